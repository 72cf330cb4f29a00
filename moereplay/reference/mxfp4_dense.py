"""MXFP4 expert weights to dense float64, a run of experts at a time, by one table gather per weight element.

The ``matmul_ogs`` reference multiplies in float64 by weights that are the float32 products ``e2m1 value × e8m0
scale`` (:func:`moereplay.reference.matmul_ogs.dequantize_expert_weight`) widened to float64. Those products take
only ``256 scale bytes × 16 codes`` values, so this module computes each of them once — on the weights' device,
with the same float32 multiplication, so overflow to ±Inf at the largest scales, NaN for scale 0xff and NaN
payloads come out as that device makes them — widens them to float64, and writes each dense weight element as one
lookup of ``(scale byte, packed byte, nibble)``. The result is bit-identical to
``dequantize_expert_weight(...).to(torch.float64)``, expert by expert.

Layout: ``packed`` is uint8 ``[experts, K/2, N]`` (byte ``(kb, n)`` holds K rows ``2kb`` in its low nibble and
``2kb + 1`` in its high nibble; any strides, e.g. the transposed view an unswizzle returns), ``scales`` uint8
``[experts, ceil(K/32), N]``. Cost per weight element: one int32 index written and read, one float64 written;
temporaries are bounded by :data:`SLICE_ELEMENTS` whatever the expert size (the dense output itself is the
caller's: ``8 · experts · K · N`` bytes).
"""

from __future__ import annotations

import functools

import torch

from moereplay.reference.numerics import decode_e2m1_codes, decode_e8m0

MX_GROUP = 32
SLICE_ELEMENTS = {"cpu": 1 << 21, "cuda": 1 << 28}
"""Dense elements written per table gather, per device type: on the CPU small slices keep the int32 index
temporaries at 8 MB (and in cache); on a GPU a whole run of experts goes in one gather (a few launches, not a few
per expert and slice), its index temporaries 12 bytes per element."""
_HIGH = 1 << 16
"""Offset of the high-nibble half of the table."""


@functools.cache
def pair_table(device: torch.device) -> torch.Tensor:
    """float64 ``[2 · 65536]``: entry ``nibble · 65536 + scale_byte · 256 + packed_byte`` is the float32 product
    ``e2m1(code) × e8m0(scale_byte)`` (code: the byte's low nibble for ``nibble`` 0, high for 1), widened."""
    codes = torch.arange(256, device=device)
    values = torch.stack((decode_e2m1_codes(codes & 0xF), decode_e2m1_codes(codes >> 4)))  # [2, 256]
    factors = decode_e8m0(torch.arange(256, dtype=torch.uint8, device=device))  # [256]
    products = values[:, None, :] * factors[None, :, None]  # value × factor, as the dequantisation multiplies
    return products.to(torch.float64).reshape(-1)


def dense_experts_float64(
    packed: torch.Tensor, scales: torch.Tensor, k: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """float64 ``[experts, K, N]`` from packed e2m1 bytes ``[experts, K/2, N]`` and e8m0 scale bytes
    ``[experts, ceil(K/32), N]`` (uint8; ``K`` even), on their device; written into ``out`` when given (a buffer
    kept between calls saves the page faults of a fresh one)."""
    experts, byte_rows, n = packed.shape
    if k % 2 or byte_rows != k // 2 or tuple(scales.shape) != (experts, -(-k // MX_GROUP), n):
        raise ValueError(
            f"cannot decode [{experts}, {byte_rows}, {n}] bytes with {tuple(scales.shape)} scales"
        )
    device = packed.device
    if out is None:
        out = torch.empty((experts, k, n), dtype=torch.float64, device=device)
    if out.numel() == 0:
        return out
    budget = SLICE_ELEMENTS.get(device.type, SLICE_ELEMENTS["cuda"])
    if out.numel() <= budget:  # the whole run at once
        _decode(out, packed, scales.to(torch.int32) * 256, 0)
        return out
    # byte rows per slice: whole scale groups (16 byte rows each), about `budget` dense elements
    step = max(16, (budget // (2 * n)) // 16 * 16)
    for expert in range(experts):
        shifted = scales[expert : expert + 1].to(torch.int32) * 256
        for first in range(0, byte_rows, step):
            rows = min(step, byte_rows - first)
            target = out[expert : expert + 1, 2 * first : 2 * (first + rows)]
            _decode(target, packed[expert : expert + 1, first : first + rows], shifted, first)
    return out


def _decode(out: torch.Tensor, packed: torch.Tensor, shifted: torch.Tensor, first: int) -> None:
    """Dense rows ``2·first …`` into ``out`` (float64 ``[e, 2·rows, N]``, each expert's rows contiguous) from the
    byte rows ``first …`` (``packed``: ``[e, rows, N]``; ``shifted``: the experts' ``[e, G, N]`` scale bytes ×
    256). Byte row ``kb`` reads scale group ``kb // 16``; its index is ``scale · 256 + byte`` (low nibble) and that
    plus 65536 (high nibble)."""
    experts, rows, n = packed.shape
    codes = packed.to(
        torch.int32, memory_format=torch.contiguous_format
    )  # a contiguous copy: every later pass reads contiguously, same-dtype adds
    index = torch.empty((experts, rows, 2, n), dtype=torch.int32, device=packed.device)
    low = index[:, :, 0]
    whole = rows // 16 * 16
    group = first // 16
    if whole:
        torch.add(
            codes[:, :whole].view(experts, whole // 16, 16, n),
            shifted[:, group : group + whole // 16, None, :],
            out=low[:, :whole].view(experts, whole // 16, 16, n),
        )
    if whole < rows:
        last = group + whole // 16
        torch.add(codes[:, whole:], shifted[:, last : last + 1], out=low[:, whole:])
    torch.add(low, _HIGH, out=index[:, :, 1])
    table = pair_table(packed.device)
    if out.is_contiguous():
        torch.index_select(table, 0, index.view(-1), out=out.view(-1))
    else:  # a slice of one expert's rows: contiguous per expert
        for expert in range(experts):
            torch.index_select(table, 0, index[expert].view(-1), out=out[expert].view(-1))
