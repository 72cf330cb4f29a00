"""The split-K rounding allowance: a simulated atomic-add / 16-bit reduction passes, real corruption still fails."""

from __future__ import annotations

import itertools

import pytest
import torch

from moereplay.errors import ReferenceError_
from moereplay.reference.compare import TOLERANCE_BF16, compare
from moereplay.reference.tolerance import (
    ErrorAllowance,
    roundings_of,
    split_k_allowance,
    split_k_magnitudes,
    unit_roundoff,
)

ROWS, K, N, TILE = 48, 2048, 192, 64
TILES = K // TILE


def _problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16-exact activations and weights, per-row coefficients (routing weights), the fp64 reference."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, K, generator=g).to(torch.bfloat16).double()
    w = torch.randn(K, N, generator=g).to(torch.bfloat16).double()
    coefficient = torch.rand(ROWS, generator=g, dtype=torch.float64) * 0.9 + 0.05
    return x, w, coefficient, (x @ w) * coefficient[:, None]


def _slices(slices: int, g: torch.Generator) -> list[tuple[int, int]]:
    """``slices`` contiguous K ranges of whole tiles, at random boundaries."""
    cuts = sorted((torch.randperm(TILES - 1, generator=g)[: slices - 1] + 1).tolist())
    bounds = [0, *cuts, TILES]
    return [(a * TILE, b * TILE) for a, b in itertools.pairwise(bounds)]


def _atomic_add(
    x: torch.Tensor, w: torch.Tensor, coefficient: torch.Tensor, slices: int, seed: int
) -> torch.Tensor:
    """Each slice's float32 partial, times the coefficient, rounded to bf16 and added into a zeroed bf16 output in
    a random order (each add rounds to bf16) — what Marlin's ``use_atomic_add`` does."""
    g = torch.Generator().manual_seed(seed)
    partials = [
        ((x[:, a:b] @ w[a:b]).float() * coefficient[:, None].float()).to(torch.bfloat16)
        for a, b in _slices(slices, g)
    ]
    out = torch.zeros(ROWS, N, dtype=torch.bfloat16)
    for index in torch.randperm(len(partials), generator=g).tolist():
        out = (out.float() + partials[index].float()).to(torch.bfloat16)
    return out


def _half_reduce(
    x: torch.Tensor, w: torch.Tensor, coefficient: torch.Tensor, slices: int, seed: int
) -> torch.Tensor:
    """Blocks of a slice in turn: the running sum passes through bf16 between them; the last applies the
    coefficient and rounds once more — Marlin's ``use_fp32_reduce=False``."""
    g = torch.Generator().manual_seed(seed)
    running = torch.zeros(ROWS, N, dtype=torch.float32)
    ranges = _slices(slices, g)
    for index, (a, b) in enumerate(ranges):
        running = running + (x[:, a:b] @ w[a:b]).float()
        if index < len(ranges) - 1:
            running = running.to(torch.bfloat16).float()
    return (running * coefficient[:, None].float()).to(torch.bfloat16)


def _allowance(atomic: bool) -> torch.Tensor:
    x, w, coefficient, _ = _problem()
    magnitudes = split_k_magnitudes(x.float(), w.float(), TILE)
    return split_k_allowance(
        magnitudes.total,
        magnitudes.subset,
        slices=TILES,
        atomic=atomic,
        dtype=torch.bfloat16,
        coefficient=coefficient,
    )


def _judge(actual: torch.Tensor, reference: torch.Tensor, allowance: torch.Tensor) -> tuple[int, ...]:
    profile = ErrorAllowance(allowance, "atomic add", "test", 1, True).profile(torch.bfloat16)
    return compare(actual, reference, profile=profile, allowance=allowance).bad_rows


@pytest.mark.parametrize("slices", [2, 4, 16, TILES])
def test_simulated_atomic_add_is_ok_where_the_plain_bf16_tolerance_may_not_be(slices: int) -> None:
    x, w, coefficient, reference = _problem()
    allowance = _allowance(atomic=True)
    for seed in range(3):
        actual = _atomic_add(x, w, coefficient, slices, seed)
        assert _judge(actual, reference, allowance) == ()
    if (
        slices == TILES
    ):  # many bf16 roundings: the single-rounding tolerance calls this correct result corrupt
        assert compare(_atomic_add(x, w, coefficient, slices, 0), reference).bad_rows != ()


@pytest.mark.parametrize("slices", [2, 8, TILES])
def test_simulated_16_bit_reduction_is_ok(slices: int) -> None:
    x, w, coefficient, reference = _problem()
    allowance = _allowance(atomic=False)
    for seed in range(3):
        assert _judge(_half_reduce(x, w, coefficient, slices, seed), reference, allowance) == ()


@pytest.mark.parametrize("atomic", [True, False])
def test_wrong_coefficient_zero_row_and_garbage_are_still_corrupt(atomic: bool) -> None:
    x, w, coefficient, reference = _problem()
    allowance = _allowance(atomic)
    simulate = _atomic_add if atomic else _half_reduce
    actual = simulate(x, w, coefficient, 8, 0).float()
    assert _judge(actual.to(torch.bfloat16), reference, allowance) == ()
    actual[3] *= 1.25  # the published case: a row scaled by a wrong coefficient
    actual[5] = 0.0  # a row never written
    actual[9, 17] = 1e4  # garbage in one element
    actual[11] = reference[12].float()  # another row's values
    assert _judge(actual.to(torch.bfloat16), reference, allowance) == (3, 5, 9, 11)


def test_magnitudes_are_the_tile_partial_sums() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 8, generator=g), torch.randn(8, 5, generator=g)
    magnitudes = split_k_magnitudes(x, w, 2)
    partials = torch.stack([x[:, t : t + 2].double() @ w[t : t + 2].double() for t in range(0, 8, 2)])
    assert magnitudes.tiles == 4
    torch.testing.assert_close(magnitudes.total.double(), partials.abs().sum(0), rtol=1e-5, atol=1e-6)
    subset = torch.maximum(partials.clamp(min=0).sum(0), -partials.clamp(max=0).sum(0))
    torch.testing.assert_close(magnitudes.subset.double(), subset, rtol=1e-5, atol=1e-6)
    assert bool((magnitudes.subset >= (x @ w).abs() - 1e-5).all())  # every subset sum, the full one included
    with pytest.raises(ReferenceError_, match="does not divide"):
        split_k_magnitudes(x, w, 3)


def test_bound_arithmetic_and_bad_allowances() -> None:
    total, subset = torch.full((2, 3), 4.0), torch.full((2, 3), 3.0)
    u = unit_roundoff(torch.bfloat16)
    atomic = split_k_allowance(total, subset, slices=5, atomic=True, dtype=torch.bfloat16)
    assert torch.allclose(atomic, torch.full((2, 3), u * (4.0 + 4 * 3.0)))
    reduce16 = split_k_allowance(
        total,
        subset,
        slices=5,
        atomic=False,
        dtype=torch.float16,
        coefficient=torch.tensor([2.0, float("nan")]),
    )
    assert (
        float(reduce16[0, 0]) == pytest.approx(2 * 4 * 3.0 * 2.0**-11, rel=1e-4) and float(reduce16[1, 0]) > 0
    )
    assert float(reduce16[1, 0]) < 1e-6  # a row with a non-finite coefficient gets no rounding allowance
    assert roundings_of(5, atomic=True) == 9 and roundings_of(5, atomic=False) == 4
    reference = torch.ones(2, 3)
    with pytest.raises(ReferenceError_, match="allowance"):
        compare(reference, reference, allowance=torch.full((2, 3), float("inf")))
    with pytest.raises(ReferenceError_, match="allowance"):
        compare(reference, reference, allowance=torch.zeros(3, 2))
    named = ErrorAllowance(atomic, "atomic add", "atomic add (≤5)", 9, True).profile(torch.bfloat16)
    assert named.name == "bf16+atomic add (≤5)" and named.max_rel == TOLERANCE_BF16.max_rel


def test_reported_errors_stay_raw_and_judged_ones_are_beyond_the_allowance() -> None:
    reference = torch.ones(2, 4)
    actual = reference.clone()
    actual[0, 1] = 1.05
    plain = compare(actual, reference, profile=TOLERANCE_BF16)
    assert plain.bad_rows == (0,) and not plain.ok and plain.judged is None
    allowed = compare(actual, reference, profile=TOLERANCE_BF16, allowance=torch.full((2, 4), 0.045))
    assert allowed.bad_rows == () and allowed.ok and allowed.first_bad is None
    assert allowed.max_rel == pytest.approx(0.05, rel=1e-4) and allowed.judged is not None
    assert allowed.judged[0] == pytest.approx(0.005, rel=1e-4)
