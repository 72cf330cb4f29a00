"""Layer calls replayed from CUDA graphs, kept by the layer-scope flight recorder (H200; the graph ring's Triton
kernels captured into the graph; vLLM 0.25.1's ``fused_marlin_moe`` from the kernel pack for the last test).

- stand-in CUDA layer captured in a ``torch.cuda.CUDAGraph`` while the writer thread is busy writing an eager
  trigger: the capture succeeds, the call is kept (one captured launch), a NaN entering replay k writes replays
  k-5 … k bit for bit with ``cudagraph: true``, found within the documented delay — with the entry (6 MB) on the
  graph's path, and staged (``MOEREPLAY_FLIGHT_GRAPH_STAGE``);
- thousands of replays through a small graph ring (it laps hundreds of times): no check lost, nothing overwritten
  written;
- a graph captured in a stand-in model runner's frame, replayed with NaN in its padding rows (past the runner's
  token count) on the staged lone path, the multi-program path and that path staged (its record node of many
  programs reading the count on the side stream): no trigger; a NaN in a real row triggers;
- vLLM's ``fused_marlin_moe`` at gpt-oss NVFP4 shapes (E = 32, top-4, hidden 2880, intermediate 2944, M = 8) in a
  CUDA graph (default activation: SWIGLUOAI's clamps would turn a NaN into a finite value): a NaN written into the
  hidden-states buffer before replay k triggers within the delay; the file holds
  the graph-replayed layer calls up to it, each input and output as vLLM's kernels saw them, and ``moereplay
  expand`` regenerates their kernel calls and finds the bad call's re-run bit-exact with the recorded output.
  Prints the time per graph replay with the recorder armed and off (interleaved rounds, medians).

    source tools/gpu/device_setup.sh && python3 -m pytest tests/gpu/test_flight_graph_gpu.py -q -s -rA
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from moereplay.capture import graph_ring
from moereplay.capture import session as session_module
from moereplay.capture.flight_graph import GraphFlight
from moereplay.capture.flight_layer import LayerFlight
from moereplay.capture.patch_points import CaptureTarget
from moereplay.capture.patching import ORIGINAL
from moereplay.format import CaptureReader

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::Warning:vllm.*"),
    pytest.mark.filterwarnings("ignore::Warning:triton.*"),
    pytest.mark.filterwarnings("ignore::Warning:torch.*"),
]

MODULE = "moereplay_gpu_graph_layers"
MARLIN_MODULE = "vllm.model_executor.layers.fused_moe.experts.marlin_moe"
EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, TOKENS = 32, 4, 2880, 2944, 8
DELAY_S = 0.1
"""What the test allows from the device finishing the bad call to the trigger (documented: about one writer poll,
5 ms, plus the time of a write the writer is busy with; measured 2.8–5.1 ms on the H200). Below the writer's idle
wait (``flight_layer.IDLE_POLL_S``, 0.5 s): a graph capture that failed to wake an idle writer shows here."""


def layer(hidden, w1, w2, topk_weights, output):
    torch.matmul(torch.matmul(hidden, w1) * topk_weights.reshape(-1, 1), w2, out=output)
    return output


TARGETS = (
    CaptureTarget(
        "layer", "parent", MODULE, "layer", static=("w1", "w2"), outputs=("output",), inputs_intact=True
    ),
)


@pytest.fixture
def kernels(stand_in_module: Callable[..., types.ModuleType]) -> Iterator[types.ModuleType]:
    try:
        yield stand_in_module(MODULE, layer=layer)
    finally:
        session_module.disarm()


def _arm(tmp_path: Path, targets: Any = TARGETS, **settings: str) -> session_module.Session:
    env = {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_DIR": str(tmp_path / "captures"),
        "MOEREPLAY_TRIGGER": "flight",
        "MOEREPLAY_QUEUE_CALLS": "100000",
    }
    env.update({f"MOEREPLAY_{key.upper()}": value for key, value in settings.items()})
    session = session_module.arm(env, **({} if targets is None else {"targets": targets}))
    assert session is not None and session.recorder.layer_scope
    return session


def _graph_flight(session: session_module.Session) -> GraphFlight:
    flight = session.recorder.flight
    assert isinstance(flight, LayerFlight) and flight.graph is not None
    return flight.graph


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().cpu().view(torch.uint8)


def _capture(fn: Callable[[], Any], warmups: int = 2) -> torch.cuda.CUDAGraph:
    """``fn`` warmed up on a side stream, then captured (torch's default global capture mode)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _wait_for_trigger(graph_flight: GraphFlight, triggers: int) -> float:
    """Seconds from now (the bad replay just synchronised) until the graph recorder has triggered ``triggers``
    times (``inf`` past 5 s)."""
    started = time.monotonic()
    while graph_flight.counters.triggers < triggers:
        if time.monotonic() - started > 5.0:
            return float("inf")
        time.sleep(0.0005)
    return time.monotonic() - started


def _chained(
    kernels: types.ModuleType,
    static: torch.Tensor,
    w1: list[torch.Tensor],
    w2: list[torch.Tensor],
    weights: torch.Tensor,
    outs: list[torch.Tensor],
) -> Callable[[], None]:
    """A forward of ``len(outs)`` stand-in layer calls, each reading the one before's output (the first
    ``static``)."""

    def forward() -> None:
        value = static
        for layer, out in enumerate(outs):
            kernels.layer(value, w1[layer], w2[layer], weights, out)
            value = out

    return forward


def _per_replay_us(graph: torch.cuda.CUDAGraph, replays: int = 200) -> tuple[float, float]:
    """Microseconds per replay over ``replays`` back-to-back replays: host-timed, and by CUDA events."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    started = time.perf_counter()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return (time.perf_counter() - started) / replays * 1e6, start.elapsed_time(end) * 1e3 / replays


@pytest.mark.parametrize(
    ("stage", "batch"),
    [(None, False), ("8M", False), ("8M", True)],
    ids=["one-node", "staged", "staged-batch"],
)
def test_a_graph_captured_while_the_writer_is_busy_keeps_its_replays(
    kernels, tmp_path: Path, stage: str | None, batch: bool
) -> None:
    # staged: the 6 MB entry (not lone) staged as MOEREPLAY_FLIGHT_GRAPH_STAGE allows — on the graph's path only
    # the copy into its slot, the record node of many programs (handshake and all) on the side stream; batch:
    # recorded instead by the batch node at the graph's end (MOEREPLAY_FLIGHT_GRAPH_BATCH)
    settings = {"flight_graph_batch": "1" if batch else "0"}
    settings["flight_graph_stage"] = "32K" if stage is None else stage  # 32K: only lone entries are staged
    session = _arm(tmp_path, flight_calls="6", **settings)
    graph_flight = _graph_flight(session)
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 1024, device="cuda", generator=generator)
    w1 = torch.randn(1024, 2048, device="cuda", generator=generator) / 32
    w2 = torch.randn(2048, 1024, device="cuda", generator=generator) / 32
    weights = torch.rand(512, device="cuda", generator=generator)
    out = torch.empty(512, 1024, device="cuda")
    for step in range(
        40
    ):  # eager calls; a NaN at 35 makes the writer write 6 calls of 6 MB as the capture begins
        value = x + step
        if step == 35:
            value[0, 0] = float("nan")
        kernels.layer(value, w1, w2, weights, out)
    static = x.clone()
    graph = _capture(lambda: kernels.layer(static, w1, w2, weights, out))
    assert graph_flight.counters.launches == 1, session.recorder.counter_values()
    assert session.recorder.counters.skipped_graph_capture == 0
    ring = next(iter(graph_flight._watches.values())).ring
    assert ring.kernels is not None, "the graph ring's Triton kernels are not in use"
    seen = []
    delay = None
    for replay in range(30):
        static.copy_(x * (replay + 1))
        if replay == 20:
            static[7, 9] = float("nan")
        graph.replay()
        seen.append((static.clone(), out.clone()))
        if replay == 20:
            torch.cuda.synchronize()
            delay = _wait_for_trigger(graph_flight, 1)
    torch.cuda.synchronize()
    print(
        f"\ngraph trigger found {delay * 1e3:.1f} ms after the bad replay finished (gate waits {session.gate.waits})"
    )
    assert delay is not None and delay < DELAY_S
    assert session.recorder.active, session.recorder.disabled_reason
    session_module.disarm()
    with CaptureReader(session.path) as reader:
        records = [record for record in reader.calls() if record.context.get("cudagraph")]
        counters = reader.footer["counters"]
        print(f"counters: { {k: v for k, v in counters.items() if k.startswith('flight')} }")
        assert counters["flight_graph_checked"] == 30 and counters["flight_graph_unchecked"] == 0
        # 6 MB an entry: one node on the graph's path unless the stage limit lets it be staged
        assert counters["flight_graph_staged"] == (0 if stage is None else 1)
        assert [record.context["graph_sequence"] for record in records] == list(range(15, 21))
        assert records[-1].context["flight"]["trigger"] and counters["flight_graph_lost"] == 0
        for record in records:
            hidden, output = seen[record.context["graph_sequence"]]
            assert torch.equal(_bits(reader.load_args(record.index)["hidden"]), _bits(hidden))
            assert torch.equal(_bits(reader.load_outputs(record.index)["output"]), _bits(output))


class _Runner:
    """vLLM's GPU model runner as ``moereplay.capture.padded_rows`` finds it while a graph is captured in its own
    frame: ``query_start_loc.gpu`` on the GPU, whose last entry is the step's token count."""

    def __init__(self) -> None:
        self.query_start_loc = types.SimpleNamespace(gpu=torch.zeros(9, dtype=torch.int32, device="cuda"))

    def capture(self, fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
        return _capture(fn)

    def step(self, tokens: int) -> None:
        self.query_start_loc.gpu.fill_(
            tokens
        )  # vLLM: the entries past the last request hold the step's total


@pytest.mark.parametrize(
    ("tokens", "hidden", "staged", "stage"),
    [
        (8, 64, 1, None),
        (512, 1024, 0, None),
        (512, 1024, 1, "8M"),
        (8, 64, 1, "batch"),
        (512, 1024, 1, "8M batch"),
    ],
    ids=["lone-staged", "multi-program", "multi-program-staged", "lone-batch", "multi-program-batch"],
)
def test_padding_rows_of_a_replayed_graph_do_not_trigger(
    kernels,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tokens: int,
    hidden: int,
    staged: int,
    stage: str | None,
) -> None:
    from moereplay.capture import padded_rows

    monkeypatch.setattr(padded_rows, "batch_tokens", lambda: tokens)  # vLLM's BatchDescriptor while capturing
    settings = {"flight_graph_batch": "1" if stage is not None and "batch" in stage else "0"}
    limit = None if stage is None else stage.replace("batch", "").strip()
    settings["flight_graph_stage"] = limit or "32K"  # 32K: only lone entries are staged
    session = _arm(tmp_path, flight_calls="4", **settings)
    graph_flight = _graph_flight(session)
    generator = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, hidden, device="cuda", generator=generator)
    w1 = torch.randn(hidden, hidden, device="cuda", generator=generator) / hidden**0.5
    w2 = torch.randn(hidden, hidden, device="cuda", generator=generator) / hidden**0.5
    weights = torch.rand(tokens, device="cuda", generator=generator)
    out = torch.empty(tokens, hidden, device="cuda")
    static = x.clone()
    runner = _Runner()
    graph = runner.capture(lambda: kernels.layer(static, w1, w2, weights, out))
    assert graph_flight.counters.launches == 1 and graph_flight.counters.rows_unknown == 0
    assert graph_flight.counters.staged == staged
    real = tokens - 2
    for replay in range(12):
        runner.step(real)
        static.copy_(x * (replay + 1))
        static[real:] = float("nan")  # the padding: whatever the buffers held
        graph.replay()
    torch.cuda.synchronize()
    time.sleep(0.2)  # a few writer polls
    assert graph_flight.counters.triggers == 0, "NaN in padding rows triggered"
    runner.step(real)
    static[real - 1, 3] = float("nan")  # a real row goes bad
    graph.replay()
    torch.cuda.synchronize()
    delay = _wait_for_trigger(graph_flight, 1)
    print(f"\n{tokens} tokens: a NaN in a real row found {delay * 1e3:.1f} ms after the replay finished")
    assert delay < DELAY_S
    session_module.disarm()
    with CaptureReader(session.path) as reader:
        counters = reader.footer["counters"]
        assert counters["flight_graph_checked"] == 13 and counters["flight_graph_rows_unknown"] == 0
        assert counters["flight_graph_triggers"] == 1  # not one for a padding row that a slow poll found late
        records = list(reader.calls())
        triggered = [record for record in records if record.context.get("flight", {}).get("trigger")]
        assert [record.context["graph_sequence"] for record in triggered] == [12]
        # every written replay says which of its rows were real (the count the kernel read into its metadata row)
        assert records and all(
            (record.context["graph_tokens"], record.context["graph_batch"]) == (real, tokens)
            for record in records
        ), [record.context for record in records]


@pytest.mark.parametrize("batch", ["0", "1"], ids=["record-nodes", "batch"])
def test_graphs_sharing_the_staging_area_keep_each_replays_bits(kernels, tmp_path: Path, batch: str) -> None:
    # every graph stages from the area's start (graph_ring: a graph's replay, its side branch included, ends before
    # the next one on the stream begins): two graphs of entries that are not lone, replayed alternately, share
    # their slot; each written replay holds its own bits, none the other graph's
    session = _arm(tmp_path, flight_calls="8", flight_graph_stage="1M", flight_graph_batch=batch)
    graph_flight = _graph_flight(session)
    generator = torch.Generator(device="cuda").manual_seed(2)
    w1 = torch.randn(256, 256, device="cuda", generator=generator) / 16
    w2 = torch.randn(256, 256, device="cuda", generator=generator) / 16
    graphs = []
    targets: list[int] = []  # where the second graph's staging copy writes
    for tokens in (96, 64):  # entries of about 193 KB and 129 KB: over the lone size, many programs
        static = torch.randn(tokens, 256, device="cuda", generator=generator)
        weights = torch.rand(tokens, device="cuda", generator=generator)
        out = torch.empty(tokens, 256, device="cuda")
        if graphs:  # the ring exists since the first capture: see the second one's staging copy
            ring = next(iter(graph_flight._watches.values())).ring
            copy = ring.stage_kernel

            def seen_copy(programs: int, stream: int, args: list[int], copy: Any = copy) -> None:
                targets.append(args[3 * graph_ring.SPANS + 8 + 3])  # ``buffer``: the slot's address
                copy(programs, stream, args)

            ring.stage_kernel = seen_copy
        graph = _capture(lambda s=static, w=weights, o=out: kernels.layer(s, w1, w2, w, o))
        graphs.append((graph, static, out))
    assert graph_flight.counters.launches == 2 and graph_flight.counters.staged == 2
    ring = next(iter(graph_flight._watches.values())).ring
    # the layer calls' launch ids (with batch, each graph's batch node takes one more for its own cells)
    assert ring.staged == ({0, 1} if batch == "0" else {0, 2})
    assert targets == [ring.stage.data_ptr()]  # the second graph stages at the area's start, as the first did
    seen = []
    for replay in range(40):
        graph, static, out = graphs[replay % 2]
        static.normal_(generator=generator)
        if replay == 39:
            static[3, 5] = float("nan")
        graph.replay()
        seen.append((static.clone(), out.clone()))
    torch.cuda.synchronize()
    assert _wait_for_trigger(graph_flight, 1) < DELAY_S
    session_module.disarm()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        assert [record.context["graph_sequence"] for record in records] == list(range(32, 40))
        for record in records:
            hidden, output = seen[record.context["graph_sequence"]]
            assert torch.equal(_bits(reader.load_args(record.index)["hidden"]), _bits(hidden))
            assert torch.equal(_bits(reader.load_outputs(record.index)["output"]), _bits(output))


@pytest.mark.parametrize("compact", ["0", "1"], ids=["unrolled", "compact"])
def test_a_batch_node_records_every_layer_of_a_graph_bit_exact(kernels, tmp_path: Path, compact: str) -> None:
    """MOEREPLAY_FLIGHT_GRAPH_BATCH: five layer calls of 96 tokens (≈ 300 KB entries, over the lone size) in one
    graph, each staged (a copy on the path), recorded by one batch node at the graph's end (either kernel:
    MOEREPLAY_FLIGHT_GRAPH_COMPACT). A NaN weight of the last layer at the 25th replay triggers; the written calls
    — the bad one and the seven before it, across two replays — hold their own bits, consecutive sequences and
    their layer's launch."""
    session = _arm(
        tmp_path,
        flight_calls="8",
        flight_graph_stage="1M",
        flight_graph_batch="1",
        flight_graph_compact=compact,
    )
    graph_flight = _graph_flight(session)
    generator = torch.Generator(device="cuda").manual_seed(3)
    tokens, hidden, layers = 96, 768, 5
    w1 = [
        torch.randn(hidden, hidden, device="cuda", generator=generator) / hidden**0.5 for _ in range(layers)
    ]
    w2 = [
        torch.randn(hidden, hidden, device="cuda", generator=generator) / hidden**0.5 for _ in range(layers)
    ]
    weights = torch.rand(tokens, device="cuda", generator=generator)
    static = torch.randn(tokens, hidden, device="cuda", generator=generator)
    outs = [torch.empty(tokens, hidden, device="cuda") for _ in range(layers)]

    graph = _capture(_chained(kernels, static, w1, w2, weights, outs))
    ring = next(iter(graph_flight._watches.values())).ring
    assert ring.batch_kernel is not None and graph_flight.counters.launches == layers
    assert graph_flight.counters.staged == layers and ring.staged == set(range(layers))
    seen = []
    for replay in range(25):
        static.normal_(generator=generator)
        if replay == 24:
            w1[-1][0, 0] = float("nan")  # only the last layer's output goes bad
        graph.replay()
        inputs = [static, *outs[:-1]]
        seen.append([(inputs[layer].clone(), outs[layer].clone()) for layer in range(layers)])
    torch.cuda.synchronize()
    assert _wait_for_trigger(graph_flight, 1) < DELAY_S
    session_module.disarm()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        sequences = [record.context["graph_sequence"] for record in records]
        assert sequences == list(range(24 * layers - 3, 25 * layers)), sequences  # replays 23 and 24
        assert records[-1].context["flight"]["trigger"]
        for record in records:
            sequence = record.context["graph_sequence"]
            replay, layer = divmod(sequence, layers)
            assert record.context["graph_launch"] == layer
            hidden_in, output = seen[replay][layer]
            assert torch.equal(_bits(reader.load_args(record.index)["hidden"]), _bits(hidden_in)), sequence
            assert torch.equal(_bits(reader.load_outputs(record.index)["output"]), _bits(output)), sequence
        assert reader.footer["counters"]["flight_graph_lost"] == 0


@pytest.mark.parametrize(
    ("batch", "layers"),
    [("0", 1), ("1", 1), ("compact", 1), ("1", 3), ("compact", 3)],
    ids=["record-node", "batch", "batch-compact", "batch-3-layers", "batch-compact-3-layers"],
)
def test_a_lapping_graph_ring_loses_no_check_and_writes_nothing_overwritten(
    kernels, tmp_path: Path, batch: str, layers: int
) -> None:
    # one entry = hidden + topk + output, three 256-byte spans (5 × 8 floats): a 64 KiB ring laps every ~85 entries;
    # each entry is staged, recorded by a record node beside the graph's path or by the graph's batch node (its
    # one-loop kernel with "compact"). With three layers a batch node records three entries a replay (2,304 bytes,
    # not a divisor of the ring), so every ~28th replay's batch runs past the ring's end and is split
    compact = "1" if batch == "compact" else "0"
    session = _arm(
        tmp_path,
        flight_calls="8",
        flight_graph_bytes="64K",
        flight_graph_batch="0" if batch == "0" else "1",
        flight_graph_compact=compact,
    )
    graph_flight = _graph_flight(session)
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(5, 8, device="cuda", generator=generator)
    w1 = [torch.randn(8, 6, device="cuda", generator=generator) for _ in range(layers)]
    w2 = [torch.randn(6, 8, device="cuda", generator=generator) / 8 for _ in range(layers)]
    weights = torch.rand(5, device="cuda", generator=generator)
    outs = [torch.empty(5, 8, device="cuda") for _ in range(layers)]
    static = x.clone()

    graph = _capture(_chained(kernels, static, w1, w2, weights, outs))
    assert graph_flight.counters.launches == layers
    replays = 3000
    seen = []
    for replay in range(replays):
        static.copy_(x + replay)
        if replay == replays - 1:
            w1[-1][1, 2] = float("nan")  # only the last layer's output goes bad
        graph.replay()
        inputs = [static, *outs[:-1]]
        seen.append([(inputs[layer].clone(), outs[layer].clone()) for layer in range(layers)])
    torch.cuda.synchronize()
    session_module.disarm()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        counters = reader.footer["counters"]
        checked = counters["flight_graph_checked"]
        assert checked == replays * layers and counters["flight_graph_unchecked"] == 0, counters
        assert counters["flight_graph_staged"] == layers  # only each entry's staging copy on the graph's path
        assert records and records[-1].context["graph_sequence"] == replays * layers - 1
        assert records[-1].context["flight"]["trigger"]
        for record in records:
            replay, layer = divmod(record.context["graph_sequence"], layers)
            assert record.context["graph_launch"] == layer
            hidden, output = seen[replay][layer]
            assert torch.equal(_bits(reader.load_args(record.index)["hidden"]), _bits(hidden))
            assert torch.equal(_bits(reader.load_outputs(record.index)["output"]), _bits(output))
        assert len(records) + counters["flight_graph_lost"] == 8
    print(
        f"\nlapping graph ring ({layers} layer(s)): {len(records)} written, {counters['flight_graph_lost']} lost"
    )


# --- vLLM's real fused_marlin_moe -------------------------------------------------------------------------------


def _backend() -> str:
    pack = os.environ.get("MOEREPLAY_PACK")
    if pack:
        from moereplay.pack import load_pack

        load_pack(pack)
        return f"pack:{pack}"
    pytest.importorskip("vllm._custom_ops", reason="needs vLLM 0.25.1: set MOEREPLAY_PACK or install vLLM")
    return "vllm"


def test_real_fused_marlin_moe_graph_replays_trigger_and_expand(tmp_path: Path) -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper (sm_90+) GPU")
    backend = _backend()
    marlin = importlib.import_module(MARLIN_MODULE)
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import rand_marlin_weight_nvfp4_like
    from vllm.scalar_type import scalar_types

    from moereplay.replay.expand import ExpandVerdict, expand_capture

    def experts(n: int, k: int):
        q, s, g = [], [], []
        for _ in range(EXPERTS):
            _ref, qweight, scale, global_scale = rand_marlin_weight_nvfp4_like(
                torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 20, 16
            )
            q.append(qweight)
            s.append(scale)
            g.append(global_scale)
        return torch.stack(q), torch.stack(s), torch.stack(g).reshape(EXPERTS)

    def routing() -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.randn(TOKENS, EXPERTS, device="cuda")
        weights, ids = torch.softmax(scores, dim=-1).topk(TOP_K, dim=-1)
        return weights.contiguous(), ids.to(torch.int32).contiguous()

    torch.manual_seed(0)
    (w1, s1, g1), (w2, s2, g2) = experts(2 * INTERMEDIATE, HIDDEN), experts(HIDDEN, INTERMEDIATE)
    hidden = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weights, ids = routing()

    def call(output: torch.Tensor, unwrapped: bool = False) -> Callable[[], Any]:
        """The layer call into ``output``: through the capture's wrapper, or vLLM's function as it is."""

        def run() -> Any:
            function = marlin.fused_marlin_moe
            if unwrapped:
                function = getattr(function, ORIGINAL)
            return function(
                hidden, w1, w2, None, None, s1, s2, weights, ids, scalar_types.float4_e2m1f.id,
                global_scale1=g1, global_scale2=g2, output=output,
            )  # fmt: skip

        return run

    out_off = torch.empty_like(hidden)
    session = session_module.arm(
        {
            "MOEREPLAY_CAPTURE": "1",
            "MOEREPLAY_DIR": str(tmp_path / "captures"),
            "MOEREPLAY_TRIGGER": "flight",
            "MOEREPLAY_FLIGHT_CALLS": "6",
        }
    )
    assert session is not None
    try:
        graph_flight = _graph_flight(session)
        out = torch.empty_like(hidden)
        graph = _capture(call(out))
        # the same call unwrapped: nothing of moereplay in the graph (its two kernel calls still meet their
        # wrappers at capture time, outside any layer: not kept, flight_graph_not_kept 2; no cost per replay)
        graph_off = _capture(call(out_off, unwrapped=True))
        assert graph_flight.counters.launches == 1, session.recorder.counter_values()
        seen = []
        delay = None
        bad = 12
        for replay in range(16):
            fresh_weights, fresh_ids = routing()
            hidden.copy_(torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16))
            weights.copy_(fresh_weights)
            ids.copy_(fresh_ids)
            if replay == bad:
                hidden[3, 7] = float("nan")
            graph.replay()
            seen.append((hidden.clone(), weights.clone(), ids.clone(), out.clone()))
            if replay == bad:
                torch.cuda.synchronize()
                delay = _wait_for_trigger(graph_flight, 1)
        torch.cuda.synchronize()
        assert not torch.isfinite(seen[bad][3]).all(), "the NaN did not reach the layer's output"
        assert delay is not None and delay < DELAY_S, (delay, session.recorder.counter_values())
        print(f"\nreal fused_marlin_moe: graph trigger {delay * 1e3:.1f} ms after the bad replay finished")
        hidden.copy_(torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16))
        armed: list[tuple[float, float]] = []
        off: list[tuple[float, float]] = []
        for round_ in range(9):  # interleaved rounds, alternating which graph goes first
            for which in ((graph, armed), (graph_off, off))[:: 1 if round_ % 2 else -1]:
                which[1].append(_per_replay_us(which[0]))
        for column, name in ((0, "host-timed"), (1, "CUDA events")):
            on_us = statistics.median(value[column] for value in armed)
            off_us = statistics.median(value[column] for value in off)
            print(
                f"time per graph replay, M = {TOKENS} ({name}, 200 back-to-back replays, median of 9 rounds): "
                f"armed {on_us:.1f} µs, off {off_us:.1f} µs, ratio {on_us / off_us:.3f}"
            )
        assert session.recorder.active, session.recorder.disabled_reason
    finally:
        session_module.disarm()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        counters = reader.footer["counters"]
        print(f"counters: { {k: v for k, v in counters.items() if k.startswith('flight')} }")
        assert [r.op for r in records] == ["fused_marlin_moe"] * 6
        assert [r.context["graph_sequence"] for r in records] == list(range(bad - 5, bad + 1))
        assert all(r.context["cudagraph"] is True and r.parent is None for r in records)
        assert records[-1].context["flight"]["trigger"] and counters["flight_graph_lost"] == 0
        for record in records:
            x, topk_weights, topk_ids, result = seen[record.context["graph_sequence"]]
            args = reader.load_args(record.index)
            outputs = reader.load_outputs(record.index)
            assert torch.equal(_bits(args["hidden_states"]), _bits(x))
            assert torch.equal(_bits(args["topk_weights"]), _bits(topk_weights))
            assert torch.equal(_bits(args["topk_ids"]), _bits(topk_ids))
            assert torch.equal(_bits(outputs["output"]), _bits(result))
            assert args["w1"].shape == w1.shape
        bad_index = records[-1].index
    report = expand_capture(session.path, tmp_path / "expanded.moe.zst", backend=backend, device="cuda")
    for line in report.notes + tuple(report.lines()):
        print(line)
    assert len(report.calls) == 6 and not report.raised
    by_call = {expanded.call: expanded for expanded in report.calls}
    assert by_call[bad_index].verdict is ExpandVerdict.BIT_EXACT, by_call[bad_index].line("expanded")
    assert len(by_call[bad_index].kernel_calls) == 2  # gemm1 and gemm2, regenerated
    assert all(expanded.verdict is ExpandVerdict.BIT_EXACT for expanded in report.calls)
    sys.stdout.flush()


GPT_OSS_MODULE = "vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe"
GPT_OSS_HIDDEN = 2880


def _differences(name: str, recorded: torch.Tensor, rerun: torch.Tensor) -> str:
    """'name: n/total elements differ in r rows, max |diff| d' (or 'name: bit-exact')."""
    a, b = recorded.detach().float().cpu(), rerun.detach().float().cpu()
    differ = (_bits(recorded).reshape(recorded.numel(), -1) != _bits(rerun).reshape(rerun.numel(), -1)).any(1)
    if not differ.any():
        return f"{name}: bit-exact"
    rows = differ.reshape(recorded.shape[0], -1).any(1)
    both = torch.isfinite(a) & torch.isfinite(b)
    worst = (a - b).abs()[both].max().item() if both.any() else float("nan")
    return (
        f"{name}: {int(differ.sum())}/{recorded.numel()} elements differ in rows "
        f"{torch.nonzero(rows).flatten().tolist()}, max |diff| {worst:.4g}"
    )


def test_real_gpt_oss_graph_replays_trigger_and_expand(tmp_path: Path) -> None:
    """vLLM's gpt-oss entry point (``make_routing_data`` + ``triton_kernel_fused_experts``, MXFP4 at gpt-oss-20b
    shapes, M = 8) captured into a CUDA graph with the flight recorder armed: replays with fresh inputs; the last
    expert's w2 bias is NaN and the router reaches it only in replay k (a NaN in the hidden states would not do:
    SWIGLUOAI's clamps turn it finite), which triggers; every written call holds the inputs and output the graph
    saw, and ``moereplay expand`` in a fresh process (the way a user runs it: the process state comes from the
    record) re-runs each bit-exactly. Printed first: the same call eagerly twice (deterministic?), and replayed
    from an unarmed and an armed graph (does a graph replay compute what an eager call does?)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper (sm_90+) GPU")
    backend = _backend()
    from ogs_inputs import gpt_oss_mxfp4_layer

    moe = importlib.import_module(GPT_OSS_MODULE)
    activation = importlib.import_module("vllm.model_executor.layers.fused_moe.activation")
    g = torch.Generator(device="cuda").manual_seed(2880)
    weights = gpt_oss_mxfp4_layer(importlib.import_module, EXPERTS, GPT_OSS_HIDDEN, GPT_OSS_HIDDEN, g)
    hidden = torch.empty(TOKENS, GPT_OSS_HIDDEN, device="cuda", dtype=torch.bfloat16)
    logits = torch.empty(TOKENS, EXPERTS, device="cuda")

    def fresh() -> None:
        hidden.copy_(
            (torch.randn(TOKENS, GPT_OSS_HIDDEN, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
        )
        logits.copy_(torch.randn(TOKENS, EXPERTS, device="cuda", generator=g))
        logits[:, EXPERTS - 1] = -30.0  # the poisoned expert: never chosen but where a replay routes to it

    def call(output: torch.Tensor, unwrapped: bool = False) -> Callable[[], Any]:
        def run() -> Any:
            topk_weights, topk_ids = torch.topk(torch.softmax(logits, dim=-1), TOP_K, dim=-1)
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
            routing_data, gather, scatter = moe.make_routing_data(topk_ids, topk_weights, EXPERTS)
            function = moe.triton_kernel_fused_experts
            if unwrapped:
                function = getattr(function, ORIGINAL, function)
            return function(
                output, hidden, weights.w13, weights.w2, routing_data, gather, scatter, topk=TOP_K,
                activation=activation.MoEActivation.SWIGLUOAI, quant_config=weights.quant_config,
            )  # fmt: skip

        return run

    weights.quant_config.w2_bias[EXPERTS - 1, 100] = float("nan")
    session = session_module.arm(
        {
            "MOEREPLAY_CAPTURE": "1",
            "MOEREPLAY_DIR": str(tmp_path / "captures"),
            "MOEREPLAY_TRIGGER": "flight",
            "MOEREPLAY_FLIGHT_CALLS": "6",
        }
    )
    assert session is not None
    try:
        graph_flight = _graph_flight(session)
        # diagnostics: eager twice, an unarmed graph's replay, same inputs
        fresh()
        eager = [torch.empty_like(hidden), torch.empty_like(hidden)]
        for out_ in eager:
            call(out_, unwrapped=True)()
        out_off = torch.empty_like(hidden)
        graph_off = _capture(call(out_off, unwrapped=True))
        graph_off.replay()
        torch.cuda.synchronize()
        print("\ngpt-oss diagnostics:", _differences("eager vs eager", eager[0], eager[1]), ";",
              _differences("unarmed graph replay vs eager", eager[0], out_off))  # fmt: skip
        out = torch.empty_like(hidden)
        graph = _capture(call(out))
        assert graph_flight.counters.launches == 1, session.recorder.counter_values()
        seen = []
        delay = None
        bad = 12
        for replay in range(16):
            fresh()
            if replay == bad:
                logits[3, EXPERTS - 1] = 30.0
            graph.replay()
            seen.append((hidden.clone(), out.clone()))
            if replay == bad:
                torch.cuda.synchronize()
                delay = _wait_for_trigger(graph_flight, 1)
        torch.cuda.synchronize()
        # the graph's replay against the same call made eagerly (unwrapped), inputs of the last replay
        check = torch.empty_like(hidden)
        call(check, unwrapped=True)()
        torch.cuda.synchronize()
        print("gpt-oss diagnostics:", _differences("armed graph replay vs eager", check, out))
        assert not torch.isfinite(seen[bad][1]).all(), "the NaN did not reach the layer's output"
        assert delay is not None and delay < DELAY_S, (delay, session.recorder.counter_values())
        assert session.recorder.active, session.recorder.disabled_reason
    finally:
        session_module.disarm()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        counters = reader.footer["counters"]
        print(f"counters: { {k: v for k, v in counters.items() if k.startswith('flight')} }")
        assert [r.op for r in records] == ["triton_kernel_fused_experts"] * 6
        assert [r.context["graph_sequence"] for r in records] == list(range(bad - 5, bad + 1))
        for record in records:
            x, result = seen[record.context["graph_sequence"]]
            args = reader.load_args(record.index)
            outputs = reader.load_outputs(record.index)
            print(f"call {record.index}:", _differences("recorded hidden_states", x, args["hidden_states"]), ";",
                  _differences("recorded output", result, outputs["output_tensor"]), ";",
                  "context", {k: v for k, v in record.context.items() if k.startswith("opt_flags")})  # fmt: skip
            assert torch.equal(_bits(args["hidden_states"]), _bits(x))
            assert torch.equal(_bits(outputs["output_tensor"]), _bits(result))
        bad_index = records[-1].index
    report_path = tmp_path / "expand.json"
    command = [sys.executable, "-m", "moereplay", "expand", str(session.path), "-o", str(tmp_path / "x.moe.zst"),
               "--backend", backend, "--json-out", str(report_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    print(done.stdout + done.stderr[-3000:])
    assert done.returncode == 0, done.stderr[-3000:]
    calls = {call["call"]: call for call in json.loads(report_path.read_text())["calls"]}
    assert len(calls) == 6
    assert calls[bad_index]["outputs"][0]["recorded_nonfinite"] > 0
    assert all(call["verdict"] == "bit_exact" for call in calls.values()), [
        c["verdict"] for c in calls.values()
    ]
    sys.stdout.flush()
