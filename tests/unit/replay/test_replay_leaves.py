"""Replay guards every tensor *leaf*: tensors inside opaque arguments get their own guard bands, named by path, for
fills, guard checks, over-read localisation and contracts (tests/unit/replay/replay_opaque_toy.py's real kernels)."""

from __future__ import annotations

from pathlib import Path

import pytest
import replay_opaque_toy as toy

from moereplay.replay import FindingKind, ReplayReport, Verdict, replay


def capture(tmp_path: Path, **kwargs: int) -> Path:
    return toy.write_capture(tmp_path / "boxed.moe.zst", toy.make_args(**kwargs))


def by_label(report: ReplayReport, label: str):  # type: ignore[no-untyped-def]
    return next(result for result in report.results if result.label == label)


@pytest.mark.parametrize("isolate", [False, True], ids=["in-process", "worker"])
def test_an_unmasked_over_read_inside_an_opaque_argument_is_found_and_named_by_its_path(
    tmp_path: Path, isolate: bool
) -> None:
    report = replay(
        capture(tmp_path, extra=4),
        fills=["0x00", "0xff"],
        backend=toy.spec("unmasked"),
        device="cpu",
        isolate=isolate,
        reuse_worker=False,
        guard_bytes=256,
    )
    # within tolerance, but its output changes with bytes outside its tensors: never "ok"
    assert report.baseline.verdict is Verdict.MEMORY_DEPENDENT and report.failed
    assert by_label(report, "fill 0x00").verdict is Verdict.OK
    assert by_label(report, "fill 0xff").verdict is Verdict.NONFINITE  # 0 · NaN in the last row
    # the contract over the leaf is a finding, stated in the kernel's terms
    contract = next(f for f in report.findings if f.kind is FindingKind.CONTRACT_VIOLATION)
    assert contract.evidence["argument"] == toy.LEAF and contract.variant == "baseline"
    assert "10 elements" in contract.message and "6 elements" in contract.message
    # the over-read is localised to the leaf, within the 16 bytes (4 float32 loads) past its end: from the first
    # byte whose 0xff makes a NaN exponent (byte 3 of the first load) to the last (byte 14, the second-highest byte
    # of the fourth load: 0xffff0000 is NaN, 0xff000000 is not)
    (read,) = [f for f in report.findings if f.kind is FindingKind.OOB_READ]
    assert read.variant == "fill 0xff" and read.rows == (5,)
    (located,) = read.evidence["arguments"]
    assert located["argument"] == toy.LEAF
    assert located["extents"] == [["after", 3, 14]]
    assert located["contract"].startswith(f"{toy.LEAF}: shape is 6 elements")
    assert f"{toy.LEAF} is over-read (bytes 3..14 past the end affect the output)" in read.message


def test_a_write_past_the_end_of_a_leaf_damages_its_own_guard(tmp_path: Path) -> None:
    report = replay(
        capture(tmp_path, extra=0),
        backend=toy.spec("oob_write"),
        device="cpu",
        isolate=False,
        guard_bytes=256,
    )
    assert report.baseline.verdict is Verdict.CORRUPT
    (write,) = [f for f in report.findings if f.kind is FindingKind.OOB_WRITE]
    assert write.evidence["argument"] == toy.LEAF
    assert (write.evidence["first"] - write.evidence["span_bytes"], write.evidence["bytes"]) == (0, 8)
    assert not [f for f in report.findings if f.kind is FindingKind.CONTRACT_VIOLATION]


def test_the_reference_backend_checks_contracts_over_leaves_too(tmp_path: Path) -> None:
    report = replay(capture(tmp_path, extra=2), backend="reference", device="cpu")
    assert report.recorded is not None and report.recorded.verdict is Verdict.OK
    (contract,) = [f for f in report.findings if f.kind is FindingKind.CONTRACT_VIOLATION]
    assert contract.evidence["argument"] == toy.LEAF
