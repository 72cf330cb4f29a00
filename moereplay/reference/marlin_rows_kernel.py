"""Triton kernels for the GPU side of the Marlin MoE reference: each output row's float32 product read straight
from the Marlin-packed codes and stored scales, with no dense weight in memory (imported only where Triton and a
GPU are; :mod:`.marlin_rows` decides and launches).

:func:`stage_rows` first writes each row block's activations as float32, K-major (``[K, 16]`` a block, rows past
the block's count zero), so that :func:`marlin_rows` reads a K row's values of two rows with one 8-byte load.
One program of :func:`marlin_rows` computes ``BLOCK_M`` rows (consecutive in the grouped order, all of one expert)
by ``BLOCK_N`` columns over one split of K's 16-row Marlin tiles, and stores that partial sum at the rows' places
in the grouped order, counted from ``row_base`` (the host adds the splits in order and puts the rows where they
belong). A code's bit in a packed tile is ``column_entries[n % 64] + row_entries[k % 16]`` (the tile permutation
separates into a column part and a row part); 4-bit codes are read as 32-bit words (rows 2j, 2j + 1, 2j + 8,
2j + 9 of a column share one) and decoded with integer operations (FP4 E2M1 and the integer kinds) or through
``lut``; 8-bit codes byte by byte through ``lut``. The column's scale is read from the stored scales at its stored
column (``columns``), decoded through ``scale_lut`` (byte formats) or converted from float16/bfloat16, and
multiplied by the expert's multiplier (its ``multipliers`` entry times ``multiplier_factor``, one float32
product); the weight is ``value · scale`` (``value · scale + offset`` with integer zero points, ``offset =
−zero · scale`` from the host) — the float32 operations the dense decoder applies to that element, so every
weight is the dense decoder's. Each output element is an explicit chain of IEEE float32 fused multiply-adds
into a tile sum (rows k in order; 4-bit: rows k and k + 8 share a byte and go in pairs, 0, 8, 1, 9, …), added to
the split's total tile by tile: the same operations whichever other rows share its program, so a row's value does
not depend on the other rows of the call.
"""

from __future__ import annotations

import triton
import triton.language as tl

STAGED_ROWS = tl.constexpr(16)
"""Rows of one staged block of activations (:func:`stage_rows`): at least every ``BLOCK_M``."""


@triton.jit
def stage_rows(x_ptr, stride_xm, stride_xk, src_ptr, tiles_ptr, staged_ptr, K, BLOCK_K: tl.constexpr):
    """The activations of row block ``t`` as float32 ``[K, STAGED_ROWS]`` at ``staged_ptr + t · K · STAGED_ROWS``:
    element ``[k, m]`` is ``x[src[start + m], k]`` for the block's rows, 0 past its ``count`` — so that
    :func:`marlin_rows` reads a K row's values for all its rows in one contiguous, aligned load."""
    t = tl.program_id(0)
    start = tl.load(tiles_ptr + t * 4)
    count = tl.load(tiles_ptr + t * 4 + 1)
    m = tl.arange(0, STAGED_ROWS)
    row_ok = m < count
    src = tl.load(src_ptr + start + m, mask=row_ok, other=0)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = k < K
    x = tl.load(
        x_ptr + src[:, None] * stride_xm + k[None, :] * stride_xk,
        mask=row_ok[:, None] & k_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    staged = staged_ptr + t.to(tl.int64) * K * STAGED_ROWS + k[None, :] * STAGED_ROWS + m[:, None]
    tl.store(staged, x, mask=k_ok[None, :])


@triton.jit
def _halves(pairs):
    """The two float32 values packed in each int64 (low word, high word)."""
    low = pairs.to(tl.int32).to(tl.float32, bitcast=True)
    high = (pairs >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return low, high


@triton.jit
def _value4(code, lut_ptr, DECODE: tl.constexpr, BIAS: tl.constexpr):
    """The exact float32 value of 4-bit codes (int32 0..15): ``DECODE`` 0 looks it up in ``lut_ptr`` (16 floats,
    one cache line); 1 builds FP4 E2M1's bits (sign, exponent e, mantissa m: ``2**(e-1) · (1 + m/2)``, ``m/2`` when
    e = 0); 2 is the integer ``code - BIAS`` (``2**23 + code`` by its bits, then a subtraction; exact)."""
    if DECODE == 1:
        magnitude = code & 7
        normal = (magnitude << 22) + 0x3F000000  # exponent e + 126, mantissa bit m
        bits = tl.where(magnitude >= 2, normal, magnitude * 0x3F000000)  # e = 0: 0.5 or 0
        value = (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)
    elif DECODE == 2:
        value = (code | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + BIAS)
    else:
        value = tl.load(lut_ptr + code)
    return value


@triton.jit
def marlin_rows(
    staged_ptr,
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
    multiplier_factor,
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
    DECODE: tl.constexpr,
    BIAS: tl.constexpr,
    ROW_STEP: tl.constexpr,
    ROW_HALF: tl.constexpr,
):
    tl.static_assert(BLOCK_M % 2 == 0 and BLOCK_M <= STAGED_ROWS, "row blocks are pairs of staged rows")
    t = tl.program_id(0)
    split = tl.program_id(2)
    start = tl.load(tiles_ptr + t * 4)
    count = tl.load(tiles_ptr + t * 4 + 1)
    expert = tl.load(tiles_ptr + t * 4 + 2)
    position = tl.load(tiles_ptr + t * 4 + 3)
    # rows in two halves, even and odd: one 8-byte load of the staged activations gives a row of each
    pair = tl.arange(0, BLOCK_M // 2)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    column_entry = tl.load(column_entries_ptr + n % 64)  # the column's bit in its tile (a whole byte)
    columns = tl.load(columns_ptr + n, mask=n_ok, other=0)
    # one float32 product, as MarlinExpertWeights.all_scale_multipliers makes it
    multiplier = tl.load(multipliers_ptr + expert) * multiplier_factor
    scale_row = scale_ptr + expert * stride_se + columns * stride_sn
    offset_row = offset_ptr + position * groups * N + n
    # staged_ptr is the float32 [K, STAGED_ROWS] block as int64 pairs of rows: K row k of rows 2p, 2p + 1 at k · 8 + p
    x_pairs = staged_ptr + t.to(tl.int64) * k_tiles * (8 * STAGED_ROWS) + pair
    # 4-bit: w_ptr is int32, a tile is TILE_BYTES // 4 words; 8-bit: w_ptr is uint8
    tile_units: tl.constexpr = TILE_BYTES // 4 if FOUR_BIT else TILE_BYTES
    columns_in_tile = (n // 64).to(tl.int64) * tile_units
    w_expert = w_ptr + expert * k_tiles * n_tiles * tile_units
    even = tl.zeros((BLOCK_M // 2, BLOCK_N), dtype=tl.float32)
    odd = tl.zeros((BLOCK_M // 2, BLOCK_N), dtype=tl.float32)
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
        tile = w_expert + kt * n_tiles * tile_units + columns_in_tile  # one expert: < 2**31 bytes
        x_tile = x_pairs + kt * (8 * STAGED_ROWS)
        even_sum = tl.zeros((BLOCK_M // 2, BLOCK_N), dtype=tl.float32)
        odd_sum = tl.zeros((BLOCK_M // 2, BLOCK_N), dtype=tl.float32)
        if FOUR_BIT:
            for j in tl.static_range(4):
                # rows 2j, 2j + 1 (low nibbles) and 2j + 8, 2j + 9 (high nibbles) of a column share one 32-bit
                # word; row 2j + h starts j · ROW_STEP + h · ROW_HALF bits into the tile (the host checks both)
                word = tl.load(tile + (column_entry >> 5) + j * (ROW_STEP // 32), mask=n_ok, other=0)
                for h in tl.static_range(2):
                    kk = 2 * j + h
                    shift = (column_entry + h * ROW_HALF) & 31
                    low = _value4((word >> shift) & 0xF, lut_ptr, DECODE, BIAS)
                    high = _value4((word >> (shift + 4)) & 0xF, lut_ptr, DECODE, BIAS)
                    if HAS_OFFSET:
                        w_low = low * scale + offset
                        w_high = high * scale + offset
                    else:
                        w_low = low * scale
                        w_high = high * scale
                    x_even, x_odd = _halves(tl.load(x_tile + kk * (STAGED_ROWS // 2)))
                    even_sum = tl.fma(x_even[:, None], w_low[None, :], even_sum)
                    odd_sum = tl.fma(x_odd[:, None], w_low[None, :], odd_sum)
                    x_even, x_odd = _halves(tl.load(x_tile + (kk + 8) * (STAGED_ROWS // 2)))
                    even_sum = tl.fma(x_even[:, None], w_high[None, :], even_sum)
                    odd_sum = tl.fma(x_odd[:, None], w_high[None, :], odd_sum)
        else:
            for kk in tl.static_range(16):
                entry = column_entry + tl.load(row_entries_ptr + kk)
                byte = tl.load(tile + (entry >> 3), mask=n_ok, other=0).to(tl.int32)
                value = tl.load(lut_ptr + byte)
                if HAS_OFFSET:  # noqa: SIM108 - a compile-time branch of the kernel
                    weight = value * scale + offset
                else:
                    weight = value * scale
                x_even, x_odd = _halves(tl.load(x_tile + kk * (STAGED_ROWS // 2)))
                even_sum = tl.fma(x_even[:, None], weight[None, :], even_sum)
                odd_sum = tl.fma(x_odd[:, None], weight[None, :], odd_sum)
        even += even_sum
        odd += odd_sum
    # the rows' places in this launch's range of the grouped order
    local = (start - row_base + 2 * pair).to(tl.int64)
    out = out_ptr + split.to(tl.int64) * stride_os + local[:, None] * stride_om + n[None, :]
    n_ok = n_ok[None, :]
    tl.store(out, even, mask=(2 * pair < count)[:, None] & n_ok)
    tl.store(out + stride_om, odd, mask=(2 * pair + 1 < count)[:, None] & n_ok)


@triton.jit
def count_scale_bytes(
    scales_ptr, experts_ptr, per_expert, total_ptr, E8M0_NAN: tl.constexpr, BLOCK: tl.constexpr
):
    """Adds to ``total_ptr`` (int64) how many scale bytes of expert ``experts[program 0]`` (``per_expert`` bytes
    each, contiguous) in this program's block are an NVFP4 scale with the top bit clear and non-zero, or (with
    ``E8M0_NAN``) an e8m0 0xFF: the weight notes' counts in one pass over the bytes, no temporaries."""
    expert = tl.load(experts_ptr + tl.program_id(0))
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < per_expert
    raw = tl.load(scales_ptr + expert * per_expert + offsets, mask=inside, other=0).to(tl.int32)
    if E8M0_NAN:  # noqa: SIM108 - a compile-time branch of the kernel
        hits = raw == 0xFF
    else:
        hits = ((raw & 0x80) == 0) & (raw != 0)
    tl.atomic_add(total_ptr, tl.sum(hits.to(tl.int64)))


@triton.jit
def add_splits(
    partial_ptr,
    stride_split,
    stride_row,
    destination_ptr,
    out_ptr,
    stride_out,
    N,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row ``r`` of a pass's split partial sums (``[SPLITS, rows, N]``) summed split by split in order — ``((p0 +
    p1) + p2) + …``, the same float32 additions for every row — and stored as row ``destination[r]`` of ``out``."""
    r = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = n < N
    source = partial_ptr + r.to(tl.int64) * stride_row + n
    total = tl.load(source, mask=inside, other=0.0)
    for split in tl.static_range(1, SPLITS):
        total += tl.load(source + split * stride_split, mask=inside, other=0.0)
    row = tl.load(destination_ptr + r).to(tl.int64)
    tl.store(out_ptr + row * stride_out + n, total, mask=inside)


@triton.jit
def finish_rows(
    gemm_ptr,
    expert_ptr,
    bias_ptr,
    stride_be,
    stride_bn,
    bias_columns_ptr,
    weights_ptr,
    num_weights,
    total_ptr,
    bias_rows_ptr,
    row_weights_ptr,
    written_ptr,
    N,
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Output row ``r`` from row ``r`` of the product (float32 ``[rows, N]``, contiguous) in the kernel's order,
    ``(gemm + bias) · weight``: the bias row of the row's expert (``expert[r]``; −1 for a row no block writes: no
    bias, weight 0) read at each logical column's stored column (``bias_columns``) and converted to float32, and the
    routing weight ``weights[r]`` (NaN past ``num_weights``; 1 without ``MUL_WEIGHTS``). The bias rows, the row
    weights and whether the row is written are stored beside it (the result's other fields)."""
    r = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = n < N
    expert = tl.load(expert_ptr + r)
    written = expert >= 0
    at = r.to(tl.int64) * N + n
    value = tl.load(gemm_ptr + at, mask=inside, other=0.0)
    if HAS_BIAS:
        stored = tl.load(bias_columns_ptr + n, mask=inside, other=0)
        bias = tl.load(bias_ptr + expert * stride_be + stored * stride_bn, mask=inside & written, other=0.0)
        bias = bias.to(tl.float32)
        tl.store(bias_rows_ptr + at, bias, mask=inside)
        value = value + bias
    if MUL_WEIGHTS:
        weight = tl.load(weights_ptr + r, mask=r < num_weights, other=float("nan")).to(tl.float32)
        weight = tl.where(written, weight, 0.0)
        value = value * weight
    else:
        weight = tl.where(written, 1.0, 0.0)
    tl.store(total_ptr + at, value, mask=inside)
    if tl.program_id(1) == 0:
        tl.store(row_weights_ptr + r, weight)
        tl.store(written_ptr + r, written)
