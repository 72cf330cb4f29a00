"""A Triton kernel for the GPU side of the Marlin MoE reference: each output row's float32 product read straight
from the Marlin-packed codes and stored scales, with no dense weight in memory (imported only where Triton and a
GPU are; :mod:`.marlin_rows` decides and launches).

One program computes ``BLOCK_M`` rows (consecutive in the grouped order, all of one expert) by ``BLOCK_N`` columns,
one 16-row Marlin tile of K at a time. Each column's byte in the packed tile comes from ``table`` (``byte · 8 +
bit shift``, the tile permutation); the code (a nibble or the byte) is looked up in ``lut`` for its exact value.
The column's scale is read from the stored scales at its stored column (``columns``), decoded through
``scale_lut`` (byte formats) or converted from float16/bfloat16, and multiplied by the expert's ``multipliers``
entry; the weight is ``value · scale`` (``value · scale + offset`` with integer zero points, ``offset = −zero ·
scale`` from the host) — the float32 operations the dense decoder applies to that element, so every weight is the
dense decoder's. The tile's product is an IEEE float32 ``tl.dot`` (fused multiply-adds, k in order, no TF32) added
to the row's total, tiles in order: each output element gets the same operations whichever other rows share its
program, so a row's value does not depend on the other rows of the call.
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
    dst_ptr,
    out_ptr,
    stride_om,
    w_ptr,
    table_ptr,
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
    start = tl.load(tiles_ptr + t * 4)
    count = tl.load(tiles_ptr + t * 4 + 1)
    expert = tl.load(tiles_ptr + t * 4 + 2)
    position = tl.load(tiles_ptr + t * 4 + 3)
    m = tl.arange(0, BLOCK_M)
    row_ok = m < count
    src = tl.load(src_ptr + start + m, mask=row_ok, other=0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, 16)
    entries = tl.load(table_ptr + kk[:, None] * 64 + (n % 64)[None, :])
    byte_offsets = (n // 64).to(tl.int64)[None, :] * TILE_BYTES + (entries >> 3)
    shifts = entries & 7
    columns = tl.load(columns_ptr + n, mask=n_ok, other=0)
    multiplier = tl.load(multipliers_ptr + expert)
    scale_row = scale_ptr + expert * stride_se + columns * stride_sn
    offset_row = offset_ptr + position * groups * N + n
    x_rows = x_ptr + src * stride_xm
    w_expert = w_ptr + expert * k_tiles * n_tiles * TILE_BYTES
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, k_tiles):
        group = kt // group_tiles
        if SCALE_BYTES:
            raw = tl.load(scale_row + group * stride_sg, mask=n_ok, other=0).to(tl.int32)
            scale = tl.load(scale_lut_ptr + raw) * multiplier
        else:
            scale = tl.load(scale_row + group * stride_sg, mask=n_ok, other=0.0).to(tl.float32) * multiplier
        tile_bytes = w_expert + kt * n_tiles * TILE_BYTES  # one expert: < 2**31 bytes
        byte = tl.load(tile_bytes + byte_offsets, mask=n_ok[None, :], other=0).to(tl.int32)
        if FOUR_BIT:  # noqa: SIM108 - a compile-time branch of the kernel
            code = (byte >> shifts) & 0xF
        else:
            code = byte
        value = tl.load(lut_ptr + code)
        if HAS_OFFSET:
            offset = tl.load(offset_row + group * N, mask=n_ok, other=0.0)
            weight = value * scale[None, :] + offset[None, :]
        else:
            weight = value * scale[None, :]
        x = tl.load(
            x_rows[:, None] + (kt * 16 + kk)[None, :] * stride_xk, mask=row_ok[:, None], other=0.0
        ).to(tl.float32)
        total += tl.dot(x, weight, input_precision="ieee")
    dst = tl.load(dst_ptr + start + m, mask=row_ok, other=0)
    tl.store(out_ptr + dst[:, None] * stride_om + n[None, :], total, mask=row_ok[:, None] & n_ok[None, :])
