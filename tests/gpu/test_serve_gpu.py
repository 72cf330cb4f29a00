"""``MOEREPLAY_CAPTURE=1 vllm serve`` of a real (random-weight) gpt-oss MXFP4 model on the GPU, end to end.

Needs CUDA, the kernel pack and the serving pack (``tools/gpu/device_setup.sh``); marked ``slow`` as well (each
server start takes 0.5–3 minutes). What it proves, through vLLM's own serving code (API server, EngineCore,
model runner, the gpt-oss model and its MXFP4 MoE method) rather than calls the tests build:

- eager mode: every request is answered; the worker's capture file holds the MoE kernel calls of every MoE layer
  with vLLM's layer names, forward steps, ranks and their parent fused call; each process closes its file;
- moereplay replays the served calls on the kernel pack (the fidelity numbers are printed);
- vLLM's default CUDA-graph mode: graphs are captured, requests are answered, the plugin warns about graph
  capture, and the calls that run outside graphs (prefill batches above the largest graph size) are captured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

REPOSITORY = Path(__file__).resolve().parents[2]
SERVE = REPOSITORY / "tools" / "gpu" / "serve_gpu.py"
MAKE_GPT_OSS = REPOSITORY / "tools" / "models" / "make_gpt_oss.py"


def _serving_available() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA"
    for module in ("vllm", "fastapi", "uvicorn"):
        found = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True)
        if found.returncode != 0:
            return f"{module} is not importable (kernel pack + serving pack: tools/gpu/device_setup.sh)"
    return None


@pytest.fixture(scope="module")
def gpt_oss_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reason = _serving_available()
    if reason:
        pytest.skip(reason)
    existing = os.environ.get("MOEREPLAY_TEST_GPT_OSS")
    if existing:
        return Path(existing)
    model = tmp_path_factory.mktemp("models") / "gpt-oss-2l"
    subprocess.run([sys.executable, str(MAKE_GPT_OSS), str(model), "--layers", "2"], check=True, timeout=300)
    return model


def _serve(model: Path, out: Path, mode: str, *extra: str) -> dict:
    finished = subprocess.run(
        [sys.executable, str(SERVE), "--model", str(model), "--mode", mode, "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(finished.stdout[-6000:])
    summary_path = out / "summary.json"
    assert summary_path.exists(), f"serve_gpu failed (rc {finished.returncode}): {finished.stderr[-3000:]}"
    return json.loads(summary_path.read_text())


def _worker_file(summary: dict) -> dict:
    with_calls = [item for item in summary["files"] if item["ops"]]
    assert with_calls, f"no capture file holds a MoE call: {summary['files']}"
    return max(with_calls, key=lambda item: item["calls"])


def test_eager_serve_captures_every_moe_layer(gpt_oss_model: Path, tmp_path: Path) -> None:
    summary = _serve(gpt_oss_model, tmp_path / "eager", "eager")
    assert summary["requests"] >= 12 and summary["completion_tokens"] > 0
    worker = _worker_file(summary)
    assert worker["ops"].get("matmul_ogs", 0) > 0, worker["ops"]
    assert worker["layer_names"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert len(worker["steps"]) >= 10 and worker["tags"].get("run", 0) > 0
    assert worker["kernel_calls_with_parent"] == worker["ops"]["matmul_ogs"]
    assert all(item["footer"] for item in summary["files"]), [i["recovery"] for i in summary["files"]]
    capture = tmp_path / "eager" / "captures" / worker["name"]
    report = tmp_path / "run.json"
    replay = subprocess.run(
        [
            sys.executable,
            "-m",
            "moereplay",
            "run",
            str(capture),
            "--op",
            "matmul_ogs",
            "--json-out",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert replay.returncode in (0, 1), replay.stderr[-2000:]
    reports = json.loads(report.read_text())["reports"]
    baselines = [_baseline(item) for item in reports]
    exact = sum(1 for result in baselines if result["bit_exact"])
    print(f"served-capture replay fidelity: {exact}/{len(baselines)} matmul_ogs calls bit-exact")
    assert baselines and all(result["verdict"] != "crash" for result in baselines)


def _baseline(report: dict) -> dict:
    """The replayed call as captured (no mutation), from one report of ``moereplay run --json``."""
    for result in report["results"]:
        if result["label"] == "baseline":
            return result
    raise AssertionError(f"no baseline row in {[r['label'] for r in report['results']]}")


SELECTION = {"MOEREPLAY_LAYERS": "1", "MOEREPLAY_STEPS": "4-", "MOEREPLAY_PER_SHAPE": "2"}


def _signature_counts(capture: Path) -> dict[tuple, int]:
    """Calls per recorder signature (``capture.recorder.shape_signature``: tensor shapes and dtypes, scalar
    values), rebuilt from the file."""
    from moereplay.format import CaptureReader
    from moereplay.format.records import TensorMeta

    counts: dict[tuple, int] = {}
    with CaptureReader(capture) as reader:
        for call in reader.calls():
            key = tuple(
                (name, tuple(value.shape), value.dtype) if isinstance(value, TensorMeta) else (name, value)
                for name, value in call.args.items()
                if isinstance(value, TensorMeta)
                or value is None
                or isinstance(value, (bool, int, float, str))
            )
            counts[(call.op, key)] = counts.get((call.op, key), 0) + 1
    return counts


def test_eager_serve_honours_layers_steps_and_per_shape(gpt_oss_model: Path, tmp_path: Path) -> None:
    """``MOEREPLAY_LAYERS``, ``STEPS`` and ``PER_SHAPE`` in a real server: only layer 1, only steps from 4 on, at
    most two calls per recorder signature — and the footer counts what was left out."""
    extra = [argument for key, value in SELECTION.items() for argument in ("--env", f"{key}={value}")]
    summary = _serve(gpt_oss_model, tmp_path / "selection", "eager", *extra)
    worker = _worker_file(summary)
    counters = worker["counters"]
    print(f"selection {SELECTION}: {worker['calls']} calls {worker['ops']}, layers {worker['layer_names']}, steps "
          f"{worker['steps'][:1]}..{worker['steps'][-1:]}, counters {counters}")  # fmt: skip
    assert worker["layer_names"] == ["model.layers.1.mlp.experts"], worker["layer_names"]
    assert worker["steps"] and min(worker["steps"]) >= 4, worker["steps"]
    assert counters.get("recorder_skipped_filters", 0) > 0, counters  # layer 0 and steps 0-3
    assert counters.get("recorder_skipped_limit", 0) > 0, counters  # third and later calls of a signature
    counts = _signature_counts(tmp_path / "selection" / "captures" / worker["name"])
    print(f"calls per signature: at most {max(counts.values())}, {len(counts)} signatures")
    assert max(counts.values()) <= 2, sorted(counts.values())


def test_eager_serve_stops_writing_at_max_bytes(gpt_oss_model: Path, tmp_path: Path) -> None:
    """``MOEREPLAY_MAX_BYTES`` between one and two layers' weights (a layer of this gpt-oss holds ~400 MB; weights
    are written once per file, with the first call that uses them): layer 0's calls are kept, layer 1's first call
    would pass the bound and is dropped with every later one, counted, and the file stays readable and within the
    bound. (On the H200, 2026-12-04, a 40 MB bound let a call in together with its 398 MB of weights: the bound
    counted only the per-call copies.)"""
    bound = 600 * 2**20
    summary = _serve(
        gpt_oss_model, tmp_path / "bound", "eager",
        "--env", "MOEREPLAY_MAX_BYTES=600M", "--env", "MOEREPLAY_STEPS=4-",
    )  # fmt: skip
    worker = _worker_file(summary)
    counters = worker["counters"]
    print(
        f"MOEREPLAY_MAX_BYTES=600M: {worker['calls']} calls, layers {worker['layer_names']}, counters {counters}"
    )
    assert worker["calls"] >= 1, counters  # calls before the bound are kept
    assert counters.get("dropped_max_bytes", 0) >= 1, counters
    assert counters.get("recorder_seen", 0) > worker["calls"], counters
    assert worker["layer_names"] == ["model.layers.0.mlp.experts"], worker["layer_names"]
    assert worker["footer"], worker["recovery"]
    capture = tmp_path / "bound" / "captures" / worker["name"]
    assert capture.stat().st_size <= bound + 2**20, capture.stat().st_size  # the bound, plus footer and index


def test_graph_mode_serve_keeps_working_and_captures_eager_calls(gpt_oss_model: Path, tmp_path: Path) -> None:
    summary = _serve(gpt_oss_model, tmp_path / "graph", "graph")
    assert summary["requests"] >= 12 and summary["completion_tokens"] > 0
    assert any("CUDA graph" in line for line in summary["plugin_lines"]), summary["plugin_lines"]
    worker = _worker_file(summary)
    assert worker["ops"].get("matmul_ogs", 0) > 0
    assert all(item["footer"] for item in summary["files"])


def test_graph_mode_flight_trigger_at_a_decode_step_expands_bit_exactly(tmp_path: Path) -> None:
    """A gpt-oss model poisoned on one expert (reached only by the word "zebra"), served in CUDA-graph mode with
    the flight recorder armed; requests biased to emit "zebra" first make the fault appear at a decode step that
    vLLM replays from a graph. The trigger's file holds graph-replayed layer calls; ``moereplay expand`` (a fresh
    process, the kernel pack) re-runs every one of them bit-exactly, the bad one's non-finite values included.
    (The same steps as ``tools/gpu/flight_session.sh``, which ran on the H200 on 2026-12-04: 16/16 bit-exact.)"""
    reason = _serving_available()
    if reason:
        pytest.skip(reason)
    pack = os.environ.get("MOEREPLAY_PACK")
    if not pack:
        pytest.skip("needs MOEREPLAY_PACK (tools/gpu/device_setup.sh)")
    model = tmp_path / "gpt-oss-bad"
    subprocess.run(
        [sys.executable, str(MAKE_GPT_OSS), str(model), "--layers", "2", "--poison", "0:5"],
        check=True,
        timeout=300,
    )
    summary = _serve(model, tmp_path / "graph", "graph", "--capture", "flight", "--requests", "8",
                     "--fault-word", "zebra")  # fmt: skip
    assert summary["requests"] >= 8
    flight = _worker_file(summary)
    assert flight["cudagraph_modes"], flight
    capture = tmp_path / "graph" / "captures" / flight["name"]
    listing = subprocess.run(
        [sys.executable, "-m", "moereplay", "ls", str(capture), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listing.returncode == 0, listing.stderr[-2000:]
    rows = json.loads(listing.stdout)
    first = next(i for i, row in enumerate(rows) if row["context"].get("flight", {}).get("trigger"))
    assert rows[first]["context"].get("cudagraph") is True, rows[first]["context"]
    calls = [argument for row in rows[: first + 1] for argument in ("--call", str(row["index"]))]
    report = tmp_path / "expand.json"
    expand = subprocess.run(
        [sys.executable, "-m", "moereplay", "expand", str(capture), "-o", str(tmp_path / "expanded.moe.zst"),
         *calls, "--backend", f"pack:{pack}", "--json-out", str(report)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    print(expand.stdout[-6000:])
    assert expand.returncode == 0, expand.stderr[-3000:]
    expanded = json.loads(report.read_text())["calls"]
    assert len(expanded) == first + 1
    assert all(call["verdict"] == "bit_exact" for call in expanded), [call["verdict"] for call in expanded]
    bad = expanded[-1]["outputs"][0]
    assert bad["recorded_nonfinite"] > 0 and bad["rerun_nonfinite"] == bad["recorded_nonfinite"]
