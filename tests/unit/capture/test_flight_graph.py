"""Layer calls replayed from CUDA graphs (``moereplay.capture.flight_graph``), on the CPU.

A CUDA graph cannot be captured here, so a "graph" is emulated: the recorder is told a capture is under way while
the layer is called once (it captures its ring launch instead of running it), and a replay re-runs the layer's
computation on the same buffers and then the captured launch — through the graph ring's torch fallback
(``GraphRing.replay``), or through emulators of the two Triton kernels driven by the very integer arguments the
ring captured (addresses included), as the device would run them. The device's counters are tensors either way:
nothing on the host tells a replay where it goes.
"""

from __future__ import annotations

import ctypes
import math
import sys
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from aligned_pool import AlignedPool
from hypothesis import example, given, settings
from hypothesis import strategies as st

from moereplay.capture import flight_graph, graph_ring, padded_rows, writer_thread
from moereplay.capture import recorder as recorder_module
from moereplay.capture import session as session_module
from moereplay.capture.context import Where
from moereplay.capture.flight_graph import SEQUENCE_BASE, GraphFlight
from moereplay.capture.flight_layer import LayerFlight
from moereplay.capture.graph_gate import GraphGate, install
from moereplay.capture.graph_ring import ALIGNMENT, SPANS, GraphRing, Spans
from moereplay.capture.patch_points import CaptureTarget
from moereplay.capture.settings import settings_from_environ
from moereplay.errors import SettingsError
from moereplay.format import CaptureReader

MODULE = "moereplay_test_graph_layers"


def layer(
    hidden: torch.Tensor, w1: torch.Tensor, topk_weights: torch.Tensor, output: torch.Tensor
) -> torch.Tensor:
    """A layer that writes its output buffer (as ``fused_marlin_moe(output=...)``) and reads its inputs only."""
    torch.matmul(hidden, w1, out=output)
    output.mul_(topk_weights.reshape(-1, 1))
    return output


def scale_in_place(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x.mul_(factor)


def routing_weights(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits, dim=-1).amax(dim=-1)


def forward(hidden: torch.Tensor, w1: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """A call above ``layer`` (as ``triton_kernel_moe_forward`` is above ``triton_kernel_fused_experts``): the
    routing from the logits, an output it allocates, then the layer through the module global."""
    out = torch.empty(hidden.shape[0], w1.shape[1])
    return sys.modules[MODULE].layer(hidden, w1, routing_weights(logits), out)


TARGETS = (
    CaptureTarget(
        "layer", "parent", MODULE, "layer", static=("w1",), outputs=("output",), inputs_intact=True
    ),
    CaptureTarget("scale", "parent", MODULE, "scale"),
    CaptureTarget(
        "forward",
        "parent",
        MODULE,
        "forward",
        static=("w1",),
        inputs_intact=True,
        layer_flight_only=True,
        in_place_of="layer",
    ),
)


class EmulatedGraph:
    """``capture(fn)``: run ``fn`` while the recorder believes a CUDA graph is being captured, and note the launch
    ids the graph ring gave out; ``replay()``: run ``compute`` (the graph's kernels: the layer on the same
    buffers), then each captured launch."""

    def __init__(self, session: session_module.Session, monkeypatch: pytest.MonkeyPatch) -> None:
        self.session = session
        self.monkeypatch = monkeypatch
        self.flight = session.recorder.flight
        assert isinstance(self.flight, LayerFlight) and self.flight.graph is not None
        self.graph: GraphFlight = self.flight.graph
        ring = self.graph.prepare(torch.device("cpu"))
        assert ring is not None
        self.ring: GraphRing = ring
        self.launches: list[int] = []
        self.compute: Callable[[], Any] = lambda: None

    def capture(self, fn: Callable[[], Any], compute: Callable[[], Any]) -> None:
        before = self.ring._issued
        recorder = self.session.recorder
        self.monkeypatch.setattr(recorder_module, "is_capturing", lambda: True)
        self.monkeypatch.setattr(recorder, "_cuda", True)
        try:
            fn()
        finally:
            self.monkeypatch.setattr(recorder_module, "is_capturing", lambda: False)
            self.monkeypatch.setattr(recorder, "_cuda", False)
        self.launches = list(range(before, self.ring._issued))
        self.compute = compute

    def replay(self) -> None:
        self.compute()
        for launch in self.launches:
            self.ring.replay(launch)


@pytest.fixture
def graph_module(stand_in_module: Callable[..., types.ModuleType]) -> types.ModuleType:
    return stand_in_module(MODULE, layer=layer, scale=scale_in_place, forward=forward)


@pytest.fixture
def forward_context(stand_in_module: Callable[..., types.ModuleType]):
    """A stand-in ``vllm.forward_context`` naming two MoE layers (what the context tracker reads)."""
    context = types.SimpleNamespace(
        all_moe_layers=["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"],
        attn_metadata=None,
        cudagraph_runtime_mode=types.SimpleNamespace(name="FULL"),
    )
    stand_in_module(
        "vllm.forward_context", is_forward_context_available=lambda: True, get_forward_context=lambda: context
    )
    return context


def _arm(tmp_path, **settings: str) -> session_module.Session:
    env = {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_DIR": str(tmp_path / "captures"),
        "MOEREPLAY_TRIGGER": "flight",
    }
    env.update({f"MOEREPLAY_{key.upper()}": value for key, value in settings.items()})
    session = session_module.arm(env, targets=TARGETS)
    assert session is not None and session.recorder.layer_scope
    return session


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def _buffers(tokens: int = 5, hidden: int = 8, inner: int = 6):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=generator)
    w1 = torch.randn(hidden, inner, generator=generator)
    weights = torch.rand(tokens, generator=generator)
    out = torch.empty(tokens, inner)
    return x, w1, weights, out


# --- the recorder, a graph of one layer call --------------------------------------------------------------------


def test_graph_replays_are_kept_and_a_nan_writes_them_up_to_the_bad_one(
    tmp_path, graph_module, monkeypatch
) -> None:
    session = _arm(tmp_path, flight_calls="4", flight_graph_bytes="64K")
    x, w1, weights, out = _buffers()
    graph_module.layer(x, w1, weights, out)  # eager warm-up: an ordinary layer-scope call
    graph = EmulatedGraph(session, monkeypatch)
    static = x.clone()
    graph.capture(
        lambda: graph_module.layer(static, w1, weights, out), lambda: layer(static, w1, weights, out)
    )
    assert graph.launches == [0]
    seen = []
    for replay in range(10):
        static.copy_(x + replay)
        if replay == 7:
            static[2, 3] = float("nan")
        graph.replay()
        seen.append((static.clone(), out.clone()))
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        counters = reader.footer["counters"]
        assert counters["flight_graph_launches"] == 1 and counters["flight_graph_checked"] == 10, counters
        assert counters["flight_graph_triggers"] == 1 and counters["flight_graph_written"] == 4
        assert counters["flight_graph_lost"] == 0 and counters["recorder_skipped_graph_capture"] == 0
        assert counters["flight_checked"] == 1 and counters["flight_triggers"] == 0  # the eager call
        least = sum(t.numel() * t.element_size() for t in (static, out))  # the input and output, at least
        assert counters["flight_graph_entry_bytes"] >= least, counters
        # the torch stand-in of the kernels runs no node programs at all
        assert counters["flight_graph_lone"] == 0
        assert [r.context["graph_sequence"] for r in records] == [4, 5, 6, 7]
        for record, sequence in zip(records, [4, 5, 6, 7], strict=True):
            context = record.context
            assert record.op == "layer" and record.parent is None and record.status == "completed"
            assert context["cudagraph"] is True and context["graph_launch"] == 0
            assert "step" not in context and "graph_step" not in context  # no layer number, no step
            assert context["flight"] == {
                "scope": "layer",
                "trigger": sequence == 7,
                "magnitude": context["flight"]["magnitude"],
            }
            hidden, output = seen[sequence]
            args = reader.load_args(record.index)
            outputs = reader.load_outputs(record.index)
            assert torch.equal(_bits(args["hidden"]), _bits(hidden))  # bit for bit, NaN included
            assert torch.equal(_bits(args["topk_weights"]), _bits(weights))
            assert torch.equal(_bits(outputs["output"]), _bits(output))
            assert args["w1"].shape == w1.shape  # static: by reference, stored once
            assert record.aliases() == {"output": ("output",)}  # the output buffer, as the call left it
        assert math.isnan(records[-1].context["flight"]["magnitude"])
        assert records[0].context["flight"]["magnitude"] == pytest.approx(float(seen[4][1].abs().max()))


def test_a_call_above_the_layer_is_kept_under_a_graph_with_its_own_inputs(
    tmp_path, graph_module, monkeypatch
) -> None:
    """A ``layer_flight_only`` call captured into a graph: its one launch keeps its own dynamic inputs (hidden
    states and logits, not the routing it computes) and the output it allocated; the layer inside passes through."""
    session = _arm(tmp_path, flight_calls="3", flight_graph_bytes="64K")
    x, w1, _, _ = _buffers()
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    graph = EmulatedGraph(session, monkeypatch)
    static, static_logits = x.clone(), logits.clone()
    captured: list[torch.Tensor] = []
    graph.capture(
        lambda: captured.append(graph_module.forward(static, w1, static_logits)),
        lambda: layer(static, w1, routing_weights(static_logits), captured[0]),
    )
    assert graph.launches == [0] and session.recorder.counters.seen == 1  # the layer inside passed through
    seen = []
    for replay in range(6):
        static.copy_(x + replay)
        static_logits.copy_(logits * (replay + 1))
        if replay == 4:
            static[1, 1] = float("nan")
        graph.replay()
        seen.append((static.clone(), static_logits.clone(), captured[0].clone()))
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        assert [r.op for r in records] == ["forward"] * 3
        assert [r.context["graph_sequence"] for r in records] == [2, 3, 4]
        for record, (hidden, routed, output) in zip(records, seen[2:5], strict=True):
            args = reader.load_args(record.index)
            assert set(args) == {"hidden", "w1", "logits"}
            assert torch.equal(_bits(args["hidden"]), _bits(hidden)) and torch.equal(
                _bits(args["logits"]), _bits(routed)
            )
            assert torch.equal(_bits(reader.load_outputs(record.index)["return"]), _bits(output))


def test_a_captured_ring_launch_wakes_a_writer_that_found_nothing_outstanding(
    tmp_path, graph_module, monkeypatch
) -> None:
    """Graph replays are found by the writer's polls only: a writer waiting out an idle poll (0.5 s) is woken when
    a layer call is captured into a graph, so the replays' checks start at once."""
    import time

    session = _arm(tmp_path, flight_calls="4", flight_graph_bytes="64K")
    flight = session.recorder.flight
    assert isinstance(flight, LayerFlight)
    wakes: list[int] = []
    monkeypatch.setattr(flight, "wake", lambda: wakes.append(1))
    deadline = time.monotonic() + 5.0
    while not flight._writer_idle and time.monotonic() < deadline:  # the writer's first poll: nothing to do
        time.sleep(0.001)
    assert flight._writer_idle
    graph = EmulatedGraph(session, monkeypatch)
    x, w1, weights, out = _buffers()
    graph.capture(lambda: graph_module.layer(x, w1, weights, out), lambda: layer(x, w1, weights, out))
    assert graph.launches == [0] and wakes == [1]
    session.close()


def test_two_layers_per_graph_carry_layer_names_steps_and_one_sequence(
    tmp_path, graph_module, forward_context, monkeypatch
) -> None:
    session = _arm(tmp_path, flight_calls="5", flight_graph_bytes="64K")
    x, w1, weights, out0 = _buffers()
    w1b = torch.randn(6, 6)
    out1 = torch.empty(5, 6)
    graph = EmulatedGraph(session, monkeypatch)
    static = x.clone()

    def forward() -> None:
        graph_module.layer(static, w1, weights, out0)
        graph_module.layer(out0, w1b, weights, out1)

    def kernels() -> None:
        layer(static, w1, weights, out0)
        layer(out0, w1b, weights, out1)

    graph.capture(forward, kernels)
    assert graph.launches == [0, 1]
    seen = []
    for replay in range(6):
        static.copy_(x * (replay + 1))
        if replay == 4:
            w1b[0, 0] = float("inf")  # layer 1 of replay 4 (sequence 9) goes bad; layer 0 stays finite
        graph.replay()
        seen.append((static.clone(), out0.clone(), out1.clone()))
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        counters = reader.footer["counters"]
    # sequence 9 (replay 4, layer 1) with the 4 before it; then sequence 11 (replay 5, layer 1, bad too) with
    # the one since (as in the eager layer scope: the next incident's history)
    assert [r.context["graph_sequence"] for r in records] == [5, 6, 7, 8, 9, 10, 11], counters
    assert [r.context["layer"] for r in records] == [1, 0, 1, 0, 1, 0, 1]
    assert [r.context["graph_step"] for r in records] == [3, 4, 4, 5, 5, 6, 6]  # replays of layer 0 so far
    assert records[1].context["layer_name"] == "model.layers.0.mlp.experts"
    assert records[0].context["layer_name"] == "model.layers.1.mlp.experts"
    assert records[0].context["cudagraph_mode"] == "FULL" and "tag" not in records[0].context
    assert [r.context["flight"]["trigger"] for r in records] == [False] * 4 + [True, False, True]
    assert counters["flight_graph_triggers"] == 2 and counters["flight_graph_written"] == 7
    with CaptureReader(session.path) as reader:
        last = reader.load_outputs(records[4].index)["output"]
    assert torch.equal(_bits(last), _bits(seen[4][2]))


def test_a_call_that_may_write_its_inputs_is_not_kept_under_a_graph(
    tmp_path, graph_module, monkeypatch
) -> None:
    session = _arm(tmp_path, flight_graph_bytes="64K")
    graph = EmulatedGraph(session, monkeypatch)
    x = torch.ones(4)
    graph.capture(lambda: graph_module.scale(x, 2.0), lambda: None)
    assert graph.launches == []
    counters = session.recorder.counter_values()
    assert counters["recorder_skipped_graph_capture"] == 1 and counters["flight_graph_not_kept"] == 1
    session.close()


def test_the_stage_setting_reaches_the_graph_ring(tmp_path, graph_module, monkeypatch) -> None:
    session = _arm(tmp_path, flight_graph_bytes="8M", flight_graph_stage="100K")  # not the default (384K)
    ring = EmulatedGraph(session, monkeypatch).ring
    assert ring.stage_bytes == 100 << 10
    session.close()


@pytest.mark.parametrize("batch", [None, "0"])
def test_the_batch_setting_reaches_the_graph_flight(tmp_path, graph_module, monkeypatch, batch) -> None:
    settings = {} if batch is None else {"flight_graph_batch": batch}
    session = _arm(tmp_path, flight_graph_bytes="8M", **settings)
    flight = session.recorder.flight
    assert flight is not None and flight.graph is not None
    assert flight.graph.batch is (batch is None)  # on by default
    session.close()


def test_without_the_graph_ring_calls_in_a_capture_are_skipped_as_before(
    tmp_path, graph_module, monkeypatch
) -> None:
    session = _arm(tmp_path, flight_graph_bytes="0")
    flight = session.recorder.flight
    assert isinstance(flight, LayerFlight) and flight.graph is None
    x, w1, weights, out = _buffers()
    monkeypatch.setattr(recorder_module, "is_capturing", lambda: True)
    monkeypatch.setattr(session.recorder, "_cuda", True)
    graph_module.layer(x, w1, weights, out)
    assert session.recorder.counters.skipped_graph_capture == 1
    monkeypatch.setattr(session.recorder, "_cuda", False)
    session.close()


# --- GraphFlight without a session: sequences, lapping, lost calls --------------------------------------------


class Harness:
    """A GraphFlight over a CPU graph ring, polled by hand; ``written`` collects what it hands to the writer."""

    def __init__(
        self,
        *,
        capacity: int,
        max_calls: int = 4,
        tags: int = 1 << 14,
        absmax: float | None = None,
        stage_bytes: int = graph_ring.ALONE_BYTES,
    ):
        self.written: list[tuple[Any, Any]] = []

        def emit(begin, complete, delivered) -> bool:
            self.written.append((begin, complete))
            delivered(True, None)
            return True

        self.layer = LayerFlight(max_calls=max_calls, max_bytes=1 << 20, absmax=absmax, emit=emit)
        self.graph = GraphFlight(self.layer, capacity, tags=tags, stage_bytes=stage_bytes)
        self.layer.graph = self.graph
        ring = self.graph.prepare(torch.device("cpu"))
        assert ring is not None
        self.ring = ring
        self.target = TARGETS[0]

    def capture_layer(self, **sizes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer call on fresh buffers captured into the graph; ``(x, hidden)``: the inputs' values and the graph's
        static input, which :meth:`replay` reads (``w1``, ``weights``, ``out`` and ``launch`` kept here)."""
        x, self.w1, self.weights, self.out = _buffers(**sizes)
        self.hidden = x.clone()
        self.launch = self.capture(self.hidden, self.w1, self.weights, self.out)
        return x, self.hidden

    def replay(self) -> None:
        """One replay of the graph :meth:`capture_layer` made: the layer on its buffers, then its ring launch."""
        layer(self.hidden, self.w1, self.weights, self.out)
        self.ring.replay(self.launch)

    def capture(self, hidden, w1, weights, out, layer_index: int | None = None) -> int:
        bound = {"hidden": hidden, "w1": w1, "topk_weights": weights, "output": out}
        where = Where(0, None, layer_index, None, None, None)
        call, copy_first = self.layer.collect(self.target, bound, where, 0)
        assert not copy_first
        result = layer(hidden, w1, weights, out)
        assert self.graph.capture(call, result, None)
        return self.ring._issued - 1


def test_sequence_slot_and_generation_mapping_of_the_fallback() -> None:
    ring = GraphRing(4096, torch.device("cpu"), tags=4, launches=2, use_kernel=False)
    source = torch.arange(64, dtype=torch.uint8)
    spans = Spans((source.data_ptr(),), (0,), (64,), None, 256)
    ring.capture(0, spans, first=True, views=[source])
    for _ in range(6):
        ring.replay(0)
    state = ring.state.tolist()
    assert state[:3] == [6 * 256, 6, 6]  # head, sequence, step (a first layer's launch bumps it)
    assert ring.hint == 6
    # sequences 4 and 5 hold slots 0 and 1 (generation 2); 2 and 3 slots 2 and 3 (generation 1)
    assert [int(word) >> 32 for word in ring.words] == [2, 2, 1, 1]
    assert ring.meta[1].tolist() == [5, 5 * 256, 0, 6, -1]  # sequence, start, launch, step, tokens (unknown)
    # sequence 5's entry is at 5 * 256 % 4096, its bytes what the span held
    assert torch.equal(ring.view(5 * 256, 0, 64), source)
    assert ring.cells[2, 0] == 0 and ring.cells[3, 0] == 0  # the max and "done" reset for the next replay


def test_entries_run_into_the_tail_instead_of_wrapping_and_know_when_they_are_lapped() -> None:
    ring = GraphRing(4096, torch.device("cpu"), use_kernel=False)
    assert ring.max_entry == 1024 and ring.buffer.numel() == 4096 + 1024
    source = torch.full((768,), 7, dtype=torch.uint8)
    ring.capture(0, Spans((source.data_ptr(),), (0,), (768,), None, 768), first=False, views=[source])
    for _ in range(6):  # starts 0, 768, ..., 3840: the sixth runs 512 bytes into the tail
        ring.replay(0)
    assert torch.equal(ring.buffer[3840 : 3840 + 768], source)
    head = int(ring.state[0])
    assert head == 6 * 768
    assert ring.intact(3840, head) and ring.intact(768, head)
    assert not ring.intact(
        0, head
    )  # conservative: the sixth ran into the tail, not over 0, but a lap is past
    ring.replay(0)  # the seventh, at physical 512-1280, overwrites the second (768-1536)
    assert not ring.intact(768, int(ring.state[0])) and ring.intact(1536, int(ring.state[0]))
    with pytest.raises(ValueError):
        ring.capture(1, Spans((0,), (0,), (2048,), None, 2048), first=False, views=[torch.zeros(2048)])


def test_a_trigger_writes_only_entries_the_head_had_not_lapped() -> None:
    # entries of 3 × 256 bytes in a 4 KiB ring; the bad one (sequence 5) is found only after two more replays,
    # by when sequence 7 (physical 1280-2048) has overwritten part of sequence 2 (1536-2304): of its history
    # (2, 3, 4) sequence 2 is lost, not written wrong
    harness = Harness(capacity=4096, max_calls=4)
    x, hidden = harness.capture_layer(tokens=5, hidden=8, inner=6)
    seen = []
    for replay in range(8):
        hidden.copy_(x + replay)
        if replay == 5:
            hidden[0, 0] = float("nan")
        harness.replay()
        seen.append((hidden.clone(), harness.out.clone()))
    harness.layer.poll(launch=True)
    counters = harness.graph.counters
    assert counters.checked == 8 and counters.triggers == 1
    assert counters.lost == 1 and counters.written == 2 + 1
    sequences = [begin.context["graph_sequence"] for begin, _ in harness.written]
    assert sequences == [3, 4, 5]
    assert [begin.sequence for begin, _ in harness.written] == [SEQUENCE_BASE + s for s in (3, 4, 5)]
    for begin, complete in harness.written:
        hidden_copy = begin.snapshot.tree["hidden"]
        output_copy = complete.outputs.tree["output"]
        expected_hidden, expected_output = seen[begin.context["graph_sequence"]]
        assert torch.equal(_bits(hidden_copy.view()), _bits(expected_hidden))
        assert torch.equal(_bits(output_copy.view()), _bits(expected_output))
        assert complete.timings == {}
    assert harness.layer.settled


def test_absmax_triggers_and_later_triggers_do_not_write_a_call_twice() -> None:
    harness = Harness(capacity=1 << 16, max_calls=3, absmax=1e3)
    x, hidden = harness.capture_layer()
    for replay in range(8):
        hidden.copy_(x * (1e6 if replay in (4, 5) else 1.0))
        harness.replay()
    harness.layer.poll(launch=True)
    sequences = [begin.context["graph_sequence"] for begin, _ in harness.written]
    assert sequences == [2, 3, 4, 5]  # trigger 4 with 2 and 3 before it; trigger 5 alone
    assert [begin.context["flight"]["trigger"] for begin, _ in harness.written] == [False, False, True, True]
    assert harness.graph.counters.triggers == 2


def test_a_writer_that_fell_a_whole_tag_array_behind_counts_the_calls_unchecked() -> None:
    harness = Harness(capacity=1 << 16, tags=8)
    harness.capture_layer()
    for _ in range(20):  # 20 sequences into 8 tag words: the first 12 words were overwritten unread
        harness.replay()
    harness.layer.poll(launch=True)
    counters = harness.graph.counters
    assert counters.unchecked == 12 and counters.checked == 8 and counters.triggers == 0
    assert harness.graph.settled


def test_polls_stop_at_the_first_unfinished_sequence_and_resume() -> None:
    harness = Harness(capacity=1 << 16)
    harness.capture_layer()
    harness.replay()
    harness.ring.host[harness.ring.tags] = 3  # the device reserved sequences 1 and 2, still running
    harness.layer.poll(launch=True)
    assert harness.graph.counters.checked == 1 and not harness.graph.settled
    for _ in range(2):
        harness.ring.replay(harness.launch)
    harness.layer.poll(launch=True)
    assert harness.graph.counters.checked == 3 and harness.graph.settled


def _float32_bits_near(values: tuple[float, ...]) -> list[int]:
    """The bits of the float32 nearest each value and of its two neighbours (where rounding decides)."""
    bits = []
    for value in values:
        near = int(np.array(np.float32(min(value, 3.4028234663852886e38)), dtype=np.float32).view(np.uint32))
        bits.extend(b for b in (near - 1, near, near + 1) if 0 <= b <= 0x7FFFFFFF)
    return bits


def test_a_poll_reads_no_word_until_the_hint_moves_and_a_stale_hint_waits_for_the_next_full_read(
    monkeypatch,
) -> None:
    harness = Harness(capacity=1 << 16)
    harness.capture_layer()
    now = [100.0]
    monkeypatch.setattr(flight_graph.time, "perf_counter", lambda: now[0])
    harness.layer.poll(launch=True)  # the first poll reads a whole chunk: nothing finished yet
    for _ in range(3):
        harness.ring.replay(harness.launch)
    hint = harness.ring.tags
    harness.ring.host[hint] = 0  # the three hints' stores still on their way (two streams' order, say)
    now[0] += flight_graph.FULL_READ_S / 2
    harness.layer.poll(launch=True)
    assert harness.graph.counters.checked == 0  # no new reservation seen: no word read
    harness.ring.host[hint] = 1  # one hint landed: the words a few past it are read too
    harness.layer.poll(launch=True)
    assert harness.graph.counters.checked == 3
    for _ in range(2):
        harness.ring.replay(harness.launch)
    harness.ring.host[hint] = 3
    now[0] += flight_graph.FULL_READ_S / 4
    harness.layer.poll(launch=True)
    assert harness.graph.counters.checked == 3
    now[0] += flight_graph.FULL_READ_S  # the periodic read of a whole chunk finds them whatever the hint says
    harness.layer.poll(launch=True)
    assert harness.graph.counters.checked == 5


def test_settling_reads_the_words_past_a_stale_hint(monkeypatch) -> None:
    harness = Harness(capacity=1 << 16)
    _, hidden = harness.capture_layer()
    monkeypatch.setattr(flight_graph.time, "perf_counter", lambda: 100.0)
    harness.layer.poll(launch=True)
    hidden[0, 0] = float("nan")
    for _ in range(2):
        harness.replay()
    harness.ring.host[harness.ring.tags] = 0  # stale: a plain poll reads nothing, and the hint says settled
    harness.layer.poll(launch=True)
    assert harness.graph.counters.checked == 0 and harness.layer.settled
    assert harness.layer.settle(1.0)
    assert harness.graph.counters.checked == 2 and harness.graph.counters.written == 2


def test_reads_across_the_end_of_the_tag_array_keep_the_window_of_a_trigger() -> None:
    harness = Harness(capacity=1 << 16, tags=8, max_calls=3)
    x, hidden = harness.capture_layer()
    for replay in range(20):
        hidden.copy_(x)
        if replay == 9:  # slot 1 of generation 2, two polls after the last one of generation 1
            hidden[0, 0] = float("inf")
        harness.replay()
        if replay % 3 == 2:
            harness.layer.poll(launch=True)
    harness.layer.poll(launch=True)
    counters = harness.graph.counters
    assert counters.checked == 20 and counters.unchecked == 0 and counters.triggers == 1
    assert [begin.context["graph_sequence"] for begin, _ in harness.written] == [7, 8, 9]
    assert [begin.context["flight"]["trigger"] for begin, _ in harness.written] == [False, False, True]


_BIT_CASES = (0.1, 1e3, 1e-45, 3.4028234663852886e38, 3.5e38)


def test_a_sequence_stuck_near_the_end_of_the_tag_array_is_given_up_and_the_words_after_it_read() -> None:
    harness = Harness(capacity=1 << 16, tags=2048, max_calls=2)
    x, hidden = harness.capture_layer()
    for _ in range(2040):
        harness.replay()
    harness.layer.poll(launch=True)
    assert harness.graph.counters.checked == 2040
    for sequence in range(2040, 3540):  # 1,500 more, through the end of the array into its next generation
        hidden.copy_(x)
        if sequence == 3530:  # (an early one's entry would have been lapped in this small ring)
            hidden[0, 0] = float("nan")
        harness.replay()
    harness.ring.words[2045] = 0  # sequence 2045 never finished (its word still an older generation's)
    harness.layer.poll(launch=True)
    counters = harness.graph.counters
    assert counters.unchecked == 1 and counters.checked == 3539 and counters.triggers == 1
    assert [begin.context["graph_sequence"] for begin, _ in harness.written] == [3529, 3530]
    assert harness.graph.settled


@settings(max_examples=300, deadline=None)
@given(
    magnitude=st.integers(0, 0x7FFFFFFF) | st.sampled_from(_float32_bits_near(_BIT_CASES)),
    absmax=st.none() | st.floats(0.0, 1e40, allow_nan=False) | st.sampled_from(_BIT_CASES),
)
@example(magnitude=1, absmax=-0.0)  # -0.0 once kept its sign bit in the threshold, which nothing exceeded
def test_the_magnitude_bits_trigger_exactly_where_the_floats_do(magnitude: int, absmax: float | None) -> None:
    graph = GraphFlight(types.SimpleNamespace(absmax=absmax), 1 << 12)  # type: ignore[arg-type]
    value = float(np.array(magnitude, dtype=np.uint32).view(np.float32))
    expected = not math.isfinite(value) or (absmax is not None and value > absmax)
    assert (magnitude > graph._threshold) == expected


# --- the Triton kernels' contract, through the arguments the ring captures -----------------------------------------

_FOLD = 8192  # graph_ring_kernel.FOLD: output elements a program folds per step


def _cell(address: int) -> ctypes.c_int64:
    return ctypes.c_int64.from_address(address)


def record_kernel(programs: int, args: list[int]) -> None:
    """What ``graph_record`` does — program by program: the first to arrive reserves, each copies, the last one
    finishing writes the tag word and resets the launch's cells — through its integer arguments."""
    assert len(args) == 3 * SPANS + 20 and programs >= 1
    (check, numel, code, moved, finish, reserve, total, first) = args[3 * SPANS : 3 * SPANS + 8]
    (state, meta, hint, buffer, capacity, launch, cells, launches, words, tags) = args[
        3 * SPANS + 8 : 3 * SPANS + 18
    ]
    rows, row_numel = args[3 * SPANS + 18 :]
    real = -1  # the metadata row's token count: unknown
    if (
        rows
    ):  # the step's token count, read at replay: into the metadata row, and padding rows are not checked
        real = ctypes.c_int32.from_address(rows).value
        if finish and real > 0:
            numel = min(numel, real * row_numel)

    def cell(row: int) -> ctypes.c_int64:
        return _cell(cells + 8 * (row * launches + launch))

    start_cell, sequence_cell, partial, counter, arrive, ready = (cell(row) for row in range(6))
    values = np.zeros(0, dtype=np.float32)
    if finish and code:
        itemsize = {1: 2, 2: 2, 3: 4}[code]
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * (numel * itemsize)).from_address(check))
        if code == 2:
            values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            values = raw.view(np.float16 if code == 1 else np.float32).astype(np.float32)
    bits = np.abs(values).view(np.int32)
    for program in range(programs):
        if reserve and programs == 1:  # alone: no arrive/ready handshake
            _reserve(state, meta, hint, launch, total, first, tags, start_cell, sequence_cell, real)
        elif reserve:
            ticket = arrive.value
            arrive.value = ticket + 1
            if ticket == 0:
                _reserve(state, meta, hint, launch, total, first, tags, start_cell, sequence_cell, real)
                ready.value = 1
            assert ready.value == 1, "a program went on before the reservation was published"
        target = buffer + start_cell.value % capacity
        if program == 0:  # the copies (every program's share at once)
            for i in range(SPANS):
                source, offset, size = args[3 * i : 3 * i + 3]
                assert (source | (target + offset) | size) % 8 == 0, "the kernel copies whole 8-byte words"
                moved -= size
                if size:
                    ctypes.memmove(target + offset, source, size)
            assert moved == 0, "the node's word count is its spans' sum"
        if not finish:
            continue
        mine = [bits[start : start + _FOLD] for start in range(program * _FOLD, numel, programs * _FOLD)]
        largest = max((int(block.max()) for block in mine if block.size), default=0)
        if programs == 1:
            word = largest
            if not reserve:
                arrive.value = ready.value = 0
        else:
            partial.value = max(partial.value, largest)
            arrived = counter.value
            counter.value = arrived + 1
            if arrived != programs - 1:
                continue
            word = partial.value
            partial.value = counter.value = arrive.value = ready.value = 0
        sequence = sequence_cell.value
        generation = (sequence // tags + 1) & 0x7FFFFFFF
        _cell(words + 8 * (sequence % tags)).value = (generation << 32) | word


def _reserve(
    state: int,
    meta: int,
    hint: int,
    launch: int,
    total: int,
    first: int,
    tags: int,
    start_cell: ctypes.c_int64,
    sequence_cell: ctypes.c_int64,
    real: int,
) -> None:
    head = _cell(state).value
    _cell(state).value = head + total
    sequence = _cell(state + 8).value
    _cell(state + 8).value = sequence + 1
    _cell(state + 16).value += first
    step = _cell(state + 16).value
    start_cell.value = head
    sequence_cell.value = sequence
    row = meta + 8 * graph_ring.META_COLUMNS * (sequence % tags)
    for i, value in enumerate((sequence, head, launch, step, real)):
        _cell(row + 8 * i).value = value
    _cell(hint).value = sequence + 1


class CapturedKernels:
    """The ring's launcher: at "capture" each launch's arguments are recorded, as a graph records them."""

    def __init__(self) -> None:
        self.graph: list[tuple[Callable[[int, list[int]], None], int, list[int]]] = []

    def launcher(self, kernel: Callable[[int, list[int]], None]) -> Callable[[int, int, list[int]], None]:
        def launch(programs: int, stream: int, args: list[int]) -> None:
            assert stream == 1234
            self.graph.append((kernel, programs, list(args)))

        return launch

    def replay(self) -> None:
        for kernel, programs, args in self.graph:
            kernel(programs, args)


aligned = AlignedPool(1 << 20).take  # on a 256-byte boundary, so address-derived spans stay in bounds


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("tokens", "nodes_programs"), [(88, 3), (24, 1), (21, 1)])
def test_the_kernel_arguments_keep_the_contract_over_replays(
    monkeypatch, dtype: torch.dtype, tokens: int, nodes_programs: int
) -> None:
    # 88 tokens: more than a lone program takes, so three programs share the entry through the handshake;
    # 24 tokens: a decode-sized entry, one program, no handshake (the launch's arrive/ready cells stay 0);
    # 21 tokens: the weights' 42 or 84 bytes break 8-byte words — the node still moves whole words (the
    # emulator asserts it) and the entry holds exactly the tensor's bytes
    monkeypatch.setattr(graph_ring, "_current_stream", lambda index: 1234)
    monkeypatch.setattr(graph_ring, "_programs", lambda index: 3)
    harness = Harness(capacity=1 << 19, max_calls=3)
    kernels = CapturedKernels()
    harness.ring.kernels = kernels.launcher(record_kernel)
    width = 96
    hidden = aligned(tokens * width, dtype).view(tokens, width)
    w1 = torch.randn(width, width).to(dtype)
    weights = aligned(tokens, dtype)
    weights.copy_(torch.rand(tokens))
    out = aligned(tokens * width, dtype).view(tokens, width)
    harness.capture(hidden, w1, weights, out, layer_index=0)
    assert [programs for _, programs, _ in kernels.graph] == [nodes_programs]  # one node per layer call
    (record_args,) = [args for _, _, args in kernels.graph]
    entry = record_args[3 * SPANS + 6]
    assert entry % ALIGNMENT == 0
    moved = record_args[3 * SPANS + 3]
    assert moved % 8 == 0 and moved >= hidden.nbytes + weights.nbytes + out.nbytes
    assert record_args[3 * SPANS : 3 * SPANS + 8] == [
        out.data_ptr(),
        out.numel(),
        {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}[dtype],
        moved,
        1,  # it finishes
        1,  # it reserves
        entry,
        1,  # a first layer's launch
    ]
    seen = []
    for replay in range(6):
        hidden.copy_(torch.randn(tokens, width).to(dtype))
        if replay == 4:
            hidden[tokens - 1, 5] = float("inf")  # the last rows: the last program's block
        layer(hidden, w1, weights, out)
        kernels.replay()
        seen.append((hidden.clone(), out.clone()))
    harness.layer.poll(launch=True)
    sequences = [begin.context["graph_sequence"] for begin, _ in harness.written]
    assert sequences == [2, 3, 4]
    assert [begin.context["graph_step"] for begin, _ in harness.written] == [3, 4, 5]
    for begin, complete in harness.written:
        expected_hidden, expected_output = seen[begin.context["graph_sequence"]]
        assert torch.equal(_bits(begin.snapshot.tree["hidden"].view()), _bits(expected_hidden))
        assert torch.equal(_bits(complete.outputs.tree["output"].view()), _bits(expected_output))
    good = harness.written[0][0].context["flight"]["magnitude"]
    assert good == float(seen[2][1].float().abs().max())
    assert not math.isfinite(harness.written[-1][0].context["flight"]["magnitude"])
    assert harness.ring.cells[3:6, 0].tolist() == [0, 0, 0]  # every replay's last program reset its cells


def stage_kernel(programs: int, args: list[int]) -> None:
    """What ``graph_record``'s STAGE variant does: the spans' words to ``buffer + offset``, nothing else."""
    assert args[3 * SPANS + 4 : 3 * SPANS + 6] == [0, 0], "a staging node neither finishes nor reserves"
    buffer = args[3 * SPANS + 8 + 3]
    for i in range(SPANS):
        source, offset, size = args[3 * i : 3 * i + 3]
        assert (source | (buffer + offset) | size) % 8 == 0
        if size:
            ctypes.memmove(buffer + offset, source, size)


class FakeStream:
    """A capturing or side stream: its handle, and the waits queued on it (``events``, shared)."""

    def __init__(self, handle: int, events: list[tuple[str, int, int]]) -> None:
        self.cuda_stream = handle
        self.events = events

    def wait_stream(self, other: FakeStream) -> None:
        self.events.append(("wait", self.cuda_stream, other.cuda_stream))


@pytest.mark.parametrize("stage_bytes", [None, 64 << 10], ids=["lone-only", "up-to-64K"])
def test_lone_launches_are_staged_off_the_graphs_path_and_joined_at_its_end(
    monkeypatch, stage_bytes: int | None
) -> None:
    # in a graph opened for staging, a lone layer call puts only a copy into its staging slot on the graph's
    # stream; its record node (reservation, copy into the ring, check, tag) goes on the side stream after a
    # fork; a call too large to stage joins the side branch first and takes the one-node path; closing the
    # capture joins the side stream back. Replayed in graph order, the entries hold each call's bits.
    # With a stage limit above the lone size, the 88-token call (34.5 KB) is staged too: its record node beside
    # the graph runs three programs through the handshake.
    monkeypatch.setattr(graph_ring, "_current_stream", lambda index: 1234)
    monkeypatch.setattr(graph_ring, "_programs", lambda index: 3)
    harness = Harness(capacity=1 << 20, max_calls=8, stage_bytes=stage_bytes or graph_ring.ALONE_BYTES)
    ring = harness.ring
    events: list[tuple[str, int, int]] = []
    graph: list[tuple[Callable[[int, list[int]], None], int, list[int]]] = []

    def launcher(kernel: Callable[[int, list[int]], None]) -> Callable[[int, int, list[int]], None]:
        def launch(programs: int, stream: int, args: list[int]) -> None:
            events.append(("launch", stream, 0))
            graph.append((kernel, programs, list(args)))

        return launch

    ring.kernels = launcher(record_kernel)
    ring.stage_kernel = launcher(stage_kernel)
    ring.stage = aligned(1 << 16, torch.uint8)  # 64 KiB: room for every entry of this graph
    ring._open[1234] = graph_ring._Open(FakeStream(1234, events), FakeStream(99, events))
    width = 96
    calls = []
    for layer_index, tokens in enumerate((2, 3, 88, 4)):  # 88 tokens: over ALONE_BYTES
        hidden = aligned(tokens * width, torch.bfloat16).view(tokens, width)
        weights = aligned(tokens, torch.bfloat16)
        weights.copy_(torch.rand(tokens))
        out = aligned(tokens * width, torch.bfloat16).view(tokens, width)
        w1 = torch.randn(width, width).to(torch.bfloat16)
        harness.capture(hidden, w1, weights, out, layer_index=layer_index)
        calls.append((hidden, w1, weights, out))
    ring.close_capture(1234)
    staged = [0, 1, 3] if stage_bytes is None else [0, 1, 2, 3]
    assert ring.staged == set(staged) and harness.graph.counters.staged == len(staged)
    # the 88-token entry's record node runs three programs, staged or not
    assert harness.graph.counters.lone == 3
    layer_2 = [("launch", 1234, 0), ("wait", 99, 1234), ("launch", 99, 0)]  # staged as the others
    if stage_bytes is None:
        layer_2 = [
            ("wait", 1234, 99),  # join: layer 2 reserves after the staged ones
            ("launch", 1234, 0),  # its one node
        ]
    assert events == [
        ("launch", 1234, 0),  # layer 0's staging copy, on the graph's path
        ("wait", 99, 1234),  # fork
        ("launch", 99, 0),  # its record node beside the graph
        ("launch", 1234, 0),  # layer 1
        ("wait", 99, 1234),
        ("launch", 99, 0),
        *layer_2,
        ("launch", 1234, 0),  # layer 3
        ("wait", 99, 1234),
        ("launch", 99, 0),
        ("wait", 1234, 99),  # the capture's end joins the side stream
    ]
    staging = [args for kernel, _, args in graph if kernel is stage_kernel]
    # the staging copy: as many programs as 128-word steps (at most the device's 3 here), no handshake
    assert [programs for kernel, programs, _ in graph if kernel is stage_kernel] == [
        max(1, min(3, -(-args[3 * SPANS + 3] // 1024))) for args in staging
    ]
    assert any(programs > 1 for kernel, programs, _ in graph if kernel is stage_kernel)
    records = [(programs, args) for kernel, programs, args in graph if kernel is record_kernel]
    assert [programs for programs, _ in records] == [1, 1, 3, 1]
    slots = [args[3 * SPANS + 8 + 3] for args in staging]
    assert slots[0] == ring.stage.data_ptr() and slots == sorted(set(slots))  # a slot a launch, in order
    for slot, (_programs, args) in zip(slots, [records[i] for i in staged], strict=True):
        # the record node reads the whole slot as one span and checks the output's staged copy
        assert (
            args[:6] == [slot, 0, args[3 * SPANS + 6], 0, 0, 0]
            and slot < args[3 * SPANS] < slot + args[1 + 1]
        )
    seen = []
    for replay in range(3):
        for hidden, w1, weights, out in calls:
            hidden.copy_(torch.randn(hidden.shape).to(torch.bfloat16))
            if replay == 2:
                hidden[-1, 5] = float("inf")
            layer(hidden, w1, weights, out)
        for kernel, programs, args in graph:  # the order the fork and join edges allow
            kernel(programs, args)
        seen.append([(hidden.clone(), out.clone()) for hidden, _, _, out in calls])
    harness.layer.poll(launch=True)
    assert len(harness.written) >= 4
    for begin, complete in harness.written:
        sequence = begin.context["graph_sequence"]
        expected_hidden, expected_output = seen[sequence // 4][sequence % 4]
        assert torch.equal(_bits(begin.snapshot.tree["hidden"].view()), _bits(expected_hidden))
        assert torch.equal(_bits(complete.outputs.tree["output"].view()), _bits(expected_output))
    assert not math.isfinite(harness.written[-1][0].context["flight"]["magnitude"])


def test_a_capture_holds_its_side_stream_until_it_has_ended_and_stages_nothing_once_closing(
    monkeypatch,
) -> None:
    # CUDA counts a side stream in a capture until cudaStreamEndCapture returns: another capture may take it only
    # after ``release_capture``; a capture left open (its end never reported) is replaced by the next one on that
    # stream; once closing, a lone launch takes the one-node path (nothing forks after the join)
    events: list[tuple[str, int, int]] = []
    current = [FakeStream(1234, events)]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: current[0])
    monkeypatch.setattr(graph_ring, "_current_stream", lambda index: current[0].cuda_stream)
    monkeypatch.setattr(graph_ring, "_programs", lambda index: 3)
    ring = GraphRing(1 << 16, torch.device("cpu"), tags=4, launches=4, use_kernel=False)
    assert ring.open_capture() is None  # no kernels: nothing to stage with
    launches: list[tuple[int, int]] = []
    ring.kernels = lambda programs, stream, args: launches.append((stream, args[3 * SPANS + 5]))
    ring.stage_kernel = lambda programs, stream, args: launches.append((stream, -1))
    ring.stage = aligned(4096, torch.uint8)
    ring._sides = [FakeStream(99, events), FakeStream(98, events)]

    def opened_on(handle: int) -> int | None:
        current[0] = FakeStream(handle, events)
        return ring.open_capture()

    assert opened_on(1234) == 1234 and ring._open[1234].side.cuda_stream == 99
    assert opened_on(555) == 555 and ring._open[555].side.cuda_stream == 98
    assert opened_on(777) is None  # both side streams taken
    source = aligned(64, torch.float32)
    spans = Spans((source.data_ptr(),), (0,), (256,), (source.data_ptr(), 64, 3), 256)
    current[0] = ring._open[1234].stream
    ring.capture(0, spans, first=True)
    assert launches == [(1234, -1), (99, 1)] and ring.staged == {0}  # staged: the copy, then the side record
    assert ring._open[1234].used == 256
    ring.close_capture(1234)
    assert events[-1] == ("wait", 1234, 99)  # joined before the capture ends
    ring.capture(1, spans, first=False)
    assert launches[-1] == (1234, 1) and ring.staged == {0}  # closing: the one-node path, no fork
    assert opened_on(777) is None  # 99 still belongs to the capture on 1234 until it has ended
    ring.release_capture(1234)
    assert opened_on(777) == 777 and ring._open[777].side.cuda_stream == 99
    assert ring._open[777].used == 0  # a new graph stages from the area's start
    ring.release_capture(555)  # never closed: not released
    assert 555 in ring._open
    assert opened_on(555) == 555 and ring._open[555].side.cuda_stream == 98  # the stale entry replaced


def test_a_side_stream_is_never_the_stream_a_capture_runs_on(monkeypatch) -> None:
    # torch hands out streams from a small pool, round robin: one of the ring's side streams may be the stream
    # vLLM captures on (or another open capture's); forking onto it would put the record nodes on the graph's
    # path, and another capture's stream cannot be forked into this one
    events: list[tuple[str, int, int]] = []
    current = [FakeStream(99, events)]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: current[0])
    ring = GraphRing(1 << 16, torch.device("cpu"), tags=4, launches=4, use_kernel=False)
    ring.stage_kernel = lambda programs, stream, args: None
    ring._sides = [FakeStream(99, events), FakeStream(98, events), FakeStream(97, events)]
    assert ring.open_capture() == 99 and ring._open[99].side.cuda_stream == 98
    current[0] = FakeStream(97, events)
    assert ring.open_capture() is None  # 99 captures, 98 is its side, 97 captures now: none left
    ring._sides.append(FakeStream(96, events))
    assert ring.open_capture() == 97 and ring._open[97].side.cuda_stream == 96


def test_staging_needs_room_and_a_check_inside_the_spans() -> None:
    ring = GraphRing(1 << 16, torch.device("cpu"), tags=4, launches=4, use_kernel=False)
    ring.stage = aligned(1024, torch.uint8)
    opened = graph_ring._Open(None, None)
    source = aligned(64, torch.float32)
    spans = Spans((source.data_ptr(),), (0,), (256,), (source.data_ptr() + 4, 60, 3), 256)
    slot, staged = ring._stage(spans, opened)  # type: ignore[misc]
    assert slot == ring.stage.data_ptr() and staged.sources == (slot,) and staged.sizes == (256,)
    assert staged.check == (slot + 4, 60, 3)
    outside = Spans((source.data_ptr(),), (0,), (256,), (source.data_ptr() + 4, 64, 3), 256)
    assert ring._stage(outside, opened) is None  # the check runs past its span
    for _ in range(3):
        assert ring._stage(spans, opened) is not None
    assert ring._stage(spans, opened) is None  # this graph's entries fill the area: the one-node path


def test_entries_over_the_lone_size_are_staged_within_the_limit() -> None:
    ring = GraphRing(1 << 16, torch.device("cpu"), tags=4, launches=4, use_kernel=False)
    ring.stage = aligned(128 << 10, torch.uint8)
    opened = graph_ring._Open(None, None)
    source = aligned(10 << 10, torch.float32)  # 40 KiB: over the lone size
    big = Spans((source.data_ptr(),), (0,), (40 << 10,), (source.data_ptr(), 10 << 10, 3), 40 << 10)
    lone = Spans((source.data_ptr(),), (0,), (8 << 10,), (source.data_ptr(), 2 << 10, 3), 8 << 10)
    assert ring.stage_bytes == graph_ring.ALONE_BYTES
    assert ring._stage(big, opened) is None  # the default: lone entries only
    wide = Spans((source.data_ptr(),), (0,), (24 << 10,), (source.data_ptr(), 12_000, 2), 24 << 10)
    assert ring._stage(wide, opened) is None  # few bytes but more elements than one program checks: not lone
    ring.stage_bytes = 32 << 10
    assert ring._stage(big, opened) is None  # over the limit
    ring.stage_bytes = 40 << 10
    slots = [ring._stage(big, opened) for _ in range(3)]  # 120 KiB of the 128
    assert all(slots) and ring._stage(big, opened) is None
    assert ring._stage(lone, opened) is not None and ring._stage(lone, opened) is None  # the last 8 KiB


def test_every_graph_reuses_the_staging_area_from_its_start() -> None:
    # a graph's replay, its side branch included, ends before the next graph on the stream begins: graphs share
    # the area, so what one graph may stage is the area itself, and captures never use it up (vLLM captures ~67
    # batch sizes, piecewise and full, and may recapture)
    ring = GraphRing(1 << 16, torch.device("cpu"), tags=4, launches=4, use_kernel=False)
    ring.stage = aligned(1024, torch.uint8)
    source = aligned(64, torch.float32)
    spans = Spans((source.data_ptr(),), (0,), (256,), (source.data_ptr(), 64, 3), 256)
    base = ring.stage.data_ptr()
    for _ in range(50):  # many graphs, each of four entries: every one finds the whole area
        opened = graph_ring._Open(None, None)
        slots = [ring._stage(spans, opened) for _ in range(4)]
        assert [slot[0] for slot in slots if slot] == [base, base + 256, base + 512, base + 768]
        assert ring._stage(spans, opened) is None


# --- settings and the gate's prepare hook -------------------------------------------------------------------------


def test_graph_ring_size_setting() -> None:
    base = {"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_TRIGGER": "flight"}
    assert settings_from_environ(base).flight_graph_bytes == 256 << 20
    assert settings_from_environ({**base, "MOEREPLAY_FLIGHT_GRAPH_BYTES": "0"}).flight_graph_bytes == 0
    assert (
        settings_from_environ({**base, "MOEREPLAY_FLIGHT_GRAPH_BYTES": "64M"}).flight_graph_bytes == 64 << 20
    )
    with pytest.raises(SettingsError, match="FLIGHT_GRAPH_BYTES"):
        settings_from_environ({**base, "MOEREPLAY_FLIGHT_GRAPH_BYTES": "100"})
    from moereplay.capture import settings as settings_module

    assert settings_module.LONE_STAGE == graph_ring.ALONE_BYTES  # settings spells it without importing torch
    default = settings_from_environ(base)
    assert default.flight_graph_stage == 384 << 10 and default.flight_graph_batch
    assert "flight_graph_stage" not in default.describe() and "flight_graph_batch" not in default.describe()
    assert default.flight_graph_compact and "flight_graph_compact" not in default.describe()
    lone = settings_from_environ(
        {**base, "MOEREPLAY_FLIGHT_GRAPH_STAGE": "32K", "MOEREPLAY_FLIGHT_GRAPH_BATCH": "0"}
    )
    assert lone.flight_graph_stage == graph_ring.ALONE_BYTES and not lone.flight_graph_batch
    assert "flight_graph_stage=32768" in lone.describe() and "flight_graph_batch=off" in lone.describe()
    # a limit up to the lone size is allowed in a ring of any size (lone entries are staged whatever it says);
    # one above the staging area of a small ring is refused
    small = {**base, "MOEREPLAY_FLIGHT_GRAPH_BYTES": "1M"}
    assert (
        settings_from_environ({**small, "MOEREPLAY_FLIGHT_GRAPH_STAGE": "32K"}).flight_graph_stage == 32 << 10
    )
    with pytest.raises(SettingsError, match=r"FLIGHT_GRAPH_STAGE.*65536-byte staging area"):
        settings_from_environ({**small, "MOEREPLAY_FLIGHT_GRAPH_STAGE": "100K"})
    with pytest.raises(SettingsError, match="FLIGHT_GRAPH_STAGE"):
        settings_from_environ({**base, "MOEREPLAY_FLIGHT_GRAPH_STAGE": "lots"})
    # an entry larger than a 256M ring's staging area (16M) could never be staged: said at once
    assert graph_ring.STAGE_SHARE == 16  # the 16M follows from it
    with pytest.raises(
        SettingsError, match=r"FLIGHT_GRAPH_STAGE.*16777216-byte staging area.*raise MOEREPLAY"
    ):
        settings_from_environ({**base, "MOEREPLAY_FLIGHT_GRAPH_STAGE": "17M"})
    assert (
        settings_from_environ({**base, "MOEREPLAY_FLIGHT_GRAPH_STAGE": "16M"}).flight_graph_stage == 16 << 20
    )
    bigger = {**base, "MOEREPLAY_FLIGHT_GRAPH_STAGE": "17M", "MOEREPLAY_FLIGHT_GRAPH_BYTES": "1G"}
    assert settings_from_environ(bigger).flight_graph_stage == 17 << 20


def test_the_gate_prepares_before_the_capture_begins_and_never_during_another() -> None:
    order: list[str] = []

    class FakeGraph:
        def capture_begin(self, *args: Any, **kwargs: Any) -> None:
            order.append("begin")

        def capture_end(self) -> None:
            order.append("end")

    gate = GraphGate()
    gate.prepare = lambda: order.append(f"prepare (captures {gate.captures})")
    undo = install(gate, FakeGraph)
    try:
        FakeGraph().capture_begin()
        FakeGraph().capture_begin()  # a second capture while the first runs: no allocation now
        FakeGraph().capture_end()
        FakeGraph().capture_end()
        gate.prepare = lambda: (_ for _ in ()).throw(RuntimeError("no memory"))  # a failing prepare: logged
        FakeGraph().capture_begin()
    finally:
        undo()
    assert order == ["prepare (captures 0)", "begin", "begin", "end", "end", "begin"]


def test_a_graph_that_stays_bad_writes_the_trigger_budget_then_counts(
    tmp_path, graph_module, monkeypatch
) -> None:
    # from replay 3 on every output is NaN (a poisoned model): the first trigger writes the history up to it,
    # one more trigger is written, the rest are counted as suppressed
    session = _arm(tmp_path, flight_calls="4", flight_graph_bytes="64K", flight_triggers="2")
    x, w1, weights, out = _buffers()
    graph = EmulatedGraph(session, monkeypatch)
    static = x.clone()
    graph.capture(
        lambda: graph_module.layer(static, w1, weights, out), lambda: layer(static, w1, weights, out)
    )
    for replay in range(10):
        static.copy_(x + replay)
        if replay >= 3:
            static[0, 0] = float("nan")
        graph.replay()
        session.recorder.flight.poll(launch=True)  # the writer thread's poll, between replays
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        counters = reader.footer["counters"]
        assert counters["flight_graph_triggers"] == 7 and counters["flight_triggers_suppressed"] == 5
        assert [r.context["graph_sequence"] for r in records] == [0, 1, 2, 3, 4]
        assert [r.context["flight"]["trigger"] for r in records] == [False, False, False, True, True]


@pytest.mark.parametrize(("first_floats", "node_programs"), [(24, [1, 1]), (2048, [2, 1])])
def test_a_call_with_more_spans_than_a_node_takes_two_nodes_that_share_one_entry(
    monkeypatch, first_floats: int, node_programs: list[int]
) -> None:
    # the first node reserves the entry and copies SPANS spans; the second reads the published start, copies the
    # rest, folds the output and finishes — one sequence, one tag word, the launch's cells reset for the next replay.
    # Small spans: both nodes run alone. 8 KB spans: the first node's programs share it through the arrive/ready
    # handshake and the lone last node must reset those cells.
    monkeypatch.setattr(graph_ring, "_current_stream", lambda index: 1234)
    monkeypatch.setattr(graph_ring, "_programs", lambda index: 2)
    ring = GraphRing(1 << 20, torch.device("cpu"), tags=8, launches=4, use_kernel=False)
    kernels = CapturedKernels()
    ring.kernels = kernels.launcher(record_kernel)
    sources = [aligned(first_floats if i < SPANS else 24, torch.float32) for i in range(SPANS + 4)]
    sizes = [source.numel() * source.element_size() for source in sources]
    offsets = [sum(-(-size // ALIGNMENT) * ALIGNMENT for size in sizes[:i]) for i in range(len(sources))]
    out = sources[-1]
    spans = Spans(
        tuple(s.data_ptr() for s in sources), tuple(offsets), tuple(sizes), (out.data_ptr(), out.numel(), 3),
        offsets[-1] + ALIGNMENT,
    )  # fmt: skip
    assert ring.capture(1, spans, first=True) == max(node_programs)
    flags = [args[3 * SPANS + 4 : 3 * SPANS + 6] for _, _, args in kernels.graph]  # (finish, reserve)
    assert flags == [[0, 1], [1, 0]]
    assert [programs for _, programs, _ in kernels.graph] == node_programs
    for replay in range(3):
        for i, source in enumerate(sources):
            source.fill_(float(100 * replay + i))
        kernels.replay()
        start = int(ring.meta[replay % 8][1])
        assert ring.meta[replay % 8].tolist() == [
            replay,
            start,
            1,
            replay + 1,
            -1,
        ]  # sequence, start, launch, step, tokens (no count: unknown)
        for i, source in enumerate(sources):
            assert torch.equal(ring.view(start, offsets[i], sizes[i]).view(torch.float32), source)
        word = int(ring.words[replay % 8])
        assert word >> 32 == 1 and (word & 0xFFFFFFFF) == int(
            torch.tensor(float(100 * replay + len(sources) - 1)).view(torch.int32)
        )
        assert ring.cells[2:6, 1].tolist() == [0, 0, 0, 0]
    assert int(ring.state[1]) == 3 and ring.hint == 3


def test_the_kernel_path_refuses_a_source_that_is_not_word_aligned(monkeypatch) -> None:
    # every node moves whole 8-byte words: a misaligned source would fault inside a served graph, so the capture
    # refuses it (flight_graph's sources are 256-byte aligned: address minus its lead)
    monkeypatch.setattr(graph_ring, "_current_stream", lambda index: 1234)
    monkeypatch.setattr(graph_ring, "_programs", lambda index: 1)
    ring = GraphRing(1 << 20, torch.device("cpu"), tags=8, launches=4, use_kernel=False)
    kernels = CapturedKernels()
    ring.kernels = kernels.launcher(record_kernel)
    source = aligned(64, torch.uint8)
    for lead, refused in ((0, False), (4, True)):
        spans = Spans((source.data_ptr() + lead,), (0,), (16,), None, ALIGNMENT)
        if refused:
            with pytest.raises(ValueError, match="8-byte aligned"):
                ring.capture(0, spans, first=True)
        else:
            assert ring.capture(0, spans, first=True) == 1
    assert len(kernels.graph) == 1  # the refused capture queued nothing


class FakeRunner:
    """vLLM's GPU model runner as :mod:`moereplay.capture.padded_rows` finds it: a caller's ``self`` whose
    ``query_start_loc.gpu`` ends with the step's token count."""

    def __init__(self, slots: int) -> None:
        self.query_start_loc = types.SimpleNamespace(gpu=torch.zeros(slots, dtype=torch.int32))

    def dummy_run(self, capture: Callable[[], int]) -> int:
        return capture()  # the layer call (and its ring launch) is captured inside the runner's own frame

    def step(self, tokens: int) -> None:
        self.query_start_loc.gpu.fill_(tokens)  # past the last request: the step's total


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel-arguments", "fallback"])
def test_padding_rows_of_a_replayed_batch_are_copied_but_not_checked(monkeypatch, kernel: bool) -> None:
    # a graph captured for 8 rows replays steps of 6 real tokens: rows 6-7 are padding and may hold NaN (a
    # served gpt-oss did); they must not trigger, while a NaN in a real row still does
    tokens, width = 8, 96
    monkeypatch.setattr(padded_rows, "batch_tokens", lambda: tokens)  # vLLM's BatchDescriptor while capturing
    harness = Harness(capacity=1 << 19, max_calls=3)
    kernels = CapturedKernels()
    if kernel:
        monkeypatch.setattr(graph_ring, "_current_stream", lambda index: 1234)
        monkeypatch.setattr(graph_ring, "_programs", lambda index: 3)
        harness.ring.kernels = kernels.launcher(record_kernel)
    hidden = aligned(tokens * width, torch.bfloat16).view(tokens, width)
    hidden.copy_(torch.randn(tokens, width))
    w1 = torch.randn(width, width).to(torch.bfloat16)
    weights = aligned(tokens, torch.bfloat16)
    weights.copy_(torch.rand(tokens))
    out = aligned(tokens * width, torch.bfloat16).view(tokens, width)
    runner = FakeRunner(slots=5)
    launch = runner.dummy_run(lambda: harness.capture(hidden, w1, weights, out, layer_index=0))
    assert harness.graph.counters.rows_unknown == 0
    if kernel:
        (record_args,) = [args for _, _, args in kernels.graph]
        assert record_args[3 * SPANS + 18 :] == [runner.query_start_loc.gpu[-1:].data_ptr(), width]

    def replay(real: int, bad_row: int | None) -> None:
        runner.step(real)
        hidden.copy_(torch.randn(tokens, width))
        hidden[real:] = float("nan")  # the padding: whatever the buffers held
        if bad_row is not None:
            hidden[bad_row, 3] = float("inf")
        layer(hidden, w1, weights, out)
        kernels.replay() if kernel else harness.ring.replay(launch)

    replay(6, None)
    replay(6, None)
    harness.layer.poll(launch=True)
    assert harness.written == []  # NaN in rows 6-7 only: no trigger
    replay(6, 5)  # a real row goes bad
    harness.layer.poll(launch=True)
    assert harness.written, "a NaN in a real row must trigger"
    bad = harness.written[-1]
    assert not math.isfinite(bad[0].context["flight"]["magnitude"])
    assert torch.isnan(_bits(bad[1].outputs.tree["output"].view())[6:].view(torch.bfloat16).float()).all()
    # every written record says which of its rows were real at its replay: a replay leaves the padding unjudged
    assert [
        (begin.context["graph_tokens"], begin.context["graph_batch"]) for begin, _ in harness.written
    ] == [(6, 8)] * len(harness.written)


def test_without_the_runner_every_row_is_checked_and_counted() -> None:
    harness = Harness(capacity=1 << 19, max_calls=3)
    tokens, width = 8, 16
    hidden = torch.randn(tokens, width).to(torch.bfloat16)
    w1 = torch.randn(width, width).to(torch.bfloat16)
    weights = torch.rand(tokens).to(torch.bfloat16)
    out = torch.zeros(tokens, width, dtype=torch.bfloat16)
    launch = harness.capture(hidden, w1, weights, out, layer_index=0)
    assert harness.graph.counters.rows_unknown == 1
    assert harness.graph.as_counters()["flight_graph_rows_unknown"] == 1
    hidden[7] = float("nan")
    layer(hidden, w1, weights, out)
    harness.ring.replay(launch)
    harness.layer.poll(launch=True)
    assert harness.written  # a padding row or not, nobody can tell: it triggers as before
    assert "graph_tokens" not in harness.written[-1][0].context  # and the record claims no real-row count


@pytest.mark.parametrize(
    ("batch", "shape"),
    [(8, (16, 4)), (None, (8, 4))],
    ids=["rows-are-not-the-batch", "no-forward-context"],
)
def test_the_count_limits_only_an_output_with_one_row_per_token_of_the_batch(
    monkeypatch, batch, shape
) -> None:
    # a data-parallel all-gather ([all ranks' tokens, hidden]), a capture outside vLLM's forward pass, an output of
    # another layout: the step's count says nothing about their rows — every row is checked, and counted
    monkeypatch.setattr(padded_rows, "batch_tokens", lambda: batch)
    harness = Harness(capacity=1 << 19, max_calls=3)
    hidden = torch.randn(shape[0], 4).to(torch.bfloat16)
    w1 = torch.randn(4, 4).to(torch.bfloat16)
    weights = torch.rand(shape[0]).to(torch.bfloat16)
    out = torch.zeros(shape, dtype=torch.bfloat16)
    runner = FakeRunner(slots=5)
    runner.dummy_run(lambda: harness.capture(hidden, w1, weights, out, layer_index=0))
    assert harness.graph.counters.rows_unknown == 1


def test_only_a_two_dimensional_contiguous_token_major_output_is_limited() -> None:
    assert padded_rows.limits_rows(torch.zeros(8, 4), 8) == 4
    assert padded_rows.limits_rows(torch.zeros(8, 2, 2), 8) is None  # [experts, tokens, hidden] or the like
    assert padded_rows.limits_rows(torch.zeros(4, 8).t(), 8) is None  # not contiguous
    assert padded_rows.limits_rows(torch.zeros(32, 4), 8) is None  # [tokens · top_k, N]


def test_a_draft_models_capture_below_the_runner_gets_no_count() -> None:
    runner = FakeRunner(slots=4)
    drafter = types.SimpleNamespace()
    runner.drafter = drafter

    class Draft:
        def __init__(self) -> None:
            self.owner = drafter

        def capture(self) -> torch.Tensor | None:
            return padded_rows.token_count(torch.device("cpu"))

    def in_runner(self: FakeRunner, draft: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        return draft()

    def drafter_frame(self: Any) -> torch.Tensor | None:  # a frame whose ``self`` is the runner's drafter
        return padded_rows.token_count(torch.device("cpu"))

    assert in_runner(runner, lambda: drafter_frame(drafter)) is None
    found = in_runner(runner, lambda: padded_rows.token_count(torch.device("cpu")))
    assert found is not None and found.data_ptr() == runner.query_start_loc.gpu[-1:].data_ptr()


def test_a_staged_launch_keeps_its_row_limit_for_the_record_node() -> None:
    ring = GraphRing(1 << 16, torch.device("cpu"))
    ring.stage = torch.zeros(4096, dtype=torch.uint8)  # a staging area, as the kernels' ring has
    source = torch.zeros(64, dtype=torch.uint8)
    spans = Spans((source.data_ptr(),), (0,), (64,), (source.data_ptr(), 32, 2), ALIGNMENT, (1234, 16))
    staged = ring._stage(spans, graph_ring._Open(None, None))
    assert staged is not None
    assert staged[1].rows == (1234, 16)


@pytest.mark.parametrize("poll_s", [0.005, 0.05])
def test_with_graph_launches_the_writer_waits_the_graph_poll_and_an_eager_call_wakes_it(
    poll_s: float,
) -> None:
    """MOEREPLAY_FLIGHT_GRAPH_POLL_MS: while graphs hold ring launches and no eager call waits for the writer, a
    poll asks for ``poll_s`` (None at the writer's own 5 ms: no wait of its own). A longer wait marks the writer
    idle, so the serving thread wakes it when it leaves an eager call to it; at 5 ms it is never idle."""
    harness = Harness(capacity=1 << 16)
    harness.graph.poll_s = poll_s
    harness.capture_layer()
    harness.replay()
    wanted = harness.layer.poll(launch=True)
    assert harness.graph.counters.checked == 1
    longer = poll_s > writer_thread.POLL_INTERVAL_S
    assert wanted == (poll_s if longer else None)
    assert harness.layer._writer_idle is longer
    wakes: list[int] = []
    harness.layer.wake = lambda: wakes.append(1)
    harness.layer.wake_if_idle()  # what the serving thread calls when it leaves an eager call unchecked
    assert wakes == ([1] if longer else [])


def test_the_graph_poll_and_batch_settings_reach_the_graph_flight(tmp_path, graph_module) -> None:
    session = _arm(tmp_path, flight_graph_bytes="64K", flight_graph_poll_ms="40", flight_graph_batch="1")
    flight = session.recorder.flight
    assert isinstance(flight, LayerFlight) and flight.graph is not None
    assert flight.graph.poll_s == pytest.approx(0.04) and flight.graph.batch and flight.graph.compact
    assert "flight_graph_compact" not in session.settings.describe()
    session_module.disarm()
    session = _arm(tmp_path, flight_graph_bytes="64K", flight_graph_compact="0")
    flight = session.recorder.flight
    assert isinstance(flight, LayerFlight) and flight.graph is not None and not flight.graph.compact
    assert "flight_graph_compact=off" in session.settings.describe()
    session.close()


def test_the_graph_poll_default_is_the_writers_own_interval() -> None:
    """settings cannot import the writer (no torch there): its default is spelled again, and must agree."""
    from moereplay.capture import settings

    assert settings.FLIGHT_GRAPH_POLL_MS / 1000 == writer_thread.POLL_INTERVAL_S == flight_graph.GRAPH_POLL_S
