"""The writer thread's look-ahead: queued messages are handed to the file writer's pool before they are written,
within the byte budget, and whatever a message did not use is released."""

from __future__ import annotations

import errno
import io
import threading
from pathlib import Path

import pytest
import torch

from moereplay.capture.sink import FormatSink
from moereplay.capture.snapshot import snapshot
from moereplay.capture.writer_thread import Begin, Complete, WriterThread
from moereplay.format import CaptureReader, CaptureWriter


class WatchedSink(FormatSink):
    """A real file sink that records prefetch/release calls; its first ``begin`` waits until released."""

    def __init__(self, path: Path) -> None:
        super().__init__(CaptureWriter(path, workers=2))
        self.gate = threading.Event()
        self.prefetched: list[int] = []
        self.released: list[int] = []

    def prefetch(self, message: Begin | Complete) -> None:
        self.prefetched.append(message.sequence)
        super().prefetch(message)

    def release(self, message: Begin | Complete) -> None:
        self.released.append(message.sequence)
        super().release(message)

    def begin(self, message: Begin, parent: int | None) -> int:
        self.gate.wait(timeout=30)
        return super().begin(message, parent)


def begin(sequence: int, values: torch.Tensor) -> Begin:
    return Begin(sequence, "op", "site", snapshot({"x": values}), {}, None)


def test_queued_messages_are_prefetched_and_released(tmp_path: Path) -> None:
    sink = WatchedSink(tmp_path / "p.zst")
    thread = WriterThread(sink, max_calls_queued=100, max_bytes_queued=1 << 30)
    inputs = [torch.randn(100_000) for _ in range(5)]
    assert thread.offer(begin(0, inputs[0]))
    while not sink.prefetched:  # the thread took message 0 and now waits in begin
        threading.Event().wait(0.001)
    for sequence in range(1, 5):
        assert thread.offer(begin(sequence, inputs[sequence]))
    assert thread.offer(Complete(0, snapshot({"out": inputs[0] * 2}), {}, "completed"))
    assert thread.offer(Complete(99, snapshot({"out": inputs[0]}), {}, "completed"))  # no such call
    sink.gate.set()
    assert thread.flush(timeout=30)
    thread.close()
    assert sorted(sink.prefetched) == [0, 0, 1, 2, 3, 4, 99]  # every message, once (begin 0, complete 0)
    assert sorted(sink.released) == sorted(sink.prefetched)
    assert not sink._prefetched and not sink.writer._prefetched
    assert thread.seconds["prefetch"] >= 0.0 and not thread.failed
    with CaptureReader(tmp_path / "p.zst") as reader:
        assert len(reader) == 5
        for sequence in range(5):
            assert torch.equal(reader.load_args(sequence)["x"], inputs[sequence])
        assert torch.equal(reader.load_outputs(0)["out"], inputs[0] * 2)


def test_prefetch_stays_within_its_byte_budget(tmp_path: Path) -> None:
    sink = WatchedSink(tmp_path / "b.zst")
    values = [torch.randn(100_000) for _ in range(4)]  # 400 kB copied each
    thread = WriterThread(sink, max_calls_queued=100, max_bytes_queued=1 << 30, prefetch_bytes=500_000)
    assert thread.offer(begin(0, values[0]))
    while not sink.prefetched:
        threading.Event().wait(0.001)
    for sequence in range(1, 4):
        assert thread.offer(begin(sequence, values[sequence]))
    sink.gate.set()
    assert thread.flush(timeout=30)
    thread.close()
    # message 0 is written without look-ahead room to spare; each later one only when it is current
    assert sink.prefetched == [0, 1, 2, 3]
    with CaptureReader(tmp_path / "b.zst") as reader:
        assert len(reader) == 4


def test_no_prefetch_without_a_pool_or_budget(tmp_path: Path) -> None:
    serial = FormatSink(CaptureWriter(tmp_path / "s.zst"))
    thread = WriterThread(serial, max_calls_queued=10, max_bytes_queued=1 << 30)
    for sequence in range(3):
        assert thread.offer(begin(sequence, torch.randn(1000)))
    assert thread.flush(timeout=30)
    thread.close()
    assert not serial._prefetched
    with CaptureReader(tmp_path / "s.zst") as reader:
        assert len(reader) == 3


class FullDisk(io.RawIOBase):
    """Accepts ``room`` bytes, then fails every write with ENOSPC."""

    def __init__(self, path: Path, room: int) -> None:
        self.inner = open(path, "wb")  # noqa: SIM115
        self.room = room

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[no-untyped-def]
        size = len(memoryview(data))
        if size > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= size
        return self.inner.write(data)

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()
        super().close()


def test_a_full_disk_with_work_prefetched_fails_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        "moereplay.format.writer.open", lambda path, mode: FullDisk(Path(path), 1_500_000), raising=False
    )
    sink = WatchedSink(tmp_path / "f.zst")
    sink.gate.set()
    failures: list[str] = []
    thread = WriterThread(sink, max_calls_queued=100, max_bytes_queued=1 << 30, on_failure=failures.append)
    values = [torch.randn(100_000) for _ in range(12)]  # 400 kB each, ~360 kB compressed
    for sequence, value in enumerate(values):
        thread.offer(begin(sequence, value))  # refused (and counted) once the disk is full
    assert thread.flush(timeout=30)
    thread.close()
    assert len(failures) == 1 and "No space left on device" in failures[0]
    counters = thread.counters
    assert counters.write_errors == 1 and counters.recorded >= 1
    assert counters.recorded + counters.dropped_after_failure + 1 == len(values)
    assert sorted(sink.released) == sorted(sink.prefetched)
    assert not sink._prefetched and not sink.writer._prefetched
    with CaptureReader(tmp_path / "f.zst") as reader:
        assert reader.recovery.footer_missing
        assert len(reader) == counters.recorded
        for record in reader.calls():
            assert torch.equal(reader.load_args(record.index)["x"], values[record.index])
