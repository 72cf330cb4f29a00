"""The w13 layout probe on vLLM's Triton fused MoE (``fused_experts``: w1 ``[E, 2N, K]``, gate rows first, as
``silu_and_mul`` reads them), on layers the references synthesize on the CPU."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from moereplay.format import CaptureReader
from moereplay.layout import LayoutVerdict, find_layer, probe_layout
from moereplay.ops.fused_moe_triton_surface import is_first_gemm, pair_fits
from moereplay.reference.activation import W13Layout
from moereplay.synth import synthesize
from moereplay.trim import trim_capture

L = W13Layout
PRESET = "triton-bf16-layer"


def layer(tmp_path: Path, *settings: str) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return synthesize(PRESET, tmp_path / "layer.moe.zst", overrides=list(settings)).path


def test_vllms_convention_is_gate_then_up(tmp_path: Path) -> None:
    path = layer(tmp_path)
    with CaptureReader(path) as reader:
        found = {find_layer(reader, call) for call in (0, 1, 2)}
    assert len(found) == 1
    (calls,) = found
    assert (calls.family, calls.parent, calls.gemm1, calls.gemm2) == ("triton_fused_moe", 0, 1, 2)
    report = probe_layout(path, 2)
    assert report.verdict is LayoutVerdict.CONSISTENT and report.activation == "silu"
    assert report.consumed is L.GATE_UP_CONCAT and report.declared is L.GATE_UP_CONCAT
    assert report.expected is L.GATE_UP_CONCAT  # silu_and_mul: x[:, :N] is the gate
    assert [h.layout for h in report.hypotheses if h.matches] == [L.GATE_UP_CONCAT]
    assert all(h.step_rms_rel is not None and h.layer_rms_rel is not None for h in report.hypotheses)


@pytest.mark.parametrize("layout", list(L))
def test_a_consistent_layer_is_found_in_every_layout(tmp_path: Path, layout: W13Layout) -> None:
    report = probe_layout(layer(tmp_path, f"w13_layout={layout.value}", "tokens=4"), 1)
    assert report.verdict is LayoutVerdict.CONSISTENT and report.consumed is layout


def test_an_activation_reading_up_first_is_a_mismatch(tmp_path: Path) -> None:
    report = probe_layout(layer(tmp_path, "activation_layout=up_gate"), 0)
    assert report.verdict is LayoutVerdict.MISMATCH and report.failed
    assert report.consumed is L.UP_GATE_CONCAT and report.declared is L.GATE_UP_CONCAT
    assert any("vLLM's kernel for silu reads [gate;up]" in message for message in report.messages)


def test_swigluoai_reads_interleaved(tmp_path: Path) -> None:
    report = probe_layout(layer(tmp_path, "activation=swigluoai", "w13_layout=gu_interleaved"), 0)
    assert report.verdict is LayoutVerdict.CONSISTENT and report.expected is L.GATE_UP_INTERLEAVED


def test_two_launches_without_their_parent(tmp_path: Path) -> None:
    pair = trim_capture(layer(tmp_path), "1-2", tmp_path / "pair.moe.zst").path
    report = probe_layout(pair, 1)
    assert report.calls.parent is None and (report.calls.gemm1, report.calls.gemm2) == (0, 1)
    assert report.activation == "silu" and report.consumed is L.GATE_UP_CONCAT
    assert len(report.hypotheses) == 20


def test_launches_pair_by_top_k_routing_weights_and_widths() -> None:
    def shaped(*shape: int) -> SimpleNamespace:
        return SimpleNamespace(shape=shape)

    gemm1 = {"top_k": 2, "mul_routed_weight": False, "C": shaped(8, 2, 128), "A": shaped(8, 64)}
    gemm2 = {"top_k": 1, "mul_routed_weight": True, "C": shaped(8, 2, 64), "A": shaped(16, 64)}
    assert is_first_gemm(gemm1) and not is_first_gemm(gemm2)
    assert is_first_gemm({"top_k": 1, "mul_routed_weight": False})
    assert pair_fits(gemm1, gemm2) and not pair_fits(gemm1, {**gemm2, "A": shaped(16, 128)})
    assert pair_fits({}, {})
