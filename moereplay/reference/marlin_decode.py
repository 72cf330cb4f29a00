"""Fast exact decoding of Marlin-packed MoE experts to dense float32: the hot path of the Marlin reference.

The general decoder (``MarlinExpertWeights.dequantize_general``) splits codes, permutes them to the logical
``[K, N]`` order, looks every code up through an int64 index and multiplies the scales in: about ten passes over
``experts * K * N`` elements, several of them 8 bytes wide. At gpt-oss shapes (32 experts, 2880 x 5888) that is
tens of gigabytes of memory traffic, far more than the GEMM that follows. This module computes the same numbers in
three narrow passes, each reading and writing contiguous runs:

1. the packed bytes are read through :func:`marlin_layout.logical_byte_view` — undoing Marlin's tile permutation
   on 1-byte data, the cheapest place to do it — into an int32 index (4-bit formats) or straight into values
   (8-bit formats);
2. 4-bit formats: two gathers from 256-entry tables (the value of a byte's low nibble, of its high nibble) write
   the values of rows k and k + 8 of every 16-row tile (bfloat16 on GPUs, float32 on the CPU:
   :func:`value_dtype`);
3. one pass writes ``value * scale`` — with integer zero points ``q*s + (-z*s)`` — as float32 into the caller's
   output, in logical order.

Exactness: every value is exact in bfloat16 (e2m1: ≤2 significant bits; e4m3: 4; integer codes minus their
bias: ≤8), and each output element is the same single product the general decoder rounds (``q*s - z*s`` is exact
in float32 because both terms are exact multiples of the scale's last bit and shorter than 24 bits), so the result
is bit-identical to the general decoder's (NaN payloads aside); the unit tests check that. Act order and float zero
points stay with the general decoder. Temporaries: 4 bytes per weight element of the chunk being decoded.
"""

from __future__ import annotations

import functools
import sys

import torch

from moereplay.errors import ReferenceError_
from moereplay.reference import marlin_layout as layout
from moereplay.reference.numerics import E2M1_VALUES

#: Every Marlin MoE weight tile is 16 rows of K (16-bit activations): scale groups are whole tiles or more.
TILE_K = 16


def value_dtype(device: torch.device) -> torch.dtype:
    """The dtype decoded values travel in before the scale pass: bfloat16 on GPUs (half the bytes; the kernels
    convert on the fly), float32 on the CPU, whose mixed-dtype elementwise ops would convert in an extra pass."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


@functools.cache
def code_values(kind: str) -> torch.Tensor:
    """float32 on the CPU: the exact value of every code of ``kind`` — 16 entries for the 4-bit kinds (``"e2m1"``,
    ``"uint4b8"``: q - 8, ``"uint4"``: q), 256 for the 8-bit ones (``"e4m3"``, ``"uint8b128"``: q - 128)."""
    if kind == "e2m1":
        return torch.tensor(E2M1_VALUES, dtype=torch.float32)
    if kind in ("uint4b8", "uint4"):
        return torch.arange(16, dtype=torch.float32) - (8 if kind == "uint4b8" else 0)
    if kind == "e4m3":
        return (
            torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        )
    if kind == "uint8b128":
        return torch.arange(256, dtype=torch.float32) - 128
    raise ReferenceError_(f"no code values for {kind!r}")


@functools.cache
def _nibble_tables(kind: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[256] tables: byte → value of its low nibble, byte → value of its high nibble (:func:`value_dtype`)."""
    values = code_values(kind).to(value_dtype(device))
    byte = torch.arange(256)
    return values[byte & 0x0F].to(device), values[byte >> 4].to(device)


SLICE_ELEMENTS = {"cpu": 1 << 20}
"""Dense elements decoded per pass, per device type (the CPU's: 4 MB of float32, about 8 MB of temporaries); other
devices decode whole experts (fewer launches)."""


def slice_rows(size_k: int, group_rows: int, size_n: int, device: torch.device) -> int:
    """Rows of K to decode per pass: ``size_k`` when the device decodes whole experts, else whole 16-row tiles
    aligned with the scale groups (a multiple of ``group_rows``, or a divisor of it) of about
    :data:`SLICE_ELEMENTS` elements."""
    budget = SLICE_ELEMENTS.get(device.type)
    if budget is None or size_k * size_n <= budget:
        return size_k
    tiles = max(1, budget // (size_n * TILE_K))
    group_tiles = max(1, group_rows // TILE_K)
    if tiles >= group_tiles:
        return tiles // group_tiles * group_tiles * TILE_K
    return max(d for d in range(1, tiles + 1) if group_tiles % d == 0) * TILE_K


def logical_values(b_qweight: torch.Tensor, num_bits: int, kind: str) -> torch.Tensor:
    """Marlin-packed ``int32[e, K/16, N*16/pack]`` → values ``[e, K/16, a, b, N]`` in logical order, as
    :func:`value_dtype` (every value is exact in it).

    Row ``k`` of tile ``t`` is ``[:, t, k // b, k % b]``; the result may be a (dense, permuted) view. ``kind``:
    ``"e2m1"``, ``"uint4b8"`` (q - 8), ``"uint4"`` (raw q) for 4-bit codes; ``"e4m3"`` or ``"uint8b128"``
    (q - 128) for 8-bit codes.
    """
    if sys.byteorder != "little":  # pragma: no cover
        raise ReferenceError_("the Marlin decoder assumes a little-endian machine")
    experts, rows, cols = b_qweight.shape
    k, n = rows * 16, cols * (32 // num_bits) // 16
    kt, nt = k // TILE_K, n // 64
    data = b_qweight.contiguous().view(torch.uint8).reshape(experts, kt, nt, -1)
    in_order = layout.logical_byte_view(data, num_bits)  # [e, Kt, k digits, Nt, n digits] of bytes
    if num_bits == 4:
        index = torch.empty(in_order.shape, dtype=torch.int32, device=data.device).copy_(in_order).reshape(-1)
        low, high = _nibble_tables(kind, b_qweight.device)
        values = torch.empty((2, index.numel()), dtype=low.dtype, device=data.device)
        torch.index_select(low, 0, index, out=values[0])
        torch.index_select(high, 0, index, out=values[1])
        # [nibble, e, Kt, 8 rows, N] → [e, Kt, nibble, 8, N]: row k of a tile is (k // 8, k % 8)
        return values.view(2, experts, kt, TILE_K // 2, n).permute(1, 2, 0, 3, 4)
    out = torch.empty(in_order.shape, dtype=value_dtype(data.device), device=data.device)
    if kind == "e4m3":
        out.copy_(in_order.view(torch.float8_e4m3fn))
    elif kind == "uint8b128":
        bias = torch.full((1,) * in_order.dim(), 128, dtype=torch.int16, device=data.device)  # no uint8 wrap
        torch.sub(in_order, bias, out=out)
    else:  # pragma: no cover - callers pass one of the above
        raise ReferenceError_(f"no 8-bit decoding for {kind!r}")
    return out.view(experts, kt, 1, TILE_K, n)


def dequantize_into(
    out: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
) -> None:
    """Write ``values * scales`` (``(values - zero_points) * scales``) into ``out`` float32 ``[e, K, N]``.

    ``values``: ``[e, K/16, a, b, N]`` (:func:`logical_values`); ``scales`` (and integer
    ``zero_points``): float32 logical ``[e, G, N]`` with ``K / G`` a multiple of 16. One pass over ``out``.
    """
    experts, k, n = out.shape
    groups = scales.shape[1]
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ReferenceError_("dequantize_into needs a contiguous float32 output")
    if k % groups or (k // groups) % TILE_K:
        raise ReferenceError_(f"scale groups of {k // max(groups, 1)} rows are not whole {TILE_K}-row tiles")
    tiles_per_group = k // groups // TILE_K
    a, b = values.shape[2], values.shape[3]
    source = values.unflatten(1, (groups, tiles_per_group))
    target = out.view(experts, groups, tiles_per_group, a, b, n)
    scale_view = scales.reshape(experts, groups, 1, 1, 1, n)
    if zero_points is None:
        torch.mul(source, scale_view, out=target)
        return
    offset = (-zero_points * scales).reshape(experts, groups, 1, 1, 1, n)
    torch.addcmul(offset, source, scale_view, out=target)
