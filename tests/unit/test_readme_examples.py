"""The README's console examples print what the commands print.

Every ```` ```console ```` block of README.md is a list of ``$ moereplay …`` commands, each followed by the lines it
prints (abridged). Each command is run here, offline, on the bundled captures it names, from a scratch directory that
holds a link to ``captures/`` (so relative paths read as in the README and nothing is written into the repository);
each shown line must match a line of the real output, in order: ``…`` stands for any text, and runs of spaces and box
characters compare equal (tables are re-flowed to the terminal's width). A README edited by hand, or a command whose
output changed, fails here.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def console_examples() -> list[tuple[str, list[str]]]:
    """``(command, shown lines)`` of every ``$ moereplay`` command in the README's console blocks."""
    examples: list[tuple[str, list[str]]] = []
    for block in re.findall(r"```console\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S):
        for line in block.splitlines():
            if line.startswith("$ "):
                examples.append((line[2:], []))
            elif examples and line.strip():
                examples[-1][1].append(line)
    return examples


def _normal(text: str) -> str:
    return " ".join(re.sub(r"[│┃┏┓┗┛┡┩└┘━─╇┳┻┼╋]", " ", text).split())


def _matches(shown: str, actual: str) -> bool:
    """``actual`` holds ``shown``'s pieces (split at ``…``) in order, compared with whitespace normalised."""
    at = 0
    target = _normal(actual)
    for piece in (_normal(part) for part in shown.split("…")):
        if not piece:
            continue
        found = target.find(piece, at)
        if found < 0:
            return False
        at = found + len(piece)
    return True


EXAMPLES = console_examples()


def test_the_readme_has_console_examples() -> None:
    commands = [command.split()[1] for command, _ in EXAMPLES]
    assert {"info", "ls", "run", "bisect", "repro"} <= set(commands), commands


@pytest.mark.parametrize(("command", "shown"), EXAMPLES, ids=[c for c, _ in EXAMPLES])
def test_console_example_prints_what_the_readme_shows(
    command: str, shown: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = shlex.split(command)
    assert argv[0] == "moereplay", command
    (tmp_path / "captures").symlink_to(ROOT / "captures")
    env = {
        "MOEREPLAY_STATE_DIR": str(tmp_path / "state"),
        "COLUMNS": "160",
        "PYTHONPATH": str(ROOT),
        "PATH": "/usr/bin:/bin",
        "HOME": str(Path.home()),
    }
    done = subprocess.run(
        [sys.executable, "-m", "moereplay", *argv[1:]],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    lines = (done.stdout + done.stderr).splitlines()
    at = 0
    for want in shown:
        while at < len(lines) and not _matches(want, lines[at]):
            at += 1
        assert at < len(lines), (
            f"README shows {want!r} after `{command}`, which printed (rc {done.returncode}):\n"
            + "\n".join(lines)
        )
        at += 1
