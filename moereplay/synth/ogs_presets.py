"""Presets for triton_kernels ``matmul_ogs`` as vLLM 0.25.1 calls it for gpt-oss MXFP4 on Hopper.

- weights: checkpoint-form MXFP4 (``[E, N, K/2]`` e2m1 bytes, ``[E, N, K/32]`` e8m0 scales 2^-6 … 2^-1) swizzled as
  ``_swizzle_mxfp4`` leaves them on sm_90 (``HOPPER_VALUE`` mx_axis 1, ``HOPPER_SCALE`` mx_axis 1, num_warps 8), fp32
  expert biases; the Triton backend pads nothing for gpt-oss (``round_up(2880, 64) = 2880``), so K = 2880 for both
  GEMMs and the swizzled scale rows are shorter than the Hopper kernel's K loop reads (see ``ops.matmul_ogs``);
- routing: a renormalised softmax top-k, turned into ``RoutingData`` / ``GatherIndx`` / ``ScatterIndx`` the way
  ``make_routing_data`` → ``routing_from_bitmatrix`` does (weights in bf16);
- the two calls of ``triton_kernel_fused_experts``: ``gpt-oss-20b-mxfp4-w13`` (gather, w13 bias, fused
  ``swiglu(1.702, 7.0)`` with ``reduction_n=2``, y ``[1, tokens·top_k, intermediate]``) and ``-w2`` (scatter with a
  grouped top-k sum, w2 bias, ``gammas`` = the routing weights, y ``[1, tokens, hidden]``); the opt_flags constraint
  vLLM pins on Hopper (``split_k=1``) is recorded like the capture plugin records it;
- ``gpt-oss-20b-mxfp4-layer``: both calls under a ``triton_kernel_fused_experts`` parent record, w13's columns laid
  out in ``w13_layout`` (gpt-oss checkpoints: ``[g, u]`` interleaved, which the fused swiglu reads).
"""

from __future__ import annotations

from typing import Any

import torch

from moereplay.format.schema import EnumValue
from moereplay.synth.drawing import SynthCall, to_device
from moereplay.synth.presets import BuildContext, Preset, Setting, register_preset, seeds, settings
from moereplay.synth.routing import TopK, ogs_routing, softmax_topk

OP = "matmul_ogs"
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
STATIC = ("w", "bias", "precision_config")
MOE_ACTIVATION = "vllm.model_executor.layers.fused_moe.activation.MoEActivation"
LAYOUTS = ("gu_interleaved", "ug_interleaved", "gate_up", "up_gate")


def swiglu() -> Any:
    from moereplay.ops.ogs_codecs import ActivationSpec, FnSpec

    spec = FnSpec("swiglu", "triton_kernels.swiglu_details._swiglu", "_swiglu_fn", ("alpha", "limit"))
    return ActivationSpec(spec, (SWIGLU_ALPHA, SWIGLU_LIMIT), 2)


def mxfp4_weight(
    ctx: BuildContext, seed: int, experts: int, k: int, n: int, layout: str | None
) -> tuple[Any, Any]:
    """(w, weight scale) as Hopper-swizzled :class:`LayoutTensor` specs over recipe-drawn storages."""
    from moereplay.ops.ogs_codecs import LayoutSpec, LayoutTensor

    params: dict[str, Any] = {"seed": seed, "experts": experts, "k": k, "n": n, "num_warps": 8}
    if layout is not None:
        params["w13_layout"] = layout
    values = ctx.drawer.draw("hopper_mxfp4", params, "values")
    scales = ctx.drawer.draw("hopper_mxfp4", params, "scales")
    value_shape = (experts, k // 2, n)
    scale_shape = (experts, k // 32, n)
    w = LayoutTensor(
        values, LayoutSpec("HOPPER_VALUE", value_shape, mx_axis=1, mma_version=3), "fp4", (experts, k, n),
        (experts, k, n),
    )  # fmt: skip
    scale = LayoutTensor(
        scales,
        LayoutSpec("HOPPER_SCALE", scale_shape, mx_axis=1, num_warps=8),
        "uint8",
        scale_shape,
        scale_shape,
    )
    return w, scale


def _constraints() -> dict[str, Any]:
    from moereplay.ops.matmul_ogs import CONSTRAINT_ARGS

    state: dict[str, Any] = {name: None for name in CONSTRAINT_ARGS}
    state["split_k"] = 1
    state["num_warps"] = None
    return state


def w13_args(ctx: BuildContext, topk: TopK, layout: str | None) -> dict[str, Any]:
    from moereplay.ops.ogs_codecs import PrecisionSpec

    tokens, experts = ctx.integer("tokens"), ctx.integer("experts")
    hidden, intermediate = ctx.integer("hidden"), ctx.integer("intermediate")
    seed = seeds(ctx.integer("seed"))
    w, scale = mxfp4_weight(ctx, seed(1), experts, hidden, 2 * intermediate, layout)
    bias = None
    if ctx.bias:
        bias_params: dict[str, Any] = {"seed": seed(6), "shape": [experts, 2 * intermediate], "std": 0.1}
        bias = ctx.drawer.draw("normal", bias_params)
    routing, gather, _ = ogs_routing(topk, experts)
    x = ctx.drawer.draw(
        "normal", {"seed": seed(2), "shape": [tokens, hidden], "dtype": "bfloat16", "std": 0.5}
    )
    return {
        "x": x,
        "w": w,
        "bias": bias,
        "routing_data": routing,
        "gather_indx": gather,
        "scatter_indx": None,
        "precision_config": PrecisionSpec(weight_scale=scale),
        "betas": None,
        "gammas": None,
        "out_alpha": None,
        "y": torch.zeros(1, tokens * topk.top_k, intermediate, dtype=torch.bfloat16),
        "fused_activation": swiglu(),
        "epilogue": None,
        **_constraints(),
    }


def w2_args(ctx: BuildContext, topk: TopK, x: torch.Tensor | None) -> dict[str, Any]:
    from moereplay.ops.ogs_codecs import PrecisionSpec

    tokens, experts, top_k = ctx.integer("tokens"), ctx.integer("experts"), topk.top_k
    hidden, intermediate = ctx.integer("hidden"), ctx.integer("intermediate")
    seed = seeds(ctx.integer("seed"))
    w, scale = mxfp4_weight(ctx, seed(4), experts, intermediate, hidden, None)
    bias = None
    if ctx.bias:
        bias = ctx.drawer.draw("normal", {"seed": seed(7), "shape": [experts, hidden], "std": 0.1})
    routing, _, scatter = ogs_routing(topk, experts)
    if x is None:
        x = ctx.drawer.draw(
            "normal",
            {"seed": seed(5), "shape": [tokens * top_k, intermediate], "dtype": "bfloat16", "std": 0.5},
        )
    return {
        "x": x,
        "w": w,
        "bias": bias,
        "routing_data": routing,
        "gather_indx": None,
        "scatter_indx": scatter,
        "precision_config": PrecisionSpec(weight_scale=scale),
        "betas": None,
        "gammas": routing.gate_scal,  # type: ignore[attr-defined]
        "out_alpha": None,
        "y": torch.zeros(1, tokens, hidden, dtype=torch.bfloat16),
        "fused_activation": None,
        "epilogue": None,
        **_constraints(),
    }


def _outputs(args: dict[str, Any], out: torch.Tensor) -> dict[str, Any]:
    """What the capture plugin records after a ``matmul_ogs`` call: the returned ``[rows, cols]`` tensor and ``y``
    (a view of the same storage)."""
    return {"return": out, "y": out.view(args["y"].shape)}


def _run(ctx: BuildContext, args: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor]:
    on_device = to_device(args, ctx.runner.device, ctx.drawer)
    return on_device, ctx.runner.run(OP, on_device)


GPT_OSS = (
    Setting("tokens", 64, "tokens in the batch"),
    Setting("experts", 32, "experts E"),
    Setting("top_k", 4, "experts per token"),
    Setting("hidden", 2880, "hidden size (w13 K, w2 N)"),
    Setting("intermediate", 2880, "intermediate size (w13 N = 2·intermediate, w2 K)"),
)


def _topk(ctx: BuildContext) -> TopK:
    seed = seeds(ctx.integer("seed"))
    return softmax_topk(
        ctx.integer("tokens"), ctx.integer("experts"), ctx.integer("top_k"), seed(3), renormalize=True
    )


def build_w13(ctx: BuildContext) -> list[SynthCall]:
    args, out = _run(ctx, w13_args(ctx, _topk(ctx), None))
    context = {"layer": 0, "gemm": "w13", "synth": "gpt-oss-20b-mxfp4-w13"}
    return [
        SynthCall(
            OP, args, _outputs(args, out), "moereplay.synth:gpt-oss-20b-mxfp4-w13", context, static=STATIC
        )
    ]


def build_w2(ctx: BuildContext) -> list[SynthCall]:
    args, out = _run(ctx, w2_args(ctx, _topk(ctx), None))
    context = {"layer": 0, "gemm": "w2", "synth": "gpt-oss-20b-mxfp4-w2"}
    return [
        SynthCall(
            OP, args, _outputs(args, out), "moereplay.synth:gpt-oss-20b-mxfp4-w2", context, static=STATIC
        )
    ]


def build_layer(ctx: BuildContext) -> list[SynthCall]:
    layout = ctx.text("w13_layout")
    topk = _topk(ctx)
    tokens, hidden = ctx.integer("tokens"), ctx.integer("hidden")
    first, out1 = _run(ctx, w13_args(ctx, topk, layout))
    intermediate_rows = out1.reshape(tokens * topk.top_k, -1).cpu()
    second, out2 = _run(ctx, w2_args(ctx, topk, intermediate_rows))
    parent = to_device(
        {
            "hidden_states": first["x"],
            "w1": first["w"],
            "w2": second["w"],
            "routing_data": first["routing_data"],
            "gather_indx": first["gather_indx"],
            "scatter_indx": second["scatter_indx"],
            "topk": topk.top_k,
            "activation": EnumValue(MOE_ACTIVATION, "SWIGLUOAI", "swigluoai"),
            "swiglu_alpha": SWIGLU_ALPHA,
            "swiglu_limit": SWIGLU_LIMIT,
            "apply_router_weight_on_input": False,
        },
        ctx.runner.device,
        ctx.drawer,
    )
    site = "moereplay.synth:gpt-oss-20b-mxfp4-layer"
    context = {"layer": 0, "synth": "gpt-oss-20b-mxfp4-layer"}
    truth = {"w13_layout": layout, "activation_layout": "gu_interleaved"}
    return [
        SynthCall(
            "triton_kernel_fused_experts",
            parent,
            {"return": out2.reshape(tokens, hidden)},
            site,
            {**context, "w13_layout": layout, "synth_truth": truth},
            static=("w1", "w2"),
        ),
        SynthCall(
            OP,
            first,
            _outputs(first, out1),
            site,
            {**context, "gemm": "w13", "w13_layout": layout},
            parent=0,
            static=STATIC,
        ),
        SynthCall(
            OP, second, _outputs(second, out2), site, {**context, "gemm": "w2"}, parent=0, static=STATIC
        ),
    ]


register_preset(
    Preset(
        "gpt-oss-20b-mxfp4-w13",
        "gpt-oss-20b MXFP4 matmul_ogs w13 on Hopper (gather, fp32 bias, fused swiglu; K=2880, N=5760)",
        OP,
        settings(*GPT_OSS),
        True,
        build_w13,
    )
)
register_preset(
    Preset(
        "gpt-oss-20b-mxfp4-w2",
        "gpt-oss-20b MXFP4 matmul_ogs w2 on Hopper (scatter + top-k sum, fp32 bias, gammas; K=2880, N=2880)",
        OP,
        settings(*GPT_OSS),
        True,
        build_w2,
    )
)
register_preset(
    Preset(
        "gpt-oss-20b-mxfp4-layer",
        "a gpt-oss MXFP4 MoE layer (triton_kernel_fused_experts + w13 + w2) for the w13 layout probe",
        "triton_kernel_fused_experts",
        settings(
            Setting("tokens", 8, "tokens in the batch"),
            Setting("experts", 8, "experts E"),
            Setting("top_k", 4, "experts per token"),
            Setting("hidden", 256, "hidden size"),
            Setting("intermediate", 256, "intermediate size"),
            Setting("w13_layout", "gu_interleaved", "how the w13 rows are laid out", LAYOUTS),
        ),
        True,
        build_layer,
    )
)
