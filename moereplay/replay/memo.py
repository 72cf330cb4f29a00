"""Caches keyed by a call's arguments: references, re-derived arguments — sound without trusting object ids alone.

A key is built per argument: plain values (numbers, flags, strings, dtypes, enums) by value; tensors up to
:data:`CONTENT_KEY_BYTES` by dtype, shape, stride and a digest of their bytes (a cast or a re-derived routing array
made twice is one key); larger tensors (weights) and any other object by identity *and* version counter, with a
strong reference kept next to the entry (a freed object's id can never be reused by another while its entry lives,
and an in-place change bumps the version). A changed argument therefore never hits a stale entry; the worst a key
can do is miss (an equal tensor under another identity).

A content key's digest is remembered per tensor object (:func:`tensor_key`): the same object at the same version
counter and data pointer is not copied to the host and hashed again, so keying a sweep's unchanged arguments costs
dictionary look-ups, not a device→host copy and a SHA-1 per argument and variant (on a GPU each copy is also a host
sync). An in-place change bumps the version (→ hashed again); a new tensor with equal bytes gets an equal digest.
This trusts the version counter as the identity keys of large tensors do (a write through ``.data`` or a raw
storage alias is invisible to both).

:func:`memos_for` gives each :class:`~moereplay.replay.source.LoadedCall` one set of caches, shared by every session
that replays that same loaded call (:func:`~moereplay.replay.source.load_call_cached` hands the same object to later
sessions while the file and the tensors are unchanged), so a second sweep over one call computes no reference twice.
"""

from __future__ import annotations

import enum
import hashlib
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

CONTENT_KEY_BYTES = 1 << 20
"""Tensors up to this many bytes are keyed by content (one device→host copy + SHA-1); larger ones by identity."""

_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)

Key = tuple[Hashable, ...]
T = TypeVar("T")


def _plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain(item) for item in value)
    return False


class _Digests:
    """Content keys remembered per tensor object: ``id → (weak reference, version, data pointer, key)``; an entry
    is used only while its tensor is alive and at the same version and address, and leaves when the tensor dies."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[torch.Tensor], int, int, Key]] = {}
        self.hashed = 0  # tensors copied to the host and hashed (a test sees a changed tensor hashed again)

    def get(self, tensor: torch.Tensor) -> Key | None:
        entry = self._entries.get(id(tensor))
        if entry is None:
            return None
        ref, version, pointer, key = entry
        if ref() is not tensor or version != tensor._version or pointer != tensor.data_ptr():
            return None
        return key

    def put(self, tensor: torch.Tensor, key: Key) -> None:
        identity = id(tensor)
        entries = self._entries

        def forget(ref: weakref.ref[torch.Tensor]) -> None:
            current = entries.get(identity)
            if current is not None and current[0] is ref:
                del entries[identity]

        entries[identity] = (weakref.ref(tensor, forget), tensor._version, tensor.data_ptr(), key)

    def __len__(self) -> int:
        return len(self._entries)


_DIGESTS = _Digests()


def tensor_key(tensor: torch.Tensor) -> tuple[Key, Any]:
    """``(key, pin)``: a content key for a small tensor (pin ``None``), an identity key for a large one (pin: it).
    A content key is computed once per tensor object and version (see the module docstring)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes <= CONTENT_KEY_BYTES:
        known = _DIGESTS.get(tensor)
        if known is not None:
            return known, None
        layout = (str(tensor.dtype), tuple(tensor.shape), tuple(tensor.stride()), str(tensor.device))
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        digest = hashlib.sha1(data.numpy().tobytes()).hexdigest() if nbytes else ""
        key: Key = ("content", *layout, digest)
        _DIGESTS.hashed += 1
        _DIGESTS.put(tensor, key)
        return key, None
    layout = (str(tensor.dtype), tuple(tensor.shape), tuple(tensor.stride()), str(tensor.device))
    return ("identity", *layout, id(tensor), tensor._version), tensor


def args_key(args: Mapping[str, Any], ignore: frozenset[str] = frozenset()) -> tuple[Key, tuple[Any, ...]]:
    """``(key, pins)`` over every argument not in ``ignore`` (see the module docstring); keep ``pins`` alive as long
    as an entry made with ``key`` may be hit."""
    parts: list[Hashable] = []
    pins: list[Any] = []
    for name in sorted(args):
        if name in ignore:
            continue
        value = args[name]
        if isinstance(value, torch.Tensor):
            key, pin = tensor_key(value)
            parts.append((name, key))
            if pin is not None:
                pins.append(pin)
        elif _plain(value):
            parts.append((name, "value", type(value).__name__, repr(value)))
        else:
            parts.append((name, "object", type(value).__name__, id(value)))
            pins.append(value)
    return tuple(parts), tuple(pins)


class ArgsCache(Generic[T]):
    """A bounded LRU of values by :func:`args_key` keys, holding each entry's pins. ``hits``/``misses`` count."""

    def __init__(self, limit: int = 32) -> None:
        self.limit = limit
        self._entries: OrderedDict[Key, tuple[T, tuple[Any, ...]]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: Key) -> T | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: Key, pins: tuple[Any, ...], value: T) -> None:
        self._entries[key] = (value, pins)
        self._entries.move_to_end(key)
        while len(self._entries) > self.limit:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class CallMemos:
    """The caches that belong to one loaded call: its references and its re-derived arguments."""

    references: ArgsCache[Any] = field(default_factory=lambda: ArgsCache(limit=32))
    derived: ArgsCache[dict[str, Any]] = field(default_factory=lambda: ArgsCache(limit=64))
    allowances: ArgsCache[Any] = field(default_factory=lambda: ArgsCache(limit=64))
    """Keyed by reference and launch (reduction mode, tile …): a sweep of 5 block sizes × 3 modes × 2 tiles is 30."""


_MEMOS: dict[int, CallMemos] = {}


def memos_for(call: object) -> CallMemos:
    """The caches of ``call`` (made on first use, dropped when ``call`` is garbage-collected)."""
    memos = _MEMOS.get(id(call))
    if memos is None:
        memos = CallMemos()
        _MEMOS[id(call)] = memos
        weakref.finalize(call, _MEMOS.pop, id(call), None)
    return memos
