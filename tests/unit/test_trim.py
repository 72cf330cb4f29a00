"""``moereplay trim``: chosen calls copied as recorded — bytes, views, aliasing, codec values — blobs stored once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moereplay.cli import app
from moereplay.errors import SettingsError
from moereplay.format import CaptureReader, CaptureWriter, register_codec, unregister_codec
from moereplay.format.codecs import codec_for
from moereplay.format.schema import CodecValue
from moereplay.synth import synthesize
from moereplay.synth.recipe import RECIPE_TYPE
from moereplay.trim import parse_call_spec, trim_capture


def test_call_specs() -> None:
    assert parse_call_spec("0,3,10-12") == [0, 3, 10, 11, 12]
    assert parse_call_spec(" 4 , 2-3,4") == [2, 3, 4]
    for bad in ("", "x", "3-1", "-2", "1,,a"):
        with pytest.raises(SettingsError):
            parse_call_spec(bad)


@pytest.fixture
def capture(tmp_path: Path) -> Path:
    """Four calls sharing a weight; call 2 has a parent (1); views, an in-place output, a codec value, a dtype."""
    path = tmp_path / "full.moe.zst"
    weight = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    with CaptureWriter(path, header={"purpose": "trim test"}) as writer:
        for index in range(4):
            base = torch.full((16, 8), float(index), dtype=torch.bfloat16)
            out = torch.zeros(8, 8, dtype=torch.bfloat16)
            args = {
                "w": weight,
                "w_t": weight.t()[1:, 3:],  # a strided view of the same storage
                "x": base[::2],
                "out": out,
                "empty": torch.empty(0, 3),
                "opaque": CodecValue("someone.elses.Type", {"t": base, "n": index}),
                "dtype": torch.float8_e4m3fn,
                "scale": 1.5,
            }
            parent = 1 if index == 2 else None
            call = writer.begin_call("toy", args, site=f"s{index}", context={"layer": index}, parent=parent,
                                     static={"w", "w_t"})  # fmt: skip
            out.add_(index)
            writer.complete_call(call, {"out": out, "return": out[:4]}, timings={"kernel_s": 0.5 * index})
    return path


def test_kept_calls_are_the_recorded_ones_byte_for_byte(capture: Path, tmp_path: Path) -> None:
    result = trim_capture(capture, "1-2", tmp_path / "t.moe.zst")
    assert result.kept == (1, 2) and result.source_calls == 4
    with CaptureReader(capture) as source, CaptureReader(result.path) as trimmed:
        assert trimmed.header["purpose"] == "trim test" and trimmed.header["trim"]["calls"] == [1, 2]
        assert trimmed.header["versions"] == source.header["versions"]
        for new, old in zip(trimmed.indices, result.kept, strict=True):
            a, b = trimmed.call(new), source.call(old)
            assert (a.op, a.site, a.static, a.timings, a.status) == (
                b.op,
                b.site,
                b.static,
                b.timings,
                b.status,
            )
            assert a.context == {**b.context, "trimmed_from": old}
            assert (
                a.arg_tensors == b.arg_tensors and a.output_tensors == b.output_tensors
            )  # views, ids, offsets
            assert a.aliases() == b.aliases() == {"out": ("out",), "return": ("out",)}
            la, lb = trimmed.load_args(new), source.load_args(old)
            for name in ("w", "w_t", "x", "out", "empty"):
                assert la[name].stride() == lb[name].stride() and torch.equal(la[name], lb[name]), name
            assert la["opaque"] == CodecValue("someone.elses.Type", {"t": la["opaque"].value["t"], "n": old})
            assert torch.equal(la["opaque"].value["t"], lb["opaque"].value["t"])
            assert la["dtype"] is torch.float8_e4m3fn and la["scale"] == 1.5
            oa, ob = trimmed.load_outputs(new), source.load_outputs(old)
            assert torch.equal(oa["return"], ob["return"]) and torch.equal(oa["out"], ob["out"])
        # call 2's parent (1) was kept and renumbered; call 1 had none
        assert trimmed.call(1).parent == 0 and trimmed.call(0).parent is None
        stats = trimmed.stats()
    assert stats.referenced_blob_bytes > stats.unique_blob_bytes  # the shared weight is stored once


def test_parents_are_kept_on_request_and_named_otherwise(capture: Path, tmp_path: Path) -> None:
    alone = trim_capture(capture, [2], tmp_path / "a.moe.zst")
    with CaptureReader(alone.path) as reader:
        record = reader.call(0)
        assert record.parent is None and record.context["trimmed_parent"] == 1
    family = trim_capture(capture, [2], tmp_path / "f.moe.zst", parents=True)
    assert family.kept == (1, 2)
    with CaptureReader(family.path) as reader:
        assert reader.call(1).parent == 0


def test_codec_values_are_copied_without_decoding(tmp_path: Path) -> None:
    """A recipe stays a recipe even where its codec is unknown (nothing is expanded, nothing gets bigger)."""
    source = synthesize("fp8-marlin", tmp_path / "s.moe.zst", overrides=["hidden=256", "intermediate=128"])
    codec = codec_for(RECIPE_TYPE)
    assert codec is not None
    unregister_codec(RECIPE_TYPE)
    try:
        result = trim_capture(source.path, "0", tmp_path / "t.moe.zst")
    finally:  # the whole codec back: without its nbytes hook a later reader cannot hold recipes to its budget
        register_codec(
            RECIPE_TYPE, codec.encode, codec.decode, codec.nbytes, codec.scratch, codec.collect, codec.tensors
        )
    assert result.file_bytes < source.file_bytes * 1.1
    with CaptureReader(result.path) as trimmed, CaptureReader(source.path) as original:
        assert isinstance(trimmed.call(0).args["b_qweight"], CodecValue)
        assert torch.equal(trimmed.load_args(0)["b_qweight"], original.load_args(0)["b_qweight"])


def test_bad_requests_are_one_line_errors(capture: Path, tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="no call 9"):
        trim_capture(capture, "9", tmp_path / "x.moe.zst")
    with pytest.raises(SettingsError, match="overwrite its own source"):
        trim_capture(capture, "0", capture)


def test_cli_trim_and_info_show_the_dedup(capture: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "cli.moe.zst"
    result = runner.invoke(app, ["trim", str(capture), "--calls", "0,2-3", "-o", str(out), "--parents"])
    assert result.exit_code == 0, result.output
    assert "kept 4 of 4 calls" in result.output  # 2's parent 1 comes along
    info = runner.invoke(app, ["info", str(out)])
    assert info.exit_code == 0 and "dedup" in info.output
    missing = runner.invoke(app, ["trim", str(tmp_path / "nope.zst"), "--calls", "0", "-o", str(out)])
    assert missing.exit_code != 0


def test_cli_trim_refuses_an_existing_output_unless_forced(capture: Path, tmp_path: Path) -> None:
    """``repro`` refuses to overwrite; ``trim`` replaced its output silently."""
    runner = CliRunner()
    out = tmp_path / "kept.moe.zst"
    out.write_bytes(b"someone's file")
    refused = runner.invoke(app, ["trim", str(capture), "--calls", "0", "-o", str(out)])
    assert refused.exit_code != 0 and "--force" in str(refused.exception)
    assert out.read_bytes() == b"someone's file"
    forced = runner.invoke(app, ["trim", str(capture), "--calls", "0", "-o", str(out), "--force"])
    assert forced.exit_code == 0, forced.output
    assert out.read_bytes() != b"someone's file"


def test_a_gpu_the_source_read_at_close_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A serving worker arms before CUDA exists: its GPU is in the footer, which a trim does not copy."""
    import moereplay.format.writer as writer_module

    late = {"initialized": True, "count": 1, "name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}
    monkeypatch.setattr(writer_module, "late_gpu", lambda header_gpu: dict(late))
    source = tmp_path / "served.moe.zst"
    with CaptureWriter(source, header={"gpu": {"initialized": False, "count": 1}}) as writer:
        call = writer.begin_call("toy", {"x": torch.ones(2)}, site="s")
        writer.complete_call(call, {"out": torch.ones(2)})
    monkeypatch.setattr(writer_module, "late_gpu", lambda header_gpu: None)
    result = trim_capture(source, "0", tmp_path / "t.moe.zst")
    with CaptureReader(result.path) as trimmed:
        assert trimmed.header["gpu"]["name"] == "NVIDIA H100 80GB HBM3"
        assert trimmed.header["gpu"]["read_at_close"] is True
