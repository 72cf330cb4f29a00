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
- ranks: TP / EP / DP / PP rank and world rank from ``vllm.distributed.parallel_state`` once it is initialised
  (looked up again only when a new step starts, until found).
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Ranks:
    world: int | None = None
    tensor_parallel: int | None = None
    expert_parallel: int | None = None
    data_parallel: int | None = None
    pipeline_parallel: int | None = None

    def as_dict(self) -> dict[str, int]:
        return {
            key: value
            for key, value in (
                ("world", self.world),
                ("tp", self.tensor_parallel),
                ("ep", self.expert_parallel),
                ("dp", self.data_parallel),
                ("pp", self.pipeline_parallel),
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


def _vllm_ranks() -> Ranks | None:
    state = sys.modules.get("vllm.distributed.parallel_state")
    if state is None:
        return None
    try:
        if not state.model_parallel_is_initialized():
            return None
        ranks: dict[str, int | None] = {}
        for key, getter in (
            ("tensor_parallel", "get_tensor_model_parallel_rank"),
            ("pipeline_parallel", "get_pp_group"),
            ("data_parallel", "get_dp_group"),
            ("expert_parallel", "get_ep_group"),
        ):
            function = getattr(state, getter, None)
            if function is None:
                continue
            value = function()
            ranks[key] = int(value if isinstance(value, int) else value.rank_in_group)
        world = getattr(state, "get_world_group", None)
        ranks["world"] = int(world().rank) if world is not None else None
        return Ranks(**ranks)
    except Exception:
        return None


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

    def as_dict(self, ranks: Ranks | None) -> dict[str, Any]:
        data: dict[str, Any] = {"call": self.call}
        for key in ("step", "layer", "layer_name", "tag", "cudagraph_mode"):
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
                return Where(call, step, layer, parent.layer_name if parent else None, None, None)
            if context is not self._context:
                self._context = context
                self._step += 1
                self._layer_in_step = -1
                if self.ranks is None:
                    self.ranks = _vllm_ranks()
            if parent is not None:
                layer, layer_name = parent.layer, parent.layer_name
            elif is_parent:
                self._layer_in_step += 1
                layer = self._layer_in_step
                names = self._moe_layer_names(context)
                layer_name = names[layer] if layer < len(names) else None
            else:
                layer, layer_name = None, None
            attn = getattr(context, "attn_metadata", None)
            tag = "dummy" if not attn else "run"
            mode = getattr(context, "cudagraph_runtime_mode", None)
            mode_name = getattr(mode, "name", None)
            return Where(call, self._step, layer, layer_name, tag, mode_name)
