"""What ``moereplay expand`` reports: per re-run layer call, its verdict, the outputs compared byte for byte, and
its kernel calls paired with the recorded ones (:mod:`moereplay.replay.expand`). Frozen data; ``line()`` is the
one line the CLI prints, ``to_json()`` the document ``--json-out`` writes."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moereplay.wording import plural


class ExpandVerdict(enum.Enum):
    """What one re-run shows about its recorded call."""

    BIT_EXACT = "bit_exact"
    DIFFERS = "differs"
    NOT_COMPARED = "not_compared"  # the recorded call has no output (inputs_saved, failed)
    RAISED = "raised"  # the re-run raised


def _json_float(value: float | None) -> float | str | None:
    """A magnitude for a JSON report: the number, or ``"nan"`` / ``"inf"`` (JSON has no non-finite numbers)."""
    return value if value is None or math.isfinite(value) else str(value)


_REASONS = "state the kernel read outside its arguments, or nondeterminism"
"""Why a re-run differs from its recording, when it does."""

_NOT_REPRODUCED = "the failure did not reproduce in a fresh process"

_PLAIN_OUTPUT_NAMES = ("return", "output", "output_tensor")
"""Output names a line calls "output" rather than naming them."""


@dataclass(frozen=True)
class OutputComparison:
    """One output tensor, recorded vs re-run, byte for byte (uint8 views: NaN payloads and signed zeros count).

    ``elements``: elements of the recorded tensor; ``differing``: elements whose bytes differ (all of them when
    dtype or shape differ, then ``mismatch`` says how); ``*_nonfinite``: NaN/Inf elements (floating dtypes);
    ``rows``: how many rows (indices of the first dimension) hold a difference, of ``total_rows``; ``max_abs``:
    the largest |recorded - re-run| where both are finite (floating dtypes; None where none such differ).
    """

    name: str
    elements: int
    differing: int
    recorded_nonfinite: int
    rerun_nonfinite: int
    mismatch: str | None = None
    rows: int = 0
    total_rows: int = 0
    max_abs: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.differing <= self.elements:
            raise ValueError("differing elements out of range")

    @property
    def bit_exact(self) -> bool:
        return self.mismatch is None and self.differing == 0

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "bit_exact": self.bit_exact,
            "elements": self.elements,
            "differing": self.differing,
            "recorded_nonfinite": self.recorded_nonfinite,
            "rerun_nonfinite": self.rerun_nonfinite,
            "mismatch": self.mismatch,
            "rows": self.rows,
            "total_rows": self.total_rows,
            "max_abs": self.max_abs,
        }

    def magnitude(self) -> str:
        """', in r of n rows, largest |difference| d' for a byte difference of same-shaped tensors; else ''."""
        if self.mismatch is not None or not self.differing:
            return ""
        text = f" in {self.rows} of {self.total_rows} rows" if self.total_rows > 1 else ""
        if self.max_abs is not None:
            text += f", largest |difference| {self.max_abs:.4g}"
        return text


@dataclass(frozen=True)
class KernelCallComparison:
    """A re-run kernel call (index in OUT) against the recorded kernel call at the same position (source index)."""

    rerun: int
    recorded: int
    op: str
    outputs: tuple[OutputComparison, ...]
    problem: str | None = None  # e.g. a different op at this position

    @property
    def bit_exact(self) -> bool:
        return self.problem is None and all(output.bit_exact for output in self.outputs)

    def to_json(self) -> dict[str, Any]:
        return {
            "rerun": self.rerun,
            "recorded": self.recorded,
            "op": self.op,
            "bit_exact": self.bit_exact,
            "problem": self.problem,
            "outputs": [output.to_json() for output in self.outputs],
        }


@dataclass(frozen=True)
class ExpandedCall:
    """One recorded layer call and its re-run.

    ``parent``: the re-run parent's index in OUT (None: the re-run recorded none — a layer call above the parent,
    ``CaptureTarget.layer_flight_only``, that failed before calling it); ``kernel_calls``: its kernel calls' indices
    in OUT;
    ``recorded_kernel_calls``: the recorded parent's kernel calls in the source (empty for a layer-scope record);
    ``outputs``: the parent's outputs compared; ``kernel_comparisons``: pairs by call order.
    """

    call: int
    op: str
    context: Mapping[str, Any]
    verdict: ExpandVerdict
    parent: int | None
    kernel_calls: tuple[int, ...]
    recorded_kernel_calls: tuple[int, ...]
    outputs: tuple[OutputComparison, ...]
    kernel_comparisons: tuple[KernelCallComparison, ...]
    error: str | None = None
    notes: tuple[str, ...] = ()
    # an output the recording checked but did not keep (MOEREPLAY_FLIGHT_OUTPUT_BYTES): (its name, the recorded
    # largest magnitude — None when its check was never read —, the re-run's), compared in place of its bytes
    checked: tuple[str, float | None, float] | None = None
    # for that output, the fingerprint of its bytes the recorder reduced and the re-run's (device_ring.
    # byte_fingerprint, 16 hex digits), where the recording has one: the verdict is bit-exact when they are equal
    fingerprints: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if (self.verdict is ExpandVerdict.RAISED) != (self.error is not None):
            raise ValueError("an error goes with the raised verdict, and only with it")

    @property
    def bit_exact(self) -> bool | None:
        if self.verdict is ExpandVerdict.BIT_EXACT:
            return True
        return False if self.verdict is ExpandVerdict.DIFFERS else None

    def where(self) -> str:
        parts = [
            f"{key} {self.context[key]}" for key in ("layer", "step") if self.context.get(key) is not None
        ]
        return f" ({', '.join(parts)})" if parts else ""

    def line(self, output_name: str) -> str:
        """The one-line summary the CLI prints."""
        head = f"call {self.call} {self.op}{self.where()}: "
        kernels = ", ".join(map(str, self.kernel_calls)) or "none"
        placed = f"kernel calls {kernels} in {output_name}"
        if self.verdict is ExpandVerdict.RAISED:
            return f"{head}the re-run raised {self.error}; {placed}"
        if self.checked is not None:
            body = self._checked_only(output_name)
        elif self.verdict is ExpandVerdict.NOT_COMPARED:
            body = "re-run; the recorded call has no output to compare"
        elif self.verdict is ExpandVerdict.BIT_EXACT:
            nonfinite = sum(output.recorded_nonfinite for output in self.outputs)
            body = "re-run bit-exact with the recorded output" + (
                f" (its {nonfinite} non-finite values reproduced)" if nonfinite else ""
            )
        else:
            body = self._difference(output_name)
        return head + body + "; " + placed + self._kernel_summary()

    @property
    def check_agrees(self) -> bool | None:
        """For an output checked but not kept: whether the re-run's largest magnitude is the recorded one (None: no
        such output, or its check was never read)."""
        if self.checked is None or self.checked[1] is None:
            return None
        recorded, rerun = self.checked[1], self.checked[2]
        return recorded == rerun or (math.isnan(recorded) and math.isnan(rerun))

    def _checked_only(self, output_name: str) -> str:
        """The line's body for an output the recording checked but did not keep: the two largest magnitudes."""
        assert self.checked is not None
        name, recorded, rerun = self.checked
        what = "output" if name in _PLAIN_OUTPUT_NAMES else name
        if self.fingerprints is not None:
            return self._fingerprinted(what, output_name)
        text = f"re-run; the recorded {what} was checked, not kept (no bytes to compare): largest |x| "
        if recorded is None:
            return text + f"{rerun:.6g} re-run, the recorded check never read (the call was not checked)"
        text += f"{recorded:.6g} recorded, {rerun:.6g} re-run"
        if self.check_agrees:
            return text + " — the check agrees"
        unreproduced = not math.isfinite(recorded) and math.isfinite(rerun)
        return text + self._finding(_NOT_REPRODUCED if unreproduced else "the check differs", output_name)

    def _fingerprinted(self, what: str, output_name: str) -> str:
        """The line's body for an output checked and fingerprinted, not kept: bit-exact or not by its fingerprint."""
        assert self.checked is not None and self.fingerprints is not None
        _, recorded, rerun = self.checked
        printed, again = self.fingerprints
        if printed == again:
            text = (
                f"re-run bit-exact with the recorded {what} by its fingerprint {printed} (checked, not kept; "
                f"largest |x| {rerun:.6g})"
            )
            if self.check_agrees is False:  # the same bytes, another magnitude: the recorded check is wrong
                text += (
                    f"; but the recorded check said largest |x| {recorded:.6g}: the flight recorder's check "
                    "disagrees with the bytes it fingerprinted"
                )
            return text
        text = f"re-run differs from the recorded {what}: fingerprint {printed} recorded, {again} re-run"
        unreproduced = False
        if recorded is not None:
            text += f"; largest |x| {recorded:.6g} recorded, {rerun:.6g} re-run"
            unreproduced = not math.isfinite(recorded) and math.isfinite(rerun)
        return text + self._finding(_NOT_REPRODUCED if unreproduced else "not bit-exact", output_name)

    def _finding(self, what: str, output_name: str) -> str:
        """A difference's end: what it is, why a re-run differs, and the replay that looks for a read out of bounds."""
        first = self.kernel_calls[0] if self.kernel_calls else None
        hint = f": moereplay run {output_name} --call {first} --fill 0xff" if first is not None else ""
        return f" — {what} ({_REASONS}); replay the expanded calls with --fill 0xff{hint}"

    def _difference(self, output_name: str) -> str:
        worst = next(output for output in self.outputs if not output.bit_exact)
        if worst.mismatch is not None:
            text = f"re-run differs from the recorded output: {worst.name} {worst.mismatch}"
        else:
            text = (
                f"re-run differs from the recorded output: {worst.differing}/{worst.elements} elements"
                + (f" of {worst.name}" if worst.name not in _PLAIN_OUTPUT_NAMES else "")
                + worst.magnitude()
                + f", recorded non-finite {worst.recorded_nonfinite} vs re-run {worst.rerun_nonfinite}"
            )
        flight = self.context.get("flight")
        triggered = isinstance(flight, Mapping) and bool(flight.get("trigger"))
        if worst.recorded_nonfinite > worst.rerun_nonfinite or (triggered and worst.rerun_nonfinite == 0):
            finding = _NOT_REPRODUCED
        elif worst.rerun_nonfinite > worst.recorded_nonfinite:
            finding = "the re-run has non-finite values the recorded call had not"
        else:
            finding = "not bit-exact"
        return text + self._finding(finding, output_name)

    def _kernel_summary(self) -> str:
        if not self.recorded_kernel_calls:
            return ""
        if not self.kernel_comparisons:
            return f" (the recorded kernel calls {', '.join(map(str, self.recorded_kernel_calls))} have no re-run)"
        pairs = []
        for pair in self.kernel_comparisons:
            if pair.bit_exact:
                state = "bit-exact"
            elif pair.problem is not None:
                state = pair.problem
            else:
                differing = [output.name for output in pair.outputs if not output.bit_exact]
                state = f"differs in {', '.join(differing)}"
            pairs.append(f"{pair.rerun} vs recorded {pair.recorded} {state}")
        counts = ""
        if len(self.kernel_calls) != len(self.recorded_kernel_calls):
            counts = f"; recorded {plural(len(self.recorded_kernel_calls), 'kernel call')}, re-run {len(self.kernel_calls)}"
        return f" ({'; '.join(pairs)}{counts})"

    def to_json(self) -> dict[str, Any]:
        return {
            "call": self.call,
            "op": self.op,
            "layer": self.context.get("layer"),
            "step": self.context.get("step"),
            "verdict": self.verdict.value,
            "bit_exact": self.bit_exact,
            "parent": self.parent,
            "kernel_calls": list(self.kernel_calls),
            "recorded_kernel_calls": list(self.recorded_kernel_calls),
            "outputs": [output.to_json() for output in self.outputs],
            "kernel_comparisons": [pair.to_json() for pair in self.kernel_comparisons],
            "error": self.error,
            "notes": list(self.notes),
            "checked": (
                None
                if self.checked is None
                else {
                    "name": self.checked[0],
                    "recorded_magnitude": _json_float(self.checked[1]),
                    "rerun_magnitude": _json_float(self.checked[2]),
                    "agrees": self.check_agrees,
                    "recorded_fingerprint": self.fingerprints[0] if self.fingerprints else None,
                    "rerun_fingerprint": self.fingerprints[1] if self.fingerprints else None,
                }
            ),
        }


@dataclass(frozen=True)
class ExpandReport:
    """What :func:`expand_capture` did: one :class:`ExpandedCall` per selected layer call, and OUT."""

    source: Path
    output: Path
    backend: str
    device: str
    calls: tuple[ExpandedCall, ...]
    output_calls: int
    file_bytes: int

    @property
    def raised(self) -> bool:
        """Whether a re-run raised (the CLI exits 1)."""
        return any(call.verdict is ExpandVerdict.RAISED for call in self.calls)

    @property
    def notes(self) -> tuple[str, ...]:
        return tuple(note for call in self.calls for note in call.notes)

    def lines(self) -> list[str]:
        return [call.line(self.output.name) for call in self.calls]

    def to_json(self) -> dict[str, Any]:
        return {
            "source": str(self.source),
            "output": str(self.output),
            "backend": self.backend,
            "device": self.device,
            "output_calls": self.output_calls,
            "file_bytes": self.file_bytes,
            "raised": self.raised,
            "calls": [call.to_json() for call in self.calls],
        }


def _nonfinite(tensor: torch.Tensor) -> int:
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return 0
    return int((~torch.isfinite(tensor.to(torch.float32))).sum())


def compare_bytes(name: str, recorded: torch.Tensor, rerun: torch.Tensor) -> OutputComparison:
    """Element-wise byte comparison of two tensors (NaN-aware by construction: bytes, not values)."""
    elements = recorded.numel()
    recorded_nonfinite, rerun_nonfinite = _nonfinite(recorded), _nonfinite(rerun)
    if recorded.dtype != rerun.dtype or recorded.shape != rerun.shape:
        mismatch = (
            f"recorded {str(recorded.dtype).removeprefix('torch.')}{list(recorded.shape)} vs re-run "
            f"{str(rerun.dtype).removeprefix('torch.')}{list(rerun.shape)}"
        )
        return OutputComparison(name, elements, elements, recorded_nonfinite, rerun_nonfinite, mismatch)
    if elements == 0:
        return OutputComparison(name, 0, 0, 0, 0)
    itemsize = recorded.element_size()

    def rows(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).reshape(elements, itemsize)

    mask = (rows(recorded) != rows(rerun)).any(dim=1)
    differing = int(mask.sum())
    if not differing:
        return OutputComparison(name, elements, 0, recorded_nonfinite, rerun_nonfinite)
    leading = recorded.shape[0] if recorded.dim() else 1
    row_count = int(mask.reshape(leading, -1).any(dim=1).sum())
    max_abs = None
    if recorded.is_floating_point():
        a = recorded.detach().cpu().reshape(-1)[mask].to(torch.float64)
        b = rerun.detach().cpu().reshape(-1)[mask].to(torch.float64)
        finite = torch.isfinite(a) & torch.isfinite(b)
        if finite.any():
            max_abs = float((a[finite] - b[finite]).abs().max())
    return OutputComparison(
        name, elements, differing, recorded_nonfinite, rerun_nonfinite, None, row_count, leading, max_abs
    )


def compare_outputs(recorded: Mapping[str, Any], rerun: Mapping[str, Any]) -> tuple[OutputComparison, ...]:
    """Every tensor output both sides recorded under one name; the primary ones (``return``, else the first
    tensor) when they share no name."""
    common = [
        name
        for name, value in recorded.items()
        if isinstance(value, torch.Tensor) and isinstance(rerun.get(name), torch.Tensor)
    ]
    if common:
        return tuple(compare_bytes(name, recorded[name], rerun[name]) for name in common)
    first, second = primary_output(recorded), primary_output(rerun)
    if first is None or second is None:
        return ()
    return (compare_bytes(first[0], first[1], second[1]),)


def primary_output(outputs: Mapping[str, Any]) -> tuple[str, torch.Tensor] | None:
    value = outputs.get("return")
    if isinstance(value, torch.Tensor):
        return "return", value
    for name, item in outputs.items():
        if isinstance(item, torch.Tensor):
            return name, item
    return None
