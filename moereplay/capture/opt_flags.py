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
from collections.abc import Callable
from typing import Any

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

    def start(self) -> None:
        self._slot.flags = None
        self._slot.armed = True

    def chosen(self) -> dict[str, Any] | None:
        """The flags ``make_opt_flags`` returned during the call begun by :meth:`start` (``None``: not called)."""
        slot = self._slot
        flags, slot.flags, slot.armed = slot.flags, None, False
        return flags_as_dict(flags)
