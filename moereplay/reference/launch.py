"""Launching the references' Triton kernels with less host work a launch.

``kernel[grid](*args, **meta)`` binds and specializes every argument, builds a cache key with the options' text,
reads Triton's knobs, checks the kernel's globals and builds launch metadata for hooks that are usually absent,
before the compiled kernel's own launcher runs. :func:`launch` keeps, per kernel, the compiled kernel Triton
returned for each *launch class* — every property Triton's specialization reads from the arguments, or more: each
tensor's dtype and whether its address is 16-byte aligned; each integer's width class, whether it is 1 and whether it
divides by 16; bools, floats and None by kind; the keyword arguments (constexprs, ``num_warps``) by type and value;
Triton's debug and instrumentation switches; the values of the globals the kernel read when compiled; the device —
and launches a kernel of a class seen before straight through the compiled kernel's launcher. A finer key than
Triton's only compiles nothing new: the first launch of each class goes through ``kernel[grid]`` (which compiles or
finds the kernel), and so does every launch while a launch hook or a pre-run hook is installed (a profiler), without
CUDA, under Triton's interpreter, with a positional argument past the first constexpr or of another kind, with a
keyword argument that is not a scalar, or with ``MOEREPLAY_DIRECT_LAUNCH=0``. A Triton whose compiled kernels lack
the launcher this uses (another release) turns the direct path off for the process, said once as a warning.

Measured on an H100 (``reference_bench.py --launch-paths``, the Marlin reference's five launches a call): 0–7 % of
a call's time saved; the compiled kernel's own launcher (argument parsing, a pointer query per tensor) is most of a
launch's cost and stays. The capture side's ring kernel has its own purpose-built launcher
(:func:`moereplay.capture.ring_kernel.compile_launcher`: one compiled variant, integers always 64-bit).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

SWITCH_VARIABLE = "MOEREPLAY_DIRECT_LAUNCH"
"""``0`` launches every kernel through ``kernel[grid]`` (Triton's own path)."""

_COMPILED: dict[tuple[object, ...], tuple[Any, tuple[object, ...]]] = {}
"""Compiled kernels (and the values of the parameters after the positional ones) by (kernel, device, keyword
arguments, argument classes, globals' values)."""

_STATE: dict[str, Any] = {}
"""``direct``: the switch as read (or set); ``off``: True once the direct path failed in this process; ``knobs``:
Triton's runtime knobs (its launch hooks); ``all_knobs``: Triton's knobs module; ``jit``: its JITFunction class."""

_INT32 = (-(1 << 31), 1 << 31)
_UINT64_FROM = 1 << 63


def enabled() -> bool:
    """Whether launches may bypass ``kernel[grid]`` here: ``MOEREPLAY_DIRECT_LAUNCH`` (read once) not ``0``, a CUDA
    device, no failure so far (:func:`set_direct` overrides the variable)."""
    direct = _STATE.get("direct")
    if direct is None:
        direct = os.environ.get(SWITCH_VARIABLE, "1") != "0" and torch.cuda.is_available()
        _STATE["direct"] = direct
    return bool(direct) and not _STATE.get("off", False)


def set_direct(direct: bool | None) -> None:
    """Launch directly (True), always through ``kernel[grid]`` (False) or as the environment says (None); for
    benchmarks and tests that compare the two paths in one process."""
    if direct is None:
        _STATE.pop("direct", None)
    else:
        _STATE["direct"] = direct


def argument_class(value: object) -> tuple[object, ...] | None:
    """What a launch's specialization may read of one positional argument (this module's key), or None for a kind
    this module does not launch directly."""
    kind = type(value)
    if kind is torch.Tensor:
        assert isinstance(value, torch.Tensor)
        return (value.dtype, value.data_ptr() & 15 == 0)
    if kind is int:
        assert isinstance(value, int)
        return (int, _int_class(value))
    if kind is bool:
        return (bool, value)
    if kind is float:
        return (float,)
    if value is None:
        return (None,)
    return None


def _int_class(value: int) -> int:
    """An integer's width class (int32, int64, uint64) and whether it is 1 or divides by 16, as one small int."""
    width = 0 if _INT32[0] <= value < _INT32[1] else (2 if value >= _UINT64_FROM else 1)
    return width * 4 + (value == 1) * 2 + (value & 15 == 0)


def launch(kernel: Any, grid: tuple[int, ...], *args: object, **meta: object) -> None:
    """``kernel[grid](*args, **meta)`` on the current device's current stream; ``meta`` holds the constexprs and
    launch options by keyword, ``args`` the rest in the kernel's order (see the module's text)."""
    if not enabled() or type(kernel) is not _jit_function():
        # Triton's interpreter (its kernels are another class) and machines without CUDA take Triton's path
        kernel[grid](*args, **meta)
        return
    device = torch.cuda.current_device()
    key = _key(kernel, device, args, meta)
    if key is None or _hooked() or getattr(kernel, "pre_run_hooks", None):
        kernel[grid](*args, **meta)
        return
    known = _COMPILED.get(key)
    if known is None:
        compiled = kernel[grid](*args, **meta)
        # keyed again: a kernel's first compile is what lists the globals it reads
        key = _key(kernel, device, args, meta)
        if key is not None and _launchable(compiled):
            _COMPILED[key] = (compiled, _trailing(kernel, len(args), meta))
        return
    compiled, trailing = known
    grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
    try:
        compiled.run(
            grid_x,
            grid_y,
            grid_z,
            _raw_stream(device),
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *args,
            *trailing,
        )
    except (AttributeError, TypeError, SystemError) as error:
        # the launcher did not take the call (another Triton's interface): nothing ran; Triton's path from now on
        _STATE["off"] = True
        _COMPILED.clear()
        warnings.warn(
            f"moereplay: direct Triton launches are off ({type(error).__name__}: {error}"[:300] + ")",
            RuntimeWarning,
            stacklevel=2,
        )
        kernel[grid](*args, **meta)


def _jit_function() -> Any:
    """Triton's compiled-kernel function class (the class of ``@triton.jit`` kernels outside its interpreter; None
    without Triton)."""
    if "jit" not in _STATE:
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:  # no Triton: no kernel of that class, nothing launches directly
            _STATE["jit"] = None
        else:
            _STATE["jit"] = JITFunction
    return _STATE["jit"]


def _key(
    kernel: Any, device: int, args: tuple[object, ...], meta: Mapping[str, object]
) -> tuple[object, ...] | None:
    """The launch class of ``kernel`` with these arguments (see the module's text), or None where one argument is
    of a kind this module does not classify: a positional argument past the first constexpr (constexprs go by
    keyword), a keyword argument that is not a bool, int, float, str or None."""
    if len(args) > _first_constexpr(kernel):
        return None
    classes: list[object] = []
    append = classes.append
    tensor = torch.Tensor
    for value in args:
        kind = type(value)
        if kind is tensor:
            append(value.dtype)  # type: ignore[attr-defined]
            append(value.data_ptr() & 15 == 0)  # type: ignore[attr-defined]
        elif kind is int:
            append(_int_class(value))  # type: ignore[arg-type]
        else:
            cls = argument_class(value)
            if cls is None:
                return None
            append(cls)
    items: list[object] = []
    for name, value in meta.items():
        kind = type(value)
        if kind not in _SCALARS:
            return None
        # by type and value: Triton compiles True, 1 and 1.0 apart, which compare equal
        items.append((name, kind, value))
    return (kernel, device, tuple(items), tuple(classes), _globals(kernel), _options(kernel))


_SCALARS = frozenset({bool, int, float, str, type(None)})

_FIRST_CONSTEXPR: dict[Any, int] = {}
"""Per kernel, the position of its first constexpr parameter (its parameter count when it has none)."""


def _first_constexpr(kernel: Any) -> int:
    first = _FIRST_CONSTEXPR.get(kernel)
    if first is None:
        first = _FIRST_CONSTEXPR[kernel] = min(kernel.constexprs, default=len(kernel.params))
    return first


def _options(kernel: Any) -> tuple[object, ...]:
    """What Triton's launch path reads besides the arguments into a kernel's compile options: the kernel's and the
    runtime's debug switches and the instrumentation mode (a change compiles anew on Triton's path; here it makes
    another key)."""
    settings: Any = _STATE.get("all_knobs")
    if settings is None:
        from triton import knobs

        settings = _STATE["all_knobs"] = knobs
    return (kernel.debug, settings.runtime.debug, settings.compilation.instrumentation_mode)


def _globals(kernel: Any) -> tuple[object, ...]:
    """The current values of the globals ``kernel`` read when compiled (Triton refuses a launch after one changed;
    here a change makes another key, so Triton's path sees it)."""
    used = getattr(kernel, "used_global_vals", None)
    if not used:
        return ()
    missing = object()
    values = []
    for (name, _), (_, namespace) in used.items():
        value = namespace.get(name, missing)
        values.append((name, id(value) if value is missing else _hashable(value)))
    return tuple(values)


def _hashable(value: object) -> object:
    try:
        hash(value)
    except TypeError:
        return id(value)
    return value


def _trailing(kernel: Any, positional: int, meta: Mapping[str, object]) -> tuple[object, ...]:
    """The values of the kernel's parameters after the positional ones, in its order (constexprs given by keyword,
    else their defaults): its launcher takes every parameter, constexprs included, and skips those."""
    values = []
    for param in kernel.params[positional:]:
        if param.name in meta:
            values.append(meta[param.name])
        else:
            values.append(param.default)
    return tuple(values)


def _launchable(compiled: object) -> bool:
    return all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata"))


def _hooked() -> bool:
    """Whether a launch hook is installed (a profiler): then every launch goes through Triton's path."""
    runtime = _STATE.get("knobs")
    if runtime is None:
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = _STATE["knobs"] = knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is None:
            continue
        calls = getattr(hook, "calls", None)
        if calls is None or calls:
            return True
    return False


def _raw_stream(device: int) -> int:
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is not None:
        return int(getter(device))
    return int(torch.cuda.current_stream(device).cuda_stream)
