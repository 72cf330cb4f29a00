"""A "serving" process for the kill -9 and full-disk tests (run as a script, not collected by pytest).

It imports torch once and then, for every command read from stdin, forks a fresh process that arms a capture and
calls a stand-in kernel in a steady stream — so a test can end many captures at many moments without paying for
the torch import each time. Commands (one per line; the answer is one line on stdout):

- ``stream DIR LOG`` → the forked pid. The fork calls the kernel until killed (or 5,000 calls), appending
  ``call sha256(x) sha256(w) sha256(expected out)`` to LOG, fsynced, *before* each call: every call the capture
  file can hold is in LOG, with the bytes it must hold.
- ``full DIR LOG LIMIT CALLS`` → the forked pid. The same stream of CALLS calls under ``RLIMIT_FSIZE`` = LIMIT
  bytes with SIGXFSZ ignored (writes past the limit are cut short, then fail with EFBIG — a full disk); checks
  that every call still returned the right output, closes the session and writes ``DIR/result.json``. Its log
  records go to ``DIR/capture.log``.
- ``reap PID`` → ``status CODE`` once PID ended (the fork is this process's child: only it can wait for it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import signal
import sys
import time
import types

import torch

from moereplay.capture import session
from moereplay.capture.patch_points import CaptureTarget

ROWS, COLUMNS = 32, 64


def gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Elementwise, so its result does not depend on memory alignment (as a BLAS call's may)."""
    torch.mul(x, w, out=out)
    out.add_(x)
    return out


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


def inputs(call: int) -> torch.Tensor:
    return torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(1000 + call))


def stream(directory: str, log_path: str, calls: int) -> list[bool]:
    """Arm, then call the wrapped kernel ``calls`` times (logging each call first); whether each result was right."""
    module = types.ModuleType("kernels")
    module.gemm = gemm  # type: ignore[attr-defined]
    sys.modules["kernels"] = module
    target = CaptureTarget("gemm", "kernel", "kernels", "gemm", static=("w",), outputs=("out",))
    armed = session.arm({"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_DIR": directory}, targets=[target])
    assert armed is not None
    w = torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(0))
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    right = []
    for call in range(calls):
        x = inputs(call)
        expected = gemm(x.clone(), w, torch.empty(ROWS, COLUMNS))
        os.write(log, f"{call} {digest(x)} {digest(w)} {digest(expected)}\n".encode())
        os.fsync(log)
        out = module.gemm(x, w, torch.empty(ROWS, COLUMNS))
        right.append(bool(torch.equal(out, expected)))
        time.sleep(0.001)  # a steady stream the writer keeps up with, as serving leaves it time between steps
    return right


def full(directory: str, log_path: str, limit: int, calls: int) -> None:
    logging.basicConfig(filename=os.path.join(directory, "capture.log"), level=logging.WARNING)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    right = stream(directory, log_path, calls)
    armed = session.current()
    assert armed is not None
    armed.flush()
    result = {
        "right": right,
        "active": armed.recorder.active,
        "disabled_reason": armed.recorder.disabled_reason,
        "failed": armed.writer.failed,
        "counters": armed.writer.counters.as_dict(),
        "path": str(armed.path),
    }
    session.disarm()  # closes the file: the footer cannot be written either
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    with open(os.path.join(directory, "result.json"), "w") as file:
        json.dump(result, file)
    logging.shutdown()


def main() -> None:
    torch.set_num_threads(1)  # no thread pool in the forking process
    print("ready", flush=True)
    for line in sys.stdin:
        command, *words = line.split()
        if command == "reap":
            _, status = os.waitpid(int(words[0]), 0)
            print(f"status {status}", flush=True)
            continue
        pid = os.fork()
        if pid:
            print(pid, flush=True)
            continue
        code = 0
        try:
            if command == "stream":
                stream(words[0], words[1], 5000)
                code = 3  # never killed: the test did not do its part
            else:
                full(words[0], words[1], int(words[2]), int(words[3]))
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)


if __name__ == "__main__":
    main()
