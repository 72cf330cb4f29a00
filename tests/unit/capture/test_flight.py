"""MOEREPLAY_TRIGGER=flight, MOEREPLAY_FLIGHT_SCOPE=kernel: nothing is written until an output goes bad; then the ring up to the bad call."""

from __future__ import annotations

import types

import torch

from moereplay.format import CaptureReader


def run(
    kernels: types.ModuleType, inputs, *, bad_step: int | None, steps: int = 12, huge_step: int | None = None
):
    x, w1, w2, weights = inputs()
    for step in range(steps):
        value = x + step
        if step == bad_step:
            value = value.clone()
            value[1, 2] = float("nan")
        if step == huge_step:
            value = value * 1e6
        kernels.fused(value, w1, w2, weights)


def test_no_trigger_writes_nothing(arm, kernels: types.ModuleType, inputs) -> None:
    session = arm(trigger="flight", flight_scope="kernel", flight_calls="6")
    run(kernels, inputs, bad_step=None)
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        assert len(reader) == 0
        counters = reader.footer["counters"]
        assert counters["flight_triggers"] == 0 and counters["flight_checked"] == 36


def test_nan_writes_the_ring_ending_with_the_offending_call(arm, kernels: types.ModuleType, inputs) -> None:
    session = arm(trigger="flight", flight_scope="kernel", flight_calls="6")
    run(kernels, inputs, bad_step=7)
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        counters = reader.footer["counters"]
        # step 7 is calls 21 (fused) 22 (gemm) 23 (gemm): gemm 22 goes bad first (the ring: 17-22), then its
        # consumer gemm 23 (a second trigger, alone); the parent 21 is written with its completion
        assert [r.context["call"] for r in records] == [17, 18, 19, 20, 21, 22, 23]
        assert [r.context["flight"]["trigger"] for r in records] == [False] * 5 + [True, True]
        assert counters["flight_triggers"] == 2 and counters["flight_lost"] == 0
        last = records[5]
        assert last.op == "gemm" and last.status == "completed"
        assert torch.isnan(reader.load_outputs(last.index)["output"]).any()
        assert torch.isnan(reader.load_args(last.index)["input"]).any()
        # the ring's earlier calls are complete and replayable
        assert all(r.status == "completed" for r in records)


def test_absmax_triggers_on_large_finite_outputs(arm, kernels: types.ModuleType, inputs) -> None:
    session = arm(trigger="flight", flight_scope="kernel", flight_calls="3", absmax="1e5")
    run(kernels, inputs, bad_step=None, huge_step=4)
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        assert [r.context["call"] for r in records] == [11, 12, 13, 14]
        magnitude = records[2].context["flight"]["magnitude"]
        assert magnitude > 1e5 and records[2].context["flight"]["trigger"]
        assert records[1].op == "fused" and records[1].status == "completed"


def test_entries_awaiting_their_check_keep_the_entries_before_them() -> None:
    """On CUDA checks lag behind calls (the writer thread launches and reads them): an entry awaiting its check
    keeps itself and the K - 1 entries before it, even when later calls push the ring past K."""
    from moereplay.capture.flight import FlightRecorder
    from moereplay.capture.snapshot import Snapshot
    from moereplay.capture.writer_thread import Begin

    flight = FlightRecorder(
        max_calls=3, max_bytes=1 << 20, absmax=None, emit=lambda entry, delivered: False, emit_complete=print
    )
    for sequence in range(4):  # checked (not pending): the ring keeps the last 3
        flight.add_begin(Begin(sequence, "op", "site", Snapshot({}), {"call": sequence}, None))
    assert [entry.begin.sequence for entry in flight._ring] == [1, 2, 3]
    flight._ring[-1].pending = True  # call 3's check is outstanding
    for sequence in range(4, 7):
        flight.add_begin(Begin(sequence, "op", "site", Snapshot({}), {"call": sequence}, None))
    assert [entry.begin.sequence for entry in flight._ring] == [1, 2, 3, 4, 5, 6]  # 3 and its history stay
    flight._ring[2].pending = False  # call 3 is checked: fine
    flight.add_begin(Begin(7, "op", "site", Snapshot({}), {"call": 7}, None))
    assert [entry.begin.sequence for entry in flight._ring] == [5, 6, 7]
