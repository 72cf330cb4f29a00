"""``moereplay run --ray``: calls × variants on a local Ray cluster (CPU workers, pure-torch toy kernels).

Skipped where Ray is not installed (it is the optional extra ``moereplay[ray]``; the default CI installs ``.[dev]``).
One local cluster serves the module (~5 s to start).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import replay_toy as toy
from typer.testing import CliRunner

from moereplay.cli import app

ray = pytest.importorskip("ray")

runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(num_cpus=3, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


def _capture(tmp_path: Path, block: int = 2) -> Path:
    args = toy.make_args()
    args["block"] = block
    return toy.write_capture(tmp_path / "toy.moe.zst", args)


def _verdicts(output: str) -> dict[str, str]:
    (report,) = json.loads(output)["reports"]
    return {item["label"]: item["verdict"] for item in report["results"]}


def test_a_ray_sweep_reports_what_a_serial_run_reports(tmp_path: Path) -> None:
    path = _capture(tmp_path)
    args = ["run", str(path), "--all", "--backend", toy.spec("neighbour"), "--device", "cpu", "--json"]
    args += ["--sweep", "block=2,4", "--flip", "mul_weights"]
    serial = runner.invoke(app, args)
    on_ray = runner.invoke(app, [*args, "--ray"])
    assert on_ray.exit_code == serial.exit_code == 1, on_ray.output
    assert _verdicts(on_ray.stdout) == _verdicts(serial.stdout)
    assert {"recorded", "baseline", "set block=2", "set block=4", "flip mul_weights"} <= set(
        _verdicts(on_ray.stdout)
    )
    assert "moereplay: ray 4/4" in on_ray.stderr


def test_a_worker_that_dies_costs_its_variant_not_the_sweep(tmp_path: Path) -> None:
    path = _capture(tmp_path)
    args = ["run", str(path), "--call", "0", "--backend", toy.spec("crash"), "--device", "cpu", "--json"]
    result = runner.invoke(
        app, [*args, "--sweep", "block=1,4", "--ray"]
    )  # block=1: the kernel calls os._exit
    assert result.exit_code == 1, result.output
    verdicts = _verdicts(result.stdout)
    assert verdicts["set block=1"] == "crash"
    assert verdicts["baseline"] == "ok" and verdicts["set block=4"] == "ok"
    (report,) = json.loads(result.stdout)["reports"]
    crashed = next(item for item in report["results"] if item["label"] == "set block=1")
    assert "Ray worker died" in crashed["reason"]


def test_bad_input_is_one_line_before_anything_runs(tmp_path: Path) -> None:
    from moereplay.errors import InvalidMutationError
    from moereplay.replay.ray_sweep import plan_units

    with pytest.raises(InvalidMutationError):
        plan_units(_capture(tmp_path), [0], ["set nosuchargument=1"], {})
