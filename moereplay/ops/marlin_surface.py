"""What the capture side needs of vLLM's Marlin MoE family, without torch (the plugin imports this).

Facts, from the sources. vLLM 0.25.1 (``vllm/model_executor/layers/fused_moe/experts/marlin_moe.py``):
``_fused_marlin_moe`` calls ``ops.moe_wna16_marlin_gemm`` twice (gemm1 with ``top_k=num_topk``, gemm2 with
``top_k=1``) where ``ops`` is the module ``vllm._custom_ops``, so the attribute
``vllm._custom_ops.moe_wna16_marlin_gemm`` is the patch point. ``MarlinExperts.apply`` calls the module global
``fused_marlin_moe`` (the parent we record: activation, routing ids, biases, scales, quant type id);
``batched_fused_marlin_moe`` is the batched (EP) parent. Signature 0.25.1: ``(input, output, b_qweight, b_bias,
b_scales, a_scales, global_scale, b_qzeros, g_idx, perm, workspace, sorted_token_ids, expert_ids,
num_tokens_past_padded, topk_weights, moe_block_size, top_k, mul_topk_weights, b_q_type, size_m, size_n, size_k,
is_k_full, use_atomic_add, use_fp32_reduce, is_zp_float, thread_k=-1, thread_n=-1, blocks_per_sm=-1)``. Current
vLLM main (``vllm/_custom_ops.py`` at 0002bde5) drops ``g_idx``, ``perm`` and ``is_k_full`` — the wrapper binds by
the running function's own signature and records its names. Older releases (≤ 0.10) kept the Marlin MoE in
``fused_moe/fused_marlin_moe.py``. ``b_q_type`` is vLLM's ``ScalarType``: its codec is
:mod:`moereplay.ops.vllm_codecs`.

A layer's two kernel calls without a parent record pair up by their arguments: gemm1 has ``top_k > 1`` rows per
token and ``size_n = 2 · gemm2's size_k``; gemm2 has ``top_k = 1``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moereplay.ops.surface import CaptureTarget, FamilySurface, register_family

GEMM_OP = "moe_wna16_marlin_gemm"
PARENT_OP = "fused_marlin_moe"
BATCHED_PARENT_OP = "batched_fused_marlin_moe"

MARLIN_MODULES = (
    "vllm.model_executor.layers.fused_moe.experts.marlin_moe",
    "vllm.model_executor.layers.fused_moe.fused_marlin_moe",
)
VLLM_CODECS = ("moereplay.ops.vllm_codecs",)
"""vLLM's own value types (``ScalarType``)."""

MARLIN_GEMM_STATIC = ("b_qweight", "b_bias", "b_scales", "global_scale", "b_qzeros", "g_idx", "perm")
FUSED_MARLIN_STATIC = (
    "w1",
    "w2",
    "bias1",
    "bias2",
    "w1_scale",
    "w2_scale",
    "input_global_scale1",
    "input_global_scale2",
    "global_scale1",
    "global_scale2",
    "g_idx1",
    "g_idx2",
    "sort_indices1",
    "sort_indices2",
    "w1_zeros",
    "w2_zeros",
)

FUSED_MARLIN_SCRATCH = ("workspace", "intermediate_cache13", "intermediate_cache2")
"""fused_marlin_moe's work buffers: the Marlin lock workspace and the two intermediate caches (the function
allocates its own when they are None)."""


def is_first_gemm(args: Mapping[str, Any]) -> bool:
    """Whether a recorded ``moe_wna16_marlin_gemm`` call is its layer's gemm1 (w13): ``top_k > 1``."""
    return isinstance(args.get("top_k"), int) and args["top_k"] > 1


def pair_fits(first: Mapping[str, Any], second: Mapping[str, Any]) -> bool:
    """Whether gemm1's ``size_n`` is twice gemm2's ``size_k`` (the gated activation halves the width)."""
    size_n, size_k = first.get("size_n"), second.get("size_k")
    return isinstance(size_n, int) and isinstance(size_k, int) and size_n == 2 * size_k


def _targets() -> tuple[CaptureTarget, ...]:
    targets: list[CaptureTarget] = [
        CaptureTarget(
            GEMM_OP,
            "kernel",
            "vllm._custom_ops",
            GEMM_OP,
            static=MARLIN_GEMM_STATIC,
            outputs=("output", "workspace"),
            codec_modules=VLLM_CODECS,
        )
    ]
    for module in MARLIN_MODULES:
        for op in (PARENT_OP, BATCHED_PARENT_OP):
            targets.append(
                CaptureTarget(
                    op,
                    "parent",
                    module,
                    op,
                    static=FUSED_MARLIN_STATIC,
                    outputs=("output",),
                    codec_modules=VLLM_CODECS,
                    scratch=FUSED_MARLIN_SCRATCH,
                    inputs_intact=True,
                )
            )
    return tuple(targets)


FAMILY = register_family(
    FamilySurface(
        name="marlin",
        kernel_ops=(GEMM_OP,),
        op_modules={GEMM_OP: "moereplay.ops.marlin_moe"},
        parent_ops=(PARENT_OP, BATCHED_PARENT_OP),
        targets=_targets(),
        vllm_series=((0, 25), (0, 33)),
        first_gemm=is_first_gemm,
        pair_fits=pair_fits,
        layer_probe="moereplay.ops.marlin_layer_probe",
        smoke="moereplay.ops.marlin_smoke:smoke",
        preset_modules=("marlin_presets",),
        mutable_names={
            GEMM_OP: (
                "mul_topk_weights",
                "use_atomic_add",
                "use_fp32_reduce",
                "is_k_full",
                "moe_block_size",
                "thread_k",
                "thread_n",
                "blocks_per_sm",
            )
        },
    )
)
