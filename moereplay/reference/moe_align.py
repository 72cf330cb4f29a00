"""vLLM's ``moe_align_block_size`` in torch, and its inverse (routing from the arrays a capture holds).

Semantics of vLLM 0.25.1 (``vllm/model_executor/layers/fused_moe/moe_align_block_size.py`` and the CUDA op):

- ``topk_ids`` ``[M, top_k]`` is read flat: slot ``i`` is token ``i // top_k``, choice ``i % top_k``.
- An id outside ``[0, num_experts)`` is ignored; with an ``expert_map`` (global → local id, -1 = not on this rank)
  unmapped slots are ignored too and the output names *local* experts (vLLM's ``ignore_invalid_experts=True``, the
  Marlin path). With ``ignore_invalid_experts=False`` every global expert is counted and blocks of unmapped experts
  get id -1 afterwards (vLLM indexes ``expert_map`` with the block ids, so trailing -1 blocks take the map's last
  entry; that is reproduced).
- Each expert's slots are padded up to a multiple of ``block_size``; experts follow in id order.
- Order of the slots inside one expert (it changes nothing a GEMM computes, but a capture holds it): when
  ``numel < 1024`` and ``num_experts <= 64`` the CUDA op runs its one-block "small batch" kernel with
  ``threads = max(num_experts, 32)`` counting threads; thread ``t`` handles slots ``t, t + threads, …`` and each
  thread's slots of an expert come after those of lower threads. So an expert's slots are ordered by
  ``(slot % threads, slot // threads)`` — deterministic, and *not* ascending once ``numel > threads``.
  Larger calls rank slots with global atomics (``count_and_sort_expert_tokens``): the order inside an expert
  varies from run to run; ascending order is used for them. ``slot_order="ascending"`` asks for ascending
  order always.
- ``sorted_token_ids`` has ``numel + num_experts * (block_size - 1)`` entries (rounded up to ``block_size`` when
  ``pad_sorted_ids``; at most ``numel * block_size`` when ``numel < num_experts``), every unused entry = ``numel``.
- ``expert_ids`` has ``ceil(len(sorted_token_ids) / block_size)`` entries; blocks past the padded total are -1.
- ``num_tokens_post_padded`` is a 1-element int32 tensor: the padded total.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from moereplay.errors import ReferenceError_

#: ``"kernel"``: the order vLLM's CUDA op produces where it is deterministic (see the module docstring);
#: ``"ascending"``: slots ascending inside each expert.
SlotOrder = Literal["kernel", "ascending"]

#: The CUDA op's one-block path is taken for fewer slots than this …
SMALL_BATCH_SLOT_LIMIT = 1024
#: … and at most this many experts.
SMALL_BATCH_EXPERT_LIMIT = 64
#: Threads per warp on NVIDIA GPUs: the small-batch kernel counts with ``max(num_experts, WARP_SIZE)`` threads.
CUDA_WARP_SIZE = 32


def kernel_order_is_deterministic(numel: int, num_experts: int) -> bool:
    """Whether vLLM's CUDA ``moe_align_block_size`` takes its one-block path (a reproducible slot order)."""
    return numel < SMALL_BATCH_SLOT_LIMIT and num_experts <= SMALL_BATCH_EXPERT_LIMIT


def small_batch_threads(num_experts: int) -> int:
    """Counting threads of the small-batch kernel (the stride between the slots one thread handles)."""
    return max(num_experts, CUDA_WARP_SIZE)


def sorted_ids_capacity(numel: int, num_experts: int, block_size: int, pad_sorted_ids: bool = False) -> int:
    """The length vLLM allocates for ``sorted_token_ids``."""
    capacity = numel + num_experts * (block_size - 1)
    if pad_sorted_ids:
        capacity = -(-capacity // block_size) * block_size
    if numel < num_experts:
        capacity = min(numel * block_size, capacity)
    return capacity


def moe_align_block_size(
    topk_ids: torch.Tensor,
    block_size: int,
    num_experts: int,
    expert_map: torch.Tensor | None = None,
    pad_to: int | None = None,
    *,
    pad_sorted_ids: bool = False,
    ignore_invalid_experts: bool = True,
    slot_order: SlotOrder = "kernel",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_token_ids, expert_ids, num_tokens_post_padded)``, int32, on ``topk_ids``' device.

    ``pad_to`` overrides the length of ``sorted_token_ids`` (e.g. to match a captured buffer); it must hold the
    padded total. ``slot_order`` picks the order inside each expert (module docstring). Cost: one sort of
    ``topk_ids.numel()`` values.
    """
    if slot_order not in ("kernel", "ascending"):
        raise ReferenceError_(f"slot_order must be 'kernel' or 'ascending', got {slot_order!r}")
    if block_size <= 0 or num_experts <= 0:
        raise ReferenceError_(f"block_size and num_experts must be positive, got {block_size}, {num_experts}")
    if topk_ids.dim() != 2:
        raise ReferenceError_(f"topk_ids must be [tokens, top_k], got shape {tuple(topk_ids.shape)}")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.long)
    numel = flat.numel()
    valid = (flat >= 0) & (flat < num_experts)
    experts = torch.where(valid, flat, torch.zeros_like(flat))
    local_count = num_experts
    if expert_map is not None:
        mapping = expert_map.to(device=device, dtype=torch.long).reshape(-1)
        if mapping.numel() < num_experts:
            raise ReferenceError_(f"expert_map has {mapping.numel()} entries for {num_experts} experts")
        if ignore_invalid_experts:
            experts = mapping[experts]
            valid = valid & (experts >= 0)
            experts = torch.where(valid, experts, torch.zeros_like(experts))
    capacity = (
        pad_to if pad_to is not None else sorted_ids_capacity(numel, num_experts, block_size, pad_sorted_ids)
    )

    counts = torch.bincount(experts[valid], minlength=local_count)[:local_count]
    padded = (counts + block_size - 1) // block_size * block_size
    starts = torch.cumsum(padded, 0) - padded
    total = int(padded.sum())
    if total > capacity:
        raise ReferenceError_(f"padded total {total} exceeds the sorted_token_ids length {capacity}")

    sorted_token_ids = torch.full((capacity,), numel, dtype=torch.int32, device=device)
    slots = torch.nonzero(valid).reshape(-1)
    if slot_order == "kernel" and kernel_order_is_deterministic(numel, num_experts):
        threads = small_batch_threads(num_experts)
        per_thread = -(-numel // threads)
        within = (slots % threads) * per_thread + slots // threads  # < threads * per_thread
        order = torch.argsort(experts[slots] * (threads * per_thread) + within)
    else:
        order = torch.argsort(experts[slots] * max(numel, 1) + slots)
    slots = slots[order]
    slot_experts = experts[slots]
    rank = torch.arange(slots.numel(), device=device) - (torch.cumsum(counts, 0) - counts)[slot_experts]
    sorted_token_ids[starts[slot_experts] + rank] = slots.to(torch.int32)

    num_blocks = -(-capacity // block_size)
    expert_ids = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
    blocks_per_expert = padded // block_size
    expert_ids[: total // block_size] = torch.repeat_interleave(
        torch.arange(local_count, device=device, dtype=torch.int32), blocks_per_expert
    )
    if expert_map is not None and not ignore_invalid_experts:
        mapping = expert_map.to(device=device, dtype=torch.long).reshape(-1)
        expert_ids = mapping[expert_ids.to(torch.long)].to(torch.int32)
    num_tokens_post_padded = torch.tensor([total], dtype=torch.int32, device=device)
    return sorted_token_ids, expert_ids, num_tokens_post_padded


@dataclass(frozen=True)
class RoutingFromAlignment:
    """Routing recovered from captured alignment arrays.

    ``topk_ids`` ``[num_slots // top_k, top_k]`` holds the (local) expert of every slot, -1 for slots that appear in
    no processed block (routed to an expert of another rank, or dropped). ``duplicate_slots`` lists slots that
    appear more than once (a corrupt alignment; the last occurrence wins in ``topk_ids``).
    """

    topk_ids: torch.Tensor
    duplicate_slots: torch.Tensor
    block_size: int


def routing_from_alignment(
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor | int,
    *,
    block_size: int,
    top_k: int,
    size_m: int,
) -> RoutingFromAlignment:
    """Invert :func:`moe_align_block_size` for the slots ``[0, size_m * top_k)`` a kernel call covers.

    ``top_k`` and ``size_m`` are the kernel's (for a Marlin gemm2 call: ``top_k=1`` and ``size_m = tokens *
    routing top_k``; reshape the result to ``[tokens, routing_top_k]``). Blocks past ``num_tokens_post_padded``
    are ignored, as the kernels ignore them.
    """
    if block_size <= 0 or top_k <= 0 or size_m < 0:
        raise ReferenceError_("block_size and top_k must be positive and size_m non-negative")
    total = (
        int(num_tokens_post_padded.reshape(-1)[0])
        if isinstance(num_tokens_post_padded, torch.Tensor)
        else int(num_tokens_post_padded)
    )
    num_slots = size_m * top_k
    device = sorted_token_ids.device
    blocks = min(total // block_size, expert_ids.numel(), sorted_token_ids.numel() // block_size)
    ids = sorted_token_ids[: blocks * block_size].to(torch.long).view(blocks, block_size)
    block_experts = expert_ids[:blocks].to(torch.long).view(blocks, 1).expand(blocks, block_size)
    valid = (ids >= 0) & (ids < num_slots)
    slots = ids[valid]
    experts = block_experts[valid]
    # The last occurrence of a slot wins, deterministically (index_put with repeated indices would not).
    last = torch.full((num_slots,), -1, dtype=torch.long, device=device)
    last.scatter_reduce_(0, slots, torch.arange(slots.numel(), device=device), reduce="amax")
    present = last >= 0
    topk = torch.full((num_slots,), -1, dtype=torch.int32, device=device)
    topk[present] = experts[last[present]].to(torch.int32)
    seen = torch.bincount(slots, minlength=num_slots)[:num_slots]
    duplicates = torch.nonzero(seen > 1).reshape(-1)
    return RoutingFromAlignment(topk.view(size_m, top_k), duplicates, block_size)
