"""The value-level types a reader hands out before (or instead of) materialising anything.

- :class:`TensorMeta` stands for a recorded tensor in a call's argument tree until ``load_args`` /
  ``load_outputs`` replaces it with a real tensor; listing and schema checks use it without reading blobs.
- :class:`Unsupported` marks a value that had no codec when it was recorded; replay refuses it.
- :class:`CodecValue` is an opaque object recorded through a codec, as its encoded value tree; loading turns it
  back into the object when a codec for ``type_name`` is registered, and leaves it as is otherwise.
- :class:`EnumValue` is an enum member whose class was not registered with ``register_enum`` when decoded.

:class:`CodecValue`, :class:`EnumValue` and :class:`Unsupported` may also be *given* to the writer (a capture
layer that ran the codecs itself); they are recorded as they are. So may :class:`TensorBytes`, a tensor the
caller already copied.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorMeta:
    """What was recorded about one tensor view: enough to list it and to rebuild it exactly.

    ``storage_offset`` and ``stride`` are in elements, as torch reports them, relative to the *original*
    storage. ``storage`` is the call-local storage id: two metas with the same id (among a call's arguments,
    or between its arguments and outputs) were views of one storage when recorded.
    """

    dtype: str
    itemsize: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    device: str
    storage: int
    conj: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Logical size: elements × item size (not the storage span)."""
        return self.numel * self.itemsize

    @property
    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def describe(self) -> str:
        """Short human form, e.g. ``bfloat16[64,2880]`` (``…@stride`` added for non-contiguous views)."""
        text = f"{self.dtype}[{','.join(str(size) for size in self.shape)}]"
        if not self.is_contiguous:
            text += f"@({','.join(str(stride) for stride in self.stride)})"
        return text

    def byte_span(self) -> tuple[int, int]:
        """``[start, end)`` in bytes of the original storage that this view touches (empty for numel 0)."""
        start = self.storage_offset * self.itemsize
        if self.numel == 0:
            return start, start
        last = self.storage_offset + sum(
            (size - 1) * stride for size, stride in zip(self.shape, self.stride, strict=True)
        )
        return start, (last + 1) * self.itemsize


@dataclass(frozen=True)
class Unsupported:
    """A value that could not be recorded: its qualified type name and the start of its ``repr``."""

    type_name: str
    repr_excerpt: str


@dataclass(frozen=True)
class CodecValue:
    """An opaque object recorded through the codec registered for ``type_name``; ``value`` is its value tree."""

    type_name: str
    value: Any


@dataclass(frozen=True)
class EnumValue:
    """An enum member whose class was not registered for decoding."""

    type_name: str
    name: str
    value: Any


@dataclass(frozen=True, eq=False)
class TensorBytes:
    """A tensor view the writer's caller has already copied: the original view's metadata plus the bytes
    ``[base, base + data.numel())`` of its original storage, in ``data`` (a 1-D contiguous uint8 tensor on
    any device; the writer copies it to the host).

    Pass it in an argument or output tree where the tensor was. ``storage`` identifies the original storage
    within one call (any hashable; equal values = views of one storage, also between ``begin_call`` and
    ``complete_call`` of the same call, which is how an in-place output is recorded as aliasing its input).
    All views of one storage in one tree must lie inside the first one's bytes. ``static_key``: an identity
    key for a weight; once the writer has stored bytes under a key, later ``TensorBytes`` with that key may
    have ``data=None`` and reuse them (no copy, no hash).
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    device: str
    storage: Hashable
    base: int
    data: torch.Tensor | None
    static_key: Hashable | None = None


def iter_tensor_metas(tree: Any, path: str = "") -> Iterator[tuple[str, TensorMeta]]:
    """Every :class:`TensorMeta` in a decoded value tree, with a readable path (``w1``, ``topk[0]``, ``cfg.x``).

    Codec values are entered (``routing<RoutingData>.gather``) so their tensors are listed too.
    """
    if isinstance(tree, TensorMeta):
        yield path, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            name = str(key)
            yield from iter_tensor_metas(value, f"{path}.{name}" if path else name)
    elif isinstance(tree, (list, tuple)):
        for position, value in enumerate(tree):
            yield from iter_tensor_metas(value, f"{path}[{position}]")
    elif isinstance(tree, CodecValue):
        short = tree.type_name.rsplit(".", 1)[-1]
        yield from iter_tensor_metas(tree.value, f"{path}<{short}>")
