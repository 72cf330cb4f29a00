"""Counts in messages agree with their number: "1 call", never "1 calls" (``moereplay.wording`` and its users)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moereplay.cli import main
from moereplay.errors import CaptureFileError, ReplayError
from moereplay.format import CaptureReader, CaptureWriter
from moereplay.layout.calls import find_layer
from moereplay.wording import index_range, plural


def test_plural_and_index_range() -> None:
    assert [plural(n, "call") for n in (0, 1, 2)] == ["0 calls", "1 call", "2 calls"]
    assert plural(1, "entry", "entries") == "1 entry" and plural(3, "entry", "entries") == "3 entries"
    assert [index_range(n, "call") for n in (0, 1, 3)] == ["no calls", "call 0", "calls 0-2"]


@pytest.fixture
def one_call(tmp_path: Path) -> Path:
    path = tmp_path / "one.moe.zst"
    with CaptureWriter(path) as writer:
        index = writer.begin_call("some_op", {"x": torch.zeros(2)}, site="tests.wording")
        writer.complete_call(index, {"out": torch.ones(2)})
    return path


def test_a_one_call_file_holds_1_call(one_call: Path) -> None:
    with CaptureReader(one_call) as reader:
        with pytest.raises(CaptureFileError, match=r"\(the file holds 1 call\)$"):
            reader.load_args(3)
        with pytest.raises(ReplayError, match=r"\(the file holds 1 call\)$"):
            find_layer(reader, 3)


@pytest.mark.parametrize(
    ("command", "said"),
    [
        (["repro", "--call", "3", "-o", "{tmp}/repro"], "(the file holds 1 call)"),
        (["trim", "--calls", "3", "-o", "{tmp}/trimmed.moe.zst"], "(the file holds call 0)"),
    ],
)
def test_the_cli_says_1_call(
    one_call: Path, command: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [command[0], str(one_call), *(part.format(tmp=one_call.parent) for part in command[1:])]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and error.endswith(said), error
