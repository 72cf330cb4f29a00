"""``synthesize()``: build a preset's calls, run them on a backend (or the reference) and write a capture file.

Tensors a preset drew from a generator are recorded either as their bytes (``store="bytes"``) or as their recipe
(``store="recipe"``: a few hundred bytes each, expanded bit-identically when the capture is loaded — see
:mod:`moereplay.synth.recipe`). Everything else (routing arrays, scratch buffers, outputs, activations computed
between two GEMMs) is recorded as bytes. The header's ``synth`` entry says what made the file: preset, settings,
bias, store, backend and where the recorded outputs come from (a kernel, or the reference).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from moereplay.errors import SettingsError
from moereplay.synth.drawing import Drawer, SynthCall, map_tensors
from moereplay.synth.presets import BuildContext, get_preset
from moereplay.synth.recipe import TensorRecipe
from moereplay.synth.runners import CallRunner, runner_for

StoreMode = Literal["bytes", "recipe"]
STORE_MODES: tuple[StoreMode, ...] = ("bytes", "recipe")


@dataclass(frozen=True)
class SynthResult:
    """What :func:`synthesize` wrote. ``recipes``: tensors recorded as recipes; ``recipe_bytes``: the bytes those
    stand for (what ``store="bytes"`` would have stored for them, before compression)."""

    path: Path
    preset: str
    settings: dict[str, Any]
    bias: bool
    store: StoreMode
    output_source: str
    calls: tuple[str, ...]
    file_bytes: int
    recipes: int
    recipe_bytes: int


def recorded_value(value: Any, drawer: Drawer, store: StoreMode, counter: list[int] | None = None) -> Any:
    """``value`` as it is written: with ``store="recipe"``, every drawn tensor replaced by its recipe."""
    if store == "bytes":
        return value

    def swap(tensor: torch.Tensor) -> Any:
        recipe = drawer.recipe_of(tensor)
        if recipe is None:
            return tensor
        if counter is not None:
            counter[0] += 1
            counter[1] += recipe.nbytes
        return dataclasses.replace(recipe, device=str(tensor.device))

    return map_tensors(value, swap)


def write_calls(
    path: Path,
    calls: Sequence[SynthCall],
    drawer: Drawer,
    store: StoreMode,
    header: dict[str, Any],
) -> tuple[int, int]:
    """Write ``calls`` (parents first, as listed); returns (recipes written, bytes they stand for)."""
    from moereplay.format import CaptureWriter
    from moereplay.synth.recipe import register

    register()
    counter = [0, 0]
    indices: list[int] = []
    with CaptureWriter(path, header=header) as writer:
        for call in calls:
            parent = None if call.parent is None else indices[call.parent]
            args = {name: recorded_value(value, drawer, store, counter) for name, value in call.args.items()}
            index = writer.begin_call(
                call.op, args, site=call.site, context=call.context, parent=parent, static=call.static
            )
            indices.append(index)
            writer.complete_call(index, call.outputs)
    return counter[0], counter[1]


def synthesize(
    preset: str,
    output: str | Path,
    *,
    overrides: Sequence[str] = (),
    bias: bool | None = None,
    store: StoreMode = "recipe",
    backend: str = "reference",
    device: str | torch.device | None = None,
    command: str | None = None,
    runner: CallRunner | None = None,
) -> SynthResult:
    """Build ``preset`` (``overrides``: ``name=value`` settings; ``bias``: expert biases, default the preset's),
    compute its outputs with ``backend`` (``reference``, ``vllm`` or ``pack:DIR``; or a given ``runner``) and write
    the capture to ``output``. ``command``: the command line to record in the header."""
    if store not in STORE_MODES:
        raise SettingsError(f"--store {store!r}: expected one of {', '.join(STORE_MODES)}")
    chosen = get_preset(preset)
    values = chosen.resolve(overrides)
    with_bias = chosen.default_bias if bias is None else bias
    runner = runner if runner is not None else runner_for(backend, device)
    drawer = Drawer()
    calls = chosen.build(BuildContext(values, with_bias, drawer, runner))
    header = {
        "purpose": f"moereplay synth {chosen.name}",
        "synth": {
            "preset": chosen.name,
            "summary": chosen.summary,
            "settings": dict(values),
            "bias": with_bias,
            "store": store,
            "backend": _runner_name(runner, backend),
            "output_source": runner.output_source,
            "command": command,
        },
    }
    path = Path(output)
    recipes, recipe_bytes = write_calls(path, calls, drawer, store, header)
    return SynthResult(
        path=path,
        preset=chosen.name,
        settings=dict(values),
        bias=with_bias,
        store=store,
        output_source=runner.output_source,
        calls=tuple(call.op for call in calls),
        file_bytes=path.stat().st_size,
        recipes=recipes,
        recipe_bytes=recipe_bytes,
    )


def _runner_name(runner: CallRunner, backend: str) -> str:
    """The backend spec the runner ran (a given runner may differ from ``backend``)."""
    spec = getattr(runner, "spec", None)
    return str(
        getattr(spec, "text", "reference" if runner.output_source.startswith("reference") else backend)
    )


def recipe_count(value: Any) -> int:
    """Recipes inside a recorded value (for tests and summaries)."""
    if isinstance(value, TensorRecipe):
        return 1
    if isinstance(value, dict):
        return sum(recipe_count(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(recipe_count(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(recipe_count(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0
