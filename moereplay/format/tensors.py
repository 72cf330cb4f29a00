"""Tensors ↔ storage spans: what the writer records about a view, and how a reader rebuilds it.

Recording: a tensor is (dtype name, item size, shape, stride, storage offset, device, storage id) plus the bytes
of the part of its storage the view touches — from its first element to one past its last, *not* a contiguous
copy — so a transposed or strided view comes back with the same strides. Views that share a storage within a
call share one storage id; the bytes stored for that storage are the union of their spans, widened downwards
to a multiple of :data:`SPAN_ALIGNMENT` bytes so every view's offset stays a whole number of its elements and
data pointers keep their alignment modulo 256 bytes.

Dtypes are handled generically: by name (``str(dtype)`` without ``torch.``) and item size, so every dtype
torch has — float8 variants, ``float8_e8m0fnu``, ``float4_e2m1fn_x2``, the sub-byte ``uint1..7``/``int1..7``,
``bits*`` and complex — round-trips bit-exactly. Quantized (``qint8`` …), sparse, nested and meta tensors are
recorded as :class:`~moereplay.format.schema.Unsupported`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from moereplay.format.dtypes import ITEMSIZES, dtype_name
from moereplay.format.schema import TensorMeta

SPAN_ALIGNMENT = 256
"""Stored storage spans start at a multiple of this many bytes of the original storage."""


def _dtype_table() -> dict[str, torch.dtype]:
    table: dict[str, torch.dtype] = {}
    for (
        name
    ) in ITEMSIZES:  # a fixed list: getattr on names from elsewhere would import torch's lazy submodules
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype) and dtype_name(value) == name:
            table[name] = value
    return table


DTYPES: Mapping[str, torch.dtype] = _dtype_table()
"""Every dtype of :data:`~moereplay.format.dtypes.ITEMSIZES` this torch has, by canonical name."""


def torch_dtype(name: object) -> torch.dtype | None:
    """The torch dtype a name from a file stands for (``"bfloat16"``, ``"torch.bfloat16"``), or ``None``.

    Only names of the fixed table are looked up: ``getattr(torch, name)`` with a name read from a file would import
    whatever lazy submodule torch has under that name (``_inductor``, ``onnx``) before rejecting it.
    """
    if not isinstance(name, str):
        return None
    return DTYPES.get(name.removeprefix("torch."))


def unsupported_reason(tensor: torch.Tensor) -> str | None:
    """Why ``tensor`` cannot be recorded as bytes (``None`` when it can)."""
    if tensor.layout is not torch.strided:
        return f"layout {tensor.layout}"
    if tensor.is_quantized:
        return "quantized tensor (scale/zero point not recorded)"
    if tensor.is_nested:
        return "nested tensor"
    if tensor.device.type == "meta":
        return "meta tensor (no data)"
    if tensor.is_neg():
        return "tensor with the negative bit set"
    if any(stride < 0 for stride in tensor.stride()):
        return "negative stride"
    return None


def span_start(start: int) -> int:
    """Where a stored span begins for views starting at byte ``start``."""
    return start - start % SPAN_ALIGNMENT


def storage_span_to_host(tensor: torch.Tensor, start: int, end: int) -> memoryview:
    """Bytes ``[start, end)`` of ``tensor``'s storage, on the host.

    CPU storages are not copied (the view is valid while the tensor lives); other devices are copied to host
    synchronously (for CUDA this waits for the work queued on the current stream).
    """
    storage = tensor.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    raw.set_(storage, start, (end - start,), (1,))
    if raw.device.type != "cpu":
        raw = raw.cpu()
    return raw.numpy().data.cast("B")


def empty_buffer(length: int) -> torch.Tensor:
    return torch.empty(length, dtype=torch.uint8)


def view_of(buffer: torch.Tensor, base: int, meta: TensorMeta, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``meta``'s dtype, shape and stride over ``buffer`` (which holds the original storage's
    bytes from ``base`` on). Callers have checked the view lies inside the buffer."""
    start, _ = meta.byte_span()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 and friends warn that they are experimental
        view = torch.empty(0, dtype=dtype, device=buffer.device)
        if meta.numel == 0:
            view.set_(
                torch.empty(0, dtype=torch.uint8, device=buffer.device).untyped_storage(),
                0,
                meta.shape,
                meta.stride,
            )
        else:
            view.set_(buffer.untyped_storage(), (start - base) // meta.itemsize, meta.shape, meta.stride)
        if meta.conj:
            view = view.conj()
    return view
