"""Every Marlin weight format: logical experts → packed like vLLM → dequantised == the float64 weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moereplay.errors import ReferenceError_
from moereplay.reference import marlin_formats as mf
from moereplay.reference import scalar_types as st
from moereplay.reference.marlin_formats import (
    MarlinExpertWeights,
    MarlinWeightFormat,
    decode_s0e5m3,
    dequant_notes,
    detect_format,
    encode_s0e5m3,
    nvfp4_scale_bytes,
    nvfp4_scale_factor,
    pack_experts,
    pack_scales,
    random_experts,
    random_logical_experts,
)

F = MarlinWeightFormat

CASES = [
    (F.NVFP4, None, torch.bfloat16, False),
    (F.NVFP4, None, torch.float16, False),
    (F.MXFP4, None, torch.bfloat16, False),
    (F.MXFP8, None, torch.bfloat16, False),
    (F.FP8, -1, torch.bfloat16, False),
    (F.FP8, 128, torch.float16, False),
    (F.GPTQ_INT4, -1, torch.bfloat16, False),
    (F.GPTQ_INT4, 32, torch.float16, False),
    (F.GPTQ_INT4, 64, torch.bfloat16, True),
    (F.GPTQ_INT8, 128, torch.bfloat16, False),
    (F.GPTQ_INT8, 32, torch.float16, True),
    (F.AWQ_INT4, 32, torch.bfloat16, False),
    (F.AWQ_INT4, -1, torch.float16, False),
    (F.AWQ_INT4_FZP, 64, torch.float16, False),
]


def _weights(packed, experts: int = 3) -> MarlinExpertWeights:
    return packed.expert_weights()


@pytest.mark.parametrize(("fmt", "group_size", "dtype", "act_order"), CASES)
def test_dequantize_matches_float64_weights(fmt, group_size, dtype, act_order) -> None:
    gen = torch.Generator().manual_seed(11)
    packed = random_experts(
        fmt, 3, 256, 128, group_size=group_size, activation_dtype=dtype, act_order=act_order, generator=gen
    )
    weights = _weights(packed)
    assert weights.format is fmt
    dense = weights.dequantize()
    assert dense.dtype == torch.float32 and dense.shape == (3, 256, 128)
    error = (dense.to(torch.float64) - packed.dense).abs()
    scale = packed.dense.abs().amax()
    # float32 holds these products exactly except NVFP4's one rounding of the global-scale product
    assert float(error.max()) <= float(scale) * 2**-23, fmt
    # selected experts, in a chosen order, and a tiny chunk budget give the same values
    some = weights.dequantize(torch.tensor([2, 0]), max_chunk_elements=1)
    assert torch.equal(some, dense[[2, 0]])


def test_zero_points_and_bias_packed() -> None:
    gen = torch.Generator().manual_seed(2)
    packed = random_experts(F.AWQ_INT4, 2, 128, 64, group_size=32, with_bias=True, generator=gen)
    assert packed.b_qzeros is not None and packed.b_qzeros.shape == (2, 4, 8)
    assert packed.b_bias is not None and packed.dense_bias is not None
    assert packed.kernel_kwargs()["b_q_type"] == st.uint4.id


def test_s0e5m3_encoding() -> None:
    # 448 * 2**7 (the largest NVFP4 scale after vLLM's * 2**7) → fp16 0x7B00 → << 1 → high byte 0xF6
    assert encode_s0e5m3(torch.tensor([448.0 * 128])).tolist() == [0xF6]
    assert decode_s0e5m3(torch.tensor([0xF6], dtype=torch.uint8)).tolist() == [448.0 * 128]
    values = torch.tensor([2.0, 3.0, 1.75 * 2**10, 0.5, 1.0])
    encoded = encode_s0e5m3(values)
    assert encoded[3] == 0 and encoded[4] == 0  # below 2: zeroed like vLLM
    assert decode_s0e5m3(encoded).tolist() == [2.0, 3.0, 1.75 * 2**10, 0.0, 0.0]
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    decoded = decode_s0e5m3(every)
    assert torch.isfinite(decoded).all() and decoded[0] == 0 and decoded[0x80] == 2.0


def test_nvfp4_scale_factor() -> None:
    scales = torch.tensor([1.0, 2.0, 0.0])
    assert (
        nvfp4_scale_factor(scales, torch.bfloat16) == 128.0
    )  # 2 * 2**7 * 128 <= 448 * 2**7 < 2 * 2**7 * 256
    assert nvfp4_scale_factor(scales, torch.float16) == 1.0
    assert nvfp4_scale_factor(torch.tensor([448.0]), torch.bfloat16) == 1.0
    assert nvfp4_scale_factor(torch.zeros(3), torch.bfloat16) == 1.0
    # the largest positive scale decides, whatever negative, zero or NaN scales lie beside it
    assert nvfp4_scale_factor(torch.tensor([-500.0, 2.0, 0.0]), torch.bfloat16) == 128.0
    assert nvfp4_scale_factor(torch.tensor([float("nan"), 2.0, 1.0]), torch.bfloat16) == 128.0
    assert nvfp4_scale_factor(torch.tensor([float("nan"), -1.0]), torch.bfloat16) == 1.0
    assert nvfp4_scale_factor(torch.tensor([-3.0, 0.0]), torch.bfloat16) == 1.0
    assert nvfp4_scale_factor(torch.zeros(0), torch.bfloat16) == 1.0


@pytest.mark.parametrize("activation_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("factor", [1.0, 2.0, 128.0])
def test_nvfp4_scale_table_is_the_elementwise_preparation_of_every_e4m3_byte(
    activation_dtype: torch.dtype, factor: float
) -> None:
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    marlin = values.to(activation_dtype).to(torch.float16)
    if factor > 1.0:
        marlin = (marlin.to(torch.float32) * factor).to(torch.float16)
    assert torch.equal(nvfp4_scale_bytes(activation_dtype, factor), encode_s0e5m3(marlin * 2.0**7))


@pytest.mark.parametrize("seed", [0, 1])
def test_nvfp4_scales_through_the_table_are_the_elementwise_preparation(seed: int) -> None:
    """Every e4m3 byte — NaN, negative, zero and subnormal ones included — packs as vLLM's steps applied to the
    whole tensor: as the activation type, reordered, fp16, times the shared factor, the byte of ``s * 2**7``."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256 if seed else 0x70, (3, 4, 128), generator=gen, dtype=torch.uint8)
    scales = raw.view(torch.float8_e4m3fn)
    assert seed or nvfp4_scale_factor(scales, torch.bfloat16) > 1.0  # no large scale: the factor path runs
    for dtype in (torch.bfloat16, torch.float16):
        s_16 = scales.to(dtype)
        factor = nvfp4_scale_factor(s_16, dtype)
        grouped = mf.layout.scales_are_grouped(4)
        marlin = mf.layout.swap_scale_pairs(mf.layout.permute_scales(s_16, grouped)).to(torch.float16)
        if factor > 1.0:
            marlin = (marlin.to(torch.float32) * factor).to(torch.float16)
        expected = encode_s0e5m3(marlin * 2.0**7)
        packed = pack_scales(
            F.NVFP4, scales, activation_dtype=dtype, global_scale=torch.ones(3), with_dense=False
        )
        assert torch.equal(packed.b_scales.view(torch.uint8), expected)


def test_scales_pack_the_same_without_their_dense_values() -> None:
    for fmt in (F.NVFP4, F.MXFP4, F.AWQ_INT4, F.AWQ_INT4_FZP):
        logical = random_logical_experts(
            fmt,
            2,
            128,
            128,
            group_size=fmt.fixed_group_size or 32,
            generator=torch.Generator().manual_seed(7),
        )
        with_dense = pack_scales(
            fmt, logical.scales, global_scale=logical.global_scale, zero_points=logical.zero_points
        )
        without = pack_scales(
            fmt,
            logical.scales,
            global_scale=logical.global_scale,
            zero_points=logical.zero_points,
            with_dense=False,
        )
        assert without.scale_dense is None and without.zp_dense is None and with_dense.scale_dense is not None
        for name in ("b_scales", "global_scale", "b_qzeros"):
            ours, theirs = getattr(without, name), getattr(with_dense, name)
            assert (ours is None and theirs is None) or torch.equal(
                ours.view(torch.uint8) if ours.dtype.itemsize == 1 else ours,
                theirs.view(torch.uint8) if theirs.dtype.itemsize == 1 else theirs,
            )


def test_nvfp4_global_scale_carries_compensation() -> None:
    codes = torch.full((1, 16, 64), 2, dtype=torch.uint8)  # e2m1 code 2 = 1.0
    scales = torch.full((1, 1, 64), 448.0)
    packed = pack_experts(F.NVFP4, codes, scales, global_scale=torch.tensor([0.5]))
    assert packed.global_scale is not None
    assert float(packed.global_scale[0]) == 0.5 * 2.0 ** (126 - 7)
    assert torch.all(packed.dense == 448.0 * 0.5)


def test_detect_format_errors() -> None:
    fp8_scales = torch.zeros(1, 1, 64, dtype=torch.float8_e4m3fn)
    bf16_scales = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ReferenceError_, match="global_scale"):
        detect_format(
            st.float4_e2m1f, fp8_scales, has_zero_points=False, is_zp_float=False, has_global_scale=False
        )
    with pytest.raises(ReferenceError_):
        detect_format(
            st.float4_e2m1f, bf16_scales, has_zero_points=False, is_zp_float=False, has_global_scale=False
        )
    with pytest.raises(ReferenceError_, match="zero points"):
        detect_format(st.uint4, bf16_scales, has_zero_points=False, is_zp_float=False, has_global_scale=False)
    with pytest.raises(ReferenceError_, match="no weight format"):
        detect_format(st.int8, bf16_scales, has_zero_points=False, is_zp_float=False, has_global_scale=False)
    with pytest.raises(ReferenceError_, match="only used by NVFP4"):
        detect_format(
            st.uint4b8, bf16_scales, has_zero_points=False, is_zp_float=False, has_global_scale=True
        )


def test_argument_checks() -> None:
    packed = random_experts(F.GPTQ_INT4, 2, 128, 64, group_size=32)
    common = {
        "b_qweight": packed.b_qweight,
        "b_scales": packed.b_scales,
        "b_q_type": st.uint4b8,
        "activation_dtype": torch.bfloat16,
    }
    with pytest.raises(ReferenceError_, match="size_k"):
        MarlinExpertWeights.from_kernel_args(**common, size_k=256, size_n=64)
    with pytest.raises(ReferenceError_, match="16-bit"):
        MarlinExpertWeights.from_kernel_args(
            **{**common, "activation_dtype": torch.int8}, size_k=128, size_n=64
        )
    with pytest.raises(ReferenceError_, match="b_scales"):
        MarlinExpertWeights.from_kernel_args(
            **{**common, "b_scales": packed.b_scales[:, :, :32]}, size_k=128, size_n=64
        )
    mx = random_experts(F.MXFP4, 1, 64, 64)
    with pytest.raises(ReferenceError_, match="bfloat16"):
        MarlinExpertWeights.from_kernel_args(
            b_qweight=mx.b_qweight,
            b_scales=mx.b_scales,
            b_q_type=st.float4_e2m1f,
            activation_dtype=torch.float16,
            size_k=64,
            size_n=64,
        )
    weights = MarlinExpertWeights.from_kernel_args(**common, size_k=128, size_n=64)
    with pytest.raises(ReferenceError_, match="out of range"):
        weights.dequantize(torch.tensor([5]))
    # empty g_idx/perm mean "no act order", as in the kernel
    empty = torch.empty((2, 0), dtype=torch.int32)
    assert not MarlinExpertWeights.from_kernel_args(
        **common, size_k=128, size_n=64, g_idx=empty, perm=empty
    ).has_act_order


def test_dequant_notes() -> None:
    packed = random_experts(F.NVFP4, 2, 64, 64)
    raw = packed.b_scales.view(torch.uint8).clone()
    raw[0, 0, 0] = 0x40  # non-zero, top bit clear
    weights = MarlinExpertWeights.from_kernel_args(
        b_qweight=packed.b_qweight,
        b_scales=raw.view(torch.float8_e4m3fn),
        b_q_type=st.float4_e2m1f,
        activation_dtype=torch.bfloat16,
        size_k=64,
        size_n=64,
        global_scale=packed.global_scale.to(torch.float16),
    )
    notes = dequant_notes(weights, torch.tensor([0, 1]))
    # in the order the checks run (the count is read after the other notes are known, its note keeps its place)
    assert [code for code, _ in notes] == ["nvfp4_scale_top_bit_clear", "global_scale_dtype"]
    assert notes[0][1].startswith("1 non-zero NVFP4 scale bytes")
    assert {code for code, _ in dequant_notes(weights, torch.tensor([1]))} == {"global_scale_dtype"}
    mx = random_experts(F.MXFP8, 1, 64, 64)
    bad = mx.b_scales.view(torch.uint8).clone()
    bad[0, 0, 3] = 0xFF
    mx_weights = MarlinExpertWeights.from_kernel_args(
        b_qweight=mx.b_qweight,
        b_scales=bad.view(torch.float8_e8m0fnu),
        b_q_type=st.float8_e4m3fn,
        activation_dtype=torch.bfloat16,
        size_k=64,
        size_n=64,
    )
    assert {code for code, _ in dequant_notes(mx_weights, torch.tensor([0]))} == {"e8m0_nan_scale"}
    assert torch.isnan(mx_weights.dequantize()).any()


@pytest.mark.parametrize(("fmt", "group_size", "dtype", "act_order"), CASES)
def test_fast_decoder_is_bit_identical_to_the_general_one(fmt, group_size, dtype, act_order) -> None:
    """Raw random packed words (every byte value, scales over their whole range): the fast path must reproduce
    the general decoder bit for bit, NaN/Inf included."""
    gen = torch.Generator().manual_seed(5)
    packed = random_experts(
        fmt, 3, 256, 128, group_size=group_size, activation_dtype=dtype, act_order=act_order, generator=gen
    )
    raw = torch.randint(-(2**31), 2**31 - 1, packed.b_qweight.shape, generator=gen, dtype=torch.int32)
    scales = packed.b_scales
    if scales.element_size() == 1:  # fp8 / e8m0 scale bytes: any byte, NaN/Inf-producing ones included
        scales = torch.randint(0, 256, scales.shape, generator=gen, dtype=torch.uint8).view(scales.dtype)
    weights = MarlinExpertWeights.from_kernel_args(
        b_qweight=raw,
        b_scales=scales,
        b_q_type=fmt.scalar_type,
        activation_dtype=dtype,
        size_k=256,
        size_n=128,
        global_scale=packed.global_scale,
        b_qzeros=packed.b_qzeros,
        g_idx=packed.g_idx,
        perm=packed.perm,
        is_zp_float=packed.is_zp_float,
    )
    fast = weights.dequantize(torch.tensor([2, 0, 1]), max_chunk_elements=256 * 128 * 2)
    general = weights.dequantize_general(torch.tensor([2, 0, 1]))
    # NaN payloads may differ (e4m3 NaN bytes pass through bfloat16 on the fast path); NaN positions may not
    differs = (fast.view(torch.int32) != general.view(torch.int32)) & ~(fast.isnan() & general.isnan())
    assert not bool(differs.any()), f"{fmt.value}: fast decoder differs at {int(differs.sum())} elements"


@pytest.mark.parametrize(
    ("fmt", "group_size"),
    [
        (MarlinWeightFormat.NVFP4, None),
        (MarlinWeightFormat.MXFP8, None),
        (MarlinWeightFormat.GPTQ_INT8, 64),
        (MarlinWeightFormat.AWQ_INT4, 32),
    ],
)
def test_a_column_slice_has_the_bits_of_those_columns_of_the_whole_expert(fmt, group_size) -> None:
    packed = mf.random_experts(
        fmt, 3, 128, 256, group_size=group_size, generator=torch.Generator().manual_seed(4), with_dense=False
    )
    weights = packed.expert_weights()
    whole = weights.dequantize(torch.tensor([1]))[0]
    factors = weights.fast_scales(torch.tensor([1]))
    for first, count in ((0, 64), (64, 128), (192, 64), (0, 256)):
        part = weights.dequantize_columns(1, first, count, factors)
        assert part.shape == (128, count)
        assert torch.equal(part.view(torch.int32), whole[:, first : first + count].view(torch.int32))
    for first, count in ((32, 64), (0, 100), (192, 128), (0, 0)):
        with pytest.raises(ReferenceError_, match="64-column tiles"):
            weights.dequantize_columns(1, first, count, factors)


@pytest.mark.parametrize(
    "fmt", [MarlinWeightFormat.NVFP4, MarlinWeightFormat.MXFP4, MarlinWeightFormat.MXFP8]
)
def test_byte_scales_reordered_then_looked_up_are_the_decoded_then_reordered_ones(fmt) -> None:
    """Every byte value (0xff e8m0 NaN included), bit for bit: the table path against decoding each element."""
    packed = mf.random_experts(fmt, 2, 128, 256, generator=torch.Generator().manual_seed(9), with_dense=False)
    weights = packed.expert_weights()
    groups = weights.b_scales.shape[1]
    every_byte = torch.arange(2 * groups * 256, dtype=torch.int64) % 256
    every_byte = every_byte[torch.randperm(every_byte.numel(), generator=torch.Generator().manual_seed(1))]
    raw = every_byte.to(torch.uint8).view(2, groups, 256).view(weights.b_scales.dtype)
    weights = dataclasses.replace(weights, b_scales=raw)
    experts = torch.tensor([1, 0])
    expected = weights._order_scales(weights._decode_scales(raw.index_select(0, experts)))
    got = weights._logical_scales(experts)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
