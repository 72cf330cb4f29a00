"""The Marlin op's rounding allowance for its reduction modes, end to end on a CPU stand-in of the kernel that
rounds split-K partial sums as ``use_atomic_add`` / ``use_fp32_reduce=False`` do (``marlin_atomic_emulator``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import marlin_atomic_emulator
import pytest
import torch
from test_marlin_op import gemm2_call as marlin_op_call

from moereplay.ops import get_op
from moereplay.ops.marlin_rounding import reduction_mode, tile_k

OP = get_op("moe_wna16_marlin_gemm")
ATOMIC = "set use_atomic_add=true"
HALF_REDUCE = "set use_fp32_reduce=false"


def gemm2_call(
    *, tokens: int = 8, top_k: int = 4, experts: int = 4, k: int = 1024, n: int = 128
) -> dict[str, Any]:
    """A correct gemm2 call on random NVFP4 experts with float32 routing weights (test_marlin_op's builder)."""
    args = marlin_op_call(tokens=tokens, top_k=top_k, experts=experts, k=k, n=n, seed=3)
    args["topk_weights"] = args["topk_weights"].reshape(-1)
    return args


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from moereplay.format import CaptureWriter

    args = gemm2_call()
    output = marlin_atomic_emulator.moe_wna16_marlin_gemm(**{**args, "output": args["output"].clone()})
    path = tmp_path_factory.mktemp("rounding") / "correct.moe.zst"
    with CaptureWriter(path) as writer:
        index = writer.begin_call(OP.name, args, site="tests:gemm2")
        writer.complete_call(index, {"output": output, "return": output})
    return path


def test_modes_and_tiles() -> None:
    args = gemm2_call(k=1024)
    assert reduction_mode(args) is None
    assert reduction_mode({**args, "use_atomic_add": True, "use_fp32_reduce": False}) == "atomic add"
    assert reduction_mode({**args, "use_fp32_reduce": False}) == "16-bit reduce"
    assert (
        tile_k(args) == 64
        and tile_k({**args, "thread_k": 128}) == 128
        and tile_k({**args, "size_k": 96}) == 32
    )
    reference = OP.reference(args)
    assert OP.error_allowance(args, reference, torch.bfloat16) is None
    allowance = OP.error_allowance({**args, "use_atomic_add": True}, reference, torch.bfloat16)
    assert allowance is not None and allowance.order_dependent and allowance.cause == "atomic add"
    assert allowance.roundings == 2 * 16 - 1 and "≤16 bfloat16 partial sums" in allowance.label
    scale = reference.output.square().mean().sqrt()
    assert bool((allowance.absolute >= 0).all()) and float(allowance.absolute.max()) < float(scale)
    explicit = OP.error_allowance(
        {**args, "use_fp32_reduce": False, "thread_k": 128, "thread_n": 128}, reference, torch.bfloat16
    )
    assert explicit is not None and not explicit.order_dependent and explicit.roundings == 8 - 1


def test_reduction_modes_of_a_correct_call_are_ok_and_atomic_repeats_are_expected(capture: Path) -> None:
    from moereplay.replay import FindingKind, Verdict, replay

    report = replay(
        capture,
        backend=marlin_atomic_emulator.SPEC,
        device="cpu",
        mutations=[ATOMIC, HALF_REDUCE, "set use_atomic_add=true+use_fp32_reduce=false"],
        repeat=3,
        isolate=False,
    )
    assert [r.verdict for r in report.results] == [Verdict.OK] * 5, [r.tolerance for r in report.results]
    assert "atomic add" in report.variants[0].tolerance and "16-bit reduce" in report.variants[1].tolerance
    repeats = [f for f in report.findings if f.kind is FindingKind.NONDETERMINISM]
    assert {f.variant for f in repeats} == {report.variants[0].label, report.variants[2].label}
    for finding in repeats:
        assert finding.evidence["expected"] is True
        assert finding.message.startswith("atomic add: reduction order varies between runs, expected")


def test_a_wrong_coefficient_in_atomic_mode_is_still_corrupt_and_its_repeats_an_alarm(
    capture: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moereplay.replay import FindingKind, Verdict, replay

    monkeypatch.setenv("MARLIN_EMULATOR_CORRUPT_ROW", "5")
    report = replay(
        capture,
        backend=marlin_atomic_emulator.SPEC,
        device="cpu",
        mutations=[ATOMIC],
        repeat=3,  # two repeats may add the six partial sums in one order (1 in 720) or round alike: seen once
        isolate=False,
        explain_fidelity=False,  # the corrupt row makes the replay differ from the recording: not this test's subject
    )
    (variant,) = report.variants
    assert variant.verdict is Verdict.CORRUPT and variant.bad_rows == 1, variant.tolerance
    assert "atomic add" in variant.tolerance
    corrupt = [
        f for f in report.findings if f.kind is FindingKind.CORRUPT_ROWS
    ]  # the variant's = the baseline's
    assert corrupt and all(f.rows == (5,) for f in corrupt)
    (repeats,) = [f for f in report.findings if f.kind is FindingKind.NONDETERMINISM]
    assert "expected" not in repeats.evidence and "expected" not in repeats.message


def test_nondeterminism_of_a_16_bit_reduction_stays_an_alarm(
    capture: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moereplay.replay import FindingKind, Verdict, replay

    monkeypatch.setenv("MARLIN_EMULATOR_RANDOM_CUTS", "1")
    report = replay(
        capture,
        backend=marlin_atomic_emulator.SPEC,
        device="cpu",
        mutations=[HALF_REDUCE],
        repeat=3,
        isolate=False,
    )
    assert report.variants[0].verdict is Verdict.OK
    (repeats,) = [f for f in report.findings if f.kind is FindingKind.NONDETERMINISM]
    assert repeats.variant == report.variants[0].label and "expected" not in repeats.evidence
