"""Evidence followed by default: a contract violation that predicts reads past a tensor's end makes ``moereplay run``
run the guard fills that test it, and a call whose output depends on bytes outside its tensors is
``memory-dependent`` — never ``ok`` — with a finding naming the tensor, the bytes past its end, the experts and the
columns. CPU stand-ins: tests/unit/replay/replay_opaque_toy.py (its kernel loads scales unmasked past the end of the
tensor, like the Hopper MXFP4 scale load of ``matmul_ogs`` at K = 2880) and replay_toy.py."""

from __future__ import annotations

import json
from pathlib import Path

import replay_opaque_toy as boxed
import replay_toy as toy
import torch
from typer.testing import CliRunner

from moereplay.cli import app
from moereplay.replay import FindingKind, Verdict, replay

runner = CliRunner()


def short_scales(tmp_path: Path, extra: int = 4) -> Path:
    return boxed.write_capture(tmp_path / "boxed.moe.zst", boxed.make_args(extra=extra))


def run_json(*args: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    result = runner.invoke(app, ["run", *args, "--device", "cpu", "--json"])
    return result.exit_code, json.loads(result.stdout)


def test_run_with_no_options_follows_the_contract_and_ends_with_the_memory_dependence(tmp_path: Path) -> None:
    path = short_scales(tmp_path)
    code, document = run_json(str(path), "--backend", boxed.spec("unmasked"))
    assert code == 1 and document["failed"] is True
    (report,) = document["reports"]
    verdicts = {item["label"]: item["verdict"] for item in report["results"]}
    assert verdicts == {
        "recorded": "ok",
        "baseline": "memory-dependent",  # within tolerance, bit-exact even — but it depends on the bytes after
        "fill 0xff": "nonfinite",
        "fill 0x00": "ok",
    }
    assert report["headline"] == {"verdict": "memory-dependent", "source": "replayed", "label": "baseline"}
    last = report["findings"][-1]
    assert last["kind"] == "memory_dependent" and last["variant"] == "baseline"
    assert (
        "scales.values is read outside its bytes: bytes 3..14 past its end change the output"
        in last["message"]
    )
    assert last["evidence"]["experts"] == [0] and last["columns"] == [0, 4] and last["rows"] == [5]
    assert last["evidence"]["arguments"][0]["extents"] == [["after", 3, 14]]
    assert last["evidence"]["fills"]["fill 0xff"]["verdict"] == "nonfinite"
    assert last["evidence"]["unchanged"] == ["fill 0x00"]
    assert any(
        note.startswith("following the evidence") and "scales.values" in note for note in report["notes"]
    )
    shown = runner.invoke(app, ["run", str(path), "--backend", boxed.spec("unmasked"), "--device", "cpu"])
    assert shown.exit_code == 1
    assert "verdict memory-dependent (replayed)" in shown.output
    findings = shown.output[shown.output.index("\nfindings") :]
    headings = [line.lstrip() for line in findings.splitlines() if line.startswith("  [")]
    assert headings[-1].startswith("[memory_dependent]")  # the table ends with that finding


def test_no_follow_leaves_the_fills_out(tmp_path: Path) -> None:
    code, document = run_json(str(short_scales(tmp_path)), "--backend", boxed.spec("unmasked"), "--no-follow")
    assert code == 0
    (report,) = document["reports"]
    assert [item["label"] for item in report["results"]] == ["recorded", "baseline"]
    assert report["headline"]["verdict"] == "ok"


def test_a_call_that_reads_inside_its_tensors_runs_no_fill(tmp_path: Path) -> None:
    code, document = run_json(str(short_scales(tmp_path, extra=0)), "--backend", boxed.spec("unmasked"))
    assert code == 0
    (report,) = document["reports"]
    assert [item["label"] for item in report["results"]] == ["recorded", "baseline"]
    assert not report["notes"] or not any("following the evidence" in note for note in report["notes"])


def test_offline_the_followed_fills_need_a_kernel_and_fail_nothing(tmp_path: Path) -> None:
    code, document = run_json(str(short_scales(tmp_path)), "--backend", "reference")
    assert code == 0
    (report,) = document["reports"]
    verdicts = {item["label"]: item["verdict"] for item in report["results"]}
    assert verdicts == {
        "recorded": "ok",
        "baseline": "needs-kernel",
        "fill 0xff": "needs-kernel",
        "fill 0x00": "needs-kernel",
    }
    assert report["headline"]["verdict"] == "ok" and report["failed"] is False
    assert any("offline: needs-kernel" in note for note in report["notes"])


def test_a_fill_that_only_moves_noise_is_not_memory_dependence(tmp_path: Path) -> None:
    """A kernel whose output differs from run to run (``noisy``): a fill variant differs from the baseline, but so
    does the baseline run again, and the fill's verdict is no worse — no memory dependence is claimed."""
    path = toy.write_capture(tmp_path / "toy.moe.zst", toy.make_args())
    report = replay(path, backend=toy.spec("noisy"), device="cpu", isolate=False, fills=["0xfe"])
    assert not [f for f in report.findings if f.kind is FindingKind.MEMORY_DEPENDENT]
    assert report.baseline.verdict is not Verdict.MEMORY_DEPENDENT
    assert any("memory dependence not established" in note for note in report.notes)


def test_memory_dependence_is_told_beside_a_worse_verdict_without_replacing_it(tmp_path: Path) -> None:
    """bf16 routing weights read as float32: the baseline is corrupt already; the fills still show it reads past
    their end, and the finding says so — the verdict stays the worse one."""
    path = toy.write_capture(tmp_path / "toy.moe.zst", toy.make_args(weights_dtype=torch.bfloat16))
    report = replay(path, backend=toy.spec("correct"), device="cpu", isolate=False)
    assert report.baseline.verdict is Verdict.CORRUPT
    (memory,) = [f for f in report.findings if f.kind is FindingKind.MEMORY_DEPENDENT]
    assert memory.evidence["arguments"][0]["argument"] == "weights"
    assert report.findings[-1] is memory
