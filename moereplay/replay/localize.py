"""Findings that localise a failure in the op's terms: which rows (by slot, token, expert, block), which columns,
which argument, which bytes.

Each function turns one kind of evidence (a comparison, repeated outputs, guard damage, contract violations) into
:class:`~moereplay.replay.findings.Finding` objects; none decides a verdict.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from moereplay.ops.base import ContractViolation, RowMap
from moereplay.replay.findings import Finding, FindingKind, row_ranges
from moereplay.replay.memory import GuardDamage


def _concentration(label: str, values: torch.Tensor, bad: Sequence[int], written: torch.Tensor) -> str | None:
    """``"experts 3, 7 (all of their rows; no other expert)"`` when the bad rows concentrate, else ``None``."""
    valid = values >= 0
    if not bool(valid.any()):
        return None
    bad_set = torch.zeros_like(written)
    bad_set[list(bad)] = True
    involved = Counter(int(values[r]) for r in bad if int(values[r]) >= 0)
    if not involved:
        return None
    population = Counter(
        int(v) for v, w in zip(values.tolist(), written.tolist(), strict=True) if w and v >= 0
    )
    if len(population) < 2 or len(involved) > len(population) // 2:
        return None  # spread over most values (or one value per row): nothing to localise
    fully = all(involved[k] == population[k] for k in involved)
    names = row_ranges(involved.keys(), limit=8)
    tail = "all of their rows" if fully else "some of their rows"
    return f"{label} {names} ({tail}; {len(involved)} of {len(population)})"


def corrupt_rows(
    bad: Sequence[int],
    written: torch.Tensor,
    rows: RowMap,
    actual: torch.Tensor,
    variant: str,
    *,
    row_max_rel: torch.Tensor | None = None,
) -> Finding | None:
    """Where the rows over tolerance are: by expert / slot / block / token, and which of them are all zeros."""
    if not bad:
        return None
    written_cpu = written.detach().to("cpu", torch.bool)
    total = int(written_cpu.sum())
    places = []
    for label, values in (
        ("experts", rows.expert),
        ("slots", rows.slot),
        ("blocks", rows.block),
        ("tokens", rows.token),
    ):
        text = _concentration(label, values.detach().to("cpu", torch.long), bad, written_cpu)
        if text:
            places.append(text)
    data = actual.detach().to("cpu")
    zero_rows = [r for r in bad if bool((data[r] == 0).all())]
    message = f"{len(bad)}/{total} written rows over tolerance: rows {row_ranges(bad)}"
    if places:
        message += "; concentrated in " + "; ".join(places)
    else:
        message += "; spread over every expert, slot and block"
    if zero_rows:
        message += f"; rows {row_ranges(zero_rows)} are all zeros"
    evidence: dict[str, object] = {
        "bad_rows": len(bad),
        "written_rows": total,
        "zero_rows": len(zero_rows),
        "by_expert": _counts(rows.expert, bad),
        "by_block": _counts(rows.block, bad),
    }
    if row_max_rel is not None:
        worst = sorted(bad, key=lambda r: -float(row_max_rel[r]))[:5]
        evidence["worst_rows"] = [
            {"row": r, "max_rel": float(row_max_rel[r]), "where": rows.describe(r)} for r in worst
        ]
    return Finding(FindingKind.CORRUPT_ROWS, message, variant, evidence, rows=tuple(bad), confidence=1.0)


def _counts(values: torch.Tensor, bad: Sequence[int]) -> dict[str, int]:
    counts = Counter(int(values[r]) for r in bad)
    return {str(key): count for key, count in sorted(counts.items())}


def _rows_word(rows: Sequence[int]) -> str:
    return "row" if len(rows) == 1 else "rows"


def nonfinite(actual: torch.Tensor, written: torch.Tensor, rows: RowMap, variant: str) -> Finding | None:
    """NaN / Inf in written rows: which rows, which column range, which experts."""
    data = actual.detach().to("cpu")
    if not data.is_floating_point():
        return None
    mask = ~torch.isfinite(data.float()) & written.detach().to("cpu", torch.bool)[:, None]
    if not bool(mask.any()):
        return None
    bad_rows = torch.nonzero(mask.any(dim=1)).flatten().tolist()
    columns = torch.nonzero(mask.any(dim=0)).flatten()
    first, last = int(columns[0]), int(columns[-1])
    nan = int(torch.isnan(data.float())[mask].sum())
    inf = int(mask.sum()) - nan
    experts = sorted({int(rows.expert[r]) for r in bad_rows if int(rows.expert[r]) >= 0})
    full_rows = [r for r in bad_rows if bool(mask[r].all())]
    message = (
        f"{nan} NaN and {inf} Inf in {_rows_word(bad_rows)} {row_ranges(bad_rows)}, columns {first}-{last}"
        + (f" ({_rows_word(full_rows)} {row_ranges(full_rows)} entirely)" if full_rows else "")
        + (f"; experts {row_ranges(experts, limit=8)}" if experts else "")
    )
    return Finding(
        FindingKind.NONFINITE,
        message,
        variant,
        {"nan": nan, "inf": inf, "rows": len(bad_rows), "columns": [first, last], "experts": experts},
        rows=tuple(bad_rows),
        columns=(first, last),
    )


def _row_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``[rows, bytes per row]`` uint8 view of a 2-D output (bit patterns, so NaN payloads count)."""
    data = tensor.detach().to("cpu").contiguous()
    return data.view(torch.uint8).reshape(data.shape[0], -1)


def nondeterminism(outputs: Sequence[torch.Tensor], written: torch.Tensor, variant: str) -> Finding | None:
    """Rows whose bytes differ between repeats of the same variant."""
    if len(outputs) < 2 or outputs[0].dim() != 2:
        return None
    first = _row_bytes(outputs[0])
    itemsize = outputs[0].element_size()
    mask = written.detach().to("cpu", torch.bool)
    differing: set[int] = set()
    columns: list[int] = []
    runs_differing = 0
    for other in outputs[1:]:
        if other.shape != outputs[0].shape or other.dtype != outputs[0].dtype:
            runs_differing += 1
            continue
        unequal = (_row_bytes(other) != first) & mask[:, None]
        if bool(unequal.any()):
            runs_differing += 1
            differing.update(torch.nonzero(unequal.any(dim=1)).flatten().tolist())
            cols = torch.nonzero(unequal.any(dim=0)).flatten()
            columns.extend([int(cols[0]) // itemsize, int(cols[-1]) // itemsize])
    if not runs_differing:
        return None
    span = (min(columns), max(columns)) if columns else None
    return Finding(
        FindingKind.NONDETERMINISM,
        f"{runs_differing} of {len(outputs) - 1} repeats differ from the first: rows {row_ranges(differing)}"
        + (f", columns {span[0]}-{span[1]}" if span else ""),
        variant,
        {"repeats": len(outputs), "differing_repeats": runs_differing, "rows": len(differing)},
        rows=tuple(sorted(differing)),
        columns=span,
    )


def guard_damage(damage: Sequence[GuardDamage], variant: str) -> list[Finding]:
    """One out-of-bounds-write finding per damaged guard region."""
    return [
        Finding(
            FindingKind.OOB_WRITE,
            f"out-of-bounds write: {item.describe()}",
            variant,
            {
                "argument": item.arg,
                "side": item.side,
                "first": item.first,
                "last": item.last,
                "bytes": item.count,
                "span_bytes": item.span_bytes,
            },
        )
        for item in damage
    ]


def contract_violations(violations: Sequence[ContractViolation], variant: str) -> list[Finding]:
    """One finding per violated contract; dtype violations the host code lets through suggest the cast."""
    findings = []
    for violation in violations:
        suggestions: tuple[str, ...] = ()
        if violation.aspect == "dtype" and not violation.host_checked:
            target = violation.expected.split(" or ")[0]
            suggestions = (f"cast {violation.arg}={target}",)
        evidence: dict[str, object] = {
            "argument": violation.arg,
            "aspect": violation.aspect,
            "expected": violation.expected,
            "actual": violation.actual,
            "host_checked": violation.host_checked,
        }
        if violation.reads_past_end is not None:
            evidence["reads_past_end"] = violation.reads_past_end
        findings.append(
            Finding(
                FindingKind.CONTRACT_VIOLATION,
                f"contract: {violation.describe()}",
                variant,
                evidence,
                suggestions=suggestions,
            )
        )
    return findings
