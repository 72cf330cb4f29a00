"""MOEREPLAY_TIMERS' garbage-collection pieces: timed by generation while installed, gone after the undo; start-up
collections (nothing frozen yet) apart from serving ones (vLLM froze its start-up heap)."""

from __future__ import annotations

import gc

from moereplay.capture import phase_timers


def test_collections_are_timed_by_generation_until_undone() -> None:
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


def test_collections_before_a_freeze_are_startup_pieces() -> None:
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
