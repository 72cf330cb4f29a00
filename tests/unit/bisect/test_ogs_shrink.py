"""Shrinking ``matmul_ogs`` calls for the shape bisection: a shrunk call is exactly the call vLLM would make for the
smaller problem — same swizzled bytes, same routing arrays, same reference output — for gemm1 (gather, fused swiglu)
and gemm2 (scatter, gammas), and illegal sizes are refused (a bisect probe of them is unresolved)."""

from __future__ import annotations

from typing import Any

import ogs_calls
import pytest
import torch

from moereplay.errors import InvalidMutationError, ReplayError
from moereplay.ops import get_op
from moereplay.ops.matmul_ogs import plain_args, scale_bytes_read
from moereplay.ops.ogs_shapes import shape_dimensions, shrink
from moereplay.reference.hopper_mxfp4 import scale_overrun

OP = get_op("matmul_ogs")
SCALE = "precision_config.weight_scale.storage"
EXPERTS, K, N, TOKENS, TOP_K = 8, 320, 384, 6, 4


@pytest.fixture(scope="module")
def problem() -> ogs_calls.Logical:
    return ogs_calls.logical(EXPERTS, K, N, TOKENS, TOP_K, seed=3)


def kept_and_mapping(ids: torch.Tensor, total: int, count: int) -> tuple[list[int], dict[int, int]]:
    """Independently of the shrinker: used experts first (id order), the rest folded onto the kept ones in turn."""
    used = sorted({int(e) for e in ids.reshape(-1).tolist()})
    if count <= len(used):
        kept, dropped = used[:count], used[count:]
    else:
        kept, dropped = sorted(used + [e for e in range(total) if e not in used][: count - len(used)]), []
    mapping = {old: new for new, old in enumerate(kept)}
    mapping.update({old: position % count for position, old in enumerate(dropped)})
    return kept, mapping


def same_tensor(a: Any, b: Any) -> None:
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
    assert torch.equal(a, b)


def same_call(shrunk: dict[str, Any], direct: dict[str, Any]) -> None:
    """Every tensor the kernel reads, byte for byte, plus layouts and sizes."""
    a, b = plain_args(shrunk), plain_args(direct)
    for name in ("x", "bias", "gammas", "betas"):
        if b[name] is None:
            assert a[name] is None, name
        else:
            same_tensor(a[name], b[name])
    assert tuple(a["y"].shape) == tuple(b["y"].shape) and a["y"].dtype == b["y"].dtype
    for mine, theirs in (
        (a["w"], b["w"]),
        (a["precision_config"].weight_scale, b["precision_config"].weight_scale),
    ):
        assert (mine.layout, mine.dtype, mine.shape) == (theirs.layout, theirs.dtype, theirs.shape)
        same_tensor(mine.storage, theirs.storage)
        assert mine.storage.stride() == theirs.storage.stride()  # the transposed view the kernel keys on
    ra, rb = a["routing_data"], b["routing_data"]
    assert (ra.n_expts_tot, ra.n_expts_act) == (rb.n_expts_tot, rb.n_expts_act)
    for field in ("gate_scal", "expt_hist"):
        same_tensor(getattr(ra, field), getattr(rb, field))
    same_tensor(ra.expt_data.hist, rb.expt_data.hist)
    same_tensor(ra.expt_data.token_offs_raw, rb.expt_data.token_offs_raw)
    assert ra.expt_data.block_sizes == rb.expt_data.block_sizes
    for block in rb.expt_data.block_sizes:
        same_tensor(ra.expt_data.token_offs_pad[block], rb.expt_data.token_offs_pad[block])
        same_tensor(ra.expt_data.block_pid_map[block], rb.expt_data.block_pid_map[block])
    for name in ("gather_indx", "scatter_indx"):
        if b[name] is None:
            assert a[name] is None, name
        else:
            same_tensor(a[name].src_indx, b[name].src_indx)
            same_tensor(a[name].dst_indx, b[name].dst_indx)


SHAPES = [
    {"experts": 3, "K": 192, "N": 256, "tokens": 4, "top_k": 2},  # fewer experts than used: routes fold
    {"experts": 1, "K": 32, "N": 192, "tokens": 1, "top_k": 1},  # the smallest call
    {"experts": 8, "K": 256, "N": 384, "tokens": 6, "top_k": 4},  # only K (now aligned)
    {"experts": 6, "K": 320, "N": 256, "tokens": 2, "top_k": 4},  # more experts than the kept slots use
    {"experts": 2, "K": 96, "N": 192, "tokens": 5, "top_k": 3},
]


@pytest.mark.parametrize("gemm", ["w13", "w2"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "-".join(str(v) for v in shape.values()))
def test_a_shrunk_call_is_the_call_of_the_sub_problem(
    problem: ogs_calls.Logical, gemm: str, shape: dict[str, int]
) -> None:
    build = ogs_calls.w13_call if gemm == "w13" else ogs_calls.w2_call
    shrunk = shrink(build(problem), shape)
    ids = problem.ids[: shape["tokens"], : shape["top_k"]]
    kept, mapping = kept_and_mapping(ids, EXPERTS, shape["experts"])
    sub = problem.sub(kept, mapping, shape["K"], shape["N"], shape["tokens"], shape["top_k"])
    direct = build(sub)
    same_call(shrunk, direct)
    ours, theirs = OP.reference(shrunk), OP.reference(direct)
    assert torch.equal(ours.output, theirs.output)
    assert torch.equal(ours.rows.expert, theirs.rows.expert) and torch.equal(
        ours.rows.token, theirs.rows.token
    )


def test_dimensions_of_a_hopper_mxfp4_call(problem: ogs_calls.Logical) -> None:
    dimensions = {d.name: d for d in shape_dimensions(ogs_calls.w13_call(problem))}
    assert list(dimensions) == ["experts", "K", "N", "tokens", "top_k"]
    assert dimensions["experts"].values == tuple(range(1, EXPERTS + 1))
    assert dimensions["K"].values == tuple(range(32, K + 1, 32)) and dimensions["K"].modulus == 128
    # block_n 256 (N > 128) is the only one that compiles with the 8-warp scale unswizzle
    assert dimensions["N"].values == tuple(range(192, N + 1, 64)) and dimensions["N"].modulus == 256
    assert dimensions["tokens"].values == tuple(range(1, TOKENS + 1))
    assert dimensions["top_k"].values == tuple(range(1, TOP_K + 1))
    w2 = {d.name: d for d in shape_dimensions(ogs_calls.w2_call(problem))}
    assert w2["tokens"].original == TOKENS  # rows of y for a scattering call
    # the op hands them to the bisect as its dimensions
    declared = OP.shape_dimensions(ogs_calls.w13_call(problem))  # type: ignore[attr-defined]
    assert [(d.name, d.modulus) for d in declared] == [
        ("experts", None),
        ("K", 128),
        ("N", 256),
        ("tokens", None),
        ("top_k", None),
    ]


def test_with_4_warps_every_n_compiles_and_the_slab_is_128_rows(problem: ogs_calls.Logical) -> None:
    args = {**ogs_calls.w13_call(problem), "num_warps": 4}  # the scales re-laid out for 4 warps
    n = next(d for d in shape_dimensions(args) if d.name == "N")
    assert n.values == tuple(range(64, N + 1, 64)) and n.modulus == 128
    with pytest.raises(InvalidMutationError):
        shrink(ogs_calls.w13_call(problem), {"N": 128})  # 8 warps: block_n 128 does not compile


def test_a_constrained_block_k_is_the_k_modulus(problem: ogs_calls.Logical) -> None:
    args = {**ogs_calls.w13_call(problem), "block_k": 64}
    k = next(d for d in shape_dimensions(args) if d.name == "K")
    assert k.modulus == 64


@pytest.mark.parametrize("k", [32, 64, 96, 128, 160, 192, 224, 256, 288, 320])
def test_short_scale_rows_are_kept_exactly_where_the_library_leaves_them(
    problem: ogs_calls.Logical, k: int
) -> None:
    """vLLM's prep leaves ``32 · ceil_even(K / 32)`` bytes per scale row; the kernel reads whole K tiles."""
    shrunk = shrink(ogs_calls.w13_call(problem), {"K": k, "experts": 2})
    storage = plain_args(shrunk)["precision_config"].weight_scale.storage
    row_bytes = int(storage.shape[-2])
    assert row_bytes == scale_overrun(N, k).row_bytes == -(-k // 64) * 64
    assert scale_bytes_read(shrunk) == -(-k // 128) * 128
    short = [v for v in OP.check(shrunk, check_device=False) if v.arg == SCALE and v.aspect == "shape"]
    assert bool(short) == (k % 128 in (32, 64))
    assert storage.stride(-2) == 1  # still a transposed view of a fresh contiguous block
    assert storage.untyped_storage().nbytes() == storage.numel()


def test_the_original_shape_is_the_call_and_illegal_values_are_refused(problem: ogs_calls.Logical) -> None:
    args = ogs_calls.w13_call(problem)
    original = {"experts": EXPERTS, "K": K, "N": N, "tokens": TOKENS, "top_k": TOP_K}
    same = shrink(args, original)
    assert all(same[name] is args[name] for name in args)
    for bad in (
        {"K": 100},
        {"K": 352},
        {"N": 96},
        {"N": 64},
        {"experts": 0},
        {"tokens": TOKENS + 1},
        {"top_k": 5},
    ):
        with pytest.raises(InvalidMutationError):
            shrink(args, bad)
    with pytest.raises(InvalidMutationError, match="unknown"):
        shrink(args, {"rows": 3})


def test_calls_it_cannot_shrink_say_so_in_one_line(problem: ogs_calls.Logical) -> None:
    args = ogs_calls.w13_call(problem)
    with pytest.raises(ReplayError, match="without routing data"):
        shape_dimensions({**args, "routing_data": None})
    with pytest.raises(ReplayError, match="neither a gather nor a scatter"):
        shape_dimensions({**args, "gather_indx": None})
