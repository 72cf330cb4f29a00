"""The weight descriptions the GPU's one-pass dequantising kernel reads (:mod:`moereplay.reference.dequant_dense`),
checked on the CPU: each launch's :class:`QuantizedWeights`, applied element by element exactly as the kernel's
docstring says (scale at ``(n // group_n, k // group_k)`` of a strided view, nibbles, zero points, rounding),
gives the torch path's dense weights bit for bit — so a wrong stride, group or zero-point layout in a description
fails here, without a GPU. (The kernel's own arithmetic is checked on the GPU: ``tests/gpu/test_dequant_dense_gpu.py``.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from moereplay.errors import ReferenceError_
from moereplay.reference import dequant_dense
from moereplay.reference import fused_moe_triton as ref
from moereplay.reference.dequant_dense import QuantizedWeights

E, N, K = 5, 48, 192
EXPERTS = [4, 0, 2]


def _apply(weights: QuantizedWeights, experts: list[int]) -> torch.Tensor:
    """The kernel's arithmetic in torch, from the description alone."""
    ids = torch.tensor(experts)
    codes = weights.codes[ids]
    if weights.int4:
        data = codes.view(torch.uint8).to(torch.int32)
        codes = torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2)
    w = codes.to(torch.float32)
    if weights.mode == 0:
        return w
    n = torch.arange(w.shape[1])
    k = torch.arange(w.shape[2])
    assert weights.scale is not None
    s = weights.scale[ids][:, n // weights.group_n][:, :, k // weights.group_k].to(torch.float32)
    if weights.mode == 1:
        return w * s
    if weights.zero_points is None:
        zero: torch.Tensor | float = weights.zero_default
    elif weights.zero_points_int4:
        z = weights.zero_points[ids].view(torch.uint8).to(torch.int32)[:, n // 2][:, :, k // weights.group_k]
        zero = ((z >> ((n % 2) * 4)[None, :, None]) & 0xF).to(torch.float32)
    else:
        zero = weights.zero_points[ids][:, n][:, :, k // weights.group_k].to(torch.float32)
    return ((w - zero) * s).to(weights.round_to).to(torch.float32)


def _launches() -> dict[str, Callable[[], ref._Launch]]:
    g = torch.Generator().manual_seed(11)
    A = torch.randn(8, K, generator=g).to(torch.bfloat16)
    A_scale = torch.rand(8, 1, generator=g)
    fp8 = (torch.randn(E, N, K, generator=g) * 4).to(torch.float8_e4m3fn)
    int8 = torch.randint(-128, 128, (E, N, K), generator=g, dtype=torch.int8)
    cases: dict[str, Callable[[], ref._Launch]] = {
        "int8-w8a16": lambda: ref._W8A16Launch(A, int8, torch.rand(E, N, generator=g), 1),
        "fp8-tensor": lambda: ref._W8A8Launch(A, A_scale, fp8, torch.rand(E, generator=g), 1, None, False),
        "fp8-channel-3d": lambda: ref._W8A8Launch(A, A_scale, fp8, torch.rand(E, N, 1, generator=g), 1, None, True),
        "fp8-block": lambda: ref._W8A8Launch(A, A_scale, fp8, torch.rand(E, 3, 3, generator=g), 1, (16, 64), False),
        "fp8-block-ragged": lambda: ref._W8A8Launch(
            A, A_scale, fp8, torch.rand(E, 2, 4, generator=g), 1, (32, 50), False
        ),
        "fp8-block-transposed-scales": lambda: ref._W8A8Launch(
            A, A_scale, fp8, torch.rand(E, 3, 3, generator=g).transpose(1, 2).contiguous().transpose(1, 2), 1,
            (16, 64), False,
        ),
        "int8-w8a8-channel": lambda: ref._W8A8Launch(A, A_scale, int8, torch.rand(E, N, generator=g), 1, None, True),
    }  # fmt: skip
    for bits in (4, 8):
        for zero_points in (False, True):
            for compute in (torch.bfloat16, torch.float16, torch.float32):
                for group in (64, 40):
                    groups = -(-K // group)
                    codes = torch.randint(
                        0, 256, (E, N, K // 2 if bits == 4 else K), generator=g, dtype=torch.uint8
                    )
                    scale = (torch.rand(E, N, groups, generator=g) * 0.02).to(compute)
                    zp = torch.randint(
                        0, 256, (E, N // 2 if bits == 4 else N, groups), generator=g, dtype=torch.uint8
                    )
                    name = f"int{bits}-{'zp' if zero_points else 'nozp'}-{str(compute)[6:]}-g{group}"
                    cases[name] = (
                        lambda codes=codes, scale=scale, zp=zp, zero_points=zero_points, compute=compute, group=group, bits=bits: (
                            ref._WNA16Launch(A, codes, scale, zp if zero_points else None, 1, group, bits == 4, compute)
                        )
                    )  # fmt: skip
    return cases


LAUNCHES = _launches()


@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_description_applied_elementwise_is_the_dense_path(name: str) -> None:
    launch = LAUNCHES[name]()
    described = launch.quantized()
    assert described is not None and dequant_dense.usable(described)
    got, want = _apply(described, EXPERTS), launch.dense(EXPERTS)
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{name}: {int((~same).sum())} of {same.numel()} weights differ"


def test_plain_weights_are_described_as_codes() -> None:
    described = ref._PlainLaunch(torch.zeros(2, K), torch.zeros(E, N, K, dtype=torch.bfloat16), 1).quantized()
    assert described is not None and described.mode == 0 and described.scale is None


def test_packed_codes_wider_than_a_byte_are_left_to_the_torch_path() -> None:
    wide = QuantizedWeights(
        torch.zeros(E, N, K // 2, dtype=torch.int16), mode=2, scale=torch.ones(E, N, 1), group_k=K, int4=True
    )
    assert not dequant_dense.usable(wide)


def test_the_kernel_is_only_for_gpus_and_can_be_switched_off() -> None:
    assert not dequant_dense.available(torch.device("cpu"), {})
    assert not dequant_dense.available(torch.device("cuda"), {dequant_dense.SWITCH_VARIABLE: "0"})


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"mode": 3}, "mode must be"),
        ({"mode": 1}, "needs a 3-D scale view"),
        ({"mode": 1, "scale": torch.ones(E, N, 1), "group_k": 0}, "groups must be positive"),
        ({"zero_points": torch.zeros(E, N, 1, dtype=torch.uint8)}, "zero points need mode 2"),
    ],
)
def test_inconsistent_descriptions_are_refused(arguments: dict, message: str) -> None:
    with pytest.raises(ReferenceError_, match=message):
        QuantizedWeights(torch.zeros(E, N, K, dtype=torch.int8), **arguments)
