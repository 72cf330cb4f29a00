"""Non-finite outputs the exact reference makes too: the diagnosis names the input that carries them.

The end-to-end cases take the bundled Marlin NVFP4 call, poison one routed expert's global scale with NaN, make the "recorded" output what the call computes (the fp32 reference cast to the output type, NaN included)
and judge it offline with the real session: the verdict stays ``ok`` (the kernel computed what it was given) and a
diagnosis names ``global_scale`` and the expert.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moereplay.ops import get_op
from moereplay.ops.base import TensorContract, block_reads, fixed_dtype, reads
from moereplay.replay import FindingKind, ReplaySession, Verdict
from moereplay.replay.input_faults import given_nonfinite, meaning_of, scan, scan_inputs
from moereplay.replay.source import load_call

ROOT = Path(__file__).resolve().parents[3]
SMALL = ROOT / "captures" / "quickstart-marlin-nvfp4-small.moe.zst"


def test_e8m0_scale_bytes_of_one_expert_are_found_where_they_are() -> None:
    storage = torch.full((4, 3, 8), 0x7F, dtype=torch.uint8)  # 2**0 in e8m0
    storage[2, 1, 5] = 0xFF
    storage[2, 0, 0] = 0xFF
    contract = TensorContract(
        "scales",
        read_as=fixed_dtype(torch.uint8),
        host_checked=False,
        accepted=lambda args: (torch.uint8, torch.float8_e8m0fnu),
        leading="expert",
        values=lambda args: torch.float8_e8m0fnu,
    )
    meaning = meaning_of(contract, storage, {})
    assert meaning == torch.float8_e8m0fnu
    fault = scan("scales", storage, meaning, "expert")
    assert fault is not None
    assert (fault.nan, fault.inf, fault.total) == (2, 0, 96)
    assert fault.indices == (2,) and fault.extent == 4
    assert "in expert 2 of 4" in fault.describe()
    assert "2 bytes 0xff (e8m0's NaN code" in fault.describe()


def test_integer_and_packed_tensors_are_not_scanned_and_clean_ones_report_nothing() -> None:
    ints = TensorContract("ids", read_as=fixed_dtype(torch.int32), host_checked=False)
    assert meaning_of(ints, torch.zeros(4, dtype=torch.int32), {}) is None
    packed = TensorContract("w", read_as=fixed_dtype(torch.uint8), host_checked=False)
    assert meaning_of(packed, torch.full((4,), 0xFF, dtype=torch.uint8), {}) is None
    wide = TensorContract(
        "s", read_as=fixed_dtype(torch.uint8), host_checked=False, values=fixed_dtype(torch.bfloat16)
    )
    assert meaning_of(wide, torch.zeros(4, dtype=torch.uint8), {}) is None  # not its element size
    assert scan("x", torch.ones(3, 5, dtype=torch.bfloat16), torch.bfloat16, "row") is None


def test_rows_are_counted_in_blocks_that_cross_slice_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    import moereplay.replay.input_faults as faults

    monkeypatch.setattr(faults, "_CHUNK_ELEMENTS", 10)  # 2 rows of 5 per block
    x = torch.zeros(7, 5, dtype=torch.float16)
    x[0, 1] = float("inf")
    x[3, 4] = float("nan")
    x[6, 0] = float("-inf")
    fault = scan("x", x, torch.float16, "row")
    assert fault is not None
    assert (fault.nan, fault.inf) == (1, 2)
    assert fault.indices == (0, 3, 6)


def test_the_diagnosis_without_a_poisoned_input_says_overflow_or_computation() -> None:
    overflow = given_nonfinite([], nan=0, inf=4, rows=(1,), reference_overflows=True, variant="recorded")
    assert overflow.kind is FindingKind.DIAGNOSIS and overflow.evidence["cause"] == "overflow"
    assert "overflows float32" in overflow.message
    inside = given_nonfinite([], nan=2, inf=0, rows=(1,), reference_overflows=False, variant="recorded")
    assert inside.evidence["cause"] == "computation"
    assert "inside the exact computation" in inside.message


def _routed_expert(args: dict) -> int:
    expert_ids = args["expert_ids"]
    blocks = int(args["num_tokens_past_padded"].reshape(-1)[0]) // int(args["moe_block_size"])
    return int(expert_ids[:blocks][0])


def _unused_expert(args: dict) -> int:
    op = get_op("moe_wna16_marlin_gemm")
    used = reads(op, args).experts
    assert used is not None
    return min(set(range(int(args["global_scale"].numel()))) - used)


def _poisoned_session(
    expert: int | None, *, unused: bool = False, input_row: int | None = None
) -> tuple[ReplaySession, int]:
    call = load_call(SMALL, 0, "cpu")
    op = get_op(call.op.name)
    args = dict(call.args)
    routed = _routed_expert(args)
    scales = args["global_scale"].clone()
    if expert is not None:
        scales[routed] = float("nan")
    if unused:
        scales[_unused_expert(args)] = float("nan")
    args["global_scale"] = scales
    if input_row is not None:
        activations = args["input"].clone()
        activations[input_row, 3] = float("inf")
        args["input"] = activations
    reference = op.reference(args)
    recorded = reference.output.to(call.captured_output.dtype).reshape(call.captured_output.shape)
    record = SimpleNamespace(op=op.name)
    return ReplaySession(record, args, output=recorded, backend="reference", device="cpu"), routed


def test_nan_the_reference_makes_from_a_poisoned_expert_is_blamed_on_that_input() -> None:
    session, routed = _poisoned_session(expert=0)
    try:
        report = session.report()
    finally:
        session.close()
    recorded = next(r for r in report.results if r.label == "recorded")
    assert recorded.verdict is Verdict.OK and recorded.nan > 0
    given = [f for f in report.findings if f.kind is FindingKind.DIAGNOSIS and f.evidence.get("cause")]
    assert len(given) == 1, [f.message for f in report.findings]
    inputs = given[0].evidence["inputs"]
    assert [i["argument"] for i in inputs] == ["global_scale"]
    assert inputs[0]["indices"] == [routed] and inputs[0]["read_as"] == "float32"
    assert f"in expert {routed} of" in given[0].message
    assert "computed what it was given" in given[0].message


def test_a_poisoned_expert_no_row_is_routed_to_is_named_but_not_blamed() -> None:
    session, _ = _poisoned_session(expert=None, unused=True, input_row=0)
    try:
        report = session.report()
    finally:
        session.close()
    (given,) = [f for f in report.findings if f.evidence.get("cause")]
    by_argument = {i["argument"]: i for i in given.evidence["inputs"]}
    assert by_argument["input"]["reaches_output"] and by_argument["input"]["indices"] == [0]
    assert not by_argument["global_scale"]["reaches_output"]
    message = given.message
    assert "input holds 1 Inf of" in message and "in row 0 of" in message
    assert message.index("not the cause: global_scale") > message.index("input holds")


def test_an_expert_list_separates_routed_experts_from_the_others() -> None:
    session, routed = _poisoned_session(expert=0, unused=True)
    try:
        report = session.report()
    finally:
        session.close()
    (given,) = [f for f in report.findings if f.evidence.get("cause")]
    unused = _unused_expert(dict(load_call(SMALL, 0, "cpu").args))
    assert (
        f"in expert {routed} of 8 (and expert {unused}, to which no row of this call is routed)"
        in given.message
    )


def test_a_clean_call_gets_no_input_diagnosis() -> None:
    session, _ = _poisoned_session(expert=None)
    try:
        report = session.report()
    finally:
        session.close()
    assert not [
        f for f in report.findings if f.evidence.get("cause") in ("inputs", "overflow", "computation")
    ]


def test_marlin_nvfp4_scale_bytes_are_not_read_as_e4m3() -> None:
    """vLLM re-encodes NVFP4 scales for Marlin: 0x7f there is a finite scale, not e4m3's NaN — no claim."""
    call = load_call(SMALL, 0, "cpu")
    op = get_op(call.op.name)
    args = dict(call.args)
    scales = args["b_scales"].clone()
    scales.view(torch.uint8)[_routed_expert(args)] = 0x7F
    args["b_scales"] = scales
    assert scan_inputs(op, args) == []


def test_scan_inputs_skips_the_output_buffer() -> None:
    call = load_call(SMALL, 0, "cpu")
    op = get_op(call.op.name)
    args = dict(call.args)
    if isinstance(args.get("output"), torch.Tensor):
        args["output"] = torch.full_like(args["output"], float("nan"))
    assert scan_inputs(op, args) == []


def test_a_tensor_the_kernel_reads_as_another_wider_type_is_not_claimed() -> None:
    # Marlin reads topk_weights as float32 whatever they are: bf16 NaN bytes are half of a finite float32
    contract = TensorContract("topk_weights", read_as=fixed_dtype(torch.float32), host_checked=False)
    weights = torch.full((8,), float("nan"), dtype=torch.bfloat16)
    assert meaning_of(contract, weights, {}) is None
    same = TensorContract("bias", read_as=fixed_dtype(torch.float16), host_checked=False)
    assert meaning_of(same, torch.zeros(4, dtype=torch.bfloat16), {}) == torch.float16  # the kernel's reading


def test_four_bit_float_formats_hold_no_codes_to_scan() -> None:
    packed = getattr(torch, "float4_e2m1fn_x2", None)
    if packed is None:
        pytest.skip("this torch has no float4_e2m1fn_x2")
    contract = TensorContract("w", read_as=fixed_dtype(packed), host_checked=False)
    assert meaning_of(contract, torch.zeros(4, dtype=torch.uint8).view(packed), {}) is None


def test_block_reads_round_a_partial_block_as_each_kernel_does() -> None:
    sorted_ids = torch.tensor([0, 1, 9, 9, 2, 3, 9, 9, 4, 5, 9, 9], dtype=torch.int32)  # 9: padding ids
    experts = torch.tensor([3, -1, 7], dtype=torch.int32)  # block 1 belongs to another rank
    # 11 padded rows: Triton runs a block that starts below them (3 blocks), Marlin whole blocks only (2)
    triton = block_reads(sorted_ids, experts, torch.tensor([11]), 4, valid=6, top_k=2, partial_block=True)
    marlin = block_reads(sorted_ids, experts, 11, 4, valid=6, top_k=2, partial_block=False)
    assert triton.experts == {3, 7} and marlin.experts == {3}
    assert triton.rows == {0, 2} and marlin.rows == {0}  # ids // top_k of the blocks that run; skipped: none


def test_the_triton_reads_hook_counts_the_last_partial_block() -> None:
    triton = ROOT / "captures" / "triton-qwen3-bf16-small.moe.zst"
    call = load_call(triton, 0, "cpu")
    args = dict(call.args)
    block = int(args["BLOCK_SIZE_M"])
    padded = int(args["num_tokens_post_padded"].reshape(-1)[0])
    last = int(args["expert_ids"].reshape(-1)[(padded - 1) // block])
    args["num_tokens_post_padded"] = torch.tensor(
        [padded - 1], dtype=torch.int32
    )  # the last block now partial
    assert last in reads(get_op(call.op.name), args).experts


def test_a_nan_row_the_call_does_not_read_is_not_blamed() -> None:
    call = load_call(SMALL, 0, "cpu")
    op = get_op(call.op.name)
    args = dict(call.args)
    known = reads(op, args)
    assert known.rows is not None and known.experts is not None
    ids = args["sorted_token_ids"].reshape(-1).clone()
    experts = args["expert_ids"].reshape(-1).clone()
    block = int(args["moe_block_size"])
    top_k = int(args["top_k"])
    valid = int(args["size_m"]) * top_k
    # hand the first block to another rank (-1): the rows only it names are no longer read
    experts[0] = -1
    args["expert_ids"] = experts
    others = {int(i) // top_k for i in ids[block:].tolist() if 0 <= int(i) < valid}
    only_first = sorted({int(i) // top_k for i in ids[:block].tolist() if 0 <= int(i) < valid} - others)
    assert only_first, "the first block names a row no other block does"
    activations = args["input"].clone()
    activations[only_first[0], 0] = float("nan")
    args["input"] = activations
    (fault,) = scan_inputs(op, args)
    assert fault.arg == "input" and not fault.reaches and fault.used == ()
    assert (
        "which this call does not read"
        in given_nonfinite(
            [fault], nan=1, inf=0, rows=(0,), reference_overflows=False, variant="recorded"
        ).message
    )


def test_a_corrupt_call_gets_no_caller_diagnosis_for_its_nan() -> None:
    call = load_call(SMALL, 0, "cpu")
    op = get_op(call.op.name)
    args = dict(call.args)
    scales = args["global_scale"].clone()
    scales[_routed_expert(args)] = float("nan")
    args["global_scale"] = scales
    recorded = (
        op.reference(args).output.to(call.captured_output.dtype).reshape(call.captured_output.shape).clone()
    )
    finite = torch.isfinite(recorded.float()).all(dim=-1).nonzero().flatten()
    recorded[finite[:3]] *= 3  # finite rows the kernel got wrong
    session = ReplaySession(
        SimpleNamespace(op=op.name), args, output=recorded, backend="reference", device="cpu"
    )
    try:
        report = session.report()
    finally:
        session.close()
    assert next(r for r in report.results if r.label == "recorded").verdict is Verdict.CORRUPT
    assert not [f for f in report.findings if f.evidence.get("cause")]


def test_the_matmul_ogs_reads_hook_follows_the_gather_and_the_histogram() -> None:
    served = ROOT / "captures" / "gpt-oss-served-nan.moe.zst"
    gemm1, gemm2 = load_call(served, 1, "cpu"), load_call(served, 2, "cpu")
    op = get_op(gemm1.op.name)
    first, second = reads(op, dict(gemm1.args)), reads(op, dict(gemm2.args))
    assert first.experts == second.experts and 5 in first.experts  # the poisoned expert has this call's row
    tokens = gemm1.args["x"].shape[0]
    assert first.rows == frozenset(range(tokens))  # every token, through gather src // top_k
    active = gemm2.args["x"].shape[0]
    assert second.rows == frozenset(range(active))  # no gather: the expert-sorted rows themselves


def test_a_strided_view_is_scanned_as_it_is_indexed() -> None:
    storage = torch.full((4, 8), 0x7F, dtype=torch.uint8)
    storage[1, 6] = 0xFF  # row 6 of the transposed view
    view = storage.t()  # [8, 4], not contiguous: read as e8m0 without a copy of the whole
    fault = scan("scales", view, torch.float8_e8m0fnu, "expert")
    assert fault is not None and fault.indices == (6,) and fault.nan == 1 and fault.extent == 8
