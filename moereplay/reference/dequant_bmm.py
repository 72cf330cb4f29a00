"""Batched expert products with the weights dequantised on the fly, for the Triton fused MoE reference on a GPU.

The torch path (:func:`moereplay.reference.expert_groups.batched_matmul_into` with dense weights) converts every
used expert's weights to float32 in memory, applies scales and zero points in further passes over them, then reads
them once more for the product: DeepSeek-V3 fp8 block-128 at 32 used experts writes 3.8 GB of float32 weights
twice, and int4 weight-only makes five passes. :class:`QuantizedWeights` describes the stored weights instead, and
:func:`dequant_bmm` computes the same products reading only the stored codes (one Triton kernel,
:mod:`moereplay.reference.dequant_bmm_kernel`): each weight element is dequantised in registers with the same
float32 operations, in the same order, as the torch path applies to it (so the dequantised weights are the same
bits — the GPU tests check it by multiplying one-hot rows), then summed in IEEE float32 (no TF32). Only the
summation order differs from ``torch.bmm``'s, as the batched path's already differs from the per-expert loop's.

Used on CUDA devices with Triton present (:data:`FUSED_DEVICE_TYPES`; ``MOEREPLAY_REFERENCE_FUSED=0`` turns it
off), for buckets of at most :data:`FUSED_MAX_PAD` rows per expert; larger buckets are compute-bound, where
cuBLAS's float32 product on dense weights is faster.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

FUSED_DEVICE_TYPES = frozenset({"cuda"})
"""Device types whose reference products may use the on-the-fly kernel (when Triton imports)."""

FUSED_MAX_PAD = 64
"""Largest bucket (padded rows per expert) the on-the-fly kernel takes; a product of more rows per weight is
compute-bound and runs faster as dense dequantisation plus one cuBLAS float32 ``bmm``."""

_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class QuantizedWeights:
    """Stored weights ``codes`` (``[E, N, K]``; int4: ``[E, N, K / 2]`` bytes) and how a weight ``(e, n, k)``
    becomes float32: ``mode`` 0 the code; 1 the code times ``scale[e, n // group_n, k // group_k]``; 2 ``(code −
    zero) · scale`` rounded through ``round_to``, ``zero`` from ``zero_points`` (int4: nibble ``n % 2`` of
    ``[e, n // 2, g]``) or ``zero_default``. ``scale`` and ``zero_points`` are 3-D views (stride 0 along an
    absent dimension); the logical K is the activations'."""

    codes: torch.Tensor
    mode: int = 0
    scale: torch.Tensor | None = None
    group_n: int = 1
    group_k: int = 1
    int4: bool = False
    zero_points: torch.Tensor | None = None
    zero_points_int4: bool = False
    zero_default: float = 0.0
    round_to: torch.dtype = torch.float32


def available(device: torch.device) -> bool:
    """Whether products on ``device`` may use the kernel: a CUDA device, Triton importable, not switched off."""
    if device.type not in FUSED_DEVICE_TYPES or os.environ.get("MOEREPLAY_REFERENCE_FUSED", "1") == "0":
        return False
    try:
        from moereplay.reference import dequant_bmm_kernel  # noqa: F401
    except ImportError:
        return False
    return True


def usable(weights: QuantizedWeights) -> bool:
    """Whether the kernel reads these weights as they are stored: one byte per code where codes are packed, a
    rounding dtype it knows."""
    if weights.int4 and weights.codes.element_size() != 1:
        return False
    if (
        weights.zero_points is not None
        and weights.zero_points_int4
        and weights.zero_points.element_size() != 1
    ):
        return False
    return weights.round_to in _ROUND and weights.codes.dim() == 3


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)


def dequant_bmm(x: torch.Tensor, weights: QuantizedWeights, experts: torch.Tensor) -> torch.Tensor:
    """``out[g] = x[g] · dequant(W[experts[g]])ᵀ`` in float32: ``x`` float32 ``[G, pad, K]``, ``experts`` int64
    ``[G]`` on the device; returns ``[G, pad, N]``. Cost: one launch; the stored codes of each used expert read
    ``⌈pad / BLOCK_M⌉`` times, no dense weights."""
    from moereplay.reference.dequant_bmm_kernel import dequant_bmm as kernel

    G, pad, K = (int(size) for size in x.shape)
    codes = _bytes(weights.codes) if weights.int4 else weights.codes
    N = int(codes.shape[1])
    out = torch.empty((G, pad, N), dtype=torch.float32, device=x.device)
    if G == 0 or pad == 0 or N == 0:
        return out
    scale = weights.scale if weights.scale is not None else codes  # never read when mode is 0
    zp = weights.zero_points
    if zp is not None and weights.zero_points_int4:
        zp = _bytes(zp)
    zp_arg = zp if zp is not None else codes
    block_m = 16 if pad <= 16 else (32 if pad <= 32 else 64)
    block_n, block_k = 64, 64
    grid = (G, triton_cdiv(N, block_n), triton_cdiv(pad, block_m))
    kernel[grid](
        x,
        codes,
        out,
        experts,
        scale,
        zp_arg,
        pad,
        N,
        K,
        *x.stride(),
        *codes.stride(),
        *out.stride(),
        *(scale.stride() if weights.scale is not None else (0, 0, 0)),
        *(zp.stride() if zp is not None else (0, 0, 0)),
        weights.group_n,
        weights.group_k,
        float(weights.zero_default),
        MODE=weights.mode,
        INT4=weights.int4,
        HAS_ZP=zp is not None,
        ZP_INT4=weights.zero_points_int4,
        ROUND=_ROUND[weights.round_to],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
