"""One armed capture in this process: settings → file → writer thread → recorder → wrappers.

:func:`arm` is what the plugin's ``register()`` calls when ``MOEREPLAY_CAPTURE`` is on. It opens this process's
file at once (``rank{r}-pid{p}.zst``, header only until a call arrives, flushed at once, so every vLLM process
shows it armed — vLLM ends its engine and worker processes without running exit handlers),
starts the writer thread, installs the wrappers, and closes the file at exit. A forked child gets a fresh
session of its own (new pid, new file) at once. When the default directory is used, ``MOEREPLAY_DIR`` is set to
it so that vLLM's child processes write beside this one.

How a process's last records reach its file — what runs when:

- While the process runs: the writer thread polls the flight recorder every ``poll_interval`` (5 ms) whether the
  serving thread is busy or idle (the layer-scope recorder's serving thread also checks its finished eager calls
  after each call and hands a bad one to the writer at once; while it does, and no CUDA graph holds ring launches,
  the writer polls every 20 ms, and every 0.5 s while no call waits for its check — the serving thread wakes it
  when one does), and writes a trigger's calls at once (flushed to the OS when its queue runs
  empty). This is the only guarantee under SIGKILL — and vLLM's default ``--shutdown-timeout 0`` sends SIGKILL
  right after SIGTERM (``vllm.v1.utils.shutdown``: its deadline has already passed), so no handler would run.
- At exit: :func:`_close_current_at_exit` closes the file (last checks, queue, footer) from a
  ``threading._register_atexit`` hook. Those hooks run when the threading module shuts down: before ``atexit``
  handlers, and also in ``multiprocessing`` children, whose ``Process._bootstrap`` calls ``threading._shutdown()``
  before ``os._exit`` (vLLM's forked EngineCore and Worker never run ``atexit``). They run in reverse order of
  registration, and ``concurrent.futures`` registers its own (which makes every pool refuse new work) when
  ``concurrent.futures.thread`` is imported — imported here first, so ours runs before it and the writer's pool
  still works. Should a pool refuse anyway, the file writer hashes and compresses on its own thread (no record is
  lost to a refusing pool). An ``atexit`` handler repeats the close where the hook is unavailable (a no-op
  otherwise).
- SIGTERM (:func:`_on_sigterm`, installed by :func:`arm` in the main thread unless SIGTERM is ignored): asks the
  writer thread to run the flight recorder's last checks and write what is queued (``WriterThread.drain``), waiting
  at most :data:`SIGTERM_BUDGET_S` — the handler only appends to the writer's queue and waits; should it have
  interrupted this thread inside the queue's lock (an offer, the layer recorder's wake of the writer), it waits on
  that lock's condition, which lets the writer take it. Then it chains: to the previous Python handler if there
  was one (vLLM's Worker raises ``SystemExit``: the exit hook above then writes the footer), else — the default
  action — it closes the file with its footer (same budget) and re-raises SIGTERM with the default action, so the
  process dies as it would have. A handler vLLM installs *after* the plugin armed (EngineCore's, in
  ``run_engine_core``) replaces this one; that handler starts vLLM's orderly shutdown, which returns through
  ``Process._bootstrap`` and so through the exit hook. ``signal.signal`` itself is not wrapped: changing how every
  library installs handlers is out of proportion, and would not help under the default SIGKILL.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from moereplay.capture.context import process_rank
from moereplay.capture.flight_layer import LayerFlight
from moereplay.capture.graph_gate import GraphGate
from moereplay.capture.graph_gate import install as install_graph_gate
from moereplay.capture.patch_points import TARGETS, CaptureTarget, vllm_series_known
from moereplay.capture.patching import Patcher
from moereplay.capture.recorder import Recorder
from moereplay.capture.settings import PREFIX, CaptureSettings, settings_from_environ, unknown_variables
from moereplay.capture.sink import FormatSink
from moereplay.capture.writer_thread import RecordSink, WriterThread

logger = logging.getLogger("moereplay.capture")

FLIGHT_SETTLE_S = 2.0
"""At close, how long the flight recorder may keep launching and reading its last checks (a bad output in the last
calls before exit still triggers; a hung device cannot stall the exit longer than this)."""

SIGTERM_BUDGET_S = 2.0
"""The longest the SIGTERM handler waits: the last checks, the queued records and (default action only) the
footer, together; whatever is not written by then is left to the writer thread until the process ends."""

SinkFactory = Callable[[Path, dict[str, Any]], RecordSink]
"""``(path, header) -> sink`` (tests); the default sink also gets the settings (compression)."""


def _vllm_version() -> str | None:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def default_sink(
    path: Path, header: dict[str, Any], *, settings: CaptureSettings | None = None
) -> RecordSink:
    """The capture file proper, compressed as ``settings`` say."""
    import torch

    from moereplay.format import CaptureWriter

    settings = settings if settings is not None else CaptureSettings()
    side_stream = torch.cuda.Stream() if torch.cuda.is_available() else None
    writer = CaptureWriter(
        path,
        header,
        compression_level=settings.compression_level,
        compression_threads=settings.compression_threads,
        workers=settings.resolved_writer_threads(),
    )
    return FormatSink(writer, side_stream=side_stream)


def _nothing() -> None:
    return None


@dataclass
class Session:
    settings: CaptureSettings
    path: Path
    recorder: Recorder
    writer: WriterThread
    patcher: Patcher
    pid: int
    gate: GraphGate | None = None
    unhook_graphs: Callable[[], None] = _nothing

    def close(self) -> None:
        """Stop recording, finish the flight recorder's last checks (bounded: it never waits on a hung device),
        write what is queued and the footer (counters included), restore nothing."""
        was_active = self.recorder.active
        self.recorder.active = False
        flight = self.recorder.flight
        if flight is not None and was_active and self.writer.failed is None:
            try:
                if not flight.settle(
                    FLIGHT_SETTLE_S, self.gate.device_work if self.gate is not None else None
                ):
                    logger.warning(
                        "moereplay: flight recorder: the last calls' checks did not finish within %.0f s at close",
                        FLIGHT_SETTLE_S,
                    )
            except Exception as error:  # closing must not raise into the process's exit
                logger.error(
                    "moereplay: flight recorder: final check failed: %s: %s", type(error).__name__, error
                )
        self.writer.flush(timeout=30.0)
        self.writer.close()
        self.name_by_rank(self.recorder.tracker.ranks)

    def name_by_rank(self, ranks: Any) -> None:
        """Give the file its process's world rank (``rank{r}-pid{p}.zst``) as soon as the ranks are known (the
        tracker calls this at the first forward step; close calls it again). vLLM's workers arm before their
        process groups exist, so the name chosen at arming says rank 0 on every rank. The file may be open (a
        rename keeps it writable), so a worker vLLM kills later keeps the right name. A file that already exists
        under that name is left alone (never overwritten)."""
        world = getattr(ranks, "world", None)
        if world is None:
            return
        wanted = self.path.with_name(file_name(int(world), self.pid))
        if wanted == self.path or wanted.exists() or not self.path.exists():
            return
        try:
            self.path.rename(wanted)
        except OSError as error:
            logger.warning("moereplay: could not rename %s to %s: %s", self.path, wanted.name, error)
            return
        logger.warning("moereplay: rank %d: %s renamed to %s", int(world), self.path.name, wanted.name)
        self.path = wanted
        file_writer = getattr(self.writer.sink, "writer", None)
        if file_writer is not None and hasattr(file_writer, "path"):
            file_writer.path = wanted  # what its messages and the closing line name

    def flush(self, timeout: float | None = 30.0) -> bool:
        return self.writer.flush(timeout)

    def drain(self, timeout: float) -> bool:
        """On the writer thread: the flight recorder's last checks, then every queued record written — waiting at
        most ``timeout`` seconds in all (safe in a signal handler, see the module docstring). Recording goes on.
        Returns whether it all finished in time."""
        flight = self.recorder.flight
        settle = None
        if flight is not None and self.recorder.active:
            device_work = self.gate.device_work if self.gate is not None else None

            def settle(seconds: float) -> None:
                flight.settle(seconds, device_work)

        return self.writer.drain(settle, timeout)


_lock = threading.Lock()
_session: Session | None = None


def current() -> Session | None:
    return _session


def file_name(rank: int, pid: int) -> str:
    return f"rank{rank}-pid{pid}.zst"


def build_header(settings: CaptureSettings, sites: Iterable[str]) -> dict[str, Any]:
    return {
        "tool": "moereplay.capture",
        "vllm": _vllm_version(),
        "argv": list(sys.argv),
        "pid": os.getpid(),
        "capture_settings": settings.describe(),
        "patch_points": sorted(sites),
        "env": {
            key: value for key, value in os.environ.items() if key.startswith((PREFIX, "VLLM_", "CUDA_"))
        },
    }


def arm(
    env: Mapping[str, str] | None = None,
    *,
    targets: Iterable[CaptureTarget] = TARGETS,
    sink_factory: SinkFactory = default_sink,
) -> Session | None:
    """Arm capture in this process if ``env`` asks for it; return the session (``None`` when off).

    Raises ``SettingsError`` for a malformed setting (the plugin logs it and stays off); any other failure
    to open the file propagates to the plugin, which logs it and stays off too.
    """
    global _session
    environment = os.environ if env is None else env
    settings = settings_from_environ(environment)
    if not settings.enabled:
        return None
    with _lock:
        if _session is not None and _session.pid == os.getpid():
            _hook_sigterm()  # again: chains a handler installed since (a forked vLLM Worker's, before its plugins)
            return _session
        for name in unknown_variables(environment):
            logger.warning("moereplay: ignoring unknown setting %s", name)
        directory = settings.directory.resolve()
        if settings.directory_was_default and env is None:
            os.environ[PREFIX + "DIR"] = str(directory)  # vLLM's child processes write beside us
        directory.mkdir(parents=True, exist_ok=True)
        pid = os.getpid()
        path = directory / file_name(process_rank(), pid)
        # a layer call above the usual parent (CaptureTarget.layer_flight_only) is wrapped for that recorder only,
        # and not where MOEREPLAY_OPS leaves it or that parent out (the parent is then the outermost call recorded)
        targets = tuple(t for t in targets if not t.layer_flight_only or _layer_flight_wraps(t, settings))
        recorder_holder: list[Recorder] = []

        def on_failure(reason: str) -> None:
            if recorder_holder:
                recorder_holder[0].disable(reason)

        header = build_header(settings, (t.site for t in targets))
        if sink_factory is default_sink:
            sink = default_sink(path, header, settings=settings)
        else:
            sink = sink_factory(path, header)
        sink.flush()  # the header is on disk now: the process shows armed even if it is killed later
        gate = GraphGate()
        writer = WriterThread(
            sink,
            max_calls_queued=settings.queue_calls,
            max_bytes_queued=settings.queue_bytes,
            max_file_bytes=settings.max_bytes,
            on_failure=on_failure,
            poll=None,
            gate=gate,
        )
        recorder = Recorder(settings, writer)
        recorder_holder.append(recorder)
        gate.prepare = recorder.prepare_graph_capture  # the graph ring, before each graph capture begins
        gate.begun = recorder.graph_capture_begun  # staged ring nodes while it is captured
        gate.ending = recorder.graph_capture_ending
        gate.ended = recorder.graph_capture_ended
        if recorder.flight is not None:
            writer.set_poll(recorder.poll)
            if isinstance(recorder.flight, LayerFlight):
                # its serving-thread check hands a bad call over at once
                recorder.flight.wake = writer.wake_poll
        writer.extra_counters = recorder.counter_values  # footer gets the recorder's counters too
        patcher = Patcher(targets, recorder)
        patcher.install()
        unhook_graphs = install_graph_gate(gate)
        session = Session(settings, path, recorder, writer, patcher, pid, gate, unhook_graphs)
        recorder.tracker.on_ranks = session.name_by_rank
        _session = session
    _report_patch_points(patcher)
    logger.warning("moereplay: capture armed in pid %d → %s (%s)", pid, path, settings.describe())
    _hook_exit()
    _hook_sigterm()
    return session


def _layer_flight_wraps(target: CaptureTarget, settings: CaptureSettings) -> bool:
    """Whether a ``layer_flight_only`` target is wrapped: the layer-scope flight recorder is armed and the ops
    filter selects the target and the parent it is recorded in place of."""
    if not settings.layer_flight or not settings.op_selected(target.op):
        return False
    return not target.in_place_of or settings.op_selected(target.in_place_of)


def _report_patch_points(patcher: Patcher) -> None:
    version = _vllm_version()
    if version is None or vllm_series_known(version):
        return
    sites = ", ".join(patcher.sites) or "none yet (modules not imported)"
    watched = ", ".join(sorted(patcher.watched))
    logger.warning(
        "moereplay: vLLM %s is not a release whose patch points were checked (0.25.x, 0.33.x); wrapped: %s%s",
        version,
        sites,
        f"; waiting for: {watched}" if watched else "",
    )


_hooked_pid: int | None = None
_previous_sigterm: Any = None


def _close_current_at_exit() -> None:
    """Close this process's session (see the module docstring: at exit)."""
    session = _session
    if session is None or session.pid != os.getpid():
        return
    try:
        session.close()
    except Exception:
        logger.exception("moereplay: closing the capture file at exit failed")


def _hook_exit() -> None:
    """Register :func:`_close_current_at_exit` once per process, to run before ``concurrent.futures`` stops taking
    work (a ``threading._register_atexit`` hook registered after its own), with ``atexit`` as the fallback."""
    global _hooked_pid
    if _hooked_pid == os.getpid():
        return
    _hooked_pid = os.getpid()
    import concurrent.futures.thread  # noqa: F401  (registers its hook now: ours, registered later, runs first)

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        with contextlib.suppress(RuntimeError):  # shutting down already: the atexit handler below still runs
            register(_close_current_at_exit)
    atexit.register(_close_current_at_exit)


def _hook_sigterm() -> None:
    """Install :func:`_on_sigterm` (once; main thread only; not over an ignored or a C-level handler)."""
    global _previous_sigterm
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm or current is signal.SIG_IGN or current is None:
        return
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError) as error:  # not the main interpreter, or no signals here
        logger.warning("moereplay: no SIGTERM flush in this process: %s", error)
        return
    _previous_sigterm = current


def _unhook_sigterm() -> None:
    """Put the previous SIGTERM handler back if ours is still the one installed (tests: :func:`disarm`)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is _on_sigterm and _previous_sigterm is not None:
        signal.signal(signal.SIGTERM, _previous_sigterm)


def _on_sigterm(signum: int, frame: Any) -> None:
    """See the module docstring (SIGTERM). Waits :data:`SIGTERM_BUDGET_S` at most."""
    deadline = time.monotonic() + SIGTERM_BUDGET_S
    previous = _previous_sigterm
    session = _session
    ours = session is not None and session.pid == os.getpid()
    if ours:
        assert session is not None
        try:
            if not session.drain(SIGTERM_BUDGET_S):
                logger.warning(
                    "moereplay: SIGTERM: the capture was not flushed within %.0f s", SIGTERM_BUDGET_S
                )
        except Exception:
            logger.exception("moereplay: SIGTERM: flushing the capture failed")
    if callable(previous):
        previous(signum, frame)
        return
    if ours:  # the default action ends the process without exit handlers: close the file first
        assert session is not None
        session.recorder.active = False
        session.writer.close(timeout=max(0.0, deadline - time.monotonic()))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def disarm() -> None:
    """Close the session and restore the originals (tests)."""
    global _session
    with _lock:
        session = _session
        _session = None
    if session is None:
        return
    session.patcher.uninstall()
    session.recorder.remove_timers()
    session.unhook_graphs()
    _unhook_sigterm()
    if session.pid == os.getpid():
        session.close()


def _after_fork_in_child() -> None:
    """A forked child inherits the parent's wrappers but not its writer thread: start its own session."""
    global _session
    session = _session
    if session is None:
        return
    _session = None
    session.recorder.active = False
    try:
        session.patcher.uninstall()
        session.unhook_graphs()
        arm()
    except Exception as error:  # never break the child
        logger.error("moereplay: could not re-arm capture after fork: %s", error)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
