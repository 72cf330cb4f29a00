"""The matmul_ogs family's w13 layer probe (``FamilySurface.layer_probe``; see :mod:`moereplay.ops.layer_probe`).

The activation is fused into gemm1 (``fused_activation``: triton_kernels' ``swiglu``), so its step is gemm1's fp32
reference *without* the activation, activated under the hypothesis, against gemm1's captured output; the layer is
that → gemm2's reference, against gemm2's captured output. triton_kernels' ``swiglu`` reads ``x[..., ::2]`` as the
gate: ``[g,u]`` interleaved is what vLLM's kernel reads, whatever the activation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moereplay.ops.layer_probe import ActivationSpec, Hypothesis, relative_errors, written_rows
from moereplay.reference.activation import GatedActivation, W13Layout


def activation(first_args: Mapping[str, Any], parent_args: Mapping[str, Any]) -> ActivationSpec | None:
    """gemm1's fused ``swiglu`` with its ``(alpha, limit)``; None for no or another fused activation."""
    spec = first_args.get("fused_activation")
    specs = getattr(spec, "specs", None)
    if specs is None or getattr(specs, "name", None) != "swiglu":
        return None
    fn_args = tuple(getattr(spec, "fn_args", ()))
    alpha = float(fn_args[0]) if len(fn_args) > 0 and fn_args[0] is not None else None
    limit = float(fn_args[1]) if len(fn_args) > 1 and fn_args[1] is not None else None
    return ActivationSpec(GatedActivation.SWIGLUOAI, alpha, limit)


def expected_layout(spec: ActivationSpec) -> W13Layout | None:
    """``[g,u]`` interleaved: the fused ``swiglu`` takes the even columns as the gate."""
    return W13Layout.GATE_UP_INTERLEAVED


def hypotheses(
    first: Any, second: Any, parent_outputs: Mapping[str, Any] | None, candidates: list[ActivationSpec]
) -> list[Hypothesis]:
    op = first.op
    plain = dict(first.args)
    plain["fused_activation"] = None
    before = op.reference(plain)  # gemm1 without its fused activation: [rows, 2N]
    written = before.written
    captured1 = first.captured_output.float()
    found = []
    for spec in candidates:
        for layout in W13Layout:
            activated = spec.apply(before.output, layout)
            step_errors = relative_errors(*written_rows(written, activated, captured1))
            rows = activated.to(second.args["x"].dtype)
            reference2 = op.reference({**second.args, "x": rows})
            layer_errors = relative_errors(
                *written_rows(reference2.written, reference2.output, second.captured_output.float())
            )
            found.append(Hypothesis(spec.label, layout, *step_errors, *layer_errors))
    return found
