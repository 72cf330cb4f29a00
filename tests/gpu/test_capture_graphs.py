"""Capture armed while a CUDA graph is captured (H200): the graph capture must succeed and replay correctly, in
full-capture and flight mode, even while the writer thread is still busy with earlier eager calls.

The writer thread waits for copies and reads device timings with CUDA calls that invalidate a graph captured in
torch's default global mode by another thread (seen on the H200: ``operation failed due to a previous error during
capture``); ``moereplay.capture.graph_gate`` keeps them apart. Plain torch matmuls stand in for the MoE kernels: the
hazard is in the capture machinery, not in a kernel.

    source tools/gpu/device_setup.sh && python3 -m pytest tests/gpu/test_capture_graphs.py -q -rA
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from moereplay.capture import session as session_module
from moereplay.capture.patch_points import CaptureTarget
from moereplay.format import CaptureReader

MODULE = "moereplay_test_graph_kernels"


def gemm(input: torch.Tensor, output: torch.Tensor, weight: torch.Tensor, scale: float) -> torch.Tensor:
    torch.matmul(input, weight, out=output)
    output.mul_(scale)
    return output


def layer(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    module = sys.modules[MODULE]
    cache = torch.empty(hidden.shape[0], w1.shape[1] + w2.shape[1], device=hidden.device)
    first = module.gemm(hidden, cache[:, : w1.shape[1]], w1, 1.0)
    return module.gemm(first, cache[:, w1.shape[1] :], w2, 0.5).clone()


def expected(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return (hidden @ w1) @ w2 * 0.5


TARGETS = (
    CaptureTarget("gemm", "kernel", MODULE, "gemm", static=("weight",), outputs=("output",)),
    CaptureTarget("layer", "parent", MODULE, "layer", static=("w1", "w2")),
)


@pytest.fixture
def kernels(stand_in_module: Callable[..., types.ModuleType]) -> Iterator[types.ModuleType]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    try:
        yield stand_in_module(MODULE, gemm=gemm, layer=layer)
    finally:
        session_module.disarm()


@pytest.mark.parametrize("trigger", ["always", "flight-kernel", "flight-layer"])
def test_a_graph_captured_while_the_writer_is_busy_succeeds(
    tmp_path: Path, kernels: types.ModuleType, trigger: str
) -> None:
    env = {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_DIR": str(tmp_path / "captures"),
        "MOEREPLAY_TRIGGER": trigger.split("-")[0],
        "MOEREPLAY_FLIGHT_SCOPE": trigger.split("-")[-1] if trigger.startswith("flight") else "layer",
        "MOEREPLAY_QUEUE_CALLS": "100000",  # 40 eager layers queue 240 messages: keep them all (default 64 drops)
    }
    session = session_module.arm(env, targets=TARGETS)
    assert session is not None and session.gate is not None
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 1024, device="cuda", generator=generator)
    w1 = torch.randn(1024, 2048, device="cuda", generator=generator) / 32
    w2 = torch.randn(2048, 1024, device="cuda", generator=generator) / 32
    for step in range(40):  # eager calls: the writer has a queue of copies to wait for and write
        kernels.layer(x + step, w1, w2)
    static_input = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernels.layer(static_input, w1, w2)  # warm-up on a side stream, as torch.cuda.graph users do
    torch.cuda.current_stream().wait_stream(stream)
    seen = session.recorder.counters.seen
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # global capture mode: any unsafe CUDA call from any thread breaks it
        result = kernels.layer(static_input, w1, w2)
    # the layer scope sees the layer call only (its two kernel calls pass straight through)
    skipped = 1 if trigger == "flight-layer" else 3
    assert session.recorder.counters.skipped_graph_capture == session.recorder.counters.seen - seen == skipped
    static_input.copy_(x + 1)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(result, expected(x + 1, w1, w2), rtol=1e-3, atol=1e-3)
    assert session.recorder.active, session.recorder.disabled_reason
    assert session.flush(timeout=120)
    print(f"\n{trigger}: gate waits {session.gate.waits}, timeouts {session.gate.timeouts}")
    assert session.writer.counters.dropped_queue_full == session.writer.counters.outputs_dropped == 0
    session_module.disarm()
    with CaptureReader(session.path) as reader:
        layers = [record for record in reader.calls() if record.op == "layer"]
    assert len(layers) == (41 if trigger == "always" else 0)  # flight writes only on a trigger
