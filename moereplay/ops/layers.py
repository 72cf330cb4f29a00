"""Layer references: what one MoE *layer* call (a parent call such as vLLM's ``fused_marlin_moe``) computes, in
fp64, from its recorded arguments — the family-declared half of the cross-rank check (:mod:`moereplay.replay.ranks`).

A kernel family that records a layer call declares, in its own module, a :class:`LayerReference`:

- ``name``: the parent op as recorded (``fused_marlin_moe``);
- ``replicated``: the arguments every TP / EP rank receives identically (vLLM replicates the hidden states and the
  router's choice across a TP group and, without all-to-all kernels, across the EP group) — the check compares them
  across ranks byte for byte;
- ``expert_map``: the argument holding vLLM's global → local expert map under EP (None where it is not an argument);
- ``reference(args, context)``: the layer's output as this rank computes it (its weight slice, its experts) in
  float64, shaped like the recorded output. Summed over a TP or EP group this is the single-GPU layer output.

``get_layer_reference(op)`` imports the built-in module declaring ``op`` on first use (this registry is separate
from the kernel op registry in :mod:`moereplay.ops`: a layer reference is not a replayable op).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from moereplay.errors import UnknownOpError

if TYPE_CHECKING:
    import torch


class LayerReference(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def replicated(self) -> tuple[str, ...]: ...

    @property
    def expert_map(self) -> str | None: ...

    @property
    def roundings(self) -> int:
        """How many buffers between the layer's input and its output the parent stores in the activation dtype
        (its reference rounds none of them): the tolerance is the output dtype's, chained that many times."""
        ...

    def reference(self, args: Mapping[str, Any], context: Mapping[Any, Any]) -> torch.Tensor: ...


_BUILTIN: dict[str, str] = {"fused_marlin_moe": "moereplay.ops.marlin_layer"}
_REGISTRY: dict[str, LayerReference] = {}


def register_layer_reference(layer: LayerReference, *, replace: bool = False) -> LayerReference:
    if layer.name in _REGISTRY and _REGISTRY[layer.name] is not layer and not replace:
        raise ValueError(f"a layer reference named {layer.name!r} is already registered")
    _REGISTRY[layer.name] = layer
    return layer


def get_layer_reference(name: str) -> LayerReference:
    """The layer reference of parent op ``name``; ``UnknownOpError`` (one line) when no family declares one."""
    found = _REGISTRY.get(name)
    if found is not None:
        return found
    module = _BUILTIN.get(name)
    if module is not None:
        importlib.import_module(module)
        found = _REGISTRY.get(name)
        if found is not None:
            return found
    known = ", ".join(sorted(set(_REGISTRY) | set(_BUILTIN)))
    raise UnknownOpError(f"no layer reference for {name!r} (layer calls with one: {known})")


def has_layer_reference(name: str) -> bool:
    return name in _REGISTRY or name in _BUILTIN
