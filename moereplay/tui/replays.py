"""What the TUI asks of the replay engine, and what it gets back to render.

:func:`run_replay` is blocking (the screens call it from a thread worker): it runs
:func:`moereplay.replay.replay` for one call and its mutations and returns the engine's
:class:`~moereplay.replay.ReplayReport` together with the tensors the diff view and the heat map draw — each
variant's output, the fp32 reference and the rows the kernel writes. When the engine hands its tensors back
(``replay(..., keep_tensors=True)`` filling ``report.tensors``) those are used. Otherwise, for the ``reference``
backend, the same pieces are rebuilt from the engine's public parts (the captured output, and ``op.reference`` of
each variant's arguments); for kernel backends :attr:`ReplayOutcome.tensors_note` says why there is nothing to draw.
Nothing here judges anything: verdicts and findings are the engine's.

Heavy imports (torch, the engine) happen inside the functions.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from moereplay.ops.base import RowMap
    from moereplay.replay.results import ReplayReport


@dataclass(frozen=True)
class ReplayRequest:
    """One replay: call ``call`` of ``capture`` as captured plus one variant per mutation text.

    ``tensors``: also collect the tensors the diff view draws (the browser's verdict-only replays skip them).
    """

    capture: Path
    call: int
    mutations: tuple[str, ...] = ()
    backend: str = "auto"
    tensors: bool = True


@dataclass(frozen=True, eq=False)
class VariantTensors:
    """A variant's output next to its reference, as ``[rows, cols]`` CPU tensors.

    ``output`` keeps the kernel's dtype; ``reference`` is fp32; ``written`` (bool ``[rows]``) marks the rows the
    kernel writes (others mean nothing); ``rows`` says what each row is (token / expert / slot), when known.
    """

    output: torch.Tensor
    reference: torch.Tensor
    written: torch.Tensor
    rows: RowMap | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.reference.shape[0]), int(self.reference.shape[1]))

    def describe_row(self, row: int) -> str:
        if self.rows is None or not 0 <= row < self.rows.rows:
            return f"row {row}"
        return self.rows.describe(row)


@dataclass(frozen=True)
class ReplayOutcome:
    """The engine's report for a request, and the tensors behind it (by variant label) when available."""

    request: ReplayRequest
    report: ReplayReport
    tensors: Mapping[str, VariantTensors] = field(default_factory=dict)
    tensors_note: str = ""
    seconds: float = 0.0


def _matrix(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.ndim == 0:
        return tensor.reshape(1, 1)
    if tensor.ndim == 1:
        return tensor.reshape(1, -1)
    return tensor.reshape(-1, tensor.shape[-1])


def _engine_supports_tensors(replay: Any) -> bool:
    try:
        return "keep_tensors" in inspect.signature(replay).parameters
    except (TypeError, ValueError):
        return False


def _from_engine(report: Any) -> dict[str, VariantTensors] | None:
    kept = getattr(report, "tensors", None)
    if not isinstance(kept, Mapping):
        return None
    tensors: dict[str, VariantTensors] = {}
    for label, item in kept.items():
        output, reference = getattr(item, "output", None), getattr(item, "reference", None)
        if output is None or reference is None:
            continue
        tensors[str(label)] = VariantTensors(
            _matrix(output).cpu(),
            _matrix(reference).float().cpu(),
            item.written.cpu(),
            getattr(item, "rows", None),
        )
    return tensors


def _rebuilt_for_reference_backend(request: ReplayRequest, report: ReplayReport) -> dict[str, VariantTensors]:
    """The reference backend judges the captured output against each variant's reference: rebuild those pairs."""
    from moereplay.replay.engine import parse_variants
    from moereplay.replay.mutations import BASELINE, apply_variant
    from moereplay.replay.source import load_call

    loaded = load_call(request.capture, request.call, "cpu")
    if loaded.captured_output is None:
        return {}
    output = _matrix(loaded.captured_output)
    judged = {result.label for result in report.results if result.rows}
    tensors: dict[str, VariantTensors] = {}
    for variant in [BASELINE, *parse_variants(loaded.op, request.mutations)]:
        if variant.label not in judged:
            continue
        applied = apply_variant(loaded.op, loaded.args, variant)
        if applied.invalid_reason is not None:
            continue
        reference = loaded.op.reference(applied.args)
        if tuple(reference.output.shape) != tuple(output.shape):
            continue
        tensors[variant.label] = VariantTensors(
            output, reference.output.float().cpu(), reference.written.cpu(), reference.rows
        )
    return tensors


def run_replay(request: ReplayRequest) -> ReplayOutcome:
    """Replay the request's call (baseline and variants) and collect what the call view draws. Blocking."""
    import time

    from moereplay.replay import replay

    start = time.perf_counter()
    keep = request.tensors and _engine_supports_tensors(replay)
    options: dict[str, Any] = {"keep_tensors": True} if keep else {}
    report = replay(
        request.capture,
        call=request.call,
        mutations=list(request.mutations),
        backend=request.backend,
        **options,
    )
    tensors = _from_engine(report) if keep else None
    note = ""
    if not request.tensors:
        return ReplayOutcome(request, report, {}, "", time.perf_counter() - start)
    if tensors is None:
        if report.backend == "reference":
            tensors = _rebuilt_for_reference_backend(request, report)
        else:
            tensors = {}
            note = (
                f"the {report.backend} backend's outputs are not returned by this version of the replay engine; "
                "the diff view and heat map need replay(..., keep_tensors=True)"
            )
    if not tensors and not note:
        note = "nothing to draw: no variant produced an output to compare"
    return ReplayOutcome(request, report, tensors, note, time.perf_counter() - start)


def mutation_labels(op_name: str, text: str) -> tuple[str, ...]:
    """The variant labels one mutation text makes (a sweep makes several); raises ``InvalidMutationError``."""
    from moereplay.ops import get_op
    from moereplay.replay.engine import parse_variants

    return tuple(variant.label for variant in parse_variants(get_op(op_name), [text]))


@dataclass(frozen=True)
class MutableArgument:
    """A mutable argument of an op as the add-mutation dialog lists it."""

    name: str
    domain: str
    description: str


def mutable_arguments(op_name: str) -> tuple[MutableArgument, ...]:
    """What the op lets a replay change (raises ``UnknownOpError`` for ops no module declares)."""
    from moereplay.ops import get_op

    op = get_op(op_name)
    return tuple(MutableArgument(m.name, m.domain.describe(), m.description) for m in op.mutable)
