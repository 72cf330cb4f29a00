"""Smaller triton_kernels ``matmul_ogs`` calls for the shape bisection: fewer experts, tokens and top-k choices,
smaller N and K — every shrunk call a valid ``matmul_ogs`` call of the same weight format and layouts.

Dimensions (:func:`shape_dimensions`, in the order the search shrinks them):

- ``experts``: 1 … E. The experts the kept routes use are kept first (in id order) and renumbered densely; below
  that count the routes of the experts left out are folded onto the kept ones in turn
  (:func:`moereplay.ops.marlin_shapes.kept_experts`), so every kept (token, choice) slot stays routed.
- ``K``: multiples of 32 for MXFP4 (one e8m0 scale group; the Hopper value and scale swizzles pad the rest), of 16
  otherwise. With Hopper-swizzled scales K carries a *modulus*, the K tile (``block_k``, 128): those scales are
  loaded unmasked in whole K tiles, so the failure may depend on ``K % block_k`` rather than on K's size (see
  :mod:`moereplay.bisect.shape`).
- ``N``: multiples of 64 (and of the activation's ``reduction_n``; gpt-oss's w13 interleaves gate and up columns,
  so a prefix of columns keeps whole pairs). With Hopper-swizzled scales only the N whose ``block_n`` (as the
  nvidia heuristics pick it: 128 for 4 warps, else 256 above N = 128, else ``next_pow2(N)``) is a multiple of
  ``32 · num_warps`` — the kernel's in-register scale unswizzle asserts it at compile time, so with vLLM's 8 warps
  N starts at 192 — and N carries the modulus ``32 · num_warps``, the N rows of one swizzled scale slab (which
  columns an unmasked scale over-read lands on depends on it).
- ``tokens``: rows of ``x`` for a gathering call (gemm1), rows of ``y`` for a scattering one (gemm2).
- ``top_k``: 1 … ``n_expts_act``. Any combination is a legal call: top_k may exceed experts (a token then has
  several slots on one expert, rows the kernel computes like any other), so there is no cross-dimension rule.

:func:`shrink` recovers the routing the captured arrays encode — every computed expert-sorted row's expert (from the
histogram and offsets) and its flat (token, choice) slot (from ``gather_indx.src_indx``, else
``scatter_indx.dst_indx``) — keeps the slots of the first ``tokens`` tokens and ``top_k`` choices, maps their
experts, sorts them by (expert, slot) as ``routing_from_bitmatrix`` does, and rebuilds ``RoutingData`` (histogram,
offsets, per-``block_m`` padded offsets and tile maps for the block sizes the capture prepared), ``GatherIndx`` /
``ScatterIndx``, ``gate_scal``, ``gammas`` and ``betas`` (each sorted row keeps its own values), ``x`` (token rows,
or the sorted rows it holds for gemm2), the bias and ``y``. Weights are never sliced in swizzled form: the Hopper
values and scales are unswizzled (:mod:`moereplay.reference.hopper_mxfp4`) for the kept experts, cut to
``[K, N]`` in their logical layout and swizzled again with the same parameters, so the new storages are the bytes
the library's own prep would give for the smaller weight — including the short scale rows that the captured call
had (``32 · ceil_even(K / 32)`` bytes).

Cost: selecting experts costs one copy of the kept experts' storages; a new N or K one unswizzle and one swizzle of
them (a few passes over ``e · K · N / 2`` bytes, on the tensors' device).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moereplay.errors import InvalidMutationError, ReplayError
from moereplay.ops.base import Args
from moereplay.ops.ogs_codecs import (
    ExptDataSpec,
    FlexCtxSpec,
    FlexDataSpec,
    GatherSpec,
    LayoutSpec,
    LayoutTensor,
    PrecisionSpec,
    RoutingSpec,
    ScatterSpec,
)

DIMENSION_ORDER: tuple[str, ...] = ("experts", "K", "N", "tokens", "top_k")
"""Experts first (every later probe gets cheap), then the weight's sizes, then the routing's."""
MX_GROUP = 32
"""K elements per e8m0 scale: the K step of MXFP4 weights."""
PLAIN_K_STEP = 16
"""The K step of unquantised weights (the MMA's K granularity)."""
N_STEP = 64
"""The N step (the value swizzle's 16-row padding and every block_n the heuristics pick divide into it)."""
HOPPER_FP4_BLOCK_K = 128
"""block_k of Hopper MXFP4 weights (``ops.matmul_ogs.HOPPER_FP4_BLOCK_K``)."""


@dataclass(frozen=True)
class ShapeDimension:
    """A shrinkable dimension: legal values (ascending, ending with the original), the original, and optionally
    the modulus whose residue may matter (see :mod:`moereplay.bisect.shape`)."""

    name: str
    values: tuple[int, ...]
    original: int
    modulus: int | None = None


# --------------------------------------------------------------------------------------------------------------
# what the call is
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Call:
    """The plain arguments and sizes of a call the shrinker understands."""

    plain: dict[str, Any]
    experts: int
    k: int
    n: int
    tokens: int
    top_k: int
    reduction_n: int
    fp4: bool
    routing: RoutingSpec
    gather: GatherSpec | None
    scatter: ScatterSpec | None


def _plain(args: Args) -> dict[str, Any]:
    from moereplay.ops.matmul_ogs import plain_args

    return plain_args(args)


def _call(args: Args) -> _Call:
    """The call's plain form and sizes; :class:`ReplayError` for a call this module cannot shrink."""
    from moereplay.ops.matmul_ogs import problem_of

    plain = _plain(args)
    problem = problem_of(plain)
    routing = plain.get("routing_data")
    gather, scatter = plain.get("gather_indx"), plain.get("scatter_indx")
    if not isinstance(routing, RoutingSpec):
        raise ReplayError("cannot shrink a matmul_ogs call without routing data (a plain matmul)")
    if gather is None and scatter is None:
        raise ReplayError("cannot shrink a matmul_ogs call with neither a gather nor a scatter index")
    w = plain.get("w")
    if isinstance(w, LayoutTensor) and w.layout.kind not in ("STRIDED", "HOPPER_VALUE"):
        raise ReplayError(f"cannot shrink matmul_ogs weights in the {w.layout.kind} layout")
    if not isinstance(w, (LayoutTensor, torch.Tensor)):
        raise ReplayError(f"cannot shrink a matmul_ogs call whose weight is a {type(w).__name__}")
    if len(w.shape) != 3:
        raise ReplayError(
            f"cannot shrink a matmul_ogs call whose weight has shape {tuple(w.shape)}, not [E, K, N]"
        )
    precision = plain.get("precision_config")
    if isinstance(precision, PrecisionSpec):
        scale = precision.weight_scale
        if isinstance(scale, LayoutTensor) and scale.layout.kind not in ("STRIDED", "HOPPER_SCALE"):
            raise ReplayError(f"cannot shrink matmul_ogs weight scales in the {scale.layout.kind} layout")
        if isinstance(precision.act_scale, LayoutTensor) or isinstance(precision.out_scale, LayoutTensor):
            raise ReplayError("cannot shrink a matmul_ogs call with MX-scaled activations or outputs")
    x = plain["x"]
    top_k = int(routing.n_expts_act)
    if gather is not None:
        tokens = int(x.shape[-2])
    else:
        assert scatter is not None
        tokens = int(scatter.src_indx.numel()) // max(top_k, 1)
    if tokens < 1 or top_k < 1:
        raise ReplayError(f"cannot shrink a matmul_ogs call of {tokens} tokens × top-{top_k}")
    return _Call(
        plain=plain,
        experts=problem.experts,
        k=problem.k,
        n=problem.n,
        tokens=tokens,
        top_k=top_k,
        reduction_n=problem.reduction_n,
        fp4=problem.fp4,
        routing=routing,
        gather=gather,
        scatter=scatter,
    )


def _scale_layout(call: _Call) -> LayoutSpec | None:
    precision = call.plain.get("precision_config")
    scale = precision.weight_scale if isinstance(precision, PrecisionSpec) else None
    return scale.layout if isinstance(scale, LayoutTensor) else None


def _k_modulus(args: Args, call: _Call, step: int) -> int | None:
    """The K tile, when the kernel reads a tensor in whole K tiles whatever K is (Hopper-swizzled scales)."""
    chosen = args.get("block_k")
    layout = _scale_layout(call)
    if isinstance(chosen, int) and chosen > 0:
        block_k = chosen
    elif layout is not None and layout.kind == "HOPPER_SCALE" and call.fp4:
        block_k = HOPPER_FP4_BLOCK_K
    else:
        return None
    return block_k if block_k > step and block_k % step == 0 else None


def _n_modulus(args: Args, call: _Call, step: int) -> int | None:
    """The N rows of one Hopper scale slab (``32 · num_warps``)."""
    warps = _hopper_scale_warps(args, call)
    if warps is None:
        return None
    slab = 32 * warps
    return slab if slab > step and slab % step == 0 else None


def _hopper_scale_warps(args: Args, call: _Call) -> int | None:
    """The warp count the Hopper scale layout is swizzled for (the ``num_warps`` pseudo-argument re-lays it out)."""
    layout = _scale_layout(call)
    if layout is None or layout.kind != "HOPPER_SCALE":
        return None
    return int(args.get("num_warps") or layout.num_warps or 8)


def _n_compiles(args: Args, call: _Call) -> Callable[[int], bool]:
    """Whether the kernel compiles for an N: with Hopper scales ``block_n % (32 · num_warps) == 0``
    (``_matmul_ogs``' static assert), with ``block_n`` as ``opt_flags_nvidia.compute_block_n`` picks it."""
    warps = _hopper_scale_warps(args, call)
    if warps is None:
        return lambda n: True
    precision = call.plain.get("precision_config")
    imprecise = precision.max_num_imprecise_acc if isinstance(precision, PrecisionSpec) else None

    def compiles(n: int) -> bool:
        if warps == 4:
            block_n = 128
        elif imprecise is None and n > 128:
            block_n = 256
        else:
            block_n = max(16, min(128, 1 << (n - 1).bit_length()))
        return block_n % (32 * warps) == 0

    return compiles


def _stepped(
    name: str,
    original: int,
    step: int,
    modulus: int | None = None,
    legal: Callable[[int], bool] = lambda value: True,
) -> ShapeDimension | None:
    """Legal values ``step, 2·step, …`` below ``original``, then ``original``; ``None`` when nothing is smaller."""
    values = [value for value in range(step, original, step) if legal(value)]
    if not values:
        return None
    return ShapeDimension(name, (*values, original), original, modulus)


def shape_dimensions(args: Args) -> list[ShapeDimension]:
    """The call's shrinkable dimensions, in :data:`DIMENSION_ORDER` (see the module docstring)."""
    call = _call(args)
    k_step = MX_GROUP if call.fp4 else PLAIN_K_STEP
    n_step = math.lcm(N_STEP, call.reduction_n)
    found = {
        "experts": _stepped("experts", call.experts, 1),
        "K": _stepped("K", call.k, k_step, _k_modulus(args, call, k_step)),
        "N": _stepped("N", call.n, n_step, _n_modulus(args, call, n_step), _n_compiles(args, call)),
        "tokens": _stepped("tokens", call.tokens, 1),
        "top_k": _stepped("top_k", call.top_k, 1),
    }
    return [dimension for name in DIMENSION_ORDER if (dimension := found[name]) is not None]


# --------------------------------------------------------------------------------------------------------------
# routing
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Routes:
    """Per computed expert-sorted row (CPU int64): its position, its expert and its flat (token, choice) slot."""

    row: torch.Tensor
    expert: torch.Tensor
    flat: torch.Tensor


def _routes(call: _Call) -> _Routes:
    routing = call.routing
    data = routing.expt_data
    hist = data.hist if data is not None and data.hist is not None else routing.expt_hist
    if hist is None:
        raise ReplayError("cannot shrink: the routing data has neither expt_data.hist nor expt_hist")
    counts = hist.reshape(-1).to(torch.int64).cpu()[: call.experts]
    if data is not None and data.token_offs_raw is not None:
        starts = data.token_offs_raw.reshape(-1).to(torch.int64).cpu()[: counts.numel()]
    else:
        starts = torch.cumsum(counts, 0) - counts
    if call.gather is not None:
        slots = call.gather.src_indx.reshape(-1).to(torch.int64).cpu()
    else:
        assert call.scatter is not None
        slots = call.scatter.dst_indx.reshape(-1).to(torch.int64).cpu()
    row_parts: list[torch.Tensor] = []
    expert_parts: list[torch.Tensor] = []
    for expert_id, (start, count) in enumerate(zip(starts.tolist(), counts.tolist(), strict=True)):
        if count > 0:
            row_parts.append(torch.arange(start, start + count, dtype=torch.int64))
            expert_parts.append(torch.full((count,), expert_id, dtype=torch.int64))
    row = torch.cat(row_parts) if row_parts else torch.zeros(0, dtype=torch.int64)
    expert = torch.cat(expert_parts) if expert_parts else torch.zeros(0, dtype=torch.int64)
    if row.numel() and int(row.max()) >= slots.numel():
        raise ReplayError(f"cannot shrink: the routing claims rows up to {int(row.max())} of {slots.numel()}")
    flat = slots[row]
    valid = (flat >= 0) & (flat < call.tokens * call.top_k)
    return _Routes(row[valid], expert[valid], flat[valid])


def _expt_data(
    hist: torch.Tensor, experts: int, gates: int, original: ExptDataSpec | None, device: torch.device
) -> ExptDataSpec:
    """``ExptData`` for a histogram: offsets, and per captured ``block_m`` the padded offsets and the tile map
    (``block << 16 | expert`` per program, −1 after the last), sized as triton_kernels sizes it."""
    dtype = torch.int32
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(hist, 0)])
    blocks = sorted(original.block_pid_map) if original is not None and original.block_pid_map else []
    pads: dict[int, torch.Tensor] = {}
    maps: dict[int, torch.Tensor] = {}
    smallest = min(blocks) if blocks else 1
    max_tiles = gates if gates <= experts else experts - 1 - ((experts - gates - 1) // smallest)
    for block in blocks:
        tiles = (hist + block - 1) // block
        pad = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(tiles, 0)])
        tile_map = torch.full((max_tiles,), -1, dtype=torch.int64)
        for expert in range(experts):
            first, count = int(pad[expert]), int(tiles[expert])
            if count:
                tile_map[first : first + count] = expert + (torch.arange(count, dtype=torch.int64) << 16)
        pads[block] = pad.to(dtype).to(device)
        maps[block] = tile_map.to(dtype).to(device)
    return ExptDataSpec(
        hist.to(dtype).to(device),
        offsets.to(dtype).to(device),
        pads if original is not None and original.token_offs_pad is not None else None,
        maps if blocks else None,
    )


def kept_experts(experts: torch.Tensor, total: int, count: int) -> tuple[list[int], torch.Tensor]:
    """The experts kept (old ids, ascending) and the old → new id map (see :mod:`moereplay.ops.marlin_shapes`)."""
    from moereplay.ops.marlin_shapes import kept_experts as keep

    return keep(experts, total, count)


# --------------------------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------------------------


def _transposed(tensor: torch.Tensor) -> bool:
    """A transposed view (stride 1 on the second-to-last axis), as the Hopper layouts hand out."""
    return tensor.dim() >= 2 and tensor.stride(-2) == 1 and tensor.stride(-1) != 1


def _like(tensor: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``tensor`` in a fresh allocation, as a transposed view of a contiguous block when ``transposed``."""
    return tensor.mT.contiguous().mT if transposed else tensor.contiguous()


def _select_experts(storage: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Storage rows of the kept experts, in the original's orientation (a fresh allocation)."""
    return _like(storage.index_select(0, index.to(storage.device)), _transposed(storage))


def _mx_from_end(layout: LayoutSpec) -> int:
    assert layout.mx_axis is not None
    axis = layout.mx_axis
    return axis - len(layout.initial_shape) if axis >= 0 else axis


def _shrink_values(w: Any, index: torch.Tensor, k: int, n: int, call: _Call) -> Any:
    """The weight of the kept experts cut to ``[K=k, N=n]``, in the original's layout."""
    resized = (k, n) != (call.k, call.n)
    experts = int(index.numel())
    if isinstance(w, LayoutTensor) and w.layout.kind == "HOPPER_VALUE":
        from moereplay.reference.hopper_mxfp4 import swizzle_hopper_values, unswizzle_hopper_values

        layout = w.layout
        mx = _mx_from_end(layout)
        if mx != -2:
            raise ReplayError("cannot shrink Hopper values packed along N (mx_axis is not the K axis)")
        storage = _select_experts(w.storage, index)
        initial = (experts, *layout.initial_shape[1:])
        if resized:
            plain = unswizzle_hopper_values(storage, initial, mx, layout.mma_version or 3)
            cut = plain[:, : k // 2, :n]
            storage = swizzle_hopper_values(cut, mx, layout.mma_version or 3)
            initial = tuple(int(size) for size in cut.shape)
        new_layout = dataclasses.replace(layout, initial_shape=initial)
        shape = (experts, k, n)
        return dataclasses.replace(w, storage=storage, layout=new_layout, shape=shape, shape_max=shape)
    storage = w.storage if isinstance(w, LayoutTensor) else w
    packed = call.fp4 and storage.shape[-2] * 2 == call.k
    cut = storage.index_select(0, index.to(storage.device))[:, : k // 2 if packed else k, :n]
    new_storage = _like(cut, _transposed(storage))
    if not isinstance(w, LayoutTensor):
        return new_storage
    shape = (experts, k, n)
    new_layout = dataclasses.replace(w.layout, initial_shape=tuple(int(size) for size in new_storage.shape))
    return dataclasses.replace(w, storage=new_storage, layout=new_layout, shape=shape, shape_max=shape)


def _shrink_scales(scale: Any, index: torch.Tensor, k: int, n: int, call: _Call) -> Any:
    """The e8m0 weight scales of the kept experts cut to ``[ceil(k / 32), n]``, in the original's layout."""
    if scale is None:
        return None
    resized = (k, n) != (call.k, call.n)
    experts = int(index.numel())
    groups = -(-k // MX_GROUP)
    if isinstance(scale, LayoutTensor) and scale.layout.kind == "HOPPER_SCALE":
        from moereplay.reference.hopper_mxfp4 import swizzle_hopper_scales, unswizzle_hopper_scales

        layout = scale.layout
        mx = _mx_from_end(layout)
        if mx != -2:
            raise ReplayError("cannot shrink Hopper scales that run along N (mx_axis is not the K axis)")
        warps = layout.num_warps or 8
        storage = _select_experts(scale.storage, index)
        initial = (experts, *layout.initial_shape[1:])
        if resized:
            plain = unswizzle_hopper_scales(storage, initial, mx, warps)
            cut = plain[:, :groups, :n]
            storage = swizzle_hopper_scales(cut, mx, warps)
            initial = tuple(int(size) for size in cut.shape)
        new_layout = dataclasses.replace(layout, initial_shape=initial)
        return dataclasses.replace(
            scale, storage=storage, layout=new_layout, shape=initial, shape_max=initial
        )
    storage = scale.storage if isinstance(scale, LayoutTensor) else scale
    if not isinstance(storage, torch.Tensor) or storage.dim() != 3:
        raise ReplayError("cannot shrink matmul_ogs weight scales that are not [E, K/32, N]")
    cut = storage.index_select(0, index.to(storage.device))[:, :groups, :n]
    new_storage = _like(cut, _transposed(storage))
    if not isinstance(scale, LayoutTensor):
        return new_storage
    shape = tuple(int(size) for size in new_storage.shape)
    new_layout = dataclasses.replace(scale.layout, initial_shape=shape)
    return dataclasses.replace(scale, storage=new_storage, layout=new_layout, shape=shape, shape_max=shape)


def _per_expert(value: torch.Tensor | None, index: torch.Tensor, total: int) -> torch.Tensor | None:
    """A per-expert tensor (first axis E) for the kept experts; anything else unchanged."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != total or total == 1:
        return value
    return value.index_select(0, index.to(value.device)).contiguous()


def _shrink_precision(
    precision: PrecisionSpec | None, index: torch.Tensor, k: int, n: int, call: _Call
) -> PrecisionSpec | None:
    if precision is None:
        return None
    flex = precision.flex_ctx
    rhs = flex.rhs_data
    new_rhs: FlexDataSpec = dataclasses.replace(rhs, scale=_per_expert(rhs.scale, index, call.experts))
    return dataclasses.replace(
        precision,
        weight_scale=_shrink_scales(precision.weight_scale, index, k, n, call),
        flex_ctx=FlexCtxSpec(flex.lhs_data, new_rhs, flex.out_data),
    )


# --------------------------------------------------------------------------------------------------------------
# shrinking
# --------------------------------------------------------------------------------------------------------------


def _checked(shape: Mapping[str, int], args: Args, call: _Call) -> dict[str, int]:
    originals = {
        "experts": call.experts,
        "K": call.k,
        "N": call.n,
        "tokens": call.tokens,
        "top_k": call.top_k,
    }
    unknown = sorted(set(shape) - set(originals))
    if unknown:
        raise InvalidMutationError(f"unknown matmul_ogs shape dimension(s) {', '.join(unknown)}")
    wanted = {name: int(shape.get(name, original)) for name, original in originals.items()}
    legal = {dimension.name: dimension.values for dimension in shape_dimensions(args)}
    for name, value in wanted.items():
        if value != originals[name] and value not in legal.get(name, ()):
            raise InvalidMutationError(f"{name}={value} is not a legal shrunk value for this matmul_ogs call")
    return wanted


def _by_row(value: Any, rows: torch.Tensor) -> Any:
    """A per-sorted-row tensor (``gate_scal``, ``gammas``, ``betas``) for the new sorted rows."""
    if not isinstance(value, torch.Tensor):
        return value
    flat = value.reshape(-1)
    if rows.numel() and int(rows.max()) >= flat.numel():
        raise ReplayError(
            f"cannot shrink: a per-row tensor has {flat.numel()} entries, rows reach {int(rows.max())}"
        )
    return flat.index_select(0, rows.to(flat.device)).contiguous()


def shrink(args: Args, shape: Mapping[str, int]) -> dict[str, Any]:
    """The arguments of the call cut to ``shape`` (some or all dimension names → values), as plain specs.

    The original shape gives back the arguments unchanged. Values outside the dimensions' legal values raise
    :class:`InvalidMutationError` (a bisect probe of them is unresolved, never passing); a call this module cannot
    shrink raises :class:`ReplayError`.
    """
    call = _call(args)
    wanted = _checked(shape, args, call)
    experts, k, n = wanted["experts"], wanted["K"], wanted["N"]
    tokens, top_k = wanted["tokens"], wanted["top_k"]
    if (experts, k, n, tokens, top_k) == (call.experts, call.k, call.n, call.tokens, call.top_k):
        return dict(args)
    plain = call.plain
    x: torch.Tensor = plain["x"]
    device = x.device

    routes = _routes(call)
    token, choice = routes.flat // call.top_k, routes.flat % call.top_k
    keep = (token < tokens) & (choice < top_k)
    old_rows, old_experts = routes.row[keep], routes.expert[keep]
    flat = token[keep] * top_k + choice[keep]
    kept, mapping = kept_experts(old_experts, call.experts, experts)
    new_experts = mapping[old_experts] if old_experts.numel() else old_experts
    order = torch.argsort(new_experts * (tokens * top_k) + flat)
    old_rows, new_experts, flat = old_rows[order], new_experts[order], flat[order]
    rows = int(flat.numel())
    sorted_of_slot = torch.full((tokens * top_k,), -1, dtype=torch.int64)
    sorted_of_slot[flat] = torch.arange(rows, dtype=torch.int64)
    hist = torch.bincount(new_experts, minlength=experts)

    routing = call.routing
    gate_scal = _by_row(routing.gate_scal, old_rows)
    new_routing = dataclasses.replace(
        routing,
        gate_scal=gate_scal,
        expt_hist=None if routing.expt_hist is None else hist.to(routing.expt_hist.dtype).to(device),
        n_expts_tot=experts,
        n_expts_act=top_k,
        expt_data=_expt_data(hist, experts, rows, routing.expt_data, device)
        if routing.expt_data is not None
        else None,
    )

    def indices(like: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return values.to(like.dtype).to(like.device)

    shrunk: dict[str, Any] = dict(args)
    shrunk["routing_data"] = new_routing
    if call.gather is not None:
        shrunk["gather_indx"] = GatherSpec(
            indices(call.gather.src_indx, flat), indices(call.gather.dst_indx, sorted_of_slot)
        )
        shrunk["x"] = x[..., :tokens, :k].contiguous()
    else:
        shrunk["x"] = x[..., old_rows.to(device), :k].contiguous()
    if call.scatter is not None:
        shrunk["scatter_indx"] = ScatterSpec(
            indices(call.scatter.src_indx, sorted_of_slot), indices(call.scatter.dst_indx, flat)
        )
    for name in ("gammas", "betas"):
        value = plain.get(name)
        if isinstance(value, torch.Tensor):
            shared = routing.gate_scal is not None and value is routing.gate_scal
            shrunk[name] = gate_scal if shared else _by_row(value, old_rows)

    index = torch.tensor(kept, dtype=torch.int64)
    shrunk["w"] = _shrink_values(plain["w"], index, k, n, call)
    shrunk["precision_config"] = _shrink_precision(plain.get("precision_config"), index, k, n, call)
    bias = plain.get("bias")
    if isinstance(bias, torch.Tensor):
        selected = _per_expert(bias, index, call.experts)
        assert selected is not None
        shrunk["bias"] = selected[..., :n].contiguous()
    y = plain.get("y")
    if isinstance(y, torch.Tensor):
        rows_out = tokens if call.scatter is not None else rows  # a scatter writes one row per token
        shrunk["y"] = torch.zeros(
            (*y.shape[:-2], rows_out, n // call.reduction_n), dtype=y.dtype, device=y.device
        )
    return shrunk


def _inverse(index: torch.Tensor, size: int) -> torch.Tensor:
    """The inverse permutation of ``index`` (entry ``index[i]`` of the result is ``i``; −1 where nothing maps),
    sized ``size``, in ``index``'s dtype and device. Entries of ``index`` outside ``[0, size)`` are left out."""
    flat = index.reshape(-1).to(torch.int64).cpu()
    inverse = torch.full((size,), -1, dtype=torch.int64)
    valid = (flat >= 0) & (flat < size)
    inverse[flat[valid]] = torch.arange(flat.numel(), dtype=torch.int64)[valid]
    return inverse.to(index.dtype).to(index.device)


def rederived_routing(args: Args) -> dict[str, Any]:
    """``args`` with the routing metadata recomputed from the routing itself, as plain specs.

    The routing is the per-expert histogram (``expt_data.hist``, else ``expt_hist``) and the expert-sorted rows'
    flat (token, choice) slots (``gather_indx.src_indx`` / ``scatter_indx.dst_indx``); what is derived from them —
    ``expt_hist``, ``token_offs_raw``, per ``block_m`` the padded offsets and tile maps (sized as triton_kernels
    sizes them), and the inverse indices ``gather_indx.dst_indx`` / ``scatter_indx.src_indx`` — is recomputed. Rows
    keep their order (their values — ``gate_scal``, ``gammas`` — stay with them). :class:`InvalidMutationError`
    when the call holds no routing to derive from.
    """
    plain = _plain(args)
    routing = plain.get("routing_data")
    if not isinstance(routing, RoutingSpec):
        raise InvalidMutationError("the call has no routing data to re-derive")
    data = routing.expt_data
    hist = data.hist if data is not None and data.hist is not None else routing.expt_hist
    if hist is None:
        raise InvalidMutationError("the routing data has neither expt_data.hist nor expt_hist")
    experts = int(routing.n_expts_tot)
    counts = hist.reshape(-1).to(torch.int64).cpu()[:experts]
    rows = int(counts.sum())
    device = hist.device
    new_routing = dataclasses.replace(
        routing,
        expt_hist=None if routing.expt_hist is None else counts.to(routing.expt_hist.dtype).to(device),
        expt_data=None if data is None else _expt_data(counts, experts, rows, data, device),
    )
    out: dict[str, Any] = dict(args)
    out["routing_data"] = new_routing
    gather, scatter = plain.get("gather_indx"), plain.get("scatter_indx")
    if isinstance(gather, GatherSpec):
        out["gather_indx"] = GatherSpec(gather.src_indx, _inverse(gather.src_indx, gather.dst_indx.numel()))
    if isinstance(scatter, ScatterSpec):
        out["scatter_indx"] = ScatterSpec(
            _inverse(scatter.dst_indx, scatter.src_indx.numel()), scatter.dst_indx
        )
    return out
