"""Smaller ``moe_wna16_marlin_gemm`` calls for the shape bisection: fewer experts, rows and top-k choices, smaller N
and K — every shrunk call still a valid Marlin call of the same weight format.

Dimensions (:func:`shape_dimensions`; each ``(name, legal values ascending, original value)``, in the order the
search shrinks them):

- ``experts``: 1 … E. The experts the routing actually uses are kept first (in id order), renumbered densely; below
  that count the routes of the experts left out are folded onto the kept ones in turn, so every routed row stays
  routed; above it, unused experts fill up (they cost memory, not work).
- ``K``: multiples of ``lcm(128, group size, thread_k)`` (a K tile of 128 exists at every block size, and every
  scale group stays whole); not offered with act order (``g_idx``/``perm`` mix K rows) or 8-bit activations.
- ``N``: multiples of ``lcm(64, thread_n)`` (Marlin's 64-wide tile; the (128, 64) tile then always fits); not
  offered with 8-bit activations.
- ``rows``: the kernel's ``size_m`` — tokens for gemm1, expanded (token, choice) rows for gemm2 (``top_k = 1``).
- ``top_k``: 1 … top_k, when the call routes each row to several experts (gemm1).

:func:`shrink` re-slices the packed tensors exactly — ``b_qweight`` through :mod:`moereplay.reference.marlin_layout`
(unpack → slice → pack), scales un-permuted (and their FP4/MX pair swap undone), sliced and permuted again in the
order the new group count needs, zero points and the bias likewise — and re-derives the routing arrays with
:func:`moereplay.reference.moe_align.moe_align_block_size` from the routing the captured arrays encode. Rows keep
their routing weights and their dtype: a ``topk_weights`` of the wrong dtype stays wrong, as the bisection needs.

Cost: one unpack and one pack of the kept experts' weights when N or K change (a few passes over ``e · K · N``
codes, on the tensors' device); nothing heavy otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from moereplay.errors import ReplayError
from moereplay.ops.base import Args
from moereplay.reference import marlin_layout as layout
from moereplay.reference import scalar_types as st
from moereplay.reference.marlin_formats import MarlinWeightFormat, detect_format

DIMENSION_ORDER: tuple[str, ...] = ("experts", "K", "N", "rows", "top_k")
"""Shrinking experts first makes every later probe cheap; rows and top-k last, since they decide what is wrong."""
K_TILE = 128
"""The K step: the (128, 64) thread tile is instantiated for every block size, so K % 128 == 0 always launches."""
N_TILE = 64
"""The N step: Marlin's tile width (and the scale permutation's run of 64)."""
_SWAPPED_SCALE_FORMATS = (MarlinWeightFormat.NVFP4, MarlinWeightFormat.MXFP4, MarlinWeightFormat.MXFP8)
_EIGHT_BIT_ACTIVATIONS = (torch.float8_e4m3fn, torch.int8)

Dimension = tuple[str, tuple[int, ...], int]


def _present(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() > 0


def weight_format(args: Args) -> MarlinWeightFormat:
    """The call's weight format, by the kernel's own dispatch (``b_q_type``, then the scale dtype)."""
    try:
        return detect_format(
            st.as_scalar_type(args.get("b_q_type")),
            args["b_scales"],
            has_zero_points=_present(args.get("b_qzeros")),
            is_zp_float=bool(args.get("is_zp_float")),
            has_global_scale=_present(args.get("global_scale")),
        )
    except Exception as error:
        raise ReplayError(f"cannot shrink this Marlin call: {error}") from error


def _group_size(args: Args) -> int | None:
    """Rows of K per scale group; ``None`` when channel-wise (one group)."""
    groups = int(args["b_scales"].shape[1])
    return None if groups <= 1 else int(args["size_k"]) // groups


def _act_order(args: Args) -> bool:
    return _present(args.get("g_idx")) and _present(args.get("perm"))


def _eight_bit(args: Args) -> bool:
    return args["input"].dtype in _EIGHT_BIT_ACTIVATIONS


def k_step(args: Args) -> int:
    """The step of legal K values (see the module docstring)."""
    step = K_TILE
    group = _group_size(args)
    if group is not None:
        step = math.lcm(step, group)
    thread_k = args.get("thread_k", -1)
    if isinstance(thread_k, int) and thread_k > 0:
        step = math.lcm(step, thread_k)
    return step


def n_step(args: Args) -> int:
    """The step of legal N values (see the module docstring)."""
    step = N_TILE
    thread_n = args.get("thread_n", -1)
    if isinstance(thread_n, int) and thread_n > 0:
        step = math.lcm(step, thread_n)
    return step


def _stepped(name: str, original: int, step: int) -> Dimension | None:
    """Values ``step, 2·step, …`` below ``original``, then ``original``; ``None`` when nothing is smaller."""
    values = [value for value in range(step, original, step)]
    return (name, (*values, original), original) if values else None


def shape_dimensions(args: Args) -> list[Dimension]:
    """The call's shrinkable dimensions as ``(name, legal values, original)``, in :data:`DIMENSION_ORDER`."""
    weight_format(args)  # refuse a call the shrinker cannot re-pack, before any search starts
    experts = int(args["b_qweight"].shape[0])
    size_m, top_k = int(args["size_m"]), int(args["top_k"])
    found: dict[str, Dimension | None] = {
        "experts": _stepped("experts", experts, 1),
        "rows": _stepped("rows", size_m, 1),
        "top_k": _stepped("top_k", top_k, 1),
    }
    if not _eight_bit(args):
        found["N"] = _stepped("N", int(args["size_n"]), n_step(args))
        if not _act_order(args):
            found["K"] = _stepped("K", int(args["size_k"]), k_step(args))
    return [dimension for name in DIMENSION_ORDER if (dimension := found.get(name)) is not None]


# --------------------------------------------------------------------------------------------------------------
# shrinking
# --------------------------------------------------------------------------------------------------------------


def _checked(shape: Mapping[str, int], args: Args) -> tuple[int, int, int, int, int]:
    """(experts, rows, top_k, N, K) of the shrunk call; each within its dimension's legal values."""
    originals = {
        "experts": int(args["b_qweight"].shape[0]),
        "rows": int(args["size_m"]),
        "top_k": int(args["top_k"]),
        "N": int(args["size_n"]),
        "K": int(args["size_k"]),
    }
    unknown = sorted(set(shape) - set(originals))
    if unknown:
        raise ReplayError(f"unknown Marlin shape dimension(s) {', '.join(unknown)}")
    wanted = {name: int(shape.get(name, original)) for name, original in originals.items()}
    legal = {dimension[0]: dimension[1] for dimension in shape_dimensions(args)}
    for name, value in wanted.items():
        if value != originals[name] and value not in legal.get(name, ()):
            raise ReplayError(f"{name}={value} is not a legal shrunk value for this Marlin call")
    return wanted["experts"], wanted["rows"], wanted["top_k"], wanted["N"], wanted["K"]


def _routes(args: Args) -> torch.Tensor:
    """``[size_m, top_k]`` expert of every slot (−1: in no processed block), from the captured alignment."""
    from moereplay.ops.marlin_moe import captured_block_size
    from moereplay.reference.moe_align import routing_from_alignment

    return routing_from_alignment(
        args["sorted_token_ids"].reshape(-1),
        args["expert_ids"].reshape(-1),
        args["num_tokens_past_padded"],
        block_size=captured_block_size(args),
        top_k=int(args["top_k"]),
        size_m=int(args["size_m"]),
    ).topk_ids


def kept_experts(routes: torch.Tensor, total: int, count: int) -> tuple[list[int], torch.Tensor]:
    """The ``count`` experts a shrunk call keeps (old ids, ascending) and the old → new id map (``[total]`` long).

    Used experts come first; an expert left out that the routing uses maps onto a kept one (in turn), so no
    routed row loses its route.
    """
    used = sorted({int(expert) for expert in routes[routes >= 0].tolist()})
    if count <= len(used):
        kept = used[:count]
        dropped = used[count:]
    else:
        used_set = set(used)
        unused = [expert for expert in range(total) if expert not in used_set]
        kept = sorted(used + unused[: count - len(used)])
        dropped = []
    mapping = torch.full((total,), -1, dtype=torch.long)
    for new, old in enumerate(kept):
        mapping[old] = new
    for position, old in enumerate(dropped):
        mapping[old] = position % count
    return kept, mapping


def _as_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """An integer view of the same bytes (permutations then move any dtype, fp8 and e8m0 included)."""
    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()]
    return tensor.contiguous().view(integer), tensor.dtype


def _shrink_scales(
    scales: torch.Tensor, fmt: MarlinWeightFormat, groups: int, n: int, *, grouped: bool
) -> torch.Tensor:
    raw, dtype = _as_bytes(scales)
    swapped = fmt in _SWAPPED_SCALE_FORMATS
    logical = layout.unpermute_scales(layout.swap_scale_pairs(raw) if swapped else raw, grouped)
    logical = logical[:, :groups, :n].contiguous()
    packed = layout.permute_scales(logical, layout.scales_are_grouped(groups))
    if swapped:
        packed = layout.swap_scale_pairs(packed)
    return packed.contiguous().view(dtype)


def _shrink_weights(
    args: Args, kept: list[int], n: int, k: int, fmt: MarlinWeightFormat
) -> dict[str, torch.Tensor | None]:
    """The weight-side tensors for the kept experts, cut to ``[K=k, N=n]``."""
    device = args["b_qweight"].device
    index = torch.tensor(kept, dtype=torch.long, device=device)
    size_n, size_k = int(args["size_n"]), int(args["size_k"])
    resized = (n, k) != (size_n, size_k)
    bits = fmt.num_bits
    out: dict[str, torch.Tensor | None] = {}

    weight = args["b_qweight"].index_select(0, index)
    if resized:
        codes = layout.unpack_weights(weight, bits)[:, :k, :n].contiguous()
        weight = layout.pack_weights(codes, bits)
    out["b_qweight"] = weight

    scales = args["b_scales"]
    scales = scales.index_select(0, index.to(scales.device))
    groups = int(scales.shape[1])
    new_groups = groups if groups <= 1 else k // (size_k // groups)
    if resized:
        scales = _shrink_scales(scales, fmt, new_groups, n, grouped=layout.scales_are_grouped(groups))
    out["b_scales"] = scales

    zeros = args.get("b_qzeros")
    if _present(zeros):
        assert zeros is not None
        zeros = zeros.index_select(0, index.to(zeros.device))
        if resized and fmt is MarlinWeightFormat.AWQ_INT4_FZP:
            logical = layout.unpermute_float_zero_points(zeros)[:, :new_groups, :n].contiguous()
            zeros = layout.permute_float_zero_points(logical).contiguous()
        elif resized:
            logical = layout.unpack_zero_points(zeros, bits)[:, :new_groups, :n].contiguous()
            zeros = layout.pack_zero_points(logical, bits)
        out["b_qzeros"] = zeros

    bias = args.get("b_bias")
    if _present(bias):
        assert bias is not None
        bias = bias.index_select(0, index.to(bias.device))
        if resized:
            bias = layout.permute_bias(layout.unpermute_bias(bias)[:, :n].contiguous()).contiguous()
        out["b_bias"] = bias

    global_scale = args.get("global_scale")
    if _present(global_scale):
        assert global_scale is not None
        out["global_scale"] = global_scale.index_select(0, index.to(global_scale.device)).contiguous()

    for name in ("g_idx", "perm"):
        value = args.get(name)
        if _present(value):
            assert value is not None
            out[name] = value.index_select(0, index.to(value.device)).contiguous()
    return out


def _shrink_topk_weights(
    weights: torch.Tensor, size_m: int, top_k: int, rows: int, choices: int
) -> torch.Tensor:
    """The routing weights of the kept slots, flat by new slot (the kernel reads them flat by output row)."""
    flat = weights.reshape(-1)
    if flat.numel() >= size_m * top_k:
        return flat[: size_m * top_k].view(size_m, top_k)[:rows, :choices].reshape(-1).contiguous()
    return flat[: min(flat.numel(), rows * choices)].contiguous()  # another length: keep its first elements


def shrink(args: Args, shape: Mapping[str, int]) -> dict[str, Any]:
    """The arguments of the call cut to ``shape`` (a mapping of some or all dimension names to values).

    The original shape gives back the arguments unchanged. Raises :class:`ReplayError` for values outside the
    dimensions' legal values.
    """
    from moereplay.reference.moe_align import moe_align_block_size

    experts, rows, choices, n, k = _checked(shape, args)
    total = int(args["b_qweight"].shape[0])
    size_m, top_k = int(args["size_m"]), int(args["top_k"])
    size_n, size_k = int(args["size_n"]), int(args["size_k"])
    if (experts, rows, choices, n, k) == (total, size_m, top_k, size_n, size_k):
        return dict(args)
    fmt = weight_format(args)

    routes = _routes(args)[:rows, :choices]
    kept, mapping = kept_experts(routes.cpu(), total, experts)
    mapping = mapping.to(routes.device)
    new_routes = torch.where(
        routes >= 0, mapping[routes.clamp(min=0).long()], torch.full_like(mapping[:1], -1)
    )
    block = int(args["moe_block_size"])
    sorted_ids, expert_ids, padded = moe_align_block_size(new_routes.to(torch.int32), block, experts)

    shrunk: dict[str, Any] = dict(args)
    shrunk.update(_shrink_weights(args, kept, n, k, fmt))
    device = args["sorted_token_ids"].device
    shrunk["sorted_token_ids"] = sorted_ids.to(device)
    shrunk["expert_ids"] = expert_ids.to(device)
    shrunk["num_tokens_past_padded"] = padded.to(device)
    shrunk["topk_weights"] = _shrink_topk_weights(args["topk_weights"], size_m, top_k, rows, choices)
    shrunk["input"] = args["input"][:rows, :k].contiguous()
    output = args.get("output")
    if isinstance(output, torch.Tensor):
        shrunk["output"] = torch.zeros((rows * choices, n), dtype=output.dtype, device=output.device)
    a_scales = args.get("a_scales")
    if _present(a_scales) and a_scales is not None and a_scales.shape[0] == size_m:
        shrunk["a_scales"] = a_scales[:rows].contiguous()
    shrunk.update(size_m=rows, top_k=choices, size_n=n, size_k=k)
    return shrunk
