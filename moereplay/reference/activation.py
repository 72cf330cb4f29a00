"""Gated activations of MoE layers and the w13 layouts they read, in fp32 (fp64 stays fp64).

A gated activation maps the ``2·d`` outputs of the fused gate/up GEMM (w13) to ``d`` values. Which half of a row is
the gate depends on how w13 was laid out, and kernels disagree:

- ``GATE_UP_INTERLEAVED`` ``[g0, u0, g1, u1, …]``: gpt-oss checkpoints; vLLM's ``swigluoai_and_mul`` and the
  ``swiglu`` fused into triton_kernels ``matmul_ogs`` (``gelu = x[..., ::2]``, ``linear = x[..., 1::2]``).
- ``UP_GATE_INTERLEAVED`` ``[u0, g0, u1, g1, …]``.
- ``GATE_UP_CONCAT`` ``[gate; up]``: vLLM's ``silu_and_mul``, ``gelu_and_mul``, ``silu_and_mul_with_clamp``,
  ``swiglustep_and_mul`` (activation on the first half).
- ``UP_GATE_CONCAT`` ``[up; gate]``: ``mul_and_silu`` and kernels that swap the halves (e.g. FlashInfer's w31).

Formulas (vLLM 0.25.1 ``layers/activation.py`` and ``csrc/activation_kernels.cu``, triton_kernels ``swiglu``):

- silu_and_mul: ``silu(g) · u``; with vLLM's ``gemm1_clamp_limit`` (``swiglu_limit_func``) the inputs are clamped
  first: ``g ≤ limit``, ``−limit ≤ u ≤ limit``.
- gelu_and_mul: ``gelu(g) · u``, exact erf form, or the tanh approximation.
- swigluoai_and_mul (gpt-oss, alpha = 1.702, limit = 7.0): ``g ← min(g, limit)`` (no lower clamp),
  ``u ← clamp(u, −limit, limit)``, ``out = g · sigmoid(alpha · g) · (u + 1)``.
- silu_and_mul_with_clamp (limit, alpha = 1, beta = 0): ``g ← min(g, limit)``, ``u ← clamp(u, ±limit)``,
  ``out = g · sigmoid(alpha · g) · (u + beta)`` — swigluoai is the case alpha = 1.702, beta = 1.
- swiglustep_and_mul (limit = 7.0): ``min(silu(g), limit) · clamp(u, ±limit)`` (clamp *after* silu).

Every function here is pure torch, any device, and computes in float32 (float64 inputs stay float64). A NaN input
stays NaN (torch's clamp propagates NaN; a kernel's min/max may not).
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

import torch

from moereplay.errors import ReferenceError_

#: gpt-oss SwiGLU constants (vLLM ``SwigluOAIAndMul`` defaults and ``triton_kernel_fused_experts`` arguments).
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


class W13Layout(Enum):
    """How the gate and up halves of a fused w13 output (or weight, or bias) are arranged along their axis."""

    GATE_UP_INTERLEAVED = "gu_interleaved"
    UP_GATE_INTERLEAVED = "ug_interleaved"
    GATE_UP_CONCAT = "gate_up"
    UP_GATE_CONCAT = "up_gate"


class GatedActivation(Enum):
    """Gated activations, named as vLLM's ``MoEActivation`` values."""

    SILU = "silu"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    SWIGLUOAI = "swigluoai"
    SWIGLUOAI_UNINTERLEAVE = "swigluoai_uninterleave"
    SWIGLUSTEP = "swiglustep"

    @property
    def default_layout(self) -> W13Layout:
        """The w13 layout vLLM's kernel for this activation expects."""
        if self is GatedActivation.SWIGLUOAI:
            return W13Layout.GATE_UP_INTERLEAVED
        return W13Layout.GATE_UP_CONCAT


def _float(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.to(torch.float32)


def _normalise_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise ReferenceError_(f"dim {dim} is out of range for a tensor of {ndim} dimensions")
    return dim + ndim if dim < 0 else dim


def _check_even(size: int, dim: int) -> None:
    if size % 2:
        raise ReferenceError_(f"a gated activation needs an even size along dim {dim}, got {size}")


def split_gate_up(x: torch.Tensor, layout: W13Layout, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``x`` along ``dim`` into (gate, up) views according to ``layout``."""
    dim = _normalise_dim(dim, x.ndim)
    size = x.shape[dim]
    _check_even(size, dim)
    half = size // 2
    if layout is W13Layout.GATE_UP_CONCAT:
        return x.narrow(dim, 0, half), x.narrow(dim, half, half)
    if layout is W13Layout.UP_GATE_CONCAT:
        return x.narrow(dim, half, half), x.narrow(dim, 0, half)
    pairs = x.unflatten(dim, (half, 2))
    first, second = pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)
    if layout is W13Layout.GATE_UP_INTERLEAVED:
        return first, second
    return second, first


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor, layout: W13Layout, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`split_gate_up`: build one tensor in ``layout`` from its gate and up halves."""
    if gate.shape != up.shape:
        raise ReferenceError_(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} halves differ in shape")
    dim = _normalise_dim(dim, gate.ndim)
    if layout is W13Layout.GATE_UP_CONCAT:
        return torch.cat((gate, up), dim=dim)
    if layout is W13Layout.UP_GATE_CONCAT:
        return torch.cat((up, gate), dim=dim)
    first, second = (gate, up) if layout is W13Layout.GATE_UP_INTERLEAVED else (up, gate)
    return torch.stack((first, second), dim=dim + 1).flatten(dim, dim + 1)


def w13_permutation(size: int, source: W13Layout, target: W13Layout) -> torch.Tensor:
    """Indices ``p`` (int64, CPU) with ``converted = x.index_select(dim, p)`` for an axis of ``size`` entries.

    Useful where the data cannot be split elementwise (e.g. to reorder rows of packed weights or their scales).
    """
    _check_even(size, 0)
    positions = torch.arange(size, dtype=torch.int64)
    gate, up = split_gate_up(positions, source)
    return merge_gate_up(gate, up, target)


def convert_w13_layout(x: torch.Tensor, source: W13Layout, target: W13Layout, dim: int = -1) -> torch.Tensor:
    """Rearrange ``x`` along ``dim`` from ``source`` to ``target`` layout (weights, biases, scales or outputs)."""
    if source is target:
        return x
    gate, up = split_gate_up(x, source, dim)
    return merge_gate_up(gate, up, target, dim)


def silu_and_mul(
    x: torch.Tensor, layout: W13Layout = W13Layout.GATE_UP_CONCAT, *, limit: float | None = None
) -> torch.Tensor:
    """``silu(g) · u``; with ``limit`` the inputs are clamped first (vLLM ``swiglu_limit_func``)."""
    gate, up = split_gate_up(_float(x), layout)
    if limit is not None and limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return torch.nn.functional.silu(gate) * up


def gelu_and_mul(
    x: torch.Tensor,
    layout: W13Layout = W13Layout.GATE_UP_CONCAT,
    *,
    approximate: Literal["none", "tanh"] = "none",
) -> torch.Tensor:
    """``gelu(g) · u`` with the exact erf GELU, or its tanh approximation."""
    gate, up = split_gate_up(_float(x), layout)
    return torch.nn.functional.gelu(gate, approximate=approximate) * up


def silu_and_mul_with_clamp(
    x: torch.Tensor,
    limit: float,
    alpha: float = 1.0,
    beta: float = 0.0,
    layout: W13Layout = W13Layout.GATE_UP_CONCAT,
) -> torch.Tensor:
    """``min(g, limit) · sigmoid(alpha · min(g, limit)) · (clamp(u, ±limit) + beta)``."""
    gate, up = split_gate_up(_float(x), layout)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + beta)


def swigluoai_and_mul(
    x: torch.Tensor,
    layout: W13Layout = W13Layout.GATE_UP_INTERLEAVED,
    *,
    alpha: float = SWIGLUOAI_ALPHA,
    limit: float | None = SWIGLUOAI_LIMIT,
) -> torch.Tensor:
    """gpt-oss SwiGLU: ``g · sigmoid(alpha · g) · (u + 1)`` after ``g ≤ limit`` and ``−limit ≤ u ≤ limit``.

    ``limit=None`` skips both clamps, as triton_kernels' ``swiglu`` does for a ``None`` limit.
    """
    gate, up = split_gate_up(_float(x), layout)
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit).add_(1.0)
    else:
        up = up + 1.0
    # ``gate · sigmoid(alpha · gate) · (up + 1)`` in that order, in one buffer (three fewer temporaries of half
    # the input each: the same numbers)
    out = torch.mul(gate, alpha).sigmoid_()
    torch.mul(gate, out, out=out)
    return torch.mul(out, up, out=out)


def swiglustep_and_mul(
    x: torch.Tensor, layout: W13Layout = W13Layout.GATE_UP_CONCAT, *, limit: float = SWIGLUOAI_LIMIT
) -> torch.Tensor:
    """``min(silu(g), limit) · clamp(u, ±limit)`` (vLLM ``SwigluStepAndMul``)."""
    gate, up = split_gate_up(_float(x), layout)
    return torch.nn.functional.silu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)


def apply_gated_activation(
    x: torch.Tensor,
    activation: GatedActivation,
    layout: W13Layout | None = None,
    *,
    alpha: float | None = None,
    limit: float | None = None,
    beta: float | None = None,
) -> torch.Tensor:
    """Dispatch on ``activation`` with vLLM's defaults for the optional constants.

    ``layout`` defaults to the one vLLM's kernel for that activation expects (:attr:`GatedActivation.default_layout`).
    SWIGLUOAI_UNINTERLEAVE needs ``limit`` (vLLM asserts ``gemm1_clamp_limit`` is set); alpha defaults to 1, beta to 0.
    """
    layout = activation.default_layout if layout is None else layout
    if activation is GatedActivation.SILU:
        return silu_and_mul(x, layout, limit=limit)
    if activation is GatedActivation.GELU:
        return gelu_and_mul(x, layout)
    if activation is GatedActivation.GELU_TANH:
        return gelu_and_mul(x, layout, approximate="tanh")
    if activation is GatedActivation.SWIGLUOAI:
        return swigluoai_and_mul(
            x,
            layout,
            alpha=SWIGLUOAI_ALPHA if alpha is None else alpha,
            limit=SWIGLUOAI_LIMIT if limit is None else limit,
        )
    if activation is GatedActivation.SWIGLUOAI_UNINTERLEAVE:
        if limit is None:
            raise ReferenceError_("swigluoai_uninterleave needs a clamp limit")
        return silu_and_mul_with_clamp(
            x, limit, 1.0 if alpha is None else alpha, 0.0 if beta is None else beta, layout
        )
    if activation is GatedActivation.SWIGLUSTEP:
        return swiglustep_and_mul(x, layout, limit=SWIGLUOAI_LIMIT if limit is None else limit)
    raise ReferenceError_(f"no reference for gated activation {activation!r}")  # pragma: no cover
