"""Strategy ``packs``: the first kernel pack where the behaviour changes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moereplay.bisect import BisectError, Observation, PackSearch, Signature, SignatureMatch, run_to_end
from moereplay.bisect.probes import ItemProbe

RELEASES = ["0.20.0", "0.20.1", "0.21.0", "0.22.0", "0.23.0", "0.24.0", "0.25.0", "0.25.1"]
TARGET = Signature("corrupt", frozenset({"wrong_routing_weight"}))
OTHER = Signature("crash", frozenset({"illegal_address"}))


def by_release(table: dict[str, Observation], default: Observation):
    def predicate(probe: ItemProbe[str]) -> Observation:
        return table.get(probe.item, default)

    return predicate


def test_finds_the_release_that_regressed() -> None:
    bad_from = RELEASES.index("0.23.0")
    result = run_to_end(
        PackSearch(RELEASES),
        lambda probe: Observation.bad(TARGET) if probe.index >= bad_from else Observation.good(),
    )
    assert result.status == "found"
    assert result.first_changed == bad_from
    assert result.to_json()["first_changed"] == "0.23.0"
    assert result.lines() == (
        "behaviour changes at 0.23.0 (after 0.22.0): good -> bad: corrupt [wrong_routing_weight]",
    )


def test_finds_the_release_that_fixed_it() -> None:
    fixed_at = RELEASES.index("0.25.0")
    result = run_to_end(
        PackSearch(RELEASES),
        lambda probe: Observation.good() if probe.index >= fixed_at else Observation.bad(TARGET),
    )
    assert (result.status, result.first_changed) == ("found", fixed_at)


def test_a_versus_b() -> None:
    search = PackSearch(["pack:A", "pack:B"])
    result = run_to_end(
        search, lambda probe: Observation.good() if probe.index == 0 else Observation.bad(TARGET)
    )
    assert (result.status, result.first_changed, search.probes_asked) == ("found", 1, 2)
    same = run_to_end(PackSearch(["pack:A", "pack:B"]), lambda probe: Observation.bad(TARGET))
    assert same.status == "no_change"


def test_a_change_of_failure_signature_is_a_change_of_behaviour() -> None:
    result = run_to_end(
        PackSearch(RELEASES),
        lambda probe: Observation.bad(OTHER if probe.index >= 5 else TARGET),
    )
    assert (result.status, result.first_changed) == ("found", 5)
    loose = run_to_end(
        PackSearch(RELEASES, match=SignatureMatch.ANY),
        lambda probe: Observation.bad(OTHER if probe.index >= 5 else TARGET),
    )
    assert loose.status == "no_change"


def test_packs_that_cannot_run_or_show_a_third_behaviour_are_skipped() -> None:
    table = {
        "0.22.0": Observation.unresolved("pack needs torch 2.9"),
        "0.23.0": Observation.bad(OTHER),
        "0.24.0": Observation.bad(TARGET),
        "0.25.0": Observation.bad(TARGET),
        "0.25.1": Observation.bad(TARGET),
    }
    result = run_to_end(PackSearch(RELEASES), by_release(table, Observation.good()))
    assert result.status == "ambiguous"
    assert [RELEASES[index] for index in result.candidates] == ["0.22.0", "0.23.0", "0.24.0"]


def test_an_end_that_cannot_run_is_unresolved() -> None:
    table = {"0.20.0": Observation.unresolved("pack missing")}
    result = run_to_end(PackSearch(RELEASES), by_release(table, Observation.bad(TARGET)))
    assert result.status == "endpoint_unresolved"


def test_fewer_than_two_packs_is_refused() -> None:
    with pytest.raises(BisectError):
        PackSearch(["only"])


@given(count=st.integers(2, 60), data=st.data())
def test_first_change_is_found_in_any_monotone_list(count: int, data: st.DataObject) -> None:
    changed_at = data.draw(st.integers(1, count - 1))
    regression = data.draw(st.booleans())

    def predicate(probe: ItemProbe[int]) -> Observation:
        new = probe.index >= changed_at
        return Observation.bad(TARGET) if new == regression else Observation.good()

    result = run_to_end(PackSearch(list(range(count))), predicate)
    assert (result.status, result.first_changed) == ("found", changed_at)
