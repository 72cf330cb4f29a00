"""What the TUI asks of the replay engine, and what it gets back to render.

:func:`run_replay` is blocking (the screens call it from a thread worker): it runs
:func:`moereplay.replay.replay` for one call and its mutations and returns the engine's
:class:`~moereplay.replay.ReplayReport` together with the tensors the diff view and the heat map draw — each
variant's output, the fp32 reference and the rows the kernel writes. The engine keeps them when asked
(``replay(..., keep_tensors=True)`` fills ``report.tensors``); an engine without that option leaves
:attr:`ReplayOutcome.tensors_note` saying why there is nothing to draw. Nothing here judges anything: verdicts,
findings and the tensors are the engine's.

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
    kernel writes (others mean nothing); ``rows`` says what each row is (token / expert / slot), when known;
    ``allowance`` (float32 ``[rows, cols]``, named ``allowance_label``): the absolute rounding bound the variant
    was judged beyond, when its launch rounds partial sums to 16 bits.
    """

    output: torch.Tensor
    reference: torch.Tensor
    written: torch.Tensor
    rows: RowMap | None = None
    allowance: torch.Tensor | None = None
    allowance_label: str | None = None

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
        allowance = getattr(item, "allowance", None)
        tensors[str(label)] = VariantTensors(
            _matrix(output).cpu(),
            _matrix(reference).float().cpu(),
            item.written.cpu(),
            getattr(item, "rows", None),
            None if allowance is None else _matrix(allowance).float().cpu(),
            getattr(item, "allowance_label", None),
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
    if not request.tensors:
        return ReplayOutcome(request, report, {}, "", time.perf_counter() - start)
    tensors = _from_engine(report) if keep else None
    note = ""
    if tensors is None:
        tensors = {}
        note = "this replay engine does not return outputs (replay(..., keep_tensors=True)): nothing to draw"
    elif not tensors:
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
