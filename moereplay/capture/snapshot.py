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


def format_codec(kind: type) -> tuple[str, Callable[[Any], Any]] | None:
    """The format registry's codec for ``kind`` (ops modules register theirs there)."""
    codec = codec_for(qualified_type_name(kind))
    return None if codec is None else (codec.type_name, codec.encode)


def snapshot(
    values: dict[str, Any],
    static_names: Iterable[str] = (),
    *,
    to_host: bool = True,
    codec_lookup: CodecLookup = format_codec,
    keep: list[torch.Tensor] | None = None,
) -> Snapshot:
    """Copy ``values`` (argument name → value) as described in the module docstring.

    ``keep``: when given, every copied original tensor is appended to it; hold the list until the call's
    outputs are copied (their storage keys are only unambiguous while these storages live).
    """
    static = frozenset(static_names)
    found: list[torch.Tensor] = []
    tree: dict[str, Any] = {}
    for name, value in values.items():
        if name in static:
            tree[name] = _walk_static(value, codec_lookup, 0)
        else:
            tree[name] = _walk(value, found, codec_lookup, 0)
    result = Snapshot(tree)
    if found:
        copies = _copy(found, result, to_host=to_host)
        result.tree = {name: _fill(item, copies) for name, item in tree.items()}
        if keep is not None:
            keep.extend(found)
    return result


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


def _copy(found: list[torch.Tensor], result: Snapshot, *, to_host: bool) -> list[TensorCopy]:
    """Copy each storage once (the union of its views' spans, from a 256-byte boundary); record one CUDA
    event after all copies."""
    groups: dict[tuple[str, int], list[int]] = {}
    for position, tensor in enumerate(found):
        groups.setdefault(storage_key(tensor), []).append(position)
    copies: list[Any] = [None] * len(found)
    cuda = False
    ranges: list[tuple[int, int]] = []
    sources: list[torch.Tensor] = []
    for positions in groups.values():
        spans = [byte_span(found[p]) for p in positions]
        start = span_start(min(s for s, _ in spans))
        end = max(e for _, e in spans)
        anchor = found[positions[0]]
        ranges.append((start, end))
        sources.append(_raw_bytes(anchor, start, end))
        cuda = cuda or anchor.is_cuda
        result.copied += end - start
    copied = copy_spans(sources, to_host=to_host)
    for (key, positions), (start, _end), data in zip(groups.items(), ranges, copied, strict=True):
        for position in positions:
            tensor = found[position]
            copies[position] = TensorCopy(
                dtype=tensor.dtype,
                shape=tuple(tensor.shape),
                stride=tuple(tensor.stride()),
                storage_offset=int(tensor.storage_offset()),
                device=key[0],
                storage=key,
                base=start,
                data=data,
            )
    if cuda:
        event = torch.cuda.Event()
        event.record()
        result.event = event
    return copies


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
