"""Presets for vLLM 0.25.1's Triton fused MoE (``fused_moe_kernel``, ``fused_moe_kernel_gptq_awq``), built the way
``fused_experts_impl`` builds its first launch (gemm1: ``A`` = the tokens, ``top_k`` rows per token,
``mul_routed_weight = apply_router_weight_on_input = False``; ``C`` = ``[M, top_k, N]``).

- ``qwen3-30b-a3b-bf16-w13``: Qwen3-30B-A3B (hidden 2048, moe_intermediate 768 → N = 2·768, 128 experts,
  top-8, renormalised softmax) in bf16;
- ``qwen3-30b-a3b-int4-w13``: the same layer GPTQ/AWQ int4 weight-only (group 128, optional zero points) through
  ``fused_moe_kernel_gptq_awq`` (``block_shape = [0, 128]``);
- ``deepseek-v3-fp8-w13``: DeepSeek-V3 (hidden 7168, moe_intermediate 2048 → N = 4096, 256 routed experts, top-8)
  fp8 w8a8 with 128×128 weight blocks and per-token-group activation scales (``block_shape = [128, 128]``), on
  one rank of 8-way expert parallelism: 32 local experts, an ``expert_map``, blocks only for local experts (rows
  routed to other ranks are not written).

The config is ``get_default_config``'s shape of answer (``BLOCK_SIZE_M/N/K``, ``GROUP_SIZE_M``, ``SPLIT_K = 1``,
``num_warps``, ``num_stages``), overridable with ``--set`` (but ``SPLIT_K``: both kernels declare it, neither uses
it). Activations of the w8a8 preset are quantised as ``moe_kernel_quantize_input`` does per token group
(``amax / 448`` per 128 columns).
"""

from __future__ import annotations

from typing import Any

import torch

from moereplay.errors import SettingsError
from moereplay.ops.fused_moe_triton_surface import CONFIG_DEFAULTS
from moereplay.synth.drawing import SynthCall, to_device
from moereplay.synth.presets import BuildContext, Preset, Setting, register_preset, seeds, settings
from moereplay.synth.routing import softmax_topk

TRITON_OP = "fused_moe_kernel"
GPTQ_OP = "fused_moe_kernel_gptq_awq"
TRITON_STATIC = ("B", "B_scale", "B_bias")
GPTQ_STATIC = ("B", "B_scale", "B_zp")
DTYPES = ("bfloat16", "float16")


def _config(ctx: BuildContext) -> dict[str, int]:
    """The config dict as vLLM's ``get_default_config`` shapes it — ``SPLIT_K`` included, which the wna16
    launcher passes on to the kernel as it is (:data:`~moereplay.ops.fused_moe_triton_surface.CONFIG_DEFAULTS`)."""
    return {
        "BLOCK_SIZE_M": ctx.integer("block_m"),
        "BLOCK_SIZE_N": ctx.integer("block_n"),
        "BLOCK_SIZE_K": ctx.integer("block_k"),
        "GROUP_SIZE_M": ctx.integer("group_m"),
        **CONFIG_DEFAULTS,
        "num_warps": ctx.integer("num_warps"),
        "num_stages": ctx.integer("num_stages"),
    }


CONFIG = (
    Setting("block_m", 16, "BLOCK_SIZE_M"),
    Setting("block_n", 64, "BLOCK_SIZE_N"),
    Setting("block_k", 128, "BLOCK_SIZE_K"),
    Setting("group_m", 1, "GROUP_SIZE_M"),
    Setting("num_warps", 4, "num_warps"),
    Setting("num_stages", 3, "num_stages"),
)


def alignment(
    topk_ids: torch.Tensor, block: int, experts: int, expert_map: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's ``moe_align_block_size(topk_ids, block, global experts, expert_map, ignore_invalid_experts=True)``."""
    from moereplay.reference.moe_align import moe_align_block_size

    return moe_align_block_size(topk_ids, block, experts, expert_map)


def quantize_fp8_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token group fp8 e4m3 quantisation: ``(codes [M, K], scales float32 [M, cdiv(K, group)])``."""
    rows, k = x.shape
    if k % group:
        raise SettingsError(f"K={k} is not a multiple of the activation group {group}")
    grouped = x.float().view(rows, k // group, group)
    scales = (grouped.abs().amax(dim=2) / 448.0).clamp(min=1e-10)
    codes = (grouped / scales[:, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes.view(rows, k), scales.contiguous()


def triton_args(
    *,
    A: torch.Tensor,
    weights: dict[str, torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: int,
    config: dict[str, int],
    compute: str,
    A_scale: torch.Tensor | None = None,
    use_fp8_w8a8: bool = False,
    use_int8_w8a16: bool = False,
    per_channel_quant: bool = False,
    block_shape: list[int] | None = None,
    expert_map: torch.Tensor | None = None,
    mul_routed_weight: bool = False,
) -> dict[str, Any]:
    """The keyword arguments of one ``invoke_fused_moe_triton_kernel`` call, as ``fused_experts_impl`` passes them."""
    top_k = int(topk_ids.shape[1])
    sorted_ids, expert_ids, padded = alignment(topk_ids, config["BLOCK_SIZE_M"], experts, expert_map)
    n = int(weights["B"].shape[1])
    return {
        "A": A,
        "B": weights["B"],
        "C": torch.zeros(A.shape[0], top_k, n, dtype=getattr(torch, compute)),
        "A_scale": A_scale,
        "B_scale": weights.get("B_scale"),
        "topk_weights": topk_weights,
        "sorted_token_ids": sorted_ids,
        "expert_ids": expert_ids,
        "num_tokens_post_padded": padded,
        "mul_routed_weight": mul_routed_weight,
        "top_k": top_k,
        "config": dict(config),
        "compute_type": compute,
        "use_fp8_w8a8": use_fp8_w8a8,
        "use_int8_w8a8": False,
        "use_int8_w8a16": use_int8_w8a16,
        "use_int4_w4a16": False,
        "per_channel_quant": per_channel_quant,
        "block_shape": block_shape,
        "B_bias": weights.get("B_bias"),
    }


def gptq_args(
    *,
    A: torch.Tensor,
    weights: dict[str, torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: int,
    config: dict[str, int],
    compute: str,
    int4: bool,
    group_size: int,
    mul_routed_weight: bool = False,
) -> dict[str, Any]:
    """The keyword arguments of one ``invoke_fused_moe_wna16_triton_kernel`` call."""
    top_k = int(topk_ids.shape[1])
    sorted_ids, expert_ids, padded = alignment(topk_ids, config["BLOCK_SIZE_M"], experts)
    n = int(weights["B"].shape[1])
    return {
        "A": A,
        "B": weights["B"],
        "C": torch.zeros(A.shape[0], top_k, n, dtype=getattr(torch, compute)),
        "B_scale": weights["B_scale"],
        "B_zp": weights.get("B_zp"),
        "topk_weights": topk_weights,
        "sorted_token_ids": sorted_ids,
        "expert_ids": expert_ids,
        "num_tokens_post_padded": padded,
        "mul_routed_weight": mul_routed_weight,
        "top_k": top_k,
        "config": dict(config),
        "compute_type": compute,
        "use_int8_w8a16": not int4,
        "use_int4_w4a16": int4,
        "block_shape": [0, group_size],
    }


def _finish(
    ctx: BuildContext, op: str, args: dict[str, Any], name: str, static: tuple[str, ...]
) -> list[SynthCall]:
    from moereplay.ops import get_op

    recorded = to_device(args, ctx.runner.device, ctx.drawer)
    loaded = get_op(op).recorded_args(recorded)  # type: ignore[attr-defined]
    out = ctx.runner.run(op, loaded)
    context = {"layer": 0, "gemm": "gemm1", "synth": name}
    return [
        SynthCall(
            op,
            recorded,
            {"C": out.reshape(recorded["C"].shape)},
            f"moereplay.synth:{name}",
            context,
            static=static,
        )
    ]


# ---------------------------------------------------------------------------------------------------------------
# Qwen3-30B-A3B
# ---------------------------------------------------------------------------------------------------------------

QWEN = (
    Setting("tokens", 16, "tokens in the batch"),
    Setting("experts", 128, "experts E"),
    Setting("top_k", 8, "experts per token"),
    Setting("hidden", 2048, "hidden size (K)"),
    Setting("intermediate", 768, "moe_intermediate_size (N = 2 · intermediate)"),
    Setting("dtype", "bfloat16", "activation dtype", DTYPES),
)


def build_qwen_bf16(ctx: BuildContext) -> list[SynthCall]:
    tokens, experts, top_k = ctx.integer("tokens"), ctx.integer("experts"), ctx.integer("top_k")
    hidden, inter, dtype = ctx.integer("hidden"), ctx.integer("intermediate"), ctx.text("dtype")
    seed = seeds(ctx.integer("seed"))
    fmt = "bf16" if dtype == "bfloat16" else "fp16"
    params: dict[str, Any] = {"seed": seed(1), "format": fmt, "experts": experts, "n": 2 * inter, "k": hidden}
    if ctx.bias:
        params.update(bias=True, dtype=dtype)
    weights = ctx.drawer.parts("triton_moe_experts", params)
    x = ctx.drawer.draw("normal", {"seed": seed(2), "shape": [tokens, hidden], "dtype": dtype, "std": 0.5})
    topk = softmax_topk(tokens, experts, top_k, seed(3), renormalize=True)
    args = triton_args(
        A=x, weights=weights, topk_weights=topk.weights, topk_ids=topk.ids, experts=experts,
        config=_config(ctx), compute=dtype, mul_routed_weight=bool(ctx.integer("mul_routed_weight")),
    )  # fmt: skip
    return _finish(ctx, TRITON_OP, args, "qwen3-30b-a3b-bf16-w13", TRITON_STATIC)


register_preset(
    Preset(
        "qwen3-30b-a3b-bf16-w13",
        "Qwen3-30B-A3B bf16 Triton fused MoE gemm1 (E=128, top-8, K=2048, N=2·768)",
        TRITON_OP,
        settings(*QWEN, *CONFIG, Setting("mul_routed_weight", 0, "1: multiply rows by their routing weight")),
        False,
        build_qwen_bf16,
    )
)


def build_qwen_int4(ctx: BuildContext) -> list[SynthCall]:
    tokens, experts, top_k = ctx.integer("tokens"), ctx.integer("experts"), ctx.integer("top_k")
    hidden, inter, dtype = ctx.integer("hidden"), ctx.integer("intermediate"), ctx.text("dtype")
    group, bits = ctx.integer("group_size"), ctx.integer("bits")
    if bits not in (4, 8):
        raise SettingsError(f"bits={bits}: expected 4 or 8")
    seed = seeds(ctx.integer("seed"))
    weights = ctx.drawer.parts(
        "triton_moe_experts",
        {
            "seed": seed(1), "format": "int4_group" if bits == 4 else "int8_group", "experts": experts,
            "n": 2 * inter, "k": hidden, "group_size": group, "zero_points": bool(ctx.integer("zero_points")),
            "dtype": dtype,
        },
    )  # fmt: skip
    x = ctx.drawer.draw("normal", {"seed": seed(2), "shape": [tokens, hidden], "dtype": dtype, "std": 0.5})
    topk = softmax_topk(tokens, experts, top_k, seed(3), renormalize=True)
    args = gptq_args(
        A=x, weights=weights, topk_weights=topk.weights, topk_ids=topk.ids, experts=experts,
        config=_config(ctx), compute=dtype, int4=bits == 4, group_size=group,
    )  # fmt: skip
    return _finish(ctx, GPTQ_OP, args, "qwen3-30b-a3b-int4-w13", GPTQ_STATIC)


register_preset(
    Preset(
        "qwen3-30b-a3b-int4-w13",
        "Qwen3-30B-A3B GPTQ/AWQ int4 (group 128) gemm1 through fused_moe_kernel_gptq_awq",
        GPTQ_OP,
        settings(
            *QWEN,
            *(s for s in CONFIG if s.name not in ("block_n", "block_k")),
            Setting("block_n", 64, "BLOCK_SIZE_N (vLLM's triton wna16 default for batches > 1)"),
            Setting("block_k", 32, "BLOCK_SIZE_K (vLLM's triton wna16 default for batches > 1)"),
            Setting("group_size", 128, "quantisation group along K"),
            Setting("zero_points", 0, "1: AWQ-style zero points (B_zp)"),
            Setting("bits", 4, "4 (use_int4_w4a16) or 8 (use_int8_w8a16)"),
        ),
        False,
        build_qwen_int4,
    )
)


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V3 fp8 block
# ---------------------------------------------------------------------------------------------------------------

DEEPSEEK = (
    Setting("tokens", 8, "tokens in the batch"),
    Setting("global_experts", 256, "routed experts of the model"),
    Setting("experts", 32, "experts on this rank (expert parallelism: global_experts / experts ranks)"),
    Setting("rank", 0, "this rank's index: it holds experts rank·experts … (rank+1)·experts − 1"),
    Setting("top_k", 8, "experts per token"),
    Setting("hidden", 7168, "hidden size (K)"),
    Setting("intermediate", 2048, "moe_intermediate_size (N = 2 · intermediate)"),
    Setting("dtype", "bfloat16", "compute dtype", DTYPES),
)


def build_deepseek(ctx: BuildContext) -> list[SynthCall]:
    tokens, experts, top_k = ctx.integer("tokens"), ctx.integer("experts"), ctx.integer("top_k")
    total, rank = ctx.integer("global_experts"), ctx.integer("rank")
    hidden, inter, dtype = ctx.integer("hidden"), ctx.integer("intermediate"), ctx.text("dtype")
    if total % experts or not 0 <= rank < total // experts:
        raise SettingsError(f"experts={experts} must divide global_experts={total} and rank lie in its ranks")
    seed = seeds(ctx.integer("seed"))
    weights = ctx.drawer.parts(
        "triton_moe_experts",
        {"seed": seed(1), "format": "fp8_block", "experts": experts, "n": 2 * inter, "k": hidden,
         "block_n": 128, "block_k": 128},
    )  # fmt: skip
    x = ctx.drawer.draw("normal", {"seed": seed(2), "shape": [tokens, hidden], "dtype": dtype, "std": 0.5})
    codes, scales = quantize_fp8_groups(x, 128)
    topk = softmax_topk(tokens, total, top_k, seed(3), renormalize=True)
    expert_map = torch.full((total,), -1, dtype=torch.int32)
    expert_map[rank * experts : (rank + 1) * experts] = torch.arange(experts, dtype=torch.int32)
    args = triton_args(
        A=codes, weights=weights, topk_weights=topk.weights, topk_ids=topk.ids, experts=total,
        config=_config(ctx), compute=dtype, A_scale=scales, use_fp8_w8a8=True, block_shape=[128, 128],
        expert_map=expert_map,
    )  # fmt: skip
    return _finish(ctx, TRITON_OP, args, "deepseek-v3-fp8-w13", TRITON_STATIC)


register_preset(
    Preset(
        "deepseek-v3-fp8-w13",
        "DeepSeek-V3 fp8 block-128 gemm1 on one of 8 expert-parallel ranks (32 of 256 experts, expert_map)",
        TRITON_OP,
        settings(*DEEPSEEK, *CONFIG),
        False,
        build_deepseek,
    )
)


# ---------------------------------------------------------------------------------------------------------------
# a fused layer for the w13 layout probe
# ---------------------------------------------------------------------------------------------------------------

MOE_ACTIVATION = "vllm.model_executor.layers.fused_moe.activation.MoEActivation"
LAYOUTS = ("gate_up", "up_gate", "gu_interleaved", "ug_interleaved")

LAYER = (
    Setting("tokens", 8, "tokens in the batch"),
    Setting("experts", 8, "experts E"),
    Setting("top_k", 2, "experts per token"),
    Setting("hidden", 128, "hidden size (K)"),
    Setting("intermediate", 64, "moe_intermediate_size (w1 holds 2 · intermediate rows per expert)"),
    Setting("dtype", "bfloat16", "activation dtype", DTYPES),
    Setting("activation", "silu", "the layer's gated activation", ("silu", "gelu", "swigluoai")),
    Setting("w13_layout", "gate_up", "the layout the capture declares for w1's rows", LAYOUTS),
    Setting(
        "activation_layout",
        "same",
        "the layout the activation reads ('same': w13_layout)",
        ("same", *LAYOUTS),
    ),
)


def build_layer(ctx: BuildContext) -> list[SynthCall]:
    """``fused_experts`` as ``fused_experts_impl`` runs it unquantised: gemm1 (``top_k`` rows per token) → the
    gated activation of its ``[M · top_k, 2N]`` rows → gemm2 (``top_k = 1``, ``mul_routed_weight``) → the top-k sum.
    The weights are random, so any declared ``w13_layout`` is right as long as the activation reads it."""
    from moereplay.format.schema import EnumValue
    from moereplay.ops import get_op
    from moereplay.reference.activation import GatedActivation, W13Layout, apply_gated_activation

    tokens, experts, top_k = ctx.integer("tokens"), ctx.integer("experts"), ctx.integer("top_k")
    hidden, inter, dtype = ctx.integer("hidden"), ctx.integer("intermediate"), ctx.text("dtype")
    w13_layout = W13Layout(ctx.text("w13_layout"))
    read = ctx.text("activation_layout")
    activation_layout = w13_layout if read == "same" else W13Layout(read)
    activation = GatedActivation(ctx.text("activation"))
    seed = seeds(ctx.integer("seed"))
    fmt = "bf16" if dtype == "bfloat16" else "fp16"
    w13 = ctx.drawer.parts(
        "triton_moe_experts",
        {"seed": seed(1), "format": fmt, "experts": experts, "n": 2 * inter, "k": hidden},
    )
    w2 = ctx.drawer.parts(
        "triton_moe_experts", {"seed": seed(4), "format": fmt, "experts": experts, "n": hidden, "k": inter}
    )
    x = ctx.drawer.draw("normal", {"seed": seed(2), "shape": [tokens, hidden], "dtype": dtype, "std": 0.5})
    topk = softmax_topk(tokens, experts, top_k, seed(3), renormalize=True)
    op = get_op(TRITON_OP)
    device = ctx.runner.device

    def run(args: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor]:
        recorded = to_device(args, device, ctx.drawer)
        return recorded, ctx.runner.run(TRITON_OP, op.recorded_args(recorded))  # type: ignore[attr-defined]

    gemm1, out1 = run(
        triton_args(
            A=x, weights=w13, topk_weights=topk.weights, topk_ids=topk.ids, experts=experts,
            config=_config(ctx), compute=dtype,
        )
    )  # fmt: skip
    rows = apply_gated_activation(out1.float(), activation, activation_layout).to(out1.dtype)
    second = triton_args(
        A=rows.cpu(), weights=w2, topk_weights=topk.weights, topk_ids=topk.ids, experts=experts,
        config=_config(ctx), compute=dtype, mul_routed_weight=True,
    )  # fmt: skip
    second.update(top_k=1, C=torch.zeros(tokens, top_k, hidden, dtype=getattr(torch, dtype)))
    gemm2, out2 = run(second)
    final = out2.view(tokens, top_k, hidden).float().sum(dim=1).to(out2.dtype)
    parent_args = to_device(
        {
            "hidden_states": x,
            "w1": w13["B"],
            "w2": w2["B"],
            "topk_weights": topk.weights,
            "topk_ids": topk.ids,
            "activation": EnumValue(MOE_ACTIVATION, activation.name, activation.value),
            "apply_router_weight_on_input": False,
            "global_num_experts": -1,
            "expert_map": None,
        },
        device,
        ctx.drawer,
    )
    name = "triton-bf16-layer"
    truth = {"w13_layout": w13_layout.value, "activation_layout": activation_layout.value}
    context = {"layer": 0, "synth": name}
    site = f"moereplay.synth:{name}"
    return [
        SynthCall(
            "fused_experts",
            parent_args,
            {"return": final},
            site,
            {**context, "w13_layout": w13_layout.value, "synth_truth": truth},
            static=("w1", "w2"),
        ),
        SynthCall(
            TRITON_OP,
            gemm1,
            {"C": out1.reshape(gemm1["C"].shape)},
            site,
            {**context, "gemm": "gemm1", "w13_layout": w13_layout.value},
            parent=0,
            static=TRITON_STATIC,
        ),
        SynthCall(
            TRITON_OP,
            gemm2,
            {"C": out2.reshape(gemm2["C"].shape)},
            site,
            {**context, "gemm": "gemm2"},
            parent=0,
            static=TRITON_STATIC,
        ),
    ]


register_preset(
    Preset(
        "triton-bf16-layer",
        "a fused bf16 Triton MoE layer (fused_experts + gemm1 + activation + gemm2) for the w13 layout probe",
        "fused_experts",
        settings(*LAYER, *CONFIG),
        False,
        build_layer,
    )
)
