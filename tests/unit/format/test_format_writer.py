"""Writer behaviour: header, statuses, dedup, static identity cache, index/footer, zstd compatibility."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import msgpack
import pytest
import torch
from capture_file_helpers import record_layout

from moereplay.format import FORMAT_MAJOR, CaptureReader, CaptureWriter
from moereplay.format.framing import RecordKind


def test_header_merges_environment_and_caller_fields(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEREPLAY_CAPTURE", "1")
    monkeypatch.delenv("MOEREPLAY_CACHE_DIR", raising=False)  # the suite's recipe store (tests/conftest.py)
    monkeypatch.delenv(
        "MOEREPLAY_STATE_DIR", raising=False
    )  # the suite's state directory (tests/conftest.py)
    monkeypatch.setenv("VLLM_USE_V1", "1")
    monkeypatch.setenv("UNRELATED_SECRET", "x")
    monkeypatch.setenv("VLLM_API_KEY", "sk-secret")
    monkeypatch.setattr(
        "sys.argv", ["vllm", "serve", "m", "--api-key", "sk-1", "--hf-token=hf-2", "--port", "8"]
    )
    path = tmp_path / "h.zst"
    with CaptureWriter(path, {"model": "tiny", "format_version": [9, 9], "magic": "nope"}):
        pass
    with CaptureReader(path) as reader:
        header = reader.header
    assert header["model"] == "tiny"
    assert header["format_version"] == [FORMAT_MAJOR, 0] and header["magic"] == "moereplay-capture"
    assert header["env"] == {"MOEREPLAY_CAPTURE": "1", "VLLM_API_KEY": "<redacted>", "VLLM_USE_V1": "1"}
    assert header["argv"] == [
        "vllm",
        "serve",
        "m",
        "--api-key",
        "<redacted>",
        "--hf-token=<redacted>",
        "--port",
        "8",
    ]
    assert header["versions"]["torch"] == str(torch.__version__)
    assert header["versions"]["moereplay"]
    assert header["pid"] > 0 and isinstance(header["argv"], list) and header["host"]


def test_statuses_timings_errors_and_counters(tmp_path: Path) -> None:
    path = tmp_path / "s.zst"
    with CaptureWriter(path) as writer:
        ok = writer.begin_call("op", {"x": 1})
        bad = writer.begin_call("op", {"x": 2})
        writer.begin_call("crashed", {"x": 3})
        writer.complete_call(ok, {"y": 2}, timings={"kernel_s": 0.5})
        writer.complete_call(bad, {}, status="failed", error="RuntimeError: illegal memory access")
        with pytest.raises(ValueError):
            writer.complete_call(ok, {})  # twice
        with pytest.raises(ValueError):
            writer.complete_call(99, {})
        with pytest.raises(ValueError):
            writer.complete_call(2, {}, status="weird")
        writer.close(counters={"dropped_queue_full": 4})
        writer.close()  # idempotent
        with pytest.raises(ValueError):
            writer.begin_call("op", {})
    with CaptureReader(path) as reader:
        records = list(reader.calls())
        stats = reader.stats()
        assert reader.recovery.complete
    assert [record.status for record in records] == ["completed", "failed", "inputs_saved"]
    assert records[0].timings == {"kernel_s": 0.5} and records[0].outputs == {"y": 2}
    assert records[1].error == "RuntimeError: illegal memory access"
    assert records[2].outputs is None
    assert stats.by_op == {"crashed": {"inputs_saved": 1}, "op": {"completed": 1, "failed": 1}}
    assert stats.counters == {"dropped_queue_full": 4}


def test_late_completion_of_a_forgotten_call(tmp_path: Path) -> None:
    from moereplay.format.writer import MAX_PENDING_CALLS

    path = tmp_path / "late.zst"
    x = torch.ones(2)
    with CaptureWriter(path) as writer:
        first = writer.begin_call("op", {"x": x})
        for _ in range(MAX_PENDING_CALLS):
            writer.begin_call("op", {})
        writer.complete_call(first, {"out": x})  # still allowed; aliasing to the input is no longer known
        with pytest.raises(ValueError):
            writer.complete_call(first, {})
    with CaptureReader(path) as reader:
        assert reader.call(first).status == "completed" and reader.call(first).aliases() == {}
        assert reader.footer is not None and reader.footer["pending"] == MAX_PENDING_CALLS


def test_compression_threads(tmp_path: Path) -> None:
    weight = torch.randn(512, 1024)
    with CaptureWriter(tmp_path / "mt.zst", compression_threads=2) as writer:
        writer.begin_call("op", {"w": weight})
    with CaptureReader(tmp_path / "mt.zst") as reader:
        assert torch.equal(reader.load_args(0)["w"], weight)


def test_context_manager_closes_on_error(tmp_path: Path) -> None:
    path = tmp_path / "e.zst"
    with pytest.raises(KeyError), CaptureWriter(path) as writer:
        writer.begin_call("op", {"x": torch.ones(3)})
        raise KeyError("boom")
    with CaptureReader(path) as reader:
        assert reader.recovery.complete and len(reader) == 1


def test_blobs_are_stored_once_per_file(tmp_path: Path) -> None:
    weight = torch.randn(256, 256)
    path = tmp_path / "d.zst"
    with CaptureWriter(path) as writer:
        for step in range(10):
            copy = weight.clone()  # a different storage with the same bytes: found by hash
            writer.begin_call("op", {"w": copy, "x": torch.full((4,), float(step))})
    with CaptureReader(path) as reader:
        stats = reader.stats()
    assert stats.blobs == 11
    assert stats.unique_blob_bytes == 256 * 256 * 4 + 10 * 16
    assert stats.file_bytes < 1.05 * stats.unique_blob_bytes + 20_000
    assert stats.dedup_ratio == pytest.approx(stats.referenced_blob_bytes / stats.unique_blob_bytes)


def test_static_cache_skips_copies_but_sees_version_bumps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moereplay.format import writer as writer_module

    copies: list[int] = []
    original = writer_module.storage_span_to_host

    def counting(tensor: torch.Tensor, start: int, end: int) -> memoryview:
        copies.append(end - start)
        return original(tensor, start, end)

    monkeypatch.setattr(writer_module, "storage_span_to_host", counting)
    weight = torch.randn(64, 64)
    before = weight.clone()
    path = tmp_path / "static.zst"
    with CaptureWriter(path) as writer:
        for _ in range(5):
            writer.begin_call("op", {"w": weight, "x": torch.ones(2)}, static={"w"})
        assert len(copies) == 5 + 1  # the weight once, x every call
        weight.add_(1)  # bumps the version counter: the cache must not answer
        writer.begin_call("op", {"w": weight}, static={"w"})
        assert len(copies) == 7
    with CaptureReader(path) as reader:
        assert torch.equal(reader.load_args(5)["w"], weight)
        assert torch.equal(reader.load_args(0)["w"], before)
        assert reader.call(0).static == ("w",)


def test_static_inference_tensors(tmp_path: Path) -> None:
    with torch.inference_mode():
        weight = torch.randn(16, 16)
    path = tmp_path / "inference.zst"
    with CaptureWriter(path) as writer:
        writer.begin_call("op", {"w": weight}, static={"w"})
        writer.begin_call("op", {"w": weight}, static={"w"})
    with CaptureReader(path) as reader:
        assert torch.equal(reader.load_args(1)["w"], weight)
        assert reader.stats().blobs == 1


def test_index_and_footer_are_used_without_scanning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOEREPLAY_CACHE_DIR", raising=False)  # the header records MOEREPLAY_* settings
    path = tmp_path / "i.zst"
    with CaptureWriter(path, index_every=4) as writer:
        for step in range(10):
            index = writer.begin_call("op", {"x": torch.full((1000,), float(step))})
            writer.complete_call(index, {"y": step})
        before_close = writer.bytes_written
    assert before_close < path.stat().st_size
    kinds = [envelope.kind for envelope in record_layout(path)]
    assert kinds[0] is RecordKind.HEADER and kinds[-2:] == [RecordKind.FOOTER, RecordKind.TAIL]
    assert kinds.count(RecordKind.INDEX) == 3  # after calls 4 and 8, and the last one at close
    with CaptureReader(path) as reader:
        assert reader.recovery.complete
        opened = reader.bytes_read
        # header, tail, footer, three index records and the 32-byte envelope of each record (the check that the
        # index lists every record): no read of the 40 kB of blobs
        assert opened < 2_500
        assert reader.call(7).outputs == {"y": 7}
        assert torch.equal(reader.load_args(7)["x"], torch.full((1000,), 7.0))


@pytest.mark.skipif(shutil.which("zstd") is None, reason="needs the zstd command-line tool")
def test_zstd_cli_decompresses_to_msgpack_documents(tmp_path: Path) -> None:
    path = tmp_path / "z.zst"
    with CaptureWriter(path) as writer:
        index = writer.begin_call("op", {"x": torch.arange(10)})
        writer.complete_call(index, {})
    result = subprocess.run(["zstd", "-dc", str(path)], capture_output=True, check=True)
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(result.stdout)
    documents = list(unpacker)
    assert documents[0]["magic"] == "moereplay-capture"
    assert [sorted(document)[:2] for document in documents[1:3]] == [["d", "h"], ["args", "ctx"]]
    assert len(documents) == 6  # header, blob, call, completion, index, footer


def test_a_gpu_not_initialised_at_the_start_is_read_again_at_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a vLLM worker arms the capture before it initialises CUDA: the header can only say how many devices there
    # are; the writer reads the GPU again when it closes the file, and `info` shows that one
    from moereplay.format import environment
    from moereplay.format.summary import capture_info

    gpu = {"initialized": True, "count": 1, "device": 0, "name": "NVIDIA H200", "compute_capability": "9.0",
           "sm_count": 132, "memory_bytes": 150_000_000_000}  # fmt: skip
    states = iter([{"initialized": False, "count": 1}, gpu])
    monkeypatch.setattr(environment, "_gpu", lambda: next(states))
    path = tmp_path / "late.zst"
    with CaptureWriter(path) as writer:
        writer.complete_call(writer.begin_call("op", {"x": torch.zeros(4)}), {"y": 1})
    with CaptureReader(path) as reader:
        assert reader.header["gpu"] == {"initialized": False, "count": 1}
        assert reader.footer is not None and reader.footer["gpu"]["name"] == "NVIDIA H200"
    info = capture_info(path)
    assert info.header["gpu"]["name"] == "NVIDIA H200" and info.header["gpu"]["read_at_close"] is True
    # a header that had the GPU keeps it, and nothing is read at close
    monkeypatch.setattr(environment, "_gpu", lambda: gpu)
    with CaptureWriter(tmp_path / "early.zst") as writer:
        writer.complete_call(writer.begin_call("op", {"x": torch.zeros(4)}), {"y": 1})
    with CaptureReader(tmp_path / "early.zst") as reader:
        assert "gpu" not in (reader.footer or {})


def test_a_byte_limit_refuses_a_record_whose_new_blobs_pass_it_and_counts_weights_once(
    tmp_path: Path,
) -> None:
    from moereplay.errors import FileLimitError

    path = tmp_path / "bound.moe.zst"
    weight = torch.randn(64, 64)  # 16 KB, written once per file
    with CaptureWriter(path) as writer:
        writer.byte_limit = writer.bytes_written + 24 * 1024
        first = writer.begin_call("gemm", {"x": torch.randn(4, 64), "w": weight}, static=["w"])
        writer.complete_call(first, {"out": torch.randn(4, 64)})
        # the weights are in the file now: a second call needs only its own few bytes
        second = writer.begin_call("gemm", {"x": torch.randn(4, 64), "w": weight}, static=["w"])
        writer.complete_call(second, {"out": torch.randn(4, 64)})
        with pytest.raises(FileLimitError, match="new blobs"):
            writer.begin_call("gemm", {"x": torch.randn(4, 64), "w": torch.randn(64, 64)}, static=["w"])
        with pytest.raises(FileLimitError):
            writer.begin_call("gemm", {"x": torch.randn(64, 128), "w": weight}, static=["w"])
        assert writer.calls == 2  # nothing of a refused call was recorded
    with CaptureReader(path) as reader:
        assert reader.recovery.complete and len(reader) == 2
        assert torch.equal(reader.load_args(1)["w"], weight)
