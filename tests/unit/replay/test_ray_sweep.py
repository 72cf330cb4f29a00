"""``moereplay run --ray``: calls × variants on a local Ray cluster (CPU workers, pure-torch toy kernels).

Skipped where Ray is not installed (it is the optional extra ``moereplay[ray]``; the default CI installs ``.[dev]``).
One local cluster serves the module (~5 s to start). Which worker process ran a unit is observed through a runner
that wraps the real :func:`~moereplay.replay.ray_sweep.run_unit` and leaves a file ``LABEL@PID`` in a folder before
the unit runs (the worker may die in it).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import replay_toy as toy
from typer.testing import CliRunner

from moereplay.cli import app
from moereplay.replay.ray_sweep import SweepUnit, context_poisoned, plan_units, pool_size, run_unit, sweep
from moereplay.replay.results import ReplayReport

ray = pytest.importorskip("ray")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module

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

    with pytest.raises(InvalidMutationError):
        plan_units(_capture(tmp_path), [0], ["set nosuchargument=1"], {})


@dataclass(frozen=True)
class _Where:
    """Runs the unit as a worker does, after leaving ``LABEL@PID`` in ``folder``; after the unit labelled
    ``poison`` it makes its process's CUDA-context check say "poisoned" (what a device fault leaves behind)."""

    folder: str
    poison: str = ""

    def __call__(self, unit: SweepUnit) -> ReplayReport:
        (Path(self.folder) / f"{unit.label}@{os.getpid()}").touch()
        report = run_unit(unit)
        if unit.label == self.poison:
            from moereplay.replay import ray_sweep

            ray_sweep.context_poisoned = lambda: True  # this process only: the driver must replace it
        return report


def _folder(tmp_path: Path, name: str = "where") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    return folder


def _pids(folder: Path) -> dict[str, int]:
    """Unit label -> the pid of the worker process that ran it."""
    return {name.rpartition("@")[0]: int(name.rpartition("@")[2]) for name in os.listdir(folder)}


def _units(tmp_path: Path, kernel: str, mutations: list[str]) -> list[SweepUnit]:
    options = {"backend": toy.spec(kernel), "device": "cpu"}
    return plan_units(_capture(tmp_path), [0], mutations, options)


def _sweep_verdicts(reports: list[ReplayReport]) -> dict[str, str]:
    (report,) = reports
    return {row.label: row.verdict.value for row in (report.baseline, *report.variants)}


MUTATIONS = ["fill 0xff", "fill 0x00", "fill 0xfe", "set block=4", "flip mul_weights"]


def test_workers_are_reused_across_units(tmp_path: Path) -> None:
    units = _units(tmp_path, "correct", MUTATIONS)
    one, many = _folder(tmp_path, "one"), _folder(tmp_path, "many")
    single = sweep(units, runner=_Where(str(one)), workers=1)
    assert set(_pids(one)) == {unit.label for unit in units}
    assert len(set(_pids(one).values())) == 1  # six units, one process
    pooled = sweep(units, runner=_Where(str(many)))  # as many workers as the cluster holds: 3 CPUs
    assert 1 <= len(set(_pids(many).values())) <= 3 < len(units)
    assert _sweep_verdicts(single) == _sweep_verdicts(pooled)
    assert set(_sweep_verdicts(single).values()) == {"ok"}


def test_a_poisoned_worker_is_replaced_and_its_unit_keeps_its_row(tmp_path: Path) -> None:
    units = _units(tmp_path, "correct", ["fill 0xff", "set block=4", "flip mul_weights"])
    labels = [unit.label for unit in units]
    assert labels == ["baseline", "fill 0xff", "set block=4", "flip mul_weights"]
    seen: list[tuple[str, str]] = []
    where = _folder(tmp_path)
    reports = sweep(
        units,
        runner=_Where(str(where), poison="fill 0xff"),
        workers=1,
        progress=lambda unit, row, done, total: seen.append((unit.label, "crash" if row is None else "row")),
    )
    pids = _pids(where)
    assert pids["baseline"] == pids["fill 0xff"]  # one worker, reused until it reported poisoned
    assert pids["set block=4"] == pids["flip mul_weights"] != pids["fill 0xff"]  # then a fresh one
    assert seen == [(label, "row") for label in labels]
    assert _sweep_verdicts(reports)["fill 0xff"] == "ok"  # the poisoned unit's own report, not a crash row


def test_a_dead_worker_is_replaced_and_the_units_after_it_run(tmp_path: Path) -> None:
    units = _units(tmp_path, "crash", ["set block=1", "set block=4"])  # block=1: the kernel calls os._exit
    where = _folder(tmp_path)
    reports = sweep(units, runner=_Where(str(where)), workers=1)
    verdicts = _sweep_verdicts(reports)
    assert verdicts == {"baseline": "ok", "set block=1": "crash", "set block=4": "ok"}
    (report,) = reports
    crashed = next(row for row in report.variants if row.label == "set block=1")
    assert "the Ray worker died" in crashed.reason
    pids = _pids(where)
    assert pids["baseline"] == pids["set block=1"] != pids["set block=4"]


def test_the_pool_is_as_large_as_the_cluster_holds() -> None:
    gpus = {"GPU": 8.0, "CPU": 64.0}
    assert pool_size(gpus, 1.0, 1.0, 1000) == 8
    assert pool_size(gpus, 0.5, 1.0, 1000) == 16
    assert pool_size(gpus, 0.25, 2.0, 1000) == 32  # CPUs bound it too
    assert pool_size(gpus, 0.1, 1.0, 1000) == 64
    assert pool_size({"CPU": 3.0}, 0.0, 1.0, 1000) == 3
    assert pool_size(gpus, 1.0, 1.0, 1000, workers=2) == 2
    assert pool_size(gpus, 1.0, 1.0, 5) == 5
    assert pool_size({"CPU": 4.0}, 1.0, 1.0, 10) == 1  # no GPU here: one actor waits for one
    assert pool_size({"CPU": 4.0}, 0.0, 0.0, 10) == 10


def test_the_context_check_never_sets_up_cuda() -> None:
    import torch

    assert context_poisoned() is False
    assert not torch.cuda.is_initialized()


@ray.remote(num_cpus=2)
class _Holder:
    """Another job's actor, holding two of the cluster's three CPUs."""

    def ready(self) -> bool:
        return True


def test_a_sweep_ends_when_its_units_are_done_though_some_workers_never_started(tmp_path: Path) -> None:
    import threading

    holder = _Holder.remote()
    ray.get(holder.ready.remote())
    try:
        units = _units(tmp_path, "correct", ["fill 0xff", "flip mul_weights"])
        finished: list[list[ReplayReport]] = []
        # the pool is sized from the cluster's totals (3 slots); only one actor can be placed while the holder lives
        worker = threading.Thread(
            target=lambda: finished.append(sweep(units, cpus_per_task=1.0)), daemon=True
        )
        worker.start()
        worker.join(timeout=120)  # liveness, not speed: before the fix the sweep never returned
        assert finished, "the sweep waited for workers that could never start"
        assert set(_sweep_verdicts(finished[0])) >= {"baseline", "fill 0xff", "flip mul_weights"}
    finally:
        ray.kill(holder)
