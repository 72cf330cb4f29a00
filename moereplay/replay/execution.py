"""Run one variant's kernel call on fresh, guarded buffers, in this process.

Used directly for in-process replay and by the worker process (:mod:`moereplay.replay.worker`). Every repeat
starts from new scratch buffers (zeroed output and workspace, from ``op.make_scratch``) and new guarded copies of
every tensor — every tensor *leaf*, inside opaque arguments too, for ops with a ``tensor_leaves`` hook — so nothing
one run writes can leak into the next. With a :class:`~moereplay.replay.memory.BufferPool` the allocations are
reused but every byte is rewritten (guards re-filled, spans re-copied from the pristine arguments) before each run.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from moereplay.ops.base import Args, KernelBackend, OpSpec, replace_tensor_leaves, tensor_leaves
from moereplay.replay.memory import DEFAULT_GUARD_BYTES, BufferPool, GuardDamage, GuardWindow, materialise
from moereplay.replay.mutations import FillPattern

RunStatus = Literal["ran", "rejected", "crash"]

_CRASH_MARKERS = (
    "illegal memory access",
    "illegal address",
    "unspecified launch failure",
    "misaligned address",
    "an illegal instruction",
    "device-side assert",
    "CUDA error",
    "cudaErrorLaunch",
    "AcceleratorError",
)


@dataclass(frozen=True)
class KernelRun:
    """What running a variant's kernel produced.

    ``status``: ``ran``; ``rejected`` (the kernel's host code refused the call — a Python exception that left the
    device usable); ``crash`` (a device fault: the CUDA context is gone). ``outputs``: the output after each repeat,
    copied out of its guarded allocation. ``damage``: guard bytes written, over all repeats. ``phases``: seconds
    spent per phase of running it (``scratch``, ``materialise``, ``kernel``, ``check`` …; see
    :class:`~moereplay.replay.timing.PhaseTimes`). ``state``: the process state the last run used, as the op's
    ``run_state()`` hook reports it (plain JSON; empty when the op declares none).
    """

    status: RunStatus
    outputs: tuple[torch.Tensor, ...] = ()
    damage: tuple[GuardDamage, ...] = ()
    error: str = ""
    elapsed_s: float | None = None
    phases: Mapping[str, float] = field(default_factory=dict)
    state: Mapping[str, Any] = field(default_factory=dict)


def run_state(op: OpSpec) -> dict[str, Any]:
    """What the op's ``run_state()`` hook says its last run used (``{}`` without the hook)."""
    hook = getattr(op, "run_state", None)
    if hook is None:
        return {}
    return dict(hook() or {})


def classify_error(error: BaseException) -> RunStatus:
    """``crash`` for device faults (the context cannot be trusted afterwards), ``rejected`` otherwise."""
    text = f"{type(error).__name__}: {error}"
    return "crash" if any(marker in text for marker in _CRASH_MARKERS) else "rejected"


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    message = next(
        (line for line in text if line.strip() and not line.startswith("Exception raised from")), ""
    )
    return f"{type(error).__name__}: {message}"[:400]


def execute(
    op: OpSpec,
    args: Args,
    backend: KernelBackend,
    *,
    fill: FillPattern,
    fills: Mapping[str, FillPattern] | None = None,
    windows: Sequence[GuardWindow] = (),
    repeat: int = 1,
    guard: int = DEFAULT_GUARD_BYTES,
    pool: BufferPool | None = None,
) -> KernelRun:
    """Run ``op`` on ``args`` ``repeat`` times, each from fresh guarded buffers on ``backend.device`` (allocations
    from ``pool`` when given: reused, every byte rewritten)."""
    device = backend.device
    outputs: list[torch.Tensor] = []
    damage: list[GuardDamage] = []
    elapsed: list[float] = []
    cuda = device.type == "cuda"
    phases: dict[str, float] = {}

    def timed(name: str, start: float) -> float:
        now = time.perf_counter()
        phases[name] = phases.get(name, 0.0) + now - start
        return now

    for _ in range(max(1, repeat)):
        clock = time.perf_counter()
        call: dict[str, Any] = dict(args)
        call.update(op.make_scratch(args, device))
        clock = timed("scratch", clock)
        guarded = materialise(
            tensor_leaves(op, call), device, fill, guard=guard, fills=fills, windows=list(windows), pool=pool
        )
        run_args = replace_tensor_leaves(op, call, guarded.args)
        clock = timed("materialise", clock)
        try:
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            result = op.run(run_args, backend)
            if cuda:
                torch.cuda.synchronize(device)
            elapsed.append(time.perf_counter() - start)
            clock = timed("kernel", clock)
        except Exception as error:  # the kernel's host checks raise; device faults surface here too
            return KernelRun(
                classify_error(error), tuple(outputs), tuple(damage), first_line(error), None, phases
            )
        out = result if isinstance(result, torch.Tensor) else run_args.get(op.output_name)
        if not isinstance(out, torch.Tensor):
            return KernelRun(
                "rejected",
                tuple(outputs),
                tuple(damage),
                f"{op.name} returned no tensor output",
                None,
                phases,
            )
        try:
            outputs.append(out.detach().clone())
            damage.extend(guarded.damage())
        except Exception as error:  # a fault reported at the next sync
            return KernelRun(
                classify_error(error), tuple(outputs), tuple(damage), first_line(error), None, phases
            )
        del out, result, run_args, call
        guarded.release()  # only after a clean run: a faulted context's buffers are never reused
        timed("check", clock)
    return KernelRun(
        "ran", tuple(outputs), tuple(damage), "", min(elapsed) if elapsed else None, phases, run_state(op)
    )
