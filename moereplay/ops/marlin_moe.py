"""``moe_wna16_marlin_gemm``: vLLM's Marlin MoE GEMM (``torch.ops._moe_C``), as of vLLM 0.25.1.

Facts, from the kernel sources (``csrc/libtorch_stable/moe/marlin_moe_wna16/ops.cu`` host code, ``marlin_template.h``,
the kernel generator; earlier ``csrc/moe/marlin_moe_wna16``) and the Python callers (``vllm/_custom_ops.py``,
``fused_moe/experts/marlin_moe.py``, which asserts float32 ``topk_weights`` before calling; the NVFP4 preparation in
``marlin_utils_fp4.py`` keeps the processed global scale in float32):

How the device code reads each pointer, and what the host code checks before launching:

==========================  ===============================  ==================================================
argument                    read by the kernel as            host check
==========================  ===============================  ==================================================
input (a)                   fp16/bf16 (or fp8/int8 + scales)  cuda, contiguous, (size_m, size_k); dtype == c's
output (c)                  c type (= a's for 16-bit a)       cuda, contiguous, (size_m*top_k, size_n)
b_qweight                   raw 16-byte vectors (int32)       cuda, contiguous, dim1 = size_k/16, size_n match
b_bias                      c type                            cuda, contiguous, size(1) == size_n — NOT dtype
b_scales                    c type; fp8 e4m3 / e8m0 for FP4   rank 3, dim2 == size_n; dtype only for FP4 types
a_scales                    float32                           dtype float32
global_scale                float32, one per expert           dtype float32; required for NVFP4
g_idx, perm                 int32                             cuda, contiguous, length — NOT dtype
workspace                   int32 lock counters (must be 0)   numel >= min(n_tiles * blocks, sms * 4)
sorted_token_ids            int32 (also as int4 vectors)      nothing
expert_ids                  int32                             nothing
num_tokens_past_padded      int32, element 0                  nothing
topk_weights                float32, flat by output row       nothing
==========================  ===============================  ==================================================

So ``topk_weights`` of another dtype is silently reinterpreted: each float32 load covers the bytes of
``4 / itemsize`` elements, and rows past ``numel * itemsize / 4`` read past the end of the tensor.

Some pointers are read only under the call's flags, and their contracts say so (``TensorContract.read_when``):
``topk_weights`` only with ``mul_topk_weights``; ``perm`` only with act order (``g_idx`` and ``perm`` both
non-empty), ``g_idx`` only with act order and ``is_k_full`` False; ``b_qzeros`` only when non-empty.

Semantics: work is ``num_tokens_past_padded / moe_block_size`` blocks; block ``b`` multiplies the rows named by
``sorted_token_ids[b*bs:(b+1)*bs]`` (ids ``< size_m*top_k``) by expert ``expert_ids[b]``. Output row ``id`` is
``(input[id // top_k] @ W[e] + bias[e]) * topk_weights[id]`` (the weight only with ``mul_topk_weights``). For NVFP4
with ``mul_topk_weights`` the kernel folds the per-expert ``global_scale`` into the routing weight instead of the
GEMM result. ``use_atomic_add`` accumulates split-K partial sums into ``output`` with atomics (needs it zeroed,
order-dependent rounding); ``use_fp32_reduce`` reduces partial sums in a float32 scratch the host allocates;
``is_k_full`` only matters with act order (``g_idx``/``perm``).

Launch configurations: ``moe_block_size`` ∈ {8, 16, 32, 48, 64} (host check: 8 or a multiple of 16 up to 64;
instantiated ``thread_m_blocks`` 0.5, 1, 2, 3, 4). Explicit ``thread_k``/``thread_n`` (both, or both -1 for the
kernel's own choice) must be an instantiated tile: for ``moe_block_size <= 16`` (128, 128), (64, 128), (128, 64);
for larger blocks (64, 256), (64, 128), (128, 64); ``thread_n | size_n`` and ``thread_k | size_k`` (host check), and
the pipeline must fit shared memory (host check). ``blocks_per_sm`` (default 1 with explicit tiles, ignored
otherwise) multiplies the grid; vLLM's workspace holds ``sms * 4`` locks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from moereplay.errors import InvalidMutationError, ReplayError
from moereplay.ops import register_op
from moereplay.ops.base import (
    ArgKind,
    Args,
    ArgSpec,
    BoolDomain,
    ChoiceDomain,
    CoefficientSource,
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
    block_reads,
    dtype_of,
    fixed_dtype,
    tokens_by_activation_rows,
)

if TYPE_CHECKING:
    from moereplay.reference.tolerance import ErrorAllowance

NAME = "moe_wna16_marlin_gemm"
BLOCK_SIZES: tuple[int, ...] = (8, 16, 32, 48, 64)
SMALL_BLOCK_TILES: tuple[tuple[int, int], ...] = ((128, 128), (64, 128), (128, 64))
LARGE_BLOCK_TILES: tuple[tuple[int, int], ...] = ((64, 256), (64, 128), (128, 64))
WORKSPACE_BLOCKS_PER_SM = 4
_HALF_TYPES = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------------------------
# the vLLM ScalarType argument
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScalarTypeCodec:
    """``b_q_type``: a vLLM ``ScalarType`` recorded as its integer ``id``.

    ``decode`` accepts what a capture may hold — an int, the format's ``CodecValue`` (``{"id": …, "name": …}``),
    a dict, or any object with an integer ``id`` — and returns the id; ``run`` turns it into the backend's own
    ``ScalarType`` with ``ScalarType.from_id``.
    """

    name: str = "vllm.scalar_type.ScalarType"

    def encode(self, value: Any) -> Any:
        return {"id": int(value.id), "name": str(value)}

    def decode(self, data: Any, *, backend: KernelBackend | None) -> int:
        return scalar_type_id(data)


def scalar_type_id(value: Any) -> int:
    """The integer id of a ScalarType in any of its recorded forms."""
    if isinstance(value, bool):
        raise ReplayError(f"b_q_type must be a ScalarType id, got {value!r}")
    if isinstance(value, int):
        return value
    inner = getattr(value, "value", value)  # format.CodecValue keeps the encoded tree in .value
    if isinstance(inner, Mapping) and isinstance(inner.get("id"), int):
        return int(inner["id"])
    type_id = getattr(value, "id", None)
    if isinstance(type_id, int) and not isinstance(type_id, bool):
        return type_id
    raise ReplayError(f"cannot read a ScalarType id from {type(value).__name__}")


_SCALAR_TYPE_CODEC = ScalarTypeCodec()


# --------------------------------------------------------------------------------------------------------------
# contracts
# --------------------------------------------------------------------------------------------------------------


def c_dtype(args: Args) -> torch.dtype | None:
    """The kernel's output ("c") element type, as its host code derives it."""
    a = args.get("input")
    if isinstance(a, torch.Tensor) and a.dtype in _HALF_TYPES:
        return a.dtype
    scales = args.get("b_scales")
    if isinstance(scales, torch.Tensor) and scales.dtype in _HALF_TYPES:
        return scales.dtype
    out = args.get("output")
    if isinstance(out, torch.Tensor):
        return out.dtype
    return None


def _b_scales_dtypes(args: Args) -> tuple[torch.dtype, ...]:
    from moereplay.reference import scalar_types as st

    try:
        quant = st.as_scalar_type(args.get("b_q_type"))
    except Exception:
        return ()
    if quant == st.KNOWN_TYPES.get("float4_e2m1f"):
        return (torch.float8_e4m3fn, torch.float8_e8m0fnu)
    dtype = c_dtype(args)
    if quant == st.KNOWN_TYPES.get("float8_e4m3fn"):  # FP8: 16-bit scales; MXFP8: e8m0 scales
        return (torch.float8_e8m0fnu,) if dtype is None else (dtype, torch.float8_e8m0fnu)
    return () if dtype is None else (dtype,)


def _b_scales_read_as(args: Args) -> torch.dtype | None:
    accepted = _b_scales_dtypes(args)
    scales = args.get("b_scales")
    if isinstance(scales, torch.Tensor) and scales.dtype in accepted:
        return scales.dtype
    return accepted[0] if accepted else None


def _b_scales_values(args: Args) -> torch.dtype | None:
    """The number format whose NaN/Inf codes ``b_scales`` can hold as the kernel reads it: e8m0 (MXFP4, MXFP8),
    the 16-bit type of per-group scales, and none for NVFP4 — vLLM re-encodes those fp8 scales into an unsigned
    5-bit-exponent byte the kernel decodes without NaN or Inf, whatever the tensor's dtype says."""
    scales = args.get("b_scales")
    activations = args.get("input")
    if not isinstance(scales, torch.Tensor):
        return None
    if isinstance(activations, torch.Tensor) and activations.dtype == torch.int8:
        return None  # int8 activations: vLLM stores int16 bit patterns in the half-precision scales
    if scales.dtype == torch.float8_e8m0fnu:
        return scales.dtype
    accepted = _b_scales_dtypes(args)
    if torch.float8_e4m3fn in accepted:  # 4-bit weights: NVFP4 (re-encoded bytes) unless stored as e8m0
        return None
    if scales.dtype == torch.uint8 and torch.float8_e8m0fnu in accepted:
        return torch.float8_e8m0fnu
    return scales.dtype if scales.dtype.is_floating_point else None


def _b_qzeros_read_as(args: Args) -> torch.dtype | None:
    return c_dtype(args) if args.get("is_zp_float") else torch.int32


def _experts(args: Args) -> int | None:
    weight = args.get("b_qweight")
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 3 else None


def _rows(args: Args) -> int | None:
    size_m, top_k = args.get("size_m"), args.get("top_k")
    return size_m * top_k if isinstance(size_m, int) and isinstance(top_k, int) else None


def _nonempty(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[-1] > 0


def _act_order(args: Args) -> bool:
    """The host code's ``has_act_order``: both ``g_idx`` and ``perm`` passed and non-empty."""
    return _nonempty(args.get("g_idx")) and _nonempty(args.get("perm"))


def _reads_g_idx(args: Args) -> bool:
    """With act order the columns of ``input`` are permuted by ``perm`` first; with a full K the main kernel then
    runs without act order and never reads ``g_idx``."""
    return _act_order(args) and not args.get("is_k_full")


def _has_zero_points(args: Args) -> bool:
    """The host code's ``has_zp``: ``b_qzeros`` passed and non-empty."""
    return _nonempty(args.get("b_qzeros"))


def _min_workspace(args: Args) -> int | None:
    sorted_ids, size_n, block = args.get("sorted_token_ids"), args.get("size_n"), args.get("moe_block_size")
    if not (
        isinstance(sorted_ids, torch.Tensor) and isinstance(size_n, int) and isinstance(block, int) and block
    ):
        return None
    return (size_n // 64) * (sorted_ids.numel() // block)


CONTRACTS: tuple[TensorContract, ...] = (
    TensorContract(
        "input",
        read_as=dtype_of("input"),
        host_checked=True,
        accepted=lambda args: (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8),
        shape=lambda args: (args.get("size_m"), args.get("size_k")),
        host_checks=frozenset({"dtype", "shape", "contiguity", "device", "presence"}),
        leading="row",
    ),
    TensorContract(
        "output",
        read_as=c_dtype,
        host_checked=True,
        required=False,
        shape=lambda args: (_rows(args), args.get("size_n")),
        note="accumulated into with atomics when use_atomic_add: must start zeroed",
        host_checks=frozenset({"dtype", "shape", "contiguity", "device"}),
    ),
    TensorContract(
        "b_qweight",
        read_as=fixed_dtype(torch.int32),
        host_checked=False,
        shape=lambda args: (
            None,
            args["size_k"] // 16 if isinstance(args.get("size_k"), int) else None,
            None,
        ),
        note="read as raw 16-byte vectors of the Marlin tile layout; sizes are checked in int32 elements",
        host_checks=frozenset({"shape", "contiguity", "device", "presence"}),
        leading="expert",
    ),
    TensorContract(
        "b_bias",
        read_as=c_dtype,
        host_checked=False,
        required=False,
        shape=lambda args: (_experts(args), args.get("size_n")),
        note="host checks device, contiguity and size(1) only",
        host_checks=frozenset({"shape", "contiguity", "device"}),
        leading="expert",
    ),
    TensorContract(
        "b_scales",
        read_as=_b_scales_read_as,
        accepted=_b_scales_dtypes,
        host_checked=False,
        shape=lambda args: (_experts(args), None, args.get("size_n")),
        note="dtype checked only for float4_e2m1f weights (fp8 e4m3 for NVFP4, e8m0 for MXFP4)",
        host_checks=frozenset({"contiguity", "device", "presence"}),
        leading="expert",
        values=_b_scales_values,
    ),
    TensorContract("a_scales", read_as=fixed_dtype(torch.float32), host_checked=True, required=False),
    TensorContract(
        "global_scale",
        read_as=fixed_dtype(torch.float32),
        host_checked=True,
        required=False,
        numel=_experts,
        note="NVFP4 only; one value per expert",
        host_checks=frozenset({"dtype", "presence"}),
        leading="expert",
    ),
    TensorContract(
        "b_qzeros",
        read_as=_b_qzeros_read_as,
        host_checked=False,
        required=False,
        note="packed int32 zero points; with is_zp_float 16-bit zero points read as the c type; read only when "
        "non-empty",
        read_when=_has_zero_points,
        leading="expert",
    ),
    TensorContract(
        "g_idx",
        read_as=fixed_dtype(torch.int32),
        host_checked=False,
        required=False,
        host_checks=frozenset({"contiguity", "device"}),
        note="read only with act order (g_idx and perm non-empty) and is_k_full False",
        read_when=_reads_g_idx,
    ),
    TensorContract(
        "perm",
        read_as=fixed_dtype(torch.int32),
        host_checked=False,
        required=False,
        host_checks=frozenset({"contiguity", "device"}),
        note="read only with act order (g_idx and perm non-empty), to permute input's columns",
        read_when=_act_order,
    ),
    TensorContract(
        "workspace",
        read_as=fixed_dtype(torch.int32),
        host_checked=False,
        note="lock counters: every entry must be 0 at launch; the kernel leaves them 0",
    ),
    TensorContract(
        "sorted_token_ids",
        read_as=fixed_dtype(torch.int32),
        host_checked=False,
        note="also loaded as int4 vectors: length a multiple of moe_block_size, 16-byte aligned",
    ),
    TensorContract("expert_ids", read_as=fixed_dtype(torch.int32), host_checked=False),
    TensorContract("num_tokens_past_padded", read_as=fixed_dtype(torch.int32), host_checked=False),
    TensorContract(
        "topk_weights",
        read_as=fixed_dtype(torch.float32),
        host_checked=False,
        numel=_rows,
        note="indexed by output row (sorted id) as float32; read only with mul_topk_weights",
        read_when=lambda args: bool(args.get("mul_topk_weights")),
    ),
)


# --------------------------------------------------------------------------------------------------------------
# mutation domains
# --------------------------------------------------------------------------------------------------------------


def _tiles(args: Args) -> tuple[tuple[int, int], ...]:
    block = args.get("moe_block_size")
    return SMALL_BLOCK_TILES if isinstance(block, int) and block <= 16 else LARGE_BLOCK_TILES


def _tile_rules(own: str, other: str) -> tuple[Rule, ...]:
    def together(value: Any, args: Args) -> bool:
        return (value == -1) == (args.get(other) == -1)

    def instantiated(value: Any, args: Args) -> bool:
        if value == -1:
            return True
        pair = (value, args.get(other)) if own == "thread_k" else (args.get(other), value)
        return pair in _tiles(args)

    def divides(value: Any, args: Args) -> bool:
        size = args.get("size_k" if own == "thread_k" else "size_n")
        return value == -1 or (isinstance(size, int) and size % value == 0)

    return (
        Rule(together, f"{own} and {other} are set together (both -1: the kernel chooses)"),
        Rule(
            instantiated,
            "no kernel is instantiated for this (thread_k, thread_n) tile at this moe_block_size "
            f"(<=16: {SMALL_BLOCK_TILES}; >16: {LARGE_BLOCK_TILES})",
        ),
        Rule(divides, f"{own}={{value}} does not divide {'size_k' if own == 'thread_k' else 'size_n'}"),
    )


def _tile_block_rule(value: Any, args: Args) -> bool:
    thread_k, thread_n = args.get("thread_k"), args.get("thread_n")
    return thread_k == -1 or (thread_k, thread_n) in _tiles(args)


MUTABLE: tuple[MutableArg, ...] = (
    MutableArg("mul_topk_weights", BoolDomain(), "multiply each row by its routing weight inside the kernel"),
    MutableArg("use_atomic_add", BoolDomain(), "reduce split-K partial sums with atomics into the output"),
    MutableArg("use_fp32_reduce", BoolDomain(), "reduce partial sums in a float32 scratch"),
    MutableArg("is_k_full", BoolDomain(), "this shard holds all of K (act order only)"),
    MutableArg(
        "moe_block_size",
        PredicateDomain(
            ChoiceDomain(BLOCK_SIZES, "the block sizes the kernel is instantiated for"),
            (Rule(_tile_block_rule, "the explicit thread_k/thread_n tile has no kernel at this block size"),),
        ),
        "rows per expert block; re-derives sorted_token_ids, expert_ids, num_tokens_past_padded",
    ),
    MutableArg(
        "thread_k",
        PredicateDomain(ChoiceDomain((-1, 64, 128)), _tile_rules("thread_k", "thread_n")),
        "tile K",
    ),
    MutableArg(
        "thread_n",
        PredicateDomain(ChoiceDomain((-1, 64, 128, 256)), _tile_rules("thread_n", "thread_k")),
        "tile N",
    ),
    MutableArg(
        "blocks_per_sm",
        IntRangeDomain(1, WORKSPACE_BLOCKS_PER_SM, extra=(-1,)),
        "thread blocks per SM with an explicit tile (vLLM's workspace holds sms*4 locks)",
    ),
)

DERIVED: tuple[DerivedArg, ...] = (
    DerivedArg("sorted_token_ids", ("moe_block_size",), "routing aligned to moe_block_size"),
    DerivedArg("expert_ids", ("moe_block_size",), "expert of each block"),
    DerivedArg("num_tokens_past_padded", ("moe_block_size",), "padded row count"),
)


# --------------------------------------------------------------------------------------------------------------
# routing re-derivation
# --------------------------------------------------------------------------------------------------------------


def captured_block_size(args: Args) -> int:
    """The block size the alignment arrays in ``args`` were built for (the current ``moe_block_size`` may be a
    mutation): the size for which ``expert_ids`` has one entry per block of ``sorted_token_ids``, the padded total
    is whole blocks, and every block lists its rows before its padding."""
    sorted_ids = args["sorted_token_ids"].reshape(-1)
    expert_ids = args["expert_ids"].reshape(-1)
    total = int(args["num_tokens_past_padded"].reshape(-1)[0])
    rows = _rows(args) or 0
    candidates = []
    for size in BLOCK_SIZES:
        if (
            expert_ids.numel() != math.ceil(sorted_ids.numel() / size)
            or total % size
            or total > sorted_ids.numel()
        ):
            continue
        blocks = sorted_ids[:total].to(torch.long).view(-1, size) < rows
        if bool((blocks.int().diff(dim=1) <= 0).all()):
            candidates.append(size)
    if len(candidates) != 1:
        raise ReplayError(
            "cannot tell which moe_block_size the captured sorted_token_ids / expert_ids were built for "
            f"(candidates: {candidates or 'none'}); re-deriving them needs it"
        )
    return candidates[0]


def rederive_alignment(args: Args, block_size: int) -> dict[str, torch.Tensor]:
    """``sorted_token_ids``, ``expert_ids``, ``num_tokens_past_padded`` for ``block_size``, from the routing the
    captured arrays encode (rows in no processed block stay unrouted)."""
    from moereplay.reference.moe_align import moe_align_block_size, routing_from_alignment

    captured = captured_block_size(args)
    size_m, top_k = int(args["size_m"]), int(args["top_k"])
    experts = _experts(args)
    if experts is None:
        raise ReplayError("b_qweight must be [experts, k/16, n*16/pack] to re-derive the routing")
    routing = routing_from_alignment(
        args["sorted_token_ids"].reshape(-1),
        args["expert_ids"].reshape(-1),
        args["num_tokens_past_padded"],
        block_size=captured,
        top_k=top_k,
        size_m=size_m,
    )
    sorted_ids, expert_ids, total = moe_align_block_size(routing.topk_ids, block_size, experts)
    device = args["sorted_token_ids"].device
    return {
        "sorted_token_ids": sorted_ids.to(device),
        "expert_ids": expert_ids.to(device),
        "num_tokens_past_padded": total.to(device),
    }


# --------------------------------------------------------------------------------------------------------------
# the op
# --------------------------------------------------------------------------------------------------------------

_ARGUMENTS: tuple[ArgSpec, ...] = (
    ArgSpec("input", ArgKind.TENSOR, description="activations [size_m, size_k]"),
    ArgSpec("output", ArgKind.TENSOR, optional=True, description="[size_m*top_k, size_n]; allocated if None"),
    ArgSpec("b_qweight", ArgKind.TENSOR, description="Marlin-packed weights [E, size_k/16, ...] int32"),
    ArgSpec("b_bias", ArgKind.TENSOR, optional=True, description="[E, size_n], Marlin-permuted"),
    ArgSpec("b_scales", ArgKind.TENSOR, description="group scales [E, groups, size_n]"),
    ArgSpec("a_scales", ArgKind.TENSOR, optional=True, description="per-row activation scales (8-bit a)"),
    ArgSpec("global_scale", ArgKind.TENSOR, optional=True, description="per-expert NVFP4 global scale"),
    ArgSpec("b_qzeros", ArgKind.TENSOR, optional=True, description="zero points (u4/u8 types)"),
    ArgSpec("g_idx", ArgKind.TENSOR, optional=True, description="act-order group index"),
    ArgSpec("perm", ArgKind.TENSOR, optional=True, description="act-order permutation"),
    ArgSpec("workspace", ArgKind.TENSOR, description="int32 lock counters, zeroed"),
    ArgSpec("sorted_token_ids", ArgKind.TENSOR, description="moe_align_block_size output"),
    ArgSpec("expert_ids", ArgKind.TENSOR, description="expert of each block"),
    ArgSpec("num_tokens_past_padded", ArgKind.TENSOR, description="[1] padded total"),
    ArgSpec("topk_weights", ArgKind.TENSOR, description="routing weights, read as float32 by output row"),
    ArgSpec("moe_block_size", ArgKind.SCALAR),
    ArgSpec("top_k", ArgKind.SCALAR, description="1 for gemm2 (rows pre-expanded)"),
    ArgSpec("mul_topk_weights", ArgKind.FLAG),
    ArgSpec("b_q_type", ArgKind.ENUM, codec=_SCALAR_TYPE_CODEC, description="weight ScalarType id"),
    ArgSpec("size_m", ArgKind.SCALAR),
    ArgSpec("size_n", ArgKind.SCALAR),
    ArgSpec("size_k", ArgKind.SCALAR),
    ArgSpec("is_k_full", ArgKind.FLAG),
    ArgSpec("use_atomic_add", ArgKind.FLAG),
    ArgSpec("use_fp32_reduce", ArgKind.FLAG),
    ArgSpec("is_zp_float", ArgKind.FLAG),
    ArgSpec("thread_k", ArgKind.SCALAR, default=-1, has_default=True),
    ArgSpec("thread_n", ArgKind.SCALAR, default=-1, has_default=True),
    ArgSpec("blocks_per_sm", ArgKind.SCALAR, default=-1, has_default=True),
)


class MarlinMoeOp:
    """The OpSpec of ``moe_wna16_marlin_gemm`` (see the module docstring for the facts it encodes)."""

    name = NAME
    arguments = _ARGUMENTS
    mutable = MUTABLE
    derived = DERIVED
    contracts = CONTRACTS
    scratch = ("output", "workspace")
    output_name = "output"
    reference_ignores = frozenset(
        {
            "output",
            "workspace",
            "thread_k",
            "thread_n",
            "blocks_per_sm",
            "use_atomic_add",
            "use_fp32_reduce",
            "is_k_full",
        }
    )
    """Launch and precision arguments; the block size stays out: it changes which block writes a row."""
    derivation_inputs = frozenset(
        {
            "moe_block_size",
            "sorted_token_ids",
            "expert_ids",
            "num_tokens_past_padded",
            "size_m",
            "top_k",
            "b_qweight",
        }
    )
    """What :func:`rederive_alignment` reads: the captured alignment, the row count and the experts (b_qweight's
    first dimension); launch flags, tiles and every other tensor cannot change the re-derived routing."""

    def __init__(self) -> None:
        from moereplay.reference.marlin_moe import ExpertWeightCache

        self._weights = ExpertWeightCache()

    def rederive(self, args: Args, changed: frozenset[str]) -> dict[str, Any]:
        new_args = dict(args)
        if "moe_block_size" in changed:
            new_args.update(rederive_alignment(args, int(args["moe_block_size"])))
        return new_args

    def rederive_routing(self, args: Args) -> dict[str, Any]:
        """``args`` with ``sorted_token_ids``, ``expert_ids`` and ``num_tokens_past_padded`` aligned afresh (vLLM's
        ``moe_align_block_size``) from the routing they encode, for the call's ``moe_block_size``: padding
        entries and anything past the padded total get the values vLLM writes there."""
        try:
            return {**args, **rederive_alignment(args, int(args["moe_block_size"]))}
        except ReplayError as error:
            raise InvalidMutationError(f"cannot re-derive the routing metadata: {error}") from error

    def shape_dimensions(self, args: Args) -> list[tuple[str, tuple[int, ...], int]]:
        """Shrinkable dimensions for the shape bisection (:mod:`moereplay.ops.marlin_shapes`)."""
        from moereplay.ops.marlin_shapes import shape_dimensions

        return shape_dimensions(args)

    def shrink(self, args: Args, shape: Mapping[str, int]) -> dict[str, Any]:
        """A valid call of ``shape`` made from this one (:mod:`moereplay.ops.marlin_shapes`)."""
        from moereplay.ops.marlin_shapes import shrink

        return shrink(args, shape)

    def make_scratch(self, args: Args, device: torch.device) -> dict[str, Any]:
        device = torch.device(device)
        scratch: dict[str, Any] = {}
        workspace = args.get("workspace")
        size = workspace.numel() if isinstance(workspace, torch.Tensor) else 0
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            size = max(size, sms * WORKSPACE_BLOCKS_PER_SM)
        elif size == 0:
            size = _min_workspace(args) or 1
        scratch["workspace"] = torch.zeros(size, dtype=torch.int32, device=device)
        output = args.get("output")
        if isinstance(output, torch.Tensor):
            scratch["output"] = torch.empty_strided(
                tuple(output.shape), tuple(output.stride()), dtype=output.dtype, device=device
            ).zero_()
        else:
            scratch["output"] = None
        return scratch

    def run(self, args: Args, backend: KernelBackend) -> torch.Tensor:
        ops = backend.module("vllm._custom_ops")
        scalar_type = backend.module("vllm.scalar_type")
        kwargs = {spec.name: args.get(spec.name, spec.default) for spec in self.arguments}
        kwargs["b_q_type"] = scalar_type.ScalarType.from_id(scalar_type_id(args["b_q_type"]))
        return ops.moe_wna16_marlin_gemm(**kwargs)

    def error_allowance(
        self, args: Args, reference: ReferenceResult, output_dtype: torch.dtype
    ) -> ErrorAllowance | None:
        """The rounding a 16-bit combination of split-K partial sums adds (``use_atomic_add``,
        ``use_fp32_reduce=False``), per element; ``None`` for the float32 reduction (:mod:`.marlin_rounding`)."""
        from moereplay.ops.marlin_rounding import marlin_error_allowance

        return marlin_error_allowance(args, reference, output_dtype, self._weights)

    def error_allowance_key(self, args: Args) -> tuple[str | None, int]:
        """What :meth:`error_allowance` reads among the launch arguments the reference ignores: the reduction mode
        and the K tile (thread_n, blocks per SM and is_k_full change nothing in the bound)."""
        from moereplay.ops.marlin_rounding import reduction_mode, tile_k

        return reduction_mode(args), tile_k(args)

    def reads(self, args: Args) -> Reads:
        """Experts of the blocks the launch runs and the input rows their row ids name (:func:`block_reads`)."""
        return block_reads(
            args.get("sorted_token_ids"),
            args.get("expert_ids"),
            args.get("num_tokens_past_padded"),
            args.get("moe_block_size"),
            _rows(args),
            args.get("top_k"),
            partial_block=False,
        )

    def layer_tokens(self, args: Args, rows: RowMap, batch: int) -> torch.Tensor | None:
        """The layer token of each output row: the row map's ``token`` is a row of ``input``, which holds the
        layer's tokens (gemm1) or its token-major ``[tokens · top_k, K]`` intermediate (gemm2, ``top_k`` 1)."""
        return tokens_by_activation_rows(rows.token, args.get("input"), batch)

    def reference(self, args: Args) -> ReferenceResult:
        from moereplay.reference.marlin_moe import reference_moe_wna16_marlin_gemm

        kwargs = {spec.name: args.get(spec.name, spec.default) for spec in self.arguments}
        result = reference_moe_wna16_marlin_gemm(**kwargs, weight_cache=self._weights)
        rows_map = result.row_map
        rows = RowMap(
            token=rows_map.input_row,
            expert=rows_map.expert,
            slot=rows_map.k_slot,
            block=rows_map.block,
        )
        terms = {"gemm": result.gemm}
        coefficients = {"gemm": result.row_weights}
        if result.bias_rows is not None:
            terms["bias"] = result.bias_rows
            coefficients["bias"] = result.row_weights
        sources: dict[str, CoefficientSource] = {}
        if args.get("mul_topk_weights"):
            index = torch.arange(result.output.shape[0], device=result.output.device)
            source = CoefficientSource("topk_weights", index, torch.float32)
            sources = {name: source for name in terms}
        scales: dict[str, torch.Tensor] = {}
        global_scale = args.get("global_scale")
        if isinstance(global_scale, torch.Tensor) and global_scale.numel():
            values = global_scale.reshape(-1).to(result.output.device, torch.float32)
            expert = rows_map.expert.to(result.output.device)
            per_row = torch.ones(expert.shape, dtype=torch.float32, device=result.output.device)
            inside = (expert >= 0) & (expert < values.numel())
            per_row[inside] = values[expert[inside]]
            scales["global_scale"] = per_row
        return ReferenceResult(
            output=result.output,
            written=result.written,
            rows=rows,
            terms=terms,
            coefficients=coefficients,
            sources=sources,
            scales=scales,
        )


MARLIN_MOE = register_op(MarlinMoeOp())
