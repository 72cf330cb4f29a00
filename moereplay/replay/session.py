"""``ReplaySession``: one call loaded once against one backend, its variants evaluated one at a time.

The shape every client of the replay engine needs: ``replay()`` (run a list of variants, report), the TUI (add a
mutation, see its row), bisect (judge probe after probe). A session loads the call and decodes its arguments once,
keeps its kernel worker (or the in-process backend) and its reference cache, evaluates the baseline first (every
variant is judged beside it), and caches each variant's outcome::

    with ReplaySession("run.moe.zst", call=3, backend="pack:/opt/kernelpack") as session:
        session.baseline.verdict                          # the call as captured
        outcome = session.run("flip mul_topk_weights")    # a VariantOutcome: verdict row + its findings
        report = session.report()                         # every variant run so far + cross-variant findings

Evaluating one variant: apply the mutations (outside the op's domain → ``invalid``), check the kernel's contracts
over every tensor leaf (a violation the host code rejects → ``invalid``; others become findings and still run), get
the fp32 reference (cached across variants that change nothing it depends on), run the kernel on fresh guarded
buffers (in a worker process unless told otherwise: a device fault → ``crash``), compare, judge, and explain bad
rows (localisation, decomposition, diagnosis). Findings that need several variants — an output that changes with
the guard fill (then localised to a tensor and bytes, :mod:`moereplay.replay.overreads`), the variants that fix a
failing baseline — are made by :meth:`ReplaySession.report`.

Besides the baseline, the *recorded* row judges the captured output — what production saw — against the exact
reference of the call as captured (:attr:`ReplaySession.recorded`, once per session); a call's headline verdict is
the worse of the two (:attr:`~moereplay.replay.results.ReplayReport.headline`).

With the ``reference`` backend no kernel runs: the recorded row is the judgement of the call, the baseline is
``needs-kernel``, and a variant asks "is the captured output what this changed call computes?" — judged against the
variant's reference without coefficient fits or blame (its call never ran). A variant only a kernel run can answer
— a guard fill, a cast, or a change that leaves the reference as it was (launch configurations) — is
``needs-kernel``: shown, never judged, never failing the exit status.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
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
)
from moereplay.reference.compare import aligned, bit_exact
from moereplay.replay import localize
from moereplay.replay.backends import BackendSpec, load_backend, parse_backend
from moereplay.replay.decompose import decompose
from moereplay.replay.differences import element_difference
from moereplay.replay.execution import KernelRun
from moereplay.replay.fidelity import FidelityProbe, explain
from moereplay.replay.findings import Finding, FindingKind, expected_nondeterminism, row_ranges
from moereplay.replay.input_faults import given_nonfinite, scan_inputs
from moereplay.replay.memo import CallMemos, Key, args_key, memos_for
from moereplay.replay.memory import DEFAULT_GUARD_BYTES
from moereplay.replay.mutations import (
    BASELINE,
    DEFAULT_FILL,
    Cast,
    Fill,
    FillPattern,
    Variant,
    apply_variant,
    is_fill_only,
    parse_spec,
    parse_variants,
)
from moereplay.replay.overreads import FillEffect, ReadLocaliser, memory_dependence, written_bytes_equal
from moereplay.replay.padding import padding_of
from moereplay.replay.results import (
    RECORDED,
    SEVERITY,
    GuardStatus,
    KeptTensors,
    ReplayReport,
    VariantOutcome,
    VariantResult,
    Verdict,
)
from moereplay.replay.runner import InProcessRunner, Runner, RunRequest, WorkerRunner, pooled_worker
from moereplay.replay.source import LoadedCall, call_from_memory, load_call_cached, select_calls
from moereplay.replay.timing import PhaseTimes


@dataclass
class _Evaluation:
    """What the session keeps about a judged variant. ``output`` is kept for the baseline and fill-only variants
    (cross-variant analysis) and for every variant when tensors are kept."""

    variant: Variant
    outcome: VariantOutcome
    output: torch.Tensor | None
    reference: ReferenceResult | None


RECORDED_VARIANT = Variant((), RECORDED)
"""The call as captured, judged by its recorded output rather than a replay (no mutations, its own label)."""

_NO_REPLAY = "replaying the call needs a kernel backend: the recorded row judges the captured output"
_HYPOTHESIS_NOTE = (
    "offline, a variant that changes what the call computes judges the captured output against the changed "
    "call's reference: whether the kernel computed that call (a hypothesis), not whether the change fixes anything"
)
_NOTHING_RECORDED = "the capture holds no output for this call and no kernel backend runs: nothing to judge"
_FILL_NEEDS_KERNEL = (
    "needs a kernel backend: guard fills test the memory a kernel reads (the reference reads none)"
)
_CAST_NEEDS_KERNEL = (
    "needs a kernel backend: a cast changes the bytes the kernel reads, not what the call computes"
)
_SAME_MEANING = (
    "needs a kernel backend: the change leaves what the call computes as it was (the reference of the call as "
    "captured), only a kernel run shows its effect"
)

FOLLOW_FILLS: tuple[FillPattern, ...] = (FillPattern(0xFF), FillPattern(0x00))
"""The guard fills run, unasked, when a contract violation predicts reads past a tensor's end: all-ones (NaN / Inf
where the bytes are read as floats or e8m0 scales) and zeros (the baseline's own fill, shown as a row of its own)."""


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads included): two references that say the same thing."""
    return a is b or bit_exact(a, b)


def _kept(output: torch.Tensor, reference: ReferenceResult, allowance: Any) -> KeptTensors:
    """A judged output beside its reference, copied to the CPU (references are cached: hand out copies)."""
    return KeptTensors(
        output.detach().cpu().clone(),
        reference.output.detach().float().cpu().clone(),
        reference.written.detach().cpu().clone(),
        reference.rows,
        None if allowance is None else allowance.absolute.detach().float().cpu().clone(),
        None if allowance is None else allowance.label,
    )


def _shape_mismatch(actual: torch.Tensor, reference: ReferenceResult) -> str:
    return (
        f"output shape {tuple(actual.shape)} differs from the reference's {tuple(reference.output.shape)} "
        "(other elements, not only a leading batch dimension of 1)"
    )


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` → CUDA when available, else the CPU; a bare ``cuda`` gets the current index (set_device needs one)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    return target


class ReplaySession:
    """Replays one call: the baseline and any variant, one at a time, judged against the fp32 reference.

    ``source``: a capture path (with ``call`` = index; a file with one replayable call needs none), a
    :class:`LoadedCall`, or a ``CallRecord``-like object with an ``op`` name plus ``args`` (and optionally its
    captured ``output``) — a call that exists only in memory (e.g. a shrunk one), written to a temporary capture the
    session removes on :meth:`close`. ``backend``: ``auto`` | ``reference`` | ``vllm`` | ``pack:DIR`` |
    ``python:MODULE``. ``isolate``: run kernels in a worker process (default: yes for kernel backends);
    ``reuse_worker`` keeps that worker for later sessions in this process (start-up, imports and kernel JIT are paid
    once). ``timeout_s``: seconds a kernel run (and the worker's start) may take before it counts as a crash — keep
    it above a first launch's JIT (≈ 90 s for the Marlin MoE kernels on Hopper). ``localise_reads``: localise
    out-of-bounds reads when a fill variant shows one. ``keep_tensors``: keep every variant's output and reference
    (``VariantOutcome.tensors``, ``ReplayReport.tensors``). ``explain_fidelity``: when the replayed baseline is not
    bit-exact with the recorded output, :meth:`report` localises the difference and tests its candidate causes
    (:mod:`moereplay.replay.fidelity`; the fills and pinned variants it runs join the rows).
    """

    def __init__(
        self,
        source: str | Path | LoadedCall | Any,
        args: Mapping[str, Any] | None = None,
        *,
        call: int | None = None,
        backend: str = "auto",
        device: str | torch.device | None = None,
        repeat: int = 1,
        isolate: bool | None = None,
        timeout_s: float = 600.0,
        guard_bytes: int = DEFAULT_GUARD_BYTES,
        reuse_worker: bool = True,
        output: torch.Tensor | None = None,
        localise_reads: bool = True,
        keep_tensors: bool = False,
        explain_fidelity: bool = True,
    ) -> None:
        self.spec: BackendSpec = parse_backend(backend)
        self.device = resolve_device(device)
        if self.spec.needs_cuda and self.device.type != "cuda":
            raise ReplayError(
                f"the {self.spec.text} backend runs CUDA kernels; no CUDA device here (use --backend reference)"
            )
        self.repeat = max(1, repeat)
        self.guard = guard_bytes
        self.timeout_s = timeout_s
        self.localise_reads = localise_reads
        self.keep_tensors = keep_tensors
        self.explain_fidelity = explain_fidelity
        isolated = self.spec.runs_kernels if isolate is None else isolate
        self._isolated = isolated
        kernel_backend: KernelBackend | None = None
        if self.spec.kind == "python" or (self.spec.runs_kernels and not isolated):
            kernel_backend = load_backend(self.spec, self.device)  # a python backend may register the op
        self._temporary: Path | None = None
        self.runner: Runner | None = None
        self._owns_runner = True
        self.findings: list[Finding] = []
        self.notes: list[str] = []
        self.phases = PhaseTimes()
        """Seconds per phase of this session's work (``load``, ``apply``, ``reference``, ``kernel_roundtrip``,
        ``judge``, and the worker's own ``worker.*`` phases)."""
        self._evaluations: dict[tuple[tuple[str, ...], str], _Evaluation] = {}
        self._judged_allowances: dict[
            str, Any
        ] = {}  # label -> the ErrorAllowance the variant was judged with
        self._order: list[_Evaluation] = []
        self._recorded: _Evaluation | None = None
        self._recorded_judged = False
        self._given_said = False  # the "what it was given" diagnosis of reproduced NaN/Inf is said once
        # references without a CUDA-graph batch's padding rows (by id of the op's result: (result, trimmed))
        self._unpadded: dict[int, tuple[ReferenceResult, ReferenceResult]] = {}
        self._padding_said = False
        self._read_findings: dict[str, list[Finding]] = {}
        self._fill_effects: dict[str, FillEffect] = {}
        self._located: list[dict[str, Any]] = []
        self._located_note: str | None = None
        self._localised = False
        self._sanitizer: list[Finding] = []
        self._run_states: dict[str, Mapping[str, Any]] = {}  # label -> the op's run_state() of that run
        self._keep_outputs: set[tuple[str, ...]] = set()  # variants whose output the session keeps (fidelity)
        self._rerun: tuple[torch.Tensor | None] | None = None  # the baseline run a second time, once
        self._fidelity: list[Finding] | None = None
        self._memory: tuple[Finding | None, VariantResult] | None = None
        self._memory_effects: dict[str, FillEffect] = {}
        try:
            with self.phases.phase("load"):
                self.call: LoadedCall = self._resolve(source, args, call, output)
            self.op: OpSpec = self.call.op
            self._memos: CallMemos = memos_for(self.call)
            if self.spec.runs_kernels:
                with self.phases.phase("worker_start"):
                    self.runner = self._runner(isolated, reuse_worker, kernel_backend)
            self.baseline_contracts: list[ContractViolation] = contract_violations(
                self.op, self.call.args, check_device=False
            )
        except BaseException:
            self.close()
            raise

    # -- set-up and tear-down ---------------------------------------------------------------------------------

    def _resolve(
        self,
        source: str | Path | LoadedCall | Any,
        args: Mapping[str, Any] | None,
        call: int | None,
        output: torch.Tensor | None,
    ) -> LoadedCall:
        if isinstance(source, LoadedCall):
            return source
        if isinstance(source, (str, Path)):
            (index,) = select_calls(source, call=call) if call is None else (call,)
            return load_call_cached(source, index, self.device)
        op_name = getattr(source, "op", None)
        if isinstance(op_name, str) and args is not None:
            self._temporary = Path(tempfile.mkdtemp(prefix="moereplay-call-"))
            return call_from_memory(op_name, args, output, self.device, self._temporary)
        raise ReplayError("replay needs a capture path, a LoadedCall, or a CallRecord with its arguments")

    def _runner(self, isolated: bool, reuse_worker: bool, kernel_backend: KernelBackend | None) -> Runner:
        call = self.call
        if isolated and reuse_worker:
            self._owns_runner = False
            return pooled_worker(
                call.capture_path,
                call.index,
                self.spec.text,
                self.device,
                timeout_s=self.timeout_s,
                guard=self.guard,
            )
        if isolated:
            return WorkerRunner(
                call.capture_path,
                call.index,
                self.spec.text,
                self.device,
                timeout_s=self.timeout_s,
                guard=self.guard,
            )
        backend = kernel_backend if kernel_backend is not None else load_backend(self.spec, self.device)
        return InProcessRunner(self.op, call.args, backend, self.guard)

    def close(self) -> None:
        """Stop the worker this session started (a pooled one stays) and remove its temporary capture."""
        if self.runner is not None and self._owns_runner:
            self.runner.close()
        self.runner = None
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None

    def __enter__(self) -> ReplaySession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- variants ---------------------------------------------------------------------------------------------

    def variants(
        self, mutations: Sequence[str | Variant] = (), fills: Sequence[str | FillPattern] = ()
    ) -> list[Variant]:
        """Variants from mutation texts (sweeps expand), Variant objects and fill patterns; malformed texts raise
        :class:`~moereplay.errors.InvalidMutationError` before anything runs."""
        return parse_variants(self.op, mutations, fills)

    def _variant(self, variant: Variant | str) -> Variant:
        if isinstance(variant, Variant):
            return variant
        made = parse_variants(self.op, [variant])
        if len(made) != 1:
            raise InvalidMutationError(
                f"mutation {variant!r} makes {len(made)} variants; run them one at a time (see variants())"
            )
        return made[0]

    @property
    def baseline(self) -> VariantOutcome:
        """The call as captured, replayed (evaluated on first use; every variant is judged beside it). Offline
        (no kernel backend) it is ``needs-kernel``: :attr:`recorded` judges the captured output instead."""
        return self._evaluate(BASELINE).outcome

    @property
    def recorded(self) -> VariantOutcome | None:
        """The captured output — what production saw — judged against the exact reference of the call as
        captured; ``None`` when the capture holds no output. Judged once per session: offline it is the only
        judgement of the call as captured; with a kernel, a replay bit-exact with the capture makes it the
        baseline's row under its own label (same numbers; the findings are the baseline's)."""
        evaluation = self._judge_recorded()
        return None if evaluation is None else evaluation.outcome

    @property
    def _peer(self) -> str:
        """The label of the row variants are set beside: the replayed baseline, or offline the recorded row."""
        return "baseline" if self.spec.runs_kernels else RECORDED

    def run(self, variant: Variant | str) -> VariantOutcome:
        """Judge one variant (a :class:`Variant` or one mutation text); the same variant twice is judged once."""
        chosen = self._variant(variant)
        self.baseline  # noqa: B018 - the baseline first: variants are judged beside it
        self.recorded  # noqa: B018 - offline, variants are set beside the recorded row
        return self._evaluate(chosen).outcome

    def run_all(self, variants: Sequence[Variant | str]) -> list[VariantOutcome]:
        return [self.run(variant) for variant in variants]

    def follow_suggestions(self) -> list[VariantOutcome]:
        """Run every mutation the findings so far suggest (e.g. the cast a diagnosis proposes) not run yet."""
        outcomes = []
        seen = {evaluation.variant.specs for evaluation in self._order}
        for finding in list(self.findings):
            for suggestion in finding.suggestions:
                try:
                    variant = Variant((parse_spec(self.op, suggestion),))
                except MoereplayError:
                    continue
                if variant.specs not in seen:
                    seen.add(variant.specs)
                    outcomes.append(self.run(variant))
        return outcomes

    def follow_evidence(self) -> list[VariantOutcome]:
        """Run the variants that test what the call's contract violations predict, unasked: a violation that
        predicts reads past a tensor's end (:attr:`~moereplay.ops.base.ContractViolation.predicts_memory_dependence`)
        runs the guard fills :data:`FOLLOW_FILLS`, so a call whose output depends on those bytes is found
        ``memory-dependent`` rather than ``ok``. A note says what ran and why. Offline the fills are
        ``needs-kernel`` rows (no kernel runs; they fail nothing)."""
        predicting = [v for v in self.baseline_contracts if v.predicts_memory_dependence]
        if not predicting:
            return []
        seen = {evaluation.variant.specs for evaluation in self._order}
        fresh = [Variant((Fill(fill),)) for fill in FOLLOW_FILLS]
        fresh = [variant for variant in fresh if variant.specs not in seen]
        if not fresh:
            return []
        reasons = "; ".join(f"{v.arg} ({v.reads_past_end} bytes past its end)" for v in predicting)
        labels = ", ".join(variant.label for variant in fresh)
        note = f"following the evidence: contracts predict reads outside the tensors — {reasons}; "
        if self.spec.runs_kernels:
            note += f"ran {labels} to test them"
        else:
            note += f"{labels} would test them on a kernel backend (offline: needs-kernel)"
        self.notes.append(note)
        return [self.run(variant) for variant in fresh]

    def sanitize(self) -> list[Finding]:
        """Run the baseline under compute-sanitizer memcheck (kernel backends); its findings join the report."""
        from moereplay.replay.sanitize import sanitize_findings

        if not self.spec.runs_kernels:
            self.notes.append("--sanitize needs a kernel backend; skipped")
            return []
        found = sanitize_findings(self.call, self.spec, self.device, timeout_s=self.timeout_s)
        self._sanitizer.extend(found)
        return found

    # -- the reference ----------------------------------------------------------------------------------------

    def _reference_key(self, args: Args) -> tuple[Key, tuple[Any, ...]]:
        ignores: frozenset[str] = getattr(self.op, "reference_ignores", frozenset())
        return args_key(args, ignores)

    def reference_for(self, args: Args, key: tuple[Key, tuple[Any, ...]] | None = None) -> ReferenceResult:
        """The reference of ``args``, shared by variants that change only what the op says it ignores (launch
        configs, atomics, workspaces …) and by every session over the same loaded call. Keyed by value for plain
        arguments and small tensors, by identity + version for large ones (:mod:`moereplay.replay.memo`): a
        mutation that changes the reference (a flag flip, a cast, a re-derived routing) always misses. ``key``: this
        session's reference key of ``args``, when the caller has it already."""
        reference_key, pins = self._reference_key(args) if key is None else key
        cache = self._memos.references
        result: ReferenceResult | None = cache.get(reference_key)
        if result is None:
            result = self.op.reference(args)
            cache.put(reference_key, pins, result)
        return self._without_padding(args, result)

    def _without_padding(self, args: Args, result: ReferenceResult) -> ReferenceResult:
        """``result`` with the output rows of a CUDA-graph batch's padding tokens left out of ``written`` (not
        judged: :mod:`moereplay.replay.padding`), said once in a note; ``result`` itself for other calls. The same
        object for the same result, so a reference compares equal to itself across variants."""
        padding = padding_of(self.call.context)
        if padding is None:
            return result
        known = self._unpadded.get(id(result))
        if known is not None and known[0] is result:
            return known[1]
        rows = padding.rows(self.op, args, result.rows)
        if not self._padding_said:
            self._padding_said = True
            self.notes.append(padding.note(rows))
        trimmed = result
        if rows is not None and bool(rows.any()):
            written = result.written & ~rows.to(result.written.device)
            trimmed = dataclasses.replace(result, written=written)
        if len(self._unpadded) >= 32:  # as many as the reference cache keeps: never hold more results alive
            self._unpadded.pop(next(iter(self._unpadded)))
        self._unpadded[id(result)] = (result, trimmed)
        return trimmed

    def allowance_for(
        self,
        args: Args,
        reference: ReferenceResult,
        dtype: torch.dtype,
        key: tuple[Key, tuple[Any, ...]] | None = None,
    ) -> Any:
        """The op's rounding allowance for ``args`` (``None`` when it declares none), shared like the reference:
        keyed by what keys the reference (``key``, when the caller has it) plus the launch values the allowance
        reads among the arguments the reference ignores — the op's ``error_allowance_key(args)`` when it declares
        one (Marlin: reduction mode and K tile), else every plain one (reduction flags, tile sizes …); the tensors
        it ignores (output buffer, workspace) cannot change the bound."""
        from moereplay.reference.tolerance import op_error_allowance

        if getattr(self.op, "error_allowance", None) is None:
            return None
        reference_key, pins = self._reference_key(args) if key is None else key
        launch_key = getattr(self.op, "error_allowance_key", None)
        if launch_key is not None:
            launch: Any = ("op", launch_key(args))
        else:
            ignores: frozenset[str] = getattr(self.op, "reference_ignores", frozenset())
            launch = tuple(
                (name, args[name])
                for name in sorted(ignores)
                if name in args and isinstance(args[name], (bool, int, float, str, type(None)))
            )
        full_key = (reference_key, launch, str(dtype))
        cache = self._memos.allowances
        cached = cache.get(full_key)
        if cached is None:
            cached = (op_error_allowance(self.op, args, reference, dtype),)
            cache.put(full_key, pins, cached)
        return cached[0]

    # -- one variant ------------------------------------------------------------------------------------------

    def _evaluate(self, variant: Variant) -> _Evaluation:
        key = (variant.specs, variant.label)
        cached = self._evaluations.get(key)
        if cached is not None:
            return cached
        start = len(self.findings)
        result, output, reference = self._judge_variant(variant)
        allowance = self._judged_allowances.pop(variant.label, None)
        outcome = VariantOutcome(result, tuple(self.findings[start:]))
        keep_output = (
            self.keep_tensors
            or variant.is_baseline
            or is_fill_only(variant)
            or variant.specs in self._keep_outputs
        )
        if self.keep_tensors and output is not None and reference is not None:
            outcome = VariantOutcome(result, outcome.findings, _kept(output, reference, allowance))
        evaluation = _Evaluation(variant, outcome, output if keep_output else None, reference)
        self._evaluations[key] = evaluation
        self._order.append(evaluation)
        return evaluation

    def _judge_recorded(self) -> _Evaluation | None:
        """The recorded row (see :attr:`recorded`), judged on first use."""
        if self._recorded_judged:
            return self._recorded
        self._recorded_judged = True
        captured = self.call.captured_output
        if captured is None:
            return None
        baseline = self._evaluate(BASELINE)
        start = len(self.findings)
        output: torch.Tensor | None = None
        reference = baseline.reference
        replayed = baseline.output
        if replayed is not None and reference is not None:
            shaped = aligned(captured.to(replayed.device), replayed.shape)
            if shaped is not None and written_bytes_equal(replayed, shaped, reference.written):
                result = dataclasses.replace(
                    baseline.outcome.result,
                    label=RECORDED,
                    mutations=(),
                    bit_exact=None,
                    guard=GuardStatus.NOT_CHECKED,
                    elapsed_s=None,
                )
                self.notes.append(
                    "the recorded output is the replayed one byte for byte: the baseline's findings are the "
                    "recorded row's too"
                )
                tensors = baseline.outcome.tensors
                evaluation = _Evaluation(
                    RECORDED_VARIANT, VariantOutcome(result, (), tensors), shaped, reference
                )
                self._recorded = evaluation
                return evaluation
        result, output, reference = self._judge_captured(captured)
        allowance = self._judged_allowances.pop(RECORDED, None)
        outcome = VariantOutcome(result, tuple(self.findings[start:]))
        if self.keep_tensors and output is not None and reference is not None:
            outcome = VariantOutcome(result, outcome.findings, _kept(output, reference, allowance))
        self._recorded = _Evaluation(RECORDED_VARIANT, outcome, output, reference)
        return self._recorded

    def _judge_captured(
        self, captured: torch.Tensor
    ) -> tuple[VariantResult, torch.Tensor | None, ReferenceResult | None]:
        """The captured output against the reference of the call as captured (no kernel runs)."""
        variant = RECORDED_VARIANT
        try:
            with self.phases.phase("reference"):
                key = self._reference_key(self.call.args)
                reference = self.reference_for(self.call.args, key)
        except ReferenceError_ as error:
            return self._invalid(variant, f"no reference for this call: {error}")
        shaped = aligned(captured.to(reference.output.device), reference.output.shape)
        if shaped is None:
            return self._invalid(variant, _shape_mismatch(captured, reference))
        with self.phases.phase("judge"):
            result = self._judge(variant, self.call.args, reference, [shaped], None, None, key)
        if result.verdict is Verdict.INVALID:
            return result, None, None
        return result, shaped, reference

    def _invalid(self, variant: Variant, reason: str) -> tuple[VariantResult, None, None]:
        return VariantResult(variant.label, variant.specs, Verdict.INVALID, reason), None, None

    def _needs_kernel(self, variant: Variant, reason: str) -> tuple[VariantResult, None, None]:
        """Offline, a variant only a kernel run can answer: shown as such, never judged (no findings about it)."""
        return VariantResult(variant.label, variant.specs, Verdict.NEEDS_KERNEL, reason), None, None

    def _same_reference(self, reference: ReferenceResult) -> bool:
        """Whether ``reference`` says what the call as captured computes (offline, judging the recorded output
        against it again would only repeat the recorded row)."""
        try:
            captured = self.reference_for(self.call.args)
        except ReferenceError_:
            return False
        return _same_bytes(reference.output, captured.output) and _same_bytes(
            reference.written, captured.written
        )

    def _judge_variant(
        self, variant: Variant
    ) -> tuple[VariantResult, torch.Tensor | None, ReferenceResult | None]:
        """The variant's verdict row, its first output and its reference (``None`` when it did not run)."""
        op = self.op
        phases = self.phases
        with phases.phase("apply"):
            applied = apply_variant(op, self.call.args, variant, derived_cache=self._memos.derived)
        if applied.invalid_reason is not None:
            return self._invalid(variant, applied.invalid_reason)
        with phases.phase("contracts"):
            violations = contract_violations(op, applied.args, check_device=False)
        said = {(v.arg, v.aspect) for v in self.baseline_contracts}
        fresh = [v for v in violations if variant.is_baseline or (v.arg, v.aspect) not in said]
        self.findings.extend(localize.contract_violations(fresh, variant.label))
        rejected = [v for v in violations if v.host_checked]
        if rejected and self.spec.runs_kernels:
            return self._invalid(
                variant, "the kernel's host code rejects it: " + "; ".join(v.describe() for v in rejected)
            )
        if not self.spec.runs_kernels:
            if variant.is_baseline:  # the recorded row judges the call as captured
                return self._needs_kernel(
                    variant, _NO_REPLAY if self.call.captured_output is not None else _NOTHING_RECORDED
                )
            if any(isinstance(m, Fill) for m in variant.mutations):
                return self._needs_kernel(variant, _FILL_NEEDS_KERNEL)
            if any(isinstance(m, Cast) for m in variant.mutations):
                return self._needs_kernel(variant, _CAST_NEEDS_KERNEL)
        try:
            with phases.phase("reference"):
                reference_key = self._reference_key(applied.args)
                reference = self.reference_for(applied.args, reference_key)
        except ReferenceError_ as error:
            return self._invalid(variant, f"no reference for this call: {error}")
        run: KernelRun | None = None
        fill: FillPattern | None
        if self.spec.runs_kernels:
            assert self.runner is not None
            with phases.phase("kernel_roundtrip"):
                run = self.runner.run(RunRequest(variant, self.repeat))
            phases.merge(run.phases, "worker.")
            if run.state:
                self._run_states[variant.label] = run.state
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
                return result, None, reference
            if run.status == "rejected" or not run.outputs:
                return self._invalid(variant, f"the kernel rejected the call: {run.error}")
            with phases.phase("output_to_device"):
                outputs = [output.to(reference.output.device) for output in run.outputs]
            fill = applied.fill
        else:
            if self.call.captured_output is None:
                return self._needs_kernel(variant, _NOTHING_RECORDED)
            if self._same_reference(reference):
                return self._needs_kernel(variant, _SAME_MEANING)
            outputs = [self.call.captured_output.to(reference.output.device)]
            fill = None
            if _HYPOTHESIS_NOTE not in self.notes:
                self.notes.append(_HYPOTHESIS_NOTE)
        shaped = [aligned(output, reference.output.shape) for output in outputs]
        if any(output is None for output in shaped):
            if run is None:  # offline: the changed call has another shape, which only a kernel could produce
                return self._needs_kernel(
                    variant, "needs a kernel backend: " + _shape_mismatch(outputs[0], reference)
                )
            return self._invalid(variant, _shape_mismatch(outputs[0], reference))
        outputs = [output for output in shaped if output is not None]
        with phases.phase("judge"):
            result = self._judge(variant, applied.args, reference, outputs, run, fill, reference_key)
        if result.verdict is Verdict.INVALID:
            return result, None, None
        return result, outputs[0], reference

    def _judge(
        self,
        variant: Variant,
        args: Args,
        reference: ReferenceResult,
        outputs: Sequence[torch.Tensor],
        run: KernelRun | None,
        fill: FillPattern | None,
        reference_key: tuple[Key, tuple[Any, ...]] | None = None,
    ) -> VariantResult:
        from moereplay.reference.compare import Comparison, compare, profile_for

        label = variant.label
        actual = outputs[0]
        if actual.shape != reference.output.shape:
            return self._invalid(variant, _shape_mismatch(actual, reference))[0]
        phases = self.phases
        try:  # a launch that rounds partial sums to 16 bits is judged beyond its rounding bound
            with phases.phase("judge/allowance"):
                allowance = self.allowance_for(args, reference, actual.dtype, reference_key)
            if allowance is not None:
                self._judged_allowances[variant.label] = allowance  # kept beside the tensors for front ends
            profile = profile_for(actual.dtype) if allowance is None else allowance.profile(actual.dtype)
            absolute = None if allowance is None else allowance.absolute

            def judged(output: torch.Tensor) -> Comparison:
                return compare(
                    output, reference.output, rows_mask=reference.written, profile=profile, allowance=absolute
                )

            with phases.phase("judge/compare"):
                comparison = judged(actual)
        except ReferenceError_ as error:
            return self._invalid(variant, f"cannot compare: {error}")[0]
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
            with phases.phase("judge/bit_exact"):
                bit_exact = written_bytes_equal(actual, captured, reference.written)
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
        localizing = time.perf_counter()
        bad = list(comparison.bad_rows)
        corrupt = localize.corrupt_rows(
            bad, reference.written, reference.rows, actual, label, row_max_rel=comparison.row_max_rel
        )
        if corrupt is not None:
            findings.append(corrupt)
        # the comparison counted NaN/Inf in the written rows already: localise only when it found some (a float64
        # output is always localised: localize's float32 view may overflow where the comparison saw finite values)
        if nonfinite_actual or actual.dtype == torch.float64:
            nonfinite = localize.nonfinite(actual, reference.written, reference.rows, label)
            if nonfinite is not None:
                findings.append(nonfinite)
                if verdict is Verdict.OK and variant.is_baseline and not self._given_said:
                    # the reference makes the same NaN/Inf and every row is right: which input carries them
                    self._given_said = True
                    given = self._given_nonfinite(args, reference, actual, nonfinite, label)
                    if given is not None:
                        findings.append(given)
        repeats = localize.nondeterminism(outputs, reference.written, label)
        if (
            repeats is not None
            and allowance is not None
            and allowance.order_dependent
            and not comparison.bad_rows
            and all(not judged(output).bad_rows for output in outputs[1:])
        ):
            repeats = expected_nondeterminism(repeats, allowance.cause)
        if repeats is not None:
            findings.append(repeats)
        findings.extend(localize.guard_damage(damage, label))
        phases.add("judge/localize", time.perf_counter() - localizing)
        # a fill variant's story is told by the over-read analysis; offline, a variant's output is the captured one,
        # which its changed call never produced: no coefficient fits, no blame (only a kernel run can show them)
        explains = not is_fill_only(variant) and (run is not None or variant.is_baseline)
        if bad and explains:
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
        return result

    def _given_nonfinite(
        self, args: Args, reference: ReferenceResult, actual: torch.Tensor, nonfinite: Finding, label: str
    ) -> Finding | None:
        """The diagnosis of NaN/Inf the exact reference makes too: which inputs hold them (as the kernel reads
        them), or the exact computation's own overflow. A scan that fails adds a note instead: a diagnosis is
        never worth the replay."""
        try:
            with self.phases.phase("judge/inputs"):
                faults = scan_inputs(self.op, args)
                bad = ~torch.isfinite(actual.float()) & reference.written.to(actual.device)[:, None]
                expected = reference.output.to(actual.device)
                overflows = bool(torch.isinf(expected[bad]).any()) if bool(bad.any()) else False
        except Exception as error:  # reported, never raised into the replay
            self.notes.append(f"the scan of the call's inputs for non-finite values failed: {error}")
            return None
        return given_nonfinite(
            faults,
            nan=int(nonfinite.evidence.get("nan", 0)),
            inf=int(nonfinite.evidence.get("inf", 0)),
            rows=nonfinite.rows,
            reference_overflows=overflows,
            variant=label,
        )

    def _beyond_baseline(self, findings: list[Finding], variant: Variant) -> list[Finding]:
        """A variant's findings minus those the row it is set beside (the baseline; offline the recorded row)
        already reported word for word (one line says so)."""
        peer = self._peer
        said = {(f.kind, f.message) for f in self.findings if f.variant in ("baseline", peer)}
        fresh = [f for f in findings if (f.kind, f.message) not in said]
        if findings and not fresh:
            return [
                Finding(
                    FindingKind.CORRUPT_ROWS,
                    f"the same findings as the {peer} row: same rows"
                    + (", same explanation" if self.spec.runs_kernels else ""),
                    variant.label,
                    {"same_as": peer},
                    rows=findings[0].rows,
                )
            ]
        return fresh

    # -- across variants --------------------------------------------------------------------------------------

    def _rerun_baseline(self) -> torch.Tensor | None:
        """The baseline run a second time on fresh buffers (once per session; ``None`` without a kernel backend or
        when it did not run): the reproducibility check that over-reads, memory dependence and fidelity share."""
        if self._rerun is None:
            output: torch.Tensor | None = None
            if self.runner is not None:
                run = self.runner.run(RunRequest(BASELINE))
                if run.status == "ran" and run.outputs:
                    output = run.outputs[0]
            self._rerun = (output,)
        return self._rerun[0]

    def _reproducible(self, base: torch.Tensor, written: torch.Tensor) -> bool | None:
        """Whether the baseline is bit-reproducible (``None``: could not tell)."""
        again = self._rerun_baseline()
        return None if again is None else written_bytes_equal(again, base, written)

    def _over_reads(self) -> list[Finding]:
        """One finding per fill-only variant whose output differs from the baseline's (localised once)."""
        baseline = self._evaluate(BASELINE)
        if baseline.output is None or baseline.reference is None:
            return []
        written = baseline.reference.written
        found: list[Finding] = []
        for evaluation in self._order:
            label = evaluation.variant.label
            if not is_fill_only(evaluation.variant) or evaluation.output is None:
                continue
            if label not in self._read_findings:
                self._read_findings[label] = self._over_read(baseline, evaluation, written)
            found.extend(self._read_findings[label])
        return found

    def _over_read(
        self, baseline: _Evaluation, evaluation: _Evaluation, written: torch.Tensor
    ) -> list[Finding]:
        assert (
            evaluation.output is not None and baseline.output is not None and baseline.reference is not None
        )
        base = baseline.output
        if written_bytes_equal(evaluation.output, base, written):
            return []
        difference = element_difference(evaluation.output, base, written)
        self._fill_effects[evaluation.variant.label] = FillEffect(
            evaluation.variant.label, difference, evaluation.outcome.verdict.value
        )
        other = evaluation.variant.fill
        rows = list(difference.rows)
        message = (
            f"output changes with the guard fill ({DEFAULT_FILL.name} → {other.name}) in rows "
            f"{row_ranges(rows)}"
        )
        columns = difference.columns
        if columns is not None:
            message += f", columns {columns[0]}-{columns[1]}"
        message += ": the kernel reads out of bounds"
        evidence: dict[str, Any] = {"fills": [DEFAULT_FILL.name, other.name], "rows": len(rows)}
        experts = sorted(
            {
                int(e)
                for e in baseline.reference.rows.expert[torch.tensor(rows, dtype=torch.long)].tolist()
                if e >= 0
            }
        )
        if experts:
            evidence["experts"] = experts
        if self.localise_reads and self.runner is not None and not self._localised:
            self._localised = True  # one localisation per session is enough
            localiser = ReadLocaliser(
                self.op, self.call.args, self.device, self.guard, self.runner, self.baseline_contracts
            )
            located, note = localiser.localise(base, written, other, self._rerun_baseline())
            if note is not None:
                self.notes.append(note)
                self._located_note = note
            if located:
                message += "; " + "; ".join(text for text, _ in located)
                evidence["arguments"] = [item for _, item in located]
                self._located = [item for _, item in located]
        return [
            Finding(
                FindingKind.OOB_READ,
                message,
                evaluation.variant.label,
                evidence,
                rows=tuple(rows),
                columns=columns,
            )
        ]

    def _memory_dependence(self) -> tuple[Finding | None, VariantResult]:
        """The memory-dependence finding and the baseline row as the report shows it: ``memory-dependent`` in
        place of ``ok`` when a guard fill changes the output (the fill variants must have run: see
        :meth:`follow_evidence`). Established when the baseline is bit-reproducible, or when the fill's verdict is
        worse than the baseline's (a difference no run-to-run variation makes)."""
        baseline = self._evaluate(BASELINE)
        result = baseline.outcome.result
        if not self._fill_effects or baseline.output is None or baseline.reference is None:
            return None, result
        if self._memory is not None and len(self._memory_effects) == len(self._fill_effects):
            return self._memory
        reproducible = self._reproducible(baseline.output, baseline.reference.written)
        effects = [
            effect
            for effect in self._fill_effects.values()
            if reproducible or SEVERITY.get(Verdict(effect.verdict), 0) > SEVERITY.get(result.verdict, 0)
        ]
        self._memory_effects = dict(self._fill_effects)
        if not effects:
            self.notes.append(
                "guard fills change the output, but so does running the baseline again: memory dependence not "
                "established"
            )
            self._memory = (None, result)
            return self._memory
        unchanged = [
            e.variant.label
            for e in self._order
            if is_fill_only(e.variant) and e.output is not None and e.variant.label not in self._fill_effects
        ]
        predicted = [v for v in self.baseline_contracts if v.predicts_memory_dependence]
        finding = memory_dependence(
            effects, unchanged, self._located, predicted, baseline.reference.rows, self._located_note
        )
        if result.verdict is Verdict.OK:
            fills = ", ".join(effect.label for effect in effects)
            result = dataclasses.replace(
                result,
                verdict=Verdict.MEMORY_DEPENDENT,
                reason=f"within tolerance here, but the output changes with bytes outside its tensors ({fills})",
            )
        self._memory = (finding, result)
        return self._memory

    def _fidelity_findings(self) -> list[Finding]:
        """Why the replayed baseline is not bit-exact with the recorded output (once; nothing runs when it is)."""
        if self._fidelity is not None:
            return self._fidelity
        self._fidelity = []
        baseline = self._evaluate(BASELINE)
        captured = self.call.captured_output
        if (
            not self.explain_fidelity
            or not self.spec.runs_kernels
            or baseline.outcome.result.bit_exact is not False
            or baseline.output is None
            or baseline.reference is None
            or captured is None
        ):
            return self._fidelity
        recorded = aligned(captured.to(baseline.output.device), baseline.output.shape)
        if recorded is None:
            return self._fidelity

        def run(variant: Variant) -> torch.Tensor | None:
            self._keep_outputs.add(variant.specs)
            self.run(variant)
            evaluation = self._evaluations.get((variant.specs, variant.label))
            return None if evaluation is None else evaluation.output

        probe = FidelityProbe(
            op=self.op,
            args=self.call.args,
            replayed=baseline.output,
            recorded=recorded,
            written=baseline.reference.written,
            rows=baseline.reference.rows,
            rerun=self._rerun_baseline,
            run=run,
            run_in_environment=self._run_in_environment if self._isolated else None,
            replayed_state=self._run_states.get(BASELINE.label, {}),
            recorded_state=self.call.recorded_state,
            recorded_environment=self.call.environment,
        )
        with self.phases.phase("fidelity"):
            finding = explain(probe)
        if finding is not None:
            self._fidelity.append(finding)
        return self._fidelity

    def _run_in_environment(self, env: Mapping[str, str | None]) -> torch.Tensor | None:
        """The baseline once in a fresh worker whose environment has ``env`` set (``None``: unset)."""
        runner = WorkerRunner(
            self.call.capture_path,
            self.call.index,
            self.spec.text,
            self.device,
            timeout_s=self.timeout_s,
            guard=self.guard,
            env=env,
        )
        try:
            run = runner.run(RunRequest(BASELINE))
        except ReplayError as error:
            self.notes.append(f"the re-run under the recorded environment did not start: {error}")
            return None
        finally:
            runner.close()
        return run.outputs[0] if run.status == "ran" and run.outputs else None

    def _fixes(self) -> list[Finding]:
        """Which variants turn a failing baseline into ``ok`` — and whether they confirm a suggested fix. Offline
        nothing is fixed: a variant that is ``ok`` says the recorded output is what the changed call computes."""
        peer = self._evaluate(BASELINE).outcome.result
        if not self.spec.runs_kernels:
            recorded = self._judge_recorded()
            if recorded is None:
                return []
            peer = recorded.outcome.result
        if peer.verdict in (Verdict.OK, Verdict.INVALID, Verdict.NEEDS_KERNEL):
            return []
        evaluations = [e for e in self._order if not e.variant.is_baseline]
        fixed = [e for e in evaluations if e.outcome.verdict is Verdict.OK and not is_fill_only(e.variant)]
        still = [
            e for e in evaluations if e.outcome.result.failed and e.outcome.verdict is not Verdict.INVALID
        ]
        if not fixed:
            return []
        if not self.spec.runs_kernels:
            labels = [e.variant.label for e in fixed]
            return [
                Finding(
                    FindingKind.DIAGNOSIS,
                    f"the recorded output is what the call computes with: {'; '.join(labels)} — a hypothesis "
                    "about what the kernel did, not a fix (only a kernel run tests a fix)",
                    "all",
                    {"recorded_matches": labels},
                    confidence=0.8,
                )
            ]
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
        return [
            Finding(FindingKind.DIAGNOSIS, message, "all", evidence, confidence=1.0 if confirmed else 0.8)
        ]

    def report(self) -> ReplayReport:
        """The report over every variant run so far: verdict rows in the order they ran, their findings, then the
        cross-variant findings — fidelity (when the replay is not bit-exact with the recording; testing its causes
        runs variants), over-reads (localising one runs the kernel), fixes, and last the memory dependence that
        makes the baseline ``memory-dependent`` — and any sanitizer report."""
        self._evaluate(BASELINE)
        recorded = self._judge_recorded()
        fidelity = self._fidelity_findings()
        over_reads = self._over_reads()
        memory, baseline_result = self._memory_dependence()
        variants = [e for e in self._order if not e.variant.is_baseline]
        findings = [
            *self.findings,
            *fidelity,
            *over_reads,
            *self._fixes(),
            *([memory] if memory is not None else []),
            *self._sanitizer,
        ]
        kept = [*([recorded] if recorded is not None else []), *self._order]
        tensors = {e.variant.label: e.outcome.tensors for e in kept if e.outcome.tensors is not None}
        return ReplayReport(
            op=self.op.name,
            call=self.call.index,
            backend=self.spec.text,
            device=str(self.device) if self.spec.runs_kernels else f"{self.device} (reference only)",
            baseline=baseline_result,
            variants=tuple(e.outcome.result for e in variants),
            findings=tuple(findings),
            site=self.call.site,
            notes=tuple(self.notes),
            tensors=tensors,
            phases=self.phases.snapshot(),
            recorded=None if recorded is None else recorded.outcome.result,
        )
