"""The w13 layout probe: for a captured fused MoE layer, which gate/up layout the backend's activation consumes,
and whether the weights are in it (see :mod:`moereplay.layout.probe`).

    from moereplay.layout import probe_layout
    report = probe_layout("layer.moe.zst", call=0)
    report.consumed, report.declared, report.verdict, report.messages

Modules: ``calls`` (finding gemm1, gemm2 and the parent of one layer), ``probe`` (the hypotheses and the verdict).
"""

from __future__ import annotations

from moereplay.layout.calls import LayerCalls, find_layer
from moereplay.layout.probe import Hypothesis, LayoutReport, LayoutVerdict, probe_layout

__all__ = ["Hypothesis", "LayerCalls", "LayoutReport", "LayoutVerdict", "find_layer", "probe_layout"]
