"""Op modules, one per kernel family, and the registry that finds them by name.

``get_op(name)`` imports the module a family declares for ``name`` (:mod:`moereplay.ops.surface`) on first use, so importing ``moereplay.ops``
costs nothing. A third-party or test op registers itself with ``register_op``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from moereplay.errors import UnknownOpError

if TYPE_CHECKING:  # ops.base imports torch; listing op names must not
    from moereplay.ops.base import OpSpec

_REGISTRY: dict[str, OpSpec] = {}


def register_op(op: OpSpec, *, replace: bool = False) -> OpSpec:
    """Make ``op`` findable by ``get_op(op.name)``. Registering a second op under a taken name is an error."""
    existing = _REGISTRY.get(op.name)
    if existing is not None and existing is not op and not replace:
        raise ValueError(f"an op named {op.name!r} is already registered")
    _REGISTRY[op.name] = op
    return op


def unregister_op(name: str) -> None:
    """Forget an op (tests register throwaway ops)."""
    _REGISTRY.pop(name, None)


def get_op(name: str) -> OpSpec:
    """The op declared under ``name``; raises ``UnknownOpError`` when no module declares it."""
    op = _REGISTRY.get(name)
    if op is not None:
        return op
    module = _surface_modules().get(name)
    if module is not None:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise UnknownOpError(f"op {name!r}: its module {module} cannot be imported ({error})") from error
        op = _REGISTRY.get(name)
        if op is not None:
            return op
    known = sorted(set(_REGISTRY) | set(_surface_modules()))
    raise UnknownOpError(f"no ops module declares {name!r} (known ops: {', '.join(known)})")


def known_op_names() -> tuple[str, ...]:
    """Names of every op that is registered or built in (built-ins are not imported)."""
    return tuple(sorted(set(_REGISTRY) | set(_surface_modules())))


def _surface_modules() -> dict[str, str]:
    """Kernel op → module, as the families declare them (:mod:`moereplay.ops.surface`, torch-free)."""
    from moereplay.ops.surface import op_modules

    return op_modules()


__all__ = ["get_op", "known_op_names", "register_op", "unregister_op"]
