"""How much rounding a Marlin MoE launch adds when it combines split-K partial sums in the 16-bit output type.

Facts and assumptions (vLLM 0.25.1's ``marlin_template.h``, as :mod:`moereplay.ops.marlin_moe` records them):

- The kernel walks K in tiles of ``thread_k`` (64 or 128: the instantiated tiles; with ``thread_k=-1`` it picks one
  of them) and hands each thread block a stripe of tiles, so the blocks sharing one output element's K range — a
  *slice* — each cover whole tiles: at most ``size_k / thread_k`` blocks. The exact count depends on the grid (SM
  count × blocks per SM) and the number of moe blocks; we do not model it and take that upper bound, with the
  smallest instantiated tile (64) when the kernel chooses.
- ``use_atomic_add``: every block of a slice converts its float32 partial sum (after the epilogue: scales,
  routing weight) to the output type and adds it atomically (one more rounding per add, order varying between
  runs). ``use_atomic_add`` takes precedence over ``use_fp32_reduce``.
- ``use_fp32_reduce=False`` (no atomics): blocks of a slice take turns, each adding its float32 partial to the
  running sum read from the 16-bit output and writing it back rounded; the epilogue (routing weight, bias) runs
  on the final sum.
- With act order the kernel reads K in ``perm`` order, so the tiles are taken in that order.

The bound itself is :mod:`moereplay.reference.tolerance`'s; here we find its ingredients: for every written row,
the tile partial products of ``input[row] @ W[expert]`` (dequantised weights from the op's cache, the reference
just made them), ``|bias|`` (added into one partial) and the row's coefficient.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import torch

from moereplay.ops.base import Args, ReferenceResult
from moereplay.reference import scalar_types as st
from moereplay.reference.marlin_formats import MarlinExpertWeights
from moereplay.reference.marlin_moe import ExpertWeightCache
from moereplay.reference.tolerance import ErrorAllowance, roundings_of, split_k_allowance, split_k_magnitudes

#: The smallest ``thread_k`` any instantiated Marlin MoE tile has (the kernel's own choice is one of them).
MIN_THREAD_K = 64

#: The tile partial-product magnitudes depend on the input, the weights, which rows each expert computes and the
#: K tile — not on the moe block size, thread_n, blocks per SM or the reduction mode — so a sweep over launch
#: configs computes them once per tile. Keyed by tensor identity + version (the tensors are pinned by the entry,
#: so an id cannot be reused) and the row map's content; a few entries only (they pin the call's weights).
_MAGNITUDES: OrderedDict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]] = OrderedDict()
_MAGNITUDES_KEPT = 4
_WEIGHT_ARGUMENTS = (
    "input",
    "b_qweight",
    "b_scales",
    "global_scale",
    "b_qzeros",
    "g_idx",
    "perm",
    "b_q_type",
)


def _magnitudes_key(
    args: Args,
    tile: int,
    live: torch.Tensor,
    expert_of_row: torch.Tensor,
    input_row: torch.Tensor,
    shape: torch.Size,
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    parts: list[Any] = [tile, tuple(shape), bool(args.get("is_zp_float", False)), args.get("size_k")]
    pins: list[Any] = []
    for name in _WEIGHT_ARGUMENTS:
        value = args.get(name)
        if isinstance(value, torch.Tensor):
            parts.append((name, id(value), value._version, tuple(value.shape), str(value.dtype)))
            pins.append(value)
        else:
            parts.append((name, repr(value)))
    row_map = torch.stack([live.to(torch.int64), expert_of_row.to(torch.int64), input_row.to(torch.int64)])
    parts.append(hashlib.sha256(row_map.cpu().numpy().tobytes()).hexdigest())
    return tuple(parts), tuple(pins)


def reduction_mode(args: Args) -> str | None:
    """``"atomic add"``, ``"16-bit reduce"`` or ``None`` (float32 reduction: one rounding, of the final value)."""
    if args.get("use_atomic_add"):
        return "atomic add"
    if not args.get("use_fp32_reduce", True):
        return "16-bit reduce"
    return None


def tile_k(args: Args) -> int:
    """The K tile the slices are made of: the launch's ``thread_k`` when it divides ``size_k``, else the smallest
    instantiated one (or the largest power of two ≤ 64 dividing ``size_k``, for shapes no tile divides)."""
    size_k = int(args["size_k"])
    thread_k = args.get("thread_k", -1)
    if isinstance(thread_k, int) and thread_k > 0 and size_k % thread_k == 0:
        return thread_k
    tile = MIN_THREAD_K
    while tile > 1 and size_k % tile:
        tile //= 2
    return tile


def marlin_error_allowance(
    args: Args, reference: ReferenceResult, output_dtype: torch.dtype, cache: ExpertWeightCache
) -> ErrorAllowance | None:
    """The per-element rounding bound of ``args``' reduction mode (``None`` for the float32 reduction)."""
    mode = reduction_mode(args)
    if mode is None:
        return None
    atomic = mode == "atomic add"
    size_k = int(args["size_k"])
    tile = tile_k(args)
    slices = max(1, size_k // tile)
    input_ = args["input"]
    weights = MarlinExpertWeights.from_kernel_args(
        b_qweight=args["b_qweight"],
        b_scales=args["b_scales"],
        b_q_type=st.as_scalar_type(args["b_q_type"]),
        activation_dtype=input_.dtype,
        size_k=size_k,
        size_n=int(args["size_n"]),
        global_scale=args.get("global_scale"),
        b_qzeros=args.get("b_qzeros"),
        g_idx=args.get("g_idx"),
        perm=args.get("perm"),
        is_zp_float=bool(args.get("is_zp_float", False)),
    )
    output = reference.output
    device = output.device
    rows_total, cols = output.shape
    total = torch.zeros((rows_total, cols), dtype=torch.float32, device=device)
    subset = torch.zeros_like(total)
    written = reference.written.to(device)
    expert_of_row = reference.rows.expert.to(device)
    input_row = reference.rows.token.to(device)
    live = written & (expert_of_row >= 0)
    key, pins = _magnitudes_key(args, tile, live, expert_of_row, input_row, output.shape)
    remembered = _MAGNITUDES.get(key)
    if remembered is not None:  # another launch config (block size, tile n, reduce mode) of the same product
        _MAGNITUDES.move_to_end(key)
        total, subset = remembered[0], remembered[1]  # read only below: bias and bound make new tensors
    else:
        experts_used = torch.unique(expert_of_row[live])
        dense = cache.get_each(weights, experts_used)
        perm = weights.perm if weights.has_act_order else None
        for index, expert in enumerate(experts_used.tolist()):
            rows = torch.nonzero(live & (expert_of_row == expert)).reshape(-1)
            x = input_.index_select(0, input_row[rows].to(input_.device)).to(device, torch.float32)
            weight = dense[index].to(device)
            if perm is not None:
                order = perm[expert].to(device=device, dtype=torch.long)
                x, weight = x.index_select(1, order), weight.index_select(0, order)
            magnitudes = split_k_magnitudes(x, weight, tile)
            total[rows] = magnitudes.total
            subset[rows] = magnitudes.subset
        _MAGNITUDES[key] = (total, subset, pins)
        while len(_MAGNITUDES) > _MAGNITUDES_KEPT:
            _MAGNITUDES.popitem(last=False)
    bias = reference.terms.get("bias")
    if bias is not None:
        magnitude = bias.to(device, torch.float32).abs()
        total, subset = total + magnitude, subset + magnitude
    coefficient = reference.coefficients.get("gemm")
    absolute = split_k_allowance(
        total, subset, slices=slices, atomic=atomic, dtype=output_dtype, coefficient=coefficient
    )
    absolute = torch.where(written[:, None], absolute, torch.zeros_like(absolute))
    type_name = str(output_dtype).removeprefix("torch.")
    return ErrorAllowance(
        absolute=absolute,
        cause=mode,
        label=f"{mode} (≤{slices} {type_name} partial sums per element)",
        roundings=roundings_of(slices, atomic=atomic),
        order_dependent=atomic,
    )
