"""The recorder: what the wrapped kernel functions do on each call while capture is armed.

For every call: note its context (step, layer, parent), decide whether to record it (op / step / layer
filters, graph-capture guard, call and per-shape limits, sampling), snapshot its inputs *before* calling the
real function, call it, snapshot its outputs, and queue both for the writer thread. Never harmful:

- the real function is called exactly once, with the caller's arguments, whatever happens here;
- its exceptions propagate unchanged (and are recorded as a ``failed`` completion);
- any internal error disables capture for the rest of the process, logged once with the reason, and the
  wrapped functions go back to a one-attribute-check pass-through;
- a full queue or disk drops and counts; nothing here blocks on the device or on the disk.

CUDA graphs: while the current stream is capturing a graph nothing may be copied (and nothing recorded would
be replayed by later graph launches), so such calls are skipped and counted, with one loud warning — except in
the layer-scope flight recorder, which captures its ring kernels into the graph after a layer call
(:mod:`moereplay.capture.flight_graph`), so every replay of it is kept and checked on the device.

Codecs: the format codecs for vLLM's ``ScalarType`` are registered when the recorder is built, and a target's
``codec_modules`` (the triton_kernels codecs of the matmul_ogs op) when the target is wrapped — before any of its
calls is encoded. Targets with process state (``process_state``; triton_kernels GEMMs) also record it: the opt_flags
constraints in force as pseudo-arguments, a manual override in the context, the flags chosen as the ``opt_flags``
output (the family's hooks, e.g. :mod:`moereplay.ops.ogs_process_state`).
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from moereplay.capture import phase_timers
from moereplay.capture.binding import ArgumentBinder
from moereplay.capture.context import ContextTracker, Where
from moereplay.capture.device_ring import TooLarge
from moereplay.capture.flight import FlightEntry, FlightRecorder, TriggerBudget
from moereplay.capture.flight_graph import GraphFlight
from moereplay.capture.flight_layer import LayerCall, LayerFlight, is_capturing
from moereplay.capture.patch_points import CaptureTarget
from moereplay.capture.patching import CallHandler
from moereplay.capture.settings import CaptureSettings, Trigger
from moereplay.capture.snapshot import Snapshot, estimate, is_view_of_any, record_cuda_event, snapshot
from moereplay.capture.writer_thread import Begin, Complete, Delivered, WriterThread

logger = logging.getLogger("moereplay.capture")

GRAPH_WARNING = (
    "moereplay: a CUDA graph is being captured: MoE kernel calls inside graphs are NOT recorded, and steps "
    "replayed from graphs are invisible to the capture (only the layer-scope flight recorder, "
    "MOEREPLAY_TRIGGER=flight, keeps graph-replayed layer calls). Start vLLM with --enforce-eager "
    "(or -cc.cudagraph_mode=NONE) to record every call."
)


@dataclass
class RecorderCounters:
    seen: int = 0
    selected: int = 0
    skipped_graph_capture: int = 0
    skipped_filters: int = 0
    skipped_limit: int = 0
    dropped_queue_full: int = 0
    internal_errors: int = 0
    host_ns: int = 0  # layer scope: serving-thread time spent in the recorder around outermost calls

    def as_dict(self) -> dict[str, int]:
        return {f"recorder_{key}": value for key, value in self.__dict__.items()}


@dataclass
class _Plan:
    """One wrapped call in progress."""

    target: CaptureTarget
    where: Where
    sequence: int
    recorded: bool
    bound: dict[str, Any] | None = None
    started: float = 0.0
    device_start: Any = None
    probe: Any = None
    keep: list[torch.Tensor] | None = None  # the copied inputs, alive until the outputs are copied


_OUTERMOST: Any = object()
"""Stands on the parent stack while a layer-scope outermost call runs (its calls inside pass through)."""


@dataclass
class _Local(threading.local):
    parents: list[_Plan] = field(default_factory=list)


class Recorder(CallHandler):
    """See the module docstring. ``writer`` is ``None`` only in tests that exercise selection alone."""

    def __init__(self, settings: CaptureSettings, writer: WriterThread | None) -> None:
        self.settings = settings
        self.writer = writer
        self.active = True
        self.disabled_reason: str | None = None
        self.counters = RecorderCounters()
        self.tracker = ContextTracker()
        self._local = _Local()
        self._lock = threading.Lock()
        self._sequence = 0
        self._recorded = 0
        self._eligible = 0
        self._per_shape: dict[tuple[Any, ...], int] = {}
        self._ops_selected: dict[str, bool] = {}
        self._graph_warned = False
        self._cuda = torch.cuda.is_available()
        self._probes: dict[int, Any] = {}  # id(original function) -> its process-state probe
        # id(original layer function) -> the state of the GEMM it calls (process_state_via)
        self._state_modules: dict[int, Any] = {}
        importlib.import_module("moereplay.ops.vllm_codecs")  # registers vLLM's own value types' codecs
        self.flight: FlightRecorder | LayerFlight | None = None
        self.layer_scope = settings.layer_flight
        # MOEREPLAY_TIMERS: the recorder's pieces timed, CPU time beside wall time (moereplay.capture.phase_timers)
        self._timers: phase_timers.Timers | None = None
        self._untime: Callable[[], None] | None = None
        if settings.timers:
            self._timers, self._untime = phase_timers.install()
        budget = TriggerBudget(settings.flight_triggers)
        if self.layer_scope:
            self.flight = LayerFlight(
                budget=budget,
                max_calls=settings.flight_calls,
                max_bytes=settings.flight_bytes,
                absmax=settings.absmax,
                emit=self._emit_layer_call,
                ranks=lambda: self.tracker.ranks,
                beside_bytes=settings.flight_beside_bytes,
                output_bytes=settings.flight_output_bytes,
                lean_bytes=settings.flight_lean_bytes,
                stream_stores=settings.flight_stream_stores,
                beside_driver=settings.flight_beside_driver,
                inline_checks=settings.flight_inline_checks,
            )
            if settings.flight_graph_bytes:
                self.flight.graph = GraphFlight(
                    self.flight,
                    settings.flight_graph_bytes,
                    stage_bytes=settings.flight_graph_stage,
                    poll_s=settings.flight_graph_poll_ms / 1000.0,
                    batch=settings.flight_graph_batch,
                    compact=settings.flight_graph_compact,
                )
        elif settings.trigger is Trigger.FLIGHT:
            self.flight = FlightRecorder(
                max_calls=settings.flight_calls,
                max_bytes=settings.flight_bytes,
                absmax=settings.absmax,
                emit=self._emit_flight_entry,
                emit_complete=self._emit_flight_complete,
                budget=budget,
            )

    # --- lifecycle --------------------------------------------------------------------------------------------

    def disable(self, reason: str) -> None:
        """Stop recording for good (the wrapped functions keep working); logged once, loudly."""
        with self._lock:
            if not self.active and self.disabled_reason is not None:
                return
            self.active = False
            self.disabled_reason = reason
        logger.error(
            "moereplay: capture disabled: %s (vLLM keeps running; the file keeps what was written)", reason
        )

    def _internal_error(self, where: str, error: BaseException) -> None:
        self.counters.internal_errors += 1
        logger.debug("moereplay: internal error in %s", where, exc_info=error)
        self.disable(f"internal error in {where}: {type(error).__name__}: {error}")

    def counter_values(self) -> dict[str, int]:
        values = self.counters.as_dict()
        if self.flight is not None:
            values.update(self.flight.as_counters())
        if self._timers is not None:
            values.update(phase_timers.as_counters(self._timers))
        return values

    def remove_timers(self) -> None:
        """Unwrap the pieces ``MOEREPLAY_TIMERS`` wrapped (their totals stay in the counters)."""
        untime, self._untime = self._untime, None
        if untime is not None:
            untime()

    def prepare(self, target: CaptureTarget, original: Callable[..., Any]) -> Callable[[], None] | None:
        """Once per wrapped target (from the patcher): register its codecs, install its family's process-state
        hooks (:class:`moereplay.ops.surface.ProcessStateHooks`)."""
        for module in target.codec_modules:
            importlib.import_module(module)
        if not target.process_state:
            return None
        hooks: Any = importlib.import_module(target.process_state)
        if target.process_state_via:
            state_module = hooks.layer_state(original, target.process_state_via)
            if state_module is None:
                return None
            self._state_modules[id(original)] = state_module
            layer_ref = original

            def forget_state() -> None:
                self._state_modules.pop(id(layer_ref), None)

            return forget_state
        probe, undo = hooks.install_probe(original)
        self._probes[id(original)] = probe
        original_ref = original  # keeps the id valid while the probe is registered

        def forget() -> None:
            self._probes.pop(id(original_ref), None)
            if undo is not None:
                undo()

        return forget

    # --- the wrapped call -------------------------------------------------------------------------------------

    def call(
        self,
        target: CaptureTarget,
        binder: ArgumentBinder,
        original: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        if self.layer_scope:
            return self._layer_call(target, binder, original, args, kwargs)
        try:
            plan = self._before(target, binder, args, kwargs, original)
        except Exception as error:
            self._internal_error(f"{target.op} (before the call)", error)
            plan = None
        if plan is None:
            return original(*args, **kwargs)
        is_parent = target.role == "parent"
        if is_parent:
            self._local.parents.append(plan)
        try:
            result = original(*args, **kwargs)
        except BaseException as error:
            if plan.recorded:
                try:
                    self._after(plan, None, error)
                except Exception as internal:
                    self._internal_error(f"{target.op} (after a failed call)", internal)
            raise
        finally:
            if is_parent:
                self._local.parents.pop()
        if plan.recorded:
            try:
                self._after(plan, result, None)
            except Exception as error:
                self._internal_error(f"{target.op} (after the call)", error)
        return result

    # --- the layer-scope flight recorder (one ring copy per outermost call) ---------------------------------

    def _layer_call(
        self,
        target: CaptureTarget,
        binder: ArgumentBinder,
        original: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """The serving-thread path of ``MOEREPLAY_FLIGHT_SCOPE=layer``: calls inside an outermost call pass
        straight through; the outermost call is bound, its dynamic tensors collected, and copied (with its
        output and the output's check) by one ring launch after it returns."""
        parents = self._local.parents
        if parents:
            return original(*args, **kwargs)
        started = time.perf_counter_ns()
        try:
            call = self._layer_before(target, binder, args, kwargs, original)
        except TooLarge as error:  # the call does not fit the ring: not kept, counted
            assert isinstance(self.flight, LayerFlight)
            self.flight.too_large(error)
            call = None
        except Exception as error:
            self._internal_error(f"{target.op} (before the call)", error)
            call = None
        spent = time.perf_counter_ns() - started
        parents.append(_OUTERMOST)
        try:
            result = original(*args, **kwargs)
        except BaseException as error:
            if call is not None:
                started = time.perf_counter_ns()
                self._layer_after(call, None, error)
                spent += time.perf_counter_ns() - started
            self.counters.host_ns += spent
            raise
        finally:
            parents.pop()
        if call is not None:
            started = time.perf_counter_ns()
            self._layer_after(call, result, None)
            spent += time.perf_counter_ns() - started
        self.counters.host_ns += spent
        return result

    def _layer_before(
        self,
        target: CaptureTarget,
        binder: ArgumentBinder,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        original: Callable[..., Any],
    ) -> LayerCall | None:
        if not self.active:
            return None
        flight = self.flight
        assert isinstance(flight, LayerFlight)
        where = self.tracker.where(parent=None, is_parent=target.role == "parent")
        sequence = self._sequence
        self._sequence = sequence + 1
        self.counters.seen += 1
        if self._cuda and is_capturing():  # its calls inside pass through
            return self._graph_before(target, binder, args, kwargs, original, where, sequence)
        if not self._selected(target, where):
            self.counters.skipped_filters += 1
            return None
        bound = _bind(target, binder, args, kwargs)
        if (self.settings.per_shape or self.settings.sample < 1.0) and not self._admit(target, bound):
            return None
        self.counters.selected += 1
        probe = self._probes.get(id(original)) if target.probes_state else None
        if probe is not None:
            bound.update(probe.state())
        call = flight.before(target, bound, where, sequence)
        try:
            self._attach(call, target, original, probe)
        except BaseException:
            flight.join(call)  # the call is not kept: its stream still waits for a copy beside it
            raise
        return call

    def _graph_before(
        self,
        target: CaptureTarget,
        binder: ArgumentBinder,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        original: Callable[..., Any],
        where: Where,
        sequence: int,
    ) -> LayerCall | None:
        """A layer call made while a CUDA graph is being captured: kept by ring kernels captured into the graph
        after it (:mod:`moereplay.capture.flight_graph`), else skipped and counted. Its context has no step nor
        tag (a replay is no host step); MOEREPLAY_STEPS therefore leaves it out, sampling and per-shape limits
        do not apply (a captured call runs on every replay)."""
        flight = self.flight
        assert isinstance(flight, LayerFlight)
        graph = flight.graph
        if graph is None:
            self._skipped_graph_capture()
            return None
        where = Where(
            where.call, None, where.layer, where.layer_name, None, where.cudagraph_mode, where.parallel
        )
        if not self._selected(target, where):
            self.counters.skipped_filters += 1
            return None
        bound = _bind(target, binder, args, kwargs)
        probe = self._probes.get(id(original)) if target.probes_state else None
        if probe is not None:
            bound.update(probe.state())
        call, copy_first = flight.collect(target, bound, where, sequence)
        if copy_first:  # its inputs would have to be copied before it: one more reservation, not supported
            graph.not_kept("a call that may write its inputs (or whose output buffer overlaps one)")
            self.counters.skipped_graph_capture += 1
            return None
        call.graph = True
        self.counters.selected += 1
        self._attach(call, target, original, probe)
        return call

    def _attach(
        self, call: LayerCall, target: CaptureTarget, original: Callable[..., Any], probe: Any
    ) -> None:
        """Give a layer call its GEMMs' process state and its opt_flags probe (started here)."""
        if target.process_state_via:
            call.state_module = self._state_modules.get(id(original))
        if probe is not None:
            extra_context = probe.context()
            if extra_context:
                call.extra_context = extra_context
            call.probe = probe
            probe.start()

    def _layer_after(self, call: LayerCall, result: Any, error: BaseException | None) -> None:
        flight = self.flight
        assert isinstance(flight, LayerFlight)
        try:
            if call.probe is not None and error is None:
                extra_outputs = call.probe.outputs()
                if extra_outputs:
                    call.extra_outputs = extra_outputs
            if call.graph:
                assert flight.graph is not None
                if not flight.graph.capture(call, result, error):
                    self.counters.skipped_graph_capture += 1
                return
            flight.after(call, result, error)
        except TooLarge as too_large:
            flight.too_large(too_large)
        except Exception as internal:
            self._internal_error(f"{call.target.op} (after the call)", internal)
        finally:
            if call.joined is not None:  # (after did not get that far)
                flight.join(call)

    def _emit_layer_call(self, begin: Begin, complete: Complete | None, delivered: Delivered) -> bool:
        """Hand a flight call to the writer (False: not handed over, ``MOEREPLAY_MAX_CALLS``); ``delivered`` is
        then told whether it reached the file (a refused offer included)."""
        if self.writer is None or not self._count_flight_call():
            return False
        self.writer.offer_call(begin, complete, delivered)
        return True

    def _count_flight_call(self) -> bool:
        settings = self.settings
        with self._lock:
            if settings.max_calls and self._recorded >= settings.max_calls:
                self.counters.skipped_limit += 1
                return False
            self._recorded += 1
        return True

    def _before(
        self,
        target: CaptureTarget,
        binder: ArgumentBinder,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        original: Callable[..., Any] | None = None,
    ) -> _Plan | None:
        if not self.active:
            return None
        capturing = self._cuda and torch.cuda.is_current_stream_capturing()
        if self.flight is not None and not capturing:  # its event queries would break the graph capture
            self.flight.poll()  # the kernel-scope recorder reads finished checks here (launches nothing)
        parents = self._local.parents
        parent = parents[-1] if parents else None
        where = self.tracker.where(parent=parent.where if parent else None, is_parent=target.role == "parent")
        with self._lock:
            sequence = self._sequence
            self._sequence += 1
        self.counters.seen += 1
        plan = _Plan(target, where, sequence, recorded=False)
        if capturing:
            self._skipped_graph_capture()
            return plan if target.role == "parent" else None
        if not self._selected(target, where):
            self.counters.skipped_filters += 1
            return plan if target.role == "parent" else None
        bound = _bind(target, binder, args, kwargs)
        if not self._admit(target, bound):
            return plan if target.role == "parent" else None
        plan.recorded = True
        plan.bound = bound
        self.counters.selected += 1
        context = where.as_dict(self.tracker.ranks)
        if target.process_state_via:
            state_module = self._state_modules.get(id(original))
            if state_module is not None:
                context.update(state_module.context())
        if target.probes_state:
            plan.probe = self._probes.get(id(original))
            if plan.probe is not None:
                bound.update(plan.probe.state())
                context.update(plan.probe.context())
        parent_sequence = parent.sequence if parent is not None and parent.recorded else None
        plan.keep = []
        if isinstance(self.flight, FlightRecorder):
            inputs = snapshot(bound, target.static, to_host=False, keep=plan.keep, record_event=False)
            begin = Begin(sequence, target.op, target.site, inputs, context, parent_sequence, target.static)
            begin.started = time.time()
            self.flight.add_begin(begin)
        else:
            assert self.writer is not None
            if not self.writer.has_room(estimate(bound, target.static)):
                self.counters.dropped_queue_full += 1
                self.writer.drop(sequence)
                with self._lock:
                    self._recorded -= 1
                plan.recorded = False
                return plan if target.role == "parent" else None
            inputs = snapshot(bound, target.static, to_host=True, keep=plan.keep)
            begin = Begin(sequence, target.op, target.site, inputs, context, parent_sequence, target.static)
            begin.started = time.time()
            if not self.writer.offer(begin):
                self.counters.dropped_queue_full += 1
                with self._lock:
                    self._recorded -= 1
                plan.recorded = False
                return plan if target.role == "parent" else None
            if self._cuda:
                plan.device_start = record_cuda_event(timing=True)
        if plan.probe is not None:
            plan.probe.start()
        plan.started = time.perf_counter()
        return plan

    def _skipped_graph_capture(self) -> None:
        self.counters.skipped_graph_capture += 1
        if not self._graph_warned:
            self._graph_warned = True
            logger.warning(GRAPH_WARNING)

    def _selected(self, target: CaptureTarget, where: Where) -> bool:
        settings = self.settings
        selected = self._ops_selected.get(target.op)
        if selected is None:  # fnmatch once per op, not per call
            selected = self._ops_selected[target.op] = settings.op_selected(target.op)
        if not selected:
            return False
        if not settings.steps.unbounded and (where.step is None or not settings.steps.contains(where.step)):
            return False
        return settings.layers.everything or settings.layers.contains(where.layer, where.layer_name)

    def _admit(self, target: CaptureTarget, bound: dict[str, Any]) -> bool:
        """Limits and sampling, in that order; counts a kept call against ``max_calls``."""
        settings = self.settings
        with self._lock:
            if settings.max_calls and self._recorded >= settings.max_calls:
                self.counters.skipped_limit += 1
                if self.flight is None and self.active:
                    self.active = False  # nothing more will be recorded: back to the pass-through
                    logger.warning(
                        "moereplay: MOEREPLAY_MAX_CALLS=%d reached; recording stops", settings.max_calls
                    )
                return False
            if settings.per_shape:
                key = shape_signature(target.op, bound)
                seen = self._per_shape.get(key, 0)
                if seen >= settings.per_shape:
                    self.counters.skipped_limit += 1
                    return False
                self._per_shape[key] = seen + 1
            if settings.sample < 1.0:
                eligible = self._eligible
                self._eligible += 1
                if int((eligible + 1) * settings.sample) == int(eligible * settings.sample):
                    self.counters.skipped_filters += 1
                    return False
            if self.flight is None:
                self._recorded += 1
        return True

    def _after(self, plan: _Plan, result: Any, error: BaseException | None) -> None:
        target = plan.target
        bound = plan.bound or {}
        elapsed = time.perf_counter() - plan.started
        outputs: dict[str, Any] = {}
        for name in target.outputs:
            value = bound.get(name)
            if isinstance(value, torch.Tensor):
                outputs[name] = value
        if error is None and not is_view_of_any(result, outputs.values()):
            outputs["return"] = result
        if plan.probe is not None:
            outputs.update(plan.probe.outputs())
        status = "completed" if error is None else "failed"
        message = None if error is None else f"{type(error).__name__}: {error}"[:2000]
        if isinstance(self.flight, FlightRecorder):
            kept = snapshot(outputs, (), to_host=False, record_event=False)
            complete = Complete(plan.sequence, kept, {"host_s": elapsed}, status, message)
            complete.finished = time.time()
            tensors = [value for value in outputs.values() if isinstance(value, torch.Tensor)]
            plan.keep = None
            self.flight.add_complete(complete, tensors)
            return
        assert self.writer is not None
        copied: Snapshot = snapshot(outputs, (), to_host=True)
        plan.keep = None
        complete = Complete(plan.sequence, copied, {"host_s": elapsed}, status, message)
        complete.finished = time.time()
        if plan.device_start is not None and error is None:
            end = record_cuda_event(timing=True)
            complete.device_timing = (plan.device_start, end)
        self.writer.offer(complete)

    # --- flight recorder → writer ---------------------------------------------------------------------------

    def _emit_flight_entry(self, entry: FlightEntry, delivered: Delivered) -> bool:
        """As :meth:`_emit_layer_call`, for the kernel-scope recorder's ring entries."""
        if self.writer is None or entry.begin is None or not self._count_flight_call():
            return False
        self.writer.offer_call(entry.begin, entry.complete, delivered)
        return True

    def _emit_flight_complete(self, complete: Complete) -> None:
        if self.writer is not None:
            self.writer.offer(complete)

    def prepare_graph_capture(self) -> None:
        """Called before a CUDA graph capture begins (``GraphGate``, outside the capture): allocate the current
        device's graph ring and compile its kernels while that is still allowed. Never raises."""
        flight = self.flight
        if not self.active or not isinstance(flight, LayerFlight) or flight.graph is None:
            return
        try:
            flight.graph.prepare(torch.device("cuda", torch.cuda.current_device()))
        except Exception as error:  # no graph ring on this device: its layer calls are not kept (counted)
            logger.error(
                "moereplay: flight recorder: no graph ring (%s: %s); layer calls in CUDA graphs are not kept",
                type(error).__name__,
                error,
            )

    def graph_capture_begun(self) -> object:
        """Called once a CUDA graph capture has begun (``GraphGate``, on the capturing thread): the graph ring
        may stage this graph's lone layer calls off its critical path. Returns what
        :meth:`graph_capture_ending` takes (None: nothing to close)."""
        flight = self.flight
        if not self.active or not isinstance(flight, LayerFlight) or flight.graph is None:
            return None
        return flight.graph.open_capture(torch.cuda.current_device())

    def graph_capture_ending(self, token: object) -> None:
        """Called right before that capture ends: the graph ring's side branch joins the graph."""
        flight = self.flight
        if isinstance(flight, LayerFlight) and flight.graph is not None:
            flight.graph.close_capture(token)

    def graph_capture_ended(self, token: object) -> None:
        """Called once that capture has ended: its side stream serves the next capture."""
        flight = self.flight
        if isinstance(flight, LayerFlight) and flight.graph is not None:
            flight.graph.release_capture(token)

    def poll(self) -> float | None:
        """Called by the writer thread between messages: run the flight recorder's pending checks. Returns the
        seconds the recorder can wait for the next poll, or None (see ``WriterThread.set_poll``)."""
        if self.flight is not None and self.active:
            return self.flight.poll(launch=True)
        return None


def _bind(
    target: CaptureTarget, binder: ArgumentBinder, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The call's arguments by name; for a method target, ``self`` replaced by the attributes it records."""
    bound = binder.bind(args, kwargs)
    if target.self_attributes and args:
        owner = args[0]
        bound.pop(binder.positional[0] if binder.positional else "self", None)
        for name in target.self_attributes:
            bound[f"self.{name}"] = getattr(owner, name, None)
    return bound


def shape_signature(op: str, bound: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two calls "the same shape": tensor shapes and dtypes, and scalar values, by argument."""
    parts: list[Any] = [op]
    for name, value in bound.items():
        if isinstance(value, torch.Tensor):
            parts.append((name, tuple(value.shape), value.dtype))
        elif value is None or isinstance(value, (bool, int, float, str)):
            parts.append((name, value))
    return tuple(parts)
