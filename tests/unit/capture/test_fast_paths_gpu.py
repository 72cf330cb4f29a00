"""The capture hot path on a GPU: device magnitude slots read through pinned memory, ring and staging buffers
reused across calls, and nothing copied while a CUDA graph is being captured. Plain torch CUDA "kernels"."""

from __future__ import annotations

import math
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from moereplay.capture import session as session_module
from moereplay.capture.flight import MagnitudeSlots
from moereplay.capture.patch_points import CaptureTarget
from moereplay.format import CaptureReader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MODULE = "moereplay_test_cuda_kernels"


def gemm(input: torch.Tensor, output: torch.Tensor, weight: torch.Tensor, scale: float) -> torch.Tensor:
    torch.matmul(input, weight, out=output)
    output.mul_(scale)
    return output


def layer(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    module = sys.modules[MODULE]
    cache = torch.empty(hidden.shape[0], w1.shape[1] + w2.shape[1], device=hidden.device)
    first = module.gemm(hidden, cache[:, : w1.shape[1]], w1, 1.0)
    return module.gemm(first, cache[:, w1.shape[1] :], w2, 0.5).clone()


TARGETS = (
    CaptureTarget("gemm", "kernel", MODULE, "gemm", static=("weight",), outputs=("output",)),
    CaptureTarget("layer", "parent", MODULE, "layer", static=("w1", "w2")),
)


@pytest.fixture
def cuda_kernels() -> Iterator[types.ModuleType]:
    module = types.ModuleType(MODULE)
    module.gemm = gemm  # type: ignore[attr-defined]
    module.layer = layer  # type: ignore[attr-defined]
    sys.modules[MODULE] = module
    try:
        yield module
    finally:
        session_module.disarm()
        sys.modules.pop(MODULE, None)


def arm(tmp_path: Path, **settings: str):
    env = {"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_DIR": str(tmp_path / "captures")}
    env.update({f"MOEREPLAY_{key.upper()}": value for key, value in settings.items()})
    session = session_module.arm(env, targets=TARGETS)
    assert session is not None
    return session


def weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(64, 128, device="cuda", generator=generator)
    w1 = torch.randn(128, 256, device="cuda", generator=generator) / 10
    w2 = torch.randn(256, 128, device="cuda", generator=generator) / 10
    return x, w1, w2


def test_device_magnitude_slots_arrive_without_a_sync_and_propagate_nan() -> None:
    slots = MagnitudeSlots(16)
    tensors = [
        torch.tensor([1.0, -3.0], device="cuda", dtype=torch.bfloat16),
        torch.tensor([float("nan"), 2.0], device="cuda"),
        torch.tensor([float("inf")], device="cuda"),
    ]
    tickets = [slots.record(i, [tensor]) for i, tensor in enumerate(tensors)]
    assert all(ticket is not None for ticket in tickets)
    deadline = time.monotonic() + 10
    values: list[float | None] = [None] * 3
    while any(v is None for v in values) and time.monotonic() < deadline:
        values = [slots.read(i, ticket) for i, ticket in enumerate(tickets)]  # type: ignore[arg-type]
    assert values[0] == 3.0 and math.isnan(values[1]) and values[2] == math.inf  # type: ignore[arg-type]


def test_flight_on_cuda_writes_the_ring_ending_with_the_nan_call(tmp_path: Path, cuda_kernels) -> None:
    session = arm(tmp_path, trigger="flight", flight_calls="6")
    x, w1, w2 = weights()
    for step in range(30):
        value = x + step
        if step == 20:
            value[3, 5] = float("nan")
        cuda_kernels.layer(value, w1, w2)
    torch.cuda.synchronize()
    session.recorder.poll()
    assert session.recorder.pool.reused > 0
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        triggers = [r for r in records if r.context["flight"]["trigger"]]
        assert triggers and triggers[0].context["call"] == 61  # step 20's first gemm
        for record in records:
            if record.op == "layer":
                step = record.context["call"] // 3
                expected = (x + step).cpu()
                if step == 20:
                    expected[3, 5] = float("nan")
                actual = reader.load_args(record.index)["hidden"]
                torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def test_full_capture_on_cuda_reuses_pinned_staging_and_keeps_each_calls_bytes(
    tmp_path: Path, cuda_kernels
) -> None:
    session = arm(tmp_path)
    x, w1, w2 = weights()
    outputs = []
    for step in range(12):
        outputs.append(cuda_kernels.layer(x + step, w1, w2).cpu())
        session.flush()
    assert session.recorder.pool.reused > 0
    session.close()
    with CaptureReader(session.path) as reader:
        parents = [r for r in reader.calls() if r.op == "layer"]
        assert len(parents) == 12
        for step, record in enumerate(parents):
            assert torch.equal(reader.load_args(record.index)["hidden"], (x + step).cpu())
            assert torch.equal(reader.load_outputs(record.index)["return"], outputs[step])


@pytest.mark.parametrize("trigger", ["always", "flight"])
def test_nothing_is_copied_while_a_cuda_graph_is_captured(tmp_path: Path, cuda_kernels, trigger: str) -> None:
    session = arm(tmp_path, trigger=trigger)
    x, w1, w2 = weights()
    cuda_kernels.layer(x, w1, w2)  # eager: recorded (warms the pools)
    torch.cuda.synchronize()
    static_input = x.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cuda_kernels.layer(static_input, w1, w2)  # warm-up on the side stream, recorded
    torch.cuda.current_stream().wait_stream(stream)
    seen = session.recorder.counters.seen
    with torch.cuda.graph(graph):
        result = cuda_kernels.layer(static_input, w1, w2)
    assert session.recorder.counters.skipped_graph_capture == session.recorder.counters.seen - seen == 3
    static_input.copy_(x + 1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(result, layer(x + 1, w1, w2), atol=1e-4)
    assert session.recorder.active
