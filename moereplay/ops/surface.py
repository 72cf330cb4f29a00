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
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Role = Literal["kernel", "parent"]

ORIGINAL = "__moereplay_original__"
"""The attribute under which a capture wrapper keeps the function it wraps (read by families' process-state hooks
and by ``moereplay expand``, which need the function as vLLM defined it)."""


class LibraryValueError(Exception):
    """A family's ``to_library`` could not build a library object: ``name`` of what it built, the ``error``."""

    def __init__(self, name: str, error: BaseException) -> None:
        super().__init__(f"cannot build {name}: {error}")
        self.name = name
        self.error = error


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
    copy its inputs after the call, with its outputs, in one launch.

    Process state (e.g. triton_kernels' opt_flags constraints): ``process_state`` names the module of the family's
    hooks (imported when the target is armed; see :class:`ProcessStateHooks`). Without ``process_state_via`` the
    call itself is probed (state as pseudo-arguments, override in the context, chosen flags as an output); with it,
    the call is a layer call whose GEMMs, reached through that global of its module, run under the state (recorded
    in the context, reapplied by ``moereplay expand``).

    ``layer_flight_only``: a layer call wrapped only while the layer-scope flight recorder is armed — one level
    above a parent every other capture records, because its arguments hold far fewer dynamic tensors (gpt-oss's
    ``triton_kernel_moe_forward``: hidden states and router logits, where the parent below it takes triton_kernels'
    routing objects: 16 tensors more for the serving thread to walk, measure and copy per call). ``moereplay
    expand`` re-runs it unwrapped, so its re-run is recorded as the parent it calls, with that parent's kernel calls.
    ``in_place_of``: that parent's op; ``MOEREPLAY_OPS`` / ``MOEREPLAY_OPS_EXCLUDE`` must select both for the call
    above it to be wrapped (where they leave it out, the parent is the outermost call recorded, or nothing is).
    """

    op: str
    role: Role
    module: str
    attribute: str
    static: tuple[str, ...] = ()
    self_attributes: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    codec_modules: tuple[str, ...] = ()
    scratch: tuple[str, ...] = ()
    inputs_intact: bool = False
    process_state: str = ""
    process_state_via: str = ""
    layer_flight_only: bool = False
    in_place_of: str = ""

    @property
    def site(self) -> str:
        return f"{self.module}:{self.attribute}"

    @property
    def probes_state(self) -> bool:
        """Whether the call itself is probed for process state (see the class docstring)."""
        return bool(self.process_state) and not self.process_state_via


class ProcessStateHooks(Protocol):
    """What a family's ``process_state`` module provides (functions of the module).

    ``install_probe(original)`` → ``(probe, undo or None)``; the probe has ``state()`` (pseudo-arguments before the
    call), ``context()`` (context entries), ``start()`` and ``outputs()`` (after the call: extra outputs).
    ``layer_state(original, via)`` → an object whose ``context()`` gives a layer call's context entries, or None.
    ``replay_state(record, function, via)`` → ``(context manager or None, note or None)``: what a re-run of the
    layer call enters, and what to say about it.
    """

    def install_probe(self, original: Callable[..., Any]) -> tuple[Any, Callable[[], None] | None]: ...

    def layer_state(self, original: Callable[..., Any], via: str) -> Any: ...

    def replay_state(
        self, record: Any, function: Callable[..., Any], via: str
    ) -> tuple[AbstractContextManager[Any] | None, str | None]: ...


@dataclass(frozen=True)
class FamilySurface:
    """What one kernel family owns outside its OpSpec.

    ``kernel_ops``: op names its kernel records carry; ``op_modules``: op name → module that registers the OpSpec
    (imported on first ``get_op``); ``parent_ops``: op names of its layer records; ``targets``: every patch point;
    ``vllm_series``: (major, minor) release series whose patch points were read from the sources;
    ``preset_modules``: modules of ``moereplay.synth`` registering its presets, by their last name (so the
    declaration does not drag the synth presets into a repro bundle's import closure); ``record_only_ops``: kernel
    ops it captures but declares no OpSpec for (not replayable yet).

    Layer pairing, for families whose layer is two calls of one kernel op (gemm1 = w13, gemm2 = w2) that
    ``moereplay.layout`` pairs up when no parent was recorded: ``first_gemm(args)`` tells gemm1 from gemm2 by the
    recorded arguments, ``pair_fits(gemm1 args, gemm2 args)`` whether two calls of the layer belong together.
    A family without ``first_gemm`` has no layer the probe understands.

    Re-running a layer call (``moereplay expand``): ``library_packages``, top-level packages besides vLLM whose
    classes may be imported to rebuild a recorded argument; ``value_modules``, modules of moereplay's plain values
    for the family's library objects: a loaded value whose type one defines is turned back into the library's object
    by that module's ``to_library(value, backend, cache)`` (``cache``: a dict the module may keep per re-run).

    Kernel packs (``moereplay.pack``): ``vendored``, top-level packages vLLM's wheel carries inside its own tree,
    name → directory in the wheel (a pack links each under its name, so both import routes reach one copy);
    ``smoke``, ``"module:function"`` of the family's kernel check on a loaded pack (:class:`SmokeCheck`).

    The w13 layout probe (``moereplay.layout``): ``layer_probe``, the module of the family's layer hypotheses
    (see :mod:`moereplay.ops.layer_probe`); a family without one is probed only if it pairs no layers.

    ``mutable_names``: kernel op → the names of the arguments its OpSpec declares mutable (what ``--flip``,
    ``--set`` and ``--sweep`` may change), so that ``moereplay run`` rejects a mistyped name before torch is
    imported; a unit test holds them equal to the OpSpecs'.
    """

    name: str
    kernel_ops: tuple[str, ...]
    op_modules: Mapping[str, str]
    parent_ops: tuple[str, ...] = ()
    targets: tuple[CaptureTarget, ...] = ()
    vllm_series: tuple[tuple[int, int], ...] = ()
    preset_modules: tuple[str, ...] = ()
    notes: Mapping[str, str] = field(default_factory=dict)
    record_only_ops: tuple[str, ...] = ()
    first_gemm: Callable[[Mapping[str, Any]], bool] | None = None
    pair_fits: Callable[[Mapping[str, Any], Mapping[str, Any]], bool] | None = None
    library_packages: tuple[str, ...] = ()
    value_modules: tuple[str, ...] = ()
    vendored: Mapping[str, str] = field(default_factory=dict)
    smoke: str = ""
    layer_probe: str = ""
    mutable_names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = [op for op in self.kernel_ops if op not in self.op_modules]
        if missing:
            raise ValueError(f"family {self.name}: kernel ops without a module: {missing}")
        declared = (*self.kernel_ops, *self.parent_ops, *self.record_only_ops)
        stray = [t.site for t in self.targets if t.op not in declared]
        if stray:
            raise ValueError(f"family {self.name}: targets of undeclared ops: {stray}")
        unknown = [op for op in self.mutable_names if op not in self.kernel_ops]
        if unknown:
            raise ValueError(f"family {self.name}: mutable names of ops it does not declare: {unknown}")


BUILTIN_SURFACES: tuple[str, ...] = (
    "moereplay.ops.marlin_surface",
    "moereplay.ops.matmul_ogs_surface",
    "moereplay.ops.fused_moe_triton_surface",
)
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


def mutable_names(op: str) -> tuple[str, ...] | None:
    """The mutable argument names a family declares for kernel op ``op`` (None: not declared)."""
    for family in families():
        if op in family.mutable_names:
            return family.mutable_names[op]
    return None


def family_named(name: str) -> FamilySurface | None:
    """The family declared under ``name``."""
    return next((family for family in families() if family.name == name), None)


def layer_family(op: str) -> FamilySurface | None:
    """The family whose layers pair two calls of kernel op ``op`` (see :class:`FamilySurface`), if any."""
    for family in families():
        if op in family.kernel_ops and family.first_gemm is not None:
            return family
    return None


def vllm_series() -> frozenset[tuple[int, int]]:
    """Every (major, minor) vLLM release series some family's patch points were read from."""
    return frozenset(series for family in families() for series in family.vllm_series)


def library_packages() -> tuple[str, ...]:
    """Every family's ``library_packages``, in family order, without repeats."""
    return tuple(dict.fromkeys(name for family in families() for name in family.library_packages))


def value_modules() -> frozenset[str]:
    """Every family's ``value_modules``."""
    return frozenset(module for family in families() for module in family.value_modules)


def vendored_packages() -> dict[str, str]:
    """Every family's ``vendored`` packages: top-level name → directory in vLLM's wheel tree."""
    return {name: where for family in families() for name, where in family.vendored.items()}


def smoke_checks() -> tuple[tuple[str, str], ...]:
    """(family name, ``"module:function"``) of every family declaring a kernel-pack smoke check, in family order."""
    return tuple((family.name, family.smoke) for family in families() if family.smoke)


@dataclass(frozen=True)
class SmokeCheck:
    """What a family's smoke check on a loaded kernel pack found: ``passed``, and ``text``, its part of the one
    line ``moereplay kernels check`` prints."""

    passed: bool
    text: str
