"""The Marlin reference's one host→device copy of its tables: the arrays' places in the copy, and the pinned
staging buffers' reuse discipline (a buffer is rewritten only after the copy that read it has run). The CUDA parts
(pinned allocation, events, streams) are replaced by stand-ins that keep the order of events; the copy itself runs
on the GPU in tests/gpu/test_marlin_rows_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moereplay.reference import marlin_moe
from moereplay.reference.marlin_moe import _PinnedStaging, _to_device_together


def test_arrays_come_back_whole_each_on_an_even_element() -> None:
    arrays = {
        "a": np.arange(3, dtype=np.int64),
        "b": np.arange(10, 20, dtype=np.int64).reshape(2, 5),
        "c": np.zeros(0, dtype=np.int64),
        "d": np.array([-1], dtype=np.int64),
    }
    moved = _to_device_together(arrays, torch.device("cpu"))
    assert list(moved) == list(arrays)
    for name, array in arrays.items():
        assert moved[name].shape == array.shape and np.array_equal(moved[name].numpy(), array), name
        # 16-byte aligned starts within the shared copy
        assert (moved[name].storage_offset() % 2 == 0) or moved[name].numel() == 0, name


LOG: list[str] = []
"""What the stand-in events saw, in order."""


class _Event:
    """A CUDA event's order of operations: ``record`` marks a copy queued, ``synchronize`` waits for it."""

    def __init__(self) -> None:
        self.pending = False

    def record(self, stream: object) -> None:
        self.pending = True
        LOG.append("record")

    def synchronize(self) -> None:
        if self.pending:
            LOG.append("wait")
        self.pending = False


@pytest.fixture
def staging(monkeypatch: pytest.MonkeyPatch) -> _PinnedStaging:
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    monkeypatch.setattr(_PinnedStaging, "_allocate", lambda self, count: torch.empty(count, dtype=torch.long))
    LOG.clear()
    return _PinnedStaging()


def test_a_buffer_is_rewritten_only_after_its_copy_ran(staging: _PinnedStaging) -> None:
    gpu = torch.device("cuda", 0)
    taken = []
    for _ in range(_PinnedStaging.BUFFERS):
        slot, buffer = staging.take(10)
        staging.copied(slot, gpu)
        taken.append((slot, buffer.data_ptr()))
    assert (
        len({ptr for _, ptr in taken}) == _PinnedStaging.BUFFERS
    )  # distinct buffers while copies are queued
    assert "wait" not in LOG
    slot, buffer = staging.take(10)  # the first buffer again: its copy must have run first
    assert (slot, buffer.data_ptr()) == taken[0] and LOG[-1] == "wait"
    staging.copied(slot, gpu)
    assert LOG.count("wait") == 1


def test_buffers_grow_to_the_copy_and_a_new_device_gets_its_own_event(staging: _PinnedStaging) -> None:
    slot, buffer = staging.take(5000)
    assert buffer.numel() >= 5000
    staging.copied(slot, torch.device("cuda", 0))
    first_event = staging.events[slot]
    for _ in range(_PinnedStaging.BUFFERS - 1):
        staging.take(1)
    slot_again, bigger = staging.take(9000)
    assert slot_again == slot and bigger.numel() >= max(9000, 2 * 5000)
    staging.copied(slot, torch.device("cuda", 1))
    assert staging.events[slot] is not first_event and staging.events[slot][1] == torch.device("cuda", 1)


def test_each_thread_has_its_own_buffers() -> None:
    import threading

    seen = []
    thread = threading.Thread(
        target=lambda: seen.append((marlin_moe._STAGING.turn, len(marlin_moe._STAGING.buffers)))
    )
    turn = marlin_moe._STAGING.turn
    marlin_moe._STAGING.turn = (turn + 1) % _PinnedStaging.BUFFERS
    try:
        thread.start()
        thread.join()
    finally:
        marlin_moe._STAGING.turn = turn
    assert seen == [(0, 0)]
