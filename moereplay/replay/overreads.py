"""Out-of-bounds reads: an output that changes with the guard fill, localised to one tensor and a byte range.

A fill-only variant whose written output bytes differ from the baseline's means the kernel reads guard bytes. The
localisation then reruns the baseline (it must be bit-reproducible, else nothing can be concluded), fills the guards
of one storage at a time with the other pattern — every tensor leaf, inside opaque arguments too, views of one
storage counted once and named together — and, for each storage whose guards change the output, bisects the guard
bytes of each side to the nearest and farthest byte that matters (windows ``[0, n)`` and ``[s, guard)``).

Cost: one kernel run per storage, plus about ``2·log2(guard)`` runs per over-read side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moereplay.ops.base import Args, ContractViolation, OpSpec, RowMap, tensor_leaves
from moereplay.reference.compare import aligned
from moereplay.replay.differences import ElementDifference, places
from moereplay.replay.findings import Finding, FindingKind, row_ranges
from moereplay.replay.memory import GuardWindow, storage_groups
from moereplay.replay.mutations import BASELINE, FillPattern
from moereplay.replay.runner import Runner, RunRequest


def written_bytes_equal(a: torch.Tensor, b: torch.Tensor, written: torch.Tensor) -> bool:
    """Whether the rows a correct kernel writes hold the same bytes in ``a`` and ``b`` (NaN payloads count; shapes
    that differ only by leading dimensions of 1 hold the same elements). One host sync (no boolean indexing, which
    would add one)."""
    shaped = aligned(b, a.shape)
    if shaped is None or a.dtype != b.dtype:
        return False
    b = shaped
    if a.numel() == 0:
        return True
    rows = written.to(a.device, torch.bool).reshape(-1)
    left = a.contiguous().view(torch.uint8).reshape(rows.numel(), -1)
    right = b.to(a.device).contiguous().view(torch.uint8).reshape(rows.numel(), -1)
    return not bool(((left != right) & rows[:, None]).any())


def differing_rows(a: torch.Tensor, b: torch.Tensor, written: torch.Tensor) -> list[int]:
    """Written rows whose bytes differ between two outputs of one shape (up to leading dimensions of 1)."""
    rows = written.numel()
    left = a.to(b.device).contiguous().view(torch.uint8).reshape(rows, -1)
    right = b.contiguous().view(torch.uint8).reshape(rows, -1)
    changed = (left != right).any(dim=1) & written.to(b.device)
    return [int(row) for row in torch.nonzero(changed).flatten().tolist()]


@dataclass
class ReadLocaliser:
    """Names the tensor a kernel over-reads and how far, by running the baseline with different guard contents.

    ``contracts``: the call's contract violations, to say when one predicts the over-read it found.
    """

    op: OpSpec
    args: Args
    device: torch.device
    guard: int
    runner: Runner
    contracts: Sequence[ContractViolation] = ()

    def _output_with(self, request: RunRequest) -> torch.Tensor | None:
        run = self.runner.run(request)
        return run.outputs[0] if run.status == "ran" and run.outputs else None

    def localise(
        self,
        base: torch.Tensor,
        written: torch.Tensor,
        other: FillPattern,
        again: torch.Tensor | None = None,
    ) -> tuple[list[tuple[str, dict[str, Any]]], str | None]:
        """``([(text, evidence item)] per over-read storage, note)``; the note says why nothing could be localised.
        ``again``: the baseline run a second time, when the caller has it (else it is run here)."""
        if again is None:
            again = self._output_with(RunRequest(BASELINE))
        if again is None or not written_bytes_equal(again, base, written):
            return [], "baseline is not bit-reproducible: out-of-bounds reads not localised"
        located: list[tuple[str, dict[str, Any]]] = []
        leaves = tensor_leaves(self.op, {**self.args, **self.op.make_scratch(self.args, self.device)})
        for group in storage_groups(leaves):  # one guard band per storage: its views share it
            name = group[0]
            output = self._output_with(RunRequest(BASELINE, fills={name: other}))
            if output is None or written_bytes_equal(output, base, written):
                continue
            sides = []
            for side in ("after", "before"):
                extent = self._extent(base, written, name, side, other)
                if extent is not None:
                    sides.append((side, extent))
            parts = []
            for side, (first, last) in sides:
                where = "past the end" if side == "after" else "before the start"
                bound = "+" if last >= self.guard - 1 else ""
                parts.append(f"bytes {first}..{last}{bound} {where}")
            alias = " (= " + ", ".join(group[1:]) + ")" if len(group) > 1 else ""
            text = f"{name}{alias} is over-read"
            if parts:
                text += f" ({', '.join(parts)} affect the output)"
            item: dict[str, Any] = {"argument": name, "extents": [[s, a, b] for s, (a, b) in sides]}
            if len(group) > 1:
                item["aliases"] = list(group[1:])
            predicted = [violation for violation in self.contracts if violation.arg in group]
            if predicted:
                text += f", as its contract predicts: {predicted[0].consequence}"
                item["contract"] = predicted[0].describe()
            located.append((text, item))
        return located, None

    def _extent(
        self, base: torch.Tensor, written: torch.Tensor, name: str, side: str, other: FillPattern
    ) -> tuple[int, int] | None:
        """Nearest and farthest guard byte (counted from the span edge) whose content changes the output."""

        def changes(start: int, stop: int) -> bool:
            window = GuardWindow(name, side, start, stop, other)  # type: ignore[arg-type]
            output = self._output_with(RunRequest(BASELINE, windows=(window,)))
            return output is not None and not written_bytes_equal(output, base, written)

        if not changes(0, self.guard):
            return None
        low, high = 1, self.guard  # smallest prefix [0, n) that changes the output
        while low < high:
            middle = (low + high) // 2
            if changes(0, middle):
                high = middle
            else:
                low = middle + 1
        first = low - 1
        low, high = first, self.guard - 1  # largest start s with [s, guard) still changing it
        while low < high:
            middle = (low + high + 1) // 2
            if changes(middle, self.guard):
                low = middle
            else:
                high = middle - 1
        return first, low


@dataclass(frozen=True, eq=False)
class FillEffect:
    """How one fill variant (``label``: ``"fill 0xff"``) changed the baseline's output, and its verdict's name."""

    label: str
    difference: ElementDifference
    verdict: str


def _span(item: Mapping[str, Any]) -> str:
    """``"bytes 0..63 past its end"`` for a localised over-read (both sides when both matter)."""
    parts = []
    for side, first, last in item.get("extents", ()):
        where = "past its end" if side == "after" else "before its start"
        parts.append(f"bytes {first}..{last} {where}")
    return " and ".join(parts) if parts else "its guard bytes"


def memory_dependence(
    effects: Sequence[FillEffect],
    unchanged: Sequence[str],
    located: Sequence[Mapping[str, Any]],
    predicted: Sequence[ContractViolation],
    rows: RowMap | None,
    note: str | None = None,
) -> Finding:
    """The call's memory-dependence finding: which tensor is read outside its bytes (localised, else as its
    contract predicts), what each fill changed (elements, rows → experts …, columns, verdict), which fills left
    the output as it was. ``located``: the localiser's evidence items; ``note``: why nothing was localised."""
    tensors: list[str] = []
    for item in located:
        text = f"{item['argument']} is read outside its bytes: {_span(item)} change the output"
        if item.get("contract"):
            text += ", as its contract predicts"
        tensors.append(text)
    if not located:
        for violation in predicted:
            text = (
                f"{violation.arg}: its contract predicts reads of {violation.reads_past_end} bytes past its end "
                "(not localised" + (f": {note}" if note else "") + ")"
            )
            tensors.append(text)
    changes: list[str] = []
    affected_rows: set[int] = set()
    columns: list[int] = []
    named: dict[str, set[int]] = {}
    per_fill: dict[str, Any] = {}
    for effect in effects:
        difference = effect.difference
        where, evidence = places(difference, rows)
        span = difference.columns
        text = f"{effect.label} changes {difference.elements} elements in rows {row_ranges(difference.rows)}"
        if where:
            text += f" ({where})"
        if span is not None:
            text += f", columns {span[0]}-{span[1]}"
            columns.extend(span)
        text += f" (verdict {effect.verdict})"
        changes.append(text)
        affected_rows.update(difference.rows)
        for key, values in evidence.items():
            named.setdefault(key, set()).update(values)
        per_fill[effect.label] = {
            "elements": difference.elements,
            "rows": list(difference.rows),
            "columns": None if span is None else list(span),
            "verdict": effect.verdict,
            **evidence,
        }
    message = "memory-dependent: the output depends on bytes outside the call's tensors"
    if tensors:
        message += " — " + "; ".join(tensors)
    message += "; " + "; ".join(changes)
    if unchanged:
        verb = "leaves" if len(unchanged) == 1 else "leave"
        message += f"; {', '.join(unchanged)} {verb} it as the baseline's"
    first_last = (min(columns), max(columns)) if columns else None
    evidence_out: dict[str, Any] = {
        "arguments": [dict(item) for item in located],
        "predicted": [
            {"argument": v.arg, "reads_past_end": v.reads_past_end, "contract": v.describe()}
            for v in predicted
        ],
        "fills": per_fill,
        "unchanged": list(unchanged),
        "columns": None if first_last is None else list(first_last),
        **{key: sorted(values) for key, values in named.items()},
    }
    return Finding(
        FindingKind.MEMORY_DEPENDENT,
        message,
        "baseline",
        evidence_out,
        rows=tuple(sorted(affected_rows)),
        columns=first_last,
    )
