"""``moereplay tui``: bad input is one line and exit 2 before the terminal is touched."""

from __future__ import annotations

from pathlib import Path

import pytest

from moereplay.cli import main


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    code = exit_info.value.code
    return (code if isinstance(code, int) else 1), capsys.readouterr().err


def test_missing_file(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, error = run_main(["tui", "missing.moe.zst"], capsys)
    assert code == 2
    assert error.startswith("moereplay: missing.moe.zst: cannot open")
    assert error.count("\n") == 1


def test_not_a_capture(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    Path("notes.txt").write_text("hello")
    code, error = run_main(["tui", "notes.txt"], capsys)
    assert code == 2 and "not a moereplay capture" in error


def test_bad_backend(marlin_capture: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, error = run_main(["tui", str(marlin_capture), "--backend", "cuda-please"], capsys)
    assert code == 2 and "--backend 'cuda-please'" in error
