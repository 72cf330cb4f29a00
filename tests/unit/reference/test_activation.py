"""Gated activations on hand-worked values under every w13 layout, and the layout conversions."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from moereplay.errors import ReferenceError_
from moereplay.reference.activation import (
    SWIGLUOAI_ALPHA,
    SWIGLUOAI_LIMIT,
    GatedActivation,
    W13Layout,
    apply_gated_activation,
    convert_w13_layout,
    gelu_and_mul,
    merge_gate_up,
    silu_and_mul,
    silu_and_mul_with_clamp,
    split_gate_up,
    swigluoai_and_mul,
    swiglustep_and_mul,
    w13_permutation,
)

GATES = (1.0, -2.0, 10.0)
UPS = (2.0, 0.5, -9.0)

# the same (gate, up) pairs written out by hand in each layout
BY_LAYOUT = {
    W13Layout.GATE_UP_INTERLEAVED: [1.0, 2.0, -2.0, 0.5, 10.0, -9.0],
    W13Layout.UP_GATE_INTERLEAVED: [2.0, 1.0, 0.5, -2.0, -9.0, 10.0],
    W13Layout.GATE_UP_CONCAT: [1.0, -2.0, 10.0, 2.0, 0.5, -9.0],
    W13Layout.UP_GATE_CONCAT: [2.0, 0.5, -9.0, 1.0, -2.0, 10.0],
}


def sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def expected_swigluoai(g: float, u: float) -> float:
    g = min(g, 7.0)
    u = max(min(u, 7.0), -7.0)
    return g * sigmoid(1.702 * g) * (u + 1.0)


def test_constants() -> None:
    assert SWIGLUOAI_ALPHA == 1.702
    assert SWIGLUOAI_LIMIT == 7.0


@pytest.mark.parametrize("layout", list(W13Layout))
def test_split_matches_hand_layout(layout: W13Layout) -> None:
    x = torch.tensor(BY_LAYOUT[layout])
    gate, up = split_gate_up(x, layout)
    assert gate.tolist() == list(GATES)
    assert up.tolist() == list(UPS)
    assert torch.equal(merge_gate_up(gate, up, layout), x)


@pytest.mark.parametrize("layout", list(W13Layout))
def test_activations_hand_worked(layout: W13Layout) -> None:
    x = torch.tensor([BY_LAYOUT[layout]], dtype=torch.float64)
    silu = [g * sigmoid(g) * u for g, u in zip(GATES, UPS, strict=True)]
    assert silu_and_mul(x, layout)[0].tolist() == pytest.approx(silu, rel=1e-12)
    clamped = [
        min(g, 7.0) * sigmoid(min(g, 7.0)) * max(min(u, 7.0), -7.0) for g, u in zip(GATES, UPS, strict=True)
    ]
    assert silu_and_mul(x, layout, limit=7.0)[0].tolist() == pytest.approx(clamped, rel=1e-12)
    gelu = [0.5 * g * (1 + math.erf(g / math.sqrt(2))) * u for g, u in zip(GATES, UPS, strict=True)]
    assert gelu_and_mul(x, layout)[0].tolist() == pytest.approx(gelu, rel=1e-12)
    swiglu = [expected_swigluoai(g, u) for g, u in zip(GATES, UPS, strict=True)]
    assert swigluoai_and_mul(x, layout)[0].tolist() == pytest.approx(swiglu, rel=1e-12)
    # gate 10 → clamped to 7 (no lower clamp on the gate), up −9 → −7: 7·σ(11.914)·(−6)
    assert swigluoai_and_mul(x, layout)[0, 2].item() == pytest.approx(7 * sigmoid(1.702 * 7) * -6, rel=1e-12)
    step = [min(g * sigmoid(g), 7.0) * max(min(u, 7.0), -7.0) for g, u in zip(GATES, UPS, strict=True)]
    assert swiglustep_and_mul(x, layout)[0].tolist() == pytest.approx(step, rel=1e-12)


def test_swigluoai_hand_values() -> None:
    x = torch.tensor([1.0, 2.0, -30.0, 0.0])  # interleaved (g, u) pairs
    out = swigluoai_and_mul(x)
    assert out.dtype == torch.float32
    assert out[0].item() == pytest.approx(3 * sigmoid(1.702), rel=1e-6)
    assert out[1].item() == pytest.approx(
        -30.0 * sigmoid(-51.06), rel=1e-5
    )  # large negative gate is not clamped
    unclamped = swigluoai_and_mul(torch.tensor([10.0, 9.0]), limit=None)
    assert unclamped.item() == pytest.approx(10 * sigmoid(17.02) * 10, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [SWIGLUOAI_LIMIT, None])
def test_swigluoai_has_the_bits_of_the_plain_expression(dtype: torch.dtype, limit: float | None) -> None:
    # computed in one buffer (memory): the numbers, NaN payloads included, of the expression written out
    torch.manual_seed(3)
    x = (torch.randn(37, 2 * 96, dtype=torch.float64) * 6).to(dtype)
    flat = x.view(-1)
    flat[::97], flat[5::131], flat[7::151] = float("nan"), float("inf"), float("-inf")
    for layout in W13Layout:
        gate, up = split_gate_up(x if dtype == torch.float64 else x.float(), layout)
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        plain = gate * torch.sigmoid(SWIGLUOAI_ALPHA * gate) * (up + 1.0)
        out = swigluoai_and_mul(x, layout, limit=limit)
        bits = torch.int64 if plain.dtype == torch.float64 else torch.int32
        assert out.dtype == plain.dtype and torch.equal(out.view(bits), plain.view(bits)), layout


def test_clamped_silu_generalises_swigluoai() -> None:
    x = torch.randn(4, 10, dtype=torch.float64) * 6
    concat = convert_w13_layout(x, W13Layout.GATE_UP_INTERLEAVED, W13Layout.GATE_UP_CONCAT)
    assert torch.allclose(silu_and_mul_with_clamp(concat, 7.0, 1.702, 1.0), swigluoai_and_mul(x), rtol=1e-14)
    via_enum = apply_gated_activation(
        concat, GatedActivation.SWIGLUOAI_UNINTERLEAVE, limit=7.0, alpha=1.702, beta=1.0
    )
    assert torch.allclose(via_enum, swigluoai_and_mul(x), rtol=1e-14)
    with pytest.raises(ReferenceError_, match="limit"):
        apply_gated_activation(concat, GatedActivation.SWIGLUOAI_UNINTERLEAVE)


def test_dispatch_uses_vllm_default_layouts() -> None:
    x = torch.randn(3, 8)
    assert GatedActivation.SWIGLUOAI.default_layout is W13Layout.GATE_UP_INTERLEAVED
    assert torch.equal(apply_gated_activation(x, GatedActivation.SWIGLUOAI), swigluoai_and_mul(x))
    assert torch.equal(apply_gated_activation(x, GatedActivation.SILU), silu_and_mul(x))
    assert torch.equal(apply_gated_activation(x, GatedActivation.GELU), gelu_and_mul(x))
    assert torch.equal(
        apply_gated_activation(x, GatedActivation.GELU_TANH), gelu_and_mul(x, approximate="tanh")
    )
    assert torch.equal(apply_gated_activation(x, GatedActivation.SWIGLUSTEP), swiglustep_and_mul(x))


@pytest.mark.parametrize(("source", "target"), list(itertools.product(W13Layout, W13Layout)))
def test_conversions(source: W13Layout, target: W13Layout) -> None:
    x = torch.tensor(BY_LAYOUT[source])
    converted = convert_w13_layout(x, source, target)
    assert converted.tolist() == BY_LAYOUT[target]
    perm = w13_permutation(6, source, target)
    assert torch.equal(x.index_select(0, perm), converted)
    # activations agree once the data follows the layout
    assert torch.allclose(swigluoai_and_mul(x, source), swigluoai_and_mul(converted, target))


def test_convert_weights_along_an_inner_axis() -> None:
    """w13 weights [E, 2I, K] convert along dim 1, biases [E, 2I] along the last dim, consistently."""
    w = torch.randn(2, 8, 3)
    bias = torch.randn(2, 8)
    x = torch.randn(5, 3)
    out_interleaved = torch.einsum("tk,enk->etn", x, w) + bias[:, None, :]
    w_concat = convert_w13_layout(w, W13Layout.GATE_UP_INTERLEAVED, W13Layout.UP_GATE_CONCAT, dim=1)
    b_concat = convert_w13_layout(bias, W13Layout.GATE_UP_INTERLEAVED, W13Layout.UP_GATE_CONCAT)
    out_concat = torch.einsum("tk,enk->etn", x, w_concat) + b_concat[:, None, :]
    assert torch.allclose(
        swigluoai_and_mul(out_interleaved), swigluoai_and_mul(out_concat, W13Layout.UP_GATE_CONCAT), atol=1e-5
    )


def test_odd_sizes_and_bad_dims_raise() -> None:
    with pytest.raises(ReferenceError_, match="even"):
        silu_and_mul(torch.ones(3, 5))
    with pytest.raises(ReferenceError_, match="out of range"):
        split_gate_up(torch.ones(4), W13Layout.GATE_UP_CONCAT, dim=2)
    with pytest.raises(ReferenceError_, match="differ"):
        merge_gate_up(torch.ones(2), torch.ones(3), W13Layout.GATE_UP_CONCAT)


def test_nan_propagates() -> None:
    x = torch.tensor([float("nan"), 1.0, 1.0, float("nan")])
    assert torch.isnan(swigluoai_and_mul(x)).all()
