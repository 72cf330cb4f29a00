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
