"""The Marlin reference's packed-code product on the GPU (marlin_rows) against its dense path and float64.

The packed-code kernel forms each weight as the dense decoder does (the CPU tests check that element by element);
here the products themselves: the same rows as the dense path within float32 summation order, against float64
within 1e-5, and a row's bits independent of the other rows of the call.
"""

from __future__ import annotations

import pytest
import torch
from marlin_calls import reference_call, routed_call, routing

from moereplay.reference import marlin_rows
from moereplay.reference.dequant_dense import SWITCH_VARIABLE
from moereplay.reference.marlin_formats import MarlinWeightFormat, PackedExperts, random_experts
from moereplay.reference.marlin_moe import reference_moe_wna16_marlin_gemm
from moereplay.reference.moe_align import moe_align_block_size

F = MarlinWeightFormat
CUDA = torch.device("cuda")

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not marlin_rows.available(CUDA, {}),
    reason="needs a CUDA GPU and Triton",
)

FAST = [
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
    (F.AWQ_INT4, -1, torch.bfloat16),
]


def _call(packed: PackedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *, top_k: int, block: int,
          experts: int, mul: bool = True):  # fmt: skip
    return reference_call(packed, x, ids, weights, top_k=top_k, block=block, experts=experts, mul=mul)


def _routing(tokens: int, top_k: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return routing(tokens, top_k, experts, seed, CUDA)


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max())


@pytest.mark.parametrize(("fmt", "group_size", "dtype"), FAST)
def test_packed_code_rows_agree_with_the_dense_path_and_float64(
    fmt, group_size, dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    experts, k, n, tokens, top_k = 8, 256, 192, 37, 3
    packed = random_experts(
        fmt,
        experts,
        k,
        n,
        group_size=group_size,
        activation_dtype=dtype,
        with_bias=True,
        generator=torch.Generator().manual_seed(3),
        device=CUDA,
    )
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(4)).to(CUDA, dtype)
    weights, ids = _routing(tokens, top_k, experts, 5)
    fused = _call(packed, x, ids, weights, top_k=top_k, block=16, experts=experts)
    assert packed.dense is not None and packed.dense_bias is not None
    expected = torch.einsum("mk,mjkn->mjn", x.double(), packed.dense.to(CUDA)[ids])
    expected = (expected + packed.dense_bias.to(CUDA)[ids]) * weights.double().unsqueeze(-1)
    assert _relative(fused.output.view(tokens, top_k, n), expected) < 1e-5
    monkeypatch.setenv(SWITCH_VARIABLE, "0")
    dense = _call(packed, x, ids, weights, top_k=top_k, block=16, experts=experts)
    assert torch.equal(fused.written, dense.written) and fused.notes == dense.notes
    assert _relative(fused.output, dense.output) < 1e-5
    assert _relative(fused.gemm, dense.gemm) < 1e-5


def test_a_rows_bits_do_not_depend_on_the_other_rows() -> None:
    """Rows of the first tokens, computed in calls of 1 … 300 tokens (every block height), are the same bits."""
    experts, k, n, top_k = 8, 512, 256, 4
    packed = random_experts(
        F.NVFP4, experts, k, n, with_dense=False, generator=torch.Generator().manual_seed(6), device=CUDA
    )
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(7)).to(CUDA, torch.bfloat16)
    weights, ids = _routing(300, top_k, experts, 8)
    full = _call(packed, x, ids, weights, top_k=top_k, block=64, experts=experts)
    for tokens in (1, 2, 5, 17, 40, 120):
        part = _call(
            packed, x[:tokens], ids[:tokens], weights[:tokens], top_k=top_k, block=8, experts=experts
        )
        rows = tokens * top_k
        assert torch.equal(part.output[:rows], full.output[:rows]), (
            f"rows of the first {tokens} tokens changed"
        )


@pytest.mark.parametrize("fmt", [F.NVFP4, F.MXFP4])
def test_gpt_oss_shapes_agree_with_the_dense_path(fmt, monkeypatch: pytest.MonkeyPatch) -> None:
    """E=32, top-4, K=2880 → N=5888 (gemm1) at 32 tokens, the reference_bench case."""
    experts, k, n, tokens, top_k = 32, 2880, 5888, 32, 4
    packed = random_experts(
        fmt, experts, k, n, with_dense=False, generator=torch.Generator().manual_seed(9), device=CUDA
    )
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(10)).to(CUDA, torch.bfloat16)
    weights, ids = _routing(tokens, top_k, experts, 11)
    fused = _call(packed, x, ids, weights, top_k=top_k, block=8, experts=experts, mul=False)
    monkeypatch.setenv(SWITCH_VARIABLE, "0")
    dense = _call(packed, x, ids, weights, top_k=top_k, block=8, experts=experts, mul=False)
    assert torch.equal(fused.written, dense.written)
    assert _relative(fused.output, dense.output) < 1e-5


@pytest.fixture(autouse=True)
def _the_kernel_ran():
    """Every test here must have run the kernel: a build or launch failure falls back to the dense path with a
    warning (an error under pytest's warning filter) and is remembered in ``_FAILED``."""
    yield
    assert not marlin_rows._FAILED, marlin_rows._FAILED


@pytest.mark.parametrize(("fmt", "group_size", "dtype"), FAST)
def test_one_hot_rows_give_the_dense_decoders_weights_bit_for_bit(fmt, group_size, dtype) -> None:
    """Input rows e_0 … e_{K-1}, all on one expert: each output row is one weight row, exactly."""
    experts, k, n = 4, 256, 192
    packed = random_experts(
        fmt, experts, k, n, group_size=group_size, activation_dtype=dtype, with_dense=False,
        generator=torch.Generator().manual_seed(12), device=CUDA,
    )  # fmt: skip
    x = torch.eye(k, device=CUDA).to(dtype)
    ids = torch.full((k, 1), 2, dtype=torch.int64, device=CUDA)
    result = _call(
        packed, x, ids, torch.ones((k, 1), device=CUDA), top_k=1, block=16, experts=experts, mul=False
    )
    weights = packed.expert_weights()
    assert torch.equal(result.gemm, weights.dequantize(torch.tensor([2], device=CUDA))[0])


def test_a_long_call_in_passes_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    experts, k, n, tokens, top_k = 8, 1024, 320, 200, 4
    packed = random_experts(
        F.GPTQ_INT4, experts, k, n, group_size=128, with_dense=False,
        generator=torch.Generator().manual_seed(13), device=CUDA,
    )  # fmt: skip
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(14)).to(CUDA, torch.bfloat16)
    weights, ids = _routing(tokens, top_k, experts, 15)
    whole = _call(packed, x, ids, weights, top_k=top_k, block=64, experts=experts)
    splits = marlin_rows.k_splits(k // 16)[0]
    monkeypatch.setattr(marlin_rows, "PARTIAL_BYTES", 40 * n * 4 * splits)  # passes of at most 40 rows
    cut = _call(packed, x, ids, weights, top_k=top_k, block=64, experts=experts)
    assert torch.equal(cut.output, whole.output)


def test_a_call_on_another_gpu_than_the_current_one() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    device = torch.device("cuda", 1)
    packed = random_experts(
        F.NVFP4, 4, 256, 128, with_dense=False, generator=torch.Generator().manual_seed(16), device=device
    )
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(17)).to(device, torch.bfloat16)
    weights, ids = _routing(9, 2, 4, 18)
    on_one = _call(packed, x, ids.to(device), weights.to(device), top_k=2, block=8, experts=4)
    packed0 = random_experts(
        F.NVFP4, 4, 256, 128, with_dense=False, generator=torch.Generator().manual_seed(16), device=CUDA
    )
    on_zero = _call(packed0, x.to(CUDA), ids, weights, top_k=2, block=8, experts=4)
    assert torch.equal(on_one.output.cpu(), on_zero.output.cpu())


@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("weights_kind", ["none", "float32", "bfloat16", "float16", "short", "strided"])
def test_the_epilogue_kernel_is_the_torch_operations_bit_for_bit(bias_dtype, weights_kind) -> None:
    """`finish_rows` (one launch) against the torch epilogue it replaces: bias rows at the logical columns, the
    routing weight read flat (NaN past a short tensor), unwritten rows 0, a strided bias."""
    from moereplay.reference.marlin_moe import _finish_rows

    gen = torch.Generator().manual_seed(19)
    rows, n, experts = 23, marlin_rows.FINISH_BLOCK + 64, 5  # two column blocks, the second partial
    gemm = torch.randn(rows, n, generator=gen).to(CUDA)
    row_experts = torch.randint(0, experts, (rows,), generator=gen)
    row_experts[[2, 7, 19]] = -1  # rows no block writes
    gemm[row_experts < 0] = 0.0
    tables = torch.full((5, rows), -1, dtype=torch.long)
    tables[1] = row_experts
    tables[4] = (row_experts >= 0).long()
    bias = None
    if bias_dtype is not None:
        bias = (torch.randn(experts, 2 * n, generator=gen) * 3).to(CUDA, bias_dtype)[:, ::2]  # strided
    weights = {
        "none": None,
        "float32": torch.rand(rows, generator=gen).to(CUDA),
        "bfloat16": torch.rand(rows, generator=gen).to(CUDA, torch.bfloat16),
        "float16": torch.rand(rows, generator=gen).to(CUDA, torch.float16),
        "short": torch.rand(rows - 4, generator=gen).to(CUDA),
        "strided": torch.rand(rows, 2, generator=gen).to(CUDA)[:, 1],
    }[weights_kind]
    kernel = marlin_rows.finish_rows(gemm, row_experts.to(CUDA), bias, weights)
    torch_ops = _finish_rows(gemm, tables.to(CUDA), bias, weights)
    assert kernel is not None
    for name, got, expected in zip(
        ("total", "bias rows", "row weights", "written"), kernel, torch_ops, strict=True
    ):
        if expected is None:
            assert got is None, name
            continue
        assert got is not None and got.dtype == expected.dtype and got.shape == expected.shape, name
        assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0)), name
        assert torch.equal(got.isnan(), expected.isnan()), name
    if weights_kind == "short":  # rows 20-22 are past the weights (row 19 is not written: weight 0)
        assert bool(kernel[2][20:].isnan().all()) and float(kernel[2][19]) == 0.0


def test_back_to_back_calls_do_not_share_their_host_tables() -> None:
    """More calls than pinned staging buffers queued behind a long kernel without a sync (routing on the host, a
    format without counted weight notes: nothing in a call waits for the device): each call's tables are its own
    (a staging buffer is rewritten only after the copy that read it has run)."""
    experts, k, n, top_k = 8, 512, 256, 2
    packed = random_experts(
        F.GPTQ_INT4, experts, k, n, group_size=32, with_dense=False,
        generator=torch.Generator().manual_seed(20), device=CUDA,
    )  # fmt: skip
    calls = []
    for seed in range(9):
        tokens = 3 + 4 * seed
        x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(seed)).to(CUDA, torch.bfloat16)
        weights, ids = _routing(tokens, top_k, experts, 100 + seed)
        calls.append((x, weights, *moe_align_block_size(ids.cpu().to(torch.int32), 8, experts)))

    def call(x, weights, sorted_ids, expert_ids, total):  # type: ignore[no-untyped-def]
        return reference_moe_wna16_marlin_gemm(
            input=x, output=None, a_scales=None, workspace=None, sorted_token_ids=sorted_ids,
            expert_ids=expert_ids, num_tokens_past_padded=total, topk_weights=weights, moe_block_size=8,
            top_k=top_k, mul_topk_weights=True, size_m=x.shape[0], **packed.kernel_kwargs(),
        )  # fmt: skip

    alone = []
    for args in calls:
        alone.append(call(*args).output.cpu())
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # keeps the stream busy (≈ 0.3 s) while the calls queue their copies
    queued = [call(*args) for args in calls]
    for expected, result in zip(alone, queued, strict=True):
        assert torch.equal(result.output.cpu(), expected)


route_on_device = marlin_rows.route_on_device


def _spy(function, seen: list[object]):  # type: ignore[no-untyped-def]
    """``function``, keeping each of its results in ``seen``."""

    def spied(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(function(*args, **kwargs))
        return seen[-1]

    return spied


ANOMALIES = (
    "none",
    "negative",
    "duplicate",
    "padding",
    "bad_expert",
    "not_multiple",
    "past_buffers",
    "int_total",
)


def _aligned_with(anomaly: str, ids: torch.Tensor, block: int, experts: int):  # type: ignore[no-untyped-def]
    """vLLM's aligned routing arrays on the GPU with one anomaly the host routing has a note for."""
    sorted_ids, expert_ids, total = moe_align_block_size(ids.to(torch.int32), block, experts)
    sorted_ids, expert_ids, total = sorted_ids.clone(), expert_ids.clone(), total.clone()
    if anomaly == "negative":
        sorted_ids[2] = -4
    elif anomaly == "duplicate":
        sorted_ids[1] = sorted_ids[0]
    elif anomaly == "padding":
        sorted_ids[0] = 1 << 20
    elif anomaly == "bad_expert":
        expert_ids[0] = experts + 3
    elif anomaly == "not_multiple":
        total -= 3
    elif anomaly == "past_buffers":
        total += 64 * block
    return sorted_ids, expert_ids, (int(total) if anomaly == "int_total" else total)


@pytest.mark.parametrize(("fmt", "group_size", "dtype"), FAST)
def test_routing_on_the_device_gives_the_host_routings_result_bit_for_bit(
    fmt, group_size, dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call routed on the GPU (``route_rows``, no host round trip) and on the host: every field of the result
    the same bits, the same notes in the same order — for gemm1 (top-k 3) and gemm2 (top-k 1 over expanded rows),
    with every routing anomaly. Formats with integer zero points route on the host either way."""
    experts, k, n, tokens = 8, 256, 192, 37
    packed = random_experts(
        fmt, experts, k, n, group_size=group_size, activation_dtype=dtype, with_bias=True, with_dense=False,
        generator=torch.Generator().manual_seed(30), device=CUDA,
    )  # fmt: skip
    for top_k, rows in ((3, tokens), (1, tokens * 3)):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(31)).to(CUDA, dtype)
        weights, ids = _routing(rows, top_k, experts, 32)
        for anomaly in ANOMALIES:
            sorted_ids, expert_ids, total = _aligned_with(anomaly, ids, 16, experts)
            results = []
            routed: list[object] = []
            for on_device in (True, False):
                monkeypatch.setattr(marlin_rows, "ROUTE_ON_DEVICE", on_device)
                monkeypatch.setattr(marlin_rows, "route_on_device", _spy(route_on_device, routed))
                results.append(
                    routed_call(packed, x, sorted_ids, expert_ids, total, weights, top_k=top_k, block=16)
                )
            device, host = results
            where = f"{fmt.name} top_k={top_k} {anomaly}"
            # the first call routed on the GPU (no silent fall-back to the host), the second on the host
            first = routed[0] if routed else None  # zero points: not even asked
            assert (first is not None) == (packed.b_qzeros is None), where
            assert all(result is None for result in routed[1:]), where
            assert device.notes == host.notes, where
            assert anomaly in ("none", "int_total") or device.notes, where
            for field in ("output", "gemm", "bias_rows", "row_weights"):
                got, expected = getattr(device, field), getattr(host, field)
                assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0)), (where, field)
            assert torch.equal(device.written, host.written), where
            assert torch.equal(device.row_map.as_tensor(), host.row_map.as_tensor()), where
            assert torch.equal(device.row_map.block, host.row_map.block), where
            assert torch.equal(device.experts_used.cpu(), host.experts_used.cpu()), where
