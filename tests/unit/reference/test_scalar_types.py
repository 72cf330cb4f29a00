"""vLLM ScalarType ids decode without vLLM."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from moereplay.errors import ReferenceError_
from moereplay.reference import scalar_types as st

# The ids vLLM 0.25.1 passes for the types the Marlin MoE kernel takes (computed by vllm/scalar_type.py).
VLLM_IDS = {
    "uint4": 1125899906843648,
    "uint4b8": 1125899907892224,
    "uint8b128": 1125899923621888,
    "uint8": 1125899906844672,
    "int8": 1125899906909952,
    "float4_e2m1f": 562949953487106,
    "float8_e4m3fn": 2814749767172868,
    "float8_e8m0fnu": 2814749767106568,
    "float16": 1125899906910725,
    "bfloat16": 1125899906909960,
}

VLLM_SOURCE = Path("/work/vllm-src/vllm/scalar_type.py")


@pytest.mark.parametrize(("name", "type_id"), sorted(VLLM_IDS.items()))
def test_known_ids(name: str, type_id: int) -> None:
    assert st.KNOWN_TYPES[name].id == type_id
    decoded = st.scalar_type_from_id(type_id)
    assert decoded.name == name
    assert decoded == st.KNOWN_TYPES[name]


def test_fields_of_uint4b8_and_fp4() -> None:
    gptq = st.ScalarType.from_id(VLLM_IDS["uint4b8"])
    assert (gptq.exponent, gptq.mantissa, gptq.signed, gptq.bias) == (0, 4, False, 8)
    assert gptq.nan_repr is st.NanRepr.IEEE_754  # vLLM's integer types keep the dataclass default
    assert gptq.size_bits == 4 and gptq.is_integer
    fp4 = st.ScalarType.from_id(VLLM_IDS["float4_e2m1f"])
    assert (fp4.exponent, fp4.mantissa, fp4.signed, fp4.finite_values_only) == (2, 1, True, True)
    assert fp4.nan_repr is st.NanRepr.NONE and fp4.is_floating_point


def test_unknown_id_is_one_line_error() -> None:
    unknown = st.ScalarType(0, 3, False, 4, False, st.NanRepr.NONE).id
    with pytest.raises(ReferenceError_, match="unknown vLLM ScalarType id"):
        st.scalar_type_from_id(unknown)
    with pytest.raises(ReferenceError_):
        st.scalar_type_from_id(-1)
    with pytest.raises(ReferenceError_):
        st.as_scalar_type("uint4")
    # from_id decodes unknown-but-well-formed ids, and names them descriptively
    assert st.ScalarType.from_id(unknown).name == "uint3b4"


def test_bad_fields() -> None:
    with pytest.raises(ReferenceError_):
        st.ScalarType(256, 0, False)
    with pytest.raises(ReferenceError_):
        st.ScalarType.from_id(3 << 50)  # NaN representation 3 does not exist


def test_as_scalar_type_accepts_objects_with_id() -> None:
    class Foreign:
        id = VLLM_IDS["uint8b128"]

    assert st.as_scalar_type(Foreign()) is st.uint8b128
    assert st.as_scalar_type(VLLM_IDS["uint4"]) is st.uint4
    assert st.as_scalar_type(st.float4_e2m1f) is st.float4_e2m1f


@pytest.mark.skipif(not VLLM_SOURCE.exists(), reason="vLLM sources not unpacked here")
def test_every_vllm_scalar_type_matches_the_source() -> None:
    spec = importlib.util.spec_from_file_location("vllm_scalar_type_source", VLLM_SOURCE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, ours in st.KNOWN_TYPES.items():
        theirs = getattr(module.scalar_types, name)
        assert theirs.id == ours.id, name
        assert st.scalar_type_from_id(theirs.id) is ours
