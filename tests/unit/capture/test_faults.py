"""Never harm the caller: full queue, full disk, size cap, kill -9."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
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
        self.release.wait(timeout=300)  # (far past the bound on the caller below: the two cannot blur)
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
    assert elapsed < 15.0  # the writer is stuck (until released below); the caller is not
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
    session = arm(max_bytes="24K")
    x, w1, w2, weights = inputs(tokens=16, hidden=32, inner=32)  # 8 KB of weights: the first calls fit
    for step in range(40):
        kernels.fused(x + step, w1, w2, weights)
    session.flush()
    assert "MOEREPLAY_MAX_BYTES" in (session.recorder.disabled_reason or "")
    session.close()
    # the cap is checked before each record, counting the weights a call writes the first time: only the
    # footer and index pass it
    assert session.path.stat().st_size < 24 * 1024 + 4 * 1024
    with CaptureReader(session.path) as reader:
        assert reader.recovery.complete
        assert reader.footer["counters"]["dropped_max_bytes"] >= 1
        assert 0 < len(reader) < 120


def test_weights_larger_than_max_bytes_are_never_written(arm, kernels: types.ModuleType, inputs) -> None:
    """Weights are written once per file, with the first call that uses them, outside what the call copies: the
    bound must count them (on the H200 a 40 MB bound let a served gpt-oss layer's 398 MB of weights in)."""
    session = arm(max_bytes="64K")
    x, w1, w2, weights = inputs(tokens=4, hidden=128, inner=256)  # w1 + w2: 256 KB of float32
    for step in range(3):
        kernels.fused(x + step, w1, w2, weights)
    session.flush()
    assert "MOEREPLAY_MAX_BYTES" in (session.recorder.disabled_reason or "")
    session.close()
    assert session.path.stat().st_size < 64 * 1024
    with CaptureReader(session.path) as reader:
        assert reader.recovery.complete
        assert reader.footer["counters"]["dropped_max_bytes"] == 1
        assert len(reader) == 0


CHILD = Path(__file__).with_name("capture_stream_child.py")

KILL_SEED = 16
KILL_MOMENTS = 12
"""Kill -9 moments: after the child logged call k (k drawn, seeded, over the whole run, 0 = right after arming)
and then a random 0–3 ms more, so the kill lands anywhere: between calls, inside a blob, inside a record."""


class ServingProcesses:
    """The forking child of ``capture_stream_child.py`` (torch imported once for every capture of a test)."""

    def __init__(self, tmp_path: Path) -> None:
        self.errors = (tmp_path / "child-stderr.txt").open("w")
        self.process = subprocess.Popen(
            [sys.executable, str(CHILD)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
            text=True,
        )
        assert self.ask("") == "ready"

    def ask(self, command: str) -> str:
        assert self.process.stdin is not None and self.process.stdout is not None
        if command:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        return self.process.stdout.readline().strip()

    def reap(self, pid: int) -> int:
        return int(self.ask(f"reap {pid}").split()[1])

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self.errors.close()


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServingProcesses]:
    processes = ServingProcesses(tmp_path_factory.mktemp("serving"))
    try:
        yield processes
    finally:
        processes.close()


def _logged(log: Path) -> dict[int, tuple[str, str, str]]:
    """The child's log: call → (sha256 of x, of w, of the expected output); a torn last line is left out."""
    calls: dict[int, tuple[str, str, str]] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            words = line.split()
            if len(words) == 4 and all(len(word) == 64 for word in words[1:]):
                calls[int(words[0])] = (words[1], words[2], words[3])
    return calls


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


def _check_against_log(path: Path, logged: dict[int, tuple[str, str, str]]) -> tuple[int, int]:
    """Every call the file holds (as the reader recovers it) is one the child logged, with exactly the logged bytes:
    its arguments always, its outputs when the file holds its completion. Returns (calls, completed)."""
    with CaptureReader(path) as reader:
        assert not reader.recovery.complete and not reader.damaged, reader.recovery.message
        records = list(reader.calls())
        assert [record.index for record in records] == list(range(len(records)))  # no hole in what was kept
        completed = 0
        for record in records:
            call = record.context["call"]
            assert call in logged, (call, reader.recovery.message)
            x_digest, w_digest, out_digest = logged[call]
            args = reader.load_args(record.index)
            assert (_digest(args["x"]), _digest(args["w"])) == (x_digest, w_digest), call
            if record.status == "completed":
                completed += 1
                assert _digest(reader.load_outputs(record.index)["out"]) == out_digest, call
            else:
                assert record.status == "inputs_saved" and record.outputs is None
        # only the newest calls can lack their completion (each call's records are written in order)
        statuses = [record.status for record in records]
        assert "inputs_saved" not in statuses[: max(0, len(statuses) - 2)], statuses
        return len(records), completed


def test_kill_9_at_many_moments_keeps_every_written_call_bit_exact(
    serving: ServingProcesses, tmp_path: Path
) -> None:
    chooser = random.Random(KILL_SEED)
    width = 150 // (KILL_MOMENTS - 1)  # one moment in each stretch of the run
    moments = [
        0,
        *(chooser.randrange(1 + width * part, 1 + width * (part + 1)) for part in range(KILL_MOMENTS - 1)),
    ]
    recovered: list[tuple[int, int, int]] = []
    for number, after in enumerate(moments):
        directory, log = tmp_path / f"kill{number}", tmp_path / f"kill{number}.log"
        directory.mkdir()
        pid = int(serving.ask(f"stream {directory} {log}"))
        deadline = time.monotonic() + 60
        while len(_logged(log)) <= after and time.monotonic() < deadline:
            time.sleep(0.0005)
        time.sleep(chooser.uniform(0, 0.003))
        os.kill(pid, signal.SIGKILL)
        assert serving.reap(pid) == signal.SIGKILL  # killed, not ended on its own
        (path,) = directory.glob("rank*-pid*.zst")
        calls, completed = _check_against_log(path, _logged(log))
        recovered.append((after, calls, completed))
    # the moments spread over the run: from a file holding its header only to one with many calls
    # (the first kill lands within a few ms of the first call; a loaded machine lets a few more through)
    assert recovered[0][1] <= 8 and recovered[-1][2] >= 20, recovered
    assert len({calls for _, calls, _ in recovered}) >= KILL_MOMENTS // 2, recovered


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


@pytest.mark.parametrize("limit", [70_000, 123_457])
def test_a_real_file_size_limit_stops_the_capture_cleanly(
    serving: ServingProcesses, tmp_path: Path, limit: int
) -> None:
    """RLIMIT_FSIZE in a serving process (SIGXFSZ ignored): the write that crosses the limit is cut short, the next
    fails with EFBIG — what a full disk does. The process keeps serving, one line says the capture stopped, the
    counters say what was dropped, and every call the file kept loads bit-exact, outputs included."""
    calls = 40
    directory, log = tmp_path / "full", tmp_path / "full.log"
    directory.mkdir()
    pid = int(serving.ask(f"full {directory} {log} {limit} {calls}"))
    assert serving.reap(pid) == 0  # no crash, no SIGXFSZ
    result = json.loads((directory / "result.json").read_text())
    assert result["right"] == [True] * calls  # every wrapped call returned what the kernel computed
    assert not result["active"] and "File too large" in result["disabled_reason"]
    counters = result["counters"]
    assert counters["write_errors"] == 1 and counters["recorded"] < calls
    lines = (directory / "capture.log").read_text().splitlines()
    assert sum("capture disabled" in line for line in lines) == 1, lines
    assert sum(line.startswith("ERROR") for line in lines) == 1, lines  # one loud line, no traceback
    (closed,) = [line for line in lines if "capture closed" in line]
    assert "write_errors=1" in closed and "writing stopped" in closed and "File too large" in closed
    path = Path(result["path"])
    assert path.stat().st_size == limit  # the last write was cut at the limit, mid-record
    written, completed = _check_against_log(path, _logged(log))
    assert 0 < completed <= written <= counters["recorded"]
    # the closing line says what the file holds, not what was handed to it (buffered bytes never reached it)
    assert f"the file keeps {written} call(s) ({completed} with outputs)" in closed, closed
    with CaptureReader(path) as reader:
        assert reader.recovery.footer_missing and reader.recovery.truncated_at is not None
