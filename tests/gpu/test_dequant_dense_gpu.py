"""The Triton fused MoE reference's one-pass dequantising kernel (:mod:`moereplay.reference.dequant_dense`) on a
GPU: for every weight format the reference knows, the dense weights it writes are the torch path's, bit for bit,
and a whole reference launch gives the same bits with it and without it. Needs CUDA and Triton; no kernel pack."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available():  # pragma: no cover - the gpu conftest marks these; no CUDA, nothing to run
    pytest.skip("needs CUDA", allow_module_level=True)

pytest.importorskip("triton")

from moereplay.reference import dequant_dense
from moereplay.reference import fused_moe_triton as ref

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
E, N, K = 6, 200, 384
EXPERTS = [5, 0, 2]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(7)


def _launches() -> dict[str, Callable[[], ref._Launch]]:
    g = _gen()
    A = torch.randn(8, K, generator=g).to(torch.bfloat16)
    A_scale = torch.rand(8, 1, generator=g)
    fp8 = (torch.randn(E, N, K, generator=g) * 4).to(torch.float8_e4m3fn)
    int8 = torch.randint(-128, 128, (E, N, K), generator=g, dtype=torch.int8)

    def d(t: torch.Tensor) -> torch.Tensor:
        return t.to(DEVICE)

    cases: dict[str, Callable[[], ref._Launch]] = {
        "bf16": lambda: ref._PlainLaunch(d(A), d(torch.randn(E, N, K, generator=g).to(torch.bfloat16)), 1),
        "fp16": lambda: ref._PlainLaunch(d(A), d(torch.randn(E, N, K, generator=g).to(torch.float16)), 1),
        "int8-w8a16": lambda: ref._W8A16Launch(d(A), d(int8), d(torch.rand(E, N, generator=g)), 1),
        "fp8-tensor": lambda: ref._W8A8Launch(
            d(A), d(A_scale), d(fp8), d(torch.rand(E, generator=g)), 1, None, False
        ),
        "fp8-channel": lambda: ref._W8A8Launch(
            d(A), d(A_scale), d(fp8), d(torch.rand(E, N, 1, generator=g)), 1, None, True
        ),
        "fp8-block-128": lambda: ref._W8A8Launch(
            d(A), d(A_scale), d(fp8), d(torch.rand(E, 2, 3, generator=g)), 1, (128, 128), False
        ),
        "fp8-block-ragged": lambda: ref._W8A8Launch(
            d(A), d(A_scale), d(fp8), d(torch.rand(E, 4, 4, generator=g)), 1, (64, 100), False
        ),
        "int8-w8a8-channel": lambda: ref._W8A8Launch(
            d(A), d(A_scale), d(int8), d(torch.rand(E, N, generator=g)), 1, None, True
        ),
    }
    for bits in (4, 8):
        for zero_points in (False, True):
            for compute in (torch.bfloat16, torch.float16):
                for group in (128, 96):
                    groups = -(-K // group)
                    packed = K // 2 if bits == 4 else K
                    codes = torch.randint(0, 256, (E, N, packed), generator=g, dtype=torch.uint8)
                    scale = (torch.rand(E, N, groups, generator=g) * 0.02).to(compute)
                    zp_rows = N // 2 if bits == 4 else N
                    zp = torch.randint(0, 256, (E, zp_rows, groups), generator=g, dtype=torch.uint8)
                    name = f"int{bits}-{'zp' if zero_points else 'nozp'}-{str(compute)[6:]}-g{group}"
                    cases[name] = (
                        lambda codes=codes, scale=scale, zp=zp, zero_points=zero_points, compute=compute, group=group, bits=bits: (
                            ref._WNA16Launch(
                                d(A), d(codes), d(scale), d(zp) if zero_points else None, 1, group, bits == 4, compute
                            )
                        )
                    )  # fmt: skip
    return cases


LAUNCHES = _launches()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element by element: the same float32 bits, or both NaN (a NaN's payload is not part of the arithmetic)."""
    return (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())


@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_one_pass_weights_are_the_torch_paths_bit_for_bit(name: str) -> None:
    launch = LAUNCHES[name]()
    described = launch.quantized()
    assert described is not None and dequant_dense.usable(described)
    want = launch.dense(EXPERTS)
    got = dequant_dense.dequant_dense(described, EXPERTS)
    assert got.shape == want.shape and got.is_contiguous()
    same = _same_bits(got, want)
    assert bool(same.all()), f"{name}: {int((~same).sum())} of {same.numel()} weights differ"


def _routing(tokens: int, experts: int, top_k: int, block_m: int) -> dict[str, object]:
    from moereplay.synth.routing import softmax_topk
    from moereplay.synth.triton_presets import alignment

    topk = softmax_topk(tokens, experts, top_k, 3, renormalize=True)
    sorted_ids, expert_ids, padded = alignment(topk.ids, block_m, experts, None)
    moved = {
        "topk_weights": topk.weights,
        "sorted_token_ids": sorted_ids,
        "expert_ids": expert_ids,
        "num_tokens_post_padded": padded,
    }
    return {name: value.to(DEVICE) for name, value in moved.items()} | {
        "top_k": top_k,
        "block_size_m": block_m,
    }


@pytest.mark.parametrize("fmt", ["fp8-block-128", "int4-zp", "int8-nozp"])
def test_reference_uses_the_kernel_and_gives_the_same_bits(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole reference launch on the GPU dequantises with the kernel, and its output is the torch path's, bit
    for bit (same weights, same cuBLAS products)."""
    g = _gen()
    experts, tokens, hidden, n = 16, 40, 512, 384
    route = _routing(tokens, experts, 4, 16)
    A = torch.randn(tokens, hidden, generator=g)
    if fmt == "fp8-block-128":
        B = (torch.randn(experts, n, hidden, generator=g) * 4).to(torch.float8_e4m3fn)
        A_scale = torch.rand(tokens, hidden // 128, generator=g)
        B_scale = torch.rand(experts, n // 128, hidden // 128, generator=g)
        run = lambda: ref.reference_fused_moe_kernel(  # noqa: E731
            A=A.to(torch.float8_e4m3fn).to(DEVICE), B=B.to(DEVICE), A_scale=A_scale.to(DEVICE),
            B_scale=B_scale.to(DEVICE),
            mul_routed_weight=False, compute_type="bfloat16", use_fp8_w8a8=True, use_int8_w8a8=False,
            use_int8_w8a16=False, use_int4_w4a16=False, per_channel_quant=False, block_shape=[128, 128], **route,
        )  # fmt: skip
    else:
        int4 = fmt.startswith("int4")
        codes = torch.randint(
            0, 256, (experts, n, hidden // 2 if int4 else hidden), generator=g, dtype=torch.uint8
        )
        scale = (torch.rand(experts, n, hidden // 128, generator=g) * 0.02).to(torch.bfloat16)
        zp = torch.randint(
            0, 256, (experts, n // 2 if int4 else n, hidden // 128), generator=g, dtype=torch.uint8
        )
        run = lambda: ref.reference_fused_moe_kernel_gptq_awq(  # noqa: E731
            A=A.to(torch.bfloat16).to(DEVICE), B=codes.to(DEVICE), B_scale=scale.to(DEVICE),
            B_zp=zp.to(DEVICE) if fmt.endswith("-zp") else None, mul_routed_weight=True, compute_type="bfloat16",
            use_int8_w8a16=not int4, use_int4_w4a16=int4, block_shape=[0, 128], **route,
        )  # fmt: skip
    calls = []
    real = dequant_dense.dequant_dense

    def counting(*a: object, **k: object) -> torch.Tensor:
        calls.append(1)
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(dequant_dense, "dequant_dense", counting)
    with_kernel = run().output
    assert calls, "the GPU reference did not dequantise with the kernel"
    monkeypatch.setattr(dequant_dense, "FUSED_DEVICE_TYPES", frozenset())
    calls.clear()
    torch_path = run().output
    assert not calls
    same = _same_bits(with_kernel, torch_path)
    assert bool(same.all()), f"{fmt}: {int((~same).sum())} output elements differ"
