"""Never harm the caller: full queue, full disk, size cap, kill -9."""

from __future__ import annotations

import errno
import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from moereplay.capture.sink import FormatSink
from moereplay.format import CaptureReader, CaptureWriter


class BlockingSink(FormatSink):
    """A real file sink whose first write waits until released: the queue behind it fills up."""

    def __init__(self, path: Path, header: dict) -> None:
        super().__init__(CaptureWriter(path, header))
        self.release = threading.Event()

    def begin(self, message, parent):
        self.release.wait(timeout=30)
        return super().begin(message, parent)


def test_full_queue_drops_and_counts_without_blocking(arm, kernels: types.ModuleType, inputs) -> None:
    sinks: list[BlockingSink] = []

    def factory(path: Path, header: dict) -> BlockingSink:
        sinks.append(BlockingSink(path, header))
        return sinks[0]

    session = arm(sink_factory=factory, queue_calls="4")
    x, w1, w2, weights = inputs()
    started = time.perf_counter()
    for step in range(20):
        kernels.fused(x + step, w1, w2, weights)
    elapsed = time.perf_counter() - started
    assert elapsed < 5.0  # the writer is stuck; the caller is not
    counters = session.writer.counters
    recorder = session.recorder.counters
    assert recorder.dropped_queue_full + counters.dropped_queue_full > 0
    sinks[0].release.set()
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        footer = reader.footer["counters"]
        dropped = footer["dropped_queue_full"] + footer["recorder_dropped_queue_full"]
        assert dropped > 0 and len(reader) + dropped >= 20
        statuses = [r.status for r in reader.calls()]
        # a call whose outputs did not fit keeps its inputs (status inputs_saved), and is counted
        assert statuses.count("inputs_saved") == footer["outputs_dropped"]
        assert statuses.count("completed") > 0


class DiskFullFile(io.RawIOBase):
    """A file that accepts ``room`` bytes, then fails every write with ENOSPC (a full disk)."""

    def __init__(self, path: Path, room: int) -> None:
        self.inner = open(path, "wb")  # noqa: SIM115
        self.room = room

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        size = len(memoryview(data))
        if size > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= size
        return self.inner.write(data)

    def tell(self) -> int:
        return self.inner.tell()

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()
        super().close()


def test_full_disk_disables_capture_and_the_caller_keeps_running(
    arm, kernels: types.ModuleType, inputs, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def full_disk_open(path, mode="rb", *args, **kwargs):
        assert "w" in mode
        return DiskFullFile(Path(path), room=40000)

    monkeypatch.setattr("moereplay.format.writer.open", full_disk_open, raising=False)
    session = arm()
    x, w1, w2, weights = inputs(tokens=16, hidden=32, inner=32)
    reference = [kernels.fused(x + step, w1, w2, weights) for step in range(40)]
    session.flush()
    assert not session.recorder.active
    assert "No space left on device" in (session.recorder.disabled_reason or "")
    # the wrapped function still computes the same thing, now without recording
    assert torch.equal(kernels.fused(x, w1, w2, weights), reference[0])
    session.close()
    with CaptureReader(session.path) as reader:
        assert reader.recovery.footer_missing
        records = list(reader.calls())
        assert 0 < len(records) < 120
        for record in records:
            reader.load_args(record.index)  # every whole record before the failure is readable


def test_max_bytes_stops_writing_and_keeps_a_valid_file(arm, kernels: types.ModuleType, inputs) -> None:
    session = arm(max_bytes="6K")
    x, w1, w2, weights = inputs(tokens=16, hidden=32, inner=32)
    for step in range(40):
        kernels.fused(x + step, w1, w2, weights)
    session.flush()
    assert "MOEREPLAY_MAX_BYTES" in (session.recorder.disabled_reason or "")
    session.close()
    # the cap is checked before each record (the record that would cross it is the last one tried), and the
    # first copy of the weights rides on the first call: the overshoot is bounded by one call plus its weights
    assert session.path.stat().st_size < 6 * 1024 + 16 * 1024
    with CaptureReader(session.path) as reader:
        assert reader.recovery.complete
        assert reader.footer["counters"]["dropped_max_bytes"] >= 1
        assert 0 < len(reader) < 120


CHILD = textwrap.dedent(
    """
    import sys, time, types, torch
    from moereplay.capture import session
    from moereplay.capture.patch_points import CaptureTarget

    module = types.ModuleType("kernels")
    def gemm(x, w, out):
        torch.matmul(x, w, out=out)
        return out
    module.gemm = gemm
    sys.modules["kernels"] = module
    target = CaptureTarget("gemm", "kernel", "kernels", "gemm", static=("w",), outputs=("out",))
    armed = session.arm({"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_DIR": sys.argv[1]}, targets=[target])
    w = torch.randn(64, 64)
    for i in range(10):
        module.gemm(torch.full((8, 64), float(i)), w, torch.empty(8, 64))
    armed.flush()
    print("ready", flush=True)
    i = 10
    while True:
        module.gemm(torch.full((8, 64), float(i)), w, torch.empty(8, 64))
        i += 1
    """
)


def test_kill_9_leaves_every_completed_call_readable(tmp_path: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.3)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        if child.stdout is not None:
            child.stdout.close()
    (path,) = tmp_path.glob("rank*-pid*.zst")
    with CaptureReader(path) as reader:
        assert reader.recovery.footer_missing
        records = list(reader.calls())
        completed = [r for r in records if r.status == "completed"]
        assert len(completed) >= 10
        for record in completed:
            args = reader.load_args(record.index)
            out = reader.load_outputs(record.index)["out"]
            assert torch.equal(out, args["x"] @ args["w"])
            assert torch.equal(args["x"], torch.full((8, 64), float(record.context["call"])))


def test_the_file_is_on_disk_from_arming_and_after_each_idle_moment(
    arm, kernels: types.ModuleType, inputs
) -> None:
    """vLLM ends its engine and worker processes without exit handlers: what was written must already be on
    disk — the header from the moment of arming, and the records whenever the writer's queue runs empty."""
    session = arm()
    with CaptureReader(session.path) as reader:
        assert len(reader) == 0 and reader.recovery.footer_missing
        assert reader.header["tool"] == "moereplay.capture"
    x, w1, _w2, weights = inputs()
    for step in range(3):
        kernels.gemm(x + step, torch.empty(x.shape[0], w1.shape[1]), w1, weights, 1, False)
    deadline = time.monotonic() + 10
    completed = 0
    while (
        time.monotonic() < deadline and completed < 3
    ):  # no session.flush(): the idle writer flushed by itself
        time.sleep(0.05)
        with CaptureReader(session.path) as reader:
            completed = sum(record.status == "completed" for record in reader.calls())
    assert completed == 3
    session.close()
