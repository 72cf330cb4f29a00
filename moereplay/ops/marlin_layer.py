"""The layer reference of vLLM's ``fused_marlin_moe`` (see :mod:`moereplay.ops.layers`): dequantise both Marlin
weight sets, route every token through its top-k experts that live on this rank, and sum in float64.

What one rank's call computes (vLLM 0.25.1, ``fused_moe/experts/marlin_moe.py``): ``K = hidden_states.size(1)``,
``N = w2.size(1) * 16`` (this rank's intermediate size — under TP a 1/tp slice of the gate columns and the same
slice of the up columns, and the matching rows of w2), ``w1`` holds ``2N`` output columns per expert, the
activation (``activation``; ``clamp_limit``, ``gemm1_alpha``/``gemm1_beta``) consumes the gate/up halves, ``w2``
brings them back to K, and each (token, slot) is weighted by ``topk_weights`` unless the weight was applied on the
input (``apply_router_weight_on_input``). Under EP ``expert_map`` sends a global expert id to its local index, ``-1``
for experts of other ranks: their slots contribute nothing here. The result is the layer's output *before* vLLM's
all-reduce (``MoERunner._maybe_reduce_final_output``), which is what the parent call returns.

The w13 layout is ``context["w13_layout"]`` when recorded (``moereplay layout`` finds it), else the activation's
default. Bias on w2 under TP is added by every rank here, as the kernel call is given it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moereplay.errors import ReferenceError_
from moereplay.ops.layers import register_layer_reference
from moereplay.reference.activation import GatedActivation, W13Layout, apply_gated_activation
from moereplay.reference.marlin_formats import MarlinExpertWeights
from moereplay.reference.scalar_types import scalar_type_from_id


def _activation(value: Any) -> GatedActivation:
    text = getattr(value, "value", value)
    name = getattr(value, "name", None)
    for candidate in (text, name):
        if isinstance(candidate, str):
            for member in GatedActivation:
                if candidate.lower() in (member.value, member.name.lower()):
                    return member
    if value is None:
        return GatedActivation.SILU
    raise ReferenceError_(f"fused_marlin_moe: unknown activation {value!r}")


def _weights(args: Mapping[str, Any], which: int, size_k: int, size_n: int) -> MarlinExpertWeights:
    activation_dtype = args["hidden_states"].dtype
    return MarlinExpertWeights.from_kernel_args(
        b_qweight=args[f"w{which}"],
        b_scales=args[f"w{which}_scale"],
        b_q_type=scalar_type_from_id(int(args["quant_type_id"])),
        activation_dtype=activation_dtype,
        size_k=size_k,
        size_n=size_n,
        global_scale=args.get(f"global_scale{which}"),
        b_qzeros=args.get(f"w{which}_zeros"),
        g_idx=args.get(f"g_idx{which}"),
        perm=args.get(f"sort_indices{which}"),
    )


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class MarlinLayerReference:
    name: str = "fused_marlin_moe"
    replicated: tuple[str, ...] = ("hidden_states", "topk_ids", "topk_weights")
    expert_map: str | None = "expert_map"
    # intermediate_cache1 (GEMM 1), intermediate_cache2 (activation), intermediate_cache3 (GEMM 2, weighted, per
    # slot) and the top-k sum: vLLM 0.25.1 allocates all four in hidden_states' dtype
    roundings: int = 4

    def reference(
        self, args: Mapping[str, Any], context: Mapping[Any, Any], *, store: torch.dtype | None = None
    ) -> torch.Tensor:
        """The layer's output in float64. ``store`` (e.g. bfloat16) rounds the four buffers vLLM keeps in the
        activation dtype (see :attr:`roundings`) as it does — what a correct kernel chain returns, for synthetic
        captures; the reference proper (``store=None``) rounds nothing."""

        def stored(value: torch.Tensor) -> torch.Tensor:
            return value if store is None else value.to(store).double()

        hidden = args["hidden_states"]
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
            raise ReferenceError_("fused_marlin_moe: hidden_states must be a [tokens, hidden] tensor")
        tokens, size_k = (int(d) for d in hidden.shape)
        intermediate = int(args["w2"].shape[1]) * 16
        w1 = _weights(args, 1, size_k, 2 * intermediate).dequantize().double()  # [E, K, 2N]
        w2 = _weights(args, 2, intermediate, size_k).dequantize().double()  # [E, N, K]
        bias1, bias2 = args.get("bias1"), args.get("bias2")
        activation = _activation(args.get("activation"))
        layout_text = context.get("w13_layout")
        layout = W13Layout(layout_text) if isinstance(layout_text, str) else None
        ids = args["topk_ids"].long()
        weights = args["topk_weights"].double()
        on_input = bool(args.get("apply_router_weight_on_input", False))
        local = ids
        expert_map = args.get("expert_map")
        if expert_map is not None:
            mapping = expert_map.long().reshape(-1)
            if int(ids.max()) >= mapping.numel() or int(ids.min()) < 0:
                raise ReferenceError_(
                    f"fused_marlin_moe: topk_ids outside the expert map's {mapping.numel()} experts"
                )
            local = mapping[ids]
        x = hidden.double()
        out = torch.zeros((tokens, size_k), dtype=torch.float64, device=hidden.device)
        experts = w1.shape[0]
        for expert in sorted({int(e) for e in local.reshape(-1).tolist() if e >= 0}):
            if expert >= experts:
                raise ReferenceError_(f"fused_marlin_moe: local expert {expert} of {experts} held")
            rows, slots = torch.nonzero(local == expert, as_tuple=True)
            coefficient = weights[rows, slots].unsqueeze(1)
            inputs = x[rows] * coefficient if on_input else x[rows]
            gate_up = inputs @ w1[expert]
            if bias1 is not None:
                gate_up = gate_up + bias1[expert].double()
            gate_up = stored(gate_up)
            activated = apply_gated_activation(
                gate_up,
                activation,
                layout,
                alpha=_float_or_none(args.get("gemm1_alpha"))
                if activation is GatedActivation.SWIGLUOAI
                else None,
                limit=_float_or_none(args.get("clamp_limit")),
                beta=_float_or_none(args.get("gemm1_beta"))
                if activation is GatedActivation.SWIGLUOAI
                else None,
            )
            activated = stored(activated.double())
            down = activated @ w2[expert]
            if bias2 is not None:
                down = down + bias2[expert].double()
            out.index_add_(0, rows, stored(down if on_input else down * coefficient))
        return stored(out)


register_layer_reference(MarlinLayerReference())
