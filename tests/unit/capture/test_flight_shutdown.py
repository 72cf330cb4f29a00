"""No lost triggers (issue 14): a bad output is written while the process runs, within the writer thread's poll
delay, and whatever way the process ends — at once, after idling, on SIGTERM (default action or chained to a
handler installed before arming, as vLLM's Worker has) — the offending call is in the file and the counters say
only what reached it.

The processes are children running the layer-scope flight recorder on the CPU (the ring's torch path) with real
writer threads: tensors of 512 KiB go through the file writer's hash/compress pool, which refuses work once the
interpreter's shutdown has begun."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from moereplay.capture.sink import FormatSink
from moereplay.capture.writer_thread import Begin, Complete, WriterThread
from moereplay.format import CaptureReader, CaptureWriter

REPOSITORY = Path(__file__).resolve().parents[3]

CHILD = textwrap.dedent(
    """
    import signal, sys, time, types, torch
    from moereplay.capture import session
    from moereplay.capture.patch_points import CaptureTarget

    mode, directory = sys.argv[1], sys.argv[2]
    module = types.ModuleType("kernels")
    def gemm(x, w, out):
        torch.matmul(x, w, out=out)
        return out
    module.gemm = gemm
    sys.modules["kernels"] = module
    def previous(signum, frame):  # vLLM's Worker handler raises SystemExit; this one says what was written
        print(f"previous handler, {armed.writer.counters.recorded} call(s) written", flush=True)
        raise SystemExit(3)
    if mode == "term-chained":  # installed before arming
        signal.signal(signal.SIGTERM, previous)
    target = CaptureTarget("gemm", "kernel", "kernels", "gemm", static=("w",), outputs=("out",))
    env = {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_DIR": directory,
        "MOEREPLAY_TRIGGER": "flight",
        "MOEREPLAY_ABSMAX": "1e4",
        "MOEREPLAY_FLIGHT_BYTES": "64M",
        "MOEREPLAY_WRITER_THREADS": "2",
    }
    if mode.endswith("-noinline"):  # no serving-thread check after a call: the writer's polls find the trigger
        env["MOEREPLAY_FLIGHT_INLINE_CHECKS"] = "0"
    armed = session.arm(env, targets=[target])
    session.SIGTERM_BUDGET_S = 20.0  # what is tested is that the handler writes, not how fast a loaded machine is
    if mode == "term-late":  # installed after arming, then the plugin registers again (a forked vLLM Worker)
        signal.signal(signal.SIGTERM, previous)
        assert session.arm(env, targets=[target]) is armed
    if mode.startswith("term"):  # the writer thread does not poll now: only the SIGTERM handler finds the trigger
        armed.writer._poll_interval = 3600.0
        armed.writer.set_poll(armed.recorder.poll)
        armed.recorder.flight.wake = None  # nor does the serving thread wake it for the bad call
        time.sleep(0.05)
    w = torch.eye(256)
    for call in range(5):  # 512 KiB tensors: their blobs go through the writer's pool
        x = torch.full((512, 256), 1e30 if call == 0 else 1.0)
        module.gemm(x, w, torch.empty(512, 256))
    print("ready", flush=True)
    if mode.startswith("idle"):  # until the test has looked (end of input), then a normal exit
        sys.stdin.readline()
    elif mode.startswith("term"):
        time.sleep(60)
    """
)


def _start(tmp_path: Path, mode: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPOSITORY))
    env.pop("MOEREPLAY_DIR", None)
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _finish(child: subprocess.Popen[str], timeout: float = 120.0) -> tuple[int, str, str]:
    """Wait for the child (``timeout``: a guard against a hang only — starting an interpreter and importing torch
    alone took 6–10 s on a loaded 2-CPU machine); its exit code, stdout and stderr."""
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
    return child.returncode, out, err


def _ready(child: subprocess.Popen[str]) -> None:
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    if line != "ready":
        child.kill()
        _, _, err = _finish(child)
        pytest.fail(f"child not ready ({line!r}): {err}")


def _path(tmp_path: Path) -> Path:
    (path,) = tmp_path.glob("rank*-pid*.zst")
    return path


def _offending_call(path: Path) -> list[int]:
    """The context call numbers of the records in ``path`` so far (readable while it is being written)."""
    with CaptureReader(path) as reader:
        return [record.context["call"] for record in reader.calls()]


def _assert_written(path: Path, err: str) -> None:
    """Call 0 (|out| = 1e30) is in the file with its output, alone, and the footer's counters say so."""
    with CaptureReader(path) as reader:
        assert reader.footer is not None, err
        records = list(reader.calls())
        counters = reader.footer["counters"]
        assert [r.context["call"] for r in records] == [0], (counters, err)
        assert records[0].status == "completed" and records[0].context["flight"]["trigger"]
        assert reader.load_outputs(records[0].index)["out"].abs().max() >= 1e30
        assert torch.equal(reader.load_args(records[0].index)["x"], torch.full((512, 256), 1e30))
        assert counters["flight_triggers"] == 1 and counters["flight_written"] == len(records), counters
        assert counters["write_errors"] == 0 and counters["flight_write_failed"] == 0, counters
    assert "flight_written=1" in err and "write_errors=0" in err  # the closing summary line says both
    assert "cannot schedule new futures" not in err


def test_a_trigger_found_at_exit_is_written_before_the_pools_stop(tmp_path: Path) -> None:
    child = _start(tmp_path, "exit")
    code, _, err = _finish(child)
    assert code == 0, err
    _assert_written(_path(tmp_path), err)


@pytest.mark.parametrize("mode", ["idle", "idle-noinline"])
def test_a_trigger_is_written_while_the_process_idles(tmp_path: Path, mode: str) -> None:
    """Found and written while the process runs on: with the serving thread's checks after each call, and
    without them (MOEREPLAY_FLIGHT_INLINE_CHECKS=0), where the writer thread's polls alone find it."""
    child = _start(tmp_path, mode)
    _ready(child)
    noticed = time.monotonic()
    calls: list[int] = []
    # the bound: a 5 ms poll and one write, generously (the child waits for the test: a loaded machine cannot
    # let it exit first)
    while time.monotonic() - noticed < 10.0 and not calls:
        time.sleep(0.02)
        calls = _offending_call(_path(tmp_path))
    still_running = child.poll() is None
    code, _, err = _finish(child)  # (closes its input: it exits)
    assert calls == [0] and still_running, err  # on disk while the process was idle, not only at its exit
    assert code == 0, err
    _assert_written(_path(tmp_path), err)
    with CaptureReader(_path(tmp_path)) as reader:
        inline = reader.footer["counters"].get("flight_inline_checks", 0)
    assert (inline == 0) == mode.endswith("-noinline"), inline


def test_sigterm_with_the_default_action_writes_the_trigger_and_the_footer(tmp_path: Path) -> None:
    child = _start(tmp_path, "term")
    _ready(child)
    assert _offending_call(_path(tmp_path)) == []  # the writer is not polling: the handler must find it
    started = time.monotonic()
    child.send_signal(signal.SIGTERM)
    code, _, err = _finish(child)
    assert time.monotonic() - started < 40.0  # not the child's 60 s sleep
    assert code == -signal.SIGTERM, err  # it still dies of the signal
    _assert_written(_path(tmp_path), err)


@pytest.mark.parametrize("mode", ["term-chained", "term-late"])
def test_sigterm_writes_first_then_chains_to_the_handler_vllm_installed(tmp_path: Path, mode: str) -> None:
    """term-chained: the handler was there before arming (vLLM's Worker with spawn); term-late: it was installed
    after arming and the plugin registered again (a forked Worker: armed at fork, handler, then plugins)."""
    child = _start(tmp_path, mode)
    _ready(child)
    child.send_signal(signal.SIGTERM)
    code, out, err = _finish(child)
    # the trigger was written before the previous handler ran; its SystemExit(3): the exit hook closes the file
    assert code == 3 and "previous handler, 1 call(s) written" in out, (out, err)
    _assert_written(_path(tmp_path), err)


# --- in process ----------------------------------------------------------------------------------------------------


def _until(ready: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Whether ``ready()`` came true within ``timeout`` seconds (looked at every 5 ms): what a thread does "soon" —
    a fixed sleep then an assertion fails on a loaded machine."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class _Sink:
    """A RecordSink keeping the sequences it was given."""

    def __init__(self) -> None:
        self.begun: list[int] = []

    def begin(self, message: Begin, parent: int | None) -> int:
        self.begun.append(message.sequence)
        return len(self.begun) - 1

    def complete(self, index: int, message: Complete) -> None:
        return None

    def bytes_written(self) -> int:
        return 0

    def flush(self) -> None:
        return None

    def close(self, counters: dict[str, int]) -> None:
        return None


def test_the_writer_polls_while_idle_when_its_poll_is_set_after_it_started() -> None:
    """arm() builds the writer thread before the recorder and sets the poll afterwards: the thread, already
    waiting for its first message without a timeout, must start polling then (in flight mode no message comes
    until a trigger)."""
    polled = threading.Event()
    writer = WriterThread(_Sink(), max_calls_queued=4, max_bytes_queued=1 << 20, poll=None)
    try:
        time.sleep(0.05)  # the thread waits for a message now
        writer.set_poll(polled.set)
        assert polled.wait(30.0)
    finally:
        writer.close()


def test_a_poll_may_ask_for_a_longer_wait_and_a_wake_brings_the_next_poll_forward(monkeypatch) -> None:
    """A poll that returns seconds stretches the wait for the next one (capped at MAX_POLL_WAIT_S; never below
    the interval); ``wake_poll`` polls at once regardless, and the interval applies again after it."""
    from moereplay.capture import writer_thread

    monkeypatch.setattr(writer_thread, "MAX_POLL_WAIT_S", 30.0)
    times: list[float] = []
    wanted = [30.0]
    polled = threading.Event()

    def poll() -> float | None:
        times.append(time.monotonic())
        polled.set()
        return wanted[0]

    writer = WriterThread(
        _Sink(), max_calls_queued=4, max_bytes_queued=1 << 20, poll=None, poll_interval=0.005
    )
    try:
        writer.set_poll(poll)
        assert polled.wait(30.0)
        time.sleep(0.3)
        assert len(times) == 1 and writer._poll_wait == 30.0  # it asked for 30 s: nothing for 0.3 s
        wanted[0] = None
        polled.clear()
        woken = time.monotonic()
        writer.wake_poll()
        assert polled.wait(10.0) and times[-1] - woken < 10.0  # not the 30 s it asked for
        assert _until(lambda: len(times) >= 5)  # back to every poll_interval
        assert writer._poll_wait == 0.005
        wanted[0] = 0.001  # below the interval: the interval
        before = len(times)
        assert _until(lambda: len(times) > before + 1) and writer._poll_wait == 0.005
    finally:
        writer.close()
    monkeypatch.undo()  # the real cap
    wanted[0] = 30.0
    writer = WriterThread(
        _Sink(), max_calls_queued=4, max_bytes_queued=1 << 20, poll=None, poll_interval=0.005
    )
    try:
        before = len(times)
        writer.set_poll(poll)
        assert _until(lambda: len(times) > before)
        time.sleep(0.05)  # (the poll's wait is stored after it returns)
        assert _until(lambda: writer._poll_wait == writer_thread.MAX_POLL_WAIT_S)
        assert writer_thread.MAX_POLL_WAIT_S < 30.0  # capped
    finally:
        writer.close()


def test_a_wake_during_a_poll_is_not_undone_by_the_wait_that_poll_asks_for(monkeypatch) -> None:
    """The serving thread may wake the writer while a poll runs that has already decided it may wait: the wake
    wins (the next poll comes after the interval, not after the poll's longer wait — 30 s here, so a loaded
    machine cannot blur the two)."""
    from moereplay.capture import writer_thread

    monkeypatch.setattr(writer_thread, "MAX_POLL_WAIT_S", 30.0)
    writer = WriterThread(
        _Sink(), max_calls_queued=4, max_bytes_queued=1 << 20, poll=None, poll_interval=0.005
    )
    waits: list[float] = []
    second = threading.Event()

    def poll() -> float:
        if not waits:
            writer.wake_poll()  # lands while this poll runs
        waits.append(writer._poll_wait)
        if len(waits) == 2:
            second.set()
        return 30.0

    try:
        writer.set_poll(poll)
        assert second.wait(5.0)  # the first poll's 30 s did not hold: the wake made the next come at once
    finally:
        writer.close()


def test_a_trickle_of_messages_does_not_put_the_polls_off() -> None:
    """The wait for the next poll counts from the last poll, not from the last message: messages arriving more
    often than the interval (the queue empty after each) still leave the polls their pace."""
    from moereplay.capture.snapshot import Snapshot

    polls: list[float] = []
    writer = WriterThread(
        _Sink(), max_calls_queued=64, max_bytes_queued=1 << 20, poll=None, poll_interval=0.05
    )
    try:
        writer.set_poll(lambda: polls.append(time.monotonic()))
        started = time.monotonic()
        sequence = 0
        # ~10 polls in 0.5 s at 50 ms (on a loaded machine, later); without the fix none after the first, however long
        while time.monotonic() - started < 30.0 and len([t for t in polls if t >= started]) < 5:
            writer.offer(Begin(sequence, "op", "site", Snapshot({}), {}, None))
            sequence += 1
            time.sleep(0.01)
        assert len([t for t in polls if t >= started]) >= 5
    finally:
        writer.close()


def test_a_drain_from_a_handler_that_interrupted_the_queues_lock_still_runs() -> None:
    """A SIGTERM handler runs on the serving thread between bytecodes — possibly while that thread holds the
    writer's queue lock (an offer, a wake of the writer). Its drain must let go of that lock while it waits, or
    the writer could never take the drain: the budget would run out and the trigger stay unwritten."""
    writer = WriterThread(_Sink(), max_calls_queued=4, max_bytes_queued=1 << 20, poll=None)
    settled: list[float] = []
    try:
        with writer._ready:  # "interrupted inside wake_poll"
            assert writer.drain(settled.append, 30.0)  # False had the writer never got the drain
            assert len(settled) == 1
        assert writer.drain(settled.append, 30.0) and len(settled) == 2  # and as before outside it
    finally:
        writer.close()


def test_delivery_is_reported_after_the_write_and_a_refusal_too() -> None:
    from moereplay.capture.snapshot import Snapshot

    reports: list[tuple[bool, str | None]] = []
    sink = _Sink()
    writer = WriterThread(sink, max_calls_queued=4, max_bytes_queued=1 << 20)
    begin = Begin(0, "op", "site", Snapshot({}), {}, None)
    complete = Complete(0, None, {}, "completed")
    writer.offer_call(begin, complete, lambda written, why: reports.append((written, why)))
    assert writer.flush(5.0)
    assert reports == [(True, None)] and sink.begun == [0]
    writer.close()
    refused = Begin(1, "op", "site", Snapshot({}), {}, None)
    writer.offer_call(refused, None, lambda written, why: reports.append((written, why)))
    assert reports[1] == (False, "the capture is closing")


class _FailingSink(FormatSink):
    """A real capture file whose call records cannot be written (as a full disk fails)."""

    def begin(self, message: Begin, parent: int | None) -> int:
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize("scope", ["layer", "kernel"])
def test_a_failed_write_counts_as_failed_not_as_written(
    arm, kernels: types.ModuleType, inputs, scope: str, caplog: pytest.LogCaptureFixture
) -> None:
    session = arm(
        sink_factory=lambda path, header: _FailingSink(CaptureWriter(path, header)),
        trigger="flight",
        flight_scope=scope,
        flight_calls="2",
    )
    x, w1, _w2, weights = inputs()
    bad = x.clone()
    bad[0, 0] = float("nan")
    with caplog.at_level(logging.WARNING, logger="moereplay.capture"):
        kernels.gemm(bad, torch.empty(5, 6), w1, weights, 1, False)
        session.close()
    with CaptureReader(session.path) as reader:
        counters = reader.footer["counters"]
        assert len(reader) == 0
        assert counters["flight_triggers"] == 1 and counters["flight_written"] == 0, counters
        assert counters["flight_write_failed"] == 1 and counters["write_errors"] == 1, counters
    messages = [record.getMessage() for record in caplog.records]
    assert any("NOT written" in message and "No space left" in message for message in messages), messages
    (summary,) = [message for message in messages if "capture closed" in message]
    assert (
        "flight_written=0" in summary and "flight_write_failed=1" in summary and "write_errors=1" in summary
    )


def test_a_wake_between_a_polls_wait_test_and_its_store_is_kept(monkeypatch) -> None:
    """A wake that lands after the poll asked for a long wait and was found not woken, but before that wait is
    stored, must still bring the next poll forward (the test and the store are made under the wake's lock). The
    wake is started from inside the writer at exactly that line (a trace function)."""
    from moereplay.capture import flight_layer, writer_thread

    assert flight_layer.IDLE_POLL_S <= writer_thread.MAX_POLL_WAIT_S  # the idle wait is not clamped away
    # (a wait no loaded machine blurs with the wake)
    monkeypatch.setattr(writer_thread, "MAX_POLL_WAIT_S", 30.0)
    times: list[float] = []
    injected: list[float] = []
    code = WriterThread._run_poll.__code__
    source = Path(code.co_filename).read_text().splitlines()
    store = [
        number
        for number, line in enumerate(source, 1)
        if line.strip() == "self._poll_wait = interval" and number > code.co_firstlineno
    ]
    assert len(store) == 1, "the store of the poll's wait moved: update this test"
    box: dict[str, WriterThread] = {}

    def poll() -> float:
        times.append(time.monotonic())
        # the wake is injected in the second poll, which asks for 30 s
        return 30.0 if len(times) >= 2 else 0.005

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not code:
            return None

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "line" and frame.f_lineno == store[0] and len(times) == 2 and not injected:
                injected.append(time.monotonic())
                threading.Thread(target=box["writer"].wake_poll).start()  # may wait for the writer's lock
                time.sleep(0.02)
            return local

        return local

    threading.settrace(tracer)
    try:
        writer = box["writer"] = WriterThread(
            _Sink(), max_calls_queued=4, max_bytes_queued=1 << 20, poll=None, poll_interval=0.005
        )
    finally:
        threading.settrace(None)
    try:
        writer.set_poll(poll)
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline and not [t for t in times if injected and t > injected[0]]:
            time.sleep(0.01)
    finally:
        writer.close()
    assert injected, "the wake was never injected"
    later = [t for t in times if t > injected[0]]
    assert later and later[0] - injected[0] < 15.0, later[:1]  # not after the 30 s the poll asked for
