"""vLLM's ScalarType through the format codec the capture registers: recorded as id + name, loaded as the id the
replay hands to the kernel, which the reference reads as the same scalar type."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from moereplay.capture import session as session_module
from moereplay.capture.patch_points import VLLM_CODECS, CaptureTarget
from moereplay.errors import UnsupportedValueError
from moereplay.format import CaptureReader, CodecValue
from moereplay.ops.vllm_codecs import decode_scalar_type, encode_scalar_type
from moereplay.reference import scalar_types
from moereplay.reference.scalar_types import as_scalar_type

MODULE = "moereplay_test_marlin_ops"


class ScalarType:
    """Stands in for ``vllm.scalar_type.ScalarType`` (same qualified name, an ``id`` and a ``str``)."""

    def __init__(self, type_id: int, name: str) -> None:
        self.id = type_id
        self._name = name

    def __str__(self) -> str:
        return self._name


ScalarType.__module__ = "vllm.scalar_type"


def gemm(input: torch.Tensor, b_q_type: ScalarType, size_n: int) -> torch.Tensor:
    """A real computation whose behaviour depends on the scalar type's id, as the Marlin kernel's does."""
    return input[:, :size_n] * float(b_q_type.id % 7 + 1)


@pytest.fixture
def armed(tmp_path: Path, stand_in_module: Callable[..., types.ModuleType]) -> Iterator[types.ModuleType]:
    module = stand_in_module(MODULE, gemm=gemm)
    env = {"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_DIR": str(tmp_path / "captures")}
    targets = (CaptureTarget("gemm", "kernel", MODULE, "gemm", codec_modules=VLLM_CODECS),)
    try:
        assert session_module.arm(env, targets=targets) is not None
        yield module
    finally:
        session_module.disarm()


def test_scalar_type_is_recorded_as_id_and_name_and_loaded_as_the_id(armed: types.ModuleType) -> None:
    nvfp4 = scalar_types.float4_e2m1f
    quant = ScalarType(nvfp4.id, "float4_e2m1f")
    x = torch.randn(3, 8)
    result = armed.gemm(x, quant, 4)
    session = session_module.current()
    assert session is not None and session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        record = reader.call(0)
        recorded = record.args["b_q_type"]
        assert recorded == CodecValue("vllm.scalar_type.ScalarType", {"id": nvfp4.id, "name": "float4_e2m1f"})
        args = reader.load_args(0)
        assert args["b_q_type"] == nvfp4.id and type(args["b_q_type"]) is int
        assert as_scalar_type(args["b_q_type"]) == nvfp4
        replayed = gemm(args["input"], ScalarType(args["b_q_type"], "replayed"), args["size_n"])
        assert torch.equal(replayed, reader.load_outputs(0)["return"]) and torch.equal(replayed, result)


def test_codec_refuses_values_without_an_id() -> None:
    with pytest.raises(UnsupportedValueError):
        encode_scalar_type(object())
    assert decode_scalar_type(17) == 17
    for bad in ({"name": "x"}, {"id": True}, {"id": -1}, "uint4b8"):
        with pytest.raises(UnsupportedValueError):
            decode_scalar_type(bad)
