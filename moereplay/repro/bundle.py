"""The moereplay code a repro carries: the import closure of what replaying one call needs, copied unmodified.

Starting from root modules (the replay engine, the call's op module, the recipe codec and generators, the kernel-pack
loader, the repro runtime), every ``moereplay`` module they import — at module level or inside functions, plus
module names that appear as string constants (lazy import tables such as ``moereplay.ops._BUILTIN_MODULES``) — is
collected, with the ``__init__.py`` of every package on the way. The CLI and the TUI are never part of it (the
architecture keeps them out of the core; :func:`module_closure` refuses them). The files are copied byte for byte,
each with its sha256, so a reader of the repro can check it against moereplay's published source.
"""

from __future__ import annotations

import ast
import hashlib
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import moereplay
from moereplay.errors import MoereplayError

PACKAGE_ROOT = Path(moereplay.__file__).resolve().parent
_MODULE_NAME = re.compile(r"moereplay(\.[A-Za-z_]\w*)+")
FORBIDDEN = tuple(f"moereplay.{area}" for area in ("cli", "tui"))  # built, so the scan of this file skips it

RUNTIME_ROOTS: tuple[str, ...] = tuple(
    f"moereplay.{name}"
    for name in (
        "replay.engine",
        "replay.worker",
        "synth.recipe",
        "synth.generators",
        "pack.load",
        "repro.runtime",
    )
)
"""What every repro needs besides the call's op module."""


@dataclass(frozen=True)
class BundledFile:
    """One copied source file: path relative to the bundle root (``moereplay/...``), size and sha256."""

    path: str
    size: int
    sha256: str


def module_file(name: str) -> Path | None:
    """The source file of a ``moereplay`` module (package ``__init__.py`` or module ``.py``), or None."""
    parts = name.split(".")
    if parts[0] != "moereplay":
        return None
    base = PACKAGE_ROOT.joinpath(*parts[1:])
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    module = base.with_suffix(".py")
    return module if module.is_file() else None


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("moereplay"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("moereplay"):
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and _MODULE_NAME.fullmatch(node.value)
        ):
            found.add(node.value)
    return found


def module_closure(roots: Iterable[str]) -> dict[str, Path]:
    """Every moereplay module ``roots`` need, by name → source file (packages included)."""
    found: dict[str, Path] = {}
    pending = list(roots)
    while pending:
        name = pending.pop()
        if name in found:
            continue
        path = module_file(name)
        if path is None:
            continue  # an attribute imported from a module, not a module
        if name.startswith(FORBIDDEN):
            raise MoereplayError(
                f"the repro bundle would need {name}: the core must not import the CLI or TUI"
            )
        found[name] = path
        parts = name.split(".")
        pending.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        pending.extend(_imports(path))
    return found


def copy_bundle(roots: Iterable[str], destination: Path) -> list[BundledFile]:
    """Copy the closure of ``roots`` under ``destination`` (``destination/moereplay/...``)."""
    files: list[BundledFile] = []
    for _name, path in sorted(module_closure(roots).items()):
        relative = path.relative_to(PACKAGE_ROOT.parent)
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        data = target.read_bytes()
        files.append(BundledFile(relative.as_posix(), len(data), hashlib.sha256(data).hexdigest()))
    return files
