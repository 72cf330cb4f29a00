"""Marlin's packed weight, scale, zero-point and bias layouts, in both directions, batched over experts.

Facts from vLLM 0.25.1 (``gptq_marlin_repack``, ``marlin_permute_scales``, ``marlin_zero_points``,
``marlin_permute_bias`` and the MoE kernel's fragment reads); the code is ours.

Weights
    A dense ``[K, N]`` matrix of integer codes (``num_bits`` = 4 or 8; fp4/fp8 bit patterns are codes too) is cut
    into tiles — 16 (k) x 64 (n) for 16-bit activations, 32 x 32 when the activations are 8-bit — stored tile after
    tile (all n-tiles of the first k-tile first). Each tile is 1024 codes = ``1024 / pack_factor`` int32 words; word
    ``t`` of a tile and the position ``p`` of a code in it select one (k, n) of the tile, the order the kernel's
    tensor-core fragments want (:func:`tile_slot_sources`). Per expert the packed tensor is ``int32[K/16,
    N*16/pack_factor]`` — a view of the flat tile sequence. Codes sit low bits first.
Scales
    ``[groups, N]``. With more than one group the kernel reads each run of 64 as an 8 x 8 transpose; with one group
    (channel-wise), or with 8-bit activations, each run of 32 in the order (0,1,8,9,16,17,24,25) + 2i. FP4 formats
    additionally swap the middle two of every 4 scales (:func:`swap_scale_pairs`).
Zero points
    ``int32[groups, N/pack_factor]``: the grouped scale order (always, even channel-wise), then (16-bit activations)
    each run of 8 (4-bit) or 4 (8-bit) interleaved even-first, then packed along N low bits first.
Bias
    ``[N]`` in the channel-wise scale order.
Act order (GPTQ ``desc_act``)
    ``perm[k]`` (vLLM's ``g_idx_sort_indices``) is the original row stored at packed row ``k``; ``g_idx`` passed to
    the kernel is already sorted; the kernel multiplies packed row ``k`` with input column ``perm[k]``.

Every function takes any number of leading (expert) dimensions, runs on the tensors' device (4-bit packing on the
CPU in numpy: :func:`_pack_nibbles`) and costs a few elementwise passes over the data plus one 1024-entry gather per
tile.
"""

from __future__ import annotations

import functools
import sys
from typing import Literal

import numpy
import torch

from moereplay.errors import ReferenceError_

NumBits = Literal[4, 8]

#: Codes per Marlin tile; the same for every layout variant.
TILE_CODES = 1024


def pack_factor(num_bits: int) -> int:
    """Codes per int32 word."""
    _check_bits(num_bits)
    return 32 // num_bits


def tile_shape(is_a_8bit: bool) -> tuple[int, int]:
    """(k, n) extent of one packed tile."""
    return (32, 32) if is_a_8bit else (16, 64)


def _check_bits(num_bits: int) -> None:
    if num_bits not in (4, 8):
        raise ReferenceError_(f"Marlin packs 4- or 8-bit codes, not {num_bits}-bit")


@functools.cache
def _tile_slot_sources_cpu(num_bits: int, is_a_8bit: bool) -> torch.Tensor:
    factor = 32 // num_bits
    words = TILE_CODES // factor
    tile_k, tile_n = tile_shape(is_a_8bit)
    sources = torch.empty(TILE_CODES, dtype=torch.long)
    # Fragment row offsets of the four values a thread holds in a 16-bit-activation tile.
    fragment_rows = (0, 1, 8, 9)
    for word in range(words):
        for position in range(factor):
            if not is_a_8bit and num_bits == 4:
                thread, warp = divmod(word, 4)
                value = (0, 2, 4, 6, 1, 3, 5, 7)[position]
                k = 2 * (thread % 4) + fragment_rows[value % 4]
                n = 16 * warp + thread // 4 + 8 * (value // 4)
            elif not is_a_8bit:
                thread, rest = divmod(word, 8)
                warp, half = divmod(rest, 2)
                value = (0, 2, 1, 3)[position]
                k = 2 * (thread % 4) + fragment_rows[value]
                n = 16 * warp + thread // 4 + 8 * half
            elif num_bits == 4:
                thread, warp = divmod(word, 4)
                value = (0, 4, 1, 5, 2, 6, 3, 7)[position]
                k = 4 * (thread % 4) + value % 4 + 16 * (value // 4)
                n = 16 * (warp // 2) + thread // 4 + 8 * (warp % 2)
            else:
                thread, rest = divmod(word, 8)
                warp, half = divmod(rest, 2)
                k = 4 * (thread % 4) + position + 16 * half
                n = 16 * (warp // 2) + thread // 4 + 8 * (warp % 2)
            sources[word * factor + position] = k * tile_n + n
    if sorted(sources.tolist()) != list(range(tile_k * tile_n)):
        raise AssertionError("Marlin tile slot table is not a permutation")  # pragma: no cover
    return sources


# The same tile permutation as axis shuffles: slot digits (most significant first) and where each digit goes in
# the tile's (k, n) digits. Derived from the table above; the tests check both agree. Names: c = thread // 4,
# r = thread % 4, w = warp (w1, w0 its bits), h = which int of a pair, p/q/t = the code's position bits.
_SLOT_AXES: dict[tuple[int, bool], tuple[tuple[int, ...], tuple[int, ...]]] = {
    # slot digit sizes, and the order of those digits in the tile (k digits first, then n digits)
    (4, False): ((8, 4, 4, 2, 2, 2), (5, 1, 3, 2, 4, 0)),  # c r w t q1 q0 → k=(q0 r t) n=(w q1 c)
    (8, False): ((8, 4, 4, 2, 2, 2), (5, 1, 4, 2, 3, 0)),  # c r w h p1 p0 → k=(p0 r p1) n=(w h c)
    (4, True): ((8, 4, 2, 2, 4, 2), (5, 1, 4, 2, 3, 0)),  # c r w1 w0 p1 p0 → k=(p0 r p1) n=(w1 w0 c)
    (8, True): ((8, 4, 2, 2, 2, 4), (4, 1, 5, 2, 3, 0)),  # c r w1 w0 h p → k=(h r p) n=(w1 w0 c)
}


def _slots_to_tiles(slots: torch.Tensor, num_bits: int, is_a_8bit: bool) -> torch.Tensor:
    """``[..., 1024]`` slot order → ``[..., tile_k * tile_n]`` (k, n) order, by reshapes only."""
    sizes, order = _SLOT_AXES[(num_bits, is_a_8bit)]
    lead = slots.shape[:-1]
    shaped = slots.reshape(*lead, *sizes)
    base = len(lead)
    return shaped.permute(*range(base), *(base + axis for axis in order)).reshape(*lead, TILE_CODES)


def _tiles_to_slots(tiles: torch.Tensor, num_bits: int, is_a_8bit: bool) -> torch.Tensor:
    """Inverse of :func:`_slots_to_tiles`."""
    sizes, order = _SLOT_AXES[(num_bits, is_a_8bit)]
    lead = tiles.shape[:-1]
    base = len(lead)
    shaped = tiles.reshape(*lead, *(sizes[axis] for axis in order))
    inverse = sorted(range(len(order)), key=lambda position: order[position])
    return shaped.permute(*range(base), *(base + axis for axis in inverse)).reshape(*lead, TILE_CODES)


def tile_slot_sources(num_bits: int, is_a_8bit: bool = False) -> torch.Tensor:
    """For each packed slot ``word * pack_factor + position`` of a tile, the flat ``k * tile_n + n`` it holds."""
    _check_bits(num_bits)
    return _tile_slot_sources_cpu(num_bits, is_a_8bit).clone()


def _check_weight_shape(k: int, n: int, is_a_8bit: bool) -> None:
    tile_k, tile_n = tile_shape(is_a_8bit)
    if k % tile_k or n % tile_n:
        raise ReferenceError_(f"Marlin weights need K % {tile_k} == 0 and N % {tile_n} == 0, got K={k} N={n}")


def _words_to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) → int32 with the same bit pattern."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _combine(codes: torch.Tensor, num_bits: int) -> torch.Tensor:
    """``[..., words * factor]`` codes → ``[..., words]`` int32, code ``p`` of a word at bits ``num_bits * p``.

    Codes that fit their width (every real call) are packed as bytes and read as little-endian words: one narrow
    pass. Anything else (a code past its bits spills into the next one's) takes the general int64 path."""
    factor = 32 // num_bits
    if (
        sys.byteorder == "little"
        and codes.numel()
        and codes.shape[-1] % factor == 0
        and _fits(codes, num_bits)
    ):
        data = codes.to(torch.uint8)
        if num_bits == 4:
            pairs = data.unflatten(-1, (-1, 2))
            data = pairs[..., 0] | (pairs[..., 1] << 4)
        return data.contiguous().view(torch.int32)
    grouped = codes.unflatten(-1, (-1, factor))
    words = torch.zeros(grouped.shape[:-1], dtype=torch.int64, device=codes.device)
    for position in range(factor):  # one position at a time: temporaries of one int64 per word
        words |= grouped[..., position].to(torch.int64) << (num_bits * position)
    return _words_to_int32(words)


def _split(words: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Inverse of :func:`_combine`: ``[..., words]`` int32 → ``[..., words * factor]`` uint8 codes.

    Reads the words' bytes (little-endian, as on every CPU and GPU torch runs on): byte ``j`` holds codes ``2j``
    (low nibble) and ``2j + 1`` (high nibble) of 4-bit data, code ``j`` of 8-bit data.
    """
    if sys.byteorder != "little":  # pragma: no cover
        raise ReferenceError_("Marlin unpacking assumes a little-endian machine")
    data = words.to(torch.int32).contiguous().view(torch.uint8)
    if num_bits == 8:
        return data
    return torch.stack((data & 0x0F, data >> 4), dim=-1).flatten(-2)


def _tile_axes(num_bits: int, is_a_8bit: bool) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(slot digit sizes, k digit positions among them, n digit positions among them)."""
    sizes, order = _SLOT_AXES[(num_bits, is_a_8bit)]
    return sizes, order[:3], order[3:]


def pack_weights(
    codes: torch.Tensor, num_bits: int, is_a_8bit: bool = False, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Dense codes ``[..., K, N]`` (values < 2**num_bits) → Marlin-packed ``int32[..., K/16, N*16/pack_factor]``.

    What ``gptq_marlin_repack`` (with an empty ``perm``) produces from the same codes. ``out``: a contiguous int32
    tensor of that shape to write into (a generator packing one expert at a time into its final buffer).
    """
    _check_bits(num_bits)
    if codes.dim() < 2:
        raise ReferenceError_("pack_weights needs a [..., K, N] tensor")
    k, n = codes.shape[-2:]
    _check_weight_shape(k, n, is_a_8bit)
    lead = codes.shape[:-2]
    shape = (*lead, k // 16, n * 16 // (32 // num_bits))
    if out is None:
        out = torch.empty(shape, dtype=torch.int32, device=codes.device)
    elif tuple(out.shape) != shape or out.dtype != torch.int32 or not out.is_contiguous():
        raise ReferenceError_(
            f"pack_weights writes a contiguous int32 {list(shape)}, got {out.dtype} {list(out.shape)}"
        )
    if out.numel():  # one matrix at a time: temporaries of one expert, not of the whole set
        targets = out.view(-1, *out.shape[-2:])
        for index, matrix in enumerate(codes.reshape(-1, k, n)):
            _pack_matrix(matrix, num_bits, is_a_8bit, targets[index])
    return out


def _pack_matrix(codes: torch.Tensor, num_bits: int, is_a_8bit: bool, out: torch.Tensor) -> None:
    """:func:`pack_weights` of one ``[K, N]`` matrix into ``out`` (contiguous int32 ``[K/16, N*16/pack]``)."""
    k, n = codes.shape
    tile_k, tile_n = tile_shape(is_a_8bit)
    if num_bits == 4 and not is_a_8bit and sys.byteorder == "little" and _fits(codes, 4):
        _pack_nibbles(codes, out)
        return
    sizes, k_axes, n_axes = _tile_axes(num_bits, is_a_8bit)
    # [Kt, k digits, Nt, n digits] → [Kt, Nt, slot digits]
    shaped = codes.reshape(k // tile_k, *(sizes[a] for a in k_axes), n // tile_n, *(sizes[a] for a in n_axes))
    source_of = {axis: 1 + i for i, axis in enumerate(k_axes)}
    source_of.update({axis: 5 + i for i, axis in enumerate(n_axes)})
    permuted = shaped.permute(0, 4, *(source_of[axis] for axis in range(6)))
    words = _combine(permuted.reshape(k // tile_k, n // tile_n, TILE_CODES), num_bits)
    out.copy_(words.reshape(out.shape))


def _fits(codes: torch.Tensor, num_bits: int) -> bool:
    """Whether every code is a non-negative value below ``2**num_bits`` (one pass)."""
    if codes.numel() == 0:
        return True
    low, high = torch.aminmax(codes)
    return int(low) >= 0 and int(high) < (1 << num_bits)


def _pack_nibbles(codes: torch.Tensor, out: torch.Tensor, *, numpy_on_cpu: bool = True) -> None:
    """4-bit codes, 16-bit-activation tiles: the two codes of a byte are rows ``k`` and ``k + 8`` of one 16-row tile
    (the code position's low bit is the tile's top k digit, see :data:`_SLOT_AXES`), so each byte is made by one
    contiguous pass over row pairs, and only the half as many bytes then move, in one permuted copy straight into
    ``out``. On the CPU both passes run in numpy: single-threaded and still faster than torch's strided copy on two
    (0.65 s against 0.85 s for a gpt-oss w13 set), which leaves the other core to a generator drawing the next
    expert (:mod:`moereplay.synth.expert_pipeline`). ``numpy_on_cpu=False``: torch there too (the tests compare)."""
    k, n = codes.shape
    # slot digits c r w t q1 q0 (q0 picks the nibble); k digits q0 r t, n digits w q1 c
    sizes, k_axes, n_axes = _tile_axes(4, False)
    if k_axes[0] != len(sizes) - 1:  # pragma: no cover - guards the table
        raise AssertionError("Marlin 4-bit bytes must pair codes of the tile's top k digit")
    source_of = {axis: 1 + i for i, axis in enumerate(k_axes[1:])}
    source_of.update({axis: 4 + i for i, axis in enumerate(n_axes)})
    order = (0, 3, *(source_of[axis] for axis in range(len(sizes) - 1)))
    digits = (*(sizes[a] for a in k_axes[1:]), n // 64, *(sizes[a] for a in n_axes))
    rows = codes.to(torch.uint8).reshape(k // 16, 2, 8, n)
    byte_slots = out.view(torch.uint8).view(k // 16, n // 64, *sizes[:-1])
    if rows.device.type == "cpu" and numpy_on_cpu:
        low, high = rows.numpy()[:, 0], rows.numpy()[:, 1]
        pairs = numpy.left_shift(high, 4)
        numpy.bitwise_or(pairs, low, out=pairs)  # [Kt, (r t), N]
        numpy.copyto(byte_slots.numpy(), pairs.reshape(k // 16, *digits).transpose(order))
        return
    pairs_t = torch.bitwise_left_shift(rows[:, 1], 4).bitwise_or_(rows[:, 0])
    byte_slots.copy_(pairs_t.reshape(k // 16, *digits).permute(order))


def unpack_weights(packed: torch.Tensor, num_bits: int, is_a_8bit: bool = False) -> torch.Tensor:
    """Exact inverse of :func:`pack_weights`: ``int32[..., K/16, N*16/pack_factor]`` → ``uint8[..., K, N]`` codes.

    Cost: one byte split and one strided copy of the ``K * N`` codes.
    """
    _check_bits(num_bits)
    if packed.dim() < 2 or packed.dtype not in (torch.int32, torch.uint32):
        raise ReferenceError_(
            f"Marlin weights are int32 [..., K/16, N*16/pack], got {packed.dtype} {tuple(packed.shape)}"
        )
    factor = 32 // num_bits
    rows, cols = packed.shape[-2:]
    k = rows * 16
    if (cols * factor) % 16:
        raise ReferenceError_(f"packed weight width {cols} is not N*16/{factor} for an integer N")
    n = cols * factor // 16
    _check_weight_shape(k, n, is_a_8bit)
    tile_k, tile_n = tile_shape(is_a_8bit)
    lead = packed.shape[:-2]
    words = packed.reshape(*lead, k // tile_k, n // tile_n, TILE_CODES // factor)
    slots = _split(words.view(torch.int32) if words.dtype == torch.uint32 else words, num_bits)
    return logical_digit_view(slots, num_bits, is_a_8bit).reshape(*lead, k, n)


def logical_digit_view(slots: torch.Tensor, num_bits: int, is_a_8bit: bool = False) -> torch.Tensor:
    """Tile-ordered values ``[..., Kt, Nt, 1024]`` (slot order, any dtype) as a *view* in logical digit order
    ``[..., Kt, k digits (3), Nt, n digits (3)]``, most significant digit first: reshaping it to ``[..., K, N]``
    gives the logical matrix. No data moves; an elementwise op reading this view undoes Marlin's tile permutation
    in the same pass."""
    _check_bits(num_bits)
    sizes, k_axes, n_axes = _tile_axes(num_bits, is_a_8bit)
    if slots.dim() < 3 or slots.shape[-1] != TILE_CODES:
        raise ReferenceError_(
            f"tile-ordered values must be [..., Kt, Nt, {TILE_CODES}], got {tuple(slots.shape)}"
        )
    lead = slots.shape[:-3]
    base = len(lead)
    shaped = slots.reshape(*lead, slots.shape[-3], slots.shape[-2], *sizes)
    # [..., Kt, Nt, slot digits] → [..., Kt, k digits, Nt, n digits]
    return shaped.permute(
        *range(base), base, *(base + 2 + a for a in k_axes), base + 1, *(base + 2 + a for a in n_axes)
    )


def logical_byte_view(data: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Packed bytes ``uint8[..., Kt, Nt, 1024 * num_bits / 8]`` (16-bit-activation layout) as a *view* in logical
    order ``[..., Kt, k digits, Nt, n digits]`` of the bytes themselves.

    8-bit codes: one code per byte, as :func:`logical_digit_view`. 4-bit codes: a byte holds two codes that differ
    only in the most significant k digit of the tile (code ``2j`` in the low nibble, k, and ``2j + 1`` in the high
    nibble, k + 8): that digit is left out, so row ``k`` of the view serves rows ``k`` (low nibbles) and ``k + 8``
    (high nibbles) of each 16-row tile.
    """
    if num_bits == 8:
        return logical_digit_view(data, 8)
    _check_bits(num_bits)
    sizes, k_axes, n_axes = _tile_axes(num_bits, False)
    nibble = len(sizes) - 1  # the last slot digit picks the nibble (code position bit 0)
    if k_axes[0] != nibble or data.shape[-1] != TILE_CODES // 2:  # pragma: no cover - guards the table
        raise ReferenceError_("Marlin 4-bit bytes must pair codes of the tile's top k digit")
    lead = data.shape[:-3]
    base = len(lead)
    shaped = data.reshape(*lead, data.shape[-3], data.shape[-2], *sizes[:nibble])
    return shaped.permute(
        *range(base), base, *(base + 2 + a for a in k_axes[1:]), base + 1, *(base + 2 + a for a in n_axes)
    )


def logical_digit_sizes(num_bits: int, is_a_8bit: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(k digit sizes, n digit sizes) of :func:`logical_digit_view`, most significant first."""
    sizes, k_axes, n_axes = _tile_axes(num_bits, is_a_8bit)
    return tuple(sizes[a] for a in k_axes), tuple(sizes[a] for a in n_axes)


def marlin_weight_extent(packed: torch.Tensor, num_bits: int) -> tuple[int, int]:
    """(K, N) of one expert's packed weight, from its shape alone."""
    _check_bits(num_bits)
    rows, cols = packed.shape[-2:]
    return rows * 16, cols * (32 // num_bits) // 16


# ----------------------------------------------------------------------------------------------------- GPTQ rows


def pack_rows(codes: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Codes ``[..., K, N]`` → GPTQ checkpoint layout ``int32[..., K/pack_factor, N]`` (K packed, low bits first).

    This is what ``gptq_marlin_repack`` reads; fp4 weights stored ``uint8[N, K/2]`` (low nibble = even k) viewed as
    int32 and transposed are exactly this layout.
    """
    _check_bits(num_bits)
    factor = 32 // num_bits
    k = codes.shape[-2]
    if k % factor:
        raise ReferenceError_(f"K={k} is not a multiple of the pack factor {factor}")
    return _combine(codes.transpose(-2, -1), num_bits).transpose(-2, -1).contiguous()


def unpack_rows(packed: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_rows`: ``int32[..., K/pack, N]`` → ``uint8[..., K, N]``."""
    _check_bits(num_bits)
    return _split(packed.transpose(-2, -1), num_bits).transpose(-2, -1).contiguous()


# ------------------------------------------------------------------------------------------- scales, zp and bias


@functools.cache
def _grouped_scale_order() -> tuple[int, ...]:
    # position 8*i + j of a run of 64 takes element i + 8*j: an 8 x 8 transpose.
    return tuple(i + 8 * j for i in range(8) for j in range(8))


@functools.cache
def _channel_scale_order() -> tuple[int, ...]:
    return tuple(2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25))


def scale_order(grouped: bool) -> tuple[int, ...]:
    """The run order Marlin stores scales in: position ``j`` of each run holds logical element ``order[j]``."""
    return _grouped_scale_order() if grouped else _channel_scale_order()


# Every Marlin run order is a transpose of the run's digits: (logical digit sizes, their order in the run).
_RUN_TRANSPOSES: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}


def _register_run_order(order: tuple[int, ...], shape: tuple[int, ...], axes: tuple[int, ...]) -> None:
    logical = torch.arange(len(order)).reshape(shape).permute(*axes).reshape(-1)
    if tuple(logical.tolist()) != order:  # pragma: no cover - guards the table below
        raise AssertionError(f"run order {order} is not the transpose {shape} {axes}")
    _RUN_TRANSPOSES[order] = (shape, axes)


def _apply_run_order(values: torch.Tensor, order: tuple[int, ...], inverse: bool) -> torch.Tensor:
    """Reorder each run of ``len(order)`` along the last dim: position ``j`` takes element ``order[j]``."""
    run = len(order)
    shape = values.shape
    if shape[-1] % run:
        raise ReferenceError_(f"last dimension {shape[-1]} is not a multiple of the Marlin run length {run}")
    lead = (*shape[:-1], shape[-1] // run)
    base = len(lead)
    digits, axes = _RUN_TRANSPOSES[order]
    if not inverse:
        shaped = values.reshape(*lead, *digits)
        return shaped.permute(*range(base), *(base + a for a in axes)).reshape(shape)
    shaped = values.reshape(*lead, *(digits[a] for a in axes))
    back = sorted(range(len(axes)), key=lambda position: axes[position])
    return shaped.permute(*range(base), *(base + a for a in back)).reshape(shape)


def scales_are_grouped(num_groups: int, is_a_8bit: bool = False) -> bool:
    """Which scale order the kernel reads: grouped when there is more than one group (and 16-bit activations)."""
    return num_groups > 1 and not is_a_8bit


def permute_scales(scales: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Logical ``[..., groups, N]`` → Marlin order (``marlin_permute_scales`` for one expert, batched)."""
    return _apply_run_order(scales, scale_order(grouped), inverse=False)


def unpermute_scales(scales: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Marlin order → logical ``[..., groups, N]``."""
    return _apply_run_order(scales, scale_order(grouped), inverse=True)


def swap_scale_pairs(scales: torch.Tensor) -> torch.Tensor:
    """Swap elements 1 and 2 of every run of 4 (the fp8-scale fragment order of FP4 formats); its own inverse."""
    return _apply_run_order(scales, (0, 2, 1, 3), inverse=False)


def permute_bias(bias: torch.Tensor) -> torch.Tensor:
    """Logical ``[..., N]`` → Marlin order (``marlin_permute_bias``)."""
    return _apply_run_order(bias, _channel_scale_order(), inverse=False)


def unpermute_bias(bias: torch.Tensor) -> torch.Tensor:
    """Marlin order → logical ``[..., N]``."""
    return _apply_run_order(bias, _channel_scale_order(), inverse=True)


def _zero_point_interleave(num_bits: int) -> tuple[int, ...]:
    return (0, 2, 4, 6, 1, 3, 5, 7) if num_bits == 4 else (0, 2, 1, 3)


_register_run_order(_grouped_scale_order(), (8, 8), (1, 0))
_register_run_order(_channel_scale_order(), (4, 4, 2), (1, 0, 2))
_register_run_order((0, 2, 1, 3), (2, 2), (1, 0))
_register_run_order(_zero_point_interleave(4), (4, 2), (1, 0))


def pack_zero_points(zero_points: torch.Tensor, num_bits: int, is_a_8bit: bool = False) -> torch.Tensor:
    """Integer zero points ``[..., groups, N]`` → ``int32[..., groups, N/pack_factor]`` (``marlin_zero_points``)."""
    _check_bits(num_bits)
    ordered = _apply_run_order(zero_points, _grouped_scale_order(), inverse=False)
    if not is_a_8bit:
        ordered = _apply_run_order(ordered, _zero_point_interleave(num_bits), inverse=False)
    return _combine(ordered, num_bits)


def unpack_zero_points(packed: torch.Tensor, num_bits: int, is_a_8bit: bool = False) -> torch.Tensor:
    """Inverse of :func:`pack_zero_points`: ``int32[..., groups, N/pack]`` → ``uint8[..., groups, N]``."""
    _check_bits(num_bits)
    codes = _split(packed, num_bits)
    if not is_a_8bit:
        codes = _apply_run_order(codes, _zero_point_interleave(num_bits), inverse=True)
    return _apply_run_order(codes, _grouped_scale_order(), inverse=True)


def permute_float_zero_points(zero_points: torch.Tensor) -> torch.Tensor:
    """Float zero points (``is_zp_float``) ``[..., groups, N]``: the kernel reads them in the grouped scale order."""
    return _apply_run_order(zero_points, _grouped_scale_order(), inverse=False)


def unpermute_float_zero_points(zero_points: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`permute_float_zero_points`."""
    return _apply_run_order(zero_points, _grouped_scale_order(), inverse=True)


# ------------------------------------------------------------------------------------------------------ act order


def sort_act_order(g_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ ``g_idx`` ``[..., K]`` (group of each original row) → (sorted g_idx, ``perm``) as vLLM prepares them.

    ``perm[k]`` is the original row stored at packed row ``k``; both are int32.
    """
    perm = torch.argsort(g_idx, dim=-1, stable=True)
    return torch.gather(g_idx, -1, perm).to(torch.int32), perm.to(torch.int32)


def act_order_rows(codes: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Reorder original rows ``[..., K, N]`` into packed-row order (``gptq_marlin_repack`` with ``perm``)."""
    index = perm.to(torch.long).unsqueeze(-1).expand(*perm.shape, codes.shape[-1])
    return torch.gather(codes, -2, index)
