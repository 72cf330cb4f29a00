"""The architecture, counted from the source (AST only, nothing imported; fast).

1. **Families live in ``ops/``.** A kernel family (Marlin, matmul_ogs / triton_kernels, vLLM's Triton fused MoE …)
   declares its whole surface in ``moereplay/ops/`` (:mod:`moereplay.ops.surface`), with its reference in
   ``moereplay/reference/`` and its presets in ``moereplay/synth/``. Code anywhere else names no family: no
   identifier, attribute, import, argument or string constant matching :data:`FAMILY_WORDS`. Docstrings and comments
   are prose and may say which family an example is about; they are not counted.
2. **Layers only look down.** Every ``moereplay`` import — module level, inside functions, under ``TYPE_CHECKING``,
   or ``importlib.import_module("moereplay.…")`` with a constant name — goes from a package to one of a lower rank
   in :data:`LAYERS` (or stays inside its own package). Peers of one rank do not import each other.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "moereplay"

FAMILY_WORDS = re.compile(
    r"marlin|(?<![a-z])ogs(?![a-z])|matmul_ogs|triton_kernel|gpt_oss|gpt-oss|fused_moe|fused_experts|wna16|gptq|awq"
    r"|opt_flags",
    re.IGNORECASE,
)
"""What names a family: its kernels, its library (triton_kernels and its ``opt_flags`` process state), its vLLM
modules and quantisation schemes."""

FAMILY_HOMES = ("ops", "reference", "synth")
"""Packages where families live (their declarations, references, presets)."""

FAMILY_ALLOWED: dict[tuple[str, str], str] = {
    ("tui/screens/browser.py", "marlin"): (
        "the filter line's placeholder shows an example query (``op:marlin*``); it is text for people, pinned by the "
        "SVG snapshots, and dispatches on nothing"
    ),
}
"""(file under moereplay/, matched word lower-cased) → why it is unavoidable."""

FAMILY_PENDING: dict[str, str] = {}
"""Files not migrated yet (issue 18): skipped whole, each with what is left to do. This list only shrinks."""

LAYERS: dict[str, int] = {
    "errors": 0,
    "wording": 0,
    "format": 1,
    "reference": 2,
    "ops": 3,
    "trim": 4,
    "pack": 4,
    "capture": 5,
    "replay": 6,
    "synth": 7,
    "layout": 8,
    "bisect": 9,
    "repro": 10,
    "tui": 11,
    "cli": 12,
    "__main__": 13,
}
"""Rank of each top-level module or package, read from the code as it is: the file format at the bottom; the
references and the ops (families and their torch-free surfaces) on it; kernel packs and capture trimming; the
capture plugin (reads the surfaces); replay (runs ops on backends, re-runs layer calls under a capture session);
synth (draws calls and runs them through replay); the layout probe (replays a layer's calls, builds synth
recipes); bisect, repro; the TUI and the CLI on top. The root package ``moereplay`` (``__version__``) is below
everything."""

ROOT_FACADE = {
    ("moereplay", "replay"): "``moereplay.replay(...)``, the documented API, imported on first use"
}
"""Imports the root package's lazy ``__getattr__`` makes: the public face, not a dependency of the layers."""


def _sources() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(encoding="utf-8"), str(path))


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the string constants that are docstrings (modules, classes, functions, attributes)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for index, statement in enumerate(body):
            if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)):
                continue
            if not isinstance(statement.value.value, str):
                continue
            first = index == 0 and isinstance(
                node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            )
            after_assign = index > 0 and isinstance(body[index - 1], (ast.Assign, ast.AnnAssign))
            if first or after_assign:
                found.add(id(statement.value))
    return found


def _words(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, text) of every name and non-docstring string the module's code holds."""
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        texts: list[str] = []
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            texts.append(node.value)
        elif isinstance(node, ast.Name):
            texts.append(node.id)
        elif isinstance(node, ast.Attribute):
            texts.append(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            texts.append(node.name)
        elif isinstance(node, ast.arg) or (isinstance(node, ast.keyword) and node.arg):
            texts.append(node.arg)
        elif isinstance(node, ast.alias):
            texts.extend(filter(None, (node.name, node.asname)))
        elif isinstance(node, ast.ImportFrom) and node.module:
            texts.append(node.module)
        for text in texts:
            yield getattr(node, "lineno", 0), text


def test_core_code_names_no_kernel_family() -> None:
    leaks: list[str] = []
    used: set[tuple[str, str]] = set()
    for relative, tree in _sources():
        if relative.split("/", 1)[0] in FAMILY_HOMES or relative in FAMILY_PENDING:
            continue
        for line, text in _words(tree):
            for match in FAMILY_WORDS.finditer(text):
                key = (relative, match.group(0).lower())
                if key in FAMILY_ALLOWED:
                    used.add(key)
                    continue
                leaks.append(f"moereplay/{relative}:{line}: {match.group(0)!r} in {text[:80]!r}")
    assert not leaks, "family names outside ops/, reference/, synth/:\n" + "\n".join(leaks)
    assert used == set(FAMILY_ALLOWED), f"stale allow-list entries: {sorted(set(FAMILY_ALLOWED) - used)}"


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "moereplay":
        return None
    return parts[1] if len(parts) > 1 else "moereplay"


def _module_name(relative: str) -> str:
    parts = ["moereplay", *relative.removesuffix(".py").split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(relative: str, tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, imported module) of every import the module makes, wherever it is."""
    here = _module_name(relative).split(".")
    package = here if relative.endswith("__init__.py") else here[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if module == "moereplay":  # ``from moereplay import replay`` names a subpackage
                for alias in node.names:
                    yield node.lineno, f"moereplay.{alias.name}" if alias.name in LAYERS else module
            else:
                yield node.lineno, module
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def _rank(package: str) -> int:
    return -1 if package == "moereplay" else LAYERS[package]


def test_every_top_level_module_has_a_layer() -> None:
    names = {path.stem if path.is_file() else path.name for path in PACKAGE.iterdir()}
    names = {name for name in names if not name.startswith((".", "_")) or name == "__main__"}
    names -= {"py"}  # py.typed
    assert names - set(LAYERS) == set(), "give the new top-level module a rank in LAYERS"


def test_layers_only_import_downwards() -> None:
    back_edges: list[str] = []
    used: set[tuple[str, str]] = set()
    for relative, tree in _sources():
        source = _package_of(_module_name(relative))
        assert source is not None
        for line, module in _imports(relative, tree):
            target = _package_of(module)
            if target is None or target == source:
                continue
            if (source, target) in ROOT_FACADE:
                used.add((source, target))
                continue
            if _rank(target) >= _rank(source):
                back_edges.append(
                    f"moereplay/{relative}:{line}: {source} (rank {_rank(source)}) imports {module}"
                )
    assert not back_edges, "imports that do not go down the layers:\n" + "\n".join(back_edges)
    assert used == set(ROOT_FACADE)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("moe_wna16_marlin_gemm", True),
        ("_ogs", True),
        ("logs", False),
        ("OptFlags", False),
        ("opt_flags", True),
    ],
)
def test_the_family_words_match_what_they_should(text: str, named: bool) -> None:
    assert bool(FAMILY_WORDS.search(text)) is named


def test_family_surfaces_load_before_the_packs_wheels() -> None:
    """The kernel-pack loader reads every family's surface (vendored packages) on a machine where zstandard,
    msgpack and torch may not be importable yet (they come with the pack): importing the surfaces must not reach
    them. (A surface that registered its codec at import pulled in the format package and broke the device
    prelude.)"""
    import subprocess
    import sys

    program = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('zstandard', 'msgpack', 'torch', 'numpy'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from moereplay.ops.surface import families, vendored_packages\n"
        "assert len(families()) >= 3 and vendored_packages()\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=root, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
