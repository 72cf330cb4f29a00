"""The codec registry: how opaque objects and enums are recorded and decoded.

A codec turns an object into a *value tree* (anything the format records natively: None, bool, int, float,
str, bytes, list, tuple, dict, tensors, enums, dtypes, devices, other codec objects) and back. Codecs are
keyed by the object's qualified type name, ``f"{type.__module__}.{type.__qualname__}"``, so a reader can name
the type of a value it has no codec for, and an ops module can register a codec without importing the library
that defines the type (pass the qualified name as a string).

Enums are recorded natively (qualified name, member name, value); they decode to real members only for enum
classes passed to :func:`register_enum` — a reader never imports a module named by a file.

The registry is process-global; registering the same name again replaces the earlier codec.
"""

from __future__ import annotations

import enum
import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Codec",
    "codec_for",
    "enum_for",
    "qualified_name",
    "register_codec",
    "register_enum",
    "unregister_codec",
]


def qualified_name(kind: type) -> str:
    """``module.QualName`` of a type: the key of the codec and enum registries."""
    return f"{kind.__module__}.{kind.__qualname__}"


@dataclass(frozen=True)
class Codec:
    """``encode(obj) -> value tree`` at capture time; ``decode(value tree) -> obj`` at load time.

    ``decode`` receives the tree with tensors already materialised (on the device asked for). ``nbytes``
    (optional) receives the tree as recorded (tensors still descriptions) and says how many bytes ``decode`` will
    allocate, so a reader can hold it to its memory budget before decoding; it raises
    :class:`~moereplay.errors.MoereplayError` for a tree it would refuse anyway. ``scratch`` (optional, same
    argument): ``(key, bytes)`` that decoding needs besides what it keeps, shared by every value with the same key —
    one generator draw several recipes are cut from — so a reader counts each key once per call (its largest).
    ``collect`` (optional): ``collect(obj, leaf)`` is ``encode(obj)`` with every tensor in the tree replaced by
    ``leaf(tensor)``, tensors met in the order a walk of ``encode``'s tree meets them — one pass where a capture
    would encode and then walk the tree. ``tensors`` (optional, with ``collect``): ``tensors(obj, append)`` calls
    ``append`` on the tensors ``collect`` would pass to its leaf, in the same order, and builds nothing — what the
    layer-scope flight recorder does per call on the serving thread (the tree is built at a trigger); it raises
    where ``collect`` would on a tensor field, and may leave other fields unchecked.
    """

    type_name: str
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]
    nbytes: Callable[[Any], int] | None = None
    scratch: Callable[[Any], tuple[str, int]] | None = None
    collect: Callable[[Any, Callable[[Any], Any]], Any] | None = None
    tensors: Callable[[Any, Callable[[Any], Any]], None] | None = None


_lock = threading.Lock()
_codecs: dict[str, Codec] = {}
_enums: dict[str, type[enum.Enum]] = {}
_generation = [0]  # bumped on every (un)registration: caches keyed by type check it


def generation() -> int:
    """A number that changes whenever a codec is registered or forgotten (for caches of lookups by type)."""
    return _generation[0]


def _key(type_or_qualname: type | str) -> str:
    if isinstance(type_or_qualname, str):
        if not type_or_qualname:
            raise ValueError("a codec needs a non-empty qualified type name")
        return type_or_qualname
    if isinstance(type_or_qualname, type):
        return qualified_name(type_or_qualname)
    raise TypeError(f"expected a type or a qualified name, got {type(type_or_qualname).__name__}")


def register_codec(
    type_or_qualname: type | str,
    encode: Callable[[Any], Any],
    decode: Callable[[Any], Any],
    nbytes: Callable[[Any], int] | None = None,
    scratch: Callable[[Any], tuple[str, int]] | None = None,
    collect: Callable[[Any, Callable[[Any], Any]], Any] | None = None,
    tensors: Callable[[Any, Callable[[Any], Any]], None] | None = None,
) -> Codec:
    """Register (or replace) the codec for a type; returns it."""
    codec = Codec(_key(type_or_qualname), encode, decode, nbytes, scratch, collect, tensors)
    with _lock:
        _codecs[codec.type_name] = codec
        _generation[0] += 1
    return codec


def unregister_codec(type_or_qualname: type | str) -> None:
    """Forget a codec (no error if none was registered)."""
    with _lock:
        _codecs.pop(_key(type_or_qualname), None)
        _generation[0] += 1


#: moereplay's own codecs that register themselves when their module is imported. A reader may import these
#: (a fixed allow-list of this package's modules) on meeting the type name; it never imports a module a file names.
BUILTIN_CODEC_PROVIDERS: dict[str, str] = {
    "moereplay.synth.recipe.TensorRecipe": "moereplay.synth.recipe",
}


def codec_for(type_name: str) -> Codec | None:
    """The codec registered for ``type_name``; moereplay's built-in codecs are registered on first need."""
    codec = _codecs.get(type_name)
    if codec is None and type_name in BUILTIN_CODEC_PROVIDERS:
        importlib.import_module(BUILTIN_CODEC_PROVIDERS[type_name])
        codec = _codecs.get(type_name)
    return codec


def register_enum(enum_class: type[enum.Enum]) -> None:
    """Let readers decode recorded members of ``enum_class`` to real members (else they stay EnumValue)."""
    if not (isinstance(enum_class, type) and issubclass(enum_class, enum.Enum)):
        raise TypeError(f"register_enum needs an Enum class, got {enum_class!r}")
    with _lock:
        _enums[qualified_name(enum_class)] = enum_class


def enum_for(type_name: str) -> type[enum.Enum] | None:
    return _enums.get(type_name)
