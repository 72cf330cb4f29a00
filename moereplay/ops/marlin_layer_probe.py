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
    separate_activation_hypotheses,
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
    return separate_activation_hypotheses(
        first, second, parent_outputs, candidates, input_name="input",
        size_m=int(first.args["size_m"]), top_k=int(first.args["top_k"]),
    )  # fmt: skip
