"""Mutation parsing, domains and application (on the real Marlin op's declarations)."""

from __future__ import annotations

import pytest
import torch

from moereplay.errors import InvalidMutationError
from moereplay.ops import get_op
from moereplay.replay.mutations import (
    BASELINE,
    Cast,
    Fill,
    FillPattern,
    Flip,
    SetValue,
    Variant,
    apply_variant,
    parse_fill,
    parse_option,
    parse_spec,
    sweep_domain,
)

MARLIN = get_op("moe_wna16_marlin_gemm")


def marlin_scalars(**overrides: object) -> dict[str, object]:
    """The non-tensor part of a gpt-oss gemm2 call (enough for domain checks)."""
    args: dict[str, object] = {
        "moe_block_size": 16,
        "top_k": 1,
        "mul_topk_weights": True,
        "size_m": 128,
        "size_n": 2880,
        "size_k": 2944,
        "is_k_full": True,
        "use_atomic_add": False,
        "use_fp32_reduce": True,
        "is_zp_float": False,
        "thread_k": -1,
        "thread_n": -1,
        "blocks_per_sm": -1,
    }
    args.update(overrides)
    return args


def test_each_option_parses_to_its_mutation() -> None:
    assert parse_option(MARLIN, "flip", "mul_topk_weights") == [Variant((Flip("mul_topk_weights"),))]
    assert parse_option(MARLIN, "set", "thread_k=128+thread_n=64") == [
        Variant((SetValue("thread_k", 128), SetValue("thread_n", 64)))
    ]
    assert parse_option(MARLIN, "set", "use_atomic_add=true")[0].mutations == (
        SetValue("use_atomic_add", True),
    )
    assert parse_option(MARLIN, "cast", "topk_weights=fp32")[0].mutations == (
        Cast("topk_weights", torch.float32),
    )
    assert parse_option(MARLIN, "fill", "0xfe")[0].mutations == (Fill(FillPattern(0xFE)),)


def test_sweep_zips_value_lists_into_one_variant_each() -> None:
    variants = parse_option(MARLIN, "sweep", "thread_k=128,64+thread_n=64,128")
    assert [v.specs for v in variants] == [
        ("set thread_k=128", "set thread_n=64"),
        ("set thread_k=64", "set thread_n=128"),
    ]
    with pytest.raises(InvalidMutationError, match="one length"):
        parse_option(MARLIN, "sweep", "thread_k=128,64+thread_n=64")


def test_specs_round_trip() -> None:
    for text in ("flip mul_topk_weights", "set moe_block_size=32", "cast topk_weights=float32", "fill nan"):
        assert parse_spec(MARLIN, text).spec == text


@pytest.mark.parametrize(
    ("option", "text", "message"),
    [
        ("flip", "no_such_arg", "no argument 'no_such_arg'"),
        ("flip", "size_m", "does not declare size_m mutable"),
        ("flip", "moe_block_size", "not a flag"),
        ("set", "sorted_token_ids=1", "derived"),
        ("set", "moe_block_size", "ARG=VALUE"),
        ("set", "moe_block_size=big", "not an integer"),
        ("set", "mul_topk_weights=maybe", "not a boolean"),
        ("cast", "size_m=float32", "not a tensor"),
        ("cast", "topk_weights=float33", "unknown dtype"),
        ("fill", "0x100", "outside 0x00..0xff"),
        ("fill", "lots", "not a byte"),
        ("sweep", "moe_block_size=16,,32", "empty value"),
    ],
)
def test_malformed_mutations_raise_one_clear_error(option: str, text: str, message: str) -> None:
    with pytest.raises(InvalidMutationError, match=message):
        parse_option(MARLIN, option, text)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("moe_block_size=24", "not one of 8, 16, 32, 48, 64"),
        ("thread_k=128", "set together"),
        ("thread_k=96+thread_n=64", "not one of -1, 64, 128"),
        ("thread_k=128+thread_n=128", "does not divide size_n"),
        ("thread_k=64+thread_n=256", "no kernel is instantiated"),
        ("blocks_per_sm=9", "9 > 4"),
    ],
)
def test_values_outside_the_domain_make_an_invalid_variant(text: str, reason: str) -> None:
    (variant,) = parse_option(MARLIN, "set", text)
    applied = apply_variant(MARLIN, marlin_scalars(), variant)
    assert applied.invalid_reason is not None
    assert reason in applied.invalid_reason


def test_legal_tiles_depend_on_the_block_size() -> None:
    (variant,) = parse_option(MARLIN, "set", "thread_k=128+thread_n=64")
    assert apply_variant(MARLIN, marlin_scalars(), variant).invalid_reason is None
    (wide,) = parse_option(MARLIN, "set", "thread_k=64+thread_n=256")
    assert apply_variant(MARLIN, marlin_scalars(size_n=4096, moe_block_size=64), wide).invalid_reason is None
    assert (
        apply_variant(MARLIN, marlin_scalars(size_n=4096, moe_block_size=16), wide).invalid_reason is not None
    )


def test_flip_negates_and_leaves_the_input_alone() -> None:
    args = marlin_scalars()
    applied = apply_variant(MARLIN, args, parse_option(MARLIN, "flip", "mul_topk_weights")[0])
    assert applied.args["mul_topk_weights"] is False
    assert args["mul_topk_weights"] is True
    assert applied.changed == frozenset({"mul_topk_weights"})


def test_cast_converts_values_and_baseline_changes_nothing() -> None:
    args = {"topk_weights": torch.tensor([0.25, 0.5], dtype=torch.bfloat16), **marlin_scalars()}
    applied = apply_variant(MARLIN, args, parse_option(MARLIN, "cast", "topk_weights=float32")[0])
    assert applied.args["topk_weights"].dtype == torch.float32
    assert applied.args["topk_weights"].tolist() == [0.25, 0.5]
    assert apply_variant(MARLIN, args, BASELINE).args == args


def test_sweep_of_a_finite_domain_lists_its_legal_values() -> None:
    variants = sweep_domain(MARLIN, "moe_block_size", marlin_scalars())
    assert [v.mutations[0].value for v in variants] == [8, 16, 32, 48, 64]  # type: ignore[union-attr]


def test_fill_patterns() -> None:
    assert parse_fill("0xff").element_bytes(torch.float32) == b"\xff" * 4
    nan = parse_fill("nan")
    assert torch.isnan(nan.pattern(torch.bfloat16, 4).view(torch.bfloat16)).all()
    assert torch.isnan(nan.pattern(torch.float32, 8).view(torch.float32)).all()
    assert nan.pattern(torch.int32, 4).tolist() == [0xFF] * 4
    assert Variant((Fill(FillPattern(0xFE)),)).fill.name == "0xfe"
