"""CUDA tensors: the writer copies the recorded spans to the host itself; loading puts them on any device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moereplay.format import CaptureReader, CaptureWriter

pytestmark = pytest.mark.gpu


def test_cuda_tensors_round_trip_and_load_on_either_device(tmp_path: Path) -> None:
    weight = torch.randn(128, 64, device="cuda").to(torch.float8_e4m3fn)
    hidden = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    path = tmp_path / "cuda.zst"
    with CaptureWriter(path) as writer:
        index = writer.begin_call("op", {"w": weight, "x": hidden, "xt": hidden.t()}, static={"w"})
        hidden.mul_(2)
        writer.complete_call(index, {"out": hidden})
        writer.begin_call("op", {"w": weight}, static={"w"})
    with CaptureReader(path) as reader:
        record = reader.call(index)
        assert record.arg_tensors["w"].device == f"cuda:{torch.cuda.current_device()}"
        assert reader.header["gpu"]["initialized"] and reader.header["gpu"]["sm_count"] > 0
        on_gpu = reader.load_args(index, device="cuda")
        on_cpu = reader.load_args(index, device="cpu")
        outputs = reader.load_outputs(index, device="cuda")
        assert reader.stats().blobs == 3  # the weight once, the input and the output of x
    assert on_gpu["w"].is_cuda and on_gpu["w"].dtype == torch.float8_e4m3fn
    assert torch.equal(on_gpu["w"].view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(on_cpu["x"] * 2, hidden.cpu()) and torch.equal(outputs["out"], hidden)
    assert on_gpu["xt"].stride() == (1, 64)
    assert on_gpu["x"].untyped_storage().data_ptr() == on_gpu["xt"].untyped_storage().data_ptr()
    assert record.aliases() == {"out": ("x", "xt")}
