"""``tools/bench/serve_bench.py``'s guards on what a number means (the servers themselves run only on the GPU
machine): a recorder that stopped — its file at ``MOEREPLAY_MAX_BYTES`` — is found in the server's log and placed
before or inside the measured rounds; every server is started without prefix caching."""

from __future__ import annotations

import datetime
import json
import re
import statistics
import sys
import types
from pathlib import Path

import pytest
from model_files import load_tool

BENCH = Path(__file__).resolve().parents[3] / "tools" / "bench" / "serve_bench.py"


@pytest.fixture(scope="module")
def bench() -> types.ModuleType:
    return load_tool("serve_bench", BENCH.parent)


def _log(path: Path, when: datetime.datetime) -> Path:
    stamp = when.strftime("%m-%d %H:%M:%S")
    path.write_text(
        "(EngineCore pid=1631) INFO 12-04 08:10:00 [core.py:1] ready\n"
        f"(EngineCore pid=1631) WARNING {stamp} [recorder.py:154] moereplay: capture disabled: the capture file "
        "reached MOEREPLAY_MAX_BYTES=12884901888 (vLLM keeps running; the file keeps what was written)\n"
    )
    return path


def test_a_recorder_stopped_during_warm_up_is_placed_before_the_rounds(
    bench: types.ModuleType, tmp_path: Path
):
    began = datetime.datetime.now().replace(microsecond=0)
    log = _log(tmp_path / "server.log", began - datetime.timedelta(seconds=40))
    why = bench.capture_stopped(log, began.timestamp())
    assert (
        why == "stopped before the measured rounds: the capture file reached MOEREPLAY_MAX_BYTES=12884901888"
    )


def test_a_recorder_stopped_mid_run_says_how_far_in(bench: types.ModuleType, tmp_path: Path) -> None:
    began = datetime.datetime.now().replace(microsecond=0)
    log = _log(tmp_path / "server.log", began + datetime.timedelta(seconds=75))
    assert bench.capture_stopped(log, began.timestamp()).startswith("stopped 75 s into the measured rounds: ")


def test_a_recorder_that_kept_running_and_a_missing_log_say_nothing(bench: types.ModuleType, tmp_path: Path):
    quiet = tmp_path / "quiet.log"
    quiet.write_text("(EngineCore pid=1) INFO moereplay: capture armed in pid 1\n")
    assert bench.capture_stopped(quiet, 0.0) is None
    assert bench.capture_stopped(tmp_path / "absent.log", 0.0) is None


def test_servers_start_without_prefix_caching() -> None:
    assert '"--no-enable-prefix-caching"' in BENCH.read_text()


def test_recorder_cost_reads_the_footer_timers(bench: types.ModuleType) -> None:
    line = bench.recorder_cost(
        {
            "recorder_host_ns": 3_000_000,
            "recorder_seen": 100,
            "flight_polls": 4,
            "flight_poll_ns": 2_000_000,
        }
    )
    assert line == (
        "recorder 30.0 µs of serving-thread time per layer call (100 calls); "
        "writer 500.0 µs per flight poll (4 polls, 0.00 s)"
    )
    assert bench.recorder_cost({"recorder_seen": 5}) is None
    # a footer with the longest poll (since 2026-12-07) says it
    longest = bench.recorder_cost(
        {"flight_polls": 4, "flight_poll_ns": 2_000_000, "flight_poll_max_ns": 1_500_000}
    )
    assert longest == "writer 500.0 µs per flight poll (4 polls, 0.00 s; the longest 1.50 ms)"


def test_recorder_cost_sets_the_rings_one_time_set_up_apart(bench: types.ModuleType) -> None:
    """A ring-kernel compile inside the first call is not a per-call cost: 100 calls of 20 µs and one 1 s compile
    read as 20 µs a call plus 1 s once, not 10 ms a call."""
    line = bench.recorder_cost(
        {
            "recorder_host_ns": 100 * 20_000 + 1_000_000_000,
            "recorder_seen": 100,
            "flight_setup_ns": 1_000_000_000,
        }
    )
    assert line == (
        "recorder 20.0 µs of serving-thread time per layer call (100 calls) plus 1000.0 ms once "
        "(eager ring buffers, ring-kernel compiles)"
    )


def test_the_idle_setting_arms_the_recorder_with_no_layer_selected(bench: types.ModuleType) -> None:
    """``flight-idle`` must parse as a flight recorder whose layer filter matches no layer of any model."""
    from moereplay.capture.settings import Trigger, settings_from_environ

    settings = settings_from_environ(bench.SETTINGS["flight-idle"])
    assert settings.trigger is Trigger.FLIGHT and not settings.layers.everything
    assert not any(
        settings.layers.contains(layer, f"model.layers.{layer}.mlp.experts") for layer in range(4096)
    )
    assert settings_from_environ(bench.SETTINGS["flight"]).layers.everything


def test_every_setting_parses_and_the_stage_setting_has_room_for_a_batch_of_32(
    bench: types.ModuleType,
) -> None:
    """A typo in a setting's variables would only show as a server that refuses to arm, minutes into a GPU call."""
    from moereplay.capture import graph_ring
    from moereplay.capture.settings import settings_from_environ

    parsed = {name: settings_from_environ(env) for name, env in bench.SETTINGS.items() if env}
    staged = parsed["flight-stage"]
    # a gpt-oss batch of 32 at triton_kernel_moe_forward: hidden states and output (bf16), router logits (32 experts)
    entry = 2 * 32 * 2880 * 2 + 32 * 32 * 2
    assert staged.flight_graph_stage >= entry
    room = graph_ring.staging_area(staged.flight_graph_bytes)
    assert 24 * entry <= room  # a full decode graph of 24 layers (every graph reuses the area)
    assert parsed["flight"].flight_graph_batch and not parsed["flight-stage"].flight_graph_batch
    nobatch = parsed["flight-nobatch"]
    assert nobatch.flight_graph_stage == graph_ring.ALONE_BYTES and not nobatch.flight_graph_batch
    assert parsed["flight-stream"].flight_stream_stores and not parsed["flight"].flight_stream_stores
    assert parsed["flight-beside-driver"].flight_beside_driver and not parsed["flight"].flight_beside_driver
    assert not parsed["flight-noinline"].flight_inline_checks and parsed["flight"].flight_inline_checks
    # the combined candidates: each cut as its own setting sets it
    both = parsed["flight-driver-noinline"]
    assert both.flight_beside_driver and not both.flight_inline_checks
    lean = parsed["flight-lean-noinline"]
    assert (
        lean.flight_lean_bytes == parsed["flight-lean"].flight_lean_bytes > 0
        and not lean.flight_inline_checks
    )
    assert not lean.flight_beside_driver


def test_a_server_whose_requests_fail_is_named_with_its_logs_error_lines(
    bench: types.ModuleType, tmp_path: Path
) -> None:
    (tmp_path / "flight-inline").mkdir()
    (tmp_path / "flight-inline" / "server.log").write_text(
        "(EngineCore pid=7) INFO 12-06 18:49:13 [core.py:1] ready\n"
        "(EngineCore pid=7) ERROR 12-06 18:50:02 [core.py:9] torch.OutOfMemoryError: CUDA out of memory. Tried to "
        "allocate 378.00 MiB\n"
        '(APIServer pid=3) INFO:     127.0.0.1:5 - "POST /v1/completions HTTP/1.1" 500 Internal Server Error\n'
    )

    class Failing:
        def complete_many(self, prompts, tokens):
            raise RuntimeError("63 of 64 requests failed; first: <HTTPError 500: 'Internal Server Error'>")

    options = types.SimpleNamespace(out=tmp_path, prefill_length=4, prefill_requests=2, decode_tokens=1)
    with pytest.raises(bench.ServerFailed) as failed:
        bench.measure_or_say("flight-inline", Failing(), ["a", "b"], "prefill", options)
    text = str(failed.value)
    assert text.startswith("setting 'flight-inline' failed prefill: 63 of 64 requests failed")
    assert "CUDA out of memory" in text and "500 Internal Server Error" in text


def test_rounds_in_two_modes_are_named_and_steady_ones_are_not(bench: types.ModuleType) -> None:
    # decode b1 of the H100's run of 2026-12-06: the flight server's rounds 2, 3, 4 and 6 in the slow mode
    results = {
        "off": {"decode_b1": [372.6, 371.2, 375.4, 371.0, 376.2, 370.1]},
        "flight": {"decode_b1": [358.3, 284.8, 287.7, 288.5, 337.6, 275.9]},
    }
    notes = bench.spread_notes(results)
    assert notes == [
        "flight decode_b1: rounds spread 275.9–358.3 tok/s (1.30×); round(s) 2, 3, 4, 6 of 6 in the slow mode — "
        "its median is not a cost"
    ]
    assert bench.spread_notes({"off": {"prefill": [70000.0, 60870.0]}}) == []  # 1.15× exactly: not two modes
    assert bench.spread_notes({"off": {"prefill": []}}) == []


def test_per_round_ratios_pair_each_round_and_shrug_off_a_slow_round(bench: types.ModuleType) -> None:
    """A round where capture off fell into the slow mode moves the ratio of the medians' columns (here off's
    median is its slow round's neighbour) but only one of the per-round ratios."""
    results = {
        "off": {"decode_b32": [4500.0, 1600.0, 4600.0, 4400.0]},
        "flight": {"decode_b32": [4300.0, 4350.0, 4400.0, 4200.0]},
    }
    paired = bench.paired_ratios(results)
    assert list(paired) == ["flight"]
    ratios = paired["flight"]["decode_b32"]
    assert ratios == pytest.approx([4500 / 4300, 1600 / 4350, 4600 / 4400, 4400 / 4200])
    lines = bench.table(results, paired, {"flight": None})
    assert lines[1].split()[:3] == ["off", "4450.0", "1.000"]
    assert lines[2].split()[:3] == ["flight", "4325.0", f"{4450 / 4325:.3f}"]
    assert lines[3] == (
        f"= flight: per-round ratios to off, median (range) of 4: decode_b32 "
        f"{sorted(ratios)[1] / 2 + sorted(ratios)[2] / 2:.3f} ({min(ratios):.3f}–{max(ratios):.3f})"
    )
    assert bench.paired_ratios({"flight": {"prefill": [1.0]}}) == {}  # no capture-off server: nothing to pair


def test_pooled_runs_keep_every_round_and_pair_rounds_within_their_run(
    bench: types.ModuleType, tmp_path: Path
) -> None:
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(
        json.dumps(
            {
                "mode": "graph",
                "results": {"off": {"prefill": [100.0, 90.0]}, "flight-stage": {"prefill": [50.0, 45.0]}},
                "stopped": {"off": None, "flight-stage": None},
            }
        )
    )
    # the second run has another setting, listed before off, and one round: its pair is its own off's round,
    # not the first run's first (what concatenating the columns would pair it with); its recorder stopped
    second.write_text(
        json.dumps(
            {
                "mode": "graph",
                "results": {"flight": {"prefill": [80.0]}, "off": {"prefill": [80.0]}},
                "stopped": {"flight": "stopped before the measured rounds: the capture file reached it"},
            }
        )
    )
    pool = bench.pooled([first, second])
    assert pool.mode == "graph" and list(pool.results) == ["off", "flight-stage", "flight"]
    assert pool.results["off"]["prefill"] == [100.0, 90.0, 80.0] and pool.rounds == 3
    assert pool.paired["flight-stage"]["prefill"] == pytest.approx([2.0, 2.0])
    assert pool.paired["flight"]["prefill"] == pytest.approx([1.0])
    # each setting's × against the capture-off rounds of its own runs: flight 80 ÷ 80, not off's pooled 90 ÷ 80
    assert pool.bases["flight"]["prefill"] == [80.0]
    lines = bench.table(pool.results, pool.paired, pool.stopped, pool.bases)
    assert lines[2].split()[:3] == ["flight-stage", "47.5", f"{95 / 47.5:.3f}"]
    assert lines[3].split()[:3] == ["flight*", "80.0", "1.000"]
    assert lines[-1] == (
        "* flight: the recorder stopped before the measured rounds: the capture file reached it (run 2, b.json) — "
        "what follows it measured capture off, not flight"
    )
    assert (
        pool.stopped["flight"]
        == "stopped before the measured rounds: the capture file reached it (run 2, b.json)"
    )


def test_pooled_spread_notes_name_the_run_and_its_own_rounds(bench: types.ModuleType, tmp_path: Path) -> None:
    """Two steady runs on different days are not one setting's two modes; a slow round is named in its run."""
    paths = []
    for index, rounds in enumerate(([4500.0, 4400.0], [3900.0, 3850.0], [4500.0, 1600.0, 4400.0])):
        paths.append(tmp_path / f"run{index}.json")
        paths[-1].write_text(json.dumps({"mode": "graph", "results": {"off": {"decode_b32": rounds}}}))
    pool = bench.pooled(paths)
    assert pool.notes == [
        "run 3 (run2.json): off decode_b32: rounds spread 1600.0–4500.0 tok/s (2.81×); round(s) 2 of 3 in the "
        "slow mode — its median is not a cost"
    ]


@pytest.mark.parametrize(
    "text, said",
    [
        ("not json", "not a serve_bench --json file (JSONDecodeError"),
        ('{"mode": "graph"}', "not a serve_bench --json file (KeyError"),
        ("[]", "not a serve_bench --json file (TypeError"),
        (
            '{"results": {"off": {"prefill": ["fast"]}}}',
            "'results' is not settings of measurements of finite",
        ),
        ('{"results": {"off": {"prefill": [true]}}}', "'results' is not settings of measurements of finite"),
        ('{"results": {"off": {"prefill": [NaN]}}}', "'results' is not settings of measurements of finite"),
        ('{"results": {"off": {"prefill": [-1.0]}}}', "'results' is not settings of measurements of finite"),
        pytest.param(
            '{"results": {"off": {"prefill": [1' + "0" * 400 + "]}}}", "(OverflowError", id="huge-int"
        ),
        pytest.param("[" * 100000, "not a serve_bench --json file (RecursionError", id="deep"),
        ('{"results": [1, 2]}', "'results' is not settings of measurements of finite numbers"),
        ('{"results": {"off": {}}, "stopped": [1]}', "'stopped' is not settings of reasons"),
        ('{"results": {"flight": {"prefill": [1.0]}}}', "the run has no capture-off server"),
    ],
)
def test_a_pooled_file_that_is_not_a_bench_run_is_named(
    bench: types.ModuleType, tmp_path: Path, text: str, said: str
) -> None:
    path = tmp_path / "run.json"
    path.write_text(text)
    with pytest.raises(bench.PoolError) as error:
        bench.pooled([path])
    assert str(error.value).startswith(f"{path}: ") and said in str(error.value)


def test_pooling_refuses_runs_of_two_modes(bench: types.ModuleType, tmp_path: Path) -> None:
    for mode in ("graph", "eager"):
        (tmp_path / f"{mode}.json").write_text(
            json.dumps({"mode": mode, "results": {"off": {"prefill": [1.0]}}})
        )
    with pytest.raises(bench.PoolError, match="mix modes"):
        bench.pooled([tmp_path / "graph.json", tmp_path / "eager.json"])


def test_the_pool_command_prints_a_table_or_one_line(
    bench: types.ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = tmp_path / "run.json"
    run.write_text(
        json.dumps({"mode": "eager", "results": {"off": {"prefill": [2.0]}, "flight": {"prefill": [1.0]}}})
    )
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"mode": "eager", "results": {"off": {"prefill": []}}}))
    outcomes = []
    for files in ([run], [empty], [tmp_path]):
        monkeypatch.setattr(sys, "argv", ["serve_bench.py", "--pool", *map(str, files)])
        code = bench.main()
        out, err = capsys.readouterr()
        outcomes.append((code, out, err))
    (code, out, err), (empty_code, _, empty_err), (dir_code, _, dir_err) = outcomes
    assert code == 0 and err == "" and "serve_bench: 1 runs pooled, eager, median of up to 1 rounds" in out
    assert out.splitlines()[3].split()[:3] == ["flight", "1.0", "2.000"]
    assert out.splitlines()[-1] == (
        "> flight against the eager targets (medians' ratio / per-round median): prefill ≤ 1.02: 2.000 / 2.000 misses"
    )
    assert (empty_code, empty_err) == (2, "serve_bench: the files hold no rounds\n")
    assert dir_code == 2 and dir_err.startswith(f"serve_bench: {tmp_path}: not a serve_bench --json file (")
    assert dir_err.count("\n") == 1


def test_the_recorder_settings_are_judged_against_the_issues_targets(bench: types.ModuleType) -> None:
    """Both figures under the target: meets; both over it by more than the A/A spread: misses; else at the line.
    Diagnostic settings and stopped recorders are not judged; eager mode has its own decode target."""
    results = {
        "off": {"decode_b1": [100.0, 100.0, 100.0], "prefill": [1000.0, 1040.0, 1000.0]},
        "off-again": {"decode_b1": [100.0, 100.0, 100.0], "prefill": [995.0, 995.0, 995.0]},  # A/A: 1.005
        # decode 1.036; prefill: medians 1000 / 985 = 1.015, per round 1.015, 1.030, 1.026
        "flight": {"decode_b1": [97.0, 96.0, 96.5], "prefill": [985.0, 1010.0, 975.0]},
        "flight-stream": {"decode_b1": [90.0, 90.0, 90.0], "prefill": [900.0, 936.0, 900.0]},  # 1.111 both
        "flight-timers": {"decode_b1": [50.0, 50.0, 50.0], "prefill": [500.0, 500.0, 500.0]},
    }
    paired = bench.paired_ratios(results)
    lines = bench.verdicts(results, paired, "graph", {})
    # in JUDGED's order; no diagnostic
    assert [line.split()[1] for line in lines] == ["flight", "flight-stream"]
    flight, stream = lines
    assert "decode_b1 ≤ 1.05: 1.036 / 1.036 meets" in flight
    assert "prefill ≤ 1.02: 1.015 / 1.026 at the line (A/A ±0.005)" in flight
    assert (
        "decode_b1 ≤ 1.05: 1.111 / 1.111 misses" in stream
        and "prefill ≤ 1.02: 1.111 / 1.111 misses" in stream
    )
    assert "decode_b1 ≤ 1.15: 1.111 / 1.111 meets" in bench.verdicts(results, paired, "eager", {})[1]
    assert (
        bench.verdicts(results, paired, "graph", {"flight": "stopped"})[0]
        == "> flight: not judged (its recorder stopped)"
    )
    assert (
        bench.verdicts({"flight": results["flight"]}, {}, "graph", {}) == []
    )  # no capture off: nothing to judge


def test_the_interval_of_the_per_round_median_says_whether_the_run_can_tell_the_target(
    bench: types.ModuleType,
) -> None:
    """A bootstrap interval of the per-round median per judged setting: all under the target, all over it, or the
    target inside it (this run cannot tell); seeded, so one run's rounds give one line; the steady rounds where the
    slow mode left some out; no interval from fewer than three rounds."""
    scattered = [1.0 + 0.004 * i for i in range(11)]  # 1.000 … 1.040, median 1.020
    low, high = bench.median_interval(scattered)
    assert min(scattered) <= low < 1.02 < high <= max(scattered)
    assert bench.median_interval(scattered) == (low, high)  # seeded
    assert bench.median_interval([1.01] * 9) == (1.01, 1.01)
    paired = {
        "flight": {"decode_b1": [1.01] * 9, "decode_b32": [1.2] * 9, "prefill": scattered},
        "flight-stream": {"decode_b1": [1.0, 1.01]},  # too few rounds: no interval
        "flight-timers": {"prefill": [1.0] * 9},  # a diagnostic: not judged
    }
    (line,) = bench.intervals(paired, "graph")
    assert line == (
        "> flight: 90 % interval of the per-round median: decode_b1 1.010–1.010 of 9 (under 1.05); "
        f"decode_b32 1.200–1.200 of 9 (over 1.05); prefill {low:.3f}–{high:.3f} of 11 "
        "(1.02 inside it: this run cannot tell)"
    )
    steady = {"flight": {"prefill": ([1.005] * 8, 3), "decode_b1": ([1.01] * 9, 0)}}
    (line,) = bench.intervals(paired, "graph", steady)
    assert "prefill steady 1.005–1.005 of 8 (under 1.02)" in line and "decode_b1 1.010–1.010 of 9" in line
    assert bench.intervals(paired, "neither") == []


def test_steady_ratios_leave_out_every_round_either_side_spent_in_the_slow_mode(
    bench: types.ModuleType,
) -> None:
    """The recorder's rounds 2 and 3 fell into the slow mode: their pairs are ratios of two modes (2.2 here), and
    only the other four rounds say what the recorder costs. Without a slow round nothing is left out, and the
    table and the verdict show no steady figure."""
    results = {
        "off": {"decode_b32": [4500.0, 4450.0, 4600.0, 4400.0, 4550.0, 4500.0], "decode_b1": [370.0, 372.0]},
        "flight": {
            "decode_b32": [4300.0, 2000.0, 2100.0, 4000.0, 4250.0, 4350.0],
            "decode_b1": [355.0, 357.0],
        },
    }
    steady = bench.steady_ratios(results)
    kept, left_out = steady["flight"]["decode_b32"]
    assert left_out == 2 and kept == pytest.approx([4500 / 4300, 4400 / 4000, 4550 / 4250, 4500 / 4350])
    paired = bench.paired_ratios(results)
    assert steady["flight"]["decode_b1"] == (pytest.approx(paired["flight"]["decode_b1"]), 0)
    assert bench.steady_ratios({"flight": results["flight"]}) == {}  # no capture off: nothing to pair

    lines = bench.table(results, paired, {"flight": None}, steady=steady)
    middle = statistics.median(kept)  # 1.059, where all six rounds' median is 1.085
    assert (
        f"= flight: the same over the steady rounds (neither in the slow mode): decode_b32 {middle:.3f} "
        f"({min(kept):.3f}–{max(kept):.3f}) of 4"
    ) in lines
    assert sum("steady" in line for line in lines) == 1  # decode b1 left nothing out
    (line,) = bench.verdicts(results, paired, "graph", {}, steady=steady)
    every = statistics.median(paired["flight"]["decode_b32"])
    assert (
        f"decode_b32 ≤ 1.05: {4500 / 4125:.3f} / {every:.3f} / steady (4 rounds) {middle:.3f} misses" in line
    )
    assert "decode_b1 ≤ 1.05: 1.042 / 1.042 meets" in line  # no steady figure where none was left out
    (eager,) = bench.verdicts(results, paired, "eager", {}, steady=steady)
    assert f"steady (4 rounds) {middle:.3f} meets" in eager

    # capture off's slow rounds pull the other two figures under the target; the steady one alone is over it
    results["off"]["decode_b32"] = [4500.0, 1600.0, 1700.0, 4400.0, 4550.0, 4500.0]
    results["flight"]["decode_b32"] = [4300.0, 4300.0, 4250.0, 4000.0, 4250.0, 4350.0]
    steady, paired = bench.steady_ratios(results), bench.paired_ratios(results)
    (line,) = bench.verdicts(results, paired, "graph", {}, steady=steady)
    every = statistics.median(paired["flight"]["decode_b32"])
    middle = statistics.median(steady["flight"]["decode_b32"][0])
    assert every <= 1.05 < middle
    assert (
        f"decode_b32 ≤ 1.05: {4450 / 4275:.3f} / {every:.3f} / steady (4 rounds) {middle:.3f} at the line"
        in line
    )
    assert line.startswith(
        "> flight against the graph targets (medians' ratio / per-round median / over the steady"
    )


def test_steady_rounds_are_paired_rounds_with_tokens_to_show(bench: types.ModuleType) -> None:
    """A round of 0 tokens/s (in a hand-made --pool file) is no round of either mode: it neither turns the slow
    mode's detection off nor counts as left out; rounds past the shorter column are not paired, and do not move
    the other's extremes; a column whose every paired round is slow says so."""
    results = {
        "off": {"decode_b32": [4500.0, 0.0, 2000.0, 4500.0, 4400.0, 9000.0]},
        "flight": {"decode_b32": [4300.0, 4300.0, 4250.0, 4200.0, 0.0]},
    }
    kept, left_out = bench.steady_ratios(results)["flight"]["decode_b32"]
    # paired rounds with tokens: 1, 3, 4 (round 2's off and round 5's flight read 0; off's round 6 has no pair)
    assert left_out == 1 and kept == pytest.approx([4500 / 4300, 4500 / 4200])
    lines = bench.table(
        {"off": {"prefill": [10.0, 30.0]}, "flight": {"prefill": [30.0, 10.0]}},
        {},
        {"flight": None},
        steady=bench.steady_ratios({"off": {"prefill": [10.0, 30.0]}, "flight": {"prefill": [30.0, 10.0]}}),
    )
    assert (
        "= flight: the same over the steady rounds (neither in the slow mode): prefill none (2 left out)"
        in lines
    )


def test_pooled_steady_rounds_are_taken_within_each_run(bench: types.ModuleType, tmp_path: Path) -> None:
    """A round is slow against its own run's rounds: the second run's 3000 is steady there (its off is 3000 too),
    though it would be the slow mode among the first run's 4500s."""
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(
        json.dumps(
            {
                "mode": "graph",
                "results": {
                    "off": {"decode_b32": [4500.0, 1600.0, 4400.0]},
                    "flight": {"decode_b32": [4300.0, 4200.0, 4000.0]},
                },
            }
        )
    )
    second.write_text(
        json.dumps(
            {
                "mode": "graph",
                "results": {
                    "off": {"decode_b32": [3000.0, 3100.0]},
                    "flight": {"decode_b32": [2900.0, 3000.0]},
                },
            }
        )
    )
    pool = bench.pooled([first, second])
    kept, left_out = pool.steady["flight"]["decode_b32"]
    assert left_out == 1
    assert kept == pytest.approx([4500 / 4300, 4400 / 4000, 3000 / 2900, 3100 / 3000])
    (line,) = bench.verdicts(pool.results, pool.paired, pool.mode, pool.stopped, pool.bases, pool.steady)
    assert f"steady (4 rounds) {sorted(kept)[1] / 2 + sorted(kept)[2] / 2:.3f}" in line


def test_the_server_measured_twice_in_a_row_is_found_by_the_rotation(bench: types.ModuleType) -> None:
    """main measures the servers in ``rotation`` order, shifted by one a round: with two servers the first
    measurement of every round from the second comes right after the same server's last one (its prefill), the two
    servers by turns; with three, never."""
    two = ["off", "flight"]
    assert [bench.rotation(two, i) for i in range(3)] == [two, ["flight", "off"], two]
    assert [bench.after_own(two, i) for i in range(5)] == [None, "flight", "off", "flight", "off"]
    three = ["off", "flight", "other"]
    assert bench.rotation(three, 4) == ["flight", "other", "off"]
    assert all(bench.after_own(three, i) is None for i in range(9))
    assert bench.after_own([], 3) is None and bench.rotation([], 3) == []


def test_a_first_measurement_slow_right_after_its_own_server_is_noted(bench: types.ModuleType) -> None:
    # off loses 1 % right after its own prefill (rounds 2, 4, 6 from 0), flight 10 % (rounds 1, 3, 5, 7)
    off = [100.0 if i % 2 else 99.0 for i in range(8)]
    flight = [86.0 if i % 2 else 95.0 for i in range(8)]
    results = {"off": {"decode_b1": off, "prefill": off}, "flight": {"decode_b1": flight, "prefill": flight}}
    notes = bench.follow_notes(results)
    assert len(notes) == 1 and notes[0].startswith("flight decode_b1: 86.0 tok/s right after")
    assert "(4 rounds), 95.0 otherwise; off 99.0 and 100.0" in notes[0]  # round 0: neither followed itself
    # the cost apart from either aftermath: off's rounds not after itself against flight's, not 99 / 95
    assert f"where neither followed itself {100 / 95:.3f}×" in notes[0]
    # three servers never measure one after itself: no note; nor a run without capture off
    assert bench.follow_notes({**results, "again": results["off"]}) == []
    assert bench.follow_notes({"a": results["off"], "b": results["flight"]}) == []
    # --aftermath ends every round with each server's own prefill: no split to make
    aftermath = {name: {**by, "b1_before": by["decode_b1"]} for name, by in results.items()}
    assert bench.follow_notes(aftermath) == []
    # rounds without tokens to show are left out, never a crash that loses the run's table
    empty = {"off": {"decode_b1": [0.0] * 8}, "flight": {"decode_b1": [0.0] * 8}}
    assert bench.follow_notes(empty) == []


def test_a_setting_named_twice_or_unknown_is_refused_before_any_server_starts(
    bench: types.ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Results are kept by setting name, the rotation by position: ``off,flight,off`` would pair rounds wrongly."""
    for settings, said in (("off,flight,off", "a setting named twice"), ("off,nonsense", "unknown settings")):
        monkeypatch.setattr(sys, "argv", ["serve_bench.py", "--model", str(tmp_path), "--settings", settings])
        with pytest.raises(SystemExit) as exit_info:
            bench.main()
        assert exit_info.value.code == 2 and said in capsys.readouterr().err
    for measure in ("prefill,decode", ",", "prefil"):  # --measure: only what a round can measure
        argv = ["serve_bench.py", "--model", str(tmp_path), "--settings", "off,flight", "--measure", measure]
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as exit_info:
            bench.main()
        assert (
            exit_info.value.code == 2
            and "name some of decode_b1, decode_b32, prefill" in capsys.readouterr().err
        )


def test_a_streamed_request_gives_when_each_step_token_came(bench: types.ModuleType) -> None:
    """``--aftermath``'s timeline: the harness reads vLLM's server-sent events (a text event per engine step, the
    usage in the last) from a real HTTP server here, and ``step_times`` turns the arrival times into figures."""
    import http.server
    import threading

    events = [{"choices": [{"text": word}]} for word in ("a", " b", " c")]
    events += [
        {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 3}}
    ]  # as vLLM's include_usage
    asked: list[dict[str, object]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            asked.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for event in events:
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = bench.harness.Server(
            process=None, port=server.server_address[1], model="m", log=Path("unused")
        )
        answer = client.complete("hello", 3, stream=True)
    finally:
        server.shutdown()
        server.server_close()
    assert asked[0]["stream"] is True and asked[0]["stream_options"] == {"include_usage": True}
    assert answer.text == "a b c" and (answer.prompt_tokens, answer.completion_tokens) == (8, 3)
    assert len(answer.times) == 3 and list(answer.times) == sorted(answer.times)  # the usage event: no time
    assert answer.times[-1] <= answer.seconds


def test_step_times_separate_the_first_token_from_slow_steps(bench: types.ModuleType) -> None:
    got = bench.step_times([0.100, 0.110, 0.120, 0.200, 0.210])
    assert got["first"] == pytest.approx(100.0) and got["total"] == pytest.approx(210.0)
    assert got["median"] == pytest.approx(10.0) and got["slowest"] == pytest.approx(80.0)
    assert got["slow_ms"] == pytest.approx(70.0)  # only the 80 ms step, beyond the 10 ms median
    assert bench.step_times([0.05]) == {
        "first": 50.0,
        "median": 0.0,
        "slow_ms": 0.0,
        "slowest": 0.0,
        "total": 50.0,
    }
    assert bench.step_times([]) == {}


def test_aftermath_notes_give_before_and_after_medians(bench: types.ModuleType) -> None:
    before = [bench.step_times([0.02, 0.03, 0.04]) for _ in range(3)]
    after = [bench.step_times([0.06, 0.07, 0.08]), bench.step_times([0.05, 0.06, 0.07]), {}]
    notes = bench.aftermath_notes(
        {"flight": {"b1_before": before, "b1_after": after}, "off": {"b1_before": []}}
    )
    assert len(notes) == 1 and notes[0].startswith("flight decode b1 streamed")
    assert "of 3 / 2 rounds" in notes[0]  # the round without a token left out
    assert "first token 20.0 / 55.0 ms" in notes[0] and "median step 10.0 / 10.0 ms" in notes[0]


def test_pooled_runs_carry_their_aftermath_notes_and_refuse_bad_timelines(
    bench: types.ModuleType, tmp_path: Path
) -> None:
    rows = {
        "b1_before": [bench.step_times([0.02, 0.03])] * 2,
        "b1_after": [bench.step_times([0.04, 0.05])] * 2,
    }
    results = {name: {"decode_b1": [100.0, 101.0]} for name in ("off", "flight")}
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"results": results, "mode": "graph", "timelines": {"flight": rows}}))
    notes = bench.pooled([good]).notes
    assert any("flight decode b1 streamed" in note and "first token 20.0 / 40.0 ms" in note for note in notes)
    for timelines in (
        {"flight": {"b1_before": [{"first": "x"}]}},
        {"flight": {"b1_before": [{"first": 1.0}]}},
    ):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"results": results, "mode": "graph", "timelines": timelines}))
        with pytest.raises(bench.PoolError, match="timelines"):
            bench.pooled([bad])


def test_a_streamed_answer_that_errs_or_breaks_off_raises(bench: types.ModuleType) -> None:
    read = bench.harness.read_events
    times: list[float] = []
    # a step whose token ends inside a character streams an empty text: its time counts (else its gap would
    # merge into the next step's and read as a slow step)
    lines = [b'data: {"choices": [{"text": ""}]}', b'data: {"choices": [{"text": "x"}]}', b"data: [DONE]"]
    answer = read(lines, 0, times)
    assert answer["choices"][0]["text"] == "x" and len(times) == 2
    for broken, said in (
        ([b'data: {"error": {"message": "boom"}}'], "reports an error"),
        ([b'data: {"choices": [{"text": "x"}]}'], "without data: [DONE]"),
        ([b"data: [1, 2]"], "non-object event"),
    ):
        with pytest.raises(RuntimeError, match=re.escape(said)):
            read(broken, 0, [])


def test_a_run_that_measured_prefill_alone_is_tabled_and_judged(bench: types.ModuleType) -> None:
    """``--measure prefill``: the table, the verdict and the interval cover the one measurement there is."""
    off = [67000.0 + 40 * (i % 5) for i in range(40)]
    lean = [value / 1.006 for value in off]
    results = {"off": {"prefill": off}, "flight-lean": {"prefill": lean}}
    paired = bench.paired_ratios(results)
    steady = bench.steady_ratios(results)
    lines = bench.table(results, paired, {}, steady=steady)
    assert "prefill tok/s" in lines[0] and "decode" not in lines[0]
    (verdict,) = bench.verdicts(results, paired, "graph", {}, steady=steady)
    assert "prefill ≤ 1.02: 1.006 / 1.006 meets" in verdict and "decode" not in verdict
    (interval,) = bench.intervals(paired, "graph", steady)
    assert "prefill 1.006–1.006 of 40 (under 1.02)" in interval


def test_each_candidate_is_compared_with_the_default_round_by_round(bench: types.ModuleType) -> None:
    """The line that decides a default: per round, the default's tokens/s ÷ the candidate's; cheaper or dearer only
    when 1.000 lies outside the whole interval; a round either server spent in the slow mode is left out; no line
    for diagnostics, for the default itself or without the default."""
    rounds = 41
    off = [70000.0 + 90 * (i % 7) for i in range(rounds)]
    flight = [value / 1.026 for value in off]
    results = {
        "off": {"prefill": off, "decode_b1": [380.0] * rounds},
        "flight": {"prefill": flight, "decode_b1": [365.0] * rounds},
        # 1.5 % faster than the default in every round
        "flight-noinline": {"prefill": [value * 1.015 for value in flight], "decode_b1": [365.0] * rounds},
        # as fast, give or take 0.4 % by turns
        "flight-driver-noinline": {
            "prefill": [value * (1.004 if i % 2 else 0.996) for i, value in enumerate(flight)],
            "decode_b1": [365.0] * rounds,
        },
        # 1 % slower
        "flight-lean-noinline": {"prefill": [value / 1.01 for value in flight]},
        "flight-timers": {"prefill": [value / 1.05 for value in flight]},  # a diagnostic
    }
    # the slow mode, once, on the default's side only (its ratios there: 0.46, 0.45)
    flight[5] = flight[5] / 2.2
    lines = bench.against_default(results, "graph")
    assert [line.split()[1] for line in lines] == [
        "flight-noinline",
        "flight-driver-noinline",
        "flight-lean-noinline",
    ]
    noinline, driver, lean = lines
    assert "prefill 0.985 (0.985–0.985) of 40 (1 slow left out): cheaper beyond the spread" in noinline
    assert "decode_b1 1.000 (1.000–1.000) of 41: no difference this run can tell" in noinline
    assert "prefill" in driver and "no difference this run can tell" in driver.split("prefill")[1]
    assert "prefill 1.010 (1.010–1.010) of 40 (1 slow left out): dearer beyond the spread" in lean
    assert "decode_b1" not in lean  # not measured
    # a stopped recorder serves as capture off from then on: not compared; the default's stopped: no line at all
    (stopped,) = [
        line
        for line in bench.against_default(results, "graph", {"flight-noinline": "stopped"})
        if "flight-noinline" in line
    ]
    assert stopped == "> flight-noinline against flight: not compared (its recorder stopped)"
    assert bench.against_default(results, "graph", {"flight": "stopped"}) == []
    # a handful of rounds, all on one side: no verdict
    few = {name: {"prefill": values["prefill"][:5]} for name, values in results.items()}
    (noinline, *_) = bench.against_default(few, "graph")
    assert "prefill 0.985 (0.985–0.985) of 5: too few rounds to tell (under 8)" in noinline
    del results["flight"]
    assert bench.against_default(results, "graph") == []


def _gc_line(process: str, ms: str, objects: int, generation: int) -> str:
    """A collection as ``VLLM_GC_DEBUG=1`` logs it (vLLM 0.25.1's format, with its multiprocessing log prefix)."""
    return (
        f"({process} pid=1631) INFO 12-07 10:00:01 [gc_utils.py:82] GC took {ms}ms to complete. Collected 12 "
        f"objects (out of {objects}) in GC generation {generation}."
    )


def test_gc_notes_summarise_vllms_gc_debugger_per_process_and_generation(
    bench: types.ModuleType, tmp_path: Path
) -> None:
    """The GC debugger's lines are summed per process and generation; other lines and a missing log give
    nothing."""
    log = tmp_path / "server.log"
    lines = [
        "(EngineCore_DP0 pid=1631) INFO 12-07 09:59:59 [core.py:1] ready",
        _gc_line("EngineCore_DP0", "281.250", 4200000, 2),
        _gc_line("EngineCore_DP0", "390.500", 5100000, 2),
        _gc_line("EngineCore_DP0", "0.200", 710, 0),
        _gc_line("APIServer", "51.700", 900000, 2),
    ]
    log.write_text("\n".join(lines) + "\n")
    assert bench.gc_notes(log) == [
        "APIServer gc2: 1 collections, median 51.7 ms, longest 51.7 ms, at most 900,000 objects",
        "EngineCore_DP0 gc0: 1 collections, median 0.2 ms, longest 0.2 ms, at most 710 objects",
        "EngineCore_DP0 gc2: 2 collections, median 335.9 ms, longest 390.5 ms, at most 5,100,000 objects",
    ]
    assert bench.gc_notes(tmp_path / "missing.log") == []
    assert bench.gc_notes(_log(tmp_path / "other.log", datetime.datetime(2026, 12, 7, 10, 0, 0))) == []
    assert "off-gcdebug" in bench.SETTINGS and "off-gcdebug" not in bench.JUDGED


def test_pooled_runs_compare_each_candidate_with_the_default_within_each_run(
    bench: types.ModuleType, tmp_path: Path
) -> None:
    """Two runs of five rounds each are too few to tell apart; pooled, their ten per-run pairs are enough. A run
    without the candidate adds nothing to its comparison (concatenated columns would pair its default's rounds
    with another run's candidate rounds)."""
    paths = []
    for number, level in enumerate((70000.0, 60000.0)):
        off = [level + 50 * (i % 3) for i in range(5)]
        flight = [value / 1.026 for value in off]
        path = tmp_path / f"run{number}.json"
        path.write_text(
            json.dumps(
                {
                    "mode": "graph",
                    "results": {
                        "off": {"prefill": off},
                        "flight": {"prefill": flight},
                        "flight-noinline": {"prefill": [value * 1.012 for value in flight]},
                    },
                    "stopped": {},
                }
            )
        )
        paths.append(path)
        (alone,) = bench.against_default(
            json.loads(path.read_text())["results"], "graph", {}, None
        )  # one run: five rounds
        assert "too few rounds to tell" in alone
    # a third run without the candidate, its default much faster: not paired with anything of the candidate's
    third = tmp_path / "run2.json"
    third.write_text(
        json.dumps(
            {
                "mode": "graph",
                "results": {"off": {"prefill": [90000.0] * 5}, "flight": {"prefill": [89000.0] * 5}},
                "stopped": {},
            }
        )
    )
    pool = bench.pooled([*paths, third])
    (line,) = bench.against_default(pool.results, pool.mode, pool.stopped, pool.against)
    assert "> flight-noinline against flight" in line
    assert "prefill 0.988 (0.988–0.988) of 10: cheaper beyond the spread" in line
