"""Fidelity: a replay that is not bit-exact with the recording — where it differs, and which cause explains it.

A replay of the call as captured should reproduce the recorded output byte for byte; when it does not, the
verdicts of both rows may still be ``ok`` while the replay is not what production ran. :func:`explain` localises the
difference (elements, rows → tokens / experts / blocks, columns, the largest distance in ULPs of the output dtype) and
tests the candidate causes itself, in this order, stopping at the first that explains it:

1. **nondeterminism** — the baseline re-run: a replay that differs from itself cannot be expected to match the
   recording bit for bit (and the later causes, which look for a bit-exact reproduction, cannot be tested);
2. **bytes outside the tensors** — the guard fills: one that reproduces the recording bit for bit, or that changes
   exactly the differing elements, says the kernel read memory outside its tensors whose contents differed;
3. **process state** — what the op reports its run chose (triton_kernels' opt_flags) against what the recording
   chose, replayed with the recorded values pinned; and the environment variables the capture's header recorded,
   replayed in a worker under them;
4. **routing metadata** — the recorded metadata against what the routing re-derives, replayed with the re-derived
   one.

Only then is the difference "unexplained". Nothing here runs when the replay is bit-exact. Cost, when it is not: one
re-run, one run per fill, one per pinned state and per re-derived routing that differ, and a worker start when the
environment differs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from moereplay.ops.base import Args, OpSpec, RowMap, tensor_leaves
from moereplay.replay.differences import ElementDifference, describe, element_difference, places
from moereplay.replay.findings import Finding, FindingKind
from moereplay.replay.mutations import Fill, FillPattern, Rederive, SetValue, Variant

Outcome = Literal["explains", "partly", "no", "untested"]

FIDELITY_FILLS: tuple[FillPattern, ...] = (FillPattern(0xFF), FillPattern(0x00), FillPattern(0xFE))
"""Guard fills tried against the recording: all-ones (NaN / −1 / e8m0 Inf), zeros (freshly cleared memory: the
baseline's own fill, run as a variant so the table shows it) and 0xfe (large finite values)."""

TOOL_VARIABLES = ("MOEREPLAY_",)
"""Recorded environment variables that configure moereplay itself, not the kernels: never compared."""
DEVICE_VARIABLES = frozenset({"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"})
"""Variables that choose the device: a replay sets its own."""
REDACTED = "<redacted>"


@dataclass(frozen=True)
class Cause:
    """One candidate cause and what testing it showed."""

    name: str
    outcome: Outcome
    detail: str

    def to_json(self) -> dict[str, str]:
        return {"cause": self.name, "outcome": self.outcome, "detail": self.detail}


@dataclass
class FidelityProbe:
    """What :func:`explain` needs from a replay session.

    ``replayed``: the baseline's output; ``recorded``: the captured output (same shape up to leading 1s);
    ``written`` / ``rows``: the reference's written rows and row map. ``rerun()``: the baseline run again (``None``
    when it did not run); ``run(variant)``: a variant's output (it joins the session's rows; ``None`` when it did
    not run); ``run_in_environment(env)``: the baseline in a fresh worker with variables set / unset (``None`` as
    a value) — ``None`` when the session cannot start one. ``replayed_state``: the op's ``run_state()`` of the
    baseline run; ``recorded_state`` and ``recorded_environment``: what the capture recorded.
    """

    op: OpSpec
    args: Args
    replayed: torch.Tensor
    recorded: torch.Tensor
    written: torch.Tensor
    rows: RowMap | None
    rerun: Callable[[], torch.Tensor | None]
    run: Callable[[Variant], torch.Tensor | None]
    run_in_environment: Callable[[Mapping[str, str | None]], torch.Tensor | None] | None = None
    replayed_state: Mapping[str, Any] = field(default_factory=dict)
    recorded_state: Mapping[str, Any] | None = None
    recorded_environment: Mapping[str, str] = field(default_factory=dict)
    environment: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    fills: Sequence[FillPattern] = FIDELITY_FILLS

    def reproduces(self, output: torch.Tensor | None) -> bool:
        return output is not None and element_difference(output, self.recorded, self.written).same


def explain(probe: FidelityProbe) -> Finding | None:
    """The fidelity finding about the baseline (``None`` when the replay is bit-exact with the recording)."""
    difference = element_difference(probe.replayed, probe.recorded, probe.written)
    if difference.same:
        return None
    causes: list[Cause] = []
    for test in (_nondeterminism, _outside_bytes, _process_state, _routing_metadata):
        found = test(probe, difference)
        causes.extend(found)
        if any(cause.outcome == "explains" for cause in found):
            break
    return _finding(probe, difference, causes)


def _finding(probe: FidelityProbe, difference: ElementDifference, causes: list[Cause]) -> Finding:
    explaining = next((cause for cause in causes if cause.outcome == "explains"), None)
    partial = [cause for cause in causes if cause.outcome == "partly"]
    message = f"replay not bit-exact with the recording: {describe(difference, probe.rows)}"
    if explaining is not None:
        message += f" — explained by {explaining.name}: {explaining.detail}"
        confidence = 1.0
    else:
        tested = "; ".join(f"{cause.name}: {cause.detail}" for cause in causes)
        lead = "partly explained by " + ", ".join(c.name for c in partial) if partial else "unexplained"
        message += f" — {lead} (tested: {tested})"
        confidence = 0.7 if partial else 0.4
    _, named = places(difference, probe.rows)
    evidence: dict[str, Any] = {
        "elements": difference.elements,
        "total": int(difference.mask.numel()),
        "rows": len(difference.rows),
        "columns": None if difference.columns is None else list(difference.columns),
        "max_ulp": difference.max_ulp if difference.max_ulp == difference.max_ulp else None,
        "dtype": str(difference.dtype).removeprefix("torch."),
        "nan_mismatch": difference.nan_mismatch,
        **named,
        "causes": [cause.to_json() for cause in causes],
        "explained_by": explaining.name
        if explaining is not None
        else ("partly" if partial else "unexplained"),
    }
    return Finding(
        FindingKind.FIDELITY,
        message,
        "baseline",
        evidence,
        rows=difference.rows,
        columns=difference.columns,
        confidence=confidence,
    )


# -- the causes, in order ------------------------------------------------------------------------------------


def _nondeterminism(probe: FidelityProbe, difference: ElementDifference) -> list[Cause]:
    again = probe.rerun()
    if again is None:
        return [Cause("nondeterminism", "untested", "the baseline could not be run again")]
    itself = element_difference(again, probe.replayed, probe.written)
    if itself.same:
        return [Cause("nondeterminism", "no", "a second run is bit-exact with the first")]
    overlap = int((itself.mask & difference.mask).sum())
    detail = (
        f"the replay differs from itself ({describe(itself, probe.rows)}; {overlap} of the {difference.elements} "
        "elements that differ from the recording among them): a recording made by this kernel can differ likewise; "
        "the later causes need a reproducible replay and were not tested"
    )
    return [Cause("nondeterminism", "explains", detail)]


def _outside_bytes(probe: FidelityProbe, difference: ElementDifference) -> list[Cause]:
    name = "bytes outside the tensors"
    outputs = {fill.name: probe.run(Variant((Fill(fill),))) for fill in probe.fills}
    ran = {label: output for label, output in outputs.items() if output is not None}
    if not ran:
        return [Cause(name, "untested", "no fill variant ran")]
    for label, output in ran.items():
        if probe.reproduces(output):
            return [
                Cause(
                    name,
                    "explains",
                    f"fill {label} reproduces the recording bit for bit: the kernel reads memory outside its "
                    f"tensors, and where it read, the recording's process held bytes that act as {label} does",
                )
            ]
    moved = torch.zeros_like(difference.mask)
    for output in ran.values():
        moved |= element_difference(output, probe.replayed, probe.written).mask
    fills = ", ".join(ran)
    if not bool(moved.any()):
        return [Cause(name, "no", f"no guard fill ({fills}) changes the output")]
    covered = int((moved & difference.mask).sum())
    if covered == difference.elements:
        return [
            Cause(
                name,
                "explains",
                f"every element that differs from the recording is one the guard fill changes ({covered} of "
                f"{int(moved.sum())} fill-dependent elements, fills {fills}): the kernel reads memory outside its "
                "tensors, and the recording's process held other bytes there",
            )
        ]
    outcome: Outcome = "partly" if covered else "no"
    return [
        Cause(
            name,
            outcome,
            f"the guard fill changes {int(moved.sum())} elements, {covered} of the {difference.elements} that "
            "differ from the recording",
        )
    ]


def _process_state(probe: FidelityProbe, difference: ElementDifference) -> list[Cause]:
    return [_chosen_state(probe), _environment(probe)]


def _chosen_state(probe: FidelityProbe) -> Cause:
    name = "process state"
    if getattr(probe.op, "run_state", None) is None:
        return Cause(name, "untested", f"{probe.op.name} reports no process state")
    if probe.recorded_state is None:
        return Cause(
            name,
            "untested",
            "the capture recorded no process state (e.g. the kernel flags a library chose) for this call",
        )
    if not probe.replayed_state:
        return Cause(name, "untested", "the replay reported no process state")
    differing = {
        key: (value, probe.replayed_state[key])
        for key, value in probe.recorded_state.items()
        if key in probe.replayed_state and probe.replayed_state[key] != value
    }
    if not differing:
        shared = sorted(set(probe.recorded_state) & set(probe.replayed_state))
        return Cause(
            name, "no", f"the replay chose what the recording chose ({', '.join(shared) or 'nothing shared'})"
        )
    shown = ", ".join(
        f"{key} {old!r} recorded, {new!r} replayed" for key, (old, new) in sorted(differing.items())
    )
    pins: Mapping[str, str] = getattr(probe.op, "state_pins", {}) or {}
    pinned = [SetValue(pins[key], value) for key, (value, _) in sorted(differing.items()) if key in pins]
    if not pinned:
        return Cause(name, "untested", f"{shown}; none of them can be pinned in a replay")
    variant = Variant(tuple(pinned))
    output = probe.run(variant)
    if output is None:
        return Cause(
            name,
            "untested",
            f"{shown}; the replay pinned to the recorded values ({variant.label}) did not run",
        )
    if probe.reproduces(output):
        return Cause(
            name,
            "explains",
            f"{shown}; pinned to the recorded values ({variant.label}) the replay is bit-exact",
        )
    return Cause(name, "no", f"{shown}; pinned to the recorded values ({variant.label}) it still differs")


def _environment_differences(probe: FidelityProbe) -> dict[str, tuple[str | None, str | None]]:
    recorded = {
        key: value
        for key, value in probe.recorded_environment.items()
        if not key.startswith(TOOL_VARIABLES) and key not in DEVICE_VARIABLES and value != REDACTED
    }
    families = {key.split("_", 1)[0] + "_" for key in recorded} | {"VLLM_"}
    now = {
        key: value
        for key, value in probe.environment.items()
        if key.startswith(tuple(families))
        and not key.startswith(TOOL_VARIABLES)
        and key not in DEVICE_VARIABLES
    }
    differing: dict[str, tuple[str | None, str | None]] = {}
    for key in sorted(set(recorded) | set(now)):
        if recorded.get(key) != now.get(key):
            differing[key] = (recorded.get(key), now.get(key))
    return differing


def _environment(probe: FidelityProbe) -> Cause:
    name = "environment"
    differing = _environment_differences(probe)
    if not differing:
        return Cause(name, "no", "the replay's environment has the recorded variables' values")
    shown = ", ".join(
        f"{key}={'unset' if old is None else repr(old)} recorded, {'unset' if new is None else repr(new)} now"
        for key, (old, new) in list(differing.items())[:6]
    ) + (f" (+{len(differing) - 6} more)" if len(differing) > 6 else "")
    if probe.run_in_environment is None:
        return Cause(name, "untested", f"{shown}; re-running under them needs a worker process")
    output = probe.run_in_environment({key: old for key, (old, _) in differing.items()})
    if output is None:
        return Cause(name, "untested", f"{shown}; the re-run under the recorded variables did not run")
    if probe.reproduces(output):
        return Cause(name, "explains", f"{shown}; re-run under the recorded values the replay is bit-exact")
    return Cause(name, "no", f"{shown}; re-run under the recorded values it still differs")


def _routing_metadata(probe: FidelityProbe, difference: ElementDifference) -> list[Cause]:
    name = "routing metadata"
    hook = getattr(probe.op, "rederive_routing", None)
    if hook is None:
        return [Cause(name, "untested", f"{probe.op.name} declares no routing metadata to re-derive")]
    try:
        rederived = hook(probe.args)
    except Exception as error:  # a call the op cannot re-derive: say why, test the other causes
        return [Cause(name, "untested", f"cannot re-derive it: {error}")]
    before, after = tensor_leaves(probe.op, probe.args), tensor_leaves(probe.op, rederived)
    changed = sorted(
        path for path in set(before) | set(after) if not _same_tensor(before.get(path), after.get(path))
    )
    if not changed:
        return [Cause(name, "no", "the recorded metadata is what the routing re-derives")]
    listed = ", ".join(changed[:4]) + (f" (+{len(changed) - 4} more)" if len(changed) > 4 else "")
    output = probe.run(Variant((Rederive(),)))
    if output is None:
        return [Cause(name, "untested", f"re-derived, {listed} differ; the replay with them did not run")]
    if probe.reproduces(output):
        return [
            Cause(name, "explains", f"re-derived, {listed} differ, and with them the replay is bit-exact")
        ]
    return [Cause(name, "no", f"re-derived, {listed} differ; with them the replay still differs")]


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    if a is b:
        return True
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    left = a.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    right = b.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(left, right))
