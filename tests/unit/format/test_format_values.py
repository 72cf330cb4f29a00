"""Argument trees round-trip: scalars, containers, enums, dtypes, devices, codecs, unsupported markers."""

from __future__ import annotations

import collections
import enum
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moereplay.errors import UnsupportedValueError
from moereplay.format import (
    CaptureReader,
    CaptureWriter,
    CodecValue,
    EnumValue,
    TensorMeta,
    Unsupported,
    qualified_name,
    register_codec,
    register_enum,
    unregister_codec,
)


class Activation(enum.Enum):
    SILU = "silu"
    SWIGLU = "swiglu"


class Flag(enum.IntFlag):
    A = 1
    B = 2


class NotRegistered(enum.IntEnum):
    X = 7


register_enum(Activation)
register_enum(Flag)


def _same(first: Any, second: Any) -> bool:
    """Equality that also checks types (tuple vs list, bool vs int) and treats nan as equal to nan."""
    if type(first) is not type(second):
        return False
    if isinstance(first, float):
        return (math.isnan(first) and math.isnan(second)) or (
            first == second and math.copysign(1, first) == math.copysign(1, second)
        )
    if isinstance(first, (list, tuple)):
        return len(first) == len(second) and all(_same(a, b) for a, b in zip(first, second, strict=True))
    if isinstance(first, dict):
        return list(first) == list(second) and all(_same(first[key], second[key]) for key in first)
    return bool(first == second)


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.sampled_from([Activation.SILU, Activation.SWIGLU, Flag.A | Flag.B])
    | st.sampled_from([torch.float8_e4m3fn, torch.float4_e2m1fn_x2, torch.bfloat16, torch.bool])
    | st.sampled_from([torch.device("cpu"), torch.device("cuda", 1)])
)
trees = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), children, max_size=4)
    ),
    max_leaves=20,
)


def _round_trip(args: dict[str, Any], path: Path, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    with CaptureWriter(path) as writer:
        writer.begin_call("op", args, **kwargs)
    with CaptureReader(path) as reader:
        return reader.call(0), reader.load_args(0)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(min_size=1, max_size=10), trees, max_size=5))
def test_argument_trees_round_trip(args: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        record, loaded = _round_trip(args, Path(directory) / "tree.zst")
    assert _same(loaded, args)
    assert _same(record.args, args)  # no tensors: the schema tree is the value tree


def test_sets_sizes_bigints_and_int_keys(tmp_path: Path) -> None:
    args = {
        "set": {1, 2, 3},
        "frozen": frozenset({"a"}),
        "size": torch.Size([3, 4]),
        "big": -(2**100),
        "keys": {0: "zero", -1: "minus one", (1, 2): "tuple key"},
        "floats": [float("inf"), -float("inf"), -0.0],
    }
    _, loaded = _round_trip(args, tmp_path / "misc.zst")
    assert loaded["set"] == {1, 2, 3} and type(loaded["frozen"]) is frozenset
    assert type(loaded["size"]) is torch.Size and loaded["size"] == torch.Size([3, 4])
    assert loaded["big"] == -(2**100)
    assert loaded["keys"] == args["keys"]
    assert _same(loaded["floats"], args["floats"])


def test_unregistered_enum_and_objects_are_markers(tmp_path: Path) -> None:
    ordered = collections.OrderedDict(a=1)
    _, loaded = _round_trip(
        {"enum": NotRegistered.X, "obj": object(), "ordered": ordered}, tmp_path / "m.zst"
    )
    assert loaded["enum"] == EnumValue(qualified_name(NotRegistered), "X", 7)
    assert isinstance(loaded["obj"], Unsupported) and loaded["obj"].type_name == "builtins.object"
    assert loaded["ordered"].type_name == "collections.OrderedDict"
    assert "a" in loaded["ordered"].repr_excerpt


def test_unsupported_repr_is_bounded_and_never_raises(tmp_path: Path) -> None:
    class Huge:
        def __repr__(self) -> str:
            return "x" * 10_000

    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    _, loaded = _round_trip({"huge": Huge(), "broken": Broken()}, tmp_path / "r.zst")
    assert len(loaded["huge"].repr_excerpt) <= 200
    assert "repr failed" in loaded["broken"].repr_excerpt


@dataclass
class Routing:
    """Stands in for an opaque library object (e.g. triton_kernels RoutingData)."""

    gate: torch.Tensor
    experts: int
    mode: Activation


def test_codec_round_trip_with_tensors_inside(tmp_path: Path) -> None:
    register_codec(
        Routing,
        lambda routing: {"gate": routing.gate, "experts": routing.experts, "mode": routing.mode},
        lambda tree: Routing(tree["gate"], tree["experts"], tree["mode"]),
    )
    try:
        gate = torch.randn(4, 3)
        record, loaded = _round_trip(
            {"routing": Routing(gate.t(), 8, Activation.SILU), "x": gate}, tmp_path / "c.zst"
        )
        assert isinstance(record.args["routing"], CodecValue)
        assert isinstance(record.arg_tensors["routing<Routing>.gate"], TensorMeta)
        assert record.arg_tensors["routing<Routing>.gate"].storage == record.arg_tensors["x"].storage
        routing = loaded["routing"]
        assert isinstance(routing, Routing) and routing.experts == 8 and routing.mode is Activation.SILU
        assert torch.equal(routing.gate, gate.t()) and routing.gate.stride() == (1, 3)
        assert routing.gate.untyped_storage().data_ptr() == loaded["x"].untyped_storage().data_ptr()
    finally:
        unregister_codec(Routing)
    # without the codec at load time the value stays a CodecValue (tensors materialised inside)
    with CaptureReader(tmp_path / "c.zst") as reader:
        value = reader.load_args(0)["routing"]
    assert isinstance(value, CodecValue) and value.type_name == qualified_name(Routing)
    assert isinstance(value.value["gate"], torch.Tensor)


def test_codec_by_qualified_name_and_given_codec_values(tmp_path: Path) -> None:
    register_codec(f"{__name__}.Routing", lambda routing: routing.experts, lambda tree: ("decoded", tree))
    try:
        args = {
            "a": Routing(torch.zeros(1), 3, Activation.SILU),
            "b": CodecValue("some.lib.Thing", {"k": [1, 2]}),
        }
        _, loaded = _round_trip(args, tmp_path / "q.zst")
    finally:
        unregister_codec(f"{__name__}.Routing")
    assert loaded["a"] == ("decoded", 3)
    assert loaded["b"] == CodecValue("some.lib.Thing", {"k": [1, 2]})


def test_failing_codec_raises_and_records_nothing(tmp_path: Path) -> None:
    def explode(_: Any) -> Any:
        raise RuntimeError("boom")

    register_codec(Routing, explode, lambda tree: tree)
    try:
        path = tmp_path / "fail.zst"
        with CaptureWriter(path) as writer:
            with pytest.raises(UnsupportedValueError, match="boom"):
                writer.begin_call("op", {"r": Routing(torch.zeros(1), 1, Activation.SILU)})
            assert writer.begin_call("op", {"fine": 1}) == 0
        with CaptureReader(path) as reader:
            assert len(reader) == 1
    finally:
        unregister_codec(Routing)


def test_failing_decoder_is_a_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "dec.zst"
    register_codec(Routing, lambda routing: routing.experts, lambda tree: 1 / 0)
    try:
        with CaptureWriter(path) as writer:
            writer.begin_call("op", {"r": Routing(torch.zeros(1), 1, Activation.SILU)})
        with CaptureReader(path) as reader, pytest.raises(UnsupportedValueError, match="ZeroDivisionError"):
            reader.load_args(0)
    finally:
        unregister_codec(Routing)


def test_cyclic_and_unencodable_values_raise(tmp_path: Path) -> None:
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    with CaptureWriter(tmp_path / "cyc.zst") as writer:
        with pytest.raises(UnsupportedValueError, match="deeper"):
            writer.begin_call("op", {"c": cyclic})
        with pytest.raises(UnsupportedValueError):
            writer.begin_call("op", {"s": "\ud800"})  # a lone surrogate is not UTF-8
        assert writer.calls == 0


def test_context_and_tensors_in_context(tmp_path: Path) -> None:
    path = tmp_path / "ctx.zst"
    with CaptureWriter(path) as writer:
        writer.begin_call(
            "op",
            {},
            site="mod.py:12",
            context={"layer": 3, "step": 9, "tags": ("a",), "t": torch.ones(1)},
            parent=None,
        )
        writer.begin_call("child", {}, parent=0)
    with CaptureReader(path) as reader:
        first, second = list(reader.calls())
    assert first.site == "mod.py:12" and first.layer == 3 and first.context["tags"] == ("a",)
    assert isinstance(first.context["t"], Unsupported)
    assert second.parent == 0 and second.layer is None
