"""The capture settings: one typed object built at the edge from the ``MOEREPLAY_*`` environment.

Nothing here reads the environment at import time: :func:`settings_from_environ` takes the mapping it parses, so
tests (and the plugin's ``register()``) decide when. This module imports neither torch nor vLLM, because the
plugin parses the settings before it knows whether to load anything heavy.

Variables (all optional; every value is validated, a malformed one raises :class:`SettingsError` naming it):

=========================  =================================================================================
``MOEREPLAY_CAPTURE``      ``1``/``true``/``yes``/``on`` arms the plugin; unset, empty or ``0`` leaves vLLM untouched
``MOEREPLAY_DIR``          output directory (default ``./moereplay-captures/run-<UTC time>/``); one file per process,
                           ``rank{r}-pid{p}.zst``
``MOEREPLAY_OPS``          comma-separated fnmatch patterns of op names to record (default ``*``)
``MOEREPLAY_OPS_EXCLUDE``  comma-separated fnmatch patterns of op names never to record
``MOEREPLAY_LAYERS``       MoE layers to record: indices and inclusive ranges (``0-3,7``) and/or fnmatch
                           patterns on the layer name (``*.layers.1[0-9].*``)
``MOEREPLAY_STEPS``        forward steps to record: ``N``, ``A-B``, ``A-`` or ``-B`` (inclusive, from 0)
``MOEREPLAY_MAX_CALLS``    stop recording after this many calls (0 or unset: no limit)
``MOEREPLAY_MAX_BYTES``    stop writing when the file would pass this size (``512M``, ``2G``, ``1GiB``, bytes),
                           counting the weights a call writes the first time
``MOEREPLAY_PER_SHAPE``    at most N calls per distinct (op, argument shapes/dtypes/scalars) signature
``MOEREPLAY_SAMPLE``       keep this fraction of eligible calls, evenly spaced (``0.25`` or ``1/4``)
``MOEREPLAY_TRIGGER``      ``always`` (default: record every selected call) or ``flight`` (see below)
``MOEREPLAY_FLIGHT_CALLS`` flight recorder: how many recent calls the ring keeps (default 16)
``MOEREPLAY_FLIGHT_BYTES`` flight recorder: device memory the ring may hold (default 1G)
``MOEREPLAY_FLIGHT_GRAPH_BYTES``  layer-scope flight recorder: device memory of the ring that keeps layer calls
                           replayed from CUDA graphs, per device (default 256M; ``0``: such calls are not kept)
``MOEREPLAY_FLIGHT_BESIDE_BYTES``  layer-scope flight recorder: an eager call whose dynamic inputs take at least
                           this much of the ring has them copied on a side stream while it runs (default 8M, a
                           prefill's hidden states; ``0``: always one copy after the call)
``MOEREPLAY_FLIGHT_OUTPUT_BYTES``  layer-scope flight recorder: an eager call's one returned output of at least
                           this many bytes is checked (its largest magnitude, as a call's first floating-point
                           output always is) but its bytes are not kept (default 0: every output kept). A
                           trigger's file then holds the call's inputs and, for that output, a marker with its
                           shape and dtype; the call's flight magnitude is its check, and beside it the 64-bit
                           fingerprint of its bytes the same pass reduces (``device_ring.byte_fingerprint``).
                           ``moereplay expand`` regenerates it and judges the re-run bit-exact or not by the
                           fingerprints (by the magnitudes alone where there is none). At prefill the output's
                           copy is 47 MB written per gpt-oss layer call at 8,192 tokens
``MOEREPLAY_FLIGHT_LEAN_BYTES``  layer-scope flight recorder: an eager call whose dynamic inputs take at least this
                           many bytes (prefill), that leaves them intact and returns one checked output, keeps
                           its bytes only if that check fails (default 0: off; it takes precedence over
                           ``FLIGHT_BESIDE_BYTES`` and ``FLIGHT_OUTPUT_BYTES`` for such calls). Ring room is
                           reserved as usual (the ring laps as fast), the output is checked where it is, and a
                           second launch copies the inputs and the output into the ring only when the check is
                           bad (NaN, Inf, or over ``MOEREPLAY_ABSMAX``) — a good call costs one read of its
                           output instead of copying ≈ 2 × its bytes. A trigger's file then holds the bad call
                           whole (its inputs as the call left them) but none of the lean calls before it whose
                           check passed or was lost (counted ``flight_lean_left_out``): a prefill's history is
                           the failing call only. Where the two launches cannot be made (no Triton, more than
                           24 tensors, an output the kernel cannot reduce) every byte is copied, and such a
                           good call is left out all the same
``MOEREPLAY_FLIGHT_GRAPH_STAGE``  layer-scope flight recorder under CUDA graphs: a graph-replayed layer call whose
                           entry takes at most this much is staged — on the graph's path only a copy, its record
                           and check at the graph's end (``FLIGHT_GRAPH_BATCH``) or beside the layers that follow
                           (default 384K: gpt-oss decode batches up to 32; entries up to 32K are staged whatever
                           this says). Each graph's staged entries share the staging area,
                           ``FLIGHT_GRAPH_BYTES / 16`` (reused by every graph: a gpt-oss decode graph of 24 layers
                           at batch 32 takes 9 MB of the default 16 MB); a limit set larger than the area is
                           refused (raise ``FLIGHT_GRAPH_BYTES`` with it; see ``graph_ring``). The default applies
                           to any ring: in one whose area is smaller, entries are staged while they fit and the
                           rest take a record node each
``MOEREPLAY_FLIGHT_GRAPH_POLL_MS``  layer-scope flight recorder under CUDA graphs: how often the writer thread
                           reads the graph-replayed calls' tag words while no eager call waits for it (default 5,
                           the writer's own interval and the least; up to 500): a trigger among them is found
                           within about this long; each poll takes the GIL from the serving threads
``MOEREPLAY_FLIGHT_GRAPH_BATCH``  layer-scope flight recorder under CUDA graphs: ``1`` records a graph's staged
                           entries (see ``FLIGHT_GRAPH_STAGE``) by one node at the graph's end — one reservation,
                           copy and check for up to 24 layer calls — instead of a record node each beside the
                           path (default 1; ``0``: a record node each)
``MOEREPLAY_FLIGHT_GRAPH_COMPACT``  layer-scope flight recorder under CUDA graphs: ``1`` runs the batch node (see
                           ``FLIGHT_GRAPH_BATCH``) as a kernel one loop long (205 KiB of code for sm_90 instead
                           of 3.7 MB: ``graph_ring_kernel.graph_record_batch_compact``); the same bytes, rows and
                           tag words (default 1: on an H100 it took a served 24-layer gpt-oss's decode batch 1
                           from 1.046× to 1.024× of capture off, per-round median; ``0``: the unrolled kernel)
``MOEREPLAY_FLIGHT_STREAM_STORES``  layer-scope flight recorder: ``1`` marks the eager ring launch's stores as
                           written once (``st.global.cs``: L2 evicts them first), so a prefill's ring writes
                           leave the L2 lines the next kernels read (default 0: measured on an H100,
                           2026-12-07, 11 rounds, no gain — prefill 1.019× against the plain stores' 1.012×)
``MOEREPLAY_FLIGHT_BESIDE_DRIVER``  layer-scope flight recorder: ``1`` forks and joins the copy beside a
                           prefill-sized call (``FLIGHT_BESIDE_BYTES``) with the driver's event calls on two
                           events made once per device, and launches it on the side stream's handle, instead of
                           torch's stream API (new events, a switch of the current stream) — less serving-thread
                           time per prefill call (default 0: a candidate, not yet measured on a GPU)
``MOEREPLAY_FLIGHT_INLINE_CHECKS``  layer-scope flight recorder: ``0`` leaves the eager calls' checks to the
                           writer thread's polls (every ≈ 5 ms while a CUDA graph holds ring launches: a bad eager
                           call is found within a poll of its launch finishing) instead of the serving thread
                           reading the finished words after each call; the serving thread still checks once more
                           than 256 calls, or calls whose copies of the tensors they hold take more than 256 MiB,
                           wait for a writer busy writing (default 1; ``0`` a candidate for graph mode, whose
                           writer polls anyway: less serving-thread time per call, not yet measured)
``MOEREPLAY_FLIGHT_SCOPE`` flight recorder: ``layer`` (default: one copy per MoE layer call, kernel calls
                           regenerated by ``moereplay expand``) or ``kernel`` (every kernel call copied: exact
                           kernel inputs, several times the cost at decode)
``MOEREPLAY_FLIGHT_TRIGGERS``  flight recorder: triggers written per process (default 8; 0: no limit); later bad
                           outputs are counted (``flight_triggers_suppressed``), not written: a model that stays
                           non-finite after its first bad call cannot flood the file, the log or the writer
``MOEREPLAY_ABSMAX``       flight recorder: an output whose largest magnitude exceeds this also triggers
``MOEREPLAY_QUEUE_CALLS``  writer queue depth in calls (default 64); a full queue drops and counts
``MOEREPLAY_QUEUE_BYTES``  host memory the writer queue may hold (default 2G); past it: drop and count
``MOEREPLAY_COMPRESSION_LEVEL``    zstd level of the file (default 1; -5 … 22)
``MOEREPLAY_COMPRESSION_THREADS``  zstd worker threads inside each tensor blob's frame (default 2; 0: none;
                           -1: one per CPU)
``MOEREPLAY_WRITER_THREADS``  threads that hash and compress tensor blobs (default -1: a quarter of the CPUs,
                           1 to 4; 0: the writer thread alone, one blob after the other)
``MOEREPLAY_TIMERS``        ``1``: time the layer-scope flight recorder's pieces (and their CPU time) and the
                           interpreter's garbage collections into the file's counters, for ``moereplay info`` —
                           a diagnostic that costs a few µs a call (:mod:`moereplay.capture.phase_timers`)
=========================  =================================================================================

Compression: every tensor span stored is hashed (sha256, for deduplication) and compressed into one zstd frame.
With writer threads (the default) the blobs of the calls waiting in the queue are hashed and compressed several at
once, ahead of the writer thread, which only writes the finished frames in order; without, the writer thread does
it all, one blob after the other, at about the rate of sha256 and zstd on one core together. bf16 activations
compress to ~78 % at zstd level 1 and at level 3 alike, level 1 being ~1.3× faster. Both kinds of threads take CPU
from the serving process.

Flight recorder: every selected call's inputs and outputs are kept in a bounded ring *on the device*; each
output's largest magnitude is reduced on the device and checked asynchronously (no host sync). Only when an
output is non-finite or above ``MOEREPLAY_ABSMAX`` are the ring's calls — the offending one last — written.
Scope ``layer`` keeps the outermost calls only (the fused MoE layer: its dynamic inputs and output, one launch
per layer call, :mod:`moereplay.capture.flight_layer`) — also those replayed from CUDA graphs, by kernels
captured into the graph (:mod:`moereplay.capture.flight_graph`); scope ``kernel`` keeps every kernel call
(:mod:`moereplay.capture.flight`).
"""

from __future__ import annotations

import enum
import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from moereplay.errors import SettingsError

PREFIX = "MOEREPLAY_"
FLIGHT_SCOPES = ("layer", "kernel")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_SIZE_FACTORS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

KNOWN_VARIABLES = (
    "CAPTURE",
    "DIR",
    "OPS",
    "OPS_EXCLUDE",
    "LAYERS",
    "STEPS",
    "MAX_CALLS",
    "MAX_BYTES",
    "PER_SHAPE",
    "SAMPLE",
    "TRIGGER",
    "FLIGHT_CALLS",
    "FLIGHT_BYTES",
    "FLIGHT_SCOPE",
    "FLIGHT_GRAPH_BYTES",
    "FLIGHT_BESIDE_BYTES",
    "FLIGHT_OUTPUT_BYTES",
    "FLIGHT_LEAN_BYTES",
    "FLIGHT_GRAPH_STAGE",
    "FLIGHT_STREAM_STORES",
    "FLIGHT_BESIDE_DRIVER",
    "FLIGHT_INLINE_CHECKS",
    "FLIGHT_GRAPH_POLL_MS",
    "FLIGHT_GRAPH_BATCH",
    "FLIGHT_GRAPH_COMPACT",
    "ABSMAX",
    "QUEUE_CALLS",
    "QUEUE_BYTES",
    "COMPRESSION_LEVEL",
    "COMPRESSION_THREADS",
    "WRITER_THREADS",
    "TIMERS",
)


class Trigger(enum.Enum):
    """When selected calls are written."""

    ALWAYS = "always"
    FLIGHT = "flight"


@dataclass(frozen=True)
class StepRange:
    """Inclusive range of forward steps; ``None`` bounds are open."""

    first: int | None = None
    last: int | None = None

    def __post_init__(self) -> None:
        if self.first is not None and self.first < 0:
            raise ValueError("first step must be >= 0")
        if self.first is not None and self.last is not None and self.last < self.first:
            raise ValueError("last step must be >= first step")

    def contains(self, step: int) -> bool:
        if self.first is not None and step < self.first:
            return False
        return not (self.last is not None and step > self.last)

    @property
    def unbounded(self) -> bool:
        return self.first is None and self.last is None


@dataclass(frozen=True)
class LayerSelection:
    """MoE layers to record: by index (``indices``) or by fnmatch pattern on the layer name (``patterns``).

    Empty on both sides means every layer. A call whose layer is unknown (no vLLM forward context) is kept only
    when the selection is empty.
    """

    indices: frozenset[int] = frozenset()
    patterns: tuple[str, ...] = ()

    @property
    def everything(self) -> bool:
        return not self.indices and not self.patterns

    def contains(self, index: int | None, name: str | None) -> bool:
        if self.everything:
            return True
        if index is not None and index in self.indices:
            return True
        return name is not None and any(fnmatch.fnmatchcase(name, p) for p in self.patterns)


FLIGHT_BESIDE_BYTES = 8 << 20
"""The default of ``MOEREPLAY_FLIGHT_BESIDE_BYTES``: an eager call whose dynamic inputs take at least this many ring
bytes has them copied on a side stream while it runs (:meth:`moereplay.capture.flight_layer.LayerFlight.before`)."""
FLIGHT_GRAPH_STAGE = 384 << 10
"""The default of ``MOEREPLAY_FLIGHT_GRAPH_STAGE``: a gpt-oss decode batch of 32 at ``triton_kernel_moe_forward``
(≈ 370 KB) is staged, and with ``MOEREPLAY_FLIGHT_GRAPH_BATCH`` (the default) recorded by its graph's batch node.
Lone entries (``graph_ring.ALONE_BYTES``) are staged whatever the setting says: ``0`` does not turn staging off."""
LONE_STAGE = 32 << 10
"""``graph_ring.ALONE_BYTES`` (no torch here): a stage limit up to it is always allowed, whatever the ring's size."""
FLIGHT_GRAPH_POLL_MS = 5
"""The default of ``MOEREPLAY_FLIGHT_GRAPH_POLL_MS`` (``flight_graph.GRAPH_POLL_S`` in milliseconds)."""


@dataclass(frozen=True)
class CaptureSettings:
    """Everything the capture plugin needs to know, validated.

    Sizes are bytes; ``0`` limits mean "no limit". ``sample`` is the kept fraction in ``(0, 1]``.
    """

    enabled: bool = False
    directory: Path = Path("moereplay-captures")
    directory_was_default: bool = True
    ops_include: tuple[str, ...] = ("*",)
    ops_exclude: tuple[str, ...] = ()
    layers: LayerSelection = field(default_factory=LayerSelection)
    steps: StepRange = field(default_factory=StepRange)
    max_calls: int = 0
    max_bytes: int = 0
    per_shape: int = 0
    sample: float = 1.0
    trigger: Trigger = Trigger.ALWAYS
    flight_calls: int = 16
    flight_bytes: int = 1 << 30
    flight_scope: str = "layer"
    flight_graph_bytes: int = 256 << 20
    flight_beside_bytes: int = FLIGHT_BESIDE_BYTES
    flight_output_bytes: int = 0
    flight_lean_bytes: int = 0
    flight_graph_stage: int = FLIGHT_GRAPH_STAGE
    flight_stream_stores: bool = False
    flight_beside_driver: bool = False
    flight_inline_checks: bool = True
    flight_graph_poll_ms: int = FLIGHT_GRAPH_POLL_MS
    flight_graph_batch: bool = True
    flight_graph_compact: bool = True
    flight_triggers: int = 8
    absmax: float | None = None
    queue_calls: int = 64
    queue_bytes: int = 2 << 30
    compression_level: int = 1
    compression_threads: int = 2
    writer_threads: int = -1
    timers: bool = False

    def __post_init__(self) -> None:
        for name in ("max_calls", "max_bytes", "per_shape"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not 0.0 < self.sample <= 1.0:
            raise ValueError("sample must be in (0, 1]")
        if self.flight_calls < 1 or self.queue_calls < 1:
            raise ValueError("flight_calls and queue_calls must be >= 1")
        if self.flight_bytes < 1 or self.queue_bytes < 1:
            raise ValueError("flight_bytes and queue_bytes must be >= 1")
        if self.flight_scope not in FLIGHT_SCOPES:
            raise ValueError(f"flight_scope must be one of {', '.join(FLIGHT_SCOPES)}")
        if self.flight_graph_bytes != 0 and self.flight_graph_bytes < 1024:
            raise ValueError("flight_graph_bytes must be 0 or at least 1024")
        if self.flight_beside_bytes < 0:
            raise ValueError("flight_beside_bytes must be >= 0")
        if self.flight_output_bytes < 0 or self.flight_lean_bytes < 0:
            raise ValueError("flight_output_bytes and flight_lean_bytes must be >= 0")
        if self.flight_graph_stage < 0:
            raise ValueError("flight_graph_stage must be >= 0")
        if not 5 <= self.flight_graph_poll_ms <= 500:
            raise ValueError("flight_graph_poll_ms must be in [5, 500]")
        if self.absmax is not None and not self.absmax > 0.0:
            raise ValueError("absmax must be > 0")
        if self.flight_triggers < 0:
            raise ValueError("flight_triggers must be >= 0")
        if not -5 <= self.compression_level <= 22 or self.compression_threads < -1:
            raise ValueError("compression_level must be in [-5, 22] and compression_threads >= -1")
        if self.writer_threads < -1:
            raise ValueError("writer_threads must be >= -1")

    @property
    def layer_flight(self) -> bool:
        """Whether the layer-scope flight recorder is armed (``MOEREPLAY_TRIGGER=flight``, scope ``layer``)."""
        return self.trigger is Trigger.FLIGHT and self.flight_scope == "layer"

    def resolved_writer_threads(self) -> int:
        """``writer_threads`` with -1 replaced by the default for this machine (a quarter of the CPUs, 1 to 4)."""
        if self.writer_threads >= 0:
            return self.writer_threads
        from moereplay.format.writer import default_workers

        return default_workers()

    def op_selected(self, op: str) -> bool:
        """Whether calls of ``op`` are recorded at all (include patterns, then exclude patterns)."""
        if not any(fnmatch.fnmatchcase(op, p) for p in self.ops_include):
            return False
        return not any(fnmatch.fnmatchcase(op, p) for p in self.ops_exclude)

    def describe(self) -> str:
        """One line for the log."""
        parts = [f"dir={self.directory}", f"trigger={self.trigger.value}"]
        if self.ops_include != ("*",) or self.ops_exclude:
            parts.append(
                f"ops={','.join(self.ops_include)}"
                + (f" -{','.join(self.ops_exclude)}" if self.ops_exclude else "")
            )
        if not self.layers.everything:
            parts.append(
                "layers=" + ",".join([*map(str, sorted(self.layers.indices)), *self.layers.patterns])
            )
        if not self.steps.unbounded:
            parts.append(
                f"steps={self.steps.first if self.steps.first is not None else ''}-"
                f"{self.steps.last if self.steps.last is not None else ''}"
            )
        for name in ("max_calls", "max_bytes", "per_shape"):
            if getattr(self, name):
                parts.append(f"{name}={getattr(self, name)}")
        if self.sample != 1.0:
            parts.append(f"sample={self.sample:g}")
        if self.trigger is Trigger.FLIGHT:
            parts.append(
                f"flight_scope={self.flight_scope} flight_calls={self.flight_calls} "
                f"flight_triggers={self.flight_triggers or 'unlimited'}"
            )
            if self.flight_scope == "layer":
                parts.append(f"flight_graph_bytes={self.flight_graph_bytes}")
                if self.flight_beside_bytes != FLIGHT_BESIDE_BYTES:
                    parts.append(f"flight_beside_bytes={self.flight_beside_bytes}")
                if self.flight_output_bytes:
                    parts.append(f"flight_output_bytes={self.flight_output_bytes}")
                if self.flight_lean_bytes:
                    parts.append(f"flight_lean_bytes={self.flight_lean_bytes}")
                if self.flight_graph_stage != FLIGHT_GRAPH_STAGE:
                    parts.append(f"flight_graph_stage={self.flight_graph_stage}")
                if self.flight_stream_stores:
                    parts.append("flight_stream_stores=on")
                if self.flight_beside_driver:
                    parts.append("flight_beside_driver=on")
                if not self.flight_inline_checks:
                    parts.append("flight_inline_checks=off")
                if not self.flight_graph_batch:
                    parts.append("flight_graph_batch=off")
                # (without a batch node there is nothing for the setting to run)
                if not self.flight_graph_compact and self.flight_graph_batch:
                    parts.append("flight_graph_compact=off")
                if self.flight_graph_poll_ms != FLIGHT_GRAPH_POLL_MS:
                    parts.append(f"flight_graph_poll_ms={self.flight_graph_poll_ms}")
            if self.absmax is not None:
                parts.append(f"absmax={self.absmax:g}")
        parts.append(f"zstd={self.compression_level}")
        if self.compression_threads:
            parts.append(f"zstd_threads={self.compression_threads}")
        parts.append(f"writer_threads={self.resolved_writer_threads()}")
        if self.timers:
            parts.append("timers=on")
        return " ".join(parts)


# ----------------------------------------------------------------------------------------------------------------
# parsing
# ----------------------------------------------------------------------------------------------------------------


def _bad(variable: str, text: str, expected: str) -> SettingsError:
    return SettingsError(f"{PREFIX}{variable}={text!r}: {expected}")


def parse_flag(variable: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise _bad(variable, text, "not a boolean (use 1/0, true/false, yes/no, on/off)")


def parse_count(variable: str, text: str, *, minimum: int = 0) -> int:
    try:
        value = int(text.strip(), 10)
    except ValueError as error:
        raise _bad(variable, text, "not an integer") from error
    if value < minimum:
        raise _bad(variable, text, f"must be >= {minimum}")
    return value


def parse_size(variable: str, text: str, *, minimum: int = 0) -> int:
    """``"512M"``, ``"2G"``, ``"1GiB"``, ``"1.5g"``, ``"4096"`` → bytes (binary units)."""
    match = _SIZE.match(text)
    if match is None:
        raise _bad(variable, text, "not a size (use bytes or e.g. 512K, 64M, 2G, 1GiB)")
    number, unit, _suffix = match.groups()
    value = int(float(number) * _SIZE_FACTORS[unit.lower()])
    if value < minimum:
        raise _bad(variable, text, f"must be at least {minimum} bytes")
    return value


def parse_fraction(variable: str, text: str) -> float:
    stripped = text.strip()
    try:
        if "/" in stripped:
            numerator, denominator = stripped.split("/", 1)
            value = int(numerator) / int(denominator)
        else:
            value = float(stripped)
    except (ValueError, ZeroDivisionError) as error:
        raise _bad(variable, text, "not a fraction (use e.g. 0.25 or 1/4)") from error
    if not 0.0 < value <= 1.0:
        raise _bad(variable, text, "must be in (0, 1]")
    return value


def parse_int_range(variable: str, text: str, low: int, high: int) -> int:
    try:
        value = int(text.strip(), 10)
    except ValueError as error:
        raise _bad(variable, text, "not an integer") from error
    if not low <= value <= high:
        raise _bad(variable, text, f"must be in [{low}, {high}]")
    return value


def parse_positive_float(variable: str, text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError as error:
        raise _bad(variable, text, "not a number") from error
    if not value > 0.0 or value != value or value == float("inf"):
        raise _bad(variable, text, "must be a finite number > 0")
    return value


def parse_patterns(variable: str, text: str) -> tuple[str, ...]:
    patterns = tuple(p.strip() for p in text.split(",") if p.strip())
    if not patterns:
        raise _bad(variable, text, "no pattern given")
    return patterns


def parse_steps(variable: str, text: str) -> StepRange:
    stripped = text.strip()
    match = re.fullmatch(r"(\d*)\s*-\s*(\d*)|(\d+)", stripped)
    if match is None or stripped == "-":
        raise _bad(variable, text, "not a step range (use N, A-B, A- or -B)")
    if match.group(3) is not None:
        step = int(match.group(3))
        return StepRange(step, step)
    first = int(match.group(1)) if match.group(1) else None
    last = int(match.group(2)) if match.group(2) else None
    if first is not None and last is not None and last < first:
        raise _bad(variable, text, "the range ends before it starts")
    return StepRange(first, last)


def parse_layers(variable: str, text: str) -> LayerSelection:
    indices: set[int] = set()
    patterns: list[str] = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        single = re.fullmatch(r"\d+", item)
        span = re.fullmatch(r"(\d+)\s*-\s*(\d+)", item)
        if single:
            indices.add(int(item))
        elif span:
            low, high = int(span.group(1)), int(span.group(2))
            if high < low:
                raise _bad(variable, text, f"layer range {item!r} ends before it starts")
            if high - low > 100_000:
                raise _bad(variable, text, f"layer range {item!r} is implausibly large")
            indices.update(range(low, high + 1))
        elif re.fullmatch(r"[-\d\s]+", item):
            raise _bad(variable, text, f"{item!r} is neither an index, a range A-B nor a name pattern")
        else:
            patterns.append(item)
    if not indices and not patterns:
        raise _bad(variable, text, "no layer given")
    return LayerSelection(frozenset(indices), tuple(patterns))


def parse_trigger(variable: str, text: str) -> Trigger:
    lowered = text.strip().lower()
    for trigger in Trigger:
        if trigger.value == lowered:
            return trigger
    raise _bad(variable, text, "unknown trigger (use always or flight)")


def default_directory(now: datetime | None = None) -> Path:
    """``./moereplay-captures/run-<UTC YYYYmmdd-HHMMSS>/`` relative to the working directory (not ``captures/``:
    a checkout of moereplay, or of a project that keeps its own ``captures/``, would mix runs into it)."""
    moment = now if now is not None else datetime.now(timezone.utc)
    return Path("moereplay-captures") / f"run-{moment.strftime('%Y%m%d-%H%M%S')}"


def capture_requested(env: Mapping[str, str]) -> bool:
    """Whether ``MOEREPLAY_CAPTURE`` asks for capture (a malformed value raises ``SettingsError``)."""
    return parse_flag("CAPTURE", env.get(PREFIX + "CAPTURE", ""))


def settings_from_environ(env: Mapping[str, str], *, now: datetime | None = None) -> CaptureSettings:
    """Parse every ``MOEREPLAY_*`` capture variable of ``env``; raise ``SettingsError`` (one line) if one is bad.

    With ``MOEREPLAY_CAPTURE`` off the other variables are not parsed (a disabled plugin never complains).
    """

    def get(name: str) -> str | None:
        value = env.get(PREFIX + name)
        return value if value is not None and value.strip() != "" else None

    if not capture_requested(env):
        return CaptureSettings(enabled=False)

    values: dict[str, object] = {"enabled": True}
    directory = get("DIR")
    if directory is not None:
        values["directory"] = Path(directory).expanduser()
        values["directory_was_default"] = False
    else:
        values["directory"] = default_directory(now)
    if (text := get("OPS")) is not None:
        values["ops_include"] = parse_patterns("OPS", text)
    if (text := get("OPS_EXCLUDE")) is not None:
        values["ops_exclude"] = parse_patterns("OPS_EXCLUDE", text)
    if (text := get("LAYERS")) is not None:
        values["layers"] = parse_layers("LAYERS", text)
    if (text := get("STEPS")) is not None:
        values["steps"] = parse_steps("STEPS", text)
    if (text := get("MAX_CALLS")) is not None:
        values["max_calls"] = parse_count("MAX_CALLS", text)
    if (text := get("MAX_BYTES")) is not None:
        values["max_bytes"] = parse_size("MAX_BYTES", text)
    if (text := get("PER_SHAPE")) is not None:
        values["per_shape"] = parse_count("PER_SHAPE", text)
    if (text := get("SAMPLE")) is not None:
        values["sample"] = parse_fraction("SAMPLE", text)
    if (text := get("TRIGGER")) is not None:
        values["trigger"] = parse_trigger("TRIGGER", text)
    if (text := get("FLIGHT_CALLS")) is not None:
        values["flight_calls"] = parse_count("FLIGHT_CALLS", text, minimum=1)
    if (text := get("FLIGHT_BYTES")) is not None:
        values["flight_bytes"] = parse_size("FLIGHT_BYTES", text, minimum=1)
    if (text := get("FLIGHT_SCOPE")) is not None:
        scope = text.strip().lower()
        if scope not in FLIGHT_SCOPES:
            raise _bad("FLIGHT_SCOPE", text, "unknown scope (use layer or kernel)")
        values["flight_scope"] = scope
    if (text := get("FLIGHT_GRAPH_BYTES")) is not None:
        size = parse_size("FLIGHT_GRAPH_BYTES", text)
        if 0 < size < 1024:
            raise _bad("FLIGHT_GRAPH_BYTES", text, "must be 0 (off) or at least 1K")
        values["flight_graph_bytes"] = size
    if (text := get("FLIGHT_BESIDE_BYTES")) is not None:
        values["flight_beside_bytes"] = parse_size("FLIGHT_BESIDE_BYTES", text)
    if (text := get("FLIGHT_OUTPUT_BYTES")) is not None:
        values["flight_output_bytes"] = parse_size("FLIGHT_OUTPUT_BYTES", text)
    if (text := get("FLIGHT_LEAN_BYTES")) is not None:
        values["flight_lean_bytes"] = parse_size("FLIGHT_LEAN_BYTES", text)
    if (text := get("FLIGHT_GRAPH_STAGE")) is not None:
        stage = values["flight_graph_stage"] = parse_size("FLIGHT_GRAPH_STAGE", text)
        ring = values.get("flight_graph_bytes", CaptureSettings.flight_graph_bytes)
        assert isinstance(ring, int)
        from moereplay.capture.graph_ring import staging_area  # torch: only where this is set

        room = staging_area(ring) if ring else 0
        if ring and stage > max(room, LONE_STAGE):
            raise _bad(
                "FLIGHT_GRAPH_STAGE",
                text,
                f"exceeds the {room}-byte staging area of a {ring}-byte graph ring "
                "(raise MOEREPLAY_FLIGHT_GRAPH_BYTES with it)",
            )
    if (text := get("FLIGHT_TRIGGERS")) is not None:
        values["flight_triggers"] = parse_count("FLIGHT_TRIGGERS", text)
    if (text := get("ABSMAX")) is not None:
        values["absmax"] = parse_positive_float("ABSMAX", text)
    if (text := get("QUEUE_CALLS")) is not None:
        values["queue_calls"] = parse_count("QUEUE_CALLS", text, minimum=1)
    if (text := get("QUEUE_BYTES")) is not None:
        values["queue_bytes"] = parse_size("QUEUE_BYTES", text, minimum=1)
    if (text := get("COMPRESSION_LEVEL")) is not None:
        values["compression_level"] = parse_int_range("COMPRESSION_LEVEL", text, -5, 22)
    if (text := get("COMPRESSION_THREADS")) is not None:
        values["compression_threads"] = parse_int_range("COMPRESSION_THREADS", text, -1, 256)
    if (text := get("WRITER_THREADS")) is not None:
        values["writer_threads"] = parse_int_range("WRITER_THREADS", text, -1, 256)
    if (text := get("FLIGHT_STREAM_STORES")) is not None:
        values["flight_stream_stores"] = parse_flag("FLIGHT_STREAM_STORES", text)
    if (text := get("FLIGHT_BESIDE_DRIVER")) is not None:
        values["flight_beside_driver"] = parse_flag("FLIGHT_BESIDE_DRIVER", text)
    if (text := get("FLIGHT_INLINE_CHECKS")) is not None:
        values["flight_inline_checks"] = parse_flag("FLIGHT_INLINE_CHECKS", text)
    if (text := get("FLIGHT_GRAPH_POLL_MS")) is not None:
        values["flight_graph_poll_ms"] = parse_int_range("FLIGHT_GRAPH_POLL_MS", text, 5, 500)
    if (text := get("FLIGHT_GRAPH_BATCH")) is not None:
        values["flight_graph_batch"] = parse_flag("FLIGHT_GRAPH_BATCH", text)
    if (text := get("FLIGHT_GRAPH_COMPACT")) is not None:
        values["flight_graph_compact"] = parse_flag("FLIGHT_GRAPH_COMPACT", text)
    if (text := get("TIMERS")) is not None:
        values["timers"] = parse_flag("TIMERS", text)
    return CaptureSettings(**values)  # type: ignore[arg-type]


def unknown_variables(env: Mapping[str, str]) -> tuple[str, ...]:
    """``MOEREPLAY_*`` names that look like capture settings but are not (typos): logged, never fatal, since
    other moereplay tools may define their own variables."""
    known = {PREFIX + name for name in KNOWN_VARIABLES}
    close = {name.replace("_", "") for name in KNOWN_VARIABLES}
    return tuple(
        sorted(
            key
            for key in env
            if (key.startswith(PREFIX) and key not in known and key[len(PREFIX) :].replace("_", "") in close)
            or key.startswith(PREFIX + "CAPTURE_")
        )
    )
