"""The Triton fused MoE reference against a naive per-(token, slot) torch computation written independently:
explicit nibble loops for int4, scale lookups by index arithmetic, one expert row at a time. Every test runs both
ways the reference multiplies: one product per expert (the CPU's) and bucketed batched products (a GPU's)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moereplay.errors import ReferenceError_
from moereplay.reference import fused_moe_triton
from moereplay.reference.fused_moe_triton import (
    reference_fused_moe_kernel,
    reference_fused_moe_kernel_gptq_awq,
)
from moereplay.reference.moe_align import moe_align_block_size

TOKENS, EXPERTS, TOP_K, N, K = 5, 6, 2, 32, 64


@pytest.fixture(autouse=True, params=["per-expert", "batched"])
def product_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The CPU takes the batched path too when asked (small runs: several buckets and parts per launch)."""
    if request.param == "batched":
        monkeypatch.setattr(fused_moe_triton, "BATCHED_DEVICE_TYPES", frozenset({"cpu"}))
        monkeypatch.setitem(fused_moe_triton.DENSE_ELEMENTS_AT_ONCE, "cpu", 2 * N * K)
    return str(request.param)


def routing(seed: int = 0, expert_map: torch.Tensor | None = None, block: int = 16) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(TOKENS, EXPERTS, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), TOP_K, dim=-1)
    ids = ids.to(torch.int32)
    sorted_ids, expert_ids, padded = moe_align_block_size(ids, block, EXPERTS, expert_map)
    return {
        "topk_weights": weights.contiguous(),
        "topk_ids": ids,
        "sorted_token_ids": sorted_ids,
        "expert_ids": expert_ids,
        "num_tokens_post_padded": padded,
        "block_size_m": block,
    }


def naive(
    a_rows: torch.Tensor, weight_of: Any, route: dict[str, Any], *, mul: bool, bias: torch.Tensor | None = None,
    local: Any = None,
) -> torch.Tensor:  # fmt: skip
    """out[t·top_k + j] = (a(t) · W[e]ᵀ + bias[e]) · w[t, j], e the (local) expert; unrouted rows stay 0."""
    out = torch.zeros(TOKENS * TOP_K, N, dtype=torch.float64)
    for t in range(TOKENS):
        for j in range(TOP_K):
            expert = int(route["topk_ids"][t, j])
            if local is not None:
                expert = local(expert)
                if expert < 0:
                    continue
            row = a_rows[t].double() @ weight_of(expert).double().T
            if bias is not None:
                row = row + bias[expert].double()
            if mul:
                row = row * float(route["topk_weights"][t, j])
            out[t * TOP_K + j] = row
    return out


def common(route: dict[str, Any], mul: bool, compute: str = "bfloat16") -> dict[str, Any]:
    return {
        "topk_weights": route["topk_weights"],
        "sorted_token_ids": route["sorted_token_ids"],
        "expert_ids": route["expert_ids"],
        "num_tokens_post_padded": route["num_tokens_post_padded"],
        "mul_routed_weight": mul,
        "top_k": TOP_K,
        "block_size_m": route["block_size_m"],
        "compute_type": compute,
    }


def close(result: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(result.double(), expected, rtol=2e-5, atol=2e-5)


FLAGS = {"use_fp8_w8a8": False, "use_int8_w8a8": False, "use_int8_w8a16": False, "use_int4_w4a16": False}


@pytest.mark.parametrize("mul", [False, True])
def test_bf16_with_bias_matches_naive(mul: bool) -> None:
    route = routing(1)
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(TOKENS, K, generator=gen).to(torch.bfloat16)
    b = torch.randn(EXPERTS, N, K, generator=gen).to(torch.bfloat16)
    bias = torch.randn(EXPERTS, N, generator=gen).to(torch.bfloat16)
    result = reference_fused_moe_kernel(
        A=a, B=b, A_scale=None, B_scale=None, **common(route, mul), **FLAGS, per_channel_quant=False,
        B_bias=bias,
    )  # fmt: skip
    close(result.output, naive(a.float(), lambda e: b[e].float(), route, mul=mul, bias=bias.float()))
    assert bool(result.written.all())


def _fp8(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * 2).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("mode", ["tensor", "channel", "block"])
def test_fp8_w8a8_scales_match_naive(mode: str) -> None:
    route = routing(3)
    gen = torch.Generator().manual_seed(4)
    a, b = _fp8(gen, (TOKENS, K)), _fp8(gen, (EXPERTS, N, K))
    block_shape = None
    if mode == "tensor":
        a_scale, b_scale = torch.rand(1, generator=gen) + 0.5, torch.rand(EXPERTS, generator=gen) + 0.5

        def a_deq(t: int) -> torch.Tensor:
            return a[t].float() * a_scale[0]

        def w(e: int) -> torch.Tensor:
            return b[e].float() * b_scale[e]
    elif mode == "channel":
        a_scale, b_scale = (
            torch.rand(TOKENS, 1, generator=gen) + 0.5,
            torch.rand(EXPERTS, N, 1, generator=gen) + 0.5,
        )

        def a_deq(t: int) -> torch.Tensor:
            return a[t].float() * a_scale[t, 0]

        def w(e: int) -> torch.Tensor:
            return b[e].float() * b_scale[e, :, 0:1]
    else:
        block_shape = [16, 32]
        a_scale = torch.rand(TOKENS, K // 32, generator=gen) + 0.5
        b_scale = torch.rand(EXPERTS, N // 16, K // 32, generator=gen) + 0.5

        def a_deq(t: int) -> torch.Tensor:
            return torch.stack([a[t, k].float() * a_scale[t, k // 32] for k in range(K)])

        def w(e: int) -> torch.Tensor:
            scale = torch.empty(N, K)
            for n in range(N):
                for k in range(K):
                    scale[n, k] = b_scale[e, n // 16, k // 32]
            return b[e].float() * scale

    a_rows = torch.stack([a_deq(t) for t in range(TOKENS)])
    result = reference_fused_moe_kernel(
        A=a, B=b, A_scale=a_scale, B_scale=b_scale, **common(route, True),
        **{**FLAGS, "use_fp8_w8a8": True}, per_channel_quant=mode == "channel", block_shape=block_shape,
    )  # fmt: skip
    close(result.output, naive(a_rows, w, route, mul=True))


def test_a_one_dimensional_per_token_scale_is_read_at_element_zero() -> None:
    """The launcher passes stride 0 for a 1-D A_scale: every row uses the first token's scale."""
    route = routing(5)
    gen = torch.Generator().manual_seed(6)
    a, b = _fp8(gen, (TOKENS, K)), _fp8(gen, (EXPERTS, N, K))
    a_scale = torch.rand(TOKENS, generator=gen) + 0.5
    b_scale = torch.ones(EXPERTS, N, 1)
    result = reference_fused_moe_kernel(
        A=a, B=b, A_scale=a_scale, B_scale=b_scale, **common(route, False),
        **{**FLAGS, "use_fp8_w8a8": True}, per_channel_quant=True,
    )  # fmt: skip
    expected = naive(a.float() * a_scale[0], lambda e: b[e].float(), route, mul=False)
    close(result.output, expected)


def test_int8_w8a16_matches_naive() -> None:
    route = routing(7)
    gen = torch.Generator().manual_seed(8)
    a = torch.randn(TOKENS, K, generator=gen).to(torch.float16)
    b = torch.randint(-128, 128, (EXPERTS, N, K), generator=gen).to(torch.int8)
    scale = (torch.rand(EXPERTS, N, generator=gen) / 64).to(torch.float16)
    result = reference_fused_moe_kernel(
        A=a, B=b, A_scale=None, B_scale=scale, **common(route, False, "float16"),
        **{**FLAGS, "use_int8_w8a16": True}, per_channel_quant=False,
    )  # fmt: skip
    close(
        result.output, naive(a.float(), lambda e: b[e].float() * scale[e].float()[:, None], route, mul=False)
    )


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zero_points", [False, True])
def test_weight_only_groups_match_naive(bits: int, zero_points: bool) -> None:
    route = routing(9)
    gen = torch.Generator().manual_seed(10)
    group = 16
    a = torch.randn(TOKENS, K, generator=gen).to(torch.bfloat16)
    width = K // 2 if bits == 4 else K
    b = torch.randint(0, 256, (EXPERTS, N, width), generator=gen).to(torch.uint8)
    scale = (torch.rand(EXPERTS, N, K // group, generator=gen) / 16).to(torch.bfloat16)
    zp = None
    if zero_points:
        zp_rows = N // 2 if bits == 4 else N
        zp = torch.randint(0, 256, (EXPERTS, zp_rows, K // group), generator=gen).to(torch.uint8)

    def code(e: int, n: int, k: int) -> int:
        if bits == 8:
            return int(b[e, n, k])
        byte = int(b[e, n, k // 2])
        return byte & 0xF if k % 2 == 0 else byte >> 4

    def zero(e: int, n: int, g: int) -> int:
        if zp is None:
            return 8 if bits == 4 else 128
        if bits == 8:
            return int(zp[e, n, g])
        byte = int(zp[e, n // 2, g])
        return byte & 0xF if n % 2 == 0 else byte >> 4

    def w(e: int) -> torch.Tensor:
        out = torch.empty(N, K)
        for n in range(N):
            for k in range(K):
                out[n, k] = (code(e, n, k) - zero(e, n, k // group)) * float(scale[e, n, k // group])
        return out.to(torch.bfloat16).float()  # the kernel rounds the weight to compute_type

    result = reference_fused_moe_kernel_gptq_awq(
        A=a, B=b, B_scale=scale, B_zp=zp, **common(route, True), use_int8_w8a16=bits == 8,
        use_int4_w4a16=bits == 4, block_shape=[0, group],
    )  # fmt: skip
    used = {int(e) for e in route["topk_ids"].reshape(-1)}
    weights = {e: w(e) for e in used}
    close(result.output, naive(a.float(), lambda e: weights[e], route, mul=True))


def test_expert_map_blocks_of_other_ranks_leave_rows_unwritten_and_minus_one_writes_zeros() -> None:
    expert_map = torch.tensor([-1, 0, 1, -1, 2, -1], dtype=torch.int32)  # 3 local experts
    route = routing(11, expert_map)
    gen = torch.Generator().manual_seed(12)
    a = torch.randn(TOKENS, K, generator=gen)
    b = torch.randn(3, N, K, generator=gen)
    result = reference_fused_moe_kernel(
        A=a, B=b, A_scale=None, B_scale=None, **common(route, False, "float32"), **FLAGS, per_channel_quant=False,
    )  # fmt: skip
    local = {0: -1, 1: 0, 2: 1, 3: -1, 4: 2, 5: -1}
    close(result.output, naive(a, lambda e: b[e], route, mul=False, local=local.get))
    routed = torch.tensor([local[int(e)] >= 0 for e in route["topk_ids"].reshape(-1)])
    assert torch.equal(result.written, routed)
    # a block whose expert is -1 writes zeros: mark the first block foreign
    ids = route["expert_ids"].clone()
    ids[0] = -1
    zeroed = reference_fused_moe_kernel(
        A=a, B=b, A_scale=None, B_scale=None, **{**common(route, False, "float32"), "expert_ids": ids}, **FLAGS,
        per_channel_quant=False,
    )  # fmt: skip
    first = route["sorted_token_ids"][:16].long()
    first = first[first < TOKENS * TOP_K]
    assert bool(zeroed.written[first].all()) and float(zeroed.output[first].abs().sum()) == 0.0


def test_naive_block_assignment_one_row_per_block() -> None:
    route = routing(13)
    gen = torch.Generator().manual_seed(14)
    a = torch.randn(TOKENS, K, generator=gen)
    b = torch.randn(EXPERTS, N, K, generator=gen)
    flat = route["topk_ids"].reshape(-1)
    args = {
        **common(route, True, "float32"),
        "sorted_token_ids": None,
        "expert_ids": flat,
        "num_tokens_post_padded": torch.tensor([flat.numel() * 16], dtype=torch.int32),
    }
    result = reference_fused_moe_kernel(
        A=a, B=b, A_scale=None, B_scale=None, **args, **FLAGS, per_channel_quant=False
    )
    close(result.output, naive(a, lambda e: b[e], route, mul=True))


def test_int4_flag_on_fused_moe_kernel_is_refused() -> None:
    route = routing(0)
    with pytest.raises(ReferenceError_, match="no int4 path"):
        reference_fused_moe_kernel(
            A=torch.zeros(TOKENS, K), B=torch.zeros(EXPERTS, N, K), A_scale=None, B_scale=torch.ones(1),
            **common(route, False), **{**FLAGS, "use_int4_w4a16": True}, per_channel_quant=False,
        )  # fmt: skip
