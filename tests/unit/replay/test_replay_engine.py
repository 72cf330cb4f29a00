"""The replay engine end to end on CPU, with the toy op's real kernels (tests/unit/replay/replay_toy.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import replay_toy as toy
import torch

from moereplay.errors import InvalidMutationError, ReplayError
from moereplay.replay import FindingKind, ReplayReport, Verdict, replay
from moereplay.replay.results import GuardStatus


def capture(tmp_path: Path, kernel: str = "correct", **kwargs: object) -> Path:
    return toy.write_capture(tmp_path / "toy.moe.zst", toy.make_args(**kwargs), kernel)  # type: ignore[arg-type]


def run(path: Path, kernel: str = "correct", **kwargs: object) -> ReplayReport:
    options: dict[str, object] = {"backend": toy.spec(kernel), "device": "cpu", "isolate": False}
    options.update(kwargs)
    return replay(path, **options)  # type: ignore[arg-type]


def kinds(report: ReplayReport, variant: str | None = None) -> list[FindingKind]:
    return [f.kind for f in report.findings if variant is None or f.variant == variant]


def by_label(report: ReplayReport, label: str):  # type: ignore[no-untyped-def]
    return next(result for result in report.results if result.label == label)


def test_a_correct_call_is_ok_bit_exact_and_clean(tmp_path: Path) -> None:
    report = run(capture(tmp_path), mutations=["sweep block=1,2,4", "flip mul_weights"], repeat=2)
    assert [r.verdict for r in report.results] == [Verdict.OK] * 6  # recorded, baseline, 4 variants
    assert report.headline.text == "ok (recorded and replayed)"
    assert report.baseline.bit_exact is True and report.baseline.guard is GuardStatus.CLEAN
    assert report.baseline.rows == 8 and report.baseline.bad_rows == 0
    assert not report.failed
    assert not [f for f in report.findings if f.kind is not FindingKind.CONTRACT_VIOLATION]


def test_caller_dtype_bug_is_diagnosed_and_the_cast_confirms_it(tmp_path: Path) -> None:
    path = capture(tmp_path, weights_dtype=torch.bfloat16)
    report = run(path, mutations=["flip mul_weights", "cast weights=float32"], fills=["0xff"])
    assert report.baseline.verdict is Verdict.CORRUPT and report.failed
    assert by_label(report, "cast weights=float32").verdict is Verdict.OK
    assert by_label(report, "flip mul_weights").verdict is Verdict.OK
    assert by_label(report, "fill 0xff").verdict is Verdict.NONFINITE  # past-the-end reads now see NaN bytes
    baseline = [f for f in report.findings if f.variant == "baseline"]
    diagnosis = next(f for f in baseline if f.kind is FindingKind.DIAGNOSIS)
    assert diagnosis.evidence["blame"] == "caller" and diagnosis.suggestions == ("cast weights=float32",)
    contract = next(f for f in baseline if f.kind is FindingKind.CONTRACT_VIOLATION)
    assert contract.evidence["argument"] == "weights" and contract.suggestions == ("cast weights=float32",)
    reads = [f for f in report.findings if f.kind is FindingKind.OOB_READ and f.variant == "fill 0xff"]
    (read,) = reads
    (item,) = read.evidence["arguments"]
    assert (item["argument"], item["extents"]) == ("weights", [["after", 0, 15]])
    assert item["contract"].startswith("weights: dtype is bfloat16, kernel expects float32")
    assert "as its contract predicts" in read.message
    summary = next(f for f in report.findings if f.variant == "all")
    assert summary.evidence["confirmed"] == "cast weights=float32"


def test_a_kernel_that_uses_another_rows_weight_is_blamed(tmp_path: Path) -> None:
    report = run(capture(tmp_path, rows=32), kernel="neighbour")
    assert report.baseline.verdict is Verdict.CORRUPT
    wrong = next(f for f in report.findings if f.kind is FindingKind.WRONG_COEFFICIENT)
    assert wrong.evidence["hypothesis"] == "other_row" and wrong.evidence["mapping"] == "index i+1"
    diagnosis = next(f for f in report.findings if f.kind is FindingKind.DIAGNOSIS)
    assert diagnosis.evidence["blame"] == "kernel"


def test_a_bias_added_twice_is_named(tmp_path: Path) -> None:
    report = run(capture(tmp_path, bias=True), kernel="bias_twice")
    wrong = next(f for f in report.findings if f.kind is FindingKind.WRONG_COEFFICIENT)
    assert (wrong.evidence["term"], wrong.evidence["hypothesis"], wrong.evidence["key"]) == (
        "bias",
        "multiple",
        "2x",
    )


def test_an_out_of_bounds_write_damages_the_guard_and_is_named(tmp_path: Path) -> None:
    report = run(capture(tmp_path), kernel="oob_write")
    assert report.baseline.guard is GuardStatus.DAMAGED and report.baseline.verdict is Verdict.CORRUPT
    (write,) = [f for f in report.findings if f.kind is FindingKind.OOB_WRITE]
    assert write.evidence["argument"] == "out" and write.evidence["side"] == "after"
    assert "bytes 0..7 past the end" in write.message


def test_repeats_that_differ_are_nondeterminism(tmp_path: Path) -> None:
    report = run(capture(tmp_path), kernel="noisy", repeat=3)
    (finding,) = [f for f in report.findings if f.kind is FindingKind.NONDETERMINISM]
    assert finding.rows == (0,) and finding.evidence["repeats"] == 3


def test_outside_the_domain_is_invalid_and_unknown_arguments_are_errors(tmp_path: Path) -> None:
    path = capture(tmp_path)
    report = run(path, mutations=["set block=3"])
    (variant,) = report.variants
    assert variant.verdict is Verdict.INVALID and "not one of 1, 2, 4" in variant.reason
    assert report.failed  # invalid is unresolved, never a pass
    with pytest.raises(InvalidMutationError):
        run(path, mutations=["flip nonexistent"])
    with pytest.raises(InvalidMutationError):
        run(path, mutations=["twist block"])


def test_the_reference_backend_judges_the_captured_output(tmp_path: Path) -> None:
    good = replay(capture(tmp_path), backend="reference", device="cpu")
    assert good.recorded is not None and good.recorded.verdict is Verdict.OK
    assert good.recorded.guard is GuardStatus.NOT_CHECKED and not good.failed
    assert good.baseline.verdict is Verdict.NEEDS_KERNEL and good.headline.text == "ok (recorded)"
    bad_path = toy.write_capture(tmp_path / "bad.moe.zst", toy.make_args(weights_dtype=torch.bfloat16))
    bad = replay(bad_path, backend="reference", device="cpu", mutations=["fill 0xff"])
    assert bad.recorded is not None and bad.recorded.verdict is Verdict.CORRUPT
    assert bad.headline.text == "corrupt (recorded)"
    diagnosis = next(f for f in bad.findings if f.kind is FindingKind.DIAGNOSIS)
    assert diagnosis.evidence["blame"] == "caller" and diagnosis.variant == "recorded"
    wrong = next(f for f in bad.findings if f.kind is FindingKind.WRONG_COEFFICIENT)
    assert wrong.evidence["past_end_rows"] == [
        4,
        5,
        6,
        7,
    ]  # unknown memory there offline: consistent, unproven
    assert bad.variants[0].verdict is Verdict.NEEDS_KERNEL and "kernel backend" in bad.variants[0].reason


def test_a_crashing_variant_is_isolated_and_the_session_continues(tmp_path: Path) -> None:
    report = run(
        capture(tmp_path),
        kernel="crash",
        isolate=True,
        mutations=["set block=2", "set block=4"],
        timeout_s=120,
    )
    assert report.baseline.verdict is Verdict.CRASH and "died" in report.baseline.reason
    assert [v.verdict for v in report.variants] == [Verdict.OK, Verdict.OK]
    assert FindingKind.CRASH in kinds(report, "baseline")


def test_api_accepts_a_call_record_with_its_arguments(tmp_path: Path) -> None:
    from moereplay.format import CaptureReader

    path = capture(tmp_path)
    with CaptureReader(path) as reader:
        record = reader.call(0)
        args = reader.load_args(0)
        output = reader.load_outputs(0)["out"]
    report = replay(record, args, output=output, backend=toy.spec("correct"), device="cpu", isolate=False)
    assert report.baseline.verdict is Verdict.OK and report.baseline.bit_exact is True


def test_a_capture_with_several_calls_needs_a_selection(tmp_path: Path) -> None:
    from moereplay.format import CaptureWriter

    path = tmp_path / "two.moe.zst"
    with CaptureWriter(path) as writer:
        for _ in range(2):
            writer.begin_call(toy.NAME, toy.make_args())
    with pytest.raises(ReplayError, match="choose with --call"):
        replay(path, backend="reference", device="cpu")
    report = replay(path, call=1, backend="reference", device="cpu")
    assert report.baseline.verdict is Verdict.NEEDS_KERNEL and "no output" in report.baseline.reason
    assert report.recorded is None and report.headline.source == "nothing judged" and report.failed


def test_report_serialises_to_plain_json(tmp_path: Path) -> None:
    import json

    report = run(capture(tmp_path, weights_dtype=torch.bfloat16), mutations=["cast weights=float32"])
    data = json.loads(json.dumps(report.to_json()))
    labels = [
        "recorded",
        "baseline",
        "cast weights=float32",
        "fill 0xff",
        "fill 0x00",
    ]  # fills: followed evidence
    assert [item["label"] for item in data["results"]] == labels
    assert [item["verdict"] for item in data["results"]] == [
        "corrupt",
        "corrupt",
        "ok",
        "nonfinite",
        "corrupt",
    ]
    assert data["headline"] == {"verdict": "corrupt", "source": "recorded and replayed", "label": "baseline"}
    assert {finding["kind"] for finding in data["findings"]} >= {"diagnosis", "wrong_coefficient"}


def test_the_recorded_row_judges_what_production_saw_beside_the_replay(tmp_path: Path) -> None:
    """The capture holds what a buggy kernel wrote (another row's weight); the replay runs a correct kernel: the
    recorded row is corrupt with its own findings, the replay ok and not bit-exact, and the call's verdict is the
    worse of the two — from the recorded output."""
    path = toy.write_capture(tmp_path / "seen.moe.zst", toy.make_args(rows=32), kernel="neighbour")
    report = run(path, "correct")
    assert report.baseline.verdict is Verdict.OK and report.baseline.bit_exact is False
    assert report.recorded is not None and report.recorded.verdict is Verdict.CORRUPT
    assert report.recorded.rows == 32 and report.recorded.bad_rows > 0 and report.recorded.bit_exact is None
    assert report.results[0] is report.recorded and report.failed
    assert report.headline.text == "corrupt (recorded)" and report.headline.result is report.recorded
    recorded = [f for f in report.findings if f.variant == "recorded"]
    assert {f.kind for f in recorded} >= {FindingKind.CORRUPT_ROWS, FindingKind.WRONG_COEFFICIENT}
    assert not [f for f in report.findings if f.variant == "baseline" and f.kind is FindingKind.CORRUPT_ROWS]


def test_a_replay_bit_exact_with_the_capture_gives_the_recorded_row_without_judging_twice(
    tmp_path: Path,
) -> None:
    report = run(capture(tmp_path, weights_dtype=torch.bfloat16))
    assert report.baseline.bit_exact is True and report.recorded is not None
    assert (report.recorded.verdict, report.recorded.bad_rows) == (
        report.baseline.verdict,
        report.baseline.bad_rows,
    )
    assert report.recorded.max_rel == report.baseline.max_rel
    assert not [f for f in report.findings if f.variant == "recorded"]  # the baseline's findings say it once
    assert any("byte for byte" in note for note in report.notes)


def test_an_output_buffer_with_a_leading_batch_dimension_is_judged_by_its_elements(tmp_path: Path) -> None:
    """The kernel writes (and the capture records) ``out`` as ``[1, rows, cols]``; the reference is ``[rows, cols]``:
    the same elements — judged, bit-exact with the capture — never ``invalid``."""
    args = toy.make_args()
    args["out"] = args["out"].unsqueeze(0)
    path = toy.write_capture(tmp_path / "batched.moe.zst", args)
    report = run(path)
    assert report.baseline.verdict is Verdict.OK and report.baseline.bit_exact is True, report.baseline
    assert report.recorded is not None and report.recorded.verdict is Verdict.OK
    offline = replay(path, backend="reference", device="cpu")
    assert offline.recorded is not None and offline.recorded.verdict is Verdict.OK, offline.recorded


def test_offline_a_cast_is_shown_as_needing_a_kernel_never_with_a_diagnosis(tmp_path: Path) -> None:
    path = capture(tmp_path, weights_dtype=torch.bfloat16)
    report = replay(path, backend="reference", device="cpu", mutations=["cast weights=float32"])
    cast, *followed = report.variants
    assert [v.label for v in followed] == ["fill 0xff", "fill 0x00"]
    assert all(v.verdict is Verdict.NEEDS_KERNEL for v in followed)
    assert cast.verdict is Verdict.NEEDS_KERNEL and not cast.failed and "kernel" in cast.reason
    assert not [f for f in report.findings if f.variant == cast.label]
    (diagnosis,) = [f for f in report.findings if f.kind is FindingKind.DIAGNOSIS]
    assert diagnosis.variant == "recorded" and diagnosis.evidence["blame"] == "caller"
