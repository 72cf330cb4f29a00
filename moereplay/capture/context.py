"""Where in the serving process a call happened: forward step, MoE layer, ranks, warm-up tag.

Cheap by construction (a few attribute reads per call, no imports on the hot path):

- forward step: vLLM builds a new ``ForwardContext`` object for every forward pass
  (``vllm.forward_context.set_forward_context``); a change of that object's identity starts a new step.
  Outside a vLLM forward pass (tests, direct kernel calls) the step is ``None``.
- MoE layer: each MoE layer invokes exactly one *parent* call (``fused_marlin_moe`` /
  ``triton_kernel_fused_experts``) per forward pass, in model order, so the n-th parent call of a step is MoE
  layer n; kernel calls inherit their parent's layer. The layer *name* is the n-th MoE layer registered in the
  compilation config: ``ForwardContext.all_moe_layers`` when vLLM fills it, else the MoE entries of
  ``no_compile_layers`` in registration order.
- tag: ``"dummy"`` when the forward pass carries no attention metadata (vLLM's profile / warm-up /
  graph-capture dummy runs pass ``attn_metadata=None``), ``"run"`` otherwise.
- ranks: TP / EP / DP / PP rank and world rank, and each group's size, from ``vllm.distributed.parallel_state``
  once it is initialised (looked up again only when a new step starts, until found). Each group is read on its own:
  vLLM creates the EP group only for MoE models and its getter asserts otherwise.
- parallel (layer calls and their kernel calls): how *this MoE layer* is split, from the layer object vLLM keeps in
  ``ForwardContext.no_compile_layers[layer_name]`` (vLLM 0.25: a ``MoERunner``; its
  ``moe_config.moe_parallel_config`` is a ``FusedMoEParallelConfig``): ``tp``/``tp_size``, ``ep``/``ep_size``,
  ``dp``/``dp_size``, ``use_ep``, ``global_experts``, ``local_experts`` and ``expert_map`` (global expert id →
  local id, -1 = on another rank; absent without EP). The layer's ranks are not the process groups' ranks: under
  ``--enable-expert-parallel`` vLLM flattens TP × DP into the MoE's EP group and sets the MoE's TP size to 1. Read
  once per layer and cached; the expert map is read again only when its tensor changes (EPLB rewrites it in place:
  its version counter moves) and never while a CUDA graph is being captured (no device read then).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("moereplay.capture")


@dataclass(frozen=True)
class Ranks:
    """This process's rank in each of vLLM's process groups, and the groups' sizes (``None``: not known)."""

    world: int | None = None
    tensor_parallel: int | None = None
    expert_parallel: int | None = None
    data_parallel: int | None = None
    pipeline_parallel: int | None = None
    world_size: int | None = None
    tensor_parallel_size: int | None = None
    expert_parallel_size: int | None = None
    data_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None

    def as_dict(self) -> dict[str, int]:
        return {
            key: value
            for key, value in (
                ("world", self.world),
                ("tp", self.tensor_parallel),
                ("ep", self.expert_parallel),
                ("dp", self.data_parallel),
                ("pp", self.pipeline_parallel),
                ("world_size", self.world_size),
                ("tp_size", self.tensor_parallel_size),
                ("ep_size", self.expert_parallel_size),
                ("dp_size", self.data_parallel_size),
                ("pp_size", self.pipeline_parallel_size),
            )
            if value is not None
        }


def process_rank() -> int:
    """The rank used in the file name: torch.distributed's if initialised, else ``RANK`` / ``LOCAL_RANK``, else 0."""
    distributed = sys.modules.get("torch.distributed")
    try:
        if distributed is not None and distributed.is_available() and distributed.is_initialized():
            return int(distributed.get_rank())
    except Exception:  # a half-initialised process group must not break arming
        pass
    for name in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def _group_rank_and_size(state: Any, getter: str, rank_attribute: str) -> tuple[int | None, int | None]:
    """(rank, size) of one of vLLM's ``GroupCoordinator`` objects; (None, None) where the group does not exist."""
    function = getattr(state, getter, None)
    if function is None:
        return None, None
    try:
        group = function()
        rank = getattr(group, rank_attribute, None)
        size = getattr(group, "world_size", None)
    except Exception:  # vLLM's getters assert when their group was never created (EP without MoE)
        return None, None
    return (int(rank) if isinstance(rank, int) else None), (int(size) if isinstance(size, int) else None)


def _vllm_ranks() -> Ranks | None:
    state = sys.modules.get("vllm.distributed.parallel_state")
    if state is None:
        return None
    try:
        if not state.model_parallel_is_initialized():
            return None
    except Exception:
        return None
    ranks: dict[str, int | None] = {}
    for key, getter, rank_attribute in (
        ("tensor_parallel", "get_tp_group", "rank_in_group"),
        ("pipeline_parallel", "get_pp_group", "rank_in_group"),
        ("data_parallel", "get_dp_group", "rank_in_group"),
        ("expert_parallel", "get_ep_group", "rank_in_group"),
        ("world", "get_world_group", "rank"),
    ):
        rank, size = _group_rank_and_size(state, getter, rank_attribute)
        ranks[key] = rank
        ranks[f"{key}_size"] = size
    if all(value is None for value in ranks.values()):
        return None
    return Ranks(**ranks)


_PARALLEL_FIELDS = ("tp_rank", "tp_size", "ep_rank", "ep_size", "dp_rank", "dp_size", "use_ep")
_PARALLEL_KEYS = {"tp_rank": "tp", "ep_rank": "ep", "dp_rank": "dp"}


def _is_capturing_graph() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


class LayerParallelCache:
    """``parallel`` context of each MoE layer object, built once per layer (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Any, tuple[int, int] | None, dict[str, Any]]] = {}

    def of(self, layer: Any) -> dict[str, Any] | None:
        if layer is None:
            return None
        expert_map = _attribute(layer, "expert_map")
        version = None
        if expert_map is not None and hasattr(expert_map, "_version"):
            version = (id(expert_map), int(expert_map._version))
        entry = self._entries.get(id(layer))
        if entry is not None and entry[0] is layer and entry[1] == version:
            return entry[2]
        data = _layer_parallel(layer)
        if expert_map is not None:
            if _is_capturing_graph() and getattr(getattr(expert_map, "device", None), "type", "cpu") != "cpu":
                if (
                    entry is not None and "expert_map" in entry[2]
                ):  # keep the last map read (no device read now)
                    data["expert_map"] = entry[2]["expert_map"]
                version = entry[1] if entry is not None else None
            else:
                with contextlib.suppress(Exception):  # an unreadable map is left out, never raised into vLLM
                    data["expert_map"] = [int(value) for value in expert_map.reshape(-1).tolist()]
        if not data:
            return None
        self._entries[id(layer)] = (layer, version, data)  # holding the layer keeps its id from being reused
        return data


def _attribute(owner: Any, name: str) -> Any:
    try:
        return getattr(owner, name, None)
    except Exception:  # properties of half-built layers may raise
        return None


def _layer_parallel(layer: Any) -> dict[str, Any]:
    config = _attribute(layer, "moe_config")
    parallel = _attribute(config, "moe_parallel_config") or _attribute(layer, "moe_parallel_config")
    data: dict[str, Any] = {}
    if parallel is not None:
        for field in _PARALLEL_FIELDS:
            value = _attribute(parallel, field)
            if isinstance(value, (bool, int)):
                data[_PARALLEL_KEYS.get(field, field)] = value if isinstance(value, bool) else int(value)
    for key, owner, name in (
        ("global_experts", config, "num_experts"),
        ("local_experts", config, "num_local_experts"),
    ):
        value = _attribute(owner, name)
        if isinstance(value, int) and not isinstance(value, bool):
            data[key] = int(value)
    return data


@dataclass(slots=True)
class Where:
    """The context of one call, as recorded (built once per call: a slots class, not a frozen dataclass, whose
    ``__init__`` costs a few microseconds of serving-thread time more)."""

    call: int
    step: int | None
    layer: int | None
    layer_name: str | None
    tag: str | None
    cudagraph_mode: str | None
    parallel: dict[str, Any] | None = None  # shared between calls of one layer: never mutate

    def as_dict(self, ranks: Ranks | None) -> dict[str, Any]:
        data: dict[str, Any] = {"call": self.call}
        for key in ("step", "layer", "layer_name", "tag", "cudagraph_mode", "parallel"):
            value = getattr(self, key)
            if value is not None:
                data[key] = value
        if ranks is not None:
            data["ranks"] = ranks.as_dict()
        return data


class ContextTracker:
    """Per-process step / layer bookkeeping. Thread-safe enough for vLLM (one forward thread per process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls = 0
        self._step = -1
        self._context: Any = None  # the last ForwardContext seen (kept alive so its id cannot be reused)
        self._layer_in_step = -1
        self._layer_names: tuple[str, ...] = ()
        self._layer_names_source: tuple[int, int] = (0, -1)
        self.ranks: Ranks | None = None
        self.on_ranks: Callable[[Ranks], None] | None = None
        """Called once, on the serving thread, when this process's ranks are first known."""
        self._parallel = LayerParallelCache()

    def _forward_context(self) -> Any:
        module = sys.modules.get("vllm.forward_context")
        if module is None:
            return None
        try:
            if not module.is_forward_context_available():
                return None
            return module.get_forward_context()
        except Exception:
            return None

    def _moe_layer_names(self, context: Any) -> tuple[str, ...]:
        names = getattr(context, "all_moe_layers", None)
        if names:
            return tuple(names)
        layers = getattr(context, "no_compile_layers", None)
        if not isinstance(layers, dict):
            return ()
        source = (id(layers), len(layers))
        if source != self._layer_names_source:
            self._layer_names = tuple(
                name for name, layer in layers.items() if "moe" in type(layer).__name__.lower()
            )
            self._layer_names_source = source
        return self._layer_names

    def where(self, *, parent: Where | None, is_parent: bool) -> Where:
        """The context of a call about to run. ``parent``: the enclosing recorded parent call's context."""
        with self._lock:
            call = self._calls
            self._calls += 1
            context = self._forward_context()
            if context is None:
                step = None
                layer = parent.layer if parent is not None else None
                return Where(
                    call,
                    step,
                    layer,
                    parent.layer_name if parent else None,
                    None,
                    None,
                    parent.parallel if parent else None,
                )
            if context is not self._context:
                self._context = context
                self._step += 1
                self._layer_in_step = -1
                if self.ranks is None:
                    self.ranks = _vllm_ranks()
                    if self.ranks is not None and self.on_ranks is not None:
                        try:
                            self.on_ranks(self.ranks)
                        except Exception:  # naming the file must never break a forward pass
                            logger.exception("moereplay: acting on this process's ranks failed")
            parallel = None
            if parent is not None:
                layer, layer_name, parallel = parent.layer, parent.layer_name, parent.parallel
            elif is_parent:
                self._layer_in_step += 1
                layer = self._layer_in_step
                names = self._moe_layer_names(context)
                layer_name = names[layer] if layer < len(names) else None
                if layer_name is not None:
                    parallel = self._layer_parallel(context, layer_name)
            else:
                layer, layer_name = None, None
            attn = getattr(context, "attn_metadata", None)
            tag = "dummy" if not attn else "run"
            mode = getattr(context, "cudagraph_runtime_mode", None)
            mode_name = getattr(mode, "name", None)
            return Where(call, self._step, layer, layer_name, tag, mode_name, parallel)

    def _layer_parallel(self, context: Any, layer_name: str) -> dict[str, Any] | None:
        layers = getattr(context, "no_compile_layers", None)
        if not isinstance(layers, dict):
            return None
        try:
            return self._parallel.of(layers.get(layer_name))
        except Exception:  # context is best effort: never raise into vLLM
            return None
