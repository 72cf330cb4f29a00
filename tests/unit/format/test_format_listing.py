"""Listing a 10,000-call file reads call records only: no blob frame, far fewer bytes than the tensors hold."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moereplay.format import CaptureReader, CaptureWriter
from moereplay.format.summary import capture_info, list_calls

CALLS = 10_000
ACTIVATION_BYTES = 4096


@pytest.fixture(scope="module")
def big_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("big") / "big.zst"
    generator = torch.Generator().manual_seed(0)
    weight = torch.randint(0, 2**31 - 1, (256, 256), dtype=torch.int32, generator=generator)
    with CaptureWriter(path) as writer:
        for step in range(CALLS):
            hidden = torch.randint(0, 256, (ACTIVATION_BYTES,), dtype=torch.uint8, generator=generator)
            op = "moe_wna16_marlin_gemm" if step % 3 else "matmul_ogs"
            index = writer.begin_call(
                op,
                {"a": hidden, "b_q_weight": weight, "top_k": 4},
                context={"layer": step % 4, "step": step // 4},
                static={"b_q_weight"},
            )
            if step % 10:
                writer.complete_call(index, {"c": hidden[: ACTIVATION_BYTES // 2]})
    return path


def test_listing_ten_thousand_calls_touches_no_blob(big_capture: Path) -> None:
    with CaptureReader(big_capture) as reader:
        records = list(reader.calls())
        listing_bytes = reader.bytes_read
        stats = reader.stats()
        assert reader.blob_frames_read == 0
        assert listing_bytes < stats.unique_blob_bytes / 4
        listed = list(reader.select(op="moe_*", layer=2, status="completed"))
        assert reader.blob_frames_read == 0
        assert torch.equal(reader.load_args(9_999)["a"][:4], reader.load_args(9_999)["a"][:4])
        assert reader.blob_frames_read == 2  # a and the weight, only when asked (then cached)
    assert len(records) == CALLS and [record.index for record in records] == list(range(CALLS))
    assert stats.by_status == {"inputs_saved": CALLS // 10, "completed": CALLS - CALLS // 10}
    assert stats.by_op["matmul_ogs"]["completed"] + stats.by_op["matmul_ogs"].get("inputs_saved", 0) == 3334
    assert stats.unique_blob_bytes >= CALLS * ACTIVATION_BYTES
    assert all(
        record.op.startswith("moe_") and record.layer == 2 and record.status == "completed"
        for record in listed
    )
    assert len(listed) == sum(1 for step in range(CALLS) if step % 3 and step % 4 == 2 and step % 10)


def test_random_access_and_summaries(big_capture: Path) -> None:
    with CaptureReader(big_capture) as reader:
        record = reader.call(7_777)
        assert record.context == {"layer": 1, "step": 1_944}
        assert record.arg_tensors["b_q_weight"].describe() == "int32[256,256]"
        assert reader.blob_frames_read == 0
    info = capture_info(big_capture)
    assert info.recovery.complete and info.stats.calls == CALLS
    recovery, rows = list_calls(big_capture, op="matmul_ogs", status="inputs_saved")
    assert recovery.complete and [row.index for row in rows] == [step for step in range(0, CALLS, 30)]
    assert rows[0].key_tensors() == "a=uint8[4096] b_q_weight=int32[256,256]"
