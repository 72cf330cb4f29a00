"""Codecs for the opaque arguments of triton_kernels' ``matmul_ogs``, and the plain specs they decode to.

``matmul_ogs`` takes library objects, not just tensors: a layout-wrapped weight (``triton_kernels.tensor.Tensor``
over a ``Storage`` whose bytes are *already swizzled* for the GPU), ``RoutingData`` with its ``ExptData``,
``GatherIndx`` / ``ScatterIndx``, a ``PrecisionConfig`` holding the swizzled weight scales and flex data,
``FusedActivation`` / ``Epilogue`` naming Triton device functions. Each codec here turns one of these into a
*value tree* — dicts, lists, ``None``/``bool``/``int``/``float``/``str`` and ``torch.Tensor`` leaves — and back.

Why the trees hold the *storage* tensor and the layout's parameters, never unswizzled data: replay must hand the
kernel exactly the bytes it read in production, and the guard bands the replay engine puts around every tensor
leaf must sit right after the swizzled buffer the kernel indexes (an unmasked load of swizzled scales past their
end must land in the guard band). So decoding rebuilds ``Storage(data=<that very tensor>, layout=<same params>)``
without calling ``swizzle_data``; no bytes are copied.

Decoding has two targets:

- ``backend`` given (the GPU machine, triton_kernels importable through the backend): the real triton_kernels
  objects, ready for ``matmul_ogs``;
- ``backend=None``: moereplay's plain, frozen specs below (:class:`LayoutTensor`, :class:`RoutingSpec`, …) that
  the fp32 reference and the findings read. Plain specs encode back to the same trees, so ``encode`` accepts
  either the library object or its spec.

Safety: decoding never imports a module named by the file except Triton device functions under the
``triton_kernels.`` package (``FnSpecs.fn``), and constructs only the fixed set of classes named here.
Encoding is cheap (no copies, no device syncs): it runs inside the serving process.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from moereplay.errors import PackError, UnsupportedValueError
from moereplay.ops.surface import LibraryValueError

TRITON_KERNELS = "triton_kernels"
VENDORED_TRITON_KERNELS = "vllm.third_party.triton_kernels"
"""vLLM ships triton_kernels at this path and aliases it as ``triton_kernels`` in ``sys.modules``."""

LayoutKind = Literal[
    "STRIDED", "HOPPER_VALUE", "HOPPER_SCALE", "BLACKWELL_VALUE", "BLACKWELL_SCALE", "CDNA4_SCALE"
]

_LAYOUT_CLASSES: dict[str, str] = {
    "STRIDED": "StridedLayout",
    "HOPPER_VALUE": "HopperMXValueLayout",
    "HOPPER_SCALE": "HopperMXScaleLayout",
    "BLACKWELL_VALUE": "BlackwellMXValueLayout",
    "BLACKWELL_SCALE": "BlackwellMXScaleLayout",
    "CDNA4_SCALE": "CDNA4MXScaleLayout",
}
"""Layout kind (the class's ``name`` attribute; ``None`` → STRIDED) → class in ``tensor_details.layout``."""

LOGICAL_FP4 = "fp4"
LOGICAL_BIT = "bit"


# --------------------------------------------------------------------------------------------------------------
# plain specs (what decoding without triton_kernels gives)
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayoutSpec:
    """A triton_kernels storage layout, by kind and constructor parameters.

    ``initial_shape``: the unswizzled shape the layout was built for (for MXFP4 values: bytes, two e2m1 per byte).
    ``mx_axis`` (Hopper value/scale), ``num_warps`` (Hopper scale: the swizzle is a handshake with the kernel's
    warp count), ``mma_version`` (Hopper value) are ``None`` for kinds without them.
    """

    kind: LayoutKind
    initial_shape: tuple[int, ...]
    mx_axis: int | None = None
    num_warps: int | None = None
    mma_version: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _LAYOUT_CLASSES:
            raise ValueError(f"unknown layout kind {self.kind!r}")
        if self.kind in ("HOPPER_VALUE", "HOPPER_SCALE") and self.mx_axis is None:
            raise ValueError(f"{self.kind} layout needs mx_axis")
        if self.kind == "HOPPER_SCALE" and (self.num_warps is None or self.num_warps & (self.num_warps - 1)):
            raise ValueError("HOPPER_SCALE layout needs a power-of-two num_warps")

    @property
    def swizzled(self) -> bool:
        return self.kind != "STRIDED"


@dataclass(frozen=True)
class LayoutTensor:
    """A ``triton_kernels.tensor.Tensor``: the storage exactly as the kernel reads it, plus its meaning.

    ``storage`` is the (possibly transposed) view the library keeps in ``Storage.data``; ``dtype`` is the logical
    element type (``"fp4"``, ``"bit"`` or a torch dtype name such as ``"uint8"``); ``shape`` the logical shape
    (for fp4 it counts elements, not bytes).
    """

    storage: torch.Tensor
    layout: LayoutSpec
    dtype: str
    shape: tuple[int, ...]
    shape_max: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype for a byte-or-wider logical type; ``None`` for fp4 / bit."""
        return None if self.dtype in (LOGICAL_FP4, LOGICAL_BIT) else _torch_dtype(self.dtype)


@dataclass(frozen=True)
class ExptDataSpec:
    """``ExptData``: per-expert histogram and offsets, and per-``block_m`` tile maps (``block_m → tensor``)."""

    hist: torch.Tensor | None
    token_offs_raw: torch.Tensor | None
    token_offs_pad: Mapping[int, torch.Tensor] | None
    block_pid_map: Mapping[int, torch.Tensor] | None

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """The ``block_m`` values this routing was prepared for (the kernel can only run with these)."""
        if self.block_pid_map is None:
            return ()
        return tuple(sorted(self.block_pid_map))


@dataclass(frozen=True)
class RoutingSpec:
    """``RoutingData``: ``gate_scal`` (routing weights in expert-sorted order), histogram, expert counts."""

    gate_scal: torch.Tensor | None
    expt_hist: torch.Tensor | None
    n_expts_tot: int
    n_expts_act: int
    expt_data: ExptDataSpec | None = None
    expected_tokens_per_expt: int | None = None


@dataclass(frozen=True)
class GatherSpec:
    """``GatherIndx``: row ``i`` of the expert-sorted input is flat (token, slot) index ``src_indx[i]``."""

    src_indx: torch.Tensor
    dst_indx: torch.Tensor


@dataclass(frozen=True)
class ScatterSpec:
    """``ScatterIndx``: expert-sorted row ``i`` goes to flat (token, slot) index ``dst_indx[i]``."""

    src_indx: torch.Tensor
    dst_indx: torch.Tensor


@dataclass(frozen=True)
class FlexDataSpec:
    """``InFlexData`` (``scale``) or ``OutFlexData`` (``expected_scale`` / ``actual_scale`` / ``checksum_scale``)."""

    direction: Literal["in", "out"]
    dtype: str | None = None
    scale: torch.Tensor | None = None
    expected_scale: torch.Tensor | None = None
    actual_scale: torch.Tensor | None = None
    checksum_scale: torch.Tensor | None = None

    @property
    def is_identity(self) -> bool:
        """No reinterpretation and no scales: the flex data changes nothing."""
        return all(
            v is None
            for v in (self.dtype, self.scale, self.expected_scale, self.actual_scale, self.checksum_scale)
        )


@dataclass(frozen=True)
class FlexCtxSpec:
    lhs_data: FlexDataSpec = FlexDataSpec("in")
    rhs_data: FlexDataSpec = FlexDataSpec("in")
    out_data: FlexDataSpec = FlexDataSpec("out")


@dataclass(frozen=True)
class PrecisionSpec:
    """``PrecisionConfig``. ``weight_scale`` is a :class:`LayoutTensor` when swizzled (Hopper MXFP4 scales)."""

    max_num_imprecise_acc: int | None = None
    allow_tf32: bool = True
    flex_ctx: FlexCtxSpec = FlexCtxSpec()
    acc_scale: float = 1.0
    flexpoint_saturate_inf: bool = False
    act_scale: torch.Tensor | LayoutTensor | None = None
    weight_scale: torch.Tensor | LayoutTensor | None = None
    out_scale: torch.Tensor | LayoutTensor | None = None
    out_dtype: str | None = None
    enforce_bitwise_invariance: bool = False


@dataclass(frozen=True)
class FnSpec:
    """``FnSpecs``: a Triton device function by module and name (``None`` for the default "no function")."""

    name: str
    fn_module: str | None
    fn_name: str | None
    fn_arg_names: tuple[str, ...] = ()
    fn_arg_do_not_specialize: tuple[str, ...] = ()

    @property
    def is_default(self) -> bool:
        return self.fn_name is None


DEFAULT_FN = FnSpec("dflt", None, None)


@dataclass(frozen=True)
class ActivationSpec:
    """``FusedActivation``: e.g. gpt-oss's swiglu with ``fn_args = (alpha, limit)`` and ``reduction_n = 2``."""

    specs: FnSpec = DEFAULT_FN
    fn_args: tuple[Any, ...] = ()
    reduction_n: int = 1


@dataclass(frozen=True)
class EpilogueSpec:
    """``Epilogue``: a device function applied at write-back (``None`` effective itemsize = the output's)."""

    specs: FnSpec = DEFAULT_FN
    fn_arg_values_matmul: tuple[Any, ...] = ()
    fn_arg_values_finalize: tuple[Any, ...] = ()
    effective_itemsize: float | None = None


PlainSpec = (
    LayoutTensor | RoutingSpec | GatherSpec | ScatterSpec | PrecisionSpec | ActivationSpec | EpilogueSpec
)


# --------------------------------------------------------------------------------------------------------------
# small value helpers
# --------------------------------------------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def _is_type(value: Any, name: str) -> bool:
    """Whether ``value``'s class (or a base) is the triton_kernels class ``name`` (from any import path).

    Matching by name, not identity, because the library may be imported as ``triton_kernels`` or as
    ``vllm.third_party.triton_kernels`` (two distinct module objects with the same classes).
    """
    key = (type(value), name)
    found = _IS_TYPE.get(key)
    if found is None:
        found = _IS_TYPE[key] = any(
            kind.__qualname__ == name
            and (
                kind.__module__.startswith(TRITON_KERNELS + ".")
                or kind.__module__.startswith(VENDORED_TRITON_KERNELS + ".")
            )
            for kind in type(value).__mro__
        )
    return found


_IS_TYPE: dict[tuple[type, str], bool] = {}  # (type, class name) -> _is_type's answer (classes do not change)


def _torch_dtype(name: str) -> torch.dtype:
    from moereplay.format.tensors import torch_dtype  # a fixed table: no getattr(torch, <file text>)

    value = torch_dtype(name)
    if value is None:
        raise UnsupportedValueError(f"{str(name)[:64]!r} is not a torch dtype")
    return value


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _int_list(values: Any, what: str) -> list[Any]:
    """Shapes: ints, or (for ragged tensors) one-element tensors, kept as tensor leaves."""
    out: list[Any] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            out.append(int(value))
        else:
            raise UnsupportedValueError(f"{what} entry {value!r} is neither an int nor a tensor")
    return out


def _shape_tuple(values: Any) -> tuple[int, ...]:
    return tuple(int(v.item()) if isinstance(v, torch.Tensor) else int(v) for v in values)


def _require_mapping(data: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise UnsupportedValueError(f"recorded {what} is not a mapping")
    return data


def _field(data: Mapping[str, Any], key: str, what: str) -> Any:
    if key not in data:
        raise UnsupportedValueError(f"recorded {what} lacks {key!r}")
    return data[key]


def _tensor_or_none(value: Any, what: str) -> torch.Tensor | None:
    if value is None or isinstance(value, torch.Tensor):
        return value
    raise UnsupportedValueError(f"recorded {what} is not a tensor")


def _scalar(value: Any, what: str) -> Any:
    """fn args and similar: plain scalars or tensors pass through; anything else is refused."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return value
    raise UnsupportedValueError(f"{what} {value!r} ({_type_name(value)}) is not a plain scalar or tensor")


# --------------------------------------------------------------------------------------------------------------
# the library, through a backend
# --------------------------------------------------------------------------------------------------------------


class TritonKernels:
    """The triton_kernels modules as one backend imports them (``module(name)`` of the ``KernelBackend``).

    vLLM 0.25.1 vendors the library as ``vllm.third_party.triton_kernels`` and, at first use, aliases it as
    ``triton_kernels`` in ``sys.modules`` (its own ``import_triton_kernels``); the library's files import each
    other as ``triton_kernels.*``. We do the same aliasing when only the vendored copy is importable, so that the
    classes we build are the very classes ``matmul_ogs`` checks with ``isinstance``.
    """

    def __init__(self, importer: Callable[[str], types.ModuleType]) -> None:
        self._importer = importer
        self._cache: dict[str, types.ModuleType] = {}

    @classmethod
    def from_backend(cls, backend: Any) -> TritonKernels:
        return cls(backend.module)

    @classmethod
    def installed(cls) -> TritonKernels:
        """The copy importable in this process (tests on the GPU machine)."""
        return cls(importlib.import_module)

    def module(self, name: str) -> types.ModuleType:
        """``name`` relative to the package, e.g. ``"matmul_ogs"`` or ``"tensor_details.layout"``."""
        cached = self._cache.get(name)
        if cached is not None:
            return cached
        full = f"{TRITON_KERNELS}.{name}" if name else TRITON_KERNELS
        try:
            module = self._importer(full)
        except ImportError:
            if TRITON_KERNELS in sys.modules:
                raise
            vendored = self._importer(VENDORED_TRITON_KERNELS)
            sys.modules.setdefault(TRITON_KERNELS, vendored)
            module = self._importer(full)
        self._cache[name] = module
        return module

    def attr(self, module: str, name: str) -> Any:
        return getattr(self.module(module), name)


# --------------------------------------------------------------------------------------------------------------
# layout-wrapped tensors
# --------------------------------------------------------------------------------------------------------------


def _layout_kind(layout: Any) -> LayoutKind:
    name = getattr(layout, "name", None)
    kind = "STRIDED" if name is None else str(name)
    if kind not in _LAYOUT_CLASSES:
        raise UnsupportedValueError(f"triton_kernels layout {_type_name(layout)} ({kind}) has no codec")
    return kind  # type: ignore[return-value]


def _logical_dtype_name(dtype: Any) -> str:
    if isinstance(dtype, torch.dtype):
        return _dtype_name(dtype)
    if _is_type(dtype, "FloatType"):
        if (dtype.bitwidth_exponent, dtype.bitwidth_mantissa, dtype.is_signed) == (2, 1, True):
            return LOGICAL_FP4
    elif _is_type(dtype, "IntegerType") and dtype.bitwidth == 1:
        return LOGICAL_BIT
    raise UnsupportedValueError(f"triton_kernels element type {dtype!r} has no codec")


def encode_layout(layout: LayoutSpec | Any) -> dict[str, Any]:
    if isinstance(layout, LayoutSpec):
        spec = layout
    else:
        kind = _layout_kind(layout)
        spec = LayoutSpec(
            kind=kind,
            initial_shape=tuple(int(s) for s in layout.initial_shape),
            mx_axis=getattr(layout, "mx_axis", None) if kind in ("HOPPER_VALUE", "HOPPER_SCALE") else None,
            num_warps=getattr(layout, "num_warps", None) if kind == "HOPPER_SCALE" else None,
            mma_version=getattr(layout, "mma_version", None) if kind == "HOPPER_VALUE" else None,
        )
    return {
        "kind": spec.kind,
        "initial_shape": list(spec.initial_shape),
        "mx_axis": spec.mx_axis,
        "num_warps": spec.num_warps,
        "mma_version": spec.mma_version,
    }


def decode_layout_spec(data: Any) -> LayoutSpec:
    tree = _require_mapping(data, "layout")
    try:
        return LayoutSpec(
            kind=_field(tree, "kind", "layout"),
            initial_shape=tuple(int(s) for s in _field(tree, "initial_shape", "layout")),
            mx_axis=tree.get("mx_axis"),
            num_warps=tree.get("num_warps"),
            mma_version=tree.get("mma_version"),
        )
    except (TypeError, ValueError) as error:
        raise UnsupportedValueError(f"recorded layout is malformed: {error}") from error


def build_layout(spec: LayoutSpec, library: TritonKernels) -> Any:
    """The real layout object, constructed (not re-swizzling anything) from its parameters."""
    cls = library.attr("tensor_details.layout", _LAYOUT_CLASSES[spec.kind])
    shape = list(spec.initial_shape)
    if spec.kind == "HOPPER_VALUE":
        return cls(
            shape, mx_axis=spec.mx_axis, mma_version=3 if spec.mma_version is None else spec.mma_version
        )
    if spec.kind == "HOPPER_SCALE":
        return cls(shape, mx_axis=spec.mx_axis, num_warps=spec.num_warps)
    return cls(shape)


def encode_layout_tensor(value: LayoutTensor | Any) -> dict[str, Any]:
    """A ``triton_kernels.tensor.Tensor`` (or its :class:`LayoutTensor`) → tree. The storage tensor is kept as is."""
    if isinstance(value, LayoutTensor):
        return {
            "storage": value.storage,
            "layout": encode_layout(value.layout),
            "dtype": value.dtype,
            "shape": list(value.shape),
            "shape_max": list(value.shape_max),
        }
    if not _is_type(value, "Tensor"):
        raise UnsupportedValueError(f"{_type_name(value)} is not a triton_kernels Tensor")
    storage = value.storage
    data = storage.data if _is_type(storage, "Storage") else storage
    if not isinstance(data, torch.Tensor):
        raise UnsupportedValueError("triton_kernels Tensor storage holds no torch tensor")
    layout = storage.layout if _is_type(storage, "Storage") else None
    layout_tree = (
        encode_layout(layout)
        if layout is not None
        else encode_layout(LayoutSpec("STRIDED", tuple(int(s) for s in data.shape)))
    )
    return {
        "storage": data,
        "layout": layout_tree,
        "dtype": _logical_dtype_name(value.dtype),
        "shape": _int_list(value.shape, "shape"),
        "shape_max": _int_list(value.shape_max, "shape_max"),
    }


def decode_layout_tensor_spec(data: Any) -> LayoutTensor:
    tree = _require_mapping(data, "layout tensor")
    storage = _field(tree, "storage", "layout tensor")
    if not isinstance(storage, torch.Tensor):
        raise UnsupportedValueError("recorded layout tensor storage is not a tensor")
    dtype = str(_field(tree, "dtype", "layout tensor"))
    if dtype not in (LOGICAL_FP4, LOGICAL_BIT):
        _torch_dtype(dtype)
    shape = _shape_tuple(_field(tree, "shape", "layout tensor"))
    shape_max = _shape_tuple(tree.get("shape_max") or shape)
    return LayoutTensor(
        storage, decode_layout_spec(_field(tree, "layout", "layout tensor")), dtype, shape, shape_max
    )


def build_layout_tensor(spec: LayoutTensor, library: TritonKernels) -> Any:
    """The real ``Tensor(Storage(spec.storage, layout))``: the storage tensor object itself, no copy."""
    tensor_module = library.module("tensor")
    if spec.dtype == LOGICAL_FP4:
        dtype: Any = tensor_module.FP4
    elif spec.dtype == LOGICAL_BIT:
        dtype = tensor_module.BIT
    else:
        dtype = _torch_dtype(spec.dtype)
    storage = tensor_module.Storage(spec.storage, build_layout(spec.layout, library))
    return tensor_module.Tensor(storage, dtype=dtype, shape=list(spec.shape), shape_max=list(spec.shape_max))


def encode_maybe_wrapped(value: Any, what: str) -> Any:
    """A field that may be ``None``, a torch tensor (kept as is) or a layout-wrapped tensor (its tree)."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    return encode_layout_tensor(value)


def decode_maybe_wrapped_spec(data: Any, what: str) -> torch.Tensor | LayoutTensor | None:
    if data is None or isinstance(data, (torch.Tensor, LayoutTensor)):
        return data
    return decode_layout_tensor_spec(_require_mapping(data, what))


def build_maybe_wrapped(value: torch.Tensor | LayoutTensor | None, library: TritonKernels) -> Any:
    return build_layout_tensor(value, library) if isinstance(value, LayoutTensor) else value


# --------------------------------------------------------------------------------------------------------------
# routing, gather, scatter
# --------------------------------------------------------------------------------------------------------------


def _block_dict(pairs: Any, what: str) -> dict[int, torch.Tensor] | None:
    if pairs is None:
        return None
    if not isinstance(pairs, Sequence):
        raise UnsupportedValueError(f"recorded {what} is not a list of (block, tensor) pairs")
    out: dict[int, torch.Tensor] = {}
    for pair in pairs:
        if (
            not isinstance(pair, Sequence)
            or len(pair) != 2
            or type(pair[0]) is not int
            or not isinstance(pair[1], torch.Tensor)
        ):
            raise UnsupportedValueError(f"recorded {what} entry is not a (block, tensor) pair")
        out[int(pair[0])] = pair[1]
    return out


def encode_routing(value: RoutingSpec | Any) -> dict[str, Any]:
    return collect_routing(value, _same)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    """The leaf of an encode: the tensor itself (``collect`` with it is ``encode``)."""
    return tensor


def _leaf_or_none(value: Any, what: str, leaf: Callable[[Any], Any]) -> Any:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return leaf(value)
    raise UnsupportedValueError(f"recorded {what} is not a tensor")


def _block_map(mapping: Any, what: str, leaf: Callable[[Any], Any]) -> list[list[Any]] | None:
    if mapping is None:
        return None
    return [
        [int(block), _leaf_or_none(tensor, what, leaf)] for block, tensor in sorted(dict(mapping).items())
    ]


def collect_routing(value: RoutingSpec | Any, leaf: Callable[[Any], Any]) -> dict[str, Any]:
    """:func:`encode_routing` with each tensor passed through ``leaf``, in the order a walk of its tree meets
    them (the format's ``Codec.collect``)."""
    if not isinstance(value, RoutingSpec) and not _is_type(value, "RoutingData"):
        raise UnsupportedValueError(f"{_type_name(value)} is not a triton_kernels RoutingData")
    gate_scal = _leaf_or_none(value.gate_scal, "routing gate_scal", leaf)
    expt_hist = _leaf_or_none(value.expt_hist, "routing expt_hist", leaf)
    n_expts_tot = int(value.n_expts_tot)
    n_expts_act = int(value.n_expts_act)
    expt_data = value.expt_data
    expt_tree = None
    if expt_data is not None:
        expt_tree = {
            "hist": _leaf_or_none(expt_data.hist, "expt_data.hist", leaf),
            "token_offs_raw": _leaf_or_none(expt_data.token_offs_raw, "expt_data.token_offs_raw", leaf),
            "token_offs_pad": _block_map(expt_data.token_offs_pad, "expt_data.token_offs_pad", leaf),
            "block_pid_map": _block_map(expt_data.block_pid_map, "expt_data.block_pid_map", leaf),
        }
    expected = value.expected_tokens_per_expt
    return {
        "gate_scal": gate_scal,
        "expt_hist": expt_hist,
        "n_expts_tot": n_expts_tot,
        "n_expts_act": n_expts_act,
        "expt_data": expt_tree,
        "expected_tokens_per_expt": None if expected is None else int(expected),
    }


def routing_tensors(value: RoutingSpec | Any, append: Callable[[Any], Any]) -> None:
    """``append`` each tensor :func:`collect_routing` would pass to its leaf, in its order, building no tree (the
    layer flight recorder's per-call walk; the tree is built from the object at a trigger)."""
    if not isinstance(value, RoutingSpec) and not _is_type(value, "RoutingData"):
        raise UnsupportedValueError(f"{_type_name(value)} is not a triton_kernels RoutingData")
    _leaf_or_none(value.gate_scal, "routing gate_scal", append)
    _leaf_or_none(value.expt_hist, "routing expt_hist", append)
    expt_data = value.expt_data
    if expt_data is not None:
        _leaf_or_none(expt_data.hist, "expt_data.hist", append)
        _leaf_or_none(expt_data.token_offs_raw, "expt_data.token_offs_raw", append)
        for mapping, what in (
            (expt_data.token_offs_pad, "expt_data.token_offs_pad"),
            (expt_data.block_pid_map, "expt_data.block_pid_map"),
        ):
            if mapping is not None:
                for _block, tensor in sorted(dict(mapping).items()):
                    _leaf_or_none(tensor, what, append)


def decode_routing_spec(data: Any) -> RoutingSpec:
    tree = _require_mapping(data, "routing data")
    expt = tree.get("expt_data")
    expt_spec = None
    if expt is not None:
        expt = _require_mapping(expt, "expt_data")
        expt_spec = ExptDataSpec(
            hist=_tensor_or_none(expt.get("hist"), "expt_data.hist"),
            token_offs_raw=_tensor_or_none(expt.get("token_offs_raw"), "expt_data.token_offs_raw"),
            token_offs_pad=_block_dict(expt.get("token_offs_pad"), "expt_data.token_offs_pad"),
            block_pid_map=_block_dict(expt.get("block_pid_map"), "expt_data.block_pid_map"),
        )
    expected = tree.get("expected_tokens_per_expt")
    return RoutingSpec(
        gate_scal=_tensor_or_none(tree.get("gate_scal"), "routing gate_scal"),
        expt_hist=_tensor_or_none(tree.get("expt_hist"), "routing expt_hist"),
        n_expts_tot=int(_field(tree, "n_expts_tot", "routing data")),
        n_expts_act=int(_field(tree, "n_expts_act", "routing data")),
        expt_data=expt_spec,
        expected_tokens_per_expt=None if expected is None else int(expected),
    )


def build_routing(spec: RoutingSpec, library: TritonKernels) -> Any:
    routing = library.module("routing")
    expt_data = None
    if spec.expt_data is not None:
        e = spec.expt_data
        expt_data = routing.ExptData(
            e.hist,
            e.token_offs_raw,
            None if e.token_offs_pad is None else dict(e.token_offs_pad),
            None if e.block_pid_map is None else dict(e.block_pid_map),
        )
    return routing.RoutingData(
        spec.gate_scal,
        spec.expt_hist,
        spec.n_expts_tot,
        spec.n_expts_act,
        expt_data,
        expected_tokens_per_expt=spec.expected_tokens_per_expt,
    )


def _encode_index(value: Any, plain: type, library_name: str) -> dict[str, Any]:
    return _collect_index(value, plain, library_name, _same)


def _collect_index(value: Any, plain: type, library_name: str, leaf: Callable[[Any], Any]) -> dict[str, Any]:
    if not isinstance(value, plain) and not _is_type(value, library_name):
        raise UnsupportedValueError(f"{_type_name(value)} is not a triton_kernels {library_name}")
    return {
        "src_indx": _leaf_or_none(value.src_indx, f"{library_name}.src_indx", leaf),
        "dst_indx": _leaf_or_none(value.dst_indx, f"{library_name}.dst_indx", leaf),
    }


def gather_tensors(value: GatherSpec | Any, append: Callable[[Any], Any]) -> None:
    _collect_index(value, GatherSpec, "GatherIndx", append)  # two entries: its tree costs next to nothing


def scatter_tensors(value: ScatterSpec | Any, append: Callable[[Any], Any]) -> None:
    _collect_index(value, ScatterSpec, "ScatterIndx", append)


def collect_gather(value: GatherSpec | Any, leaf: Callable[[Any], Any]) -> dict[str, Any]:
    return _collect_index(value, GatherSpec, "GatherIndx", leaf)


def collect_scatter(value: ScatterSpec | Any, leaf: Callable[[Any], Any]) -> dict[str, Any]:
    return _collect_index(value, ScatterSpec, "ScatterIndx", leaf)


def encode_gather(value: GatherSpec | Any) -> dict[str, Any]:
    return _encode_index(value, GatherSpec, "GatherIndx")


def encode_scatter(value: ScatterSpec | Any) -> dict[str, Any]:
    return _encode_index(value, ScatterSpec, "ScatterIndx")


def _index_tensors(data: Any, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    tree = _require_mapping(data, what)
    src = _tensor_or_none(_field(tree, "src_indx", what), f"{what}.src_indx")
    dst = _tensor_or_none(_field(tree, "dst_indx", what), f"{what}.dst_indx")
    if src is None or dst is None:
        raise UnsupportedValueError(f"recorded {what} lacks its index tensors")
    return src, dst


def decode_gather_spec(data: Any) -> GatherSpec:
    return GatherSpec(*_index_tensors(data, "GatherIndx"))


def decode_scatter_spec(data: Any) -> ScatterSpec:
    return ScatterSpec(*_index_tensors(data, "ScatterIndx"))


def build_gather(spec: GatherSpec, library: TritonKernels) -> Any:
    return library.module("routing").GatherIndx(src_indx=spec.src_indx, dst_indx=spec.dst_indx)


def build_scatter(spec: ScatterSpec, library: TritonKernels) -> Any:
    return library.module("routing").ScatterIndx(src_indx=spec.src_indx, dst_indx=spec.dst_indx)


# --------------------------------------------------------------------------------------------------------------
# precision config
# --------------------------------------------------------------------------------------------------------------


def _encode_flex(value: Any, direction: Literal["in", "out"]) -> dict[str, Any]:
    if isinstance(value, FlexDataSpec):
        spec = value
    else:
        expected = "InFlexData" if direction == "in" else "OutFlexData"
        if not _is_type(value, expected):
            raise UnsupportedValueError(f"{_type_name(value)} is not a triton_kernels {expected}")
        dtype = value.dtype
        if direction == "in":
            spec = FlexDataSpec("in", None if dtype is None else _dtype_name(dtype), scale=value.scale)
        else:
            spec = FlexDataSpec(
                "out",
                None if dtype is None else _dtype_name(dtype),
                expected_scale=value.expected_scale,
                actual_scale=value.actual_scale,
                checksum_scale=value.checksum_scale,
            )
    tree: dict[str, Any] = {"dtype": spec.dtype}
    if direction == "in":
        tree["scale"] = _tensor_or_none(spec.scale, "flex scale")
    else:
        tree["expected_scale"] = _tensor_or_none(spec.expected_scale, "flex expected_scale")
        tree["actual_scale"] = _tensor_or_none(spec.actual_scale, "flex actual_scale")
        tree["checksum_scale"] = _tensor_or_none(spec.checksum_scale, "flex checksum_scale")
    return tree


def _decode_flex_spec(data: Any, direction: Literal["in", "out"]) -> FlexDataSpec:
    if data is None:
        return FlexDataSpec(direction)
    tree = _require_mapping(data, "flex data")
    dtype = tree.get("dtype")
    if dtype is not None:
        _torch_dtype(str(dtype))
    if direction == "in":
        return FlexDataSpec("in", dtype, scale=_tensor_or_none(tree.get("scale"), "flex scale"))
    return FlexDataSpec(
        "out",
        dtype,
        expected_scale=_tensor_or_none(tree.get("expected_scale"), "flex expected_scale"),
        actual_scale=_tensor_or_none(tree.get("actual_scale"), "flex actual_scale"),
        checksum_scale=_tensor_or_none(tree.get("checksum_scale"), "flex checksum_scale"),
    )


def _build_flex(spec: FlexDataSpec, library: TritonKernels) -> Any:
    numerics = library.module("numerics")
    dtype = None if spec.dtype is None else _torch_dtype(spec.dtype)
    if spec.direction == "in":
        return numerics.InFlexData(dtype=dtype, scale=spec.scale)
    return numerics.OutFlexData(
        dtype=dtype,
        expected_scale=spec.expected_scale,
        actual_scale=spec.actual_scale,
        checksum_scale=spec.checksum_scale,
    )


_PRECISION_FIELDS = (
    "max_num_imprecise_acc",
    "allow_tf32",
    "flex_ctx",
    "acc_scale",
    "flexpoint_saturate_inf",
    "report_quantization_err_fn",
    "act_scale",
    "weight_scale",
    "out_scale",
    "out_dtype",
    "enforce_bitwise_invariance",
)
"""The fields of vLLM 0.25.1's vendored PrecisionConfig; an unknown extra field set to a non-default is refused."""


def encode_precision(value: PrecisionSpec | Any) -> dict[str, Any]:
    if isinstance(value, PrecisionSpec):
        flex = value.flex_ctx
        return {
            "max_num_imprecise_acc": value.max_num_imprecise_acc,
            "allow_tf32": value.allow_tf32,
            "flex_ctx": {
                "lhs_data": _encode_flex(flex.lhs_data, "in"),
                "rhs_data": _encode_flex(flex.rhs_data, "in"),
                "out_data": _encode_flex(flex.out_data, "out"),
            },
            "acc_scale": value.acc_scale,
            "flexpoint_saturate_inf": value.flexpoint_saturate_inf,
            "act_scale": encode_maybe_wrapped(value.act_scale, "act_scale"),
            "weight_scale": encode_maybe_wrapped(value.weight_scale, "weight_scale"),
            "out_scale": encode_maybe_wrapped(value.out_scale, "out_scale"),
            "out_dtype": value.out_dtype,
            "enforce_bitwise_invariance": value.enforce_bitwise_invariance,
        }
    if not _is_type(value, "PrecisionConfig"):
        raise UnsupportedValueError(f"{_type_name(value)} is not a triton_kernels PrecisionConfig")
    if dataclasses.is_dataclass(value):
        for field in dataclasses.fields(value):
            if field.name not in _PRECISION_FIELDS and getattr(value, field.name) != field.default:
                raise UnsupportedValueError(f"PrecisionConfig field {field.name!r} is set and has no codec")
    if getattr(value, "report_quantization_err_fn", None) is not None:
        raise UnsupportedValueError(
            "PrecisionConfig.report_quantization_err_fn (a Python callable) cannot be recorded"
        )
    flex = value.flex_ctx
    out_dtype = value.out_dtype
    acc_scale = value.acc_scale
    return {
        "max_num_imprecise_acc": None
        if value.max_num_imprecise_acc is None
        else int(value.max_num_imprecise_acc),
        "allow_tf32": bool(value.allow_tf32),
        "flex_ctx": {
            "lhs_data": _encode_flex(flex.lhs_data, "in"),
            "rhs_data": _encode_flex(flex.rhs_data, "in"),
            "out_data": _encode_flex(flex.out_data, "out"),
        },
        "acc_scale": acc_scale if isinstance(acc_scale, torch.Tensor) else float(acc_scale),
        "flexpoint_saturate_inf": bool(value.flexpoint_saturate_inf),
        "act_scale": encode_maybe_wrapped(value.act_scale, "act_scale"),
        "weight_scale": encode_maybe_wrapped(value.weight_scale, "weight_scale"),
        "out_scale": encode_maybe_wrapped(value.out_scale, "out_scale"),
        "out_dtype": None if out_dtype is None else _dtype_name(out_dtype),
        "enforce_bitwise_invariance": bool(getattr(value, "enforce_bitwise_invariance", False)),
    }


def decode_precision_spec(data: Any) -> PrecisionSpec:
    tree = _require_mapping(data, "precision config")
    flex_tree = _require_mapping(tree.get("flex_ctx") or {}, "flex_ctx")
    out_dtype = tree.get("out_dtype")
    if out_dtype is not None:
        _torch_dtype(str(out_dtype))
    max_imprecise = tree.get("max_num_imprecise_acc")
    return PrecisionSpec(
        max_num_imprecise_acc=None if max_imprecise is None else int(max_imprecise),
        allow_tf32=bool(tree.get("allow_tf32", True)),
        flex_ctx=FlexCtxSpec(
            lhs_data=_decode_flex_spec(flex_tree.get("lhs_data"), "in"),
            rhs_data=_decode_flex_spec(flex_tree.get("rhs_data"), "in"),
            out_data=_decode_flex_spec(flex_tree.get("out_data"), "out"),
        ),
        acc_scale=tree.get("acc_scale", 1.0),
        flexpoint_saturate_inf=bool(tree.get("flexpoint_saturate_inf", False)),
        act_scale=decode_maybe_wrapped_spec(tree.get("act_scale"), "act_scale"),
        weight_scale=decode_maybe_wrapped_spec(tree.get("weight_scale"), "weight_scale"),
        out_scale=decode_maybe_wrapped_spec(tree.get("out_scale"), "out_scale"),
        out_dtype=None if out_dtype is None else str(out_dtype),
        enforce_bitwise_invariance=bool(tree.get("enforce_bitwise_invariance", False)),
    )


def build_precision(spec: PrecisionSpec, library: TritonKernels) -> Any:
    matmul = library.module("matmul_ogs")
    flex = matmul.FlexCtx(
        lhs_data=_build_flex(spec.flex_ctx.lhs_data, library),
        rhs_data=_build_flex(spec.flex_ctx.rhs_data, library),
        out_data=_build_flex(spec.flex_ctx.out_data, library),
    )
    return matmul.PrecisionConfig(
        max_num_imprecise_acc=spec.max_num_imprecise_acc,
        allow_tf32=spec.allow_tf32,
        flex_ctx=flex,
        acc_scale=spec.acc_scale,
        flexpoint_saturate_inf=spec.flexpoint_saturate_inf,
        act_scale=build_maybe_wrapped(spec.act_scale, library),
        weight_scale=build_maybe_wrapped(spec.weight_scale, library),
        out_scale=build_maybe_wrapped(spec.out_scale, library),
        out_dtype=None if spec.out_dtype is None else _torch_dtype(spec.out_dtype),
        enforce_bitwise_invariance=spec.enforce_bitwise_invariance,
    )


# --------------------------------------------------------------------------------------------------------------
# fused activation and epilogue (Triton device functions by name)
# --------------------------------------------------------------------------------------------------------------


def _function_location(fn: Any) -> tuple[str, str]:
    """(module, name) of a Triton JITFunction, normalised to the ``triton_kernels.`` package path."""
    inner = getattr(fn, "fn", fn)
    module = getattr(inner, "__module__", None)
    name = getattr(inner, "__name__", None)
    if not isinstance(module, str) or not isinstance(name, str):
        raise UnsupportedValueError(f"device function {fn!r} has no module/name")
    if module.startswith(VENDORED_TRITON_KERNELS + "."):
        module = TRITON_KERNELS + module[len(VENDORED_TRITON_KERNELS) :]
    if not module.startswith(TRITON_KERNELS + "."):
        raise UnsupportedValueError(
            f"device function {module}.{name} is outside triton_kernels; moereplay only replays library functions"
        )
    return module, name


def encode_fn_specs(value: FnSpec | Any) -> dict[str, Any]:
    if isinstance(value, FnSpec):
        spec = value
    else:
        if not _is_type(value, "FnSpecs"):
            raise UnsupportedValueError(f"{_type_name(value)} is not a triton_kernels FnSpecs")
        if value.fn is None:
            module, name = None, None
        else:
            module, name = _function_location(value.fn)
        spec = FnSpec(
            name=str(value.name),
            fn_module=module,
            fn_name=name,
            fn_arg_names=tuple(str(n) for n in value.fn_arg_names),
            fn_arg_do_not_specialize=tuple(str(n) for n in getattr(value, "fn_arg_do_not_specialize", ())),
        )
    return {
        "name": spec.name,
        "fn_module": spec.fn_module,
        "fn_name": spec.fn_name,
        "fn_arg_names": list(spec.fn_arg_names),
        "fn_arg_do_not_specialize": list(spec.fn_arg_do_not_specialize),
    }


def decode_fn_spec(data: Any) -> FnSpec:
    if data is None:
        return DEFAULT_FN
    tree = _require_mapping(data, "FnSpecs")
    module = tree.get("fn_module")
    name = tree.get("fn_name")
    if (module is None) != (name is None):
        raise UnsupportedValueError("recorded FnSpecs names half a function")
    if module is not None and not str(module).startswith(TRITON_KERNELS + "."):
        raise UnsupportedValueError(f"recorded device function module {module!r} is outside triton_kernels")
    return FnSpec(
        name=str(_field(tree, "name", "FnSpecs")),
        fn_module=None if module is None else str(module),
        fn_name=None if name is None else str(name),
        fn_arg_names=tuple(str(n) for n in tree.get("fn_arg_names", ())),
        fn_arg_do_not_specialize=tuple(str(n) for n in tree.get("fn_arg_do_not_specialize", ())),
    )


def build_fn_specs(spec: FnSpec, library: TritonKernels) -> Any:
    matmul = library.module("matmul_ogs")
    if spec.is_default:
        return matmul.FnSpecs.default()
    assert spec.fn_module is not None and spec.fn_name is not None
    module = library.module(spec.fn_module[len(TRITON_KERNELS) + 1 :])
    fn = getattr(module, spec.fn_name, None)
    if fn is None or not hasattr(fn, "fn"):
        raise UnsupportedValueError(
            f"{spec.fn_module}.{spec.fn_name} is not a Triton function of this library"
        )
    return matmul.FnSpecs(spec.name, fn, spec.fn_arg_names, spec.fn_arg_do_not_specialize)


def encode_activation(value: ActivationSpec | Any) -> dict[str, Any]:
    if not isinstance(value, ActivationSpec) and not _is_type(value, "FusedActivation"):
        raise UnsupportedValueError(f"{_type_name(value)} is not a triton_kernels FusedActivation")
    return {
        "specs": encode_fn_specs(value.specs),
        "fn_args": [_scalar(a, "fused activation argument") for a in value.fn_args],
        "reduction_n": int(value.reduction_n),
    }


def decode_activation_spec(data: Any) -> ActivationSpec:
    tree = _require_mapping(data, "FusedActivation")
    return ActivationSpec(
        specs=decode_fn_spec(tree.get("specs")),
        fn_args=tuple(_scalar(a, "fused activation argument") for a in tree.get("fn_args", ())),
        reduction_n=int(tree.get("reduction_n", 1)),
    )


def build_activation(spec: ActivationSpec, library: TritonKernels) -> Any:
    matmul = library.module("matmul_ogs")
    return matmul.FusedActivation(build_fn_specs(spec.specs, library), tuple(spec.fn_args), spec.reduction_n)


def encode_epilogue(value: EpilogueSpec | Any) -> dict[str, Any]:
    if not isinstance(value, EpilogueSpec) and not _is_type(value, "Epilogue"):
        raise UnsupportedValueError(f"{_type_name(value)} is not a triton_kernels Epilogue")
    itemsize = value.effective_itemsize
    return {
        "specs": encode_fn_specs(value.specs),
        "fn_arg_values_matmul": [_scalar(a, "epilogue argument") for a in value.fn_arg_values_matmul],
        "fn_arg_values_finalize": [_scalar(a, "epilogue argument") for a in value.fn_arg_values_finalize],
        "effective_itemsize": None if itemsize is None else float(itemsize),
    }


def decode_epilogue_spec(data: Any) -> EpilogueSpec:
    tree = _require_mapping(data, "Epilogue")
    itemsize = tree.get("effective_itemsize")
    return EpilogueSpec(
        specs=decode_fn_spec(tree.get("specs")),
        fn_arg_values_matmul=tuple(
            _scalar(a, "epilogue argument") for a in tree.get("fn_arg_values_matmul", ())
        ),
        fn_arg_values_finalize=tuple(
            _scalar(a, "epilogue argument") for a in tree.get("fn_arg_values_finalize", ())
        ),
        effective_itemsize=None if itemsize is None else float(itemsize),
    )


def build_epilogue(spec: EpilogueSpec, library: TritonKernels) -> Any:
    matmul = library.module("matmul_ogs")
    return matmul.Epilogue(
        build_fn_specs(spec.specs, library),
        tuple(spec.fn_arg_values_matmul),
        tuple(spec.fn_arg_values_finalize),
        spec.effective_itemsize,
    )


# --------------------------------------------------------------------------------------------------------------
# weights: a torch tensor or a layout-wrapped one
# --------------------------------------------------------------------------------------------------------------


def encode_weight(value: Any) -> Any:
    """``matmul_ogs``'s ``w``: a plain torch tensor (bf16/fp8, or uint8 meaning fp4) or a layout-wrapped Tensor."""
    tree = encode_maybe_wrapped(value, "w")
    if tree is None:
        raise UnsupportedValueError("matmul_ogs weight is None")
    return tree


def decode_weight_spec(data: Any) -> torch.Tensor | LayoutTensor:
    value = decode_maybe_wrapped_spec(data, "weight")
    if value is None:
        raise UnsupportedValueError("recorded matmul_ogs weight is empty")
    return value


# --------------------------------------------------------------------------------------------------------------
# codec objects (ops.base.ValueCodec) and plain <-> library conversion
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeCodec:
    """One opaque type: ``encode`` → value tree; ``decode`` → library object (backend) or plain spec (None).

    ``type_names``: the library class names this codec accepts (matched under both import paths).
    """

    name: str
    type_names: tuple[str, ...]
    encode_tree: Callable[[Any], Any]
    decode_tree: Callable[[Any], Any]
    build: Callable[[Any, TritonKernels], Any]
    plain_types: tuple[type, ...]
    collect_tree: Callable[[Any, Callable[[Any], Any]], Any] | None = None  # encode + walk in one pass
    collect_tensors: Callable[[Any, Callable[[Any], Any]], None] | None = None  # collect_tree's tensors only

    def encode(self, value: Any) -> Any:
        return self.encode_tree(value)

    def decode_plain(self, data: Any) -> Any:
        """A value tree → the plain spec; any malformation is an ``UnsupportedValueError`` naming the codec."""
        try:
            return self.decode_tree(data)
        except UnsupportedValueError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as error:
            raise UnsupportedValueError(f"recorded {self.name} is malformed: {error}") from error

    def decode(self, data: Any, *, backend: Any | None = None) -> Any:
        """A value tree (or an already decoded plain spec, or a format ``CodecValue`` holding a tree) → the
        library object through ``backend``, or the plain spec when ``backend`` is ``None``."""
        if hasattr(data, "type_name") and hasattr(data, "value") and not isinstance(data, torch.Tensor):
            data = data.value
        spec = data if isinstance(data, self.plain_types) else self.decode_plain(data)
        if backend is None:
            return spec
        return self.build(spec, TritonKernels.from_backend(backend))

    def to_plain(self, value: Any) -> Any:
        """A library object (or an already plain spec) as its plain spec. Shares every tensor."""
        if value is None or isinstance(value, self.plain_types):
            return value
        return self.decode_plain(self.encode_tree(value))

    def to_library(self, value: Any, library: TritonKernels) -> Any:
        """A plain spec as the library object; a library object passes through. Shares every tensor."""
        if value is None:
            return None
        if isinstance(value, self.plain_types):
            return self.build(value, library)
        return value

    def qualnames(self) -> tuple[str, ...]:
        """Fully qualified class names this codec encodes, for a type-keyed codec registry: the library class under
        both import paths, and moereplay's plain spec (so a call built from plain specs can be recorded too)."""
        out: list[str] = []
        for type_name in self.type_names:
            module = _TYPE_MODULES[type_name]
            out.append(f"{TRITON_KERNELS}.{module}.{type_name}")
            out.append(f"{VENDORED_TRITON_KERNELS}.{module}.{type_name}")
        for plain in self.plain_types:
            if plain is not torch.Tensor:
                out.append(f"{plain.__module__}.{plain.__qualname__}")
        return tuple(out)


_TYPE_MODULES: dict[str, str] = {
    "Tensor": "tensor",
    "RoutingData": "routing",
    "GatherIndx": "routing",
    "ScatterIndx": "routing",
    "PrecisionConfig": "matmul_ogs",
    "FusedActivation": "matmul_ogs",
    "Epilogue": "matmul_ogs",
}


def _build_weight(spec: torch.Tensor | LayoutTensor, library: TritonKernels) -> Any:
    return build_maybe_wrapped(spec, library)


LAYOUT_TENSOR = TreeCodec(
    "triton_kernels.Tensor",
    ("Tensor",),
    encode_layout_tensor,
    decode_layout_tensor_spec,
    build_layout_tensor,
    (LayoutTensor,),
)
WEIGHT = TreeCodec(
    "triton_kernels.weight",
    ("Tensor",),
    encode_weight,
    decode_weight_spec,
    _build_weight,
    (LayoutTensor, torch.Tensor),
)
ROUTING = TreeCodec(
    "triton_kernels.RoutingData",
    ("RoutingData",),
    encode_routing,
    decode_routing_spec,
    build_routing,
    (RoutingSpec,),
    collect_routing,
    routing_tensors,
)
GATHER = TreeCodec(
    "triton_kernels.GatherIndx",
    ("GatherIndx",),
    encode_gather,
    decode_gather_spec,
    build_gather,
    (GatherSpec,),
    collect_gather,
    gather_tensors,
)
SCATTER = TreeCodec(
    "triton_kernels.ScatterIndx",
    ("ScatterIndx",),
    encode_scatter,
    decode_scatter_spec,
    build_scatter,
    (ScatterSpec,),
    collect_scatter,
    scatter_tensors,
)
PRECISION = TreeCodec(
    "triton_kernels.PrecisionConfig",
    ("PrecisionConfig",),
    encode_precision,
    decode_precision_spec,
    build_precision,
    (PrecisionSpec,),
)
ACTIVATION = TreeCodec(
    "triton_kernels.FusedActivation",
    ("FusedActivation",),
    encode_activation,
    decode_activation_spec,
    build_activation,
    (ActivationSpec,),
)
EPILOGUE = TreeCodec(
    "triton_kernels.Epilogue",
    ("Epilogue",),
    encode_epilogue,
    decode_epilogue_spec,
    build_epilogue,
    (EpilogueSpec,),
)

TYPE_CODECS: tuple[TreeCodec, ...] = (
    LAYOUT_TENSOR,
    ROUTING,
    GATHER,
    SCATTER,
    PRECISION,
    ACTIVATION,
    EPILOGUE,
)
"""One codec per library type (``WEIGHT`` is the ``w`` argument's codec: a torch tensor or a ``Tensor``)."""


# --------------------------------------------------------------------------------------------------------------
# tensor leaves: every tensor a (plain) value holds, by path
# --------------------------------------------------------------------------------------------------------------


def tensor_leaves(value: Any, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor inside a plain spec (or tensor), keyed ``prefix.field.…`` (``[block]`` for per-block maps).

    Replay materialises each leaf in its own guarded allocation; for a :class:`LayoutTensor` the leaf is the
    swizzled storage itself, so an over-read of it lands in *its* guard band.
    """
    out: dict[str, torch.Tensor] = {}
    if value is None:
        return out
    if isinstance(value, torch.Tensor):
        out[prefix] = value
        return out
    if isinstance(value, Mapping):
        for key, item in value.items():
            out.update(tensor_leaves(item, f"{prefix}[{key}]"))
        return out
    if isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            out.update(tensor_leaves(item, f"{prefix}[{index}]"))
        return out
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            out.update(tensor_leaves(getattr(value, field.name), f"{prefix}.{field.name}"))
    return out


def replace_tensor_leaves(value: Any, prefix: str, replacements: Mapping[str, torch.Tensor]) -> Any:
    """``value`` with the tensors at the given paths (as :func:`tensor_leaves` names them) replaced."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return replacements.get(prefix, value)
    if isinstance(value, Mapping):
        return {
            key: replace_tensor_leaves(item, f"{prefix}[{key}]", replacements) for key, item in value.items()
        }
    if isinstance(value, tuple):
        return tuple(
            replace_tensor_leaves(item, f"{prefix}[{i}]", replacements) for i, item in enumerate(value)
        )
    if isinstance(value, list):
        return [replace_tensor_leaves(item, f"{prefix}[{i}]", replacements) for i, item in enumerate(value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            field.name: replace_tensor_leaves(
                getattr(value, field.name), f"{prefix}.{field.name}", replacements
            )
            for field in dataclasses.fields(value)
        }
        return dataclasses.replace(value, **changes)
    return value


def register_with_format(register: Callable[..., Any]) -> None:
    """Register every type codec with the format's registry: ``register(qualname, encode, decode, collect=…,
    tensors=…)`` (None where a codec has no one-pass walk).

    The format decodes a recorded tree (tensors already materialised) to the *plain* spec: loading a capture never
    needs triton_kernels. ``OpSpec.run`` turns plain specs into library objects through the backend.
    """
    for codec in TYPE_CODECS:
        for qualname in codec.qualnames():
            register(
                qualname,
                codec.encode,
                codec.decode_plain,
                collect=codec.collect_tree,
                tensors=codec.collect_tensors,
            )


def to_library(value: Any, backend: Any, cache: dict[str, Any]) -> Any:
    """A plain spec of this module as the backend's triton_kernels object (``moereplay expand``; see
    :class:`moereplay.ops.surface.FamilySurface`); other values unchanged. ``cache`` keeps the backend's
    triton_kernels namespace. Raises :class:`~moereplay.ops.surface.LibraryValueError` when the library lacks a
    piece (ImportError, PackError, AttributeError)."""
    library = cache.get("triton_kernels")
    if library is None:
        library = cache["triton_kernels"] = TritonKernels.from_backend(backend)
    for codec in TYPE_CODECS:
        if isinstance(value, codec.plain_types):
            try:
                return codec.to_library(value, library)
            except (ImportError, PackError, AttributeError) as error:
                raise LibraryValueError(codec.name, error) from error
    return value
