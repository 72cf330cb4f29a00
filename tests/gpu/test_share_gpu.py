"""Share and explore on the H200: every example capture replays with the verdicts it was recorded with, the layer's
layout probe says what it said, and the failing Marlin call's repro runs standalone with the pack.

Run on the GPU machine after the prelude::

    source tools/gpu/device_setup.sh && python3 -m pytest tests/gpu/test_share_gpu.py -q -rA -s

The captures and their recorded verdicts come from ``tools/gpu/make_captures.py`` (``manifest.json`` beside them):
``$MOEREPLAY_CAPTURES`` when set, else the repository's ``captures/`` when it holds a ``manifest.json``, else they are
made now into a temporary directory (a few minutes: the Marlin modules JIT from PTX on a cold cache). Tables,
findings and the repro's output are printed (``-s``) so they can be pasted into the issue.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # pragma: no cover - the gpu conftest skips these anyway
    pytest.skip("needs CUDA", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "make_captures", REPO / "tools" / "gpu" / "make_captures.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


make_captures = _tool()


def _backend() -> tuple[str, str | None]:
    pack = os.environ.get("MOEREPLAY_PACK")
    if pack and Path(pack).exists():
        return f"pack:{pack}", pack
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs a vLLM 0.25.1 kernel pack ($MOEREPLAY_PACK) or an installed vLLM")
    return "vllm", None


BACKEND, PACK = _backend()


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """(directory, manifest) of the example captures."""
    for candidate in (os.environ.get("MOEREPLAY_CAPTURES"), str(REPO / "captures")):
        if candidate and (Path(candidate) / "manifest.json").is_file():
            directory = Path(candidate)
            break
    else:
        directory = tmp_path_factory.mktemp("captures")
        argv = ["--out", str(directory), "--backend", BACKEND]
        if PACK:
            argv += ["--pack", PACK]
        assert make_captures.main(argv) == 0, "make_captures failed or made files over the size limits"
    manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["captures"], "the manifest lists no capture"
    return directory, manifest


def show(report: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from moereplay.cli.run_cmd import render_reports

    with capsys.disabled():
        print()
        render_reports([report])


def test_captures_are_small_and_unchanged(made: tuple[Path, dict[str, Any]]) -> None:
    directory, manifest = made
    sizes = {}
    for entry in manifest["captures"]:
        path = directory / entry["file"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"], entry["file"]
        sizes[entry["file"]] = path.stat().st_size
        assert sizes[entry["file"]] <= make_captures.MAX_FILE_BYTES, entry["file"]
    assert sum(sizes.values()) <= make_captures.MAX_TOTAL_BYTES, sizes
    assert {e["file"] for e in manifest["captures"]} >= {f"{s.name}.moe.zst" for s in make_captures.CAPTURES}


def test_every_capture_replays_with_its_recorded_verdicts(
    made: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    import moereplay.synth  # noqa: F401 - recipes expand in this process
    from moereplay.replay import replay

    directory, manifest = made
    isolate = make_captures._isolate()
    differences = []
    for entry in manifest["captures"]:
        for index, recorded in entry["calls"].items():
            report = replay(
                directory / entry["file"],
                call=int(index),
                backend=BACKEND,
                mutations=entry["mutations"],
                fills=entry["fills"],
                isolate=isolate,
            )
            show(report, capsys)
            verdicts = {result.label: result.verdict.value for result in report.results}
            if verdicts != recorded["verdicts"]:
                differences.append(
                    f"{entry['file']} call {index}: {verdicts} != recorded {recorded['verdicts']}"
                )
            if report.baseline.bit_exact is not True:
                differences.append(
                    f"{entry['file']} call {index}: the replayed output is not the captured one"
                )
    assert not differences, "\n".join(differences)


def test_offline_verdicts_are_the_recorded_ones(made: tuple[Path, dict[str, Any]]) -> None:
    from moereplay.replay import replay

    directory, manifest = made
    for entry in manifest["captures"]:
        for index, recorded in entry["offline"].items():
            report = replay(
                directory / entry["file"], call=int(index), backend="reference", mutations=entry["mutations"]
            )
            verdicts = {result.label: result.verdict.value for result in report.results}
            assert verdicts == recorded["verdicts"], (entry["file"], index)


def test_the_failing_marlin_call_fails_and_the_correct_one_does_not(
    made: tuple[Path, dict[str, Any]],
) -> None:
    _, manifest = made
    by_file = {entry["file"]: entry for entry in manifest["captures"]}
    report_case = by_file["marlin-nvfp4-report.moe.zst"]["calls"]["0"]["verdicts"]
    assert report_case["baseline"] != "ok" and report_case["cast topk_weights=float32"] == "ok"
    correct = by_file["marlin-nvfp4-gpt-oss-gemm1.moe.zst"]["calls"]["0"]["verdicts"]
    assert set(correct.values()) == {"ok"}


def test_the_layer_layout_probe(
    made: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    from moereplay.layout import probe_layout

    directory, manifest = made
    entry = next(e for e in manifest["captures"] if "layout" in e)
    report = probe_layout(directory / entry["file"], 0)
    with capsys.disabled():
        print(f"\nlayout probe of {entry['file']}: {report.verdict.value}")
        for hypothesis in report.hypotheses:
            print(
                f"  {hypothesis.layout.value:15s} step rms {hypothesis.step_rms_rel:.2e} layer rms {hypothesis.layer_rms_rel:.2e}"
            )
        for message in report.messages:
            print(f"  {message}")
    assert report.verdict.value == entry["layout"]["verdict"]
    assert report.consumed is not None and report.consumed.value == entry["layout"]["consumed"]


def test_the_repro_runs_standalone_with_the_pack(
    made: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No repository and no installed moereplay on the path: only the pack's site (vLLM, its wheels, zstandard)."""
    from moereplay.repro import export_repro

    directory, manifest = made
    entry = next(e for e in manifest["captures"] if e["file"] == "marlin-nvfp4-report.moe.zst")
    bundle = export_repro(
        directory / entry["file"], 0, tmp_path / "repro", mutations=entry["mutations"], fills=entry["fills"]
    )
    if PACK:
        from moereplay.pack.load import unpack_pack

        paths = [str(path) for path in unpack_pack(Path(PACK)).paths]
        argv = [sys.executable, str(bundle.script), "--pack", PACK]
    else:
        paths = [
            p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO
        ]
        argv = [sys.executable, str(bundle.script), "--backend", "vllm"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800, check=False
    )
    with capsys.disabled():
        print(f"\n$ {' '.join(argv)}\n{done.stdout}{done.stderr}")
    assert done.returncode == 1, done.stderr  # the call as captured is not ok
    assert f"from {bundle.directory / 'support' / 'moereplay'}" in done.stdout
    recorded = entry["calls"]["0"]["verdicts"]
    for label, verdict in recorded.items():
        row = next(line for line in done.stdout.splitlines() if line.startswith(label + " "))
        assert f" {verdict} " in row, (label, row)
    assert "findings" in done.stdout
