"""``ReplaySession``: a call loaded once, variants judged one at a time (the API bisect and the TUI use), and
``replay()`` built on it — with the toy op's real kernels (tests/unit/replay/replay_toy.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import replay_toy as toy
import torch

from moereplay.errors import InvalidMutationError
from moereplay.replay import Finding, FindingKind, ReplaySession, Verdict, replay
from moereplay.replay.mutations import BASELINE, Fill, FillPattern, Variant
from moereplay.replay.runner import WorkerRunner


def bf16_capture(tmp_path: Path) -> Path:
    return toy.write_capture(tmp_path / "toy.moe.zst", toy.make_args(weights_dtype=torch.bfloat16))


def session(path: Path, kernel: str = "correct", **options: object) -> ReplaySession:
    settings: dict[str, object] = {"backend": toy.spec(kernel), "device": "cpu", "isolate": False}
    settings.update(options)
    return ReplaySession(path, **settings)  # type: ignore[arg-type]


def test_variants_one_at_a_time_give_the_report_replay_gives(tmp_path: Path) -> None:
    path = bf16_capture(tmp_path)
    mutations = ["flip mul_weights", "cast weights=float32"]
    with session(path) as live:
        assert live.baseline.verdict is Verdict.CORRUPT
        baseline_findings = {f.kind for f in live.baseline.findings}
        assert {FindingKind.CONTRACT_VIOLATION, FindingKind.DIAGNOSIS} <= baseline_findings
        flipped = live.run("flip mul_weights")
        assert flipped.verdict is Verdict.OK and flipped.label == "flip mul_weights"
        assert all(f.variant == "flip mul_weights" for f in flipped.findings)
        cast = live.run(Variant(live.variants(["cast weights=float32"])[0].mutations))
        assert cast.verdict is Verdict.OK
        assert live.run("flip mul_weights") is flipped  # judged once
        live.follow_evidence()  # what replay() adds unasked: the fills the bf16 weights' contract predicts
        stepwise = live.report()
    whole = replay(path, mutations=mutations, backend=toy.spec("correct"), device="cpu", isolate=False)
    assert [r.label for r in whole.variants] == [*mutations, "fill 0xff", "fill 0x00"]
    assert [r.to_json() | {"elapsed_s": None} for r in stepwise.results] == [
        r.to_json() | {"elapsed_s": None} for r in whole.results
    ]
    assert [(f.kind, f.message) for f in stepwise.findings] == [(f.kind, f.message) for f in whole.findings]
    summary = next(f for f in stepwise.findings if f.variant == "all")
    assert summary.evidence["confirmed"] == "cast weights=float32"


def test_a_mutation_text_that_makes_several_variants_is_refused_by_run(tmp_path: Path) -> None:
    with session(bf16_capture(tmp_path)) as live:
        with pytest.raises(InvalidMutationError, match="makes 2 variants"):
            live.run("sweep block=2,4")
        assert [v.label for v in live.variants(["sweep block=2,4"])] == ["set block=2", "set block=4"]
        assert live.run(BASELINE) is live.baseline


def test_the_over_read_analysis_covers_fills_run_after_the_report(tmp_path: Path) -> None:
    def fill_reads(findings: tuple[Finding, ...]) -> list[Finding]:
        return [f for f in findings if f.kind is FindingKind.OOB_READ and "fills" in f.evidence]

    with session(bf16_capture(tmp_path)) as live:
        assert not fill_reads(live.report().findings)
        live.run(Variant((Fill(FillPattern(0xFF)),)))
        first = fill_reads(live.report().findings)
        again = fill_reads(live.report().findings)
    assert len(first) == 1 and first == again  # localised once, reported every time
    assert first[0].evidence["arguments"][0]["argument"] == "weights"


def test_kept_tensors_are_outputs_beside_their_references(tmp_path: Path) -> None:
    report = replay(
        bf16_capture(tmp_path),
        mutations=["cast weights=float32"],
        backend=toy.spec("correct"),
        device="cpu",
        isolate=False,
        keep_tensors=True,
        follow_evidence=False,
    )
    assert set(report.tensors) == {"recorded", "baseline", "cast weights=float32"}
    kept = report.tensors["cast weights=float32"]
    assert kept.output.shape == kept.reference.shape == (8, 24) and kept.written.all()
    assert torch.allclose(kept.output, kept.reference, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(report.tensors["baseline"].output, report.tensors["baseline"].reference)
    recorded, baseline = report.tensors["recorded"], report.tensors["baseline"]
    assert torch.equal(recorded.output, baseline.output)  # the replay is bit-exact with the capture
    assert "tensors" not in report.to_json()


def test_one_worker_serves_every_variant_and_a_memory_call_leaves_no_file(tmp_path: Path) -> None:
    from moereplay.format import CaptureReader

    path = bf16_capture(tmp_path)
    with CaptureReader(path) as reader:
        record, args = reader.call(0), reader.load_args(0)
    live = session(record, args=args, isolate=True, reuse_worker=False, timeout_s=120)
    try:
        temporary = live.call.capture_path
        assert temporary.exists()
        assert live.baseline.verdict is Verdict.CORRUPT
        assert [live.run(text).verdict for text in ("set block=2", "set block=4", "flip mul_weights")] == [
            Verdict.CORRUPT,
            Verdict.CORRUPT,
            Verdict.OK,
        ]
        assert isinstance(live.runner, WorkerRunner) and live.runner.starts == 1
    finally:
        live.close()
    assert not temporary.exists()


def test_a_pooled_worker_loads_a_call_once_across_sessions(tmp_path: Path) -> None:
    from moereplay.replay.runner import _POOL, close_pool

    first = bf16_capture(tmp_path)
    second = toy.write_capture(tmp_path / "other.moe.zst", toy.make_args())
    close_pool()
    try:
        for path in (first, first, second, second):
            report = replay(path, backend=toy.spec("correct"), device="cpu", timeout_s=120)
            assert report.baseline.verdict in (Verdict.OK, Verdict.CORRUPT)
        (worker,) = _POOL.values()
        assert (worker.starts, worker.inits) == (1, 2)
    finally:
        close_pool()
