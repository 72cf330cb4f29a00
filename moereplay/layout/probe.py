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
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moereplay.errors import ReplayError
from moereplay.layout.calls import LayerCalls, find_layer
from moereplay.reference.activation import GatedActivation, W13Layout, apply_gated_activation

MATCH_RMS = 0.02
"""RMS relative error (‖a − e‖ / ‖e‖ over the compared rows) under which a hypothesis reproduces the captured data:
well above bf16 rounding of an fp32 pipeline (~3e-3), far below what a wrong layout gives (≳ 0.5)."""

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
class ActivationSpec:
    """The gated activation of a layer with its constants (``None``: vLLM's defaults)."""

    activation: GatedActivation
    alpha: float | None = None
    limit: float | None = None
    beta: float | None = None

    def apply(self, values: torch.Tensor, layout: W13Layout) -> torch.Tensor:
        return apply_gated_activation(
            values, self.activation, layout, alpha=self.alpha, limit=self.limit, beta=self.beta
        )

    @property
    def label(self) -> str:
        return self.activation.value


@dataclass(frozen=True)
class Hypothesis:
    """One (activation, layout) hypothesis and its errors (``None``: that evidence was not available)."""

    activation: str
    layout: W13Layout
    step_max_rel: float | None
    step_rms_rel: float | None
    layer_max_rel: float | None
    layer_rms_rel: float | None

    @property
    def step_match(self) -> bool:
        return self.step_rms_rel is not None and self.step_rms_rel <= MATCH_RMS

    @property
    def layer_match(self) -> bool:
        return self.layer_rms_rel is not None and self.layer_rms_rel <= MATCH_RMS

    @property
    def matches(self) -> bool:
        """Reproduces every piece of evidence there is."""
        evidence = [e for e in (self.step_rms_rel, self.layer_rms_rel) if e is not None]
        return bool(evidence) and all(e <= MATCH_RMS for e in evidence)

    def to_json(self) -> dict[str, Any]:
        return {
            "activation": self.activation,
            "layout": self.layout.value,
            "step_max_rel": self.step_max_rel,
            "step_rms_rel": self.step_rms_rel,
            "layer_max_rel": self.layer_max_rel,
            "layer_rms_rel": self.layer_rms_rel,
            "matches": self.matches,
        }


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


def relative_errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(max |a − e| / max |e|, ‖a − e‖ / ‖e‖) in float64; NaN anywhere counts as an infinite error."""
    a, e = actual.double(), expected.double().to(actual.device)
    if a.shape != e.shape:
        raise ReplayError(f"cannot compare shapes {tuple(a.shape)} and {tuple(e.shape)}")
    if bool(torch.isnan(a).any()) or bool(torch.isnan(e).any()):
        return float("inf"), float("inf")
    difference = a - e
    scale = float(e.abs().max()) if e.numel() else 0.0
    norm = float(e.norm())
    tiny = 1e-30
    return float(difference.abs().max()) / max(scale, tiny), float(difference.norm()) / max(norm, tiny)


def _enum_value(value: Any) -> str | None:
    if isinstance(value, enum.Enum):
        return str(value.value)
    inner = getattr(value, "value", None)
    if isinstance(inner, str):
        return inner
    return value if isinstance(value, str) else None


def _activation_from_parent(parent_args: Mapping[str, Any]) -> ActivationSpec | None:
    name = _enum_value(parent_args.get("activation"))
    try:
        activation = GatedActivation(name) if name is not None else None
    except ValueError:
        return None
    if activation is None:
        return None
    limit = parent_args.get("clamp_limit", parent_args.get("swiglu_limit"))
    alpha = parent_args.get("gemm1_alpha", parent_args.get("swiglu_alpha"))
    beta = parent_args.get("gemm1_beta")
    if activation is GatedActivation.SWIGLUOAI:
        return ActivationSpec(activation, alpha if isinstance(alpha, float) and alpha != 1.0 else None, None)
    return ActivationSpec(
        activation,
        float(alpha) if isinstance(alpha, (int, float)) and activation.value.startswith("swiglu") else None,
        float(limit) if isinstance(limit, (int, float)) else None,
        float(beta) if isinstance(beta, (int, float)) and activation.value.startswith("swiglu") else None,
    )


def _activation_from_ogs(args: Mapping[str, Any]) -> ActivationSpec | None:
    spec = args.get("fused_activation")
    specs = getattr(spec, "specs", None)
    if specs is None or getattr(specs, "name", None) != "swiglu":
        return None
    fn_args = tuple(getattr(spec, "fn_args", ()))
    alpha = float(fn_args[0]) if len(fn_args) > 0 and fn_args[0] is not None else None
    limit = float(fn_args[1]) if len(fn_args) > 1 and fn_args[1] is not None else None
    return ActivationSpec(GatedActivation.SWIGLUOAI, alpha, limit)


def _declared(*contexts: Mapping[Any, Any]) -> W13Layout | None:
    for context in contexts:
        value = context.get("w13_layout")
        if isinstance(value, str):
            try:
                return W13Layout(value)
            except ValueError:
                continue
    return None


def _final_output(outputs: Mapping[str, Any] | None) -> torch.Tensor | None:
    if not outputs:
        return None
    for key in ("return", "output", "output_tensor"):
        value = outputs.get(key)
        if isinstance(value, torch.Tensor):
            return value
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

    if activation is not None:
        try:
            candidates = [ActivationSpec(GatedActivation(activation))]
        except ValueError as error:
            known = ", ".join(a.value for a in GatedActivation)
            raise ReplayError(f"--activation {activation!r}: expected one of {known}") from error
    else:
        found = (
            _activation_from_parent(parent_args)
            if calls.family == "marlin"
            else _activation_from_ogs(first.args)
        )
        if found is None and parent_args:
            found = _activation_from_parent(parent_args)
        candidates = [found] if found is not None else [ActivationSpec(a) for a in TRIED_WHEN_UNKNOWN]

    hypotheses = (
        _marlin(first, second, parent_outputs, candidates)
        if calls.family == "marlin"
        else _ogs(first, second, candidates)
    )
    declared = _declared(parent_record.context if parent_record is not None else {}, first_context)
    known_activation = candidates[0].activation if len(candidates) == 1 else None
    expected = known_activation.default_layout if known_activation is not None else None
    if len(candidates) == 1 and calls.family == "ogs":
        expected = W13Layout.GATE_UP_INTERLEAVED  # triton_kernels' swiglu reads x[..., ::2] as the gate
    return _judge(str(path), calls, candidates, hypotheses, declared, expected)


def _rows(mask: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.reshape(mask.shape[0], -1)[mask.to(t.device)] for t in tensors]


def _marlin(
    first: Any, second: Any, parent_outputs: Mapping[str, Any] | None, candidates: list[ActivationSpec]
) -> list[Hypothesis]:
    op = first.op
    reference1 = op.reference(first.args)
    written1 = reference1.written
    captured1 = first.captured_output.float()
    consumed2 = second.args["input"]
    final = _final_output(parent_outputs)
    size_m, top_k = int(first.args["size_m"]), int(first.args["top_k"])
    hypotheses = []
    for spec in candidates:
        for layout in W13Layout:
            step = spec.apply(captured1, layout).to(consumed2.dtype)
            step_errors = relative_errors(*_rows(written1, step, consumed2))
            rows = spec.apply(reference1.output, layout).to(consumed2.dtype)
            reference2 = op.reference({**second.args, "input": rows})
            if final is not None and tuple(final.shape) == (size_m, reference2.output.shape[1]):
                predicted = reference2.output.view(size_m, top_k, -1).sum(dim=1)
                layer_errors = relative_errors(predicted, final.float())
            else:
                layer_errors = relative_errors(
                    *_rows(reference2.written, reference2.output, second.captured_output.float())
                )
            hypotheses.append(Hypothesis(spec.label, layout, *step_errors, *layer_errors))
    return hypotheses


def _ogs(first: Any, second: Any, candidates: list[ActivationSpec]) -> list[Hypothesis]:
    op = first.op
    plain = dict(first.args)
    plain["fused_activation"] = None
    before = op.reference(plain)  # gemm1 without its fused activation: [rows, 2N]
    written = before.written
    captured1 = first.captured_output.float()
    hypotheses = []
    for spec in candidates:
        for layout in W13Layout:
            activated = spec.apply(before.output, layout)
            step_errors = relative_errors(*_rows(written, activated, captured1))
            rows = activated.to(second.args["x"].dtype)
            reference2 = op.reference({**second.args, "x": rows})
            layer_errors = relative_errors(
                *_rows(reference2.written, reference2.output, second.captured_output.float())
            )
            hypotheses.append(Hypothesis(spec.label, layout, *step_errors, *layer_errors))
    return hypotheses


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
