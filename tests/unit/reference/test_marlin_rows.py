"""The host side of the packed-code Marlin product (marlin_rows): the kernel's addressing, value tables and
factors, applied in torch element by element, rebuild the dense decoder's weights bit for bit; the tile plan."""

from __future__ import annotations

import sys

import pytest
import torch

from moereplay.errors import ReferenceError_
from moereplay.reference import marlin_rows
from moereplay.reference.dequant_dense import SWITCH_VARIABLE
from moereplay.reference.marlin_formats import MarlinExpertWeights, MarlinWeightFormat, random_experts

F = MarlinWeightFormat

FAST = [
    (F.NVFP4, None, torch.bfloat16),
    (F.NVFP4, None, torch.float16),
    (F.MXFP4, None, torch.bfloat16),
    (F.MXFP8, None, torch.bfloat16),
    (F.FP8, -1, torch.bfloat16),
    (F.FP8, 128, torch.float16),
    (F.GPTQ_INT4, 32, torch.bfloat16),
    (F.GPTQ_INT4, -1, torch.float16),
    (F.GPTQ_INT8, 64, torch.bfloat16),
    (F.AWQ_INT4, 32, torch.float16),
    (F.AWQ_INT4, -1, torch.bfloat16),
]


def _weights(fmt, group_size, dtype, *, experts: int = 4, k: int = 256, n: int = 192, **extra):
    packed = random_experts(
        fmt,
        experts,
        k,
        n,
        group_size=group_size,
        activation_dtype=dtype,
        generator=torch.Generator().manual_seed(11),
        **extra,
    )
    return packed.expert_weights()


def _kernel_weights(weights: MarlinExpertWeights, experts: torch.Tensor) -> torch.Tensor:
    """The weights as the kernel forms them: table → byte and shift, code → value, ``value * scale (+ offset)``."""
    kind = weights.fast_kind()
    assert kind is not None
    bits = weights.format.num_bits
    column_entries, row_entries = (t.long() for t in marlin_rows.tile_entries(bits))
    offsets = weights.fast_factors(experts)[1]
    scale_table, columns = weights.scale_layout()
    multipliers = weights.scale_multipliers(torch.arange(weights.num_experts))
    size_k, size_n = weights.size_k, weights.size_n
    k = torch.arange(size_k).view(-1, 1)
    n = torch.arange(size_n).view(1, -1)
    tile_bytes = 16 * 64 * bits // 8
    if bits == 4:
        # as the kernel: row 2j + h of the low nibbles is at j · step + h · half bits (rows k + 8: the high
        # nibbles of the same bytes); the word holds rows 2j, 2j + 1 of the column
        step, half = marlin_rows.four_bit_row_steps(row_entries)
        words = weights.b_qweight.contiguous().view(torch.int32)
        words = words.reshape(weights.num_experts, size_k // 16, -1)
        column = column_entries[n % 64]
        word_of = (column >> 5) + (k % 8) // 2 * (step // 32)
        word = words[experts][:, k // 16, (n // 64) * (tile_bytes // 4) + word_of].to(torch.int64)
        shift = ((column + (k % 2) * half) & 31) + torch.where(k % 16 < 8, 0, 4)
        value = marlin_rows.value_table(kind)[(word >> shift) & 0xF]
    else:
        entry = column_entries[n % 64] + row_entries[k % 16]
        packed = weights.b_qweight.contiguous().view(torch.uint8)
        packed = packed.reshape(weights.num_experts, size_k // 16, -1)
        data = packed[experts][:, k // 16, (n // 64) * tile_bytes + (entry >> 3)].to(torch.int64)
        value = marlin_rows.value_table(kind)[data]
    group = k // weights.group_size
    stored = weights.b_scales[experts][:, group, columns[n]]
    if scale_table is not None:
        decoded = scale_table[stored.view(torch.uint8).long()]
    else:
        decoded = stored.to(torch.float32)
    scales = decoded * multipliers[experts].view(-1, 1, 1)
    result = value * scales
    if offsets is not None:
        result = result + offsets[:, group, n]
    return result


@pytest.mark.parametrize(("fmt", "group_size", "dtype"), FAST)
def test_the_kernels_addressing_rebuilds_the_dense_decoders_weights(fmt, group_size, dtype) -> None:
    weights = _weights(fmt, group_size, dtype)
    assert marlin_rows.usable(weights)
    experts = torch.tensor([3, 0, 2])
    expected = weights.dequantize(experts)
    assert torch.equal(_kernel_weights(weights, experts), expected)


def test_a_swapped_table_row_breaks_the_weights() -> None:
    """The check above can fail: two rows of the byte table exchanged give other weights."""
    weights = _weights(F.GPTQ_INT4, 32, torch.bfloat16)
    experts = torch.tensor([1])
    columns, rows = marlin_rows.tile_entries(4)
    swapped = rows.clone()
    swapped[[0, 1]] = rows[[1, 0]]
    original = marlin_rows._entries_cpu
    marlin_rows._entries_cpu = lambda bits: (columns, swapped)  # type: ignore[assignment]
    try:
        assert not torch.equal(_kernel_weights(weights, experts), weights.dequantize(experts))
    finally:
        marlin_rows._entries_cpu = original


def test_byte_table_entries() -> None:
    four, eight = marlin_rows.byte_table(4), marlin_rows.byte_table(8)
    assert four.shape == eight.shape == (16, 64)
    # 4-bit: rows k and k + 8 share their bytes, the low nibble is row k
    assert torch.equal(four[:8] >> 3, four[8:] >> 3)
    assert set((four[:8] & 7).unique().tolist()) == {0} and set((four[8:] & 7).unique().tolist()) == {4}
    assert sorted((four[:8].reshape(-1) >> 3).tolist()) == list(range(512))
    assert sorted((eight.reshape(-1) >> 3).tolist()) == list(range(1024))
    for bits, table in ((4, four), (8, eight)):
        columns, rows = marlin_rows.tile_entries(bits)
        assert torch.equal(rows[:, None] + columns[None, :], table) and not bool((columns & 7).any())


def test_k_splits_depend_on_k_alone_and_cover_it() -> None:
    for k_tiles in (1, 15, 16, 33, 64, 180, 184, 448):
        splits, per_split = marlin_rows.k_splits(k_tiles)
        assert 1 <= splits <= marlin_rows.MAX_SPLITS
        assert (splits - 1) * per_split < k_tiles <= splits * per_split
    assert marlin_rows.k_splits(180) == (11, 17) and marlin_rows.k_splits(8) == (1, 8)
    assert marlin_rows.k_splits(448) == (16, 28)


def test_value_tables() -> None:
    assert marlin_rows.value_table("uint4b8")[:16].tolist() == [float(q - 8) for q in range(16)]
    assert marlin_rows.value_table("uint8b128")[[0, 128, 255]].tolist() == [-128.0, 0.0, 127.0]
    e2m1 = marlin_rows.value_table("e2m1")
    assert e2m1[[1, 7, 15]].tolist() == [0.5, 6.0, -6.0] and torch.signbit(e2m1[8])
    e4m3 = marlin_rows.value_table("e4m3")
    assert e4m3[0x38].item() == 1.0 and torch.isnan(e4m3[0x7F]) and torch.isnan(e4m3[0xFF])
    with pytest.raises(ReferenceError_, match="no code values for 'e8m0'"):
        marlin_rows.value_table("e8m0")


def test_plan_tiles_gives_each_row_to_one_program_of_its_expert() -> None:
    counts, experts = [3, 1, 0, 70, 16, 17, 6], [5, 7, 9, 11, 2, 4, 8]
    plan = marlin_rows.plan_tiles(counts, experts)
    assert set(plan) <= set(marlin_rows.BLOCK_ROWS)
    covered: list[int] = []
    starts = [sum(counts[:u]) for u in range(len(counts))]
    for height, tiles in plan.items():
        for start, count, expert, position in tiles:
            assert 0 < count <= height
            assert expert == experts[position]
            assert starts[position] <= start and start + count <= starts[position] + counts[position]
            covered.extend(range(start, start + count))
    assert sorted(covered) == list(range(sum(counts)))
    assert plan[4] == [(0, 3, 5, 0), (3, 1, 7, 1)] and plan[8] == [(107, 6, 8, 6)]
    assert [c for _, c, e, _ in plan[16] if e == 11] == [16, 16, 16, 16, 6]


def test_passes_cut_the_plan_into_runs_of_whole_blocks_keeping_their_heights() -> None:
    plan = marlin_rows.plan_tiles([3, 1, 70, 6], [5, 7, 11, 8])
    runs = marlin_rows.passes(plan, row_budget=20)
    seen = [tile for run in runs for tiles in run.values() for tile in tiles]
    assert sorted(seen) == sorted(tile for tiles in plan.values() for tile in tiles)
    for run in runs:
        rows = [tile for tiles in run.values() for tile in tiles]
        assert sum(tile[1] for tile in rows) <= 20 or len(rows) == 1
        starts = sorted(tile[0] for tile in rows)
        assert starts == sorted(set(starts))
        for height, tiles in run.items():
            assert all(tile in plan[height] for tile in tiles)  # a block keeps its height
    assert any(
        (68, 6, 11, 2) in run.get(16, []) for run in runs
    )  # the 70-row expert's last 6 rows: height 16
    assert len(marlin_rows.passes(plan, row_budget=10**6)) == 1


def test_usable_and_available() -> None:
    assert not marlin_rows.usable(_weights(F.GPTQ_INT4, 32, torch.bfloat16, act_order=True))
    assert not marlin_rows.usable(_weights(F.AWQ_INT4_FZP, 32, torch.float16))
    assert not marlin_rows.available(torch.device("cpu"), {})
    assert not marlin_rows.available(torch.device("cuda"), {SWITCH_VARIABLE: "0"})


def test_a_kernel_that_cannot_run_warns_once_and_the_dense_path_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel that cannot be built here (its module cannot be imported): forced on, the reference warns,
    answers with the dense path's bits and keeps to the dense path afterwards."""
    from moereplay.reference.marlin_moe import reference_moe_wna16_marlin_gemm
    from moereplay.reference.moe_align import moe_align_block_size

    packed = random_experts(
        F.NVFP4, 4, 256, 128, generator=torch.Generator().manual_seed(1), with_dense=False
    )
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 256, generator=gen).to(torch.bfloat16)
    weights, ids = torch.topk(torch.softmax(torch.randn(5, 4, generator=gen), -1), 2)
    sorted_ids, expert_ids, total = moe_align_block_size(ids.to(torch.int32), 8, 4)
    args = dict(
        input=x, output=None, a_scales=None, workspace=None, sorted_token_ids=sorted_ids, expert_ids=expert_ids,
        num_tokens_past_padded=total, topk_weights=weights, moe_block_size=8, top_k=2, mul_topk_weights=True,
        size_m=5, **packed.kernel_kwargs(),
    )  # fmt: skip
    expected = reference_moe_wna16_marlin_gemm(**args)
    real_available = marlin_rows.available
    monkeypatch.setitem(sys.modules, "moereplay.reference.marlin_rows_kernel", None)  # cannot be imported
    monkeypatch.setattr(marlin_rows, "_FAILED", [])
    monkeypatch.setattr(marlin_rows, "_ROUTE_FAILED", [])
    monkeypatch.setattr(marlin_rows, "available", lambda device, environ=None: not marlin_rows._FAILED)
    with pytest.warns(RuntimeWarning) as caught:  # the routing kernel first, then the products kernel
        result = reference_moe_wna16_marlin_gemm(**args)
    said = [str(warning.message) for warning in caught]
    assert len(said) == 2 and "device routing cannot run here" in said[0], said
    assert "packed-code Marlin reference kernel cannot run here" in said[1], said
    assert torch.equal(result.output, expected.output)
    assert marlin_rows._FAILED and "marlin_rows_kernel" in marlin_rows._FAILED[0]
    assert not real_available(torch.device("cuda"), {})  # the dense path from then on


def test_plan_rows_lists_the_fields_in_launch_order() -> None:
    """The fields the caller copies with its tables are the kernel's launch order: pass by pass, height by height
    within a pass, each height's blocks in plan order — what ``expert_rows`` slices per launch."""
    counts, experts = [3, 1, 70, 6], [5, 7, 11, 8]
    plan = marlin_rows.plan_rows(counts, experts, size_k=2944, size_n=2880)
    assert (plan.splits, plan.per_split) == marlin_rows.k_splits(2944 // 16)
    assert len(plan.passes) == 1 and plan.fields is not None and plan.fields.dtype.name == "int64"
    assert plan.fields.tolist() == [
        [0, 3, 5, 0], [3, 1, 7, 1],  # height 4
        [74, 6, 8, 3],  # height 8
        [4, 16, 11, 2], [20, 16, 11, 2], [36, 16, 11, 2], [52, 16, 11, 2], [68, 6, 11, 2],  # height 16
    ]  # fmt: skip
    assert marlin_rows.plan_rows([], [], size_k=256, size_n=256).fields.shape == (0, 4)


@pytest.mark.parametrize(("fmt", "group_size", "dtype"), FAST)
def test_all_scale_multipliers_are_scale_multipliers_of_every_expert_bit_for_bit(
    fmt, group_size, dtype
) -> None:
    weights = _weights(fmt, group_size, dtype)
    expected = weights.scale_multipliers(torch.arange(weights.num_experts))
    assert torch.equal(weights.all_scale_multipliers().view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nvfp4_multipliers_in_float32_round_like_the_float64_product(dtype) -> None:
    """NVFP4's per-expert factor as one float32 product by 2**-b: the same bits as the float64 product rounded
    once, subnormal results included (bfloat16's b = 126 makes most of them subnormal), and the float64 path
    for a global scale that is not float32."""
    weights = _weights(F.NVFP4, None, dtype, experts=64)
    generator = torch.Generator().manual_seed(5)
    scales = torch.cat(
        (
            torch.exp2(torch.empty(60).uniform_(-140, 120, generator=generator)),
            torch.tensor([0.0, 2.0**-149, 3.4e38, 1.0]),
        )
    ).to(torch.float32)
    for global_scale in (scales, scales.to(torch.float64)):
        changed = MarlinExpertWeights(**{**weights.__dict__, "global_scale": global_scale})
        expected = changed.expert_multipliers(torch.arange(64))
        assert torch.equal(changed.all_scale_multipliers().view(torch.int32), expected.view(torch.int32))


def test_multiplier_parts_are_in_expert_order_whatever_the_global_scales_strides() -> None:
    """The products kernel reads ``scale_multiplier_parts``' per-expert tensor by expert index: a strided
    ``global_scale`` (a column of a wider tensor, as a checkpoint's slice gives) comes back contiguous, in order,
    and its product with the factor is :meth:`all_scale_multipliers` bit for bit."""
    weights = _weights(F.NVFP4, None, torch.bfloat16, experts=8)
    wide = torch.rand(8, 2, generator=torch.Generator().manual_seed(9)) + 0.5
    strided = MarlinExpertWeights(**{**weights.__dict__, "global_scale": wide[:, 0]})
    per_expert, factor = strided.scale_multiplier_parts()
    assert per_expert.is_contiguous() and torch.equal(per_expert, wide[:, 0])
    expected = strided.expert_multipliers(torch.arange(8))
    assert torch.equal((per_expert * factor).view(torch.int32), expected.view(torch.int32))


def test_one_pass_is_the_general_cut_with_a_budget_above_every_row() -> None:
    """:func:`passes`' one-pass shortcut gives what its general loop gives: cutting at a budget of the total rows
    minus nothing (shortcut) and at budgets the loop must handle agree on the tiles, in order, per height."""
    plan = marlin_rows.plan_tiles([3, 1, 70, 6, 9, 2], [5, 7, 11, 8, 1, 0])
    total = 3 + 1 + 70 + 6 + 9 + 2
    (one,) = marlin_rows.passes(plan, row_budget=total)
    cut = marlin_rows.passes(plan, row_budget=total - 1)  # the general loop: two runs
    assert len(cut) == 2
    joined: dict[int, list[marlin_rows.Tile]] = {}
    for run in cut:
        for height, tiles in run.items():
            joined.setdefault(height, []).extend(tiles)
    assert one == plan and joined == one


def test_a_routing_kernel_that_cannot_run_leaves_the_products_kernel_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A routing launch that fails (compile or resources) sends routing back to the host, once and for the process;
    the packed-code products stay available (they ran with host routing before the device routing existed)."""
    monkeypatch.setattr(marlin_rows, "_FAILED", [])
    monkeypatch.setattr(marlin_rows, "_ROUTE_FAILED", [])
    monkeypatch.setattr(marlin_rows, "available", lambda device, environ=None: True)

    def fails(*args: object, **kwargs: object) -> None:
        raise ImportError("no routing kernel here")

    monkeypatch.setattr(marlin_rows, "launch", fails)
    ids = torch.arange(16, dtype=torch.int32)
    experts = torch.zeros(2, dtype=torch.int32)
    with pytest.warns(RuntimeWarning, match="device routing cannot run here"):
        assert marlin_rows.route_on_device(ids, experts, 16, 8, 16, 1, 4, 256, 128) is None
    assert marlin_rows._ROUTE_FAILED and not marlin_rows._FAILED
    assert marlin_rows.route_on_device(ids, experts, 16, 8, 16, 1, 4, 256, 128) is None  # no second try
