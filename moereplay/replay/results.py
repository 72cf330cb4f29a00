"""The typed results of a replay: a verdict per variant and the report that holds them with the findings."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from moereplay.replay.findings import Finding

if TYPE_CHECKING:
    import torch

    from moereplay.ops.base import RowMap


class Verdict(enum.Enum):
    """How one variant ended, worst first in :data:`SEVERITY` order (``needs-kernel``: not judged at all)."""

    OK = "ok"  # every written row within tolerance of the reference, no guard damage
    MEMORY_DEPENDENT = (
        "memory-dependent"  # within tolerance here, but the output changes with bytes outside its tensors
    )
    CORRUPT = "corrupt"  # rows over tolerance, or guard bytes written
    NONFINITE = "nonfinite"  # NaN / Inf where the reference is finite
    CRASH = "crash"  # the kernel killed its CUDA context / worker
    INVALID = (
        "invalid"  # outside the op's domain or rejected by the kernel's host checks: unresolved, never a pass
    )
    NEEDS_KERNEL = "needs-kernel"  # only a kernel run can answer it and none runs (offline): not judged


SEVERITY = {
    Verdict.OK: 0,
    Verdict.MEMORY_DEPENDENT: 1,
    Verdict.CORRUPT: 2,
    Verdict.NONFINITE: 3,
    Verdict.CRASH: 4,
    Verdict.INVALID: 5,
}
"""Judged verdicts, best to worst; ``needs-kernel`` is not among them (nothing was judged). A memory-dependent call
is never ``ok``, but an output that is wrong already is worse news than one that may go wrong."""

RECORDED = "recorded"
"""Label of the row that judges the captured output (what production saw) against the exact reference."""


class GuardStatus(enum.Enum):
    CLEAN = "clean"
    DAMAGED = "damaged"
    NOT_CHECKED = "n/a"  # reference backend, or the variant never ran


@dataclass(frozen=True)
class VariantResult:
    """One variant's outcome. Error figures are over the rows the kernel writes, against the fp32 reference.

    ``rows``: rows compared; ``bad_rows``: rows over the tolerance profile. ``bit_exact``: output bytes identical to
    the captured output (``None`` when the capture has no output to compare). ``reason``: why the verdict is
    ``invalid`` or ``crash`` (empty otherwise). ``elapsed_s``: kernel wall time per run (``None`` if not run).
    """

    label: str
    mutations: tuple[str, ...]
    verdict: Verdict
    reason: str = ""
    rows: int = 0
    bad_rows: int = 0
    max_rel: float = math.nan
    rms_rel: float = math.nan
    max_abs: float = math.nan
    nan: int = 0
    inf: int = 0
    bit_exact: bool | None = None
    guard: GuardStatus = GuardStatus.NOT_CHECKED
    elapsed_s: float | None = None
    tolerance: str = ""

    @property
    def judged(self) -> bool:
        """Whether an output was judged at all (``needs-kernel`` rows were not)."""
        return self.verdict is not Verdict.NEEDS_KERNEL

    @property
    def failed(self) -> bool:
        """Judged and not ``ok`` (a ``needs-kernel`` row neither passes nor fails)."""
        return self.judged and self.verdict is not Verdict.OK

    def to_json(self) -> dict[str, Any]:
        def number(value: float) -> float | None:
            return None if math.isnan(value) else (value if math.isfinite(value) else str(value))  # type: ignore[return-value]

        return {
            "label": self.label,
            "mutations": list(self.mutations),
            "verdict": self.verdict.value,
            "reason": self.reason,
            "rows": self.rows,
            "bad_rows": self.bad_rows,
            "max_rel": number(self.max_rel),
            "rms_rel": number(self.rms_rel),
            "max_abs": number(self.max_abs),
            "nan": self.nan,
            "inf": self.inf,
            "bit_exact": self.bit_exact,
            "guard": self.guard.value,
            "elapsed_s": self.elapsed_s,
            "tolerance": self.tolerance,
        }


@dataclass(frozen=True, eq=False)
class KeptTensors:
    """A variant's output beside its reference, kept for front ends that draw them (``keep_tensors=True``).

    ``output``: the kernel's output (or, on the reference backend, the captured one) as ``[rows, cols]`` on the CPU in
    its own dtype; ``reference``: fp32 ``[rows, cols]``; ``written``: bool ``[rows]``, the rows a correct kernel
    writes; ``rows``: what each row is (token / expert / slot / block). ``allowance``: the per-element absolute
    rounding bound the variant was judged beyond (float32 ``[rows, cols]``; launches that round partial sums to 16
    bits), named by ``allowance_label``; ``None`` when it was judged by its dtype's tolerance alone.
    """

    output: torch.Tensor
    reference: torch.Tensor
    written: torch.Tensor
    rows: RowMap
    allowance: torch.Tensor | None = None
    allowance_label: str | None = None


@dataclass(frozen=True)
class VariantOutcome:
    """One variant as a :class:`~moereplay.replay.session.ReplaySession` judged it: the verdict row, the findings
    about this variant (those the baseline already reported word for word are left out, one line says so), and its
    tensors when the session keeps them."""

    result: VariantResult
    findings: tuple[Finding, ...] = ()
    tensors: KeptTensors | None = None

    @property
    def label(self) -> str:
        return self.result.label

    @property
    def verdict(self) -> Verdict:
        return self.result.verdict


HeadlineSource = Literal["recorded", "replayed", "recorded and replayed", "nothing judged"]


@dataclass(frozen=True)
class Headline:
    """A call's verdict: the worse of its recorded output's and its replay's, and which of the two it is.

    ``result``: the row the verdict comes from (the replay's on a tie); ``source``: ``recorded`` (the captured
    output judged against the reference), ``replayed`` (the baseline replay), both when they agree, or ``nothing
    judged`` (offline without a captured output).
    """

    verdict: Verdict
    source: HeadlineSource
    result: VariantResult

    def __post_init__(self) -> None:
        if self.verdict is not self.result.verdict:
            raise ValueError(
                f"headline {self.verdict.value} differs from its row's {self.result.verdict.value}"
            )

    @property
    def text(self) -> str:
        """``"corrupt (recorded)"``."""
        return f"{self.verdict.value} ({self.source})"

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict.value, "source": self.source, "label": self.result.label}


def headline_of(recorded: VariantResult | None, replayed: VariantResult) -> Headline:
    """The worse (:data:`SEVERITY`) of the judged rows among ``recorded`` and ``replayed``."""
    judged = [result for result in (recorded, replayed) if result is not None and result.judged]
    if not judged:
        return Headline(replayed.verdict, "nothing judged", replayed)
    worst = max(SEVERITY[result.verdict] for result in judged)
    at_worst = [result for result in judged if SEVERITY[result.verdict] == worst]
    if len(at_worst) == 2:
        return Headline(replayed.verdict, "recorded and replayed", replayed)
    (result,) = at_worst
    return Headline(result.verdict, "replayed" if result is replayed else "recorded", result)


@dataclass(frozen=True)
class ReplayReport:
    """Everything one replay of one call found. ``variants`` excludes the baseline.

    ``recorded``: the captured output judged against the exact reference of the call as captured — what production
    saw — (``None`` when the capture holds no output); ``baseline``: the call as captured, replayed on the kernel
    (offline: ``needs-kernel``). :attr:`headline` is the worse of the two. Offline, variants are set beside the
    recorded row (the captured output judged against each changed call's reference); with a kernel, beside the
    baseline.

    ``tensors`` (label → :class:`KeptTensors`) is filled only when asked for (``keep_tensors``) and is not part of
    the JSON form; nor is ``phases``: seconds per phase of the session's work (see
    :class:`~moereplay.replay.timing.PhaseTimes`), for benchmarks.
    """

    op: str
    call: int | None
    backend: str
    device: str
    baseline: VariantResult
    variants: tuple[VariantResult, ...] = ()
    findings: tuple[Finding, ...] = ()
    site: str = ""
    notes: tuple[str, ...] = field(default=())
    tensors: Mapping[str, KeptTensors] = field(default_factory=dict, compare=False, repr=False)
    phases: Mapping[str, float] = field(default_factory=dict, compare=False, repr=False)
    recorded: VariantResult | None = None

    def __post_init__(self) -> None:
        if self.recorded is not None and self.recorded.label != RECORDED:
            raise ValueError(f"the recorded row is labelled {self.recorded.label!r}, not {RECORDED!r}")

    @property
    def results(self) -> tuple[VariantResult, ...]:
        """Every row, as the table shows them: recorded (when captured), baseline, then the variants."""
        head = (self.recorded,) if self.recorded is not None else ()
        return (*head, self.baseline, *self.variants)

    @property
    def headline(self) -> Headline:
        """The call's verdict: the worse of recorded and replayed, saying which."""
        return headline_of(self.recorded, self.baseline)

    @property
    def as_captured(self) -> VariantResult:
        """The judged row of the call as captured that variants are set beside: the replayed baseline, or offline
        (baseline not judged) the recorded row."""
        if self.baseline.judged or self.recorded is None:
            return self.baseline
        return self.recorded

    @property
    def failed(self) -> bool:
        """The CLI's exit status 1: the headline is not ``ok`` (also when nothing could be judged), or a judged
        variant is not; ``needs-kernel`` variants count neither way."""
        return self.headline.verdict is not Verdict.OK or any(result.failed for result in self.variants)

    def to_json(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "call": self.call,
            "site": self.site,
            "backend": self.backend,
            "device": self.device,
            "failed": self.failed,
            "headline": self.headline.to_json(),
            "results": [result.to_json() for result in self.results],
            "findings": [finding.to_json() for finding in self.findings],
            "notes": list(self.notes),
        }
