"""MOEREPLAY_TIMERS' garbage-collection pieces: timed by generation while installed, gone after the undo; start-up
collections (nothing frozen yet) apart from serving ones (vLLM froze its start-up heap)."""

from __future__ import annotations

import gc
import types
from collections.abc import Iterator

import pytest

from moereplay.capture import phase_timers


@pytest.fixture
def no_automatic_collections() -> Iterator[None]:
    """Only the test's own collections (``gc.collect`` runs regardless): exact counts."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def test_collections_are_timed_by_generation_until_undone(no_automatic_collections: None) -> None:
    before = list(gc.callbacks)
    times, undo = phase_timers.install()
    try:
        gc.collect(0)
        gc.collect(2)
        assert times["gc0-startup"][1] >= 1 and times["gc2-startup"][1] >= 1
        assert times["gc2-startup"][0] > 0 and times["gc2-startup"][2] >= 0  # wall and CPU nanoseconds
        counters = phase_timers.as_counters(times)
        assert counters["timer_gc2-startup_calls"] == times["gc2-startup"][1]
        assert phase_timers.from_counters(counters)["gc2-startup"][1] == times["gc2-startup"][1]
    finally:
        undo()
    assert gc.callbacks == before
    calls = times["gc2-startup"][1]
    gc.collect(2)
    assert times["gc2-startup"][1] == calls  # no longer timed


def test_collections_before_a_freeze_are_startup_pieces(no_automatic_collections: None) -> None:
    times, undo = phase_timers.install()
    try:
        assert gc.get_freeze_count() == 0
        gc.collect(2)
        assert times["gc2-startup"][1] == 1 and times["gc2"][1] == 0
        gc.freeze()  # as vLLM's processes do once ready to serve
        try:
            assert gc.get_freeze_count() > 0
            gc.collect(2)
            assert times["gc2"][1] == 1 and times["gc2-startup"][1] == 1
        finally:
            gc.unfreeze()
    finally:
        undo()


def test_the_freeze_count_is_asked_until_a_freeze_is_seen_then_never(
    monkeypatch: pytest.MonkeyPatch, no_automatic_collections: None
) -> None:
    """CPython counts the frozen objects by walking their list: in a serving vLLM process (millions frozen) one
    ask takes tens of ms. Asked at every collection, it made each collection look that long and slowed a served
    prefill ~6× (the thirtieth session's eager bench with MOEREPLAY_TIMERS)."""
    answers = iter([0, 0, 7])
    asked: list[int] = []
    clock = [0]  # the timers' clocks: a tick a read, and a second for the slow ask below

    def tick() -> int:
        clock[0] += 1
        return clock[0]

    def freeze_count() -> int:
        answer = next(answers, 7)
        asked.append(answer)
        if answer:  # as slow as walking a served process's frozen heap: never inside a collection's time
            clock[0] += 10**9
        return answer

    monkeypatch.setattr(
        phase_timers, "time", types.SimpleNamespace(perf_counter_ns=tick, thread_time_ns=tick)
    )
    monkeypatch.setattr(gc, "get_freeze_count", freeze_count)
    times, undo = phase_timers.install()
    try:
        gc.collect(0)
        gc.collect(0)
        assert times["gc0-startup"][1] == 2 and times["gc0"][1] == 0 and asked == [0, 0]
        for _ in range(5):
            gc.collect(0)
        assert times["gc0"][1] == 5 and times["gc0-startup"][1] == 2
        assert asked == [0, 0, 7]  # once seen frozen, never asked again
        assert times["gc0"][0] < 10**9  # the one-second ask came before the first one's clocks started
    finally:
        undo()


def test_the_driver_call_of_each_ring_launch_is_a_piece_of_its_own_while_installed() -> None:
    """``cu_launch``: the driver's ``cuLaunchKernel`` alone, wrapped into every ring kernel compiled while the
    timers are installed (``device_ring.DRIVER_TIMER``); nothing is wrapped once they are undone."""
    from moereplay.capture import device_ring

    assert device_ring.DRIVER_TIMER is None
    times, undo = phase_timers.install()
    try:
        calls: list[tuple[int, ...]] = []

        def driver(*args: int) -> int:
            calls.append(args)
            return 0

        timed = device_ring.DRIVER_TIMER(driver)
        assert timed(1, 2, 3) == 0 and timed(4) == 0
        assert calls == [(1, 2, 3), (4,)] and times["cu_launch"][1] == 2 and times["cu_launch"][0] > 0
        assert phase_timers.as_counters(times)["timer_cu_launch_calls"] == 2
    finally:
        undo()
    assert device_ring.DRIVER_TIMER is None


def test_a_ring_kernel_compiled_while_timed_launches_through_the_timed_driver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ring_kernel.compile_launcher``'s direct launch (no GPU here: the compiled kernel and the driver are
    stand-ins, the parameter block and the launch path are the real ones)."""
    pytest.importorskip("triton")
    import contextlib
    import types

    import torch

    from moereplay.capture import ring_kernel

    launched: list[tuple[object, ...]] = []
    monkeypatch.setattr(ring_kernel, "_driver", lambda: lambda *args: launched.append(args) or 0)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    metadata = types.SimpleNamespace(num_warps=4, shared=0, global_scratch_size=0, profile_scratch_size=0)
    compiled = types.SimpleNamespace(run=None, function=7, packed_metadata=None, metadata=metadata)
    kernel = types.SimpleNamespace(warmup=lambda *args, **kwargs: compiled)
    times, undo = phase_timers.install()
    try:
        launch = ring_kernel.compile_launcher(kernel, 3, {"BLOCK": 1}, 0, name="test", timed=True)
        launch(5, 0, [1, 2, 3])
        # the graph ring's kernel (compiled without ``timed``): its launches are captured into graphs, not timed
        graph = ring_kernel.compile_launcher(kernel, 3, {"BLOCK": 1}, 0, name="graph record")
        graph(5, 0, [1, 2, 3])
    finally:
        undo()
    assert len(launched) == 2 and launched[0][:2] == (7, 5)
    assert times["cu_launch"][1] == 1
    untimed = ring_kernel.compile_launcher(kernel, 3, {"BLOCK": 1}, 0, name="test", timed=True)
    untimed(5, 0, [1, 2, 3])
    assert len(launched) == 3 and times["cu_launch"][1] == 1  # compiled after the undo: not timed


def test_an_undo_restores_the_driver_timer_it_replaced() -> None:
    """Two installs (a benchmark's inside a served process's): undoing the inner one leaves the outer's timer."""
    from moereplay.capture import device_ring

    _, outer_undo = phase_timers.install()
    try:
        outer = device_ring.DRIVER_TIMER
        _, inner_undo = phase_timers.install()
        try:
            assert device_ring.DRIVER_TIMER is not outer
        finally:
            inner_undo()
        assert device_ring.DRIVER_TIMER is outer
    finally:
        outer_undo()
    assert device_ring.DRIVER_TIMER is None
