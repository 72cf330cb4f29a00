"""What a reader reports: one call (:class:`CallRecord`), how the file was read (:class:`Recovery`), and
file-wide figures (:class:`CaptureStats`). All frozen; none holds tensor bytes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from moereplay.format.schema import TensorMeta, iter_tensor_metas

CallStatus = Literal["inputs_saved", "completed", "failed"]
"""``inputs_saved``: the arguments were recorded and no completion followed (e.g. the process died in the
kernel); ``completed``: outputs and timings were recorded after the call; ``failed``: the call raised and the
writer's caller recorded the error (outputs are whatever it passed, often empty)."""
CALL_STATUSES: tuple[CallStatus, ...] = ("inputs_saved", "completed", "failed")
COMPLETION_STATUSES: tuple[CallStatus, ...] = ("completed", "failed")


@dataclass(frozen=True)
class CallRecord:
    """One recorded kernel call, without tensor bytes.

    ``args`` and ``outputs`` are the recorded value trees with :class:`TensorMeta` where tensors were (and
    :class:`~moereplay.format.schema.CodecValue` where opaque objects were); ``outputs`` is ``None`` until
    the call completed. ``started``/``finished`` are wall-clock seconds since the epoch; ``timings`` are
    whatever the writer's caller measured (seconds unless its keys say otherwise).
    """

    index: int
    op: str
    site: str
    context: dict[Any, Any]
    parent: int | None
    status: CallStatus
    args: dict[str, Any]
    outputs: dict[str, Any] | None
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    static: tuple[str, ...] = ()
    started: float | None = None
    finished: float | None = None

    @property
    def layer(self) -> Any:
        """``context["layer"]`` when the capture recorded one."""
        return self.context.get("layer")

    @property
    def arg_tensors(self) -> dict[str, TensorMeta]:
        """Every tensor in the arguments, by path (``w1``, ``expert_map``, ``routing<RoutingData>.gate``)."""
        return dict(iter_tensor_metas(self.args))

    @property
    def output_tensors(self) -> dict[str, TensorMeta]:
        return dict(iter_tensor_metas(self.outputs)) if self.outputs is not None else {}

    def aliases(self) -> dict[str, tuple[str, ...]]:
        """Output tensor path → the argument tensor paths that were views of the same storage.

        An output written in place over an input shows up here (e.g. ``{"out": ("hidden_states",)}``).
        """
        by_storage: dict[int, list[str]] = {}
        for path, meta in self.arg_tensors.items():
            by_storage.setdefault(meta.storage, []).append(path)
        return {
            path: tuple(by_storage[meta.storage])
            for path, meta in self.output_tensors.items()
            if meta.storage in by_storage and meta.numel > 0
        }


@dataclass(frozen=True)
class DamagedCall:
    """A call the index or a scan found whose call or completion record cannot be read: ``problem`` says why
    (one line, naming the record). Listing shows it as damaged; the file's other calls still read and replay."""

    index: int
    problem: str


@dataclass(frozen=True)
class Recovery:
    """How much of the file could be read.

    ``complete``: a footer, its index chain and the tail were found and agree. ``footer_missing``: no footer
    was found (the writer did not close the file). ``truncated_at``: offset of the first byte that could not
    be read as a whole record (``None`` when the file ends on a record boundary). ``message``: one line.
    ``missing_bytes``: when the file ends inside a record whose length its envelope gives, the bytes of that
    record past the end of the file (``None`` otherwise).
    """

    complete: bool
    footer_missing: bool
    truncated_at: int | None
    calls_recovered: int
    message: str
    missing_bytes: int | None = None


@dataclass(frozen=True)
class CaptureStats:
    """File-wide figures, computed from call records (never from blob frames).

    ``unique_blob_bytes``: bytes of distinct blobs the calls refer to (what dedup stores);
    ``referenced_blob_bytes``: the same summed over every reference (what storing each call alone would need);
    ``tensor_bytes``: elements × item size over every recorded tensor (views counted separately);
    ``expanded_bytes``: the same plus what codec values (recipes) expand to — the tensors a replay holds;
    ``largest_call`` / ``largest_call_bytes``: the call whose arguments and outputs need the most memory to load
    (what the reader's budget checks: storages, expanded recipes, one generator draw per weight set);
    ``dedup_ratio`` = referenced ÷ unique (1.0 when there are no blobs). ``counters`` are the footer's
    writer-supplied counters (e.g. dropped calls), empty when the footer is missing.
    """

    calls: int
    by_op: dict[str, dict[str, int]]
    by_status: dict[str, int]
    file_bytes: int
    blobs: int
    unique_blob_bytes: int
    referenced_blob_bytes: int
    tensor_bytes: int
    dedup_ratio: float
    counters: dict[str, int]
    damaged: dict[int, str] = field(default_factory=dict)
    """Call index → why its records cannot be read (those calls are not in the other figures)."""
    expanded_bytes: int = 0
    largest_call: int | None = None
    largest_call_bytes: int = 0
