"""A Triton kernel for the GPU side of the Marlin MoE reference: each output row's float32 product read straight
from the Marlin-packed codes and stored scales, with no dense weight in memory (imported only where Triton and a
GPU are; :mod:`.marlin_rows` decides and launches).

One program computes ``BLOCK_M`` rows (consecutive in the grouped order, all of one expert) by ``BLOCK_N`` columns
over one split of K's 16-row Marlin tiles, and stores that partial sum at the rows' places in the grouped order,
counted from ``row_base`` (the host adds the splits in order and puts the rows where they belong). A code's
byte in a packed tile is ``column_entries[n % 64] + row_entries[k % 16]`` (``byte · 8 + bit shift``: the tile
permutation separates into a column part and a row part); the code (a nibble or the byte) is looked up in ``lut``
for its exact value. The column's scale is read from the stored scales at its stored column (``columns``), decoded
through ``scale_lut`` (byte formats) or converted from float16/bfloat16, and multiplied by the expert's
``multipliers`` entry; the weight is ``value · scale`` (``value · scale + offset`` with integer zero points,
``offset = −zero · scale`` from the host) — the float32 operations the dense decoder applies to that element, so
every weight is the dense decoder's. Each output element is an explicit chain of IEEE float32 fused multiply-adds
into a tile sum (rows k in order; 4-bit: rows k and k + 8 share a byte and go in pairs, 0, 8, 1, 9, …), added to
the split's total tile by tile: the same operations whichever other rows share its program, so a row's value does not depend on the other
rows of the call.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def marlin_rows(
    x_ptr,
    stride_xm,
    stride_xk,
    src_ptr,
    row_base,
    out_ptr,
    stride_os,
    stride_om,
    w_ptr,
    column_entries_ptr,
    row_entries_ptr,
    lut_ptr,
    scale_ptr,
    stride_se,
    stride_sg,
    stride_sn,
    columns_ptr,
    scale_lut_ptr,
    multipliers_ptr,
    offset_ptr,
    tiles_ptr,
    k_tiles,
    tiles_per_split,
    n_tiles,
    N,
    groups,
    group_tiles,
    FOUR_BIT: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    TILE_BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    split = tl.program_id(2)
    start = tl.load(tiles_ptr + t * 4)
    count = tl.load(tiles_ptr + t * 4 + 1)
    expert = tl.load(tiles_ptr + t * 4 + 2)
    position = tl.load(tiles_ptr + t * 4 + 3)
    m = tl.arange(0, BLOCK_M)
    row_ok = m < count
    src = tl.load(src_ptr + start + m, mask=row_ok, other=0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    column_bytes = (n // 64).to(tl.int64) * TILE_BYTES + (tl.load(column_entries_ptr + n % 64) >> 3)
    columns = tl.load(columns_ptr + n, mask=n_ok, other=0)
    multiplier = tl.load(multipliers_ptr + expert)
    scale_row = scale_ptr + expert * stride_se + columns * stride_sn
    offset_row = offset_ptr + position * groups * N + n
    x_rows = x_ptr + src * stride_xm
    w_expert = w_ptr + expert * k_tiles * n_tiles * TILE_BYTES
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_first = split * tiles_per_split
    k_last = tl.minimum(k_first + tiles_per_split, k_tiles)
    for kt in range(k_first, k_last):
        group = kt // group_tiles
        if SCALE_BYTES:
            raw = tl.load(scale_row + group * stride_sg, mask=n_ok, other=0).to(tl.int32)
            scale = tl.load(scale_lut_ptr + raw) * multiplier
        else:
            scale = tl.load(scale_row + group * stride_sg, mask=n_ok, other=0.0).to(tl.float32) * multiplier
        if HAS_OFFSET:
            offset = tl.load(offset_row + group * N, mask=n_ok, other=0.0)
        tile = w_expert + kt * n_tiles * TILE_BYTES + column_bytes  # one expert: < 2**31 bytes
        x_tile = x_rows + tl.cast(kt, tl.int64) * 16 * stride_xk
        tile_sum = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if FOUR_BIT:
            for kk in tl.static_range(8):
                low_entry = tl.load(row_entries_ptr + kk)
                high_entry = tl.load(row_entries_ptr + kk + 8)  # the same byte (the host checks)
                byte = tl.load(tile + (low_entry >> 3), mask=n_ok, other=0).to(tl.int32)
                low = tl.load(lut_ptr + ((byte >> (low_entry & 7)) & 0xF))
                high = tl.load(lut_ptr + ((byte >> (high_entry & 7)) & 0xF))
                if HAS_OFFSET:
                    w_low = low * scale + offset
                    w_high = high * scale + offset
                else:
                    w_low = low * scale
                    w_high = high * scale
                x_low = tl.load(x_tile + kk * stride_xk, mask=row_ok, other=0.0).to(tl.float32)
                x_high = tl.load(x_tile + (kk + 8) * stride_xk, mask=row_ok, other=0.0).to(tl.float32)
                tile_sum = tl.fma(x_low[:, None], w_low[None, :], tile_sum)
                tile_sum = tl.fma(x_high[:, None], w_high[None, :], tile_sum)
        else:
            for kk in tl.static_range(16):
                entry = tl.load(row_entries_ptr + kk)
                byte = tl.load(tile + (entry >> 3), mask=n_ok, other=0).to(tl.int32)
                value = tl.load(lut_ptr + byte)
                if HAS_OFFSET:  # noqa: SIM108 - a compile-time branch of the kernel
                    weight = value * scale + offset
                else:
                    weight = value * scale
                x = tl.load(x_tile + kk * stride_xk, mask=row_ok, other=0.0).to(tl.float32)
                tile_sum = tl.fma(x[:, None], weight[None, :], tile_sum)
        total += tile_sum
    local = (start - row_base + m).to(tl.int64)  # the row's place in this launch's range of the grouped order
    out = out_ptr + split.to(tl.int64) * stride_os + local[:, None] * stride_om + n[None, :]
    tl.store(out, total, mask=row_ok[:, None] & n_ok[None, :])
