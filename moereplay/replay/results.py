"""The typed results of a replay: a verdict per variant and the report that holds them with the findings."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moereplay.replay.findings import Finding

if TYPE_CHECKING:
    import torch

    from moereplay.ops.base import RowMap


class Verdict(enum.Enum):
    """How one variant ended, worst first in :data:`SEVERITY` order."""

    OK = "ok"  # every written row within tolerance of the reference, no guard damage
    CORRUPT = "corrupt"  # rows over tolerance, or guard bytes written
    NONFINITE = "nonfinite"  # NaN / Inf where the reference is finite
    CRASH = "crash"  # the kernel killed its CUDA context / worker
    INVALID = (
        "invalid"  # outside the op's domain or rejected by the kernel's host checks: unresolved, never a pass
    )


SEVERITY = {Verdict.OK: 0, Verdict.CORRUPT: 1, Verdict.NONFINITE: 2, Verdict.CRASH: 3, Verdict.INVALID: 4}


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
    def failed(self) -> bool:
        return self.verdict is not Verdict.OK

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


@dataclass(frozen=True)
class ReplayReport:
    """Everything one replay of one call found. ``variants`` excludes the baseline.

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

    @property
    def results(self) -> tuple[VariantResult, ...]:
        return (self.baseline, *self.variants)

    @property
    def failed(self) -> bool:
        """Anything not ``ok``: the CLI's exit status 1."""
        return any(result.failed for result in self.results)

    def to_json(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "call": self.call,
            "site": self.site,
            "backend": self.backend,
            "device": self.device,
            "failed": self.failed,
            "results": [result.to_json() for result in self.results],
            "findings": [finding.to_json() for finding in self.findings],
            "notes": list(self.notes),
        }
