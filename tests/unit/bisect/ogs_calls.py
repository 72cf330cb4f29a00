"""gpt-oss-like ``matmul_ogs`` calls built from *logical* tensors, the way vLLM 0.25.1 prepares them on Hopper.

A :class:`Logical` problem holds checkpoint-form MXFP4 weights (``[E, N, K/2]`` e2m1 bytes, ``[E, N, K/32]`` e8m0
scales), fp32 biases, the router's top-k choice and the activations; :func:`w13_call` / :func:`w2_call` turn it into
the plain-spec arguments of gemm1 (gather, bias, fused swiglu) and gemm2 (scatter, bias, gammas): weights swizzled
with the Hopper value / scale layouts (num_warps 8), routing through ``moereplay.synth.routing.ogs_routing``.
:meth:`Logical.sub` cuts the *logical* problem — the independent construction the shrinker is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moereplay.ops.matmul_ogs import CONSTRAINT_ARGS
from moereplay.ops.ogs_codecs import ActivationSpec, FnSpec, LayoutSpec, LayoutTensor, PrecisionSpec
from moereplay.reference.hopper_mxfp4 import swizzle_hopper_scales, swizzle_hopper_values
from moereplay.synth.routing import TopK, ogs_routing

SWIGLU = ActivationSpec(
    FnSpec("swiglu", "triton_kernels.swiglu_details._swiglu", "_swiglu_fn", ("alpha", "limit")),
    (1.702, 7.0),
    2,
)


@dataclass(frozen=True)
class Logical:
    """One MoE GEMM in logical form. ``slot_x``: the input of every flat (token, choice) slot (gemm2's rows)."""

    values: torch.Tensor  # uint8 [E, N, K/2]
    scales: torch.Tensor  # uint8 [E, N, K/32]
    bias: torch.Tensor  # float32 [E, N]
    ids: torch.Tensor  # int32 [T, top_k]
    weights: torch.Tensor  # float32 [T, top_k]
    x: torch.Tensor  # bf16 [T, K]
    slot_x: torch.Tensor  # bf16 [T * top_k, K]

    @property
    def experts(self) -> int:
        return int(self.values.shape[0])

    @property
    def k(self) -> int:
        return int(self.values.shape[2]) * 2

    @property
    def n(self) -> int:
        return int(self.values.shape[1])

    def sub(
        self, kept: list[int], mapping: dict[int, int], k: int, n: int, tokens: int, top_k: int
    ) -> Logical:
        """The sub-problem: experts ``kept`` (old ids → new ids by ``mapping``), K, N, tokens and choices cut."""
        index = torch.tensor(kept)
        ids = self.ids[:tokens, :top_k].clone()
        ids.apply_(lambda old: mapping[old])
        slots = self.slot_x.view(self.ids.shape[0], self.ids.shape[1], -1)[:tokens, :top_k, :k]
        return Logical(
            values=self.values[index][:, :n, : k // 2].contiguous(),
            scales=self.scales[index][:, :n, : k // 32].contiguous(),
            bias=self.bias[index][:, :n].contiguous(),
            ids=ids.contiguous(),
            weights=self.weights[:tokens, :top_k].contiguous(),
            x=self.x[:tokens, :k].contiguous(),
            slot_x=slots.reshape(tokens * top_k, k).contiguous(),
        )


def logical(experts: int, k: int, n: int, tokens: int, top_k: int, seed: int = 0) -> Logical:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=generator)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return Logical(
        values=torch.randint(0, 256, (experts, n, k // 2), generator=generator, dtype=torch.uint8),
        scales=torch.randint(118, 128, (experts, n, k // 32), generator=generator, dtype=torch.uint8),
        bias=torch.randn(experts, n, generator=generator) * 0.1,
        ids=ids.to(torch.int32),
        weights=(weights / weights.sum(-1, keepdim=True)).contiguous(),
        x=(torch.randn(tokens, k, generator=generator) * 0.5).to(torch.bfloat16),
        slot_x=(torch.randn(tokens * top_k, k, generator=generator) * 0.5).to(torch.bfloat16),
    )


def weights_of(problem: Logical) -> tuple[LayoutTensor, LayoutTensor]:
    """(w, weight scale) swizzled as ``_swizzle_mxfp4`` leaves them on sm_90."""
    values_t, scales_t = problem.values.transpose(1, 2), problem.scales.transpose(1, 2)
    shape = (problem.experts, problem.k, problem.n)
    w = LayoutTensor(
        swizzle_hopper_values(values_t, 1),
        LayoutSpec("HOPPER_VALUE", tuple(values_t.shape), mx_axis=1, mma_version=3),
        "fp4",
        shape,
        shape,
    )
    scale = LayoutTensor(
        swizzle_hopper_scales(scales_t, 1, 8),
        LayoutSpec("HOPPER_SCALE", tuple(scales_t.shape), mx_axis=1, num_warps=8),
        "uint8",
        tuple(scales_t.shape),
        tuple(scales_t.shape),
    )
    return w, scale


def _constraints() -> dict[str, Any]:
    state: dict[str, Any] = {name: None for name in CONSTRAINT_ARGS}
    state["split_k"] = 1
    state["num_warps"] = None
    return state


def w13_call(problem: Logical) -> dict[str, Any]:
    """gemm1: gather of token rows, bias, fused swiglu; ``y`` ``[1, T·top_k, N/2]``."""
    w, scale = weights_of(problem)
    routing, gather, _ = ogs_routing(TopK(problem.weights, problem.ids), problem.experts)
    rows = problem.ids.numel()
    return {
        "x": problem.x,
        "w": w,
        "bias": problem.bias,
        "routing_data": routing,
        "gather_indx": gather,
        "scatter_indx": None,
        "precision_config": PrecisionSpec(weight_scale=scale),
        "betas": None,
        "gammas": None,
        "out_alpha": None,
        "y": torch.zeros(1, rows, problem.n // 2, dtype=torch.bfloat16),
        "fused_activation": SWIGLU,
        "epilogue": None,
        **_constraints(),
    }


def w2_call(problem: Logical) -> dict[str, Any]:
    """gemm2: expert-sorted rows in, scatter with a grouped top-k sum, bias, ``gammas`` = the routing weights."""
    w, scale = weights_of(problem)
    routing, gather, scatter = ogs_routing(TopK(problem.weights, problem.ids), problem.experts)
    sorted_x = problem.slot_x[gather.src_indx.long()].contiguous()  # type: ignore[attr-defined]
    return {
        "x": sorted_x,
        "w": w,
        "bias": problem.bias,
        "routing_data": routing,
        "gather_indx": None,
        "scatter_indx": scatter,
        "precision_config": PrecisionSpec(weight_scale=scale),
        "betas": None,
        "gammas": routing.gate_scal,  # type: ignore[attr-defined]
        "out_alpha": None,
        "y": torch.zeros(1, problem.ids.shape[0], problem.n, dtype=torch.bfloat16),
        "fused_activation": None,
        "epilogue": None,
        **_constraints(),
    }
