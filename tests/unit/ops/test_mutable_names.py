"""The families' torch-free mutable-name declarations (the first check of ``moereplay run``'s mutations) and the
OpSpecs that judge mutations in full must name the same arguments."""

from __future__ import annotations

import pytest

from moereplay.errors import InvalidMutationError
from moereplay.ops import get_op
from moereplay.ops.surface import FamilySurface, families, mutable_names, op_modules
from moereplay.replay.mutation_names import check_names, mutated_names


@pytest.mark.parametrize("op_name", sorted(op_modules()))
def test_every_kernel_op_declares_the_mutable_names_of_its_opspec(op_name: str) -> None:
    assert mutable_names(op_name) == tuple(mutable.name for mutable in get_op(op_name).mutable)


def test_a_family_cannot_declare_names_for_an_op_it_does_not_own() -> None:
    (family, *_) = families()
    with pytest.raises(ValueError, match="mutable names of ops it does not declare"):
        FamilySurface(name="x", kernel_ops=("a",), op_modules={"a": "m"}, mutable_names={"b": ("n",)})
    assert family.mutable_names


def test_mutated_names() -> None:
    assert mutated_names("flip a+b") == ("flip", ["a", "b"])
    assert mutated_names("--set a=1+b=2") == ("set", ["a", "b"])
    assert mutated_names("sweep a=1,2+b=3,4") == ("sweep", ["a", "b"])
    assert mutated_names("cast a=float32") == ("cast", [])
    assert mutated_names("fill 0xff") == ("fill", [])


def test_check_names_rejects_only_what_no_op_declares() -> None:
    marlin, ogs = "moe_wna16_marlin_gemm", "matmul_ogs"
    check_names([marlin], ["flip mul_topk_weights", "set moe_block_size=8", "cast input=float32"])
    check_names([marlin, ogs], ["sweep split_k=1,2"])  # some op of the file declares it
    check_names(["an_op_a_python_backend_brings"], ["flip anything"])  # undeclared op: left to the OpSpec
    check_names([], ["flip anything"])
    with pytest.raises(InvalidMutationError, match="--flip topk_weights: no call's op declares topk_weights"):
        check_names([marlin], ["flip use_atomic_add+topk_weights"])
    with pytest.raises(InvalidMutationError, match="--sweep block_m"):
        check_names([marlin], ["sweep block_m=64,128"])


def test_cast_dtype_names_are_the_mutation_tables_and_worded_alike() -> None:
    from moereplay.replay import mutation_names, mutations

    assert frozenset(mutations._DTYPE_ALIASES) == mutation_names.CAST_DTYPES
    for text in ("fp16", "torch.BFloat16", " float8_e4m3fn "):
        assert mutation_names.unknown_dtype(text) is None
        mutations.parse_dtype(text)
    with pytest.raises(InvalidMutationError) as full:
        mutations.parse_dtype("float12")
    assert mutation_names.unknown_dtype("float12") == str(full.value)


def test_check_casts_rejects_unknown_arguments_and_dtypes_in_the_full_checks_order() -> None:
    from moereplay.replay.mutation_names import check_casts

    arguments = {"moe_wna16_marlin_gemm": {"input", "topk_weights", "mul_topk_weights"}}
    check_casts(arguments, ["cast input=bf16+topk_weights=float16", "flip nothing_checked_here", "fill 0xff"])
    check_casts(arguments, ["cast malformed"])  # the full check words it
    check_casts({}, ["cast anything=float32"])  # no kernel call read: left to the full check
    with pytest.raises(
        InvalidMutationError, match="--cast topk_weight: no call's op has an argument 'topk_weight'"
    ):
        check_casts(arguments, ["cast topk_weight=float32"])
    with pytest.raises(InvalidMutationError, match="unknown dtype 'nosuch'"):
        check_casts(arguments, ["cast input=nosuch"])
    with pytest.raises(InvalidMutationError, match="no call's op has an argument 'bad'"):
        check_casts(arguments, ["cast bad=nosuch"])  # the name first, as the full check
