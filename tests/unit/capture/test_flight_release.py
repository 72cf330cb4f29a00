"""The layer-scope flight recorder lets go of a large call's tensors right after its copy (prefill: vLLM's gpt-oss
layer returns a fresh output each call, and K of them held would keep K × 47 MB from the allocator at 8,192
tokens); a decode-sized call's references stay until it leaves the history. Either way a trigger writes the
calls bit for bit, and a released call is described as a kept one is (CPU: the ring's torch path)."""

from __future__ import annotations

import gc
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_codec_collect import _layer_bound, _layer_target, _normal

from moereplay.capture import flight_layer
from moereplay.capture.context import Where
from moereplay.capture.patch_points import CaptureTarget
from moereplay.format import CaptureReader
from moereplay.format.schema import Unsupported

MODULE = "moereplay_test_release"
COLUMNS = 512
LARGE = 4096  # rows: 8 MiB of float32 hidden states (RELEASE_BYTES with the output alone)
WHERE = Where(0, 1, 0, "layer.0", "run", "NONE")


def fresh_layer(hidden: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """A layer that reads its inputs and returns a fresh output, as vLLM's ``triton_kernel_moe_forward`` does."""
    return torch.matmul(hidden, weight) * gate[:, :1]


def halve_in_place(hidden: torch.Tensor) -> torch.Tensor:
    """A layer that writes its input (copied before the call) and returns a small summary."""
    hidden.mul_(0.5)
    return hidden[:, :1].sum(dim=0, keepdim=True)


def with_scratch(hidden: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    torch.matmul(hidden, weight, out=cache)
    return cache * 2


@pytest.fixture
def layer(arm, stand_in_module: Callable[..., types.ModuleType]):
    """``layer(target, **settings)`` → ``module``: the stand-in layers, ``target`` the only one armed (a
    ``CaptureTarget`` of ``MODULE``); the session is ``module.session``."""

    def _arm(target: CaptureTarget, **settings: str) -> types.ModuleType:
        stand_in_module(MODULE, fresh=fresh_layer, halve=halve_in_place, scratchy=with_scratch)
        module = sys.modules[MODULE]
        module.session = arm(targets=(target,), trigger="flight", **settings)
        return module

    return _arm


FRESH = CaptureTarget("fresh", "parent", MODULE, "fresh", static=("weight",), inputs_intact=True)


def call_dropping_everything(module: types.ModuleType, rows: int, weight: torch.Tensor):
    """One layer call on fresh inputs; returns weak references to its hidden states, gate and output."""
    hidden = torch.ones(rows, COLUMNS)
    gate = torch.ones(rows, 4)
    output = module.fresh(hidden, weight, gate)
    refs = (weakref.ref(hidden), weakref.ref(gate), weakref.ref(output))
    del hidden, gate, output
    gc.collect()
    return refs


def close(module: types.ModuleType) -> None:
    module.session.flush()
    module.session.close()


def test_a_large_call_lets_go_of_its_tensors_when_it_returns(layer) -> None:
    module = layer(FRESH, flight_calls="4")
    refs = call_dropping_everything(module, LARGE, torch.eye(COLUMNS))
    assert [ref() is None for ref in refs] == [True, True, True]
    call_dropping_everything(module, 8, torch.eye(COLUMNS))
    close(module)
    with CaptureReader(module.session.path) as reader:
        assert reader.footer["counters"]["flight_released"] == 1  # the large call, not the small one


@pytest.mark.parametrize("stream_stores", ["0", "1"])
def test_the_stream_stores_setting_reaches_the_rings(layer, stream_stores: str) -> None:
    module = layer(FRESH, flight_calls="4", flight_stream_stores=stream_stores)
    call_dropping_everything(module, 8, torch.eye(COLUMNS))
    rings = list(module.session.recorder.flight._rings.values())
    assert [ring.stream_stores for ring in rings] == [stream_stores == "1"]
    close(module)


@pytest.mark.parametrize("rows", [8, 512])  # 512 rows: 2 MiB of copies, under RELEASE_BYTES
def test_a_smaller_call_keeps_its_tensors_until_it_leaves_the_history(layer, rows: int) -> None:
    module = layer(FRESH, flight_calls="4")
    weight = torch.eye(COLUMNS)
    first = call_dropping_everything(module, rows, weight)
    assert all(ref() is not None for ref in first)  # held: described only if a trigger writes it
    for _ in range(6):  # four calls kept for the next trigger; the first leaves once checked
        call_dropping_everything(module, rows, weight)
    module.session.recorder.flight.poll(launch=True)
    gc.collect()
    assert all(ref() is None for ref in first)
    close(module)


def test_inputs_copied_before_the_call_count_toward_the_release(layer) -> None:
    # the layer writes its input: 8 MiB copied before the call, a 4-byte output after it
    target = CaptureTarget("halve", "parent", MODULE, "halve")
    module = layer(target, flight_calls="4")
    hidden = torch.ones(LARGE, COLUMNS)
    ref = weakref.ref(hidden)
    module.halve(hidden)
    del hidden
    gc.collect()
    assert ref() is None
    close(module)


def test_an_output_buffer_passed_in_is_let_go(layer, arm_intact) -> None:
    def doubling(hidden: torch.Tensor, w1: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        output.copy_(hidden * 2)
        return output

    session, module = arm_intact(doubling, trigger="flight", flight_calls="4")
    hidden, output = torch.ones(LARGE, COLUMNS), torch.empty(LARGE, COLUMNS)
    refs = [weakref.ref(hidden), weakref.ref(output)]
    module.layer(hidden, torch.zeros(2, 2), output)
    del hidden, output
    gc.collect()
    assert [ref() is None for ref in refs] == [True, True]
    session.flush()
    session.close()


def test_a_released_scratch_buffer_is_let_go_and_written_as_its_marker(layer) -> None:
    target = CaptureTarget(
        "scratchy", "parent", MODULE, "scratchy", static=("weight",), scratch=("cache",), inputs_intact=True
    )
    module = layer(target, flight_calls="4")
    weight = torch.eye(COLUMNS)
    hidden, cache = torch.ones(LARGE, COLUMNS), torch.empty(LARGE, COLUMNS)
    ref = weakref.ref(cache)
    module.scratchy(hidden, weight, cache)
    del cache
    gc.collect()
    assert ref() is None  # the call is in the history, kept for a trigger
    hidden[0, 0] = float("nan")
    module.scratchy(hidden, weight, torch.empty(LARGE, COLUMNS))
    close(module)
    with CaptureReader(module.session.path) as reader:
        records = list(reader.calls())
        assert len(records) == 2
        for record in records:
            marker = reader.load_args(record.index)["cache"]
            assert isinstance(marker, Unsupported)
            assert marker.repr_excerpt.startswith("scratch buffer (4096, 512)")


@pytest.mark.parametrize("rows", [8, LARGE])
def test_a_trigger_writes_released_and_held_calls_bit_for_bit(layer, rows: int) -> None:
    module = layer(FRESH, flight_calls="3")
    weight = torch.eye(COLUMNS) * 0.5
    kept = []
    for step in range(5):
        hidden = torch.full((rows, COLUMNS), float(step + 1))
        if step == 3:
            hidden[rows - 1, 7] = float("nan")
        gate = torch.full((rows, 4), 2.0)
        output = module.fresh(hidden, weight, gate)
        kept.append((hidden.clone(), gate.clone(), output.clone()))
        del hidden, gate, output
    close(module)
    with CaptureReader(module.session.path) as reader:
        records = list(reader.calls())
        assert [r.context["call"] for r in records] == [1, 2, 3]
        assert records[-1].context["flight"]["trigger"]
        for record, (hidden, gate, output) in zip(records, kept[1:4], strict=True):
            args = reader.load_args(record.index)
            assert args["hidden"].shape == (rows, COLUMNS) and args["gate"].stride() == (4, 1)
            assert torch.equal(args["hidden"].view(torch.uint8), hidden.view(torch.uint8))
            assert torch.equal(args["gate"], gate)
            assert torch.equal(args["weight"], weight)
            recorded = reader.load_outputs(record.index)["return"]
            assert torch.equal(recorded.view(torch.uint8), output.view(torch.uint8))


def _described(release_bytes: int, bound: dict[str, Any]) -> tuple[flight_layer.LayerCall, list[Any]]:
    flight = flight_layer.LayerFlight(
        max_calls=4, max_bytes=1 << 22, absmax=None, emit=lambda *a: True, release_bytes=release_bytes
    )
    call = flight.before(_layer_target(), dict(bound), WHERE, 0)
    flight.after(call, bound["output"], None)
    tensors = list(call.tensors or ())  # inputs, then outputs (as kept)
    flight._describe(call)
    return call, tensors


def test_a_released_call_with_codec_objects_is_described_as_a_kept_one() -> None:
    """triton_kernels' routing objects are walked again when the call is described and their tensors checked by
    identity: a released call keeps only those, and describes to the same trees and tensor metadata."""
    bound = _layer_bound()
    kept, tensors = _described(0, bound)
    released, _ = _described(1, bound)
    assert released.copies is not None and kept.copies is not None
    assert [c[:6] for c in map(_fields, released.copies)] == [c[:6] for c in map(_fields, kept.copies)]
    assert _normal(released.input_tree, tensors) == _normal(kept.input_tree, tensors)
    assert _normal(released.output_tree, tensors) == _normal(kept.output_tree, tensors)
    assert released.outputs == kept.outputs
    assert not any(isinstance(value, Unsupported) for value in (released.input_tree or {}).values())


def test_release_keeps_only_the_codec_objects_tensors() -> None:
    bound = _layer_bound()
    flight = flight_layer.LayerFlight(
        max_calls=4, max_bytes=1 << 22, absmax=None, emit=lambda *a: True, release_bytes=1
    )
    call = flight.before(_layer_target(), dict(bound), WHERE, 0)
    collected = list(call.tensors or ())
    flight.after(call, bound["output"], None)
    hidden = collected.index(bound["hidden_states"])
    assert call.tensors is not None and call.tensors[hidden] is None  # not a codec object's: let go
    assert sum(t is not None for t in call.tensors) == sum(
        d.count for d in call.trees.values() if isinstance(d, flight_layer._Deferred)
    )
    assert call.bound is not None and call.bound["hidden_states"] is None and call.bound["output"] is None


def _fields(copy: Any) -> tuple[Any, ...]:
    return (copy.dtype, copy.shape, copy.stride, copy.storage_offset, copy.device, copy.storage, copy.size)
