"""The decomposition names each known fault on synthetic outputs built from a reference's ingredients."""

from __future__ import annotations

import torch

from moereplay.ops.base import CoefficientSource, ReferenceResult, RowMap, TensorContract, fixed_dtype
from moereplay.replay.decompose import decompose, fit_rows
from moereplay.replay.findings import Finding, FindingKind
from moereplay.replay.mutations import FillPattern

ROWS, COLS = 128, 512
CONTRACTS = (TensorContract("topk_weights", read_as=fixed_dtype(torch.float32), host_checked=False),)


def ingredients(seed: int = 0, *, bias: bool = False) -> tuple[ReferenceResult, torch.Tensor]:
    """A reference like Marlin's gemm2: softmax top-4 routing weights (bf16) of 32 tokens, one row each."""
    generator = torch.Generator().manual_seed(seed)
    gemm = torch.randn(ROWS, COLS, generator=generator)
    weights = torch.softmax(torch.randn(32, 32, generator=generator), -1).topk(4, dim=-1).values.reshape(-1)
    weights = weights.to(torch.bfloat16)
    coefficient = weights.float()
    terms = {"gemm": gemm}
    coefficients = {"gemm": coefficient}
    output = gemm * coefficient[:, None]
    if bias:
        terms["bias"] = torch.randn(ROWS, COLS, generator=generator)
        coefficients["bias"] = coefficient
        output = output + terms["bias"] * coefficient[:, None]
    source = CoefficientSource("topk_weights", torch.arange(ROWS), torch.float32)
    rows = RowMap(
        torch.arange(ROWS) // 4,
        torch.randint(0, 32, (ROWS,), generator=generator),
        torch.arange(ROWS) % 4,
        torch.arange(ROWS) // 16,
    )
    scales = {"global_scale": torch.rand(ROWS, generator=generator) * 1e-2 + 1e-3}
    reference = ReferenceResult(
        output,
        torch.ones(ROWS, dtype=torch.bool),
        rows,
        terms,
        coefficients,
        {name: source for name in terms},
        scales,
    )
    return reference, weights


def analyse(actual: torch.Tensor, reference: ReferenceResult, weights: torch.Tensor) -> list[Finding]:
    expected = reference.output
    bad = [r for r in range(ROWS) if not torch.allclose(actual[r].float(), expected[r], rtol=2e-2, atol=1e-3)]
    return decompose(
        actual,
        reference,
        bad,
        {"topk_weights": weights},
        contracts=CONTRACTS,
        output_dtype=actual.dtype,
        fill=FillPattern(0x00),
        guard_bytes=4096,
    )


def of_kind(findings: list[Finding], kind: FindingKind) -> list[Finding]:
    return [f for f in findings if f.kind is kind]


def test_fit_recovers_the_applied_coefficients() -> None:
    reference, _ = ingredients(bias=True)
    actual = reference.terms["gemm"] * 0.25 + reference.terms["bias"] * 3.0
    fits = fit_rows(actual, reference, [0, 5])
    assert all(fit.explained for fit in fits)
    assert abs(fits[0].coefficients["gemm"] - 0.25) < 1e-6 and abs(fits[1].coefficients["bias"] - 3.0) < 1e-6


def test_bf16_bytes_read_as_float32_are_named_with_the_rows_read_past_the_end() -> None:
    reference, weights = ingredients()
    padded = torch.cat([weights.view(torch.uint8), torch.zeros(4096, dtype=torch.uint8)])
    applied = padded[: ROWS * 4].view(torch.float32).to(torch.bfloat16).float()  # the kernel rounds to bf16
    actual = (reference.terms["gemm"] * applied[:, None]).to(torch.bfloat16)
    findings = analyse(actual, reference, weights)
    (wrong,) = of_kind(findings, FindingKind.WRONG_COEFFICIENT)
    assert wrong.evidence["hypothesis"] == "dtype" and wrong.evidence["read_as"] == "float32"
    assert wrong.evidence["matched_rows"] == wrong.evidence["wrong_rows"]
    assert wrong.suggestions == ("cast topk_weights=float32",)
    (oob,) = of_kind(findings, FindingKind.OOB_READ)
    assert oob.evidence["bytes_past_end"] == [0, 255] and set(oob.rows) == set(range(64, 128))
    (diagnosis,) = of_kind(findings, FindingKind.DIAGNOSIS)
    assert diagnosis.evidence["blame"] == "caller" and diagnosis.evidence["kernel_reads"] == "float32"


def test_another_rows_weight_is_named_with_the_mapping() -> None:
    reference, weights = ingredients()
    source_rows = (torch.arange(ROWS) + 3) % ROWS
    applied = weights.float()[source_rows]
    actual = (reference.terms["gemm"] * applied[:, None]).to(torch.bfloat16)
    findings = analyse(actual, reference, weights.float())  # float32: no contract violation
    (wrong,) = of_kind(findings, FindingKind.WRONG_COEFFICIENT)
    assert wrong.evidence["hypothesis"] == "other_row"
    assert wrong.evidence["mapping"] == "index i+3"
    (diagnosis,) = of_kind(findings, FindingKind.DIAGNOSIS)
    assert diagnosis.evidence["blame"] == "kernel"


def test_zero_coefficients_are_named() -> None:
    reference, weights = ingredients()
    applied = weights.float().clone()
    applied[40:60] = 0.0
    actual = (reference.terms["gemm"] * applied[:, None]).to(torch.bfloat16)
    findings = analyse(actual, reference, weights.float())
    (wrong,) = of_kind(findings, FindingKind.WRONG_COEFFICIENT)
    assert wrong.evidence["hypothesis"] == "zero" and wrong.rows == tuple(range(40, 60))


def test_bias_applied_twice_is_named() -> None:
    reference, weights = ingredients(bias=True)
    w = weights.float()[:, None]
    actual = (reference.terms["gemm"] * w + 2 * reference.terms["bias"] * w).to(torch.bfloat16)
    findings = analyse(actual, reference, weights.float())
    (wrong,) = of_kind(findings, FindingKind.WRONG_COEFFICIENT)
    assert wrong.evidence["term"] == "bias"
    assert (wrong.evidence["hypothesis"], wrong.evidence["key"]) == ("multiple", "2x")


def test_a_scale_applied_to_the_wrong_term_is_named() -> None:
    reference, weights = ingredients(bias=True)
    w = weights.float()[:, None]
    scale = reference.scales["global_scale"][:, None]
    actual = (reference.terms["gemm"] * w + reference.terms["bias"] * w * scale).to(torch.bfloat16)
    findings = analyse(actual, reference, weights.float())
    (wrong,) = of_kind(findings, FindingKind.WRONG_COEFFICIENT)
    assert wrong.evidence["term"] == "bias"
    assert (wrong.evidence["hypothesis"], wrong.evidence["key"]) == ("scale", "global_scale*")


def test_values_that_are_no_combination_of_the_ingredients_are_unexplained() -> None:
    reference, weights = ingredients()
    actual = reference.output.clone()
    actual[7, 100:200] = torch.randn(100)
    findings = analyse(actual, reference, weights.float())
    (unexplained,) = of_kind(findings, FindingKind.UNEXPLAINED)
    assert unexplained.rows == (7,)
    assert not of_kind(findings, FindingKind.WRONG_COEFFICIENT)


def test_a_term_drowned_by_another_is_no_stray_finding_beside_a_complete_explanation() -> None:
    """The bias carries its coefficient × a huge per-row scale (2**100): the gemm term is far below the output's
    rounding, so its fitted coefficient is noise — no "none of the tested explanations" finding beside the scale
    explanation that covers every bad row."""
    reference, weights = ingredients(bias=True)
    w = weights.float()
    scale = 2.0**100 / w  # the coefficient applied to the bias becomes exactly 2**100 (a power of two)
    reference = ReferenceResult(
        reference.output,
        reference.written,
        reference.rows,
        {"gemm": reference.terms["gemm"], "bias": reference.terms["bias"].to(torch.bfloat16).float()},
        reference.coefficients,
        reference.sources,
        {"global_scale": scale},
    )
    actual = (reference.terms["gemm"] * w[:, None] + reference.terms["bias"] * 2.0**100).to(torch.bfloat16)
    findings = analyse(actual, reference, weights.float())
    (wrong,) = of_kind(findings, FindingKind.WRONG_COEFFICIENT)
    assert wrong.evidence["term"] == "bias" and wrong.rows == tuple(range(ROWS))
    assert (wrong.evidence["hypothesis"], wrong.evidence["key"]) == ("scale", "global_scale*")
    assert all(finding.confidence == 1.0 for finding in findings)
    (diagnosis,) = of_kind(findings, FindingKind.DIAGNOSIS)
    assert diagnosis.evidence["blame"] == "kernel"


def test_a_weak_match_on_rows_a_diagnosis_explains_rides_inside_that_finding() -> None:
    """Every row's bias is applied twice (a diagnosis of every bad row); row 5's gemm coefficient is also off by a
    factor no hypothesis names, and only a chance match fits it: told inside the bias finding, not as a
    low-confidence finding and diagnosis of its own."""
    reference, weights = ingredients(bias=True)
    w = weights.float()[:, None]
    gemm_coefficient = w.clone()
    gemm_coefficient[5] *= 1.37
    actual = (reference.terms["gemm"] * gemm_coefficient + 2 * reference.terms["bias"] * w).to(torch.bfloat16)
    findings = analyse(actual, reference, weights.float())
    (wrong,) = of_kind(findings, FindingKind.WRONG_COEFFICIENT)
    assert (wrong.evidence["term"], wrong.evidence["key"]) == ("bias", "2x")
    assert wrong.evidence["also_deviating"] == {"gemm": [5]} and "gemm term" in wrong.message
    (diagnosis,) = of_kind(findings, FindingKind.DIAGNOSIS)
    assert diagnosis.confidence == 1.0
