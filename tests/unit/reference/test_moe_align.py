"""moe_align_block_size in torch: vLLM's documented example, buffer sizes, expert maps, and the inverse."""

from __future__ import annotations

import pytest
import torch

from moereplay.errors import ReferenceError_
from moereplay.reference.moe_align import moe_align_block_size, routing_from_alignment, sorted_ids_capacity


def test_documented_example() -> None:
    # vLLM's docstring example (experts 1..4, block 4): every expert gets 3 slots + 1 pad (pad value = numel = 12)
    topk_ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]])
    sorted_ids, expert_ids, total = moe_align_block_size(topk_ids, 4, 5)
    assert sorted_ids.dtype == expert_ids.dtype == total.dtype == torch.int32
    assert sorted_ids.shape == (12 + 5 * 3,)
    assert sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert (sorted_ids[16:] == 12).all()
    assert expert_ids.tolist() == [1, 2, 3, 4, -1, -1, -1]
    assert total.tolist() == [16]


def test_capacity_rules() -> None:
    assert sorted_ids_capacity(12, 4, 4) == 24
    assert sorted_ids_capacity(12, 4, 5, pad_sorted_ids=True) == 30  # 28 rounded up to 5
    assert sorted_ids_capacity(2, 32, 16) == 32  # fewer slots than experts: at most numel * block_size
    sorted_ids, expert_ids, _ = moe_align_block_size(torch.tensor([[5, 7]]), 16, 32)
    assert sorted_ids.numel() == 32 and expert_ids.numel() == 2
    assert sorted_ids.tolist() == [0] + [2] * 15 + [1] + [2] * 15
    assert expert_ids.tolist() == [5, 7]


def test_invalid_ids_and_expert_map() -> None:
    topk_ids = torch.tensor([[0, 3], [9, 1], [-1, 3]])  # 9 and -1 are outside [0, 4): ignored
    sorted_ids, expert_ids, total = moe_align_block_size(topk_ids, 2, 4)
    assert total.tolist() == [6]
    assert sorted_ids[:6].tolist() == [0, 6, 3, 6, 1, 5]
    assert expert_ids[:3].tolist() == [0, 1, 3]
    # rank-local experts: global 1 → 0, global 3 → 1, others not here
    expert_map = torch.tensor([-1, 0, -1, 1])
    sorted_ids, expert_ids, total = moe_align_block_size(topk_ids, 2, 4, expert_map)
    assert total.tolist() == [4]
    assert sorted_ids[:4].tolist() == [3, 6, 1, 5]
    assert expert_ids[:2].tolist() == [0, 1]
    # vLLM's ignore_invalid_experts=False: count globally, then map block ids (-1 for experts of other ranks)
    _, expert_ids, total = moe_align_block_size(topk_ids, 2, 4, expert_map, ignore_invalid_experts=False)
    assert total.tolist() == [6]
    assert expert_ids[:3].tolist() == [-1, 0, 1]


def test_pad_to_and_errors() -> None:
    sorted_ids, expert_ids, _ = moe_align_block_size(torch.tensor([[0, 1]]), 4, 2, pad_to=20)
    assert sorted_ids.numel() == 20 and expert_ids.numel() == 5
    with pytest.raises(ReferenceError_):
        moe_align_block_size(torch.tensor([[0, 1]]), 4, 2, pad_to=4)
    with pytest.raises(ReferenceError_):
        moe_align_block_size(torch.tensor([0, 1]), 4, 2)
    with pytest.raises(ReferenceError_):
        moe_align_block_size(torch.tensor([[0, 1]]), 0, 2)


@pytest.mark.parametrize("block_size", [8, 16, 32, 48, 64])
def test_round_trip(block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    tokens, top_k, experts = 37, 4, 16
    topk_ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    sorted_ids, expert_ids, total = moe_align_block_size(topk_ids, block_size, experts)
    assert int(total) % block_size == 0
    routing = routing_from_alignment(
        sorted_ids, expert_ids, total, block_size=block_size, top_k=top_k, size_m=tokens
    )
    assert torch.equal(routing.topk_ids.to(torch.long), topk_ids)
    assert routing.duplicate_slots.numel() == 0
    # gemm2 view of the same arrays: size_m = tokens * top_k, top_k = 1
    flat = routing_from_alignment(
        sorted_ids, expert_ids, total, block_size=block_size, top_k=1, size_m=tokens * top_k
    )
    assert torch.equal(flat.topk_ids.view(tokens, top_k).to(torch.long), topk_ids)


def test_inverse_marks_missing_and_duplicates() -> None:
    sorted_ids = torch.tensor([0, 2, 4, 4, 2, 4, 4, 4], dtype=torch.int32)
    expert_ids = torch.tensor([3, 5], dtype=torch.int32)
    routing = routing_from_alignment(sorted_ids, expert_ids, 8, block_size=4, top_k=2, size_m=2)
    assert routing.topk_ids.tolist() == [[3, -1], [5, -1]]  # slot 2 appears twice: the last block wins
    assert routing.duplicate_slots.tolist() == [2]
    # blocks past the padded total are ignored
    routing = routing_from_alignment(sorted_ids, expert_ids, 4, block_size=4, top_k=2, size_m=2)
    assert routing.topk_ids.tolist() == [[3, -1], [3, -1]]
