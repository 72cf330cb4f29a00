"""Shape shrinking for the Triton fused MoE ops (the shape bisection's ``shape_dimensions`` / ``shrink``).

Dimensions, each ``(name, legal values ascending, original)``, in the order the search shrinks them:

- ``experts``: 1 … E (used experts kept first, renumbered densely; routes of dropped experts folded onto kept ones
  — :func:`moereplay.ops.marlin_shapes.kept_experts`);
- ``K``: multiples of the scale group along K (block-wise fp8: ``block_k``; weight-only: the group size; else 16);
- ``N``: multiples of ``block_n`` for block-wise scales, else 16 (int4 zero points: pairs along N stay whole);
- ``rows``: ``A``'s rows — tokens for gemm1, expanded rows for gemm2 (``top_k = 1``).

:func:`shrink` slices every tensor along those dimensions (packed int4 bytes and scale blocks by whole units),
re-aligns the routing with vLLM's ``moe_align_block_size`` for the call's ``BLOCK_SIZE_M`` and returns a valid call;
the naive block assignment (no ``sorted_token_ids``) keeps one block per row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from moereplay.errors import ReplayError
from moereplay.ops.base import Args
from moereplay.ops.marlin_shapes import kept_experts

Dimension = tuple[str, tuple[int, ...], int]
ORDER = ("experts", "K", "N", "rows")


def _stepped(name: str, original: int, step: int) -> Dimension | None:
    values = list(range(step, original, step))
    return (name, (*values, original), original) if values else None


def _block_shape(args: Args) -> tuple[int, int] | None:
    value = args.get("block_shape")
    if value is None:
        return None
    items = tuple(int(v) for v in value)
    return (items[0], items[1]) if len(items) == 2 else None


def _steps(args: Args) -> tuple[int, int]:
    """(K step, N step)."""
    shape = _block_shape(args)
    k_step, n_step = 16, 16
    if shape is not None and shape[1] > 0:
        k_step = math.lcm(k_step, shape[1])
    if shape is not None and shape[0] > 0:
        n_step = math.lcm(n_step, shape[0])
    return k_step, n_step


def _routes(args: Args) -> torch.Tensor:
    """``[A rows, top_k]`` expert of every row (−1: unrouted), from the call's alignment."""
    from moereplay.ops.fused_moe_triton import captured_block_size_m
    from moereplay.reference.moe_align import routing_from_alignment

    rows, top_k = int(args["A"].shape[0]), int(args["top_k"])
    if args.get("sorted_token_ids") is None:
        return args["expert_ids"].reshape(-1)[: rows * top_k].to(torch.int32).view(rows, top_k)
    return routing_from_alignment(
        args["sorted_token_ids"].reshape(-1),
        args["expert_ids"].reshape(-1),
        args["num_tokens_post_padded"],
        block_size=captured_block_size_m(args),
        top_k=top_k,
        size_m=rows,
    ).topk_ids


def shape_dimensions(args: Args) -> list[Dimension]:
    k_step, n_step = _steps(args)
    experts, n = int(args["B"].shape[0]), int(args["B"].shape[1])
    k, rows = int(args["A"].shape[1]), int(args["A"].shape[0])
    found = {
        "experts": _stepped("experts", experts, 1),
        "K": _stepped("K", k, k_step) if k % k_step == 0 else None,
        "N": _stepped("N", n, n_step) if n % n_step == 0 else None,
        "rows": _stepped("rows", rows, 1),
    }
    return [dimension for name in ORDER if (dimension := found[name]) is not None]


def _cut(value: Any, index: Any) -> Any:
    return value[index].contiguous() if isinstance(value, torch.Tensor) else value


def shrink(args: Args, shape: Mapping[str, int]) -> dict[str, Any]:
    """The call cut to ``shape`` (some or all of ``experts``, ``K``, ``N``, ``rows``); the original shape returns
    the arguments unchanged."""
    from moereplay.reference.moe_align import moe_align_block_size

    total, n0 = int(args["B"].shape[0]), int(args["B"].shape[1])
    rows0, k0 = int(args["A"].shape[0]), int(args["A"].shape[1])
    experts = int(shape.get("experts", total))
    k, n, rows = int(shape.get("K", k0)), int(shape.get("N", n0)), int(shape.get("rows", rows0))
    if (experts, k, n, rows) == (total, k0, n0, rows0):
        return dict(args)
    k_step, n_step = _steps(args)
    if not (1 <= experts <= total and 1 <= rows <= rows0 and 0 < k <= k0 and 0 < n <= n0):
        raise ReplayError(f"shape {dict(shape)} is outside the call's dimensions")
    if (k != k0 and k % k_step) or (n != n0 and n % n_step):
        raise ReplayError(f"K must be a multiple of {k_step} and N of {n_step}")
    top_k = int(args["top_k"])
    routes = _routes(args)[:rows]
    kept, mapping = kept_experts(routes.cpu(), total, experts)
    mapping = mapping.to(routes.device)
    new_routes = torch.where(
        routes >= 0, mapping[routes.clamp(min=0).long()], torch.full_like(mapping[:1], -1)
    )
    keep = torch.tensor(kept, dtype=torch.long, device=args["B"].device)
    out: dict[str, Any] = dict(args)
    shape_blocks = _block_shape(args)
    blockwise = (
        shape_blocks if shape_blocks is not None and shape_blocks[0] > 0 and shape_blocks[1] > 0 else None
    )
    group = shape_blocks[1] if shape_blocks is not None and shape_blocks[0] == 0 else None
    int4 = bool(args.get("use_int4_w4a16")) and group is not None

    out["A"] = _cut(args["A"], (slice(0, rows), slice(0, k)))
    b_k = k // 2 if int4 else k
    out["B"] = _cut(args["B"][keep], (slice(None), slice(0, n), slice(0, b_k)))
    scale = args.get("B_scale")
    if isinstance(scale, torch.Tensor):
        scale = scale[keep]
        if blockwise is not None:
            scale = scale[:, : -(-n // blockwise[0]), : -(-k // blockwise[1])]
        elif group is not None:
            scale = scale[:, :n, : -(-k // group)]
        elif scale.dim() >= 2:
            scale = scale[:, :n]
        out["B_scale"] = scale.contiguous()
    zp = args.get("B_zp")
    if isinstance(zp, torch.Tensor) and group is not None:
        zp = zp[keep]
        out["B_zp"] = zp[:, : (-(-n // 2) if int4 else n), : -(-k // group)].contiguous()
    a_scale = args.get("A_scale")
    if isinstance(a_scale, torch.Tensor) and a_scale.dim() >= 1 and a_scale.numel() > 1:
        a_scale = a_scale[:rows]
        if blockwise is not None and a_scale.dim() == 2:
            a_scale = a_scale[:, : -(-k // blockwise[1])]
        out["A_scale"] = a_scale.contiguous()
    bias = args.get("B_bias")
    if isinstance(bias, torch.Tensor):
        out["B_bias"] = bias[keep][:, :n].contiguous()
    weights = args.get("topk_weights")
    if isinstance(weights, torch.Tensor):
        out["topk_weights"] = weights.reshape(-1)[: rows * top_k].reshape(rows, top_k).contiguous()
    c = args["C"]
    out["C"] = torch.zeros(rows, top_k, n, dtype=c.dtype, device=c.device)
    device = args["expert_ids"].device
    if args.get("sorted_token_ids") is None:
        block = int(args["BLOCK_SIZE_M"])
        out["expert_ids"] = new_routes.reshape(-1).to(torch.int32).to(device)
        out["num_tokens_post_padded"] = torch.tensor([rows * top_k * block], dtype=torch.int32, device=device)
    else:
        sorted_ids, expert_ids, padded = moe_align_block_size(
            new_routes.to(torch.int32), int(args["BLOCK_SIZE_M"]), experts
        )
        out["sorted_token_ids"] = sorted_ids.to(device)
        out["expert_ids"] = expert_ids.to(device)
        out["num_tokens_post_padded"] = padded.to(device)
    return out
