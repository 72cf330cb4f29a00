"""Dense float32 expert weights from their stored codes in one pass, for the Triton fused MoE reference on a GPU.

The torch path (``w8a8_weight``, ``wna16_weight`` in :mod:`moereplay.reference.fused_moe_triton`) converts the used
experts' codes to float32 and then applies scales, zero points and the rounding through the compute dtype in
further passes over those float32 weights: DeepSeek-V3 fp8 block-128 at 32 used experts writes 3.8 GB of float32
twice, int4 weight-only makes five passes. :class:`QuantizedWeights` describes the stored weights instead, and
:func:`dequant_dense` writes the same dense weights reading the codes once and writing each float32 once (one
Triton kernel, :mod:`moereplay.reference.dequant_kernel`): each element gets the same float32 operations, in the
same order, as the torch path gives it, so the weights are the same bits (``tests/gpu/test_dequant_dense_gpu.py``
compares them for every format) and the products that follow — cuBLAS's float32 ``bmm``, unchanged — are too.

Used on CUDA devices with Triton present (:data:`FUSED_DEVICE_TYPES`; ``MOEREPLAY_REFERENCE_FUSED=0`` turns it
off); elsewhere the torch path runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from moereplay.errors import ReferenceError_

FUSED_DEVICE_TYPES = frozenset({"cuda"})
"""Device types whose reference dequantises with the one-pass kernel (when Triton imports)."""

_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def to_device_async(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a wait: copied from pinned memory (a copy from pageable memory waits
    for the device's queue to drain first)."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class QuantizedWeights:
    """Stored weights ``codes`` (``[E, N, K]``; int4: ``[E, N, K / 2]`` bytes) and how a weight ``(e, n, k)``
    becomes float32: ``mode`` 0 the code; 1 the code times ``scale[e, n // group_n, k // group_k]``; 2 ``(code −
    zero) · scale`` rounded through ``round_to``, ``zero`` from ``zero_points`` (int4: nibble ``n % 2`` of
    ``[e, n // 2, g]``) or ``zero_default``. ``scale`` and ``zero_points`` are 3-D views (stride 0 along an
    absent dimension)."""

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

    def __post_init__(self) -> None:
        if self.mode not in (0, 1, 2):
            raise ReferenceError_(
                f"mode must be 0 (codes), 1 (times a scale) or 2 (zero point and rounding), not {self.mode}"
            )
        if self.mode and (self.scale is None or self.scale.dim() != 3):
            raise ReferenceError_(f"mode {self.mode} needs a 3-D scale view")
        if self.group_n < 1 or self.group_k < 1:
            raise ReferenceError_(f"groups must be positive, got {self.group_n} x {self.group_k}")
        if self.zero_points is not None and (self.mode != 2 or self.zero_points.dim() != 3):
            raise ReferenceError_("zero points need mode 2 and a 3-D view")

    @property
    def k(self) -> int:
        return int(self.codes.shape[2]) * (2 if self.int4 else 1)


SWITCH_VARIABLE = "MOEREPLAY_REFERENCE_FUSED"
"""``0`` keeps the torch passes on every device (to compare, or to rule the kernel out)."""


def available(device: torch.device, environ: Mapping[str, str] | None = None) -> bool:
    """Whether weights on ``device`` may be dequantised by the kernel: a CUDA device, Triton importable, not
    switched off (``environ``: default ``os.environ``, read when called)."""
    environment = os.environ if environ is None else environ
    if device.type not in FUSED_DEVICE_TYPES or environment.get(SWITCH_VARIABLE, "1").strip() == "0":
        return False
    try:
        from moereplay.reference import dequant_kernel  # noqa: F401
    except ImportError:
        return False
    return True


def usable(weights: QuantizedWeights) -> bool:
    """Whether the kernel reads these weights as they are stored: one byte per packed code, a rounding dtype it
    knows, 3-D codes."""
    if weights.int4 and weights.codes.element_size() != 1:
        return False
    zero_points = weights.zero_points
    if zero_points is not None and weights.zero_points_int4 and zero_points.element_size() != 1:
        return False
    return weights.round_to in _ROUND and weights.codes.dim() == 3


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)


BLOCK_N, BLOCK_K = 16, 256
"""Tile of one program: 4,096 weights, K contiguous (coalesced loads of the codes and stores of the floats)."""


def dequant_dense(weights: QuantizedWeights, experts: Sequence[int]) -> torch.Tensor:
    """Float32 ``[len(experts), N, K]``: the dequantised weights of ``experts`` (ids), contiguous. Cost: one
    launch (plus one small host-to-device copy of the ids); the experts' codes and scales read once, each float
    written once."""
    from moereplay.reference.dequant_kernel import dequant_dense as kernel
    from moereplay.reference.launch import launch

    codes = _bytes(weights.codes) if weights.int4 else weights.codes
    device = codes.device
    N, K = int(codes.shape[1]), weights.k
    out = torch.empty((len(experts), N, K), dtype=torch.float32, device=device)
    if out.numel() == 0:
        return out
    ids = to_device_async(torch.tensor([int(e) for e in experts], dtype=torch.int64), device)
    scale = weights.scale
    zero_points = weights.zero_points
    if zero_points is not None and weights.zero_points_int4:
        zero_points = _bytes(zero_points)
    grid = (len(experts), -(-N // BLOCK_N), -(-K // BLOCK_K))
    launch(
        kernel,
        grid,
        codes,
        out,
        ids,
        scale if scale is not None else codes,  # never read in mode 0
        zero_points if zero_points is not None else codes,  # never read without zero points
        N,
        K,
        *codes.stride(),
        *out.stride(),
        *(scale.stride() if scale is not None else (0, 0, 0)),
        *(zero_points.stride() if zero_points is not None else (0, 0, 0)),
        weights.group_n,
        weights.group_k,
        float(weights.zero_default),
        MODE=weights.mode,
        INT4=weights.int4,
        HAS_ZP=zero_points is not None,
        ZP_INT4=weights.zero_points_int4,
        ROUND=_ROUND[weights.round_to],
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=4,
    )
    return out
