"""triton_kernels ``matmul_ogs`` — the MoE GEMM of vLLM 0.25.1's gpt-oss Triton path (MXFP4 weights on Hopper).

vLLM calls it twice per MoE layer (``triton_kernel_fused_experts``): gemm1 with a gather of the token rows, the w13
bias and a fused SwiGLU (``FusedActivation("swiglu", (1.702, 7.0), reduction_n=2)``); gemm2 with a scatter back to
tokens (a grouped top-k sum) and the routing weights as ``gammas``. Weights are MXFP4, prepared once by
``_swizzle_mxfp4``: ``HOPPER_VALUE`` values and ``HOPPER_SCALE`` e8m0 scales (``num_warps=8``), wrapped in
``triton_kernels.tensor.Tensor``; on sm_90 vLLM also pins the process-wide opt_flags constraint ``split_k=1``.

What this module declares (see :mod:`moereplay.ops.base`):

- the schema: ``matmul_ogs``'s own parameters (``x, w, bias, routing_data, gather_indx, scatter_indx,
  precision_config, betas, gammas, out_alpha, y, fused_activation, epilogue``) followed by *process-state*
  pseudo-arguments — the triton_kernels opt_flags constraints in force for the call (``block_m``, ``block_k``,
  ``split_k``, ``num_stages``, ``fused_scatter``, ``is_persistent``, ``epilogue_subtile``, ``idle_sms``; ``None``
  = unconstrained, the library's heuristics choose) and ``num_warps`` (the kernel's warp count = the Hopper scale
  layout's; ``None`` = as laid out);
- mutation domains for those, with the rules read from ``_matmul_ogs.py`` / ``opt_flags*.py`` (a value outside
  gives verdict ``invalid``; Triton's compile-time refusals at run time become ``InvalidMutationError`` too);
- contracts for every tensor the kernel reads, including the tensors inside the opaque objects, named by path
  (``"precision_config.weight_scale.storage"``): see :meth:`MatmulOgsOp.contract_args`. The swizzled weight scales
  must hold ``ceil(K / block_k) · block_k`` bytes per row, because the Hopper kernel loads them unmasked; vLLM's
  prep leaves them at ``32 · ceil_even(K / 32)`` — at K = 2880 and block_k = 128, 64 bytes short per row;
- ``run``: plain specs → triton_kernels objects through the backend (sharing every tensor, so guard bands stay
  where the replay engine put them), opt_flags constraints set from the pseudo-arguments and restored afterwards;
- ``reference``: :func:`moereplay.reference.matmul_ogs.reference_matmul_ogs`, returned as a
  :class:`~moereplay.ops.base.ReferenceResult` with its ingredients and a row map (token, top-k slot, expert,
  tile of ``block_m`` rows).

Argument values may be triton_kernels objects, moereplay's plain specs (:mod:`moereplay.ops.ogs_codecs`), or the
format's ``CodecValue`` wrappers of their trees; every entry point normalises them first.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moereplay.errors import InvalidMutationError, ReferenceError_, ReplayError
from moereplay.format.codecs import register_codec
from moereplay.ops import ogs_codecs as codecs
from moereplay.ops import register_op
from moereplay.ops.base import (
    ArgKind,
    Args,
    ArgSpec,
    BoolDomain,
    ChoiceDomain,
    CoefficientSource,
    ContractViolation,
    DerivedArg,
    IntRangeDomain,
    KernelBackend,
    MutableArg,
    PredicateDomain,
    Reads,
    ReferenceResult,
    RowMap,
    Rule,
    TensorContract,
    check_contracts,
    tokens_by_activation_rows,
)
from moereplay.ops.ogs_codecs import (
    ActivationSpec,
    EpilogueSpec,
    GatherSpec,
    LayoutSpec,
    LayoutTensor,
    PrecisionSpec,
    RoutingSpec,
    ScatterSpec,
    TritonKernels,
    _torch_dtype,
)

NAME = "matmul_ogs"

MX_GROUP = 32
"""Elements per e8m0 scale (MXFP4 block)."""
HOPPER_FP4_BLOCK_K = 128
"""block_k the nvidia heuristics pick for 4-bit weights without native MXFP (``compute_block_k``)."""
TILE_BLOCK_M = (16, 32, 64, 128)
"""block_m values triton_kernels' routing prepares tile maps for on CUDA (``ExptData.block_pid_map`` keys)."""

CONSTRAINT_ARGS: tuple[str, ...] = (
    "block_m",
    "block_k",
    "split_k",
    "num_stages",
    "fused_scatter",
    "is_persistent",
    "epilogue_subtile",
    "idle_sms",
)
"""Pseudo-arguments that are triton_kernels opt_flags constraints (``update_opt_flags_constraints`` keys that the
nvidia heuristics accept)."""
PROCESS_ARGS: tuple[str, ...] = (*CONSTRAINT_ARGS, "num_warps")

_OPAQUE_CODECS: dict[str, codecs.TreeCodec] = {
    "w": codecs.WEIGHT,
    "routing_data": codecs.ROUTING,
    "gather_indx": codecs.GATHER,
    "scatter_indx": codecs.SCATTER,
    "precision_config": codecs.PRECISION,
    "fused_activation": codecs.ACTIVATION,
    "epilogue": codecs.EPILOGUE,
}


def _arg(name: str, kind: ArgKind, description: str, *, optional: bool = True, codec: Any = None) -> ArgSpec:
    return ArgSpec(
        name,
        kind,
        optional=optional,
        description=description,
        codec=codec,
        default=None,
        has_default=optional,
    )


ARGUMENTS: tuple[ArgSpec, ...] = (
    _arg("x", ArgKind.TENSOR, "activations [M, K] (bf16 for Hopper MXFP4)", optional=False),
    _arg("w", ArgKind.OPAQUE, "weights [E, K, N]: torch tensor or layout-wrapped Tensor", optional=False,
         codec=codecs.WEIGHT),
    _arg("bias", ArgKind.TENSOR, "per-expert bias [E, N] (vLLM: fp32)"),
    _arg("routing_data", ArgKind.OPAQUE, "RoutingData: expert histogram, offsets, tile maps", codec=codecs.ROUTING),
    _arg("gather_indx", ArgKind.OPAQUE, "GatherIndx: expert-sorted row -> flat (token, slot)", codec=codecs.GATHER),
    _arg("scatter_indx", ArgKind.OPAQUE, "ScatterIndx: flat (token, slot) <-> expert-sorted row",
         codec=codecs.SCATTER),
    _arg("precision_config", ArgKind.OPAQUE, "PrecisionConfig: swizzled weight scales, flex data",
         codec=codecs.PRECISION),
    _arg("betas", ArgKind.TENSOR, "per-row bias multipliers (expert-sorted)"),
    _arg("gammas", ArgKind.TENSOR, "per-row output multipliers (expert-sorted; vLLM: the routing weights)"),
    _arg("out_alpha", ArgKind.SCALAR, "output multiplier"),
    _arg("y", ArgKind.TENSOR, "output buffer [batch (1 for 2-D x), rows, N / reduction_n]"),
    _arg("fused_activation", ArgKind.OPAQUE, "FusedActivation (gpt-oss: swiglu alpha, limit)",
         codec=codecs.ACTIVATION),
    _arg("epilogue", ArgKind.OPAQUE, "Epilogue device function", codec=codecs.EPILOGUE),
    _arg("block_m", ArgKind.SCALAR, "opt_flags constraint: rows per tile"),
    _arg("block_k", ArgKind.SCALAR, "opt_flags constraint: K per step"),
    _arg("split_k", ArgKind.SCALAR, "opt_flags constraint: K splits (vLLM pins 1 on Hopper)"),
    _arg("num_stages", ArgKind.SCALAR, "opt_flags constraint: software pipeline stages"),
    _arg("fused_scatter", ArgKind.FLAG, "opt_flags constraint: scatter in the GEMM epilogue"),
    _arg("is_persistent", ArgKind.FLAG, "opt_flags constraint: persistent TMA kernel"),
    _arg("epilogue_subtile", ArgKind.SCALAR, "opt_flags constraint: epilogue subtiles"),
    _arg("idle_sms", ArgKind.SCALAR, "opt_flags constraint: SMs a persistent kernel leaves idle"),
    _arg("num_warps", ArgKind.SCALAR, "warps per program = the Hopper scale layout's num_warps"),
)  # fmt: skip


def process_state(opt_flags: Any) -> dict[str, Any]:
    """The process-state pseudo-arguments of a call about to run: the opt_flags constraints now in force.

    ``opt_flags`` is the library's ``matmul_ogs_details.opt_flags`` module (the one ``matmul_ogs`` uses). The
    capture side merges this into the bound ``matmul_ogs`` arguments, so a replay reproduces the constraints
    (e.g. vLLM's ``split_k=1`` on Hopper); ``num_warps`` is ``None`` (as the scale layout says).
    """
    constraints = dict(getattr(opt_flags, "_opt_flags_constraints", {}) or {})
    state: dict[str, Any] = {name: constraints.get(name) for name in CONSTRAINT_ARGS}
    state["num_warps"] = None
    return state


# --------------------------------------------------------------------------------------------------------------
# normalising argument values
# --------------------------------------------------------------------------------------------------------------


def plain_value(name: str, value: Any) -> Any:
    """One argument as moereplay's plain spec (tensors shared, never copied); non-opaque values pass through."""
    codec = _OPAQUE_CODECS.get(name)
    if codec is None or value is None:
        return value
    if hasattr(value, "type_name") and hasattr(value, "value") and not isinstance(value, torch.Tensor):
        value = value.value  # a format CodecValue: its tree
    if isinstance(value, codec.plain_types):
        return value
    if isinstance(value, Mapping):
        return codec.decode_plain(value)
    return codec.to_plain(value)


def plain_args(args: Args) -> dict[str, Any]:
    """Every argument in plain form (see :func:`plain_value`)."""
    return {name: plain_value(name, value) for name, value in args.items()}


@dataclass(frozen=True)
class Problem:
    """The sizes of one call, from its (plain) arguments.

    ``rows``: rows the GEMM computes (gather length, else rows of x); ``experts``: E; ``k`` / ``n``: the logical
    weight shape; ``top_k``: ``n_expts_act``; ``reduction_n``: output columns = n / reduction_n; ``fp4``: MXFP4
    weights; ``value_layout`` / ``scale_layout``: layout kinds (STRIDED when plain); ``scale_warps``: the Hopper
    scale layout's num_warps.
    """

    rows: int
    experts: int
    k: int
    n: int
    top_k: int
    reduction_n: int
    fp4: bool
    value_layout: str
    scale_layout: str | None
    scale_warps: int | None
    has_gather: bool
    has_scatter: bool
    has_activation: bool
    has_epilogue: bool


def _weight_kn(w: Any) -> tuple[int, int, int, bool, str]:
    """(E, K, N, fp4, layout kind) of a plain weight."""
    if isinstance(w, LayoutTensor):
        shape = w.shape
        fp4 = w.dtype == codecs.LOGICAL_FP4
        kind = w.layout.kind
    elif isinstance(w, torch.Tensor):
        shape = tuple(w.shape)
        fp4 = w.dtype == torch.uint8
        if fp4:
            packed = list(w.stride()).index(1) if 1 in w.stride() else w.ndim - 1
            shape = tuple(s * 2 if i == packed else s for i, s in enumerate(shape))
        kind = "STRIDED"
    else:
        raise ReplayError(f"matmul_ogs weight is a {type(w).__name__}, not a tensor")
    if len(shape) not in (2, 3):
        raise ReplayError(f"matmul_ogs weight has shape {shape}; expected [E, K, N] or [K, N]")
    experts = shape[0] if len(shape) == 3 else 1
    return experts, int(shape[-2]), int(shape[-1]), fp4, kind


def problem_of(args: Args) -> Problem:
    """Sizes of the call (cheap: metadata only)."""
    plain = plain_args(args)
    x = plain.get("x")
    if not isinstance(x, torch.Tensor):
        raise ReplayError("matmul_ogs call has no tensor x")
    experts, k, n, fp4, value_layout = _weight_kn(plain.get("w"))
    gather: GatherSpec | None = plain.get("gather_indx")
    routing: RoutingSpec | None = plain.get("routing_data")
    precision: PrecisionSpec | None = plain.get("precision_config")
    activation: ActivationSpec | None = plain.get("fused_activation")
    epilogue: EpilogueSpec | None = plain.get("epilogue")
    scale = precision.weight_scale if precision is not None else None
    scale_layout = None
    scale_warps = None
    if isinstance(scale, LayoutTensor):
        scale_layout = scale.layout.kind
        scale_warps = scale.layout.num_warps
    elif isinstance(scale, torch.Tensor):
        scale_layout = "STRIDED"
    rows = int(gather.src_indx.shape[0]) if gather is not None else int(x.shape[-2])
    return Problem(
        rows=rows,
        experts=experts,
        k=k,
        n=n,
        top_k=routing.n_expts_act if routing is not None else 1,
        reduction_n=activation.reduction_n if activation is not None else 1,
        fp4=fp4,
        value_layout=value_layout,
        scale_layout=scale_layout,
        scale_warps=scale_warps,
        has_gather=gather is not None,
        has_scatter=plain.get("scatter_indx") is not None,
        has_activation=activation is not None and not activation.specs.is_default,
        has_epilogue=epilogue is not None and not epilogue.specs.is_default,
    )


def _next_power_of_2(value: int) -> int:
    return 1 if value <= 1 else 1 << (value - 1).bit_length()


def predicted_block_m(args: Args) -> int:
    """block_m as the nvidia heuristics choose it (``max(16, min(next_pow2(rows / E), 128))``) unless constrained."""
    chosen = args.get("block_m")
    if chosen:
        return int(chosen)
    problem = problem_of(args)
    routing = plain_value("routing_data", args.get("routing_data"))
    if routing is None:
        tokens_per_expert = problem.rows
    elif routing.expected_tokens_per_expt is not None:
        tokens_per_expert = routing.expected_tokens_per_expt
    else:
        tokens_per_expert = max(1, problem.rows // routing.n_expts_tot)
    return max(16, min(_next_power_of_2(tokens_per_expert), 128))


def predicted_block_k(args: Args) -> int | None:
    """block_k of the nvidia heuristics for this call unless constrained; ``None`` where it needs the device.

    4-bit weights without native MXFP (every Hopper-laid-out weight) get 128; wider weights
    ``max(32, min(next_pow2(K), 1024 // narrowest bit width))``. Native MXFP (Blackwell) may cap it differently.
    """
    chosen = args.get("block_k")
    if chosen is not None:
        return int(chosen)
    problem = problem_of(args)
    if (
        problem.fp4
        and problem.value_layout in ("HOPPER_VALUE", "STRIDED")
        and problem.scale_layout != ("BLACKWELL_SCALE")
    ):
        return HOPPER_FP4_BLOCK_K
    x = args.get("x")
    if not isinstance(x, torch.Tensor) or problem.fp4:
        return None
    plain_w = plain_value("w", args.get("w"))
    w_bits = (
        (plain_w.torch_dtype or torch.uint8).itemsize * 8
        if isinstance(plain_w, LayoutTensor)
        else (plain_w.dtype.itemsize * 8)
    )
    narrowest = min(x.dtype.itemsize * 8, w_bits)
    return max(32, min(_next_power_of_2(problem.k), 1024 // narrowest))


# --------------------------------------------------------------------------------------------------------------
# mutation domains
# --------------------------------------------------------------------------------------------------------------


def _routing_blocks(args: Args) -> tuple[int, ...] | None:
    routing = plain_value("routing_data", args.get("routing_data"))
    if routing is None or routing.expt_data is None or routing.expt_data.block_pid_map is None:
        return None
    return routing.expt_data.block_sizes


def _block_m_prepared(value: Any, args: Args) -> bool:
    blocks = _routing_blocks(args)
    return blocks is None or value in blocks


def _scale_layout(args: Args) -> str | None:
    precision = plain_value("precision_config", args.get("precision_config"))
    scale = None if precision is None else precision.weight_scale
    if isinstance(scale, LayoutTensor):
        return scale.layout.kind
    return None if scale is None else "STRIDED"


def _value_layout(args: Args) -> str:
    w = plain_value("w", args.get("w"))
    return w.layout.kind if isinstance(w, LayoutTensor) else "STRIDED"


def _block_k_fits_scale_swizzle(value: Any, args: Args) -> bool:
    return _scale_layout(args) != "HOPPER_SCALE" or value % (2 * MX_GROUP) == 0


def _block_k_fits_mx(value: Any, args: Args) -> bool:
    return _scale_layout(args) is None or value % MX_GROUP == 0


def _fused_scatter_possible(value: Any, args: Args) -> bool:
    if not value:
        return True
    routing = plain_value("routing_data", args.get("routing_data"))
    activation = plain_value("fused_activation", args.get("fused_activation"))
    epilogue = plain_value("epilogue", args.get("epilogue"))
    return (
        args.get("scatter_indx") is not None
        and (activation is None or activation.specs.is_default)
        and (epilogue is None or epilogue.specs.is_default)
        and (routing is None or routing.n_expts_act == 1)
        and args.get("split_k") in (None, 1)
    )


def _split_k_allows_fused_scatter(value: Any, args: Args) -> bool:
    return value == 1 or not args.get("fused_scatter")


def _persistent_possible(value: Any, args: Args) -> bool:
    if value:
        return _value_layout(args) != "HOPPER_VALUE"
    return _scale_layout(args) not in ("BLACKWELL_SCALE",)


def _warps_match_layout(value: Any, args: Args) -> bool:
    return _scale_layout(args) == "HOPPER_SCALE"


MUTABLE: tuple[MutableArg, ...] = (
    MutableArg(
        "block_m",
        PredicateDomain(
            ChoiceDomain(TILE_BLOCK_M, "the block sizes triton_kernels' routing prepares tile maps for"),
            (Rule(_block_m_prepared, "the routing data holds no tile map for block_m={value}"),),
        ),
        "rows per tile; the tile map of that size is taken from routing_data.expt_data",
    ),
    MutableArg(
        "block_k",
        PredicateDomain(
            ChoiceDomain((32, 64, 128, 256), "K per step"),
            (
                Rule(_block_k_fits_mx, "block_k={value} is not a multiple of the 32-element MX block"),
                Rule(
                    _block_k_fits_scale_swizzle,
                    "block_k={value}: the Hopper scale unswizzle needs an even number of 32-wide scale groups per "
                    "K step (block_k a multiple of 64)",
                ),
            ),
        ),
        "K per step; with Hopper scales a K that is not a multiple of it makes the kernel over-read the scales",
    ),
    MutableArg(
        "split_k",
        PredicateDomain(
            IntRangeDomain(1, 16),
            (
                Rule(
                    _split_k_allows_fused_scatter, "split_k={value} > 1 cannot be combined with fused_scatter"
                ),
            ),
        ),
        "K splits (fp32 scratchpad, activation moves to the reduction)",
    ),
    MutableArg(
        "num_stages", IntRangeDomain(1, 8), "pipeline stages (too many for shared memory: invalid at run)"
    ),
    MutableArg(
        "fused_scatter",
        PredicateDomain(
            BoolDomain(),
            (
                Rule(
                    _fused_scatter_possible,
                    "fused scatter needs a scatter, n_expts_act == 1, split_k == 1 and no fused activation/epilogue",
                ),
            ),
        ),
        "scatter rows in the GEMM epilogue instead of a grouped reduction",
    ),
    MutableArg(
        "is_persistent",
        PredicateDomain(
            BoolDomain(),
            (
                Rule(
                    _persistent_possible,
                    "is_persistent={value}: Hopper MXFP4 weights cannot use TMA (persistent kernel); native MXFP "
                    "(Blackwell scales) needs it",
                ),
            ),
        ),
        "persistent TMA kernel",
    ),
    MutableArg("epilogue_subtile", ChoiceDomain((1, 2, 4), "epilogue subtiles"), "epilogue subtiles"),
    MutableArg(
        "num_warps",
        PredicateDomain(
            ChoiceDomain((4, 8), "block_n = 128 / 256 must be a multiple of 32·num_warps"),
            (
                Rule(
                    _warps_match_layout,
                    "num_warps is fixed by the weight-scale layout; only Hopper-swizzled scales can be re-laid out",
                ),
            ),
        ),
        "warps per program; re-swizzles the Hopper weight scales for that warp count (a fresh tensor)",
    ),
)

DERIVED: tuple[DerivedArg, ...] = (
    DerivedArg(
        "precision_config",
        ("num_warps",),
        "the Hopper weight scales are re-swizzled for the new warp count (the swizzle is a handshake with it)",
    ),
)


def relayout_scales(precision: PrecisionSpec, num_warps: int) -> PrecisionSpec:
    """``precision`` with its Hopper-swizzled weight scales re-laid out for ``num_warps`` (pure torch, any device).

    Unswizzles with the old warp count and swizzles with the new one (moereplay's own implementation of the
    layout, checked against triton_kernels' on the GPU). The new storage is a fresh tensor.
    """
    from moereplay.reference.hopper_mxfp4 import swizzle_hopper_scales, unswizzle_hopper_scales

    scale = precision.weight_scale
    if not isinstance(scale, LayoutTensor) or scale.layout.kind != "HOPPER_SCALE":
        raise InvalidMutationError("num_warps can only change Hopper-swizzled weight scales")
    layout = scale.layout
    if layout.num_warps == num_warps:
        return precision
    assert layout.mx_axis is not None and layout.num_warps is not None
    initial = layout.initial_shape
    mx_axis = layout.mx_axis - len(initial) if layout.mx_axis >= 0 else layout.mx_axis
    plain = unswizzle_hopper_scales(scale.storage, initial, mx_axis, layout.num_warps)
    storage = swizzle_hopper_scales(plain, mx_axis, num_warps)
    new_layout = dataclasses.replace(layout, num_warps=num_warps)
    new_scale = dataclasses.replace(scale, storage=storage, layout=new_layout)
    return dataclasses.replace(precision, weight_scale=new_scale)


# --------------------------------------------------------------------------------------------------------------
# contracts
# --------------------------------------------------------------------------------------------------------------


def _problem_or_none(args: Args) -> Problem | None:
    try:
        return problem_of(args)
    except ReplayError:
        return None


def _x_dtypes(args: Args) -> tuple[torch.dtype, ...]:
    if _value_layout(args) == "HOPPER_VALUE":
        return (torch.bfloat16,)
    return (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)


def _batch(args: Args) -> int | None:
    """The batch of a batched call (3-D ``x``: one GEMM per batch entry, no routing), else ``None``."""
    x = args.get("x")
    return int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() == 3 else None


def _x_shape(args: Args) -> tuple[int | None, ...] | None:
    problem = _problem_or_none(args)
    if problem is None:
        return None
    return (None, problem.k) if _batch(args) is None else (None, None, problem.k)


def _bias_shape(args: Args) -> tuple[int | None, ...] | None:
    problem = _problem_or_none(args)
    return None if problem is None else (problem.experts, problem.n)


def _sorted_rows(args: Args) -> int | None:
    problem = _problem_or_none(args)
    return None if problem is None else problem.rows


def _output_rows(problem: Problem, args: Args) -> int:
    scatter = plain_value("scatter_indx", args.get("scatter_indx"))
    if scatter is None or problem.top_k == 1:
        return problem.rows
    return int(scatter.src_indx.shape[0]) // problem.top_k


def _y_shape(args: Args) -> tuple[int | None, ...] | None:
    """``init_allocation``'s output shape, which ``apply_allocation`` asserts ``y`` has: ``[batch, rows, N /
    reduction_n]`` with batch = ``x.shape[0]`` for a 3-D ``x``, else 1 (what ``matmul_ogs`` returns for a 2-D
    ``x`` is that buffer without its leading 1)."""
    problem = _problem_or_none(args)
    if problem is None:
        return None
    return (_batch(args) or 1, _output_rows(problem, args), problem.n // problem.reduction_n)


def _y_dtype(args: Args) -> torch.dtype | None:
    precision = plain_value("precision_config", args.get("precision_config"))
    if precision is not None and precision.out_dtype is not None:
        return _torch_dtype(precision.out_dtype)
    x = args.get("x")
    return x.dtype if isinstance(x, torch.Tensor) else None


def _experts(args: Args) -> int | None:
    problem = _problem_or_none(args)
    return None if problem is None else problem.experts


def _value_storage_shape(args: Args) -> tuple[int | None, ...] | None:
    w = plain_value("w", args.get("w"))
    if not isinstance(w, LayoutTensor) or w.layout.kind != "HOPPER_VALUE":
        return None
    from moereplay.reference.hopper_mxfp4 import HopperValueShape

    layout = w.layout
    assert layout.mx_axis is not None
    mx_axis = layout.mx_axis - len(layout.initial_shape) if layout.mx_axis >= 0 else layout.mx_axis
    return HopperValueShape(layout.initial_shape, mx_axis, layout.mma_version or 3).swizzled


def scale_bytes_read(args: Args) -> int | None:
    """Bytes the Hopper kernel loads from the start of each swizzled scale row: ``ceil(K / block_k) · block_k``.

    ``None`` when the scales are not Hopper-swizzled or block_k is unknown.
    """
    if _scale_layout(args) != "HOPPER_SCALE":
        return None
    problem = _problem_or_none(args)
    block_k = predicted_block_k(args)
    if problem is None or block_k is None:
        return None
    return -(-problem.k // block_k) * block_k


def _scale_storage_shape(args: Args) -> tuple[int | None, ...] | None:
    """The swizzled scale view ``[E, row bytes, rows]`` must have at least :func:`scale_bytes_read` row bytes."""
    precision = plain_value("precision_config", args.get("precision_config"))
    scale = None if precision is None else precision.weight_scale
    needed = scale_bytes_read(args)
    if not isinstance(scale, LayoutTensor) or needed is None:
        return None
    shape = tuple(scale.storage.shape)
    transposed = scale.storage.dim() >= 2 and scale.storage.stride(-2) == 1
    k_axis = len(shape) - 2 if transposed else len(shape) - 1
    have = shape[k_axis]
    wanted = list(shape)
    wanted[k_axis] = max(have, needed)
    return tuple(wanted)


def _offsets_len(args: Args) -> int | None:
    experts = _experts(args)
    return None if experts is None else experts + 1


_INDEX = (torch.int32, torch.int64, torch.int16)
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)

CONTRACTS: tuple[TensorContract, ...] = (
    TensorContract(
        "x",
        read_as=lambda args: args["x"].dtype if isinstance(args.get("x"), torch.Tensor) else None,
        host_checked=True,
        accepted=_x_dtypes,
        shape=_x_shape,
        contiguous=False,
        note="rows × K, any row stride; Hopper MXFP4 upcasts weights to bf16 and needs bf16 activations "
        "(a compile-time assert)",
        leading="row",
    ),
    TensorContract(
        "w.storage",
        read_as=lambda args: torch.uint8,
        host_checked=False,
        accepted=lambda args: (torch.uint8,) if _value_layout(args) == "HOPPER_VALUE" else (),
        shape=_value_storage_shape,
        contiguous=False,
        required=False,
        note="HOPPER_VALUE storage: a transposed view of a contiguous [E, 2·K_pad, N_pad/4] block; loads are masked "
        "along K",
        leading="expert",
    ),
    TensorContract(
        "bias",
        read_as=lambda args: args["bias"].dtype if isinstance(args.get("bias"), torch.Tensor) else None,
        host_checked=False,
        accepted=lambda args: _FLOATS,
        shape=_bias_shape,
        contiguous=True,
        required=False,
        note="indexed as bias + expert·stride(0) + column: the column stride must be 1; vLLM asserts fp32",
        leading="expert",
    ),
    TensorContract(
        "betas",
        read_as=lambda args: args["betas"].dtype if isinstance(args.get("betas"), torch.Tensor) else None,
        host_checked=False,
        accepted=lambda args: _FLOATS,
        numel=_sorted_rows,
        required=False,
        note="one multiplier per expert-sorted row, indexed densely",
    ),
    TensorContract(
        "gammas",
        read_as=lambda args: args["gammas"].dtype if isinstance(args.get("gammas"), torch.Tensor) else None,
        host_checked=False,
        accepted=lambda args: _FLOATS,
        numel=_sorted_rows,
        required=False,
        note="one multiplier per expert-sorted row (vLLM passes routing_data.gate_scal), indexed densely",
    ),
    TensorContract(
        "y",
        read_as=_y_dtype,
        host_checked=True,
        shape=_y_shape,
        required=False,
        note="matmul_ogs asserts the shape [batch, rows, N / reduction_n] (batch 1 unless x is 3-D)",
        host_checks=frozenset({"dtype", "shape", "device", "presence"}),
    ),
    TensorContract(
        "gather_indx.src_indx",
        read_as=lambda args: torch.int32,
        host_checked=False,
        accepted=lambda args: _INDEX,
        numel=_sorted_rows,
        required=False,
        note="expert-sorted row -> flat (token, slot) index; divided by n_expts_act to find the x row",
    ),
    TensorContract(
        "scatter_indx.src_indx",
        read_as=lambda args: torch.int32,
        host_checked=False,
        accepted=lambda args: _INDEX,
        required=False,
        note="flat (token, slot) -> expert-sorted row (−1: none); grouped n_expts_act per token in the reduction",
    ),
    TensorContract(
        "routing_data.expt_data.hist",
        read_as=lambda args: torch.int32,
        host_checked=True,
        numel=_experts,
        required=False,
        note="rows per expert; ExptData asserts int32",
    ),
    TensorContract(
        "routing_data.expt_data.token_offs_raw",
        read_as=lambda args: torch.int32,
        host_checked=True,
        numel=_offsets_len,
        required=False,
        note="first expert-sorted row of each expert",
    ),
    TensorContract(
        "routing_data.expt_data.block_pid_map[block_m]",
        read_as=lambda args: torch.int32,
        host_checked=True,
        required=False,
        note="the tile map of the block_m in use: one (block << 16 | expert) or −1 per program; the kernel reads "
        "n_blocks(rows, block_m) entries",
    ),
    TensorContract(
        "precision_config.weight_scale.storage",
        read_as=lambda args: torch.uint8,
        host_checked=False,
        accepted=lambda args: (torch.uint8, torch.float8_e8m0fnu),
        shape=_scale_storage_shape,
        contiguous=False,
        required=False,
        note="HOPPER_SCALE loads are unmasked: every swizzled row must hold ceil(K / block_k)·block_k bytes. "
        "Shorter rows make the last K step read the next row's first bytes (for the last expert's last row: the "
        "bytes after the allocation) as scales of masked-out zero weights — harmless if finite, NaN if the byte is "
        "0xff (the kernel upcasts e8m0 0xff to +Inf, and 0·Inf = NaN)",
        leading="expert",
        values=lambda args: torch.float8_e8m0fnu,
    ),
)


SCALE_STORAGE = "precision_config.weight_scale.storage"


def _scale_row_violation(violation: ContractViolation, args: Args) -> ContractViolation:
    """A short-scale-row shape violation restated as "the kernel reads N bytes per scale row, the tensor holds M"."""
    if violation.arg != SCALE_STORAGE or violation.aspect != "shape":
        return violation
    needed = scale_bytes_read(args)
    precision = plain_value("precision_config", args.get("precision_config"))
    scale = None if precision is None else precision.weight_scale
    if needed is None or not isinstance(scale, LayoutTensor) or scale.storage.dim() < 2:
        return violation
    storage = scale.storage
    transposed = storage.stride(-2) == 1
    have = int(storage.shape[-2] if transposed else storage.shape[-1])
    if have >= needed:
        return violation
    block_k = predicted_block_k(args)
    consequence = (
        f"the kernel reads {needed} bytes per scale row (ceil(K / block_k) · block_k with block_k={block_k}, "
        f"unmasked), the tensor holds {have}: the last K step of every row reads {needed - have} bytes beyond it "
        "(the next row's, and past the allocation for the last expert's last row) as scales of masked-out zero "
        "weights — harmless while finite, NaN where a byte is 0xff"
    )
    # every row's last K step reads into the next row; the last expert's last row reads past the allocation
    return dataclasses.replace(violation, consequence=consequence, reads_past_end=needed - have)


def contract_args(args: Args) -> dict[str, Any]:
    """``args`` plus every tensor inside the opaque ones under its path, for :data:`CONTRACTS`.

    Paths: ``w.storage``, ``precision_config.weight_scale.storage``, ``gather_indx.src_indx``,
    ``routing_data.expt_data.hist`` …, and the tile map in use as ``routing_data.expt_data.block_pid_map[block_m]``.
    """
    plain = plain_args(args)
    merged: dict[str, Any] = dict(args)
    for name, value in plain.items():
        if name in _OPAQUE_CODECS and value is not None and not isinstance(value, torch.Tensor):
            merged.update(codecs.tensor_leaves(value, name))
    routing = plain.get("routing_data")
    if isinstance(routing, RoutingSpec) and routing.expt_data is not None:
        block_m = predicted_block_m(args)
        maps = routing.expt_data.block_pid_map or {}
        if block_m in maps:
            merged["routing_data.expt_data.block_pid_map[block_m]"] = maps[block_m]
    return merged


# --------------------------------------------------------------------------------------------------------------
# row meaning
# --------------------------------------------------------------------------------------------------------------


def _histogram(routing: RoutingSpec) -> torch.Tensor | None:
    """Rows per expert: ``expt_data.hist``, else ``expt_hist``."""
    data = routing.expt_data
    hist = data.hist if data is not None and data.hist is not None else routing.expt_hist
    return hist if isinstance(hist, torch.Tensor) else None


def _tile_of_rows(routing: RoutingSpec | None, experts: torch.Tensor, block_m: int) -> torch.Tensor:
    """For expert-sorted rows: the program (tile) index that computes each row with ``block_m``."""
    blocks = torch.full_like(experts, -1)
    if routing is None or routing.expt_data is None:
        return blocks
    data = routing.expt_data
    hist = _histogram(routing)
    if hist is None:
        return blocks
    counts = hist.reshape(-1).to(torch.int64).cpu()
    if data.token_offs_raw is not None:
        starts = data.token_offs_raw.reshape(-1).to(torch.int64).cpu()[: counts.numel()]
    else:
        starts = torch.cumsum(counts, 0) - counts
    tiles = -(-counts // block_m)
    first_tile = torch.cumsum(tiles, 0) - tiles
    valid = experts >= 0
    e = experts.clamp(min=0)
    position = torch.arange(experts.numel(), dtype=torch.int64) - starts[e]
    return torch.where(valid, first_tile[e] + position // block_m, blocks)


def _row_map(reference: Any, plain: Mapping[str, Any], block_m: int) -> RowMap:
    """moereplay's row map from the reference's (token, slot, expert), plus the tile (program) of each row.

    Tiles are known for rows computed by one program: expert-sorted rows, and fused-scatter rows (the tile of the
    sorted row they receive); a grouped top-k sum has none.
    """
    rows = reference.row_map
    kind = rows.kind.value
    routing: RoutingSpec | None = plain.get("routing_data")
    token = rows.token.to(torch.int64).cpu()
    expert = rows.expert.to(torch.int64).cpu()
    slot = rows.slot.to(torch.int64).cpu()
    block = torch.full_like(token, -1)
    if kind == "expert_sorted":
        block = _tile_of_rows(routing, expert, block_m)
    elif kind == "scattered":
        scatter: ScatterSpec | None = plain.get("scatter_indx")
        sorted_blocks = _tile_of_rows(routing, reference.sorted_expert.to(torch.int64).cpu(), block_m)
        if scatter is not None:
            source = scatter.src_indx.to(torch.int64).cpu()[: token.numel()]
            has_source = (source >= 0) & (source < sorted_blocks.numel())
            picked = sorted_blocks[source.clamp(0, max(sorted_blocks.numel() - 1, 0))]
            block[: source.numel()] = torch.where(has_source, picked, -1)
    return RowMap(token=token, expert=expert, slot=slot, block=block)


# --------------------------------------------------------------------------------------------------------------
# the op
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChosenFlags:
    """The opt_flags triton_kernels chose for the last run (diagnostics: ``MatmulOgsOp.last_flags``)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    is_persistent: bool
    fused_scatter: bool
    even_k: bool


RECORDED_FLAGS = "opt_flags"
"""The call output under which the capture records the flags make_opt_flags chose
(:mod:`moereplay.ops.ogs_process_state`)."""

STATE_PINS: Mapping[str, str] = types.MappingProxyType(
    {name: name for name in ("block_m", "block_k", "split_k", "num_stages", "is_persistent", "fused_scatter")}
)
"""Chosen opt_flags a replay can pin through the constraint pseudo-argument of the same name (num_warps is not
one: changing it re-swizzles the scales)."""

_REFUSALS = ("InapplicableConstraint", "OutOfResources", "CompilationError")
"""Exception class names with which triton_kernels / Triton refuse a configuration (→ verdict ``invalid``)."""


class MatmulOgsOp:
    """The :class:`~moereplay.ops.base.OpSpec` of ``matmul_ogs`` (one instance, registered as ``"matmul_ogs"``)."""

    name = NAME
    arguments = ARGUMENTS
    mutable = MUTABLE
    derived = DERIVED
    contracts = CONTRACTS
    scratch: tuple[str, ...] = ("y",)
    output_name = "y"
    reference_ignores: frozenset[str] = frozenset(
        {"block_k", "num_stages", "num_warps", "epilogue_subtile", "idle_sms", "is_persistent", "y"}
    )
    state_pins: Mapping[str, str] = STATE_PINS

    def __init__(self) -> None:
        self.last_flags: ChosenFlags | None = None

    # ------------------------------------------------------------------------------------------ process state

    def run_state(self) -> dict[str, Any]:
        """The opt_flags the last :meth:`run` chose (``{}`` before a run, or when make_opt_flags was not called)."""
        if self.last_flags is None:
            return {}
        chosen = dataclasses.asdict(self.last_flags)
        chosen.pop("even_k", None)  # derived here, not a flag of triton_kernels'
        return chosen

    def recorded_state(self, outputs: Mapping[str, Any], context: Mapping[Any, Any]) -> dict[str, Any] | None:
        """The opt_flags the recorded call chose (the capture's ``opt_flags`` output), ``None`` when not recorded.

        A manual ``set_opt_flags`` override in force at capture (the context's ``opt_flags_override``) is what
        make_opt_flags returned, so it stands in for flags that were not recorded."""
        chosen = outputs.get(RECORDED_FLAGS)
        if not isinstance(chosen, Mapping):
            chosen = context.get("opt_flags_override")
        if not isinstance(chosen, Mapping):
            return None
        return {
            str(key): value for key, value in chosen.items() if isinstance(value, (bool, int, float, str))
        }

    def rederive_routing(self, args: Args) -> dict[str, Any]:
        """``args`` with the routing metadata re-derived from the histogram and the gather/scatter indices
        (:func:`moereplay.ops.ogs_shapes.rederived_routing`)."""
        from moereplay.ops.ogs_shapes import rederived_routing

        return rederived_routing(args)

    # ------------------------------------------------------------------------------------------ schema helpers

    def contract_args(self, args: Args) -> dict[str, Any]:
        return contract_args(args)

    def reads(self, args: Args) -> Reads:
        """Experts with rows in the routing histogram, and the rows of ``x`` the call reads: through the gather
        index, token ``src // n_expts_act`` of each of the first ``sum(hist)`` sorted rows; without it, the
        sorted rows ``0 … sum(hist) - 1`` themselves. Nothing known for a call without routing data."""
        routing = plain_value("routing_data", args.get("routing_data"))
        if not isinstance(routing, RoutingSpec):
            return Reads()
        hist = _histogram(routing)
        if hist is None:
            return Reads()
        counts = hist.reshape(-1).to("cpu", torch.long)
        experts = frozenset(torch.nonzero(counts > 0).flatten().tolist())
        active = int(counts.sum())
        gather = plain_value("gather_indx", args.get("gather_indx"))
        source = getattr(gather, "src_indx", None) if gather is not None else None
        if gather is None:
            return Reads(experts, frozenset(range(active)))
        if isinstance(source, torch.Tensor) and routing.n_expts_act > 0:
            ids = source.reshape(-1)[:active].to("cpu", torch.long)
            rows = torch.div(ids, routing.n_expts_act, rounding_mode="trunc")  # C-style: a -1 reads row 0
            return Reads(experts, frozenset(rows[rows >= 0].tolist()))
        return Reads(experts, None)

    def layer_tokens(self, args: Args, rows: RowMap, batch: int) -> torch.Tensor | None:
        """The layer token of each output row. With a scatter the output's rows are the layer's tokens (the
        row map says which; a call whose output is not ``batch`` rows is not that batch's); otherwise the row
        map's ``token`` is a row of ``x`` — through the gather index, the layer's tokens themselves."""
        if not bool((rows.token >= 0).any()):  # expert-sorted rows without a gather: no row names its token
            return None
        if args.get("scatter_indx") is not None:
            return rows.token.to(torch.int64) if rows.rows == batch else None
        return tokens_by_activation_rows(rows.token, args.get("x"), batch)

    def check(self, args: Args, *, check_device: bool = True) -> list[ContractViolation]:
        """Every contract violation of a call, including the tensors inside its opaque arguments.

        The swizzled scale rows' shortfall is stated in bytes (what the unmasked load reads against what a row
        holds), the terms in which the over-read shows up in replay's guard bands.
        """
        violations = check_contracts(self.contracts, contract_args(args), check_device=check_device)
        return [_scale_row_violation(violation, args) for violation in violations]

    def tensor_leaves(self, args: Args) -> dict[str, torch.Tensor]:
        """Every tensor the call holds, by path (top-level names and ``arg.field…`` inside opaque ones)."""
        out: dict[str, torch.Tensor] = {}
        for name, value in plain_args(args).items():
            out.update(codecs.tensor_leaves(value, name))
        return out

    def replace_tensor_leaves(self, args: Args, replacements: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Plain ``args`` with the tensors at the given paths swapped (e.g. for guarded copies)."""
        return {
            name: codecs.replace_tensor_leaves(value, name, replacements)
            for name, value in plain_args(args).items()
        }

    def rederive(self, args: Args, changed: frozenset[str]) -> dict[str, Any]:
        out = dict(args)
        if "num_warps" in changed and args.get("num_warps") is not None:
            precision = plain_value("precision_config", args.get("precision_config"))
            if precision is not None:
                out["precision_config"] = relayout_scales(precision, int(args["num_warps"]))
        return out

    def shape_dimensions(self, args: Args) -> list[Any]:
        """Shrinkable dimensions for the shape bisection (:mod:`moereplay.ops.ogs_shapes`; the bisection reads
        their ``name``, ``values``, ``original`` and ``modulus``)."""
        from moereplay.ops.ogs_shapes import shape_dimensions

        return list(shape_dimensions(args))

    def shrink(self, args: Args, shape: Mapping[str, int]) -> dict[str, Any]:
        """A valid call of ``shape`` made from this one (:mod:`moereplay.ops.ogs_shapes`)."""
        from moereplay.ops.ogs_shapes import shrink

        return shrink(args, shape)

    def make_scratch(self, args: Args, device: torch.device) -> dict[str, Any]:
        y = args.get("y")
        if not isinstance(y, torch.Tensor):
            return {"y": None}
        return {"y": torch.zeros(y.shape, dtype=y.dtype, device=device)}

    # ------------------------------------------------------------------------------------------ running

    def library_args(self, args: Args, library: TritonKernels) -> dict[str, Any]:
        """The call's ``matmul_ogs`` keyword arguments as triton_kernels objects (tensors shared)."""
        plain = plain_args(args)
        warps = args.get("num_warps")
        precision = plain.get("precision_config")
        if warps is not None and isinstance(precision, PrecisionSpec):
            plain["precision_config"] = relayout_scales(precision, int(warps))
        out: dict[str, Any] = {}
        for spec in ARGUMENTS:
            if spec.name in PROCESS_ARGS:
                continue
            value = plain.get(spec.name)
            codec = _OPAQUE_CODECS.get(spec.name)
            out[spec.name] = codec.to_library(value, library) if codec is not None else value
        return out

    def run(self, args: Args, backend: KernelBackend) -> torch.Tensor:
        library = TritonKernels.from_backend(backend)
        return self.run_with(args, library)

    def run_with(self, args: Args, library: TritonKernels) -> torch.Tensor:
        """``run`` with an already resolved library (tests on a machine where triton_kernels is importable)."""
        matmul = library.module("matmul_ogs")
        opt_flags = library.module("matmul_ogs_details.opt_flags")
        call = self.library_args(args, library)
        constraints = {name: args[name] for name in CONSTRAINT_ARGS if args.get(name) is not None}
        saved_constraints = dict(opt_flags._opt_flags_constraints)
        saved_flags = getattr(opt_flags, "_opt_flags", None)
        original = getattr(matmul, "make_opt_flags")  # noqa: B009 - a module global we wrap and restore
        chosen: list[Any] = []

        def recording(*positional: Any, **keywords: Any) -> Any:
            flags = original(*positional, **keywords)
            chosen.append(flags)
            return flags

        self.last_flags = None
        try:
            opt_flags.reset_opt_flags_constraints()
            setattr(opt_flags, "_opt_flags", None)  # noqa: B010 - a manual override would hide the constraints
            if constraints:
                opt_flags.update_opt_flags_constraints(constraints)
            setattr(matmul, "make_opt_flags", recording)  # noqa: B010 - matmul_ogs looks it up in its globals
            result = matmul.matmul_ogs(**call)
        except Exception as error:
            if type(error).__name__ in _REFUSALS or (isinstance(error, AssertionError) and not chosen):
                raise InvalidMutationError(
                    f"triton_kernels refuses this configuration (constraints {constraints}): "
                    f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                ) from error
            raise
        finally:
            setattr(matmul, "make_opt_flags", original)  # noqa: B010
            opt_flags.reset_opt_flags_constraints()
            opt_flags.update_opt_flags_constraints(saved_constraints)
            setattr(opt_flags, "_opt_flags", saved_flags)  # noqa: B010
        if chosen:
            flags = chosen[0]
            k = problem_of(args).k
            self.last_flags = ChosenFlags(
                block_m=int(flags.block_m),
                block_n=int(flags.block_n),
                block_k=int(flags.block_k),
                split_k=int(flags.split_k),
                num_warps=int(flags.num_warps),
                num_stages=int(flags.num_stages),
                is_persistent=bool(flags.is_persistent),
                fused_scatter=bool(flags.fused_scatter),
                even_k=k % int(flags.block_k) == 0,
            )
        return result

    # ------------------------------------------------------------------------------------------ reference

    def reference(self, args: Args) -> ReferenceResult:
        from moereplay.reference import matmul_ogs as ref

        plain = plain_args(args)
        call = _reference_arguments(plain)
        split_k = args.get("split_k")
        if split_k is None and self.last_flags is not None:
            split_k = self.last_flags.split_k
        try:
            result = ref.reference_matmul_ogs(**call, split_k=int(split_k or 1))
        except ReferenceError_:
            raise
        except (RuntimeError, ValueError, IndexError) as error:
            raise ReferenceError_(f"matmul_ogs reference failed: {error}") from error
        rows = _row_map(result, plain, predicted_block_m(args))
        terms, coefficients, sources = _ingredients(result, plain, call)
        return ReferenceResult(
            output=result.output,
            written=result.row_map.written.to(torch.bool).cpu(),
            rows=rows,
            terms=terms,
            coefficients=coefficients,
            sources=sources,
        )


# --------------------------------------------------------------------------------------------------------------
# plain specs -> the reference's mirrors
# --------------------------------------------------------------------------------------------------------------


def _reference_layout(spec: LayoutSpec) -> Any:
    from moereplay.reference import matmul_ogs as ref

    if spec.kind == "STRIDED":
        return ref.LayoutSpec()
    if spec.kind not in ("HOPPER_VALUE", "HOPPER_SCALE"):
        raise ReferenceError_(f"no reference for the {spec.kind} layout")
    return ref.LayoutSpec(
        name=spec.kind,
        initial_shape=spec.initial_shape,
        mx_axis=spec.mx_axis,
        num_warps=spec.num_warps or 8,
        mma_version=spec.mma_version or 3,
    )


def _reference_tensor(value: Any) -> Any:
    from moereplay.reference import matmul_ogs as ref

    if not isinstance(value, LayoutTensor):
        return value
    dtype: Any = ref.FP4 if value.dtype == codecs.LOGICAL_FP4 else value.torch_dtype
    if dtype is None:
        raise ReferenceError_(f"no reference for {value.dtype} tensors")
    return ref.TensorSpec(value.storage, _reference_layout(value.layout), value.shape, dtype)


def _reference_arguments(plain: Mapping[str, Any]) -> dict[str, Any]:
    from moereplay.reference import matmul_ogs as ref

    routing: RoutingSpec | None = plain.get("routing_data")
    precision: PrecisionSpec | None = plain.get("precision_config")
    activation: ActivationSpec | None = plain.get("fused_activation")
    epilogue: EpilogueSpec | None = plain.get("epilogue")
    gather: GatherSpec | None = plain.get("gather_indx")
    scatter: ScatterSpec | None = plain.get("scatter_indx")
    if epilogue is not None and not epilogue.specs.is_default:
        raise ReferenceError_(f"matmul_ogs epilogue {epilogue.specs.name!r} has no reference")
    ref_routing = None
    if routing is not None:
        expt = None
        if routing.expt_data is not None:
            expt = ref.ExptDataSpec(routing.expt_data.hist, routing.expt_data.token_offs_raw)
        ref_routing = ref.RoutingDataSpec(
            routing.gate_scal, routing.expt_hist, routing.n_expts_tot, routing.n_expts_act, expt
        )
    ref_precision = None
    if precision is not None:
        flex = precision.flex_ctx
        if (
            flex.lhs_data.dtype is not None
            or flex.rhs_data.dtype is not None
            or flex.out_data.dtype is not None
        ):
            raise ReferenceError_("flexpoint reinterpretation (flex dtype) has no reference")
        ref_precision = ref.PrecisionSpec(
            weight_scale=None
            if precision.weight_scale is None
            else _reference_tensor(precision.weight_scale),
            flex=ref.FlexSpec(flex.lhs_data.scale, flex.rhs_data.scale, flex.out_data.expected_scale),
            out_dtype=None if precision.out_dtype is None else _torch_dtype(precision.out_dtype),
            act_scale=precision.act_scale if isinstance(precision.act_scale, torch.Tensor) else None,
            out_scale=precision.out_scale if isinstance(precision.out_scale, torch.Tensor) else None,
            flexpoint_saturate_inf=precision.flexpoint_saturate_inf,
        )
        if isinstance(precision.act_scale, LayoutTensor) or isinstance(precision.out_scale, LayoutTensor):
            raise ReferenceError_("MX-scaled activations or outputs have no reference")
    ref_activation = None
    if activation is not None and not activation.specs.is_default:
        ref_activation = ref.ActivationSpec(
            activation.specs.name, tuple(activation.fn_args), activation.reduction_n
        )
    return {
        "x": plain["x"],
        "w": _reference_tensor(plain["w"]),
        "bias": plain.get("bias"),
        "routing_data": ref_routing,
        "gather_indx": None if gather is None else ref.GatherIndxSpec(gather.src_indx, gather.dst_indx),
        "scatter_indx": None if scatter is None else ref.ScatterIndxSpec(scatter.src_indx, scatter.dst_indx),
        "precision_config": ref_precision,
        "betas": plain.get("betas"),
        "gammas": plain.get("gammas"),
        "out_alpha": plain.get("out_alpha"),
        "fused_activation": ref_activation,
    }


def _ingredients(
    result: Any, plain: Mapping[str, Any], call: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, CoefficientSource]]:
    """Linear ingredients of the output rows, where the output is linear in them.

    - no fused activation, no grouped reduction (one output row per sorted row): ``gemm`` and ``bias``, each with
      coefficient ``gammas[p]`` (1 without gammas);
    - grouped top-k reduction without activation (gemm2): per top-k slot ``j``, ``gemm[slot j]`` and
      ``bias[slot j]`` of the sorted row summed into this token, coefficient ``gammas`` of that sorted row;
    - a fused activation is not linear: no ingredients (the findings then work on whole rows).
    """
    kind = result.row_map.kind.value
    activation = call.get("fused_activation")
    gammas = plain.get("gammas")
    if activation is not None:
        return {}, {}, {}
    gamma = result.gammas
    rows_out = result.output.shape[0]
    device = result.output.device
    read_as = gammas.dtype if isinstance(gammas, torch.Tensor) else torch.float32
    terms: dict[str, torch.Tensor] = {}
    coefficients: dict[str, torch.Tensor] = {}
    sources: dict[str, CoefficientSource] = {}
    if kind in ("expert_sorted", "dense", "scattered"):
        if kind == "scattered":
            return {}, {}, {}
        coefficient = gamma if gamma is not None else torch.ones(rows_out, device=device)
        index = (
            torch.arange(rows_out, dtype=torch.int64) if gamma is not None else torch.full((rows_out,), -1)
        )
        terms["gemm"] = result.gemm
        coefficients["gemm"] = coefficient.to(torch.float32)
        if gamma is not None:
            sources["gemm"] = CoefficientSource("gammas", index, read_as)
        if result.bias is not None:
            terms["bias"] = result.bias
            coefficients["bias"] = coefficient.to(torch.float32)
            if gamma is not None:
                sources["bias"] = CoefficientSource("gammas", index, read_as)
        return terms, coefficients, sources
    groups = result.row_map.sources
    if groups is None:
        return {}, {}, {}
    groups = groups.to(device)
    valid = groups >= 0
    picked = groups.clamp(min=0)
    for slot in range(groups.shape[1]):
        rows = picked[:, slot]
        mask = valid[:, slot]
        gemm = torch.where(mask[:, None], result.gemm[rows], torch.zeros_like(result.gemm[rows]))
        if gamma is not None:
            coefficient = torch.where(mask, gamma[rows], torch.zeros_like(gamma[rows]))
            index = torch.where(mask, rows, torch.full_like(rows, -1)).cpu()
        else:
            coefficient = mask.to(torch.float32)
            index = torch.full((rows_out,), -1, dtype=torch.int64)
        terms[f"gemm[slot {slot}]"] = gemm
        coefficients[f"gemm[slot {slot}]"] = coefficient.to(torch.float32)
        if gamma is not None:
            sources[f"gemm[slot {slot}]"] = CoefficientSource("gammas", index, read_as)
        if result.bias is not None:
            bias = torch.where(mask[:, None], result.bias[rows], torch.zeros_like(result.bias[rows]))
            terms[f"bias[slot {slot}]"] = bias
            coefficients[f"bias[slot {slot}]"] = coefficient.to(torch.float32)
            if gamma is not None:
                sources[f"bias[slot {slot}]"] = CoefficientSource("gammas", index, read_as)
    return terms, coefficients, sources


OP = MatmulOgsOp()
register_op(OP)
codecs.register_with_format(register_codec)
