"""What the capture side needs of the gpt-oss Triton MoE family (triton_kernels' ``matmul_ogs``), without torch.

Facts, from the sources. The gpt-oss Triton MoE (``.../fused_moe/experts/gpt_oss_triton_kernels_moe.py`` in vLLM
0.25.1 and main; older releases ``.../fused_moe/gpt_oss_triton_kernels_moe.py``) does ``from
triton_kernels.matmul_ogs import matmul_ogs`` at import, so its *module global* ``matmul_ogs`` is the patch point.
Its parents are the module global ``triton_kernel_fused_experts`` (called by ``OAITritonExperts.apply`` and, via
``triton_kernel_moe_forward``, by ``OAITritonMxfp4ExpertsMonolithic``) and ``UnfusedOAITritonExperts.apply``, which
calls ``matmul_ogs`` itself. Newer triton_kernels renamed the entry point ``triton_kernels.matmul.matmul`` (``a, b,
bias, a_ragged_metadata, b_ragged_metadata, gather_indx, scatter_indx, precision_config, ..., c``); it is wrapped
on its defining module, which reaches callers that look it up after the plugin armed (recorded, not replayed: no
op declares it yet).

triton_kernels state that changes the kernel: ``matmul_ogs`` calls ``make_opt_flags`` (its own module global, from
``matmul_ogs_details/opt_flags.py``), which honours the process-wide ``_opt_flags_constraints`` and ``_opt_flags``
of that module. The constraints are recorded as the call's process-state pseudo-arguments
(:func:`moereplay.ops.matmul_ogs.process_state`), a manual ``_opt_flags`` override in the call's context, and the
flags chosen for the call as its ``opt_flags`` output (see :mod:`moereplay.ops.ogs_process_state`).

The layer-scope flight recorder records gpt-oss one level higher where the served Hopper MXFP4 path
(``OAITritonMxfp4ExpertsMonolithic.apply``) calls ``triton_kernel_moe_forward(hidden_states, w1, w2, gating_output,
topk, renormalize, ...)``: it computes the routing from the router logits (triton_kernels' fused ``routing`` with the
legacy triton_kernels and no expert map; else ``topk`` and ``make_routing_data``), allocates the output and calls
``triton_kernel_fused_experts``. Its dynamic arguments are two tensors, where ``triton_kernel_fused_experts``' are 17
(the hidden states; RoutingData with four block sizes' offsets and block maps; GatherIndx; ScatterIndx), and the
recorder's per-call host work is mostly per tensor. Only that recorder wraps it (``CaptureTarget.layer_flight_only``);
``OAITritonExperts.apply`` calls ``triton_kernel_fused_experts`` directly, which stays the layer call there.
``moereplay expand`` re-runs it from the recorded logits, and the re-run is recorded as the
``triton_kernel_fused_experts`` call it makes, with its two ``matmul_ogs`` calls. The legacy routing without an
expert map was measured bit-identical run to run (``tools/gpu/routing_determinism.py``); the other path was not.

A layer's two ``matmul_ogs`` calls without a parent record pair up by their arguments: gemm1 gathers (and fuses
the activation), gemm2 scatters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moereplay.ops.surface import CaptureTarget, FamilySurface, register_family

GEMM_OP = "matmul_ogs"
MATMUL_OP = "matmul"
FUSED_PARENT_OP = "triton_kernel_fused_experts"
FORWARD_PARENT_OP = "triton_kernel_moe_forward"
UNFUSED_PARENT_OP = "unfused_oai_triton_experts"

GPT_OSS_MODULES = (
    "vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe",
    "vllm.model_executor.layers.fused_moe.gpt_oss_triton_kernels_moe",
)

PROCESS_STATE = "moereplay.ops.ogs_process_state"
"""The hooks recording and reapplying triton_kernels' opt_flags (:class:`moereplay.ops.surface.ProcessStateHooks`)."""

VENDORED_DIR = "vllm/third_party/triton_kernels"
"""Where vLLM's wheel (0.25.1 and main) carries triton_kernels: a kernel pack links it as top-level
``triton_kernels``, the name the library imports itself by (and the one vLLM prefers when importable)."""

OGS_CODECS = ("moereplay.ops.matmul_ogs",)
"""Importing the matmul_ogs op registers the triton_kernels codecs (layout Tensor, RoutingData, GatherIndx,
ScatterIndx, PrecisionConfig, FusedActivation, Epilogue) with the format."""


def is_first_gemm(args: Mapping[str, Any]) -> bool:
    """Whether a recorded ``matmul_ogs`` call is its layer's gemm1 (w13): it gathers or fuses the activation."""
    return args.get("gather_indx") is not None or args.get("fused_activation") is not None


def pair_fits(first: Mapping[str, Any], second: Mapping[str, Any]) -> bool:
    """Any gathering call pairs with the next scattering one of its layer."""
    return True


def _targets() -> tuple[CaptureTarget, ...]:
    targets: list[CaptureTarget] = []
    for module in GPT_OSS_MODULES:
        targets.append(
            CaptureTarget(
                GEMM_OP,
                "kernel",
                module,
                GEMM_OP,
                static=("w", "bias", "precision_config"),
                outputs=("y",),
                codec_modules=OGS_CODECS,
                process_state=PROCESS_STATE,
            )
        )
        targets.append(
            CaptureTarget(
                FUSED_PARENT_OP,
                "parent",
                module,
                FUSED_PARENT_OP,
                static=("w1", "w2", "quant_config"),
                outputs=("output_tensor",),
                codec_modules=OGS_CODECS,
                scratch=("intermediate_cache",),
                # vLLM 0.25.1's body writes only intermediate_cache (gemm1's y) and output_tensor (gemm2's y);
                # the routing it passes is read, never written
                inputs_intact=True,
                process_state=PROCESS_STATE,
                process_state_via=GEMM_OP,
            )
        )
        if module == GPT_OSS_MODULES[0]:  # read in vLLM 0.25.1's source; the older module's was not
            targets.append(
                CaptureTarget(
                    FORWARD_PARENT_OP,
                    "parent",
                    module,
                    FORWARD_PARENT_OP,
                    # expert_map static (stored once per file): its only caller, OAITritonMxfp4ExpertsMonolithic,
                    # refuses EPLB, the one thing that rewrites a map in place (triton_kernel_fused_experts, reached
                    # by other callers too, keeps it dynamic)
                    static=("w1", "w2", "quant_config", "expert_map"),
                    codec_modules=OGS_CODECS,
                    # vLLM 0.25.1's body reads hidden_states and gating_output, allocates its output and writes only
                    # that (through triton_kernel_fused_experts)
                    inputs_intact=True,
                    process_state=PROCESS_STATE,
                    process_state_via=GEMM_OP,
                    layer_flight_only=True,
                    in_place_of=FUSED_PARENT_OP,
                )
            )
        targets.append(
            CaptureTarget(
                UNFUSED_PARENT_OP,
                "parent",
                module,
                "UnfusedOAITritonExperts.apply",
                static=("w1", "w2", "self.quant_config"),
                self_attributes=("quant_config",),
                outputs=("output",),
                codec_modules=OGS_CODECS,
                scratch=("workspace13", "workspace2"),
                process_state=PROCESS_STATE,
                process_state_via=GEMM_OP,
            )
        )
    targets.append(
        CaptureTarget(
            MATMUL_OP,
            "kernel",
            "triton_kernels.matmul",
            MATMUL_OP,
            static=("b", "bias", "precision_config"),
            outputs=("c",),
            codec_modules=OGS_CODECS,
            process_state=PROCESS_STATE,
        )
    )
    return tuple(targets)


FAMILY = register_family(
    FamilySurface(
        name="ogs",
        kernel_ops=(GEMM_OP,),
        op_modules={GEMM_OP: "moereplay.ops.matmul_ogs"},
        parent_ops=(FUSED_PARENT_OP, FORWARD_PARENT_OP, UNFUSED_PARENT_OP),
        record_only_ops=(MATMUL_OP,),
        targets=_targets(),
        vllm_series=((0, 25), (0, 33)),
        first_gemm=is_first_gemm,
        pair_fits=pair_fits,
        layer_probe="moereplay.ops.ogs_layer_probe",
        smoke="moereplay.ops.ogs_smoke:smoke",
        preset_modules=("ogs_presets",),
        library_packages=("triton_kernels",),
        value_modules=("moereplay.ops.ogs_codecs",),
        vendored={"triton_kernels": VENDORED_DIR},
        mutable_names={
            GEMM_OP: (
                "block_m",
                "block_k",
                "split_k",
                "num_stages",
                "fused_scatter",
                "is_persistent",
                "epilogue_subtile",
                "num_warps",
            )
        },
    )
)
