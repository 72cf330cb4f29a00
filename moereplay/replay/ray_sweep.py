"""Replay sweeps on a Ray cluster: calls × variants fanned out to Ray workers, one GPU each (or a fraction).

``moereplay run FILE --all --ray [ADDRESS]`` splits the sweep into units: per call, one *baseline unit* (the
recorded row, the baseline, the guard fills the evidence calls for, the fidelity explanation — what a plain
``replay()`` of the call does) and one unit per variant (``parse_variants`` expands sweeps here, on the driver). Each
unit is one Ray task that opens the capture file by path and loads only its call's tensors (the reader's index:
other calls' blobs are never read), replays with the kernel in the Ray worker itself (the worker *is* the isolation:
no extra subprocess), and returns the typed report. No capture data travels through Ray — only the path, the call
index and the variant; what comes back is the report (verdicts, statistics, findings), not tensors. On a cluster of
several machines the file must be at the same path on every node (a shared filesystem).

Results stream back as tasks finish (``progress`` is called per unit) and are merged into one
:class:`~moereplay.replay.results.ReplayReport` per call, in the order a serial run lists them: the baseline unit's
rows and findings, then each variant's row and the findings about it. A variant unit judges its variant beside its
own replay of the baseline (a kernel's verdict depends on it), so a sweep runs each call's baseline once per unit;
findings that set variants beside each other (which variants fix a failing baseline) are not made across units.
Tasks are never retried: a worker that dies (an illegal memory access kills the CUDA context; ``os._exit``) costs
its unit, which becomes a ``crash`` row with Ray's reason, and the sweep goes on.

Without an address a local Ray cluster is started (CPU workers, and GPU workers where this machine has GPUs);
``ray`` is an optional dependency (``pip install 'moereplay[ray]'``) imported only here, only when used.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from moereplay.errors import SettingsError
from moereplay.replay.mutations import Variant
from moereplay.replay.results import ReplayReport, VariantResult, Verdict


@dataclass(frozen=True)
class SweepUnit:
    """One Ray task: a call's baseline unit (``variant`` None) or one of its variants."""

    path: str
    call: int
    variant: Variant | None
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def label(self) -> str:
        return "baseline" if self.variant is None else self.variant.label


UnitRunner = Callable[[SweepUnit], ReplayReport]


def run_unit(unit: SweepUnit) -> ReplayReport:
    """What a Ray worker runs for one unit (also callable in-process: the tests compare both)."""
    from moereplay.replay.engine import replay

    options = dict(unit.options)
    if unit.variant is not None:  # the evidence and fidelity follow-ups belong to the baseline unit
        options.update(follow_evidence=False, explain_fidelity=False, follow_suggestions=False)
    return replay(
        unit.path,
        call=unit.call,
        mutations=[] if unit.variant is None else [unit.variant],
        isolate=False,
        reuse_worker=False,
        **options,
    )


def plan_units(
    path: str | Path, calls: Sequence[int], mutations: Sequence[str], options: dict[str, Any]
) -> list[SweepUnit]:
    """Every unit of the sweep; malformed mutations raise here, before anything is sent to the cluster."""
    from moereplay.format.reader import CaptureReader
    from moereplay.ops import get_op
    from moereplay.replay.mutations import parse_variants

    units: list[SweepUnit] = []
    with CaptureReader(path) as reader:
        for call in calls:
            op = get_op(reader.call(call).op)
            units.append(SweepUnit(str(path), call, None, options))
            units.extend(
                SweepUnit(str(path), call, variant, options) for variant in parse_variants(op, mutations)
            )
    return units


@dataclass
class _Progress:
    done: int = 0
    crashed: int = 0
    started: float = field(default_factory=time.perf_counter)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise SettingsError("--ray needs Ray: pip install 'moereplay[ray]'") from error
    return ray


def connect(address: str | None, *, num_cpus: int | None = None) -> Any:
    """Join the cluster at ``address`` ("auto": the one this machine belongs to), or start a local one."""
    ray = _import_ray()
    if ray.is_initialized():
        return ray
    try:
        if address:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise SettingsError(f"--ray {address or '(local)'}: cannot connect: {reason}") from error
    return ray


def sweep(
    units: Sequence[SweepUnit],
    *,
    address: str | None = None,
    gpus_per_task: float = 0.0,
    cpus_per_task: float = 1.0,
    runner: UnitRunner = run_unit,
    progress: Callable[[SweepUnit, VariantResult | None, int, int], None] | None = None,
) -> list[ReplayReport]:
    """Run ``units`` on Ray; one merged report per call, in the order the calls first appear in ``units``."""
    with contextlib.redirect_stdout(sys.stderr):  # Ray reports dead workers on stdout; stdout holds results
        return _sweep(units, address, gpus_per_task, cpus_per_task, runner, progress)


def _sweep(
    units: Sequence[SweepUnit],
    address: str | None,
    gpus_per_task: float,
    cpus_per_task: float,
    runner: UnitRunner,
    progress: Callable[[SweepUnit, VariantResult | None, int, int], None] | None,
) -> list[ReplayReport]:
    ray = connect(address)
    remote = ray.remote(_execute).options(num_gpus=gpus_per_task, num_cpus=cpus_per_task, max_retries=0)
    pending = {remote.remote(runner, unit): position for position, unit in enumerate(units)}
    finished: dict[int, ReplayReport | str] = {}
    state = _Progress()
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            position = pending.pop(ref)
            unit = units[position]
            try:
                outcome: ReplayReport | str = ray.get(ref)
            except Exception as error:  # the worker died (or raised): this unit is a crash, the sweep goes on
                outcome = _crash_reason(error)
                state.crashed += 1
            finished[position] = outcome
            state.done += 1
            if progress is not None:
                row = None if isinstance(outcome, str) else _unit_row(unit, outcome)
                progress(unit, row, state.done, len(units))
    return _merge(units, finished)


def _execute(runner: UnitRunner, unit: SweepUnit) -> ReplayReport:
    return runner(unit)


def _crash_reason(error: BaseException) -> str:
    name = type(error).__name__
    text = str(error).strip().splitlines()
    detail = next((line.strip() for line in text if line.strip()), "")
    if "WorkerCrashed" in name or "died" in detail.lower() or "exited" in detail.lower():
        return f"the Ray worker died ({name}): {detail[:200]}"
    return f"{name}: {detail[:200]}"


def _unit_row(unit: SweepUnit, report: ReplayReport) -> VariantResult:
    if unit.variant is None:
        return report.baseline
    for result in report.variants:
        if result.label == unit.variant.label:
            return result
    return report.baseline


def _crash_row(label: str, mutations: tuple[str, ...], reason: str) -> VariantResult:
    return VariantResult(label=label, mutations=mutations, verdict=Verdict.CRASH, reason=reason)


def _merge(units: Sequence[SweepUnit], finished: dict[int, ReplayReport | str]) -> list[ReplayReport]:
    by_call: dict[int, list[int]] = {}
    for position, unit in enumerate(units):
        by_call.setdefault(unit.call, []).append(position)
    reports = []
    for call, members in by_call.items():
        base_position = next((p for p in members if units[p].variant is None), None)
        base = finished.get(base_position) if base_position is not None else None
        if isinstance(base, ReplayReport):
            report = base
        else:
            template = next((finished[u] for u in members if isinstance(finished.get(u), ReplayReport)), None)
            reason = base if isinstance(base, str) else "no baseline unit"
            report = ReplayReport(
                op=template.op if isinstance(template, ReplayReport) else "?",
                call=call,
                backend=template.backend if isinstance(template, ReplayReport) else "?",
                device=template.device if isinstance(template, ReplayReport) else "?",
                baseline=_crash_row("baseline", (), reason),
                site=template.site if isinstance(template, ReplayReport) else "",
            )
        variants = list(report.variants)
        findings = list(report.findings)
        notes = list(report.notes)
        for position in members:
            unit = units[position]
            if unit.variant is None:
                continue
            outcome = finished[position]
            if isinstance(outcome, str):
                variants.append(_crash_row(unit.variant.label, unit.variant.specs, outcome))
                notes.append(f"{unit.variant.label}: its Ray task failed ({outcome}); the sweep went on")
                continue
            variants.extend(outcome.variants)
            findings.extend(f for f in outcome.findings if f.variant != "baseline")
        reports.append(
            replace(report, variants=tuple(variants), findings=tuple(findings), notes=tuple(notes))
        )
    return reports
