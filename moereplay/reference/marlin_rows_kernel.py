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
    k_ok = (k < K) & (count > 0)  # a block of no rows (a routed plan's spare entry) stages nothing
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
    # a block of no rows (a routed plan's spare entry) runs no tile and stores nothing
    k_last = tl.where(count > 0, tl.minimum(k_first + tiles_per_split, k_tiles), k_first)
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
    inside = (offsets < per_expert) & (expert >= 0)  # -1: no expert (the spare entries of a routed list)
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
    p1) + p2) + …``, the same float32 additions for every row — and stored as row ``destination[r]`` of ``out``
    (nothing where it is negative: a routed plan's rows past the written ones)."""
    r = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = n < N
    source = partial_ptr + r.to(tl.int64) * stride_row + n
    total = tl.load(source, mask=inside, other=0.0)
    for split in tl.static_range(1, SPLITS):
        total += tl.load(source + split * stride_split, mask=inside, other=0.0)
    row = tl.load(destination_ptr + r).to(tl.int64)
    tl.store(out_ptr + row * stride_out + n, total, mask=inside & (row >= 0))


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


ROUTE_SUMMARY = tl.constexpr(9)
"""int64 entries :func:`route_rows` leaves in ``summary_ptr`` (:data:`moereplay.reference.marlin_rows.SUMMARY`
names them)."""


@triton.jit
def _store_fields(at, start, rows, expert, position, mask):
    """One row block's four fields (start, rows, expert, position) at ``at``, where ``mask``."""
    tl.store(at, start, mask=mask)
    tl.store(at + 1, rows, mask=mask)
    tl.store(at + 2, expert, mask=mask)
    tl.store(at + 3, position, mask=mask)


@triton.jit(
    do_not_specialize=[
        "total_value",
        "id_count",
        "expert_count",
        "num_slots",
        "top_k",
        "num_experts",
        "block_size",
        "table_stride",
        "tiles4",
        "tiles8",
        "tiles16",
    ]
)
def route_rows(
    ids_ptr,
    experts_ptr,
    total_ptr,
    total_value,
    id_count,
    expert_count,
    num_slots,
    top_k,
    num_experts,
    block_size,
    last_ptr,
    rank_ptr,
    start_ptr,
    tables_ptr,
    table_stride,
    source_ptr,
    destination_ptr,
    fields_ptr,
    tiles4,
    tiles8,
    tiles16,
    used_ptr,
    summary_ptr,
    TOTAL_IN_MEMORY: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    EXPERTS: tl.constexpr,
):
    """The routing of one Marlin MoE call on the device, in one program (no host round trip): what the host's
    numpy routing makes, the same numbers in the same order.

    - ``last``: per output row the largest position of ``sorted_token_ids`` that writes it (−1: none) — valid
      entries of the first ``min(total // block_size, buffers)`` blocks whose block expert is in range;
    - ``tables`` (int64 ``[5, table_stride]``): per output row its input row, expert, k slot, block (−1 where not
      written) and whether it is written;
    - the grouped order (rows by expert, each expert's rows by output row): ``source`` (input row) and
      ``destination`` (output row; −1 past the written rows);
    - ``fields`` (int64 ``[tiles4 + tiles8 + tiles16, 4]``: start, rows, expert, position among the used experts):
      the row blocks of heights 4, 8 and 16 from entries 0, ``tiles4`` and ``tiles4 + tiles8``, in expert order,
      the spare entries with no rows;
    - ``used``: the used experts ascending, −1 after them;
    - ``summary``: negative ids, valid entries after padding in their block, valid entries dropped by a block
      expert out of range, entries kept, rows written, whether the blocks ran past the buffers, whether ``total``
      is not a multiple of ``block_size``, used experts, and ``total`` itself.
    Phases are separated by barriers (one program: its threads see each other's stores after one)."""
    tiles = tiles4 + tiles8 + tiles16
    for first in range(0, num_slots, BLOCK):
        s = first + tl.arange(0, BLOCK)
        inside = s < num_slots
        tl.store(last_ptr + s, -1, mask=inside)
        tl.store(destination_ptr + s, -1, mask=inside)
    for first in range(0, tiles * 4, BLOCK):
        f = first + tl.arange(0, BLOCK)
        tl.store(fields_ptr + f, 0, mask=f < tiles * 4)
    tl.debug_barrier()

    # the entries: each valid one names its output row's last writer by position
    if TOTAL_IN_MEMORY:  # noqa: SIM108 - a compile-time branch of the kernel
        total = tl.load(total_ptr).to(tl.int64)
    else:
        total = total_value.to(tl.int64)
    blocks = tl.maximum(total // block_size, 0)
    available = tl.minimum(id_count // block_size, expert_count).to(tl.int64)
    past = blocks > available
    blocks = tl.minimum(blocks, available)
    count = (blocks * block_size).to(tl.int32)
    negative = tl.zeros([1], dtype=tl.int64)
    after_padding = tl.zeros([1], dtype=tl.int64)
    dropped = tl.zeros([1], dtype=tl.int64)
    kept = tl.zeros([1], dtype=tl.int64)
    for first in range(0, count, BLOCK):
        p = first + tl.arange(0, BLOCK)
        inside = p < count
        ident = tl.load(ids_ptr + p, mask=inside, other=0).to(tl.int64)
        valid = inside & (ident >= 0) & (ident < num_slots)
        negative += tl.sum((inside & (ident < 0)).to(tl.int64))
        opens = (p % block_size) == 0
        before = tl.load(ids_ptr + p - 1, mask=inside & ~opens, other=0).to(tl.int64)
        valid_before = (before >= 0) & (before < num_slots)
        after_padding += tl.sum((valid & ~opens & ~valid_before).to(tl.int64))
        expert = tl.load(experts_ptr + p // block_size, mask=inside, other=0).to(tl.int64)
        good = (expert >= 0) & (expert < num_experts)
        dropped += tl.sum((valid & ~good).to(tl.int64))
        keep = valid & good
        kept += tl.sum(keep.to(tl.int64))
        tl.atomic_max(last_ptr + ident, p, mask=keep)
    tl.debug_barrier()

    # the rows: tables, and each written row's rank among its expert's rows (one-hot running counts: stable)
    expert_index = tl.arange(0, EXPERTS)
    per_expert = tl.zeros([EXPERTS], dtype=tl.int32)
    written_rows = tl.zeros([1], dtype=tl.int64)
    for first in range(0, num_slots, ROWS):
        s = first + tl.arange(0, ROWS)
        inside = s < num_slots
        last = tl.load(last_ptr + s, mask=inside, other=-1)
        written = last >= 0
        block = tl.where(written, last // block_size, -1)
        expert = tl.load(experts_ptr + block, mask=written, other=0).to(tl.int32)
        expert = tl.where(written, expert, -1)
        tl.store(tables_ptr + s, tl.where(written, s // top_k, -1), mask=inside)
        tl.store(tables_ptr + table_stride + s, expert, mask=inside)
        tl.store(tables_ptr + 2 * table_stride + s, tl.where(written, s % top_k, -1), mask=inside)
        tl.store(tables_ptr + 3 * table_stride + s, block, mask=inside)
        tl.store(tables_ptr + 4 * table_stride + s, written.to(tl.int64), mask=inside)
        hot = (expert[:, None] == expert_index[None, :]).to(tl.int32)
        earlier = tl.cumsum(hot, axis=0) - hot
        rank = tl.sum(hot * (earlier + per_expert[None, :]), axis=1)
        tl.store(rank_ptr + s, rank, mask=written)
        per_expert += tl.sum(hot, axis=0)
        written_rows += tl.sum(written.to(tl.int64))

    # the experts: where their rows start, the used ones, their row blocks by height
    known = expert_index < num_experts
    start = tl.cumsum(per_expert, axis=0) - per_expert
    tl.store(start_ptr + expert_index, start, mask=known)
    used = (per_expert > 0).to(tl.int32)
    position = tl.cumsum(used, axis=0) - used
    used_count = tl.sum(used)
    tl.store(used_ptr + position, expert_index, mask=used > 0)
    tl.store(used_ptr + expert_index, -1, mask=known & (expert_index >= used_count))
    height4 = ((per_expert > 0) & (per_expert <= 4)).to(tl.int32)
    height8 = ((per_expert > 4) & (per_expert <= 8)).to(tl.int32)
    blocks16 = tl.where(per_expert > 8, (per_expert + 15) // 16, 0)
    at4 = (tl.cumsum(height4, axis=0) - height4) * 4
    at8 = (tiles4 + tl.cumsum(height8, axis=0) - height8) * 4
    at16 = tiles4 + tiles8 + tl.cumsum(blocks16, axis=0) - blocks16
    _store_fields(fields_ptr + at4, start, per_expert, expert_index, position, height4 > 0)
    _store_fields(fields_ptr + at8, start, per_expert, expert_index, position, height8 > 0)
    for j in range(0, tl.max(blocks16, axis=0)):
        rows = tl.minimum(per_expert - 16 * j, 16)
        _store_fields(fields_ptr + (at16 + j) * 4, start + 16 * j, rows, expert_index, position, j < blocks16)
    tl.debug_barrier()

    # the grouped order
    for first in range(0, num_slots, BLOCK):
        s = first + tl.arange(0, BLOCK)
        inside = s < num_slots
        expert = tl.load(tables_ptr + table_stride + s, mask=inside, other=-1)
        written = expert >= 0
        rank = tl.load(rank_ptr + s, mask=written, other=0)
        grouped = tl.load(start_ptr + expert, mask=written, other=0) + rank
        tl.store(source_ptr + grouped, s // top_k, mask=written)
        tl.store(destination_ptr + grouped, s, mask=written)

    summary = tl.arange(0, 16)
    values = tl.where(summary == 0, negative, 0)
    values = tl.where(summary == 1, after_padding, values)
    values = tl.where(summary == 2, dropped, values)
    values = tl.where(summary == 3, kept, values)
    values = tl.where(summary == 4, written_rows, values)
    values = tl.where(summary == 5, past.to(tl.int64), values)
    values = tl.where(summary == 6, (total % block_size != 0).to(tl.int64), values)
    values = tl.where(summary == 7, used_count.to(tl.int64), values)
    values = tl.where(summary == 8, total, values)
    tl.store(summary_ptr + summary, values, mask=summary < ROUTE_SUMMARY)
