"""A codec's one-pass ``collect`` (what the layer-scope flight recorder runs on the serving thread) gives exactly
what encoding and then walking the encoded tree gives: the same tree, the same tensors in the same order."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moereplay.capture.snapshot import _codec_of, _Pending, _walk, format_codec
from moereplay.format.schema import CodecValue
from moereplay.ops import (
    matmul_ogs,  # noqa: F401  (registers the triton_kernels codecs)
    ogs_codecs,
)


def _ints(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int32)


def _routing(**changes: Any) -> ogs_codecs.RoutingSpec:
    expt = ogs_codecs.ExptDataSpec(
        hist=_ints(4),
        token_offs_raw=_ints(5),
        token_offs_pad={64: _ints(5), 16: _ints(5), 32: _ints(5)},  # unsorted keys: the tree sorts them
        block_pid_map={16: _ints(9), 64: _ints(7), 32: _ints(8)},
    )
    fields: dict[str, Any] = {
        "gate_scal": torch.rand(8),
        "expt_hist": _ints(4),
        "n_expts_tot": 4,
        "n_expts_act": 2,
        "expt_data": expt,
        "expected_tokens_per_expt": None,
    }
    fields.update(changes)
    return ogs_codecs.RoutingSpec(**fields)


def _normal(tree: Any, found: list[torch.Tensor]) -> Any:
    """The tree with each placeholder as the id of its tensor (placeholders differ as objects)."""
    if isinstance(tree, _Pending):
        return ("tensor", id(found[tree.index]))
    if isinstance(tree, CodecValue):
        return ("codec", tree.type_name, _normal(tree.value, found))
    if isinstance(tree, dict):
        return {key: _normal(value, found) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return [type(tree).__name__, *(_normal(value, found) for value in tree)]
    return tree


CASES = {
    "routing": _routing(),
    "routing without expt_data": _routing(expt_data=None),
    "routing without gate_scal, expected tokens": _routing(gate_scal=None, expected_tokens_per_expt=7),
    "routing without block maps": _routing(expt_data=ogs_codecs.ExptDataSpec(_ints(4), None, None, None)),
    "gather": ogs_codecs.GatherSpec(_ints(8), _ints(8)),
    "scatter": ogs_codecs.ScatterSpec(_ints(8), _ints(8)),
    "a list of them": [ogs_codecs.GatherSpec(_ints(8), _ints(8)), _routing(), 3, None],
    "nested past the depth limit": [[[[[[_routing()]]]]]],  # the walk's MAX_DEPTH cuts inside the tree
}


@pytest.mark.parametrize("name", list(CASES))
def test_collect_equals_encode_then_walk(name: str) -> None:
    value = CASES[name]
    codec = format_codec(type(value)) if not isinstance(value, list) else None
    assert isinstance(value, list) or codec is not None
    fast: list[torch.Tensor] = []
    tree = _walk(value, fast, format_codec, 0)  # the registry's codecs have ``collect``: one pass

    def no_collect(kind: type) -> Any:  # another lookup function: the generic encode-then-walk path
        return format_codec(kind)

    slow: list[torch.Tensor] = []
    expected = _walk(value, slow, no_collect, 0)
    assert [id(t) for t in fast] == [id(t) for t in slow]
    assert _normal(tree, fast) == _normal(expected, slow)


@pytest.mark.parametrize("name", [name for name, value in CASES.items() if not isinstance(value, list)])
def test_tensors_only_gives_collects_tensors_in_its_order(name: str) -> None:
    """The serving thread's tensors-only walk (``Codec.tensors``) meets exactly the tensors ``collect`` passes to
    its leaf, in the same order (the tree built at a trigger numbers them by it)."""
    value = CASES[name]
    codec = _codec_of(type(value))
    assert codec is not None and codec.tensors is not None and codec.collect is not None
    met: list[torch.Tensor] = []
    codec.collect(value, met.append)
    appended: list[torch.Tensor] = []
    assert codec.tensors(value, appended.append) is None  # builds nothing
    assert [id(t) for t in appended] == [id(t) for t in met] and met


def test_tensors_only_refuses_a_tensor_field_that_is_not_one() -> None:
    routing = _routing()
    routing.expt_data.block_pid_map[16] = [1, 2]  # type: ignore[index]
    for bad, match in (
        (ogs_codecs.GatherSpec(_ints(8), "not a tensor"), r"GatherIndx\.dst_indx is not a tensor"),  # type: ignore[arg-type]
        (routing, r"expt_data\.block_pid_map is not a tensor"),
        (ogs_codecs.ScatterSpec(_ints(8), _ints(8)), None),
    ):
        codec = _codec_of(type(bad))
        assert codec is not None and codec.tensors is not None
        if match is None:
            codec.tensors(bad, [].append)
            continue
        with pytest.raises(Exception, match=match):
            codec.tensors(bad, [].append)
        with pytest.raises(Exception, match=match):
            codec.collect(bad, lambda tensor: tensor)  # type: ignore[misc]


def test_collect_refuses_what_encode_refuses() -> None:
    bad = ogs_codecs.GatherSpec(_ints(8), "not a tensor")  # type: ignore[arg-type]
    with pytest.raises(Exception, match=r"GatherIndx\.dst_indx is not a tensor"):
        _walk(bad, [], format_codec, 0)


# --- the layer-scope flight recorder collects a codec object's tensors now and builds its tree at the trigger ---


def _layer_flight() -> Any:
    from moereplay.capture import flight_layer

    return flight_layer.LayerFlight(max_calls=4, max_bytes=1 << 20, absmax=None, emit=lambda *a: True)


def _layer_target() -> Any:
    from moereplay.ops.surface import CaptureTarget

    return CaptureTarget(
        "triton_kernel_fused_experts", "parent", "test", "triton_kernel_fused_experts",
        static=("w1",), outputs=("output",), inputs_intact=True,
    )  # fmt: skip


def _layer_bound() -> dict[str, Any]:
    return {
        "output": torch.zeros(4, 8),
        "hidden_states": torch.randn(4, 8),
        "w1": torch.zeros(2, 2),
        "routing_data": _routing(),
        "gather_indx": ogs_codecs.GatherSpec(_ints(8), _ints(8)),
        "scatter_indx": ogs_codecs.ScatterSpec(_ints(8), _ints(8)),
        "pair": [ogs_codecs.GatherSpec(_ints(8), _ints(8)), 3],  # a plain container: walked on the spot
        "topk": 2,
    }


def _layer_call(bound: dict[str, Any]) -> Any:
    from moereplay.capture.context import Where

    flight = _layer_flight()
    call = flight.before(_layer_target(), dict(bound), Where(0, 1, 0, "layer.0", "run", "NONE"), 0)
    flight.after(call, bound["output"], None)
    return flight, call


def test_a_layer_call_copies_a_codec_objects_tensors_in_its_walk_order_and_describes_it_the_same() -> None:
    from moereplay.capture.flight_layer import _Deferred

    bound = _layer_bound()
    flight, call = _layer_call(bound)
    # the codec objects' trees wait for the trigger; the plain list is walked on the spot
    assert {name for name, tree in call.trees.items() if type(tree) is _Deferred} == {
        "routing_data", "gather_indx", "scatter_indx"
    }  # fmt: skip
    copied = list(call.tensors)
    expected_found: list[torch.Tensor] = []
    expected: dict[str, Any] = {}
    for name in ("hidden_states", "routing_data", "gather_indx", "scatter_indx", "pair"):
        value = bound[name]
        if isinstance(value, torch.Tensor):
            expected_found.append(value)
            expected[name] = ("tensor", id(value))
        else:
            expected[name] = _normal(_walk(value, expected_found, format_codec, 0), expected_found)
    assert [id(t) for t in copied[: len(expected_found)]] == [id(t) for t in expected_found]
    flight._describe(call)
    tree = call.input_tree
    assert tree is not None
    for name, want in expected.items():
        assert _normal(tree[name], copied) == want, name
    assert tree["topk"] == 2


def test_a_codec_object_whose_tensors_were_replaced_after_the_call_is_written_unsupported() -> None:
    from moereplay.format.schema import Unsupported

    bound = _layer_bound()
    _, call = _layer_call(bound)
    flight = _layer_flight()
    # another tensor than the one the ring copied (triton_kernels' own classes are not frozen; these specs are)
    object.__setattr__(bound["gather_indx"], "src_indx", _ints(8))
    flight._describe(call)
    tree = call.input_tree
    assert tree is not None
    assert isinstance(tree["gather_indx"], Unsupported)
    assert "changed between the call and the trigger" in tree["gather_indx"].repr_excerpt
    assert isinstance(tree["routing_data"], CodecValue)  # the others stay as they were


def test_a_codec_object_that_its_codec_refuses_at_the_trigger_is_written_unsupported() -> None:
    from moereplay.format.schema import Unsupported

    bound = _layer_bound()
    _, call = _layer_call(bound)
    object.__setattr__(bound["scatter_indx"], "dst_indx", "not a tensor")
    _layer_flight()._describe(call)
    tree = call.input_tree
    assert tree is not None
    assert isinstance(tree["scatter_indx"], Unsupported)
    assert "not recordable at the trigger" in tree["scatter_indx"].repr_excerpt
