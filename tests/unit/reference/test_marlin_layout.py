"""Marlin packing: hand-worked positions (from the repack kernel's thread/fragment mapping) and exact inverses."""

from __future__ import annotations

import pytest
import torch

from moereplay.errors import ReferenceError_
from moereplay.reference import marlin_layout as layout


def _single(k_extent: int, n_extent: int, k: int, n: int, code: int = 1) -> torch.Tensor:
    codes = torch.zeros((k_extent, n_extent), dtype=torch.uint8)
    codes[k, n] = code
    return codes


def _where(packed: torch.Tensor, num_bits: int) -> tuple[int, int]:
    """(flat word, position in word) of the one non-zero code."""
    flat = packed.reshape(-1).to(torch.int64) & 0xFFFFFFFF
    words = torch.nonzero(flat).reshape(-1)
    assert words.numel() == 1, words
    word = int(words[0])
    value = int(flat[word])
    mask = (1 << num_bits) - 1
    positions = [p for p in range(32 // num_bits) if (value >> (num_bits * p)) & mask]
    assert len(positions) == 1
    return word, positions[0]


@pytest.mark.parametrize(
    ("k", "n", "word", "position"),
    [
        (0, 0, 0, 0),
        (8, 0, 0, 1),  # second value of the fragment: row + 8
        (0, 8, 0, 2),  # the b2 half: column + 8
        (8, 8, 0, 3),
        (1, 0, 0, 4),
        (9, 0, 0, 5),
        (1, 8, 0, 6),
        (9, 8, 0, 7),
        (2, 0, 4, 0),  # thread 1 (row pair 2-3) → word 4 (words are thread * 4 + warp)
        (0, 1, 16, 0),  # column 1 is thread 4
        (0, 16, 1, 0),  # columns 16-31 are warp 1
        (0, 64, 128, 0),  # second n-tile starts at word 128
    ],
)
def test_4bit_positions(k: int, n: int, word: int, position: int) -> None:
    packed = layout.pack_weights(_single(16, 128, k, n), 4)
    assert packed.shape == (1, 256)
    assert _where(packed, 4) == (word, position)


def test_4bit_second_k_tile_is_second_row() -> None:
    packed = layout.pack_weights(_single(32, 64, 16, 0), 4)
    assert packed.shape == (2, 128)
    assert _where(packed, 4) == (128, 0)


@pytest.mark.parametrize(
    ("k", "n", "word", "position"),
    [
        (0, 0, 0, 0),
        (8, 0, 0, 1),
        (1, 0, 0, 2),
        (9, 0, 0, 3),
        (0, 8, 1, 0),  # second word of the pair holds column + 8
        (0, 16, 2, 0),  # warp 1
        (2, 0, 8, 0),  # thread 1: words are thread * 8 + warp * 2 + half
    ],
)
def test_8bit_positions(k: int, n: int, word: int, position: int) -> None:
    packed = layout.pack_weights(_single(16, 64, k, n), 8)
    assert packed.shape == (1, 256)
    assert _where(packed, 8) == (word, position)


@pytest.mark.parametrize(
    ("num_bits", "k", "n", "word", "position"),
    [
        (4, 16, 0, 0, 1),  # 8-bit activations: 32 x 32 tiles, rows r..r+3 and r+16..r+19 interleaved
        (4, 1, 0, 0, 2),
        (4, 0, 8, 1, 0),
        (4, 0, 16, 2, 0),
        (4, 4, 0, 4, 0),
        (8, 1, 0, 0, 1),
        (8, 16, 0, 1, 0),
        (8, 0, 8, 2, 0),
    ],
)
def test_8bit_activation_positions(num_bits: int, k: int, n: int, word: int, position: int) -> None:
    packed = layout.pack_weights(_single(32, 32, k, n, code=1), num_bits, is_a_8bit=True)
    assert _where(packed, num_bits) == (word, position)


@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("is_a_8bit", [False, True])
def test_pack_unpack_identity(num_bits: int, is_a_8bit: bool) -> None:
    gen = torch.Generator().manual_seed(num_bits + 2 * is_a_8bit)
    codes = torch.randint(0, 1 << num_bits, (3, 96, 128), generator=gen, dtype=torch.uint8)
    packed = layout.pack_weights(codes, num_bits, is_a_8bit)
    assert packed.dtype == torch.int32
    assert packed.shape == (3, 96 // 16, 128 * 16 * num_bits // 32)
    assert torch.equal(layout.unpack_weights(packed, num_bits, is_a_8bit), codes)
    assert layout.marlin_weight_extent(packed, num_bits) == (96, 128)


def test_tile_tables_are_permutations_and_match_the_axis_shuffle() -> None:
    for bits in (4, 8):
        for a8 in (False, True):
            table = layout.tile_slot_sources(bits, a8)
            assert torch.equal(torch.sort(table).values, torch.arange(1024))
            # the fast reshape/permute path moves slot s to tile position table[s]
            assert torch.equal(layout._slots_to_tiles(table, bits, a8), torch.arange(1024))
            assert torch.equal(layout._tiles_to_slots(torch.arange(1024), bits, a8), table)


def test_rows_round_trip_and_fp4_bytes() -> None:
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (64, 32), generator=gen, dtype=torch.uint8)
    rows = layout.pack_rows(codes, 4)
    assert rows.shape == (8, 32)
    assert torch.equal(layout.unpack_rows(rows, 4), codes)
    # checkpoint fp4: uint8 [N, K/2], element 2i in the low nibble of byte i; as int32, transposed = pack_rows
    as_bytes = (codes[0::2].T | (codes[1::2].T << 4)).contiguous()
    assert torch.equal(as_bytes.view(torch.int32).T, rows)


def test_scale_orders_hand_worked() -> None:
    logical = torch.arange(64, dtype=torch.float32).view(1, 64)
    grouped = layout.permute_scales(logical, grouped=True)
    assert grouped[0, 1] == 8 and grouped[0, 8] == 1 and grouped[0, 9] == 9  # 8 x 8 transpose
    channel = layout.permute_scales(logical, grouped=False)
    assert channel[0, :16].tolist() == [0, 1, 8, 9, 16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27]
    assert channel[0, 32:40].tolist() == [32, 33, 40, 41, 48, 49, 56, 57]
    for flag in (True, False):
        assert torch.equal(layout.unpermute_scales(layout.permute_scales(logical, flag), flag), logical)
    swapped = layout.swap_scale_pairs(torch.arange(8).view(1, 8))
    assert swapped.tolist() == [[0, 2, 1, 3, 4, 6, 5, 7]]
    bias = torch.arange(64.0)
    assert torch.equal(layout.permute_bias(bias), channel[0])
    assert torch.equal(layout.unpermute_bias(layout.permute_bias(bias)), bias)
    assert layout.scales_are_grouped(2) and not layout.scales_are_grouped(1)
    assert not layout.scales_are_grouped(4, is_a_8bit=True)


def test_zero_points_hand_worked_and_round_trip() -> None:
    zp = (torch.arange(64) // 8).view(1, 64).to(torch.uint8)
    packed = layout.pack_zero_points(zp, 4)
    assert packed.shape == (1, 8)
    # transpose gives 0,8,...,56 → values 0..7, interleave (0,2,4,6,1,3,5,7), 4 bits each, low first
    assert (int(packed[0, 0]) & 0xFFFFFFFF) == 0x75316420
    gen = torch.Generator().manual_seed(5)
    for bits in (4, 8):
        for a8 in (False, True):
            values = torch.randint(0, 1 << bits, (2, 3, 128), generator=gen, dtype=torch.uint8)
            packed = layout.pack_zero_points(values, bits, a8)
            assert packed.shape == (2, 3, 128 * bits // 32)
            assert torch.equal(layout.unpack_zero_points(packed, bits, a8), values)
    floats = torch.rand(2, 4, 64, generator=gen)
    assert torch.equal(layout.unpermute_float_zero_points(layout.permute_float_zero_points(floats)), floats)


def test_act_order_helpers() -> None:
    g_idx = torch.tensor([[1, 0, 1, 0]], dtype=torch.int32)
    sorted_g, perm = layout.sort_act_order(g_idx)
    assert sorted_g.tolist() == [[0, 0, 1, 1]]
    assert perm.tolist() == [[1, 3, 0, 2]]
    rows = torch.arange(8).view(1, 4, 2)
    assert layout.act_order_rows(rows, perm)[0, :, 0].tolist() == [2, 6, 0, 4]


def test_shape_errors() -> None:
    with pytest.raises(ReferenceError_):
        layout.pack_weights(torch.zeros(8, 64, dtype=torch.uint8), 4)
    with pytest.raises(ReferenceError_):
        layout.pack_weights(torch.zeros(16, 48, dtype=torch.uint8), 4)
    with pytest.raises(ReferenceError_):
        layout.pack_weights(torch.zeros(16, 64, dtype=torch.uint8), 3)
    with pytest.raises(ReferenceError_):
        layout.unpack_weights(torch.zeros(1, 128, dtype=torch.float32), 4)
    with pytest.raises(ReferenceError_):
        layout.permute_scales(torch.zeros(1, 40), grouped=True)


def test_run_orders_match_their_index_definition() -> None:
    values = torch.arange(3 * 128).view(3, 128)
    for order in [
        layout.scale_order(True),
        layout.scale_order(False),
        (0, 2, 1, 3),
        (0, 2, 4, 6, 1, 3, 5, 7),
    ]:
        index = torch.tensor(order)
        expected = values.view(3, -1, len(order))[..., index].reshape(3, 128)
        assert torch.equal(layout._apply_run_order(values, order, inverse=False), expected)
        assert torch.equal(layout._apply_run_order(expected, order, inverse=True), values)


@pytest.mark.parametrize("num_bits", [4, 8])
def test_byte_packing_matches_the_general_word_packing(num_bits: int) -> None:
    """Codes that fit their width are packed as bytes read as words; the int64 path (taken for a code past its
    width) gives the same words for the same codes."""
    gen = torch.Generator().manual_seed(num_bits)
    codes = torch.randint(0, 1 << num_bits, (3, 6, 1024), generator=gen, dtype=torch.uint8)
    fast = layout._combine(codes, num_bits)
    factor = 32 // num_bits
    grouped = codes.unflatten(-1, (-1, factor)).to(torch.int64)
    words = sum(grouped[..., p] << (num_bits * p) for p in range(factor))
    expected = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    assert torch.equal(fast, expected)
    spilled = codes.to(torch.int64)
    spilled[0, 0, 1], spilled[0, 0, 2] = 1 << num_bits, 0  # code 1 too wide: its bit lands in code 2's field
    assert int(layout._combine(spilled, num_bits)[0, 0, 0]) >> (2 * num_bits) & 1 == 1


def test_a_batch_packs_like_its_matrices_one_by_one() -> None:
    codes = torch.randint(0, 16, (2, 3, 64, 128), dtype=torch.uint8)
    whole = layout.pack_weights(codes, 4)
    assert whole.shape == (2, 3, 4, 128 * 16 // 8) and whole.is_contiguous()
    for i in range(2):
        for j in range(3):
            assert torch.equal(whole[i, j], layout.pack_weights(codes[i, j], 4))


def _packed_by_the_general_path(codes: torch.Tensor, num_bits: int) -> torch.Tensor:
    """One [K, N] matrix packed the general way: permute the codes into slot order, then pair them into words."""
    k, n = codes.shape
    sizes, k_axes, n_axes = layout._tile_axes(num_bits, False)
    shaped = codes.reshape(k // 16, *(sizes[a] for a in k_axes), n // 64, *(sizes[a] for a in n_axes))
    source_of = {axis: 1 + i for i, axis in enumerate(k_axes)}
    source_of.update({axis: 5 + i for i, axis in enumerate(n_axes)})
    slots = shaped.permute(0, 4, *(source_of[axis] for axis in range(6))).reshape(k // 16, n // 64, 1024)
    return layout._combine(slots, num_bits).reshape(k // 16, -1)


@pytest.mark.parametrize("numpy_on_cpu", [True, False])
@pytest.mark.parametrize(("k", "n"), [(16, 64), (48, 192), (320, 512)])
def test_4bit_codes_paired_first_pack_like_the_general_path(k: int, n: int, numpy_on_cpu: bool) -> None:
    """The 4-bit fast path (rows k and k + 8 paired into bytes, then one byte reorder; numpy on the CPU, torch
    elsewhere) gives the words of the general path, which permutes codes first."""
    codes = torch.randint(0, 16, (k, n), generator=torch.Generator().manual_seed(k + n), dtype=torch.uint8)
    out = torch.full((k // 16, n * 2), -1, dtype=torch.int32)
    layout._pack_nibbles(codes, out, numpy_on_cpu=numpy_on_cpu)
    assert torch.equal(out, _packed_by_the_general_path(codes, 4))
    assert torch.equal(layout.pack_weights(codes.to(torch.int64), 4), out)  # any integer dtype of codes


def test_pack_weights_writes_into_a_given_buffer_of_its_shape_only() -> None:
    codes = torch.randint(0, 16, (2, 32, 128), dtype=torch.uint8)
    out = torch.empty(2, 2, 256, dtype=torch.int32)
    assert layout.pack_weights(codes, 4, out=out) is out
    assert torch.equal(out, layout.pack_weights(codes, 4))
    with pytest.raises(ReferenceError_, match="contiguous int32"):
        layout.pack_weights(codes, 4, out=torch.empty(2, 2, 255, dtype=torch.int32))
    with pytest.raises(ReferenceError_, match="contiguous int32"):
        layout.pack_weights(codes, 4, out=torch.empty(2, 256, 2, dtype=torch.int32).mT)
