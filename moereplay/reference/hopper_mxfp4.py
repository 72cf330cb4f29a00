"""The Hopper MXFP4 weight layouts of triton_kernels (``HOPPER_VALUE`` and ``HOPPER_SCALE``), both directions.

On sm_90 vLLM 0.25.1 prepares gpt-oss MXFP4 expert weights for ``matmul_ogs`` with
``mxfp4_utils._swizzle_mxfp4``: the checkpoint tensors ``w [E, N, K/2]`` (two e2m1 codes a byte, element ``2i`` in
the low nibble) and ``scale [E, N, K/32]`` (e8m0 bytes) are transposed to ``[E, K/2, N]`` / ``[E, K/32, N]`` and
converted with ``HopperMXValueLayout(mx_axis=1)`` and ``HopperMXScaleLayout(mx_axis=1, num_warps=8)``; the kernel
then runs with ``split_k = 1``, ``num_warps = 8`` (taken from the scale layout), ``block_n = 256`` and
``block_k = 128`` (every 4-bit weight without native MXFP), non-persistent (no TMA for MXFP4 on Hopper).

Both layouts name their two last axes ``(K, N)`` in the storage's *initial* shape; ``mx_axis`` is the axis the
values are packed / the scales run along. When ``mx_axis`` is the second-to-last axis (vLLM's case) the layout works
on the transpose ``[..., N, K]`` and hands back a transposed view, so the swizzled storage has stride 1 on its
second-to-last axis (the kernel keys ``W_TRANSPOSE`` on exactly that stride). Below, ``rows`` is the axis that is
not ``mx_axis`` and ``cols`` the ``mx_axis`` one, after that transpose.

Value layout (``HOPPER_VALUE``, ``mma_version`` 3; uint8 storage, one byte = two e2m1 codes):
- padding: rows to a multiple of 16, cols (bytes) to a multiple of 32 (64 fp4 values), with zero bytes;
- byte ``(r, c)`` with ``r = 16·r0 + 8·w0 + 2·t0 + s0`` and ``c = 32·c0 + 8·q + 4·w1 + t1`` moves to row
  ``4·r0 + t0`` and column ``128·c0 + 64·s0 + 16·t1 + 4·q + 2·w1 + w0`` of a ``[rows/4, 4·cols]`` matrix (the
  16-bit MMA fragment of one thread, four K tiles deep, and the "threads 4–7 next to 0–3" cache-line trick);
- each run of 4 bytes ``b0..b3`` (8 codes) is then bit-shuffled into one little-endian 32-bit word so that the
  kernel turns it into bf16 pairs with masks and shifts: half ``h`` (h=0: low nibbles, h=1: high nibbles) holds, from
  bit 15 down, ``s(b0) s(b3) m(b3) s(b1) e(b3) s(b2) em(b0) em(b1) em(b2)`` where ``s`` is a code's sign bit, ``e``
  its 2 exponent bits, ``m`` its mantissa bit and ``em`` its 3 low bits. The mma_version 2 variant (4-byte k-width)
  is supported the same way.
- For mx_axis = ndim−2 the swizzled shape is ``[..., 4·cols_pad, rows_pad/4]``; ``[E, 2·K_pad, N_pad/4]`` for
  vLLM's ``[E, K/2, N]`` (``K_pad`` = K rounded up to 64). K=2880 needs no value padding (1440 bytes = 45·32).

Scale layout (``HOPPER_SCALE``, ``num_warps`` w; uint8 e8m0 storage):
- padding: rows to a multiple of ``32·w`` (256 for w=8), cols (scale groups along K) to a multiple of 2, with zeros;
- byte ``(r, c)`` with ``r = 32w·r0 + 16w·a + 16·v + 8·b + d`` (v < w, d < 8) and ``c = 2·c0 + e`` moves to row
  ``w·r0 + v`` and column ``64·c0 + 32·a + 4·d + 2·e + b`` of a ``[rows/32, 32·cols]`` matrix;
- swizzled shape for vLLM's ``[E, K/32, N]``: ``[E, 32·Ks, N_pad/32]`` with ``Ks`` = K/32 rounded up to even and
  ``N_pad`` = N rounded up to 256, stored as a transposed view of a contiguous ``[E, N_pad/32, 32·Ks]`` block.
  gpt-oss: N=2880 → 3072 (96 swizzled rows), N=5760 (w13) → 5888 (184 rows); K=2880 → Ks=90, rows of 2880 bytes.

What the kernel reads for scales when K is not a multiple of the K tile (the known bug class). ``_matmul_ogs`` loads
the swizzled scale tile of each K step *without a mask* (only the strided layout masks its scale loads): per expert
and per 32-row slab of the swizzled block it reads ``ceil(K / block_k) · block_k`` bytes from the start of a row of
``32·Ks`` bytes. For K=2880 and block_k=128 that is 23·128 = 2944 bytes — 64 bytes past the end of every row
(:func:`scale_overrun`). Those 64 bytes are the next row's first 64 (or, for the last expert's last row, the 64 bytes
after the end of the whole allocation); the in-kernel unswizzle maps them to scale groups 90 and 91 of all 32
weight columns of the row. Their weight values are masked to zero, so a finite byte there is harmless, but the
kernel upcasts e8m0 as bf16 bits (``byte << 7``): 0x00 becomes +0.0 and 0xff becomes **+Inf** (not NaN as in the OCP
spec), and 0 × Inf = NaN inside the dot product. So bytes 0xff right after the scale tensor poison the outputs of the
last expert in the weight columns of its last swizzled row: columns ``[256·m + 112, +16)`` and ``[256·m + 240, +16)``
with ``m = N_pad/256 − 1`` — for w13 (N=5760) columns 5744..5759, i.e. SwiGLU outputs 2872..2879 of rows routed to
expert E−1; for N=2880 the affected columns (2928.., 3056..) are padding and masked on store, so w2 is immune.
:func:`scale_overrun` computes those columns for any shape. (Read from the kernel source; the GPU test
``tests/gpu/test_matmul_ogs_reference.py::test_scale_fill_past_the_end`` measures it on the real kernel.)

Torch on any device (the CPU value swizzle of mma_version 3 runs in numpy: :func:`swizzle_hopper_value_matrix`);
swizzle and unswizzle are exact inverses (unswizzle crops the padding). Cost: one permuted copy of the storage (plus
four int32 temporaries for the value bit shuffle; on the CPU two 65536-entry gathers instead).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy
import torch

from moereplay.errors import ReferenceError_

#: Layout names as triton_kernels stores them in ``Layout.name`` (and passes as ``SWIZZLE_MX_*`` to the kernel).
HOPPER_VALUE = "HOPPER_VALUE"
HOPPER_SCALE = "HOPPER_SCALE"

#: Values vLLM 0.25.1 ends up with on sm_90 for MXFP4 weights (see the module docstring).
HOPPER_NUM_WARPS = 8
HOPPER_BLOCK_K = 128
MX_GROUP = 32


def _ceil_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _axis(mx_axis: int, ndim: int) -> int:
    axis = mx_axis + ndim if mx_axis < 0 else mx_axis
    if axis not in (ndim - 2, ndim - 1) or ndim < 2:
        raise ReferenceError_(
            f"Hopper MX layouts need mx_axis on one of the two last axes, got {mx_axis} of {ndim}"
        )
    return axis


def _to_rows_cols(data: torch.Tensor, transposed: bool) -> torch.Tensor:
    return data.mT if transposed else data


# --------------------------------------------------------------------------------------------------------------
# value layout
# --------------------------------------------------------------------------------------------------------------


def _value_factors(mma_version: int) -> tuple[int, int]:
    """(bytes each thread owns contiguously along cols, K tiles grouped) for an MMA version."""
    if mma_version == 3:
        return 1, 4
    if mma_version == 2:
        return 4, 1
    raise ReferenceError_(f"Hopper value layout knows mma_version 2 and 3, got {mma_version}")


def _pack_words(codes_lo: list[torch.Tensor], codes_hi: list[torch.Tensor]) -> torch.Tensor:
    """Bit-shuffle four bytes (as their low/high nibbles) into one int32 word per group."""

    def half(n0: torch.Tensor, n1: torch.Tensor, n2: torch.Tensor, n3: torch.Tensor) -> torch.Tensor:
        word = ((n0 >> 3) & 1) << 15
        word |= ((n3 >> 3) & 1) << 14
        word |= (n3 & 1) << 13
        word |= ((n1 >> 3) & 1) << 12
        word |= ((n3 >> 1) & 3) << 10
        word |= ((n2 >> 3) & 1) << 9
        word |= (n0 & 7) << 6
        word |= (n1 & 7) << 3
        word |= n2 & 7
        return word

    return half(*codes_lo) | (half(*codes_hi) << 16)


def _unpack_words(words: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of :func:`_pack_words`: int32 words → the four bytes (int32, 0..255) they came from."""
    out = []
    for index in range(4):
        nibbles = []
        for shift in (0, 16):
            half = (words >> shift) & 0xFFFF
            if index == 0:
                sign, low = (half >> 15) & 1, (half >> 6) & 7
            elif index == 1:
                sign, low = (half >> 12) & 1, (half >> 3) & 7
            elif index == 2:
                sign, low = (half >> 9) & 1, half & 7
            else:
                sign, low = (half >> 14) & 1, (((half >> 10) & 3) << 1) | ((half >> 13) & 1)
            nibbles.append((sign << 3) | low)
        out.append(nibbles[0] | (nibbles[1] << 4))
    return out


@functools.cache
def _half_table(device: torch.device) -> torch.Tensor:
    """int32[65536]: a 16-bit half of a shuffled word → its four nibbles at bits 0, 8, 16, 24 (one per byte)."""
    halves = torch.arange(1 << 16, dtype=torch.int32)
    table = torch.zeros_like(halves)
    for index, part in enumerate(_unpack_words(halves)):
        table |= (part & 0xF) << (8 * index)
    return table.to(device)


def _unpack_words_fast(words: torch.Tensor) -> torch.Tensor:
    """Same as :func:`_unpack_words` with two table lookups: int32 words → int32 words of the four plain bytes.
    (int32 indices: an int64 index would double the temporaries.)"""
    table = _half_table(words.device)
    flat = words.reshape(-1)
    low = table.index_select(0, flat & 0xFFFF)
    high = table.index_select(0, (flat >> 16) & 0xFFFF)
    return low.bitwise_or_(high.bitwise_left_shift_(4)).view(words.shape)


@dataclass(frozen=True)
class HopperValueShape:
    """Shapes of one ``HOPPER_VALUE`` conversion. ``initial`` is the unswizzled storage shape (uint8, packed)."""

    initial: tuple[int, ...]
    mx_axis: int
    mma_version: int = 3

    @property
    def transposed(self) -> bool:
        return _axis(self.mx_axis, len(self.initial)) == len(self.initial) - 2

    @property
    def rows_cols(self) -> tuple[int, int]:
        """(rows, cols) before padding, after the transpose that puts ``mx_axis`` last."""
        a, b = self.initial[-2:]
        return (b, a) if self.transposed else (a, b)

    @property
    def padded_rows_cols(self) -> tuple[int, int]:
        kwidth, ktiles = _value_factors(self.mma_version)
        rows, cols = self.rows_cols
        return _ceil_to(rows, 16), _ceil_to(cols, ktiles * 2 * 4 * kwidth)

    @property
    def swizzled(self) -> tuple[int, ...]:
        rows, cols = self.padded_rows_cols
        last = (rows // 4, cols * 4)
        if self.transposed:
            last = (last[1], last[0])
        return (*self.initial[:-2], *last)


def _value_view_shape(batch: tuple[int, ...], rows: int, cols: int, mma_version: int) -> tuple[int, ...]:
    kwidth, ktiles = _value_factors(mma_version)
    # rows = 16·r0 + 8·w0 + 2·t0 + s0 ; cols = (ktiles·8·kwidth)·c0 + (8·kwidth)·q + (4·kwidth)·w1 + kwidth·t1 + u
    return (*batch, rows // 16, 2, 4, 2, cols // (ktiles * 8 * kwidth), ktiles, 2, 4, kwidth)


# axes of the view above (after the batch axes): r0 w0 t0 s0 c0 q w1 t1 u ; swizzled order: r0 t0 | c0 s0 t1 q w1 w0 u
_VALUE_PERM = (0, 2, 4, 3, 7, 5, 6, 1, 8)
_VALUE_INVERSE = tuple(_VALUE_PERM.index(i) for i in range(len(_VALUE_PERM)))


def swizzle_hopper_values(data: torch.Tensor, mx_axis: int, mma_version: int = 3) -> torch.Tensor:
    """``HopperMXValueLayout.swizzle_data``: packed e2m1 bytes ``[..., K_bytes, N]`` (mx_axis=-2) → swizzled storage.

    Returns a transposed view (stride 1 on the second-to-last axis) when ``mx_axis`` is the second-to-last axis, as
    triton_kernels does. Pads with zero bytes (see the module docstring). Works one matrix of the batch at a time
    into the output (:func:`swizzle_hopper_value_matrix`; temporaries: a few times one matrix, not the whole
    tensor).
    """
    shape = HopperValueShape(tuple(data.shape), mx_axis, mma_version)
    as_bytes = data.view(torch.uint8) if data.dtype != torch.uint8 else data
    matrices = _to_rows_cols(as_bytes, shape.transposed)
    rows, cols = shape.rows_cols
    rows_pad, cols_pad = shape.padded_rows_cols
    batch = tuple(matrices.shape[:-2])
    out = torch.empty((*batch, rows_pad // 4, cols_pad * 4), dtype=torch.uint8, device=data.device)
    if out.numel():
        sources = matrices.reshape(-1, rows, cols)
        targets = out.view(-1, rows_pad // 4, cols_pad * 4)
        for index in range(sources.shape[0]):
            swizzle_hopper_value_matrix(sources[index], targets[index], mma_version)
    return _to_rows_cols(out, shape.transposed)


def swizzle_hopper_value_matrix(matrix: torch.Tensor, out: torch.Tensor, mma_version: int = 3) -> None:
    """One matrix of :func:`swizzle_hopper_values` in its rows/cols orientation — ``[N, K/2]`` bytes for vLLM's
    mx_axis=1, the checkpoint's own layout — into ``out`` (contiguous uint8 ``[rows_pad/4, 4·cols_pad]``).

    On the CPU (mma_version 3) the byte reorder and the bit shuffle are one step: the four bytes of a swizzled word
    are rows ``r`` and ``r + 8`` (w0) of columns ``c`` and ``c + 4`` (w1), so rows ``r`` and ``r + 8`` are paired
    into 16-bit values in one contiguous pass, and each word is two lookups (w1 = 0 and 1) in 65536-entry tables
    of the shuffled bits, gathered straight in the swizzled order (numpy: 0.45 s for a gpt-oss w13 set on one core,
    against 1.2 s for the reorder then the shuffle). Elsewhere the reorder and the shuffle run as torch ops.
    """
    rows, cols = matrix.shape
    as_bytes = matrix.view(torch.uint8) if matrix.dtype != torch.uint8 else matrix
    probe = HopperValueShape((rows, cols), 1, mma_version)
    rows_pad, cols_pad = probe.padded_rows_cols
    if (
        tuple(out.shape) != (rows_pad // 4, cols_pad * 4)
        or out.dtype != torch.uint8
        or not out.is_contiguous()
    ):
        raise ReferenceError_(
            f"swizzled Hopper values of a [{rows}, {cols}] matrix are a contiguous uint8 "
            f"[{rows_pad // 4}, {cols_pad * 4}], got {out.dtype} {list(out.shape)}"
        )
    if (rows_pad, cols_pad) != (rows, cols):
        as_bytes = torch.nn.functional.pad(as_bytes, (0, cols_pad - cols, 0, rows_pad - rows))
    if mma_version == 3 and as_bytes.device.type == "cpu":
        _swizzle_words_numpy(as_bytes.numpy(), out.numpy())
        return
    view = _value_view_shape((), rows_pad, cols_pad, mma_version)
    work = as_bytes.reshape(view).permute(*_VALUE_PERM).reshape(rows_pad // 4, cols_pad * 4)
    out.view(torch.int32).copy_(_shuffle_words(work.view(torch.int32)))


@functools.cache
def _word_tables() -> tuple[numpy.ndarray, numpy.ndarray]:
    """uint32[65536] each: the shuffled word (:func:`_pack_words`) holding bytes ``b0 | b1 << 8`` of a group as its
    bytes 0 and 1 (the other two zero), and the same for bytes 2 and 3; a shuffle moves bits, so a word is the OR
    of its two halves' entries."""
    pairs = torch.arange(1 << 16, dtype=torch.int32)
    first, second = pairs & 0xFF, pairs >> 8
    zero = torch.zeros_like(pairs)
    low = _pack_words([first & 0xF, second & 0xF, zero, zero], [first >> 4, second >> 4, zero, zero])
    high = _pack_words([zero, zero, first & 0xF, second & 0xF], [zero, zero, first >> 4, second >> 4])
    return low.numpy().view(numpy.uint32), high.numpy().view(numpy.uint32)


def _swizzle_words_numpy(matrix: numpy.ndarray, out: numpy.ndarray) -> None:
    """:func:`swizzle_hopper_value_matrix` for mma_version 3 (padded ``[rows, cols]`` uint8 → ``out``)."""
    rows, cols = matrix.shape
    low_table, high_table = _word_tables()
    # rows = 16·r0 + 8·w0 + 2·t0 + s0: rows r and r + 8 (w0 = 0, 1) become one 16-bit value, w0 = 1 the high byte
    halves = matrix.reshape(rows // 16, 2, 8, cols)
    paired = halves[:, 1].astype(numpy.uint16)
    paired <<= 8
    paired |= halves[:, 0]
    # [r0, t0, s0, c0, q, w1, t1] → words in the swizzled order r0 t0 | c0 s0 t1 q, one gather per w1
    digits = paired.reshape(rows // 16, 4, 2, cols // 32, 4, 2, 4)
    words = out.view(numpy.uint32).reshape(rows // 16, 4, cols // 32, 2, 4, 4)
    # (indices are 16-bit: always in range; mode="clip" only spares numpy buffering ``out``, as "raise" does)
    numpy.take(low_table, digits[:, :, :, :, :, 0].transpose(0, 1, 3, 2, 5, 4), out=words, mode="clip")
    words |= numpy.take(high_table, digits[:, :, :, :, :, 1].transpose(0, 1, 3, 2, 5, 4), mode="clip")


@functools.cache
def _shuffle_table(device: torch.device) -> torch.Tensor:
    """int32[65536]: four nibbles ``n0 | n1<<4 | n2<<8 | n3<<12`` → the 16-bit half :func:`_pack_words` makes."""
    index = torch.arange(1 << 16, dtype=torch.int32)
    nibbles = [(index >> (4 * i)) & 0xF for i in range(4)]
    zeros = [torch.zeros_like(index)] * 4
    return (_pack_words(nibbles, zeros) & 0xFFFF).to(device)


def _nibble_index(nibbles: torch.Tensor) -> torch.Tensor:
    """int32 words with a nibble in bits 0, 8, 16, 24 → ``n0 | n1<<4 | n2<<8 | n3<<12``."""
    merged = nibbles | (nibbles >> 4)
    return (merged & 0xFF) | ((merged >> 8) & 0xFF00)


def _shuffle_words(words: torch.Tensor) -> torch.Tensor:
    """Same as :func:`_pack_words` on the four bytes of each int32 word (little-endian), by two table lookups."""
    table = _shuffle_table(words.device)
    flat = words.reshape(-1)
    low = table.index_select(0, _nibble_index(flat & 0x0F0F0F0F))
    high = table.index_select(0, _nibble_index((flat >> 4) & 0x0F0F0F0F))
    return low.bitwise_or_(high.bitwise_left_shift_(16)).view(words.shape)


def unswizzle_hopper_values(
    swizzled: torch.Tensor, initial_shape: tuple[int, ...] | torch.Size, mx_axis: int, mma_version: int = 3
) -> torch.Tensor:
    """``HopperMXValueLayout.unswizzle_data``: swizzled storage → packed bytes of ``initial_shape``, padding cropped.

    ``initial_shape`` is the layout's ``initial_shape`` (the storage shape before swizzling). The result is a view
    with the same orientation as the original storage (a transpose when mx_axis is the second-to-last axis).
    """
    shape = HopperValueShape(tuple(initial_shape), mx_axis, mma_version)
    if tuple(swizzled.shape) != shape.swizzled:
        raise ReferenceError_(
            f"swizzled Hopper values have shape {tuple(swizzled.shape)}, expected {shape.swizzled} "
            f"for initial shape {shape.initial}"
        )
    rows, cols = shape.rows_cols
    rows_pad, cols_pad = shape.padded_rows_cols
    as_bytes = swizzled.view(torch.uint8) if swizzled.dtype != torch.uint8 else swizzled
    work = _to_rows_cols(as_bytes, shape.transposed).contiguous()
    batch = tuple(work.shape[:-2])
    nb = len(batch)
    if work.numel():
        work = _unpack_words_fast(work.view(torch.int32)).view(torch.uint8)
    view = _value_view_shape(batch, rows_pad, cols_pad, mma_version)
    swz_view = tuple(view[nb + p] for p in _VALUE_PERM)
    work = work.reshape(*batch, *swz_view)
    work = work.permute(*range(nb), *(nb + p for p in _VALUE_INVERSE)).reshape(*batch, rows_pad, cols_pad)
    return _to_rows_cols(work[..., :rows, :cols], shape.transposed)


# --------------------------------------------------------------------------------------------------------------
# scale layout
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HopperScaleShape:
    """Shapes of one ``HOPPER_SCALE`` conversion. ``initial`` is the unswizzled scale storage shape."""

    initial: tuple[int, ...]
    mx_axis: int
    num_warps: int = HOPPER_NUM_WARPS

    def __post_init__(self) -> None:
        if self.num_warps <= 0 or self.num_warps & (self.num_warps - 1):
            raise ReferenceError_(f"Hopper scale layout needs a power-of-two num_warps, got {self.num_warps}")

    @property
    def transposed(self) -> bool:
        return _axis(self.mx_axis, len(self.initial)) == len(self.initial) - 2

    @property
    def rows_cols(self) -> tuple[int, int]:
        a, b = self.initial[-2:]
        return (b, a) if self.transposed else (a, b)

    @property
    def padded_rows_cols(self) -> tuple[int, int]:
        rows, cols = self.rows_cols
        return _ceil_to(rows, 32 * self.num_warps), _ceil_to(cols, 2)

    @property
    def swizzled(self) -> tuple[int, ...]:
        rows, cols = self.padded_rows_cols
        last = (rows // 32, cols * 32)
        if self.transposed:
            last = (last[1], last[0])
        return (*self.initial[:-2], *last)


# view axes: r0 a v b d | c0 e   (rows = 32w·r0 + 16w·a + 16·v + 8·b + d, cols = 2·c0 + e);
# swizzled order: r0 v | c0 a d e b
_SCALE_PERM = (0, 2, 5, 1, 4, 6, 3)
_SCALE_INVERSE = tuple(_SCALE_PERM.index(i) for i in range(len(_SCALE_PERM)))


def _scale_view_shape(batch: tuple[int, ...], rows: int, cols: int, num_warps: int) -> tuple[int, ...]:
    return (*batch, rows // (32 * num_warps), 2, num_warps, 2, 8, cols // 2, 2)


def swizzle_hopper_scales(
    data: torch.Tensor, mx_axis: int, num_warps: int = HOPPER_NUM_WARPS
) -> torch.Tensor:
    """``HopperMXScaleLayout.swizzle_data``: e8m0 bytes ``[..., K/32, N]`` (mx_axis=-2) → swizzled storage.

    Pads with zero bytes; returns a transposed view of a fresh contiguous block when mx_axis is the second-to-last
    axis, as triton_kernels does. Works on any 1-byte dtype (the bytes are moved, never decoded).
    """
    shape = HopperScaleShape(tuple(data.shape), mx_axis, num_warps)
    work = _to_rows_cols(data, shape.transposed).contiguous()
    rows, cols = shape.rows_cols
    rows_pad, cols_pad = shape.padded_rows_cols
    as_bytes = work.view(torch.uint8) if work.dtype != torch.uint8 else work
    as_bytes = torch.nn.functional.pad(as_bytes, (0, cols_pad - cols, 0, rows_pad - rows))
    batch = tuple(as_bytes.shape[:-2])
    nb = len(batch)
    view = as_bytes.reshape(_scale_view_shape(batch, rows_pad, cols_pad, num_warps))
    swz = view.permute(*range(nb), *(nb + p for p in _SCALE_PERM)).reshape(
        *batch, rows_pad // 32, cols_pad * 32
    )
    swz = swz.contiguous()
    if data.dtype != torch.uint8:
        swz = swz.view(data.dtype)
    return _to_rows_cols(swz, shape.transposed)


def unswizzle_hopper_scales(
    swizzled: torch.Tensor,
    initial_shape: tuple[int, ...] | torch.Size,
    mx_axis: int,
    num_warps: int = HOPPER_NUM_WARPS,
) -> torch.Tensor:
    """Inverse of :func:`swizzle_hopper_scales`, cropped to ``initial_shape`` (triton_kernels' own unswizzle keeps
    the padding; crop ``[..., :K/32, :N]`` of it to compare)."""
    shape = HopperScaleShape(tuple(initial_shape), mx_axis, num_warps)
    if tuple(swizzled.shape) != shape.swizzled:
        raise ReferenceError_(
            f"swizzled Hopper scales have shape {tuple(swizzled.shape)}, expected {shape.swizzled} "
            f"for initial shape {shape.initial}"
        )
    rows, cols = shape.rows_cols
    rows_pad, cols_pad = shape.padded_rows_cols
    work = _to_rows_cols(swizzled, shape.transposed)
    dtype = work.dtype
    as_bytes = work.contiguous()
    as_bytes = as_bytes.view(torch.uint8) if dtype != torch.uint8 else as_bytes
    batch = tuple(as_bytes.shape[:-2])
    nb = len(batch)
    view = _scale_view_shape(batch, rows_pad, cols_pad, num_warps)
    swz_view = tuple(view[nb + p] for p in _SCALE_PERM)
    out = as_bytes.reshape(*batch, *swz_view).permute(*range(nb), *(nb + p for p in _SCALE_INVERSE))
    out = out.reshape(*batch, rows_pad, cols_pad)[..., :rows, :cols]
    if dtype != torch.uint8:
        out = out.contiguous().view(dtype)
    return _to_rows_cols(out, shape.transposed)


# --------------------------------------------------------------------------------------------------------------
# what the kernel does with those bytes
# --------------------------------------------------------------------------------------------------------------


def decode_e8m0_as_hopper_kernel(scales: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes → float32 the way the Hopper ``mxfp4_to_bf16_triton`` upcast sees them (``byte << 7`` as bf16).

    Equal to the OCP value ``2**(b-127)`` for bytes 1..254; byte 0 becomes +0.0 (OCP: 2**-127) and byte 0xff becomes
    +Inf (OCP: NaN). Use it to explain a kernel result; the reference itself follows the OCP spec.
    """
    raw = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    bits = raw.to(torch.int32) << 7
    return (bits << 16).view(torch.float32)


@dataclass(frozen=True)
class ScaleOverrun:
    """The unmasked scale reads of one Hopper MXFP4 ``matmul_ogs`` weight, per expert.

    ``row_bytes``: length of one swizzled scale row; ``bytes_read``: bytes the kernel loads from each row's start;
    ``overrun``: bytes past the row end (0 = none); ``last_row_columns``: the real weight columns (< N) whose scales
    sit in the last swizzled row of an expert, i.e. the outputs that read past the end of the whole tensor for the
    last expert.
    """

    n: int
    k: int
    num_warps: int
    block_k: int
    row_bytes: int
    bytes_read: int
    overrun: int
    last_row_columns: tuple[int, ...]


def scale_overrun(
    n: int, k: int, *, num_warps: int = HOPPER_NUM_WARPS, block_k: int = HOPPER_BLOCK_K
) -> ScaleOverrun:
    """Where the kernel's unmasked scale loads go past each swizzled row for a weight of logical ``[K, N]``."""
    if k % MX_GROUP:
        raise ReferenceError_(f"MXFP4 needs K to be a multiple of {MX_GROUP}, got {k}")
    row_bytes = _ceil_to(k // MX_GROUP, 2) * 32
    bytes_read = -(-k // block_k) * block_k
    n_pad = _ceil_to(n, 32 * num_warps)
    last_slab = n_pad // (32 * num_warps) - 1
    base = 32 * num_warps * last_slab
    warp = num_warps - 1
    columns = [
        base + 16 * num_warps * a + 16 * warp + 8 * b + d
        for a in range(2)
        for b in range(2)
        for d in range(8)
    ]
    return ScaleOverrun(
        n=n,
        k=k,
        num_warps=num_warps,
        block_k=block_k,
        row_bytes=row_bytes,
        bytes_read=bytes_read,
        overrun=max(0, bytes_read - row_bytes),
        last_row_columns=tuple(sorted(c for c in columns if c < n)),
    )
