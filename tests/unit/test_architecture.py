"""The folders are the architecture: core packages never pull in the UI or CLI libraries.

Checked in a fresh interpreter per package so that one test's imports cannot hide another's.
"""

from __future__ import annotations

import importlib.util
import json
import pkgutil
import subprocess
import sys

import pytest

import moereplay

CORE_PACKAGES = (
    "format",
    "capture",
    "reference",
    "ops",
    "replay",
    "pack",
    "bisect",
    "synth",
    "repro",
    "layout",
)
FORBIDDEN = ("textual", "rich", "typer", "click")
NEEDS_TRITON = frozenset(
    {
        "moereplay.capture.ring_kernel",
        "moereplay.capture.graph_ring_kernel",
        "moereplay.reference.dequant_kernel",
        "moereplay.reference.marlin_rows_kernel",
    }
)
"""Modules that are Triton kernels themselves (imported only where Triton is, by their users)."""


def _modules_under(package: str) -> list[str]:
    try:
        module = __import__(f"moereplay.{package}", fromlist=["__path__"])
    except ImportError:
        return []
    names = [f"moereplay.{package}"]
    triton = importlib.util.find_spec("triton") is not None
    for info in pkgutil.walk_packages(module.__path__, prefix=f"moereplay.{package}."):
        if info.name in NEEDS_TRITON and not triton:
            continue
        names.append(info.name)
    return names


@pytest.mark.parametrize("package", CORE_PACKAGES)
def test_core_package_imports_no_ui_library(package: str) -> None:
    modules = _modules_under(package)
    if not modules:
        pytest.skip(f"moereplay.{package} does not exist yet")
    script = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    leaked = json.loads(result.stdout.strip().splitlines()[-1])
    assert leaked == [], f"moereplay.{package} imports UI/CLI libraries: {leaked}"


def test_plugin_module_import_has_no_side_effects() -> None:
    """vLLM imports the plugin in every process: importing it must not import torch or patch anything."""
    script = "import sys\nimport moereplay.capture.plugin\nprint('torch' in sys.modules)\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    if "No module named 'moereplay.capture.plugin'" in result.stderr:
        pytest.skip("capture plugin not written yet")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_version_is_exposed() -> None:
    assert moereplay.__version__


def test_replay_api_is_callable_from_the_package() -> None:
    """``moereplay.replay(...)`` is the documented API even though ``moereplay.replay`` is a subpackage."""
    import moereplay.replay.engine

    assert callable(moereplay.replay)
    assert moereplay.replay.replay is moereplay.replay.engine.replay
