"""Timers around the layer-scope flight recorder's pieces, for finding where its serving-thread time goes.

``MOEREPLAY_TIMERS=1`` (a diagnostic, not for production: a few µs a call) wraps the recorder's pieces below with
``perf_counter_ns`` accumulators that also read their thread's CPU time (``thread_time_ns``). The file's footer
then holds, per piece, ``timer_<piece>_ns``, ``timer_<piece>_cpu_ns`` and ``timer_<piece>_calls``: a wall time
well above its CPU time is time the thread spent waiting — for the GIL, held by another thread, or for the OS —
rather than working (a launch releases the GIL: another thread may take it meanwhile). The pieces nest (an inner
piece's time is inside its caller's). ``moereplay info`` prints them; ``tools/bench/capture_bench.py --phases``
uses the same timers in a benchmark. Piece ``cu_launch`` is the driver's ``cuLaunchKernel`` inside
``launch_prepared``, for every eager ring variant compiled while the timers are installed (see
``device_ring.DRIVER_TIMER``; the graph ring's launches are made while a graph is captured, and are not timed).
A prefill-sized call's own pieces: ``before`` (around ``collect``; with the inputs' copy beside the call,
``copy_beside``: a side stream's events and its launch), ``join`` (its stream waiting for that copy), ``release``
(``record_stream`` per tensor and the metadata read early) and, for lean calls, ``record_lean`` (two launches).
The interpreter's garbage collections are timed too, by generation: pieces ``gc0``–``gc2`` once part of the
heap is frozen — vLLM's processes ``gc.freeze()`` their start-up heap when they are ready to serve, so these are
the collections of serving time — and ``gc0-startup``–``gc2-startup`` before (start-up's own explicit
``gc.collect()`` calls walk the whole heap: hundreds of ms each, never a serving cost).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Mapping
from typing import Any

Timers = dict[str, list[int]]
"""``{piece: [wall nanoseconds, calls, thread CPU nanoseconds]}``."""


def _spots() -> list[tuple[Any, str]]:
    from moereplay.capture import context, device_ring, flight_layer, recorder

    return [
        (recorder.Recorder, "_layer_before"),
        (recorder.Recorder, "_layer_after"),
        (flight_layer.LayerFlight, "poll"),
        (flight_layer.LayerFlight, "_take_new"),
        (flight_layer.LayerFlight, "_launch_reads"),
        (flight_layer.LayerFlight, "_evict"),
        (flight_layer.LayerFlight, "_check_inline"),
        (flight_layer.LayerFlight, "_check_in_place"),
        (context.ContextTracker, "where"),
        (recorder, "_bind"),
        (flight_layer.LayerFlight, "before"),
        (flight_layer.LayerFlight, "collect"),
        (flight_layer.LayerFlight, "_copy_beside"),
        (flight_layer.LayerFlight, "after"),
        (flight_layer.LayerFlight, "join"),
        (flight_layer.LayerFlight, "release"),
        (flight_layer, "collect_outputs"),
        (device_ring.DeviceRing, "record"),
        (device_ring.DeviceRing, "record_lean"),
        (device_ring.DeviceRing, "_measure"),
        (device_ring.DeviceRing, "_reserve"),
        (device_ring._Launcher, "launch_prepared"),
    ]


def install() -> tuple[Timers, Callable[[], None]]:
    """Wrap the pieces (process-wide, every thread); returns the timers and the function that unwraps them."""
    times: Timers = {}
    saved: list[tuple[Any, str, Any]] = []
    for owner, name in _spots():
        raw = owner.__dict__.get(name)
        if raw is None:  # a piece renamed since: timed no more, never an error in a serving process
            continue
        original = raw.__func__ if isinstance(raw, staticmethod) else raw
        piece = name.lstrip("_")
        cell = times.setdefault(piece, [0, 0, 0])

        timed_piece = _timed(original, cell)
        setattr(owner, name, staticmethod(timed_piece) if isinstance(raw, staticmethod) else timed_piece)
        saved.append((owner, name, raw))

    collecting = _time_garbage_collections(times)
    gc.callbacks.append(collecting)
    from moereplay.capture import device_ring

    previous_timer = device_ring.DRIVER_TIMER
    driver_timer = device_ring.DRIVER_TIMER = _driver_timer(times.setdefault("cu_launch", [0, 0, 0]))

    def undo() -> None:
        for owner, name, raw in reversed(saved):
            setattr(owner, name, raw)
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(collecting)
        # (ring variants compiled meanwhile keep their timed call)
        if device_ring.DRIVER_TIMER is driver_timer:
            device_ring.DRIVER_TIMER = previous_timer

    return times, undo


def _driver_timer(cell: list[int]) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Wraps an eager ring variant's ``cuLaunchKernel`` (see ``device_ring.DRIVER_TIMER``): piece ``cu_launch``,
    the driver call inside ``launch_prepared`` — what the launch costs in the driver, apart from the Python that
    fills its parameter block (a standalone launch took ~8.4 µs of host time, ``launch_prepared`` in a served eager
    engine 35–51). Also inside it: ctypes converting the call's 11 arguments (the call keeps the GIL), and a switch
    to another thread when the interpreter checks for one as the call returns — the CPU column tells that wait
    from the driver's work."""

    def wrap(driver: Callable[..., int]) -> Callable[..., int]:
        return _timed(driver, cell)

    return wrap


def _timed(function: Callable[..., Any], cell: list[int]) -> Callable[..., Any]:
    """``function`` adding each call's wall and thread CPU nanoseconds and the call to ``cell``."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        cpu = time.thread_time_ns()
        started = time.perf_counter_ns()
        try:
            return function(*args, **kwargs)
        finally:
            cell[0] += time.perf_counter_ns() - started
            cell[2] += time.thread_time_ns() - cpu
            cell[1] += 1

    return timed


def _time_garbage_collections(times: Timers) -> Callable[[str, dict[str, Any]], None]:
    """A ``gc.callbacks`` entry timing the interpreter's collections (on whichever thread ran them) as pieces
    ``gc0``–``gc2`` while part of the heap is frozen, else ``gc0-startup``–``gc2-startup`` (see the module
    docstring): the recorder's per-call objects may make them more frequent, and a collection of an older
    generation walks every object not frozen."""
    serving = [times.setdefault(f"gc{generation}", [0, 0, 0]) for generation in range(3)]
    startup = [times.setdefault(f"gc{generation}-startup", [0, 0, 0]) for generation in range(3)]
    started = [0, 0]
    # whether a part of the heap has been frozen, asked until the answer is yes and never again: the freeze count
    # is the length of the frozen list, which CPython walks to count (an empty walk before the freeze; tens of ms
    # in a serving vLLM process, whose frozen heap holds millions of objects — asked at every collection it made
    # each one look that long, and slowed a served prefill ~6×). A heap unfrozen later still counts as serving.
    frozen = [False]
    freeze_count = gc.get_freeze_count

    def collecting(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            if not frozen[0]:
                frozen[0] = freeze_count() > 0  # before the clocks start: never part of a collection's time
            started[0] = time.perf_counter_ns()
            started[1] = time.thread_time_ns()
            return
        generation = info.get("generation")
        if phase == "stop" and started[0] and type(generation) is int and 0 <= generation < 3:
            cell = (serving if frozen[0] else startup)[generation]
            cell[0] += time.perf_counter_ns() - started[0]
            cell[2] += time.thread_time_ns() - started[1]
            cell[1] += 1
        started[0] = 0

    return collecting


def as_counters(times: Timers) -> dict[str, int]:
    """The footer's counters of ``times``: ``timer_<piece>_ns``, ``timer_<piece>_cpu_ns`` and
    ``timer_<piece>_calls``."""
    counters: dict[str, int] = {}
    for piece, (ns, calls, cpu) in times.items():
        counters[f"timer_{piece}_ns"] = ns
        counters[f"timer_{piece}_cpu_ns"] = cpu
        counters[f"timer_{piece}_calls"] = calls
    return counters


def from_counters(counters: Mapping[str, Any]) -> dict[str, tuple[int, int, int | None]]:
    """``{piece: (wall nanoseconds, calls, CPU nanoseconds or None)}`` of a footer's timer counters (empty
    without them)."""
    pieces: dict[str, tuple[int, int, int | None]] = {}
    for key, value in counters.items():
        if key.startswith("timer_") and key.endswith("_ns") and not key.endswith("_cpu_ns"):
            piece = key[len("timer_") : -len("_ns")]
            cpu = counters.get(f"timer_{piece}_cpu_ns")
            pieces[piece] = (
                int(value),
                int(counters.get(f"timer_{piece}_calls", 0)),
                None if cpu is None else int(cpu),
            )
    return pieces
