"""Hostile and damaged captures made from the bundled ones (issue 16): one line naming the record and the problem,
bounded memory, file text never markup or terminal control, and everything readable still listed and replayable.

Each test mutates one thing with :mod:`capture_mutations` (the rest of the file stays consistent) and checks the
reader, the CLI (``info``, ``ls``, ``run`` through ``main()``) and the replay loading path.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
from capture_mutations import Record, build, map_tensors, pack_ext, parse, unpack_ext, walk, zero_blob

from moereplay.cli import main
from moereplay.errors import CaptureFileError, MemoryBudgetError, MoereplayError
from moereplay.format import CaptureReader, DamagedCall
from moereplay.format.framing import RecordKind
from moereplay.format.values import Ext

CAPTURES = Path(__file__).resolve().parents[3] / "captures"
LAYER = CAPTURES / "marlin-nvfp4-layer.moe.zst"  # a layer call (0) and its two kernel calls (1, 2), recipes
SMALL = CAPTURES / "quickstart-marlin-nvfp4-small.moe.zst"  # one kernel call, every tensor as bytes


def _mutate(source: Path, target: Path, change: Callable[[list[Record]], object]) -> Path:
    records = parse(source)
    change(records)
    target.write_bytes(build(records))
    return target


def _of(records: list[Record], kind: RecordKind, position: int = -1) -> Record:
    return [record for record in records if record.kind is kind][position]


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        main(list(argv))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    else:
        code = 0
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moereplay: "), err
    for needle in needles:
        assert needle in lines[0], err


@pytest.mark.parametrize(
    ("kind", "key"),
    [
        (RecordKind.CALL, "parent"),
        (RecordKind.CALL, "t"),
        (RecordKind.COMPLETION, "t"),
        (RecordKind.COMPLETION, "error"),
    ],
)
def test_a_record_missing_a_key_is_one_damaged_call(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: RecordKind, key: str
) -> None:
    path = _mutate(LAYER, tmp_path / "missing.zst", lambda records: _of(records, kind, 1).document.pop(key))
    with CaptureReader(path) as reader:
        with pytest.raises(CaptureFileError, match=rf"call 1: the \w+ record has no '{key}'"):
            reader.call(1)
        entries = list(reader.entries())
        assert [type(entry) for entry in entries] == [type(entries[0]), DamagedCall, type(entries[0])]
        assert [record.index for record in reader.calls()] == [0, 2]
        assert reader.stats().damaged.keys() == {1}
    code, out, err = _cli(capsys, "ls", str(path))
    assert code == 0 and "damaged" in out.splitlines()[2] and f"has no '{key}'" in out
    code, out, _ = _cli(capsys, "info", str(path))
    assert code == 0 and "1 damaged" in out
    code, _, err = _cli(capsys, "run", str(path), "--call", "1", "--backend", "reference")
    _one_line_error(code, err, "call 1", f"no '{key}'")
    code, out, err = _cli(capsys, "run", str(path), "--call", "2", "--backend", "reference", "--no-follow")
    assert code in (0, 1) and "call #2" in out, err  # the intact calls still replay


@pytest.mark.parametrize(
    "value",
    [5, pack_ext(Ext.CODEC, ["some.Type", 1]), pack_ext(Ext.ENUM, ["some.Enum", "A", 1])],
    ids=["int", "codec", "enum"],
)
def test_a_non_tensor_where_a_tensor_belongs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: object
) -> None:
    def change(records: list[Record]) -> None:
        _of(records, RecordKind.CALL, 0).document["args"]["input"] = value

    path = _mutate(SMALL, tmp_path / "kind.zst", change)
    code, _, err = _cli(capsys, "run", str(path), "--call", "0", "--backend", "reference")
    _one_line_error(code, err, "call 0", "argument input should be a tensor")


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"dt": "qint8", "is": 1}, "does not load"),
        ({"sh": [2**40, 2**40]}, "is over"),
        ({"sh": [0, 2**62]}, "is over"),
        ({"st": [2**63, 1]}, "out of range"),
        ({"of": 2**60}, "reach past"),
    ],
    ids=["quantized", "overflow", "overflow-empty", "stride", "offset"],
)
def test_tensor_descriptors_torch_would_reject(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fields: dict[str, object], problem: str
) -> None:
    def change(records: list[Record]) -> None:
        document = _of(records, RecordKind.CALL, 0).document
        document["args"]["input"] = map_tensors(
            document["args"]["input"], lambda payload: {**payload, **fields}
        )

    path = _mutate(SMALL, tmp_path / "meta.zst", change)
    with CaptureReader(path) as reader, pytest.raises(CaptureFileError, match=problem) as caught:
        reader.load_args(0)
    assert "\n" not in str(caught.value) and "call 0" in str(caught.value)
    code, _, err = _cli(capsys, "run", str(path), "--call", "0", "--backend", "reference")
    _one_line_error(code, err, "call 0", problem)


def test_file_text_is_never_markup_or_terminal_control(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hostile = "[/][bold]x\x1b[2J\x1b]0;title\x07\u202eevil\nline"

    def change(records: list[Record]) -> None:
        records[0].document["host"] = hostile
        records[0].document["argv"] = [hostile]
        call = _of(records, RecordKind.CALL, 0).document
        call["site"] = hostile
        call["ctx"]["layer_name"] = hostile

    path = _mutate(SMALL, tmp_path / "text.zst", change)
    for argv in (["info"], ["ls"], ["run", "--call", "0", "--backend", "reference", "--no-follow"]):
        code, out, err = _cli(capsys, *argv, str(path))
        assert code in (0, 1), err
        for stream in (out, err):
            assert "\x1b" not in stream and "\x07" not in stream and "\u202e" not in stream
        assert "[/][bold]x\\x1b[2J" in out  # shown literally, escapes and brackets included
    # an op name is file text too: quoted in the one-line error, escaped
    _mutate(
        SMALL,
        tmp_path / "op.zst",
        lambda records: _of(records, RecordKind.CALL, 0).document.update(op="\x1b[31m[/]"),
    )
    code, _, err = _cli(capsys, "run", str(tmp_path / "op.zst"), "--call", "0")
    assert code == 2 and "\x1b" not in err and len(err.strip().splitlines()) == 1


def test_a_small_file_holding_a_huge_zero_blob_is_refused_before_allocating(tmp_path: Path) -> None:
    length = 64 * 2**20
    digest, frame = zero_blob(length)

    def change(records: list[Record]) -> None:
        call = _of(records, RecordKind.CALL, 0).document
        storage = unpack_ext(call["args"]["input"])["sid"]
        blob = Record(RecordKind.BLOB, length, None, frame=frame)
        records.insert(1, blob)
        blob.origin = -1
        call["storages"][storage] = {**call["storages"][storage], "h": digest, "n": length, "at": -1}
        call["args"]["input"] = map_tensors(
            call["args"]["input"], lambda p: {**p, "sh": [length // 2], "st": [1], "of": 0}
        )

    path = _mutate(SMALL, tmp_path / "bomb.zst", change)
    assert path.stat().st_size < 2 * 2**20
    with CaptureReader(path, memory_budget=16 * 2**20) as reader:
        with pytest.raises(
            MemoryBudgetError, match=r"call 0 arguments need [\d,]+ bytes, over the memory budget"
        ):
            reader.load_args(0)
        assert reader.blob_frames_read == 0  # refused before reading (or allocating) anything
    with CaptureReader(path, memory_budget=256 * 2**20) as reader:
        assert reader.load_args(0)["input"].count_nonzero() == 0  # within budget it is a valid file


def test_storages_sharing_one_blob_read_it_once_and_count_each(tmp_path: Path) -> None:
    def change(records: list[Record]) -> None:
        call = _of(records, RecordKind.CALL, 0).document
        first_id = unpack_ext(call["args"]["input"])["sid"]
        entry = call["storages"][first_id]
        for copy in range(6):
            storage = 1000 + copy
            call["storages"][storage] = dict(entry)
            call["args"][f"copy{copy}"] = map_tensors(
                call["args"]["input"], lambda p, s=storage: {**p, "sid": s}
            )

    path = _mutate(SMALL, tmp_path / "shared.zst", change)
    with CaptureReader(path, blob_cache_bytes=0) as reader:
        baseline = CaptureReader(SMALL, blob_cache_bytes=0)
        baseline.load_args(0)
        args = reader.load_args(0)
        assert reader.blob_frames_read == baseline.blob_frames_read  # each blob decoded and hashed once
        baseline.close()
        for copy in range(6):
            assert args[f"copy{copy}"].equal(args["input"])
            assert (
                args[f"copy{copy}"].untyped_storage().data_ptr() != args["input"].untyped_storage().data_ptr()
            )
        need = sum(entry["n"] for entry in _of(parse(path), RecordKind.CALL, 0).document["storages"].values())
        reader.memory_budget = need - 1
        with pytest.raises(MemoryBudgetError):
            reader.load_args(0)


def test_a_recipe_enlarged_is_refused_before_expanding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moereplay.synth import recipe

    def enlarge(value: object) -> object:
        if isinstance(value, msgpack.ExtType) and value.code == Ext.CODEC:
            type_name, tree = unpack_ext(value)
            if type_name == recipe.RECIPE_TYPE and tree["generator"] == "normal":
                tree["params"] = {**tree["params"], "shape": [10**9]}
                return pack_ext(Ext.CODEC, [type_name, tree])
        return value

    def change(records: list[Record]) -> None:
        call = _of(records, RecordKind.CALL, 0).document
        call["args"] = walk(call["args"], enlarge)

    path = _mutate(LAYER, tmp_path / "recipe.zst", change)
    drawn: list[str] = []
    recipe.generator_names()  # registers the built-in generators
    original = recipe._GENERATORS["normal"]
    monkeypatch.setitem(
        recipe._GENERATORS, "normal", lambda params: drawn.append("normal") or original(params)
    )
    recipe.clear_cache()
    with CaptureReader(path, memory_budget=2**30) as reader, pytest.raises(MemoryBudgetError, match="call 0"):
        reader.load_args(0)
    assert drawn == []


def test_a_recipe_dtype_name_imports_nothing(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from moereplay.errors import UnsupportedValueError\n"
        "from moereplay.synth.recipe import recipe_from_tree\n"
        "for name in ('_inductor', 'onnx', '_dynamo', 'float32x'):\n"
        "    tree = {'v': 1, 'generator': 'normal', 'part': '', 'dtype': name, 'sha256': '0' * 64, 'params': {},"
        " 'shape': [1], 'stride': [1]}\n"
        "    try:\n"
        "        recipe_from_tree(tree)\n"
        "    except UnsupportedValueError:\n"
        "        pass\n"
        "print(sorted(m for m in ('torch._inductor', 'torch.onnx', 'torch._dynamo') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]", result.stderr


def test_bytes_after_a_records_frame_are_damage(tmp_path: Path) -> None:
    def junk_after_call(records: list[Record]) -> None:
        _of(records, RecordKind.CALL, 1).trailer = b"junk"

    path = _mutate(LAYER, tmp_path / "trailing.zst", junk_after_call)
    with CaptureReader(path) as reader:
        (problem,) = reader.damaged.values()
        assert re.fullmatch(r"call frame at offset \d+ has 4 bytes after its zstd frame", problem)
        assert reader.indices == [0, 1, 2]
    path = _mutate(
        SMALL,
        tmp_path / "trailing-blob.zst",
        lambda records: setattr(_of(records, RecordKind.BLOB, 0), "trailer", b"\0" * 8),
    )
    with CaptureReader(path) as reader, pytest.raises(CaptureFileError, match="8 bytes after its zstd frame"):
        reader.load_args(0)


def test_records_the_index_does_not_list_are_reported(tmp_path: Path) -> None:
    def zero_length(records: list[Record]) -> None:
        position = records.index(_of(records, RecordKind.CALL, 1))
        records.insert(position, Record(RecordKind.CALL, 7, None, raw_frame=b""))

    path = _mutate(LAYER, tmp_path / "empty.zst", zero_length)
    with CaptureReader(path) as reader:
        assert not reader.recovery.complete
        assert "no room for a zstd frame" in reader.recovery.message
        assert reader.indices == [0, 1, 2]

    def spliced(records: list[Record]) -> None:  # a whole call record, valid, that no index lists
        extra = Record(
            RecordKind.CALL, 9, None, document={**_of(records, RecordKind.CALL, 1).document, "i": 9}
        )
        records.insert(records.index(_of(records, RecordKind.FOOTER)), extra)

    path = _mutate(LAYER, tmp_path / "spliced.zst", spliced)
    with CaptureReader(path) as reader:
        assert not reader.recovery.complete
        assert "1 call record the index does not list" in reader.recovery.message
        assert reader.indices == [0, 1, 2, 9]  # listed: it is recorded data


def test_one_damaged_record_hides_nothing_else(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def damage(records: list[Record]) -> None:
        _of(records, RecordKind.CALL, 1).raw_frame = b"\x28\xb5\x2f\xfd" + bytes(20)

    path = _mutate(LAYER, tmp_path / "damaged.zst", damage)
    with CaptureReader(path) as reader:
        assert [record.index for record in reader.calls()] == [0, 2]
        assert set(reader.damaged) == {1}
    code, out, _ = _cli(capsys, "ls", str(path))
    assert code == 0 and [line.split()[0] for line in out.splitlines()[1:]] == ["0", "1", "2"]
    code, out, _ = _cli(capsys, "info", str(path))
    assert code == 0 and "2 (2 completed; 1 damaged)" in out
    code, out, err = _cli(capsys, "run", str(path), "--call", "2", "--backend", "reference", "--no-follow")
    assert code in (0, 1) and "call #2" in out, err


def test_damaged_bytes_between_records_are_skipped_when_scanning(tmp_path: Path) -> None:
    """Without a usable index the scan searches past a damaged envelope instead of stopping at it."""
    data = bytearray(LAYER.read_bytes())
    records = parse(LAYER)
    call = _of(records, RecordKind.CALL, 1)
    data[call.origin + 9] ^= 0xFF  # the envelope's CRC fails
    data[-8:] = bytes(8)  # and the tail's: no index
    path = tmp_path / "scan.zst"
    path.write_bytes(bytes(data))
    with CaptureReader(path) as reader:
        assert reader.indices == [0, 2]
        assert "damaged bytes" in reader.recovery.message
        reader.load_outputs(2)


def test_every_error_names_the_file_on_one_line(tmp_path: Path) -> None:
    path = _mutate(
        LAYER,
        tmp_path / "x.zst",
        lambda records: _of(records, RecordKind.COMPLETION, 1).document.pop("outputs"),
    )
    with CaptureReader(path) as reader, pytest.raises(MoereplayError) as caught:
        reader.load_outputs(1)
    assert str(caught.value).startswith(str(path)) and "\n" not in str(caught.value)
    assert hashlib.sha256(path.read_bytes()).digest()  # the file itself is left alone
