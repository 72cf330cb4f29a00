"""The launch classes of moereplay.reference.launch (the GPU tests check them against Triton's own binder) and its
fall-back to Triton's path where the direct one does not apply."""

from __future__ import annotations

import pytest
import torch

from moereplay.reference import launch as launches


@pytest.mark.parametrize(
    ("same", "other"),
    [
        (2, 3),  # neither 1 nor a multiple of 16, int32
        (16, 2880 * 2),
        (2**31 + 16, 2**40),
        (-(2**31) - 1, -(2**40) - 3),
        (2**63 + 1, 2**64 - 1),
    ],
)
def test_integers_of_one_triton_class_share_a_launch_class(same: int, other: int) -> None:
    assert launches.argument_class(same) == launches.argument_class(other)


@pytest.mark.parametrize(
    ("one", "another"),
    [(1, 2), (1, 17), (16, 17), (0, 3), (2**31 - 16, 2**31), (-(2**31), -(2**31) - 16), (2**63 - 16, 2**63)],
)
def test_integers_triton_may_tell_apart_have_other_launch_classes(one: int, another: int) -> None:
    assert launches.argument_class(one) != launches.argument_class(another)


def test_tensors_are_classed_by_dtype_and_16_byte_alignment() -> None:
    storage = torch.zeros(64, dtype=torch.float32)
    aligned = launches.argument_class(storage[:8])
    assert launches.argument_class(storage[4:12]) == aligned  # 16 bytes on
    assert launches.argument_class(storage[1:9]) != aligned
    assert launches.argument_class(storage[2:10]) != aligned  # 8 bytes: not 16-byte aligned
    assert launches.argument_class(storage.view(torch.int32)[:8]) != aligned


def test_bools_floats_and_none_have_classes_and_other_kinds_none() -> None:
    assert launches.argument_class(True) != launches.argument_class(False)
    assert launches.argument_class(True) != launches.argument_class(1)
    assert launches.argument_class(0.5) == launches.argument_class(2.0)
    assert launches.argument_class(None) == (None,)
    assert launches.argument_class("text") is None
    assert launches.argument_class([1]) is None


class _Recorded:
    """Records ``kernel[grid](*args, **meta)`` calls (what Triton's path receives)."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, tuple[object, ...], dict[str, object]]] = []

    def __getitem__(self, grid: object):
        def run(*args: object, **meta: object) -> None:
            self.calls.append((grid, args, meta))

        return run


@pytest.mark.parametrize("direct", [None, False, True])
def test_without_cuda_or_a_compiled_kernel_every_launch_takes_tritons_path(direct: bool | None) -> None:
    launches.set_direct(direct)
    try:
        kernel = _Recorded()
        tensor = torch.zeros(4)
        launches.launch(kernel, (3, 2), tensor, 7, BLOCK=64)
        launches.launch(kernel, (3,), tensor, 7, BLOCK=64)
        assert kernel.calls == [((3, 2), (tensor, 7), {"BLOCK": 64}), ((3,), (tensor, 7), {"BLOCK": 64})]
    finally:
        launches.set_direct(None)


def test_the_switch_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(launches.SWITCH_VARIABLE, "0")
    launches.set_direct(None)
    try:
        assert not launches.enabled()
        launches.set_direct(True)
        assert launches.enabled()
    finally:
        launches.set_direct(None)


def _binder(kernel):
    """Triton's own argument binder for ``kernel`` on a Hopper target (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import create_function_from_signature

    return create_function_from_signature(
        kernel.signature, kernel.params, CUDABackend(GPUTarget("cuda", 90, 32))
    )


INTS = [0, 1, 2, 3, 15, 16, 17, 32, 2880, 2**31 - 16, 2**31 - 1, 2**31, 2**40 + 16, -1, -16, -(2**31) - 1, 2**63,
        2**64 - 16]  # fmt: skip


def test_equal_launch_keys_mean_equal_triton_specializations() -> None:
    """Over probes of every argument of add_splits (pointers at offsets 0–32 bytes and three dtypes, integers
    across widths and divisibility, constexprs by keyword), two probes with one launch key always get one
    specialization from Triton's own binder — the key never joins what Triton compiles apart."""
    pytest.importorskip("triton")
    from moereplay.reference.marlin_rows_kernel import add_splits

    if type(add_splits) is not launches._jit_function():
        pytest.skip("Triton's interpreter is on")
    binder = _binder(add_splits)
    storage = torch.zeros(4096, dtype=torch.float32)
    rows = torch.zeros(64, dtype=torch.int64)
    base = [storage[:1024], 1024, 128, rows[:8], storage[2048:3072], 128, 128]
    probes: list[tuple[list[object], dict[str, object]]] = [(list(base), {"SPLITS": 2, "BLOCK": 128})]
    for at in (0, 4):
        probes += [
            ([*base[:at], storage[i : i + 1024], *base[at + 1 :]], {"SPLITS": 2, "BLOCK": 128})
            for i in range(9)
        ]
        probes += [
            ([*base[:at], storage.to(dtype)[:1024], *base[at + 1 :]], {"SPLITS": 2, "BLOCK": 128})
            for dtype in (torch.float16, torch.bfloat16)
        ]
    probes += [([*base[:3], rows[i : i + 8], *base[4:]], {"SPLITS": 2, "BLOCK": 128}) for i in range(4)]
    for at in (1, 2, 5, 6):
        probes += [([*base[:at], value, *base[at + 1 :]], {"SPLITS": 2, "BLOCK": 128}) for value in INTS]
    probes += [(list(base), meta) for meta in ({"SPLITS": 3, "BLOCK": 128}, {"SPLITS": 2, "BLOCK": 64})]
    by_key: dict[object, set[str]] = {}
    for args, meta in probes:
        key = launches._key(add_splits, 0, tuple(args), meta)
        assert key is not None
        _, specialization, options = binder(*args, **meta)
        by_key.setdefault(key, set()).add(repr(specialization) + repr(sorted(options.items())))
    joined = {key: found for key, found in by_key.items() if len(found) > 1}
    assert not joined, f"{len(joined)} launch keys cover several specializations"
    assert len(by_key) > 20


def test_keys_refuse_positional_constexprs_and_tell_keyword_types_apart() -> None:
    pytest.importorskip("triton")
    from moereplay.reference.marlin_rows_kernel import count_scale_bytes

    if type(count_scale_bytes) is not launches._jit_function():
        pytest.skip("Triton's interpreter is on")
    scales = torch.zeros((2, 64), dtype=torch.uint8)
    experts = torch.zeros(2, dtype=torch.int64)
    total = torch.zeros((), dtype=torch.int64)
    args = (scales, experts, 64, total)
    keys = [
        launches._key(count_scale_bytes, 0, args, {"E8M0_NAN": flag, "BLOCK": 8192})
        for flag in (True, 1, 1.0)
    ]
    assert len(set(keys)) == 3  # Triton compiles each apart
    assert launches._key(count_scale_bytes, 0, (*args, True, 8192), {}) is None
    assert launches._key(count_scale_bytes, 0, args, {"E8M0_NAN": True, "BLOCK": torch.zeros(1)}) is None
