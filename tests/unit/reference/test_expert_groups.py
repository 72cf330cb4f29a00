"""Grouping rows by expert and the per-expert product: the same bits as a plain per-expert loop, whatever the views'
offsets, run lengths and row counts."""

from __future__ import annotations

import pytest
import torch

from moereplay.reference import expert_groups, fused_moe_triton
from moereplay.reference.expert_groups import expert_runs, group_by_expert, matmul_into, on_threads
from moereplay.reference.fused_moe_triton import reference_fused_moe_kernel
from moereplay.reference.moe_align import moe_align_block_size


def test_rows_are_grouped_stably_by_expert() -> None:
    groups = group_by_expert(torch.tensor([3, 1, 3, 0, 1, 3]))
    assert groups.order.tolist() == [3, 1, 4, 0, 2, 5]
    assert (groups.experts, groups.counts, groups.starts) == ((0, 1, 3), (1, 2, 3), (0, 1, 3))
    empty = group_by_expert(torch.zeros(0, dtype=torch.long))
    assert empty.experts == () and empty.order.numel() == 0


def test_runs_are_consecutive_ids_at_most_so_long() -> None:
    assert list(expert_runs((0, 1, 2, 4, 5, 9), 10)) == [(0, 3), (3, 2), (5, 1)]
    assert list(expert_runs((0, 1, 2, 3, 4), 2)) == [(0, 2), (2, 2), (4, 1)]
    assert list(expert_runs((7,), 0)) == [(0, 1)]
    assert list(expert_runs((), 4)) == []


@pytest.mark.parametrize("offset", [0, 1, 3, 16])
def test_matmul_into_views_at_any_offset_matches_fresh_operands(offset: int) -> None:
    gen = torch.Generator().manual_seed(offset)
    k, n = 37, 13
    x_buffer = torch.randn(offset + 5, k, generator=gen)
    w_buffer = torch.randn(2 * n * k + offset, generator=gen)
    x = x_buffer[offset : offset + 5]
    weight = w_buffer[offset : offset + n * k].view(n, k).T  # [K, N], a transposed view as the references use
    out_buffer = torch.full((offset + 5, n), float("nan"))
    out = out_buffer[offset : offset + 5]
    matmul_into(out, x, weight)
    expected = x.clone() @ weight.T.clone().T
    assert torch.equal(out, expected)
    assert torch.isnan(out_buffer[:offset]).all(), "wrote outside its rows"


def test_misaligned_operands_are_copied_before_the_product(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int, int]] = []
    real = torch.mm

    def recording(a: torch.Tensor, b: torch.Tensor, **kwargs: object) -> torch.Tensor:
        out = kwargs.get("out")
        pointers = (a.data_ptr(), b.data_ptr(), out.data_ptr() if isinstance(out, torch.Tensor) else 0)
        seen.append(tuple(p % 64 for p in pointers))  # type: ignore[arg-type]
        return real(a, b, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(expert_groups.torch, "mm", recording)
    x = torch.randn(4, 9)[1:]  # 36 bytes in: misaligned
    weight = torch.randn(5 * 9 + 1)[1:].view(5, 9).T
    out = torch.empty(4, 5)[1:]
    matmul_into(out, x, weight)
    assert seen == [(0, 0, 0)]


def _naive_triton(kwargs: dict, routed: torch.Tensor) -> torch.Tensor:
    """The gemm term computed the plain way: every used expert's rows, one fresh matmul each."""
    top_k, A, B = kwargs["top_k"], kwargs["A"], kwargs["B"]
    flat = routed.reshape(-1)
    gemm = torch.zeros(flat.numel(), B.shape[1])
    for expert in torch.unique(flat).tolist():
        rows = torch.nonzero(flat == expert).reshape(-1)
        gemm[rows] = A[rows // top_k].to(torch.float32) @ B[expert].to(torch.float32).T
    return gemm


@pytest.mark.parametrize("tokens", [1, 3, 24])
@pytest.mark.parametrize("most", [1, 3, 1 << 30])
def test_triton_gemm_is_a_per_expert_loop_bit_for_bit(
    tokens: int, most: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Odd K and N put the grouped views at offsets a fresh tensor never has; runs of 1, 3 or all experts."""
    experts, top_k, k, n = 7, 3, 37, 13
    gen = torch.Generator().manual_seed(tokens)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=gen), -1), top_k)
    sorted_ids, expert_ids, padded = moe_align_block_size(ids.to(torch.int32), 16, experts)
    kwargs = {
        "A": torch.randn(tokens, k, generator=gen).to(torch.bfloat16),
        "B": torch.randn(experts, n, k, generator=gen).to(torch.bfloat16),
        "top_k": top_k,
    }
    monkeypatch.setitem(fused_moe_triton.DENSE_ELEMENTS_AT_ONCE, "cpu", most * n * k)
    result = reference_fused_moe_kernel(
        **kwargs,
        A_scale=None,
        B_scale=None,
        topk_weights=weights,
        sorted_token_ids=sorted_ids,
        expert_ids=expert_ids,
        num_tokens_post_padded=padded,
        mul_routed_weight=True,
        block_size_m=16,
        compute_type="bfloat16",
        use_fp8_w8a8=False,
        use_int8_w8a8=False,
        use_int8_w8a16=False,
        use_int4_w4a16=False,
        per_channel_quant=False,
    )
    assert torch.equal(result.gemm, _naive_triton(kwargs, ids))
    assert torch.equal(result.output, result.gemm * weights.reshape(-1, 1))


def test_row_buckets_share_one_for_small_groups_and_powers_of_two_above() -> None:
    small = expert_groups.SMALL_GROUP_ROWS
    assert expert_groups.row_buckets((1, 2, 3, 0, 9)) == {9: [0, 1, 2, 4]}
    counts = (1, small + 1, 3, 4 * small, 2 * small, 0, 2 * small + 1)
    assert expert_groups.row_buckets(counts) == {
        3: [0, 2], 2 * small: [1, 4], 4 * small: [3, 6],
    }  # fmt: skip
    assert expert_groups.row_buckets(()) == {}


def test_gather_experts_copies_runs_converting() -> None:
    source = torch.arange(7 * 3 * 2, dtype=torch.int8).view(7, 3, 2)
    for experts in ([4, 5, 6, 0, 2, 3], [], [1]):
        got = expert_groups.gather_experts(source, experts, torch.float32)
        assert got.dtype == torch.float32 and got.is_contiguous()
        assert torch.equal(got, source[torch.tensor(experts, dtype=torch.long)].to(torch.float32))
    strided = source.transpose(1, 2)
    assert torch.equal(expert_groups.gather_experts(strided, [3, 4]), strided[3:5])


@pytest.mark.parametrize("most", [1, 2, 1 << 30])
def test_batched_products_match_the_loop_to_float32_rounding(most: int) -> None:
    """Each group's rows against its own expert only; padding rows dropped; groups not asked for left alone;
    a small-groups bucket and a power-of-two one; runs of 1, 2 or all experts per bucket product."""
    gen = torch.Generator().manual_seed(most)
    k, n = 37, 13
    expert = torch.tensor([4, 0, 4, 2, 2, 2, 5, 4, 0, 4, 4, 1] + [3] * (expert_groups.SMALL_GROUP_ROWS + 4))
    groups = group_by_expert(expert)
    x = torch.randn(expert.numel(), k, generator=gen)  # already in group order
    weights = torch.randn(6, n, k, generator=gen)
    out = torch.full((expert.numel(), n), float("nan"))
    skipped = groups.experts.index(5)
    members = [i for i in range(len(groups.experts)) if i != skipped]
    asked: list[list[int]] = []

    def weights_of(experts: tuple[int, ...]) -> torch.Tensor:
        asked.append(list(experts))
        return weights[list(experts)]

    expert_groups.batched_matmul_into(out, x, groups, members, weights_of, most * n * k)
    for index, e in enumerate(groups.experts):
        rows = slice(groups.starts[index], groups.starts[index] + groups.counts[index])
        if index == skipped:
            assert torch.isnan(out[rows]).all()
            continue
        torch.testing.assert_close(out[rows], x[rows] @ weights[e].T, rtol=1e-6, atol=1e-5)
    assert sorted(e for part in asked for e in part) == sorted(groups.experts[i] for i in members)
    assert max(len(part) for part in asked) <= most


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_on_threads_returns_in_job_order_with_one_intra_op_thread_each(threads: int) -> None:
    import threading

    def job(index: int) -> tuple[int, int, str]:
        return index, torch.get_num_threads(), threading.current_thread().name

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = on_threads(job, [(i,) for i in range(7)])
        assert torch.get_num_threads() == threads  # restored
    finally:
        torch.set_num_threads(before)
    assert [index for index, _, _ in results] == list(range(7))
    if threads > 1:
        assert all(inside == 1 and name.startswith("moereplay-experts") for _, inside, name in results)


def test_on_threads_raises_the_first_jobs_error_and_restores_the_threads() -> None:
    def job(index: int) -> int:
        if index in (2, 4):
            raise ValueError(f"job {index}")
        return index

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(ValueError, match="job 2"):
            on_threads(job, [(i,) for i in range(6)])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
