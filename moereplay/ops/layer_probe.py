"""What the w13 layout probe (:mod:`moereplay.layout.probe`) and the families' layer probes share: the activation
hypothesis (:class:`ActivationSpec`), one hypothesis' evidence (:class:`Hypothesis`) and how it is measured.

A family whose layers the probe understands declares ``FamilySurface.layer_probe``, a module providing
(:class:`LayerProbe`):

- ``activation(first_args, parent_args)`` → the layer's :class:`ActivationSpec` as the family's calls record it,
  or None (the probe then reads the parent's ``activation`` argument, :func:`activation_from_parent`, and failing
  that tries every gated activation);
- ``hypotheses(first, second, parent_outputs, candidates)`` → one :class:`Hypothesis` per (candidate, layout):
  ``first`` and ``second`` are the layer's loaded gemm1 and gemm2 (:class:`moereplay.replay.source.LoadedCall`:
  ``op``, ``args``, ``captured_output``), ``parent_outputs`` the parent's recorded outputs (None without one);
- ``expected_layout(spec)`` → the layout vLLM's kernel for that activation reads in this family, or None.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moereplay.errors import ReplayError
from moereplay.reference.activation import GatedActivation, W13Layout, apply_gated_activation

MATCH_RMS = 0.02
"""RMS relative error (‖a − e‖ / ‖e‖ over the compared rows) under which a hypothesis reproduces the captured data:
well above bf16 rounding of an fp32 pipeline (~3e-3), far below what a wrong layout gives (≳ 0.5)."""


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


class LayerProbe(Protocol):
    """What a family's ``layer_probe`` module provides (functions of the module; see the module docstring)."""

    def activation(
        self, first_args: Mapping[str, Any], parent_args: Mapping[str, Any]
    ) -> ActivationSpec | None: ...

    def hypotheses(
        self,
        first: Any,
        second: Any,
        parent_outputs: Mapping[str, Any] | None,
        candidates: list[ActivationSpec],
    ) -> list[Hypothesis]: ...

    def expected_layout(self, spec: ActivationSpec) -> W13Layout | None: ...


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


def written_rows(mask: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """The rows ``mask`` (bool ``[rows]``) selects of each tensor, viewed as ``[rows, -1]``."""
    return [t.reshape(mask.shape[0], -1)[mask.to(t.device)] for t in tensors]


def _enum_value(value: Any) -> str | None:
    if isinstance(value, enum.Enum):
        return str(value.value)
    inner = getattr(value, "value", None)
    if isinstance(inner, str):
        return inner
    return value if isinstance(value, str) else None


def activation_from_parent(parent_args: Mapping[str, Any]) -> ActivationSpec | None:
    """The activation a parent (layer) record names in its ``activation`` argument (vLLM's ``MoEActivation``),
    with the clamp and SwiGLU constants some parents carry (``clamp_limit``/``swiglu_limit``,
    ``gemm1_alpha``/``swiglu_alpha``, ``gemm1_beta``)."""
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


def final_output(outputs: Mapping[str, Any] | None) -> torch.Tensor | None:
    """A parent's output tensor among its recorded outputs (the returned one, else ``output`` /
    ``output_tensor``)."""
    if not outputs:
        return None
    for key in ("return", "output", "output_tensor"):
        value = outputs.get(key)
        if isinstance(value, torch.Tensor):
            return value
    return None


def separate_activation_hypotheses(
    first: Any,
    second: Any,
    parent_outputs: Mapping[str, Any] | None,
    candidates: list[ActivationSpec],
    *,
    input_name: str,
    size_m: int,
    top_k: int,
) -> list[Hypothesis]:
    """Every (activation, layout) hypothesis of a layer whose activation runs as its own kernel between the two
    GEMMs (gemm2 reads it from its ``input_name`` argument): the step is gemm1's captured rows → gemm2's captured
    input; the layer is gemm1's reference → activation → gemm2's reference, summed over the ``top_k`` slots of the
    ``size_m`` tokens against the parent's output when recorded, else against gemm2's captured rows."""
    op = first.op
    reference1 = op.reference(first.args)
    written1 = reference1.written
    captured1 = first.captured_output.float()
    consumed2 = second.args[input_name]
    final = final_output(parent_outputs)
    found = []
    for spec in candidates:
        for layout in W13Layout:
            step = spec.apply(captured1, layout).to(consumed2.dtype)
            step_errors = relative_errors(*written_rows(written1, step, consumed2))
            rows = spec.apply(reference1.output, layout).to(consumed2.dtype)
            reference2 = op.reference({**second.args, input_name: rows})
            if final is not None and tuple(final.shape) == (size_m, reference2.output.shape[1]):
                predicted = reference2.output.view(size_m, top_k, -1).sum(dim=1)
                layer_errors = relative_errors(predicted, final.float())
            else:
                layer_errors = relative_errors(
                    *written_rows(reference2.written, reference2.output, second.captured_output.float())
                )
            found.append(Hypothesis(spec.label, layout, *step_errors, *layer_errors))
    return found
