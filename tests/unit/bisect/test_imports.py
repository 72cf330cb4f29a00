"""The engine is plain Python: importing any bisect module pulls in neither torch nor the replay engine."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import moereplay.bisect


def test_bisect_modules_import_no_torch() -> None:
    modules = ["moereplay.bisect"] + [
        info.name for info in pkgutil.walk_packages(moereplay.bisect.__path__, prefix="moereplay.bisect.")
    ]
    assert "moereplay.bisect.replay_wiring" in modules
    script = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m == 'moereplay.replay')))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
