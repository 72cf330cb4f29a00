"""MOEREPLAY_FLIGHT_SCOPE=layer (the default flight scope): one ring copy per outermost call; on a bad output the
layer calls up to it are written as parents without children, bit for bit (CPU: the ring's torch path)."""

from __future__ import annotations

import math
import struct
import sys
import types

import hypothesis
import numpy as np
import pytest
import torch
from conftest import layer_doubling
from hypothesis import strategies as st

from moereplay.capture import session as session_module
from moereplay.capture.device_ring import ALIGNMENT, DeviceRing, byte_fingerprint, decode_word
from moereplay.capture.patch_points import CaptureTarget
from moereplay.format import CaptureReader
from moereplay.format.schema import Unsupported


def run(
    kernels: types.ModuleType | None, inputs, *, bad_step=None, huge_step=None, steps: int = 12, layer=None
):
    """``steps`` calls of ``kernels.fused`` (or of ``layer(hidden, w1)``): their inputs and outputs, cloned."""
    x, w1, w2, weights = inputs()
    outputs = []
    for step in range(steps):
        value = x + step
        if step == bad_step:
            value[1, 2] = float("nan")
        if step == huge_step:
            value = value * 1e6
        result = layer(value, w1) if layer is not None else kernels.fused(value, w1, w2, weights)  # type: ignore[union-attr]
        outputs.append((value.clone(), result.clone()))
    return outputs


def close(session: session_module.Session) -> None:
    session.flush()
    session.close()


def test_no_trigger_writes_nothing_and_checks_every_layer_call(arm, kernels, inputs) -> None:
    session = arm(trigger="flight", flight_calls="6")
    assert session.recorder.layer_scope
    run(kernels, inputs)
    close(session)
    with CaptureReader(session.path) as reader:
        assert len(reader) == 0
        counters = reader.footer["counters"]
        # 12 layer calls checked; their 24 kernel calls passed straight through (not seen, not copied)
        assert counters["flight_checked"] == 12 and counters["flight_triggers"] == 0
        assert counters["recorder_seen"] == 12


def test_nan_writes_the_layer_calls_ending_with_the_offending_one(arm, kernels, inputs) -> None:
    session = arm(trigger="flight", flight_calls="6")
    calls = run(kernels, inputs, bad_step=7)
    close(session)
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        counters = reader.footer["counters"]
        assert [r.op for r in records] == ["fused"] * 6
        assert [r.context["call"] for r in records] == [2, 3, 4, 5, 6, 7]
        assert [r.context["flight"]["trigger"] for r in records] == [False] * 5 + [True]
        assert all(r.context["flight"]["scope"] == "layer" for r in records)
        assert all(r.parent is None and r.status == "completed" for r in records)
        assert counters["flight_triggers"] == 1 and counters["flight_lost"] == 0
        assert math.isnan(records[-1].context["flight"]["magnitude"])
        for record, (hidden, output) in zip(records, calls[2:8], strict=True):
            args = reader.load_args(record.index)
            recorded = reader.load_outputs(record.index)["return"]
            # bit for bit (NaN included): compare the bytes
            assert torch.equal(args["hidden"].view(torch.uint8), hidden.view(torch.uint8))
            assert torch.equal(recorded.view(torch.uint8), output.view(torch.uint8))
            assert args["w1"].shape == (8, 6)  # static: stored once per file, found by identity


def test_absmax_triggers_on_a_large_finite_output(arm, kernels, inputs) -> None:
    session = arm(trigger="flight", flight_calls="3", absmax="1e5")
    run(kernels, inputs, huge_step=4)
    close(session)
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        assert [r.context["call"] for r in records] == [2, 3, 4]
        flight = records[-1].context["flight"]
        assert flight["trigger"] and flight["magnitude"] > 1e5


def test_a_kernel_call_outside_any_layer_is_kept_itself(arm, kernels, inputs) -> None:
    session = arm(trigger="flight", flight_calls="4")
    x, w1, _w2, weights = inputs()
    bad = x.clone()
    bad[0, 0] = float("inf")
    out = torch.empty(5, 6)
    kernels.gemm(x, out, w1, weights, 1, False)
    kernels.gemm(bad, out, w1, weights, 1, False)
    close(session)
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        assert [r.op for r in records] == ["gemm", "gemm"]
        last = reader.load_args(records[1].index)
        # gemm writes its ``output`` argument: the inputs were copied before the call (a second launch)
        assert torch.isinf(last["input"]).any()
        assert not torch.isfinite(reader.load_outputs(records[1].index)["output"]).all()


def scale_in_place(x: torch.Tensor, factor: float) -> torch.Tensor:
    x.mul_(factor)
    return x


def layer_with_scratch(hidden: torch.Tensor, w1: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    torch.matmul(hidden, w1, out=cache)
    return cache.sum(dim=1, keepdim=True) * hidden


def test_inputs_written_in_place_are_recorded_as_they_were_before_the_call(
    arm, stand_in_module, inputs
) -> None:
    stand_in_module("moereplay_test_inplace", scale=scale_in_place)
    targets = (CaptureTarget("scale", "parent", "moereplay_test_inplace", "scale"),)
    session = arm(targets=targets, trigger="flight", flight_calls="4")
    module = sys.modules["moereplay_test_inplace"]
    x = torch.full((3, 4), 2.0)
    module.scale(x, 3.0)
    y = torch.full((3, 4), float("nan"))
    module.scale(y, 1.0)
    close(session)
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        assert len(records) == 2
        first = reader.load_args(records[0].index)["x"]
        assert torch.equal(first, torch.full((3, 4), 2.0))  # before the call, not 6.0
        assert torch.equal(reader.load_outputs(records[0].index)["return"], torch.full((3, 4), 6.0))


def test_scratch_buffers_are_not_kept(arm, stand_in_module, inputs) -> None:
    stand_in_module("moereplay_test_scratch", layer=layer_with_scratch)
    targets = (
        CaptureTarget(
            "layer",
            "parent",
            "moereplay_test_scratch",
            "layer",
            static=("w1",),
            scratch=("cache",),
            inputs_intact=True,
        ),
    )
    session = arm(targets=targets, trigger="flight", flight_calls="4")
    module = sys.modules["moereplay_test_scratch"]
    x, w1, _w2, _weights = inputs()
    x[0, 0] = float("nan")
    module.layer(x, w1, torch.empty(5, 6))
    close(session)
    with CaptureReader(session.path) as reader:
        (record,) = list(reader.calls())
        cache = reader.load_args(record.index)["cache"]
        assert isinstance(cache, Unsupported) and cache.repr_excerpt.startswith(
            "scratch buffer (5, 6) float32"
        )


def test_calls_too_large_for_the_ring_are_counted_and_serving_goes_on(arm, kernels, inputs) -> None:
    # the stand-in layer may write its inputs: they are copied before the call, two 256-byte spans > the ring
    session = arm(trigger="flight", flight_calls="4", flight_bytes="300")
    outputs = run(kernels, inputs, bad_step=3, steps=5)
    close(session)
    assert len(outputs) == 5  # every call returned
    with CaptureReader(session.path) as reader:
        counters = reader.footer["counters"]
        assert len(reader) == 0 and counters["flight_too_large"] == 5
    assert session.recorder.disabled_reason is None


def test_calls_overwritten_in_the_ring_are_lost_not_written_wrong(arm, kernels, inputs) -> None:
    # each layer call copies hidden (160 B) + topk (20 B) + output (160 B): three 256-byte spans; a 2 KiB ring
    # holds two calls, so of the six kept before the trigger the oldest are overwritten by the time it fires
    session = arm(trigger="flight", flight_calls="6", flight_bytes="2048")
    calls = run(kernels, inputs, bad_step=11)
    close(session)
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        counters = reader.footer["counters"]
        assert counters["flight_lost"] >= 1
        assert records and records[-1].context["flight"]["trigger"]
        for record in records:
            step = record.context["call"]
            hidden, output = calls[step]
            args = reader.load_args(record.index)
            recorded = reader.load_outputs(record.index)["return"]
            assert torch.equal(args["hidden"].view(torch.uint8), hidden.view(torch.uint8))
            assert torch.equal(recorded.view(torch.uint8), output.view(torch.uint8))


def test_exceptions_propagate_and_capture_stays_armed(arm, stand_in_module) -> None:
    def broken(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("kernel says no")

    stand_in_module("moereplay_test_broken", broken=broken)
    targets = (CaptureTarget("broken", "parent", "moereplay_test_broken", "broken"),)
    session = arm(targets=targets, trigger="flight")
    with pytest.raises(RuntimeError, match="kernel says no"):
        sys.modules["moereplay_test_broken"].broken(torch.ones(3))
    assert session.recorder.active
    close(session)


# --- the ring itself ---------------------------------------------------------------------------------------------


def test_ring_words_say_pending_ok_or_lost() -> None:
    ring = DeviceRing(4096, torch.device("cpu"), tags=4)
    x = torch.tensor([1.0, -3.5, 2.0])
    starts, leads, sizes, tag = ring.record([x], x, True)
    assert tag is not None
    word = int(ring.words[tag[0]])
    assert decode_word(word, tag[1]) == ("ok", 3.5)
    assert decode_word(word, tag[1] + 1)[0] == "pending"  # this slot's next use has not run yet
    assert decode_word(word, tag[1] - 1)[0] == "lost"  # an older entry of this slot was overwritten
    assert torch.equal(ring.view(starts[0] + leads[0], x.nbytes), x.view(torch.uint8))
    assert sizes == [x.nbytes]


def test_ring_never_straddles_its_end_and_knows_what_is_intact() -> None:
    ring = DeviceRing(4 * ALIGNMENT, torch.device("cpu"))
    a = torch.zeros(64)  # 256 bytes
    b = torch.zeros(128)  # 512 bytes
    first = ring.record([a, a, a], None, False)[0]
    assert first == [0, 256, 512]
    second = ring.record([b], None, False)[0]
    assert second == [1024]  # 256 bytes left in the lap: skipped
    # [1024, 1536) is physical [0, 512): what was at 0 and 256 is gone, 512 and 768 are not
    assert not ring.intact(0) and not ring.intact(256) and ring.intact(512) and ring.intact(1024)
    with pytest.raises(ValueError):
        ring.record([torch.zeros(2048)], None, False)


def test_ring_copies_views_from_their_storage_offset() -> None:
    ring = DeviceRing(8192, torch.device("cpu"))
    base = torch.arange(200, dtype=torch.float32)
    view = base[70:90]  # 280 bytes in: lead 24 bytes
    starts, leads, sizes, _ = ring.record([view], None, False)
    assert leads == [280 % ALIGNMENT] and sizes == [view.nbytes + leads[0]]
    assert torch.equal(ring.view(starts[0] + leads[0], view.nbytes), view.view(torch.uint8))


@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
def test_ring_magnitude_word_orders_nan_above_inf(special: float) -> None:
    ring = DeviceRing(4096, torch.device("cpu"))
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x = torch.tensor([1.0, special, -2.0], dtype=dtype)
        _, _, _, tag = ring.record([x], x, True)
        assert tag is not None
        state, value = decode_word(int(ring.words[tag[0]]), tag[1])
        assert state == "ok"
        assert math.isnan(value) if math.isnan(special) else value == math.inf


def layer_into(hidden: torch.Tensor, w1: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    torch.matmul(hidden, w1, out=output)
    return output


def test_an_intact_layer_copies_its_output_buffer_once_after_the_call(arm_intact, inputs) -> None:
    session, module = arm_intact(layer_into, trigger="flight", flight_calls="4")
    x, w1, _w2, _weights = inputs()
    out = torch.full((5, 6), 7.0)  # stale bytes before the call: not what is recorded
    x[0, 0] = float("nan")
    module.layer(x, w1, out)
    flight = session.recorder.flight
    ring = next(iter(flight._rings.values()))  # type: ignore[union-attr]
    assert (
        ring.head == 2 * 256
    )  # hidden and output, one copy each: the output buffer was not copied as an input
    close(session)
    with CaptureReader(session.path) as reader:
        (record,) = list(reader.calls())
        args = reader.load_args(record.index)
        outputs = reader.load_outputs(record.index)
        assert torch.equal(args["output"].view(torch.uint8), out.view(torch.uint8))  # as the call left it
        assert torch.equal(outputs["output"].view(torch.uint8), out.view(torch.uint8))
        assert record.aliases() == {"output": ("output",)}  # one storage, as in a full capture


def test_an_output_buffer_over_an_input_is_found_with_the_measured_spans(arm_intact) -> None:
    """The overlap check before the call: the first call (no ring yet) checks the tensors themselves; later ones
    measure the inputs' spans once and hand them to the copy after the call. An output buffer that is a view of
    the input makes the inputs copy first, so the file holds the input as it was before the call wrote it."""
    session, module = arm_intact(layer_doubling, trigger="flight", flight_calls="4")
    w1 = torch.ones(8, 6)
    apart = torch.arange(40, dtype=torch.float32).reshape(5, 8)
    module.layer(apart, w1, torch.zeros(5, 6))  # makes the ring
    separate = apart + 1
    module.layer(separate, w1, torch.zeros(5, 6))  # measured spans, no overlap
    shared = torch.arange(40, dtype=torch.float32).reshape(5, 8) + 100
    shared[0, 0] = float("nan")
    before = shared.clone()
    module.layer(shared, w1, shared[:, 2:8])  # the output is a view of the input: copied before the call
    flight = session.recorder.flight
    ring = next(iter(flight._rings.values()))  # type: ignore[union-attr]
    assert (
        ring.head == 6 * 256
    )  # each call one input and one output span (the last: its input before the call)
    close(session)
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        assert [r.context["call"] for r in records] == [0, 1, 2] and records[-1].context["flight"]["trigger"]
        hidden = [reader.load_args(r.index)["hidden"] for r in records]
        assert torch.equal(hidden[0], apart) and torch.equal(hidden[1], separate)
        assert torch.equal(
            hidden[2].view(torch.uint8), before.view(torch.uint8)
        )  # as before the call wrote it
        output = reader.load_outputs(records[2].index)["output"]
        assert torch.equal(output.view(torch.uint8), shared[:, 2:8].view(torch.uint8))


def test_a_check_that_lags_behind_later_calls_still_finds_the_calls_before_it(arm, kernels, inputs) -> None:
    """The writer thread's checks lag behind the serving thread's calls: calls made after a bad one, before its
    check, must not push the calls before it out of the history (K = 3: calls 2, 3, 4 for a bad call 4)."""
    session = arm(trigger="flight", flight_calls="3")
    session.writer.set_poll(lambda: None)  # this test polls, in a chosen order
    flight = session.recorder.flight
    x, w1, w2, weights = inputs()

    def call(step: int) -> None:
        value = x + step
        if step == 4:
            value[0, 0] = float("nan")
        kernels.fused(value, w1, w2, weights)

    for step in range(4):
        call(step)
    flight.poll(launch=True)  # calls 0-3 taken, their words read
    flight.poll(launch=True)  # ... and checked: fine
    call(4)
    call(5)
    flight.poll(launch=True)  # 4 and 5 taken (unchecked): 2 and 3 are 4's history, they must stay
    flight.poll(launch=True)  # 4 is checked: the trigger
    close(session)
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        assert [r.context["call"] for r in records] == [2, 3, 4]
        assert records[-1].context["flight"]["trigger"]
        assert reader.footer["counters"]["flight_written"] == 3


@pytest.mark.parametrize("scope", ["layer", "kernel"])
def test_triggers_past_the_budget_are_counted_not_written(arm, kernels, inputs, scope: str) -> None:
    # every output exceeds absmax: a model that stays bad would trigger on every call; two triggers are written
    session = arm(trigger="flight", flight_scope=scope, flight_calls="4", absmax="1e-9", flight_triggers="2")
    outputs = run(kernels, inputs, steps=9)
    close(session)
    assert len(outputs) == 9
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        counters = reader.footer["counters"]
        assert counters["flight_triggers_suppressed"] > 0
        triggers = [r for r in records if r.context["flight"]["trigger"]]
        assert len(triggers) == 2
        assert [r.context["call"] for r in triggers] == sorted({r.context["call"] for r in triggers})
        assert max(r.context["call"] for r in records) < 4  # nothing after the second trigger's incident


def test_the_trigger_budget_setting_is_validated() -> None:
    from moereplay.capture.settings import SettingsError, settings_from_environ

    on = {"MOEREPLAY_CAPTURE": "1"}
    assert settings_from_environ({**on, "MOEREPLAY_FLIGHT_TRIGGERS": "0"}).flight_triggers == 0
    assert settings_from_environ(on).flight_triggers == 8
    with pytest.raises(SettingsError, match="MOEREPLAY_FLIGHT_TRIGGERS"):
        settings_from_environ({**on, "MOEREPLAY_FLIGHT_TRIGGERS": "-1"})


def test_an_intact_layer_whose_output_shares_a_storage_with_its_input_is_written(arm_intact) -> None:
    """Hidden states and the output buffer as views of one storage (a workspace): the inputs' snapshot names the
    output buffer as the call left it, so the two copies share one buffer there — the input's bytes from before
    the call where they overlap — and the outputs' snapshot keeps the output's own. Every call is written exact.
    (Before 2026-12-04 such a trigger failed to write: two buffers for one storage in one snapshot.)"""
    session, module = arm_intact(layer_doubling, trigger="flight", flight_calls="4")
    pool = torch.zeros(4096)
    w1 = torch.ones(8, 6)
    seen = []
    for step in range(3):
        hidden = pool[512 * step : 512 * step + 40].view(5, 8)
        hidden.copy_((torch.arange(40.0) + step).view(5, 8))
        out = pool[3000:3030].view(5, 6)
        module.layer(hidden, w1, out)
        seen.append((hidden.clone(), out.clone()))
    shared = pool[2048 : 2048 + 40].view(5, 8)
    shared.copy_((torch.arange(40.0) + 100).view(5, 8))
    shared[0, 0] = float("nan")
    before = shared.clone()
    module.layer(shared, w1, shared[:, 2:8])  # the output over its own input
    seen.append((before, shared[:, 2:8].clone()))
    close(session)
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        assert [r.context["call"] for r in records] == [0, 1, 2, 3], reader.footer["counters"]
        for record, (hidden, output) in zip(records, seen, strict=True):
            args = reader.load_args(record.index)
            result = reader.load_outputs(record.index)["output"]
            assert torch.equal(args["hidden"].view(torch.uint8), hidden.view(torch.uint8))
            assert torch.equal(result.view(torch.uint8), output.view(torch.uint8))


def test_info_shows_what_the_armed_recorder_cost(arm, kernels, inputs) -> None:
    """The footer's timers become one line of ``moereplay info``: serving-thread µs per recorded layer call and the
    writer's µs per check poll."""
    from typer.testing import CliRunner

    from moereplay.cli import app

    session = arm(trigger="flight", flight_calls="6")
    run(kernels, inputs)
    close(session)
    with CaptureReader(session.path) as reader:
        counters = reader.footer["counters"]
    assert (
        counters["recorder_host_ns"] > 0
        and counters["recorder_selected"] == 12
        and counters["flight_polls"] > 0
    )
    result = CliRunner().invoke(app, ["info", str(session.path)])
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("cost")]
    assert (
        0 < counters["flight_setup_ns"] < counters["recorder_host_ns"]
    )  # the ring's buffers, made in call 0
    per_call = (counters["recorder_host_ns"] - counters["flight_setup_ns"]) / 12 / 1e3
    assert f"recorder {per_call:.1f} µs of serving-thread time per layer call (12 calls) plus " in line
    assert "ms once (eager ring buffers, ring-kernel compiles)" in line
    assert "µs per flight poll" in line
    # the longest poll: one of them, so no longer than all together, no shorter than their mean
    longest = counters["flight_poll_max_ns"]
    assert counters["flight_poll_ns"] / counters["flight_polls"] <= longest <= counters["flight_poll_ns"]
    assert f"the longest {longest / 1e6:.2f} ms)" in line


def test_timers_time_the_recorders_pieces_into_the_footer_and_come_off_at_disarm(
    arm, kernels, inputs
) -> None:
    """``MOEREPLAY_TIMERS=1``: each piece of the serving thread's path counted once per layer call (its wall time
    and its CPU time) in the footer, printed by ``moereplay info``; disarming unwraps them."""
    from typer.testing import CliRunner

    from moereplay.capture import flight_layer, phase_timers, recorder
    from moereplay.cli import app

    originals = {
        "collect": flight_layer.LayerFlight.__dict__["collect"],
        "layer_before": recorder.Recorder.__dict__["_layer_before"],
        "measure": DeviceRing.__dict__["_measure"],
    }
    session = arm(trigger="flight", flight_calls="6", timers="1")
    assert "timers=on" in session.settings.describe()
    assert flight_layer.LayerFlight.__dict__["collect"] is not originals["collect"]
    run(kernels, inputs)
    session_module.disarm()  # closes the session, then unwraps
    assert flight_layer.LayerFlight.__dict__["collect"] is originals["collect"]
    assert recorder.Recorder.__dict__["_layer_before"] is originals["layer_before"]
    assert DeviceRing.__dict__["_measure"] is originals["measure"]
    with CaptureReader(session.path) as reader:
        counters = reader.footer["counters"]
    pieces = phase_timers.from_counters(counters)
    assert pieces["layer_before"][1] == pieces["layer_after"][1] == pieces["collect"][1] == 12
    assert pieces["before"][1] == pieces["after"][1] == pieces["join"][1] == 12  # a prefill call's pieces too
    assert pieces["check_inline"][1] == 12  # the serving thread's own look at finished words, once a call
    assert all(cpu is not None for _ns, _calls, cpu in pieces.values())  # CPU time beside every wall time
    assert (
        pieces["poll"][1] >= 1 and pieces["poll"][2] is not None
    )  # the writer's polls (their count races the footer)
    assert all(ns > 0 for piece, (ns, calls, _) in pieces.items() if calls and piece != "launch_prepared")
    result = CliRunner().invoke(app, ["info", str(session.path)])
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("timers")]
    assert "layer_before " in line and "(CPU " in line and "collect " in line and "×12" in line


def test_timers_are_off_by_default(arm, kernels, inputs) -> None:
    from moereplay.capture import flight_layer

    collect = flight_layer.LayerFlight.__dict__["collect"]
    session = arm(trigger="flight", flight_calls="6")
    run(kernels, inputs, steps=2)
    assert flight_layer.LayerFlight.__dict__["collect"] is collect
    close(session)
    with CaptureReader(session.path) as reader:
        assert not any(key.startswith("timer_") for key in reader.footer["counters"])


def test_a_call_copied_before_it_runs_and_returning_no_tensor_is_still_checked() -> None:
    """Inputs copied before the call (it may write them; on CUDA also a large call's inputs copied beside it)
    and no output tensor: the launch after the call is an empty entry that still carries the call's tag word,
    so the call is checked (it used to be left without one, never counted)."""
    from moereplay.capture.context import Where
    from moereplay.capture.flight_layer import LayerFlight
    from moereplay.capture.patch_points import CaptureTarget

    flight = LayerFlight(max_calls=4, max_bytes=1 << 16, absmax=None, emit=lambda *a: True)
    target = CaptureTarget("scale", "parent", "moereplay_test_no_output", "scale")  # may write its inputs
    where = Where(0, 1, 0, "model.layers.0.mlp.experts", "run", "NONE")
    for sequence in range(3):
        x = torch.ones(4, 4)
        call = flight.before(target, {"x": x, "factor": 2.0}, where, sequence)
        assert call.input_copy is not None
        x.mul_(2.0)
        flight.after(call, None, None)
    flight.poll(launch=True)
    assert flight.counters.checked == 3


def test_an_output_over_the_output_limit_is_checked_but_not_kept(arm, kernels, inputs) -> None:
    """``MOEREPLAY_FLIGHT_OUTPUT_BYTES``: the returned output's magnitude still triggers (the check reads it where
    it is), the inputs are kept bit for bit, and the output is a marker naming what it was — never stale ring
    bytes presented as the output."""
    session = arm(trigger="flight", flight_calls="4", flight_output_bytes="1")
    calls = run(kernels, inputs, bad_step=5, steps=8)
    close(session)
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        counters = reader.footer["counters"]
        assert [r.context["call"] for r in records] == [2, 3, 4, 5]
        assert math.isnan(records[-1].context["flight"]["magnitude"])  # the check of the unkept output
        assert counters["flight_outputs_unkept"] == 8 and counters["flight_lost"] == 0  # every call
        for record, (hidden, output) in zip(records, calls[2:6], strict=True):
            args = reader.load_args(record.index)
            assert torch.equal(args["hidden"].view(torch.uint8), hidden.view(torch.uint8))
            marker = reader.load_outputs(record.index)["return"]
            assert isinstance(marker, Unsupported) and "not kept" in marker.repr_excerpt
            assert str(tuple(output.shape)) in marker.repr_excerpt
            # the fingerprint of the bytes not kept, reduced in the check's pass: expand's bit-exact proof
            assert record.context["flight"]["fingerprint"] == f"{byte_fingerprint(output):016x}"


def test_an_output_under_the_output_limit_is_kept(arm, kernels, inputs) -> None:
    session = arm(trigger="flight", flight_calls="4", flight_output_bytes="1G")
    calls = run(kernels, inputs, bad_step=5, steps=8)
    close(session)
    with CaptureReader(session.path) as reader:
        kept = [reader.load_outputs(r.index)["return"] for r in reader.calls()]
        assert len(kept) == 4 and all(
            torch.equal(k.view(torch.uint8), c[1].view(torch.uint8))
            for k, c in zip(kept, calls[2:6], strict=True)
        )
        assert reader.footer["counters"].get("flight_outputs_unkept", 0) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("special", [None, float("nan"), float("inf"), -float("inf"), -0.0, 1e-40])
def test_largest_magnitude_is_what_the_ring_check_records(dtype: torch.dtype, special: float | None) -> None:
    """``expand`` compares a re-run's largest magnitude with the recorded check's, so the two must agree bit for bit:
    the ring's word (torch path; the kernel's encoding is the same) decoded, against ``largest_magnitude``."""
    from moereplay.capture.flight_layer import largest_magnitude

    values = torch.tensor([0.5, -3.25, 2.0, 1e-3], dtype=dtype)
    if special is not None:
        values[1] = special
    ring = DeviceRing(1 << 16, torch.device("cpu"))
    _, _, _, tag = ring.record([values], values, True)
    assert tag is not None
    state, recorded = decode_word(int(ring.words[tag[0]]), tag[1])
    assert state not in ("pending", "lost"), state
    mine = largest_magnitude(values)
    assert (math.isnan(recorded) and math.isnan(mine)) or recorded == mine, (recorded, mine)


LEAN_MODULE = "moereplay_test_lean"


def fresh_layer(hidden: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    """An intact layer returning a fresh output, as vLLM's ``triton_kernel_moe_forward`` does."""
    return hidden @ w1


@pytest.fixture
def arm_lean(arm, stand_in_module):
    stand_in_module(LEAN_MODULE, layer=fresh_layer)
    target = CaptureTarget("layer", "parent", LEAN_MODULE, "layer", static=("w1",), inputs_intact=True)

    def _arm(**settings: str):
        return arm(targets=(target,), trigger="flight", flight_calls="4", **settings), sys.modules[
            LEAN_MODULE
        ]

    return _arm


def test_lean_calls_write_the_bad_call_alone(arm_lean, inputs) -> None:
    """``MOEREPLAY_FLIGHT_LEAN_BYTES``: calls at or over the limit keep their bytes only when their check fails —
    the trigger's file holds the bad call whole (inputs and output bit for bit, as the call left them) and leaves
    out the good calls before it, which kept nothing, counting them."""
    session, module = arm_lean(flight_lean_bytes="1")
    assert "flight_lean_bytes=1" in session.settings.describe()
    calls = run(None, inputs, bad_step=5, steps=8, layer=module.layer)
    close(session)
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        counters = reader.footer["counters"]
        assert [r.context["call"] for r in records] == [5]
        assert records[0].context["flight"]["trigger"] and math.isnan(
            records[0].context["flight"]["magnitude"]
        )
        assert counters["flight_lean"] == 8 and counters["flight_lean_left_out"] == 3, counters
        hidden, output = calls[5]
        assert torch.equal(
            reader.load_args(records[0].index)["hidden"].view(torch.uint8), hidden.view(torch.uint8)
        )
        kept = reader.load_outputs(records[0].index)["return"]
        assert torch.equal(kept.view(torch.uint8), output.view(torch.uint8))


def test_lean_limit_above_the_calls_keeps_every_call(arm_lean, inputs) -> None:
    session, module = arm_lean(flight_lean_bytes="1G")
    run(None, inputs, bad_step=5, steps=8, layer=module.layer)
    close(session)
    with CaptureReader(session.path) as reader:
        assert [r.context["call"] for r in reader.calls()] == [2, 3, 4, 5]
        assert reader.footer["counters"].get("flight_lean", 0) == 0


_FLOAT32_BITS = st.integers(min_value=0, max_value=0x7FFFFFFF)  # every non-negative float32: NaNs and Inf too


@hypothesis.example(bits=0x7F7FFFFF, absmax=None)  # the largest finite magnitude: good without absmax
@hypothesis.example(bits=0x7F800000, absmax=None)  # Inf: bad
@hypothesis.example(bits=0x7FC00000, absmax=None)  # NaN: bad
@hypothesis.example(bits=0x7F800000, absmax=math.inf)
@hypothesis.example(bits=0x7F7FFFFF, absmax=math.inf)
@hypothesis.example(bits=0x40A00000, absmax=5.0)  # exactly absmax: good
@hypothesis.example(bits=0x40A00001, absmax=5.0)
@hypothesis.given(
    bits=_FLOAT32_BITS,
    absmax=st.one_of(
        st.none(), st.floats(min_value=1e-45, allow_infinity=True, allow_nan=False), _FLOAT32_BITS
    ),
)
def test_over_bits_is_the_recorders_bad(bits: int, absmax) -> None:
    """The device's test of a lean call (``bits(m) > over_bits(absmax)``) is the host's ``_is_bad(m)`` for every
    float32 magnitude ``m`` — else a trigger would write a call whose bytes the device never copied, or leave out
    one it did."""
    from moereplay.capture.device_ring import over_bits
    from moereplay.capture.flight_layer import LayerFlight

    if isinstance(absmax, int):  # a float32 itself, and the float64 just above and below it
        absmax = float(np.array(absmax, dtype=np.uint32).view(np.float32))
        if not math.isfinite(absmax) or absmax <= 0:
            absmax = None
    (magnitude,) = struct.unpack("<f", struct.pack("<I", bits))
    flight = LayerFlight(max_calls=1, max_bytes=1 << 16, absmax=absmax, emit=lambda *a: True)
    assert (bits > over_bits(absmax)) == flight._is_bad(magnitude), (bits, magnitude, absmax)
    if absmax is not None:
        for near in (math.nextafter(absmax, 0.0), math.nextafter(absmax, math.inf)):
            if near > 0 and math.isfinite(near):
                flight = LayerFlight(max_calls=1, max_bytes=1 << 16, absmax=near, emit=lambda *a: True)
                assert (bits > over_bits(near)) == flight._is_bad(magnitude), (bits, magnitude, near)
