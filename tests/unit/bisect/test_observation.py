from __future__ import annotations

import pytest

from moereplay.bisect import (
    BisectLogError,
    Observation,
    Outcome,
    Signature,
    SignatureMatch,
    classify,
)

TARGET = Signature("corrupt", frozenset({"wrong_routing_weight"}), frozenset({3, 7}))
OTHER = Signature("nonfinite", frozenset({"nan_columns"}), frozenset({1}))


def test_signature_round_trips_through_json() -> None:
    assert Signature.from_json(TARGET.to_json()) == TARGET
    assert TARGET.to_json() == {
        "verdict": "corrupt",
        "finding_kinds": ["wrong_routing_weight"],
        "experts": [3, 7],
    }


def test_observation_round_trips_through_json() -> None:
    for observation in (
        Observation.good("fine"),
        Observation.bad(TARGET, "rows 0-3"),
        Observation.bad(None),
        Observation.unresolved("invalid: moe_block_size 7", OTHER),
    ):
        assert Observation.from_json(observation.to_json()) == observation


def test_good_observation_has_no_signature() -> None:
    with pytest.raises(ValueError):
        Observation(Outcome.GOOD, TARGET)


@pytest.mark.parametrize(
    "data",
    [
        None,
        {"outcome": "maybe"},
        {"outcome": "bad", "signature": {"verdict": 3}},
        {"outcome": "bad", "signature": {"verdict": "corrupt", "experts": ["x"]}},
        {"outcome": "good", "signature": {"verdict": "corrupt"}},
        {"outcome": "good", "note": 5},
    ],
)
def test_malformed_observation_json_is_a_log_error(data: object) -> None:
    with pytest.raises(BisectLogError):
        Observation.from_json(data)


def test_match_policies() -> None:
    other_experts = Signature(TARGET.verdict, TARGET.finding_kinds, frozenset({9}))
    other_kinds = Signature(TARGET.verdict, frozenset({"oob_read"}), TARGET.experts)
    assert SignatureMatch.EXACT.matches(TARGET, TARGET)
    assert not SignatureMatch.EXACT.matches(TARGET, other_experts)
    assert SignatureMatch.KINDS.matches(TARGET, other_experts)
    assert not SignatureMatch.KINDS.matches(TARGET, other_kinds)
    assert SignatureMatch.VERDICT.matches(TARGET, other_kinds)
    assert not SignatureMatch.VERDICT.matches(TARGET, OTHER)
    assert SignatureMatch.ANY.matches(TARGET, OTHER)
    assert SignatureMatch.KINDS.matches(None, OTHER)
    assert not SignatureMatch.KINDS.matches(TARGET, None)


def test_classify_turns_a_different_failure_into_unresolved() -> None:
    assert classify(Observation.bad(OTHER), TARGET, SignatureMatch.KINDS) is Outcome.UNRESOLVED
    assert classify(Observation.bad(TARGET), TARGET, SignatureMatch.KINDS) is Outcome.BAD
    assert classify(Observation.good(), TARGET, SignatureMatch.KINDS) is Outcome.GOOD
    assert classify(Observation.unresolved(), TARGET, SignatureMatch.KINDS) is Outcome.UNRESOLVED
    assert classify(Observation.bad(OTHER), None, SignatureMatch.EXACT) is Outcome.BAD
