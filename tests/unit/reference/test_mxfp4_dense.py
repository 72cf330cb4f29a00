"""The table decoder of MXFP4 experts gives the bits of the per-expert float32 dequantisation widened to float64."""

from __future__ import annotations

import pytest
import torch

from moereplay.reference import matmul_ogs, mxfp4_dense
from moereplay.reference.matmul_ogs import dequantize_expert_weight, reference_matmul_ogs
from moereplay.reference.mxfp4_dense import dense_experts_float64, packed_columns


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int64)


def _weights(experts: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ``[E, K/2, N]`` (a transposed view, as unswizzled storage is) and scales ``[E, ceil(K/32), N]``
    covering every scale byte: 0 (subnormal products), 254 (products overflow to ±Inf), 255 (NaN)."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (experts, n, k // 2), generator=gen, dtype=torch.uint8).transpose(1, 2)
    scales = torch.randint(0, 256, (experts, n, -(-k // 32)), generator=gen, dtype=torch.uint8).transpose(
        1, 2
    )
    scales[0, 0, :4] = torch.tensor([0, 254, 255, 127], dtype=torch.uint8)
    return packed, scales


@pytest.mark.parametrize("k", [64, 48, 2, 96])
@pytest.mark.parametrize("slice_elements", [1, 1 << 21])
def test_bits_equal_the_float32_dequantisation_widened(
    k: int, slice_elements: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(mxfp4_dense.SLICE_ELEMENTS, "cpu", slice_elements)
    packed, scales = _weights(3, k, 40, seed=k)
    dense = dense_experts_float64(packed, scales, k)
    assert dense.shape == (3, k, 40) and dense.dtype == torch.float64
    for expert in range(3):
        expected = dequantize_expert_weight(packed, scales, expert).to(torch.float64)
        assert torch.equal(_bits(dense[expert]), _bits(expected)), f"expert {expert}"
    values = dense[0, : min(k, 32), :4]  # scale group 0
    assert torch.isnan(values[:, 2]).all() and torch.isinf(values[:, 1]).any() and (values[:, 0] != 0).any()


def test_writes_into_a_given_buffer_and_refuses_mismatched_scales() -> None:
    packed, scales = _weights(2, 64, 8, seed=1)
    buffer = torch.full((2, 64, 8), float("nan"), dtype=torch.float64)
    assert dense_experts_float64(packed, scales, 64, out=buffer) is buffer
    assert torch.equal(_bits(buffer), _bits(dense_experts_float64(packed, scales, 64)))
    with pytest.raises(ValueError, match="cannot decode"):
        dense_experts_float64(packed, scales[:, :1], 64)


@pytest.mark.parametrize("most", [1, 2, 1 << 30])
def test_ogs_gemm_is_a_per_expert_loop_bit_for_bit(most: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of 1, 2 or all experts; odd N puts the rows' views at offsets a fresh tensor never has."""
    experts, tokens, top_k, k, n = 5, 7, 2, 96, 13
    packed, scales = _weights(experts, k, n, seed=5)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(tokens * top_k, k, generator=gen).to(torch.bfloat16)
    hist = torch.tensor([3, 0, 5, 4, 2], dtype=torch.int32)
    routing = matmul_ogs.RoutingDataSpec(None, hist, experts, 1)
    monkeypatch.setitem(matmul_ogs.DENSE_ELEMENTS_AT_ONCE, "cpu", most * k * n)
    result = reference_matmul_ogs(x, packed, None, routing, precision_config=matmul_ogs.PrecisionSpec(scales))
    start = 0
    for expert, count in enumerate(hist.tolist()):
        if count:
            weight = dequantize_expert_weight(packed, scales, expert).to(torch.float64)
            expected = (x[start : start + count].to(torch.float64) @ weight).to(torch.float32)
            assert torch.equal(_bits(result.gemm[start : start + count].double()), _bits(expected.double()))
        start += count


# exact products: a slice of columns at a time, the bits of the whole dense product


def _narrow(experts: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed bytes (a transposed view) and scales of a few neighbouring exponents: products that are exact."""
    packed, scales = _weights(experts, k, n, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    return packed, torch.randint(120, 127, tuple(scales.shape), generator=gen, dtype=torch.uint8)


def _dense_product(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    return x @ dense_experts_float64(packed[None], scales[None], k)[0]


def _rows(count: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(count, k, generator=gen).to(torch.bfloat16).to(torch.float64)


@pytest.mark.parametrize(
    ("k", "n", "chunk", "align"), [(96, 40, 1 << 19, 1), (80, 37, 200, 1), (64, 48, 64, 16)]
)
def test_exact_product_has_the_bits_of_the_dense_one(
    k: int, n: int, chunk: int, align: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole or in slices of columns (``chunk`` elements; K not a multiple of 32 included)."""
    monkeypatch.setattr(mxfp4_dense, "EXACT_CHUNK_ELEMENTS", chunk)
    packed, scales = _narrow(1, k, n, seed=k + n)
    x = _rows(5, k, seed=n)
    out = torch.full((5, n), float("nan"), dtype=torch.float64)
    assert mxfp4_dense.exact_matmul_into(out, x, packed_columns(packed[0]), scales[0], k, align=align)
    assert torch.equal(_bits(out), _bits(_dense_product(x, packed[0], scales[0], k)))


@pytest.mark.parametrize(
    "case", ["nan-row", "inf-scale", "nan-scale", "zero-rows", "wide-range", "zero-weights", "sum-of-zeros"]
)
def test_exact_product_declines_what_could_round_or_has_a_kernel_sign(case: str) -> None:
    k, n = 64, 24
    packed, scales = _narrow(1, k, n, seed=3)
    packed, scales = packed[0].clone(), scales[0].clone()
    x = _rows(3, k, seed=4)
    if case == "nan-row":
        x[1, 5] = float("nan")
    elif case == "inf-scale":
        scales[0, 3] = 254  # 6 × 2**127 overflows float32
    elif case == "nan-scale":
        scales[1, 0] = 255
    elif case == "zero-rows":
        x.zero_()
    elif case == "wide-range":
        x[0, 0], x[0, 1] = 2.0**60, 2.0**-60
    elif case == "zero-weights":
        packed.zero_()
    else:  # a sum of zeros only: row 2's one nonzero entry (K index 6) meets a zero weight in column 0
        x[2] = 0
        x[2, 6] = 1.5
        packed[3, 0] = 0x80  # K 6 of column 0 (low nibble of byte 3) is +0, K 7 is -0
    out = torch.empty((3, n), dtype=torch.float64)
    assert not mxfp4_dense.exact_matmul_into(out, x, packed_columns(packed), scales, k)


def test_exact_sums_of_cancelling_products_are_positive_zeros() -> None:
    k, n = 64, 8
    packed = torch.full((k // 2, n), 0x22, dtype=torch.uint8)  # every weight 1.0 (code 2) at scale 127
    scales = torch.full((k // 32, n), 127, dtype=torch.uint8)
    x = torch.zeros(1, k, dtype=torch.float64)
    x[0, 0], x[0, 1] = 3.0, -3.0
    out = torch.empty((1, n), dtype=torch.float64)
    assert mxfp4_dense.exact_matmul_into(out, x, packed_columns(packed), scales, k)
    assert torch.equal(_bits(out), _bits(torch.zeros(1, n, dtype=torch.float64)))


def _hopper_call(experts: int, k: int, n: int, scale_range: tuple[int, int], seed: int) -> dict:
    from moereplay.reference.hopper_mxfp4 import swizzle_hopper_scales, swizzle_hopper_values

    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 256, (experts, n, k // 2), generator=gen, dtype=torch.uint8).transpose(1, 2)
    scales = torch.randint(*scale_range, (experts, n, k // 32), generator=gen, dtype=torch.uint8).transpose(
        1, 2
    )
    w = matmul_ogs.TensorSpec(
        swizzle_hopper_values(values, 1), matmul_ogs.LayoutSpec("HOPPER_VALUE", tuple(values.shape), mx_axis=1),
        (experts, k, n), "fp4",
    )  # fmt: skip
    s = matmul_ogs.TensorSpec(
        swizzle_hopper_scales(scales, 1, 8),
        matmul_ogs.LayoutSpec("HOPPER_SCALE", tuple(scales.shape), mx_axis=1, num_warps=8),
        tuple(scales.shape), torch.uint8,
    )  # fmt: skip
    return {"values": values, "scales": scales, "w": w, "precision": matmul_ogs.PrecisionSpec(s)}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("scale_range", [(119, 127), (0, 256)])
def test_ogs_gemm_of_hopper_weights_is_a_per_expert_loop_bit_for_bit(
    threads: int, scale_range: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exact products (narrow scales), unswizzled a 16-column block at a time, spread over threads; and experts
    whose products could round (every scale byte), decoded whole: the bits of the per-expert dense loop. N=88
    is not a multiple of 16 (the last block is cropped), K=96 not a multiple of 64 (padded)."""
    monkeypatch.setattr(mxfp4_dense, "EXACT_CHUNK_ELEMENTS", 96 * 32)
    experts, tokens, k, n = 4, 6, 96, 88
    call = _hopper_call(experts, k, n, scale_range, seed=7)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(tokens * 2, k, generator=gen).to(torch.bfloat16)
    hist = torch.tensor([3, 0, 5, 4], dtype=torch.int32)
    routing = matmul_ogs.RoutingDataSpec(None, hist, experts, 1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        result = reference_matmul_ogs(x, call["w"], None, routing, precision_config=call["precision"])
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    start = 0
    for expert, count in enumerate(hist.tolist()):
        if count:
            weight = dequantize_expert_weight(call["values"], call["scales"], expert).to(torch.float64)
            expected = (x[start : start + count].to(torch.float64) @ weight).to(torch.float32)
            assert torch.equal(_bits(result.gemm[start : start + count].double()), _bits(expected.double()))
        start += count


def test_overlapping_expert_ranges_keep_the_later_range() -> None:
    """Ranges that share rows are multiplied in order, each then scaled: the later range's rows win."""
    experts, k, n = 2, 64, 32
    call = _hopper_call(experts, k, n, (120, 126), seed=9)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    hist = torch.tensor([3, 2], dtype=torch.int32)
    offsets = torch.tensor([0, 1, 3], dtype=torch.int32)  # expert 1's rows 1-2 overlap expert 0's rows 0-2
    routing = matmul_ogs.RoutingDataSpec(None, hist, experts, 1, matmul_ogs.ExptDataSpec(hist, offsets))
    result = reference_matmul_ogs(x, call["w"], None, routing, precision_config=call["precision"])
    dense = [dequantize_expert_weight(call["values"], call["scales"], e).to(torch.float64) for e in range(2)]
    x64 = x.to(torch.float64)
    assert torch.equal(_bits(result.gemm[0:1].double()), _bits((x64[0:1] @ dense[0]).float().double()))
    assert torch.equal(_bits(result.gemm[1:3].double()), _bits((x64[1:3] @ dense[1]).float().double()))
