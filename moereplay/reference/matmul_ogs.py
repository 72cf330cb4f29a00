"""An exact reference for one triton_kernels ``matmul_ogs`` call, without triton.

``matmul_ogs(x, w, bias, routing_data, gather_indx, scatter_indx, precision_config, betas, gammas, out_alpha, y,
fused_activation)`` — "matmul with outer gather/scatter" — is the MoE GEMM of vLLM 0.25.1's gpt-oss Triton path
(``triton_kernel_fused_experts``: gemm1 with a gather and a fused SwiGLU, gemm2 with a scatter and the routing
weights as ``gammas``). What it computes, read from ``matmul_ogs.py`` and ``_matmul_ogs.py`` / ``_reduce_grouped.py``:

- Rows are *expert-sorted*. The routing's histogram ``hist[e]`` and offsets ``offs[e]`` (``expt_data.hist`` and
  ``expt_data.token_offs_raw``, else ``expt_hist`` and its cumulative sum) give each expert ``e`` the rows
  ``p ∈ [offs[e], offs[e] + hist[e])``; rows past ``Σ hist`` are never computed.
- Gather: row ``p`` reads ``x[gather_indx.src_indx[p] // n_expts_act]`` (C-style division: a −1 inside an expert's
  range reads row 0); without a gather it reads ``x[p]``.
- ``acc = x_row · W[e]`` in fp32 (bf16 × dequantised weight products are exact), times the flex scales of x and w;
  then ``acc + bias[e] · betas[p]``; then ``× out_alpha``; then the fused activation (gpt-oss ``swiglu``: gate =
  even columns, linear = odd columns, ``alpha``, ``limit``; the output has ``N / reduction_n`` columns); then
  ``× gammas[p]`` (``gammas`` is indexed by the sorted row: vLLM passes ``routing_data.gate_scal``).
- No scatter: output row ``p`` is that result (kind ``EXPERT_SORTED``).
- Scatter with ``n_expts_act == 1`` and no activation (the "fused scatter"): output row ``scatter_indx.dst_indx[p]``
  receives row ``p``; output rows ``m`` with ``scatter_indx.src_indx[m] == −1`` are zeroed (kind ``SCATTERED``).
- Any other scatter goes through a scratchpad of sorted rows (in the output dtype when split_k = 1) and a grouped
  reduction: output row ``g`` (one per token) is ``Σ_j act(z[src[g·k + j]])`` over ``j < k = n_expts_act`` with
  ``src = scatter_indx.src_indx`` and −1 entries skipped; a group with no valid entry is written as zeros (kind
  ``TOKEN_SUM``). In this path — and with split_k > 1 — the activation moves into the reduction and therefore runs
  *after* ``gammas`` (``act(γ·z)``, not ``act(z)·γ``).

Weights: a ``[E, K, N]`` tensor — plain (bf16/fp16/fp32) or MXFP4 (uint8, two e2m1 codes a byte packed along K,
low nibble first) with e8m0 scales ``[E, K/32, N]`` in ``precision_config.weight_scale`` — either strided or in the
Hopper layouts of :mod:`moereplay.reference.hopper_mxfp4`. Scales decode per the OCP MX spec (0xff → NaN; the Hopper
kernel would see +Inf, see that module).

Arguments may be triton_kernels objects (read by attribute: ``Tensor.storage.data / .storage.layout / .shape /
.dtype``, ``RoutingData``, ``GatherIndx``, ``ScatterIndx``, ``PrecisionConfig``, ``FusedActivation``) or the frozen
mirrors defined here, which a capture decodes to without importing triton. The reference accumulates in float64 and
returns float32, on the device of ``x`` unless told otherwise. Each used expert's rows are one float64 matmul by its
dense weight (the product a loop over experts computes, bit for bit: :mod:`moereplay.reference.expert_groups`);
MXFP4 weights are decoded straight to float64 by a table lookup per element, a run of experts at a time
(:mod:`moereplay.reference.mxfp4_dense`, :data:`DENSE_ELEMENTS_AT_ONCE`), and nothing in the expert loop waits for
the device. On the CPU an expert whose product is exact in float64 (bf16 activations of an ordinary range by MXFP4
weights: every summation order gives its bits) is instead unswizzled, decoded and multiplied a slice of weight
columns at a time, experts spread over the intra-op threads (:class:`_ExactProducts`), never holding its 133 MB
dense weight. Cost at gpt-oss w13 shapes (32 experts, 2880 × 5760, 256 rows) on 2 CPU cores: ≈ 0.8 s, ≈ 0.1 GB
beyond the call's tensors.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

import torch

from moereplay.errors import ReferenceError_
from moereplay.reference.activation import W13Layout, swigluoai_and_mul
from moereplay.reference.expert_groups import expert_runs, matmul_into, on_threads
from moereplay.reference.hopper_mxfp4 import (
    HOPPER_NUM_WARPS,
    HOPPER_SCALE,
    HOPPER_VALUE,
    MX_GROUP,
    HopperValueShape,
    unswizzle_hopper_scales,
    unswizzle_hopper_values,
)
from moereplay.reference.mxfp4_dense import (
    ColumnBytes,
    dense_experts_float64,
    exact_matmul_into,
    packed_columns,
)
from moereplay.reference.numerics import decode_e2m1_codes, decode_e8m0

STRIDED = "STRIDED"
LayoutName = Literal["STRIDED", "HOPPER_VALUE", "HOPPER_SCALE"]
FP4: Literal["fp4"] = "fp4"

# ----------------------------------------------------------------------------------------------------------------
# mirrors of the triton_kernels argument objects
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayoutSpec:
    """A triton_kernels ``Layout``: its ``name`` (one of :data:`LayoutName`; None → STRIDED), ``initial_shape``
    and parameters."""

    name: str = STRIDED
    initial_shape: tuple[int, ...] = ()
    mx_axis: int | None = None
    num_warps: int = HOPPER_NUM_WARPS
    mma_version: int = 3

    def __post_init__(self) -> None:
        if self.name not in (STRIDED, HOPPER_VALUE, HOPPER_SCALE):
            raise ReferenceError_(f"no reference for weight layout {self.name!r}")
        if self.name != STRIDED and (self.mx_axis is None or not self.initial_shape):
            raise ReferenceError_(f"layout {self.name} needs mx_axis and initial_shape")


@dataclass(frozen=True, eq=False)
class TensorSpec:
    """A triton_kernels ``Tensor``: storage ``data`` in ``layout``, logical ``shape``, element ``dtype``.

    ``dtype`` is a torch dtype, or ``"fp4"`` for packed e2m1 (two codes a byte along the packed axis).
    """

    data: torch.Tensor
    layout: LayoutSpec = field(default_factory=LayoutSpec)
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | Literal["fp4"] = torch.uint8


@dataclass(frozen=True, eq=False)
class ExptDataSpec:
    """The parts of triton_kernels ``ExptData`` the GEMM's row ranges come from."""

    hist: torch.Tensor | None = None
    token_offs_raw: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class RoutingDataSpec:
    """triton_kernels ``RoutingData``: ``gate_scal`` (routing weights, expert-sorted), ``expt_hist`` (rows per
    expert), ``n_expts_tot``, ``n_expts_act`` (top-k), ``expt_data``."""

    gate_scal: torch.Tensor | None
    expt_hist: torch.Tensor | None
    n_expts_tot: int
    n_expts_act: int
    expt_data: ExptDataSpec | None = None


@dataclass(frozen=True, eq=False)
class GatherIndxSpec:
    """triton_kernels ``GatherIndx``: row ``p`` of the GEMM reads ``x[src_indx[p] // n_expts_act]``."""

    src_indx: torch.Tensor
    dst_indx: torch.Tensor


@dataclass(frozen=True, eq=False)
class ScatterIndxSpec:
    """triton_kernels ``ScatterIndx``: ``src_indx`` groups sorted rows by token, ``dst_indx[p]`` is row p's target."""

    src_indx: torch.Tensor
    dst_indx: torch.Tensor


@dataclass(frozen=True, eq=False)
class FlexSpec:
    """Flexpoint scales of ``FlexCtx``: ``lhs_data.scale``, ``rhs_data.scale``, ``out_data.expected_scale``."""

    lhs_scale: torch.Tensor | None = None
    rhs_scale: torch.Tensor | None = None
    out_expected_scale: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class PrecisionSpec:
    """triton_kernels ``PrecisionConfig`` (the fields a reference needs; ``act_scale`` / ``out_scale`` — MX
    activations or outputs — are not supported)."""

    weight_scale: TensorSpec | torch.Tensor | None = None
    flex: FlexSpec = field(default_factory=FlexSpec)
    out_dtype: torch.dtype | None = None
    act_scale: torch.Tensor | None = None
    out_scale: torch.Tensor | None = None
    flexpoint_saturate_inf: bool = False


@dataclass(frozen=True)
class ActivationSpec:
    """triton_kernels ``FusedActivation``: ``specs.name``, ``fn_args``, ``reduction_n``. Known: ``"swiglu"``
    (args alpha, limit; reduction 2)."""

    name: str
    args: tuple[Any, ...] = ()
    reduction_n: int = 1


# ----------------------------------------------------------------------------------------------------------------
# reading either kind of object
# ----------------------------------------------------------------------------------------------------------------


def _int_tuple(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


def layout_spec_from(layout: Any) -> LayoutSpec:
    """A :class:`LayoutSpec` from a spec, a triton_kernels layout object (``name``), a codec spec with a ``kind``,
    or None (strided)."""
    if layout is None or isinstance(layout, LayoutSpec):
        return layout or LayoutSpec()
    name = getattr(layout, "name", None) or getattr(layout, "kind", None) or STRIDED
    if name == STRIDED:
        return LayoutSpec()
    return LayoutSpec(
        name=name,
        initial_shape=_int_tuple(getattr(layout, "initial_shape", ())),
        mx_axis=getattr(layout, "mx_axis", None),
        num_warps=int(getattr(layout, "num_warps", None) or HOPPER_NUM_WARPS),
        mma_version=int(getattr(layout, "mma_version", None) or 3),
    )


def _dtype_of(dtype: Any) -> torch.dtype | Literal["fp4"]:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == FP4 or getattr(dtype, "bitwidth", None) == 4:
        return FP4
    from moereplay.format.tensors import torch_dtype  # a fixed table: no getattr(torch, <file text>)

    named = torch_dtype(dtype)
    if named is not None:
        return named
    raise ReferenceError_(f"no reference for element type {dtype!r}")


def tensor_spec_from(value: Any, *, uint8_is_fp4: bool = False) -> TensorSpec:
    """A :class:`TensorSpec` from a spec, a triton_kernels ``Tensor``, a codec spec, or a plain torch tensor.

    Attribute reading: ``storage`` is either a torch tensor (codec spec, layout in ``layout``) or a ``Storage``
    (``storage.data``, ``storage.layout``); ``shape`` is logical; ``dtype`` a torch dtype, its name, a 4-bit
    triton ``FloatType`` or ``"fp4"``. A plain uint8 tensor is packed fp4 when ``uint8_is_fp4`` (``matmul_ogs``
    treats a uint8 ``w`` so): its logical shape doubles the axis whose stride is 1, as ``wrap_torch_tensor`` does.
    """
    if isinstance(value, TensorSpec):
        return value
    if isinstance(value, torch.Tensor):
        if uint8_is_fp4 and value.dtype == torch.uint8:
            shape = list(value.shape)
            packed = list(value.stride()).index(1) if 1 in value.stride() else value.ndim - 1
            shape[packed] *= 2
            return TensorSpec(value, LayoutSpec(), tuple(shape), FP4)
        return TensorSpec(value, LayoutSpec(), tuple(value.shape), value.dtype)
    storage = getattr(value, "storage", None)
    inner = getattr(storage, "data", None)
    if isinstance(storage, torch.Tensor):
        data, layout = storage, getattr(value, "layout", None)
    elif isinstance(inner, torch.Tensor):
        data, layout = inner, getattr(storage, "layout", None)
    else:
        raise ReferenceError_(f"expected a tensor or a triton_kernels Tensor, got {type(value).__name__}")
    return TensorSpec(
        data=data,
        layout=layout_spec_from(layout),
        shape=_int_tuple(value.shape),
        dtype=_dtype_of(value.dtype),
    )


def routing_spec_from(value: Any) -> RoutingDataSpec | None:
    if value is None or isinstance(value, RoutingDataSpec):
        return value
    data = getattr(value, "expt_data", None)
    expt = None
    if data is not None:
        expt = ExptDataSpec(getattr(data, "hist", None), getattr(data, "token_offs_raw", None))
    return RoutingDataSpec(
        gate_scal=getattr(value, "gate_scal", None),
        expt_hist=getattr(value, "expt_hist", None),
        n_expts_tot=int(value.n_expts_tot),
        n_expts_act=int(value.n_expts_act),
        expt_data=expt,
    )


def gather_spec_from(value: Any) -> GatherIndxSpec | None:
    if value is None or isinstance(value, GatherIndxSpec):
        return value
    return GatherIndxSpec(value.src_indx, value.dst_indx)


def scatter_spec_from(value: Any) -> ScatterIndxSpec | None:
    if value is None or isinstance(value, ScatterIndxSpec):
        return value
    return ScatterIndxSpec(value.src_indx, value.dst_indx)


def precision_spec_from(value: Any) -> PrecisionSpec:
    if value is None:
        return PrecisionSpec()
    if isinstance(value, PrecisionSpec):
        return value
    flex = getattr(value, "flex_ctx", None)
    flex_spec = FlexSpec()
    if flex is not None:
        flex_spec = FlexSpec(
            lhs_scale=getattr(getattr(flex, "lhs_data", None), "scale", None),
            rhs_scale=getattr(getattr(flex, "rhs_data", None), "scale", None),
            out_expected_scale=getattr(getattr(flex, "out_data", None), "expected_scale", None),
        )
    scale = getattr(value, "weight_scale", None)
    out_dtype = getattr(value, "out_dtype", None)
    return PrecisionSpec(
        weight_scale=None if scale is None else tensor_spec_from(scale),
        flex=flex_spec,
        out_dtype=None if out_dtype is None else _torch_dtype(out_dtype),
        act_scale=getattr(value, "act_scale", None),
        out_scale=getattr(value, "out_scale", None),
        flexpoint_saturate_inf=bool(getattr(value, "flexpoint_saturate_inf", False)),
    )


def _torch_dtype(value: Any) -> torch.dtype:
    dtype = _dtype_of(value)
    if not isinstance(dtype, torch.dtype):
        raise ReferenceError_(f"expected a torch dtype, got {value!r}")
    return dtype


def _names_a_function(specs: Any) -> bool:
    """A ``FnSpecs`` (``fn``) or codec ``FnSpec`` (``fn_name``) that is not the default "no function"."""
    if specs is None:
        return False
    return getattr(specs, "fn", None) is not None or getattr(specs, "fn_name", None) is not None


def activation_spec_from(value: Any) -> ActivationSpec | None:
    """An :class:`ActivationSpec` from a spec or a ``FusedActivation``-shaped object; None for no activation."""
    if value is None or isinstance(value, ActivationSpec):
        return value
    specs = getattr(value, "specs", None)
    if not _names_a_function(specs):
        return None
    return ActivationSpec(
        str(getattr(specs, "name", "")),
        tuple(getattr(value, "fn_args", ())),
        int(getattr(value, "reduction_n", 1)),
    )


# ----------------------------------------------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------------------------------------------


def _storage_bytes(spec: TensorSpec, expert: int | None) -> torch.Tensor:
    """The unswizzled storage of one expert (or the whole tensor) in its initial orientation."""
    layout = spec.layout
    data = spec.data
    if layout.name == STRIDED:
        return data if expert is None or data.ndim < 3 else data[expert]
    initial = layout.initial_shape
    mx = int(layout.mx_axis if layout.mx_axis is not None else -2)
    mx_from_end = mx - len(initial) if mx >= 0 else mx
    if expert is not None and data.ndim >= 3:
        data, initial = data[expert], initial[1:]
    if layout.name == HOPPER_VALUE:
        return unswizzle_hopper_values(data, initial, mx_from_end, layout.mma_version)
    return unswizzle_hopper_scales(data, initial, mx_from_end, layout.num_warps)


def _logical_kn(spec: TensorSpec) -> tuple[int, int]:
    if len(spec.shape) < 2:
        raise ReferenceError_(f"a weight needs at least 2 dimensions, got shape {spec.shape}")
    return int(spec.shape[-2]), int(spec.shape[-1])


@functools.cache
def _byte_pair_table(device: torch.device) -> torch.Tensor:
    """float32[256, 2]: an e2m1 byte → (value of its low nibble, value of its high nibble)."""
    codes = torch.arange(256)
    return torch.stack((decode_e2m1_codes(codes & 0xF), decode_e2m1_codes(codes >> 4)), dim=-1).to(device)


def dequantize_expert_weight(
    w: Any, weight_scale: Any = None, expert: int = 0, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """The dense float32 ``[K, N]`` weight of one expert as the GEMM uses it.

    ``w`` is a triton_kernels ``Tensor``, a :class:`TensorSpec` or a torch tensor (uint8 = packed fp4);
    ``weight_scale`` the matching e8m0 scales (required for fp4). Values × OCP-decoded scales, exact in fp32.
    """
    spec = tensor_spec_from(w, uint8_is_fp4=True)
    k, n = _logical_kn(spec)
    if spec.dtype != FP4:
        dense = spec.data if spec.data.ndim < 3 else spec.data[expert]
        if weight_scale is not None:
            raise ReferenceError_("microscaled non-fp4 weights (mxfp8) have no reference yet")
        return dense.to(device=device or dense.device, dtype=torch.float32)
    if weight_scale is None:
        raise ReferenceError_("fp4 weights need precision_config.weight_scale")
    packed = _storage_bytes(spec, expert).to(device)
    if packed.dtype != torch.uint8:
        packed = packed.view(torch.uint8)
    if tuple(packed.shape) == (k, n // 2) and k % 2 == 0 and (k // 2, n) != (k, n // 2):
        raise ReferenceError_("fp4 weights packed along N have no reference (matmul_ogs packs along K here)")
    if tuple(packed.shape) != (k // 2, n):
        raise ReferenceError_(
            f"fp4 storage of shape {tuple(packed.shape)} does not match logical [K, N] = [{k}, {n}]"
        )
    # byte (kb, n) holds K rows 2kb (low nibble) and 2kb+1 (high nibble)
    # an embedding lookup gathers the 256-row table about twice as fast as advanced indexing on the CPU
    pairs = torch.nn.functional.embedding(packed.to(torch.int32), _byte_pair_table(packed.device))
    values = pairs.permute(0, 2, 1).reshape(k, n)
    scale_spec = tensor_spec_from(weight_scale)
    scales = _storage_bytes(scale_spec, expert).to(device)
    groups = -(-k // MX_GROUP)
    if tuple(scales.shape) != (groups, n):
        raise ReferenceError_(
            f"weight scales of shape {tuple(scales.shape)} do not match [K/32, N] = [{groups}, {n}]"
        )
    factors = decode_e8m0(scales)
    if k % MX_GROUP:
        factors = factors.repeat_interleave(MX_GROUP, dim=0)[:k]
        return values * factors
    return (values.view(groups, MX_GROUP, n) * factors[:, None, :]).view(k, n)


def dequantize_weights(
    w: Any, weight_scale: Any = None, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """All experts: float32 ``[E, K, N]`` (or ``[K, N]`` for a 2-D weight). Memory: 4·E·K·N bytes."""
    spec = tensor_spec_from(w, uint8_is_fp4=True)
    if len(spec.shape) < 3:
        return dequantize_expert_weight(spec, weight_scale, 0, device=device)
    return torch.stack(
        [dequantize_expert_weight(spec, weight_scale, e, device=device) for e in range(spec.shape[0])]
    )


# ----------------------------------------------------------------------------------------------------------------
# result
# ----------------------------------------------------------------------------------------------------------------


class RowKind(Enum):
    """What an output row of ``matmul_ogs`` is."""

    DENSE = "dense"  # no routing: row i of x times the (single) weight
    EXPERT_SORTED = "expert_sorted"  # row p of the expert-sorted order (no scatter)
    SCATTERED = "scattered"  # fused scatter: row dst_indx[p] holds sorted row p
    TOKEN_SUM = "token_sum"  # grouped reduction: row g sums its n_expts_act sorted rows


@dataclass(frozen=True, eq=False)
class RowMap:
    """Meaning of every output row. int64 / bool tensors on the CPU, one entry per output row; −1 = none/unknown.

    ``token``/``slot``: the flat top-k index ``f`` a row stands for split as ``f // n_expts_act``, ``f % ...``;
    ``expert``: the expert whose weight produced it (−1 for a sum over experts or an unwritten row);
    ``written``: the kernel stores this row; ``sources``: for TOKEN_SUM, the sorted rows summed (``[rows, k]``).
    """

    kind: RowKind
    token: torch.Tensor
    expert: torch.Tensor
    slot: torch.Tensor
    written: torch.Tensor
    sources: torch.Tensor | None = None

    def describe(self, row: int) -> str:
        """A short phrase for findings: ``"row 5 (token 1, slot 1, expert 7)"``."""
        if not bool(self.written[row]):
            return f"row {row} (not written by the kernel)"
        bits = []
        if int(self.token[row]) >= 0:
            bits.append(f"token {int(self.token[row])}")
        if int(self.slot[row]) >= 0:
            bits.append(f"slot {int(self.slot[row])}")
        if int(self.expert[row]) >= 0:
            bits.append(f"expert {int(self.expert[row])}")
        elif self.sources is not None:
            bits.append("sum over its top-k experts")
        return f"row {row} ({', '.join(bits)})" if bits else f"row {row}"


@dataclass(frozen=True, eq=False)
class MatmulOgsReference:
    """The reference output and its ingredients (float32, on the compute device).

    ``output``: what the kernel's ``y`` should hold (rows the kernel does not write are 0; see ``row_map.written``).
    Per *sorted* row ``p`` (``P`` = gather length or rows of x): ``gemm`` = x·W (× flex scales), ``bias`` = the
    bias·betas term added (None without bias), ``gammas`` (None without), ``rows`` = the GEMM stage's result for
    that row — after bias, alpha, the activation when the GEMM applies it, and gammas; when a reduction follows it
    is the scratchpad row, before the activation — and ``sorted_expert`` (int64, CPU, −1 = not computed).
    """

    output: torch.Tensor
    row_map: RowMap
    gemm: torch.Tensor
    bias: torch.Tensor | None
    gammas: torch.Tensor | None
    rows: torch.Tensor
    sorted_expert: torch.Tensor


# ----------------------------------------------------------------------------------------------------------------
# the reference
# ----------------------------------------------------------------------------------------------------------------


def _activate(values: torch.Tensor, activation: ActivationSpec | None) -> torch.Tensor:
    if activation is None:
        return values
    if activation.name == "swiglu":
        if activation.reduction_n != 2 or len(activation.args) != 2:
            raise ReferenceError_(
                f"swiglu expects (alpha, limit) and reduction_n 2, got {activation.args} / {activation.reduction_n}"
            )
        alpha, limit = activation.args
        return swigluoai_and_mul(
            values,
            W13Layout.GATE_UP_INTERLEAVED,
            alpha=float(alpha),
            limit=None if limit is None else float(limit),
        )
    raise ReferenceError_(f"no reference for fused activation {activation.name!r}")


def _scalar(t: torch.Tensor | None, index: int = 0) -> float:
    if t is None:
        return 1.0
    flat = t.reshape(-1)
    return float(flat[index if flat.numel() > 1 else 0])


def _row_ranges(routing: RoutingDataSpec) -> tuple[list[int], list[int]]:
    data = routing.expt_data
    hist = data.hist if data is not None and data.hist is not None else routing.expt_hist
    if hist is None:
        raise ReferenceError_("routing data has neither expt_data.hist nor expt_hist")
    counts = [int(v) for v in hist.reshape(-1).tolist()]
    if data is not None and data.token_offs_raw is not None:
        starts = [int(v) for v in data.token_offs_raw.reshape(-1)[: len(counts)].tolist()]
    else:
        starts, run = [], 0
        for c in counts:
            starts.append(run)
            run += c
    return starts, counts


def _trunc_div(a: torch.Tensor, b: int) -> torch.Tensor:
    return torch.div(a, b, rounding_mode="trunc")


def _gemm_stage(
    x_t: torch.Tensor,
    x64: torch.Tensor,
    w_spec: TensorSpec,
    precision: PrecisionSpec,
    bias: torch.Tensor | None,
    betas: torch.Tensor | None,
    gather: GatherIndxSpec | None,
    ranges: list[tuple[int, int, int]],
    n_sorted: int,
    n: int,
    top_k: int,
    x_scale: float,
    dev: torch.device,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float64 ``gemm`` (``x · W[e]`` × flex scales) and ``bias`` term rows of every expert range, in range order
    (a later range overwrites an earlier one). Each range is one float64 matmul of its gathered rows by its expert's
    dense weight, exactly as a loop over experts computes it (:func:`moereplay.reference.expert_groups.matmul_into`);
    the weights are decoded a run of experts at a time (:func:`_expert_weights`), the gather indices and flex scales
    read back once, so the loop syncs with the device nowhere. Ranges that share no row take their products from
    :class:`_ExactProducts` where it applies, all of them before their flex scales and bias terms."""
    gemm = torch.zeros((n_sorted, n), dtype=torch.float64, device=dev)
    bias_term = torch.zeros((n_sorted, n), dtype=torch.float64, device=dev) if bias is not None else None
    bias64 = None if bias is None else bias.to(device=dev, dtype=torch.float64)
    betas64 = None if betas is None else betas.to(device=dev, dtype=torch.float64)
    host_rows = None
    if gather is not None:
        host_rows = _trunc_div(gather.src_indx.to(dtype=torch.int64).cpu(), top_k)
    rhs_scale = precision.flex.rhs_scale
    rhs_scale = None if rhs_scale is None else rhs_scale.cpu()
    x_parts = _gathered_rows(x64, host_rows, ranges)
    experts = [e for e, _, _ in ranges]
    exact = _ExactProducts.of(w_spec, precision.weight_scale, dev) if _disjoint(ranges) else None
    products = None if exact is not None else _expert_products(w_spec, precision.weight_scale, experts, dev)
    jobs: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def finish(e: int, start: int, count: int) -> None:
        """The range's flex scales and bias term (after its product)."""
        gemm[start : start + count].mul_(x_scale * _scalar(rhs_scale, e))
        if bias64 is not None and bias_term is not None:
            b = bias64[e] if bias64.ndim == 2 else bias64
            factor = (
                betas64[start : start + count, None]
                if betas64 is not None
                else torch.ones((count, 1), dtype=torch.float64, device=dev)
            )
            bias_term[start : start + count] = b[None, :] * factor

    for index, (e, start, count) in enumerate(ranges):
        x_rows = host_rows[start : start + count] if host_rows is not None else None
        low, high = (
            (int(x_rows.min()), int(x_rows.max()))
            if x_rows is not None and count
            else (start, start + count - 1)
        )
        if count and (low < 0 or high >= x_t.shape[0]):
            raise ReferenceError_(f"expert {e} gathers x rows outside 0..{x_t.shape[0] - 1}")
        if exact is not None:
            if not jobs:
                exact.storage(e)  # raises what decoding the first expert raises, where it would
            jobs.append((e, gemm[start : start + count], x_parts(index)))
            continue
        assert products is not None
        multiply = next(products)
        multiply(gemm[start : start + count], x_parts(index))
        del multiply  # may hold a view of the decoder's run buffer: let a run of another length free it
        finish(e, start, count)
    if exact is not None:
        exact.run(jobs)
        for e, start, count in ranges:
            finish(e, start, count)
    return gemm, bias_term


def _gathered_rows(
    x64: torch.Tensor, host_rows: torch.Tensor | None, ranges: list[tuple[int, int, int]]
) -> Callable[[int], torch.Tensor]:
    """The rows of ``x64`` each range multiplies, by range index: gathered in one go (valid rows only: every range's
    rows are checked before its product), or — for a strided ``x64``, whose gather's layout depends on the row
    count — range by range as ``x64[rows]``."""
    device = x64.device
    if not x64.is_contiguous():

        def each(index: int) -> torch.Tensor:
            _, start, count = ranges[index]
            rows = torch.arange(start, start + count)
            chosen = host_rows[rows] if host_rows is not None else rows
            return x64[chosen.to(device)]

        return each
    limit = x64.shape[0]
    pieces = [
        (host_rows[start : start + count] if host_rows is not None else torch.arange(start, start + count))
        for _, start, count in ranges
    ]
    safe = [piece.clamp(0, max(limit - 1, 0)) for piece in pieces]  # out-of-range rows raise before use
    if not safe or not limit:  # no rows to gather (a range naming rows raised before asking for them)
        return lambda index: x64[:0]
    gathered = x64[torch.cat(safe).to(device)]
    splits = torch.split(gathered, [piece.numel() for piece in pieces])
    return lambda index: splits[index]


def _disjoint(ranges: list[tuple[int, int, int]]) -> bool:
    """Whether no two ranges share a row (then their products may be computed in any order)."""
    spans = sorted((start, start + count) for _, start, count in ranges if count)
    return all(end <= following for (_, end), (following, _) in itertools.pairwise(spans))


def _expert_products(
    w_spec: TensorSpec, weight_scale: Any, experts: list[int], device: torch.device
) -> Iterator[Callable[[torch.Tensor, torch.Tensor], None]]:
    """For each expert of ``experts`` (ascending), a function ``(out, x)`` that writes ``x @ W[e]`` (float64) into
    ``out`` as :func:`moereplay.reference.expert_groups.matmul_into` computes it with the dense weight of
    :func:`_expert_weights` — by :class:`_ExactProducts` where it applies."""
    exact = _ExactProducts.of(w_spec, weight_scale, device)
    if exact is None:
        for weight in _expert_weights(w_spec, weight_scale, experts, device):
            yield functools.partial(_multiply_by, weight)
        return
    for e in experts:
        exact.storage(e)
        yield functools.partial(exact.product, e)


class _ExactProducts:
    """Products of packed MXFP4 experts on the CPU (:data:`EXACT_PRODUCT_DEVICE_TYPES`), each first tried as an
    exact one (:func:`moereplay.reference.mxfp4_dense.exact_matmul_into`: the bits of the dense product, its
    weight unswizzled and decoded a slice of columns at a time instead of 133 MB at once for a gpt-oss expert);
    an expert whose product could round is decoded whole and multiplied as :func:`_expert_weights` does."""

    def __init__(self, w_spec: TensorSpec, weight_scale: Any, device: torch.device) -> None:
        self.w_spec, self.weight_scale, self.device = w_spec, weight_scale, device
        self.k, self.n = _logical_kn(w_spec)
        self._dense: torch.Tensor | None = None  # the dense weight of an expert whose product is not exact

    @classmethod
    def of(cls, w_spec: TensorSpec, weight_scale: Any, device: torch.device) -> _ExactProducts | None:
        k, _ = _logical_kn(w_spec)
        if device.type not in EXACT_PRODUCT_DEVICE_TYPES or not _decodes_by_table(w_spec, weight_scale, k):
            return None
        return cls(w_spec, weight_scale, device)

    def storage(self, expert: int) -> tuple[ColumnBytes, int, torch.Tensor]:
        """A reader of the expert's packed bytes a slice of columns at a time, the column multiple its slices
        start at, and its scale bytes ``[K/32, N]`` — with :func:`_fp4_storage`'s checks, in its order."""
        k, n, device = self.k, self.n, self.device
        reader = _fp4_columns(self.w_spec, expert, k, n)
        if reader is None:
            reader = packed_columns(_fp4_values(self.w_spec, expert, 1, k, n, device)[0]), 1
        return (*reader, _fp4_scales(self.weight_scale, expert, 1, k, n, device)[0])

    def exact(self, expert: int, out: torch.Tensor, x: torch.Tensor) -> bool:
        """``out[:] = x @ W[expert]`` when that product is exact (else False, ``out`` unspecified)."""
        columns, align, scales = self.storage(expert)
        return exact_matmul_into(out, x, columns, scales, self.k, align=align)

    def dense(self, expert: int, out: torch.Tensor, x: torch.Tensor) -> None:
        """``out[:] = x @ W[expert]`` with the whole dense weight, as :func:`_expert_weights` gives it."""
        packed, scales = _fp4_storage(self.w_spec, self.weight_scale, expert, 1, self.k, self.n, self.device)
        if self._dense is None:
            self._dense = torch.empty((1, self.k, self.n), dtype=torch.float64, device=self.device)
        matmul_into(out, x, dense_experts_float64(packed, scales, self.k, out=self._dense)[0])

    def product(self, expert: int, out: torch.Tensor, x: torch.Tensor) -> None:
        if not self.exact(expert, out, x):
            self.dense(expert, out, x)

    def run(self, jobs: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Every ``(expert, out, x)`` product, the exact ones spread over the intra-op threads
        (:func:`moereplay.reference.expert_groups.on_threads`), the others after them on this thread."""
        for (expert, out, x), done in zip(jobs, on_threads(self.exact, jobs), strict=True):
            if not done:
                self.dense(expert, out, x)


def _multiply_by(weight: torch.Tensor, out: torch.Tensor, x: torch.Tensor) -> None:
    matmul_into(out, x, weight)


EXACT_PRODUCT_DEVICE_TYPES = frozenset({"cpu"})
"""Device types whose MXFP4 products are tried as exact ones first (:func:`_expert_products`): on the CPU the
dense weight of one expert costs more time and memory than its product; a GPU decodes runs of experts whole."""


def _expert_weights(
    w_spec: TensorSpec, weight_scale: Any, experts: list[int], device: torch.device
) -> Iterator[torch.Tensor]:
    """The float64 dense ``[K, N]`` weight of each expert of ``experts`` (ascending), as
    ``dequantize_expert_weight(...).to(torch.float64)`` gives it; packed MXFP4 weights are decoded a run of
    consecutive experts at a time (:data:`DENSE_ELEMENTS_AT_ONCE`) by :mod:`moereplay.reference.mxfp4_dense`."""
    k, n = _logical_kn(w_spec)
    if not _decodes_by_table(w_spec, weight_scale, k):
        for e in experts:
            yield dequantize_expert_weight(w_spec, weight_scale, e, device=device).to(torch.float64)
        return
    most = DENSE_ELEMENTS_AT_ONCE.get(device.type, DENSE_ELEMENTS_AT_ONCE["cpu"]) // max(1, k * n)
    buffer: torch.Tensor | None = None  # reused while runs have its length: no fresh pages per expert
    for first, length in expert_runs(tuple(experts), most):
        packed, scales = _fp4_storage(w_spec, weight_scale, experts[first], length, k, n, device)
        if buffer is None or buffer.shape[0] != length:
            buffer = None
            buffer = torch.empty((length, k, n), dtype=torch.float64, device=device)
        dense_experts_float64(packed, scales, k, out=buffer)
        del packed, scales
        yield from buffer.unbind(0)


DENSE_ELEMENTS_AT_ONCE = {"cpu": 1 << 24, "cuda": 1 << 28}
"""Most float64 dense weight elements decoded at once, per device type (128 MB on the CPU — one gpt-oss expert of
2880 × 5760 —; 2 GB on a GPU — 16 such experts, decoded in one table gather with ~2 GB of index temporaries); a run
holds at least one expert."""


def _decodes_by_table(w_spec: TensorSpec, weight_scale: Any, k: int) -> bool:
    """Packed fp4 with 1-byte scales and an even K: the table decoder applies (else the per-expert one, which also
    raises the errors)."""
    if w_spec.dtype != FP4 or weight_scale is None or k % 2:
        return False
    scale = tensor_spec_from(weight_scale)
    return scale.data.element_size() == 1 and w_spec.data.element_size() == 1


def _fp4_storage(
    w_spec: TensorSpec, weight_scale: Any, first: int, count: int, k: int, n: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unswizzled packed bytes ``[count, K/2, N]`` and scale bytes ``[count, K/32, N]`` of experts ``first …``,
    with :func:`dequantize_expert_weight`'s checks (and messages)."""
    packed = _fp4_values(w_spec, first, count, k, n, device)
    return packed, _fp4_scales(weight_scale, first, count, k, n, device)


def _fp4_values(
    w_spec: TensorSpec, first: int, count: int, k: int, n: int, device: torch.device
) -> torch.Tensor:
    """The packed bytes of :func:`_fp4_storage`."""
    packed = _storage_run(w_spec, first, count).to(device)
    if packed.dtype != torch.uint8:
        packed = packed.view(torch.uint8)
    if tuple(packed.shape[1:]) == (k, n // 2) and k % 2 == 0 and (k // 2, n) != (k, n // 2):
        raise ReferenceError_("fp4 weights packed along N have no reference (matmul_ogs packs along K here)")
    if tuple(packed.shape[1:]) != (k // 2, n):
        raise ReferenceError_(
            f"fp4 storage of shape {tuple(packed.shape[1:])} does not match logical [K, N] = [{k}, {n}]"
        )
    return packed


def _fp4_scales(
    weight_scale: Any, first: int, count: int, k: int, n: int, device: torch.device
) -> torch.Tensor:
    """The scale bytes of :func:`_fp4_storage`."""
    scales = _storage_run(tensor_spec_from(weight_scale), first, count).to(device)
    groups = -(-k // MX_GROUP)
    if tuple(scales.shape[1:]) != (groups, n):
        raise ReferenceError_(
            f"weight scales of shape {tuple(scales.shape[1:])} do not match [K/32, N] = [{groups}, {n}]"
        )
    return scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales


def _fp4_columns(w_spec: TensorSpec, expert: int, k: int, n: int) -> tuple[ColumnBytes, int] | None:
    """A reader of one expert's packed bytes a slice of weight columns at a time, and the column multiple its
    slices start at, for the CPU storages it applies to: a strided ``[E, K/2, N]`` one (views), or a Hopper value
    layout swizzled from ``[E, K/2, N]`` with ``mx_axis`` on ``K/2`` (vLLM's), whose swizzled rows ``4i … 4i + 3``
    hold the 16 weight columns ``16i …`` — a slice of 16-column blocks is unswizzled on its own. ``None``
    otherwise (and for storage :func:`_fp4_values` would refuse): the expert is unswizzled whole."""
    data = w_spec.data
    layout = w_spec.layout
    if data.ndim != 3 or data.element_size() != 1 or data.device.type != "cpu":
        return None
    matrix = data[expert].view(torch.uint8) if data.dtype != torch.uint8 else data[expert]
    if layout.name == STRIDED:
        return (packed_columns(matrix), 1) if tuple(matrix.shape) == (k // 2, n) else None
    if layout.name != HOPPER_VALUE or len(layout.initial_shape) != 3:
        return None
    mx = int(layout.mx_axis if layout.mx_axis is not None else -2)
    mx_from_end = mx - 3 if mx >= 0 else mx
    try:
        shape = HopperValueShape(tuple(layout.initial_shape), mx_from_end, layout.mma_version)
        usable = (
            shape.transposed
            and tuple(shape.initial[1:]) == (k // 2, n)
            and shape.swizzled == tuple(data.shape)
        )
    except ReferenceError_:
        return None
    if not usable:
        return None
    mma_version = layout.mma_version

    def read(first: int, width: int) -> torch.Tensor:
        blocks = -(-width // 16)
        swizzled = matrix[:, first // 4 : first // 4 + 4 * blocks]
        return unswizzle_hopper_values(swizzled, (k // 2, width), -2, mma_version).mT

    return read, 16


def _storage_run(spec: TensorSpec, first: int, count: int) -> torch.Tensor:
    """:func:`_storage_bytes` of experts ``first … first + count − 1`` stacked on a leading axis (a 2-D weight is
    its one expert); unswizzled in one go."""
    data = spec.data
    if data.ndim < 3:
        return _storage_bytes(spec, None)[None]
    layout = spec.layout
    if layout.name == STRIDED:
        return data[first : first + count]
    initial = (count, *layout.initial_shape[1:])
    mx = int(layout.mx_axis if layout.mx_axis is not None else -2)
    mx_from_end = mx - len(layout.initial_shape) if mx >= 0 else mx
    chunk = data[first : first + count]
    if layout.name == HOPPER_VALUE:
        return unswizzle_hopper_values(chunk, initial, mx_from_end, layout.mma_version)
    return unswizzle_hopper_scales(chunk, initial, mx_from_end, layout.num_warps)


def reference_matmul_ogs(
    x: Any,
    w: Any,
    bias: torch.Tensor | None,
    routing_data: Any = None,
    gather_indx: Any = None,
    scatter_indx: Any = None,
    precision_config: Any = None,
    betas: torch.Tensor | None = None,
    gammas: torch.Tensor | None = None,
    out_alpha: float | None = None,
    y: torch.Tensor | None = None,
    fused_activation: Any = None,
    epilogue: Any = None,
    *,
    split_k: int = 1,
    round_scratchpad: bool = False,
    device: torch.device | str | None = None,
) -> MatmulOgsReference:
    """Recompute one ``matmul_ogs`` call (same arguments) in float64 and return float32 rows and a row map.

    ``y`` (the kernel's output buffer) is accepted and ignored. ``split_k`` is the opt_flags value the kernel ran
    with (vLLM pins 1 on Hopper); > 1 moves the fused activation after ``gammas``. ``round_scratchpad`` rounds the
    per-slot rows to the output dtype before a grouped reduction, as the kernel's scratchpad does with split_k = 1.
    """
    del y
    if epilogue is not None and _names_a_function(getattr(epilogue, "specs", None)):
        raise ReferenceError_("matmul_ogs epilogues have no reference")
    x_t = x if isinstance(x, torch.Tensor) else tensor_spec_from(x).data
    if not isinstance(x_t, torch.Tensor):
        raise ReferenceError_(f"x must be a tensor, got {type(x).__name__}")
    if x_t.ndim == 3 and x_t.shape[0] == 1:
        x_t = x_t[0]
    if x_t.ndim != 2:
        raise ReferenceError_(f"batched matmul_ogs (x of shape {tuple(x_t.shape)}) has no reference")
    dev = torch.device(device) if device is not None else x_t.device
    routing = routing_spec_from(routing_data)
    gather = gather_spec_from(gather_indx)
    scatter = scatter_spec_from(scatter_indx)
    precision = precision_spec_from(precision_config)
    activation = activation_spec_from(fused_activation)
    if precision.act_scale is not None or precision.out_scale is not None:
        raise ReferenceError_("MX-scaled activations or outputs (act_scale / out_scale) have no reference")
    if precision.flex.out_expected_scale is not None:
        raise ReferenceError_("flexpoint output scales have no reference")
    w_spec = tensor_spec_from(w, uint8_is_fp4=True)
    k, n = _logical_kn(w_spec)
    if x_t.shape[1] != k:
        raise ReferenceError_(f"x has {x_t.shape[1]} columns but w has K = {k}")
    n_experts = int(w_spec.shape[0]) if len(w_spec.shape) == 3 else 1
    reduction = 1 if activation is None else activation.reduction_n
    if n % reduction:
        raise ReferenceError_(f"N = {n} is not divisible by the activation's reduction {reduction}")
    out_dtype = precision.out_dtype or x_t.dtype
    top_k = routing.n_expts_act if routing is not None else 1

    x64 = x_t.to(device=dev, dtype=torch.float64)
    n_sorted = int(gather.src_indx.shape[0]) if gather is not None else int(x_t.shape[0])
    x_scale = _scalar(precision.flex.lhs_scale)

    # sorted rows → (expert, x row)
    sorted_expert = torch.full((n_sorted,), -1, dtype=torch.int64)
    if routing is None or (routing.expt_hist is None and routing.expt_data is None):
        if n_experts != 1:
            raise ReferenceError_("matmul_ogs without routing needs a single weight matrix")
        ranges = [(0, 0, n_sorted)]
    else:
        starts, counts = _row_ranges(routing)
        if any(counts[n_experts:]):
            raise ReferenceError_(f"routing sends rows to experts beyond the weight's {n_experts}")
        counts = counts[:n_experts]
        if len(starts) < len(counts):
            raise ReferenceError_(
                f"expt_data.token_offs_raw has {len(starts)} offsets for {len(counts)} experts"
            )
        ranges = [(e, starts[e], c) for e, c in enumerate(counts) if c > 0]
    for e, start, count in ranges:
        if start < 0 or start + count > n_sorted:
            raise ReferenceError_(
                f"expert {e} claims rows {start}..{start + count - 1} of only {n_sorted} rows"
            )
        sorted_expert[start : start + count] = e

    gemm, bias_term = _gemm_stage(
        x_t, x64, w_spec, precision, bias, betas, gather, ranges, n_sorted, n, top_k, x_scale, dev
    )

    computed = (sorted_expert >= 0).to(dev)
    # what the result reports of the two terms, then their sum in place (each float64 term is 8 bytes an element)
    gemm32 = gemm.to(torch.float32)
    bias32 = None if bias_term is None else bias_term.to(torch.float32)
    pre = gemm if bias_term is None else gemm.add_(bias_term)
    del gemm, bias_term
    if out_alpha is not None:
        pre.mul_(float(out_alpha))
    gamma = None
    if gammas is not None:
        gamma = gammas.to(device=dev, dtype=torch.float64).reshape(-1)[:n_sorted]
        needed = max((start + count for _, start, count in ranges), default=0)
        if gamma.numel() < needed:
            raise ReferenceError_(
                f"gammas has {gamma.numel()} entries but rows up to {needed - 1} are computed"
            )
        gamma = torch.nn.functional.pad(gamma, (0, n_sorted - gamma.numel()))

    fused_scatter = scatter is not None and top_k == 1 and activation is None and split_k == 1
    activation_in_reduce = split_k > 1 or (scatter is not None and not fused_scatter)
    if activation_in_reduce:
        per_row = pre if gamma is None else pre * gamma[:, None]
    else:
        per_row = _activate(pre, activation)
        if gamma is not None:
            per_row = per_row * gamma[:, None]
    per_row = torch.where(computed[:, None], per_row, torch.zeros_like(per_row))
    n_out = n // reduction

    flat_index = None if gather is None else gather.src_indx.to(torch.int64).cpu()

    if scatter is None:
        output = _activate(per_row, activation) if activation_in_reduce else per_row
        output = torch.where(computed[:, None], output, torch.zeros_like(output))
        kind = RowKind.DENSE if routing is None else RowKind.EXPERT_SORTED
        if kind is RowKind.DENSE:
            token = torch.arange(n_sorted, dtype=torch.int64)
            slot = torch.zeros(n_sorted, dtype=torch.int64)
        elif flat_index is not None:
            token = torch.where(sorted_expert >= 0, _trunc_div(flat_index, top_k), -1)
            slot = torch.where(sorted_expert >= 0, flat_index % top_k, -1)
        else:
            token = torch.full((n_sorted,), -1, dtype=torch.int64)
            slot = token.clone()
        row_map = RowMap(kind, token, sorted_expert.clone(), slot, sorted_expert >= 0)
    elif fused_scatter:
        n_rows = n_sorted
        output = torch.zeros((n_rows, n_out), dtype=torch.float64, device=dev)
        written = torch.zeros(n_rows, dtype=torch.bool)
        expert_of_row = torch.full((n_rows,), -1, dtype=torch.int64)
        src = scatter.src_indx.to(torch.int64).cpu()[:n_rows]
        zeroed = torch.zeros(n_rows, dtype=torch.bool)
        zeroed[: src.numel()] = src == -1
        written |= zeroed
        dst = scatter.dst_indx.to(torch.int64).cpu()
        targets = torch.nonzero(sorted_expert >= 0).reshape(-1)
        if dst.numel() < n_sorted and targets.numel() and int(targets.max()) >= dst.numel():
            raise ReferenceError_("scatter_indx.dst_indx is shorter than the computed rows")
        targets = targets[dst[targets] != -1]
        rows_to = dst[targets]
        if rows_to.numel() and (int(rows_to.min()) < 0 or int(rows_to.max()) >= n_rows):
            raise ReferenceError_(f"scatter_indx.dst_indx points outside 0..{n_rows - 1}")
        output[rows_to.to(dev)] = per_row[targets.to(dev)]
        written[rows_to] = True
        expert_of_row[rows_to] = sorted_expert[targets]
        all_rows = torch.arange(n_rows, dtype=torch.int64)
        row_map = RowMap(
            RowKind.SCATTERED,
            torch.where(written, all_rows, -1),
            expert_of_row,
            torch.where(written, torch.zeros_like(all_rows), -1),
            written,
        )
    else:
        if round_scratchpad and split_k == 1:
            per_row = per_row.to(out_dtype).to(torch.float64)
        src = scatter.src_indx.to(device=dev, dtype=torch.int64)
        if src.numel() % top_k:
            raise ReferenceError_(
                f"scatter_indx.src_indx has {src.numel()} entries, not a multiple of {top_k}"
            )
        groups = src.reshape(-1, top_k)
        valid = groups != -1
        if bool(((groups < -1) | (groups >= n_sorted)).any()):
            raise ReferenceError_(f"scatter_indx.src_indx points outside 0..{n_sorted - 1}")
        # invalid entries load zeros; the activation still runs on them (act(0) = 0 for swiglu)
        picked = per_row[groups.clamp(min=0)]
        picked = torch.where(valid[..., None], picked, torch.zeros_like(picked))
        output = _activate(picked, activation).sum(dim=1)
        n_groups = groups.shape[0]
        row_map = RowMap(
            RowKind.TOKEN_SUM,
            torch.arange(n_groups, dtype=torch.int64),
            torch.full((n_groups,), -1, dtype=torch.int64),
            torch.full((n_groups,), -1, dtype=torch.int64),
            torch.ones(n_groups, dtype=torch.bool),
            groups.cpu(),
        )

    return MatmulOgsReference(
        output=output.to(torch.float32),
        row_map=row_map,
        gemm=gemm32,
        bias=bias32,
        gammas=None if gamma is None else gamma.to(torch.float32),
        rows=per_row.to(torch.float32),
        sorted_expert=sorted_expert,
    )
