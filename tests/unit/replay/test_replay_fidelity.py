"""Fidelity: every baseline replay is compared with the recorded output; when it is not bit-exact, one finding says
where (elements, rows → tokens / experts / blocks, columns, ULPs of the output dtype) and which candidate cause
explains it — nondeterminism, bytes outside the tensors, process state, routing metadata — tested in that order by
running the variants that test them, "unexplained" only after all of them. CPU stand-ins: the toy ops' real kernels
(replay_toy.py, replay_opaque_toy.py, replay_routed_toy.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import replay_opaque_toy as boxed
import replay_routed_toy as routed
import replay_toy as toy

from moereplay.format import CaptureWriter
from moereplay.replay import Finding, FindingKind, ReplayReport, replay
from moereplay.replay.memory import materialise
from moereplay.replay.mutations import FillPattern

CAUSES = ["nondeterminism", "bytes outside the tensors", "process state", "environment", "routing metadata"]


def fidelity(report: ReplayReport) -> Finding:
    (finding,) = [f for f in report.findings if f.kind is FindingKind.FIDELITY]
    assert finding.variant == "baseline"
    return finding


def run(path: Path, spec: str, **options: object) -> ReplayReport:
    settings: dict[str, object] = {"backend": spec, "device": "cpu", "isolate": False}
    settings.update(options)
    return replay(path, **settings)  # type: ignore[arg-type]


def test_a_bit_exact_replay_runs_nothing_more(tmp_path: Path) -> None:
    report = run(toy.write_capture(tmp_path / "toy.moe.zst", toy.make_args()), toy.spec("correct"))
    assert report.baseline.bit_exact is True
    assert report.variants == () and not [f for f in report.findings if f.kind is FindingKind.FIDELITY]
    assert "fidelity" not in report.phases


def test_a_recording_made_over_0xff_bytes_is_explained_by_them(tmp_path: Path) -> None:
    """The recorded process held 0xff after the short scales (the kernel read NaN scales there); the replay's
    guards hold zeros: not bit-exact — the guard fill 0xff reproduces the recording bit for bit."""
    args = boxed.make_args(extra=4)
    guarded = materialise(boxed.BOXED.tensor_leaves(args), "cpu", FillPattern(0xFF))
    output = boxed._kernel("unmasked", boxed.BOXED.replace_tensor_leaves(args, guarded.args)).clone()
    path = tmp_path / "seen.moe.zst"
    with CaptureWriter(path) as writer:
        index = writer.begin_call(boxed.NAME, args, site="tests.toy")
        writer.complete_call(index, {"out": output, "return": output})
    report = run(path, boxed.spec("unmasked"))
    assert report.baseline.bit_exact is False
    finding = fidelity(report)
    assert finding.evidence["explained_by"] == "bytes outside the tensors"
    assert finding.rows == (5,) and finding.columns == (0, 4)
    assert finding.evidence["elements"] == 5 and finding.evidence["nan_mismatch"] == 5
    assert "fill 0xff reproduces the recording bit for bit" in finding.message
    assert [c["cause"] for c in finding.evidence["causes"]] == CAUSES[:2]  # it stops at the first explanation


def test_a_nondeterministic_replay_is_said_to_be_and_nothing_later_is_tested(tmp_path: Path) -> None:
    path = toy.write_capture(tmp_path / "toy.moe.zst", toy.make_args())
    report = run(path, toy.spec("noisy"))
    finding = fidelity(report)
    assert finding.evidence["explained_by"] == "nondeterminism"
    assert finding.rows == (0,) and finding.evidence["experts"] == [int(toy.make_args()["expert"][0])]
    assert [c["cause"] for c in finding.evidence["causes"]] == ["nondeterminism"]
    assert "the replay differs from itself" in finding.message
    assert [v.label for v in report.variants] == []  # no fill ran: bit-exact tests need a reproducible replay


def test_the_recorded_process_state_pinned_reproduces_the_recording(tmp_path: Path) -> None:
    """The recorded run summed K in chunks of 4 (its process state says so); the call's own argument says 1, so the
    replay rounds differently. Pinned to the recorded state, the replay is bit-exact."""
    path = toy.write_capture(
        tmp_path / "toy.moe.zst",
        toy.make_args(k=64),
        "chunked",
        ran_with={"block": 4},
        state={"block": 4},
    )
    report = run(path, toy.spec("chunked"))
    assert report.baseline.bit_exact is False and report.baseline.verdict.value == "ok"
    finding = fidelity(report)
    assert finding.evidence["explained_by"] == "process state"
    (state,) = [c for c in finding.evidence["causes"] if c["cause"] == "process state"]
    assert "block 4 recorded, 1 replayed" in state["detail"] and "set block=4" in state["detail"]
    assert finding.evidence["max_ulp"] >= 1 and "ULP of float32" in finding.message
    assert [v.label for v in report.variants][-1] == "set block=4"


@pytest.mark.parametrize("isolate", [False, True], ids=["in-process", "worker"])
def test_stale_routing_metadata_is_found_by_re_deriving_it(tmp_path: Path, isolate: bool) -> None:
    args = routed.make_args()
    assert int(args["topk_ids"].max()) > 0  # the stale copy (all zeros) differs
    path = routed.write_stale_capture(tmp_path / "routed.moe.zst", args)
    report = run(path, routed.SPEC, isolate=isolate, reuse_worker=False, timeout_s=120)
    finding = fidelity(report)
    assert finding.evidence["explained_by"] == "routing metadata"
    assert [c["cause"] for c in finding.evidence["causes"]] == CAUSES
    (routing,) = [c for c in finding.evidence["causes"] if c["cause"] == "routing metadata"]
    assert "row_expert" in routing["detail"]
    moved = sorted({int(e) for e in args["topk_ids"].tolist() if int(e) != 0})
    assert finding.evidence["experts"] == moved  # rows whose expert the stale copy changed
    assert report.variants[-1].label == "rederive routing"


def test_an_output_the_replay_cannot_reproduce_is_unexplained_after_every_cause(tmp_path: Path) -> None:
    """The recording came from a kernel that took the next row's weight; the replay runs a correct one."""
    path = toy.write_capture(tmp_path / "seen.moe.zst", toy.make_args(rows=32), kernel="neighbour")
    report = run(path, toy.spec("correct"))
    finding = fidelity(report)
    assert finding.evidence["explained_by"] == "unexplained" and "unexplained" in finding.message
    assert [c["cause"] for c in finding.evidence["causes"]] == CAUSES
    assert finding.evidence["rows"] == 32 and finding.columns == (0, 23)


def test_the_recorded_environment_is_re_run_in_a_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recording process had ``VLLM_TOY_SCALE=2`` (the capture's header says so) and the kernel reads it; this
    process has it unset: the fidelity check re-runs the baseline in a worker under the recorded variables."""
    recorded_env = {"VLLM_TOY_SCALE": "2", "MOEREPLAY_CAPTURE": "1"}
    monkeypatch.setenv("VLLM_TOY_SCALE", "2")  # what the recording process computed with
    path = toy.write_capture(
        tmp_path / "env.moe.zst", toy.make_args(), "env_scaled", header={"env": recorded_env}
    )
    monkeypatch.delenv("VLLM_TOY_SCALE")
    report = run(path, toy.spec("env_scaled"), isolate=True, reuse_worker=False, timeout_s=120)
    finding = fidelity(report)
    assert finding.evidence["explained_by"] == "environment"
    (environment,) = [c for c in finding.evidence["causes"] if c["cause"] == "environment"]
    assert "VLLM_TOY_SCALE='2' recorded, unset now" in environment["detail"]
    assert "MOEREPLAY_CAPTURE" not in environment["detail"]  # moereplay's own settings are not the kernels'


def test_rederive_is_a_mutation_only_ops_with_routing_metadata_accept() -> None:
    from moereplay.errors import InvalidMutationError
    from moereplay.replay.mutations import Rederive, parse_spec, parse_variants

    assert parse_spec(routed.ROUTED, "rederive routing") == Rederive()
    (variant,) = parse_variants(routed.ROUTED, ["rederive routing"])
    assert variant.label == "rederive routing"
    with pytest.raises(InvalidMutationError, match="no routing metadata"):
        parse_spec(toy.TOY, "rederive routing")
    with pytest.raises(InvalidMutationError, match="only 'rederive routing'"):
        parse_spec(routed.ROUTED, "rederive weights")
