"""Capture on: real CPU computations wrapped, recorded, read back with CaptureReader, replayed bit-exactly."""

from __future__ import annotations

import logging
import types

import pytest
import torch
from conftest import MODULE, TARGETS, gemm

from moereplay.capture.patching import ORIGINAL
from moereplay.format import CaptureReader


def test_parent_and_kernel_calls_round_trip(arm, kernels: types.ModuleType, inputs) -> None:
    session = arm()
    x, w1, w2, weights = inputs()
    expected = [kernels.fused(x + step, w1, w2, weights) for step in range(3)]
    assert session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        assert [r.op for r in records] == ["fused", "gemm", "gemm"] * 3
        assert all(r.status == "completed" for r in records)
        for parent in range(0, 9, 3):
            assert records[parent].parent is None
            assert records[parent + 1].parent == parent and records[parent + 2].parent == parent
        # every kernel call replays bit-exactly from what was recorded
        for record in records:
            if record.op != "gemm":
                continue
            args = reader.load_args(record.index)
            if args["output"] is not None:
                args["output"] = args["output"].clone()
            assert torch.equal(
                gemm(**args),
                reader.load_outputs(record.index)["output"]
                if "output" in record.outputs
                else reader.load_outputs(record.index)["return"],
            )
        # the parent's output is the layer's output
        for step, parent in enumerate(range(0, 9, 3)):
            assert torch.equal(reader.load_outputs(parent)["return"], expected[step])
        # weights are stored once per file: the w1/w2 blobs are shared by every call
        stats = reader.stats()
        assert stats.dedup_ratio > 1.5
        assert reader.footer is not None and reader.footer["counters"]["recorded"] == 9


def test_inputs_are_copied_before_the_call_mutates_them(arm, kernels: types.ModuleType, inputs) -> None:
    session = arm()
    x, w1, _w2, weights = inputs()
    buffer = torch.full((x.shape[0], w1.shape[1]), 7.0)
    kernels.gemm(x, buffer, w1, weights, 1, False)
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        assert torch.equal(reader.load_args(0)["output"], torch.full_like(buffer, 7.0))
        assert torch.equal(reader.load_outputs(0)["output"], x @ w1)
        # written in place: the recorded output aliases the recorded input buffer
        assert reader.call(0).aliases() == {"output": ("output",)}


def test_exceptions_propagate_and_are_recorded(arm, kernels: types.ModuleType) -> None:
    session = arm()
    with pytest.raises(RuntimeError):
        kernels.gemm(torch.ones(2, 3), None, torch.ones(4, 5), torch.ones(2), 1, False)
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        (record,) = list(reader.calls())
        assert record.status == "failed" and "RuntimeError" in (record.error or "")


@pytest.mark.parametrize(
    ("settings", "expected_ops"),
    [
        ({"ops_exclude": "fused"}, ["gemm"] * 6),
        ({"ops": "fused"}, ["fused"] * 3),
        ({"max_calls": "4"}, ["fused", "gemm", "gemm", "fused"]),
        ({"per_shape": "1"}, ["fused", "gemm", "gemm"]),
        ({"sample": "1/3"}, ["gemm", "gemm", "gemm"]),
    ],
)
def test_selection(
    arm, kernels: types.ModuleType, inputs, settings: dict[str, str], expected_ops: list[str]
) -> None:
    session = arm(**settings)
    x, w1, w2, weights = inputs()
    for step in range(3):
        kernels.fused(x * step, w1, w2, weights)
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        assert [r.op for r in reader.calls()] == expected_ops


def test_internal_error_disables_capture_and_the_function_keeps_working(
    arm, kernels: types.ModuleType, inputs, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    session = arm()
    x, w1, w2, weights = inputs()

    def broken(*args, **kwargs):
        raise ValueError("simulated bug in the recorder")

    monkeypatch.setattr("moereplay.capture.recorder.snapshot", broken)
    with caplog.at_level(logging.ERROR, logger="moereplay.capture"):
        result = kernels.fused(x, w1, w2, weights)
        again = kernels.fused(x, w1, w2, weights)
    reference = TARGETS and getattr(kernels.fused, ORIGINAL)(x, w1, w2, weights)
    assert torch.equal(result, reference) and torch.equal(again, reference)
    assert not session.recorder.active
    messages = [r.getMessage() for r in caplog.records if "capture disabled" in r.getMessage()]
    assert len(messages) == 1 and "simulated bug in the recorder" in messages[0]


def test_graph_capture_guard_records_nothing_and_warns_once(
    arm, kernels: types.ModuleType, inputs, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    session = arm()
    session.recorder._cuda = True  # pretend a GPU: the guard asks the stream whether it is capturing a graph
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    x, w1, w2, weights = inputs()
    with caplog.at_level(logging.WARNING, logger="moereplay.capture"):
        results = [kernels.fused(x, w1, w2, weights) for _ in range(2)]
    assert all(torch.equal(r, results[0]) for r in results)
    warnings = [r for r in caplog.records if "--enforce-eager" in r.getMessage()]
    assert len(warnings) == 1
    assert session.recorder.counters.skipped_graph_capture == 6
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        assert len(reader) == 0


def test_disarm_restores_the_original_objects(arm, kernels: types.ModuleType) -> None:
    gemm_before, fused_before = kernels.gemm, kernels.fused
    arm()
    assert kernels.gemm is not gemm_before
    from moereplay.capture import session as session_module

    session_module.disarm()
    assert kernels.gemm is gemm_before and kernels.fused is fused_before
    assert MODULE in __import__("sys").modules


def test_default_sink_compresses_as_the_settings_say(
    arm, kernels: types.ModuleType, inputs, monkeypatch: pytest.MonkeyPatch
) -> None:
    import moereplay.format as format_module

    made: list[dict] = []

    class Recording(format_module.CaptureWriter):
        def __init__(self, *args, **kwargs) -> None:
            made.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(format_module, "CaptureWriter", Recording)
    session = arm(compression_level="5", compression_threads="2", writer_threads="3")
    assert made == [{"compression_level": 5, "compression_threads": 2, "workers": 3}]
    x, w1, w2, weights = inputs()
    kernels.fused(x, w1, w2, weights)
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        counters = reader.footer["counters"]
        # fused: x in, return out; gemm 1: x, cache (before and after); gemm 2: first, weights in, return out
        floats = 4 * (5 * 8 + 5 * 8 + 5 * 8 + 2 * 5 * 6 + 5 * 6 + 5 * 8)
        assert counters["copied_bytes"] >= floats
        assert "zstd=5 zstd_threads=2 writer_threads=3" in reader.header["capture_settings"]
