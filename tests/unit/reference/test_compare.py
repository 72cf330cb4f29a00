"""compare(): relative errors against the reference scale, NaN/Inf agreement, bad rows, bit exactness."""

from __future__ import annotations

import pytest
import torch

from moereplay.errors import ReferenceError_
from moereplay.reference.compare import (
    TOLERANCE_BF16,
    TOLERANCE_FP8_E4M3,
    TOLERANCE_FP16,
    TOLERANCE_FP32,
    Tolerance,
    bit_exact,
    compare,
    profile_for,
)


def _reference(rows: int = 8, cols: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-3, 2, rows)[:, None]  # rows of very different magnitude, like routing weights
    return torch.randn(rows, cols, generator=g) * scales


def test_identical_and_bf16_rounding() -> None:
    ref = _reference()
    same = compare(ref.clone(), ref)
    assert same.ok and same.max_rel == 0.0 and same.rms_rel == 0.0 and same.bit_exact
    rounded = compare(ref.to(torch.bfloat16), ref)
    assert rounded.tolerance is TOLERANCE_BF16
    assert rounded.ok, rounded.summary()
    assert 0 < rounded.max_rel <= 2.0**-8
    assert rounded.bad_rows == () and rounded.first_bad is None
    assert not rounded.bit_exact
    assert rounded.rows_compared == 8 and rounded.shape == (8, 64)
    assert rounded.element_stats.count == 8 * 64
    assert rounded.element_stats.p50 <= rounded.element_stats.p99 <= rounded.element_stats.max


def test_a_scaled_row_is_found_even_when_small() -> None:
    """Row 1 has magnitude ~1e-3 of the largest row; scaling it by 2 must still flag exactly that row."""
    ref = _reference()
    actual = ref.clone()
    actual[1] *= 2.0
    result = compare(actual.to(torch.bfloat16), ref)
    assert not result.ok
    assert result.bad_rows == (1,)
    assert result.first_bad is not None and result.first_bad.row == 1
    assert result.row_max_rel[1] > 0.5 and float(result.row_max_rel[0]) < 1e-2
    # against the whole tensor's RMS (triton_kernels' choice) the same error hides under the big rows
    assert compare(actual, ref, scale="tensor", profile=TOLERANCE_BF16).bad_rows == ()


def test_nan_and_inf_agreement() -> None:
    ref = _reference()
    ref[2, 5] = float("nan")
    ref[3, 7] = float("inf")
    agree = ref.clone()
    agree_result = compare(agree, ref)
    assert agree_result.ok and agree_result.nonfinite_positions_agree
    assert (agree_result.nan_actual, agree_result.nan_reference) == (1, 1)
    assert (agree_result.inf_actual, agree_result.inf_reference) == (1, 1)

    moved = ref.clone()
    moved[2, 5] = 0.0
    moved[4, 1] = float("nan")
    result = compare(moved, ref)
    assert not result.ok and not result.nonfinite_positions_agree
    assert result.nonfinite_mismatch == 2
    assert result.bad_rows == (2, 4)
    assert result.first_bad is not None
    assert (result.first_bad.row, result.first_bad.col) == (2, 5)
    assert result.first_bad.rel_err == float("inf")

    flipped = ref.clone()
    flipped[3, 7] = float("-inf")
    assert compare(flipped, ref).nonfinite_mismatch == 1


def test_zero_rows() -> None:
    ref = _reference()
    ref[5] = 0.0
    assert compare(ref.clone(), ref).ok
    actual = ref.clone()
    actual[5, 3] = 1e-3  # the row should be zero; judged against the tensor-RMS floor, this is wrong
    result = compare(actual, ref)
    assert result.bad_rows == (5,)
    all_zero = torch.zeros(3, 4)
    assert compare(all_zero.clone(), all_zero).ok
    assert not compare(all_zero + 1e-3, all_zero).ok


def test_rows_mask_excludes_unwritten_rows() -> None:
    ref = _reference()
    actual = ref.clone()
    actual[6] = float("nan")  # garbage in a row the kernel never writes
    mask = torch.ones(8, dtype=torch.bool)
    mask[6] = False
    result = compare(actual, ref, rows_mask=mask)
    assert result.ok and result.rows_compared == 7 and result.nan_actual == 0
    assert float(result.row_max_rel[6]) == 0.0
    with pytest.raises(ReferenceError_, match="rows_mask"):
        compare(actual, ref, rows_mask=mask[:3])


def test_shapes_profiles_and_errors() -> None:
    with pytest.raises(ReferenceError_, match="shapes"):
        compare(torch.zeros(2, 3), torch.zeros(3, 2))
    assert profile_for(torch.float32) is TOLERANCE_FP32
    assert profile_for(torch.float16) is TOLERANCE_FP16
    assert profile_for(torch.float8_e4m3fn) is TOLERANCE_FP8_E4M3
    with pytest.raises(ReferenceError_, match="profile"):
        profile_for(torch.int32)
    with pytest.raises(ReferenceError_):
        Tolerance("bad", 0.0, 1.0, "no")
    for profile in (TOLERANCE_FP32, TOLERANCE_BF16, TOLERANCE_FP16, TOLERANCE_FP8_E4M3):
        assert profile.rms_rel < profile.max_rel and profile.rationale
    vector = compare(torch.ones(5), torch.ones(5))
    assert vector.shape == (1, 5)
    batched = compare(torch.ones(2, 3, 4), torch.ones(2, 3, 4))
    assert batched.shape == (6, 4)


def test_fp8_output() -> None:
    ref = torch.randn(8, 32, generator=torch.Generator().manual_seed(3)) * 10  # inside e4m3's normal range
    actual = ref.to(torch.float8_e4m3fn)
    result = compare(actual, ref)
    assert result.tolerance is TOLERANCE_FP8_E4M3 and result.ok, result.summary()


def test_bit_exact() -> None:
    a = torch.tensor([1.0, -0.0, float("nan")])
    assert bit_exact(a, a.clone())
    assert not bit_exact(a, torch.tensor([1.0, 0.0, float("nan")]))  # signed zero
    other_nan = a.clone()
    other_nan.view(torch.int32)[2] = 0x7FC00001
    assert not bit_exact(a, other_nan)  # NaN payload
    assert not bit_exact(a, a.to(torch.float64))
    assert not bit_exact(a, a[:2])
    assert bit_exact(torch.empty(0), torch.empty(0))
    strided = torch.arange(12.0).reshape(3, 4).T
    assert bit_exact(strided, strided.contiguous())


def test_summary_line() -> None:
    ref = _reference()
    actual = ref.clone()
    actual[0, 0] = float("nan")
    line = compare(actual, ref).summary()
    assert line.startswith("BAD") and "first_bad=(0,0)" in line and "\n" not in line


def test_aligned_drops_only_leading_dimensions_of_one() -> None:
    from moereplay.reference.compare import aligned

    output = torch.arange(12.0).reshape(1, 3, 4)
    view = aligned(output, (3, 4))
    assert view is not None and view.shape == (3, 4) and view.data_ptr() == output.data_ptr()
    assert aligned(output[0], (1, 3, 4)) is not None and aligned(output, (1, 3, 4)) is output
    for other in ((4, 3), (12,), (3, 1, 4)):  # other elements, or the same ones in another layout
        assert aligned(output, other) is None


@pytest.mark.parametrize("finite", [0, 1, 2, 7, 100, 1000])
def test_the_in_place_quantiles_are_those_of_a_full_sort(finite: int) -> None:
    """The CPU picks the quantiles of the finite relative errors by a partial sort in place: the same elements
    as sorting a copy (the rest of the elements are +inf and sort last)."""
    from moereplay.reference import compare as compare_module

    gen = torch.Generator().manual_seed(finite)
    values = torch.rand(1000, generator=gen, dtype=torch.float64) ** 3
    values[finite:] = float("inf")
    values = values[torch.randperm(1000, generator=gen)]
    count = torch.tensor(float(finite), dtype=torch.float64)
    expected = values.sort().values.index_select(0, compare_module._quantile_positions(count))
    got = compare_module._order_statistics(values.clone(), count)
    assert torch.equal(got, expected)
