"""Decompose wrong output rows into the reference's ingredients, and explain wrong coefficients.

For every bad row ``r`` the reference gives its ingredients ``T_t[r]`` (e.g. the unweighted GEMM row and the bias
row) and the coefficient ``e_t[r]`` each should carry (e.g. the routing weight). A least-squares fit in fp64,
``actual[r] ≈ Σ_t c_t · T_t[r]``, recovers the coefficients the kernel actually applied. When the fit is tight
(small residual) the row is "right ingredients, wrong coefficients", and each wrong ``c_t`` is tested against
explanations, from most to least specific:

- ``dtype``: ``c`` equals the coefficient argument's bytes read as another dtype at the element the row should read
  (e.g. bf16 routing weights read as float32 — which also yields "another row's value" for the first half of the
  rows and guard-band bytes past the end for the second half);
- ``scale``: ``c = e · s`` or ``e / s`` for a per-row scale the kernel applies elsewhere (a scale on the wrong term);
- ``multiple``: ``c = k · e`` (a term applied k times);
- ``other_term``: ``c`` equals another term's expected coefficient (a weight on the wrong term);
- ``other_row``: ``c`` equals the coefficient argument's value at another index (which one);
- ``zero``: ``c = 0``.

The hypothesis covering the most rows wins (ties go to the more specific). Findings report it with per-row evidence,
list the others as alternatives, and a diagnosis states whether the evidence points at the call's arguments (a
contract the caller broke) or at the kernel. Nothing here knows which answer to expect.

Cost: one batched ``lstsq`` over the bad rows (``[rows, cols, terms]`` in fp64) plus O(rows · entries) comparisons.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from moereplay.ops.base import Args, CoefficientSource, ReferenceResult, RowMap, TensorContract
from moereplay.replay.findings import Finding, FindingKind, row_ranges
from moereplay.replay.mutations import FillPattern, dtype_name

FIT_RESIDUAL = 0.02
"""A row is "explained by its ingredients" when ‖actual − fit‖ / ‖actual‖ is below this (bf16 output rounding and
kernel accumulation order give ~4e-3)."""

_SPECIFICITY = ("dtype", "scale", "multiple", "other_term", "other_row", "zero")
_MULTIPLES = (2.0, 3.0, 4.0, 0.5)
_PROBE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _relative_precision(dtype: torch.dtype) -> float:
    """Two ulps (relative) of ``dtype``: how closely a coefficient the kernel rounded to ``dtype`` can match."""
    if dtype == torch.bfloat16:
        return 2.0**-7
    if dtype == torch.float16:
        return 2.0**-10
    if dtype == torch.float32:
        return 2.0**-22
    return 2.0**-7


def _round_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype in (torch.bfloat16, torch.float16, torch.float32):
        return values.to(dtype).to(torch.float64)
    return values


@dataclass(frozen=True)
class RowFit:
    """The fitted coefficients of one row. ``residual``: relative misfit; ``stderr``: per-term standard error;
    ``norm``: the row's L2 norm; ``term_norms``: each fitted term's row norm (what a unit of its coefficient
    moves the row by)."""

    row: int
    coefficients: Mapping[str, float]
    stderr: Mapping[str, float]
    residual: float
    norm: float = 0.0
    term_norms: Mapping[str, float] = field(default_factory=dict)

    @property
    def explained(self) -> bool:
        return self.residual <= FIT_RESIDUAL

    def resolution(self, term: str, precision: float) -> float:
        """The smallest change of ``term``'s coefficient the row can show: one that moves the row by more than
        its own rounding (``precision`` relative, the output dtype's). A term far below the rest of the row (a bias
        scaled by 1e30 beside a GEMM of size 1) is rounded away entirely: its coefficient is not measured, and a
        fitted value however far from the expected one is no evidence."""
        size = self.term_norms.get(term, 0.0)
        if size <= 0.0 or self.norm <= 0.0:
            return 0.0
        return precision * self.norm / size


def fit_rows(actual: torch.Tensor, reference: ReferenceResult, rows: Sequence[int]) -> list[RowFit]:
    """Least-squares coefficients of each row's ingredients (finite rows only)."""
    if not rows or not reference.terms:
        return []
    index = torch.tensor(list(rows), dtype=torch.long)
    data = actual.detach().to("cpu", torch.float64)[index]
    names = list(reference.terms)
    terms = torch.stack([reference.terms[n].detach().to("cpu", torch.float64)[index] for n in names], dim=-1)
    fits: list[RowFit] = []
    active = terms.abs().amax(dim=1) > 0  # [rows, terms]
    finite = torch.isfinite(data).all(dim=1)
    for pattern in torch.unique(active, dim=0):
        chosen = [names[i] for i in range(len(names)) if pattern[i]]
        members = [i for i in range(len(rows)) if torch.equal(active[i], pattern) and bool(finite[i])]
        if not members:
            continue
        member_index = torch.tensor(members, dtype=torch.long)
        a = data[member_index]  # [m, cols]
        if not chosen:
            for m in members:
                norm = float(data[m].norm())
                fits.append(RowFit(rows[m], {}, {}, 0.0 if norm == 0 else 1.0))
            continue
        design = terms[member_index][:, :, pattern]  # [m, cols, k]
        solution = torch.linalg.lstsq(design, a.unsqueeze(-1)).solution.squeeze(-1)  # [m, k]
        predicted = (design @ solution.unsqueeze(-1)).squeeze(-1)
        residual = (a - predicted).norm(dim=1)
        scale = torch.maximum(a.norm(dim=1), predicted.norm(dim=1))
        dof = max(design.shape[1] - design.shape[2], 1)
        gram = design.transpose(1, 2) @ design
        try:
            inverse_diag = torch.linalg.inv(gram).diagonal(dim1=1, dim2=2)
        except RuntimeError:
            inverse_diag = torch.full(solution.shape, math.inf, dtype=torch.float64)
        sigma2 = residual**2 / dof
        stderr = (sigma2.unsqueeze(-1) * inverse_diag).clamp_min(0).sqrt()
        row_norms = a.norm(dim=1)
        term_norms = design.norm(dim=1)  # [m, k]
        for j, m in enumerate(members):
            rel = float(residual[j] / scale[j]) if float(scale[j]) > 0 else 0.0
            fits.append(
                RowFit(
                    rows[m],
                    {name: float(solution[j, i]) for i, name in enumerate(chosen)},
                    {name: float(stderr[j, i]) for i, name in enumerate(chosen)},
                    rel,
                    float(row_norms[j]),
                    {name: float(term_norms[j, i]) for i, name in enumerate(chosen)},
                )
            )
    fits.sort(key=lambda fit: fit.row)
    return fits


# --------------------------------------------------------------------------------------------------------------
# reading an argument's bytes the way a kernel would
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReadModel:
    """An argument's bytes, extended past its end by what a guarded replay placed there.

    ``values(dtype)`` gives float64 values of the bytes read as ``dtype`` (element ``i`` covers bytes
    ``[i·size, (i+1)·size)``); entries past ``known_bytes`` are NaN-free only when the guard content is known.
    """

    raw: bytes
    tail: bytes | None  # the guard bytes after the end (None: unknown memory, e.g. a captured run)

    @property
    def nbytes(self) -> int:
        return len(self.raw)

    def values(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(float64 values, bool "read past the end") for every whole ``dtype`` element of raw + tail."""
        data = self.raw + (self.tail or b"")
        count = len(data) // dtype.itemsize
        if count == 0:
            return torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.bool)
        buffer = torch.frombuffer(bytearray(data[: count * dtype.itemsize]), dtype=torch.uint8)
        values = buffer.view(dtype).to(torch.float64)
        ends = (torch.arange(count) + 1) * dtype.itemsize
        return values, ends > len(self.raw)


def read_model(tensor: torch.Tensor, fill: FillPattern | None, guard_bytes: int) -> ReadModel:
    """The bytes a kernel reading ``tensor`` densely from its data pointer sees (the view's span, then guard)."""
    span_elements = 0
    if tensor.numel():
        span_elements = 1 + sum(
            (s - 1) * abs(st) for s, st in zip(tensor.shape, tensor.stride(), strict=True)
        )
    flat = torch.as_strided(tensor.detach(), (span_elements,), (1,), tensor.storage_offset()).to("cpu")
    raw = flat.contiguous().view(torch.uint8).numpy().tobytes()
    tail = None if fill is None else fill.pattern(tensor.dtype, guard_bytes).numpy().tobytes()
    return ReadModel(raw, tail)


# --------------------------------------------------------------------------------------------------------------
# explanations
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Explanation:
    """One hypothesis about one term, and the rows it explains."""

    kind: str  # one of _SPECIFICITY
    key: str  # e.g. "float32", "global_scale*", "2x", "bias", "topk_weights"
    description: str
    rows: tuple[int, ...]
    examples: tuple[dict[str, float | int | str | None], ...]
    past_end_rows: tuple[int, ...] = ()
    unverified_rows: tuple[
        int, ...
    ] = ()  # read past the end into memory of unknown content: consistent, unproven
    mapping: str = ""
    chance: float = 0.0  # rows expected to match by coincidence

    @property
    def weight(self) -> float:
        """Rows explained, unverifiable ones counting half."""
        return len(self.rows) - 0.5 * len(self.unverified_rows)

    @property
    def rank(self) -> tuple[float, int]:
        return (self.weight, -_SPECIFICITY.index(self.kind))


def _close(c: float, target: float, tol_rel: float, tol_abs: float) -> bool:
    if not math.isfinite(target):
        return False
    return abs(c - target) <= max(tol_rel * abs(target), tol_abs)


def _mapping(candidates: list[tuple[int, list[int]]]) -> tuple[str, dict[int, int]]:
    """An affine rule ``own index -> matched index`` consistent with ≥ 90 % of the rows, when one exists.

    ``candidates``: for each row, its own index and every index whose value matches its coefficient (values repeat,
    so a row may match several). Returns the rule's text and the chosen match per own index.
    """
    if len(candidates) < 3:
        return "", {}
    best: tuple[int, int, int] | None = None  # count, slope, offset
    anchors = candidates[: min(4, len(candidates))]
    for (i0, c0), (i1, c1) in itertools.pairwise(anchors):
        if i1 == i0:
            continue
        for j0 in c0:
            for j1 in c1:
                if (j1 - j0) % (i1 - i0):
                    continue
                slope = (j1 - j0) // (i1 - i0)
                offset = j0 - slope * i0
                count = sum(1 for i, c in candidates if slope * i + offset in c)
                if best is None or count > best[0]:
                    best = (count, slope, offset)
    if best is None or best[0] < 0.9 * len(candidates):
        return "", {}
    _, slope, offset = best
    rule = f"index {slope}·i{offset:+d}" if slope != 1 else f"index i{offset:+d}"
    chosen = {i: slope * i + offset for i, c in candidates if slope * i + offset in c}
    return rule, chosen


@dataclass(frozen=True)
class TermAnalysis:
    term: str
    wrong_rows: tuple[int, ...]
    explanations: tuple[Explanation, ...]  # best first
    source: CoefficientSource | None

    @property
    def best(self) -> Explanation | None:
        return self.explanations[0] if self.explanations else None


def explain_term(
    term: str,
    fits: Sequence[RowFit],
    reference: ReferenceResult,
    args: Args,
    *,
    output_dtype: torch.dtype,
    fill: FillPattern | None,
    guard_bytes: int,
    nonfinite_rows: Sequence[int] = (),
) -> TermAnalysis:
    """Which rows have a wrong coefficient on ``term``, and which hypotheses explain them."""
    expected = reference.coefficients[term].detach().to("cpu", torch.float64)
    precision = _relative_precision(output_dtype)
    wrong: list[RowFit] = []
    for fit in fits:
        if not fit.explained or term not in fit.coefficients:
            continue
        c, e = fit.coefficients[term], float(expected[fit.row])
        tolerance = max(
            4 * fit.stderr.get(term, 0.0),
            2 * precision * max(abs(e), abs(c)),
            fit.resolution(term, precision),
            1e-12,
        )
        if abs(c - e) > tolerance:
            wrong.append(fit)
    source = reference.sources.get(term)
    wrong_rows = tuple(f.row for f in wrong)
    if not wrong and not nonfinite_rows:
        return TermAnalysis(term, (), (), source)

    def tol_for(fit: RowFit) -> tuple[float, float]:
        return max(precision, 1e-6), max(4 * fit.stderr.get(term, 0.0), 1e-9)

    explanations: list[Explanation] = []
    tensor = args.get(source.arg) if source is not None else None
    index = source.index.detach().to("cpu", torch.long) if source is not None else None

    # dtype: the argument's bytes read as another dtype at the row's own index
    if source is not None and isinstance(tensor, torch.Tensor) and index is not None:
        model = read_model(tensor, fill, guard_bytes)
        probe = [source.read_as] + [d for d in _PROBE_DTYPES if d != source.read_as]
        for dtype in probe:
            if dtype == tensor.dtype:
                continue
            values, past_end = model.values(dtype)
            matched: list[int] = []
            past: list[int] = []
            unverified: list[int] = []
            examples: list[dict[str, float | int | str | None]] = []
            for fit in wrong:
                i = int(index[fit.row])
                if model.tail is None and i * dtype.itemsize >= model.nbytes:
                    matched.append(fit.row)
                    past.append(fit.row)
                    unverified.append(fit.row)
                    continue
                if i < 0 or i >= values.numel():
                    continue
                raw = float(values[i])
                targets = [raw, float(_round_to(torch.tensor([raw], dtype=torch.float64), output_dtype)[0])]
                rel, absolute = tol_for(fit)
                c = fit.coefficients[term]
                if any(_close(c, t, rel, absolute) for t in targets):
                    matched.append(fit.row)
                    if bool(past_end[i]):
                        past.append(fit.row)
                    if len(examples) < 8:
                        examples.append(
                            {
                                "row": fit.row,
                                "fitted": c,
                                "expected": float(expected[fit.row]),
                                "predicted": raw,
                                "byte_offset": i * dtype.itemsize,
                            }
                        )
            for row in nonfinite_rows:
                i = int(index[row])
                if model.tail is None and i * dtype.itemsize >= model.nbytes:
                    matched.append(row)
                    past.append(row)
                    unverified.append(row)
                elif 0 <= i < values.numel() and not math.isfinite(float(values[i])):
                    matched.append(row)
                    if bool(past_end[i]):
                        past.append(row)
            if matched:
                what = f"the bytes of {source.arg} read as {dtype_name(dtype)}"
                if dtype == source.read_as:
                    what += " (the type the kernel reads)"
                explanations.append(
                    Explanation(
                        "dtype",
                        dtype_name(dtype),
                        f"{what}, at the element the row should read",
                        tuple(sorted(matched)),
                        tuple(examples),
                        tuple(sorted(past)),
                        tuple(sorted(unverified)),
                    )
                )

    # scale: expected coefficient times / divided by a per-row scale
    for name, scale_values in reference.scales.items():
        scales = scale_values.detach().to("cpu", torch.float64)
        for operation in ("*", "/"):
            matched, examples = [], []
            for fit in wrong:
                s = float(scales[fit.row])
                if s == 0 or not math.isfinite(s) or abs(s - 1.0) < 1e-6:
                    continue
                target = float(expected[fit.row]) * (s if operation == "*" else 1.0 / s)
                rel, absolute = tol_for(fit)
                if _close(fit.coefficients[term], target, rel, absolute):
                    matched.append(fit.row)
                    if len(examples) < 8:
                        examples.append(
                            {
                                "row": fit.row,
                                "fitted": fit.coefficients[term],
                                "expected": float(expected[fit.row]),
                                name: s,
                            }
                        )
            if matched:
                verb = "multiplied by" if operation == "*" else "divided by"
                explanations.append(
                    Explanation(
                        "scale",
                        f"{name}{operation}",
                        f"the expected coefficient {verb} {name} (a scale applied to the {term} term)",
                        tuple(matched),
                        tuple(examples),
                    )
                )

    # multiple: the term applied k times
    for k in _MULTIPLES:
        matched, examples = [], []
        for fit in wrong:
            e = float(expected[fit.row])
            rel, absolute = tol_for(fit)
            if e != 0 and _close(fit.coefficients[term], k * e, rel, absolute):
                matched.append(fit.row)
                if len(examples) < 8:
                    examples.append({"row": fit.row, "fitted": fit.coefficients[term], "expected": e})
        if matched:
            times = f"{k:g} times" if k >= 1 else f"{k:g} of"
            explanations.append(
                Explanation(
                    "multiple",
                    f"{k:g}x",
                    f"{times} the expected coefficient",
                    tuple(matched),
                    tuple(examples),
                )
            )

    # other_term: the coefficient another term should have carried
    for other, other_values in reference.coefficients.items():
        if other == term:
            continue
        others = other_values.detach().to("cpu", torch.float64)
        matched, examples = [], []
        for fit in wrong:
            target = float(others[fit.row])
            rel, absolute = tol_for(fit)
            if abs(target - float(expected[fit.row])) > 1e-12 and _close(
                fit.coefficients[term], target, rel, absolute
            ):
                matched.append(fit.row)
                if len(examples) < 8:
                    examples.append({"row": fit.row, "fitted": fit.coefficients[term], other: target})
        if matched:
            explanations.append(
                Explanation(
                    "other_term",
                    other,
                    f"the coefficient the {other} term should carry",
                    tuple(matched),
                    tuple(examples),
                )
            )

    # other_row: the argument's value at another index
    if source is not None and isinstance(tensor, torch.Tensor) and index is not None and tensor.numel():
        values = tensor.detach().to("cpu").flatten().to(torch.float64)
        rounded = _round_to(values, output_dtype)
        matched, examples = [], []
        candidates: list[tuple[int, list[int]]] = []
        nearest: dict[int, int] = {}
        chance = 0.0
        spread = float(values.max() - values.min()) if values.numel() > 1 else 0.0
        for fit in wrong:
            c = fit.coefficients[term]
            rel, absolute = tol_for(fit)
            width = max(rel * abs(c), absolute)
            distance = torch.minimum((values - c).abs(), (rounded - c).abs())
            own = int(index[fit.row])
            if 0 <= own < values.numel():
                distance[own] = math.inf
            close = torch.nonzero(distance <= width).flatten()
            if close.numel() == 0:
                continue
            order = torch.argsort(distance[close])[:32]
            matched.append(fit.row)
            candidates.append((own, [int(j) for j in close[order]]))
            nearest[fit.row] = int(close[order[0]])
            if spread > 0:
                chance += min(1.0, values.numel() * 2 * width / spread)
        mapping, chosen = _mapping(candidates)
        for fit in wrong:
            if fit.row not in nearest or len(examples) >= 8:
                continue
            j = chosen.get(int(index[fit.row]), nearest[fit.row])
            examples.append(
                {
                    "row": fit.row,
                    "fitted": fit.coefficients[term],
                    "expected": float(expected[fit.row]),
                    "matched_index": j,
                    "matched_value": float(values[j]),
                }
            )
        if matched:
            if mapping:
                chance = 0.0  # one rule for ≥ 90 % of the rows is no coincidence
            explanations.append(
                Explanation(
                    "other_row",
                    source.arg,
                    f"the value of {source.arg} at another index"
                    + (f" ({mapping} instead of i)" if mapping else ""),
                    tuple(matched),
                    tuple(examples),
                    mapping=mapping,
                    chance=chance,
                )
            )

    # zero
    matched = [
        fit.row
        for fit in wrong
        if abs(fit.coefficients[term])
        <= max(4 * fit.stderr.get(term, 0.0), 1e-3 * abs(float(expected[fit.row])))
    ]
    if matched:
        explanations.append(Explanation("zero", "0", "zero", tuple(matched), ()))

    explanations.sort(key=lambda ex: ex.rank, reverse=True)
    return TermAnalysis(term, wrong_rows, tuple(explanations), source)


# --------------------------------------------------------------------------------------------------------------
# findings
# --------------------------------------------------------------------------------------------------------------


def _contract_for(contracts: Sequence[TensorContract], arg: str) -> TensorContract | None:
    for contract in contracts:
        if contract.arg == arg:
            return contract
    return None


def decompose(
    actual: torch.Tensor,
    reference: ReferenceResult,
    bad_rows: Sequence[int],
    args: Args,
    *,
    contracts: Sequence[TensorContract],
    output_dtype: torch.dtype,
    fill: FillPattern | None,
    guard_bytes: int,
    variant: str = "baseline",
) -> list[Finding]:
    """Findings for the bad rows of one variant: wrong coefficients, what explains them, and a diagnosis."""
    if not bad_rows or not reference.terms:
        return []
    actual_cpu = actual.detach().to("cpu", torch.float64)
    finite_rows = [r for r in bad_rows if bool(torch.isfinite(actual_cpu[r]).all())]
    nonfinite_rows = [r for r in bad_rows if r not in set(finite_rows)]
    fits = fit_rows(actual_cpu, reference, finite_rows)
    findings: list[Finding] = []
    unexplained = [fit for fit in fits if not fit.explained]
    analyses = [
        explain_term(
            term,
            fits,
            reference,
            args,
            output_dtype=output_dtype,
            fill=fill,
            guard_bytes=guard_bytes,
            nonfinite_rows=nonfinite_rows if term in reference.sources else (),
        )
        for term in reference.terms
    ]
    rows_meta = reference.rows

    def group_key(analysis: TermAnalysis) -> tuple[object, ...] | None:
        best = analysis.best
        if best is None:
            return None
        return (best.kind, best.key, best.rows, analysis.source.arg if analysis.source else None)

    terms_sharing: dict[tuple[object, ...], list[str]] = {}
    for analysis in analyses:
        key = group_key(analysis)
        if key is not None:
            terms_sharing.setdefault(key, []).append(analysis.term)
    riders = _riders(analyses, bad_rows, unexplained)
    emitted: set[tuple[object, ...]] = set()
    for analysis in analyses:
        if not analysis.wrong_rows and not analysis.explanations:
            continue
        if analysis.term in riders:
            continue  # told inside the finding that explains these rows (see _riders)
        best = analysis.best
        wrong = analysis.wrong_rows
        key = group_key(analysis)
        if key is not None:
            if key in emitted:
                continue  # the same explanation for another term: reported once, naming every term
            emitted.add(key)
        shared = terms_sharing.get(key, [analysis.term]) if key is not None else [analysis.term]
        if len(shared) > 1:
            possessive = f"the {' and '.join(shared)} terms' coefficients are"
        else:
            possessive = f"the {analysis.term} term's coefficient is"
        if best is None:
            findings.append(
                Finding(
                    FindingKind.WRONG_COEFFICIENT,
                    f"rows {row_ranges(wrong)}: the {analysis.term} term carries a wrong coefficient that none of "
                    "the tested explanations (another dtype, a scale, a multiple, another row's value, zero) matches",
                    variant,
                    {
                        "term": analysis.term,
                        "rows": len(wrong),
                        "examples": _fit_examples(fits, analysis.term, wrong),
                    },
                    rows=wrong,
                    confidence=0.5,
                )
            )
            continue
        total = len(set(wrong) | set(best.rows))
        message = (
            f"rows {row_ranges(best.rows)}: {possessive} {best.description} "
            f"({len(best.rows)}/{total} rows with a wrong coefficient match)"
        )
        alternatives = [
            {
                "hypothesis": ex.kind,
                "key": ex.key,
                "rows": len(ex.rows),
                "mapping": ex.mapping,
                "chance": ex.chance,
            }
            for ex in analysis.explanations[1:]
        ]
        evidence: dict[str, object] = {
            "term": analysis.term,
            "terms": list(shared),
            "hypothesis": best.kind,
            "key": best.key,
            "matched_rows": len(best.rows),
            "wrong_rows": total,
            "examples": list(best.examples),
            "alternatives": alternatives,
        }
        suggestions: tuple[str, ...] = ()
        source = analysis.source
        if best.kind == "dtype" and source is not None:
            tensor = args.get(source.arg)
            evidence.update(
                {
                    "argument": source.arg,
                    "argument_dtype": dtype_name(tensor.dtype) if isinstance(tensor, torch.Tensor) else None,
                    "read_as": best.key,
                    "past_end_rows": list(best.past_end_rows),
                }
            )
            if best.key == dtype_name(source.read_as) and isinstance(tensor, torch.Tensor):
                suggestions = (f"cast {source.arg}={best.key}",)
        if best.kind == "other_row" and best.mapping:
            evidence["mapping"] = best.mapping
        if best.kind == "dtype" and source is not None:
            echo = next(
                (ex for ex in analysis.explanations[1:] if ex.kind == "other_row" and ex.mapping), None
            )
            tensor = args.get(source.arg)
            if echo is not None and isinstance(tensor, torch.Tensor):
                read = _dtype_from_name(best.key)
                message += (
                    f"; the 'another row's value' pattern of rows {row_ranges(echo.rows)} ({echo.mapping}) "
                    f"follows from it: a {read.itemsize}-byte read at element i covers "
                    f"{dtype_name(tensor.dtype)} elements {read.itemsize // tensor.element_size()}·i and up"
                    if read.itemsize > tensor.element_size()
                    else ""
                )
        if riders and not any(f.kind is FindingKind.WRONG_COEFFICIENT for f in findings):
            for term, (rows, note) in riders.items():
                message += (
                    f"; in these rows the {term} term's fitted coefficient also strays (rows {row_ranges(rows)}, "
                    f"{note})"
                )
            evidence["also_deviating"] = {term: list(rows) for term, (rows, _) in riders.items()}
        findings.append(
            Finding(
                FindingKind.WRONG_COEFFICIENT,
                message,
                variant,
                evidence,
                rows=best.rows,
                confidence=_confidence(best, total),
                suggestions=suggestions,
            )
        )
        if best.kind == "dtype" and best.past_end_rows and source is not None:
            findings.append(_past_end_finding(best, source, args, variant, fill))
        findings.extend(_diagnosis(analysis, best, total, args, contracts, rows_meta, variant))
    if unexplained:
        worst = max(fit.residual for fit in unexplained)
        findings.append(
            Finding(
                FindingKind.UNEXPLAINED,
                f"rows {row_ranges(f.row for f in unexplained)} are not a combination of the reference's "
                f"ingredients ({', '.join(reference.terms)}): relative residual up to {worst:.3g} — wrong values "
                "inside the row, not a wrong per-row coefficient",
                variant,
                {"rows": len(unexplained), "max_residual": worst},
                rows=tuple(f.row for f in unexplained),
                confidence=1.0,
            )
        )
    return findings


PRIMARY_CONFIDENCE = 0.5
"""A term's explanation can stand as a diagnosis of its rows when it covers all of them with at least even odds."""


def _primary(analysis: TermAnalysis) -> bool:
    """Whether ``analysis``'s best explanation covers every row with a wrong coefficient on its term, with at least
    :data:`PRIMARY_CONFIDENCE`."""
    best = analysis.best
    if best is None:
        return False
    total = len(set(analysis.wrong_rows) | set(best.rows))
    return len(best.rows) == total and _confidence(best, total) >= PRIMARY_CONFIDENCE


def _riders(
    analyses: Sequence[TermAnalysis], bad_rows: Sequence[int], unexplained: Sequence[RowFit]
) -> dict[str, tuple[tuple[int, ...], str]]:
    """Terms whose wrong coefficients no hypothesis explains well (none, or one short of :func:`_primary`), in rows
    the primary explanations of other terms account for — when those account for every bad row. They are told
    inside the first primary finding (term → rows, what matched best), not as findings of their own: a diagnosis
    that explains every bad row stands without stray low-confidence lines beside it."""
    covered: set[int] = set()
    for analysis in analyses:
        if _primary(analysis):
            assert analysis.best is not None
            covered |= set(analysis.best.rows)
    if unexplained or not covered or not set(bad_rows) <= covered:
        return {}
    riders: dict[str, tuple[tuple[int, ...], str]] = {}
    for analysis in analyses:
        rows = tuple(sorted(set(analysis.wrong_rows) | set(analysis.best.rows if analysis.best else ())))
        if _primary(analysis) or not rows or not set(rows) <= covered:
            continue
        best = analysis.best
        if best is None:
            note = "which no tested explanation matches"
        else:
            note = f"best matched by {best.description} (confidence {_confidence(best, len(rows)):.2f})"
        riders[analysis.term] = (rows, note)
    return riders


def _fit_examples(fits: Sequence[RowFit], term: str, rows: Sequence[int]) -> list[dict[str, float | int]]:
    wanted = set(rows)
    return [
        {"row": fit.row, "fitted": fit.coefficients.get(term, math.nan), "residual": fit.residual}
        for fit in fits
        if fit.row in wanted
    ][:8]


def _confidence(best: Explanation, total: int) -> float:
    if total == 0:
        return 0.0
    coverage = best.weight / total
    if best.kind == "other_row" and best.chance:
        coverage *= max(0.0, 1.0 - best.chance / max(len(best.rows), 1))
    return max(0.0, min(1.0, coverage))


def _past_end_finding(
    best: Explanation, source: CoefficientSource, args: Args, variant: str, fill: FillPattern | None
) -> Finding:
    tensor = args[source.arg]
    itemsize = torch.empty(0, dtype=_dtype_from_name(best.key)).element_size()
    index = source.index.detach().to("cpu", torch.long)
    offsets = [int(index[r]) * itemsize for r in best.past_end_rows]
    nbytes = tensor.numel() * tensor.element_size()
    first = min(offsets) - nbytes
    last = max(offsets) + itemsize - 1 - nbytes
    content = f"guard fill {fill.name}" if fill is not None else "whatever memory follows it"
    return Finding(
        FindingKind.OOB_READ,
        f"reading {source.arg} as {best.key} runs past its end: rows {row_ranges(best.past_end_rows)} take their "
        f"coefficient from bytes {first}..{last} past the end of its {nbytes} bytes ({content})",
        variant,
        {
            "argument": source.arg,
            "bytes_past_end": [first, last],
            "argument_bytes": nbytes,
            "rows": len(best.past_end_rows),
            "fill": fill.name if fill is not None else None,
        },
        rows=best.past_end_rows,
        confidence=1.0,
    )


def _dtype_from_name(name: str) -> torch.dtype:
    from moereplay.format.tensors import torch_dtype

    dtype = torch_dtype(name)
    if dtype is None:
        raise ValueError(name)
    return dtype


def _diagnosis(
    analysis: TermAnalysis,
    best: Explanation,
    total: int,
    args: Args,
    contracts: Sequence[TensorContract],
    rows: RowMap,
    variant: str,
) -> list[Finding]:
    source = analysis.source
    confidence = _confidence(best, total)
    if best.kind == "dtype" and source is not None:
        tensor = args.get(source.arg)
        contract = _contract_for(contracts, source.arg)
        actual_dtype = dtype_name(tensor.dtype) if isinstance(tensor, torch.Tensor) else "?"
        reads_as = dtype_name(source.read_as)
        if best.key == reads_as and actual_dtype != reads_as:
            checked = contract.host_checked if contract is not None else False
            return [
                Finding(
                    FindingKind.DIAGNOSIS,
                    f"caller: {source.arg} is {actual_dtype}, but the kernel reads it as {reads_as}"
                    + ("" if checked else " and its host code does not check")
                    + f"; reading those bytes as {reads_as} reproduces the applied coefficients of "
                    f"{len(best.rows)}/{total} wrong rows. The kernel does what it was given — the call breaks "
                    f"its contract. Test: --cast {source.arg}={reads_as}",
                    variant,
                    {
                        "blame": "caller",
                        "argument": source.arg,
                        "argument_dtype": actual_dtype,
                        "kernel_reads": reads_as,
                        "host_checked": checked,
                        "explained_rows": len(best.rows),
                        "wrong_rows": total,
                    },
                    rows=best.rows,
                    confidence=confidence,
                    suggestions=(f"cast {source.arg}={reads_as}",),
                )
            ]
        return [
            Finding(
                FindingKind.DIAGNOSIS,
                f"kernel: it reads {source.arg} as {best.key}, not as {reads_as} as its contract says "
                f"({len(best.rows)}/{total} wrong rows match)",
                variant,
                {
                    "blame": "kernel",
                    "argument": source.arg,
                    "read_as_observed": best.key,
                    "kernel_reads": reads_as,
                },
                rows=best.rows,
                confidence=confidence,
            )
        ]
    if best.kind in ("other_row", "zero", "scale", "multiple", "other_term"):
        violations = []
        if source is not None:
            contract = _contract_for(contracts, source.arg)
            tensor = args.get(source.arg)
            if contract is not None and isinstance(tensor, torch.Tensor):
                from moereplay.ops.base import check_contract

                violations = check_contract(contract, args, check_device=False)
        if violations:
            return [
                Finding(
                    FindingKind.DIAGNOSIS,
                    f"undecided: the {analysis.term} coefficient is {best.description}, and {source.arg if source else '?'} "
                    f"breaks its contract ({'; '.join(v.describe() for v in violations)}); fix the call first",
                    variant,
                    {"blame": "undecided", "hypothesis": best.kind},
                    rows=best.rows,
                    confidence=confidence * 0.5,
                )
            ]
        where = f" (source {source.arg} matches its contract)" if source is not None else ""
        return [
            Finding(
                FindingKind.DIAGNOSIS,
                f"kernel: the {analysis.term} term's coefficient is {best.description} for "
                f"{len(best.rows)}/{total} wrong rows{where}; the arguments are what the kernel reads, so the "
                "kernel applies the wrong value",
                variant,
                {"blame": "kernel", "hypothesis": best.kind, "key": best.key, "mapping": best.mapping},
                rows=best.rows,
                confidence=confidence,
            )
        ]
    return []
