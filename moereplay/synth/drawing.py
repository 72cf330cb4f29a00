"""What a synthesized call is made of: tensors drawn from recipes (remembered so they can be recorded as recipes),
and the calls themselves, with their outputs.

:class:`Drawer` draws tensors through the recipe generators and remembers each one's :class:`TensorRecipe` by
identity; :func:`map_tensors` rebuilds a value (dicts, lists, tuples, frozen plain specs) with every tensor passed
through a function, preserving aliasing — used to move a call to the device and to swap recipe-backed tensors for
their recipes when writing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from moereplay.synth.recipe import TensorRecipe, generate, recipe_for


class Drawer:
    """Draws tensors from generators; ``recipes`` maps ``id(tensor)`` → its recipe (tensors are kept alive here)."""

    def __init__(self) -> None:
        self.recipes: dict[int, TensorRecipe] = {}
        self._alive: list[torch.Tensor] = []

    def draw(self, generator: str, params: Mapping[str, Any], part: str = "") -> torch.Tensor:
        """A fresh copy of ``generator(params)[part]`` (same strides), remembered with its recipe."""
        source = generate(generator, params)[part]
        tensor = torch.empty_strided(tuple(source.shape), tuple(source.stride()), dtype=source.dtype)
        tensor.copy_(source)
        self.remember(tensor, recipe_for(tensor, generator, params, part))
        return tensor

    def parts(self, generator: str, params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Every output of one generator call, each drawn as by :meth:`draw`."""
        return {part: self.draw(generator, params, part) for part in generate(generator, params)}

    def remember(self, tensor: torch.Tensor, recipe: TensorRecipe) -> None:
        self.recipes[id(tensor)] = recipe
        self._alive.append(tensor)

    def recipe_of(self, tensor: torch.Tensor) -> TensorRecipe | None:
        return self.recipes.get(id(tensor))


def map_tensors(
    value: Any, function: Callable[[torch.Tensor], Any], memo: dict[int, Any] | None = None
) -> Any:
    """``value`` rebuilt with ``function(t)`` in place of every tensor ``t`` (one call per distinct tensor)."""
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        key = id(value)
        if key not in memo:
            memo[key] = function(value)
        return memo[key]
    if isinstance(value, dict):
        return {key: map_tensors(item, function, memo) for key, item in value.items()}
    if isinstance(value, list):
        return [map_tensors(item, function, memo) for item in value]
    if isinstance(value, tuple):
        return tuple(map_tensors(item, function, memo) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: map_tensors(getattr(value, f.name), function, memo) for f in dataclasses.fields(value)
        }
        return dataclasses.replace(value, **changes)
    return value


def to_device(value: Any, device: torch.device, drawer: Drawer) -> Any:
    """``value`` with every tensor on ``device``; recipes follow their tensors."""

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == device:
            return tensor
        moved = torch.empty_strided(
            tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device=device
        )
        moved.copy_(tensor)
        recipe = drawer.recipe_of(tensor)
        if recipe is not None:
            drawer.remember(moved, dataclasses.replace(recipe, device=str(device)))
        return moved

    return map_tensors(value, move)


@dataclass(frozen=True)
class SynthCall:
    """One call to record: ``args`` (tensors, scalars, plain specs), its ``outputs`` (name → value), where it was
    made (``site``), small ``context`` metadata, the index of its ``parent`` among the calls recorded before it,
    and the names of its weight arguments (``static``)."""

    op: str
    args: dict[str, Any]
    outputs: dict[str, Any]
    site: str
    context: dict[str, Any] = field(default_factory=dict)
    parent: int | None = None
    static: tuple[str, ...] = ()
