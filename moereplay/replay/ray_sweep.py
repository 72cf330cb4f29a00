"""Replay sweeps on a Ray cluster: calls × variants fanned out to a pool of Ray workers, one GPU each (or a fraction).

``moereplay run FILE --all --ray [ADDRESS]`` splits the sweep into units: per call, one *baseline unit* (the
recorded row, the baseline, the guard fills the evidence calls for, the fidelity explanation — what a plain
``replay()`` of the call does) and one unit per variant (``parse_variants`` expands sweeps here, on the driver). The
units run on a pool of Ray *actors*, one per worker slot the cluster holds (:func:`pool_size`): each is one long-lived
process that imports torch, loads the backend and sets up CUDA once, then runs units one at a time — the driver
hands an actor its next unit as soon as it returns one, so a 1,000-variant sweep starts a handful of processes, not
1,000 (a Ray *task* that asks for a GPU gets a fresh process per call). A unit opens the capture file by path and
loads only its call's tensors (the reader's index: other calls' blobs are never read), replays with the kernel in the
actor itself (the actor *is* the isolation: no extra subprocess), and returns the typed report. No capture data
travels through Ray — only the path, the call index and the variant; what comes back is the report (verdicts,
statistics, findings), not tensors. On a cluster of several machines the file must be at the same path on every node
(a shared filesystem).

Results stream back as units finish (``progress`` is called per unit) and are merged into one
:class:`~moereplay.replay.results.ReplayReport` per call, in the order a serial run lists them: the baseline unit's
rows and findings, then each variant's row and the findings about it. A variant unit judges its variant beside its
own replay of the baseline (a kernel's verdict depends on it), so a sweep runs each call's baseline once per unit;
findings that set variants beside each other (which variants fix a failing baseline) are not made across units.

A device fault (an illegal memory access) does not end the process that ran it: it leaves the CUDA context unusable
(a sticky error), and every later unit there would fail and be blamed wrongly. So after each unit the actor says
whether its context still works (:func:`context_poisoned`; a unit with a ``crash`` row counts as poisoned whatever
the context answers); a poisoned actor is killed and a fresh one takes its
slot, and the unit keeps its own report (the engine has already made the fault that variant's ``crash`` row). Units
are never retried: an actor that dies mid-unit (``os._exit``, a segfault), or whose unit raises, costs that unit,
which becomes a ``crash`` row with Ray's reason; a fresh actor takes the slot and the sweep goes on. Every actor is
killed when the sweep ends, also when it ends by an exception or Ctrl-C.

Without an address a local Ray cluster is started (CPU workers, and GPU workers where this machine has GPUs);
``ray`` is an optional dependency (``pip install 'moereplay[ray]'``) imported only here, only when used.
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from moereplay.errors import SettingsError
from moereplay.replay.mutations import Variant
from moereplay.replay.results import ReplayReport, VariantResult, Verdict


@dataclass(frozen=True)
class SweepUnit:
    """One unit of a Ray sweep: a call's baseline unit (``variant`` None) or one of its variants."""

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


def pool_size(
    resources: Mapping[str, float],
    gpus_per_task: float,
    cpus_per_task: float,
    units: int,
    workers: int | None = None,
) -> int:
    """How many actors a sweep of ``units`` starts on a cluster of ``resources`` (``GPU``, ``CPU`` …): the slots
    the cluster holds — for every resource a unit asks for, how many times it fits (GPUs / ``gpus_per_task``, CPUs /
    ``cpus_per_task``), the fewest of those — at least 1, at most ``units`` and at most ``workers`` when given.

    The sweep passes the cluster's totals, not what is free this instant: Ray's count of free resources lags (the
    actors of a sweep that has just ended still hold theirs for a moment), and an actor that waits for resources
    held elsewhere costs nothing — only started actors are given units."""
    asks = {"GPU": gpus_per_task, "CPU": cpus_per_task}
    fits = [int(resources.get(name, 0.0) / each + 1e-9) for name, each in asks.items() if each > 0]
    slots = min(fits) if fits else units
    if workers is not None:
        slots = min(slots, workers)
    return max(1, min(slots, units))


def context_poisoned() -> bool:
    """Whether this process's CUDA context is unusable after a unit (a device fault's sticky error: every later CUDA
    call fails). Asked only where torch is imported and CUDA initialised — it never sets CUDA up to answer; a
    context that is fine costs one ``torch.cuda.synchronize()``. The actor looks it up by name after every unit (a
    test can stand in for it)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return False
    try:
        torch.cuda.synchronize()
    except Exception:  # the sticky error of a device fault
        return True
    return False


class UnitWorker:
    """One worker slot of a sweep: a Ray actor (one process) that runs units one at a time with ``runner``."""

    def __init__(self, runner: UnitRunner) -> None:
        self.runner = runner

    def ready(self) -> bool:
        """Answered once the actor has started (the driver feeds only started actors)."""
        return True

    def run(self, unit: SweepUnit) -> tuple[ReplayReport, bool]:
        """The unit's report, and whether this process's CUDA context is poisoned after it."""
        report = self.runner(unit)
        # a kernel that crashed in this process leaves it suspect even where the context still answers
        crashed = any(row.verdict is Verdict.CRASH for row in (report.baseline, *report.variants))
        return report, crashed or context_poisoned()


def sweep(
    units: Sequence[SweepUnit],
    *,
    address: str | None = None,
    gpus_per_task: float = 0.0,
    cpus_per_task: float = 1.0,
    runner: UnitRunner = run_unit,
    progress: Callable[[SweepUnit, VariantResult | None, int, int], None] | None = None,
    workers: int | None = None,
) -> list[ReplayReport]:
    """Run ``units`` on Ray; one merged report per call, in the order the calls first appear in ``units``.

    ``workers`` caps the pool (default: as many actors as the cluster holds, :func:`pool_size`)."""
    if workers is not None and workers < 1:
        raise SettingsError(f"a Ray sweep needs at least one worker, not {workers}")
    with contextlib.redirect_stdout(sys.stderr):  # Ray reports dead workers on stdout; stdout holds results
        return _sweep(units, address, gpus_per_task, cpus_per_task, runner, progress, workers)


class _Pool:
    """The sweep's actors, one per slot (``None``: the slot is empty). Every actor is killed by :meth:`close`."""

    def __init__(self, ray: Any, runner: UnitRunner, gpus_per_task: float, cpus_per_task: float) -> None:
        self.ray = ray
        self.runner = runner
        self.actor_class = ray.remote(UnitWorker).options(
            num_gpus=gpus_per_task, num_cpus=cpus_per_task, max_restarts=0, max_task_retries=0
        )
        self.actors: list[Any] = []

    def start(self, slot: int) -> Any:
        """A fresh actor in ``slot``; returns the reference its readiness answers on."""
        actor = self.actor_class.remote(self.runner)
        if slot == len(self.actors):
            self.actors.append(actor)
        else:
            self.actors[slot] = actor
        return actor.ready.remote()

    def kill(self, slot: int) -> None:
        actor, self.actors[slot] = self.actors[slot], None
        if actor is not None:
            with contextlib.suppress(Exception):  # already dead: nothing to kill
                self.ray.kill(actor, no_restart=True)

    def close(self) -> None:
        for slot in range(len(self.actors)):
            self.kill(slot)


def _sweep(
    units: Sequence[SweepUnit],
    address: str | None,
    gpus_per_task: float,
    cpus_per_task: float,
    runner: UnitRunner,
    progress: Callable[[SweepUnit, VariantResult | None, int, int], None] | None,
    workers: int | None,
) -> list[ReplayReport]:
    ray = connect(address)
    finished: dict[int, ReplayReport | str] = {}
    state = _Progress()

    def record(position: int, outcome: ReplayReport | str) -> None:
        finished[position] = outcome
        state.done += 1
        state.crashed += isinstance(outcome, str)
        if progress is not None:
            unit = units[position]
            row = None if isinstance(outcome, str) else _unit_row(unit, outcome)
            progress(unit, row, state.done, len(units))

    queue = deque(range(len(units)))
    resources = ray.cluster_resources()
    slots = pool_size(resources, gpus_per_task, cpus_per_task, len(units), workers) if units else 0
    pool = _Pool(ray, runner, gpus_per_task, cpus_per_task)
    # a reference Ray answers on -> (slot, unit position; None: the actor's readiness)
    pending: dict[Any, tuple[int, int | None]] = {}
    start_failure = ""
    try:
        for slot in range(slots):
            pending[pool.start(slot)] = (slot, None)
        # until every unit has its outcome: once none is queued or running, actors still waiting to be placed
        # (the pool is sized from the cluster's totals; another job may hold some) are not waited for
        while pending and (queue or any(position is not None for _, position in pending.values())):
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            slot, position = pending.pop(ref)
            if position is None:  # an actor has started, or could not start
                try:
                    ray.get(ref)
                except Exception as error:  # its slot stays empty; the other slots go on
                    start_failure = _crash_reason(error)
                    pool.kill(slot)
                    continue
            else:
                try:
                    report, poisoned = ray.get(ref)
                    outcome: ReplayReport | str = report
                except Exception as error:  # the actor died mid-unit (or the runner raised): a crash row
                    outcome, poisoned = _crash_reason(error), True
                record(position, outcome)
                if poisoned:  # its process is dead or its CUDA context unusable: a fresh actor takes the slot
                    pool.kill(slot)
                    if queue:
                        pending[pool.start(slot)] = (slot, None)
                    continue
            if queue:
                position = queue.popleft()
                pending[pool.actors[slot].run.remote(units[position])] = (slot, position)
        while queue:  # every slot lost its actor at start-up
            record(queue.popleft(), f"no Ray worker could start: {start_failure}")
    finally:
        pool.close()
    return _merge(units, finished)


def _crash_reason(error: BaseException) -> str:
    name = type(error).__name__
    plain = re.sub(r"\x1b\[[0-9;]*m", "", str(error))  # Ray colours names in its messages
    text = plain.strip().splitlines()
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
                notes.append(f"{unit.variant.label}: its Ray worker failed ({outcome}); the sweep went on")
                continue
            variants.extend(outcome.variants)
            findings.extend(f for f in outcome.findings if f.variant != "baseline")
        reports.append(
            replace(report, variants=tuple(variants), findings=tuple(findings), notes=tuple(notes))
        )
    return reports
