"""The layer-scope flight recorder: one ring copy per MoE layer call, kernel calls regenerated later.

``MOEREPLAY_TRIGGER=flight`` with ``MOEREPLAY_FLIGHT_SCOPE=layer`` (the default scope). The kernel-scope recorder
(:mod:`moereplay.capture.flight`) copies every kernel call's inputs and outputs: exact, but at decode it costs
several times the call, because every copy is a launch and a launch costs as much host time as the kernels it
watches. Here only the *outermost* recorded call — the fused MoE layer (``fused_marlin_moe``,
``triton_kernel_fused_experts`` …; on vLLM's served gpt-oss path ``triton_kernel_moe_forward`` above it, wrapped
for this recorder only: ``CaptureTarget.layer_flight_only``), or a kernel call made outside any layer — is kept,
and with ONE launch
(:class:`~moereplay.capture.device_ring.DeviceRing`): its dynamic inputs (hidden states, routing; not weights,
which are stored once per file, and not scratch buffers, whose bytes before the call mean nothing) and its output
go into a circular device buffer, and the same launch folds the output's largest magnitude into a tag word.
Kernel calls inside a layer call pass straight through. When a layer's output turns bad, the layer calls up to and
including it are written as parent records without children; ``moereplay expand`` re-runs them with the real
kernels to regenerate (and prove) the kernel calls.

Threads. Serving thread (per layer call): bind the arguments, collect the dynamic tensors, call, one ring launch,
append to a queue (no event, no host transfer, no allocation), then read the finished tag words of the calls
before it where the ring kernel's last program stored them, in host-mapped memory (plain memory reads, no CUDA
call; one integer decode per call) — only the all-clear is handled there. Writer thread (:meth:`LayerFlight.poll`
with ``launch=True``, inside the graph gate, every ≈ 5 ms whether the serving thread is busy or idle; it leaves
the eager ring alone while the serving thread has checked it within :data:`INLINE_WINDOW_S` and left it nothing —
its Python time is GIL time taken from the serving thread; a bad output is found at the next call's end, or about
one poll after its call ran on the device once calls stop, see ``WriterThread``): read the words the serving
thread did not (without the kernel, one event and one small copy per poll, read at the next), and on a bad word
describe the offending call and the K calls before it (tensor metadata, argument trees), copy their ring regions to the
host, check that nothing overwrote them meanwhile (the ring's ``head`` had not lapped them when the copy
finished) and hand them to the writer. Until a call leaves the history (K calls later, once checked) its argument
references are held — not copies: the allocator reuses those tensors' memory K calls later than it would have.
A call whose copies take at least :data:`RELEASE_BYTES` of the ring (prefill) has its tensors' metadata read right
after its launch and its references let go there (:meth:`LayerFlight.release`): K prefill calls' fresh outputs
held would keep K × 47 MB from the allocator at 8,192 tokens of gpt-oss — memory vLLM's start-up profile run
counts against the KV cache.

Scratch buffers are recorded as :class:`~moereplay.format.schema.Unsupported` (``"scratch …"``); an output
buffer passed in (``output``) is recorded as an input with its bytes *after* the call when the call may be
copied after it (the target declares its inputs intact) — its bytes before the call are not used by the kernels.
A target that may write its inputs, or whose output overlaps an input, gets a second launch before the call.
A call whose inputs take at least ``MOEREPLAY_FLIGHT_BESIDE_BYTES`` (prefill) has them copied on a side stream
beside the call, joined before the output launch (:meth:`LayerFlight.before`).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import math
import threading
import time
import types
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from moereplay.capture.context import Ranks, Where
from moereplay.capture.device_ring import (
    DeviceRing,
    Measured,
    decode_word,
    driver_stream_calls,
    magnitude,
    measure,
    over_bits,
)
from moereplay.capture.flight import FlightCounters, PollingRecorder, TriggerBudget, TriggerDelivery
from moereplay.capture.patch_points import CaptureTarget
from moereplay.capture.settings import FLIGHT_BESIDE_BYTES
from moereplay.capture.snapshot import (
    Snapshot,
    TensorCopy,
    _codec_of,
    _fill,
    _Pending,
    _walk,
    _walk_static,
    byte_span,
    format_codec,
    is_view_of_any,
    qualified_type_name,
    storage_key,
)
from moereplay.capture.writer_thread import POLL_INTERVAL_S, Begin, Complete, Delivered
from moereplay.format.schema import Unsupported

if TYPE_CHECKING:
    from moereplay.capture.flight_graph import GraphFlight

logger = logging.getLogger("moereplay.capture")

_PLAIN = frozenset({type(None), bool, int, float, str, bytes, torch.dtype, torch.device})
_LATER = (
    enum.Enum,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    functools.partial,
)  # values without tensors inside: recorded from the live object when the call is described
_get_stream = torch._C._cuda_getCurrentRawStream if hasattr(torch._C, "_cuda_getCurrentRawStream") else None


def _serving_stream(index: int) -> int:
    """The raw handle of device ``index``'s current stream (0 on a torch without CUDA)."""
    return _get_stream(index) if _get_stream is not None else 0


_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def is_scratch_marker(value: Any) -> bool:
    """Whether ``value`` is what :func:`scratch_marker` records (``moereplay expand`` passes ``None`` for it)."""
    return isinstance(value, Unsupported) and value.repr_excerpt.lstrip().lower().startswith("scratch")


UNKEPT = "checked (the call's flight magnitude), its bytes not kept by the layer-scope flight recorder"


def unkept_marker(value: torch.Tensor) -> Unsupported:
    """What a layer call's output checked but not copied (``MOEREPLAY_FLIGHT_OUTPUT_BYTES``) is recorded as."""
    return Unsupported(
        "torch.Tensor",
        f"output {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}: {UNKEPT} "
        "(MOEREPLAY_FLIGHT_OUTPUT_BYTES)",
    )


def is_unkept_marker(value: Any) -> bool:
    """Whether ``value`` is what :func:`unkept_marker` records."""
    return isinstance(value, Unsupported) and UNKEPT in value.repr_excerpt


def largest_magnitude(tensor: torch.Tensor) -> float:
    """A tensor's largest magnitude as the flight recorder's check reports it (:func:`device_ring.magnitude`: NaN
    when it holds one, float32); 0.0 for no element, and |x| of the largest for integers."""
    if not tensor.numel():
        return 0.0
    if not tensor.is_floating_point() or tensor.is_complex():
        return float(tensor.detach().abs().max())
    return float(magnitude(tensor).item())


def scratch_marker(value: torch.Tensor) -> Unsupported:
    return Unsupported(
        "torch.Tensor",
        f"scratch buffer {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}: "
        "not kept by the layer-scope flight recorder (moereplay expand passes None)",
    )


@dataclass(eq=False, slots=True)
class _Copied:
    """Where one copied tensor's bytes are in the ring, and what it was."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    device: str
    storage: tuple[str, int]
    start: int  # absolute ring position of the copy (``lead`` bytes before the tensor's first byte)
    lead: int
    size: int


class _Beside:
    """A device's side stream for the inputs' copies beside prefill-sized calls (:meth:`LayerFlight.before`), with
    its two events made once and reused by every call, for the driver's ``cuEventRecord`` and ``cuStreamWaitEvent``
    on their raw handles (``MOEREPLAY_FLIGHT_BESIDE_DRIVER``): the fork (recorded on the serving stream, waited
    for by the side stream at once) and the join (recorded on the side stream after the copy, waited for by the
    serving stream after the call). A stream waits for an event's latest record as of its wait, so recording the
    join again for the next call is safe once the serving stream has waited. A call claims the pair from its fork
    to its join (``claim``, a lock released by :meth:`LayerFlight.join`); one that finds it claimed — another
    serving thread's call on the device, still between the two — makes events of its own."""

    def __init__(self, index: int) -> None:
        self.stream = torch.cuda.Stream(index)
        self.raw = int(self.stream.cuda_stream)
        self.fork = torch.cuda.Event()
        self.join = torch.cuda.Event()
        # torch makes an event on its first record: its handle exists from here
        self.fork.record(self.stream)
        self.join.record(self.stream)
        self.fork_raw = int(self.fork.cuda_event)
        self.join_raw = int(self.join.cuda_event)
        self.claim = threading.Lock()


class LayerCall:
    """One recorded outermost call. The serving thread sets the first group of attributes; the rest are class
    defaults until the writer thread (or the call's completion) sets them — a plain ``__init__`` of eight
    assignments keeps the per-call cost down."""

    # completion (serving thread, after the call)
    input_copy: tuple[list[int], list[int], list[int]] | None = None  # (starts, leads, sizes) of the inputs
    output_copy: tuple[list[int], list[int], list[int]] | None = None  # of the outputs (or inputs + outputs)
    tag: tuple[int, int] | None = None
    ring: DeviceRing | None = None
    stream: int = 0
    device_index: int = -1
    host_s: float = 0.0
    started: float = 0.0  # perf_counter() before the call
    ended: float = 0.0  # perf_counter() after it
    status: str = "completed"
    error: str | None = None
    measured: Measured | None = None  # the dynamic inputs' spans, measured before the call (overlap check)
    joined: Any = None  # the event after the inputs' copy on the side stream (see LayerFlight.before)
    probe: Any = None  # the triton_kernels opt_flags probe of a matmul_ogs call made outside a layer
    state_module: Any = None  # the process state of a layer call's GEMMs (process_state_via): .context()
    extra_context: dict[str, Any] | None = None
    extra_outputs: dict[str, Any] | None = None  # values, not tensors (the chosen opt_flags)
    unkept: dict[str, Unsupported] | None = None  # outputs checked but not copied (LayerFlight.output_bytes)
    # its bytes copied into the ring only if its check fails (LayerFlight.lean_bytes; see before)
    lean: bool = False
    # writer thread
    copies: list[_Copied] | None = None
    input_tree: dict[str, Any] | None = None
    output_tree: dict[str, Any] | None = None
    checked: bool = False
    value: float | None = None
    emitted: bool = False
    graph: bool = False  # made while a CUDA graph was captured (:mod:`moereplay.capture.flight_graph`)
    # its place in the history (numbered as calls join it: the history's orders are consecutive)
    order: int = 0

    def __init__(
        self,
        target: CaptureTarget,
        where: Where,
        sequence: int,
        bound: dict[str, Any],
        trees: dict[str, Any],
        tensors: list[torch.Tensor],
    ) -> None:
        self.target = target
        self.where = where
        self.sequence = sequence
        self.bound: dict[str, Any] | None = bound
        # dynamic argument name -> index into ``tensors``, a tree with _Pending indices, or a _Deferred codec object
        self.trees = trees
        self.tensors: list[torch.Tensor] | None = (
            tensors  # the dynamic inputs (index order), then the outputs
        )
        self.n_inputs = len(tensors)
        self.outputs: dict[str, int] = {}  # output name -> index into ``tensors``

    @property
    def first_start(self) -> int:
        starts = [c.start for c in self.copies or ()]
        return min(starts) if starts else 0


@dataclass(frozen=True)
class _Deferred:
    """A codec object's place in a layer call's tensors: ``count`` of them from ``first``, collected on the serving
    thread without its tree (see :func:`_deferred_tree`)."""

    first: int
    count: int


def _deferred_tree(value: Any, deferred: _Deferred, tensors: list[torch.Tensor]) -> Any:
    """The argument tree of a codec object whose tensors were collected on the serving thread: the object walked
    again (the codec's walk meets its tensors in the order its collect did), its tensors numbered from
    ``deferred.first``. An object whose tensors are no longer the ones copied (replaced after the call) is
    written as unsupported, never with another tensor's bytes. Its plain fields (counts, block sizes) are read
    here, at the trigger: vLLM builds these objects afresh for each layer call and does not change them after it;
    a graph-captured call is described while its graph is captured."""
    found = list(tensors[: deferred.first])
    try:
        tree = _walk(value, found, format_codec, 0)
    except Exception as error:  # the object changed into something its codec refuses
        return Unsupported(qualified_type_name(type(value)), f"not recordable at the trigger: {error}"[:200])
    copied = tensors[deferred.first : deferred.first + deferred.count]
    walked = found[deferred.first :]
    if len(walked) != len(copied) or any(a is not b for a, b in zip(walked, copied, strict=True)):
        return Unsupported(
            qualified_type_name(type(value)), "its tensors changed between the call and the trigger"
        )
    return tree


@dataclass
class LayerCounters(FlightCounters):
    too_large: int = 0
    polls: int = 0  # writer-thread polls
    # their time, the graph half's included (GIL held for most of it: time the serving thread may wait)
    poll_ns: int = 0
    # the longest one (both halves): a backlog worked off in one poll keeps the serving thread waiting that long
    poll_max_ns: int = 0
    # of the polls, those that worked on the eager ring (the serving thread had left it to them)
    eager_polls: int = 0
    # checks the serving thread made itself after an eager call (see LayerFlight._check_inline)
    inline_checks: int = 0
    # eager calls whose inputs were copied on a side stream beside the call (see LayerFlight.before)
    beside: int = 0
    # eager calls that let go of their tensors when they returned (see LayerFlight.release)
    released: int = 0
    # eager calls whose returned output was checked but not kept (MOEREPLAY_FLIGHT_OUTPUT_BYTES)
    outputs_unkept: int = 0
    # eager calls whose bytes were copied only if their check failed (MOEREPLAY_FLIGHT_LEAN_BYTES), and of them
    # those a trigger's file left out: their check passed (no bytes kept: nothing to re-run) or was lost
    lean: int = 0
    lean_left_out: int = 0


QUIET_POLL_S = 0.02
"""How long the writer may wait for its next poll while the serving thread checks the eager ring itself (and no
CUDA graph holds ring launches): each poll takes the GIL from the serving thread, and every 5 ms that is ~9 hand-
offs per eager decode step. A call the serving thread leaves to the writer wakes it at once; once calls stop,
the last ones are checked within this plus ``inline_window``."""

IDLE_POLL_S = 0.5
"""How long the writer may wait for its next poll while nothing is outstanding — no call of the eager ring waits
for its check, none is left to the writer, and no CUDA graph holds ring launches: a process whose MoE layers are
not recorded (vLLM's API server, a layer filter that selects none), or between requests. Its polls would find
nothing, and each takes the GIL from the threads that serve. The serving thread wakes the writer when it records
a call it cannot finish checking itself, so a trigger waits no longer for it (see :meth:`LayerFlight.poll`)."""

SETTLE_LOCK_WAIT_S = 0.2
"""How long a settling poll waits for the lock the serving thread holds (see LayerFlight._acquire_for_poll)."""

NEW_BOUND = 256
"""Calls waiting for the writer to take them in (``MOEREPLAY_FLIGHT_INLINE_CHECKS=0``) past which the serving
thread's check after a call runs anyway: the history stays bounded while the writer is busy writing."""

NEW_HELD_BYTES = 256 << 20
"""Ring bytes of the calls waiting for the writer to take them in (``MOEREPLAY_FLIGHT_INLINE_CHECKS=0``) that keep
their tensors alive — those under :data:`RELEASE_BYTES`, which hold them until they leave the history (what they
keep alive: at least their copies' bytes, a view's whole block at most) — past which the serving thread's check
after a call runs anyway: while the writer is busy writing, 256 calls of up to 8 MiB each would otherwise hold
2 GiB that vLLM's memory planning never gave the recorder."""

INLINE_WINDOW_S = 0.005
"""While the serving thread has checked the eager ring itself within this many seconds, the writer thread's poll
leaves the ring alone (unless the serving thread left it something): a finished call is checked at the next
eager call's end, or by the writer within about ``inline_window`` + :data:`QUIET_POLL_S` once calls stop."""


RELEASE_BYTES = FLIGHT_BESIDE_BYTES
"""A call whose copies (inputs and outputs) take at least this many ring bytes — prefill, as for the beside copy:
8 MiB, ~700 tokens of gpt-oss — lets go of its tensors right after its launch (their metadata read then: a few µs
a call, see :meth:`LayerFlight.release`). Smaller calls (decode) keep their references until they leave the
history: the last K calls, more while the checks lag behind the serving thread; a view keeps its whole block."""


@dataclass(eq=False)
class _Plan:
    """Per target and argument layout: the names to look at for dynamic tensors, and the output buffers that may
    be passed in (checked for overlap with the inputs)."""

    candidates: tuple[str, ...]
    outputs: tuple[str, ...] = ()


@dataclass(eq=False)
class _WordRead:
    calls: list[LayerCall]
    event: Any
    host: torch.Tensor


@dataclass(eq=False)
class _CopyOut:
    calls: list[LayerCall]
    trigger: LayerCall
    event: Any
    hosts: list[torch.Tensor]  # per call: its copied bytes, regions back to back in ``copies`` order
    delivery: TriggerDelivery


class LayerFlight(PollingRecorder):
    """See the module docstring. ``emit(begin, complete, delivered)`` hands one call to the writer: False when it
    did not (``MOEREPLAY_MAX_CALLS``), else ``delivered`` is told once whether it was written (``flight_written``
    counts those). ``ranks``: called on the writer thread for the context's ranks."""

    def __init__(
        self,
        *,
        max_calls: int,
        max_bytes: int,
        absmax: float | None,
        emit: Callable[[Begin, Complete | None, Delivered], bool],
        ranks: Callable[[], Ranks | None] = lambda: None,
        budget: TriggerBudget | None = None,
        beside_bytes: int = FLIGHT_BESIDE_BYTES,
        release_bytes: int = RELEASE_BYTES,
        stream_stores: bool = False,
        output_bytes: int = 0,
        lean_bytes: int = 0,
        beside_driver: bool = False,
        inline_checks: bool = True,
    ) -> None:
        self.budget = budget if budget is not None else TriggerBudget(0)
        self.beside_bytes = beside_bytes
        # the copy beside a call forked and joined by the driver on reused events, launched on the side stream
        # without switching to it (MOEREPLAY_FLIGHT_BESIDE_DRIVER; see _copy_beside)
        self.beside_driver = beside_driver
        self._driver_besides: dict[int, _Beside] = {}
        # the serving thread checks the eager ring's finished words after each call (see _check_inline); False
        # (MOEREPLAY_FLIGHT_INLINE_CHECKS=0): the writer's polls do, as they poll a graph ring every ≈ 5 ms anyway
        self.inline_checks = inline_checks
        # a returned output of at least this many bytes is checked, not copied (MOEREPLAY_FLIGHT_OUTPUT_BYTES; 0: off)
        self.output_bytes = output_bytes
        # a call whose dynamic inputs take at least this many ring bytes keeps its bytes only if its check fails
        # (MOEREPLAY_FLIGHT_LEAN_BYTES; 0: off): see before
        self.lean_bytes = lean_bytes
        self.release_bytes = release_bytes
        # the ring kernel's stores marked streaming (MOEREPLAY_FLIGHT_STREAM_STORES)
        self.stream_stores = stream_stores
        self._besides: dict[int, Any] = {}  # per device, the side stream of large calls' input copies
        self.max_calls = max_calls
        self.max_bytes = max_bytes
        self.absmax = absmax
        self.emit = emit
        self.ranks = ranks
        self.counters = LayerCounters()
        self._rings: dict[int, DeviceRing] = {}
        self._plans: dict[tuple[int, int], _Plan] = {}
        self._new: deque[LayerCall] = deque()  # serving thread appends, writer thread pops
        self._history: deque[LayerCall] = deque()  # described, in call order
        self._unchecked: deque[LayerCall] = deque()  # described, no word read launched yet
        self._reads: deque[_WordRead] = deque()
        self._copy_outs: deque[_CopyOut] = deque()
        self._sides: dict[int, Any] = {}
        self._streams: dict[tuple[int, int], Any] = {}
        self._currents: dict[tuple[int, int], Any] = {}  # see _current
        self._lock = threading.Lock()  # the writer-side state (poll may run from settle on another thread)
        self._warned_large = False
        # the serving thread's own checks (see _check_inline): when it made the last one (perf_counter seconds), and
        # whether it left something only the writer thread handles (a bad word, a ring without host words)
        self._inline_at = -math.inf
        self._joined = 0  # calls that joined the history (the next one's order)
        # without inline checks: the ring bytes of the calls in _new that hold their tensors (see NEW_HELD_BYTES);
        # reset when _take_new empties _new (a call appended meanwhile may go uncounted: a bound, not a ledger)
        self._new_held = 0
        self._settling = False  # settle() runs (the writer thread at close; see _acquire_for_poll)
        self._lock_abandoned = False
        # the (device, stream) pairs eager calls ran on: with more than one, a pending word does not say that the
        # calls after it are pending too (see _check_in_place)
        self._streams_seen: set[tuple[int, int]] = set()
        self._last_stream: tuple[int, int] | None = None
        # brings the writer's next poll forward (the session sets WriterThread.wake_poll): called by the serving
        # thread when its check leaves the writer something while the writer may be waiting QUIET_POLL_S, or
        # leaves a call unchecked while it may be waiting IDLE_POLL_S
        self.wake: Callable[[], None] | None = None
        self._inline_defers = False
        # the writer's last poll found nothing outstanding and asked to wait IDLE_POLL_S: the serving thread wakes
        # it when it leaves a call unchecked (see _check_inline)
        self._writer_idle = False
        self.inline_window = INLINE_WINDOW_S
        self.graph: GraphFlight | None = None  # graph-replayed calls (set by the recorder)

    @property
    def absmax(self) -> float | None:
        """``MOEREPLAY_ABSMAX``: a checked magnitude above it is bad (``_is_bad``); set, it also sets the limit lean
        calls' copy launch compares on the device (:func:`over_bits`), so the two never disagree."""
        return self._absmax

    @absmax.setter
    def absmax(self, value: float | None) -> None:
        self._absmax = value
        self._over = over_bits(value)

    # --- serving thread ---------------------------------------------------------------------------------------

    def _new_plan(self, target: CaptureTarget, bound: dict[str, Any]) -> _Plan:
        """The plan of ``target``'s calls bound to ``bound``'s names, cached under ``(id(target), len(bound))``
        (the names of a target's bound call differ only with unknown keywords)."""
        static = frozenset(target.static)
        # an intact-inputs target's output buffers are copied once, after the call, as outputs (their bytes
        # before it are not read): the input tree names that copy
        later = frozenset(target.outputs) if target.inputs_intact else frozenset()
        candidates = tuple(
            name for name in bound if name not in static and name not in target.scratch and name not in later
        )
        outputs = tuple(name for name in target.outputs if name in bound)
        plan = self._plans[(id(target), len(bound))] = _Plan(candidates, outputs)
        return plan

    def _ring(self, tensor: torch.Tensor) -> DeviceRing:
        """The ring of ``tensor``'s device (keyed by ``get_device()``: an int, no device object per call)."""
        key = tensor.get_device()
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = DeviceRing(
                self.max_bytes, tensor.device, stream_stores=self.stream_stores
            )
        return ring

    def before(self, target: CaptureTarget, bound: dict[str, Any], where: Where, sequence: int) -> LayerCall:
        """Collect the dynamic inputs; copy them now when the call may write them (else after the call).

        A call whose inputs it leaves intact and take at least :attr:`beside_bytes` of the ring (prefill: a
        gpt-oss layer call's hidden states are 47 MB at 8,192 tokens) has them copied now, on a side stream
        that waits for the work queued so far and runs beside the call's kernels, which only read them; after
        the call its stream waits for that copy, then one launch copies the outputs and folds the check as
        usual. The inputs' half of the copy then leaves the step's critical path where the device has room
        beside the call's kernels. Decode-sized calls keep the one launch after the call: a side stream's
        events cost host time, which decode cannot spare."""
        call, copy_first = self.collect(target, bound, where, sequence)
        tensors = call.tensors
        if copy_first:
            assert tensors is not None
            ring = self._ring(tensors[0])
            call.ring = ring
            call.input_copy = ring.record(tensors, None, False, call.measured)[:3]
        elif tensors and (self.lean_bytes or (self.beside_bytes and tensors[0].is_cuda)):
            ring = self._ring(tensors[0])
            measured = call.measured
            if self.lean_bytes:
                if measured is None:
                    measured = call.measured = ring.measure(tensors)
                if measured.total >= self.lean_bytes:
                    call.ring = ring
                    call.lean = True  # nothing copied now: after the call, only if its check fails
            if not call.lean and self.beside_bytes and tensors[0].is_cuda and ring.launcher is not None:
                if measured is None:
                    measured = call.measured = ring.measure(tensors)
                if measured.total >= self.beside_bytes:
                    call.ring = ring
                    try:
                        self._copy_beside(call, ring, tensors, measured)
                    except BaseException:
                        # (the ring too small: TooLarge) the call is not kept — its stream still waits for
                        # whatever was queued beside it, and the driver's pair is let go
                        self.join(call)
                        raise
        call.started = time.perf_counter()
        return call

    def _copy_beside(
        self, call: LayerCall, ring: DeviceRing, tensors: list[torch.Tensor], measured: Measured
    ) -> None:
        """Copy ``tensors`` into the ring on the device's side stream, after the work queued on the current one
        (see :meth:`before`); ``call.joined`` is the event :meth:`after` makes the call's stream wait for.

        With :attr:`beside_driver`, the fork and the join are the driver's calls on two events made once per
        device (:class:`_Beside`), and the copy is launched on the side stream's handle: no event objects, no
        switch of the current stream — four driver calls where torch's stream API takes tens of microseconds of
        serving-thread time on a serving host (``copy_beside`` under ``MOEREPLAY_TIMERS``)."""
        index = ring.index
        # (a serving stream that is the legacy default one, handle 0, is the driver's null stream of the thread's
        # current device: the events path unless that is the ring's)
        if self.beside_driver:
            serving = _serving_stream(index)
            if serving != 0 or torch.cuda.current_device() == index:
                beside = self._driver_besides.get(index)
                if beside is None:
                    beside = self._driver_besides[index] = _Beside(index)
                if beside.claim.acquire(blocking=False):
                    # the call holds the pair from here: whatever raises from now on (a driver call that fails,
                    # the driver library not loading, a signal handler's exception) leaves it to join, which
                    # lets it go — a wait for the join event's last record, one already waited for, is harmless
                    call.joined = beside
                    self._copy_beside_driver(call, ring, tensors, measured, beside, serving)
                    return
        side = self._besides.get(index)
        if side is None:
            side = self._besides[index] = torch.cuda.Stream(index)
        fork = torch.cuda.Event()
        fork.record(self._current(index))
        side.wait_event(fork)
        joined = torch.cuda.Event()
        with torch.cuda.stream(side):
            try:
                call.input_copy = ring.record(tensors, None, False, measured)[:3]
            finally:  # whatever was queued before a failure: the serving stream still waits for it
                joined.record(side)
                call.joined = joined
        self.counters.beside += 1

    def _copy_beside_driver(
        self,
        call: LayerCall,
        ring: DeviceRing,
        tensors: list[torch.Tensor],
        measured: Measured,
        beside: _Beside,
        serving: int,
    ) -> None:
        """:meth:`_copy_beside` through the driver (see there), ``beside`` claimed by this call (``call.joined`` is
        ``beside`` already), forked from the serving stream's handle ``serving``: :meth:`join` waits for the join
        event's last record and lets the claim go, whatever raises here — this call's copy where the join's own
        record was made; where that record failed (the call is then not kept), the one before it."""
        record, wait = driver_stream_calls()
        status = record(beside.fork_raw, serving)
        if not status:
            status = wait(beside.raw, beside.fork_raw, 0)
        if status:  # nothing queued on the side stream: the join waits for the pair's last join, long done
            raise RuntimeError(f"the fork of a copy beside a call failed with CUresult {status}")
        try:
            call.input_copy = ring.record(tensors, None, False, measured, stream=beside.raw)[:3]
        finally:  # whatever was queued before a failure: the serving stream still waits for it (unless this fails)
            status = record(beside.join_raw, beside.raw)
            if status:
                raise RuntimeError(f"the join of a copy beside a call failed with CUresult {status}")
        self.counters.beside += 1

    def _current(self, index: int) -> Any:
        """The device's current stream as torch's ``Stream``, kept by its raw handle: ``torch.cuda.current_stream``
        builds a new object per call (the serving thread's time). Torch's own object, not an ``ExternalStream`` of
        the handle: the allocator tells streams apart by torch's stream id (``record_stream``)."""
        if _get_stream is None:
            return torch.cuda.current_stream(index)
        key = (index, _get_stream(index))
        stream = self._currents.get(key)
        if stream is None:
            if len(self._currents) > 64:
                self._currents.clear()
            stream = self._currents[key] = torch.cuda.current_stream(index)
        return stream

    def collect(
        self, target: CaptureTarget, bound: dict[str, Any], where: Where, sequence: int
    ) -> tuple[LayerCall, bool]:
        """The call with its dynamic inputs collected, and whether they must be copied before the call (it may
        write them, or an output buffer passed in overlaps one). Top-level tensors are remembered by name only
        (their trees are built if a trigger writes the call)."""
        plan = self._plans.get((id(target), len(bound)))
        if plan is None:
            plan = self._new_plan(target, bound)
        tensors: list[torch.Tensor] = []
        trees: dict[str, Any] = {}
        plain = _PLAIN
        for name in plan.candidates:
            value = bound.get(name)
            if value is None or type(value) in plain:
                continue
            if isinstance(value, torch.Tensor):
                trees[name] = len(tensors)
                tensors.append(value)
            elif not isinstance(value, _LATER):
                before = len(tensors)
                codec = _codec_of(type(value))
                if codec is not None and codec.collect is not None:
                    # a codec object (triton_kernels' routing objects): only its tensors now, in the order its
                    # walk meets them; its tree is built from the same object if a trigger writes the call
                    (codec.tensors or codec.collect)(value, tensors.append)
                    if len(tensors) != before:
                        trees[name] = _Deferred(before, len(tensors) - before)
                    continue
                tree = _walk(value, tensors, format_codec, 0)
                if len(tensors) != before:
                    trees[name] = tree
        call = LayerCall(target, where, sequence, bound, trees, tensors)
        if not tensors:
            return call, False
        if not target.inputs_intact:
            return call, True
        if plan.outputs:  # an output buffer passed in that overlaps an input: copy the inputs first
            ring = self._rings.get(tensors[0].get_device())  # made by the first eager call (never made here:
            if ring is None:  # this may run inside a graph capture)
                return call, _outputs_overlap(plan.outputs, bound, measure(tensors, by_address=False))
            measured = call.measured = ring.measure(tensors)  # measured once: record reuses it
            return call, _outputs_overlap(plan.outputs, bound, measured)
        return call, False

    def after(self, call: LayerCall, result: Any, error: BaseException | None) -> None:
        """Copy the outputs (and the inputs, unless copied before) and fold the check: one launch."""
        now = time.perf_counter()
        call.host_s = now - call.started
        call.ended = now  # the wall-clock time is derived when the call is written (one clock read less here)
        tensors = call.tensors
        assert tensors is not None
        self.join(call)  # the inputs' copy beside the call: before anything the caller queues next
        outputs: list[torch.Tensor] = []
        check = None
        if error is None:
            outputs, check = collect_outputs(call, result)
            single = check is not None and len(outputs) == 1 and outputs[0] is check  # one output, checked
            call.lean = call.lean and single  # (else every byte copied after the call, as usual)
            if not call.lean and (
                single
                and self.output_bytes
                and check is not None
                and "return" in call.outputs
                and check.numel() * check.element_size() >= self.output_bytes
            ):  # checked by the launch below, its bytes not kept (a marker in its place: see _describe)
                del call.outputs["return"]
                call.unkept = {"return": unkept_marker(check)}
                outputs = []
                self.counters.outputs_unkept += 1
        else:
            call.status = "failed"
            call.error = f"{type(error).__name__}: {error}"[:2000]
            call.lean = False
        if call.input_copy is not None:
            copied = outputs
            tensors.extend(outputs)
        else:  # (a lean call's too: reserved for, copied only if its check fails)
            tensors.extend(outputs)
            copied = tensors
        # (inputs copied before the call and no output tensor, or one not kept: an empty entry still carries the
        # call's tag word — the check of an output not kept reads it where it is)
        if copied or check is not None or (call.input_copy is not None and error is None):
            ring = call.ring
            if ring is None:
                ring = call.ring = self._ring(copied[0] if copied else check)  # type: ignore[arg-type]
            index = ring.index
            if index >= 0:
                call.device_index = index
                call.stream = _serving_stream(index)
            stream = (index, call.stream)
            if stream != self._last_stream:
                self._last_stream = stream
                self._streams_seen.add(stream)
            if call.lean:
                assert check is not None
                starts, leads, sizes, tag = ring.record_lean(copied, check, self._over, call.measured)
                inputs = call.n_inputs  # its spans: the inputs', then the output's
                call.input_copy = (starts[:inputs], leads[:inputs], sizes[:inputs])
                starts, leads, sizes = starts[inputs:], leads[inputs:], sizes[inputs:]
                self.counters.lean += 1
            else:
                starts, leads, sizes, tag = ring.record(
                    copied,
                    check,
                    error is None,
                    call.measured if copied is tensors else None,
                    call.unkept is not None,  # an output not kept: its fingerprint proves a re-run bit-exact
                )
            call.output_copy = (starts, leads, sizes)
            call.tag = tag
            if call.unkept and check is not None and check.is_cuda:
                # no reference is kept to the output the launch reads: its memory must wait for the launch
                # (a no-op where the caller allocated it on this stream, as vLLM does)
                with contextlib.suppress(RuntimeError):
                    check.record_stream(self._current(ring.index))
            total = sum(sizes) + (sum(call.input_copy[2]) if call.input_copy is not None else 0)
            if self.release_bytes and total >= self.release_bytes:
                self.release(call)
            elif not self.inline_checks:
                # its tensors held until it leaves the history: counted until the call is taken in
                self._new_held += total
        self._new.append(call)
        if self.inline_checks or len(self._new) > NEW_BOUND or self._new_held > NEW_HELD_BYTES:
            # (without inline checks, the serving thread still takes new calls in — and lets old ones go — when
            # the writer has not for NEW_BOUND calls or NEW_HELD_BYTES of held tensors: a long write of a
            # trigger's calls between its polls)
            self._check_inline(now)
        else:  # the writer's next poll checks it (woken if its last poll found nothing outstanding)
            self.wake_if_idle()

    def join(self, call: LayerCall) -> None:
        """Make the call's stream wait for its inputs' copy beside it, once (see :meth:`before`): :meth:`after`
        does, and the recorder again whatever failed before it got there — the caller may reuse the inputs'
        memory as soon as the call returns."""
        joined = call.joined
        if joined is not None:
            call.joined = None
            assert call.ring is not None
            index = call.ring.index
            if type(joined) is _Beside:
                try:
                    status = driver_stream_calls()[1](_serving_stream(index), joined.join_raw, 0)
                finally:
                    joined.claim.release()
                if status:
                    raise RuntimeError(f"the join of a copy beside a call failed with CUresult {status}")
                return
            self._current(index).wait_event(joined)

    def _check_inline(self, now: float) -> None:
        """The serving thread's own look at finished tag words, right after an eager call: plain memory reads of
        the host words (the earlier calls' words, mostly: this call's is rarely finished yet), no CUDA call.
        While these run, the writer thread's poll skips the eager ring (see :meth:`poll`): its polls took the
        GIL from the serving thread every ``poll_interval`` — measured at ~80 µs of CPU time per poll of a
        served gpt-oss model, and more in waits for the GIL and the OS, while this costs a few µs per call.
        Only the all-clear is handled here: a bad word (a trigger: copy-out launches, logging), a ring without
        host words (reads by event and copy) or a busy writer (its lock) are left to the writer thread's next
        poll — brought forward by :attr:`wake` when something is newly left."""
        lock = self._lock
        if not lock.acquire(blocking=False):
            # the writer holds the lock: its poll may have found nothing just before this call joined — bring
            # its next poll forward rather than leave the call for IDLE_POLL_S
            self.wake_if_idle()
            return
        try:
            self.counters.inline_checks += 1
            self._take_new()
            deferred = self._inline_defers
            self._inline_defers = not self._check_in_place()
            self._evict()
            self._inline_at = now
            woken = self._inline_defers and not deferred
            if self._writer_idle and self._unchecked:  # a pending call: the idle writer polls again from now
                self._writer_idle = False
                woken = True
        finally:
            lock.release()
        if woken and self.wake is not None:
            self.wake()

    def _check_in_place(self) -> bool:
        """Decode the unchecked calls' host words, oldest first, up to the first one whose launch has not
        finished (on one stream the later ones have not finished either: one pending call bounds the work here,
        however far the serving thread runs ahead of the device); count the finished good ones (and the lost).
        Returns False when some call is left for the writer thread: a bad magnitude (it stays unchecked, so its
        history stays too), a ring without host words, or — once eager calls have run on more than one stream or
        device — calls behind a pending one, which may have finished on another stream (the writer's poll reads
        every word)."""
        unchecked = self._unchecked
        counters = self.counters
        left: list[LayerCall] = []
        behind = False
        try:  # a signal handler may raise on this (the main) thread: the calls set aside go back regardless
            while unchecked:
                call = unchecked[0]
                ring = call.ring
                words = ring.host_words if ring is not None else None
                tag = call.tag
                if words is None or tag is None:
                    left.append(unchecked.popleft())
                    continue
                state, value = decode_word(int(words[tag[0]]), tag[1])
                if state == "pending":
                    # calls on another stream or device may have finished behind it: the writer reads them all
                    behind = len(self._streams_seen) > 1 and len(unchecked) > 1
                    break
                unchecked.popleft()
                if state == "lost":
                    call.checked = True
                    counters.unchecked += 1
                    continue
                if not call.emitted and self._is_bad(value):
                    left.append(call)
                    continue
                call.checked = True
                call.value = value
                counters.checked += 1
        finally:
            if left:
                unchecked.extendleft(reversed(left))
        return not (left or behind)

    def too_large(self, error: ValueError) -> None:
        self.counters.too_large += 1
        if not self._warned_large:
            self._warned_large = True
            logger.warning(
                "moereplay: flight recorder: a call's copies do not fit the ring (%s); such calls are not kept "
                "(raise MOEREPLAY_FLIGHT_BYTES)",
                error,
            )

    # --- writer thread ----------------------------------------------------------------------------------------

    def poll(self, *, launch: bool = False) -> float | None:
        """Describe new calls, read tag words, handle triggers and finished copy-outs. Launches (word reads,
        copy-outs) only with ``launch`` (the writer thread, inside the graph gate). Returns how long the writer may
        wait for the next poll while no CUDA graph holds ring launches: :data:`IDLE_POLL_S` when nothing is
        outstanding, :data:`QUIET_POLL_S` when the serving thread checks the eager ring itself — it wakes the
        writer when it leaves it something, or leaves a call unchecked after an idle poll — else None."""
        if not launch:
            return None
        started = time.perf_counter_ns()
        locked = self._acquire_for_poll()
        quiet = False
        try:
            # (without inline checks the serving thread's check after NEW_BOUND calls, or bytes, is no reason to
            # leave the ring alone: the calls after it wait for this poll)
            quiet = self.inline_checks and not (
                self._inline_defers
                or self._copy_outs
                or self._reads
                or time.perf_counter() - self._inline_at >= self.inline_window
            )
            if not quiet:  # else the serving thread checks the eager ring itself (see _check_inline)
                self._take_new()
                self._finish_copy_outs()
                self._read_words()
                self._launch_reads()
                self._evict()
                self._inline_defers = False
                self.counters.eager_polls += 1
            idle = not self._outstanding()  # (the eager work above, or a quiet poll, left no defers)
            graph = self.graph
            # idle: the writer may wait longer than its poll interval (IDLE_POLL_S, or the graph ring's poll wait
            # while graphs hold ring launches), so a call left to it must wake it
            self._writer_idle = idle and (
                graph is None or not graph.counters.launches or graph.poll_s > POLL_INTERVAL_S
            )
            # a call that joined after ``idle`` was read saw the flag unset (no wake): read again after setting it
            if self._writer_idle and self._new:
                self._writer_idle = idle = False
            self.counters.polls += 1
            spent = time.perf_counter_ns() - started
            self.counters.poll_ns += spent
        finally:
            if locked:
                self._lock.release()
        if graph is not None:
            graph_started = time.perf_counter_ns()
            graph.poll(launch=True, full=self._settling)
            graph_ns = time.perf_counter_ns() - graph_started
            self.counters.poll_ns += graph_ns  # the writer's poll: both halves
            spent += graph_ns
        self.counters.poll_max_ns = max(self.counters.poll_max_ns, spent)
        if graph is not None and graph.counters.launches:
            # graph replays are found by polls only: every graph.poll_s at most; a trigger's copy-out in flight:
            # its entries are written at the next poll, not poll_s later
            if not idle or graph.poll_s <= POLL_INTERVAL_S or graph.copying:
                self._writer_idle = False
                return None
            return graph.poll_s
        if idle:
            return IDLE_POLL_S
        return QUIET_POLL_S if quiet else None

    def wake_if_idle(self) -> None:
        """Bring the writer's next poll forward if its last one found nothing outstanding (it may be waiting
        :data:`IDLE_POLL_S`): a call it must look at is on its way (an eager call this thread could not check, a
        layer call captured into a CUDA graph, whose replays only polls find)."""
        if self._writer_idle and self.wake is not None:
            self._writer_idle = False
            self.wake()

    def _outstanding(self) -> bool:
        """Whether an eager call waits for its check, a word read or a copy-out."""
        return bool(self._new or self._unchecked or self._reads or self._copy_outs)

    def _acquire_for_poll(self) -> bool:
        """The writer-side lock, or — while settling, when the serving thread has held it for
        :data:`SETTLE_LOCK_WAIT_S` — none (returns whether it was taken). The serving thread takes the lock for
        its own check after each call; a signal handler that runs on it inside that check (vLLM's SIGTERM: the
        session's flush waits for this thread's settle) would otherwise keep it held until the flush gives up.
        That thread is then stopped in the handler, so the state is not changed under this poll."""
        if not self._settling:
            self._lock.acquire()
            return True
        if self._lock_abandoned:
            return False
        if self._lock.acquire(timeout=SETTLE_LOCK_WAIT_S):
            return True
        self._lock_abandoned = True
        logger.warning(
            "moereplay: flight recorder: the serving thread has held its check's lock for %.1f s while the "
            "capture closes (a signal handler inside its check); settling without it",
            SETTLE_LOCK_WAIT_S,
        )
        return False

    def settle(self, timeout: float, device_work: Callable[[], Any] | None = None) -> bool:
        self._settling = True
        try:
            return super().settle(timeout, device_work)
        finally:
            self._settling = False
            self._lock_abandoned = False

    @property
    def settled(self) -> bool:
        return not self._outstanding() and (self.graph is None or self.graph.settled)

    def as_counters(self) -> dict[str, int]:
        counters = super().as_counters()
        # one-time costs inside the first recorded calls (counted in the recorder's serving-thread time)
        counters["flight_setup_ns"] = sum(ring.setup_ns() for ring in list(self._rings.values()))
        if self.graph is not None:
            counters.update(self.graph.as_counters())
        return counters

    def _take_new(self) -> None:
        """New calls join the history (described only if a trigger writes them: until then a call costs this
        thread nothing but the read of its tag word — Python time here is GIL time taken from serving)."""
        new = self._new
        history = self._history
        unchecked = self._unchecked
        joined = self._joined
        try:
            while new:
                call = new[0]
                call.order = joined
                history.append(call)
                if call.tag is None:  # failed calls: nothing to check
                    call.checked = True
                else:
                    unchecked.append(call)
                new.popleft()
                joined += 1
        finally:  # (see _check_in_place)
            self._joined = joined
            if not new:
                self._new_held = 0

    def release(self, call: LayerCall) -> None:
        """Read the copied tensors' metadata now and let go of what the call's description will not need: every
        dynamic tensor but those of a codec object whose tree is built at the trigger (triton_kernels' routing
        objects: their tensors are checked by identity then), the output buffers passed in, and the scratch
        buffers (their marker is made now). Runs on the serving thread right after the call's launch and before
        the call joins the history (no other thread sees it yet).

        The ring's kernels may not have read these tensors yet when the caller drops them: the caching allocator
        then hands their memory to later allocations on the stream it was allocated on, ordered after the work
        queued there. A tensor from another stream is marked used on the serving stream (``record_stream``) —
        where the output launch was queued after the side copy's join — so its memory waits for that; where the
        allocator cannot be told, the call keeps its references."""
        tensors = call.tensors
        ring = call.ring
        if tensors and ring is not None and ring.index >= 0:
            stream = self._current(ring.index)
            try:
                for tensor in tensors:
                    if tensor.is_cuda:
                        tensor.record_stream(stream)
            except RuntimeError:
                return
        self.counters.released += 1
        call.copies = self._copied(call)
        trees = call.trees
        kept: list[Any] | None = None
        for found in trees.values():
            if type(found) is _Deferred and tensors is not None:
                if kept is None:
                    kept = [None] * call.n_inputs
                end = found.first + found.count
                kept[found.first : end] = tensors[found.first : end]
        bound = call.bound
        if bound is not None:
            # a copy of the caller's names, with only the few that change visited (not every bound name)
            released: dict[str, Any] = dict(bound)
            for name, found in trees.items():
                if type(found) is not _Deferred:
                    released[name] = None  # described from its copy (_Pending), never from the value
            target = call.target
            if target.inputs_intact:  # output buffers passed in: described from their copies after the call
                outputs = call.outputs
                for name in target.outputs:
                    if name in outputs and name in released:
                        released[name] = None
            for name in target.scratch:
                value = released.get(name)
                if isinstance(value, torch.Tensor):
                    released[name] = scratch_marker(value)
            call.bound = released
        call.tensors = kept

    def _copied(self, call: LayerCall) -> list[_Copied]:
        """Each copied tensor's metadata and where its bytes are in the ring (the tensors are alive)."""
        tensors = call.tensors or []
        copies: list[_Copied] = []
        regions: list[tuple[int, int, int]] = []
        for copy in (call.input_copy, call.output_copy):
            if copy is not None:
                regions.extend(zip(*copy, strict=True))
        for tensor, (start, lead, size) in zip(tensors, regions, strict=True):
            key = storage_key(tensor)
            copies.append(
                _Copied(
                    tensor.dtype,
                    tuple(tensor.shape),
                    tuple(tensor.stride()),
                    int(tensor.storage_offset()),
                    key[0],
                    key,
                    start,
                    lead,
                    size,
                )
            )
        return copies

    def _describe(self, call: LayerCall) -> None:
        """Tensor metadata (unless :meth:`release` read it) and argument trees; the live dynamic tensors are let
        go."""
        bound = call.bound or {}
        tensors = call.tensors or []
        copies = call.copies if call.copies is not None else self._copied(call)
        static = frozenset(call.target.static)
        scratch = frozenset(call.target.scratch)
        tree: dict[str, Any] = {}
        later = call.target.outputs if call.target.inputs_intact else ()
        for name, value in bound.items():
            if name in call.trees:
                found = call.trees[name]
                if type(found) is int:
                    tree[name] = _Pending(found)
                elif type(found) is _Deferred:
                    tree[name] = _deferred_tree(value, found, tensors)
                else:
                    tree[name] = found
            elif name in later and name in call.outputs:  # the buffer as the call left it (see _new_plan)
                tree[name] = _Pending(call.outputs[name])
            elif name in static:
                tree[name] = (
                    value if isinstance(value, torch.Tensor) else _walk_static(value, format_codec, 0)
                )
            elif name in scratch and isinstance(value, torch.Tensor):
                tree[name] = scratch_marker(value)
            elif name in scratch and isinstance(value, Unsupported):  # made by release
                tree[name] = value
            elif isinstance(value, torch.Tensor):  # cannot happen: every dynamic tensor is in ``trees``
                tree[name] = Unsupported("torch.Tensor", "not copied")
            else:
                tree[name] = _walk(value, [], format_codec, 0)
        if call.state_module is not None:  # read when described: at the trigger, or when a graph captured it
            call.extra_context = {**(call.extra_context or {}), **call.state_module.context()}
            call.state_module = None
        call.copies = copies
        call.input_tree = tree
        outputs: dict[str, Any] = {name: _Pending(index) for name, index in call.outputs.items()}
        outputs.update(call.unkept or {})
        for name, value in (call.extra_outputs or {}).items():
            outputs[name] = _walk(value, [], format_codec, 0)
        call.output_tree = outputs
        call.bound = None
        call.tensors = None

    def _stream(self, device_index: int, raw: int) -> Any:
        key = (device_index, raw)
        stream = self._streams.get(key)
        if stream is None:
            if len(self._streams) > 64:
                self._streams.clear()
            stream = self._streams[key] = torch.cuda.ExternalStream(raw, device=device_index)
        return stream

    def _side(self, device_index: int) -> Any:
        side = self._sides.get(device_index)
        if side is None:
            side = self._sides[device_index] = torch.cuda.Stream(device_index)
        return side

    def _after_streams(self, side: Any, device_index: int, calls: list[LayerCall]) -> None:
        """Make ``side`` wait for the work queued so far on every serving stream ``calls`` ran on (calls that
        copied nothing ran on none)."""
        for raw in {call.stream for call in calls if call.device_index >= 0}:
            event = torch.cuda.Event()
            event.record(self._stream(device_index, raw))
            side.wait_event(event)

    def _launch_reads(self) -> None:
        """Check the new calls. A ring with host words (the kernel's, or the CPU's) is read in place: finished
        words are decoded, the rest stay unchecked for the next poll — no CUDA call. Otherwise one read of the
        tag words per ring, after an event on each serving stream the calls were made on."""
        if not self._unchecked:
            return
        by_ring: dict[int, list[LayerCall]] = {}
        rings: dict[int, DeviceRing] = {}
        waiting: list[LayerCall] = []
        while self._unchecked:
            call = self._unchecked.popleft()
            ring = call.ring
            assert ring is not None
            if ring.host_words is not None:
                assert call.tag is not None
                state, value = decode_word(int(ring.host_words[call.tag[0]]), call.tag[1])
                if state == "pending":  # its launch has not finished
                    waiting.append(call)
                else:
                    self._checked(call, state, value)
                continue
            by_ring.setdefault(id(ring), []).append(call)
            rings[id(ring)] = ring
        self._unchecked.extend(waiting)
        for key, calls in by_ring.items():
            ring = rings[key]
            index = calls[0].device_index
            side = self._side(index)
            self._after_streams(side, index, calls)
            host = torch.empty(ring.tags, dtype=torch.int64, pin_memory=True)
            with torch.cuda.stream(side):
                host.copy_(ring.words, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            self._reads.append(_WordRead(calls, done, host))

    def _read_words(self) -> None:
        while self._reads:
            read = self._reads[0]
            if not read.event.query():
                return
            self._reads.popleft()
            words = read.host.numpy()  # a view: only the calls' own slots become Python integers
            for call in read.calls:
                assert call.tag is not None
                state, value = decode_word(int(words[call.tag[0]]), call.tag[1])
                if state == "pending":  # not possible after the event; read again later
                    self._unchecked.append(call)
                    continue
                self._checked(call, state, value)

    def _checked(self, call: LayerCall, state: str, value: float) -> None:
        """A call's finished (or overwritten) tag word: count it, and trigger on a bad magnitude."""
        call.checked = True
        if state == "lost":
            self.counters.unchecked += 1
            return
        call.value = value
        self.counters.checked += 1
        # an emitted call was written (as history) by an earlier trigger
        if not call.emitted and self._is_bad(value):
            self._trigger(call)

    def _trigger(self, trigger: LayerCall) -> None:
        self.counters.triggers += 1
        calls: list[LayerCall] = []
        for call in self._history:
            if call.emitted:
                continue
            if call.lean and not call.checked and call is not trigger:
                continue  # its bytes are kept only if its own check fails, and that check may still trigger it
            call.emitted = True  # written now, or too old to be written by a later trigger
            calls.append(call)
            if call is trigger:
                break
        if not self.budget.take(f"{trigger.target.op} call {trigger.where.call}"):
            return
        # a lean call's bytes are in the ring only if its check failed (as the device judged it: over_bits)
        kept = [c for c in calls if not c.lean or (c.value is not None and self._is_bad(c.value))]
        self.counters.lean_left_out += len(calls) - len(kept)
        calls = kept
        self.counters.evicted += max(0, len(calls) - self.max_calls)
        calls = calls[-self.max_calls :]
        for call in calls:
            if call.input_tree is None:
                self._describe(call)
        name = f"{trigger.target.op} call {trigger.where.call}"
        logger.error(
            "moereplay: flight recorder triggered by %s (largest |output| = %s): writing %d layer call(s)",
            name,
            trigger.value,
            len(calls),
        )
        hosts: list[torch.Tensor] = []
        ring = trigger.ring
        assert ring is not None
        cuda = ring.device.type == "cuda"
        side = self._side(trigger.device_index) if cuda else None
        if side is not None:
            # the trigger's finished word says its own stream got that far; calls of its history made on other
            # streams may still be queued there: the copy-out waits for every stream the calls ran on
            self._after_streams(side, trigger.device_index, calls)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for call in calls:
                total = sum(copy.size for copy in call.copies or ())
                host = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
                at = 0
                for copy in call.copies or ():
                    assert call.ring is not None
                    host.narrow(0, at, copy.size).copy_(
                        call.ring.view(copy.start, copy.size), non_blocking=cuda
                    )
                    at += copy.size
                hosts.append(host)
            event = None
            if side is not None:
                event = torch.cuda.Event()
                event.record(side)
        delivery = TriggerDelivery(self.counters, name, len(calls))
        self._copy_outs.append(_CopyOut(calls, trigger, event, hosts, delivery))
        self._finish_copy_outs()

    def _finish_copy_outs(self) -> None:
        while self._copy_outs:
            out = self._copy_outs[0]
            if out.event is not None and not out.event.query():
                return
            self._copy_outs.popleft()
            for call, host in zip(out.calls, out.hosts, strict=True):
                ring = call.ring
                if call.copies and ring is not None and not ring.intact(call.first_start):
                    self.counters.lost += 1
                    logger.error(
                        "moereplay: flight recorder: %s call %d was overwritten in the ring before it could be "
                        "written (raise MOEREPLAY_FLIGHT_BYTES)",
                        call.target.op,
                        call.where.call,
                    )
                    out.delivery.not_handed_over("overwritten in the ring (flight_lost)")
                    continue
                begin, complete = self._messages(call, host, call is out.trigger)
                if not self.emit(begin, complete, out.delivery.delivered):
                    out.delivery.not_handed_over("MOEREPLAY_MAX_CALLS reached")

    def _messages(self, call: LayerCall, host: torch.Tensor, trigger: bool) -> tuple[Begin, Complete | None]:
        copies: list[TensorCopy] = []
        at = 0
        for copy in call.copies or ():
            data = host.narrow(0, at, copy.size)
            at += copy.size
            base = copy.storage_offset * copy.dtype.itemsize - copy.lead
            if base < 0:  # the copy began before its storage (a storage base not 256-byte aligned): trim
                data = data.narrow(0, -base, copy.size + base)
                base = 0
            copies.append(
                TensorCopy(
                    copy.dtype,
                    copy.shape,
                    copy.stride,
                    copy.storage_offset,
                    copy.device,
                    copy.storage,
                    base,
                    data,
                )
            )
        n_inputs = len(call.copies or ()) - len(call.outputs)
        # one data buffer per storage in each snapshot. The inputs' may name an output copy too (an intact
        # target's output buffer, recorded as the call left it), whose storage may hold an input: their bytes
        # share a buffer, the inputs' winning where they overlap (bytes before the call); the outputs' apart
        later = call.target.outputs if call.target.inputs_intact else ()
        named = {call.outputs[name] for name in later if name in call.outputs}  # see _describe
        input_side = copies[:]
        _share_storages(input_side, [*range(n_inputs), *sorted(named)], first=n_inputs)
        output_side = copies[:]
        _share_storages(output_side, range(n_inputs, len(copies)))
        context = call.where.as_dict(self.ranks())
        context.update(call.extra_context or {})
        context["flight"] = {"scope": "layer", "trigger": trigger, "magnitude": call.value}
        if call.unkept and call.ring is not None and call.tag is not None:
            # the output not kept: its bytes' fingerprint (device_ring.byte_fingerprint), where there is one
            printed = call.ring.fingerprint_of(call.tag)
            if printed is not None:
                context["flight"]["fingerprint"] = f"{printed:016x}"
        inputs = Snapshot(
            _fill(call.input_tree, input_side), copied=sum(c.size for c in (call.copies or ())[:n_inputs])
        )
        target = call.target
        begin = Begin(call.sequence, target.op, target.site, inputs, context, None, target.static)
        finished = time.time() - (time.perf_counter() - call.ended)
        begin.started = finished - call.host_s
        outputs = Snapshot(
            _fill(call.output_tree, output_side), copied=sum(c.size for c in (call.copies or ())[n_inputs:])
        )
        complete = Complete(call.sequence, outputs, {"host_s": call.host_s}, call.status, call.error)
        complete.finished = finished
        return begin, complete

    def _evict(self) -> None:
        """Keep the last ``max_calls`` calls for the next trigger, every unchecked call, and the ``max_calls - 1``
        calls before each unchecked one (its history, should it be bad: the checks lag behind the serving
        thread's calls). The open calls (unchecked, not yet written) are all in ``_unchecked`` or a pending word
        read; the history's orders are consecutive, so the first open call's place is its order less the oldest
        call's — no walk over the history (this runs after every eager call)."""
        history = self._history
        max_calls = self.max_calls
        if len(history) > max_calls:
            first_open = math.inf
            for call in self._unchecked:
                if not call.emitted and call.order < first_open:
                    first_open = call.order
            for read in self._reads:
                for call in read.calls:
                    if not (call.checked or call.emitted) and call.order < first_open:
                        first_open = call.order
            evicted = 0
            while len(history) > max_calls:
                old = history[0]
                # the oldest leaves once checked (or written) and no open call has it among its history
                if not (old.emitted or old.checked) or first_open - old.order < max_calls:
                    break
                history.popleft()
                if not old.emitted:
                    evicted += 1
            self.counters.evicted += evicted
        while history and history[0].emitted and history[0].checked:
            history.popleft()


def collect_outputs(call: LayerCall, result: Any) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """A completed call's output tensors (its output buffers passed in, then the result unless it is a view of
    one), named in ``call.outputs`` by their index after its inputs; and the one to check (the first floating
    point one), or None."""
    bound = call.bound
    tensors = call.tensors
    assert bound is not None and tensors is not None
    outputs: list[torch.Tensor] = []
    named = call.outputs
    for name in call.target.outputs:
        value = bound.get(name)
        if value is not None and isinstance(value, torch.Tensor):
            named[name] = len(tensors) + len(outputs)
            outputs.append(value)
    if isinstance(result, torch.Tensor) and not is_view_of_any(result, outputs):
        named["return"] = len(tensors) + len(outputs)
        outputs.append(result)
    for value in outputs:
        if value.is_floating_point() and value.numel() and not value.is_complex():
            return outputs, value
    return outputs, None


def _share_storages(copies: list[TensorCopy], positions: Iterable[int], *, first: int = 0) -> None:
    """The copies at ``positions`` (one snapshot's) that are of one original storage get one data buffer (the
    union of their spans), as the snapshot module gives them: the file records views of one storage over one
    storage. Where spans overlap, positions before ``first`` are written last (their bytes win)."""
    by_storage: dict[tuple[str, int], list[int]] = {}
    for position in positions:
        by_storage.setdefault(copies[position].storage, []).append(position)
    for group in by_storage.values():
        if len(group) < 2:
            continue
        low = min(copies[p].base for p in group)
        high = max(copies[p].base + copies[p].data.numel() for p in group)
        union = torch.zeros(high - low, dtype=torch.uint8)
        for p in sorted(group, key=lambda position: position < first):
            copy = copies[p]
            union.narrow(0, copy.base - low, copy.data.numel()).copy_(copy.data)
        for p in group:
            copy = copies[p]
            copies[p] = TensorCopy(
                copy.dtype,
                copy.shape,
                copy.stride,
                copy.storage_offset,
                copy.device,
                copy.storage,
                low,
                union,
            )


def _outputs_overlap(names: tuple[str, ...], bound: dict[str, Any], inputs: Measured) -> bool:
    """Whether an output buffer passed in (``names``) shares bytes with a dynamic input's measured span (then the
    inputs are copied before the call). Device addresses are unique in the process (unified addressing)."""
    for name in names:
        out = bound.get(name)
        if not isinstance(out, torch.Tensor):
            continue
        low, high = _address_span(out)
        if high != low and inputs.overlaps(low, high):
            return True
    return False


def _address_span(tensor: torch.Tensor) -> tuple[int, int]:
    """``[first, end)`` device addresses of the bytes ``tensor`` touches (a strided view's whole span)."""
    low = tensor.data_ptr()
    if tensor.is_contiguous():
        return low, low + tensor.nbytes
    start, end = byte_span(tensor)
    return low, low + (end - start)


def is_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (a direct C call where torch has one)."""
    if _is_capturing is not None:
        return bool(_is_capturing())
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
