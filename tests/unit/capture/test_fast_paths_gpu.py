"""The capture hot path on CUDA: device snapshots without per-snapshot events (flight), pinned host snapshots
(staged through one device gather, or span by span past the staging limit), and the flight recorder's checks
launched by the writer thread's poll on a side stream over the ring copies — every recorded call still
bit-exact."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moereplay.capture import session as session_module
from moereplay.capture import snapshot as snapshot_module
from moereplay.capture.patch_points import CaptureTarget
from moereplay.capture.snapshot import TensorCopy, snapshot
from moereplay.format import CaptureReader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MODULE = "moereplay_gpu_fast_path_kernels"


def gemm(input, output, weight, topk_weights, top_k, mul_topk_weights, scale=1.0):
    torch.matmul(input, weight, out=output)
    if mul_topk_weights:
        output.mul_(topk_weights.reshape(-1, 1)[: output.shape[0]])
    output.mul_(scale)
    return output


def fused(hidden, w1, w2, topk_weights):
    module = sys.modules[MODULE]
    cache = torch.empty(hidden.shape[0], w1.shape[1] + w2.shape[1], device=hidden.device)
    first = module.gemm(hidden, cache[:, : w1.shape[1]], w1, topk_weights, 1, False)
    return module.gemm(first, cache[:, w1.shape[1] :], w2, topk_weights, 1, True, scale=0.5)


TARGETS = (
    CaptureTarget("gemm", "kernel", MODULE, "gemm", static=("weight",), outputs=("output",)),
    CaptureTarget("fused", "parent", MODULE, "fused", static=("w1", "w2")),
)


@pytest.fixture
def kernels(stand_in_module: Callable[..., types.ModuleType]) -> types.ModuleType:
    return stand_in_module(MODULE, gemm=gemm, fused=fused)


def _values() -> dict[str, object]:
    cache = torch.arange(4096, dtype=torch.float32, device="cuda")
    return {
        "a": cache[5:17],
        "b": cache[600:700].view(torch.int32),
        "c": torch.arange(7, dtype=torch.int16, device="cuda"),
        "d": torch.randn(3, 4, device="cuda").t(),
        "e": torch.empty(0, device="cuda"),
        "n": 4,
    }


@pytest.mark.parametrize("to_host", [False, True])
@pytest.mark.parametrize("record_event", [False, True])
def test_cuda_snapshots_are_exact(to_host: bool, record_event: bool) -> None:
    values = _values()
    taken = snapshot(values, to_host=to_host, record_event=record_event)
    assert (taken.event is not None) == record_event
    torch.cuda.synchronize()
    for name, original in values.items():
        copy = taken.tree[name]
        if not isinstance(original, torch.Tensor):
            assert copy == original
            continue
        assert isinstance(copy, TensorCopy)
        assert copy.data.device.type == ("cpu" if to_host else "cuda")
        if to_host:
            assert copy.data.is_pinned()
        assert copy.storage[0] == "cuda:0" and copy.base % 256 == 0
        view = copy.view()
        assert view.stride() == original.stride() or original.numel() == 0
        assert torch.equal(view, original.cpu())
    assert taken.tree["a"].storage == taken.tree["b"].storage


def test_large_host_snapshots_copy_span_by_span(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshot_module, "_STAGE_LIMIT", 1024)
    values = _values()
    taken = snapshot(values, to_host=True)
    taken.wait()
    for name in ("a", "b", "c", "d"):
        assert taken.tree[name].data.is_pinned()
        assert torch.equal(taken.tree[name].view(), values[name].cpu())  # type: ignore[union-attr]


def test_the_current_stream_is_respected() -> None:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        source = torch.full((1 << 20,), 7.0, device="cuda")
        taken = snapshot({"x": source}, to_host=True)
        assert snapshot_module.current_stream(0) == side
    taken.wait()
    assert torch.equal(taken.tree["x"].view(), torch.full((1 << 20,), 7.0))


def _run(kernels: types.ModuleType, steps: int, bad_step: int | None):
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(5, 8, device="cuda", generator=generator)
    w1 = torch.randn(8, 6, device="cuda", generator=generator)
    w2 = torch.randn(6, 8, device="cuda", generator=generator)
    weights = torch.rand(5, device="cuda", generator=generator)
    inputs = []
    for step in range(steps):
        value = x + step
        if step == bad_step:
            value[1, 2] = float("nan")
        inputs.append(value.clone())
        kernels.fused(value, w1, w2, weights)
    return inputs


def _check_all(session: session_module.Session) -> None:
    """What the writer thread's polls do, done here to the end: launch the checks of every completed call
    (side stream), then read them (a poll on the serving thread would only read)."""
    for _ in range(2):
        torch.cuda.synchronize()
        session.recorder.poll()


def _arm(tmp_path: Path, **settings: str) -> session_module.Session:
    env = {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_DIR": str(tmp_path / "captures"),
        "MOEREPLAY_TRIGGER": "flight",
        "MOEREPLAY_FLIGHT_SCOPE": "kernel",  # these tests check the exact per-kernel ring; the layer scope's: below
    }
    env.update({f"MOEREPLAY_{key.upper()}": value for key, value in settings.items()})
    session = session_module.arm(env, targets=TARGETS)
    assert session is not None
    return session


def test_flight_without_a_bad_output_writes_nothing_and_checks_every_call(kernels, tmp_path: Path) -> None:
    session = _arm(tmp_path, flight_calls="6")
    _run(kernels, 40, None)
    session.flush()
    _check_all(session)
    session.close()
    with CaptureReader(session.path) as reader:
        assert len(reader) == 0
        counters = reader.footer["counters"]
        assert counters["flight_triggers"] == 0 and counters["flight_checked"] == 120
        assert counters["flight_unchecked"] == 0 and counters["flight_lost"] == 0


def test_flight_nan_writes_exact_calls_ending_with_the_offending_one(kernels, tmp_path: Path) -> None:
    session = _arm(tmp_path, flight_calls="16")
    inputs = _run(kernels, 12, bad_step=7)
    _check_all(session)
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        counters = reader.footer["counters"]
        calls = [r.context["call"] for r in records]
        assert 22 in calls and counters["flight_lost"] == 0  # gemm 22 (step 7's first gemm) went bad first
        first = records[calls.index(22)]
        assert first.context["flight"]["trigger"] and first.op == "gemm"
        assert torch.isnan(reader.load_outputs(first.index)["output"]).any()
        assert calls[: calls.index(22) + 1] == list(range(calls[0], 23))  # the ring up to it, in order
        for record in records:
            assert record.status == "completed"
            if record.op == "fused":
                step = record.context["call"] // 3
                recorded = reader.load_args(record.index)["hidden"]
                assert recorded.dtype == inputs[step].dtype
                # bit-exact, NaN included (torch 2.11's torch.equal has no equal_nan)
                assert torch.equal(recorded.view(torch.uint8), inputs[step].cpu().view(torch.uint8))


def test_a_bad_output_just_before_close_still_triggers(kernels, tmp_path: Path) -> None:
    """No poll after the last calls: close itself launches and reads the remaining checks (bounded wait)."""
    session = _arm(tmp_path, flight_calls="16")
    _run(kernels, 6, bad_step=5)  # the last step goes bad; nobody polls before close
    session.close()
    with CaptureReader(session.path) as reader:
        counters = reader.footer["counters"]
        assert counters["flight_triggers"] >= 1 and counters["flight_lost"] == 0
        triggers = [r for r in reader.calls() if r.context["flight"]["trigger"]]
        assert triggers and triggers[0].context["call"] == 3 * 5 + 1  # step 5's first gemm


def test_the_ring_wraps_around_without_losing_checks(kernels, tmp_path: Path) -> None:
    session = _arm(tmp_path, flight_calls="16")
    steps = 1500  # the ring wraps hundreds of times while the writer thread checks in the background
    _run(kernels, steps, bad_step=steps - 2)
    _check_all(session)
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        counters = reader.footer["counters"]
        assert counters["flight_triggers"] >= 1 and counters["flight_lost"] == 0
        assert counters["flight_unchecked"] == 0 and counters["flight_checked"] >= 3 * (steps - 2)
        triggers = [r for r in reader.calls() if r.context["flight"]["trigger"]]
        assert triggers[0].context["call"] == 3 * (steps - 2) + 1
