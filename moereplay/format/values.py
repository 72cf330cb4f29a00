"""Value trees ↔ msgpack: how argument values are written and read back.

msgpack holds None, bool, int (−2⁶³ … 2⁶⁴−1), float (float64, so nan/inf/−0.0 survive), str, bytes, lists and
maps natively. Everything else is a msgpack *extension* value whose payload is itself a msgpack document:

====  ==========  ========================================================================================
code  name        payload
====  ==========  ========================================================================================
1     tuple       array of values (tuples stay tuples)
2     tensor      map ``dt`` dtype name, ``is`` item size, ``sh`` shape, ``st`` stride, ``of`` storage
                  offset (elements), ``dev`` device, ``sid`` call-local storage id, ``cj`` conj bit
3     enum        ``[qualified class name, member name, value]``
4     dtype       canonical dtype name (``"float8_e4m3fn"``)
5     device      ``str(device)``
6     codec       ``[qualified type name, value tree]``
7     unsupported ``[qualified type name, repr excerpt]``
8     bigint      decimal string of an int outside msgpack's 64-bit range
9     set         array of values
10    frozenset   array of values
11    size        array of ints (``torch.Size``)
====  ==========  ========================================================================================

Map keys may be any hashable value (str and int in practice). Types are matched exactly: a subclass of a
builtin container (``OrderedDict``, a namedtuple) needs a codec, or it is recorded as unsupported.

Importing this module does not import torch, and neither does reading a tree without dtype, device or size
values (tensors decode to :class:`TensorMeta`): listing a capture stays free of torch's import cost. Decoding a
dtype, device or ``torch.Size`` imports torch then.
"""

from __future__ import annotations

import enum
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack

from moereplay.errors import UnsupportedValueError
from moereplay.format.codecs import codec_for, enum_for, qualified_name
from moereplay.format.dtypes import ITEMSIZES, dtype_name
from moereplay.format.schema import CodecValue, EnumValue, TensorBytes, TensorMeta, Unsupported

if TYPE_CHECKING:
    import torch


class Ext(enum.IntEnum):
    TUPLE = 1
    TENSOR = 2
    ENUM = 3
    DTYPE = 4
    DEVICE = 5
    CODEC = 6
    UNSUPPORTED = 7
    BIGINT = 8
    SET = 9
    FROZENSET = 10
    SIZE = 11


MAX_DEPTH = 64
"""Deepest value tree the writer records (deeper, or cyclic, values raise UnsupportedValueError)."""
REPR_EXCERPT = 200
"""Characters of ``repr`` kept for an unsupported value."""
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1

TensorHook = Callable[["torch.Tensor | TensorBytes"], "dict[str, Any] | Unsupported"]
"""Called by the encoder for each tensor: the tensor payload map, or an Unsupported marker."""


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _ext(code: Ext, payload: Any) -> msgpack.ExtType:
    return msgpack.ExtType(int(code), _pack(payload))


def _repr_excerpt(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as error:  # a broken __repr__ must not break recording
        text = f"<repr failed: {type(error).__name__}>"
    return text if len(text) <= REPR_EXCERPT else text[: REPR_EXCERPT - 1] + "…"


def unsupported(value: Any) -> Unsupported:
    return Unsupported(qualified_name(type(value)), _repr_excerpt(value))


def to_wire(value: Any, tensor_hook: TensorHook | None, depth: int = 0) -> Any:
    """Convert a value tree to msgpack-native values (extension values for everything else).

    ``tensor_hook`` is None where tensors are not allowed (call context): they become Unsupported.
    """
    if depth > MAX_DEPTH:
        raise UnsupportedValueError(f"value nested deeper than {MAX_DEPTH} levels (cyclic?)")
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is bytes or kind is float:
        return value
    if kind is int:
        return value if _INT_MIN <= value <= _INT_MAX else _ext(Ext.BIGINT, str(value))
    deeper = depth + 1
    if kind is list:
        return [to_wire(item, tensor_hook, deeper) for item in value]
    if kind is dict:
        return {
            to_wire(key, tensor_hook, deeper): to_wire(item, tensor_hook, deeper)
            for key, item in value.items()
        }
    if kind is tuple:
        return _ext(Ext.TUPLE, [to_wire(item, tensor_hook, deeper) for item in value])
    codec = codec_for(qualified_name(kind))
    if codec is not None:
        try:
            tree = codec.encode(value)
        except Exception as error:
            raise UnsupportedValueError(
                f"codec for {codec.type_name} failed to encode a value: {type(error).__name__}: {error}"
            ) from error
        return _ext(Ext.CODEC, [codec.type_name, to_wire(tree, tensor_hook, deeper)])
    # Without torch imported no tensor, dtype, device or Size can exist, so the checks need not import it.
    torch_module = sys.modules.get("torch")
    if kind is TensorBytes or (torch_module is not None and isinstance(value, torch_module.Tensor)):
        if tensor_hook is None:
            return _unsupported_wire(Unsupported("torch.Tensor", "tensors are not allowed here"))
        payload = tensor_hook(value)
        if isinstance(payload, Unsupported):
            return _unsupported_wire(payload)
        return _ext(Ext.TENSOR, payload)
    if isinstance(value, enum.Enum):
        return _ext(Ext.ENUM, [qualified_name(kind), value.name, to_wire(value.value, None, deeper)])
    if torch_module is not None:
        if kind is torch_module.dtype:
            return _ext(Ext.DTYPE, dtype_name(value))
        if kind is torch_module.device:
            return _ext(Ext.DEVICE, str(value))
        if kind is torch_module.Size:
            return _ext(Ext.SIZE, list(value))
    if kind is set or kind is frozenset:
        code = Ext.SET if kind is set else Ext.FROZENSET
        return _ext(code, [to_wire(item, tensor_hook, deeper) for item in value])
    if kind is Unsupported:
        return _unsupported_wire(value)
    if kind is CodecValue:
        return _ext(Ext.CODEC, [value.type_name, to_wire(value.value, tensor_hook, deeper)])
    if kind is EnumValue:
        return _ext(Ext.ENUM, [value.type_name, value.name, to_wire(value.value, None, deeper)])
    return _unsupported_wire(unsupported(value))


def _unsupported_wire(marker: Unsupported) -> msgpack.ExtType:
    return _ext(Ext.UNSUPPORTED, [marker.type_name, marker.repr_excerpt])


# ----------------------------------------------------------------------------------------------- reading


class WireError(ValueError):
    """Malformed extension payload (turned into CaptureFileError by the reader)."""


_nesting = threading.local()
"""Extension values nest through this hook and msgpack's C code: counted here, because a deep enough file
would otherwise overflow the C stack before Python's recursion limit notices."""


def _unpack(payload: bytes) -> Any:
    depth = getattr(_nesting, "depth", 0)
    if depth >= MAX_DEPTH + 8:
        raise WireError(f"extension values nested deeper than {MAX_DEPTH + 8} levels")
    _nesting.depth = depth + 1
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False, ext_hook=ext_hook)
    finally:
        _nesting.depth = depth


def _ints(value: Any, what: str, *, limit: int = 64) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > limit:
        raise WireError(f"{what} is not a list of at most {limit} ints")
    for item in value:
        if type(item) is not int or item < 0:
            raise WireError(f"{what} holds {item!r}, not a non-negative int")
    return tuple(value)


MAX_TENSOR_BYTES = 2**50
"""Largest tensor (elements × item size, zero-size dimensions left out) or storage extent a record may describe;
far past any real allocation, small enough that torch's 64-bit size arithmetic cannot overflow."""


def _tensor_meta(payload: Any) -> TensorMeta:
    if not isinstance(payload, dict):
        raise WireError("tensor payload is not a map")
    dtype, itemsize, offset = payload.get("dt"), payload.get("is"), payload.get("of")
    device, storage = payload.get("dev"), payload.get("sid")
    if not isinstance(dtype, str) or len(dtype) > 64:
        raise WireError("tensor dtype is not a short string")
    if type(itemsize) is not int or not 1 <= itemsize <= 64:
        raise WireError(f"tensor item size {itemsize!r} is out of range")
    if type(offset) is not int or offset < 0 or type(storage) is not int or storage < 0:
        raise WireError("tensor storage offset or id is not a non-negative int")
    if not isinstance(device, str) or len(device) > 64:
        raise WireError("tensor device is not a short string")
    shape = _ints(payload.get("sh"), "tensor shape")
    stride = _ints(payload.get("st"), "tensor stride")
    if len(shape) != len(stride):
        raise WireError("tensor shape and stride differ in length")
    known = ITEMSIZES.get(dtype)
    if known is not None and known != itemsize:
        raise WireError(f"tensor dtype {dtype} has item size {known}, the file says {itemsize}")
    elements = 1
    for size in shape:
        elements *= max(size, 1)  # a zero dimension does not make the others harmless to torch
        if elements * itemsize > MAX_TENSOR_BYTES:
            raise WireError(f"tensor shape {list(shape)} is over {MAX_TENSOR_BYTES} bytes")
    if any(step > MAX_TENSOR_BYTES for step in stride):
        raise WireError(f"tensor stride {list(stride)} is out of range")
    reach = offset + sum((size - 1) * step for size, step in zip(shape, stride, strict=True) if size)
    if reach * itemsize > MAX_TENSOR_BYTES:
        raise WireError(
            f"tensor stride {list(stride)} and offset {offset} reach past {MAX_TENSOR_BYTES} bytes"
        )
    return TensorMeta(dtype, itemsize, shape, stride, offset, device, storage, payload.get("cj") is True)


def _pair(payload: Any, what: str, length: int) -> list[Any]:
    if not isinstance(payload, list) or len(payload) != length or not isinstance(payload[0], str):
        raise WireError(f"{what} payload is malformed")
    return payload


def ext_hook(code: int, data: bytes) -> Any:
    """msgpack ``ext_hook``: decode one extension value (tensors become :class:`TensorMeta`)."""
    payload = _unpack(data)
    if code == Ext.TUPLE:
        if not isinstance(payload, list):
            raise WireError("tuple payload is not an array")
        return tuple(payload)
    if code == Ext.TENSOR:
        return _tensor_meta(payload)
    if code == Ext.ENUM:
        type_name, name, value = _pair(payload, "enum", 3)
        enum_class = enum_for(type_name)
        if enum_class is not None:
            try:
                return enum_class(value)
            except (ValueError, TypeError):
                pass
        return EnumValue(type_name, str(name), value)
    if code == Ext.DTYPE:
        if not isinstance(payload, str):
            raise WireError("dtype payload is not a string")
        from moereplay.format.tensors import DTYPES  # imports torch: only trees holding dtypes pay for it

        dtype = DTYPES.get(payload)
        return dtype if dtype is not None else Unsupported("torch.dtype", payload[:REPR_EXCERPT])
    if code == Ext.DEVICE:
        if not isinstance(payload, str) or len(payload) > 64:
            raise WireError("device payload is not a short string")
        import torch

        try:
            return torch.device(payload)
        except (RuntimeError, ValueError) as error:
            raise WireError(f"bad device {payload!r}") from error
    if code == Ext.CODEC:
        type_name, value = _pair(payload, "codec", 2)
        return CodecValue(type_name, value)
    if code == Ext.UNSUPPORTED:
        type_name, excerpt = _pair(payload, "unsupported", 2)
        return Unsupported(type_name, str(excerpt))
    if code == Ext.BIGINT:
        if not isinstance(payload, str) or len(payload) > 4000:
            raise WireError("bigint payload is not a short decimal string")
        return int(payload)
    if code in (Ext.SET, Ext.FROZENSET):
        if not isinstance(payload, list):
            raise WireError("set payload is not an array")
        return set(payload) if code == Ext.SET else frozenset(payload)
    if code == Ext.SIZE:
        import torch

        return torch.Size(_ints(payload, "torch.Size", limit=4096))
    raise WireError(f"unknown extension type {code}")
