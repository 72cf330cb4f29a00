"""A layer call wrapped only for the layer-scope flight recorder (``CaptureTarget.layer_flight_only``): gpt-oss's
``triton_kernel_moe_forward`` above ``triton_kernel_fused_experts``. Stand-ins with the same structure: ``forward``
computes the routing from router logits and calls the parent ``fused``, which calls the kernel ``gemm`` twice.
The flight recorder keeps ``forward`` (two dynamic tensors); every other capture records ``fused`` and ``gemm`` as
before; ``moereplay expand`` re-runs ``forward`` unwrapped and gets ``fused`` with its kernel calls."""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import gemm

from moereplay.capture import session as session_module
from moereplay.capture.patch_points import TARGETS as REAL_TARGETS
from moereplay.capture.patch_points import CaptureTarget
from moereplay.format import CaptureReader, CaptureWriter
from moereplay.ops.surface import parent_ops
from moereplay.replay.expand import ExpandVerdict, expand_capture

MODULE = "moereplay_test_forward"


def fused(
    output_tensor: torch.Tensor,
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Writes the output buffer it is given and returns a view of it, as ``triton_kernel_fused_experts`` does."""
    module = sys.modules[MODULE]
    first = module.gemm(hidden, None, w1, topk_weights, 1, True)
    module.gemm(torch.relu(first), output_tensor, w2, topk_weights, 1, True, scale=0.5)
    return output_tensor.view(output_tensor.shape)


def forward(
    hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, logits: torch.Tensor, topk: int
) -> torch.Tensor:
    """The routing from the logits (a per-row weight here), then the parent through the module global, into an
    output it allocates. No routing without two experts at least: it raises before calling the parent."""
    if logits.shape[-1] < 2:
        raise ValueError("routing needs two experts at least")
    weights = torch.softmax(logits, dim=-1).topk(topk, dim=-1).values.sum(dim=-1)
    return sys.modules[MODULE].fused(torch.empty_like(hidden), hidden, w1, w2, weights)


TARGETS = (
    CaptureTarget("gemm", "kernel", MODULE, "gemm", static=("weight",), outputs=("output",)),
    CaptureTarget("fused", "parent", MODULE, "fused", static=("w1", "w2"), outputs=("output_tensor",)),
    CaptureTarget(
        "forward",
        "parent",
        MODULE,
        "forward",
        static=("w1", "w2"),
        inputs_intact=True,
        layer_flight_only=True,
        in_place_of="fused",
    ),
)


@pytest.fixture
def module(stand_in_module: Callable[..., types.ModuleType]) -> types.ModuleType:
    return stand_in_module(MODULE, gemm=gemm, fused=fused, forward=forward)


@pytest.fixture
def arm_here(arm) -> Callable[..., session_module.Session]:
    """conftest's ``arm`` with this file's targets, writing into the directory given."""

    def _arm(directory: Path, **settings: str) -> session_module.Session:
        return arm(targets=TARGETS, directory=directory, **settings)

    return _arm


def serve(
    module: types.ModuleType, calls: int, bad: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``calls`` layer calls through ``forward``; hidden states of call ``bad`` hold a NaN. (inputs, output) each."""
    generator = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(8, 12, generator=generator), torch.randn(12, 8, generator=generator)
    made = []
    for call in range(calls):
        hidden = torch.randn(5, 8, generator=generator)
        logits = torch.randn(5, 6, generator=generator)
        if call == bad:
            hidden[2, 3] = math.nan
        made.append((hidden.clone(), module.forward(hidden, w1, w2, logits, 1).clone()))
    return made


def close(session: session_module.Session) -> None:
    assert session.flush()
    session_module.disarm()


def test_every_other_capture_leaves_it_unwrapped(module, arm_here, tmp_path: Path) -> None:
    for settings in ({}, {"trigger": "flight", "flight_scope": "kernel"}):
        session = arm_here(tmp_path / str(len(settings)), **settings)
        assert f"{MODULE}:forward" not in session.patcher.sites and f"{MODULE}:fused" in session.patcher.sites
        session_module.disarm()
    session = arm_here(tmp_path / "full")
    serve(module, 2)
    close(session)
    with CaptureReader(session.path) as reader:
        assert [(r.op, r.parent) for r in reader.calls()] == [
            ("fused", None), ("gemm", 0), ("gemm", 0), ("fused", None), ("gemm", 3), ("gemm", 3)
        ]  # fmt: skip


def test_the_layer_flight_recorder_keeps_it_with_its_own_two_tensors(
    module, arm_here, tmp_path: Path
) -> None:
    session = arm_here(tmp_path, trigger="flight", flight_calls="3")
    assert f"{MODULE}:forward" in session.patcher.sites
    made = serve(module, 6, bad=4)
    flight = session.recorder.flight
    assert flight is not None
    assert {call.n_inputs for call in flight._history} == {
        2
    }  # hidden states and logits: the routing is not kept
    close(session)
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        assert [r.op for r in records] == ["forward"] * 3 and all(r.parent is None for r in records)
        assert [r.context["flight"]["trigger"] for r in records] == [False, False, True]
        assert reader.footer["counters"]["recorder_seen"] == 6  # the parent and kernels inside passed through
        for record, (hidden, output) in zip(records, made[2:5], strict=True):
            args = reader.load_args(record.index)
            assert torch.equal(args["hidden"].view(torch.uint8), hidden.view(torch.uint8))
            assert torch.equal(
                reader.load_outputs(record.index)["return"].view(torch.uint8), output.view(torch.uint8)
            )


def test_ops_leaving_it_out_make_the_parent_below_the_layer_call(module, arm_here, tmp_path: Path) -> None:
    session = arm_here(tmp_path / "a", trigger="flight", flight_calls="2", ops="fused,gemm")
    assert f"{MODULE}:forward" not in session.patcher.sites
    serve(module, 3, bad=2)
    close(session)
    with CaptureReader(session.path) as reader:
        assert [r.op for r in reader.calls()] == ["fused", "fused"]
    # excluding the parent it stands in for leaves the layer unrecorded, as it did before the call above existed
    session = arm_here(tmp_path / "b", trigger="flight", flight_calls="2", ops_exclude="fused")
    assert f"{MODULE}:forward" not in session.patcher.sites
    serve(module, 3, bad=2)
    close(session)
    with CaptureReader(session.path) as reader:
        assert len(reader) == 0


def test_expand_reruns_it_unwrapped_as_the_parent_it_calls(module, arm_here, tmp_path: Path) -> None:
    session = arm_here(tmp_path / "captures", trigger="flight", flight_calls="3")
    serve(module, 6, bad=4)
    close(session)
    out = tmp_path / "expanded.moe.zst"
    report = expand_capture(session.path, out, backend="vllm", device="cpu", targets=TARGETS)
    assert [call.verdict for call in report.calls] == [ExpandVerdict.BIT_EXACT] * 3
    assert all(any("re-run unwrapped" in note for note in call.notes) for call in report.calls)
    with CaptureReader(out) as reader:
        records = list(reader.calls())
        assert [r.op for r in records] == ["fused", "gemm", "gemm"] * 3
        assert [call.kernel_calls for call in report.calls] == [(1, 2), (4, 5), (7, 8)]
        bad = reader.load_outputs(6)
        assert torch.isnan(next(iter(bad.values()))).any()  # the bad call's NaN, regenerated


def test_a_rerun_failing_before_its_layer_call_is_reported_beside_the_others(
    module, arm_here, tmp_path: Path
) -> None:
    """A recorded call whose re-run raises in its routing, before the parent it calls, leaves no top-level record:
    it is reported as raised, and the calls around it are still paired with their own re-runs."""
    session = arm_here(tmp_path / "captures", trigger="flight", flight_calls="3")
    serve(module, 6, bad=4)
    close(session)
    source = session.path
    damaged = tmp_path / "damaged.moe.zst"
    with CaptureReader(source) as reader, CaptureWriter(damaged) as writer:
        for record in reader.calls():
            args = reader.load_args(record.index)
            if record.index == 1:  # one expert only: the stand-in's routing raises
                args["logits"] = args["logits"][:, :1].contiguous()
            index = writer.begin_call(
                record.op, args, site=record.site, context=record.context, static={"w1", "w2"}
            )
            writer.complete_call(index, reader.load_outputs(record.index))
    report = expand_capture(damaged, tmp_path / "out.moe.zst", backend="vllm", device="cpu", targets=TARGETS)
    verdicts = [call.verdict for call in report.calls]
    assert verdicts == [ExpandVerdict.BIT_EXACT, ExpandVerdict.RAISED, ExpandVerdict.BIT_EXACT]
    raised = report.calls[1]
    assert raised.parent is None and raised.kernel_calls == () and "two experts" in (raised.error or "")
    assert [call.kernel_calls for call in report.calls] == [(1, 2), (), (4, 5)]
    assert report.to_json()["calls"][1]["parent"] is None


def test_gpt_oss_moe_forward_is_declared_for_the_layer_flight_recorder_only() -> None:
    (target,) = [t for t in REAL_TARGETS if t.op == "triton_kernel_moe_forward" and "experts." in t.module]
    assert target.layer_flight_only and target.role == "parent" and target.inputs_intact
    assert {"w1", "w2", "quant_config", "expert_map"} == set(target.static)
    assert target.process_state_via == "matmul_ogs" and target.in_place_of == "triton_kernel_fused_experts"
    assert "triton_kernel_moe_forward" in parent_ops()
