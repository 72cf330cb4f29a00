"""Compare a kernel output with its reference: relative errors against a reference scale, NaN/Inf agreement.

The error measure follows triton_kernels' ``testing.assert_close``: an element's error is ``|actual − expected|``
divided by ``max(scale, |expected|)``, where ``scale`` is the RMS of the reference — so a value near zero is judged
against the typical magnitude around it, a large value against itself. triton_kernels takes the RMS of the whole
tensor; here the default takes it per row (``scale="row"``), because MoE output rows differ in magnitude by their
routing weights and a row-level bug ("row 0 was scaled by row 1's weight") should be visible in that row's terms.
A row whose reference RMS is below ``ROW_SCALE_FLOOR`` of the tensor's RMS (an all-zero row, say) is measured against
that floor instead. Over the compared elements we report the maximum and the RMS of these relative errors, as
triton_kernels does, and judge them against a :class:`Tolerance` chosen by output dtype. An op whose launch rounds
partial sums to 16 bits (split-K with atomics, 16-bit reductions) passes a per-element absolute ``allowance``
(:mod:`moereplay.reference.tolerance`): elements are then judged by their error beyond it, while the errors reported
stay the raw ones.

Non-finite values are classified (finite, NaN, +Inf, −Inf) in both tensors; an element where both agree on a
non-finite class has error 0, one where they disagree is a *non-finite mismatch* and is always bad. RMS and max
relative error are taken over elements where both are finite.

Tensors are compared as matrices ``[rows, cols]``: the last dimension is ``cols``, all others flatten into rows
(a 1-D tensor is one row). Pure torch on the tensors' device; the per-row results come back on the CPU. Cost: a few
elementwise passes and one sort of the relative errors (for the quantiles), and one device→host copy of everything
(statistics and per-row vectors packed together: one host sync on a GPU, not one per statistic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from moereplay.errors import ReferenceError_

#: A row's scale is at least this fraction of the tensor's reference RMS (rows of legitimately small magnitude,
#: e.g. tiny routing weights, keep their own scale; an all-zero reference row is judged against the floor).
ROW_SCALE_FLOOR = 1e-6
_TINY = 1e-30


@dataclass(frozen=True)
class Tolerance:
    """Maximum and RMS relative error a kernel output may show against an exact reference."""

    name: str
    max_rel: float
    rms_rel: float
    rationale: str

    def __post_init__(self) -> None:
        if not (self.max_rel > 0 and self.rms_rel > 0):
            raise ReferenceError_(f"tolerance {self.name!r} needs positive bounds")

    def chained(self, roundings: int) -> Tolerance:
        """The bounds for a chain of kernels judged as one against an unrounded reference: each of ``roundings``
        intermediate buffers stored in the output's dtype (a layer's GEMM outputs, its activation, the per-slot
        results before the top-k sum) costs what one kernel's output may; at worst those errors add, so the bounds
        scale linearly. ``roundings`` ≤ 1 is this tolerance."""
        if roundings <= 1:
            return self
        return Tolerance(
            f"{self.name}×{roundings}",
            max_rel=self.max_rel * roundings,
            rms_rel=self.rms_rel * roundings,
            rationale=f"{roundings} stored roundings in a chain, each within {self.name} ({self.rationale})",
        )


TOLERANCE_FP32 = Tolerance(
    "fp32",
    max_rel=1e-4,
    rms_rel=1e-5,
    rationale="fp32 output of an fp32-accumulated GEMM differs from an fp64 sum only by summation order "
    "(≈√K·2⁻²⁴ ≈ 3e-6 of the row scale at K=2880); 30× headroom",
)
TOLERANCE_BF16 = Tolerance(
    "bf16",
    max_rel=2e-2,
    rms_rel=4e-3,
    rationale="triton_kernels' assert_close defaults; rounding to bf16 alone costs ≤2⁻⁹≈2e-3 per element and a "
    "bf16 scratchpad before the top-k sum can double that",
)
TOLERANCE_FP16 = Tolerance(
    "fp16",
    max_rel=1e-2,
    rms_rel=2e-3,
    rationale="fp16 keeps 3 more mantissa bits than bf16 (rounding ≤2⁻¹²); half of the bf16 bounds leaves room for "
    "fp16 intermediates",
)
TOLERANCE_FP8_E4M3 = Tolerance(
    "fp8_e4m3",
    max_rel=0.13,
    rms_rel=4e-2,
    rationale="3 mantissa bits: rounding ≤2⁻⁴≈6%, and a value on a rounding boundary may land one ulp (12.5%) away",
)
TOLERANCE_FP8_E5M2 = Tolerance(
    "fp8_e5m2",
    max_rel=0.26,
    rms_rel=8e-2,
    rationale="2 mantissa bits: rounding ≤2⁻³, one ulp is 25%",
)

_PROFILES: dict[torch.dtype, Tolerance] = {
    torch.float32: TOLERANCE_FP32,
    torch.float64: TOLERANCE_FP32,
    torch.bfloat16: TOLERANCE_BF16,
    torch.float16: TOLERANCE_FP16,
    torch.float8_e4m3fn: TOLERANCE_FP8_E4M3,
    torch.float8_e4m3fnuz: TOLERANCE_FP8_E4M3,
    torch.float8_e5m2: TOLERANCE_FP8_E5M2,
    torch.float8_e5m2fnuz: TOLERANCE_FP8_E5M2,
}


def profile_for(dtype: torch.dtype) -> Tolerance:
    """The tolerance profile for a kernel output of ``dtype``."""
    try:
        return _PROFILES[dtype]
    except KeyError as e:
        raise ReferenceError_(f"no tolerance profile for output dtype {dtype}") from e


@dataclass(frozen=True)
class BadElement:
    """One element over tolerance: coordinates in the ``[rows, cols]`` view and both values."""

    row: int
    col: int
    actual: float
    expected: float
    rel_err: float


@dataclass(frozen=True)
class RelErrorStats:
    """Quantiles of the per-element relative error over elements where both tensors are finite."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


@dataclass(frozen=True, eq=False)
class Comparison:
    """Everything :func:`compare` measured. Per-row tensors are float32 on the CPU, indexed by row.

    Counts (NaN, Inf, elements over tolerance, mismatches) cover the compared rows only; ``bad_rows`` are rows over
    either bound or with a non-finite mismatch; ``first_bad`` is the first element (row-major) over ``max_rel`` or
    mismatching; ``bit_exact`` says whether actual and reference have the same dtype and bytes.
    """

    shape: tuple[int, int]
    tolerance: Tolerance
    scale_mode: Literal["row", "tensor"]
    rows_compared: int
    max_abs: float
    max_rel: float
    rms_rel: float
    element_stats: RelErrorStats
    elements_over: int
    row_scale: torch.Tensor = field(repr=False)
    row_max_rel: torch.Tensor = field(repr=False)
    row_rms_rel: torch.Tensor = field(repr=False)
    bad_rows: tuple[int, ...]
    nan_actual: int
    nan_reference: int
    inf_actual: int
    inf_reference: int
    nonfinite_mismatch: int
    first_bad: BadElement | None
    bit_exact: bool
    judged: tuple[float, float] | None = None
    """With an allowance: max and RMS relative error beyond it (what ``ok`` and ``bad_rows`` judge); else None."""

    @property
    def nonfinite_positions_agree(self) -> bool:
        """NaN and ±Inf sit at the same positions (and are of the same kind) in both tensors."""
        return self.nonfinite_mismatch == 0

    @property
    def ok(self) -> bool:
        """Within tolerance everywhere compared (beyond the allowance, if any), with NaN/Inf agreement."""
        max_rel, rms_rel = self.judged if self.judged is not None else (self.max_rel, self.rms_rel)
        return (
            self.nonfinite_mismatch == 0
            and max_rel <= self.tolerance.max_rel
            and rms_rel <= self.tolerance.rms_rel
        )

    def summary(self) -> str:
        """One line: verdict, errors, bad rows, non-finite counts, first bad element."""
        verdict = "ok" if self.ok else "BAD"
        parts = [
            f"{verdict} max_rel={self.max_rel:.3e} rms_rel={self.rms_rel:.3e} max_abs={self.max_abs:.3e}",
            f"({self.tolerance.name}: {self.tolerance.max_rel:g}/{self.tolerance.rms_rel:g})",
            f"bad_rows={len(self.bad_rows)}/{self.rows_compared}",
        ]
        if self.nan_actual or self.nan_reference or self.inf_actual or self.inf_reference:
            parts.append(
                f"nan={self.nan_actual}/{self.nan_reference} inf={self.inf_actual}/{self.inf_reference} "
                f"mismatch={self.nonfinite_mismatch}"
            )
        if self.first_bad is not None:
            b = self.first_bad
            parts.append(f"first_bad=({b.row},{b.col}) actual={b.actual:.6g} expected={b.expected:.6g}")
        return " ".join(parts)


def bit_exact(actual: torch.Tensor, other: torch.Tensor) -> bool:
    """Same dtype, same shape and the same bytes (NaN payloads and signed zeros included)."""
    if actual.dtype != other.dtype or actual.shape != other.shape:
        return False
    if actual.numel() == 0:
        return True
    a = actual.detach().contiguous().reshape(-1).view(torch.uint8)
    b = other.detach().contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(a, b.to(a.device)))


def _without_leading_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
    start = 0
    while start < len(shape) - 1 and shape[start] == 1:
        start += 1
    return shape[start:]


def aligned(actual: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor | None:
    """``actual`` as a view of ``shape`` when the two differ only by leading singleton dimensions — the same
    elements in the same order (e.g. ``matmul_ogs``' 3-D output buffer ``[1, rows, N]`` beside the ``[rows, N]``
    it returns for 2-D activations); ``None`` when they hold different elements. Free: a view, no copy."""
    wanted = tuple(int(size) for size in shape)
    if tuple(actual.shape) == wanted:
        return actual
    if _without_leading_ones(tuple(actual.shape)) != _without_leading_ones(wanted):
        return None
    return actual.reshape(wanted)


def _as_matrix(t: torch.Tensor) -> torch.Tensor:
    if t.ndim == 0:
        return t.reshape(1, 1)
    if t.ndim == 1:
        return t.reshape(1, -1)
    return t.reshape(-1, t.shape[-1])


def _classes(t: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +Inf, 3 −Inf (int8)."""
    cls = torch.zeros(t.shape, dtype=torch.int8, device=t.device)
    cls = torch.where(torch.isnan(t), 1, cls)
    cls = torch.where(torch.isposinf(t), 2, cls)
    return torch.where(torch.isneginf(t), 3, cls).to(torch.int8)


_QUANTILES = (0.5, 0.9, 0.99)


_QUANTILE_TENSORS: dict[torch.device, torch.Tensor] = {}


def _quantile_positions(count: torch.Tensor) -> torch.Tensor:
    """``min(n - 1, int(q·(n - 1) + 0.5))`` for each of :data:`_QUANTILES`, of a device count ``n`` (float64; 0
    when ``n`` is 0), without a sync (the quantiles are copied to each device once)."""
    quantiles = _QUANTILE_TENSORS.get(count.device)
    if quantiles is None:
        quantiles = torch.tensor(_QUANTILES, dtype=torch.float64).to(count.device)
        _QUANTILE_TENSORS[count.device] = quantiles
    last = (count - 1).clamp(min=0)
    return torch.minimum(last, torch.floor(quantiles * last + 0.5)).to(torch.int64)


_KEPT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
"""Operand dtypes :func:`compare` reads as they are (others are converted to float64 once)."""


def _order_statistics(values: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The :data:`_QUANTILES` of the first ``count`` of ``values`` once sorted (float64, 1-D, consumed): on the
    CPU a partial sort in place (no sorted copy, no index tensor: two fewer output-sized temporaries); elsewhere
    one sort on the device, picked without a sync."""
    positions = _quantile_positions(count)
    if values.device.type != "cpu":
        return values.sort().values.index_select(0, positions)
    array = values.numpy()
    kth = sorted({int(p) for p in positions.tolist()})
    array.partition(kth)
    return values.index_select(0, positions)


def compare(
    actual: torch.Tensor,
    reference: torch.Tensor,
    *,
    rows_mask: torch.Tensor | None = None,
    profile: Tolerance | None = None,
    scale: Literal["row", "tensor"] = "row",
    allowance: torch.Tensor | None = None,
) -> Comparison:
    """Compare ``actual`` (a kernel output, any float dtype) with ``reference`` (fp32/fp64, same shape).

    ``rows_mask`` (bool, one entry per row of the ``[rows, cols]`` view) limits the comparison to the rows a kernel
    is meant to write; other rows count nowhere. ``profile`` defaults to :func:`profile_for` of ``actual.dtype``.
    ``allowance`` (finite, ≥ 0, the shape of the ``[rows, cols]`` view): absolute error each element may show on
    top of ``profile``; an element is judged by ``max(0, |actual − reference| − allowance)`` over its scale.

    Every statistic is computed on the reference's device and comes back in one device→host copy (one sync on a
    GPU): the scalars and the per-row vectors packed into one float64 tensor.
    """
    if actual.shape != reference.shape:
        raise ReferenceError_(
            f"cannot compare shapes {tuple(actual.shape)} (actual) and {tuple(reference.shape)} (reference)"
        )
    tolerance = profile if profile is not None else profile_for(actual.dtype)
    if scale not in ("row", "tensor"):
        raise ReferenceError_(f"scale must be 'row' or 'tensor', got {scale!r}")
    device = reference.device
    # the operands stay in their own float dtype (no float64 copy of each: 24 MB apiece at gpt-oss shapes); every
    # computation below reads them into float64 first, which is exact, so the numbers are those of float64 copies
    act = _as_matrix(actual.detach()).to(device=device)
    if act.dtype not in _KEPT_DTYPES:
        act = act.to(torch.float64)
    ref = _as_matrix(reference.detach())
    if ref.dtype not in _KEPT_DTYPES:
        ref = ref.to(torch.float64)
    rows, cols = ref.shape
    if rows_mask is None:
        mask = torch.ones(rows, dtype=torch.bool, device=device)
    else:
        mask = rows_mask.to(device=device, dtype=torch.bool).reshape(-1)
        if mask.numel() != rows:
            raise ReferenceError_(f"rows_mask has {mask.numel()} entries for {rows} rows")
    row_sel = mask[:, None]
    zero = torch.zeros((), dtype=torch.float64, device=device)

    cls_act, cls_ref = _classes(act), _classes(ref)
    ref_counted = (cls_ref == 0) & row_sel
    both_finite = (cls_act == 0) & ref_counted
    mismatch = (cls_act != cls_ref) & row_sel
    ref_square = ref.to(torch.float64, copy=True).masked_fill_(~ref_counted, 0.0).square_()

    counted = ref_counted.sum(dim=1)
    row_ms = ref_square.sum(dim=1) / counted.clamp(min=1)
    tensor_rms = torch.sqrt(ref_square.sum() / counted.sum().clamp(min=1))
    del ref_square  # each temporary here is one float64 copy of the output: freed once used
    if scale == "row":
        row_scale = torch.maximum(torch.sqrt(row_ms), tensor_rms * ROW_SCALE_FLOOR)
    else:
        row_scale = tensor_rms.expand(rows)
    row_scale = row_scale.clamp(min=_TINY)

    # in place where the same numbers allow it: each float64 [rows, cols] temporary is 24 MB at gpt-oss shapes
    diff = act.to(torch.float64, copy=True).sub_(ref)
    diff.abs_().masked_fill_(~both_finite, 0.0)
    denom = ref.to(torch.float64, copy=True).abs_().nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    torch.maximum(denom, row_scale[:, None], out=denom)
    rel = diff / denom if allowance is not None else torch.div(diff, denom, out=denom)  # judged needs denom
    infinite = torch.full((), float("inf"), dtype=torch.float64, device=device)
    # an element whose class differs (NaN/Inf against a finite value) counts as an infinite error; rel is 0 there
    # (diff is), and never NaN: the bad-element views below are formed from rel and the mismatch mask, never
    # materialised (one output-sized float64 tensor each)
    row_mismatch = mismatch.any(dim=1)
    judged = rel  # what the bounds judge: the error beyond the allowance, if any
    allowance_ok = None
    if allowance is not None:
        allow = _as_matrix(allowance.detach()).to(device=device, dtype=torch.float64)
        if allow.shape != rel.shape:
            raise ReferenceError_(f"the error allowance must be finite, >= 0 and {rows}x{cols}")
        # checked once the results are on the host
        allowance_ok = (torch.isfinite(allow) & (allow >= 0)).all()
        judged = (diff - allow).clamp(min=0) / denom
        del allow
    del denom

    n_finite = both_finite.sum()
    finite_count = n_finite.to(torch.float64)
    elements = rel.numel()
    rel_square = rel.square()
    rel_square_rows = rel_square.sum(dim=1)
    rel_square_total = rel_square.sum()
    del rel_square
    finite_per_row = both_finite.sum(dim=1).clamp(min=1)
    if cols:
        row_max_rel = torch.where(row_mismatch, infinite, rel.amax(dim=1))
    else:
        row_max_rel = torch.zeros(rows, dtype=torch.float64, device=device)
    row_rms_rel = torch.sqrt(rel_square_rows / finite_per_row)
    row_max_judged, row_rms_judged = row_max_rel, row_rms_rel
    if allowance is not None:
        row_max_judged = torch.where(row_mismatch, infinite, judged.amax(dim=1)) if cols else row_max_rel
        row_rms_judged = torch.sqrt(judged.square().sum(dim=1) / finite_per_row)
    row_bad = mask & (
        (row_max_judged > tolerance.max_rel) | (row_rms_judged > tolerance.rms_rel) | row_mismatch
    )

    over = judged > tolerance.max_rel
    if float("inf") > tolerance.max_rel:  # a mismatch's infinite error is over any finite bound
        over |= mismatch
    over = over.reshape(-1)
    first = over.to(torch.uint8).argmax() if elements else torch.zeros((), dtype=torch.int64, device=device)
    exact = _same_bytes(actual, reference)
    no = torch.zeros((), dtype=torch.int64, device=device)
    counts = torch.stack(
        [
            n_finite,
            mask.sum(),
            over.sum(),
            first,
            ((cls_act == 1) & row_sel).sum(),
            ((cls_ref == 1) & row_sel).sum(),
            ((cls_act >= 2) & row_sel).sum(),
            ((cls_ref >= 2) & row_sel).sum(),
            mismatch.sum(),
            no if exact is None else exact.to(torch.int64),
            no if allowance_ok is None else allowance_ok.to(torch.int64),
        ]
    ).to(torch.float64)
    if elements:
        # quantiles of the relative error over the finite elements: sorted with every other element last (+inf);
        # picked with index_select (indexing by a device scalar would read it on the host)
        maxima = torch.stack(
            [diff.max(), rel_max := rel.max(), rel_max if allowance is None else judged.max()]
        )
        at_first = [
            values.reshape(-1).index_select(0, first.reshape(1)).to(torch.float64)
            for values in (act, ref, rel)
        ]
        at_first[2] = torch.where(
            mismatch.reshape(-1).index_select(0, first.reshape(1)), infinite, at_first[2]
        )
        # diff is not read after this: its buffer takes the elements to be ordered
        ordered = torch.where(both_finite, rel, infinite, out=diff).reshape(-1)
        picked = [_order_statistics(ordered, finite_count), maxima, *at_first]
        del ordered, diff
    else:
        picked = [torch.zeros(len(_QUANTILES) + 6, dtype=torch.float64, device=device)]
    judged_square = rel_square_total if allowance is None else judged.square().sum()
    sums = torch.stack([rel_square_total, rel.sum(), judged_square])
    packed = torch.cat(
        [
            counts,
            *picked,
            sums,
            row_scale,
            torch.where(mask, row_max_rel, zero),
            torch.where(mask, row_rms_rel, zero),
            row_bad.to(torch.float64),
        ]
    ).cpu()  # the one device→host copy
    scalars = counts.numel() + sum(item.numel() for item in picked) + sums.numel()
    (
        count,
        rows_compared,
        elements_over,
        first_index,
        nan_actual,
        nan_reference,
        inf_actual,
        inf_reference,
        nonfinite_mismatch,
        exact_bytes,
        allowance_valid,
        p50,
        p90,
        p99,
        max_abs,
        max_rel,
        judged_max,
        first_actual,
        first_expected,
        first_rel,
        rel_square_sum,
        rel_sum,
        judged_square_sum,
    ) = packed[:scalars].tolist()
    if allowance is not None and not allowance_valid:
        raise ReferenceError_(f"the error allowance must be finite, >= 0 and {rows}x{cols}")
    per_row = packed[scalars:].reshape(4, rows)
    n = int(count)
    first_bad = None
    if elements_over:
        r, c = divmod(int(first_index), cols)
        first_bad = BadElement(row=r, col=c, actual=first_actual, expected=first_expected, rel_err=first_rel)
    stats = RelErrorStats(
        count=n,
        mean=rel_sum / n if n else 0.0,
        p50=p50 if n else 0.0,
        p90=p90 if n else 0.0,
        p99=p99 if n else 0.0,
        max=max_rel,
    )
    return Comparison(
        shape=(rows, cols),
        tolerance=tolerance,
        scale_mode=scale,
        rows_compared=int(rows_compared),
        max_abs=max_abs,
        max_rel=max_rel,
        rms_rel=math.sqrt(rel_square_sum / max(n, 1)),
        element_stats=stats,
        elements_over=int(elements_over),
        row_scale=per_row[0].to(torch.float32),
        row_max_rel=per_row[1].to(torch.float32),
        row_rms_rel=per_row[2].to(torch.float32),
        bad_rows=tuple(index for index, bad in enumerate(per_row[3].tolist()) if bad),
        nan_actual=int(nan_actual),
        nan_reference=int(nan_reference),
        inf_actual=int(inf_actual),
        inf_reference=int(inf_reference),
        nonfinite_mismatch=int(nonfinite_mismatch),
        first_bad=first_bad,
        bit_exact=bool(exact_bytes) if exact is not None else bit_exact(actual, reference),  # no sync then
        judged=None if allowance is None else (judged_max, math.sqrt(judged_square_sum / max(n, 1))),
    )


def _same_bytes(actual: torch.Tensor, other: torch.Tensor) -> torch.Tensor | None:
    """:func:`bit_exact` as a device bool, without a sync; ``None`` when dtype or shape differ or nothing is to
    compare (then :func:`bit_exact` answers without reading any element)."""
    if actual.dtype != other.dtype or actual.shape != other.shape or actual.numel() == 0:
        return None
    a = actual.detach().contiguous().reshape(-1).view(torch.uint8)
    b = other.detach().contiguous().reshape(-1).view(torch.uint8).to(a.device)
    return (a == b).all().to(other.device)
