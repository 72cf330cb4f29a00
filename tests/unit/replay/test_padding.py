"""A CUDA graph's padding rows: a graph-kept call's context says how many of its batch's tokens were real, and a
replay leaves the rest out of what it judges (NaN there is not the call's fault and reached no user).

The end-to-end case takes the bundled Marlin NVFP4 gemm2 call (32 rows: 8 tokens × top-4, token-major), puts NaN
into the intermediate rows of tokens 6 and 7, makes the "recorded" output what the call computes (the exact
reference, NaN included) and judges it offline with the real session, with and without the context of a graph
batch of 8 that had 6 real tokens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from moereplay.ops import get_op
from moereplay.ops.base import RowMap, layer_tokens, tokens_by_activation_rows
from moereplay.replay import FindingKind, ReplaySession, Verdict
from moereplay.replay.padding import Padding, padding_of
from moereplay.replay.source import load_call

ROOT = Path(__file__).resolve().parents[3]
SMALL = ROOT / "captures" / "quickstart-marlin-nvfp4-small.moe.zst"
SERVED = ROOT / "captures" / "gpt-oss-served-nan.moe.zst"


def _judged(context: dict, bad_rows: slice, real_bad_row: int | None = None):
    call = load_call(SMALL, 0, "cpu")
    op = get_op(call.op.name)
    args = dict(call.args)
    activations = args["input"].clone()
    activations[bad_rows] = float("nan")  # what a padding token's buffers held
    if real_bad_row is not None:
        activations[real_bad_row, 0] = float("nan")
    args["input"] = activations
    recorded = op.reference(args).output.to(call.captured_output.dtype).reshape(call.captured_output.shape)
    loaded = dataclasses.replace(
        call, args=args, captured_output=recorded, context={**call.context, **context}
    )
    session = ReplaySession(loaded, backend="reference", device="cpu")
    try:
        report = session.report()
    finally:
        session.close()
    return next(r for r in report.results if r.label == "recorded"), report


def test_nan_in_the_padding_rows_of_a_graph_batch_is_not_judged() -> None:
    # 32 rows = 8 tokens × 4: tokens 6 and 7 (rows 24-31) are the padding of a batch of 8 with 6 real tokens
    recorded, report = _judged({"graph_tokens": 6, "graph_batch": 8}, slice(24, 32))
    assert recorded.verdict is Verdict.OK
    assert recorded.nan == 0 and recorded.inf == 0 and recorded.rows == 24
    assert not [f for f in report.findings if f.kind in (FindingKind.NONFINITE, FindingKind.DIAGNOSIS)]
    assert any(
        "output rows 24-31 (8 of 32) belong to padding tokens 6-7 and are not judged" in note
        for note in report.notes
    ), report.notes


def test_without_the_context_the_same_nan_is_the_calls() -> None:
    recorded, report = _judged({}, slice(24, 32))
    assert recorded.verdict is Verdict.OK and recorded.nan > 0 and recorded.rows == 32
    assert [f for f in report.findings if f.kind is FindingKind.DIAGNOSIS]
    assert not any("padding" in note for note in report.notes)


def test_nan_in_a_real_row_of_a_padded_batch_is_still_the_calls() -> None:
    recorded, report = _judged({"graph_tokens": 6, "graph_batch": 8}, slice(24, 32), real_bad_row=5)
    assert recorded.nan == 256  # row 5 (token 1), every column; the padding rows' NaN not counted
    (nonfinite,) = [f for f in report.findings if f.kind is FindingKind.NONFINITE]
    assert nonfinite.rows == (5,)


@pytest.mark.parametrize(
    "context",
    [
        {"graph_tokens": 8, "graph_batch": 8},  # not padded
        {"graph_tokens": 0, "graph_batch": 8},
        {"graph_tokens": 9, "graph_batch": 8},
        {"graph_tokens": "6", "graph_batch": 8},
        {"graph_tokens": True, "graph_batch": 8},
        {"graph_tokens": 6},
        {},
    ],
)
def test_a_context_that_is_not_a_padded_batch_claims_nothing(context: dict) -> None:
    assert padding_of(context) is None


def test_tokens_of_a_token_major_activation() -> None:
    token = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, -1])
    assert tokens_by_activation_rows(token, torch.zeros(8, 4), 8).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, -1]
    assert tokens_by_activation_rows(token, torch.zeros(8, 4), 4).tolist() == [0, 0, 1, 1, 2, 2, 3, 3, -1]
    assert tokens_by_activation_rows(token, torch.zeros(8, 4), 3) is None  # 8 rows are not 3 tokens' rows
    assert tokens_by_activation_rows(token, torch.zeros(8, 4), 16) is None  # fewer rows than tokens
    assert tokens_by_activation_rows(token, torch.zeros(8), 8) is None


def test_matmul_ogs_rows_follow_the_gather_and_the_scatter() -> None:
    # the served gpt-oss call: gemm1 gathers 8 tokens into 16 expert-sorted rows (top-2), gemm2 scatters them back
    gemm1, gemm2 = load_call(SERVED, 1, "cpu"), load_call(SERVED, 2, "cpu")
    op = get_op(gemm1.op.name)
    first = op.reference(dict(gemm1.args)).rows
    tokens = layer_tokens(op, dict(gemm1.args), first, 8)
    assert tokens is not None
    gather = gemm1.args["gather_indx"].src_indx.reshape(-1)[: first.rows].to(torch.int64)
    assert tokens.tolist() == torch.div(gather, 2, rounding_mode="floor").tolist()
    assert sorted(tokens.tolist()) == sorted(list(range(8)) * 2)  # each token's two rows
    second = op.reference(dict(gemm2.args)).rows
    assert layer_tokens(op, dict(gemm2.args), second, 8).tolist() == list(
        range(8)
    )  # the output's rows: tokens
    assert layer_tokens(op, dict(gemm2.args), second, 4) is None  # not a batch of 4


def test_the_note_names_one_row_and_one_token_in_the_singular() -> None:
    # measured on the served gpt-oss: a batch of 8 with 7 real tokens, gemm2's output row 7 the padding's
    note = Padding(tokens=7, batch=8).note(torch.tensor([False] * 7 + [True]))
    assert "output row 7 belongs to padding token 7 and is not judged" in note
    note = Padding(tokens=7, batch=8).note(torch.tensor([False, True] * 8))
    assert (
        "output rows 1, 3, 5, 7, 9, 11, 13, 15 (8 of 16) belong to padding token 7 and are not judged" in note
    )


def test_an_op_without_the_hook_is_judged_whole_and_says_so() -> None:
    padding = Padding(tokens=3, batch=4)
    rows = RowMap(*(torch.zeros(4, dtype=torch.int64) for _ in range(4)))
    op = get_op("moe_wna16_marlin_gemm")
    assert padding.rows(op, {}, rows) is None  # no activation to read rows from
    assert "every row is judged" in padding.note(None)


def test_matmul_ogs_rows_without_a_token_cannot_be_told_apart() -> None:
    # expert-sorted rows with no gather: the row map names no token, so the op cannot say which rows are padding
    op = get_op("matmul_ogs")
    rows = RowMap(*(torch.full((6,), -1, dtype=torch.int64) for _ in range(4)))
    assert layer_tokens(op, {"x": torch.zeros(6, 4)}, rows, 3) is None
