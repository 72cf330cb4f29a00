"""Where vLLM calls the MoE kernels: the names the capture plugin wraps, per vLLM / triton_kernels generation.

Each target names a module attribute *where it is looked up at call time* — wrapping the defining function
elsewhere would miss call sites that bound it by ``from x import f``. Facts, from the sources:

vLLM 0.25.1 (``vllm/model_executor/layers/fused_moe/experts/marlin_moe.py``): ``_fused_marlin_moe`` calls
``ops.moe_wna16_marlin_gemm`` twice (gemm1 with ``top_k=num_topk``, gemm2 with ``top_k=1``) where ``ops`` is the
module ``vllm._custom_ops``, so the attribute ``vllm._custom_ops.moe_wna16_marlin_gemm`` is the patch point.
``MarlinExperts.apply`` calls the module global ``fused_marlin_moe`` (the parent we record: activation, routing
ids, biases, scales, quant type id); ``batched_fused_marlin_moe`` is the batched (EP) parent. Signature 0.25.1:
``(input, output, b_qweight, b_bias, b_scales, a_scales, global_scale, b_qzeros, g_idx, perm, workspace,
sorted_token_ids, expert_ids, num_tokens_past_padded, topk_weights, moe_block_size, top_k, mul_topk_weights,
b_q_type, size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce, is_zp_float, thread_k=-1,
thread_n=-1, blocks_per_sm=-1)``. Current vLLM main (``vllm/_custom_ops.py`` at 0002bde5) drops ``g_idx``,
``perm`` and ``is_k_full`` — the wrapper binds by the running function's own signature and records its names.
Older releases (≤ 0.10) kept the Marlin MoE in ``fused_moe/fused_marlin_moe.py``.

gpt-oss Triton MoE (``.../fused_moe/experts/gpt_oss_triton_kernels_moe.py`` in 0.25.1 and main; older releases
``.../fused_moe/gpt_oss_triton_kernels_moe.py``): the module does ``from triton_kernels.matmul_ogs import
matmul_ogs`` at import, so its *module global* ``matmul_ogs`` is the patch point. Its parents are the module
global ``triton_kernel_fused_experts`` (called by ``OAITritonExperts.apply`` and, via
``triton_kernel_moe_forward``, by ``OAITritonMxfp4ExpertsMonolithic``) and ``UnfusedOAITritonExperts.apply``,
which calls ``matmul_ogs`` itself. Newer triton_kernels renamed the entry point ``triton_kernels.matmul.matmul``
(``a, b, bias, a_ragged_metadata, b_ragged_metadata, gather_indx, scatter_indx, precision_config, ..., c``); it
is wrapped on its defining module, which reaches callers that look it up after the plugin armed.

triton_kernels state that changes the kernel: ``matmul_ogs`` calls ``make_opt_flags`` (its own module global,
from ``matmul_ogs_details/opt_flags.py``), which honours the process-wide ``_opt_flags_constraints`` and
``_opt_flags`` of that module. The constraints are recorded as the call's process-state pseudo-arguments
(:func:`moereplay.ops.matmul_ogs.process_state`), a manual ``_opt_flags`` override in the call's context, and the
flags chosen for the call as its ``opt_flags`` output (see :mod:`moereplay.capture.opt_flags`).
"""

from __future__ import annotations

from moereplay.ops.surface import CaptureTarget, Role, families, family_targets

__all__ = ["TARGETS", "CaptureTarget", "Role", "vllm_series_known"]

MARLIN_MODULES = (
    "vllm.model_executor.layers.fused_moe.experts.marlin_moe",
    "vllm.model_executor.layers.fused_moe.fused_marlin_moe",
)
GPT_OSS_MODULES = (
    "vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe",
    "vllm.model_executor.layers.fused_moe.gpt_oss_triton_kernels_moe",
)

OGS_CODECS = ("moereplay.ops.matmul_ogs",)
"""Importing the matmul_ogs op registers the triton_kernels codecs (layout Tensor, RoutingData, GatherIndx,
ScatterIndx, PrecisionConfig, FusedActivation, Epilogue) with the format."""
VLLM_CODECS = ("moereplay.capture.vllm_codecs",)
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


def _targets() -> tuple[CaptureTarget, ...]:
    targets: list[CaptureTarget] = [
        CaptureTarget(
            "moe_wna16_marlin_gemm",
            "kernel",
            "vllm._custom_ops",
            "moe_wna16_marlin_gemm",
            static=MARLIN_GEMM_STATIC,
            outputs=("output", "workspace"),
            codec_modules=VLLM_CODECS,
        )
    ]
    for module in MARLIN_MODULES:
        targets.append(
            CaptureTarget(
                "fused_marlin_moe",
                "parent",
                module,
                "fused_marlin_moe",
                static=FUSED_MARLIN_STATIC,
                outputs=("output",),
                codec_modules=VLLM_CODECS,
                scratch=FUSED_MARLIN_SCRATCH,
                inputs_intact=True,
            )
        )
        targets.append(
            CaptureTarget(
                "batched_fused_marlin_moe",
                "parent",
                module,
                "batched_fused_marlin_moe",
                static=FUSED_MARLIN_STATIC,
                outputs=("output",),
                codec_modules=VLLM_CODECS,
                scratch=FUSED_MARLIN_SCRATCH,
                inputs_intact=True,
            )
        )
    for module in GPT_OSS_MODULES:
        targets.append(
            CaptureTarget(
                "matmul_ogs",
                "kernel",
                module,
                "matmul_ogs",
                static=("w", "bias", "precision_config"),
                outputs=("y",),
                codec_modules=OGS_CODECS,
                opt_flags=True,
            )
        )
        targets.append(
            CaptureTarget(
                "triton_kernel_fused_experts",
                "parent",
                module,
                "triton_kernel_fused_experts",
                static=("w1", "w2", "quant_config"),
                outputs=("output_tensor",),
                codec_modules=OGS_CODECS,
                scratch=("intermediate_cache",),
                # vLLM 0.25.1's body writes only intermediate_cache (gemm1's y) and output_tensor (gemm2's y);
                # the routing it passes is read, never written
                inputs_intact=True,
                opt_flags_via="matmul_ogs",
            )
        )
        targets.append(
            CaptureTarget(
                "unfused_oai_triton_experts",
                "parent",
                module,
                "UnfusedOAITritonExperts.apply",
                static=("w1", "w2", "self.quant_config"),
                self_attributes=("quant_config",),
                outputs=("output",),
                codec_modules=OGS_CODECS,
                scratch=("workspace13", "workspace2"),
                opt_flags_via="matmul_ogs",
            )
        )
    targets.append(
        CaptureTarget(
            "matmul",
            "kernel",
            "triton_kernels.matmul",
            "matmul",
            static=("b", "bias", "precision_config"),
            outputs=("c",),
            codec_modules=OGS_CODECS,
            opt_flags=True,
        )
    )
    targets.extend(family_targets())
    return tuple(targets)


TARGETS: tuple[CaptureTarget, ...] = _targets()
"""Every patch point the plugin knows; a module that does not exist in the running vLLM is simply absent."""

KNOWN_VLLM_SERIES: tuple[tuple[int, int], ...] = tuple(
    sorted({(0, 25), (0, 33), *(series for family in families() for series in family.vllm_series)})
)
"""vLLM release series whose patch points were read from the sources; others get one warning naming the
patch points that matched."""


def vllm_series_known(version: str) -> bool:
    parts = version.split("+", 1)[0].split(".")
    try:
        series = (int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or "-1"))
    except (IndexError, ValueError):
        return False
    return series in KNOWN_VLLM_SERIES
