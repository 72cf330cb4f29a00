"""Dtype names and item sizes, without importing torch.

Listing a capture (``moereplay ls``/``info``, the TUI's call browser) decodes call records, whose tensors are
:class:`~moereplay.format.schema.TensorMeta` (a dtype *name* and an item size). Checking that the two agree must
not cost the ~200 MB and ~1 s of ``import torch``; this table is what torch 2.x reports for its dtypes
(``torch.<name>.itemsize``), kept in step with the installed torch by a unit test. Names it lacks (a dtype from a
newer torch) are checked against torch itself when the tensor is loaded (:mod:`moereplay.format.reader`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_BY_SIZE: dict[int, tuple[str, ...]] = {
    1: (
        "bool",
        "uint8",
        "int8",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
        "qint8",
        "quint8",
        "quint4x2",
        "quint2x4",
        "bits1x8",
        "bits2x4",
        "bits4x2",
        "bits8",
        *(f"uint{bits}" for bits in range(1, 8)),
        *(f"int{bits}" for bits in range(1, 8)),
    ),
    2: ("float16", "bfloat16", "int16", "uint16", "bits16"),
    4: ("float32", "int32", "uint32", "qint32", "complex32", "bcomplex32"),  # bcomplex32: torch 2.14
    8: ("float64", "int64", "uint64", "complex64"),
    16: ("complex128",),
}

ITEMSIZES: Mapping[str, int] = MappingProxyType(
    {name: size for size, names in _BY_SIZE.items() for name in names}
)
"""Canonical torch dtype name (``"float8_e4m3fn"``, as ``str(dtype)`` without ``torch.``) → bytes per element."""

LOADABLE: frozenset[str] = frozenset(name for name in ITEMSIZES if not name.startswith(("qint", "quint")))
"""The dtypes a reader materialises: a fixed allow-list, checked before torch sees a name from a file. Quantized
dtypes (``qint8`` …) are left out: their tensors carry a scale and zero point the format does not record, and torch
refuses to build them over raw bytes."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float8_e4m3fn`` → ``"float8_e4m3fn"`` (the canonical name, never an alias like ``half``)."""
    return str(dtype).removeprefix("torch.")
