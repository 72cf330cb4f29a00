"""The layer flight recorder's history bookkeeping against its definition, on random histories.

``LayerFlight._evict`` runs after every eager call on the serving thread, so it finds the first open call by the
calls' orders instead of walking the history. These tests hold it to the plain definition: the oldest call
leaves while the history is longer than ``max_calls``, it is checked (or written), and no open call (unchecked,
not written) lies among the ``max_calls - 1`` calls after it; then written-and-checked calls at the front leave.
"""

from __future__ import annotations

import types
from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from moereplay.capture import flight_layer


def evict_by_definition(history: list[types.SimpleNamespace], max_calls: int) -> tuple[list[int], int]:
    """The orders left and how many unwritten calls were evicted, by walking the history."""
    left = list(history)
    evicted = 0

    def is_open(call: types.SimpleNamespace) -> bool:
        return not (call.checked or call.emitted)

    while left and not is_open(left[0]) and len(left) > max_calls:
        if any(is_open(call) for call in left[1:max_calls]):
            break
        old = left.pop(0)
        evicted += not old.emitted
    while left and left[0].emitted and left[0].checked:
        left.pop(0)
    return [call.order for call in left], evicted


states = st.sampled_from(["checked", "open", "emitted", "emitted-checked"])


@settings(max_examples=400, deadline=None)
@given(
    st.lists(states, max_size=40),
    st.integers(min_value=1, max_value=8),
    st.integers(min_value=0, max_value=5),
    st.booleans(),
)
def test_evict_keeps_what_the_definition_keeps(kinds, max_calls, first_order, via_reads) -> None:
    flight = flight_layer.LayerFlight(
        max_calls=max_calls, max_bytes=1 << 12, absmax=None, emit=lambda *a: True
    )
    history = []
    for offset, kind in enumerate(kinds):
        call = types.SimpleNamespace(
            order=first_order + offset,
            checked=kind in ("checked", "emitted-checked"),
            emitted=kind.startswith("emitted"),
        )
        history.append(call)
    unchecked = [call for call in history if not call.checked]  # written-but-unchecked calls wait there too
    expected, evicted = evict_by_definition(history, max_calls)
    flight._history = deque(history)
    if via_reads and unchecked:  # some open calls wait on a word read instead
        half = len(unchecked) // 2
        flight._unchecked = deque(unchecked[:half])
        flight._reads = deque([types.SimpleNamespace(calls=unchecked[half:])])
    else:
        flight._unchecked = deque(unchecked)
    flight._evict()
    assert [call.order for call in flight._history] == expected
    assert flight.counters.evicted == evicted


def test_the_serving_threads_check_stops_at_the_first_unfinished_word() -> None:
    """Words are read oldest first up to the first unfinished one (its launch has not run): the work per call
    stays bounded however far the serving thread runs ahead; the later calls wait their turn, and a bad one
    among the finished is left (unchecked, in order) for the writer thread."""
    import numpy as np

    words = np.zeros(8, dtype=np.int64)
    ring = types.SimpleNamespace(host_words=words)
    flight = flight_layer.LayerFlight(max_calls=4, max_bytes=1 << 12, absmax=100.0, emit=lambda *a: True)
    calls = [
        types.SimpleNamespace(ring=ring, tag=(slot, 1), checked=False, emitted=False, value=None, order=slot)
        for slot in range(5)
    ]
    ok = 1 << 32 | 0x3F800000  # generation 1, |x| = 1.0
    large = 1 << 32 | 0x447A0000  # generation 1, |x| = 1000.0 > absmax
    words[[0, 2, 3]] = ok
    words[4] = large  # call 1's word is still unwritten (generation 0: pending)
    flight._unchecked = deque(calls)
    assert flight._check_in_place()
    assert [call.checked for call in calls] == [True, False, False, False, False]
    assert list(flight._unchecked) == calls[1:] and flight.counters.checked == 1
    words[1] = ok  # call 1 finishes: 1, 2, 3 are checked, 4 is bad and left for the writer
    assert not flight._check_in_place()
    assert [call.checked for call in calls] == [True, True, True, True, False]
    assert list(flight._unchecked) == [calls[4]] and flight.counters.triggers == 0


def test_with_calls_on_several_streams_a_pending_word_leaves_the_rest_to_the_writer() -> None:
    """On one stream a pending word means the later calls are pending too; once calls ran on two streams, one
    behind it may have finished (bad, even): the serving thread leaves them all to the writer's full read."""
    import numpy as np

    words = np.zeros(4, dtype=np.int64)
    ring = types.SimpleNamespace(host_words=words)
    calls = [
        types.SimpleNamespace(ring=ring, tag=(slot, 1), checked=False, emitted=False, value=None, order=slot)
        for slot in range(2)
    ]
    words[1] = 1 << 32 | 0x7F800000  # call 1 (another stream) finished with +Inf; call 0 still pending
    for streams, left_to_writer in (({(0, 7)}, False), ({(0, 7), (0, 9)}, True)):
        flight = flight_layer.LayerFlight(max_calls=4, max_bytes=1 << 12, absmax=None, emit=lambda *a: True)
        flight._streams_seen = set(streams)
        flight._unchecked = deque(calls)
        assert flight._check_in_place() is not left_to_writer
        assert list(flight._unchecked) == calls and not any(call.checked for call in calls)
