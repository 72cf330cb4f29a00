"""The Triton fused MoE reference's on-the-fly dequantising product (:mod:`moereplay.reference.dequant_bmm`) on a
GPU: for every weight format the reference knows, the weights it dequantises in registers are the same bits as
the torch path's dense weights (read back by multiplying one-hot rows: ``1 · w`` summed with zeros is ``w``), and
whole launches agree with the dense path within float32 summation order. Needs CUDA and Triton; no kernel pack."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available():  # pragma: no cover - the gpu conftest marks these; no CUDA, nothing to run
    pytest.skip("needs CUDA", allow_module_level=True)

pytest.importorskip("triton")

from moereplay.reference import dequant_bmm
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


@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_on_the_fly_weights_are_the_dense_weights_bit_for_bit(name: str) -> None:
    launch = LAUNCHES[name]()
    described = launch.quantized()
    assert described is not None and dequant_bmm.usable(described)
    dense = launch.dense(EXPERTS)  # [G, N, K]
    experts = torch.tensor(EXPERTS, device=DEVICE)
    eye = torch.eye(K, device=DEVICE)
    for first in range(0, K, dequant_bmm.FUSED_MAX_PAD):
        rows = eye[first : first + dequant_bmm.FUSED_MAX_PAD]
        read = dequant_bmm.dequant_bmm(rows.expand(len(EXPERTS), -1, -1).contiguous(), described, experts)
        want = dense[:, :, first : first + rows.shape[0]].transpose(1, 2)
        same = (read == want) | (read.isnan() & want.isnan())  # a one-hot sum turns -0 into +0
        assert bool(same.all()), f"{name}: {int((~same).sum())} dequantised weights differ at k ≥ {first}"


@pytest.mark.parametrize("name", ["bf16", "fp8-block-128", "int4-zp-bfloat16-g128", "int8-nozp-float16-g96"])
def test_whole_launch_agrees_with_the_dense_path(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    launch = LAUNCHES[name]()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(len(EXPERTS), 16, K, generator=g).to(DEVICE)
    experts = torch.tensor(EXPERTS, device=DEVICE)
    described = launch.quantized()
    assert described is not None
    fused = dequant_bmm.dequant_bmm(x, described, experts)
    dense = torch.bmm(x, launch.dense(EXPERTS).transpose(1, 2))
    scale = dense.abs().amax().clamp_min(1e-30)
    assert float((fused - dense).abs().amax() / scale) < 1e-5, name


def test_reference_takes_the_on_the_fly_path_for_small_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode-shaped Triton fused MoE reference on the GPU calls the kernel, and its output is the dense path's
    within float32 summation order."""
    from moereplay.synth.routing import softmax_topk
    from moereplay.synth.triton_presets import triton_args

    g = _gen()
    experts, top_k, tokens, hidden, inter = 16, 4, 24, 256, 128
    weight = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    topk = softmax_topk(tokens, experts, top_k, 3, renormalize=True)
    config = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}
    args = triton_args(
        A=x, weights={"B": weight}, topk_weights=topk.weights, topk_ids=topk.ids, experts=experts,
        config=config, compute="bfloat16",
    )  # fmt: skip
    moved = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    from moereplay.ops import get_op

    op = get_op("fused_moe_kernel")
    recorded = op.recorded_args(moved)  # type: ignore[attr-defined]
    calls = []
    real = dequant_bmm.dequant_bmm

    def counting(*a: object, **k: object) -> torch.Tensor:
        calls.append(1)
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(dequant_bmm, "dequant_bmm", counting)
    on_the_fly = op.reference(recorded).output
    assert calls, "the GPU reference did not use the on-the-fly product"
    monkeypatch.setattr(dequant_bmm, "FUSED_DEVICE_TYPES", frozenset())
    dense = op.reference(recorded).output
    scale = dense.abs().amax().clamp_min(1e-30)
    assert float((on_the_fly - dense).abs().amax() / scale) < 1e-5
