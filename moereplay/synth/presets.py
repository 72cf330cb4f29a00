"""Presets: named recipes for whole calls, with settings a user may override (``--set name=value``).

A preset declares its :class:`Setting` s (name, default, help) and a build function that draws the call's tensors
(:class:`~moereplay.synth.drawing.Drawer`), runs the kernel or the reference (a
:class:`~moereplay.synth.runners.CallRunner`) and returns the calls to record. The presets themselves live in
:mod:`moereplay.synth.marlin_presets` and :mod:`moereplay.synth.ogs_presets` …, which the kernel families declare
(``FamilySurface.preset_modules``); :func:`get_preset` finds them by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moereplay.errors import SettingsError
from moereplay.synth.drawing import Drawer, SynthCall
from moereplay.synth.runners import CallRunner

SettingValue = int | float | str


@dataclass(frozen=True)
class Setting:
    """One overridable dimension or option of a preset; ``choices`` restricts text values."""

    name: str
    default: SettingValue
    help: str
    choices: tuple[str, ...] = ()

    def parse(self, text: str) -> SettingValue:
        kind = type(self.default)
        try:
            value: SettingValue = kind(text) if kind is not int else int(text, 0)
        except ValueError as error:
            raise SettingsError(f"--set {self.name}={text}: expected {kind.__name__}") from error
        if self.choices and value not in self.choices:
            raise SettingsError(f"--set {self.name}={text}: expected one of {', '.join(self.choices)}")
        return value


@dataclass(frozen=True)
class BuildContext:
    """What a preset's build function gets: the resolved settings, whether expert biases are on, where to draw and
    who computes outputs."""

    values: Mapping[str, SettingValue]
    bias: bool
    drawer: Drawer
    runner: CallRunner

    def integer(self, name: str) -> int:
        return int(self.values[name])

    def text(self, name: str) -> str:
        return str(self.values[name])


@dataclass(frozen=True)
class Preset:
    """A named synthesizable call (or fused layer)."""

    name: str
    summary: str
    op: str
    settings: tuple[Setting, ...]
    default_bias: bool
    build: Callable[[BuildContext], list[SynthCall]]

    def resolve(self, overrides: Sequence[str] = ()) -> dict[str, SettingValue]:
        """Defaults with ``name=value`` overrides applied (unknown names or bad values: one-line SettingsError)."""
        known = {setting.name: setting for setting in self.settings}
        values: dict[str, SettingValue] = {name: setting.default for name, setting in known.items()}
        for item in overrides:
            name, sep, text = item.partition("=")
            name = name.strip()
            if not sep or not name:
                raise SettingsError(f"--set {item!r}: expected name=value")
            setting = known.get(name)
            if setting is None:
                raise SettingsError(
                    f"--set {name}: preset {self.name} has no such setting (settings: {', '.join(known)})"
                )
            values[name] = setting.parse(text.strip())
        return values


_PRESETS: dict[str, Preset] = {}


def register_preset(preset: Preset) -> Preset:
    _PRESETS[preset.name] = preset
    return preset


def _load() -> None:
    import importlib

    from moereplay.ops.surface import families

    for family in families():
        for module in family.preset_modules:
            importlib.import_module(f"moereplay.synth.{module}")


def get_preset(name: str) -> Preset:
    _load()
    preset = _PRESETS.get(name)
    if preset is None:
        raise SettingsError(f"no synth preset {name!r} (presets: {', '.join(sorted(_PRESETS))})")
    return preset


def all_presets() -> tuple[Preset, ...]:
    _load()
    return tuple(_PRESETS[name] for name in sorted(_PRESETS))


COMMON: tuple[Setting, ...] = (Setting("seed", 0, "seed of every draw (weights, activations, routing)"),)


def settings(*items: Setting) -> tuple[Setting, ...]:
    return (*items, *COMMON)


def seeds(seed: int) -> Callable[[int], int]:
    """Distinct, stable seeds for the draws of one call: ``seeds(seed)(k)`` for the k-th draw."""
    return lambda k: seed * 64 + k


def values_summary(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{name}={value}" for name, value in values.items())
