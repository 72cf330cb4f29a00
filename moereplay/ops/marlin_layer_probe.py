"""The Marlin family's w13 layer probe (``FamilySurface.layer_probe``; see :mod:`moereplay.ops.layer_probe`).

The activation runs between the two GEMMs as its own vLLM kernel, so its step is seen directly: gemm1's captured
output (the intermediate it wrote) → gemm2's captured ``input`` (what the activation kernel wrote). The layer is
gemm1's reference → activation → gemm2's reference, against the parent's output (the top-k sum) when recorded,
else gemm2's captured output. The activation is the parent's ``activation`` argument.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moereplay.ops.layer_probe import (
    ActivationSpec,
    Hypothesis,
    activation_from_parent,
    final_output,
    relative_errors,
    written_rows,
)
from moereplay.reference.activation import W13Layout


def activation(first_args: Mapping[str, Any], parent_args: Mapping[str, Any]) -> ActivationSpec | None:
    """The parent's ``activation`` (the kernel calls do not record it)."""
    return activation_from_parent(parent_args)


def expected_layout(spec: ActivationSpec) -> W13Layout | None:
    """What vLLM's activation kernel for ``spec`` reads (``GatedActivation.default_layout``)."""
    return spec.activation.default_layout


def hypotheses(
    first: Any, second: Any, parent_outputs: Mapping[str, Any] | None, candidates: list[ActivationSpec]
) -> list[Hypothesis]:
    op = first.op
    reference1 = op.reference(first.args)
    written1 = reference1.written
    captured1 = first.captured_output.float()
    consumed2 = second.args["input"]
    final = final_output(parent_outputs)
    size_m, top_k = int(first.args["size_m"]), int(first.args["top_k"])
    found = []
    for spec in candidates:
        for layout in W13Layout:
            step = spec.apply(captured1, layout).to(consumed2.dtype)
            step_errors = relative_errors(*written_rows(written1, step, consumed2))
            rows = spec.apply(reference1.output, layout).to(consumed2.dtype)
            reference2 = op.reference({**second.args, "input": rows})
            if final is not None and tuple(final.shape) == (size_m, reference2.output.shape[1]):
                predicted = reference2.output.view(size_m, top_k, -1).sum(dim=1)
                layer_errors = relative_errors(predicted, final.float())
            else:
                layer_errors = relative_errors(
                    *written_rows(reference2.written, reference2.output, second.captured_output.float())
                )
            found.append(Hypothesis(spec.label, layout, *step_errors, *layer_errors))
    return found
