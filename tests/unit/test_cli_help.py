"""The rendered ``--help`` of every command: flags stand alone (no ``<bool>`` after ``--json`` or ``--help``)."""

from __future__ import annotations

from typing import Any

import typer
from typer.testing import CliRunner

from moereplay.cli import app


def _command_paths() -> list[list[str]]:
    root = typer.main.get_command(app)
    paths: list[list[str]] = [[]]

    def walk(command: Any, path: list[str]) -> None:
        for name, child in getattr(command, "commands", {}).items():
            paths.append([*path, name])
            walk(child, [*path, name])

    walk(root, [])
    return paths


def test_every_help_shows_flags_without_a_bool_type() -> None:
    runner = CliRunner()
    paths = _command_paths()
    assert ["run"] in paths and ["bisect"] in paths
    for path in paths:
        result = runner.invoke(app, [*path, "--help"], terminal_width=100)
        assert result.exit_code == 0, (path, result.output)
        assert "<bool>" not in result.output, (path, result.output)
        assert "--help" in result.output
    shown = runner.invoke(app, ["run", "--help"], terminal_width=100).output
    assert (
        "--call" in shown and "<list[int]>" in shown
    )  # options that take a value still say what (repeatable)


def test_every_command_is_in_the_readmes_commands_table() -> None:
    """Each command and subcommand appears as ``moereplay …`` in a row of the README's Commands table."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("## Commands", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `moereplay ")]
    missing = []
    for path in _command_paths():
        if not path:
            continue
        spelled = "moereplay " + " ".join(path)
        if not any(spelled in row or (len(path) > 1 and f"/ `{' '.join(path)} " in row) for row in rows):
            missing.append(spelled)
    assert not missing, f"not in the README's Commands table: {missing}"


def test_every_option_is_in_its_commands_row_of_the_readme() -> None:
    """Each visible option of each command (its long name, or a short or negative alias) appears in the README's
    Commands row that names the command."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("## Commands", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `moereplay ")]
    root = typer.main.get_command(app)
    missing = []
    for path in _command_paths():
        command: Any = root
        for name in path:
            command = command.commands[name]
        if not path or getattr(command, "commands", None):
            continue
        spelled = " ".join(path)
        mine = [row for row in rows if f"moereplay {spelled} " in row or f"/ `{spelled} " in row]
        for param in command.params:
            if param.param_type_name != "option" or param.hidden or "--help" in param.opts:
                continue
            names = [*param.opts, *param.secondary_opts]
            if not any(re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", row) for row in mine for n in names):
                missing.append(f"{spelled} {names[0]}")
    assert not missing, f"options not in their command's row of the README's Commands table: {missing}"


def test_bracketed_words_in_help_survive_the_markup() -> None:
    """Rich reads ``[ray]`` as markup and drops it: the help must say which extra to install."""
    shown = CliRunner().invoke(app, ["run", "--help"], terminal_width=250).output
    assert "moereplay[ray]" in shown, shown
