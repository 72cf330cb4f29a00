"""compare() brings every statistic back in one device→host copy: it must report exactly what the previous
implementation (one ``.item()`` per statistic, kept here as the oracle) reported, on outputs with NaN/Inf, masks,
allowances, other dtypes and shapes."""

from __future__ import annotations

from typing import Literal

import pytest
import torch

from moereplay.errors import ReferenceError_
from moereplay.reference.compare import (
    _TINY,
    ROW_SCALE_FLOOR,
    BadElement,
    Comparison,
    RelErrorStats,
    Tolerance,
    _as_matrix,
    _classes,
    bit_exact,
    compare,
    profile_for,
)


def _quantile(sorted_values: torch.Tensor, q: float) -> float:
    n = sorted_values.numel()
    if n == 0:
        return 0.0
    return float(sorted_values[min(n - 1, int(q * (n - 1) + 0.5))])


def compare_before(
    actual: torch.Tensor,
    reference: torch.Tensor,
    *,
    rows_mask: torch.Tensor | None = None,
    profile: Tolerance | None = None,
    scale: Literal["row", "tensor"] = "row",
    allowance: torch.Tensor | None = None,
) -> Comparison:
    """The implementation before the packed transfer (one host sync per statistic)."""
    if actual.shape != reference.shape:
        raise ReferenceError_(
            f"cannot compare shapes {tuple(actual.shape)} (actual) and {tuple(reference.shape)} (reference)"
        )
    tolerance = profile if profile is not None else profile_for(actual.dtype)
    device = reference.device
    act = _as_matrix(actual.detach()).to(device=device, dtype=torch.float64)
    ref = _as_matrix(reference.detach()).to(torch.float64)
    rows, cols = ref.shape
    if rows_mask is None:
        mask = torch.ones(rows, dtype=torch.bool, device=device)
    else:
        mask = rows_mask.to(device=device, dtype=torch.bool).reshape(-1)
        if mask.numel() != rows:
            raise ReferenceError_(f"rows_mask has {mask.numel()} entries for {rows} rows")
    row_sel = mask[:, None].expand(rows, cols)

    cls_act, cls_ref = _classes(act), _classes(ref)
    both_finite = (cls_act == 0) & (cls_ref == 0) & row_sel
    mismatch = (cls_act != cls_ref) & row_sel
    ref_finite = torch.where((cls_ref == 0) & row_sel, ref, torch.zeros_like(ref))

    counted = ((cls_ref == 0) & row_sel).sum(dim=1)
    row_ms = ref_finite.square().sum(dim=1) / counted.clamp(min=1)
    total = counted.sum().clamp(min=1)
    tensor_rms = torch.sqrt(ref_finite.square().sum() / total)
    if scale == "row":
        row_scale = torch.maximum(torch.sqrt(row_ms), tensor_rms * ROW_SCALE_FLOOR)
    elif scale == "tensor":
        row_scale = tensor_rms.expand(rows)
    else:
        raise ReferenceError_(f"scale must be 'row' or 'tensor', got {scale!r}")
    row_scale = row_scale.clamp(min=_TINY)

    diff = torch.where(both_finite, (act - ref).abs(), torch.zeros_like(ref))
    denom = torch.maximum(row_scale[:, None], ref.abs().nan_to_num(posinf=0.0, neginf=0.0))
    rel = diff / denom
    rel_bad = torch.where(mismatch, torch.full_like(rel, float("inf")), rel)
    judged, judged_bad = rel, rel_bad  # what the bounds judge: the error beyond the allowance, if any
    if allowance is not None:
        allow = _as_matrix(allowance.detach()).to(device=device, dtype=torch.float64)
        if allow.shape != rel.shape or not bool(torch.isfinite(allow).all()) or bool((allow < 0).any()):
            raise ReferenceError_(f"the error allowance must be finite, >= 0 and {rows}x{cols}")
        judged = (diff - allow).clamp(min=0) / denom
        judged_bad = torch.where(mismatch, torch.full_like(judged, float("inf")), judged)

    n_finite = int(both_finite.sum())
    max_abs = float(diff.max()) if diff.numel() else 0.0
    max_rel = float(rel.max()) if rel.numel() else 0.0
    rms_rel = float(torch.sqrt(rel.square().sum() / max(n_finite, 1)))

    finite_per_row = both_finite.sum(dim=1).clamp(min=1)
    row_max_rel = rel_bad.amax(dim=1) if cols else torch.zeros(rows, dtype=torch.float64, device=device)
    row_rms_rel = torch.sqrt(rel.square().sum(dim=1) / finite_per_row)
    row_max_judged, row_rms_judged = row_max_rel, row_rms_rel
    if allowance is not None:
        row_max_judged = judged_bad.amax(dim=1) if cols else row_max_rel
        row_rms_judged = torch.sqrt(judged.square().sum(dim=1) / finite_per_row)
    row_bad = mask & (
        (row_max_judged > tolerance.max_rel) | (row_rms_judged > tolerance.rms_rel) | mismatch.any(dim=1)
    )
    bad_rows = tuple(int(i) for i in torch.nonzero(row_bad).reshape(-1).tolist())

    over = judged_bad > tolerance.max_rel
    elements_over = int(over.sum())
    first_bad = None
    if elements_over:
        flat = int(torch.nonzero(over.reshape(-1))[0])
        r, c = divmod(flat, cols)
        first_bad = BadElement(
            row=r,
            col=c,
            actual=float(act[r, c]),
            expected=float(ref[r, c]),
            rel_err=float(rel_bad[r, c]),
        )

    values = torch.sort(rel[both_finite]).values
    stats = RelErrorStats(
        count=n_finite,
        mean=float(values.mean()) if n_finite else 0.0,
        p50=_quantile(values, 0.5),
        p90=_quantile(values, 0.9),
        p99=_quantile(values, 0.99),
        max=max_rel,
    )
    sel_act = cls_act[row_sel]
    sel_ref = cls_ref[row_sel]
    return Comparison(
        shape=(rows, cols),
        tolerance=tolerance,
        scale_mode=scale,
        rows_compared=int(mask.sum()),
        max_abs=max_abs,
        max_rel=max_rel,
        rms_rel=rms_rel,
        element_stats=stats,
        elements_over=elements_over,
        row_scale=row_scale.to(torch.float32).cpu(),
        row_max_rel=torch.where(mask, row_max_rel, torch.zeros_like(row_max_rel)).to(torch.float32).cpu(),
        row_rms_rel=torch.where(mask, row_rms_rel, torch.zeros_like(row_rms_rel)).to(torch.float32).cpu(),
        bad_rows=bad_rows,
        nan_actual=int((sel_act == 1).sum()),
        nan_reference=int((sel_ref == 1).sum()),
        inf_actual=int((sel_act >= 2).sum()),
        inf_reference=int((sel_ref >= 2).sum()),
        nonfinite_mismatch=int(mismatch.sum()),
        first_bad=first_bad,
        bit_exact=bit_exact(actual, reference),
        judged=None
        if allowance is None
        else (
            float(judged.max()) if judged.numel() else 0.0,
            float(torch.sqrt(judged.square().sum() / max(n_finite, 1))),
        ),
    )


def _case(seed: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 64), (5, 3, 16), (40,), (1, 1), (0, 8), (3, 1), (16, 96)]
    shape = shapes[seed % len(shapes)]
    reference = torch.randn(shape, generator=g, dtype=torch.float64) * torch.logspace(-3, 2, 1).item()
    if reference.dim() >= 2 and reference.numel():
        reference = reference * torch.logspace(-4, 2, reference.shape[-2])[:, None].to(torch.float64)
    dtype = (torch.bfloat16, torch.float32, torch.float16, torch.float64)[seed % 4]
    actual = reference.to(dtype)
    if seed % 3 == 0 and actual.numel():
        flat = actual.view(-1)
        noise = torch.randn(flat.shape, generator=g).to(dtype) * 0.05
        flat += noise * flat.abs()  # some elements over tolerance
    if seed % 5 == 1 and actual.numel() > 4:
        actual.view(-1)[1] = float("nan")
        actual.view(-1)[3] = float("inf")
        reference.view(-1)[3] = float("inf")  # agreeing Inf
        reference.view(-1)[-1] = float("-inf")  # a mismatch
    if seed % 7 == 2 and actual.numel() > 2:
        reference.view(-1)[0] = float("nan")
    options: dict = {"scale": "tensor" if seed % 6 == 5 else "row"}
    matrix_rows = _as_matrix(reference).shape[0]
    if seed % 2:
        options["rows_mask"] = torch.rand(matrix_rows, generator=g) > 0.3
    if seed % 4 == 3:
        options["allowance"] = (
            torch.rand(_as_matrix(reference).shape, generator=g, dtype=torch.float32) * 1e-2
        )
    if seed % 11 == 4:
        actual = reference.clone()  # bit exact
    return actual, reference.float() if seed % 2 else reference, options


def _fields(comparison: Comparison) -> dict:
    values = {
        name: getattr(comparison, name)
        for name in (
            "shape",
            "tolerance",
            "scale_mode",
            "rows_compared",
            "max_abs",
            "max_rel",
            "elements_over",
            "bad_rows",
            "nan_actual",
            "nan_reference",
            "inf_actual",
            "inf_reference",
            "nonfinite_mismatch",
            "first_bad",
            "bit_exact",
        )
    }
    stats = comparison.element_stats
    values["stats"] = (stats.count, stats.p50, stats.p90, stats.p99, stats.max)
    return values


@pytest.mark.parametrize("seed", range(60))
def test_the_packed_comparison_reports_what_the_previous_one_did(seed: int) -> None:
    actual, reference, options = _case(seed)
    now = compare(actual, reference, **options)
    before = compare_before(actual, reference, **options)
    assert repr(_fields(now)) == repr(_fields(before))  # repr: NaN fields compare equal
    # sums taken in another order, a square root of another rounding of one quotient: the last bits may differ
    assert now.element_stats.mean == pytest.approx(before.element_stats.mean, rel=1e-12, abs=0.0)
    assert now.rms_rel == pytest.approx(before.rms_rel, rel=1e-12, abs=0.0)
    assert (now.judged is None) == (before.judged is None)
    if now.judged is not None and before.judged is not None:
        assert now.judged == pytest.approx(before.judged, rel=1e-12, abs=0.0)
    for name in ("row_scale", "row_max_rel", "row_rms_rel"):
        assert torch.equal(getattr(now, name), getattr(before, name)), name
        assert getattr(now, name).dtype == torch.float32 and getattr(now, name).device.type == "cpu"
    assert now.ok == before.ok


def test_an_invalid_allowance_is_still_rejected() -> None:
    reference = torch.randn(4, 8)
    for bad in (torch.full((4, 8), -1.0), torch.full((4, 8), float("nan")), torch.zeros(4, 7)):
        with pytest.raises(ReferenceError_, match="allowance"):
            compare(reference.to(torch.bfloat16), reference, allowance=bad)
    assert bit_exact(reference, reference.clone())
