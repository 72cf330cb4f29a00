"""The rounding allowance's tile magnitudes are computed once per product and K tile, and recomputed when an
input changes."""

from __future__ import annotations

import torch
from test_marlin_rounding import OP, gemm2_call

from moereplay.ops import marlin_rounding


def allowance(args: dict) -> torch.Tensor:
    reference = OP.reference(args)
    result = OP.error_allowance(args, reference, torch.bfloat16)
    assert result is not None
    return result.absolute


def test_launch_configs_of_one_product_share_the_magnitudes_and_get_the_same_bound() -> None:
    marlin_rounding._MAGNITUDES.clear()
    args = gemm2_call()
    first = allowance({**args, "use_atomic_add": True, "thread_n": 128})
    assert len(marlin_rounding._MAGNITUDES) == 1
    again = allowance({**args, "use_atomic_add": True, "thread_n": 64, "blocks_per_sm": 2})
    assert len(marlin_rounding._MAGNITUDES) == 1  # same tile, same rows: a hit
    assert torch.equal(first, again)
    marlin_rounding._MAGNITUDES.clear()
    fresh = allowance({**args, "use_atomic_add": True, "thread_n": 64, "blocks_per_sm": 2})
    assert torch.equal(fresh, again)  # the cached magnitudes are the ones a fresh computation gives
    reduce = allowance({**args, "use_fp32_reduce": False})
    assert len(marlin_rounding._MAGNITUDES) == 1 and not torch.equal(
        reduce, first
    )  # same magnitudes, other mode


def test_another_tile_or_a_changed_input_misses() -> None:
    marlin_rounding._MAGNITUDES.clear()
    args = gemm2_call()
    base = allowance({**args, "use_atomic_add": True})
    allowance({**args, "use_atomic_add": True, "thread_k": 128})
    assert len(marlin_rounding._MAGNITUDES) == 2
    args["input"].mul_(2)  # in place: same tensor object, new version
    doubled = allowance({**args, "use_atomic_add": True})
    assert len(marlin_rounding._MAGNITUDES) == 3
    assert not torch.equal(doubled, base)
