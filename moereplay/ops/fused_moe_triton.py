"""vLLM's Triton fused MoE: ``fused_moe_kernel`` and ``fused_moe_kernel_gptq_awq``, as of vLLM 0.25.1.

Two ops, one per launcher in ``vllm/model_executor/layers/fused_moe/fused_moe.py`` (the capture wraps the launchers,
which take tensors and a config dict, not the ``@triton.jit`` functions):

- ``fused_moe_kernel`` ← ``invoke_fused_moe_triton_kernel(A, B, C, A_scale, B_scale, topk_weights,
  sorted_token_ids, expert_ids, num_tokens_post_padded, mul_routed_weight, top_k, config, compute_type,
  use_fp8_w8a8, use_int8_w8a8, use_int8_w8a16, use_int4_w4a16, per_channel_quant, block_shape=None,
  B_bias=None)``: bf16/fp16/fp32, fp8 and int8 w8a8 (per tensor, per channel, block-wise), int8 w8a16;
- ``fused_moe_kernel_gptq_awq`` ← ``invoke_fused_moe_wna16_triton_kernel(A, B, C, B_scale, B_zp, topk_weights,
  sorted_token_ids, expert_ids, num_tokens_post_padded, mul_routed_weight, top_k, config, compute_type,
  use_int8_w8a16, use_int4_w4a16, block_shape)``: int4/int8 weight-only with a group size, optional zero points.

The launchers' ``config`` dict (``BLOCK_SIZE_M/N/K``, ``GROUP_SIZE_M``, ``num_warps``, ``num_stages``) is split
into one pseudo-argument per key when a call is loaded (:meth:`TritonMoeOp.recorded_args`), so a replay mutates
them like any argument; other keys stay in ``config``. ``compute_type`` (a ``triton.language`` dtype) is recorded
by name (:mod:`moereplay.ops.fused_moe_triton_surface`). What each launch computes, and the strides it passes:
:mod:`moereplay.reference.fused_moe_triton`.

Host checks (asserts in the launchers): ``topk_weights.stride(1) == 1``, ``sorted_token_ids.stride(0) == 1``,
``topk_weights`` present with ``mul_routed_weight``; w8a8: ``B_scale`` present and, block-wise, ``B_scale`` of
``cdiv(N, block_n) × cdiv(K, block_k)`` blocks; unquantised: no scales; wna16: ``B_scale`` 3-D, ``B_zp`` 3-D or
``None``, ``block_shape[0] == 0``. Everything else is the kernel's to trust: dtypes (Triton loads each pointer as its
own type), ``C``'s rows (addressed ``stride(1)`` apart), ``topk_weights`` read flat from its data pointer, and the
sorted-id padding (ids ``>= num_valid_tokens`` are masked; ``num_tokens_post_padded`` whole blocks of
``BLOCK_SIZE_M``; a 1-D per-token ``A_scale`` is read at element 0 for every row).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

import moereplay.ops.fused_moe_triton_codecs  # noqa: F401  (registers the compute_type codec)
from moereplay.errors import InvalidMutationError, ReplayError
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
    block_reads,
    check_contracts,
    dtype_of,
    fixed_dtype,
    tokens_by_activation_rows,
)
from moereplay.ops.fused_moe_triton_surface import (
    CONFIG_KEYS,
    FUSED_MOE_MODULE,
    GPTQ_AWQ_LAUNCHER,
    GPTQ_AWQ_OP,
    TRITON_LAUNCHER,
    TRITON_OP,
    compute_type_name,
    required_config_keys,
)

BLOCK_SIZES_M: tuple[int, ...] = (16, 32, 64, 128, 256)
"""``BLOCK_SIZE_M`` values: ``tl.dot`` needs at least 16 rows; vLLM's tuned configs use 16..256."""
TILE_SIZES: tuple[int, ...] = (16, 32, 64, 128, 256)
WARPS: tuple[int, ...] = (1, 2, 4, 8, 16)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ComputeTypeCodec:
    """``compute_type``: a ``triton.language`` dtype, recorded and decoded as ``bfloat16`` / ``float16`` /
    ``float32``; :meth:`TritonMoeOp.run` turns the name back into the launcher module's ``tl`` dtype."""

    name: str = "triton.language.core.dtype"

    def encode(self, value: Any) -> Any:
        return {"name": compute_type_name(value)}

    def decode(self, data: Any, *, backend: KernelBackend | None) -> str:
        inner = getattr(data, "value", data)
        if isinstance(inner, Mapping):
            inner = inner.get("name")
        return compute_type_name(inner)


@dataclass(frozen=True)
class PlainCodec:
    """Plain recorded data (a dict of launch settings, a list of block sizes) passed through as recorded."""

    name: str

    def encode(self, value: Any) -> Any:
        return value

    def decode(self, data: Any, *, backend: KernelBackend | None) -> Any:
        if isinstance(data, Mapping):
            return dict(data)
        if isinstance(data, (list, tuple)):
            return [int(v) for v in data]
        return data


_COMPUTE = ComputeTypeCodec()
_CONFIG = PlainCodec("config")
_BLOCK_SHAPE = PlainCodec("block_shape")


# --------------------------------------------------------------------------------------------------------------
# what the call says
# --------------------------------------------------------------------------------------------------------------


def compute_dtype(args: Args) -> torch.dtype | None:
    from moereplay.reference.fused_moe_triton import COMPUTE_TYPES

    value = args.get("compute_type")
    try:
        return COMPUTE_TYPES[compute_type_name(value)]
    except (KeyError, ValueError):
        return None


def _size(args: Args, name: str, dim: int) -> int | None:
    value = args.get(name)
    return int(value.shape[dim]) if isinstance(value, torch.Tensor) and value.dim() > dim else None


def num_valid_tokens(args: Args) -> int | None:
    rows, top_k = _size(args, "A", 0), args.get("top_k")
    return rows * top_k if rows is not None and isinstance(top_k, int) else None


def block_shape(args: Args) -> tuple[int, int] | None:
    value = args.get("block_shape")
    if value is None:
        return None
    items = tuple(int(v) for v in value)
    return (items[0], items[1]) if len(items) == 2 else None


def _blockwise(args: Args) -> tuple[int, int] | None:
    shape = block_shape(args)
    return shape if shape is not None and shape[0] > 0 and shape[1] > 0 else None


def _w8a8(args: Args) -> bool:
    return bool(args.get("use_fp8_w8a8") or args.get("use_int8_w8a8"))


def _cdiv(a: int | None, b: int) -> int | None:
    return None if a is None else -(-a // b)


def _a_dtypes(args: Args) -> tuple[torch.dtype, ...]:
    if args.get("use_fp8_w8a8"):
        return (torch.float8_e4m3fn,)
    if args.get("use_int8_w8a8"):
        return (torch.int8,)
    dtype = compute_dtype(args)
    return () if dtype is None else (dtype,)


def _b_dtypes(args: Args) -> tuple[torch.dtype, ...]:
    if args.get("use_fp8_w8a8"):
        return (torch.float8_e4m3fn,)
    if args.get("use_int8_w8a8") or args.get("use_int8_w8a16"):
        return (torch.int8,)
    return _a_dtypes(args)


def _a_scale_shape(args: Args) -> tuple[int | None, ...] | None:
    rows, k = _size(args, "A", 0), _size(args, "A", 1)
    blocks = _blockwise(args)
    if blocks is not None:
        return (rows, _cdiv(k, blocks[1]))
    if args.get("per_channel_quant"):
        return (rows, 1)
    return None


def _a_scale_numel(args: Args) -> int | None:
    return 1 if _blockwise(args) is None and not args.get("per_channel_quant") else None


def _b_scale_shape(args: Args) -> tuple[int | None, ...] | None:
    experts, n, k = _size(args, "B", 0), _size(args, "B", 1), _size(args, "B", 2)
    blocks = _blockwise(args)
    if blocks is not None and _w8a8(args):
        return (experts, _cdiv(n, blocks[0]), _cdiv(k, blocks[1]))
    return None


def _b_scale_numel(args: Args) -> int | None:
    experts, n = _size(args, "B", 0), _size(args, "B", 1)
    if experts is None or n is None or _blockwise(args) is not None:
        return None
    if args.get("use_int8_w8a16") or args.get("per_channel_quant"):
        return experts * n
    return experts if _w8a8(args) else None


def _output_shape(args: Args) -> tuple[int | None, ...]:
    """``C`` as the kernel writes it: ``num_valid_tokens`` row ids of N, in C's own split of rows — gemm1 passes
    ``[M, top_k, 2N]`` with the routing's top_k; vLLM's gemm2 passes ``[M, topk, K]`` with ``top_k=1`` (its A
    already has ``M · topk`` rows), so the split is C's ``shape[1]`` whenever that divides the row ids."""
    rows, width, c = num_valid_tokens(args), _size(args, "B", 1), args.get("C")
    if (
        rows is not None
        and isinstance(c, torch.Tensor)
        and c.dim() == 3
        and c.shape[1] > 0
        and rows % c.shape[1] == 0
    ):
        return (rows // c.shape[1], int(c.shape[1]), width)
    return (_size(args, "A", 0), args.get("top_k"), width)


def _weights_read(args: Args) -> bool:
    return bool(args.get("mul_routed_weight"))


def _float_dtypes(args: Args) -> tuple[torch.dtype, ...]:
    return _FLOATS


COMMON_CONTRACTS: tuple[TensorContract, ...] = (
    TensorContract(
        "C",
        read_as=compute_dtype,
        host_checked=False,
        contiguous=False,
        shape=_output_shape,
        note="written as compute_type; row ids (A rows · top_k of them) addressed flat, C.stride(1) apart "
        "(checked separately)",
    ),
    TensorContract(
        "topk_weights",
        read_as=dtype_of("topk_weights"),
        accepted=_float_dtypes,
        host_checked=False,
        required=False,
        numel=num_valid_tokens,
        note="read flat from its data pointer by output row id (host asserts stride(1) == 1 only); "
        "read only with mul_routed_weight",
        read_when=_weights_read,
        host_checks=frozenset({"presence"}),
    ),
    TensorContract(
        "expert_ids",
        read_as=fixed_dtype(torch.int32),
        host_checked=False,
        note="expert of each BLOCK_SIZE_M block; -1 writes zeros (an expert of another rank)",
    ),
    TensorContract(
        "num_tokens_post_padded",
        read_as=fixed_dtype(torch.int32),
        host_checked=False,
        numel=lambda args: 1,
    ),
)

TRITON_CONTRACTS: tuple[TensorContract, ...] = (
    TensorContract(
        "A",
        read_as=dtype_of("A"),
        accepted=_a_dtypes,
        host_checked=False,
        contiguous=False,
        shape=lambda args: (None, _size(args, "B", 2)),
        note="strides passed to the kernel; fp8 / int8 with w8a8",
        leading="row",
    ),
    TensorContract(
        "B",
        read_as=dtype_of("B"),
        accepted=_b_dtypes,
        host_checked=False,
        contiguous=False,
        shape=lambda args: (None, None, _size(args, "A", 1)),
        note="[E, N, K]; strides passed to the kernel",
        leading="expert",
    ),
    *COMMON_CONTRACTS,
    TensorContract(
        "A_scale",
        read_as=fixed_dtype(torch.float32),
        host_checked=False,
        required=True,
        contiguous=False,
        shape=_a_scale_shape,
        numel=_a_scale_numel,
        note="w8a8 only: per block [M, cdiv(K, block_k)], per token [M, 1] (a 1-D tensor gets stride 0: every row "
        "reads element 0), per tensor one value",
        read_when=_w8a8,
    ),
    TensorContract(
        "B_scale",
        read_as=fixed_dtype(torch.float32),
        host_checked=False,
        contiguous=False,
        shape=_b_scale_shape,
        numel=_b_scale_numel,
        note="per block [E, cdiv(N, block_n), cdiv(K, block_k)] (host-checked), per channel [E, N(, 1)], per tensor "
        "[E]",
        read_when=lambda args: _w8a8(args) or bool(args.get("use_int8_w8a16")),
        host_checks=frozenset({"presence"}),
        leading="expert",
    ),
    TensorContract(
        "sorted_token_ids",
        read_as=fixed_dtype(torch.int32),
        host_checked=False,
        required=False,
        note="None: naive block assignment (one row per block)",
    ),
    TensorContract(
        "B_bias",
        read_as=dtype_of("B_bias"),
        accepted=_float_dtypes,
        host_checked=False,
        required=False,
        contiguous=False,
        shape=lambda args: (_size(args, "B", 0), _size(args, "B", 1)),
        leading="expert",
    ),
)


def _int4(args: Args) -> bool:
    return bool(args.get("use_int4_w4a16"))


def _group(args: Args) -> int | None:
    shape = block_shape(args)
    return shape[1] if shape is not None and shape[1] > 0 else None


GPTQ_CONTRACTS: tuple[TensorContract, ...] = (
    TensorContract(
        "A",
        read_as=dtype_of("A"),
        accepted=lambda args: _a_dtypes(args),
        host_checked=False,
        contiguous=False,
        shape=lambda args: (None, None),
        leading="row",
    ),
    TensorContract(
        "B",
        read_as=fixed_dtype(torch.uint8),
        accepted=lambda args: (torch.uint8,) if _int4(args) else (torch.uint8, torch.int8),
        host_checked=False,
        contiguous=False,
        shape=lambda args: (
            None,
            None,
            (_size(args, "A", 1) or 0) // 2 if _int4(args) else _size(args, "A", 1),
        ),
        note="int4: [E, N, K/2] bytes, low nibble = even k; int8: [E, N, K]; B loads are not masked along K",
        leading="expert",
    ),
    *COMMON_CONTRACTS,
    TensorContract(
        "B_scale",
        read_as=compute_dtype,
        accepted=_float_dtypes,
        host_checked=False,
        contiguous=False,
        shape=lambda args: (
            _size(args, "B", 0),
            _size(args, "B", 1),
            _cdiv(_size(args, "A", 1), _group(args) or 1),
        ),
        host_checks=frozenset({"presence"}),
        leading="expert",
    ),
    TensorContract(
        "B_zp",
        read_as=dtype_of("B_zp"),
        host_checked=False,
        required=False,
        contiguous=False,
        shape=lambda args: (
            _size(args, "B", 0),
            _cdiv(_size(args, "B", 1), 2) if _int4(args) else _size(args, "B", 1),
            _cdiv(_size(args, "A", 1), _group(args) or 1),
        ),
        note="int4: two zero points per byte along N",
        leading="expert",
    ),
    TensorContract("sorted_token_ids", read_as=fixed_dtype(torch.int32), host_checked=False),
)


def layout_violations(args: Args) -> list[ContractViolation]:
    """What the dtype/shape contracts cannot say: C's row addressing, topk_weights' flat read, the sorted-id
    padding."""
    found: list[ContractViolation] = []
    c = args.get("C")
    if (
        isinstance(c, torch.Tensor)
        and c.dim() == 3
        and c.shape[0] > 1
        and c.stride(0) != c.shape[1] * c.stride(1)
    ):
        found.append(
            ContractViolation(
                "C",
                "contiguity",
                f"stride(0) == shape[1] · stride(1) = {c.shape[1] * c.stride(1)}",
                f"strides {tuple(c.stride())}",
                False,
                "the kernel writes row id at id · stride(1): rows land in other tokens' places",
            )
        )
    ids, padded, bm = (
        args.get("sorted_token_ids"),
        args.get("num_tokens_post_padded"),
        args.get("BLOCK_SIZE_M"),
    )
    if isinstance(ids, torch.Tensor) and isinstance(padded, torch.Tensor) and isinstance(bm, int) and bm > 0:
        total = int(padded.reshape(-1)[0]) if padded.numel() else 0
        if total % bm:
            found.append(
                ContractViolation(
                    "num_tokens_post_padded",
                    "shape",
                    f"a multiple of BLOCK_SIZE_M={bm}",
                    str(total),
                    False,
                    "the routing was aligned for another block size: blocks mix experts' rows",
                )
            )
        needed = -(-total // bm) * bm
        if ids.numel() < needed:
            found.append(
                ContractViolation(
                    "sorted_token_ids",
                    "shape",
                    f"at least {needed} ids",
                    f"{ids.numel()} ids",
                    False,
                    "the last processed block reads ids past the end",
                    (needed - ids.numel()) * ids.element_size(),
                )
            )
        valid = num_valid_tokens(args)
        if valid is not None and total <= ids.numel():
            chosen = ids.reshape(-1)[:total].to(torch.long)
            real = chosen[(chosen >= 0) & (chosen < valid)]
            if real.numel() != torch.unique(real).numel():
                found.append(
                    ContractViolation(
                        "sorted_token_ids",
                        "shape",
                        "each row id at most once (padding ids >= num_valid_tokens)",
                        "repeated row ids",
                        False,
                        "two blocks write one row: the result depends on their order",
                    )
                )
    return found


# --------------------------------------------------------------------------------------------------------------
# mutations and re-derivation
# --------------------------------------------------------------------------------------------------------------


def _weights_present(value: Any, args: Args) -> bool:
    return not value or isinstance(args.get("topk_weights"), torch.Tensor)


def _one_weight_type(value: Any, args: Args) -> bool:
    return bool(args.get("use_int4_w4a16")) != bool(args.get("use_int8_w8a16"))


def _block_k_even(value: Any, args: Args) -> bool:
    return not _int4(args) or value % 2 == 0


CONFIG_MUTABLE: tuple[MutableArg, ...] = (
    MutableArg(
        "BLOCK_SIZE_M",
        ChoiceDomain(BLOCK_SIZES_M, "tl.dot needs 16 rows; vLLM's configs use 16..256"),
        "rows per expert block; re-derives sorted_token_ids, expert_ids, num_tokens_post_padded",
    ),
    MutableArg("BLOCK_SIZE_N", ChoiceDomain(TILE_SIZES), "output columns per program"),
    MutableArg(
        "BLOCK_SIZE_K",
        PredicateDomain(
            ChoiceDomain(TILE_SIZES), (Rule(_block_k_even, "int4 weights need an even BLOCK_SIZE_K"),)
        ),
        "K per loop step (block-quantised fp8: clamped by the launcher to min(block_shape))",
    ),
    MutableArg("GROUP_SIZE_M", IntRangeDomain(1, 64), "M blocks per L2 group of the program order"),
    MutableArg("num_warps", ChoiceDomain(WARPS), "warps per program"),
    MutableArg("num_stages", IntRangeDomain(1, 6), "software pipeline stages"),
    MutableArg(
        "mul_routed_weight",
        PredicateDomain(BoolDomain(), (Rule(_weights_present, "mul_routed_weight needs topk_weights"),)),
        "multiply each row by its routing weight inside the kernel",
    ),
)

GPTQ_MUTABLE: tuple[MutableArg, ...] = (
    *CONFIG_MUTABLE,
    MutableArg(
        "use_int4_w4a16",
        PredicateDomain(
            BoolDomain(),
            (
                Rule(
                    _one_weight_type,
                    "exactly one of use_int4_w4a16 / use_int8_w8a16 (set both in one variant)",
                ),
            ),
        ),
        "read B as packed int4 (else int8)",
    ),
    MutableArg(
        "use_int8_w8a16",
        PredicateDomain(
            BoolDomain(),
            (
                Rule(
                    _one_weight_type,
                    "exactly one of use_int4_w4a16 / use_int8_w8a16 (set both in one variant)",
                ),
            ),
        ),
        "read B as int8 (else packed int4)",
    ),
)

DERIVED: tuple[DerivedArg, ...] = (
    DerivedArg("sorted_token_ids", ("BLOCK_SIZE_M",), "routing aligned to BLOCK_SIZE_M"),
    DerivedArg("expert_ids", ("BLOCK_SIZE_M",), "expert of each block"),
    DerivedArg("num_tokens_post_padded", ("BLOCK_SIZE_M",), "padded row count"),
)


def wna16_default_tiles(args: Args) -> dict[str, int]:
    """``BLOCK_SIZE_N`` / ``BLOCK_SIZE_K`` that vLLM 0.25.1's ``get_moe_wna16_block_config`` picks for the Triton
    wna16 kernel when the config has not both: 32 / 64 for a single token (``num_valid_tokens // top_k == 1``),
    64 / 32 otherwise."""
    rows = _size(args, "A", 0)
    return {"BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64} if rows == 1 else {"BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32}


def captured_block_size_m(args: Args) -> int:
    """The ``BLOCK_SIZE_M`` the alignment arrays in ``args`` were built for (the current value may be a
    mutation): one ``expert_ids`` entry per block of ``sorted_token_ids``, whole blocks, rows before padding."""
    ids = args["sorted_token_ids"].reshape(-1)
    experts = args["expert_ids"].reshape(-1)
    total = int(args["num_tokens_post_padded"].reshape(-1)[0])
    valid = num_valid_tokens(args) or 0
    candidates = []
    for size in BLOCK_SIZES_M:
        if experts.numel() != math.ceil(ids.numel() / size) or total % size or total > ids.numel():
            continue
        blocks = ids[:total].to(torch.long).view(-1, size) < valid
        if bool((blocks.int().diff(dim=1) <= 0).all()):
            candidates.append(size)
    current = args.get("BLOCK_SIZE_M")
    if len(candidates) > 1 and isinstance(current, int) and current in candidates:
        candidates = [current]
    if len(candidates) != 1:
        raise ReplayError(
            "cannot tell which BLOCK_SIZE_M the captured sorted_token_ids / expert_ids were built for "
            f"(candidates: {candidates or 'none'}); re-deriving them needs it"
        )
    return candidates[0]


def rederive_alignment(args: Args, block_size: int, captured: int | None = None) -> dict[str, Any]:
    """``sorted_token_ids``, ``expert_ids``, ``num_tokens_post_padded`` for ``block_size`` from the routing the
    captured arrays encode (vLLM's ``moe_align_block_size``; experts = ``B``'s first dimension, the local ones)."""
    from moereplay.reference.moe_align import moe_align_block_size, routing_from_alignment

    device = args["expert_ids"].device
    if args.get("sorted_token_ids") is None:  # naive assignment: one row per block
        rows = num_valid_tokens(args) or 0
        return {"num_tokens_post_padded": torch.tensor([rows * block_size], dtype=torch.int32, device=device)}
    captured = captured if captured is not None else captured_block_size_m(args)
    top_k, rows = int(args["top_k"]), int(args["A"].shape[0])
    routing = routing_from_alignment(
        args["sorted_token_ids"].reshape(-1),
        args["expert_ids"].reshape(-1),
        args["num_tokens_post_padded"],
        block_size=captured,
        top_k=top_k,
        size_m=rows,
    )
    experts = int(args["B"].shape[0])
    sorted_ids, expert_ids, total = moe_align_block_size(routing.topk_ids, block_size, experts)
    return {
        "sorted_token_ids": sorted_ids.to(device),
        "expert_ids": expert_ids.to(device),
        "num_tokens_post_padded": total.to(device),
    }


# --------------------------------------------------------------------------------------------------------------
# the ops
# --------------------------------------------------------------------------------------------------------------

_CONFIG_ARGS: tuple[ArgSpec, ...] = (
    ArgSpec("BLOCK_SIZE_M", ArgKind.SCALAR, description="config: rows per block"),
    ArgSpec("BLOCK_SIZE_N", ArgKind.SCALAR, optional=True, description="config: columns per program"),
    ArgSpec("BLOCK_SIZE_K", ArgKind.SCALAR, optional=True, description="config: K per step"),
    ArgSpec("GROUP_SIZE_M", ArgKind.SCALAR, optional=True, description="config: program grouping"),
    ArgSpec("num_warps", ArgKind.SCALAR, optional=True, default=None, has_default=True),
    ArgSpec("num_stages", ArgKind.SCALAR, optional=True, default=None, has_default=True),
    ArgSpec("config", ArgKind.OPAQUE, optional=True, codec=_CONFIG, default=None, has_default=True),
)

_ROUTING_ARGS: tuple[ArgSpec, ...] = (
    ArgSpec("topk_weights", ArgKind.TENSOR, optional=True, description="[M, top_k] routing weights"),
    ArgSpec("sorted_token_ids", ArgKind.TENSOR, optional=True, description="moe_align_block_size ids"),
    ArgSpec("expert_ids", ArgKind.TENSOR, description="expert of each block (-1: another rank's)"),
    ArgSpec("num_tokens_post_padded", ArgKind.TENSOR, description="[1] padded total"),
    ArgSpec("mul_routed_weight", ArgKind.FLAG),
    ArgSpec("top_k", ArgKind.SCALAR, description="1 for gemm2 (rows pre-expanded)"),
)

TRITON_ARGUMENTS: tuple[ArgSpec, ...] = (
    ArgSpec("A", ArgKind.TENSOR, description="activations [M, K]"),
    ArgSpec("B", ArgKind.TENSOR, description="expert weights [E, N, K]"),
    ArgSpec("C", ArgKind.TENSOR, description="output [M, top_k, N]"),
    ArgSpec("A_scale", ArgKind.TENSOR, optional=True),
    ArgSpec("B_scale", ArgKind.TENSOR, optional=True),
    *_ROUTING_ARGS,
    *_CONFIG_ARGS,
    ArgSpec("compute_type", ArgKind.ENUM, codec=_COMPUTE),
    ArgSpec("use_fp8_w8a8", ArgKind.FLAG),
    ArgSpec("use_int8_w8a8", ArgKind.FLAG),
    ArgSpec("use_int8_w8a16", ArgKind.FLAG),
    ArgSpec("use_int4_w4a16", ArgKind.FLAG),
    ArgSpec("per_channel_quant", ArgKind.FLAG),
    ArgSpec("block_shape", ArgKind.OPAQUE, optional=True, codec=_BLOCK_SHAPE, default=None, has_default=True),
    ArgSpec("B_bias", ArgKind.TENSOR, optional=True, default=None, has_default=True),
)

GPTQ_ARGUMENTS: tuple[ArgSpec, ...] = (
    ArgSpec("A", ArgKind.TENSOR, description="activations [M, K]"),
    ArgSpec("B", ArgKind.TENSOR, description="int4 [E, N, K/2] or int8 [E, N, K] bytes"),
    ArgSpec("C", ArgKind.TENSOR, description="output [M, top_k, N]"),
    ArgSpec("B_scale", ArgKind.TENSOR, description="[E, N, K/group]"),
    ArgSpec("B_zp", ArgKind.TENSOR, optional=True, description="zero points (int4: two per byte along N)"),
    *_ROUTING_ARGS,
    *_CONFIG_ARGS,
    ArgSpec("compute_type", ArgKind.ENUM, codec=_COMPUTE),
    ArgSpec("use_int8_w8a16", ArgKind.FLAG),
    ArgSpec("use_int4_w4a16", ArgKind.FLAG),
    ArgSpec("block_shape", ArgKind.OPAQUE, optional=True, codec=_BLOCK_SHAPE),
)


class TritonMoeOp:
    """The OpSpec of one Triton fused MoE launcher (see the module docstring)."""

    derived = DERIVED
    scratch = ("C",)
    output_name = "C"
    reference_ignores = frozenset(
        {"C", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages"}
    )
    """Launch settings; ``BLOCK_SIZE_M`` stays out: it changes which block writes a row."""
    derivation_inputs = frozenset(
        {"BLOCK_SIZE_M", "sorted_token_ids", "expert_ids", "num_tokens_post_padded", "top_k", "A", "B"}
    )

    def __init__(
        self,
        name: str,
        launcher: str,
        arguments: tuple[ArgSpec, ...],
        contracts: tuple[TensorContract, ...],
        mutable: tuple[MutableArg, ...],
    ) -> None:
        self.name = name
        self.launcher = launcher
        self.arguments = arguments
        self.contracts = contracts
        self.mutable = mutable

    # ---- loading ---------------------------------------------------------------------------------------------

    def recorded_args(self, args: Args) -> dict[str, Any]:
        """The launcher's ``config`` dict split into one pseudo-argument per :data:`CONFIG_KEYS` entry (other keys
        stay in ``config``); arguments already split pass through."""
        loaded = dict(args)
        config = loaded.get("config")
        if isinstance(config, Mapping) and any(key in config for key in CONFIG_KEYS):
            rest = {key: value for key, value in config.items() if key not in CONFIG_KEYS}
            for key in CONFIG_KEYS:
                loaded[key] = config.get(key)
            loaded["config"] = rest or None
        return loaded

    def launch_config(self, args: Args) -> dict[str, Any]:
        """The ``config`` dict the launcher takes, rebuilt from the pseudo-arguments and the other keys the call
        carried (``SPLIT_K``: kept as recorded, whatever is mutated). For the wna16 launcher, which keeps
        ``BLOCK_SIZE_N`` / ``BLOCK_SIZE_K`` only when the config has both (else it picks both), a call that sets
        one of them (a mutation of a captured call that had neither) gets the other at the launcher's own choice,
        so the mutated value is the one that runs."""
        config = dict(args.get("config") or {})
        for key in CONFIG_KEYS:
            value = args.get(key)
            if value is not None:
                config[key] = value
        if self.name == GPTQ_AWQ_OP and ("BLOCK_SIZE_N" in config) != ("BLOCK_SIZE_K" in config):
            for key, value in wna16_default_tiles(args).items():
                config.setdefault(key, value)
        return config

    # ---- contracts, derivation, shapes -----------------------------------------------------------------------

    def check(self, args: Args, *, check_device: bool = True) -> list[ContractViolation]:
        return (
            check_contracts(self.contracts, args, check_device=check_device)
            + layout_violations(args)
            + self.config_violations(args)
        )

    def config_violations(self, args: Args) -> list[ContractViolation]:
        """Config keys the kernel declares as constexprs that neither the call nor its launcher supplies: the
        launch fails before the kernel runs (Triton: ``missing … required positional argument``)."""
        config = self.launch_config(args)
        missing = [key for key in required_config_keys(self.name) if key not in config]
        if not missing:
            return []
        return [
            ContractViolation(
                "config",
                "presence",
                "keys " + ", ".join(required_config_keys(self.name)),
                "no " + ", ".join(missing),
                True,
                f"{self.launcher} passes the config on as **config to a kernel that declares "
                f"{', '.join(missing)} tl.constexpr: the launch is rejected",
            )
        ]

    def rederive(self, args: Args, changed: frozenset[str]) -> dict[str, Any]:
        new_args = dict(args)
        if "BLOCK_SIZE_M" in changed:
            new_args.update(rederive_alignment(args, int(args["BLOCK_SIZE_M"])))
        return new_args

    def rederive_routing(self, args: Args) -> dict[str, Any]:
        """The alignment arrays re-made from the routing they encode, for the call's own ``BLOCK_SIZE_M``."""
        try:
            block = int(args["BLOCK_SIZE_M"])
            return {**args, **rederive_alignment(args, block, captured=block)}
        except ReplayError as error:
            raise InvalidMutationError(f"cannot re-derive the routing metadata: {error}") from error

    def shape_dimensions(self, args: Args) -> list[tuple[str, tuple[int, ...], int]]:
        from moereplay.ops.fused_moe_triton_shapes import shape_dimensions

        return shape_dimensions(args)

    def shrink(self, args: Args, shape: Mapping[str, int]) -> dict[str, Any]:
        from moereplay.ops.fused_moe_triton_shapes import shrink

        return shrink(args, shape)

    def make_scratch(self, args: Args, device: torch.device) -> dict[str, Any]:
        c = args["C"]
        fresh = torch.empty_strided(tuple(c.shape), tuple(c.stride()), dtype=c.dtype, device=device).zero_()
        return {"C": fresh}

    # ---- running ---------------------------------------------------------------------------------------------

    def run(self, args: Args, backend: KernelBackend) -> torch.Tensor:
        module = backend.module(FUSED_MOE_MODULE)
        launcher = getattr(module, self.launcher)
        kwargs: dict[str, Any] = {}
        for spec in self.arguments:
            if spec.name in CONFIG_KEYS or spec.name == "config":
                continue
            kwargs[spec.name] = args.get(spec.name, spec.default)
        kwargs["config"] = self.launch_config(args)
        kwargs["compute_type"] = getattr(
            module.tl,
            {"bfloat16": "bfloat16", "float16": "float16"}.get(
                compute_type_name(args["compute_type"]), "float32"
            ),
        )
        if kwargs.get("block_shape") is not None:
            kwargs["block_shape"] = list(kwargs["block_shape"])
        launcher(**kwargs)
        return self.output_rows(args["C"])

    def output_rows(self, output: torch.Tensor) -> torch.Tensor:
        """``C`` (``[M, top_k, N]``) as the reference's ``[M · top_k, N]`` rows (the kernel's flat row ids)."""
        return output.reshape(-1, output.shape[-1]) if output.dim() > 2 else output

    def reads(self, args: Args) -> Reads:
        """Experts of the blocks the launch runs and the input rows their row ids name (:func:`block_reads`)."""
        return block_reads(
            args.get("sorted_token_ids"),
            args.get("expert_ids"),
            args.get("num_tokens_post_padded"),
            args.get("BLOCK_SIZE_M"),
            num_valid_tokens(args),
            args.get("top_k"),
            partial_block=True,
        )

    def layer_tokens(self, args: Args, rows: RowMap, batch: int) -> torch.Tensor | None:
        """The layer token of each output row: the row map's ``token`` is a row of ``A`` (the layer's tokens, or
        its token-major ``[tokens · top_k, N]`` intermediate with ``top_k`` 1)."""
        return tokens_by_activation_rows(rows.token, args.get("A"), batch)

    def reference(self, args: Args) -> ReferenceResult:
        from moereplay.reference import fused_moe_triton as ref

        common = {
            "A": args["A"],
            "B": args["B"],
            "topk_weights": args.get("topk_weights"),
            "sorted_token_ids": args.get("sorted_token_ids"),
            "expert_ids": args["expert_ids"],
            "num_tokens_post_padded": args["num_tokens_post_padded"],
            "mul_routed_weight": bool(args["mul_routed_weight"]),
            "top_k": int(args["top_k"]),
            "block_size_m": int(args["BLOCK_SIZE_M"]),
            "compute_type": args["compute_type"],
            "use_int8_w8a16": bool(args["use_int8_w8a16"]),
            "use_int4_w4a16": bool(args["use_int4_w4a16"]),
            "block_shape": args.get("block_shape"),
        }
        if self.name == GPTQ_AWQ_OP:
            result = ref.reference_fused_moe_kernel_gptq_awq(
                **common, B_scale=args["B_scale"], B_zp=args.get("B_zp")
            )
        else:
            result = ref.reference_fused_moe_kernel(
                **common,
                A_scale=args.get("A_scale"),
                B_scale=args.get("B_scale"),
                use_fp8_w8a8=bool(args["use_fp8_w8a8"]),
                use_int8_w8a8=bool(args["use_int8_w8a8"]),
                per_channel_quant=bool(args["per_channel_quant"]),
                B_bias=args.get("B_bias"),
            )
        top_k = int(args["top_k"])
        count = result.output.shape[0]
        ids = torch.arange(count, device=result.output.device)
        rows = RowMap(
            token=ids // top_k,
            expert=result.expert,
            slot=ids % top_k if top_k > 1 else torch.full_like(ids, -1),
            block=result.block,
        )
        terms = {"gemm": result.gemm}
        coefficients = {"gemm": result.row_weights}
        if result.bias_rows is not None:
            terms["bias"] = result.bias_rows
            coefficients["bias"] = result.row_weights
        sources: dict[str, CoefficientSource] = {}
        weights = args.get("topk_weights")
        if args.get("mul_routed_weight") and isinstance(weights, torch.Tensor):
            source = CoefficientSource("topk_weights", result.weight_index, weights.dtype)
            sources = {name: source for name in terms}
        return ReferenceResult(
            output=result.output,
            written=result.written,
            rows=rows,
            terms=terms,
            coefficients=coefficients,
            sources=sources,
        )


TRITON_MOE = register_op(
    TritonMoeOp(TRITON_OP, TRITON_LAUNCHER, TRITON_ARGUMENTS, TRITON_CONTRACTS, CONFIG_MUTABLE)
)
GPTQ_AWQ_MOE = register_op(
    TritonMoeOp(GPTQ_AWQ_OP, GPTQ_AWQ_LAUNCHER, GPTQ_ARGUMENTS, GPTQ_CONTRACTS, GPTQ_MUTABLE)
)
