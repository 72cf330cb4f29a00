"""reference_moe_wna16_marlin_gemm against an independent float64 computation from the logical weights."""

from __future__ import annotations

import pytest
import torch

from moereplay.errors import ReferenceError_
from moereplay.reference.marlin_formats import MarlinWeightFormat, PackedExperts, random_experts
from moereplay.reference.marlin_moe import ExpertWeightCache, reference_moe_wna16_marlin_gemm
from moereplay.reference.moe_align import moe_align_block_size

F = MarlinWeightFormat
E, K, N, M, TOP_K = 6, 128, 64, 7, 3


def _routing(
    gen: torch.Generator, tokens: int, top_k: int, experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k)
    return weights.to(torch.float32), ids


def _call(
    packed: PackedExperts,
    x: torch.Tensor,
    aligned,
    weights: torch.Tensor,
    *,
    top_k: int,
    block: int,
    mul: bool,
    bias: bool = True,
    **extra,
):
    sorted_ids, expert_ids, total = aligned
    kwargs = packed.kernel_kwargs()
    if not bias:
        kwargs["b_bias"] = None
    return reference_moe_wna16_marlin_gemm(
        input=x,
        output=None,
        a_scales=None,
        workspace=None,
        sorted_token_ids=sorted_ids,
        expert_ids=expert_ids,
        num_tokens_past_padded=total,
        topk_weights=weights,
        moe_block_size=block,
        top_k=top_k,
        mul_topk_weights=mul,
        size_m=x.shape[0],
        is_k_full=True,
        use_atomic_add=False,
        use_fp32_reduce=True,
        **kwargs,
        **extra,
    )


def _float64_rows(
    packed: PackedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None, bias: bool
) -> torch.Tensor:
    """[M, top_k, N] = (x[m] @ W[ids[m, j]] + bias) * weight, all float64."""
    rows = torch.einsum("mk,mjkn->mjn", x.to(torch.float64), packed.dense[ids])
    if bias and packed.dense_bias is not None:
        rows = rows + packed.dense_bias[ids]
    if weights is not None:
        rows = rows * weights.to(torch.float64).unsqueeze(-1)
    return rows


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.to(torch.float64) - expected).abs().max() / expected.abs().max())


FORMATS = [
    (F.NVFP4, None, torch.bfloat16),
    (F.NVFP4, None, torch.float16),
    (F.MXFP4, None, torch.bfloat16),
    (F.MXFP8, None, torch.bfloat16),
    (F.FP8, -1, torch.bfloat16),
    (F.FP8, 128, torch.float16),
    (F.GPTQ_INT4, 32, torch.bfloat16),
    (F.GPTQ_INT4, -1, torch.float16),
    (F.GPTQ_INT8, 64, torch.bfloat16),
    (F.AWQ_INT4, 32, torch.float16),
    (F.AWQ_INT4_FZP, 32, torch.float16),
]


@pytest.mark.parametrize(("fmt", "group_size", "dtype"), FORMATS)
@pytest.mark.parametrize("mul", [False, True])
def test_gemm1_and_gemm2_against_float64(fmt, group_size, dtype, mul: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    packed = random_experts(
        fmt, E, K, N, group_size=group_size, activation_dtype=dtype, with_bias=True, generator=gen
    )
    x = torch.randn(M, K, generator=gen).to(dtype)
    weights, ids = _routing(gen, M, TOP_K, E)
    aligned = moe_align_block_size(ids, 16, E)
    expected = _float64_rows(packed, x, ids, weights if mul else None, bias=True)

    # gemm1: one input row per token, top_k rows out
    result = _call(packed, x, aligned, weights, top_k=TOP_K, block=16, mul=mul)
    assert result.written.all()
    assert result.output.shape == (M * TOP_K, N)
    assert _relative(result.output.view(M, TOP_K, N), expected) < 1e-5
    assert result.notes == ()

    # gemm2: pre-expanded rows, top_k = 1, same alignment arrays
    expanded = x.repeat_interleave(TOP_K, dim=0)
    result2 = _call(packed, expanded, aligned, weights, top_k=1, block=16, mul=mul)
    assert _relative(result2.output.view(M, TOP_K, N), expected) < 1e-5
    assert torch.equal(result2.row_map.input_row, torch.arange(M * TOP_K))


@pytest.mark.parametrize("fmt", [F.GPTQ_INT4, F.GPTQ_INT8])
def test_act_order_uses_the_permuted_input_columns(fmt) -> None:
    gen = torch.Generator().manual_seed(3)
    packed = random_experts(fmt, E, K, N, group_size=32, act_order=True, generator=gen)
    assert packed.perm is not None and not torch.equal(packed.perm[0], torch.arange(K, dtype=torch.int32))
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    weights, ids = _routing(gen, M, TOP_K, E)
    result = _call(packed, x, moe_align_block_size(ids, 8, E), weights, top_k=TOP_K, block=8, mul=True)
    assert (
        _relative(result.output.view(M, TOP_K, N), _float64_rows(packed, x, ids, weights, bias=False)) < 1e-5
    )


@pytest.mark.parametrize("block", [8, 16, 32, 48, 64])
def test_ingredients_and_row_map(block: int) -> None:
    gen = torch.Generator().manual_seed(block)
    packed = random_experts(F.MXFP4, E, K, N, with_bias=True, generator=gen)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    weights, ids = _routing(gen, M, TOP_K, E)
    result = _call(
        packed, x, moe_align_block_size(ids, block, E), weights, top_k=TOP_K, block=block, mul=True
    )
    assert result.bias_rows is not None
    recomposed = (result.gemm + result.bias_rows) * result.row_weights.unsqueeze(1)
    assert torch.equal(recomposed, result.output)
    assert torch.equal(result.row_map.expert.view(M, TOP_K), ids)
    assert torch.equal(result.row_map.input_row.view(M, TOP_K), torch.arange(M).view(M, 1).expand(M, TOP_K))
    assert torch.equal(result.row_map.k_slot.view(M, TOP_K), torch.arange(TOP_K).expand(M, TOP_K))
    assert torch.equal(result.row_weights.view(M, TOP_K), weights)
    assert result.row_map.as_tensor().shape == (M * TOP_K, 3)
    assert torch.equal(result.experts_used, torch.unique(ids))
    assert (result.row_map.block >= 0).all()


def test_unwritten_rows_are_zero_and_marked() -> None:
    gen = torch.Generator().manual_seed(5)
    packed = random_experts(F.GPTQ_INT4, E, K, N, group_size=32, with_bias=True, generator=gen)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    weights, ids = _routing(gen, M, TOP_K, E)
    expert_map = torch.tensor([0, 1, 2, -1, -1, -1])  # experts 3-5 live on another rank
    aligned = moe_align_block_size(ids, 16, E, expert_map)
    result = _call(packed, x, aligned, weights, top_k=TOP_K, block=16, mul=True)
    local = (ids < 3).reshape(-1)
    assert torch.equal(result.written, local)
    assert (result.output[~local] == 0).all() and (result.gemm[~local] == 0).all()
    assert (result.row_map.expert[~local] == -1).all() and (result.row_map.input_row[~local] == -1).all()
    assert (result.row_weights[~local] == 0).all()
    expected = _float64_rows(packed, x, ids, weights, bias=True).reshape(M * TOP_K, N)[local]
    assert _relative(result.output[local], expected) < 1e-5


def _manual_alignment(ids: list[int], experts: list[int], total: int):
    return (
        torch.tensor(ids, dtype=torch.int32),
        torch.tensor(experts, dtype=torch.int32),
        torch.tensor([total], dtype=torch.int32),
    )


def test_contract_notes() -> None:
    gen = torch.Generator().manual_seed(9)
    packed = random_experts(F.GPTQ_INT8, 2, 64, 64, group_size=32, generator=gen)
    x = torch.randn(2, 64, generator=gen).to(torch.bfloat16)
    weights = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    pad = 4  # size_m * top_k
    # block 0: slot 0, pad, slot 1 (padding inside the block); block 1: expert 7 does not exist;
    # block 2: slot 1 again (duplicate) and slot 3
    blocks = [[0, pad, 1], [2], [1, 3]]
    aligned = _manual_alignment([i for b in blocks for i in b + [pad] * (8 - len(b))], [0, 7, 1], 24)
    result = _call(packed, x, aligned, weights.to(torch.bfloat16), top_k=2, block=8, mul=True)
    expected_codes = {"padding_inside_block", "invalid_block_expert", "duplicate_slot", "topk_weights_dtype"}
    assert result.note_codes() == expected_codes
    assert result.written.tolist() == [True, True, False, True]
    assert result.row_map.expert.tolist() == [0, 1, -1, 1]  # slot 1: the last block (expert 1) wins
    assert torch.equal(result.row_weights, torch.tensor([0.25, 0.75, 0.0, 0.5]))
    # short topk_weights: the rows past it get NaN weights (the kernel reads beyond the tensor)
    short = _call(packed, x, aligned, weights.reshape(-1)[:2].contiguous(), top_k=2, block=8, mul=True)
    assert "topk_weights_short" in short.note_codes()
    assert torch.isnan(short.output[3]).all() and not torch.isnan(short.output[0]).any()
    # unwritten: 0, not the NaN read past it
    assert short.row_weights[2] == 0 and (short.output[2] == 0).all()
    # unwritten rows stay 0 with a bias too, and the output is its own tensor, not the products'
    with_bias = random_experts(F.GPTQ_INT8, 2, 64, 64, group_size=32, generator=gen, with_bias=True)
    biased = _call(with_bias, x, aligned, weights, top_k=2, block=8, mul=False)
    assert biased.bias_rows is not None and (biased.bias_rows[2] == 0).all() and (biased.output[2] == 0).all()
    assert biased.output.data_ptr() != biased.gemm.data_ptr()
    # without mul_topk_weights the weights are not read at all
    plain = _call(packed, x, aligned, weights.to(torch.bfloat16), top_k=2, block=8, mul=False)
    assert "topk_weights_dtype" not in plain.note_codes()
    assert torch.equal(plain.row_weights, torch.tensor([1.0, 1.0, 0.0, 1.0]))
    # a padded total beyond the buffers, and one that is not a whole number of blocks
    over = _call(packed, x, _manual_alignment([0, 1, 2, 3], [0], 9), weights, top_k=2, block=4, mul=False)
    assert over.note_codes() == {
        "padded_total_exceeds_buffers",
        "padded_total_not_multiple",
        "unsupported_block_size",
    }
    assert over.written.all()


def test_weight_cache_hits_and_invalidation() -> None:
    gen = torch.Generator().manual_seed(1)
    packed = random_experts(F.AWQ_INT4, E, K, N, group_size=32, activation_dtype=torch.float16, generator=gen)
    x = torch.randn(M, K, generator=gen).to(torch.float16)
    weights, ids = _routing(gen, M, TOP_K, E)
    aligned = moe_align_block_size(ids, 16, E)
    cache = ExpertWeightCache()
    first = _call(packed, x, aligned, weights, top_k=TOP_K, block=16, mul=True, weight_cache=cache)
    assert cache.misses == first.experts_used.numel() and cache.hits == 0
    again = _call(packed, x, aligned, weights, top_k=TOP_K, block=16, mul=True, weight_cache=cache)
    assert torch.equal(first.output, again.output) and cache.hits == first.experts_used.numel()
    packed.b_scales.mul_(2)  # in-place change bumps the version counter: no stale weights
    doubled = _call(packed, x, aligned, weights, top_k=TOP_K, block=16, mul=True, weight_cache=cache)
    assert torch.allclose(doubled.output, 2 * first.output, rtol=1e-6, atol=0)
    assert len(cache._entries) == first.experts_used.numel()  # the old version's experts were dropped
    tiny = ExpertWeightCache(max_bytes=K * N * 4)
    _call(packed, x, aligned, weights, top_k=TOP_K, block=16, mul=True, weight_cache=tiny)
    assert len(tiny._entries) == 1
    cache.clear()


def _full_kwargs(packed: PackedExperts, x: torch.Tensor, aligned, weights: torch.Tensor, **overrides) -> dict:
    kwargs = packed.kernel_kwargs()
    kwargs.update(
        input=x,
        output=None,
        a_scales=None,
        workspace=None,
        sorted_token_ids=aligned[0],
        expert_ids=aligned[1],
        num_tokens_past_padded=aligned[2],
        topk_weights=weights,
        moe_block_size=8,
        top_k=2,
        mul_topk_weights=False,
        size_m=1,
        is_k_full=True,
        use_atomic_add=False,
        use_fp32_reduce=True,
    )
    kwargs.update(overrides)
    return kwargs


def test_rejections() -> None:
    packed = random_experts(F.GPTQ_INT4, 2, 64, 64, group_size=32)
    aligned = moe_align_block_size(torch.tensor([[0, 1]]), 8, 2)
    weights = torch.ones(1, 2)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    assert reference_moe_wna16_marlin_gemm(**_full_kwargs(packed, x, aligned, weights)).written.all()
    cases = [
        ({"input": x.to(torch.int8), "a_scales": torch.ones(1)}, "8-bit activations"),
        ({"input": x.to(torch.float32)}, "float16/bfloat16"),
        ({"moe_block_size": 0}, "moe_block_size"),
        ({"input": torch.zeros(2, 64, dtype=torch.bfloat16)}, "input is"),
        ({"b_q_type": 12345}, "unknown vLLM ScalarType"),
        ({"size_n": 128}, "size_n"),
        ({"b_bias": torch.zeros(2, 32, dtype=torch.bfloat16)}, "b_bias"),
    ]
    for overrides, message in cases:
        with pytest.raises(ReferenceError_, match=message):
            reference_moe_wna16_marlin_gemm(**_full_kwargs(packed, x, aligned, weights, **overrides))


def test_matmuls_run_without_tf32_and_the_setting_is_restored() -> None:
    """Every matmul the reference issues sees TF32 off, even when the caller turned it on."""
    import warnings

    from torch.overrides import TorchFunctionMode

    seen: list[bool] = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.mm, torch.bmm, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
                seen.append(bool(torch.backends.cuda.matmul.allow_tf32))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(4)
    packed = random_experts(F.NVFP4, E, K, N, activation_dtype=torch.bfloat16, with_bias=True, generator=gen)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    weights, ids = _routing(gen, M, TOP_K, E)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")  # TF32 allowed for the caller
    try:
        with Spy():
            _call(packed, x, moe_align_block_size(ids, 16, E), weights, top_k=TOP_K, block=16, mul=True)
        assert seen and not any(seen), f"matmuls saw allow_tf32={seen}"
        assert torch.backends.cuda.matmul.allow_tf32, "the caller's TF32 setting was not restored"
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.set_float32_matmul_precision(previous)


def test_a_rows_result_does_not_depend_on_the_other_rows() -> None:
    """The shape bisection compares rows across calls: a row computed alone (an expert with one row) or among
    many must come out bit-identical."""
    gen = torch.Generator().manual_seed(8)
    packed = random_experts(F.MXFP4, E, K, N, activation_dtype=torch.bfloat16, with_bias=True, generator=gen)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    weights, ids = _routing(gen, M, TOP_K, E)
    full = _call(packed, x, moe_align_block_size(ids, 8, E), weights, top_k=TOP_K, block=8, mul=True)
    for tokens in (1, 2, 3):
        part = _call(
            packed,
            x[:tokens],
            moe_align_block_size(ids[:tokens], 8, E),
            weights[:tokens],
            top_k=TOP_K,
            block=8,
            mul=True,
        )
        rows = tokens * TOP_K
        assert torch.equal(part.output[:rows], full.output[:rows]), (
            f"rows of the first {tokens} tokens changed"
        )


def test_a_weight_set_over_the_budget_is_dequantized_in_chunks_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gpt-oss layer's dense fp32 weights (2.2 GB) must not be held at once on the CPU: a format without the
    column-slice decoder (act order) is dequantized a chunk of experts at a time."""
    from moereplay.reference import marlin_moe
    from moereplay.reference.marlin_formats import MarlinExpertWeights

    gen = torch.Generator().manual_seed(11)
    packed = random_experts(
        F.GPTQ_INT4, E, K, N, group_size=32, act_order=True, activation_dtype=torch.float16, generator=gen
    )
    x = torch.randn(M, K, generator=gen).to(torch.float16)
    weights, ids = _routing(gen, M, TOP_K, E)
    aligned = moe_align_block_size(ids, 16, E)
    whole = _call(packed, x, aligned, weights, top_k=TOP_K, block=16, mul=True)
    calls: list[int] = []
    dequantize = MarlinExpertWeights.dequantize

    def counted(
        self: MarlinExpertWeights, experts: torch.Tensor, **options: torch.Tensor | None
    ) -> torch.Tensor:
        calls.append(int(experts.numel()))
        return dequantize(self, experts, **options)

    monkeypatch.setattr(MarlinExpertWeights, "dequantize", counted)
    monkeypatch.setitem(marlin_moe.DENSE_BYTES_AT_ONCE, "cpu", 4 * K * N * 4)  # one expert per chunk
    chunked = _call(
        packed, x, aligned, weights, top_k=TOP_K, block=16, mul=True, weight_cache=ExpertWeightCache()
    )
    assert torch.equal(chunked.output, whole.output)
    assert calls and max(calls) == 1 and sum(calls) == whole.experts_used.numel()


@pytest.mark.parametrize(
    ("fmt", "group_size", "dtype"),
    [
        (F.NVFP4, None, torch.bfloat16),
        (F.MXFP4, None, torch.bfloat16),
        (F.MXFP8, None, torch.bfloat16),
        (F.FP8, -1, torch.float16),
        (F.GPTQ_INT4, 32, torch.bfloat16),
        (F.GPTQ_INT8, 64, torch.float16),
        (F.AWQ_INT4, 32, torch.float16),
    ],
)
def test_a_weight_set_over_the_budget_is_decoded_a_column_slice_at_a_time_with_the_same_bits(
    monkeypatch: pytest.MonkeyPatch, fmt, group_size, dtype
) -> None:
    """Over the budget, formats with the fast decoder are decoded 64 columns at a time (never a whole expert) and
    multiplied slice by slice: every row, lone rows included, has the bits of the whole-expert product."""
    from moereplay.reference import marlin_moe
    from moereplay.reference.marlin_formats import MarlinExpertWeights

    n, k = 192, 256
    gen = torch.Generator().manual_seed(5)
    packed = random_experts(fmt, E, k, n, group_size=group_size, activation_dtype=dtype, generator=gen)
    x = torch.randn(M, k, generator=gen).to(dtype)
    weights, ids = _routing(gen, M, TOP_K, E)
    ids[0, 0] = E - 1  # expert E - 1 has exactly one row: the lone-row product
    ids[1:, :] = torch.where(ids[1:, :] == E - 1, 0, ids[1:, :])
    ids[0, 1:] = torch.where(ids[0, 1:] == E - 1, 0, ids[0, 1:])
    aligned = moe_align_block_size(ids, 16, E)
    whole = _call(packed, x, aligned, weights, top_k=TOP_K, block=16, mul=True)
    slices: list[tuple[int, int, int]] = []
    columns = MarlinExpertWeights.dequantize_columns

    def counted(self: MarlinExpertWeights, expert: int, first: int, count: int, factors) -> torch.Tensor:
        slices.append((expert, first, count))
        return columns(self, expert, first, count, factors)

    def whole_experts(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("a whole expert was dequantized")

    monkeypatch.setattr(MarlinExpertWeights, "dequantize_columns", counted)
    monkeypatch.setattr(MarlinExpertWeights, "dequantize", whole_experts)
    monkeypatch.setitem(marlin_moe.DENSE_BYTES_AT_ONCE, "cpu", k * n * 4)  # less than the experts used
    monkeypatch.setattr(marlin_moe, "COLUMN_SLICE_BYTES", k * 64 * 4)  # one 64-column tile a slice
    sliced = _call(packed, x, aligned, weights, top_k=TOP_K, block=16, mul=True)
    used = [int(e) for e in whole.experts_used.tolist()]
    assert slices == [(e, first, 64) for e in used for first in (0, 64, 128)]
    assert torch.equal(sliced.gemm.view(torch.int32), whole.gemm.view(torch.int32))
    assert torch.equal(sliced.output.view(torch.int32), whole.output.view(torch.int32))
