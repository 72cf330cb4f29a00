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

Exact products (:func:`exact_matmul_into`): when no partial sum of ``x · W`` can round in float64 — checked from the
exponents of ``x`` and of the weights its scale bytes give — the product has the same bits in any summation order,
so it is computed a slice of weight columns at a time (decoded two values a byte, multiplied while in cache), with
no dense copy of the expert.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

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


# --------------------------------------------------------------------------------------------------------------
# products that are exact: any summation order gives their bits
# --------------------------------------------------------------------------------------------------------------

EXACT_CHUNK_ELEMENTS = 1 << 19
"""Dense weight elements decoded per product of :func:`exact_matmul_into` (4 MB of float64: a slice of weight
columns that stays in cache between its decode and its product)."""


ColumnBytes = Callable[[int, int], torch.Tensor]
"""``(first, width)`` → the packed bytes of weight columns ``first … first + width − 1``, transposed: uint8
``[width, K/2]`` (any strides)."""


def packed_columns(packed: torch.Tensor) -> ColumnBytes:
    """The :data:`ColumnBytes` of one expert's packed ``[K/2, N]`` bytes (views, no copy)."""
    rows_of = packed.mT
    return lambda first, width: rows_of[first : first + width]


def exact_matmul_into(
    out: torch.Tensor,
    x: torch.Tensor,
    columns: ColumnBytes,
    scales: torch.Tensor,
    k: int,
    *,
    align: int = 1,
) -> bool:
    """``out[:] = x @ W`` for the float64 ``[K, N]`` weight ``W`` that :func:`dense_experts_float64` decodes from
    one expert's packed bytes (read a slice of columns at a time through ``columns``, :data:`ColumnBytes`) and
    ``scales`` ``[ceil(K/32), N]`` (``x``: float64 ``[R, K]``, ``out``: float64 ``[R, N]``) — when the product is
    exact; then it returns True. Otherwise it returns False and ``out`` holds no answer (the caller multiplies the
    dense weight as before).

    Exact means every product ``x[r, k] · W[k, n]`` and every partial sum of them is a float64 number: each is an
    integer multiple of ``2**q`` — ``q`` the lowest set bit of any nonzero ``x`` entry plus that of any weight its
    scale bytes can give — below ``2**(q + 53)`` in magnitude, which :func:`_sums_are_exact` checks from the
    entries' exponents (all of them finite). Then every summation order — a BLAS kernel's for the whole ``[K, N]``
    weight, or this function's for ``N`` in slices — rounds nowhere and gives the same bits; a zero sum is ``+0``
    in any order unless all its products are zeros, the one case left to the caller (its sign is the kernel's).
    So the weight is decoded a slice of columns at a time (:data:`EXACT_CHUNK_ELEMENTS`, a multiple of ``align``
    columns), never whole: the dense weight of a gpt-oss expert is 133 MB.

    Layout: a slice ``W[:, n0:n1]`` is decoded transposed, ``[n, K]`` with ``K`` contiguous, by one gather of two
    values (a byte's two nibbles) per byte from a complex128 view of :func:`pair_table`."""
    groups, n = scales.shape
    byte_rows = k // 2
    if k % 2 or groups != -(-k // MX_GROUP) or tuple(x.shape) != (out.shape[0], k) or out.shape[1] != n:
        raise ValueError(
            f"cannot multiply {tuple(x.shape)} rows by K = {k} with {tuple(scales.shape)} scales"
        )
    if not _sums_are_exact(x, scales, k):
        return False
    device = scales.device
    step = max(align, EXACT_CHUNK_ELEMENTS // k // align * align)
    whole = byte_rows // 16
    index = torch.empty((min(step, n), byte_rows), dtype=torch.int32, device=device)
    shifts = torch.empty((min(step, n), groups), dtype=torch.int32, device=device)
    pairs = torch.empty((min(step, n), byte_rows), dtype=torch.complex128, device=device)
    product = torch.empty((x.shape[0], min(step, n)), dtype=torch.float64, device=device)
    table = _pair_values(device)
    for first in range(0, n, step):
        width = min(step, n - first)
        chunk = index[:width]
        packed = columns(first, width)
        if tuple(packed.shape) != (width, byte_rows) or packed.dtype != torch.uint8:
            raise ValueError(f"columns {first}.. of K = {k} are not uint8 [{width}, {byte_rows}]")
        shifted = shifts[:width]
        shifted.copy_(scales[:, first : first + width].mT).mul_(256)  # [n, G]: scale byte · 256 (int32)
        if whole:
            torch.add(
                packed[:, : 16 * whole].unflatten(1, (whole, 16)),
                shifted[:, :whole, None],
                out=chunk[:, : 16 * whole].unflatten(1, (whole, 16)),
            )
        if 16 * whole < byte_rows:
            torch.add(
                packed[:, 16 * whole :],
                shifted[:, whole : whole + 1],
                out=chunk[:, 16 * whole :],
            )
        del packed
        weights = pairs[:width]
        torch.index_select(table, 0, chunk.view(-1), out=weights.view(-1))
        dense = torch.view_as_real(weights).view(width, k)  # [n, K]: W[:, first:first + width] transposed
        result = product[:, :width]
        torch.mm(x, dense.mT, out=result)
        if not _zeros_have_products(result, x, dense):
            return False
        out[:, first : first + width] = result
    return True


@functools.cache
def _pair_values(device: torch.device) -> torch.Tensor:
    """complex128 ``[65536]``: entry ``scale_byte · 256 + packed_byte`` holds the byte's low-nibble value (real)
    and high-nibble value (imaginary), the bits of :func:`pair_table`."""
    table = pair_table(device)
    return torch.view_as_complex(torch.stack((table[:_HIGH], table[_HIGH:]), dim=-1))


@functools.cache
def _scale_ranges(device: torch.device) -> torch.Tensor:
    """int64 ``[256, 3]``: per scale byte, whether every weight it gives is finite (1/0), the largest exponent
    ``e`` with ``|w| < 2**e`` over its weights, and the lowest set bit of any nonzero one (read off
    :func:`pair_table`, so the bound is on the values the decoder writes)."""
    table = pair_table(device).view(2, 256, 256)  # [nibble, scale byte, packed byte]
    values = torch.cat((table[0, :, :16], table[1, :, ::16]), dim=1)  # every code, as either nibble
    finite = torch.isfinite(values).all(dim=1)
    nonzero = values != 0
    safe = torch.where(nonzero & torch.isfinite(values), values, torch.ones_like(values))
    _, top = torch.frexp(safe)
    low = _lowest_bits(safe)
    high = torch.where(nonzero, top, torch.full_like(top, -(1 << 20))).amax(dim=1)
    lowest = torch.where(nonzero, low, torch.full_like(low, 1 << 20)).amin(dim=1)
    return torch.stack((finite.to(torch.int64), high.to(torch.int64), lowest.to(torch.int64)), dim=1)


def _lowest_bits(values: torch.Tensor) -> torch.Tensor:
    """The exponent of the lowest set bit of each float64 value (nonzero, finite): ``v = m · 2**that`` with ``m``
    an odd integer."""
    mantissa, exponent = torch.frexp(values)
    integer = torch.ldexp(mantissa, torch.tensor(53, dtype=torch.int32, device=values.device)).to(torch.int64)
    _, bit = torch.frexp((integer & -integer).to(torch.float64))  # 2**j → exponent j + 1
    return exponent.to(torch.int64) - 54 + bit.to(torch.int64)


def _sums_are_exact(x: torch.Tensor, scales: torch.Tensor, k: int) -> bool:
    """Whether every partial sum of ``x[r, :] · W[:, n]`` products is a float64 number (see
    :func:`exact_matmul_into`): all of ``x`` and of the weights the used scale bytes give finite, and
    ``⌈log2 K⌉ + (top of x) + (top of W) ≤ (lowest bit of x) + (lowest bit of W) + 53``."""
    if not bool(torch.isfinite(x).all()):
        return False
    nonzero = x[x != 0]
    if nonzero.numel() == 0:
        return False  # every sum is one of zeros: its sign is the kernel's
    _, top = torch.frexp(nonzero.abs().max())
    x_top, x_low = int(top), int(_lowest_bits(nonzero).min())
    used = torch.bincount(scales.reshape(-1).to(torch.int64), minlength=256) > 0
    ranges = _scale_ranges(scales.device)[used]
    if not bool(ranges[:, 0].all()):
        return False
    w_top, w_low = int(ranges[:, 1].max()), int(ranges[:, 2].min())
    if w_low > w_top:  # every weight is zero: every sum is one of zeros
        return False
    return (k - 1).bit_length() + x_top + w_top <= x_low + w_low + 53


def _zeros_have_products(result: torch.Tensor, x: torch.Tensor, columns: torch.Tensor) -> bool:
    """Whether each zero of ``result`` (``x @ columns.mT``) sums at least one nonzero product: then it is ``+0``
    whatever the summation order; a sum of zeros only is ``±0`` as the kernel makes it."""
    zeros = (result == 0).nonzero()
    if zeros.numel() == 0:
        return True
    rows, cols = zeros.unbind(1)
    return bool(((x[rows] != 0) & (columns[cols] != 0)).any(dim=1).all())
