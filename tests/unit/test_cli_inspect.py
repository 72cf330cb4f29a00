"""``moereplay info`` and ``moereplay ls``: through typer's runner, ``main()``, and a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moereplay.cli import app, main
from moereplay.errors import CaptureFileError
from moereplay.format import CaptureWriter

runner = CliRunner()


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "run.zst"
    weight = torch.randn(64, 32)
    with CaptureWriter(path, {"model": "tiny-moe"}, index_every=2) as writer:
        for step in range(6):
            hidden = torch.randn(8, 32, dtype=torch.bfloat16)
            op = "moe_wna16_marlin_gemm" if step % 2 == 0 else "matmul_ogs"
            index = writer.begin_call(
                op,
                {"a": hidden, "w": weight.t(), "top_k": 2},
                site="fused_moe.py:10",
                context={
                    "layer": step % 3,
                    "step": step,
                    "layer_name": f"model.layers.{step % 3}.mlp.experts",
                },
                static={"w"},
            )
            if step != 5:
                writer.complete_call(
                    index,
                    {"c": hidden},
                    status="failed" if step == 3 else "completed",
                    error="boom" if step == 3 else None,
                )
        writer.close(counters={"dropped_queue_full": 1})
    return path


@pytest.fixture(scope="module")
def truncated(capture: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cut") / "cut.zst"
    data = capture.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    return path


def test_info_human(capture: Path) -> None:
    result = runner.invoke(app, ["info", str(capture)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "complete: 6 calls" in out and "torch" in out and "dedup" in out
    assert "moe_wna16_marlin_gemm" in out and "matmul_ogs" in out
    assert "dropped_queue_full=1" in out
    assert "6 (4 completed" not in out  # counts per status are listed individually
    assert "1 inputs_saved" in out and "1 failed" in out and "4 completed" in out


def test_info_json(capture: Path) -> None:
    result = runner.invoke(app, ["info", str(capture), "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["header"]["model"] == "tiny-moe"
    assert document["recovery"]["complete"] is True
    stats = document["stats"]
    assert stats["calls"] == 6
    assert stats["by_op"] == {
        "matmul_ogs": {"completed": 1, "failed": 1, "inputs_saved": 1},
        "moe_wna16_marlin_gemm": {"completed": 3},
    }
    assert stats["dedup_ratio"] > 1 and stats["counters"] == {"dropped_queue_full": 1}


def test_info_on_a_truncated_file_reports_recovery(truncated: Path) -> None:
    result = runner.invoke(app, ["info", str(truncated), "--json"])
    assert result.exit_code == 0, result.output
    recovery = json.loads(result.stdout)["recovery"]
    assert recovery["complete"] is False and recovery["footer_missing"] is True
    assert recovery["calls_recovered"] < 6 and "recovered" in recovery["message"]
    human = runner.invoke(app, ["info", str(truncated)])
    assert "footer missing" in human.stdout


def test_ls_human_and_filters(capture: Path) -> None:
    result = runner.invoke(app, ["ls", str(capture)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["#", "op", "site", "step", "layer", "parent", "status", "tensors"]
    assert len(lines) == 7
    assert "a=bfloat16[8,32]" in lines[1] and "w=float32[32,64]@(1,32)" in lines[1]
    assert "fused_moe.py:10" in lines[1]
    filtered = runner.invoke(app, ["ls", str(capture), "--op", "moe_*", "--layer", "2"])
    assert [line.split()[0] for line in filtered.stdout.splitlines()[1:]] == ["2"]
    failed = runner.invoke(app, ["ls", str(capture), "--status", "failed", "--json"])
    assert [row["index"] for row in json.loads(failed.stdout)] == [3]


def test_ls_json(capture: Path) -> None:
    result = runner.invoke(app, ["ls", str(capture), "--json"])
    rows = json.loads(result.stdout)
    assert [row["status"] for row in rows] == ["completed"] * 3 + ["failed", "completed", "inputs_saved"]
    assert rows[0]["tensors"]["w"] == {
        "dtype": "float32",
        "shape": [32, 64],
        "stride": [1, 32],
        "storage_offset": 0,
        "device": "cpu",
        "storage": 1,
    }
    assert rows[4]["layer"] == 1
    assert rows[4]["context"] == {"layer": 1, "step": 4, "layer_name": "model.layers.1.mlp.experts"}


def test_ls_shows_step_layer_name_and_parent_and_filters_by_them(capture: Path) -> None:
    result = runner.invoke(app, ["ls", str(capture)])
    first = result.stdout.splitlines()[1].split()
    assert first[:6] == [
        "0",
        "moe_wna16_marlin_gemm",
        "fused_moe.py:10",
        "0",
        "model.layers.0.mlp.experts",
        "-",
    ]
    by_step = runner.invoke(app, ["ls", str(capture), "--step", "4", "--json"])
    assert [row["index"] for row in json.loads(by_step.stdout)] == [4]
    by_name = runner.invoke(app, ["ls", str(capture), "--layer", "model.layers.2.*", "--json"])
    assert [row["index"] for row in json.loads(by_name.stdout)] == [2, 5]
    by_index = runner.invoke(app, ["ls", str(capture), "--layer", "2", "--json"])
    assert [row["index"] for row in json.loads(by_index.stdout)] == [2, 5]


def test_ls_on_a_truncated_file_notes_it_on_stderr(truncated: Path) -> None:
    result = runner.invoke(app, ["ls", str(truncated), "--json"])
    assert result.exit_code == 0
    assert "note:" in result.stderr and "footer missing" in result.stderr
    assert len(json.loads(result.stdout)) < 6


def test_bad_status_is_a_settings_error(capture: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["ls", str(capture), "--status", "running"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith("moereplay: --status must be one of")


def test_bad_file_through_the_runner_and_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.zst"
    bad.write_bytes(b"definitely not a capture")
    result = runner.invoke(app, ["info", str(bad)])
    assert isinstance(result.exception, CaptureFileError)
    with pytest.raises(SystemExit) as exited:
        main(["ls", str(bad)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err == f"moereplay: {bad}: not a moereplay capture file (bad magic)\n"


@pytest.mark.parametrize("command", ["info", "ls"])
def test_bad_file_in_a_subprocess(tmp_path: Path, command: str) -> None:
    bad = tmp_path / "bad.zst"
    bad.write_bytes(b"\x28\xb5\x2f\xfd" + b"\x00" * 64)
    result = subprocess.run(
        [sys.executable, "-m", "moereplay", command, str(bad)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"moereplay: {bad}:")
    assert result.stdout == ""


def test_ls_describes_generated_tensors_by_their_dtype_and_shape() -> None:
    """Recipe-stored weights list as the tensor they expand to, not as their zero-element anchor."""
    from pathlib import Path

    from typer.testing import CliRunner

    from moereplay.cli import app

    capture = Path(__file__).resolve().parents[2] / "captures" / "marlin-nvfp4-report.moe.zst"
    result = CliRunner().invoke(app, ["ls", str(capture)])
    assert result.exit_code == 0, result.output
    assert "b_qweight=int32[32,184,5760] (recipe)" in result.output
    assert "anchor" not in result.output


def test_ls_marks_graph_replayed_layer_calls_by_their_graph_step(tmp_path: Path) -> None:
    path = tmp_path / "graph.zst"
    with CaptureWriter(path, {}) as writer:
        for context in (
            {"layer": 0, "cudagraph": True, "graph_step": 41},
            {"layer": 1, "step": 7},
            {"layer": 1},
        ):
            index = writer.begin_call("triton_kernel_fused_experts", {"x": torch.ones(2, 4)}, context=context)
            writer.complete_call(index, {"output_tensor": torch.ones(2, 4)})
    lines = runner.invoke(app, ["ls", str(path)]).stdout.splitlines()[1:]
    assert [line.split()[3] for line in lines] == ["g41", "7", "-"]


def test_info_on_a_bundled_capture_counts_one_call_and_names_an_unrecorded_version() -> None:
    """``1 calls`` and ``moereplay —`` (the writer of three bundled files left its version empty)."""
    from pathlib import Path

    from typer.testing import CliRunner

    from moereplay.cli import app

    capture = Path(__file__).resolve().parents[2] / "captures" / "marlin-nvfp4-report.moe.zst"
    result = CliRunner().invoke(app, ["info", str(capture)])
    assert result.exit_code == 0, result.output
    assert "complete: 1 call," in result.output and "1 calls" not in result.output
    assert "moereplay (not recorded)" in result.output and "moereplay —" not in result.output


@pytest.mark.parametrize("fraction", [0.3, 0.6, 0.9])
def test_info_on_a_cut_file_says_where_it_was_cut(capture: Path, tmp_path: Path, fraction: float) -> None:
    """Not only where the last whole record ends: the same for every cut inside one record."""
    data = capture.read_bytes()
    size = int(len(data) * fraction)
    cut = tmp_path / "cut.zst"
    cut.write_bytes(data[:size])
    recovery = json.loads(runner.invoke(app, ["info", str(cut), "--json"]).stdout)["recovery"]
    start, missing = recovery["truncated_at"], recovery["missing_bytes"]
    assert start < size and missing > 0
    human = runner.invoke(app, ["info", str(cut)]).stdout
    assert (
        f"truncated: the file ends at byte {size} inside a" in human
        and f"record that starts at byte {start} and ends at byte {size + missing} ({missing} bytes missing)"
        in " ".join(human.split())
    ), human


def test_info_shows_expanded_recipe_bytes_and_the_memory_a_replay_holds() -> None:
    """The report capture stores 1.5 MB of tensor elements; its recipes expand to 154.9 MB — what a replay holds."""
    capture = Path(__file__).resolve().parents[2] / "captures" / "marlin-nvfp4-report.moe.zst"
    shown = runner.invoke(app, ["info", str(capture)])
    assert shown.exit_code == 0, shown.output
    assert "154.9 MB expanded" in shown.output
    assert "call (#0) holds 154.9 MB of arguments and outputs" in shown.output
    stats = json.loads(runner.invoke(app, ["info", str(capture), "--json"]).output)["stats"]
    assert stats["expanded_bytes"] == 154_850_268 and stats["largest_call"] == 0


def test_a_cut_inside_the_index_record_reads_an_index_record(tmp_path: Path) -> None:
    """The record's kind takes its article ("an index record", "a blob record")."""
    data = (Path(__file__).resolve().parents[2] / "captures" / "marlin-nvfp4-layer.moe.zst").read_bytes()
    found = []
    for size in range(len(data) - 1, len(data) - 400, -7):  # the tail holds the index, then the footer
        cut = tmp_path / "cut.zst"
        cut.write_bytes(data[:size])
        human = " ".join(runner.invoke(app, ["info", str(cut)]).stdout.split())
        if "index record" in human:
            found.append(human)
            break
    assert found, "no cut in the last 400 bytes landed inside the index record"
    assert "inside an index record that starts at byte" in found[0], found[0]


def test_info_reads_only_integer_counters_from_a_footer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file written by someone else may hold anything in its footer's counters: ``info`` keeps the integers
    (its cost and timers lines do arithmetic on them) and never raises on the rest."""
    finish = CaptureWriter._finish
    hostile = {
        "recorder_host_ns": "x",
        "recorder_seen": 3,
        "flight_polls": 2.5,
        "flight_poll_ns": None,
        "timer_collect_ns": "y",
        "timer_collect_calls": [1],
        "timer_poll_ns": 5000,
        "timer_poll_cpu_ns": "z",
        "timer_poll_calls": 1,
        "dropped_queue_full": True,
    }
    monkeypatch.setattr(CaptureWriter, "_finish", lambda self, counters: finish(self, hostile))
    path = tmp_path / "hostile-footer.zst"
    with CaptureWriter(path, {"model": "tiny-moe"}):
        pass
    monkeypatch.undo()
    result = runner.invoke(app, ["info", str(path)])
    assert result.exit_code == 0, result.output
    assert result.exception is None
    (counters,) = [line for line in result.output.splitlines() if line.startswith("counters")]
    assert "recorder_seen=3" in counters and "timer_poll_ns=5000" in counters
    assert "recorder_host_ns" not in counters and "dropped_queue_full" not in counters
    (timers,) = [line for line in result.output.splitlines() if line.startswith("timers")]
    assert "poll 5.0 ×1" in timers
