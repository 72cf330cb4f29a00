"""``moereplay bisect`` over calls whose output depends on bytes outside their tensors (verdict ``memory-dependent``).

The calls are of the replay tests' opaque toy op (``tests/unit/replay/replay_opaque_toy.py``: its kernel loads
``count`` scales unmasked, past the end of the tensor when the caller made it short). Every call is within
tolerance as replayed; from ``FIRST_SHORT`` on the scales are short, so the guard fills the contract predicts show
the output depends on the bytes after them. The engine judges every probe; nothing stands in for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from typer.testing import CliRunner

from moereplay.bisect.replay_wiring import ReplayWiring, observation_of, replay_judge
from moereplay.cli import app, bisect_cmd

REPLAY_TESTS = Path(__file__).resolve().parents[1] / "replay"
FIRST_SHORT = 3


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    if not (REPLAY_TESTS / "replay_opaque_toy.py").exists():
        pytest.skip("the replay tests' opaque toy op is not there")
    monkeypatch.syspath_prepend(str(REPLAY_TESTS))
    import replay_opaque_toy

    return replay_opaque_toy


@pytest.fixture
def capture(tmp_path: Path, toy: ModuleType) -> Path:
    from moereplay.format import CaptureWriter
    from moereplay.replay.memory import materialise
    from moereplay.replay.mutations import DEFAULT_FILL

    path = tmp_path / "boxed.moe.zst"
    with CaptureWriter(path) as writer:
        for position in range(6):
            args = toy.make_args(extra=4 if position >= FIRST_SHORT else 0, seed=position)
            guarded = materialise(toy.BOXED.tensor_leaves(args), "cpu", DEFAULT_FILL)
            output = toy._kernel("unmasked", toy.BOXED.replace_tensor_leaves(args, guarded.args)).clone()
            index = writer.begin_call(
                toy.NAME, args, site="tests.toy", context={"step": 0, "layer": position}
            )
            writer.complete_call(index, {"out": output})
    return path


def test_a_memory_dependent_call_is_a_failure_with_its_own_signature(capture: Path, toy: ModuleType) -> None:
    judge = replay_judge(capture, device="cpu", isolate=False)
    good = judge(0, (), toy.spec("unmasked"), None)
    bad = judge(FIRST_SHORT, (), toy.spec("unmasked"), None)
    assert good.outcome.value == "good"
    assert bad.outcome.value == "bad" and bad.signature is not None
    assert bad.signature.verdict == "memory-dependent"
    assert "memory_dependent" in bad.signature.finding_kinds
    assert bad.signature.experts == frozenset({0})  # the toy's rows all belong to expert 0


def test_first_memory_dependent_call_found_by_replaying(
    capture: Path, toy: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        bisect_cmd, "wiring_factory", lambda: ReplayWiring(replay_options={"device": "cpu", "isolate": False})
    )
    result = CliRunner().invoke(
        app,
        [
            "bisect",
            str(capture),
            "--strategy",
            "calls",
            "--backend",
            toy.spec("unmasked"),
            "--no-tui",
            "--json",
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)["summary"]["result"]
    assert summary["first_bad"] == FIRST_SHORT
    assert summary["target"]["verdict"] == "memory-dependent"


def test_the_memory_dependent_kind_counts_only_when_it_is_the_verdicts_reason() -> None:
    from moereplay.replay import Finding, FindingKind
    from moereplay.replay.results import VariantResult, Verdict

    finding = Finding(FindingKind.MEMORY_DEPENDENT, "memory-dependent: …", "baseline", {"experts": [7]})
    corrupt = observation_of(VariantResult("baseline", (), Verdict.CORRUPT, rows=4, bad_rows=1), [finding])
    assert corrupt.signature is not None and corrupt.signature.finding_kinds == frozenset()
    dependent = observation_of(VariantResult("baseline", (), Verdict.MEMORY_DEPENDENT, rows=4), [finding])
    assert dependent.signature is not None
    assert dependent.signature.finding_kinds == frozenset({"memory_dependent"})
    assert dependent.signature.experts == frozenset({7})
