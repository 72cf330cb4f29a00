"""Helpers shared by the format tests: byte-level tensor comparison and record layouts of small files."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from moereplay.format.framing import Envelope, FrameSource, ReadLimits


def element_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of every element of ``tensor`` as a contiguous uint8 tensor of shape ``(*shape, itemsize)``.

    Works for every dtype (fp8, fp4x2, sub-byte, bits, complex) because it only copies uint8."""
    itemsize = tensor.element_size()
    raw = torch.empty(0, dtype=torch.uint8)
    raw.set_(
        tensor.untyped_storage(),
        tensor.storage_offset() * itemsize,
        (*tensor.shape, itemsize),
        (*(stride * itemsize for stride in tensor.stride()), 1),
    )
    return raw.clone(memory_format=torch.contiguous_format)


def view_over(storage: torch.Tensor, dtype: torch.dtype, shape, stride, offset: int) -> torch.Tensor:
    """A view of ``dtype`` over the uint8 tensor ``storage``'s storage (offset in elements of ``dtype``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental"
        view = torch.empty(0, dtype=dtype)
        view.set_(storage.untyped_storage(), offset, tuple(shape), tuple(stride))
    return view


def same_storage(first: torch.Tensor, second: torch.Tensor) -> bool:
    return first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()


def record_layout(path: Path) -> list[Envelope]:
    """Every record envelope of a well-formed file, in file order."""
    source = FrameSource(path, ReadLimits())
    try:
        envelopes = []
        position = 0
        while position < source.size:
            envelope = source.envelope_at(position)
            envelopes.append(envelope)
            position = envelope.end
        return envelopes
    finally:
        source.close()
