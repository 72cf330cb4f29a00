"""Damaged files: cut at every byte offset, bit flips everywhere, random corruption.

The properties: a cut file reads up to its last whole record and says what it recovered; a corrupted file
either reads (and then every value it returns is the original one) or raises a one-line MoereplayError —
never another exception, never a hang.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from capture_file_helpers import record_layout
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moereplay.errors import CaptureFileError, MoereplayError
from moereplay.format import CaptureReader, CaptureWriter
from moereplay.format.framing import Envelope, RecordKind

LIMITS = {"max_frame_bytes": 1 << 20, "max_blob_bytes": 1 << 20}


@pytest.fixture(scope="module")
def small_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, list[Envelope]]:
    """Three calls (the last never completed), aliasing views, a shared weight, an index after every call."""
    path = tmp_path_factory.mktemp("small") / "small.zst"
    weight = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    hidden = torch.arange(8, dtype=torch.bfloat16)
    with CaptureWriter(path, {"argv": [], "env": {}}, index_every=1) as writer:
        first = writer.begin_call(
            "gemm", {"w": weight, "x": hidden, "xs": hidden[2:6], "k": 2}, context={"layer": 0}
        )
        writer.complete_call(first, {"out": hidden[:4]})
        second = writer.begin_call("gemm", {"w": weight, "x": hidden * 2}, context={"layer": 1})
        writer.complete_call(second, {"out": weight.t()}, timings={"s": 1.0})
        writer.begin_call("route", {"ids": torch.tensor([3, 1], dtype=torch.int64)})
    return path.read_bytes(), record_layout(path)


def _snapshot(reader: CaptureReader) -> list[tuple[Any, ...]]:
    """Everything a reader returns, in comparable form (loads every tensor)."""
    result = []
    for record in reader.calls():
        args = reader.load_args(record.index)
        outputs = reader.load_outputs(record.index) if record.status != "inputs_saved" else None
        result.append((record.index, record.op, record.status, record.context, _plain(args), _plain(outputs)))
    return result


def _plain(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return (
            str(tree.dtype),
            tuple(tree.shape),
            tree.stride(),
            tree.view(-1).tolist() if tree.is_contiguous() else tree.tolist(),
        )
    if isinstance(tree, dict):
        return {key: _plain(value) for key, value in tree.items()}
    return tree


def test_cut_at_every_byte_offset(small_file: tuple[bytes, list[Envelope]], tmp_path: Path) -> None:
    data, layout = small_file
    header_end = layout[0].end
    path = tmp_path / "cut.zst"
    with CaptureReader(_write(path, data)) as reader:
        full = _snapshot(reader)
    boundaries = {envelope.offset for envelope in layout} | {len(data)}
    for size in range(len(data) + 1):
        _write(path, data[:size])
        if size < header_end:
            with pytest.raises(CaptureFileError, match=r"cut\.zst"):
                CaptureReader(path, **LIMITS)
            continue
        whole = [envelope for envelope in layout if envelope.end <= size]
        calls = [envelope.value for envelope in whole if envelope.kind is RecordKind.CALL]
        done = {envelope.value for envelope in whole if envelope.kind is RecordKind.COMPLETION}
        with CaptureReader(path, **LIMITS) as reader:
            recovery = reader.recovery
            assert recovery.calls_recovered == len(calls) == len(reader), size
            assert recovery.complete == (size == len(data)), size
            assert recovery.footer_missing == (
                RecordKind.FOOTER not in {envelope.kind for envelope in whole}
            ), size
            assert recovery.truncated_at == (
                None if size in boundaries else max(b for b in boundaries if b < size)
            ), size
            assert f"recovered {len(calls)} call" in recovery.message or recovery.complete
            snapshot = _snapshot(reader)
        expected = [
            (
                index,
                op,
                status if index in done else "inputs_saved",
                context,
                args,
                outputs if index in done else None,
            )
            for index, op, status, context, args, outputs in full[: len(calls)]
        ]
        assert snapshot == expected, size


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _read_all_or_fail_cleanly(path: Path, original: list[tuple[Any, ...]]) -> None:
    started = time.monotonic()
    try:
        with CaptureReader(path, **LIMITS) as reader:
            reader.stats()
            snapshot = _snapshot(reader)
            complete = reader.recovery.complete
            damaged = reader.damaged
    except MoereplayError as error:
        message = str(error)
        assert "\n" not in message and message.startswith(str(path)), message
    else:
        # whatever is returned is original data: all of it, or (when damage made a call unreadable, or a scan
        # skipped damaged bytes) the other calls, where a call whose completion was lost reads as inputs_saved
        if complete and not damaged:
            assert snapshot == original
        assert {entry[0] for entry in snapshot}.isdisjoint(damaged)
        by_index = {entry[0]: entry for entry in original}
        for got in snapshot:
            expected = by_index[got[0]]
            assert got == expected or got == (*expected[:2], "inputs_saved", *expected[3:5], None)
    assert time.monotonic() - started < 30  # no pathological scan (a loaded machine is slow, not this slow)


def test_one_bit_flipped_in_every_byte(small_file: tuple[bytes, list[Envelope]], tmp_path: Path) -> None:
    data, _ = small_file
    path = tmp_path / "flip.zst"
    with CaptureReader(_write(path, data)) as reader:
        original = _snapshot(reader)
    for position in range(len(data)):
        damaged = bytearray(data)
        damaged[position] ^= 1 << (position % 8)
        _read_all_or_fail_cleanly(_write(path, bytes(damaged)), original)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.data())
def test_random_corruption(
    small_file: tuple[bytes, list[Envelope]], tmp_path: Path, data: st.DataObject
) -> None:
    original_bytes, _ = small_file
    damaged = bytearray(original_bytes)
    for _ in range(data.draw(st.integers(1, 4))):
        start = data.draw(st.integers(0, len(damaged) - 1))
        patch = data.draw(st.binary(min_size=1, max_size=16))
        damaged[start : start + len(patch)] = patch
    path = tmp_path / "random.zst"
    original_path = tmp_path / "original.zst"
    with CaptureReader(_write(original_path, original_bytes)) as reader:
        original = _snapshot(reader)
    _read_all_or_fail_cleanly(_write(path, bytes(damaged)), original)
