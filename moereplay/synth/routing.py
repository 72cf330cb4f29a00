"""Routing for synthesized calls: a seeded softmax top-k, and the arrays each kernel family is handed for it.

- :func:`softmax_topk`: router logits ``N(0, 1)`` ``[tokens, experts]`` from a seeded CPU generator, softmax, top-k
  (``torch.topk``: descending weight, so per-token expert order is the router's, as vLLM's routers produce it);
  ``renormalize`` divides by the sum of the chosen weights (gpt-oss). Weights float32, ids int32.
- :func:`marlin_block_size`: the ``moe_block_size`` vLLM 0.25.1's ``fused_marlin_moe`` picks (the first of 8, 16,
  32, 48, 64 with ``tokens · top_k / experts / size < 0.9``; at least 16 for 8-bit activations).
- :func:`marlin_alignment`: ``moe_align_block_size`` (moereplay's torch implementation of vLLM's op).
- :func:`ogs_routing`: ``RoutingData`` / ``GatherIndx`` / ``ScatterIndx`` as plain specs, the way triton_kernels'
  ``routing_from_bitmatrix`` builds them from vLLM's ``make_routing_data`` (weights cast to bf16; flat slots sorted
  by expert, stably; per-``block_m`` padded offsets and tile maps for block_m 16, 32, 64, 128).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moereplay.errors import SettingsError

MARLIN_BLOCK_SIZES = (8, 16, 32, 48, 64)
OGS_BLOCK_SIZES = (16, 32, 64, 128)


@dataclass(frozen=True)
class TopK:
    """The router's choice: ``weights`` float32 and ``ids`` int32, both ``[tokens, top_k]``."""

    weights: torch.Tensor
    ids: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[1])


def softmax_topk(tokens: int, experts: int, top_k: int, seed: int, *, renormalize: bool = False) -> TopK:
    if not 1 <= top_k <= experts:
        raise SettingsError(f"top_k={top_k} must be between 1 and experts={experts}")
    if tokens < 1:
        raise SettingsError(f"tokens={tokens} must be positive")
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen, dtype=torch.float32)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return TopK(weights.contiguous(), ids.to(torch.int32).contiguous())


def marlin_block_size(tokens: int, top_k: int, experts: int, *, eight_bit_activations: bool = False) -> int:
    chosen = MARLIN_BLOCK_SIZES[-1]
    for size in MARLIN_BLOCK_SIZES:
        if tokens * top_k / experts / size < 0.9:
            chosen = size
            break
    return max(chosen, 16) if eight_bit_activations else chosen


def marlin_alignment(
    ids: torch.Tensor, block_size: int, experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_token_ids, expert_ids, num_tokens_past_padded)`` int32, as vLLM's op allocates and fills them."""
    from moereplay.reference.moe_align import moe_align_block_size

    return moe_align_block_size(ids, block_size, experts)


def ogs_routing(topk: TopK, experts: int) -> tuple[object, object, object]:
    """(RoutingSpec, GatherSpec, ScatterSpec) for ``matmul_ogs`` (see the module docstring)."""
    from moereplay.ops.ogs_codecs import ExptDataSpec, GatherSpec, RoutingSpec, ScatterSpec

    flat_ids = topk.ids.reshape(-1).to(torch.int64)
    flat_weights = topk.weights.to(torch.bfloat16).reshape(-1)
    topk_indx = torch.argsort(flat_ids, stable=True)
    gate_indx = torch.argsort(topk_indx, stable=True)
    gate_scal = flat_weights[topk_indx].contiguous()
    hist = torch.bincount(flat_ids, minlength=experts).to(torch.int32)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(hist, 0).to(torch.int32)])
    gates = flat_ids.numel()
    smallest = min(OGS_BLOCK_SIZES)
    max_tiles = gates if gates <= experts else experts - 1 - ((experts - gates - 1) // smallest)
    pads: dict[int, torch.Tensor] = {}
    maps: dict[int, torch.Tensor] = {}
    for block in OGS_BLOCK_SIZES:
        tiles = (hist + block - 1) // block
        pads[block] = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(tiles, 0).to(torch.int32)])
        tile_map = torch.full((max_tiles,), -1, dtype=torch.int32)
        columns = torch.arange(max_tiles, dtype=torch.int64)
        values = (torch.arange(experts, dtype=torch.int64)[:, None] + (columns << 16)[None, :]).to(
            torch.int32
        )
        positions = pads[block][:-1, None].to(torch.int64) + columns[None, :]
        mask = columns[None, :] < tiles[:, None]
        tile_map[positions[mask]] = values[mask]
        maps[block] = tile_map
    routing = RoutingSpec(gate_scal, hist, experts, topk.top_k, ExptDataSpec(hist, offsets, pads, maps))
    gather = GatherSpec(topk_indx.to(torch.int32), gate_indx.to(torch.int32))
    scatter = ScatterSpec(gate_indx.to(torch.int32), topk_indx.to(torch.int32))
    return routing, gather, scatter
