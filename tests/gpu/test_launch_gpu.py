"""Direct Triton launches (moereplay.reference.launch) against Triton's own path, on the GPU.

The direct path reuses a compiled kernel for every launch of the same *launch class*; that is only right if the
class separates every pair of arguments Triton's specialization separates. The first test asks the installed
Triton's own binder; the others check that direct launches run (no ``kernel.run``), compute what Triton's path
computes (misaligned and odd-sized arguments included), step aside for launch hooks, and that the Marlin reference
gives the same bits either way.
"""

from __future__ import annotations

import importlib
from collections import defaultdict

import pytest
import torch
from marlin_calls import reference_call, routing

from moereplay.reference import launch as launches
from moereplay.reference import marlin_rows
from moereplay.reference.marlin_formats import MarlinWeightFormat, random_experts

CUDA = torch.device("cuda")

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not marlin_rows.available(CUDA, {}),
    reason="needs a CUDA GPU and Triton",
)


@pytest.fixture(autouse=True)
def _direct_on():
    launches.set_direct(True)
    yield
    launches.set_direct(None)


def _add_splits():
    from moereplay.reference.marlin_rows_kernel import add_splits

    return add_splits


def _add_args(partial: torch.Tensor, destination: torch.Tensor, out: torch.Tensor, n: int) -> tuple:
    return (partial, partial.stride(0), partial.stride(1), destination, out, out.stride(0), n)


INTS = [0, 1, 2, 3, 15, 16, 17, 32, 48, 2880, 2944, 5888, 2**31 - 16, 2**31 - 1, 2**31, 2**32, 2**40 + 16,
        -1, -16, -(2**31), -(2**31) - 1, 2**63 - 16, 2**63, 2**64 - 16]  # fmt: skip


def test_launch_classes_separate_what_tritons_specialization_separates() -> None:
    """For each argument position of add_splits, probe values of one launch class get one specialization from
    the installed Triton's binder (pointers at every offset up to 32 bytes; integers across widths and
    divisibility)."""
    kernel = _add_splits()
    base = torch.zeros(4096, dtype=torch.float32, device=CUDA)
    rows = torch.zeros(64, dtype=torch.int64, device=CUDA)
    out = torch.zeros(4096, dtype=torch.float32, device=CUDA)
    args = list(_add_args(base[:1024].view(2, 4, 128), rows[:4], out.view(32, 128), 128))
    meta = {"SPLITS": 2, "BLOCK": 128}
    kernel[(1, 1)](*args, **meta)  # makes the device's binder
    binder = kernel.device_caches[torch.cuda.current_device()][4]
    probes: list[tuple[int, list[object]]] = [
        (0, [base[i : i + 1024].view(2, 4, 128) for i in range(9)]),
        (
            0,
            [
                base.to(dtype)[:1024].view(2, 4, 128)
                for dtype in (torch.float16, torch.bfloat16, torch.float32)
            ],
        ),
        (3, [rows[i : i + 4] for i in range(5)]),
        (4, [out[i : i + 128 * 8].view(8, 128) for i in range(9)]),
        *((position, list(INTS)) for position in (1, 2, 5, 6)),
    ]
    checked = 0
    for at, values in probes:
        seen: dict[object, set[str]] = defaultdict(set)
        for value in values:
            probe = list(args)
            probe[at] = value
            _, specialization, _ = binder(*probe, **meta)
            seen[launches.argument_class(value)].add(repr(specialization[at]))
        for cls, specializations in seen.items():
            assert len(specializations) == 1, f"argument {at}: class {cls} covers {sorted(specializations)}"
        checked += len(values)
    assert checked == 122


def _expected(partial: torch.Tensor, destination: torch.Tensor, rows_out: int) -> torch.Tensor:
    total = partial[0].clone()
    for split in range(1, partial.shape[0]):
        total = total + partial[split]
    out = torch.zeros((rows_out, partial.shape[2]), dtype=torch.float32, device=partial.device)
    out[destination] = total
    return out


def test_direct_launches_run_and_compute_what_tritons_path_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = _add_splits()
    launches._COMPILED.clear()
    through_triton = []
    original = kernel.run

    def counted(*args, **kwargs):
        through_triton.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", counted, raising=False)
    gen = torch.Generator(device=CUDA).manual_seed(0)
    storage = torch.randn(3 * 9 * 208 + 8, generator=gen, device=CUDA)
    cases = [(0, 200), (0, 200), (3, 200), (0, 208), (1, 208), (3, 200), (0, 200)]
    for offset, n in cases:
        partial = storage[offset : offset + 3 * 9 * n].view(3, 9, n)
        destination = torch.randperm(12, generator=gen, device=CUDA)[:9]
        out = torch.zeros((12, n), dtype=torch.float32, device=CUDA)
        launches.launch(
            kernel, (9, -(-n // 64)), *_add_args(partial, destination, out, n), SPLITS=3, BLOCK=64
        )
        assert torch.equal(out, _expected(partial, destination, 12)), f"offset {offset}, N {n}"
    # classes: (aligned, 200), (misaligned, 200), (aligned, 208: strides and N divide by 16), (misaligned, 208):
    # four launches through Triton, three direct
    assert len(through_triton) == 4
    assert len([key for key in launches._COMPILED if key[0] is kernel]) == 4


def test_a_launch_hook_sends_every_launch_through_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton import knobs

    kernel = _add_splits()
    through_triton = []
    original = kernel.run

    def counted(*args, **kwargs):
        through_triton.append(1)
        return original(*args, **kwargs)

    partial = torch.ones((2, 4, 64), device=CUDA)
    destination = torch.arange(4, device=CUDA)
    out = torch.zeros((4, 64), device=CUDA)
    args = _add_args(partial, destination, out, 64)
    launches.launch(kernel, (4, 1), *args, SPLITS=2, BLOCK=64)
    monkeypatch.setattr(kernel, "run", counted, raising=False)
    launches.launch(kernel, (4, 1), *args, SPLITS=2, BLOCK=64)
    assert through_triton == []  # a class seen before: direct
    seen = []

    def hook(metadata) -> None:
        seen.append(metadata)

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launches.launch(kernel, (4, 1), *args, SPLITS=2, BLOCK=64)
        launches.launch(kernel, (4, 1), *args, SPLITS=2, BLOCK=64)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert len(through_triton) == 2 and len(seen) == 2


@pytest.mark.parametrize(
    "fmt", [MarlinWeightFormat.NVFP4, MarlinWeightFormat.MXFP4, MarlinWeightFormat.GPTQ_INT4]
)
def test_the_marlin_reference_gives_the_same_bits_on_either_path(fmt) -> None:
    experts, k, n, tokens, top_k = 8, 512, 256, 21, 4
    packed = random_experts(
        fmt,
        experts,
        k,
        n,
        with_bias=True,
        with_dense=False,
        generator=torch.Generator().manual_seed(2),
        device=CUDA,
    )
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(3)).to(CUDA, torch.bfloat16)
    weights, ids = routing(tokens, top_k, experts, 4, CUDA)

    def call():
        return reference_call(packed, x, ids, weights, top_k=top_k, block=16, experts=experts)

    launches.set_direct(False)
    through_triton = call()
    launches.set_direct(True)
    first = call()  # each launch class's first launch goes through Triton
    kernels = importlib.import_module("moereplay.reference.marlin_rows_kernel")
    names = ("stage_rows", "marlin_rows", "add_splits", "finish_rows", "count_scale_bytes")
    originals = {name: getattr(kernels, name).run for name in names}
    went_through_triton: list[str] = []
    for name in names:

        def counted(*args, _name=name, **kwargs):
            went_through_triton.append(_name)
            return originals[_name](*args, **kwargs)

        getattr(kernels, name).run = counted
    try:
        direct = call()
    finally:
        for name in names:
            del getattr(kernels, name).run
    assert went_through_triton == [], f"launched through Triton: {went_through_triton}"
    for result in (first, direct):
        assert torch.equal(result.output.view(torch.int32), through_triton.output.view(torch.int32))
        assert torch.equal(result.gemm.view(torch.int32), through_triton.gemm.view(torch.int32))
        assert result.notes == through_triton.notes
