"""Each kernel family's capture surface, declared by the family in ``moereplay/ops/`` and read by everyone else.

A family (Marlin, matmul_ogs, the Triton fused MoE …) declares one :class:`FamilySurface`: its kernel ops and the
modules that define them, its parent (layer) ops, and its :class:`CaptureTarget` s — the patch points per vLLM
release with their static, scratch and output arguments, codec modules, process state (opt_flags) and parent
roles. ``capture`` (what to wrap), ``layout`` and ``expand`` (which records are layer calls), ``ops`` (where an op
lives) and ``synth`` (which preset modules to load) read these declarations instead of naming families.

Torch-free on purpose: the vLLM plugin imports this in every process. Declarations live in
``moereplay/ops/<family>_surface.py`` modules listed in :data:`BUILTIN_SURFACES`, imported on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Role = Literal["kernel", "parent"]


@dataclass(frozen=True)
class CaptureTarget:
    """One attribute to wrap.

    ``attribute`` may be dotted (``"Class.method"``: the wrapper is set on the class). ``static`` names the
    arguments holding weights and scales: their tensors (nested ones included) are stored once per file, found
    again by identity. ``self_attributes``: for methods, attributes of ``self`` recorded as extra arguments
    (``self.<name>``). ``outputs``: argument names the call writes into, recorded after the call besides the
    return value.
    ``scratch``: arguments that are work buffers (their bytes before the call do not matter): the layer-scope
    flight recorder does not keep them. ``inputs_intact``: the call writes none of its arguments but its
    ``outputs`` and ``scratch`` (read from the vLLM source for the Marlin layer), so the layer-scope recorder may
    copy its inputs after the call, with its outputs, in one launch. ``opt_flags_via``: for a layer call whose
    GEMMs are triton_kernels' (``matmul_ogs``), the name of that GEMM in the function's module: the opt_flags
    constraints in force (process-wide; vLLM pins ``split_k=1`` on Hopper) are recorded in the call's context as
    ``opt_flags_constraints``, and ``moereplay expand`` re-runs the call under them.
    """

    op: str
    role: Role
    module: str
    attribute: str
    static: tuple[str, ...] = ()
    self_attributes: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    codec_modules: tuple[str, ...] = ()
    opt_flags: bool = False
    scratch: tuple[str, ...] = ()
    inputs_intact: bool = False
    opt_flags_via: str = ""

    @property
    def site(self) -> str:
        return f"{self.module}:{self.attribute}"


@dataclass(frozen=True)
class FamilySurface:
    """What one kernel family owns outside its OpSpec.

    ``kernel_ops``: op names its kernel records carry; ``op_modules``: op name → module that registers the OpSpec
    (imported on first ``get_op``); ``parent_ops``: op names of its layer records; ``targets``: every patch point;
    ``vllm_series``: (major, minor) release series whose patch points were read from the sources;
    ``preset_modules``: modules of ``moereplay.synth`` registering its presets, by their last name (so the
    declaration does not drag the synth presets into a repro bundle's import closure).
    """

    name: str
    kernel_ops: tuple[str, ...]
    op_modules: Mapping[str, str]
    parent_ops: tuple[str, ...] = ()
    targets: tuple[CaptureTarget, ...] = ()
    vllm_series: tuple[tuple[int, int], ...] = ()
    preset_modules: tuple[str, ...] = ()
    notes: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = [op for op in self.kernel_ops if op not in self.op_modules]
        if missing:
            raise ValueError(f"family {self.name}: kernel ops without a module: {missing}")
        stray = [t.site for t in self.targets if t.op not in (*self.kernel_ops, *self.parent_ops)]
        if stray:
            raise ValueError(f"family {self.name}: targets of undeclared ops: {stray}")


BUILTIN_SURFACES: tuple[str, ...] = ("moereplay.ops.fused_moe_triton_surface",)
"""Modules declaring the built-in families (each calls :func:`register_family` on import)."""

_FAMILIES: dict[str, FamilySurface] = {}


def register_family(surface: FamilySurface) -> FamilySurface:
    """Make ``surface`` known (re-registering the same name replaces it)."""
    _FAMILIES[surface.name] = surface
    return surface


def families() -> tuple[FamilySurface, ...]:
    """Every declared family, built-ins imported on first use."""
    for module in BUILTIN_SURFACES:
        importlib.import_module(module)
    return tuple(_FAMILIES[name] for name in sorted(_FAMILIES))


def family_targets() -> tuple[CaptureTarget, ...]:
    """Every family's capture targets."""
    return tuple(target for family in families() for target in family.targets)


def parent_ops() -> frozenset[str]:
    """Op names of every family's layer (parent) records."""
    return frozenset(op for family in families() for op in family.parent_ops)


def op_modules() -> dict[str, str]:
    """Kernel op name → module registering it, over every family."""
    return {op: module for family in families() for op, module in family.op_modules.items()}


def family_of(op: str) -> FamilySurface | None:
    """The family owning kernel or parent op ``op``."""
    for family in families():
        if op in family.kernel_ops or op in family.parent_ops:
            return family
    return None
