"""reference_matmul_ogs against an independent fp64 computation written from matmul_ogs' documented semantics."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from moereplay.errors import ReferenceError_
from moereplay.reference.hopper_mxfp4 import swizzle_hopper_scales, swizzle_hopper_values
from moereplay.reference.matmul_ogs import (
    ActivationSpec,
    ExptDataSpec,
    GatherIndxSpec,
    LayoutSpec,
    PrecisionSpec,
    RoutingDataSpec,
    RowKind,
    ScatterIndxSpec,
    TensorSpec,
    dequantize_expert_weight,
    dequantize_weights,
    reference_matmul_ogs,
)

# ---------------------------------------------------------------------------------------------------------------
# independent helpers (no moereplay decoding): e2m1 from its bit fields, e8m0 as a power of two, plain loops
# ---------------------------------------------------------------------------------------------------------------


def e2m1_value(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exponent = (code >> 1) & 3
    mantissa = code & 1
    if exponent == 0:
        return sign * 0.5 * mantissa
    return sign * 2.0 ** (exponent - 1) * (1.0 + 0.5 * mantissa)


E2M1 = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float64)


class MxWeight:
    """Random MXFP4 expert weights in checkpoint form ``[E, N, K/2]`` / ``[E, N, K/32]`` and their fp64 value."""

    def __init__(self, experts: int, k: int, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.codes = torch.randint(0, 16, (experts, n, k), generator=g)
        self.scale_bytes = torch.randint(118, 126, (experts, n, k // 32), generator=g).to(torch.uint8)
        low, high = self.codes[..., 0::2], self.codes[..., 1::2]
        self.packed = (low | (high << 4)).to(torch.uint8)  # [E, N, K/2]
        exponents = self.scale_bytes.to(torch.float64) - 127.0
        factors = torch.pow(2.0, exponents).repeat_interleave(32, dim=-1)
        self.dense = (E2M1[self.codes] * factors).transpose(1, 2).contiguous()  # [E, K, N] fp64

    def strided(self) -> tuple[torch.Tensor, torch.Tensor]:
        """As matmul_ogs takes them without swizzling: uint8 ``[E, K/2, N]`` (stride 1 along K) and scales."""
        return self.packed.transpose(1, 2), self.scale_bytes.transpose(1, 2)

    def hopper(self, num_warps: int = 8) -> tuple[TensorSpec, TensorSpec]:
        """As vLLM's _swizzle_mxfp4 leaves them on Hopper (transpose, then mx_axis=1 layouts)."""
        values, scales = self.strided()
        e, kb, n = values.shape
        w = TensorSpec(
            swizzle_hopper_values(values, 1),
            LayoutSpec("HOPPER_VALUE", (e, kb, n), mx_axis=1),
            (e, 2 * kb, n),
            "fp4",
        )
        s = TensorSpec(
            swizzle_hopper_scales(scales, 1, num_warps),
            LayoutSpec("HOPPER_SCALE", tuple(scales.shape), mx_axis=1, num_warps=num_warps),
            tuple(scales.shape),
            torch.uint8,
        )
        return w, s


def make_routing(tokens: int, experts: int, top_k: int, seed: int, *, drop: tuple[tuple[int, int], ...] = ()):
    """Routing like triton_kernels' routing_torch: per-token distinct experts, flat (token, slot) order sorted by
    expert. ``drop`` marks (token, slot) pairs as invalid (expert −1): they get no sorted row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g, dtype=torch.float64) + 0.1
    weights = (weights / weights.sum(dim=1, keepdim=True)).to(torch.bfloat16)
    for t, s in drop:
        ids[t, s] = -1
    flat = ids.reshape(-1)
    key = torch.where(flat < 0, experts, flat)
    order = torch.argsort(key, stable=True)  # sorted row -> flat index
    valid = int((flat >= 0).sum())
    topk_indx = torch.where(torch.arange(order.numel()) < valid, order, -1).to(torch.int32)
    gate_indx = torch.full_like(topk_indx, -1)
    gate_indx[order[:valid]] = torch.arange(valid, dtype=torch.int32)
    hist = torch.bincount(flat[flat >= 0], minlength=experts).to(torch.int32)
    offs = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(hist, 0).to(torch.int32)])
    gate_scal = torch.where(
        torch.arange(order.numel()) < valid, weights.reshape(-1)[order], torch.zeros((), dtype=torch.bfloat16)
    )
    routing = RoutingDataSpec(gate_scal, hist, experts, top_k, ExptDataSpec(hist, offs))
    return ids, weights, routing, GatherIndxSpec(topk_indx, gate_indx), ScatterIndxSpec(gate_indx, topk_indx)


def swiglu64(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    out = torch.empty(h.shape[0] // 2, dtype=torch.float64)
    for i in range(out.numel()):
        g = min(float(h[2 * i]), limit)
        u = max(min(float(h[2 * i + 1]), limit), -limit)
        out[i] = g / (1.0 + math.exp(min(-alpha * g, 700.0))) * (u + 1.0)
    return out


def assert_close64(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item() + 1e-30
    err = (actual.to(torch.float64) - expected).abs().max().item()
    assert err <= 2e-6 * scale, f"max error {err} vs scale {scale}"


# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [64, 96, 2880])
def test_dequantize_matches_fp64_strided_and_hopper(k: int) -> None:
    weight = MxWeight(2, k, 40, seed=k)
    values, scales = weight.strided()
    w_hopper, s_hopper = weight.hopper()
    for e in range(2):
        strided = dequantize_expert_weight(values, scales, e)
        hopper = dequantize_expert_weight(w_hopper, s_hopper, e)
        assert strided.dtype == torch.float32
        assert torch.equal(strided.to(torch.float64), weight.dense[e])
        assert torch.equal(hopper.to(torch.float64), weight.dense[e])
    assert torch.equal(dequantize_weights(w_hopper, s_hopper).to(torch.float64), weight.dense)


def test_dequantize_plain_weight_and_errors() -> None:
    dense = torch.randn(3, 8, 5, dtype=torch.bfloat16)
    assert torch.equal(dequantize_expert_weight(dense, None, 2), dense[2].float())
    weight = MxWeight(1, 64, 8, seed=1)
    values, scales = weight.strided()
    with pytest.raises(ReferenceError_, match="weight_scale"):
        dequantize_expert_weight(values, None, 0)
    with pytest.raises(ReferenceError_, match="do not match"):
        dequantize_expert_weight(values, scales[:, :1], 0)


@pytest.mark.parametrize("k", [64, 160])
def test_w13_gather_bias_swiglu_matches_fp64(k: int) -> None:
    experts, tokens, top_k, n = 4, 5, 2, 2 * 24
    weight = MxWeight(experts, k, n, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(experts, n, generator=g)
    ids, _, routing, gather, _ = make_routing(tokens, experts, top_k, seed=5)
    act = ActivationSpec("swiglu", (1.702, 7.0), 2)
    w, s = weight.hopper()
    ref = reference_matmul_ogs(
        x,
        w,
        bias,
        routing,
        gather_indx=gather,
        precision_config=PrecisionSpec(weight_scale=s),
        fused_activation=act,
    )
    assert ref.output.shape == (tokens * top_k, n // 2) and ref.output.dtype == torch.float32
    assert ref.row_map.kind is RowKind.EXPERT_SORTED
    for p in range(tokens * top_k):
        flat = int(gather.src_indx[p])
        t, slot = divmod(flat, top_k)
        e = int(ids[t, slot])
        h = x[t].to(torch.float64) @ weight.dense[e] + bias[e].to(torch.float64)
        assert_close64(ref.output[p], swiglu64(h, 1.702, 7.0))
        assert (int(ref.row_map.token[p]), int(ref.row_map.slot[p]), int(ref.row_map.expert[p])) == (
            t,
            slot,
            e,
        )
    assert bool(ref.row_map.written.all())
    assert ref.gammas is None and ref.bias is not None


def test_w2_scatter_gammas_top_k_sum_matches_fp64() -> None:
    experts, tokens, top_k, k, n = 4, 6, 3, 64, 40
    weight = MxWeight(experts, k, n, seed=7)
    g = torch.Generator().manual_seed(8)
    ids, weights, routing, _, scatter = make_routing(tokens, experts, top_k, seed=9)
    x = torch.randn(tokens * top_k, k, generator=g).to(torch.bfloat16)  # expert-sorted rows
    bias = torch.randn(experts, n, generator=g)
    values, scales = weight.strided()
    ref = reference_matmul_ogs(
        x,
        values,
        bias,
        routing,
        scatter_indx=scatter,
        precision_config=PrecisionSpec(weight_scale=scales),
        gammas=routing.gate_scal,
    )
    assert ref.output.shape == (tokens, n)
    assert ref.row_map.kind is RowKind.TOKEN_SUM
    assert ref.row_map.sources is not None and ref.row_map.sources.shape == (tokens, top_k)
    for t in range(tokens):
        expected = torch.zeros(n, dtype=torch.float64)
        for slot in range(top_k):
            e = int(ids[t, slot])
            p = int(scatter.src_indx[t * top_k + slot])
            row = x[p].to(torch.float64) @ weight.dense[e] + bias[e].to(torch.float64)
            expected += float(weights[t, slot]) * row
        assert_close64(ref.output[t], expected)
    assert ref.row_map.describe(0) == "row 0 (token 0, sum over its top-k experts)"


def test_round_scratchpad_rounds_each_slot_to_the_output_dtype() -> None:
    experts, tokens, top_k, k, n = 2, 3, 2, 64, 16
    weight = MxWeight(experts, k, n, seed=10)
    _, _, routing, _, scatter = make_routing(tokens, experts, top_k, seed=11)
    x = torch.randn(tokens * top_k, k).to(torch.bfloat16)
    values, scales = weight.strided()
    args = dict(
        scatter_indx=scatter, precision_config=PrecisionSpec(weight_scale=scales), gammas=routing.gate_scal
    )
    exact = reference_matmul_ogs(x, values, None, routing, **args)
    rounded = reference_matmul_ogs(x, values, None, routing, round_scratchpad=True, **args)
    groups = scatter.src_indx.long().reshape(-1, top_k)
    expected = exact.rows.to(torch.bfloat16).to(torch.float64)[groups].sum(dim=1)
    assert torch.allclose(rounded.output.to(torch.float64), expected, rtol=0, atol=1e-6)
    assert not torch.equal(rounded.output, exact.output)


def test_fused_scatter_single_slot_routing() -> None:
    """vLLM's unfused path sets n_expts_act = 1 for gemm2: sorted row p lands in output row dst_indx[p]."""
    experts, tokens, top_k, k, n = 3, 4, 2, 64, 16
    weight = MxWeight(experts, k, n, seed=12)
    ids, weights, routing, _, scatter = make_routing(tokens, experts, top_k, seed=13)
    single = RoutingDataSpec(routing.gate_scal, routing.expt_hist, experts, 1, routing.expt_data)
    x = torch.randn(tokens * top_k, k).to(torch.bfloat16)
    values, scales = weight.strided()
    ref = reference_matmul_ogs(
        x,
        values,
        None,
        single,
        scatter_indx=scatter,
        precision_config=PrecisionSpec(weight_scale=scales),
        gammas=routing.gate_scal,
    )
    assert ref.row_map.kind is RowKind.SCATTERED
    assert ref.output.shape == (tokens * top_k, n)
    for flat in range(tokens * top_k):
        t, slot = divmod(flat, top_k)
        p = int(scatter.src_indx[flat])
        e = int(ids[t, slot])
        expected = float(weights[t, slot]) * (x[p].to(torch.float64) @ weight.dense[e])
        assert_close64(ref.output[flat], expected)
        assert int(ref.row_map.expert[flat]) == e


def test_invalid_slots_are_skipped_and_empty_groups_are_zero() -> None:
    experts, tokens, top_k, k, n = 3, 3, 2, 64, 8
    weight = MxWeight(experts, k, n, seed=14)
    drop = ((1, 0), (1, 1), (2, 1))
    _, _, routing, gather, scatter = make_routing(tokens, experts, top_k, seed=15, drop=drop)
    valid = tokens * top_k - len(drop)
    x = torch.randn(tokens, k).to(torch.bfloat16)
    values, scales = weight.strided()
    gemm1 = reference_matmul_ogs(
        x, values, None, routing, gather_indx=gather, precision_config=PrecisionSpec(weight_scale=scales)
    )
    assert gemm1.row_map.written.tolist() == [True] * valid + [False] * len(drop)
    assert torch.equal(gemm1.output[valid:], torch.zeros(len(drop), n))
    assert gemm1.row_map.describe(valid) == f"row {valid} (not written by the kernel)"
    gemm2 = reference_matmul_ogs(
        torch.randn(tokens * top_k, k).to(torch.bfloat16),
        values,
        None,
        routing,
        scatter_indx=scatter,
        precision_config=PrecisionSpec(weight_scale=scales),
        gammas=routing.gate_scal,
    )
    assert torch.equal(gemm2.output[1], torch.zeros(n))  # token 1 lost both slots
    assert bool(gemm2.output[2].abs().sum() > 0)


def test_activation_moves_after_gammas_in_the_reduction() -> None:
    """With a scatter (or split_k > 1) matmul_ogs applies the fused activation in the reduction, after gammas."""
    experts, tokens, top_k, k, n = 2, 2, 1, 64, 8
    weight = MxWeight(experts, k, n, seed=16)
    _, _, routing, gather, _ = make_routing(tokens, experts, top_k, seed=17)
    x = torch.randn(tokens, k).to(torch.bfloat16) * 4
    values, scales = weight.strided()
    act = ActivationSpec("swiglu", (1.702, 7.0), 2)
    gammas = torch.tensor([0.25, 3.0])
    common = dict(
        gather_indx=gather,
        precision_config=PrecisionSpec(weight_scale=scales),
        gammas=gammas,
        fused_activation=act,
    )
    direct = reference_matmul_ogs(x, values, None, routing, **common)
    split = reference_matmul_ogs(x, values, None, routing, split_k=2, **common)
    pre = direct.gemm.to(torch.float64)
    for p in range(tokens):
        assert_close64(direct.output[p], swiglu64(pre[p], 1.702, 7.0) * float(gammas[p]))
        assert_close64(split.output[p], swiglu64(pre[p] * float(gammas[p]), 1.702, 7.0))


def test_betas_out_alpha_and_flex_scales() -> None:
    experts, tokens, top_k, k, n = 2, 3, 1, 32, 4
    dense = torch.randn(experts, k, n, dtype=torch.float32)
    _, _, routing, gather, _ = make_routing(tokens, experts, top_k, seed=18)
    x = torch.randn(tokens, k)
    bias = torch.randn(experts, n)
    betas = torch.tensor([0.5, 2.0, -1.0])
    flex = SimpleNamespace(
        lhs_data=SimpleNamespace(scale=torch.tensor([2.0])),
        rhs_data=SimpleNamespace(scale=torch.tensor([3.0, 5.0])),
        out_data=SimpleNamespace(expected_scale=None),
    )
    precision = SimpleNamespace(
        weight_scale=None, flex_ctx=flex, out_dtype=None, act_scale=None, out_scale=None
    )
    ref = reference_matmul_ogs(
        x, dense, bias, routing, gather_indx=gather, precision_config=precision, betas=betas, out_alpha=0.5
    )
    for p in range(tokens):
        e = int(ref.sorted_expert[p])
        t = int(gather.src_indx[p])
        w_scale = 3.0 if e == 0 else 5.0
        expected = (
            (x[t].double() @ dense[e].double()) * 2.0 * w_scale + bias[e].double() * float(betas[p])
        ) * 0.5
        assert_close64(ref.output[p], expected)


def test_duck_typed_triton_like_objects() -> None:
    """Objects shaped like triton_kernels' (Tensor/Storage/Layout, RoutingData, FusedActivation) and like the
    capture codec's specs (``storage`` tensor + ``layout.kind``, dtype names) give the same result as the specs."""
    experts, tokens, top_k, k, n = 2, 3, 2, 64, 16
    weight = MxWeight(experts, k, n, seed=19)
    w, s = weight.hopper()
    _, _, routing, gather, _ = make_routing(tokens, experts, top_k, seed=20)
    x = torch.randn(tokens, k).to(torch.bfloat16)
    expected = reference_matmul_ogs(
        x,
        w,
        None,
        routing,
        gather_indx=gather,
        precision_config=PrecisionSpec(weight_scale=s),
        fused_activation=ActivationSpec("swiglu", (1.702, 7.0), 2),
    )

    def triton_layout(spec: LayoutSpec) -> SimpleNamespace:
        return SimpleNamespace(
            name=spec.name,
            initial_shape=list(spec.initial_shape),
            mx_axis=spec.mx_axis,
            num_warps=spec.num_warps,
            mma_version=spec.mma_version,
        )

    tk_w = SimpleNamespace(
        storage=SimpleNamespace(data=w.data, layout=triton_layout(w.layout)),
        shape=list(w.shape),
        dtype=SimpleNamespace(bitwidth=4),
    )
    tk_s = SimpleNamespace(
        storage=SimpleNamespace(data=s.data, layout=triton_layout(s.layout)), shape=list(s.shape)
    )
    tk_s.dtype = torch.uint8
    tk_routing = SimpleNamespace(
        gate_scal=routing.gate_scal,
        expt_hist=routing.expt_hist,
        n_expts_tot=experts,
        n_expts_act=top_k,
        expt_data=SimpleNamespace(hist=routing.expt_hist, token_offs_raw=routing.expt_data.token_offs_raw),
    )
    tk_gather = SimpleNamespace(src_indx=gather.src_indx, dst_indx=gather.dst_indx)
    tk_act = SimpleNamespace(
        specs=SimpleNamespace(name="swiglu", fn=object()), fn_args=(1.702, 7.0), reduction_n=2
    )
    tk_precision = SimpleNamespace(
        weight_scale=tk_s, flex_ctx=None, out_dtype=None, act_scale=None, out_scale=None
    )
    got = reference_matmul_ogs(
        x,
        tk_w,
        None,
        tk_routing,
        gather_indx=tk_gather,
        precision_config=tk_precision,
        fused_activation=tk_act,
    )
    assert torch.equal(got.output, expected.output)

    def codec_layout(spec: LayoutSpec) -> SimpleNamespace:
        return SimpleNamespace(
            kind=spec.name,
            initial_shape=spec.initial_shape,
            mx_axis=spec.mx_axis,
            num_warps=spec.num_warps,
            mma_version=spec.mma_version,
        )

    codec_w = SimpleNamespace(storage=w.data, layout=codec_layout(w.layout), dtype="fp4", shape=w.shape)
    codec_s = SimpleNamespace(storage=s.data, layout=codec_layout(s.layout), dtype="uint8", shape=s.shape)
    codec_act = SimpleNamespace(
        specs=SimpleNamespace(name="swiglu", fn_module="triton_kernels.swiglu", fn_name="swiglu_fn"),
        fn_args=(1.702, 7.0),
        reduction_n=2,
    )
    codec_precision = SimpleNamespace(
        weight_scale=codec_s, flex_ctx=None, out_dtype="bfloat16", act_scale=None, out_scale=None
    )
    no_epilogue = SimpleNamespace(specs=SimpleNamespace(name="dflt", fn_module=None, fn_name=None))
    got = reference_matmul_ogs(
        x,
        codec_w,
        None,
        tk_routing,
        gather_indx=tk_gather,
        precision_config=codec_precision,
        fused_activation=codec_act,
        epilogue=no_epilogue,
    )
    assert torch.equal(got.output, expected.output)


def test_dense_without_routing() -> None:
    x = torch.randn(5, 16)
    w = torch.randn(16, 3)
    ref = reference_matmul_ogs(x, w, None)
    assert ref.row_map.kind is RowKind.DENSE
    assert_close64(ref.output, x.double() @ w.double())


def test_zero_rows_give_an_empty_answer() -> None:
    # a prefill chunk can leave an expert group (or a dense call) with no rows: an empty result, not an IndexError
    ref = reference_matmul_ogs(torch.randn(0, 16), torch.randn(16, 3), None)
    assert ref.output.shape == (0, 3)


def test_bad_calls_raise_reference_errors() -> None:
    experts, tokens, top_k, k, n = 2, 3, 2, 64, 8
    weight = MxWeight(experts, k, n, seed=21)
    values, scales = weight.strided()
    _, _, routing, gather, _ = make_routing(tokens, experts, top_k, seed=22)
    precision = PrecisionSpec(weight_scale=scales)
    x = torch.randn(tokens, k).to(torch.bfloat16)
    with pytest.raises(ReferenceError_, match="columns"):
        reference_matmul_ogs(x[:, :32], values, None, routing, gather_indx=gather, precision_config=precision)
    bad_gather = GatherIndxSpec(gather.src_indx.clone().fill_(100), gather.dst_indx)
    with pytest.raises(ReferenceError_, match="gathers x rows"):
        reference_matmul_ogs(x, values, None, routing, gather_indx=bad_gather, precision_config=precision)
    with pytest.raises(ReferenceError_, match="fused activation"):
        reference_matmul_ogs(
            x,
            values,
            None,
            routing,
            gather_indx=gather,
            precision_config=precision,
            fused_activation=ActivationSpec("gelu", (), 2),
        )
    with pytest.raises(ReferenceError_, match="layout"):
        LayoutSpec("BLACKWELL_VALUE", (1, 2, 3), mx_axis=1)
    with pytest.raises(ReferenceError_, match="epilogue"):
        epilogue = SimpleNamespace(specs=SimpleNamespace(name="q", fn=object()))
        reference_matmul_ogs(
            x, values, None, routing, gather_indx=gather, precision_config=precision, epilogue=epilogue
        )
