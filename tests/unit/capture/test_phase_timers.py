"""MOEREPLAY_TIMERS' garbage-collection pieces: timed by generation while installed, gone after the undo; start-up
collections (nothing frozen yet) apart from serving ones (vLLM froze its start-up heap)."""

from __future__ import annotations

import gc

import pytest

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


def test_the_freeze_count_is_asked_until_a_freeze_is_seen_then_never(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPython counts the frozen objects by walking their list: in a serving vLLM process (millions frozen) one
    ask takes tens of ms. Asked at every collection, it made each collection look that long and slowed a served
    prefill ~6× (the twenty-ninth session's eager bench with MOEREPLAY_TIMERS)."""
    answers = iter([0, 0, 7])
    asked: list[int] = []

    def freeze_count() -> int:
        answer = next(answers, 7)
        asked.append(answer)
        return answer

    monkeypatch.setattr(gc, "get_freeze_count", freeze_count)
    was_enabled = gc.isenabled()
    gc.disable()  # only the test's own collections (gc.collect runs regardless)
    times, undo = phase_timers.install()
    try:
        gc.collect(0)
        gc.collect(0)
        assert times["gc0-startup"][1] == 2 and times["gc0"][1] == 0 and asked == [0, 0]
        for _ in range(5):
            gc.collect(0)
        assert times["gc0"][1] == 5 and times["gc0-startup"][1] == 2
        assert asked == [0, 0, 7]  # once seen frozen, never asked again
    finally:
        undo()
        if was_enabled:
            gc.enable()
