"""Guard-banded materialisation: layouts survive, guards hold the fill, out-of-bounds writes are found."""

from __future__ import annotations

import torch

from moereplay.replay.memory import GuardWindow, materialise
from moereplay.replay.mutations import FillPattern


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())


def test_views_keep_shape_strides_values_and_relative_offset() -> None:
    base = torch.arange(60, dtype=torch.float32)
    view = base[7:].view(-1)[:48].view(6, 8)[:, 2:7]  # non-contiguous, offset into its storage
    guarded = materialise({"view": view, "flag": True}, "cpu", FillPattern(0xFF), guard=256)
    copy = guarded.args["view"]
    assert copy.shape == view.shape and copy.stride() == view.stride()
    assert torch.equal(copy, view)
    assert copy.storage_offset() == 256 // 4  # the span starts right after the guard
    assert guarded.args["flag"] is True
    assert copy.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
    assert guarded.damage() == []


def test_aliasing_views_share_one_allocation() -> None:
    base = torch.zeros(32, dtype=torch.float16)
    guarded = materialise({"a": base[:16], "b": base[8:24]}, "cpu", FillPattern(0x00), guard=64)
    a, b = guarded.args["a"], guarded.args["b"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    a[8] = 3.0
    assert float(b[0]) == 3.0


def test_guards_hold_the_fill_pattern() -> None:
    tensor = torch.ones(5, dtype=torch.bfloat16)
    guarded = materialise({"t": tensor}, "cpu", FillPattern(None), guard=32)
    raw = raw_bytes(guarded.args["t"])
    assert torch.isnan(raw[:32].view(torch.bfloat16)).all()
    assert torch.isnan(raw[32 + 10 :].view(torch.bfloat16)).all()


def test_a_deliberate_write_past_the_end_is_found_with_its_byte_range() -> None:
    out = torch.zeros(4, 3, dtype=torch.float32)
    guarded = materialise({"out": out, "other": torch.ones(2)}, "cpu", FillPattern(0xFE), guard=128)
    view = guarded.args["out"]
    raw = raw_bytes(view)
    end = (view.storage_offset() + view.numel()) * 4
    raw[end + 4 : end + 12] = 0  # bytes 4..11 past the end
    raw[128 - 2] = 7  # two bytes before the start
    damage = {(d.arg, d.side): d for d in guarded.damage()}
    after = damage[("out", "after")]
    assert (after.first - after.span_bytes, after.last - after.span_bytes, after.count) == (4, 11, 8)
    assert "bytes 4..11 past the end" in after.describe()
    before = damage[("out", "before")]
    assert (before.first, before.last) == (-2, -2)
    assert "bytes 2..2 before the start" in before.describe()
    assert ("other", "after") not in damage


def test_windows_change_part_of_one_arguments_guard() -> None:
    tensor = torch.ones(4, dtype=torch.float32)
    window = GuardWindow("t", "after", 8, 16, FillPattern(0xAA))
    guarded = materialise({"t": tensor}, "cpu", FillPattern(0x00), guard=32, windows=[window])
    raw = raw_bytes(guarded.args["t"])
    tail = raw[32 + 16 :]
    assert (
        tail[:8].tolist() == [0] * 8 and tail[8:16].tolist() == [0xAA] * 8 and tail[16:].tolist() == [0] * 16
    )
    assert guarded.damage() == []  # the window is the expected content, not damage


def test_per_argument_fills() -> None:
    guarded = materialise(
        {"a": torch.ones(2), "b": torch.ones(2)},
        "cpu",
        FillPattern(0x00),
        guard=16,
        fills={"b": FillPattern(0xFF)},
    )
    assert raw_bytes(guarded.args["a"])[:16].tolist() == [0] * 16
    assert raw_bytes(guarded.args["b"])[:16].tolist() == [0xFF] * 16
