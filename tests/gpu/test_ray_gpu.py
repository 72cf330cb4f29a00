"""Replay sweeps on Ray over the GPUs: the kernel pack's Marlin MoE GEMM, and a genuine device fault.

Run on a machine with a GPU (the spread over GPUs needs two), after ``source tools/gpu/device_setup.sh`` (the kernel pack in
``$MOEREPLAY_PACK``; Ray installed: ``pip install 'moereplay[ray]'``)::

    python -m pytest tests/gpu/test_ray_gpu.py -q -rA -s

The capture is a small synthetic fp8 Marlin call (``synthesize("fp8-marlin", …, hidden=256, intermediate=128)``, as
``tools/bench/ray_sweep_bench.py`` makes it). Its serial run (``moereplay run`` without ``--ray``, the pack's kernel
in moereplay's own worker process) is the yardstick.

1. ``moereplay run CAP --all --ray --backend pack:$MOEREPLAY_PACK --json`` with a guard fill, a flag flip and a block
   size sweep gives the serial run's verdict for every label; ``sweep()`` on a local cluster of two GPUs, with a
   runner that is the real :func:`~moereplay.replay.ray_sweep.run_unit` (the real pack kernel) after noting which
   process and which GPU (Ray's ``CUDA_VISIBLE_DEVICES``) took the unit, gives them too — and its units ran on both
   GPUs, in fewer processes than units.
2. A real device fault: a ``python:`` backend (written here) that is the pack's GEMM, except that with
   ``use_atomic_add=True`` it first launches a one-thread Triton kernel that stores through a wild pointer — an
   illegal memory access, which leaves that process's CUDA context unusable. On one worker slot, that variant is a
   ``crash`` row, every other variant has the serial run's verdict, and the units after the fault ran in a fresh
   process.

The first Marlin launch on a fresh machine JIT-compiles the sm_80 PTX (about a minute; the driver caches it for
later processes): the serial run, first, pays it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # pragma: no cover - needs a GPU
    pytest.skip("needs CUDA", allow_module_level=True)
ray = pytest.importorskip("ray")
PACK = os.environ.get("MOEREPLAY_PACK", "")
if not PACK:  # pragma: no cover
    pytest.skip("needs a kernel pack: source tools/gpu/device_setup.sh", allow_module_level=True)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module

from moereplay.replay.ray_sweep import SweepUnit, plan_units, run_unit, sweep  # noqa: E402
from moereplay.replay.results import ReplayReport  # noqa: E402

CLI_TIMEOUT_S = 540
MUTATIONS = ["fill 0xff", "flip mul_topk_weights", "sweep moe_block_size=16,32"]
FAULT = "flip use_atomic_add"  # the faulting backend's trigger (the capture records use_atomic_add=False)


@dataclass(frozen=True)
class _Where:
    """The real :func:`run_unit`, after leaving a note in ``folder`` of the process and GPU that took the unit
    (before it runs: the process may die in it)."""

    folder: str

    def __call__(self, unit: SweepUnit) -> ReplayReport:
        note = {"label": unit.label, "pid": os.getpid(), "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
        (Path(self.folder) / f"{uuid.uuid4().hex}.json").write_text(json.dumps(note))
        return run_unit(unit)


def _notes(folder: Path) -> dict[str, dict[str, Any]]:
    """Unit label -> where it ran."""
    notes = (json.loads(path.read_text()) for path in folder.glob("*.json"))
    return {note["label"]: note for note in notes}


def _cli(*args: str) -> dict[str, str]:
    command = [sys.executable, "-m", "moereplay", "run", *args, "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False)
    assert result.returncode in (0, 1), result.stderr[-4000:]
    (report,) = json.loads(result.stdout)["reports"]
    return {item["label"]: item["verdict"] for item in report["results"]}


def _flags(mutations: list[str]) -> list[str]:
    """``["fill 0xff", …]`` as CLI options: ``["--fill", "0xff", …]``."""
    return [part for text in mutations for part in ("--" + text.split(" ", 1)[0], text.split(" ", 1)[1])]


def _verdicts(reports: list[ReplayReport]) -> dict[str, str]:
    (report,) = reports
    return {row.label: row.verdict.value for row in report.results}


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from moereplay.synth.build import synthesize

    path = tmp_path_factory.mktemp("ray-gpu") / "marlin.moe.zst"
    synthesize("fp8-marlin", path, overrides=["hidden=256", "intermediate=128"])
    return path


@pytest.fixture(scope="module")
def serial(capture: Path) -> dict[str, str]:
    """The serial run's verdict per label (the yardstick)."""
    verdicts = _cli(str(capture), "--all", "--backend", f"pack:{PACK}", *_flags(MUTATIONS))
    assert {"baseline", "fill 0xff", "flip mul_topk_weights", "set moe_block_size=32"} <= set(verdicts)
    assert verdicts["baseline"] == "ok", verdicts
    return verdicts


@pytest.fixture(scope="module")
def cluster(serial: dict[str, str]) -> Any:
    """A local cluster of two GPUs in this process (after the serial run: no two first JIT compiles at once)."""
    ray.init(num_gpus=2, num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


def test_the_cli_on_ray_reports_what_the_serial_run_reports(capture: Path, serial: dict[str, str]) -> None:
    on_ray = _cli(str(capture), "--all", "--ray", "--backend", f"pack:{PACK}", *_flags(MUTATIONS))
    assert on_ray == serial


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_units_spread_over_both_gpus_in_reused_workers(
    capture: Path, serial: dict[str, str], cluster: Any, tmp_path: Path
) -> None:
    more = ["fill 0x00", "fill 0xfe"]  # seven units for two workers
    units = plan_units(capture, [0], [*MUTATIONS, *more], {"backend": f"pack:{PACK}"})
    reports = sweep(units, gpus_per_task=1.0, runner=_Where(str(tmp_path)))
    verdicts = _verdicts(reports)
    assert {label: verdicts[label] for label in serial} == serial
    notes = _notes(tmp_path)
    assert set(notes) == {unit.label for unit in units}
    assert len({note["gpus"] for note in notes.values()}) == 2  # Ray's CUDA_VISIBLE_DEVICES: one GPU each
    assert len({note["pid"] for note in notes.values()}) < len(units)


FAULTING_BACKEND = '''"""The kernel pack's Marlin MoE GEMM, except that with use_atomic_add=True a one-thread Triton kernel first stores
through a wild pointer: a genuine illegal memory access (written by tests/gpu/test_ray_gpu.py)."""

import types

import torch
import triton
import triton.language as tl

from moereplay.pack import load_pack
from moereplay.replay.backends import ModuleBackend

PACK = PACK_DIR
WILD_ELEMENTS = 1 << 40  # float32 elements past a fresh allocation: 4 TiB away, nothing mapped there


@triton.jit
def wild_store(pointer, offset):
    tl.store(pointer + offset, 1.0)


def backend(device, name):
    pack = load_pack(PACK)
    real = pack.import_module("vllm._custom_ops")

    def moe_wna16_marlin_gemm(**kwargs):
        if kwargs["use_atomic_add"]:
            target = torch.zeros(1, dtype=torch.float32, device=device)
            wild_store[(1,)](target, WILD_ELEMENTS)
            torch.cuda.synchronize(device)  # raises: an illegal memory access was encountered
        return real.moe_wna16_marlin_gemm(**kwargs)

    ops = types.ModuleType("vllm._custom_ops")
    ops.__getattr__ = lambda attribute: getattr(real, attribute)
    ops.moe_wna16_marlin_gemm = moe_wna16_marlin_gemm
    def importer(module):
        return ops if module == ops.__name__ else pack.import_module(module)

    return ModuleBackend("faulting-marlin", torch.device(device), importer)
'''


def test_a_device_fault_costs_its_variant_and_a_fresh_worker_runs_the_rest(
    capture: Path, serial: dict[str, str], cluster: Any, tmp_path: Path
) -> None:
    pytest.importorskip("triton")
    stand_in = tmp_path / "faulting_marlin.py"
    stand_in.write_text(FAULTING_BACKEND.replace("PACK_DIR", repr(PACK)))
    folder = tmp_path / "where"
    folder.mkdir()
    mutations = [MUTATIONS[0], FAULT, *MUTATIONS[1:]]
    units = plan_units(capture, [0], mutations, {"backend": f"python:{stand_in}"})
    labels = [unit.label for unit in units]
    assert labels.index(FAULT) < len(labels) - 1  # units run after the fault, on the same (only) slot
    reports = sweep(units, gpus_per_task=1.0, runner=_Where(str(folder)), workers=1)
    verdicts = _verdicts(reports)
    (report,) = reports
    notes = _notes(folder)
    for row in (report.baseline, *report.variants):  # what each unit said, and where it ran
        print(
            f"{row.label}: {row.verdict.value} pid {notes.get(row.label, {}).get('pid')} {row.reason[:300]!r}"
        )
    faulted = next(row for row in report.variants if row.label == FAULT)
    assert faulted.verdict.value == "crash", faulted
    assert "illegal memory access" in faulted.reason or "Ray worker died" in faulted.reason, faulted.reason
    assert {label: verdicts[label] for label in serial} == serial  # the others, as the serial run judged them
    after = labels[labels.index(FAULT) + 1 :]
    assert notes["baseline"]["pid"] == notes[FAULT]["pid"]  # one worker, reused up to the fault
    assert {notes[label]["pid"] for label in after}.isdisjoint({notes[FAULT]["pid"]})  # then a fresh one
