"""What the capture side needs of vLLM's Triton fused MoE family, without torch (the plugin imports this).

Facts, from vLLM 0.25.1's ``vllm/model_executor/layers/fused_moe/fused_moe.py`` and ``experts/triton_moe.py``:

- ``fused_moe.py`` defines the launchers ``invoke_fused_moe_triton_kernel`` (→ ``fused_moe_kernel``) and
  ``invoke_fused_moe_wna16_triton_kernel`` (→ ``fused_moe_kernel_gptq_awq``); its ``dispatch_fused_moe_kernel``
  looks both up as module globals at call time, so the attributes of ``fused_moe.py`` are patch points for the
  functional path (``fused_experts`` → ``torch.ops.vllm.fused_experts`` → ``fused_experts_impl`` → dispatch).
- ``experts/triton_moe.py`` (``TritonExperts.apply``, ``TritonWNA16Experts.apply`` — the modular-kernel path most
  deployments take) binds both names by ``from … fused_moe import …``: its module globals are patch points too.
- The parent: ``fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input,
  global_num_experts, expert_map, quant_config)``, defined in ``fused_moe.py`` and re-exported by the package
  ``vllm.model_executor.layers.fused_moe`` (callers such as ``quantization/moe_wna16.py`` import it from the
  package inside the function, i.e. at call time). It allocates its intermediate caches itself and writes none of
  its arguments.
- ``fused_experts_impl`` launches gemm1 with ``top_k`` = the routing's top-k and ``mul_routed_weight =
  apply_router_weight_on_input`` (only allowed with top-1), gemm2 with ``top_k = 1`` and ``mul_routed_weight = not
  apply_router_weight_on_input``; gemm1 writes ``C`` ``[M, top_k, 2N]`` (from ``w1`` ``[E, 2N, K]``, gate rows first:
  ``silu_and_mul`` takes each row's first half as the gate), gemm2 reads ``A`` ``[M · top_k, N]``. So a layer's two
  launches without a parent record pair up: gemm1 is the one with ``top_k > 1`` or without ``mul_routed_weight``, and
  its ``C`` is twice as wide as gemm2's ``A`` (:mod:`moereplay.ops.fused_moe_triton_layer_probe` weighs the
  layouts).
- ``compute_type`` is a ``triton.language`` dtype (``tl.bfloat16`` …; class ``triton.language.core.dtype``, whose
  ``name`` is ``bf16`` / ``fp16`` / ``fp32``): recorded as ``{"name": "bfloat16" | "float16" | "float32"}``.

What a served model reaches (vLLM 0.25.1, read for ``tools/gpu/triton_session.sh``):

- unquantized (bf16) MoE: ``UnquantizedFusedMoEMethod`` → ``FusedMoEKernel`` → ``TritonExperts.apply``, which
  calls ``invoke_fused_moe_triton_kernel`` (its module global) twice; ``fused_experts`` is never called, so these
  kernel calls have **no parent record** and no layer name (the tracker takes layers from parents; ``layout``
  pairs gemm1/gemm2 by :func:`is_first_gemm` / :func:`pair_fits`). With ``num_tokens · top_k · 4 <= experts``
  (``_prepare_expert_assignment``) ``sorted_token_ids`` is ``None`` (naive block assignment).
- ``--quantization moe_wna16`` (GPTQ/AWQ int4/int8): ``MoeWNA16Method.apply`` calls the package's
  ``fused_experts`` (the recorded parent) → ``dispatch_fused_moe_kernel``, which sends batches with
  ``num_tokens · top_k / experts <= 6`` (group 32/64/128, int4: ``should_moe_wna16_use_cuda``) to the CUDA op
  ``moe_wna16_gemm`` (not captured) and the rest to ``invoke_fused_moe_wna16_triton_kernel``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moereplay.ops.surface import CaptureTarget, FamilySurface, register_family

TRITON_OP = "fused_moe_kernel"
GPTQ_AWQ_OP = "fused_moe_kernel_gptq_awq"
PARENT_OP = "fused_experts"
TRITON_LAUNCHER = "invoke_fused_moe_triton_kernel"
GPTQ_AWQ_LAUNCHER = "invoke_fused_moe_wna16_triton_kernel"
PACKAGE = "vllm.model_executor.layers.fused_moe"
FUSED_MOE_MODULE = f"{PACKAGE}.fused_moe"
EXPERTS_MODULE = f"{PACKAGE}.experts.triton_moe"
CODEC_MODULE = "moereplay.ops.fused_moe_triton_codecs"

CONFIG_KEYS: tuple[str, ...] = (
    "BLOCK_SIZE_M",
    "BLOCK_SIZE_N",
    "BLOCK_SIZE_K",
    "GROUP_SIZE_M",
    "num_warps",
    "num_stages",
)
"""Keys of the launchers' ``config`` dict that replay exposes as pseudo-arguments."""

CONFIG_CONSTEXPRS: tuple[str, ...] = (
    "BLOCK_SIZE_M",
    "BLOCK_SIZE_N",
    "BLOCK_SIZE_K",
    "GROUP_SIZE_M",
    "SPLIT_K",
)
"""The meta-parameters both 0.25.1 kernels declare ``tl.constexpr`` and their launchers take from the ``config``
dict (``**config``; ``num_warps`` / ``num_stages`` are Triton launch options, optional). ``SPLIT_K`` is unused by
either kernel but declared by both: Triton rejects a launch without it (``missing … argument: 'SPLIT_K'``)."""

LAUNCHER_SUPPLIED: dict[str, frozenset[str]] = {
    TRITON_OP: frozenset({"SPLIT_K"}),
    GPTQ_AWQ_OP: frozenset({"BLOCK_SIZE_N", "BLOCK_SIZE_K"}),
}
"""Constexprs a launcher fills in itself when the config lacks them: ``invoke_fused_moe_triton_kernel`` sets
``SPLIT_K = 1``; ``invoke_fused_moe_wna16_triton_kernel`` sets ``BLOCK_SIZE_N`` and ``BLOCK_SIZE_K`` together
(``get_moe_wna16_block_config``: unless the config has both) — and passes everything else on as it is, so its
config must carry ``SPLIT_K`` (vLLM's ``get_default_config`` always puts ``"SPLIT_K": 1`` in)."""

CONFIG_DEFAULTS: dict[str, int] = {"SPLIT_K": 1}
"""The values vLLM puts in every config it builds for keys replay does not expose (synth presets use them)."""


def required_config_keys(op: str) -> tuple[str, ...]:
    """The ``config`` keys a call of ``op`` must carry for its launcher to launch the kernel (see
    :data:`CONFIG_CONSTEXPRS`, :data:`LAUNCHER_SUPPLIED`)."""
    supplied = LAUNCHER_SUPPLIED[op]
    return tuple(key for key in CONFIG_CONSTEXPRS if key not in supplied)


TRITON_DTYPE = "triton.language.core.dtype"
_NAMES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
}

TRITON_STATIC = ("B", "B_scale", "B_bias")
GPTQ_STATIC = ("B", "B_scale", "B_zp")
PARENT_STATIC = ("w1", "w2", "quant_config")


def compute_type_name(value: Any) -> str:
    """``bfloat16`` / ``float16`` / ``float32`` for a triton dtype, a torch dtype or a name; ValueError else."""
    name = getattr(value, "name", None)
    text = str(name if isinstance(name, str) else value).removeprefix("torch.").removeprefix("tl.")
    canonical = _NAMES.get(text)
    if canonical is None:
        raise ValueError(f"compute_type {value!r} is not bf16, fp16 or fp32")
    return canonical


def _encode_dtype(value: Any) -> dict[str, str]:
    from moereplay.errors import UnsupportedValueError

    try:
        return {"name": compute_type_name(value)}
    except ValueError as error:
        raise UnsupportedValueError(str(error)) from error


def _decode_dtype(tree: Any) -> str:
    from moereplay.errors import UnsupportedValueError

    name = tree.get("name") if isinstance(tree, dict) else tree
    try:
        return compute_type_name(name)
    except ValueError as error:
        raise UnsupportedValueError(str(error)) from error


def register_codecs() -> None:
    """Register the triton dtype codec with the format's registry (idempotent). Not run at this module's import:
    the kernel-pack loader reads every surface before the pack's wheels (zstandard, which the format package
    imports) are on the path; :data:`CODEC_MODULE` runs it for capture, and the op module for replay."""
    from moereplay.format.codecs import register_codec

    register_codec(TRITON_DTYPE, _encode_dtype, _decode_dtype)


def is_first_gemm(args: Mapping[str, Any]) -> bool:
    """Whether a recorded launch is its layer's gemm1 (w13): ``top_k > 1``, or top-1 without routing weights
    (gemm2 multiplies them in unless the layer applies them on the input — then the pair is told by order only)."""
    top_k = args.get("top_k")
    if not isinstance(top_k, int):
        return False
    return top_k > 1 or args.get("mul_routed_weight") is False


def _shape(value: Any) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    return tuple(int(size) for size in shape) if shape is not None else None


def pair_fits(first: Mapping[str, Any], second: Mapping[str, Any]) -> bool:
    """Whether gemm1's ``C`` rows (``[M, top_k, 2N]``) are twice as wide as gemm2's ``A`` rows and as many
    (unknown shapes fit)."""
    written, read = _shape(first.get("C")), _shape(second.get("A"))
    if not written or not read or len(read) != 2:
        return True
    rows = 1
    for size in written[:-1]:
        rows *= size
    return written[-1] == 2 * read[-1] and rows == read[0]


def _targets() -> tuple[CaptureTarget, ...]:
    targets: list[CaptureTarget] = []
    for module in (FUSED_MOE_MODULE, EXPERTS_MODULE):
        targets.append(
            CaptureTarget(
                TRITON_OP,
                "kernel",
                module,
                TRITON_LAUNCHER,
                static=TRITON_STATIC,
                outputs=("C",),
                codec_modules=(CODEC_MODULE,),
            )
        )
        targets.append(
            CaptureTarget(
                GPTQ_AWQ_OP,
                "kernel",
                module,
                GPTQ_AWQ_LAUNCHER,
                static=GPTQ_STATIC,
                outputs=("C",),
                codec_modules=(CODEC_MODULE,),
            )
        )
    for module in (PACKAGE, FUSED_MOE_MODULE):
        targets.append(
            CaptureTarget(
                PARENT_OP,
                "parent",
                module,
                PARENT_OP,
                static=PARENT_STATIC,
                codec_modules=(CODEC_MODULE,),
                inputs_intact=True,
            )
        )
    return tuple(targets)


_CONFIG_MUTABLE = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
"""The Triton launch configuration a replay may change (both kernels)."""


FAMILY = register_family(
    FamilySurface(
        name="triton_fused_moe",
        kernel_ops=(TRITON_OP, GPTQ_AWQ_OP),
        op_modules={
            TRITON_OP: "moereplay.ops.fused_moe_triton",
            GPTQ_AWQ_OP: "moereplay.ops.fused_moe_triton",
        },
        parent_ops=(PARENT_OP,),
        targets=_targets(),
        vllm_series=((0, 25),),
        preset_modules=("triton_presets",),
        first_gemm=is_first_gemm,
        pair_fits=pair_fits,
        layer_probe="moereplay.ops.fused_moe_triton_layer_probe",
        mutable_names={
            TRITON_OP: (*_CONFIG_MUTABLE, "mul_routed_weight"),
            GPTQ_AWQ_OP: (*_CONFIG_MUTABLE, "mul_routed_weight", "use_int4_w4a16", "use_int8_w8a16"),
        },
    )
)
