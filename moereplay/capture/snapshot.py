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

from moereplay.format.codecs import Codec, codec_for
from moereplay.format.codecs import generation as codecs_generation
from moereplay.format.schema import CodecValue, TensorBytes, Unsupported
from moereplay.format.tensors import SPAN_ALIGNMENT

MAX_DEPTH = 8
"""Nesting depth past which an argument is recorded as unsupported (cycles, huge object graphs)."""


@dataclass(eq=False, slots=True)
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

    def view(self, *, on_host: bool = True) -> torch.Tensor:
        """A tensor with the original dtype, shape and stride over the copied bytes (offset relative to
        ``base``). ``on_host``: move device copies to the host first (flight recorder entries being written);
        else the view stays over the copy where it is (no transfer, no launch: the flight recorder's checks)."""
        data = self.data if self.data.device.type == "cpu" or not on_host else self.data.cpu()
        result = torch.empty(0, dtype=self.dtype, device=data.device)
        if any(size == 0 for size in self.shape):
            return torch.empty(self.shape, dtype=self.dtype, device=data.device)
        itemsize = result.element_size()
        offset = (data.storage_offset() + self.storage_offset * itemsize - self.base) // itemsize
        result.set_(data.untyped_storage(), offset, self.shape, self.stride)
        return result


@dataclass
class Snapshot:
    """A copied argument tree: :class:`TensorCopy` where non-static tensors were, live tensors where static
    ones were. ``event``: CUDA event recorded after the copies (``None`` on CPU). ``copied``: bytes copied."""

    tree: dict[str, Any]
    copied: int = 0
    event: Any = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


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
    """Bytes ``[start, end)`` of ``tensor``'s storage as a 1-D uint8 tensor (no copy)."""
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    raw.set_(tensor.untyped_storage(), start, (end - start,), (1,))
    return raw


def copy_spans(sources: list[torch.Tensor], *, to_host: bool) -> list[torch.Tensor]:
    """Asynchronous copies of 1-D uint8 spans, queued on the current stream, as views of one new buffer: pinned
    host memory for CUDA sources when ``to_host``, else memory on the sources' device (one multi-tensor copy).
    Sources on several devices are copied one by one."""
    if not sources:
        return []
    device = sources[0].device
    sizes = [int(source.numel()) for source in sources]
    if any(source.device != device for source in sources):
        return [copy_spans([source], to_host=to_host)[0] for source in sources]
    on_device = device.type != "cpu" and not to_host
    pinned = device.type != "cpu" and to_host
    starts = []
    total = 0
    for size in sizes:  # each span starts on a 256-byte boundary of the buffer, as it did in its storage
        starts.append(total)
        total += -(-size // SPAN_ALIGNMENT) * SPAN_ALIGNMENT
    flat = torch.empty(total, dtype=torch.uint8, device=device if on_device else "cpu", pin_memory=pinned)
    targets = [flat.narrow(0, start, size) for start, size in zip(starts, sizes, strict=True)]
    if on_device and len(sources) > 1:
        torch._foreach_copy_(targets, sources)  # one multi-tensor kernel launch
    else:
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source, non_blocking=pinned)
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


_CODEC_CACHE: dict[type, Codec | None] = {}
_CODEC_CACHE_GENERATION = [-1]


def _codec_of(kind: type) -> Codec | None:
    """The format registry's codec for ``kind``, cached by type until the registry changes (the layer-scope
    flight recorder looks codecs up on the serving thread, every call)."""
    generation = codecs_generation()
    if generation != _CODEC_CACHE_GENERATION[0]:
        _CODEC_CACHE.clear()
        _CODEC_CACHE_GENERATION[0] = generation
    try:
        return _CODEC_CACHE[kind]
    except KeyError:
        pass
    codec = codec_for(qualified_type_name(kind))  # may import a provider, which registers (a new generation)
    if codecs_generation() == generation:  # not if a registration raced this lookup
        _CODEC_CACHE[kind] = codec
    return codec


def format_codec(kind: type) -> tuple[str, Callable[[Any], Any]] | None:
    """The format registry's codec for ``kind`` (ops modules register theirs there)."""
    codec = _codec_of(kind)
    return None if codec is None else (codec.type_name, codec.encode)


_PLAIN_TYPES = frozenset({type(None), bool, int, float, str, bytes, torch.dtype, torch.device})


def snapshot(
    values: dict[str, Any],
    static_names: Iterable[str] = (),
    *,
    to_host: bool = True,
    codec_lookup: CodecLookup = format_codec,
    keep: list[torch.Tensor] | None = None,
    record_event: bool = True,
) -> Snapshot:
    """Copy ``values`` (argument name → value) as described in the module docstring.

    ``keep``: when given, every copied original tensor is appended to it; hold the list until the call's
    outputs are copied (their storage keys are only unambiguous while these storages live).
    ``record_event``: record the CUDA event after the copies (the flight recorder passes ``False`` and sets
    :attr:`Snapshot.event` itself, one event per batch of snapshots).

    Fast path: a top-level tensor, ``None`` or plain scalar (every Marlin argument) costs a type check; only
    containers and opaque objects go through the generic walk.
    """
    static = static_names if isinstance(static_names, frozenset) else frozenset(static_names)
    found: list[torch.Tensor] = []
    top: list[tuple[str, int]] = []  # (name, index in found) of top-level non-static tensors
    walked: list[str] = []  # names whose tree holds _Pending placeholders
    tree: dict[str, Any] = {}
    plain = _PLAIN_TYPES
    for name, value in values.items():
        kind = type(value)
        if kind in plain:
            tree[name] = value
        elif isinstance(value, torch.Tensor):
            if name in static:
                tree[name] = value
            else:
                top.append((name, len(found)))
                found.append(value)
                tree[name] = None
        elif name in static:
            tree[name] = _walk_static(value, codec_lookup, 0)
        else:
            before = len(found)
            tree[name] = _walk(value, found, codec_lookup, 0)
            if len(found) != before:
                walked.append(name)
    result = Snapshot(tree)
    if found:
        copies = _copy(found, result, to_host=to_host, record_event=record_event)
        for name, index in top:
            tree[name] = copies[index]
        for name in walked:
            tree[name] = _fill(tree[name], copies)
        if keep is not None:
            keep.extend(found)
    return result


_LEAF_TYPES = frozenset({type(None), bool, int, float, str, bytes, torch.dtype, torch.device})


def _leaf(value: Any) -> bool:
    return type(value) in _LEAF_TYPES or isinstance(
        value, (bool, int, float, str, bytes, torch.dtype, torch.device, enum.Enum)
    )


def _walk(value: Any, found: list[torch.Tensor], codec_lookup: CodecLookup, depth: int) -> Any:
    """``value`` with every tensor in it appended to ``found`` and replaced by its :class:`_Pending` index. The
    layer-scope flight recorder walks a layer call's routing objects with this on the serving thread: exact
    leaf types and tensors in containers are handled without a call of their own."""
    kind = type(value)
    if kind in _LEAF_TYPES:
        return value
    if isinstance(value, torch.Tensor):
        found.append(value)
        return _Pending(len(found) - 1)
    if depth >= MAX_DEPTH:
        return (
            value if _leaf(value) else Unsupported(qualified_type_name(kind), "nested too deeply to record")
        )
    deeper = depth + 1
    if kind is list or kind is tuple or kind is torch.Size:
        items = []
        for item in value:
            if type(item) in _LEAF_TYPES:
                items.append(item)
            elif type(item) is torch.Tensor:
                found.append(item)
                items.append(_Pending(len(found) - 1))
            else:
                items.append(_walk(item, found, codec_lookup, deeper))
        return items if kind is list else tuple(items)
    if kind is dict:
        out = {}
        for key, item in value.items():
            if type(item) in _LEAF_TYPES:
                out[key] = item
            elif type(item) is torch.Tensor:
                found.append(item)
                out[key] = _Pending(len(found) - 1)
            else:
                out[key] = _walk(item, found, codec_lookup, deeper)
        return out
    if _leaf(value):  # subclasses of the leaf types, enum members
        return value
    if codec_lookup is format_codec and depth == 0:  # (deeper, the walk applies MAX_DEPTH inside the tree)
        found_codec = _codec_of(kind)
        if found_codec is not None and found_codec.collect is not None:  # encode and walk in one pass

            def leaf(tensor: torch.Tensor) -> _Pending:
                found.append(tensor)
                return _Pending(len(found) - 1)

            return CodecValue(found_codec.type_name, found_codec.collect(value, leaf))
    codec = codec_lookup(kind)
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
    return (_device_name(tensor.device), tensor.untyped_storage().data_ptr())


_DEVICE_NAMES: dict[torch.device, str] = {}


def _device_name(device: torch.device) -> str:
    name = _DEVICE_NAMES.get(device)
    if name is None:
        name = _DEVICE_NAMES[device] = str(device)
    return name


_STAGE_LIMIT = 16 << 20
"""Full capture of CUDA tensors: snapshots up to this many bytes are gathered on the device by one multi-tensor
copy and moved to pinned host memory in one transfer (two launches, whatever the number of spans); larger ones
are copied span by span straight into pinned memory (no transient device buffer)."""


def _copy(
    found: list[torch.Tensor], result: Snapshot, *, to_host: bool, record_event: bool = True
) -> list[TensorCopy]:
    """Copy each storage once (the union of its views' spans, from a 256-byte boundary) into one new buffer;
    record one CUDA event after all copies (when ``record_event``).

    Per view: a handful of metadata reads (no storage object, no ``str(device)``: the storage key is the data
    pointer less the view's offset, the device name is cached). Per storage: one uint8 view of its span. Per
    snapshot: one allocation, one split into destination views, one copy launch (two for pinned host copies of
    at most ``_STAGE_LIMIT`` bytes)."""
    # per storage key: [start, end, anchor tensor, views as (position in found, storage offset), ...]
    groups: dict[tuple[str, int], list[Any]] = {}
    names = _DEVICE_NAMES
    first_device = found[0].device
    several_devices = False
    for position, tensor in enumerate(found):
        itemsize = tensor.element_size()
        offset: int = tensor.storage_offset()  # type: ignore[assignment]  # never symbolic here
        start = offset * itemsize
        numel = tensor.numel()
        if numel == 0:
            end = start
        elif tensor.is_contiguous():
            end = start + numel * itemsize
        else:
            last = offset
            for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
                last += (size - 1) * stride
            end = (last + 1) * itemsize
        device = tensor.device
        name = names.get(device)
        if name is None:
            name = _device_name(device)
        if device != first_device:
            several_devices = True
        key = (name, tensor.data_ptr() - start)
        group = groups.get(key)
        if group is None:
            groups[key] = [start, end, tensor, position, offset]
        else:
            if start < group[0]:
                group[0] = start
            if end > group[1]:
                group[1] = end
            group.append(position)
            group.append(offset)
    if several_devices:
        return _copy_per_device(found, result, to_host=to_host, record_event=record_event)
    copies: list[Any] = [None] * len(found)
    spans: list[tuple[Any, int, int]] = []  # (anchor, start, end) per storage
    sizes: list[int] = []
    total = 0
    copied = 0
    for group in groups.values():
        start = group[0] - group[0] % SPAN_ALIGNMENT
        group[0] = start
        size = group[1] - start
        padded = -(-size // SPAN_ALIGNMENT) * SPAN_ALIGNMENT
        spans.append((group[2], start, group[1]))
        sizes.append(size)
        sizes.append(padded - size)
        total += padded
        copied += size
    result.copied = copied
    device = first_device
    cuda = device.type == "cuda"
    pinned = cuda and to_host
    staged = pinned and total <= _STAGE_LIMIT and len(spans) > 1
    on_device = device.type != "cpu" and (not to_host or staged)
    flat = torch.empty(
        total, dtype=torch.uint8, device=device if on_device else "cpu", pin_memory=pinned and not staged
    )
    single = len(spans) == 1 and sizes[1] == 0
    targets = [flat] if single else flat.split_with_sizes(sizes)[0::2]
    sources = _span_views(spans, device)
    if len(sources) > 1 and not (pinned and not staged):
        torch._foreach_copy_(targets, sources)  # one multi-tensor kernel launch
    else:
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source, non_blocking=pinned)
    if staged:
        host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        targets = [host] if single else host.split_with_sizes(sizes)[0::2]
    for (key, group), data in zip(groups.items(), targets, strict=True):
        base = group[0]
        name = key[0]
        for index in range(3, len(group), 2):
            tensor = found[group[index]]
            copies[group[index]] = TensorCopy(
                tensor.dtype, tuple(tensor.shape), tensor.stride(), group[index + 1], name, key, base, data
            )
    if cuda and record_event:
        result.event = record_cuda_event(device)
    return copies


def _copy_per_device(
    found: list[torch.Tensor], result: Snapshot, *, to_host: bool, record_event: bool
) -> list[TensorCopy]:
    """Tensors on several devices: one copy per device (rare: a call's arguments normally share one)."""
    by_device: dict[torch.device, list[int]] = {}
    for position, tensor in enumerate(found):
        by_device.setdefault(tensor.device, []).append(position)
    copies: list[Any] = [None] * len(found)
    events = []
    copied = 0
    for positions in by_device.values():
        part = Snapshot({})
        part_copies = _copy([found[p] for p in positions], part, to_host=to_host, record_event=record_event)
        copied += part.copied
        if part.event is not None:
            events.append(part.event)
        for position, copy in zip(positions, part_copies, strict=True):
            copies[position] = copy
    result.copied = copied
    if events:
        result.event = events[-1] if len(events) == 1 else _EventGroup(events)
    return copies


class _EventGroup:
    """Several devices' events behind the one ``synchronize`` a snapshot offers."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()

    def query(self) -> bool:
        return all(event.query() for event in self.events)


class _ViewPool(threading.local):
    """Per thread and device: uint8 tensors re-pointed (``set_``) at each snapshot's source spans, so a span
    view costs one ``set_`` instead of an empty tensor plus a ``set_``. A pooled view keeps the last storage
    it named alive until the next snapshot of the thread re-points it (the recorder keeps inputs alive that
    long anyway)."""

    def __init__(self) -> None:
        self.views: dict[torch.device, list[torch.Tensor]] = {}


_POOL = _ViewPool()


def _span_views(spans: list[tuple[torch.Tensor, int, int]], device: torch.device) -> list[torch.Tensor]:
    """One uint8 view of bytes ``[start, end)`` of each ``(tensor, start, end)``'s storage (no copy)."""
    pool = _POOL.views.get(device)
    if pool is None:
        pool = _POOL.views[device] = []
    while len(pool) < len(spans):
        pool.append(torch.empty(0, dtype=torch.uint8, device=device))
    views = []
    for view, (tensor, start, end) in zip(pool, spans, strict=False):
        view.set_(tensor.untyped_storage(), start, (end - start,), (1,))
        views.append(view)
    return views


_STREAMS: dict[tuple[int, int], Any] = {}


def current_stream(device_index: int) -> Any:
    """``torch.cuda.current_stream(device_index)`` without building a Stream object per call: the current raw
    stream handle is read (cheap) and the Stream object for it cached (a stream's handle and object do not
    change while it exists; a recycled handle is the stream it names now, so caching by handle stays right)."""
    raw = torch._C._cuda_getCurrentRawStream(device_index)
    key = (device_index, raw)
    stream = _STREAMS.get(key)
    if stream is None:
        stream = torch.cuda.current_stream(device_index)
        if len(_STREAMS) > 256:
            _STREAMS.clear()
        _STREAMS[key] = stream
    return stream


def record_cuda_event(device: torch.device | None = None, *, timing: bool = False) -> Any:
    """A CUDA event recorded now on ``device``'s (default: the current device's) current stream, without a
    ``torch.cuda.current_stream()`` call per event."""
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    event = torch.cuda.Event(enable_timing=timing)
    torch._C._CudaEventBase.record(event, current_stream(index))
    return event


def _fill(tree: Any, copies: list[TensorCopy]) -> Any:
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


def is_view_of_any(result: Any, outputs: Any) -> bool:
    """Whether ``result`` is one of the recorded output buffers or a view of one (then it is not copied again:
    vLLM's wrappers return ``output`` or ``output.view(...)``)."""
    if not isinstance(result, torch.Tensor):
        return False
    for value in outputs:
        if result is value:
            return True
        if (
            isinstance(value, torch.Tensor)
            and result.device == value.device
            and result.numel()
            and result.untyped_storage().data_ptr() == value.untyped_storage().data_ptr()
        ):
            return True
    return False
