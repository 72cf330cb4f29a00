"""Copy a call's argument tree at the right moment, without a host sync.

The caller thread walks the bound arguments, replaces every tensor by a :class:`TensorCopy` and every opaque
object by its codec's value tree (codecs run here, because the tensors inside them must be copied before the
kernel runs). Cost model:

- CUDA tensors: one asynchronous copy per storage span into one pinned host buffer per snapshot (PyTorch's
  caching host allocator, so no ``cudaHostAlloc`` per call), queued on the *current* stream: stream order
  guarantees the input copy sees the bytes before the kernel and the output copy the bytes after it, with no
  host sync. A CUDA event recorded after the copies tells the writer thread when the bytes are there. In
  flight-recorder mode the copies stay on the device (``to_host=False``): one device buffer per snapshot and one
  multi-tensor copy kernel for all its spans (``torch._foreach_copy_``), not an allocation and a launch per span.
- CPU tensors: a plain copy (the caller may overwrite the buffer right after the call).
- Views of one storage among a call's arguments are copied once, as the union of their spans (widened down to
  the format's 256-byte span alignment, so replayed views keep their data-pointer alignment and views of other
  dtypes stay whole elements), so the recorded tensors alias exactly as the originals did (gemm1/gemm2
  intermediate caches are views of one buffer).
- Aliasing between a call's inputs and outputs: every copy names its original storage by ``(device, data
  pointer)``, the writer's storage key (``TensorBytes.storage``). An output written in place over an input has
  the input's key, so the file records it with the input's storage id and its own original storage offset
  (``CallRecord.aliases()``). A data pointer names one storage only while that storage lives: the caller keeps
  the input tensors alive (``keep=``) until the outputs are copied, so a temporary made by a codec and freed
  before the kernel runs cannot lend its address to an output and fake an alias.
- Static tensors (weights, scales; the arguments named static per patch point) are not copied here at all: the
  tree keeps the live tensor, and the file writer (``CaptureWriter.begin_call(static=...)``) copies it once per
  file and finds it again by identity. Weights are not written while serving, so reading them later, from the
  writer thread, sees the same bytes. Objects with a registered codec are handed over live too (the writer
  encodes them); other containers and dataclasses holding static tensors are walked here, so a vLLM config
  object around weights is recorded field by field instead of as unsupported.

- Buffers: with a :class:`BufferPool` the copies land in buffers taken from the pool (pinned host or device,
  sizes rounded up to sixteenths of a power of two) and given back with :meth:`Snapshot.release` once the bytes were
  written or dropped — no allocation (``cudaHostAlloc`` for pinned memory) per call once warm.
- Lazy records: the :class:`TensorCopy` objects and the filled tree are built when :attr:`Snapshot.tree` is first
  read (the writer thread, or a flight-recorder trigger), not on the serving thread.

Opaque objects become :class:`~moereplay.format.schema.CodecValue` (through the format's codec registry, or
field by field for dataclasses without one); functions become :class:`~moereplay.format.schema.Unsupported`
naming them; enums, dtypes and devices stay as they are (the format records them natively).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import threading
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from moereplay.format.codecs import codec_for
from moereplay.format.schema import CodecValue, TensorBytes, Unsupported
from moereplay.format.tensors import SPAN_ALIGNMENT, span_start

MAX_DEPTH = 8
"""Nesting depth past which an argument is recorded as unsupported (cycles, huge object graphs)."""


@dataclass(eq=False)
class TensorCopy:
    """One recorded tensor view: its original metadata and the copied bytes of (a superset of) its span.

    ``data`` is a uint8 tensor (pinned host, or device in flight mode) holding bytes ``[base, base + n)`` of the
    original storage; views of one original storage in one snapshot share ``data``.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    device: str
    storage: tuple[str, int]
    base: int
    data: torch.Tensor

    def view(self) -> torch.Tensor:
        """A tensor with the original dtype, shape and stride over the copied bytes (offset relative to
        ``base``). Moves device copies to the host first (flight recorder entries)."""
        data = self.data if self.data.device.type == "cpu" else self.data.cpu()
        result = torch.empty(0, dtype=self.dtype)
        if any(size == 0 for size in self.shape):
            return torch.empty(self.shape, dtype=self.dtype)
        itemsize = result.element_size()
        offset = (data.storage_offset() + self.storage_offset * itemsize - self.base) // itemsize
        result.set_(data.untyped_storage(), offset, self.shape, self.stride)
        return result


class Snapshot:
    """A copied argument tree: :class:`TensorCopy` where non-static tensors were, live tensors where static
    ones were. ``event``: what :meth:`wait` waits on — a CUDA event recorded after the copies, or a stream
    (``None`` on CPU). ``copied``: bytes copied. The tree is filled on first access (see the module docstring)."""

    __slots__ = ("_leases", "_pending", "_tree", "copied", "event")

    def __init__(self, tree: dict[str, Any], copied: int = 0, event: Any = None) -> None:
        self._tree = tree
        self._pending: tuple[list[_Found], list[torch.Tensor]] | None = None
        self.copied = copied
        self.event = event
        self._leases: list[Lease] = []

    @property
    def tree(self) -> dict[str, Any]:
        pending = self._pending
        if pending is not None:
            copies = [found.copy(pending[1]) for found in pending[0]]
            self._tree = {name: _fill(item, copies) for name, item in self._tree.items()}
            self._pending = None
        return self._tree

    @tree.setter
    def tree(self, value: dict[str, Any]) -> None:
        self._tree = value
        self._pending = None

    def file_tree(self) -> dict[str, Any]:
        """The tree as the file writer records it (:func:`materialize`), built in one pass when the tree was
        never read."""
        pending = self._pending
        if pending is None:
            return {name: materialize(item) for name, item in self._tree.items()}
        copies = [found.tensor_bytes(pending[1]) for found in pending[0]]
        return {name: _fill(item, copies) for name, item in self._tree.items()}

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def release(self) -> None:
        """Give the copy buffers back to their pool (after the bytes were written, or dropped). The tree's
        copies must not be read afterwards."""
        leases, self._leases = self._leases, []
        for lease in leases:
            lease.give_back()


def qualified_type_name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """``[start, end)`` bytes of the storage the view touches (strides are never negative in torch)."""
    itemsize = tensor.element_size()
    offset = int(tensor.storage_offset())
    start = offset * itemsize
    if tensor.numel() == 0:
        return start, start
    last = offset + sum(
        (int(size) - 1) * int(stride) for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return start, (last + 1) * itemsize


def _raw_bytes(tensor: torch.Tensor, start: int, end: int) -> torch.Tensor:
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    raw.set_(tensor.untyped_storage(), start, (end - start,), (1,))
    return raw


def bucket_size(nbytes: int) -> int:
    """The pool's size class for ``nbytes``: rounded up to a sixteenth of the next power of two (≤ 12.5 %
    slack)."""
    if nbytes <= 4096:
        return 4096
    step = 1 << max((nbytes - 1).bit_length() - 4, 0)
    return -(-nbytes // step) * step


class Lease:
    """One buffer taken from a :class:`BufferPool`; :meth:`give_back` returns it (once)."""

    __slots__ = ("buffer", "key", "pool", "views")

    def __init__(
        self,
        pool: BufferPool,
        key: tuple[str, int, int],
        buffer: torch.Tensor,
        views: dict[tuple[int, ...], list[torch.Tensor]],
    ) -> None:
        self.pool = pool
        self.key = key
        self.buffer = buffer
        self.views = views  # span sizes -> the buffer's views for them, made once per layout

    def targets(self, sizes: tuple[int, ...]) -> list[torch.Tensor]:
        """Views of the buffer for spans of ``sizes`` bytes, each starting on a 256-byte boundary."""
        targets = self.views.get(sizes)
        if targets is None:
            targets = []
            start = 0
            for size in sizes:
                targets.append(self.buffer.narrow(0, start, size))
                start += -(-size // SPAN_ALIGNMENT) * SPAN_ALIGNMENT
            if len(self.views) >= 16:
                self.views.clear()
            self.views[sizes] = targets
        return targets

    def give_back(self) -> None:
        pool, self.pool = self.pool, None  # type: ignore[assignment]
        if pool is not None:
            pool.give(self.key, self.buffer, self.views)


class BufferPool:
    """Reusable uint8 copy buffers: pinned host memory (``pinned=True``) or device memory, by size class and by
    the stream that last wrote them (a buffer is only refilled in stream order after its last use).

    Thread-safe: the serving thread takes, the writer thread gives back. At most ``max_free_bytes`` of free
    buffers are kept (the rest is freed). ``allocated`` / ``reused``: counts, for benchmarks and tests.
    """

    def __init__(self, max_free_bytes: int) -> None:
        self.max_free_bytes = max_free_bytes
        self._free: dict[tuple[str, int, int], list[tuple[torch.Tensor, dict[Any, Any]]]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()
        self.allocated = 0
        self.reused = 0

    def take(self, device: torch.device, nbytes: int, *, pinned: bool, stream: int = 0) -> Lease:
        size = bucket_size(nbytes)
        key = ("pinned" if pinned else str(device), stream, size)
        with self._lock:
            free = self._free.get(key)
            if free:
                self._free_bytes -= size
                self.reused += 1
                return Lease(self, key, *free.pop())
            self.allocated += 1
        if pinned:
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        else:
            buffer = torch.empty(size, dtype=torch.uint8, device=device)
        return Lease(self, key, buffer, {})

    def give(
        self,
        key: tuple[str, int, int],
        buffer: torch.Tensor,
        views: dict[tuple[int, ...], list[torch.Tensor]],
    ) -> None:
        with self._lock:
            if self._free_bytes + key[2] > self.max_free_bytes:
                return
            self._free.setdefault(key, []).append((buffer, views))
            self._free_bytes += key[2]

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._free_bytes = 0


def copy_spans(
    sources: list[torch.Tensor],
    *,
    to_host: bool,
    pool: BufferPool | None = None,
    leases: list[Lease] | None = None,
) -> list[torch.Tensor]:
    """Asynchronous copies of 1-D uint8 spans, queued on the current stream, as views of one buffer: pinned
    host memory for CUDA sources when ``to_host``, else memory on the sources' device (one multi-tensor copy).
    With ``pool`` the buffer is taken from it and its lease appended to ``leases``. Sources on several devices
    are copied one by one."""
    if not sources:
        return []
    device = sources[0].device
    if any(source.device != device for source in sources):
        return [copy_spans([source], to_host=to_host, pool=pool, leases=leases)[0] for source in sources]
    on_device = device.type != "cpu" and not to_host
    pinned = device.type != "cpu" and to_host
    sizes = tuple(source.numel() for source in sources)
    # each span starts on a 256-byte boundary of the buffer, as it did in its storage
    total = sum(-(-size // SPAN_ALIGNMENT) * SPAN_ALIGNMENT for size in sizes)
    if pool is not None:
        # keyed by the stream copying into it: a buffer given back before its copy ran (a dropped message) is
        # refilled only behind that copy
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        lease = pool.take(device if on_device else torch.device("cpu"), total, pinned=pinned, stream=stream)
        if leases is not None:
            leases.append(lease)
        targets = lease.targets(sizes)
    else:
        flat = torch.empty(total, dtype=torch.uint8, device=device if on_device else "cpu", pin_memory=pinned)
        targets = Lease(None, ("", 0, 0), flat, {}).targets(sizes)  # type: ignore[arg-type]
    if len(sources) > 1 and (on_device or device.type == "cpu"):
        torch._foreach_copy_(targets, sources, non_blocking=on_device)  # one multi-tensor kernel launch
    else:
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source, non_blocking=pinned or on_device)
    return targets


def _shallow_tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item


def estimate(values: dict[str, Any], static_names: Iterable[str]) -> int:
    """Bytes a snapshot would copy (top-level and list tensors; static arguments count 0). Cheap: metadata."""
    static = frozenset(static_names)
    total = 0
    for name, value in values.items():
        if name in static:
            continue
        for tensor in _shallow_tensors(value):
            start, end = byte_span(tensor)
            total += end - start
    return total


class _Pending:
    """Placeholder for the ``index``-th tensor found by a walk, replaced once the copies exist."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


CodecLookup = Callable[[type], "tuple[str, Callable[[Any], Any]] | None"]


_CODEC_NAMES: dict[type, str] = {}


def format_codec(kind: type) -> tuple[str, Callable[[Any], Any]] | None:
    """The format registry's codec for ``kind`` (ops modules register theirs there). The qualified type name
    is cached per type; the registry is asked on every call (codecs may be registered or replaced later)."""
    name = _CODEC_NAMES.get(kind)
    if name is None:
        name = _CODEC_NAMES[kind] = qualified_type_name(kind)
    codec = codec_for(name)
    return None if codec is None else (codec.type_name, codec.encode)


def snapshot(
    values: dict[str, Any],
    static_names: Iterable[str] = (),
    *,
    to_host: bool = True,
    codec_lookup: CodecLookup = format_codec,
    keep: list[torch.Tensor] | None = None,
    pool: BufferPool | None = None,
    event: bool = True,
) -> Snapshot:
    """Copy ``values`` (argument name → value) as described in the module docstring.

    ``keep``: when given, every copied original tensor is appended to it; hold the list until the call's
    outputs are copied (their storage keys are only unambiguous while these storages live). ``pool``: take the
    copy buffer from it (give it back with :meth:`Snapshot.release`). ``event``: record a CUDA event after the
    copies (the flight recorder does without: it waits on the device, when it writes at all).
    """
    static = static_names if isinstance(static_names, (frozenset, set)) else frozenset(static_names)
    found: list[torch.Tensor] = []
    tree: dict[str, Any] = {}
    for name, value in values.items():
        kind = type(value)
        if kind is torch.Tensor:  # the common cases first, without the walk
            if name in static:
                tree[name] = value
            else:
                found.append(value)
                tree[name] = _Pending(len(found) - 1)
        elif kind in _PLAIN or _leaf(value):
            tree[name] = value
        elif name in static:
            tree[name] = _walk_static(value, codec_lookup, 0)
        else:
            tree[name] = _walk(value, found, codec_lookup, 0)
    result = Snapshot(tree)
    if found:
        _copy(found, result, to_host=to_host, pool=pool, event=event)
        if keep is not None:
            keep.extend(found)
    return result


_PLAIN = frozenset({type(None), bool, int, float, str, bytes, torch.dtype, torch.device})
_DEVICE_NAMES: dict[torch.device, str] = {}


def _leaf(value: Any) -> bool:
    return value is None or isinstance(
        value, (bool, int, float, str, bytes, torch.dtype, torch.device, enum.Enum)
    )


def _walk(value: Any, found: list[torch.Tensor], codec_lookup: CodecLookup, depth: int) -> Any:
    if _leaf(value):
        return value
    if isinstance(value, torch.Tensor):
        found.append(value)
        return _Pending(len(found) - 1)
    if depth >= MAX_DEPTH:
        return Unsupported(qualified_type_name(type(value)), "nested too deeply to record")
    deeper = depth + 1
    if type(value) is list:
        return [_walk(item, found, codec_lookup, deeper) for item in value]
    if type(value) is tuple or type(value) is torch.Size:
        return tuple(_walk(item, found, codec_lookup, deeper) for item in value)
    if type(value) is dict:
        return {key: _walk(item, found, codec_lookup, deeper) for key, item in value.items()}
    codec = codec_lookup(type(value))
    if codec is not None:
        type_name, encode = codec
        return CodecValue(type_name, _walk(encode(value), found, codec_lookup, deeper))
    return _opaque(value, lambda fields: _walk(fields, found, codec_lookup, deeper))


def _walk_static(value: Any, codec_lookup: CodecLookup, depth: int) -> Any:
    """A static argument: tensors and codec objects stay live (the writer stores their tensors once, by
    identity); plain containers and dataclasses around them are opened here."""
    if _leaf(value) or isinstance(value, torch.Tensor):
        return value
    if depth >= MAX_DEPTH:
        return Unsupported(qualified_type_name(type(value)), "nested too deeply to record")
    deeper = depth + 1
    if type(value) is list:
        return [_walk_static(item, codec_lookup, deeper) for item in value]
    if type(value) is tuple or type(value) is torch.Size:
        return tuple(_walk_static(item, codec_lookup, deeper) for item in value)
    if type(value) is dict:
        return {key: _walk_static(item, codec_lookup, deeper) for key, item in value.items()}
    if codec_lookup(type(value)) is not None:
        return value
    return _opaque(value, lambda fields: _walk_static(fields, codec_lookup, deeper))


def _opaque(value: Any, walk_fields: Callable[[dict[str, Any]], Any]) -> Any:
    """An object without a codec: a dataclass field by field, else unsupported (named)."""
    if isinstance(
        value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)
    ):
        return Unsupported(qualified_type_name(type(value)), _callable_name(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}
        return CodecValue(qualified_type_name(type(value)), walk_fields(fields))
    if callable(value):
        return Unsupported(qualified_type_name(type(value)), _callable_name(value))
    try:
        excerpt = repr(value)[:200]
    except Exception:
        excerpt = "<repr failed>"
    return Unsupported(qualified_type_name(type(value)), excerpt)


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """The identity of ``tensor``'s storage while it lives: ``(device, data pointer)``."""
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


class _Found:
    """What a copy needs to know of one original tensor (its :class:`TensorCopy` is built lazily)."""

    __slots__ = ("base", "dtype", "group", "key", "offset", "shape", "stride")

    def __init__(
        self,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        stride: tuple[int, ...],
        offset: int,
        key: tuple[str, int],
    ) -> None:
        self.dtype = dtype
        self.shape = shape
        self.stride = stride
        self.offset = offset
        self.key = key
        self.base = 0
        self.group = 0

    def tensor_bytes(self, data: list[torch.Tensor]) -> TensorBytes:
        return TensorBytes(
            dtype=self.dtype,
            shape=self.shape,
            stride=self.stride,
            storage_offset=self.offset,
            device=self.key[0],
            storage=self.key,
            base=self.base,
            data=data[self.group],
        )

    def copy(self, data: list[torch.Tensor]) -> TensorCopy:
        return TensorCopy(
            dtype=self.dtype,
            shape=self.shape,
            stride=self.stride,
            storage_offset=self.offset,
            device=self.key[0],
            storage=self.key,
            base=self.base,
            data=data[self.group],
        )


def _copy(
    found: list[torch.Tensor], result: Snapshot, *, to_host: bool, pool: BufferPool | None, event: bool
) -> None:
    """Copy each storage once (the union of its views' spans, from a 256-byte boundary); record one CUDA
    event after all copies (if ``event``). Leaves the tree to be filled lazily."""
    groups: dict[tuple[str, int], list[int]] = {}  # storage key -> [start, end, group index]
    records: list[_Found] = []
    sources: list[torch.Tensor] = []
    cuda = False
    for tensor in found:
        device = tensor.device
        device_name = _DEVICE_NAMES.get(device)
        if device_name is None:
            device_name = _DEVICE_NAMES[device] = str(device)
        key = (device_name, tensor.untyped_storage().data_ptr())
        shape: tuple[int, ...] = tuple(tensor.shape)
        stride: tuple[int, ...] = tensor.stride()
        offset = int(tensor.storage_offset())
        itemsize = tensor.element_size()
        start = offset * itemsize
        if 0 in shape:
            end = start
        else:
            last = offset + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))
            end = (last + 1) * itemsize
        record = _Found(tensor.dtype, shape, stride, offset, key)
        records.append(record)
        group = groups.get(key)
        if group is None:
            group = groups[key] = [start, end, len(sources)]
            sources.append(tensor)
            cuda = cuda or device.type == "cuda"
        else:
            group[0] = min(group[0], start)
            group[1] = max(group[1], end)
        record.group = group[2]
    raw: list[torch.Tensor] = []
    for start, end, index in groups.values():
        base = span_start(start)
        source = sources[index]
        if base == start and source.dim() == 1 and source.stride(0) == 1 and end - start == source.nbytes:
            raw.append(source.view(torch.uint8))  # the common 1-D case, cheaper than a storage view
        else:
            raw.append(_raw_bytes(source, base, end))
        result.copied += end - base
    for record in records:
        record.base = span_start(groups[record.key][0])
    copied = copy_spans(raw, to_host=to_host, pool=pool, leases=result._leases)
    result._pending = (records, copied)
    if cuda and event:
        done = torch.cuda.Event()
        done.record()
        result.event = done


def _fill(tree: Any, copies: list[Any]) -> Any:
    if isinstance(tree, _Pending):
        return copies[tree.index]
    if type(tree) is list:
        return [_fill(item, copies) for item in tree]
    if type(tree) is tuple:
        return tuple(_fill(item, copies) for item in tree)
    if type(tree) is dict:
        return {key: _fill(item, copies) for key, item in tree.items()}
    if isinstance(tree, CodecValue):
        return CodecValue(tree.type_name, _fill(tree.value, copies))
    return tree


def materialize(tree: Any) -> Any:
    """The tree the file writer records: every :class:`TensorCopy` as the format's ``TensorBytes`` (original
    metadata, the copied bytes, and the original storage as its identity, so an output written in place over an
    input is recorded as aliasing it)."""
    if isinstance(tree, TensorCopy):
        return TensorBytes(
            dtype=tree.dtype,
            shape=tree.shape,
            stride=tree.stride,
            storage_offset=tree.storage_offset,
            device=tree.device,
            storage=tree.storage,
            base=tree.base,
            data=tree.data,
        )
    if type(tree) is list:
        return [materialize(item) for item in tree]
    if type(tree) is tuple:
        return tuple(materialize(item) for item in tree)
    if type(tree) is dict:
        return {key: materialize(item) for key, item in tree.items()}
    if isinstance(tree, CodecValue):
        return CodecValue(tree.type_name, materialize(tree.value))
    return tree


def _callable_name(value: Any) -> str:
    module = getattr(value, "__module__", None) or ""
    name = (
        getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or type(value).__qualname__
    )
    return f"{module}.{name}" if module else str(name)
