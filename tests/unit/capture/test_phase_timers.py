"""MOEREPLAY_TIMERS' garbage-collection pieces: timed by generation while installed, gone after the undo."""

from __future__ import annotations

import gc

from moereplay.capture import phase_timers


def test_collections_are_timed_by_generation_until_undone() -> None:
    before = list(gc.callbacks)
    times, undo = phase_timers.install()
    try:
        gc.collect(0)
        gc.collect(2)
        assert times["gc0"][1] >= 1 and times["gc2"][1] >= 1
        assert times["gc2"][0] > 0 and times["gc2"][2] >= 0  # wall and CPU nanoseconds
        counters = phase_timers.as_counters(times)
        assert counters["timer_gc2_calls"] == times["gc2"][1]
        assert phase_timers.from_counters(counters)["gc2"][1] == times["gc2"][1]
    finally:
        undo()
    assert gc.callbacks == before
    calls = times["gc2"][1]
    gc.collect(2)
    assert times["gc2"][1] == calls  # no longer timed
