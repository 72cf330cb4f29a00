"""Shape bisection of the bundled gpt-oss ``matmul_ogs`` capture under ``fill 0xff`` on the H200 (issue #5).

``captures/ogs-mxfp4-w13-k2880.moe.zst`` replayed with the guard fill 0xff fails (rows 241–255 = expert 31): the
Hopper MXFP4 kernel loads the swizzled weight scales unmasked in whole 128-wide K tiles, 2944 bytes per row where the
rows hold 2880, and for the last expert's last row those bytes lie past the allocation (0xff → e8m0 +Inf → NaN in
the dot product). The headless CLI shrinks that call while the failure holds, exactly as a person would run it::

    moereplay bisect captures/ogs-mxfp4-w13-k2880.moe.zst --strategy shape --call 0 --no-tui --fresh \\
        --backend pack:$MOEREPLAY_PACK -m "fill 0xff"

Asserted: the bisect reaches a shrunk shape that is smaller than the captured one (fewer experts and tokens, N
smaller) and K keeps its misalignment (K % 128 = 64) and is reported as mattering — by alignment, with an aligned
K passing. The whole log (every probe, the minimal shape and the report per dimension) is printed for the issue.

Expected from the kernel source (``_matmul_ogs.py`` and :mod:`moereplay.reference.hopper_mxfp4`), not asserted
beyond the above: minimal ``experts=1 K=64 N=384 tokens=1 top_k=1`` (N = 128 keeps N % 256 but does not compile
with 8 warps); K fails when K % 128 is 32 or 64 (rows of ``32 · ceil_even(K / 32)`` bytes, whole 128-byte tiles
read) and passes when it is 0 or 96; N fails when N % 256 is 0, 128 or 192 and passes when it is 64 (the over-read
scales then belong to padding columns of the last slab); experts, tokens and top_k free.

Run on the GPU machine after the prelude (about 20 probes, most of them tiny calls; the first replays the full
call)::

    source tools/gpu/device_setup.sh && python3 -m pytest tests/gpu/test_bisect_ogs.py -q -rA -s

With ``MOEREPLAY_BISECT_LOG=PATH`` the session is logged there and *resumed* when the file exists (no ``--fresh``),
so a run cut by the device's time limit continues where it stopped.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CAPTURE = "ogs-mxfp4-w13-k2880.moe.zst"
ORIGINAL = {"experts": 32, "K": 2880, "N": 5760, "tokens": 64, "top_k": 4}
TIMEOUT_S = 570


def _backend() -> str:
    pack = os.environ.get("MOEREPLAY_PACK")
    if pack and Path(pack).exists():
        return f"pack:{pack}"
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs a vLLM 0.25.1 kernel pack ($MOEREPLAY_PACK) or an installed vLLM")
    return "vllm"


def _capture() -> Path:
    for directory in (os.environ.get("MOEREPLAY_CAPTURES"), str(REPO / "captures")):
        if directory and (Path(directory) / CAPTURE).is_file():
            return Path(directory) / CAPTURE
    pytest.skip(f"{CAPTURE} is not there")


def _shape(text: str) -> dict[str, int]:
    return {name: int(value) for name, value in re.findall(r"(\w+)=(\d+)", text)}


def test_shape_bisect_of_the_k2880_capture_under_fill_0xff(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper (sm_90+) GPU")
    backend = _backend()
    capture = _capture()
    kept_log = os.environ.get("MOEREPLAY_BISECT_LOG")
    log = Path(kept_log) if kept_log else tmp_path / "bisect.jsonl"
    command = [
        sys.executable, "-m", "moereplay", "bisect", str(capture), "--strategy", "shape", "--call", "0",
        "--no-tui", *([] if kept_log else ["--fresh"]), "--backend", backend, "-m", "fill 0xff", "--log", str(log),
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO)
        stdout, stderr, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        stderr = expired.stderr.decode() if isinstance(expired.stderr, bytes) else (expired.stderr or "")
        code = None
    with capsys.disabled():
        print(f"\n$ {shlex.join(command)}\n{stdout}")
        if stderr.strip():
            print(f"--- stderr (last 4000 characters) ---\n{stderr[-4000:]}")
    assert code is not None, (
        f"the bisect did not finish within {TIMEOUT_S} s (MOEREPLAY_BISECT_LOG resumes it)"
    )
    assert code == 0, f"moereplay bisect exited with {code}"

    found = re.search(r"^minimal failing shape: (.*)$", stdout, re.MULTILINE)
    assert found, "no minimal shape in the output"
    minimal = _shape(found.group(1))
    assert set(minimal) == set(ORIGINAL)
    assert all(minimal[name] <= ORIGINAL[name] for name in ORIGINAL)
    assert minimal["experts"] < ORIGINAL["experts"] and minimal["tokens"] < ORIGINAL["tokens"]
    assert minimal["N"] < ORIGINAL["N"]
    assert minimal["K"] % 128 == ORIGINAL["K"] % 128 == 64  # the shrink keeps K's misalignment

    lines = {
        match.group(1): match.group(2) for match in re.finditer(r"^  (\w+): (.*)$", stdout, re.MULTILINE)
    }
    assert lines["K"].startswith("matters"), lines["K"]
    assert "by alignment" in lines["K"], lines["K"]
    passing = re.search(r"passes when K % 128 is ([\d, or]+)", lines["K"])
    assert passing and "0" in re.findall(r"\d+", passing.group(1)), lines["K"]  # an aligned K passes
    failing = re.search(r"fails when K % 128 is ([\d, or]+)", lines["K"])
    assert failing and "64" in re.findall(r"\d+", failing.group(1)), lines["K"]
