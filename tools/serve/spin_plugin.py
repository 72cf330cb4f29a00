"""A vLLM general plugin for serve_bench's host-cost experiments: serving-thread work with nothing recorded.

Not part of moereplay's product. The flight recorder's served prefill cost (≈ 1.02×, issue 14) is either its device
work or the serving thread's time per recorded layer call (≈ 250 µs served, thirty-seventh session), and the two
cannot be told apart by turning pieces of the recorder off. This plugin adds host work alone, the size asked for,
to a server that records nothing, so the cost of that much serving-thread time is measured directly:

- ``MOEREPLAY_BENCH_SPIN_US=N``: every eager call of vLLM's gpt-oss layer entry point (``triton_kernel_moe_forward``,
  the call the flight recorder keeps) first spins ``N`` µs on the calling thread, holding the GIL as the recorder's
  Python does (not while a CUDA graph is being captured: graph replays run no Python, as with the recorder);
- ``MOEREPLAY_BENCH_POLL_US=M`` (every ``MOEREPLAY_BENCH_POLL_MS``, default 5): a daemon thread of the process that
  makes those calls, started at its first call, holds the GIL ``M`` µs every ``P`` ms — the share the recorder's
  writer thread takes with its polls, without their work.

serve_bench declares this plugin (:func:`declare`) for a setting that names either variable, beside moereplay's
own entry point, and puts this folder on the server's ``PYTHONPATH``. Without either variable :func:`register`
wraps nothing.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ENTRY_POINT = "moereplay_bench_spin = spin_plugin:register"
VARIABLES = ("MOEREPLAY_BENCH_SPIN_US", "MOEREPLAY_BENCH_POLL_US", "MOEREPLAY_BENCH_POLL_MS")


def declare(site: Path) -> Path:
    """A dist-info in ``site`` (a harness site) declaring :func:`register` as a vLLM general plugin; the folder to
    put on ``PYTHONPATH`` so that it imports (this file's)."""
    info = site / "moereplay_bench_spin-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: moereplay-bench-spin\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{ENTRY_POINT}\n")
    return Path(__file__).resolve().parent


def _microseconds(environ: dict[str, str] | os._Environ[str], name: str, default: int = 0) -> int:
    text = environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: not a whole number") from None
    if value < 0:
        raise ValueError(f"{name}={text!r}: a count of microseconds (or ms) at least 0")
    return value


def spin(microseconds: int) -> None:
    """Busy-wait ``microseconds`` on this thread (holding the GIL between the interpreter's switch points)."""
    end = time.perf_counter_ns() + microseconds * 1000
    while time.perf_counter_ns() < end:
        pass


class GilPoller:
    """A daemon thread that spins ``hold_us`` every ``every_ms`` (started once, by :meth:`start`; until
    :meth:`stop`)."""

    def __init__(self, hold_us: int, every_ms: int) -> None:
        self.hold_us = hold_us
        self.every_s = every_ms / 1000
        self.holds = 0
        self._started = False
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._run, name="moereplay-bench-poll", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self.every_s):
            spin(self.hold_us)
            self.holds += 1


def make_handler(spin_us: int, poller: GilPoller | None, capturing: Callable[[], bool]) -> Any:
    """moereplay's :class:`~moereplay.capture.patching.CallHandler` that spins before each call (see the module)."""
    from moereplay.capture.patching import CallHandler

    class Spin(CallHandler):
        active = True

        def __init__(self) -> None:
            self.calls = 0
            self.spun = 0

        def prepare(self, target: Any, original: Any) -> None:
            # in the server's log: the wrapper is in place (a diagnostic that silently wrapped nothing would read
            # as "host time costs nothing")
            print(
                f"moereplay bench spin: wrapped {target.site} (pid {os.getpid()})",
                file=sys.stderr,
                flush=True,
            )

        def report(self) -> str:
            holds = f", the poll thread held the GIL {poller.holds} times" if poller is not None else ""
            return f"moereplay bench spin: {self.calls} calls, {self.spun} spun {spin_us} µs (pid {os.getpid()}){holds}"

        def call(self, target: Any, binder: Any, original: Any, args: Any, kwargs: Any) -> Any:
            self.calls += 1
            if poller is not None:
                poller.start()
            if spin_us and not capturing():
                spin(spin_us)
                self.spun += 1
            return original(*args, **kwargs)

    return Spin()


def _capturing() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def install(environ: dict[str, str] | os._Environ[str], targets: Sequence[Any]) -> Any:
    """Wrap ``targets`` (moereplay ``CaptureTarget``\\ s) as the variables in ``environ`` ask; the patcher, or None
    when they ask for nothing."""
    spin_us = _microseconds(environ, "MOEREPLAY_BENCH_SPIN_US")
    poll_us = _microseconds(environ, "MOEREPLAY_BENCH_POLL_US")
    poll_ms = _microseconds(environ, "MOEREPLAY_BENCH_POLL_MS", 5)
    if not spin_us and not poll_us:
        return None
    from moereplay.capture.patching import Patcher

    poller = GilPoller(poll_us, max(1, poll_ms)) if poll_us else None
    handler = make_handler(spin_us, poller, _capturing)
    patcher = Patcher(targets, handler)
    patcher.install()
    return patcher


def _report(handler: Any) -> None:
    if handler.calls:  # the processes that made the calls (vLLM's engine), not every one the plugin loaded in
        print(handler.report(), file=sys.stderr, flush=True)


def gpt_oss_forward_targets() -> list[Any]:
    """moereplay's patch point for vLLM's ``triton_kernel_moe_forward`` (the layer call the flight recorder keeps)."""
    from moereplay.ops.matmul_ogs_surface import FAMILY, FORWARD_PARENT_OP

    return [target for target in FAMILY.targets if target.op == FORWARD_PARENT_OP]


_INSTALLED: list[Any] = []


def register() -> None:
    """vLLM's general-plugin hook (every vLLM process calls it)."""
    if _INSTALLED:
        return
    try:
        patcher = install(os.environ, gpt_oss_forward_targets())
    except ValueError as error:  # a malformed variable: one line in the server's log, the server stops
        raise SystemExit(f"moereplay bench spin: {error}") from None
    if patcher is not None:
        _INSTALLED.append(patcher)
        atexit.register(_report, patcher.handler)  # the counts in the server's log at exit
