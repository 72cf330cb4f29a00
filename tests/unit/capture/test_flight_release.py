"""The layer-scope flight recorder lets go of a large call's tensors right after its copy (prefill: vLLM's gpt-oss
layer returns a fresh output each call, and K of them held would keep K × 47 MB from the allocator at 8,192
tokens); a decode-sized call's references stay until it leaves the history. Either way a trigger writes the
calls bit for bit (CPU: the ring's torch path)."""

from __future__ import annotations

import gc
import sys
import types
import weakref
from collections.abc import Callable

import pytest
import torch

from moereplay.capture import flight_layer
from moereplay.capture.patch_points import CaptureTarget
from moereplay.format import CaptureReader

MODULE = "moereplay_test_release"


def fresh_layer(hidden: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """A layer that reads its inputs and returns a fresh output, as vLLM's ``triton_kernel_moe_forward`` does."""
    return torch.matmul(hidden, weight) * gate[:, :1]


@pytest.fixture
def layer(arm, stand_in_module: Callable[..., types.ModuleType]):
    """``layer(**settings)`` → ``(session, module)``: ``fresh_layer`` armed as the only target."""

    def _arm(**settings: str):
        stand_in_module(MODULE, layer=fresh_layer)
        target = CaptureTarget("layer", "parent", MODULE, "layer", static=("weight",), inputs_intact=True)
        return arm(targets=(target,), trigger="flight", **settings), sys.modules[MODULE]

    return _arm


def call_dropping_everything(module: types.ModuleType, rows: int, weight: torch.Tensor, value: float = 1.0):
    """One layer call on fresh inputs; returns weak references to its hidden states, gate and output."""
    hidden = torch.full((rows, 256), value)
    gate = torch.ones(rows, 4)
    output = module.layer(hidden, weight, gate)
    refs = (weakref.ref(hidden), weakref.ref(gate), weakref.ref(output))
    del hidden, gate, output
    gc.collect()
    return refs


def test_a_large_call_lets_go_of_its_tensors_when_it_returns(layer) -> None:
    session, module = layer(flight_calls="4")
    weight = torch.eye(256)
    # 1,024 rows: 1 MiB of hidden states and 1 MiB of output, at RELEASE_BYTES with its gate
    refs = call_dropping_everything(module, 1024, weight)
    assert [ref() is None for ref in refs] == [True, True, True]
    session.flush()
    session.close()


def test_a_decode_sized_call_keeps_its_tensors_until_it_leaves_the_history(layer) -> None:
    session, module = layer(flight_calls="4")
    weight = torch.eye(256)
    first = call_dropping_everything(module, 8, weight)
    assert all(ref() is not None for ref in first)  # held: described only if a trigger writes it
    for _ in range(6):  # four calls kept for the next trigger; the first leaves once checked
        call_dropping_everything(module, 8, weight)
    session.recorder.flight.poll(launch=True)
    gc.collect()
    assert all(ref() is None for ref in first)
    session.flush()
    session.close()


@pytest.mark.parametrize("rows", [8, 1024])
def test_a_trigger_writes_released_and_held_calls_bit_for_bit(layer, rows: int) -> None:
    session, module = layer(flight_calls="3")
    weight = torch.eye(256) * 0.5
    kept = []
    for step in range(5):
        hidden = torch.full((rows, 256), float(step + 1))
        if step == 3:
            hidden[rows - 1, 7] = float("nan")
        gate = torch.full((rows, 4), 2.0)
        output = module.layer(hidden, weight, gate)
        kept.append((hidden.clone(), gate.clone(), output.clone()))
        del hidden, gate, output
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        assert [r.context["call"] for r in records] == [1, 2, 3]
        assert records[-1].context["flight"]["trigger"]
        for record, (hidden, gate, output) in zip(records, kept[1:4], strict=True):
            args = reader.load_args(record.index)
            assert args["hidden"].shape == (rows, 256) and args["gate"].stride() == (4, 1)
            assert torch.equal(args["hidden"].view(torch.uint8), hidden.view(torch.uint8))
            assert torch.equal(args["gate"], gate)
            assert torch.equal(args["weight"], weight)
            recorded = reader.load_outputs(record.index)["return"]
            assert torch.equal(recorded.view(torch.uint8), output.view(torch.uint8))


def test_release_keeps_a_codec_objects_inputs_and_lets_the_outputs_go() -> None:
    """triton_kernels' routing objects are walked again at the trigger and their tensors checked by identity: a
    released call keeps its inputs when it has such an object, and still lets its outputs go."""
    target = CaptureTarget("layer", "parent", MODULE, "layer", static=("weight",), inputs_intact=True)
    hidden, output = torch.ones(4, 8), torch.ones(4, 8)
    call = flight_layer.LayerCall(
        target, None, 0, {"hidden": hidden, "routing": object()}, {"hidden": 0, "routing": flight_layer._Deferred(1, 0)},
        [hidden],
    )  # fmt: skip
    call.outputs = {"return": 1}
    call.tensors = [hidden, output]
    call.output_copy = ([0, 256], [0, 0], [128, 128])
    flight = flight_layer.LayerFlight(max_calls=2, max_bytes=1 << 20, absmax=None, emit=lambda *a: True)
    flight.release(call)
    assert call.tensors == [hidden] and call.tensors[0] is hidden
    assert call.bound is not None and call.bound["hidden"] is None and call.bound["routing"] is not None
    assert [c.shape for c in call.copies or ()] == [(4, 8), (4, 8)]
