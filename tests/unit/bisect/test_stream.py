"""Strategy ``calls``: the first bad item of an ordered stream."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moereplay.bisect import (
    BisectError,
    FirstBadSearch,
    Interval,
    Observation,
    Outcome,
    Signature,
    SignatureMatch,
    run_to_end,
)
from moereplay.bisect.probes import ItemProbe

TARGET = Signature("corrupt", frozenset({"wrong_routing_weight"}), frozenset({3}))
OTHER = Signature("nonfinite", frozenset({"nan_columns"}))


def monotone(first_bad: int, unresolved: frozenset[int] = frozenset(), drift: frozenset[int] = frozenset()):
    """Good before ``first_bad``, the target failure from there on; some indices unresolved or another bug."""
    asked: list[int] = []

    def predicate(probe: ItemProbe[int]) -> Observation:
        asked.append(probe.index)
        if probe.index in unresolved:
            return Observation.unresolved("invalid")
        if probe.index in drift:
            return Observation.bad(OTHER)
        if probe.index >= first_bad:
            return Observation.bad(TARGET)
        return Observation.good()

    predicate.asked = asked  # type: ignore[attr-defined]
    return predicate


def test_finds_the_first_bad_call_and_adopts_the_target_signature() -> None:
    search = FirstBadSearch(list(range(1000)), labels=[f"call {index}" for index in range(1000)])
    result = run_to_end(search, monotone(613))
    assert result.status == "found"
    assert result.first_bad == 613
    assert result.last_good == 612
    assert result.labels == ("call 613",)
    assert result.target == TARGET
    assert search.probes_asked <= math.ceil(math.log2(1000)) + 1


def test_first_item_bad_has_no_last_good() -> None:
    result = run_to_end(FirstBadSearch(list(range(10))), monotone(0))
    assert (result.status, result.first_bad, result.last_good) == ("found", 0, None)


def test_known_bad_end_passing_means_no_failure() -> None:
    result = run_to_end(FirstBadSearch(list(range(10))), monotone(10))
    assert result.status == "no_failure"
    assert result.first_bad is None


def test_known_bad_end_failing_differently_is_unresolved() -> None:
    search = FirstBadSearch(list(range(10)), target=TARGET)
    result = run_to_end(search, monotone(3, drift=frozenset({9})))
    assert result.status == "unresolved_end"


def test_a_different_failure_is_skipped_not_taken_as_the_bug() -> None:
    # Items 2..4 fail with another bug; a search that drifted would report 2.
    predicate = monotone(6, drift=frozenset({2, 3, 4}))
    result = run_to_end(FirstBadSearch(list(range(12))), predicate)
    assert result.status == "found"
    assert result.first_bad == 6


def test_skips_next_to_the_boundary_leave_a_range() -> None:
    predicate = monotone(40, unresolved=frozenset({38, 39, 40}))
    result = run_to_end(FirstBadSearch(list(range(64))), predicate)
    assert result.status == "ambiguous"
    assert result.first_bad is None
    assert result.candidates == (38, 39, 40, 41)
    assert result.last_good == 37


def test_known_good_and_bad_bound_the_search() -> None:
    predicate = monotone(30)
    result = run_to_end(FirstBadSearch(list(range(100)), known_good=20, known_bad=50), predicate)
    assert result.first_bad == 30
    assert all(20 < index <= 50 for index in predicate.asked)
    assert predicate.asked[0] == 50


def test_driven_step_by_step_with_person_overrides() -> None:
    search = FirstBadSearch(list(range(16)))
    assert search.current is not None and search.current.index == 15
    assert "known-bad end" in search.progress.line
    search.observe(Observation.bad(TARGET))
    assert search.progress.line == "first bad is one of items 0..15 (16 left)"
    decisions = {7: Outcome.GOOD, 11: Outcome.UNRESOLVED, 10: Outcome.BAD, 8: Outcome.GOOD, 9: Outcome.GOOD}
    while (probe := search.current) is not None:
        decided = decisions[probe.index]
        search.observe(Observation.bad(TARGET) if decided is Outcome.BAD else Observation(decided))
    assert search.result.first_bad == 10
    assert search.progress.line == "done: found"


def test_progress_reports_skips() -> None:
    search = FirstBadSearch(list(range(16)))
    for observation in (Observation.bad(TARGET), Observation.good(), Observation.unresolved()):
        search.observe(observation)
    assert search.progress.line == "first bad is one of items 8..15 (8 left, 1 skipped)"
    assert search.progress.data == {"last_good": 7, "first_known_bad": 15, "skipped": [11]}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"known_good": 5, "known_bad": 5}, "known good"), ({"known_bad": 10}, "known good")],
)
def test_bad_bounds_are_refused(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(BisectError, match=message):
        FirstBadSearch(list(range(10)), **kwargs)


def test_empty_stream_is_refused() -> None:
    with pytest.raises(BisectError):
        FirstBadSearch([])


def test_observing_a_finished_search_is_an_error() -> None:
    search = FirstBadSearch([0])
    search.observe(Observation.good())
    assert search.done
    with pytest.raises(BisectError):
        search.observe(Observation.good())


@given(
    length=st.integers(1, 300),
    data=st.data(),
)
def test_first_bad_is_found_for_any_monotone_stream(length: int, data: st.DataObject) -> None:
    first_bad = data.draw(st.integers(0, length))
    search = FirstBadSearch(list(range(length)), match=SignatureMatch.EXACT)
    result = run_to_end(search, monotone(first_bad))
    if first_bad == length:
        assert result.status == "no_failure"
    else:
        assert (result.status, result.first_bad) == ("found", first_bad)
        assert search.probes_asked <= math.ceil(math.log2(length)) + 1 if length > 1 else 1


@given(length=st.integers(2, 200), data=st.data())
def test_with_skips_the_true_first_bad_is_always_a_candidate(length: int, data: st.DataObject) -> None:
    first_bad = data.draw(st.integers(0, length - 1))
    skipped = data.draw(st.frozensets(st.integers(0, length - 2), max_size=length // 2))
    drift = data.draw(st.frozensets(st.integers(0, length - 2), max_size=3)) - skipped
    result = run_to_end(FirstBadSearch(list(range(length))), monotone(first_bad, skipped, drift))
    assert result.status in ("found", "ambiguous")
    assert first_bad in result.candidates
    if result.status == "found":
        assert result.first_bad == first_bad
    else:
        # Every candidate but the last is a skipped (unresolved or other-bug) index.
        assert set(result.candidates[:-1]) <= skipped | drift
        assert result.candidates[-1] >= first_bad
    assert result.last_good is None or result.last_good < first_bad


def test_interval_invariants() -> None:
    interval = Interval(3, 7, (4, 6))
    assert not interval.exact
    assert interval.candidates == (4, 6, 7)
    assert Interval(3, 4, ()).exact
    with pytest.raises(ValueError):
        Interval(4, 4, ())
    with pytest.raises(ValueError):
        Interval(3, 7, (8,))
