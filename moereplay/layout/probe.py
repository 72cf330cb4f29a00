"""The w13 layout probe: which gate/up layout a captured MoE layer's activation consumed, and whether that is the
layout its weights are in.

For each hypothesis — the layer's gated activation reading the fused w13 output as ``[g,u]`` interleaved, ``[u,g]``
interleaved, ``[gate;up]`` or ``[up;gate]`` (:class:`~moereplay.reference.activation.W13Layout`) — two pieces of
evidence are weighed, both against what the backend actually produced:

1. **the activation step**: the activation applied, under the hypothesis, to what gemm1 produced, against what gemm2
   consumed. Marlin: gemm1's captured output (the intermediate it wrote) → gemm2's captured input (what vLLM's
   activation kernel wrote between them). ``matmul_ogs``: the activation is fused into gemm1, so gemm1's fp32
   reference *without* the activation, activated under the hypothesis, against gemm1's captured output.
2. **the layer**: the whole layer recomputed by the references under the hypothesis (gemm1 reference → activation →
   gemm2 reference on that input; Marlin with a parent: the top-k sum) against the captured final output (the
   parent's output, else gemm2's).

Exactly one layout should reproduce both; that is the layout the backend's activation **consumes**. Which layout the
**weights are in** is not in the kernel data (any column order is a valid w13); a capture may declare it
(``context["w13_layout"]`` of the parent or gemm1 — ``moereplay synth`` and ``tools/gpu/make_captures.py`` record it).
Declared and consumed must agree; when nothing is declared, the probe says which layout the weights must be in for
the layer to be right, and what vLLM's kernel for the layer's activation reads (``GatedActivation.default_layout``).
The activation is the parent's ``activation`` argument (Marlin), the fused ``swiglu`` of gemm1 (``matmul_ogs``), or —
when unknown — every gated activation moereplay has a reference for is tried.

Each family gathers its evidence itself: the layer probe module it declares (``FamilySurface.layer_probe``, e.g.
:mod:`moereplay.ops.marlin_layer_probe`) reads its calls' activation, weighs the hypotheses and says what vLLM's
kernel reads; the shared types live in :mod:`moereplay.ops.layer_probe`. This module pairs the calls, judges and
reports.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moereplay.errors import ReplayError
from moereplay.layout.calls import LayerCalls, find_layer
from moereplay.ops.layer_probe import (
    MATCH_RMS,
    ActivationSpec,
    Hypothesis,
    LayerProbe,
    activation_from_parent,
    relative_errors,
)
from moereplay.ops.surface import family_named
from moereplay.reference.activation import GatedActivation, W13Layout

__all__ = [
    "LAYOUT_NAMES",
    "MATCH_RMS",
    "TRIED_WHEN_UNKNOWN",
    "ActivationSpec",
    "Hypothesis",
    "LayoutReport",
    "LayoutVerdict",
    "probe_layout",
    "relative_errors",
]

LAYOUT_NAMES: dict[W13Layout, str] = {
    W13Layout.GATE_UP_INTERLEAVED: "[g,u] interleaved",
    W13Layout.UP_GATE_INTERLEAVED: "[u,g] interleaved",
    W13Layout.GATE_UP_CONCAT: "[gate;up]",
    W13Layout.UP_GATE_CONCAT: "[up;gate]",
}
TRIED_WHEN_UNKNOWN = (
    GatedActivation.SWIGLUOAI,
    GatedActivation.SILU,
    GatedActivation.GELU,
    GatedActivation.GELU_TANH,
    GatedActivation.SWIGLUSTEP,
)


class LayoutVerdict(enum.Enum):
    CONSISTENT = "consistent"  # declared weight layout == the layout the activation consumed
    MISMATCH = "mismatch"  # they differ: gate and up are misread
    UNDECLARED = "undeclared"  # one layout consumed; the capture does not say which the weights are in
    AMBIGUOUS = "ambiguous"  # several layouts reproduce the data
    UNDETERMINED = "undetermined"  # none does (the GEMMs themselves may be wrong: see moereplay run)


@dataclass(frozen=True)
class LayoutReport:
    """What the probe found for one layer (see the module docstring)."""

    path: str
    calls: LayerCalls
    activation: str
    hypotheses: tuple[Hypothesis, ...]
    consumed: W13Layout | None
    declared: W13Layout | None
    expected: W13Layout | None
    verdict: LayoutVerdict
    messages: tuple[str, ...]

    @property
    def failed(self) -> bool:
        return self.verdict not in (LayoutVerdict.CONSISTENT, LayoutVerdict.UNDECLARED)

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.path,
            "family": self.calls.family,
            "calls": {"parent": self.calls.parent, "gemm1": self.calls.gemm1, "gemm2": self.calls.gemm2},
            "activation": self.activation,
            "consumed": None if self.consumed is None else self.consumed.value,
            "declared": None if self.declared is None else self.declared.value,
            "expected_by_vllm_kernel": None if self.expected is None else self.expected.value,
            "verdict": self.verdict.value,
            "messages": list(self.messages),
            "hypotheses": [h.to_json() for h in self.hypotheses],
        }


# ---------------------------------------------------------------------------------------------------------------
# evidence
# ---------------------------------------------------------------------------------------------------------------


def _declared(*contexts: Mapping[Any, Any]) -> W13Layout | None:
    for context in contexts:
        value = context.get("w13_layout")
        if isinstance(value, str):
            try:
                return W13Layout(value)
            except ValueError:
                continue
    return None


def probe_layout(
    path: str | Path, call: int, *, device: str | torch.device = "cpu", activation: str | None = None
) -> LayoutReport:
    """Probe the layer of call ``call`` of a capture (see the module docstring). ``activation``: a
    :class:`GatedActivation` value overriding what the capture says (``swigluoai``, ``silu`` …)."""
    from moereplay.format import CaptureReader
    from moereplay.replay.source import load_call
    from moereplay.synth.recipe import register

    register()
    path = Path(path)
    target = torch.device(device)
    with CaptureReader(path) as reader:
        calls = find_layer(reader, call)
        parent_record = None
        parent_args: dict[str, Any] = {}
        parent_outputs: dict[str, Any] | None = None
        if calls.parent is not None:
            parent_record = reader.call(calls.parent)
            parent_args = reader.load_args(calls.parent, device=target)
            if parent_record.status == "completed":
                parent_outputs = reader.load_outputs(calls.parent, device=target)
        first_context = reader.call(calls.gemm1).context
    first = load_call(path, calls.gemm1, target)
    second = load_call(path, calls.gemm2, target)
    if first.captured_output is None or second.captured_output is None:
        raise ReplayError(
            f"{path}: the layer's GEMMs must both have completed (recorded outputs) to be probed"
        )

    probe = _layer_probe(calls.family)
    if activation is not None:
        try:
            candidates = [ActivationSpec(GatedActivation(activation))]
        except ValueError as error:
            known = ", ".join(a.value for a in GatedActivation)
            raise ReplayError(f"--activation {activation!r}: expected one of {known}") from error
    else:
        found = probe.activation(first.args, parent_args)
        if found is None and parent_args:
            found = activation_from_parent(parent_args)
        candidates = [found] if found is not None else [ActivationSpec(a) for a in TRIED_WHEN_UNKNOWN]

    hypotheses = probe.hypotheses(first, second, parent_outputs, candidates)
    declared = _declared(parent_record.context if parent_record is not None else {}, first_context)
    expected = probe.expected_layout(candidates[0]) if len(candidates) == 1 else None
    return _judge(str(path), calls, candidates, hypotheses, declared, expected)


def _layer_probe(name: str) -> LayerProbe:
    """The layer probe module the family ``name`` declares (``FamilySurface.layer_probe``)."""
    family = family_named(name)
    if family is None or not family.layer_probe:
        raise ReplayError(f"the {name} family declares no layer probe: its layers cannot be probed")
    probe: LayerProbe = importlib.import_module(family.layer_probe)
    return probe


def _name(layout: W13Layout | None) -> str:
    return "unknown" if layout is None else LAYOUT_NAMES[layout]


def _judge(
    path: str,
    calls: LayerCalls,
    candidates: list[ActivationSpec],
    hypotheses: list[Hypothesis],
    declared: W13Layout | None,
    expected: W13Layout | None,
) -> LayoutReport:
    matching = [h for h in hypotheses if h.matches]
    activation = (
        candidates[0].label
        if len(candidates) == 1
        else "unknown (tried " + ", ".join(c.label for c in candidates) + ")"
    )
    messages: list[str] = []
    consumed: W13Layout | None = None
    if not matching:
        verdict = LayoutVerdict.UNDETERMINED
        best = min(hypotheses, key=lambda h: (h.step_rms_rel or 0.0) + (h.layer_rms_rel or 0.0))
        messages.append(
            f"no layout reproduces the captured layer (closest: {best.activation} reading {_name(best.layout)}, "
            f"activation step rms rel {best.step_rms_rel:.2e}, layer rms rel {best.layer_rms_rel:.2e}); the GEMMs "
            "themselves may be wrong — replay them with `moereplay run`"
        )
    elif len({h.layout for h in matching}) > 1:
        verdict = LayoutVerdict.AMBIGUOUS
        messages.append(
            "several layouts reproduce the captured layer: "
            + ", ".join(f"{h.activation} reading {_name(h.layout)}" for h in matching)
            + " (gate and up halves too alike to tell apart)"
        )
    else:
        consumed = matching[0].layout
        if len(candidates) > 1:
            activation = matching[0].activation
        messages.append(
            f"the backend's {activation} consumed the w13 output as {_name(consumed)} (activation step rms rel "
            f"{matching[0].step_rms_rel:.1e}, layer rms rel {matching[0].layer_rms_rel:.1e}; every other layout ≥ "
            f"{min((h.layer_rms_rel or 0.0) for h in hypotheses if h.layout is not consumed):.2f})"
        )
        if declared is None:
            verdict = LayoutVerdict.UNDECLARED
            messages.append(
                f"the capture does not declare the weights' layout: for this layer to be right they must be in "
                f"{_name(consumed)}"
            )
        elif declared is consumed:
            verdict = LayoutVerdict.CONSISTENT
            messages.append(f"the weights are in {_name(declared)} (declared by the capture): consistent")
        else:
            verdict = LayoutVerdict.MISMATCH
            messages.append(
                f"MISMATCH: the weights are in {_name(declared)} (declared by the capture) but the activation reads "
                f"{_name(consumed)} — it takes the wrong columns as gate and up, so the layer output is wrong"
            )
        if expected is not None and expected is not consumed:
            messages.append(
                f"note: vLLM's kernel for {activation} reads {_name(expected)}; this backend's activation read "
                f"{_name(consumed)}"
            )
    return LayoutReport(
        path, calls, activation, tuple(hypotheses), consumed, declared, expected, verdict, tuple(messages)
    )
