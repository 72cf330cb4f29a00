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


def _small_batch_kernel(topk_ids: torch.Tensor, block_size: int, experts: int, expert_map=None) -> list[int]:
    """A literal Python walk of the CUDA small-batch kernel's ranking: thread t counts slots t, t + T, …; an
    expert's slots of thread t follow those of threads < t."""
    flat = topk_ids.reshape(-1).tolist()
    threads = max(experts, 32)

    def local(i: int) -> int:
        e = flat[i]
        if e < 0 or e >= experts:
            return -1
        return e if expert_map is None else int(expert_map[e])

    counts = [[0] * experts for _ in range(threads + 1)]
    for t in range(threads):
        for i in range(t, len(flat), threads):
            if local(i) >= 0:
                counts[t + 1][local(i)] += 1
    for t in range(1, threads + 1):  # prefix over threads
        for e in range(experts):
            counts[t][e] += counts[t - 1][e]
    cumsum = [0]
    for e in range(experts):
        cumsum.append(cumsum[-1] + -(-counts[threads][e] // block_size) * block_size)
    out = [len(flat)] * cumsum[-1]
    for t in range(threads):
        for i in range(t, len(flat), threads):
            e = local(i)
            if e >= 0:
                out[cumsum[e] + counts[t][e]] = i
                counts[t][e] += 1
    return out


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "block_size"),
    [(45, 4, 16, 8), (45, 4, 16, 16), (30, 2, 40, 16), (9, 4, 64, 64), (255, 4, 8, 32)],
)
def test_kernel_order_matches_the_small_batch_kernel(
    tokens: int, top_k: int, experts: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(tokens * experts + block_size)
    topk_ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    topk_ids[0, 0] = experts + 3  # an id the op ignores
    sorted_ids, _, total = moe_align_block_size(topk_ids, block_size, experts)
    walked = _small_batch_kernel(topk_ids, block_size, experts)
    assert int(total) == len(walked)
    assert sorted_ids[: len(walked)].tolist() == walked
    expert_map = torch.tensor([i // 2 if i % 3 else -1 for i in range(experts)])
    sorted_ids, _, total = moe_align_block_size(topk_ids, block_size, experts, expert_map)
    walked = _small_batch_kernel(topk_ids, block_size, experts, expert_map)
    assert sorted_ids[: len(walked)].tolist() == walked


def test_kernel_order_hand_worked() -> None:
    # 40 slots of one expert, 32 counting threads: thread t holds slots t and t + 32 (t < 8), then t alone
    topk_ids = torch.zeros((20, 2), dtype=torch.int64)
    sorted_ids, _, total = moe_align_block_size(topk_ids, 8, 2)
    expected = [s for t in range(8) for s in (t, t + 32)] + list(range(8, 32))
    assert int(total) == 40 and sorted_ids[:40].tolist() == expected
    ascending, _, _ = moe_align_block_size(topk_ids, 8, 2, slot_order="ascending")
    assert ascending[:40].tolist() == list(range(40))
    # 1024 slots or more (or more than 64 experts): the op's order is not reproducible; ascending is used
    big = torch.zeros((512, 2), dtype=torch.int64)
    assert moe_align_block_size(big, 8, 2)[0][:1024].tolist() == list(range(1024))
    with pytest.raises(ReferenceError_):
        moe_align_block_size(topk_ids, 8, 2, slot_order="random")  # type: ignore[arg-type]
