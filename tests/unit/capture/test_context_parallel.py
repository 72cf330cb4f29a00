"""Ranks, group sizes and each MoE layer's split are read from vLLM's objects by name, without importing vLLM.

The fakes mirror vLLM 0.25.1: ``parallel_state`` getters returning ``GroupCoordinator``-like objects (``rank``,
``rank_in_group``, ``world_size``; ``get_ep_group`` asserts when the group was never made), and a ``MoERunner``-like
layer in ``ForwardContext.no_compile_layers`` with ``moe_config.moe_parallel_config`` and an ``expert_map`` buffer.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from moereplay.capture.context import ContextTracker
from moereplay.format import CaptureReader


@dataclass
class Group:
    rank: int
    rank_in_group: int
    world_size: int


def _parallel_state(*, tp: tuple[int, int], ep: tuple[int, int] | None, world: tuple[int, int]) -> Any:
    state = types.ModuleType("vllm.distributed.parallel_state")

    def ep_group() -> Group:
        assert ep is not None, "expert parallel group is not initialized"
        return Group(world[0], ep[0], ep[1])

    state.model_parallel_is_initialized = lambda: True  # type: ignore[attr-defined]
    state.get_tp_group = lambda: Group(world[0], tp[0], tp[1])  # type: ignore[attr-defined]
    state.get_pp_group = lambda: Group(world[0], 0, 1)  # type: ignore[attr-defined]
    state.get_dp_group = lambda: Group(world[0], 0, 1)  # type: ignore[attr-defined]
    state.get_ep_group = ep_group  # type: ignore[attr-defined]
    state.get_world_group = lambda: Group(world[0], world[0], world[1])  # type: ignore[attr-defined]
    return state


@dataclass
class ParallelConfig:  # vLLM's FusedMoEParallelConfig fields that moereplay reads
    tp_size: int
    tp_rank: int
    ep_size: int
    ep_rank: int
    dp_size: int = 1
    dp_rank: int = 0
    use_ep: bool = False


@dataclass
class MoeConfig:
    num_experts: int
    num_local_experts: int
    moe_parallel_config: ParallelConfig


@dataclass
class Runner:
    moe_config: MoeConfig
    expert_map: torch.Tensor | None


@dataclass
class ForwardContext:
    no_compile_layers: dict[str, Any]
    all_moe_layers: list[str] = field(default_factory=list)
    attn_metadata: Any = "meta"


def _install(monkeypatch: pytest.MonkeyPatch, state: Any, context: ForwardContext) -> None:
    forward = types.ModuleType("vllm.forward_context")
    forward.is_forward_context_available = lambda: True  # type: ignore[attr-defined]
    forward.get_forward_context = lambda: context  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "vllm.distributed.parallel_state", state)
    monkeypatch.setitem(__import__("sys").modules, "vllm.forward_context", forward)


def test_tp_rank_sizes_and_layer_split_are_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = Runner(MoeConfig(8, 8, ParallelConfig(tp_size=2, tp_rank=1, ep_size=1, ep_rank=0)), None)
    context = ForwardContext({"model.layers.0.mlp.experts": layer}, ["model.layers.0.mlp.experts"])
    _install(monkeypatch, _parallel_state(tp=(1, 2), ep=None, world=(1, 2)), context)
    tracker = ContextTracker()
    parent = tracker.where(parent=None, is_parent=True)
    kernel = tracker.where(parent=parent, is_parent=False)
    recorded = kernel.as_dict(tracker.ranks)
    assert recorded["ranks"] == {
        "world": 1,
        "tp": 1,
        "pp": 0,
        "dp": 0,
        "world_size": 2,
        "tp_size": 2,
        "pp_size": 1,
        "dp_size": 1,
    }
    assert "ep" not in recorded["ranks"]  # vLLM asserted: no EP group; the other groups are still recorded
    assert recorded["parallel"] == {
        "tp": 1, "tp_size": 2, "ep": 0, "ep_size": 1, "dp": 0, "dp_size": 1, "use_ep": False,
        "global_experts": 8, "local_experts": 8,
    }  # fmt: skip


def test_expert_map_is_read_once_and_again_after_an_in_place_change(monkeypatch: pytest.MonkeyPatch) -> None:
    expert_map = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    layer = Runner(MoeConfig(4, 2, ParallelConfig(1, 0, 2, 1, use_ep=True)), expert_map)
    context = ForwardContext({"model.layers.0.mlp.experts": layer}, ["model.layers.0.mlp.experts"])
    _install(monkeypatch, _parallel_state(tp=(1, 2), ep=(1, 2), world=(1, 2)), context)
    tracker = ContextTracker()
    first = tracker.where(parent=None, is_parent=True).as_dict(tracker.ranks)
    assert first["parallel"]["expert_map"] == [-1, -1, 0, 1]
    assert first["parallel"]["ep"] == 1 and first["parallel"]["use_ep"] is True
    assert first["ranks"]["ep"] == 1 and first["ranks"]["ep_size"] == 2
    contexts = iter([ForwardContext(context.no_compile_layers, context.all_moe_layers) for _ in range(2)])
    step = next(contexts)  # a new forward pass: a new ForwardContext, the same layer object
    monkeypatch.setattr(
        __import__("sys").modules["vllm.forward_context"], "get_forward_context", lambda: step
    )
    second = tracker.where(parent=None, is_parent=True)
    assert second.parallel is tracker.where(parent=second, is_parent=False).parallel
    assert second.parallel is tracker._parallel.of(layer)  # cached: the map was not read again
    expert_map.copy_(torch.tensor([0, 1, -1, -1]))  # EPLB-style rewrite in place: the version counter moves
    step = next(contexts)
    third = tracker.where(parent=None, is_parent=True).as_dict(tracker.ranks)
    assert third["parallel"]["expert_map"] == [0, 1, -1, -1]


def test_a_layer_without_parallel_attributes_records_no_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    context = ForwardContext({"model.layers.0.mlp.experts": object()}, ["model.layers.0.mlp.experts"])
    _install(monkeypatch, _parallel_state(tp=(0, 1), ep=None, world=(0, 1)), context)
    tracker = ContextTracker()
    assert "parallel" not in tracker.where(parent=None, is_parent=True).as_dict(tracker.ranks)


def test_a_closed_file_is_named_by_the_world_rank_its_calls_saw(monkeypatch: pytest.MonkeyPatch, arm) -> None:
    # vLLM's workers arm before their process groups exist: every rank's file starts as rank0-pid….zst
    session = arm()
    first_name = session.path.name
    assert first_name.startswith("rank0-")
    layer = Runner(MoeConfig(8, 8, ParallelConfig(tp_size=2, tp_rank=1, ep_size=1, ep_rank=0)), None)
    context = ForwardContext({"model.layers.0.mlp.experts": layer}, ["model.layers.0.mlp.experts"])
    _install(monkeypatch, _parallel_state(tp=(1, 2), ep=None, world=(1, 2)), context)
    session.recorder.tracker.where(parent=None, is_parent=True)  # what a recorded call does first
    # renamed at once, while open (a worker vLLM kills before its capture closes keeps the right name)
    assert session.path.name == f"rank1-pid{session.pid}.zst"
    assert session.path.exists() and not session.path.with_name(first_name).exists()
    session.close()
    assert session.path.name == f"rank1-pid{session.pid}.zst"
    with CaptureReader(session.path) as reader:
        assert reader.recovery.complete  # the footer went to the renamed file


def test_a_file_keeps_its_name_when_no_rank_was_seen(arm) -> None:
    session = arm()
    name = session.path.name
    session.close()
    assert session.path.name == name and session.path.exists()
