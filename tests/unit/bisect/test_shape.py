"""Strategy ``shape``: the minimal failing shape over legal dimension values."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moereplay.bisect import BisectError, Dimension, Observation, Outcome, ShapeSearch, Signature, run_to_end
from moereplay.bisect.probes import ShapeProbe
from moereplay.bisect.shape import ILLEGAL_NOTE

TARGET = Signature("corrupt", frozenset({"wrong_routing_weight"}), frozenset({3}))
SHRUNK_EXPERTS = Signature("corrupt", frozenset({"wrong_routing_weight"}), frozenset({0}))
OTHER = Signature("nonfinite", frozenset({"nan_columns"}))


def marlin_like() -> list[Dimension]:
    return [
        Dimension.stepped("experts", 32),
        Dimension.stepped("tokens", 32),
        Dimension.choices("top_k", [1, 2, 4], 4),
        Dimension.stepped("N", 2880, step=64, minimum=64),
        Dimension.stepped("K", 2944, step=128, minimum=128),
    ]


def fails_when(rule: Callable[[Mapping[str, int]], Observation | None]):
    asked: list[dict[str, int]] = []

    def predicate(probe: ShapeProbe) -> Observation:
        shape = dict(probe.shape)
        asked.append(shape)
        verdict = rule(shape)
        return Observation.good() if verdict is None else verdict

    predicate.asked = asked  # type: ignore[attr-defined]
    return predicate


def test_shrinks_to_thresholds_and_reports_roles() -> None:
    def rule(shape: Mapping[str, int]) -> Observation | None:
        if shape["tokens"] >= 2 and shape["K"] >= 2000:
            # The affected experts change as the shape shrinks; the kind of defect does not.
            return Observation.bad(TARGET if shape["experts"] > 3 else SHRUNK_EXPERTS)
        return None

    search = ShapeSearch(marlin_like())
    result = run_to_end(search, fails_when(rule))
    assert result.status == "shrunk"
    assert result.converged
    assert dict(result.minimal) == {"experts": 1, "tokens": 2, "top_k": 1, "N": 64, "K": 2048}
    roles = {report.name: report.role for report in result.dimensions}
    assert roles == {"experts": "free", "tokens": "matters", "top_k": "free", "N": "free", "K": "matters"}
    k_report = next(report for report in result.dimensions if report.name == "K")
    assert (k_report.lost_at, k_report.lost_outcome) == (1920, Outcome.GOOD)
    assert "K: matters (fails at 2048, passes at 1920)" in "\n".join(result.lines())


def test_does_not_drift_to_a_different_failure_at_small_shapes() -> None:
    # Below 8 tokens a different bug (NaNs) appears; the search must not accept those shapes.
    def rule(shape: Mapping[str, int]) -> Observation | None:
        if shape["tokens"] < 8:
            return Observation.bad(OTHER)
        return Observation.bad(TARGET)

    result = run_to_end(ShapeSearch(marlin_like()), fails_when(rule))
    minimal = dict(result.minimal)
    assert minimal["tokens"] == 8
    tokens = next(report for report in result.dimensions if report.name == "tokens")
    assert tokens.role == "undetermined"  # smaller values fail differently: unresolved, not "passes"


def test_unresolved_values_are_skipped_during_the_binary_search() -> None:
    def rule(shape: Mapping[str, int]) -> Observation | None:
        if shape["tokens"] in (9, 10, 11):
            return Observation.unresolved("invalid: tokens not a multiple the kernel supports")
        return Observation.bad(TARGET) if shape["tokens"] >= 12 else None

    dimensions = [Dimension.stepped("tokens", 32)]
    result = run_to_end(ShapeSearch(dimensions), fails_when(rule))
    assert dict(result.minimal) == {"tokens": 12}
    (tokens,) = result.dimensions
    assert (tokens.role, tokens.lost_at) == ("matters", 8)


def test_illegal_shapes_are_never_run() -> None:
    predicate = fails_when(lambda shape: Observation.bad(TARGET) if shape["experts"] >= 4 else None)
    search = ShapeSearch(
        [Dimension.stepped("experts", 16), Dimension.choices("top_k", [1, 2, 4, 8], 8)],
        legal=lambda shape: shape["top_k"] <= shape["experts"],
    )
    result = run_to_end(search, predicate)
    assert all(shape["top_k"] <= shape["experts"] for shape in predicate.asked)
    assert dict(result.minimal) == {"experts": 4, "top_k": 1}
    illegal = search.observation_for(search.probe_of({"experts": 1, "top_k": 8}))
    assert illegal is None or illegal.note == ILLEGAL_NOTE


def test_original_shape_not_failing_is_not_reproduced() -> None:
    search = ShapeSearch(marlin_like(), target=TARGET)
    result = run_to_end(search, fails_when(lambda shape: Observation.bad(OTHER)))
    assert result.status == "not_reproduced"
    assert search.probes_asked == 1


def test_dimension_at_its_minimum_is_untested() -> None:
    result = run_to_end(
        ShapeSearch([Dimension.stepped("top_k", 1), Dimension.stepped("tokens", 4)]),
        fails_when(lambda shape: Observation.bad(TARGET)),
    )
    roles = {report.name: report.role for report in result.dimensions}
    assert roles == {"top_k": "untested", "tokens": "free"}


def test_max_rounds_bounds_the_search() -> None:
    # Shrinking one dimension unlocks the other: needs more than one round.
    def rule(shape: Mapping[str, int]) -> Observation | None:
        return Observation.bad(TARGET) if shape["a"] + shape["b"] >= 20 or shape["a"] == shape["b"] else None

    dimensions = [Dimension.stepped("a", 16), Dimension.stepped("b", 16)]
    result = run_to_end(ShapeSearch(dimensions, max_rounds=1), fails_when(rule))
    assert not result.converged
    assert "may shrink further" in "\n".join(result.lines())


def test_progress_names_the_dimension_being_shrunk() -> None:
    search = ShapeSearch([Dimension.stepped("experts", 8), Dimension.stepped("tokens", 16)])
    search.observe(Observation.bad(TARGET))
    assert search.progress.line == "round 1: shrinking experts from 8"
    assert search.progress.data == {"shape": {"experts": 8, "tokens": 16}, "round": 1, "dimension": "experts"}


def test_dimension_constructors() -> None:
    assert Dimension.stepped("K", 80, step=16).values == (16, 32, 48, 64, 80)
    assert Dimension.stepped("K", 88, step=16).values == (16, 32, 48, 64, 80, 88)
    assert Dimension.stepped("tokens", 5, minimum=2).values == (2, 3, 4, 5)
    assert Dimension.choices("block", [64, 8, 16, 32, 8], 32).values == (8, 16, 32)
    with pytest.raises(BisectError):
        Dimension("K", (16, 8), 16)
    with pytest.raises(BisectError):
        Dimension("K", (8, 16), 12)
    with pytest.raises(BisectError):
        Dimension.stepped("K", 8, step=16)
    with pytest.raises(BisectError):
        ShapeSearch([Dimension.stepped("a", 4), Dimension.stepped("a", 8)])


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_monotone_thresholds_are_found_exactly(data: st.DataObject) -> None:
    """For a failure that needs each dimension at or above a threshold, the minimal shape is the thresholds."""
    count = data.draw(st.integers(1, 4))
    originals = [data.draw(st.integers(1, 40)) for _ in range(count)]
    thresholds = [data.draw(st.integers(1, original)) for original in originals]
    dimensions = [Dimension.stepped(f"d{index}", original) for index, original in enumerate(originals)]

    def rule(shape: Mapping[str, int]) -> Observation | None:
        holds = all(shape[f"d{index}"] >= threshold for index, threshold in enumerate(thresholds))
        return Observation.bad(TARGET) if holds else None

    result = run_to_end(ShapeSearch(dimensions), fails_when(rule))
    assert [value for _, value in result.minimal] == thresholds
    for report, threshold, original in zip(result.dimensions, thresholds, originals, strict=True):
        if original == 1:
            assert report.role == "untested"
        elif threshold == 1:
            assert report.role == "free"
        else:
            assert report.role == "matters"
            assert report.lost_at == threshold - 1
