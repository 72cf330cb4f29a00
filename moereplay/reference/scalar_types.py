"""vLLM ``ScalarType`` ids decoded without importing vLLM.

vLLM passes quantised element types to its kernels as one 64-bit integer (``ScalarType.id``) built by packing the
fields below from the least significant bit up (vLLM 0.25.1, ``vllm/scalar_type.py`` and
``csrc/core/scalar_type.hpp``):

===========  =====  ====================================================================
field        bits   meaning
===========  =====  ====================================================================
exponent      8     exponent bits of a floating type; 0 for integer types
mantissa      8     mantissa bits (float) or value bits without the sign bit (integer)
signed        1     has a sign bit
bias         32     stored = value + bias (GPTQ ``uint4b8`` stores ``q + 8``)
finite        1     finite values only (no infinities)
nan_repr      8     0 none, 1 IEEE 754, 2 extended range (NaN only at all-ones)
===========  =====  ====================================================================

vLLM's integer types keep the dataclass default ``nan_repr = IEEE 754``, so their ids carry ``1 << 50``; a decoder
that assumed 0 there would not recognise a single captured integer type.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from moereplay.errors import ReferenceError_

_FIELD_BITS: tuple[tuple[str, int], ...] = (
    ("exponent", 8),
    ("mantissa", 8),
    ("signed", 1),
    ("bias", 32),
    ("finite_values_only", 1),
    ("nan_repr", 8),
)


class NanRepr(enum.IntEnum):
    """How a floating type encodes NaN (the enum of ``csrc/core/scalar_type.hpp``)."""

    NONE = 0
    IEEE_754 = 1
    EXTD_RANGE_MAX_MIN = 2


@dataclass(frozen=True)
class ScalarType:
    """One vLLM scalar type: the fields its id packs, plus the name vLLM's ``scalar_types`` gives it."""

    exponent: int
    mantissa: int
    signed: bool
    bias: int = 0
    finite_values_only: bool = False
    nan_repr: NanRepr = NanRepr.IEEE_754

    def __post_init__(self) -> None:
        for name, bits in _FIELD_BITS:
            value = int(getattr(self, name))
            if not 0 <= value < (1 << bits):
                raise ReferenceError_(f"ScalarType field {name}={value} does not fit in {bits} bits")

    @property
    def id(self) -> int:
        """The 64-bit id vLLM passes to its custom ops."""
        value = 0
        offset = 0
        for name, bits in _FIELD_BITS:
            value |= (int(getattr(self, name)) & ((1 << bits) - 1)) << offset
            offset += bits
        return value

    @classmethod
    def from_id(cls, type_id: int) -> ScalarType:
        """Decode any well-formed id (known or not); see :func:`scalar_type_from_id` for the named lookup."""
        if not isinstance(type_id, int) or type_id < 0 or type_id >= (1 << 58):
            raise ReferenceError_(f"not a vLLM ScalarType id: {type_id!r}")
        fields: dict[str, int] = {}
        offset = 0
        for name, bits in _FIELD_BITS:
            fields[name] = (type_id >> offset) & ((1 << bits) - 1)
            offset += bits
        if fields["nan_repr"] not in {int(member) for member in NanRepr}:
            raise ReferenceError_(f"ScalarType id {type_id:#x} has an unknown NaN representation")
        return cls(
            exponent=fields["exponent"],
            mantissa=fields["mantissa"],
            signed=bool(fields["signed"]),
            bias=fields["bias"],
            finite_values_only=bool(fields["finite_values_only"]),
            nan_repr=NanRepr(fields["nan_repr"]),
        )

    @property
    def size_bits(self) -> int:
        """Storage width in bits."""
        return self.exponent + self.mantissa + int(self.signed)

    @property
    def is_floating_point(self) -> bool:
        return self.exponent != 0

    @property
    def is_integer(self) -> bool:
        return self.exponent == 0

    @property
    def name(self) -> str:
        """vLLM's attribute name in ``scalar_types`` (e.g. ``uint4b8``), or a descriptive one for unknown types."""
        known = _NAMES_BY_ID.get(self.id)
        if known is not None:
            return known
        if self.is_integer:
            base = f"{'int' if self.signed else 'uint'}{self.size_bits}"
            return base + (f"b{self.bias}" if self.bias else "")
        return f"float{self.size_bits}_e{self.exponent}m{self.mantissa}?"

    def __str__(self) -> str:
        return self.name


def _int(size_bits: int, bias: int = 0) -> ScalarType:
    return ScalarType(0, size_bits - 1, True, bias)


def _uint(size_bits: int, bias: int = 0) -> ScalarType:
    return ScalarType(0, size_bits, False, bias)


def _ieee(exponent: int, mantissa: int) -> ScalarType:
    return ScalarType(exponent, mantissa, True, 0, False, NanRepr.IEEE_754)


def _float(exponent: int, mantissa: int, finite_values_only: bool, nan_repr: NanRepr) -> ScalarType:
    return ScalarType(exponent, mantissa, True, 0, finite_values_only, nan_repr)


int4 = _int(4)
uint4 = _uint(4)
int8 = _int(8)
uint8 = _uint(8)
uint2b2 = _uint(2, 2)
uint3b4 = _uint(3, 4)
uint4b8 = _uint(4, 8)
uint5b16 = _uint(5, 16)
uint6b32 = _uint(6, 32)
uint7b64 = _uint(7, 64)
uint8b128 = _uint(8, 128)
float8_e4m3fn = _float(4, 3, True, NanRepr.EXTD_RANGE_MAX_MIN)
float8_e5m2 = _ieee(5, 2)
float8_e8m0fnu = ScalarType(8, 0, False, 0, True, NanRepr.EXTD_RANGE_MAX_MIN)
float16 = _ieee(5, 10)
bfloat16 = _ieee(8, 7)
float6_e3m2f = _float(3, 2, True, NanRepr.NONE)
float6_e2m3f = _float(2, 3, True, NanRepr.NONE)
float4_e2m1f = _float(2, 1, True, NanRepr.NONE)

#: Every type vLLM 0.25.1 names in ``vllm.scalar_type.scalar_types``, by that name.
KNOWN_TYPES: dict[str, ScalarType] = {
    "int4": int4,
    "uint4": uint4,
    "int8": int8,
    "uint8": uint8,
    "uint2b2": uint2b2,
    "uint3b4": uint3b4,
    "uint4b8": uint4b8,
    "uint5b16": uint5b16,
    "uint6b32": uint6b32,
    "uint7b64": uint7b64,
    "uint8b128": uint8b128,
    "float8_e4m3fn": float8_e4m3fn,
    "float8_e5m2": float8_e5m2,
    "float8_e8m0fnu": float8_e8m0fnu,
    "float16": float16,
    "bfloat16": bfloat16,
    "float6_e3m2f": float6_e3m2f,
    "float6_e2m3f": float6_e2m3f,
    "float4_e2m1f": float4_e2m1f,
}

_NAMES_BY_ID: dict[int, str] = {scalar_type.id: name for name, scalar_type in KNOWN_TYPES.items()}


def scalar_type_from_id(type_id: int) -> ScalarType:
    """The known vLLM scalar type with this id; anything else is a :class:`ReferenceError_`."""
    if isinstance(type_id, bool) or not isinstance(type_id, int):
        raise ReferenceError_(f"a ScalarType id must be an int, got {type(type_id).__name__}")
    if type_id not in _NAMES_BY_ID:
        raise ReferenceError_(f"unknown vLLM ScalarType id {type_id} ({type_id:#x})")
    return KNOWN_TYPES[_NAMES_BY_ID[type_id]]


def as_scalar_type(value: int | ScalarType | object) -> ScalarType:
    """Accept an id, one of ours, or any object with an integer ``id`` attribute (vLLM's own ``ScalarType``)."""
    if isinstance(value, ScalarType):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return scalar_type_from_id(value)
    type_id = getattr(value, "id", None)
    if isinstance(type_id, int) and not isinstance(type_id, bool):
        return scalar_type_from_id(type_id)
    raise ReferenceError_(f"cannot read a vLLM ScalarType from {type(value).__name__}")
