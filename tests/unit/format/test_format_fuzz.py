"""A structure-aware fuzz campaign over the bundled captures (issue 16), small enough for the CPU suite.

Each example parses a bundled capture into records (:mod:`capture_mutations`), changes a few things the way a
damaged or hostile file would — a key dropped, a value of the wrong type, a tensor descriptor torch rejects, a
storage pointed elsewhere, a recipe enlarged, file text holding markup and terminal control, bytes appended inside
a record, records inserted, dropped or flipped — writes a consistent file around the change, and runs what a user
would: the reader (open, list, stats, load every call's arguments and outputs), the replay loading path, and
``info``/``ls``/``run`` through ``main()``.

The properties: no exception other than a one-line :class:`~moereplay.errors.MoereplayError` (exit 2 from the
CLI), nothing from the file written to the terminal as control characters, and memory held to the budget
(``MOEREPLAY_LOAD_BUDGET`` = 64 MiB here, so a bomb is refused instead of allocated).
"""

from __future__ import annotations

import resource
import time
from functools import cache
from pathlib import Path
from typing import Any

import msgpack
import pytest
from capture_mutations import Record, build, map_tensors, pack_ext, parse, unpack_ext, walk
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moereplay.cli import main
from moereplay.errors import MoereplayError
from moereplay.format import CaptureReader
from moereplay.format.framing import RecordKind
from moereplay.format.values import Ext

CAPTURES = Path(__file__).resolve().parents[3] / "captures"
SOURCES = ("quickstart-marlin-nvfp4-small.moe.zst", "marlin-nvfp4-layer.moe.zst")
BUDGET = 64 * 2**20
HOSTILE_TEXT = [
    "[/]",
    "[bold red]x[/bold red]",
    "\x1b[2J\x1b[H",
    "\x1b]0;pwned\x07",
    "\u202eevil",
    "a\nb",
    "",
]
HUGE = [0, 1, 2**31, 2**40, 2**62, 2**63 - 1, 2**64 - 1]
DTYPES = ["qint8", "quint4x2", "float32", "bool", "float4_e2m1fn_x2", "_inductor", "onnx", "complex32", ""]


@cache
def _parsed(name: str) -> bytes:
    return (CAPTURES / name).read_bytes()


def _records(name: str, folder: Path) -> list[Record]:
    path = folder / f"source-{name}"
    if not path.exists():
        path.write_bytes(_parsed(name))
    return parse(path)


values = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(HUGE),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.sampled_from(HOSTILE_TEXT),
    st.binary(max_size=40),
    st.just([]),
    st.just({}),
    st.just(pack_ext(Ext.CODEC, ["some.Type", 1])),
    st.just(pack_ext(Ext.ENUM, ["some.Enum", "A", 1])),
    st.just(pack_ext(Ext.TUPLE, [1, 2])),
    st.just(pack_ext(Ext.DTYPE, "_inductor")),
    st.just(msgpack.ExtType(99, b"\x01")),
)
tensor_changes = st.fixed_dictionaries(
    {},
    optional={
        "dt": st.sampled_from(DTYPES),
        "is": st.sampled_from([0, 1, 2, 4, 64, 65]),
        "sh": st.lists(st.sampled_from([*HUGE, 3, 16]), max_size=4),
        "st": st.lists(st.sampled_from([*HUGE, 3, 16]), max_size=4),
        "of": st.sampled_from(HUGE),
        "sid": st.integers(0, 12),
        "cj": st.booleans(),
    },
)


def _documents(records: list[Record], kinds: tuple[RecordKind, ...]) -> list[Record]:
    return [record for record in records if record.kind in kinds and isinstance(record.document, dict)]


class Mutated(bytes):
    """A mutated file; its repr (in hypothesis' failure report) names the source and the mutations, not the bytes."""

    label = ""

    def __repr__(self) -> str:
        return f"<{len(self)} bytes: {self.label}>"


@st.composite
def mutated(draw: st.DrawFn, folder: Path) -> Mutated:
    source = draw(st.sampled_from(SOURCES))
    records = _records(source, folder)
    actions = [_mutate(draw, records) for _ in range(draw(st.integers(1, 3)))]
    result = Mutated(build(records))
    result.label = f"{source}: {', '.join(actions)}"
    return result


def _mutate(draw: st.DrawFn, records: list[Record]) -> str:
    action = draw(
        st.sampled_from(
            [
                "drop-key",
                "retype",
                "tensor",
                "not-a-tensor",
                "storage",
                "shared-blob",
                "recipe",
                "text",
                "trailer",
                "insert",
                "remove",
                "flip",
            ]
        )
    )
    calls = _documents(records, (RecordKind.CALL, RecordKind.COMPLETION))
    record = draw(st.sampled_from(calls))
    document = record.document
    if action == "drop-key":
        document.pop(draw(st.sampled_from(sorted(document))), None)
    elif action == "retype":
        document[draw(st.sampled_from(sorted(document)))] = draw(values)
    elif action in ("tensor", "not-a-tensor"):
        tree_key = "args" if record.kind is RecordKind.CALL else "outputs"
        tree = document.get(tree_key)
        if isinstance(tree, dict) and tree:
            name = draw(st.sampled_from(sorted(tree, key=str)))
            if action == "tensor":
                changes = draw(tensor_changes)
                tree[name] = map_tensors(tree[name], lambda payload: {**payload, **changes})
            else:
                tree[name] = draw(values)
    elif action == "storage":
        storages = document.get("storages")
        if isinstance(storages, dict) and storages:
            entry = storages[draw(st.sampled_from(sorted(storages)))]
            if isinstance(entry, dict):
                entry[draw(st.sampled_from(["h", "at", "base", "n"]))] = draw(values)
    elif action == "shared-blob":
        storages = document.get("storages")
        if isinstance(storages, dict) and len(storages) > 1:
            first = storages[min(storages)]
            for key in storages:
                storages[key] = dict(first)
    elif action == "recipe":
        field = draw(st.sampled_from(["shape", "params", "dtype", "stride", "generator", "v"]))
        replacement = draw(
            st.one_of(
                values, st.just([10**9]), st.just({"seed": 0, "shape": [10**9]}), st.sampled_from(DTYPES)
            )
        )

        def change(value: Any) -> Any:
            if isinstance(value, msgpack.ExtType) and value.code == Ext.CODEC:
                type_name, tree = unpack_ext(value)
                if isinstance(tree, dict) and "generator" in tree:
                    tree[field] = replacement
                    return pack_ext(Ext.CODEC, [type_name, tree])
            return value

        for key in ("args", "outputs"):
            if key in document:
                document[key] = walk(document[key], change)
    elif action == "text":
        target = draw(st.sampled_from(["op", "site", "header", "ctx", "error"]))
        text = draw(st.sampled_from(HOSTILE_TEXT))
        if target == "header":
            records[0].document[draw(st.sampled_from(["host", "created", "argv", "versions"]))] = text
        elif target == "ctx" and isinstance(document.get("ctx"), dict):
            document["ctx"]["layer_name"] = text
        else:
            document[target] = text
    elif action == "trailer":
        draw(st.sampled_from(records[1:])).trailer = draw(st.binary(min_size=1, max_size=8))
    elif action == "insert":
        position = draw(st.integers(1, len(records) - 1))
        kind = draw(
            st.sampled_from([RecordKind.CALL, RecordKind.COMPLETION, RecordKind.BLOB, RecordKind.HEADER])
        )
        records.insert(
            position, Record(kind, draw(st.integers(0, 4)), None, raw_frame=draw(st.binary(max_size=24)))
        )
    elif action == "remove":
        records.remove(draw(st.sampled_from(records[1:])))
    elif action == "flip":
        victim = draw(st.sampled_from(records[1:-1]))
        raw = bytearray(victim.raw_frame or victim.frame or _compressed(victim))
        if raw:
            position = draw(st.integers(0, len(raw) - 1))
            raw[position] ^= 1 << draw(st.integers(0, 7))
            victim.raw_frame = bytes(raw)
    return action


def _compressed(record: Record) -> bytes:
    import zstandard

    if record.document is None:
        return b""
    return zstandard.ZstdCompressor(write_checksum=True, write_content_size=True).compress(
        msgpack.packb(record.document, use_bin_type=True)
    )


def _clean(error: BaseException, path: Path) -> None:
    assert isinstance(error, MoereplayError), f"{type(error).__name__}: {error}"
    message = str(error)
    assert "\n" not in message, message


def _exercise_reader(path: Path) -> None:
    from moereplay.replay.source import load_call

    try:
        with CaptureReader(path, memory_budget=BUDGET, max_frame_bytes=1 << 22) as reader:
            reader.stats()
            entries = list(reader.entries())
            for record in reader.calls():
                loads = [reader.load_args]
                if record.status != "inputs_saved":
                    loads.append(reader.load_outputs)
                for load in loads:
                    try:
                        load(record.index)
                    except Exception as error:
                        _clean(error, path)
    except Exception as error:
        _clean(error, path)
        return
    for entry in entries[:3]:
        try:
            load_call(path, entry.index)
        except Exception as error:
            _clean(error, path)


def _exercise_cli(path: Path, capsys: pytest.CaptureFixture[str], replay: bool) -> None:
    commands = [["info"], ["ls"], ["ls", "--json"]]
    if replay:
        commands.append(["run", "--all", "--backend", "reference", "--no-follow"])
    for argv in commands:
        try:
            main([*argv, str(path)])
        except SystemExit as exit_:
            code = exit_.code
        else:
            code = 0
        out, err = capsys.readouterr()
        assert code in (0, 1, 2), (argv, code, err)
        for stream in (out, err):
            assert "\x1b" not in stream and "\x07" not in stream and "\u202e" not in stream, (argv, stream)
        if (
            code == 2
        ):  # one error line (for `run`, after its one-line notes: file cut or damaged, calls left out)
            lines = err.strip().splitlines()
            notes = [line for line in lines if line.startswith("moereplay: note: ")]
            assert len(lines) - len(notes) == 1 and len(notes) <= 2 and lines[-1] not in notes, err


@pytest.fixture
def budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEREPLAY_LOAD_BUDGET", str(BUDGET))


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
)
@given(data=st.data())
def test_mutated_bundled_captures(
    data: st.DataObject, tmp_path: Path, capsys: pytest.CaptureFixture[str], budget: None
) -> None:
    started = time.monotonic()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    path = tmp_path / "mutated.zst"
    path.write_bytes(data.draw(mutated(tmp_path)))
    _exercise_reader(path)
    _exercise_cli(path, capsys, replay=data.draw(st.integers(0, 7)) == 0)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) * 1024
    assert grown < 4 * BUDGET, f"peak memory grew by {grown} bytes"
    assert time.monotonic() - started < 30
