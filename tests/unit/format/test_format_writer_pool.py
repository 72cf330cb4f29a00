"""The writer's hash/compress worker pool and prefetch: same records as the serial writer, dedup kept, nothing
leaked, and files ``zstd -d`` still reads."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import msgpack
import pytest
import torch
from capture_file_helpers import record_layout

from moereplay.format import CaptureReader, CaptureWriter
from moereplay.format.framing import RecordKind
from moereplay.format.schema import TensorBytes


def given(data: torch.Tensor, storage: object = "s") -> TensorBytes:
    """``data`` (1-D uint8, CPU) handed over as already-copied bytes of a float32 tensor."""
    count = data.numel() // 4
    return TensorBytes(torch.float32, (count,), (1,), 0, "cuda:0", storage, 0, data)


def raw(values: torch.Tensor) -> torch.Tensor:
    return values.contiguous().view(torch.uint8).reshape(-1).clone()


def blob_frames(path: Path) -> list[bytes]:
    """The raw bytes of every blob frame, in file order."""
    data = path.read_bytes()
    return [
        data[envelope.frame_offset : envelope.end]
        for envelope in record_layout(path)
        if envelope.kind is RecordKind.BLOB
    ]


def write_calls(
    path: Path, workers: int, tensors: list[torch.Tensor], weight: torch.Tensor, prefetch: bool
) -> None:
    with CaptureWriter(path, workers=workers) as writer:
        datas = [raw(tensor) for tensor in tensors]
        if prefetch:
            for data in datas:
                writer.prefetch(data)
        for step in range(0, len(datas), 2):
            index = writer.begin_call("op", {"a": given(datas[step], "a"), "w": weight}, static=("w",))
            writer.complete_call(index, {"out": given(datas[step + 1], "b")})


@pytest.mark.parametrize("prefetch", [False, True])
def test_pool_writes_the_same_blob_frames_as_the_serial_writer(tmp_path: Path, prefetch: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(70_000 + 64 * i, generator=generator) for i in range(8)]
    tensors[5] = tensors[1].clone()  # same bytes as an earlier blob: stored once
    weight = torch.randn(3000, generator=generator)  # small: written inline
    write_calls(tmp_path / "serial.zst", 0, tensors, weight, False)
    write_calls(tmp_path / "pool.zst", 3, tensors, weight, prefetch)
    serial, pooled = blob_frames(tmp_path / "serial.zst"), blob_frames(tmp_path / "pool.zst")
    assert serial == pooled and len(pooled) == 8  # 7 distinct activations + the static weight
    with CaptureReader(tmp_path / "pool.zst") as reader:
        assert len(reader) == 4
        for call in range(4):
            assert torch.equal(reader.load_args(call)["a"], tensors[2 * call])
            assert torch.equal(reader.load_args(call)["w"], weight)
            assert torch.equal(reader.load_outputs(call)["out"], tensors[2 * call + 1])
        assert reader.footer["blobs"] == 8


def test_prefetched_bytes_the_file_holds_are_not_compressed_again(tmp_path: Path) -> None:
    values = torch.randn(100_000)
    path = tmp_path / "d.zst"
    with CaptureWriter(path, workers=2) as writer:
        writer.begin_call("op", {"x": given(raw(values))})
        compressed = writer.phase_seconds["compress"]
        again = raw(values)
        assert writer.prefetch(again)
        writer._prefetched[id(again)].future.result()
        assert writer.phase_seconds["compress"] == compressed  # hashed, found in the file, not compressed
        writer.begin_call("op", {"x": given(again)})
        assert not writer._prefetched
    with CaptureReader(path) as reader:
        assert reader.footer["blobs"] == 1
        assert torch.equal(reader.load_args(1)["x"], values)


def test_prefetch_refuses_what_it_cannot_use_and_forget_releases(tmp_path: Path) -> None:
    with CaptureWriter(tmp_path / "serial.zst") as serial:
        assert not serial.prefetch(raw(torch.ones(100_000)))  # no pool
    with CaptureWriter(tmp_path / "p.zst", workers=1) as writer:
        assert not writer.prefetch(torch.ones(8))  # not uint8
        assert not writer.prefetch(torch.empty(0, dtype=torch.uint8))
        assert not writer.prefetch(raw(torch.ones(64)))  # small: not worth a hand-over
        data = raw(torch.ones(100_000))
        assert writer.prefetch(data) and not writer.prefetch(data)
        writer.forget(data)
        assert not writer._prefetched
        unused = raw(torch.zeros(100_000))
        assert writer.prefetch(unused)
    assert not writer._prefetched  # closing drops unused work
    assert not writer.prefetch(raw(torch.ones(100_000)))  # closed


def test_pool_threads_end_at_close(tmp_path: Path) -> None:
    before = {thread.name for thread in threading.enumerate()}
    with CaptureWriter(tmp_path / "t.zst", workers=4) as writer:
        for step in range(6):
            writer.begin_call("op", {"x": torch.full((100_000,), float(step))})
    after = {thread.name for thread in threading.enumerate()} - before
    assert not [name for name in after if name.startswith("moereplay-blob")]


def test_workers_must_be_known(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="workers"):
        CaptureWriter(tmp_path / "w.zst", workers=-2)
    with CaptureWriter(tmp_path / "d.zst", workers=-1) as writer:
        assert 1 <= writer.workers <= 8


def test_zstd_cli_reads_a_pooled_file(tmp_path: Path) -> None:
    path = tmp_path / "z.zst"
    with CaptureWriter(path, workers=2, compression_threads=2) as writer:
        data = raw(torch.arange(100_000, dtype=torch.float32))
        writer.prefetch(data)
        index = writer.begin_call("op", {"x": given(data)})
        writer.complete_call(index, {})
    result = subprocess.run(["zstd", "-dc", str(path)], capture_output=True, check=True)
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_bin_len=2**30)
    unpacker.feed(result.stdout)
    documents = list(unpacker)
    assert sorted(documents[1]) == ["d", "h", "n"] and documents[1]["d"] == bytes(data.numpy())


def test_a_pool_that_refuses_work_loses_no_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the interpreter's shutdown has begun, concurrent.futures' pools refuse new work (its threading atexit
    hook runs before any atexit handler, so a capture closed at exit meets refusing pools): the writer then hashes
    and compresses on the calling thread and writes the same blob frames."""
    import concurrent.futures.thread as pool_module

    generator = torch.Generator().manual_seed(1)
    tensors = [torch.randn(70_000 + 64 * i, generator=generator) for i in range(4)]
    weight = torch.randn(3000, generator=generator)
    write_calls(tmp_path / "serial.zst", 0, tensors, weight, False)
    path = tmp_path / "refused.zst"
    with CaptureWriter(path, workers=2) as writer:
        datas = [raw(tensor) for tensor in tensors]
        assert writer.prefetch(datas[0])  # started while the pool still took work
        monkeypatch.setattr(pool_module, "_shutdown", True)  # what the interpreter's shutdown hook sets
        assert not writer.prefetch(datas[2])  # refused: nothing started, no exception
        for step in range(0, len(datas), 2):
            index = writer.begin_call("op", {"a": given(datas[step], "a"), "w": weight}, static=("w",))
            writer.complete_call(index, {"out": given(datas[step + 1], "b")})
        assert writer.pool_refused is not None and "shutdown" in writer.pool_refused
    assert blob_frames(path) == blob_frames(tmp_path / "serial.zst")
    with CaptureReader(path) as reader:
        assert len(reader) == 2 and reader.recovery.complete
        for call in range(2):
            assert torch.equal(reader.load_args(call)["a"], tensors[2 * call])
            assert torch.equal(reader.load_outputs(call)["out"], tensors[2 * call + 1])
