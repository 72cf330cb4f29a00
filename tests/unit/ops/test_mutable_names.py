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
