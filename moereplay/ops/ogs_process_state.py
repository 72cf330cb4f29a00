"""triton_kernels opt_flags: the process-wide state a ``matmul_ogs`` call runs under, and the flags it chose.

``matmul_ogs`` picks its tile sizes, split-K, persistence … by calling ``make_opt_flags`` — a global of the module
that defines it, imported from ``matmul_ogs_details/opt_flags.py`` — which honours two process-wide globals of that
module: ``_opt_flags_constraints`` (vLLM pins ``split_k=1`` on Hopper when it swizzles MXFP4 weights) and a manual
``_opt_flags`` override. A replay must run under the same constraints, so the recorder merges
:func:`moereplay.ops.matmul_ogs.process_state` of *that* module into the call's arguments (the pseudo-arguments
``block_m``, ``block_k``, ``split_k``, …) and, when an override is set, notes it in the call's context.

The flags actually chosen are read after the call at no extra cost: the wrapped function's own ``make_opt_flags``
global is replaced once, when the patch point is armed, by a pass-through that remembers its result in a
thread-local slot while a recorded call is in flight (one attribute check otherwise). Its module is located
through the running function's globals, never by name, because vLLM can hold two copies of triton_kernels (the
vendored ``vllm.third_party.triton_kernels`` aliased as ``triton_kernels``, and an installed one).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

from moereplay.ops.surface import ORIGINAL

MAKE_OPT_FLAGS = "make_opt_flags"
RECORDING_MARK = "__moereplay_opt_flags_recorder__"


def flags_as_dict(flags: Any) -> dict[str, Any] | None:
    """An ``OptFlags`` dataclass as ``{field: value}`` (scalars and small dicts; ``None`` when not one)."""
    if flags is None or not dataclasses.is_dataclass(flags) or isinstance(flags, type):
        return None
    out: dict[str, Any] = {}
    for field in dataclasses.fields(flags):
        value = getattr(flags, field.name, None)
        if value is None or isinstance(value, (bool, int, float, str)):
            out[field.name] = value
        elif isinstance(value, dict):
            out[field.name] = {
                str(key): item for key, item in value.items() if isinstance(item, (bool, int, float, str))
            }
        else:
            out[field.name] = repr(value)[:200]
    return out


class _Slot(threading.local):
    armed: bool = False
    flags: Any = None


class OptFlagsProbe:
    """Where one wrapped GEMM entry point's opt_flags live, and the flags its last recorded call chose.

    Built by :meth:`install` when the patch point is armed. Per recorded call: :meth:`state` (before the call:
    the pseudo-arguments), :meth:`override`, :meth:`start` … :meth:`chosen` (after the call).
    """

    def __init__(
        self,
        module: types.ModuleType | None,
        state_of: Callable[[Any], dict[str, Any]],
    ) -> None:
        self.module = module
        self._state_of = state_of
        self._slot = _Slot()

    @classmethod
    def install(
        cls, function: Callable[..., Any], state_of: Callable[[Any], dict[str, Any]]
    ) -> tuple[OptFlagsProbe, Callable[[], None] | None]:
        """A probe for ``function`` (the original ``matmul_ogs``), and the action that undoes its hook.

        The hook replaces ``make_opt_flags`` in ``function``'s globals; when that name is missing (an unknown
        triton_kernels) the probe still reports the constraints of the module it can find, and chooses nothing.
        """
        namespace: dict[str, Any] = getattr(function, "__globals__", {}) or {}
        current = namespace.get(MAKE_OPT_FLAGS)
        existing = getattr(current, RECORDING_MARK, None)
        if isinstance(existing, OptFlagsProbe):  # the same function wrapped at a second patch point
            return existing, None
        module = sys.modules.get(getattr(current, "__module__", "") or "") if current is not None else None
        probe = cls(module, state_of)
        if current is None or not callable(current):
            return probe, None
        slot = probe._slot
        original = current

        def make_opt_flags(*args: Any, **kwargs: Any) -> Any:
            flags = original(*args, **kwargs)
            if slot.armed and slot.flags is None:
                slot.flags = flags
            return flags

        make_opt_flags.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(make_opt_flags, RECORDING_MARK, probe)
        namespace[MAKE_OPT_FLAGS] = make_opt_flags

        def undo() -> None:
            if namespace.get(MAKE_OPT_FLAGS) is make_opt_flags:
                namespace[MAKE_OPT_FLAGS] = original

        return probe, undo

    def state(self) -> dict[str, Any]:
        """The process-state pseudo-arguments now (``{}`` when the opt_flags module was not found)."""
        if self.module is None:
            return {}
        return self._state_of(self.module)

    def override(self) -> dict[str, Any] | None:
        """A manual ``set_opt_flags`` override in force (it replaces the heuristics entirely), else ``None``."""
        if self.module is None:
            return None
        return flags_as_dict(getattr(self.module, "_opt_flags", None))

    def context(self) -> dict[str, Any]:
        """The call's context entries: the manual override in force, if any (``opt_flags_override``)."""
        override = self.override()
        return {} if override is None else {"opt_flags_override": override}

    def start(self) -> None:
        self._slot.flags = None
        self._slot.armed = True

    def chosen(self) -> dict[str, Any] | None:
        """The flags ``make_opt_flags`` returned during the call begun by :meth:`start` (``None``: not called)."""
        slot = self._slot
        flags, slot.flags, slot.armed = slot.flags, None, False
        return flags_as_dict(flags)

    def outputs(self) -> dict[str, Any]:
        """The call's extra outputs: the flags chosen (``opt_flags``), when ``make_opt_flags`` ran."""
        chosen = self.chosen()
        return {} if chosen is None else {"opt_flags": chosen}


def gemm_of(function: Callable[..., Any], name: str) -> Callable[..., Any] | None:
    """The triton_kernels GEMM ``function`` calls by the global ``name`` (``matmul_ogs``), unwrapped when a capture
    session wrapped it; ``None`` when its module has no such callable."""
    namespace: dict[str, Any] = getattr(function, "__globals__", {}) or {}
    gemm = namespace.get(name)
    gemm = getattr(gemm, ORIGINAL, gemm)
    return gemm if callable(gemm) else None


def opt_flags_module(gemm: Callable[..., Any]) -> types.ModuleType | None:
    """The module whose ``_opt_flags_constraints`` govern ``gemm`` (the one defining the ``make_opt_flags`` in its
    globals, under a recording hook or not)."""
    current = (getattr(gemm, "__globals__", {}) or {}).get(MAKE_OPT_FLAGS)
    current = getattr(current, "__wrapped__", current)
    if current is None:
        return None
    module = sys.modules.get(getattr(current, "__module__", "") or "")
    return module if module is not None and hasattr(module, "_opt_flags_constraints") else None


def constraints_in_force(module: types.ModuleType) -> dict[str, Any]:
    """The process-wide constraints now (plain values only: what a record can hold)."""
    constraints = getattr(module, "_opt_flags_constraints", {}) or {}
    return {
        str(key): value for key, value in constraints.items() if isinstance(value, (bool, int, float, str))
    }


class ConstraintsApplied:
    """A context manager: ``module``'s constraints replaced by ``constraints`` (and no manual override) while it
    is entered, restored after — how a re-run reproduces the process state a recorded call ran under."""

    def __init__(self, module: types.ModuleType, constraints: dict[str, Any]) -> None:
        self.module = module
        self.constraints = dict(constraints)
        self._saved: dict[str, Any] = {}
        self._saved_flags: Any = None

    def __enter__(self) -> ConstraintsApplied:
        module = self.module
        self._saved = getattr(module, "_opt_flags_constraints", {})
        self._saved_flags = getattr(module, "_opt_flags", None)
        # rebound, not mutated: triton_kernels' reset_opt_flags_constraints rebinds the global too
        setattr(module, "_opt_flags_constraints", dict(self.constraints))  # noqa: B010
        setattr(module, "_opt_flags", None)  # noqa: B010
        return self

    def __exit__(self, *exc_info: object) -> None:
        setattr(self.module, "_opt_flags_constraints", self._saved)  # noqa: B010
        setattr(self.module, "_opt_flags", self._saved_flags)  # noqa: B010


def gemm_state_context(state_module: Any) -> dict[str, Any]:
    """A layer call's context entries for the process state of the triton_kernels GEMMs it calls: the opt_flags
    constraints in force (``{}`` when none) and a manual override, when one is set."""
    context: dict[str, Any] = {"opt_flags_constraints": constraints_in_force(state_module)}
    override = flags_as_dict(getattr(state_module, "_opt_flags", None))
    if override is not None:
        context["opt_flags_override"] = override
    return context


# ---------------------------------------------------------------------------------------------------------------
# the family's process-state hooks (moereplay.ops.surface.ProcessStateHooks)
# ---------------------------------------------------------------------------------------------------------------


def install_probe(original: Callable[..., Any]) -> tuple[OptFlagsProbe, Callable[[], None] | None]:
    """A probe for a wrapped ``matmul_ogs`` (its constraints as the op's pseudo-arguments)."""
    from moereplay.ops.matmul_ogs import process_state

    return OptFlagsProbe.install(original, process_state)


class LayerState:
    """The opt_flags module governing a layer call's GEMMs: its context entries when the call is described."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module

    def context(self) -> dict[str, Any]:
        return gemm_state_context(self.module)


def layer_state(original: Callable[..., Any], via: str) -> LayerState | None:
    """The state of the GEMM ``original`` calls by the global ``via``; ``None`` when it cannot be found."""
    gemm = gemm_of(original, via)
    module = opt_flags_module(gemm) if gemm is not None else None
    return None if module is None else LayerState(module)


def replay_state(
    record: Any, function: Callable[..., Any], via: str
) -> tuple[ConstraintsApplied | None, str | None]:
    """The process state a layer call whose GEMMs are triton_kernels' must re-run under (the opt_flags constraints
    its record holds), and a note for the report. ``function``: the layer function as vLLM defined it."""
    gemm = gemm_of(function, via)
    module = opt_flags_module(gemm) if gemm is not None else None
    if module is None:
        return None, f"{via}'s opt_flags module was not found: re-run under its defaults"
    context = record.context if isinstance(record.context, Mapping) else {}
    recorded = context.get("opt_flags_constraints")
    if isinstance(recorded, Mapping):
        constraints = {str(key): value for key, value in recorded.items()}
        shown = ", ".join(f"{key}={value}" for key, value in sorted(constraints.items())) or "none"
        note = f"re-run under the recorded triton_kernels opt_flags constraints ({shown})"
        if context.get("opt_flags_override"):
            note += "; the recorded manual opt_flags override is not reapplied"
        return ConstraintsApplied(module, constraints), note
    here = constraints_in_force(module)
    shown = ", ".join(f"{key}={value}" for key, value in sorted(here.items())) or "none"
    return None, (
        "the record does not say which triton_kernels opt_flags constraints were in force (recorded before "
        f"moereplay kept them): re-run under this process's ({shown}); vLLM pins split_k=1 on Hopper when it "
        "loads MXFP4 weights, so a re-run under other constraints may differ in rounding"
    )
