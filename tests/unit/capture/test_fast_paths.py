"""The snapshot fast path (flat argument lists) and the flight recorder's batched checks, on CPU."""

from __future__ import annotations

import enum
import math

import torch

from moereplay.capture.flight import _largest
from moereplay.capture.snapshot import TensorCopy, snapshot
from moereplay.format.schema import CodecValue


class Kind(enum.Enum):
    A = 1


def _copies(tree: dict) -> dict[str, TensorCopy]:
    return {name: value for name, value in tree.items() if isinstance(value, TensorCopy)}


def test_flat_arguments_mixed_with_nested_ones_keep_their_order_and_aliasing() -> None:
    cache = torch.arange(64, dtype=torch.float32)
    weight = torch.randn(4, 4)
    values = {
        "input": cache[3:11],
        "weight": weight,  # static: kept live
        "nested": [cache[40:48].view(2, 4), None, {"k": torch.ones(2, dtype=torch.int64)}],
        "empty": torch.empty(0, 5),
        "none": None,
        "flag": True,
        "size": 7,
        "dtype": torch.bfloat16,
        "kind": Kind.A,
        "strided": torch.arange(30, dtype=torch.int16).view(5, 6)[:, ::2],
        "scalar0d": torch.tensor(2.5),
    }
    keep: list[torch.Tensor] = []
    taken = snapshot(values, ("weight",), keep=keep)
    tree = taken.tree
    assert tree["weight"] is weight and tree["none"] is None and tree["flag"] is True and tree["size"] == 7
    assert tree["dtype"] is torch.bfloat16 and tree["kind"] is Kind.A
    nested = tree["nested"]
    assert isinstance(nested[0], TensorCopy) and nested[1] is None and isinstance(nested[2]["k"], TensorCopy)
    assert nested[0].storage == tree["input"].storage  # views of one storage: one key, one copy
    assert nested[0].data is tree["input"].data
    for copy, original in (
        (tree["input"], values["input"]),
        (nested[0], cache[40:48].view(2, 4)),
        (nested[2]["k"], torch.ones(2, dtype=torch.int64)),
        (tree["empty"], values["empty"]),
        (tree["strided"], values["strided"]),
        (tree["scalar0d"], values["scalar0d"]),
    ):
        view = copy.view()
        assert view.dtype == original.dtype and view.shape == original.shape
        assert view.stride() == original.stride() or original.numel() == 0
        assert torch.equal(view, original)
    assert len(keep) == 6
    cache.fill_(-1)  # copies, not views
    assert torch.equal(tree["input"].view(), torch.arange(3, 11, dtype=torch.float32))


def test_copied_bytes_count_each_storage_span_once() -> None:
    buffer = torch.zeros(1000, dtype=torch.uint8)
    taken = snapshot({"a": buffer[0:100], "b": buffer[50:300], "c": torch.zeros(10, dtype=torch.uint8)})
    assert taken.copied == 300 + 10
    copies = _copies(taken.tree)
    assert copies["a"].base == copies["b"].base == 0
    assert copies["a"].data.numel() == 300 and copies["c"].data.numel() == 10


def test_unaligned_views_widen_down_to_the_span_alignment() -> None:
    buffer = torch.arange(300, dtype=torch.int32)
    view = buffer[70:75]  # bytes 280..300
    copy = snapshot({"v": view}).tree["v"]
    assert copy.base == 256 and copy.data.numel() == 300 - 256
    assert torch.equal(copy.view(), view) and copy.storage_offset == 70


def test_codec_values_and_dataclasses_still_take_the_generic_walk() -> None:
    from dataclasses import dataclass

    @dataclass
    class Holder:
        scratch: torch.Tensor
        n: int

    holder = Holder(torch.full((4,), 3.0), 2)
    tree = snapshot({"holder": holder, "x": torch.ones(2)}).tree
    assert isinstance(tree["holder"], CodecValue)
    assert isinstance(tree["holder"].value["scratch"], TensorCopy) and tree["holder"].value["n"] == 2
    assert torch.equal(tree["holder"].value["scratch"].view(), holder.scratch)


def test_repeated_snapshots_reuse_nothing_they_returned() -> None:
    """The span views are pooled per thread; the copies handed out must stay independent."""
    first = snapshot({"a": torch.full((8,), 1.0), "b": torch.full((8,), 2.0)}).tree
    second = snapshot({"a": torch.full((8,), 3.0), "b": torch.full((8,), 4.0)}).tree
    assert torch.equal(first["a"].view(), torch.full((8,), 1.0))
    assert torch.equal(first["b"].view(), torch.full((8,), 2.0))
    assert torch.equal(second["b"].view(), torch.full((8,), 4.0))


def test_largest_propagates_nan() -> None:
    assert _largest([1.0, 3.0, 2.0]) == 3.0
    assert math.isnan(_largest([1.0, math.nan, 2.0]))
    assert math.isnan(_largest([math.nan, 5.0]))
    assert _largest([math.inf, 1.0]) == math.inf
