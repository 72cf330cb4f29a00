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

Every function takes any number of leading (expert) dimensions, runs on the tensors' device and costs a few
elementwise passes over the data plus one 1024-entry gather per tile.
"""

from __future__ import annotations

import functools
from typing import Literal

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


@functools.lru_cache(maxsize=64)
def _on_device(table: str, num_bits: int, is_a_8bit: bool, device: torch.device) -> torch.Tensor:
    sources = _tile_slot_sources_cpu(num_bits, is_a_8bit)
    if table == "inverse":
        sources = torch.argsort(sources)
    return sources.to(device)


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
    """``[..., words * factor]`` codes → ``[..., words]`` int32, code ``p`` of a word at bits ``num_bits * p``."""
    factor = 32 // num_bits
    grouped = codes.to(torch.int64).unflatten(-1, (-1, factor))
    shifts = torch.arange(factor, device=codes.device, dtype=torch.int64) * num_bits
    return _words_to_int32((grouped << shifts).sum(-1))


def _split(words: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Inverse of :func:`_combine`: ``[..., words]`` int32 → ``[..., words * factor]`` uint8 codes."""
    factor = 32 // num_bits
    shifts = torch.arange(factor, device=words.device, dtype=torch.int32) * num_bits
    codes = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)
    return codes.to(torch.uint8).flatten(-2)


def pack_weights(codes: torch.Tensor, num_bits: int, is_a_8bit: bool = False) -> torch.Tensor:
    """Dense codes ``[..., K, N]`` (values < 2**num_bits) → Marlin-packed ``int32[..., K/16, N*16/pack_factor]``.

    What ``gptq_marlin_repack`` (with an empty ``perm``) produces from the same codes.
    """
    _check_bits(num_bits)
    if codes.dim() < 2:
        raise ReferenceError_("pack_weights needs a [..., K, N] tensor")
    k, n = codes.shape[-2:]
    _check_weight_shape(k, n, is_a_8bit)
    tile_k, tile_n = tile_shape(is_a_8bit)
    lead = codes.shape[:-2]
    tiles = codes.reshape(*lead, k // tile_k, tile_k, n // tile_n, tile_n).transpose(-3, -2)
    tiles = tiles.reshape(*lead, k // tile_k, n // tile_n, TILE_CODES)
    slots = tiles.index_select(-1, _on_device("forward", num_bits, is_a_8bit, codes.device))
    words = _combine(slots, num_bits)
    return words.reshape(*lead, k // 16, n * 16 // (32 // num_bits))


def unpack_weights(packed: torch.Tensor, num_bits: int, is_a_8bit: bool = False) -> torch.Tensor:
    """Exact inverse of :func:`pack_weights`: ``int32[..., K/16, N*16/pack_factor]`` → ``uint8[..., K, N]`` codes."""
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
    tiles = slots.index_select(-1, _on_device("inverse", num_bits, is_a_8bit, packed.device))
    tiles = tiles.reshape(*lead, k // tile_k, n // tile_n, tile_k, tile_n).transpose(-3, -2)
    return tiles.reshape(*lead, k, n)


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


def _apply_run_order(values: torch.Tensor, order: tuple[int, ...], inverse: bool) -> torch.Tensor:
    run = len(order)
    shape = values.shape
    if shape[-1] % run:
        raise ReferenceError_(f"last dimension {shape[-1]} is not a multiple of the Marlin run length {run}")
    index = torch.tensor(order, dtype=torch.long, device=values.device)
    if inverse:
        index = torch.argsort(index)
    runs = values.reshape(*shape[:-1], shape[-1] // run, run)
    return runs.index_select(-1, index).reshape(shape)


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
