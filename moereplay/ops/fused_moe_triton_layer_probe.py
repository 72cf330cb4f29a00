"""vLLM's Triton fused MoE w13 layer probe (``FamilySurface.layer_probe``; see :mod:`moereplay.ops.layer_probe`).

Facts, from vLLM 0.25.1's ``fused_moe/fused_moe.py`` (``fused_experts_impl``): gemm1 writes ``intermediate_cache1``
(``C`` ``[M, top_k, 2N]``, from ``w1`` ``[E, 2N, K]``); ``apply_moe_activation(activation, intermediate_cache2,
intermediate_cache1.view(-1, 2N))`` runs the activation as its own kernel (``silu_and_mul``, ``gelu_and_mul``,
``swigluoai_and_mul`` … of ``_C``); ``moe_kernel_quantize_input`` passes ``intermediate_cache2`` through unchanged
when the activations are not quantised; gemm2 reads it as ``A`` (``[M · top_k, N]``, ``top_k = 1``) and writes
``intermediate_cache3`` ``[M, top_k, K]``, which ``moe_sum`` reduces to the layer's output. ``silu_and_mul`` takes
the first half of each row as the gate, ``x[:, :N]``, and the second as up: vLLM's w13 convention for this family is
``[gate; up]`` (``GatedActivation.default_layout``; ``swigluoai_and_mul`` reads ``[g,u]`` interleaved).

So, as for Marlin: the activation step is gemm1's captured rows → gemm2's captured ``A``; the layer is gemm1's
reference → activation → gemm2's reference, summed over the top-k slots against the parent's output when recorded
(else against gemm2's captured rows). The activation is the parent's ``activation`` argument. Layers whose
activations are quantised between the GEMMs (w8a8: gemm2's ``A`` is fp8/int8 codes with ``A_scale``) are not
probed: the quantisation error alone exceeds what tells layouts apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from moereplay.errors import ReplayError
from moereplay.ops.layer_probe import (
    ActivationSpec,
    Hypothesis,
    activation_from_parent,
    separate_activation_hypotheses,
)
from moereplay.reference.activation import W13Layout

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def activation(first_args: Mapping[str, Any], parent_args: Mapping[str, Any]) -> ActivationSpec | None:
    """The parent's ``activation`` (the launches do not record it)."""
    return activation_from_parent(parent_args)


def expected_layout(spec: ActivationSpec) -> W13Layout | None:
    """What vLLM's activation kernel for ``spec`` reads (``[gate; up]`` for ``silu_and_mul``)."""
    return spec.activation.default_layout


def hypotheses(
    first: Any, second: Any, parent_outputs: Mapping[str, Any] | None, candidates: list[ActivationSpec]
) -> list[Hypothesis]:
    consumed2 = second.args["A"]
    if consumed2.dtype not in _FLOATS or second.args.get("A_scale") is not None:
        raise ReplayError(
            f"gemm2 reads quantised activations ({consumed2.dtype}, A_scale): the layout probe compares "
            "unquantised ones only"
        )
    return separate_activation_hypotheses(
        first, second, parent_outputs, candidates, input_name="A",
        size_m=int(first.args["A"].shape[0]), top_k=int(first.args["top_k"]),
    )  # fmt: skip
