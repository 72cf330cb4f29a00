"""Strategy ``mutations``: ddmin for the minimal passing mutation set."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moereplay.bisect import BisectError, MutationSearch, Observation, Outcome, Signature, run_to_end
from moereplay.bisect.ddmin import split
from moereplay.bisect.probes import SubsetProbe

TARGET = Signature("corrupt", frozenset({"wrong_routing_weight"}))
OTHER = Signature("crash", frozenset({"illegal_address"}))

MUTATIONS = [
    "flip mul_topk_weights",
    "set moe_block_size=64",
    "cast topk_weights=float32",
    "flip use_atomic_add",
    "set thread_k=128",
    "flip use_fp32_reduce",
    "fill 0x00",
    "flip is_k_full",
]


def needs(required: set[str], *, poison: Callable[[frozenset[str]], Observation | None] | None = None):
    """Passes exactly when every ``required`` mutation is applied, unless ``poison`` says otherwise."""

    def predicate(probe: SubsetProbe[str]) -> Observation:
        applied = frozenset(probe.items)
        if poison is not None and (special := poison(applied)) is not None:
            return special
        return Observation.good() if required <= applied else Observation.bad(TARGET)

    return predicate


def test_finds_the_required_pair_and_classifies_the_rest() -> None:
    search = MutationSearch(MUTATIONS)
    result = run_to_end(search, needs({"cast topk_weights=float32", "flip use_fp32_reduce"}))
    assert result.status == "minimised"
    assert result.names(result.minimal) == ["cast topk_weights=float32", "flip use_fp32_reduce"]
    assert len(result.irrelevant) == len(MUTATIONS) - 2
    assert result.interfering == () and result.undetermined == ()
    assert result.target == TARGET
    assert "do not matter" in "\n".join(result.lines())


def test_interfering_and_undetermined_mutations_are_reported() -> None:
    def poison(applied: frozenset[str]) -> Observation | None:
        if "fill 0x00" in applied and len(applied) < len(MUTATIONS):
            return Observation.bad(TARGET)  # undoes the fix
        if "set thread_k=128" in applied and len(applied) < len(MUTATIONS):
            return Observation.unresolved("invalid: thread_k=128 with this N")
        return None

    result = run_to_end(MutationSearch(MUTATIONS), needs({"flip mul_topk_weights"}, poison=poison))
    assert result.names(result.minimal) == ["flip mul_topk_weights"]
    assert result.names(result.interfering) == ["fill 0x00"]
    assert result.names(result.undetermined) == ["set thread_k=128"]


def test_a_subset_failing_differently_is_not_a_pass() -> None:
    # Dropping "flip is_k_full" turns the failure into a crash: that is another bug, not a fix.
    def poison(applied: frozenset[str]) -> Observation | None:
        return Observation.bad(OTHER) if "flip is_k_full" not in applied and applied else None

    result = run_to_end(MutationSearch(MUTATIONS), needs({"flip mul_topk_weights"}, poison=poison))
    assert set(result.names(result.minimal)) == {"flip mul_topk_weights", "flip is_k_full"}


def test_baseline_that_passes_has_nothing_to_minimise() -> None:
    search = MutationSearch(MUTATIONS)
    result = run_to_end(search, lambda probe: Observation.good())
    assert result.status == "baseline_passes"
    assert search.probes_asked == 1


def test_baseline_with_another_signature_is_unresolved() -> None:
    result = run_to_end(MutationSearch(MUTATIONS, target=TARGET), lambda probe: Observation.bad(OTHER))
    assert result.status == "baseline_unresolved"


def test_full_set_must_pass() -> None:
    result = run_to_end(MutationSearch(MUTATIONS), lambda probe: Observation.bad(TARGET))
    assert result.status == "full_set_does_not_pass"
    assert result.minimal == ()


def test_progress_shows_the_passing_set() -> None:
    search = MutationSearch(MUTATIONS[:4])
    search.observe(Observation.bad(TARGET))  # baseline
    search.observe(Observation.good())  # all four
    assert search.progress.line == "4 mutations pass together; trying 2 parts and their complements"
    assert search.progress.data["passing"] == MUTATIONS[:4]


def test_each_subset_is_asked_at_most_once() -> None:
    asked: list[tuple[int, ...]] = []

    def predicate(probe: SubsetProbe[str]) -> Observation:
        asked.append(probe.indices)
        return needs({"flip use_atomic_add", "fill 0x00"})(probe)

    run_to_end(MutationSearch(MUTATIONS), predicate)
    assert len(asked) == len(set(asked))


def test_without_mutations_is_refused() -> None:
    with pytest.raises(BisectError):
        MutationSearch([])


@given(st.integers(1, 40), st.integers(1, 12))
def test_split_is_balanced_and_complete(length: int, parts: int) -> None:
    parts = min(parts, length)
    chunks = split(list(range(length)), parts)
    assert [index for chunk in chunks for index in chunk] == list(range(length))
    assert max(map(len, chunks)) - min(map(len, chunks)) <= 1


@settings(max_examples=150, deadline=None)
@given(count=st.integers(1, 12), seed=st.integers(0, 2**32 - 1), unresolved_rate=st.sampled_from([0, 2, 4]))
def test_result_is_one_minimal_under_any_predicate(count: int, seed: int, unresolved_rate: int) -> None:
    """Whatever the predicate, the answer passes and removing any one mutation from it does not."""

    def judge(indices: tuple[int, ...]) -> Observation:
        if not indices:
            return Observation.bad(TARGET)
        if len(indices) == count:
            return Observation.good()
        digest = hashlib.sha256(f"{seed}:{indices}".encode()).digest()[0] % 8
        if digest < unresolved_rate:
            return Observation.unresolved("invalid")
        if digest == 7:
            return Observation.bad(OTHER)
        return Observation.good() if digest % 2 else Observation.bad(TARGET)

    search = MutationSearch(list(range(count)))
    result = run_to_end(search, lambda probe: judge(probe.indices))
    assert result.status == "minimised"
    assert judge(result.minimal).outcome is Outcome.GOOD
    for dropped in result.minimal:
        rest = tuple(index for index in result.minimal if index != dropped)
        assert search.classify(judge(rest)) is not Outcome.GOOD
    covered = (
        set(result.minimal) | set(result.irrelevant) | set(result.interfering) | set(result.undetermined)
    )
    assert covered == set(range(count))


@settings(max_examples=100, deadline=None)
@given(count=st.integers(1, 16), data=st.data())
def test_monotone_predicate_gives_exactly_the_required_set(count: int, data: st.DataObject) -> None:
    required = data.draw(st.frozensets(st.integers(0, count - 1), min_size=1))
    search = MutationSearch(list(range(count)))
    result = run_to_end(
        search,
        lambda probe: Observation.good() if required <= set(probe.indices) else Observation.bad(TARGET),
    )
    assert set(result.minimal) == required
    assert set(result.irrelevant) == set(range(count)) - required
