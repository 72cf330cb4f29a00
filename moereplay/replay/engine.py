"""``replay()``: rerun one captured call as-is and with mutations, judge every variant, and explain failures.

The flow for one call:

1. load the call (capture file + index, or arguments given in memory) and decode its arguments;
2. parse the mutations into variants (one per CLI option; sweeps expand) — malformed ones raise
   :class:`~moereplay.errors.InvalidMutationError` before anything runs;
3. for the baseline and each variant: apply the mutations (outside the op's domain → verdict ``invalid``), check the
   kernel's contracts (a violation the host code rejects → ``invalid``; others become findings and still run),
   get the fp32 reference (cached across variants that change nothing it depends on), run the kernel on fresh
   guarded buffers (in a worker process unless told otherwise: a device fault → ``crash``), compare, judge;
4. findings: corrupt rows by expert/slot/block, NaN/Inf localised, repeats that differ, guard damage,
   contract violations, and the decomposition of bad rows into coefficients with explanations and a diagnosis;
5. across variants: outputs that change with the guard fill (an out-of-bounds read, then localised to one argument
   and a byte range by varying one guard at a time), variants that fix a failing baseline, and whether they
   confirm the diagnosis's suggestion.

With the ``reference`` backend no kernel runs: the *captured* output is judged against the reference (the offline
verdict), and a variant asks "does the captured output match the semantics of this changed call?".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moereplay.errors import InvalidMutationError, MoereplayError, ReferenceError_, ReplayError
from moereplay.ops.base import (
    Args,
    ContractViolation,
    KernelBackend,
    OpSpec,
    ReferenceResult,
    contract_args,
    contract_violations,
    tensor_leaves,
)
from moereplay.replay import localize
from moereplay.replay.backends import BackendSpec, load_backend, parse_backend
from moereplay.replay.decompose import decompose
from moereplay.replay.execution import KernelRun
from moereplay.replay.findings import Finding, FindingKind, row_ranges
from moereplay.replay.memory import DEFAULT_GUARD_BYTES, GuardWindow, storage_groups
from moereplay.replay.mutations import (
    BASELINE,
    DEFAULT_FILL,
    Fill,
    FillPattern,
    Variant,
    apply_variant,
    expand,
    parse_fill,
    parse_option,
    parse_spec,
)
from moereplay.replay.results import GuardStatus, ReplayReport, VariantResult, Verdict
from moereplay.replay.runner import InProcessRunner, Runner, RunRequest, WorkerRunner, pooled_worker
from moereplay.replay.source import LoadedCall, call_from_memory, load_call

_MUTATION_KINDS = ("flip", "set", "cast", "fill", "sweep")


def parse_variants(
    op: OpSpec, mutations: Sequence[str | Variant], fills: Sequence[str | FillPattern] = ()
) -> list[Variant]:
    """Variants from mutation texts (``"flip mul_topk_weights"``, ``"sweep moe_block_size=8,16"`` …), Variant
    objects and fill patterns, in order, without duplicates."""
    variants: list[Variant] = []
    for item in mutations:
        if isinstance(item, Variant):
            variants.append(item)
            continue
        kind, _, rest = item.strip().partition(" ")
        if kind.startswith("--"):
            kind = kind[2:]
        if kind not in _MUTATION_KINDS or not rest.strip():
            raise InvalidMutationError(
                f"mutation {item!r}: expected one of {', '.join(_MUTATION_KINDS)} and a value"
            )
        variants.extend(parse_option(op, kind, rest.strip()))
    for fill in fills:
        pattern = fill if isinstance(fill, FillPattern) else parse_fill(fill)
        variants.append(Variant((Fill(pattern),)))
    return [variant for variant in expand(variants) if not variant.is_baseline]


def _fill_only(variant: Variant) -> bool:
    return bool(variant.mutations) and all(isinstance(m, Fill) for m in variant.mutations)


def _written_bytes_equal(a: torch.Tensor, b: torch.Tensor, written: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    rows = written.to(a.device, torch.bool)
    return bool(
        torch.equal(
            a[rows].contiguous().view(torch.uint8), b.to(a.device)[rows].contiguous().view(torch.uint8)
        )
    )


@dataclass
class _Evaluation:
    """What the engine keeps about a variant after judging it (for cross-variant analysis)."""

    variant: Variant
    result: VariantResult
    output: torch.Tensor | None
    reference: ReferenceResult | None
    args: Args | None
    fill: FillPattern | None


class _Session:
    def __init__(
        self,
        call: LoadedCall,
        spec: BackendSpec,
        device: torch.device,
        *,
        repeat: int,
        isolate: bool,
        timeout_s: float,
        guard: int,
        kernel_backend: KernelBackend | None,
        reuse_worker: bool,
    ) -> None:
        self.call = call
        self.op = call.op
        self.spec = spec
        self.device = device
        self.repeat = max(1, repeat)
        self.guard = guard
        self.findings: list[Finding] = []
        self.notes: list[str] = []
        self._references: list[tuple[tuple[Any, ...], Args, ReferenceResult]] = []
        self.runner: Runner | None = None
        self._owns_runner = True
        if spec.runs_kernels:
            if isolate and reuse_worker:
                self.runner = pooled_worker(
                    call.capture_path, call.index, spec.text, device, timeout_s=timeout_s, guard=guard
                )
                self._owns_runner = False
            elif isolate:
                self.runner = WorkerRunner(
                    call.capture_path, call.index, spec.text, device, timeout_s=timeout_s, guard=guard
                )
            else:
                backend = kernel_backend if kernel_backend is not None else load_backend(spec, device)
                self.runner = InProcessRunner(self.op, call.args, backend, guard)
        self.baseline_contracts: list[ContractViolation] = contract_violations(
            self.op, call.args, check_device=False
        )
        self.baseline_violations = {(v.arg, v.aspect) for v in self.baseline_contracts}

    def close(self) -> None:
        if self.runner is not None and self._owns_runner:
            self.runner.close()

    # -- the reference ----------------------------------------------------------------------------------------

    def reference_for(self, args: Args) -> ReferenceResult:
        ignores: frozenset[str] = getattr(self.op, "reference_ignores", frozenset())
        key = tuple(
            (name, id(value) if isinstance(value, torch.Tensor) else repr(value))
            for name, value in sorted(args.items())
            if name not in ignores
        )
        for cached_key, _, result in self._references:
            if cached_key == key:
                return result
        result = self.op.reference(args)
        self._references.append((key, args, result))
        return result

    # -- one variant ------------------------------------------------------------------------------------------

    def _invalid(self, variant: Variant, reason: str) -> _Evaluation:
        result = VariantResult(variant.label, variant.specs, Verdict.INVALID, reason)
        return _Evaluation(variant, result, None, None, None, None)

    def evaluate(self, variant: Variant) -> _Evaluation:
        op = self.op
        applied = apply_variant(op, self.call.args, variant)
        if applied.invalid_reason is not None:
            return self._invalid(variant, applied.invalid_reason)
        violations = contract_violations(op, applied.args, check_device=False)
        new_violations = [
            v for v in violations if variant.is_baseline or (v.arg, v.aspect) not in self.baseline_violations
        ]
        self.findings.extend(localize.contract_violations(new_violations, variant.label))
        rejected = [v for v in violations if v.host_checked]
        if rejected and self.spec.runs_kernels:
            return self._invalid(
                variant, "the kernel's host code rejects it: " + "; ".join(v.describe() for v in rejected)
            )
        try:
            reference = self.reference_for(applied.args)
        except ReferenceError_ as error:
            return self._invalid(variant, f"no reference for this call: {error}")
        run: KernelRun | None = None
        fill: FillPattern | None
        if self.spec.runs_kernels:
            assert self.runner is not None
            run = self.runner.run(RunRequest(variant, self.repeat))
            if run.status == "crash":
                self.findings.append(
                    Finding(
                        FindingKind.CRASH,
                        f"{variant.label}: {run.error}",
                        variant.label,
                        {"error": run.error},
                    )
                )
                result = VariantResult(variant.label, variant.specs, Verdict.CRASH, run.error)
                return _Evaluation(variant, result, None, reference, applied.args, None)
            if run.status == "rejected" or not run.outputs:
                return self._invalid(variant, f"the kernel rejected the call: {run.error}")
            outputs = [output.to(reference.output.device) for output in run.outputs]
            fill = applied.fill
        else:
            if any(isinstance(m, Fill) for m in variant.mutations):
                return self._invalid(
                    variant, "guard fills need a kernel backend (the reference reads no memory)"
                )
            if self.call.captured_output is None:
                return self._invalid(
                    variant, "the capture holds no output for this call and no kernel backend runs"
                )
            outputs = [self.call.captured_output.to(reference.output.device)]
            fill = None
        actual = outputs[0]
        return self._judge(variant, applied.args, reference, actual, outputs, run, fill)

    def _judge(
        self,
        variant: Variant,
        args: Args,
        reference: ReferenceResult,
        actual: torch.Tensor,
        outputs: Sequence[torch.Tensor],
        run: KernelRun | None,
        fill: FillPattern | None,
    ) -> _Evaluation:
        from moereplay.reference.compare import compare, profile_for

        label = variant.label
        if actual.shape != reference.output.shape:
            return self._invalid(
                variant,
                f"output shape {tuple(actual.shape)} differs from the reference's {tuple(reference.output.shape)}",
            )
        try:
            comparison = compare(
                actual, reference.output, rows_mask=reference.written, profile=profile_for(actual.dtype)
            )
        except ReferenceError_ as error:
            return self._invalid(variant, f"cannot compare: {error}")
        damage = run.damage if run is not None else ()
        guard = (
            GuardStatus.NOT_CHECKED if run is None else (GuardStatus.DAMAGED if damage else GuardStatus.CLEAN)
        )
        nonfinite_actual = comparison.nan_actual + comparison.inf_actual
        if comparison.nonfinite_mismatch and nonfinite_actual:
            verdict = Verdict.NONFINITE
        elif comparison.bad_rows or damage:
            verdict = Verdict.CORRUPT
        else:
            verdict = Verdict.OK
        bit_exact = None
        captured = self.call.captured_output
        if run is not None and captured is not None:
            bit_exact = _written_bytes_equal(actual, captured, reference.written)
        result = VariantResult(
            label=label,
            mutations=variant.specs,
            verdict=verdict,
            rows=comparison.rows_compared,
            bad_rows=len(comparison.bad_rows),
            max_rel=comparison.max_rel,
            rms_rel=comparison.rms_rel,
            max_abs=comparison.max_abs,
            nan=comparison.nan_actual,
            inf=comparison.inf_actual,
            bit_exact=bit_exact,
            guard=guard,
            elapsed_s=run.elapsed_s if run is not None else None,
            tolerance=f"{comparison.tolerance.name} max {comparison.tolerance.max_rel:g} rms {comparison.tolerance.rms_rel:g}",
        )
        findings: list[Finding] = []
        bad = list(comparison.bad_rows)
        corrupt = localize.corrupt_rows(
            bad, reference.written, reference.rows, actual, label, row_max_rel=comparison.row_max_rel
        )
        if corrupt is not None:
            findings.append(corrupt)
        nonfinite = localize.nonfinite(actual, reference.written, reference.rows, label)
        if nonfinite is not None:
            findings.append(nonfinite)
        repeats = localize.nondeterminism(outputs, reference.written, label)
        if repeats is not None:
            findings.append(repeats)
        findings.extend(localize.guard_damage(damage, label))
        if bad and not _fill_only(variant):  # a fill variant's story is told by fill_sensitivity
            findings.extend(
                decompose(
                    actual,
                    reference,
                    bad,
                    contract_args(self.op, args),
                    contracts=self.op.contracts,
                    output_dtype=actual.dtype,
                    fill=fill,
                    guard_bytes=self.guard,
                    variant=label,
                )
            )
        if not variant.is_baseline:
            findings = self._beyond_baseline(findings, variant)
        self.findings.extend(findings)
        return _Evaluation(variant, result, actual, reference, args, fill)

    def _beyond_baseline(self, findings: list[Finding], variant: Variant) -> list[Finding]:
        """A variant's findings minus those the baseline already reported word for word (one line says so)."""
        said = {(f.kind, f.message) for f in self.findings if f.variant == "baseline"}
        fresh = [f for f in findings if (f.kind, f.message) not in said]
        if findings and not fresh:
            return [
                Finding(
                    FindingKind.CORRUPT_ROWS,
                    "the same failure as the baseline: same rows, same explanation",
                    variant.label,
                    {"same_as": "baseline"},
                    rows=findings[0].rows,
                )
            ]
        return fresh

    # -- across variants --------------------------------------------------------------------------------------

    def fill_sensitivity(
        self, baseline: _Evaluation, evaluations: Sequence[_Evaluation], localise: bool
    ) -> None:
        """An output that changes with the guard fill reads out of bounds; name the argument and bytes."""
        if baseline.output is None or baseline.reference is None:
            return
        written = baseline.reference.written
        for evaluation in evaluations:
            if not _fill_only(evaluation.variant) or evaluation.output is None:
                continue
            if _written_bytes_equal(evaluation.output, baseline.output, written):
                continue
            other = evaluation.variant.fill
            differing = (
                torch.nonzero(
                    (
                        evaluation.output.to(baseline.output.device)
                        .contiguous()
                        .view(torch.uint8)
                        .reshape(written.numel(), -1)
                        != baseline.output.contiguous().view(torch.uint8).reshape(written.numel(), -1)
                    ).any(dim=1)
                    & written.to(baseline.output.device)
                )
                .flatten()
                .tolist()
            )
            message = (
                f"output changes with the guard fill ({DEFAULT_FILL.name} → {other.name}) in rows "
                f"{row_ranges(differing)}: the kernel reads out of bounds"
            )
            evidence: dict[str, Any] = {"fills": [DEFAULT_FILL.name, other.name], "rows": len(differing)}
            if localise and self.runner is not None:
                located = self._localise_read(baseline.output, written, other)
                if located:
                    message += "; " + "; ".join(text for text, _ in located)
                    evidence["arguments"] = [item for _, item in located]
            self.findings.append(
                Finding(
                    FindingKind.OOB_READ, message, evaluation.variant.label, evidence, rows=tuple(differing)
                )
            )
            return  # one localisation per session is enough

    def _output_with(self, request: RunRequest) -> torch.Tensor | None:
        assert self.runner is not None
        run = self.runner.run(request)
        return run.outputs[0] if run.status == "ran" and run.outputs else None

    def _localise_read(
        self, base: torch.Tensor, written: torch.Tensor, other: FillPattern
    ) -> list[tuple[str, dict[str, Any]]]:
        again = self._output_with(RunRequest(BASELINE))
        if again is None or not _written_bytes_equal(again, base, written):
            self.notes.append("baseline is not bit-reproducible: out-of-bounds reads not localised")
            return []
        located: list[tuple[str, dict[str, Any]]] = []
        leaves = tensor_leaves(
            self.op, {**self.call.args, **self.op.make_scratch(self.call.args, self.device)}
        )
        for group in storage_groups(leaves):  # one guard band per storage: views of it share it
            name = group[0]
            output = self._output_with(RunRequest(BASELINE, fills={name: other}))
            if output is None or _written_bytes_equal(output, base, written):
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
            label = " (= " + ", ".join(group[1:]) + ")" if len(group) > 1 else ""
            text = f"{name}{label} is over-read" + (
                f" ({', '.join(parts)} affect the output)" if parts else ""
            )
            item: dict[str, Any] = {"argument": name, "extents": [[s, a, b] for s, (a, b) in sides]}
            if len(group) > 1:
                item["aliases"] = list(group[1:])
            predicted = [v for v in self.baseline_contracts if v.arg in group]
            if predicted:
                text += f", as its contract predicts: {predicted[0].consequence}"
                item["contract"] = predicted[0].describe()
            located.append((text, item))
        return located

    def _extent(
        self, base: torch.Tensor, written: torch.Tensor, name: str, side: str, other: FillPattern
    ) -> tuple[int, int] | None:
        """Nearest and farthest guard byte (counted from the span edge) whose content changes the output."""

        def changes(start: int, stop: int) -> bool:
            window = GuardWindow(name, side, start, stop, other)  # type: ignore[arg-type]
            output = self._output_with(RunRequest(BASELINE, windows=(window,)))
            return output is not None and not _written_bytes_equal(output, base, written)

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

    def fixes(self, baseline: _Evaluation, evaluations: Sequence[_Evaluation]) -> None:
        """Which variants turn a failing baseline into ``ok`` — and whether they confirm a suggested fix."""
        if baseline.result.verdict is Verdict.OK or baseline.result.verdict is Verdict.INVALID:
            return
        fixed = [e for e in evaluations if e.result.verdict is Verdict.OK and not _fill_only(e.variant)]
        still = [e for e in evaluations if e.result.verdict not in (Verdict.OK, Verdict.INVALID)]
        if not fixed:
            return
        suggested = {s for f in self.findings if f.kind is FindingKind.DIAGNOSIS for s in f.suggestions}
        confirmed = [e for e in fixed if set(e.variant.specs) & suggested]
        message = "fixed by: " + "; ".join(e.variant.label for e in fixed)
        if still:
            message += "; not fixed by: " + "; ".join(e.variant.label for e in still)
        evidence: dict[str, Any] = {
            "fixed_by": [e.variant.label for e in fixed],
            "not_fixed_by": [e.variant.label for e in still],
        }
        if confirmed:
            message += f" — confirms the diagnosis: {confirmed[0].variant.label} alone makes the call correct"
            evidence["confirmed"] = confirmed[0].variant.label
        self.findings.append(
            Finding(FindingKind.DIAGNOSIS, message, "all", evidence, confidence=1.0 if confirmed else 0.8)
        )


def _resolve_call(
    source: str | Path | LoadedCall | Any,
    args: Mapping[str, Any] | None,
    call: int | None,
    output: torch.Tensor | None,
    device: torch.device,
) -> LoadedCall:
    if isinstance(source, LoadedCall):
        return source
    if isinstance(source, (str, Path)):
        from moereplay.replay.source import select_calls

        (index,) = select_calls(source, call=call) if call is None else (call,)
        return load_call(source, index, device)
    op_name = getattr(source, "op", None)
    if isinstance(op_name, str) and args is not None:
        return call_from_memory(op_name, args, output, device)
    raise ReplayError("replay() needs a capture path, a LoadedCall, or a CallRecord with its arguments")


def replay(
    source: str | Path | LoadedCall | Any,
    args: Mapping[str, Any] | None = None,
    *,
    call: int | None = None,
    mutations: Sequence[str | Variant] = (),
    fills: Sequence[str | FillPattern] = (),
    backend: str = "auto",
    repeat: int = 1,
    sanitize: bool = False,
    device: str | torch.device | None = None,
    isolate: bool | None = None,
    timeout_s: float = 600.0,
    follow_suggestions: bool = False,
    localise_reads: bool = True,
    output: torch.Tensor | None = None,
    guard_bytes: int = DEFAULT_GUARD_BYTES,
    reuse_worker: bool = True,
) -> ReplayReport:
    """Replay one call (baseline + every variant) and return the typed report.

    ``source``: a capture path (with ``call`` = index; a file with one replayable call needs none), a
    :class:`LoadedCall`, or a ``CallRecord`` with ``args`` (and optionally its captured ``output``).
    ``mutations``: texts like ``"flip mul_topk_weights"``, ``"set thread_k=128+thread_n=64"``,
    ``"cast topk_weights=float32"``, ``"sweep moe_block_size=8,16,32"``, ``"fill 0xff"``, or :class:`Variant`s.
    ``backend``: ``auto`` | ``reference`` | ``vllm`` | ``pack:DIR``. ``isolate``: run kernels in a worker process
    (default: yes for kernel backends); ``reuse_worker`` keeps that worker for later calls in this process.
    ``follow_suggestions``: also run the mutations the findings suggest.
    """
    spec = parse_backend(backend)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    if spec.needs_cuda and target.type != "cuda":
        raise ReplayError(
            f"the {spec.text} backend runs CUDA kernels; no CUDA device here (use --backend reference)"
        )
    isolated = spec.runs_kernels if isolate is None else isolate
    kernel_backend = None
    if spec.kind == "python" or (spec.runs_kernels and not isolated):
        kernel_backend = load_backend(spec, target)  # a python backend may register the op the call names
    loaded = _resolve_call(source, args, call, output, target)
    op = loaded.op
    variants = parse_variants(op, mutations, fills)
    session = _Session(
        loaded,
        spec,
        target,
        repeat=repeat,
        isolate=isolated,
        timeout_s=timeout_s,
        guard=guard_bytes,
        kernel_backend=kernel_backend,
        reuse_worker=reuse_worker,
    )
    try:
        baseline = session.evaluate(BASELINE)
        evaluations = [session.evaluate(variant) for variant in variants]
        if follow_suggestions:
            seen = {variant.specs for variant in variants}
            for finding in list(session.findings):
                for suggestion in finding.suggestions:
                    try:
                        variant = Variant((parse_spec(op, suggestion),))
                    except MoereplayError:
                        continue
                    if variant.specs not in seen:
                        seen.add(variant.specs)
                        evaluations.append(session.evaluate(variant))
        session.fill_sensitivity(baseline, evaluations, localise_reads)
        session.fixes(baseline, evaluations)
        if sanitize:
            from moereplay.replay.sanitize import sanitize_findings

            if spec.runs_kernels:
                session.findings.extend(sanitize_findings(loaded, spec, target, timeout_s=timeout_s))
            else:
                session.notes.append("--sanitize needs a kernel backend; skipped")
    finally:
        session.close()
    return ReplayReport(
        op=op.name,
        call=loaded.index,
        backend=spec.text,
        device=str(target) if spec.runs_kernels else f"{target} (reference only)",
        baseline=baseline.result,
        variants=tuple(e.result for e in evaluations),
        findings=tuple(session.findings),
        site=loaded.site,
        notes=tuple(session.notes),
    )
