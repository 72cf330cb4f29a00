"""tools/bench/layer_recorder_bench.py's whole-path timing: it must go through the plugin's real wrapper and the
layer-scope flight recorder for every call it times (a timing of nothing would read as a cheap recorder)."""

from __future__ import annotations

import argparse
import math
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from model_files import load_tool

BENCH = Path(__file__).resolve().parents[3] / "tools" / "bench" / "layer_recorder_bench.py"


@pytest.fixture(scope="module")
def bench() -> types.ModuleType:
    return load_tool("layer_recorder_bench", BENCH.parent)


def _left_behind(bench: types.ModuleType, ring: object, previous: object) -> None:
    """Nothing of the bench's is left in this process: no session armed, the real ring, the module that was in
    ``vllm.forward_context``'s place before (a real vLLM's, where one is imported), no stand-in module."""
    from moereplay.capture import flight_layer
    from moereplay.capture import session as session_module

    assert session_module._session is None
    assert flight_layer.DeviceRing is ring
    assert sys.modules.get("vllm.forward_context") is previous and bench.STAND_IN not in sys.modules


@pytest.fixture
def previous_context() -> Iterator[types.ModuleType]:
    """A module in ``vllm.forward_context``'s place, as a process with vLLM imported has."""
    saved = sys.modules.get("vllm.forward_context")
    module = types.ModuleType("vllm.forward_context")
    sys.modules["vllm.forward_context"] = module
    yield module
    if saved is None:
        sys.modules.pop("vllm.forward_context", None)
    else:
        sys.modules["vllm.forward_context"] = saved


def test_the_whole_path_is_timed_through_the_wrapper_and_leaves_nothing_behind(
    bench: types.ModuleType, capsys: pytest.CaptureFixture[str], previous_context: types.ModuleType
) -> None:
    from moereplay.capture import flight_layer

    ring = flight_layer.DeviceRing
    options = argparse.Namespace(calls=48, rounds=1, prefill=256, pieces=True)
    medians = bench.time_whole(options)
    assert set(medians) == {"32 tokens", "256 tokens"}
    # (a figure, not a timed assertion: that every call went through the recorder is checked by time_whole itself)
    assert all(math.isfinite(value) for value in medians.values())
    out = capsys.readouterr().out
    assert "whole path, 256 tokens:" in out and "1 rounds of 48 calls" in out
    assert "cProfile" in out and "flight_layer.py" in out  # the profile saw the recorder's own functions
    _left_behind(bench, ring, previous_context)


def test_a_failing_whole_path_timing_leaves_nothing_behind(
    bench: types.ModuleType, monkeypatch: pytest.MonkeyPatch, previous_context: types.ModuleType
) -> None:
    from moereplay.capture import flight_layer

    ring = flight_layer.DeviceRing
    made = 0

    def failing(*args: object, **kwargs: object) -> torch.Tensor:
        nonlocal made
        made += 1
        if made > 60:  # inside the first armed run
            raise RuntimeError("the stand-in fails")
        return torch.empty(1)

    monkeypatch.setattr(bench, "_stand_in_forward", failing)
    with pytest.raises(RuntimeError, match="the stand-in fails"):
        bench.time_whole(argparse.Namespace(calls=48, rounds=1, prefill=0, pieces=False))
    _left_behind(bench, ring, previous_context)


def test_a_forward_context_shaped_as_vllms_names_each_moe_layer(
    bench: types.ModuleType, previous_context: types.ModuleType
) -> None:
    """The recorder's ``where`` reads the stand-in context as it reads vLLM's: a new step per context, the MoE
    layers' names in order, their parallel configuration."""
    from moereplay.capture.context import ContextTracker

    context = bench.vllm_forward_context(3)
    sys.modules["vllm.forward_context"] = context
    try:
        tracker = ContextTracker()
        context.new_step()
        first = [tracker.where(parent=None, is_parent=True) for _ in range(3)]
        context.new_step()
        second = tracker.where(parent=None, is_parent=True)
    finally:
        sys.modules["vllm.forward_context"] = previous_context
    assert [w.layer_name for w in first] == [f"model.layers.{i}.mlp.experts" for i in range(3)]
    assert [w.step for w in first] == [0, 0, 0] and second.step == 1 and second.layer == 0
    assert first[0].tag == "run" and first[0].cudagraph_mode == "NONE"
    assert first[0].parallel is not None and first[0].parallel.get("global_experts") == bench.EXPERTS
