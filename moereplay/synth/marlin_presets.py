"""Presets for vLLM 0.25.1's Marlin MoE GEMM (``moe_wna16_marlin_gemm``), built the way vLLM builds the calls.

- ``gpt-oss-20b-nvfp4-gemm1`` / ``-gemm2``: gpt-oss-20b (E=32, top_k=4, hidden = intermediate = 2880) on NVFP4
  Marlin. ``prepare_nvfp4_moe_layer_for_marlin`` pads the rank-local intermediate size for the Marlin tiles — to a
  multiple of 64 when ``hidden % 128 == 0``, else (``hidden % 64 == 0``) of 128: 2880 → 2944 — zero-padding each
  gate/up shard of w13 along N (gemm1: N = 2·2944 = 5888, K = 2880) and w2 along K (gemm2: K = 2944, N = 2880).
  gemm1 is ``fused_marlin_moe``'s first call (``top_k`` rows per token, ``mul_topk_weights=False``), gemm2 its second
  (rows pre-expanded: ``size_m = tokens·top_k``, ``top_k=1``, ``mul_topk_weights=True``); float32 routing weights
  from a renormalised softmax top-k; ``moe_block_size`` as ``fused_marlin_moe`` picks it. Expert biases are on by
  default (gpt-oss layers carry them), laid out like ``marlin_permute_bias``.
- ``marlin-nvfp4-report``: the published bug report's case — NVFP4 weights drawn as the report drew them (E=32,
  N=2880, K=2880 padded to 2944 with zero codes and scales, group 16, per-expert global scale), 32 tokens × top-4
  rows pre-expanded (gemm2 style, ``top_k=1``), ``moe_block_size=16``, routing weights from a softmax top-k **cast
  to the activation dtype (bf16) as the report did**, ``mul_topk_weights=True``.
- ``gptq-int4-marlin``, ``fp8-marlin``: a gemm1 call with GPTQ uint4b8 (group 128, optional act order; fp16) or fp8
  e4m3 weights (channel-wise scales; bf16).
- ``marlin-nvfp4-layer``: a whole fused MoE layer for the w13 layout probe — a ``fused_marlin_moe`` parent record and
  its two kernel calls, with the gated activation between them reading the gate/up halves in ``activation_layout``
  while the w13 columns are laid out in ``w13_layout`` (equal by default: a consistent backend).
"""

from __future__ import annotations

from typing import Any

import torch

from moereplay.errors import SettingsError
from moereplay.format.schema import EnumValue
from moereplay.synth.drawing import Drawer, SynthCall, to_device
from moereplay.synth.presets import BuildContext, Preset, Setting, register_preset, seeds, settings
from moereplay.synth.routing import TopK, marlin_alignment, marlin_block_size, softmax_topk

OP = "moe_wna16_marlin_gemm"
STATIC = ("b_qweight", "b_bias", "b_scales", "global_scale", "b_qzeros", "g_idx", "perm")
HOPPER_SMS = 132
"""SMs of an H100/H200 SXM: the workspace size (``sms · 4`` lock counters) of a call synthesized without a GPU."""
MOE_ACTIVATION = "vllm.model_executor.layers.fused_moe.activation.MoEActivation"
DTYPES = ("bfloat16", "float16")
LAYOUTS = ("gu_interleaved", "ug_interleaved", "gate_up", "up_gate")


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def nvfp4_marlin_intermediate(hidden: int, intermediate: int) -> int:
    """The intermediate size ``prepare_nvfp4_moe_layer_for_marlin`` pads to (see the module docstring)."""
    if hidden % 128 == 0:
        return round_up(intermediate, 64)
    if hidden % 64:
        raise SettingsError(f"hidden={hidden} is unsupported by the Marlin tiles (needs a multiple of 64)")
    return round_up(intermediate, 128)


def _workspace(device: torch.device) -> torch.Tensor:
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else HOPPER_SMS
    )
    return torch.zeros(sms * 4, dtype=torch.int32)


def marlin_args(
    *,
    x: torch.Tensor,
    weights: dict[str, torch.Tensor],
    fmt: Any,
    topk: TopK,
    topk_weights: torch.Tensor,
    block: int,
    experts: int,
    top_k: int,
    mul_topk_weights: bool,
    size_m: int,
    size_n: int,
    size_k: int,
    device: torch.device,
) -> dict[str, Any]:
    """The keyword arguments of one ``moe_wna16_marlin_gemm`` call, as ``_fused_marlin_moe`` passes them."""
    sorted_ids, expert_ids, padded = marlin_alignment(topk.ids, block, experts)
    return {
        "input": x,
        "output": torch.zeros(size_m * top_k, size_n, dtype=x.dtype),
        "b_qweight": weights["b_qweight"],
        "b_bias": weights.get("b_bias"),
        "b_scales": weights["b_scales"],
        "a_scales": None,
        "global_scale": weights.get("global_scale"),
        "b_qzeros": weights.get("b_qzeros"),
        "g_idx": weights.get("g_idx"),
        "perm": weights.get("perm"),
        "workspace": _workspace(device),
        "sorted_token_ids": sorted_ids,
        "expert_ids": expert_ids,
        "num_tokens_past_padded": padded,
        "topk_weights": topk_weights,
        "moe_block_size": block,
        "top_k": top_k,
        "mul_topk_weights": mul_topk_weights,
        "b_q_type": fmt.scalar_type.id,
        "size_m": size_m,
        "size_n": size_n,
        "size_k": size_k,
        "is_k_full": True,
        "use_atomic_add": False,
        "use_fp32_reduce": True,
        "is_zp_float": fmt.value == "uint4-float-zp",
        "thread_k": -1,
        "thread_n": -1,
        "blocks_per_sm": -1,
    }


def _run(ctx: BuildContext, args: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor]:
    on_device = to_device(args, ctx.runner.device, ctx.drawer)
    return on_device, ctx.runner.run(OP, on_device)


def _site(ctx: BuildContext, name: str) -> str:
    return f"moereplay.synth:{name}"


def _experts_params(**values: Any) -> dict[str, Any]:
    return {name: value for name, value in values.items() if value is not None}


# ---------------------------------------------------------------------------------------------------------------
# gpt-oss-20b NVFP4
# ---------------------------------------------------------------------------------------------------------------

GPT_OSS = (
    Setting("tokens", 32, "tokens in the batch"),
    Setting("experts", 32, "experts E"),
    Setting("top_k", 4, "experts per token"),
    Setting("hidden", 2880, "hidden size (gemm1 K, gemm2 N)"),
    Setting("intermediate", 2880, "intermediate size per partition before Marlin padding"),
    Setting("block_size", 0, "moe_block_size (0: as fused_marlin_moe picks it)"),
    Setting("dtype", "bfloat16", "activation dtype", DTYPES),
)


def _block(ctx: BuildContext, tokens: int, top_k: int, experts: int) -> int:
    return ctx.integer("block_size") or marlin_block_size(tokens, top_k, experts)


def build_nvfp4_gemm(ctx: BuildContext, which: str, name: str) -> list[SynthCall]:
    from moereplay.reference.marlin_formats import MarlinWeightFormat

    tokens, experts, top_k = ctx.integer("tokens"), ctx.integer("experts"), ctx.integer("top_k")
    hidden, intermediate, dtype = ctx.integer("hidden"), ctx.integer("intermediate"), ctx.text("dtype")
    padded = nvfp4_marlin_intermediate(hidden, intermediate)
    seed = seeds(ctx.integer("seed"))
    drawer = ctx.drawer
    topk = softmax_topk(tokens, experts, top_k, seed(3), renormalize=True)
    block = _block(ctx, tokens, top_k, experts)
    fmt = MarlinWeightFormat.NVFP4
    if which == "gemm1":
        weights = drawer.parts(
            "marlin_experts",
            _experts_params(
                seed=seed(1), format=fmt.value, experts=experts, size_k=hidden, size_n=2 * intermediate,
                shards=2, pad_n=padded if padded != intermediate else None, bias=ctx.bias,
                activation_dtype=dtype,
            ),
        )  # fmt: skip
        x = drawer.draw("normal", {"seed": seed(2), "shape": [tokens, hidden], "dtype": dtype, "std": 0.5})
        args = marlin_args(
            x=x, weights=weights, fmt=fmt, topk=topk, topk_weights=topk.weights, block=block, experts=experts,
            top_k=top_k, mul_topk_weights=False, size_m=tokens, size_n=2 * padded, size_k=hidden,
            device=ctx.runner.device,
        )  # fmt: skip
    else:
        weights = drawer.parts(
            "marlin_experts",
            _experts_params(
                seed=seed(4), format=fmt.value, experts=experts, size_k=intermediate, size_n=hidden,
                pad_k=padded if padded != intermediate else None, bias=ctx.bias, activation_dtype=dtype,
            ),
        )  # fmt: skip
        x = drawer.draw(
            "normal",
            {"seed": seed(5), "shape": [tokens * top_k, padded], "dtype": dtype, "std": 0.5,
             "zero_from": intermediate},
        )  # fmt: skip
        args = marlin_args(
            x=x, weights=weights, fmt=fmt, topk=topk, topk_weights=topk.weights, block=block, experts=experts,
            top_k=1, mul_topk_weights=True, size_m=tokens * top_k, size_n=hidden, size_k=padded,
            device=ctx.runner.device,
        )  # fmt: skip
    args, out = _run(ctx, args)
    context = {"layer": 0, "gemm": which, "synth": name}
    return [SynthCall(OP, args, {"output": out}, _site(ctx, name), context, static=STATIC)]


register_preset(
    Preset(
        "gpt-oss-20b-nvfp4-gemm1",
        "gpt-oss-20b NVFP4 Marlin gemm1 (w13: K=2880, N=2·2944 padded per shard, top_k rows per token)",
        OP,
        settings(*GPT_OSS),
        True,
        lambda ctx: build_nvfp4_gemm(ctx, "gemm1", "gpt-oss-20b-nvfp4-gemm1"),
    )
)
register_preset(
    Preset(
        "gpt-oss-20b-nvfp4-gemm2",
        "gpt-oss-20b NVFP4 Marlin gemm2 (w2: K=2880 padded to 2944, N=2880, rows pre-expanded, top_k=1)",
        OP,
        settings(*GPT_OSS),
        True,
        lambda ctx: build_nvfp4_gemm(ctx, "gemm2", "gpt-oss-20b-nvfp4-gemm2"),
    )
)


# ---------------------------------------------------------------------------------------------------------------
# the published report's case
# ---------------------------------------------------------------------------------------------------------------

REPORT = (
    Setting("tokens", 32, "tokens (rows = tokens · top_k, pre-expanded)"),
    Setting("experts", 32, "experts E"),
    Setting("top_k", 4, "experts per token"),
    Setting("n", 2880, "size_n (the layer's hidden size)"),
    Setting("k", 2880, "size_k before Marlin padding (the intermediate size)"),
    Setting("block_size", 16, "moe_block_size"),
    Setting(
        "weights_dtype",
        "bfloat16",
        "dtype the routing weights are cast to",
        ("bfloat16", "float16", "float32"),
    ),
    Setting("dtype", "bfloat16", "activation dtype", DTYPES),
)


def build_report(ctx: BuildContext) -> list[SynthCall]:
    from moereplay.reference.marlin_formats import MarlinWeightFormat

    tokens, experts, top_k = ctx.integer("tokens"), ctx.integer("experts"), ctx.integer("top_k")
    n, k, dtype = ctx.integer("n"), ctx.integer("k"), ctx.text("dtype")
    padded = nvfp4_marlin_intermediate(n, k)
    seed = seeds(ctx.integer("seed"))
    fmt = MarlinWeightFormat.NVFP4
    weights = ctx.drawer.parts(
        "marlin_experts",
        _experts_params(
            seed=seed(1), format=fmt.value, experts=experts, size_k=k, size_n=n, style="report",
            pad_k=padded if padded != k else None, bias=ctx.bias, activation_dtype=dtype,
        ),
    )  # fmt: skip
    topk = softmax_topk(tokens, experts, top_k, seed(2))
    x = ctx.drawer.draw(
        "normal",
        {"seed": seed(3), "shape": [tokens * top_k, padded], "dtype": dtype, "std": 0.5, "zero_from": k},
    )
    args = marlin_args(
        x=x, weights=weights, fmt=fmt, topk=topk,
        topk_weights=topk.weights.to(getattr(torch, ctx.text("weights_dtype"))),
        block=ctx.integer("block_size"), experts=experts, top_k=1, mul_topk_weights=True,
        size_m=tokens * top_k, size_n=n, size_k=padded, device=ctx.runner.device,
    )  # fmt: skip
    args, out = _run(ctx, args)
    context = {"layer": 0, "gemm": "gemm2", "synth": "marlin-nvfp4-report"}
    return [SynthCall(OP, args, {"output": out}, _site(ctx, "marlin-nvfp4-report"), context, static=STATIC)]


register_preset(
    Preset(
        "marlin-nvfp4-report",
        "the published report's Marlin NVFP4 case (gemm2-style rows, top_k=1, block 16, bf16 routing weights, "
        "mul_topk_weights=True)",
        OP,
        settings(*REPORT),
        False,
        build_report,
    )
)


# ---------------------------------------------------------------------------------------------------------------
# GPTQ int4 and fp8
# ---------------------------------------------------------------------------------------------------------------

INTEGER = (
    Setting("tokens", 16, "tokens in the batch"),
    Setting("experts", 8, "experts E"),
    Setting("top_k", 2, "experts per token"),
    Setting("hidden", 1024, "hidden size (K)"),
    Setting("intermediate", 512, "intermediate size (N = 2 · intermediate)"),
    Setting("group_size", 128, "quantisation group size (-1: channel-wise)"),
    Setting("act_order", 0, "1: GPTQ act order (g_idx / perm)"),
    Setting("block_size", 0, "moe_block_size (0: as fused_marlin_moe picks it)"),
)


def build_gemm1(ctx: BuildContext, fmt_value: str, name: str) -> list[SynthCall]:
    from moereplay.reference.marlin_formats import MarlinWeightFormat

    fmt = MarlinWeightFormat(fmt_value)
    tokens, experts, top_k = ctx.integer("tokens"), ctx.integer("experts"), ctx.integer("top_k")
    hidden, intermediate, dtype = ctx.integer("hidden"), ctx.integer("intermediate"), ctx.text("dtype")
    seed = seeds(ctx.integer("seed"))
    act_order = bool(ctx.values.get("act_order", 0))
    weights = ctx.drawer.parts(
        "marlin_experts",
        _experts_params(
            seed=seed(1), format=fmt.value, experts=experts, size_k=hidden, size_n=2 * intermediate,
            group_size=ctx.integer("group_size"), act_order=act_order or None, bias=ctx.bias,
            activation_dtype=dtype,
        ),
    )  # fmt: skip
    x = ctx.drawer.draw("normal", {"seed": seed(2), "shape": [tokens, hidden], "dtype": dtype, "std": 0.5})
    topk = softmax_topk(tokens, experts, top_k, seed(3), renormalize=True)
    args = marlin_args(
        x=x, weights=weights, fmt=fmt, topk=topk, topk_weights=topk.weights,
        block=_block(ctx, tokens, top_k, experts), experts=experts, top_k=top_k, mul_topk_weights=False,
        size_m=tokens, size_n=2 * intermediate, size_k=hidden, device=ctx.runner.device,
    )  # fmt: skip
    args, out = _run(ctx, args)
    context = {"layer": 0, "gemm": "gemm1", "synth": name}
    return [SynthCall(OP, args, {"output": out}, _site(ctx, name), context, static=STATIC)]


register_preset(
    Preset(
        "gptq-int4-marlin",
        "GPTQ uint4b8 Marlin gemm1 (group 128, fp16 activations; act_order=1 for g_idx/perm)",
        OP,
        settings(*INTEGER, Setting("dtype", "float16", "activation dtype", DTYPES)),
        False,
        lambda ctx: build_gemm1(ctx, "uint4b8", "gptq-int4-marlin"),
    )
)
register_preset(
    Preset(
        "fp8-marlin",
        "fp8 e4m3 Marlin gemm1 (channel-wise scales by default, bf16 activations)",
        OP,
        settings(
            *(s for s in INTEGER if s.name not in ("group_size", "act_order")),
            Setting("group_size", -1, "scale group size (-1: channel-wise, or 128)"),
            Setting("dtype", "bfloat16", "activation dtype", DTYPES),
        ),
        False,
        lambda ctx: build_gemm1(ctx, "fp8", "fp8-marlin"),
    )
)


# ---------------------------------------------------------------------------------------------------------------
# a fused layer for the w13 layout probe
# ---------------------------------------------------------------------------------------------------------------

LAYER = (
    Setting("tokens", 8, "tokens in the batch"),
    Setting("experts", 8, "experts E"),
    Setting("top_k", 4, "experts per token"),
    Setting("hidden", 256, "hidden size"),
    Setting("intermediate", 256, "intermediate size per partition before Marlin padding"),
    Setting("block_size", 0, "moe_block_size (0: as fused_marlin_moe picks it)"),
    Setting("dtype", "bfloat16", "activation dtype", DTYPES),
    Setting("activation", "swigluoai", "the layer's gated activation", ("swigluoai", "silu")),
    Setting("w13_layout", "gu_interleaved", "how the w13 columns are laid out", LAYOUTS),
    Setting(
        "activation_layout",
        "same",
        "the layout the activation reads ('same': w13_layout)",
        ("same", *LAYOUTS),
    ),
)


def build_layer(ctx: BuildContext) -> list[SynthCall]:
    from moereplay.reference.activation import GatedActivation, W13Layout, apply_gated_activation
    from moereplay.reference.marlin_formats import MarlinWeightFormat

    tokens, experts, top_k = ctx.integer("tokens"), ctx.integer("experts"), ctx.integer("top_k")
    hidden, intermediate, dtype = ctx.integer("hidden"), ctx.integer("intermediate"), ctx.text("dtype")
    padded = nvfp4_marlin_intermediate(hidden, intermediate)
    w13_layout = W13Layout(ctx.text("w13_layout"))
    read = ctx.text("activation_layout")
    activation_layout = w13_layout if read == "same" else W13Layout(read)
    activation = GatedActivation(ctx.text("activation"))
    seed = seeds(ctx.integer("seed"))
    drawer: Drawer = ctx.drawer
    fmt = MarlinWeightFormat.NVFP4
    device = ctx.runner.device
    w13 = drawer.parts(
        "marlin_experts",
        _experts_params(
            seed=seed(1), format=fmt.value, experts=experts, size_k=hidden, size_n=2 * intermediate, shards=2,
            pad_n=padded if padded != intermediate else None, bias=ctx.bias, activation_dtype=dtype,
            w13_layout=w13_layout.value,
        ),
    )  # fmt: skip
    w2 = drawer.parts(
        "marlin_experts",
        _experts_params(
            seed=seed(4), format=fmt.value, experts=experts, size_k=intermediate, size_n=hidden,
            pad_k=padded if padded != intermediate else None, bias=ctx.bias, activation_dtype=dtype,
        ),
    )  # fmt: skip
    x = drawer.draw("normal", {"seed": seed(2), "shape": [tokens, hidden], "dtype": dtype, "std": 0.5})
    topk = softmax_topk(tokens, experts, top_k, seed(3), renormalize=True)
    block = _block(ctx, tokens, top_k, experts)
    gemm1 = marlin_args(
        x=x, weights=w13, fmt=fmt, topk=topk, topk_weights=topk.weights, block=block, experts=experts,
        top_k=top_k, mul_topk_weights=False, size_m=tokens, size_n=2 * padded, size_k=hidden, device=device,
    )  # fmt: skip
    gemm1, out1 = _run(ctx, gemm1)
    intermediate_rows = apply_gated_activation(out1.float(), activation, activation_layout).to(out1.dtype)
    gemm2 = marlin_args(
        x=intermediate_rows.cpu(), weights=w2, fmt=fmt, topk=topk, topk_weights=topk.weights, block=block,
        experts=experts, top_k=1, mul_topk_weights=True, size_m=tokens * top_k, size_n=hidden, size_k=padded,
        device=device,
    )  # fmt: skip
    gemm2, out2 = _run(ctx, gemm2)
    final = out2.view(tokens, top_k, hidden).float().sum(dim=1).to(out2.dtype)
    parent_args = to_device(
        {
            "hidden_states": x,
            "w1": w13["b_qweight"],
            "w2": w2["b_qweight"],
            "bias1": w13.get("b_bias"),
            "bias2": w2.get("b_bias"),
            "w1_scale": w13["b_scales"],
            "w2_scale": w2["b_scales"],
            "topk_weights": topk.weights,
            "topk_ids": topk.ids,
            "quant_type_id": fmt.scalar_type.id,
            "apply_router_weight_on_input": False,
            "global_num_experts": -1,
            "activation": EnumValue(MOE_ACTIVATION, activation.name, activation.value),
            "global_scale1": w13.get("global_scale"),
            "global_scale2": w2.get("global_scale"),
            "is_k_full": True,
        },
        device,
        drawer,
    )
    truth = {"w13_layout": w13_layout.value, "activation_layout": activation_layout.value}
    context = {"layer": 0, "synth": "marlin-nvfp4-layer"}
    site = _site(ctx, "marlin-nvfp4-layer")
    return [
        SynthCall(
            "fused_marlin_moe",
            parent_args,
            {"return": final},
            site,
            {**context, "w13_layout": w13_layout.value, "synth_truth": truth},
            static=("w1", "w2", "bias1", "bias2", "w1_scale", "w2_scale", "global_scale1", "global_scale2"),
        ),
        SynthCall(
            OP,
            gemm1,
            {"output": out1},
            site,
            {**context, "gemm": "gemm1", "w13_layout": w13_layout.value},
            parent=0,
            static=STATIC,
        ),
        SynthCall(OP, gemm2, {"output": out2}, site, {**context, "gemm": "gemm2"}, parent=0, static=STATIC),
    ]


register_preset(
    Preset(
        "marlin-nvfp4-layer",
        "a fused NVFP4 Marlin MoE layer (fused_marlin_moe + gemm1 + activation + gemm2) for the w13 layout probe",
        "fused_marlin_moe",
        settings(*LAYER),
        True,
        build_layer,
    )
)
