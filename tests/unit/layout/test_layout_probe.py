"""The w13 layout probe on synthesized layers: it finds the layout the activation consumed, from any call of the
layer, and holds it against the layout the weights are declared in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moereplay.cli import app
from moereplay.errors import ReplayError
from moereplay.format import CaptureReader
from moereplay.layout import LayerCalls, LayoutVerdict, find_layer, probe_layout
from moereplay.layout.probe import ActivationSpec, Hypothesis, _judge, relative_errors
from moereplay.reference.activation import GatedActivation, W13Layout
from moereplay.synth import synthesize
from moereplay.trim import trim_capture

L = W13Layout


def layer(tmp_path: Path, preset: str, *settings: str) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return synthesize(preset, tmp_path / f"{preset}.moe.zst", overrides=list(settings)).path


@pytest.mark.parametrize("layout", list(L))
def test_a_consistent_marlin_layer_is_found_in_every_layout(tmp_path: Path, layout: W13Layout) -> None:
    path = layer(tmp_path, "marlin-nvfp4-layer", f"w13_layout={layout.value}", "activation=silu", "tokens=4")
    report = probe_layout(path, 0)
    assert (
        report.verdict is LayoutVerdict.CONSISTENT and report.consumed is layout and report.declared is layout
    )
    assert [h.layout for h in report.hypotheses if h.matches] == [layout]
    assert report.expected is L.GATE_UP_CONCAT  # vLLM's silu_and_mul reads [gate; up]


def test_every_call_of_the_layer_names_the_same_layer(tmp_path: Path) -> None:
    path = layer(tmp_path, "marlin-nvfp4-layer")
    with CaptureReader(path) as reader:
        found = {find_layer(reader, call) for call in (0, 1, 2)}
    assert len(found) == 1
    (calls,) = found
    assert (calls.family, calls.parent, calls.gemm1, calls.gemm2) == ("marlin", 0, 1, 2)


def test_an_activation_reading_another_layout_is_a_mismatch(tmp_path: Path) -> None:
    path = layer(tmp_path, "marlin-nvfp4-layer", "activation_layout=gate_up")
    report = probe_layout(path, 2)
    assert report.verdict is LayoutVerdict.MISMATCH and report.failed
    assert report.consumed is L.GATE_UP_CONCAT and report.declared is L.GATE_UP_INTERLEAVED
    assert any("MISMATCH" in message for message in report.messages)
    assert any(
        "vLLM's kernel for swigluoai reads [g,u] interleaved" in message for message in report.messages
    )


def test_matmul_ogs_layers_fused_swiglu_reads_interleaved(tmp_path: Path) -> None:
    good = probe_layout(layer(tmp_path, "gpt-oss-20b-mxfp4-layer"), 1)
    assert good.calls.family == "ogs" and good.verdict is LayoutVerdict.CONSISTENT
    assert good.consumed is L.GATE_UP_INTERLEAVED and good.activation == "swigluoai"
    bad = probe_layout(layer(tmp_path / "b", "gpt-oss-20b-mxfp4-layer", "w13_layout=up_gate"), 0)
    assert bad.verdict is LayoutVerdict.MISMATCH and bad.consumed is L.GATE_UP_INTERLEAVED


def test_two_kernel_calls_without_parent_and_an_unknown_activation(tmp_path: Path) -> None:
    """Without the parent record the activation is unknown: every gated activation is tried, and the right
    (activation, layout) pair is the only one that reproduces the layer."""
    source = layer(tmp_path, "marlin-nvfp4-layer", "activation=silu", "w13_layout=ug_interleaved")
    pair = trim_capture(source, "1-2", tmp_path / "pair.moe.zst").path
    report = probe_layout(pair, 1)
    assert report.calls.parent is None and (report.calls.gemm1, report.calls.gemm2) == (0, 1)
    assert report.activation == "silu" and report.consumed is L.UP_GATE_INTERLEAVED
    assert report.declared is L.UP_GATE_INTERLEAVED  # gemm1's context declares it too
    assert len(report.hypotheses) == 20
    overridden = probe_layout(pair, 0, activation="silu")
    assert len(overridden.hypotheses) == 4 and overridden.consumed is L.UP_GATE_INTERLEAVED


def test_a_lone_kernel_call_is_not_a_layer(tmp_path: Path) -> None:
    path = synthesize(
        "fp8-marlin", tmp_path / "one.moe.zst", overrides=["hidden=256", "intermediate=128"]
    ).path
    with pytest.raises(ReplayError, match="no matching gemm2"):
        probe_layout(path, 0)
    with pytest.raises(ReplayError, match="no call 7"):
        probe_layout(path, 7)
    layer_path = layer(tmp_path, "marlin-nvfp4-layer")
    with pytest.raises(ReplayError, match="--activation"):
        probe_layout(layer_path, 0, activation="relu")


def test_verdicts_without_a_declaration_or_a_single_match() -> None:
    def hypothesis(layout: W13Layout, error: float) -> Hypothesis:
        return Hypothesis("silu", layout, error, error, error, error)

    calls = LayerCalls("marlin", 1, 2, None)
    spec = [ActivationSpec(GatedActivation.SILU)]
    one = _judge(
        "f", calls, spec, [hypothesis(h, 0.0 if h is L.GATE_UP_CONCAT else 1.0) for h in L], None, None
    )
    assert (
        one.verdict is LayoutVerdict.UNDECLARED
        and not one.failed
        and "must be in [gate;up]" in one.messages[1]
    )
    two = _judge(
        "f",
        calls,
        spec,
        [hypothesis(h, 0.0 if h.value.endswith("interleaved") else 1.0) for h in L],
        None,
        None,
    )
    assert two.verdict is LayoutVerdict.AMBIGUOUS and two.consumed is None
    none = _judge("f", calls, spec, [hypothesis(h, 1.0) for h in L], L.GATE_UP_CONCAT, None)
    assert none.verdict is LayoutVerdict.UNDETERMINED and "moereplay run" in none.messages[0]


def test_relative_errors() -> None:
    expected = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    assert relative_errors(expected, expected) == (0.0, 0.0)
    max_rel, rms_rel = relative_errors(expected + torch.tensor([[0.0, 0.0], [0.0, 0.4]]), expected)
    assert max_rel == pytest.approx(0.1) and rms_rel == pytest.approx(0.4 / expected.norm().item())
    assert relative_errors(torch.full((2, 2), float("nan")), expected) == (float("inf"), float("inf"))


def test_cli_layout(tmp_path: Path) -> None:
    runner = CliRunner()
    good = layer(tmp_path, "marlin-nvfp4-layer", "tokens=4")
    result = runner.invoke(app, ["layout", str(good), "--call", "1"])
    assert result.exit_code == 0, result.output
    assert "[g,u] interleaved" in result.output and "consistent" in result.output
    bad = layer(tmp_path / "b", "marlin-nvfp4-layer", "tokens=4", "activation_layout=up_gate")
    result = runner.invoke(app, ["layout", str(bad), "--call", "0", "--json"])
    assert result.exit_code == 1
    document = json.loads(result.stdout)
    assert document["verdict"] == "mismatch" and document["consumed"] == "up_gate"
    assert len(document["hypotheses"]) == 4
