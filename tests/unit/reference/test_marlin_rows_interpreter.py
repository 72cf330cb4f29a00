"""The packed-code Marlin kernel run by Triton's interpreter on the CPU (where Triton is installed; CI has none and
skips): every fast format against the dense path, its weights bit for bit (one-hot input rows), a row's bits
independent of the other rows and of the passes a long call is cut into. It found a bug
the element-wise CPU checks could not (a strided table handed to the kernel as if contiguous)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed"),
    pytest.mark.slow,  # about four minutes on two cores: `pytest -m slow tests/unit/reference/test_marlin_rows_interpreter.py`
]


def test_the_kernel_agrees_with_the_dense_path_in_the_interpreter() -> None:
    script = Path(__file__).with_name("marlin_rows_interpreted.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parents[3])}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("written and notes the same: True") == 11, done.stdout
    assert done.stdout.count("bit for bit: True") == 11, done.stdout
