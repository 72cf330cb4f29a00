"""``moereplay bisect``: the headless command over an injected wiring (synthetic judges, real capture files)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moereplay.bisect import Dimension, Observation, Signature
from moereplay.bisect.log import default_log_path
from moereplay.bisect.replay_wiring import CallRef, ReplayWiring, observation_of, stream_of_calls
from moereplay.cli import app, bisect_cmd, main
from moereplay.format.writer import CaptureWriter

TARGET = Signature("corrupt", frozenset({"wrong_coefficient"}), frozenset({3}))
OP = "moe_wna16_marlin_gemm"


@pytest.fixture
def capture(tmp_path: Path) -> Path:
    """Three steps × four layers of one kernel under a parent call; steps are recorded newest first."""
    path = tmp_path / "run.zst"
    with CaptureWriter(path) as writer:
        for step in (2, 1, 0):
            for layer in range(4):
                context = {"step": step, "layer": layer}
                parent = writer.begin_call("fused_marlin_moe", {"x": torch.zeros(2)}, context=context)
                index = writer.begin_call(OP, {"a": torch.ones(2, 2)}, context=context, parent=parent)
                writer.complete_call(index, {"out": torch.ones(2)})
                writer.complete_call(parent, {"out": torch.ones(2)})
    return path


class Judge:
    """Synthetic judge: call ``first_bad`` and later (in stream order) fail; mutations / packs / shapes by rule."""

    def __init__(self, bad_calls: set[int]) -> None:
        self.bad_calls = bad_calls
        self.asked: list[tuple[int, tuple[str, ...], str | None, dict[str, int] | None]] = []

    def __call__(
        self, call: int, mutations: Sequence[str], backend: str | None, shape: Mapping[str, int] | None
    ) -> Observation:
        self.asked.append((call, tuple(mutations), backend, None if shape is None else dict(shape)))
        if backend is not None and backend.startswith("pack:"):
            return Observation.bad(TARGET) if Path(backend[5:]).name >= "v3" else Observation.good()
        if shape is not None:
            return Observation.bad(TARGET) if shape["tokens"] >= 3 else Observation.good()
        if "flip mul_topk_weights" in mutations:
            return Observation.good()
        return Observation.bad(TARGET) if call in self.bad_calls else Observation.good()


def shapes(capture: Path, call: int):
    return [Dimension.stepped("experts", 8), Dimension.stepped("tokens", 16)], None


def use(monkeypatch: pytest.MonkeyPatch, judge: Judge) -> None:
    monkeypatch.setattr(bisect_cmd, "wiring_factory", lambda: ReplayWiring(judge, shapes))


def bad_from(capture: Path, position: int) -> set[int]:
    return {ref.index for ref in stream_of_calls(capture)[position:]}


def test_stream_is_ordered_by_step_and_layer_and_skips_parent_calls(capture: Path) -> None:
    refs = stream_of_calls(capture)
    assert len(refs) == 12
    assert all(ref.op == OP for ref in refs)
    assert [(ref.step, ref.layer) for ref in refs] == [
        (step, layer) for step in range(3) for layer in range(4)
    ]
    assert refs[0] == CallRef(index=17, op=OP, step=0, layer=0)
    assert refs[0].label == f"#17 {OP} (step 0, layer 0)"
    assert len(stream_of_calls(capture, op="fused_*")) == 12
    assert len(stream_of_calls(capture, layer=2)) == 3


def test_without_the_replay_engine_the_command_prints_one_line(
    capture: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "moereplay.replay", None)  # as if the engine were not installed
    with pytest.raises(SystemExit) as exit_info:
        main(["bisect", str(capture), "--strategy", "calls", "--no-tui"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("moereplay: replay engine unavailable")
    assert error.count("\n") == 1


def test_calls_headless_text_then_resume(capture: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    judge = Judge(bad_from(capture, 7))
    use(monkeypatch, judge)
    runner = CliRunner()
    result = runner.invoke(
        app, ["bisect", str(capture), "--strategy", "calls", "--no-tui", "--max-steps", "2"]
    )
    assert result.exit_code == 1, result.output  # stopped before the answer
    log = default_log_path(capture, "calls")
    assert log.exists() and log.parent.name == "bisect"
    assert not capture.with_name("run.zst.bisect-calls.jsonl").exists()  # never beside the capture
    assert f"log: {log}" in result.output
    asked_before = len(judge.asked)

    result = runner.invoke(app, ["bisect", str(capture), "--strategy", "calls", "--no-tui"])
    assert result.exit_code == 0, result.output
    assert "(from log)" in result.output
    ref = stream_of_calls(capture)[7]
    assert f"first bad: #{ref.index} {OP} (step 1, layer 3)" in result.output
    assert "item" not in result.output
    assert "failure: corrupt [wrong_coefficient] experts 3" in result.output
    logged = {call for call, *_ in judge.asked[:asked_before]}
    assert not logged & {call for call, *_ in judge.asked[asked_before:]}  # logged steps are not re-run


def test_calls_json_and_fresh(capture: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use(monkeypatch, Judge(bad_from(capture, 0)))
    runner = CliRunner()
    args = ["bisect", str(capture), "--strategy", "calls", "--no-tui", "--json"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    document = json.loads(first.output)
    assert document["summary"]["result"]["first_bad"] == 0
    assert document["summary"]["done"] is True
    assert document["steps"][0]["decided_by"] == "auto"
    again = runner.invoke(app, [*args, "--fresh"])
    assert again.exit_code == 0
    assert json.loads(again.output)["summary"]["steps"] == document["summary"]["steps"]


def test_calls_with_known_good_and_bad(capture: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    refs = stream_of_calls(capture)
    judge = Judge(bad_from(capture, 5))
    use(monkeypatch, judge)
    result = CliRunner().invoke(
        app,
        ["bisect", str(capture), "-s", "calls", "--no-tui", "--json",
         "--good", str(refs[3].index), "--call", str(refs[8].index)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["summary"]["result"]["first_bad"] == 5
    positions = {ref.index: position for position, ref in enumerate(refs)}
    assert all(3 < positions[call] <= 8 for call, *_ in judge.asked)


def test_mutations(capture: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    judge = Judge({1})
    use(monkeypatch, judge)
    result = CliRunner().invoke(
        app,
        ["bisect", str(capture), "--strategy", "mutations", "--call", "1", "--no-tui",
         "-m", "flip use_atomic_add;flip mul_topk_weights", "-m", "set moe_block_size=64"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "minimal passing set: flip mul_topk_weights" in result.output
    assert "do not matter: flip use_atomic_add, set moe_block_size=64" in result.output
    assert default_log_path(capture, "mutations", "call1").exists()
    assert {call for call, *_ in judge.asked} == {1}


def test_packs(capture: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    use(monkeypatch, Judge(set()))
    packs = [str(tmp_path / f"v{number}") for number in range(1, 6)]
    result = CliRunner().invoke(
        app,
        ["bisect", str(capture), "--strategy", "packs", "--call", "1", "--no-tui", "--json",
         *[option for pack in packs for option in ("--pack", pack)]],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["summary"]["result"]["first_changed"] == "v3"


def test_shape(capture: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    judge = Judge({1})
    use(monkeypatch, judge)
    result = CliRunner().invoke(
        app, ["bisect", str(capture), "--strategy", "shape", "--call", "1", "--no-tui", "--dim", "tokens"]
    )
    assert result.exit_code == 0, result.output
    assert "minimal failing shape: tokens=3" in result.output
    assert all(shape is not None and set(shape) == {"tokens"} for *_, shape in judge.asked)


def test_inconclusive_search_exits_1(capture: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use(monkeypatch, Judge(set()))  # nothing fails
    result = CliRunner().invoke(app, ["bisect", str(capture), "--strategy", "calls", "--no-tui"])
    assert result.exit_code == 1
    assert "no failure" in result.output


@pytest.fixture
def one_call(tmp_path: Path) -> Path:
    """A parent call and the one kernel call under it (the parent is context, not a call to bisect)."""
    path = tmp_path / "one.zst"
    with CaptureWriter(path) as writer:
        parent = writer.begin_call("fused_marlin_moe", {"x": torch.zeros(2)})
        index = writer.begin_call(OP, {"a": torch.ones(2, 2)}, parent=parent)
        writer.complete_call(index, {"out": torch.ones(2)})
        writer.complete_call(parent, {"out": torch.ones(2)})
    return path


@pytest.mark.parametrize("strategy", ["shape", "mutations"])
def test_a_one_call_file_needs_no_call(
    one_call: Path, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    judge = Judge({1})
    use(monkeypatch, judge)
    result = CliRunner().invoke(
        app, ["bisect", str(one_call), "-s", strategy, "--no-tui", "-m", "flip mul_topk_weights"]
    )
    assert result.exit_code == 0, result.output
    assert f"bisect {strategy}: call #1" in result.output
    assert {call for call, *_ in judge.asked} == {1}
    assert default_log_path(one_call, strategy, "call1").exists()  # the same log as with --call 1


def test_without_call_several_calls_are_named_in_one_line(
    capture: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    use(monkeypatch, Judge(set()))
    with pytest.raises(SystemExit) as exit_info:
        main(["bisect", str(capture), "--no-tui", "-s", "shape", "--layer", "2"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    layer2 = sorted(ref.index for ref in stream_of_calls(capture, layer=2))
    assert f"run.zst holds calls {', '.join(map(str, layer2))}" in error
    assert error.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategy", "bogus"], "--strategy must be one of calls, mutations, shape, packs"),
        (["--strategy", "calls", "--match", "fuzzy"], "--match must be one of"),
        (["--strategy", "packs", "--call", "1", "--pack", "a"], "at least two --pack"),
        (["--strategy", "mutations", "--call", "1"], "needs candidate mutations"),
        (["--strategy", "shape"], "needs --call N"),
        (
            ["--strategy", "calls", "--call", "0"],
            "--call 0 is not among the selected calls (1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23; see",
        ),
        (["--strategy", "mutations", "--call", "1", "--good", "0", "-m", "flip a"], "--good only applies"),
        (["--strategy", "shape", "--call", "1", "--dim", "N"], "unknown dimension(s) N"),
        (
            ["--strategy", "mutations", "--call", "1", "--nonfinite"],
            "--nonfinite only applies to --strategy calls",
        ),
    ],
)
def test_bad_options_are_one_line_errors(
    capture: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    use(monkeypatch, Judge(set()))
    with pytest.raises(SystemExit) as exit_info:
        main(["bisect", str(capture), "--no-tui", *args])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert message in error
    assert error.count("\n") == 1


def test_observation_of_replay_results() -> None:
    results = pytest.importorskip("moereplay.replay.results")
    findings = pytest.importorskip("moereplay.replay.findings")
    corrupt = results.VariantResult(
        "flip", ("flip mul_topk_weights",), results.Verdict.CORRUPT, rows=128, bad_rows=100
    )
    found = [
        findings.Finding(findings.FindingKind.WRONG_COEFFICIENT, "row 0 scaled by row 1's weight", "flip",
                         evidence={"experts": [3, 7]}),
        findings.Finding(findings.FindingKind.CORRUPT_ROWS, "rows", "flip", evidence={"by_expert": {"9": 4, "-1": 1}}),
        findings.Finding(findings.FindingKind.DIAGNOSIS, "kernel bug", "flip"),
        findings.Finding(findings.FindingKind.NONFINITE, "about another variant", "baseline"),
    ]  # fmt: skip
    observation = observation_of(corrupt, found)
    assert observation.signature == Signature(
        "corrupt", frozenset({"wrong_coefficient", "corrupt_rows"}), frozenset({3, 7, 9})
    )
    assert observation.note == "100/128 rows bad"
    ok = results.VariantResult("baseline", (), results.Verdict.OK)
    assert observation_of(ok, found) == Observation.good()
    invalid = results.VariantResult("x", (), results.Verdict.INVALID, reason="moe_block_size 7 not supported")
    assert observation_of(invalid, found) == Observation.unresolved("invalid: moe_block_size 7 not supported")
    # not judged (offline, only a kernel could answer): unresolved, never a pass
    unjudged = results.VariantResult("fill", ("fill 0xff",), results.Verdict.NEEDS_KERNEL, reason="offline")
    assert observation_of(unjudged, found) == Observation.unresolved("needs-kernel: offline")


def test_on_a_terminal_the_session_goes_to_the_tui(capture: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app_module = pytest.importorskip("moereplay.tui.app")
    launched = []

    def run(self) -> None:  # the person steps through the whole session in the TUI
        launch = self.initial_bisect
        launched.append(launch)
        launch.session.run_to_end()

    monkeypatch.setattr(app_module.MoereplayApp, "run", run)
    monkeypatch.setattr(bisect_cmd, "_interactive_terminal", lambda: True)
    use(monkeypatch, Judge({1}))
    result = CliRunner().invoke(
        app, ["bisect", str(capture), "--strategy", "mutations", "--call", "1", "-m", "flip mul_topk_weights"]
    )
    assert result.exit_code == 0, result.output
    (launch,) = launched
    assert (launch.capture, launch.call, launch.resumed_steps) == (capture, 1, 0)
    assert "minimal passing set: flip mul_topk_weights" in result.output


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``moereplay ARGS`` as the console script runs it: exit status, stdout, stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    code = exit_info.value.code
    return (code if isinstance(code, int) else 1), captured.out, captured.err


def packs_in(folder: Path) -> list[str]:
    return [option for number in range(1, 6) for option in ("--pack", str(folder / f"v{number}"))]


@pytest.mark.parametrize(
    ("strategy", "first", "changed", "differs"),
    [
        ("calls", [], ["-m", "flip mul_topk_weights"], "mutations"),
        ("calls", [], ["--backend", "reference"], "backend"),
        ("mutations", ["-m", "flip mul_topk_weights"], ["-m", "flip mul_topk_weights", "--backend", "vllm"],
         "backend"),
        ("shape", [], ["-m", "fill 0xff"], "mutations"),
        ("shape", [], ["--backend", "vllm"], "backend"),
        ("packs", packs_in(Path("a")), [*packs_in(Path("a")), "-m", "fill 0xff"], "mutations"),
        ("packs", packs_in(Path("a")), packs_in(Path("b")), "packs"),  # packs of the same names elsewhere
    ],
)  # fmt: skip
def test_a_rerun_with_other_settings_is_refused_and_the_same_settings_resume(
    capture: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    strategy: str,
    first: list[str],
    changed: list[str],
    differs: str,
) -> None:
    use(monkeypatch, Judge(bad_from(capture, 0)))
    call = [] if strategy == "calls" else ["--call", "1"]
    base = ["bisect", str(capture), "-s", strategy, "--no-tui", *call]
    code, _, _ = run_main([*base, *first, "--max-steps", "1"], capsys)
    assert code == 1  # stopped after one step, logged

    code, out, err = run_main([*base, *changed], capsys)
    assert code == 2 and not out
    assert f"the log was written for a different {strategy} search (differs in {differs});" in err
    assert "--fresh" in err and err.count("\n") == 1 and "Traceback" not in err

    code, out, err = run_main([*base, *first], capsys)  # the same settings still resume the log
    assert code == 0, err
    assert "(from log)" in out and "(1 step recorded)" in err

    code, out, err = run_main([*base, *changed, "--fresh"], capsys)
    assert code != 2, err
    assert "(from log)" not in out


def test_a_rerun_about_another_call_is_refused(
    capture: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    use(monkeypatch, Judge({1, 3}))
    log = ["--log", str(tmp_path / "shape.jsonl")]  # one log for both: only the settings tell them apart
    base = ["bisect", str(capture), "-s", "shape", "--no-tui", *log]
    assert run_main([*base, "--call", "1", "--max-steps", "1"], capsys)[0] == 1
    code, _, err = run_main([*base, "--call", "3"], capsys)
    assert code == 2 and "(differs in call);" in err


def test_a_mutation_typo_fails_before_any_weight_is_rebuilt(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``bisect -m 'flip topk_weights'`` on a recipe capture: refused from the call's record, as `run` refuses it
    (it used to rebuild the report capture's weights first, ~5-15 s)."""
    from moereplay.synth import recipe

    def no_expansion(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were rebuilt before the mutations were checked")

    monkeypatch.setattr(recipe, "expand", no_expansion)
    report = Path(__file__).resolve().parents[3] / "captures" / "marlin-nvfp4-report.moe.zst"
    code, out, err = run_main(
        ["bisect", str(report), "-s", "calls", "--no-tui", "-m", "flip topk_weights",
         "--backend", "reference", "--log", str(tmp_path / "typo.jsonl")],
        capsys,
    )  # fmt: skip
    assert code == 2 and not out, err
    assert "topk_weights" in err and "mul_topk_weights" in err and err.count("\n") == 1, err


def test_an_ok_output_holding_nan_is_bad_only_when_asked() -> None:
    results = pytest.importorskip("moereplay.replay.results")
    findings = pytest.importorskip("moereplay.replay.findings")
    given = results.VariantResult("recorded", (), results.Verdict.OK, rows=8, nan=256)
    found = [
        findings.Finding(findings.FindingKind.NONFINITE, "256 NaN", "recorded", evidence={"experts": [5]})
    ]
    assert observation_of(given, found) == Observation.good()
    observation = observation_of(given, found, nonfinite=True)
    assert observation.signature == Signature("nonfinite-output")
    assert "256 NaN" in observation.note and "the exact reference makes them too" in observation.note
    clean = results.VariantResult("recorded", (), results.Verdict.OK, rows=8)
    assert observation_of(clean, found, nonfinite=True) == Observation.good()
    # the call where the kernel made the NaN has the same signature as the calls it was passed on to: the search
    # for where NaN first appears must not take them for two different bugs
    made = results.VariantResult("recorded", (), results.Verdict.NONFINITE, rows=8, bad_rows=2, nan=8)
    kernel = [
        findings.Finding(findings.FindingKind.CORRUPT_ROWS, "rows", "recorded", evidence={"experts": [1]})
    ]
    assert observation_of(made, kernel, nonfinite=True).signature == observation.signature
    assert observation_of(made, kernel).signature.verdict == "nonfinite"  # without the flag: as before


def test_nonfinite_finds_where_nan_first_appears_in_a_served_capture(tmp_path: Path) -> None:
    """The bundled served capture's gemm2 call is ok (the exact reference makes its NaN: the call was given them):
    the plain search finds no failure, ``--nonfinite`` finds that call, offline."""
    served = Path(__file__).resolve().parents[3] / "captures" / "gpt-oss-served-nan.moe.zst"
    common = ["bisect", str(served), "--strategy", "calls", "--no-tui", "--backend", "reference"]
    runner = CliRunner()
    plain = runner.invoke(app, [*common, "--log", str(tmp_path / "plain.jsonl")])
    assert plain.exit_code == 1 and "no failure" in plain.stdout
    found = runner.invoke(app, [*common, "--nonfinite", "--log", str(tmp_path / "nan.jsonl")])
    assert found.exit_code == 0, found.output
    assert "first bad: #2 matmul_ogs (layer 0)" in found.stdout
    assert "nonfinite-output" in found.stdout
