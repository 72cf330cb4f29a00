"""The table decoder of MXFP4 experts gives the bits of the per-expert float32 dequantisation widened to float64."""

from __future__ import annotations

import pytest
import torch

from moereplay.reference import matmul_ogs, mxfp4_dense
from moereplay.reference.matmul_ogs import dequantize_expert_weight, reference_matmul_ogs
from moereplay.reference.mxfp4_dense import dense_experts_float64


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
