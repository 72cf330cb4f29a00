"""Hopper MXFP4 value/scale swizzles: exact inverses, the documented byte placement, padding, the overrun map."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from moereplay.errors import ReferenceError_
from moereplay.reference.hopper_mxfp4 import (
    HopperScaleShape,
    HopperValueShape,
    decode_e8m0_as_hopper_kernel,
    scale_overrun,
    swizzle_hopper_scales,
    swizzle_hopper_values,
    unswizzle_hopper_scales,
    unswizzle_hopper_values,
)

VALUE_SHAPES = [
    ((2, 1440, 512), 1),  # K = 2880: 1440 bytes, no value padding
    ((1, 1472, 256), 1),  # K = 2944
    ((3, 100, 40), 1),  # rows and cols both padded
    ((2, 40, 100), 2),  # mx_axis last: no transpose
    ((33, 17), 0),
    ((2, 2, 64, 48), 2),
]
SCALE_SHAPES = [
    ((2, 90, 5760), 1, 8),  # w13 of gpt-oss: K = 2880, N = 5760 → 5888
    ((2, 90, 2880), 1, 8),  # w2: N = 2880 → 3072
    ((2, 91, 300), 1, 4),  # odd K/32 → padded to 92
    ((5, 7, 300), 1, 8),
    ((2, 300, 7), 2, 8),
    ((90, 2880), 0, 8),
    ((2, 3, 45, 260), 2, 2),
]


def _random_bytes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mma_version", [3, 2])
@pytest.mark.parametrize(("shape", "mx_axis"), VALUE_SHAPES)
def test_value_swizzle_roundtrip(shape: tuple[int, ...], mx_axis: int, mma_version: int) -> None:
    data = _random_bytes(shape, seed=sum(shape))
    swizzled = swizzle_hopper_values(data, mx_axis, mma_version)
    layout = HopperValueShape(shape, mx_axis, mma_version)
    assert tuple(swizzled.shape) == layout.swizzled
    if layout.transposed:
        assert swizzled.stride(-2) == 1  # the kernel keys W_TRANSPOSE on this stride
    back = unswizzle_hopper_values(swizzled, shape, mx_axis, mma_version)
    assert torch.equal(back, data)


def test_value_swizzle_shapes_for_gpt_oss() -> None:
    # vLLM's w13 storage [E, K/2, N] = [32, 1440, 5760] → [E, 2·K, N/4], no padding at K = 2880
    assert HopperValueShape((32, 1440, 5760), 1).swizzled == (32, 5760, 1440)
    assert HopperValueShape((32, 1440, 2880), 1).swizzled == (32, 5760, 720)
    # rows to 16, bytes to 32: [.., 20 bytes, 10 rows] → [.., 4·32, 16/4]
    assert HopperValueShape((20, 10), 0).swizzled == (128, 4)


def test_value_byte_placement_and_bit_shuffle() -> None:
    """One non-zero byte at (row r, byte c) lands in the documented word with the documented bits."""
    rows, cols = 32, 64
    for r, c in [(0, 0), (9, 5), (27, 41), (31, 63), (6, 38)]:
        data = torch.zeros(rows, cols, dtype=torch.uint8)
        data[r, c] = 0xB3  # low nibble 0b0011, high nibble 0b1011
        swz = swizzle_hopper_values(data, mx_axis=1)
        r0, rem = divmod(r, 16)
        w0, rem = divmod(rem, 8)
        t0, s0 = divmod(rem, 2)
        c0, rem = divmod(c, 32)
        q, rem = divmod(rem, 8)
        w1, t1 = divmod(rem, 4)
        out_row = 4 * r0 + t0
        out_col = 128 * c0 + 64 * s0 + 16 * t1 + 4 * q + 2 * w1 + w0
        words = swz.contiguous().view(torch.int32)
        nonzero = torch.nonzero(words)
        assert nonzero.tolist() == [[out_row, out_col // 4]]
        word = int(words[out_row, out_col // 4]) & 0xFFFFFFFF
        position = out_col % 4  # which of b0..b3 the byte became
        low, high = 0x3, 0xB

        def half_bits(code: int, position: int = position) -> int:
            sign, low3, exponent, mantissa = (code >> 3) & 1, code & 7, (code >> 1) & 3, code & 1
            return [
                (sign << 15) | (low3 << 6),
                (sign << 12) | (low3 << 3),
                (sign << 9) | low3,
                (sign << 14) | (mantissa << 13) | (exponent << 10),
            ][position]

        assert word == half_bits(low) | (half_bits(high) << 16)


def test_word_shuffle_by_table_matches_the_bit_formula() -> None:
    """Every word shuffled by the two table lookups equals the bit-by-bit shuffle of its four bytes."""
    from moereplay.reference.hopper_mxfp4 import _pack_words, _shuffle_words

    gen = torch.Generator().manual_seed(3)
    words = torch.randint(-(2**31), 2**31, (4096,), generator=gen, dtype=torch.int64).to(torch.int32)
    words[:4] = torch.tensor([0, -1, 0x0F0F0F0F, -0x0F0F0F10], dtype=torch.int32)
    parts = [(words >> (8 * i)) & 0xFF for i in range(4)]
    expected = _pack_words([p & 0xF for p in parts], [(p >> 4) & 0xF for p in parts])
    assert torch.equal(_shuffle_words(words.view(64, 64)), expected.view(64, 64))


def test_a_batch_swizzles_like_its_matrices_one_by_one() -> None:
    data = torch.randint(0, 256, (3, 2, 100, 40), dtype=torch.uint8)
    whole = swizzle_hopper_values(data, mx_axis=2)
    for i in range(3):
        for j in range(2):
            assert torch.equal(whole[i, j], swizzle_hopper_values(data[i, j], mx_axis=0))


def test_value_padding_is_zero_bytes() -> None:
    data = torch.full((10, 20), 0xFF, dtype=torch.uint8)
    swz = swizzle_hopper_values(data, mx_axis=1)
    assert int((swz != 0).sum()) < swz.numel()
    assert torch.equal(unswizzle_hopper_values(swz, (10, 20), mx_axis=1), data)


@pytest.mark.parametrize(("shape", "mx_axis", "num_warps"), SCALE_SHAPES)
def test_scale_swizzle_roundtrip(shape: tuple[int, ...], mx_axis: int, num_warps: int) -> None:
    data = _random_bytes(shape, seed=len(shape) + num_warps)
    swizzled = swizzle_hopper_scales(data, mx_axis, num_warps)
    layout = HopperScaleShape(shape, mx_axis, num_warps)
    assert tuple(swizzled.shape) == layout.swizzled
    assert torch.equal(unswizzle_hopper_scales(swizzled, shape, mx_axis, num_warps), data)


def test_scale_swizzle_keeps_e8m0_dtype() -> None:
    data = _random_bytes((2, 4, 64), seed=3).view(torch.float8_e8m0fnu)
    swz = swizzle_hopper_scales(data, 1)
    assert swz.dtype == torch.float8_e8m0fnu
    assert torch.equal(unswizzle_hopper_scales(swz, (2, 4, 64), 1).view(torch.uint8), data.view(torch.uint8))


def test_scale_shapes_for_gpt_oss() -> None:
    assert HopperScaleShape((32, 90, 5760), 1).swizzled == (32, 2880, 184)
    assert HopperScaleShape((32, 90, 2880), 1).swizzled == (32, 2880, 96)
    assert HopperScaleShape((32, 91, 2880), 1).swizzled == (32, 2944, 96)


def test_scale_byte_placement() -> None:
    num_warps = 4
    rows, cols = 2 * 32 * num_warps, 6  # rows = N, cols = K/32 (mx_axis last)
    for r, c in [(0, 0), (77, 3), (255, 5), (130, 1)]:
        data = torch.zeros(rows, cols, dtype=torch.uint8)
        data[r, c] = 7
        swz = swizzle_hopper_scales(data, mx_axis=1, num_warps=num_warps)
        r0, rem = divmod(r, 32 * num_warps)
        a, rem = divmod(rem, 16 * num_warps)
        v, rem = divmod(rem, 16)
        b, d = divmod(rem, 8)
        c0, e = divmod(c, 2)
        assert torch.nonzero(swz).tolist() == [[num_warps * r0 + v, 64 * c0 + 32 * a + 4 * d + 2 * e + b]]


def test_shape_mismatch_is_a_reference_error() -> None:
    data = _random_bytes((2, 32, 16), seed=1)
    swz = swizzle_hopper_values(data, 1)
    with pytest.raises(ReferenceError_, match="expected"):
        unswizzle_hopper_values(swz, (2, 64, 16), 1)
    with pytest.raises(ReferenceError_, match="mx_axis"):
        swizzle_hopper_values(data, 0)
    with pytest.raises(ReferenceError_, match="power-of-two"):
        swizzle_hopper_scales(data, 1, num_warps=6)


def test_kernel_scale_decode() -> None:
    raw = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = decode_e8m0_as_hopper_kernel(raw)
    assert got[0] == 0.0
    assert got[1] == 2.0**-126
    assert got[2:6].tolist() == [0.5, 1.0, 2.0, 2.0**127]
    assert torch.isposinf(got[6])


def test_scale_overrun_at_k_2880() -> None:
    w13 = scale_overrun(5760, 2880)
    assert (w13.row_bytes, w13.bytes_read, w13.overrun) == (2880, 2944, 64)
    assert w13.last_row_columns == tuple(range(5744, 5760))
    w2 = scale_overrun(2880, 2880)
    assert w2.overrun == 64 and w2.last_row_columns == ()
    assert scale_overrun(2880, 3072).overrun == 0
    assert scale_overrun(2880, 2912).overrun == 0  # 91 groups pad to 92: rows of 2944 bytes
    with pytest.raises(ReferenceError_):
        scale_overrun(2880, 2890)


def test_overrun_columns_match_the_swizzled_last_row() -> None:
    """The columns scale_overrun names are exactly those whose scales sit in the last swizzled row."""
    n, k = 5760, 2880
    marker = torch.zeros(1, k // 32, n, dtype=torch.uint8)
    swz = swizzle_hopper_scales(marker + 1, 1)
    storage = swz.mT.contiguous()  # [1, rows, 32·Ks] as laid out in memory
    storage[0, -1, :] = 9
    back = unswizzle_hopper_scales(storage.mT, marker.shape, 1)
    columns = torch.nonzero((back[0] == 9).any(dim=0)).reshape(-1).tolist()
    assert tuple(columns) == scale_overrun(n, k).last_row_columns


def _load_triton_kernels_layouts() -> tuple[types.ModuleType, types.ModuleType]:
    """triton_kernels' own Hopper layout classes, only where triton imports (they decorate kernels at import)."""
    pytest.importorskip("triton", reason="triton_kernels' layout modules import triton")
    root = Path("/work/vllm-src/vllm/third_party/triton_kernels")
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.submodule_search_locations:
        root = Path(next(iter(spec.submodule_search_locations))) / "third_party" / "triton_kernels"
    if not root.is_dir():
        pytest.skip("no triton_kernels sources found")
    sys.path.insert(0, str(root.parent))
    try:
        value = importlib.import_module("triton_kernels.tensor_details.layout_details.hopper_value")
        scale = importlib.import_module("triton_kernels.tensor_details.layout_details.hopper_scale")
    except Exception as e:  # pragma: no cover - depends on the machine
        pytest.skip(f"triton_kernels layouts do not import here: {e}")
    finally:
        sys.path.remove(str(root.parent))
    return value, scale


def test_matches_triton_kernels_layout_classes() -> None:
    value_mod, scale_mod = _load_triton_kernels_layouts()
    for shape, mx_axis in VALUE_SHAPES:
        data = _random_bytes(shape, seed=11)
        theirs = value_mod.HopperMXValueLayout(list(shape), mx_axis).swizzle_data(data)
        assert torch.equal(theirs, swizzle_hopper_values(data, mx_axis))
    for shape, mx_axis, num_warps in SCALE_SHAPES:
        data = _random_bytes(shape, seed=12)
        theirs = scale_mod.HopperMXScaleLayout(list(shape), mx_axis, num_warps=num_warps).swizzle_data(data)
        assert torch.equal(theirs, swizzle_hopper_scales(data, mx_axis, num_warps))


@pytest.mark.parametrize(("rows", "cols"), [(5760 // 8, 1440 // 8), (100, 40), (16, 32), (48, 64)])
def test_cpu_value_swizzle_is_the_reorder_then_the_word_shuffle(rows: int, cols: int) -> None:
    """On the CPU (mma_version 3) rows r / r + 8 are paired and each word is two table lookups, gathered in the
    swizzled order: the same bytes as reordering them (the layout's permute) and shuffling each word after."""
    from moereplay.reference.hopper_mxfp4 import (
        _VALUE_PERM,
        _shuffle_words,
        _value_view_shape,
        swizzle_hopper_value_matrix,
    )

    matrix = _random_bytes((rows, cols), rows + cols)
    rows_pad, cols_pad = HopperValueShape((cols, rows), 0, 3).padded_rows_cols
    padded = torch.nn.functional.pad(matrix, (0, cols_pad - cols, 0, rows_pad - rows))
    reordered = padded.reshape(_value_view_shape((), rows_pad, cols_pad, 3)).permute(*_VALUE_PERM)
    expected = _shuffle_words(reordered.reshape(rows_pad // 4, cols_pad * 4).contiguous().view(torch.int32))
    out = torch.empty(rows_pad // 4, cols_pad * 4, dtype=torch.uint8)
    swizzle_hopper_value_matrix(matrix, out)
    assert torch.equal(out.view(torch.int32), expected)
    with pytest.raises(ReferenceError_, match="contiguous uint8"):
        swizzle_hopper_value_matrix(matrix, out[:, :-4])
