"""Strategy ``shape`` with dimensions that may matter by alignment (a modulus): the shrink keeps the original's
residue, the residue probes say which residues fail and which pass."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest

from moereplay.bisect import BisectError, Dimension, Observation, ShapeSearch, Signature, run_to_end
from moereplay.bisect.probes import ShapeProbe
from moereplay.bisect.shape import MAX_RESIDUES, AlignmentReport

TARGET = Signature("corrupt", frozenset({"corrupt_rows", "oob_read"}), frozenset({7}))
OTHER = Signature("crash", frozenset({"crash"}))


def judged(rule: Callable[[Mapping[str, int]], Observation | None]) -> Callable[[ShapeProbe], Observation]:
    def predicate(probe: ShapeProbe) -> Observation:
        verdict = rule(dict(probe.shape))
        return Observation.good() if verdict is None else verdict

    return predicate


def test_search_values_keep_the_original_residue_and_representatives_cover_every_residue() -> None:
    k = Dimension.stepped("K", 2880, step=32, modulus=128)
    assert k.residues == (0, 32, 64, 96)
    assert k.search_values[:3] == (64, 192, 320) and k.search_values[-1] == 2880
    assert all(value % 128 == 64 for value in k.search_values)
    assert k.representatives(64) == (32, 64, 96, 128)
    assert k.representatives(2880) == (2784, 2816, 2848, 2880)
    plain = Dimension.stepped("tokens", 8)
    assert plain.search_values == plain.values and plain.residues == () and plain.representatives(3) == ()


def test_modulus_is_checked_and_only_written_to_the_config_when_set() -> None:
    with pytest.raises(BisectError, match="at least 2"):
        Dimension.stepped("K", 256, step=32, modulus=1)
    with pytest.raises(BisectError, match="residue classes"):
        Dimension.stepped("K", 4096, step=1, modulus=MAX_RESIDUES + 1)
    assert "modulus" not in Dimension.stepped("tokens", 8).to_json()  # logs of older sessions still resume
    assert Dimension.stepped("K", 256, step=32, modulus=128).to_json()["modulus"] == 128
    assert (
        ShapeSearch([Dimension.stepped("K", 256, step=32, modulus=128)]).config()["dimensions"][0]["modulus"]
        == 128
    )


def test_a_failure_of_misaligned_k_matters_by_alignment() -> None:
    """Fails iff K % 128 != 0: a greedy shrink over all K would call K 'free' (K = 32 fails); the residue probes
    show that the alignment decides it."""
    dimensions = [Dimension.stepped("experts", 8), Dimension.stepped("K", 2880, step=32, modulus=128)]
    result = run_to_end(
        ShapeSearch(dimensions), judged(lambda s: Observation.bad(TARGET) if s["K"] % 128 else None)
    )
    assert dict(result.minimal) == {"experts": 1, "K": 64}
    experts, k = result.dimensions
    assert experts.role == "free" and experts.alignment is None
    assert k.role == "matters" and k.by_alignment
    assert k.alignment is not None
    assert k.alignment.failing_residues == (32, 64, 96) and k.alignment.passing_residues == (0,)
    assert k.alignment.failing == (32, 64, 96, 2784, 2848, 2880)
    assert k.alignment.passing == (128, 2816)
    assert k.lost_at == 128
    lines = "\n".join(result.lines())
    assert (
        "K: matters by alignment — fails when K % 128 is 32, 64 or 96 (K=32, 64, 96, 2784, 2848, 2880), "
        "passes when K % 128 is 0 (K=128, 2816); keeping K % 128 = 64 it shrank from 2880 to 64" in lines
    )
    document = result.to_json()
    assert document["dimensions"][1]["by_alignment"] is True
    assert document["dimensions"][1]["alignment"]["passing_residues"] == [0]


def test_alignment_that_does_not_matter_leaves_the_size_story() -> None:
    dimensions = [Dimension.stepped("N", 1024, step=64, modulus=256)]
    result = run_to_end(
        ShapeSearch(dimensions), judged(lambda s: Observation.bad(TARGET) if s["N"] >= 512 else None)
    )
    (n,) = result.dimensions
    assert dict(result.minimal) == {"N": 512}
    assert n.role == "matters" and not n.by_alignment  # 256 (same residue) passes: size, not alignment
    assert n.lost_at == 256
    assert "N: matters (fails at 512, passes at 256); N % 256 alone does not decide it" in "\n".join(
        result.lines()
    )


def test_every_residue_failing_says_the_alignment_does_not_matter() -> None:
    dimensions = [Dimension.stepped("K", 640, step=32, modulus=128)]
    result = run_to_end(ShapeSearch(dimensions), judged(lambda s: Observation.bad(TARGET)))
    (k,) = result.dimensions
    assert k.role == "free" and not k.by_alignment
    assert "K % 128 does not matter" in "\n".join(result.lines())


def test_residues_that_fail_differently_are_unresolved_never_passing() -> None:
    def rule(shape: Mapping[str, int]) -> Observation | None:
        residue = shape["K"] % 128
        if residue == 64:
            return Observation.bad(TARGET)
        if residue == 96:
            return Observation.bad(OTHER)  # another bug: not evidence that this one is gone
        if residue == 32:
            return Observation.unresolved("invalid: the kernel refuses this K")
        return None

    result = run_to_end(ShapeSearch([Dimension.stepped("K", 320, step=32, modulus=128)]), judged(rule))
    (k,) = result.dimensions
    assert k.alignment == AlignmentReport(
        128, failing=(64, 320), passing=(128, 256), unresolved=(32, 96, 224, 288)
    )
    assert k.by_alignment and k.alignment.passing_residues == (0,)
    assert "undecided at K=32, 96, 224, 288" in "\n".join(result.lines())


def test_an_original_on_the_minimum_of_its_residue_is_still_probed_by_residue() -> None:
    dimensions = [Dimension.stepped("K", 64, step=32, modulus=64)]  # search values: just 64
    result = run_to_end(
        ShapeSearch(dimensions), judged(lambda s: None if s["K"] % 64 else Observation.bad(TARGET))
    )
    (k,) = result.dimensions
    assert k.alignment == AlignmentReport(64, failing=(64,), passing=(32,), unresolved=())
    assert k.by_alignment and k.role == "matters" and k.lost_at == 32
