"""Browsing a capture in the TUI does not import torch (issue 5: ~200 MB of the browser's ~240 MB was torch).

The app is started headless in a fresh interpreter (so other tests' imports cannot hide one), the call table draws
its first screenful, a row is highlighted and the filter runs over every call; then the child reports whether torch
was imported and, if it was, which of moereplay's files imported it first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from moereplay.format import CaptureWriter

CHILD = """
import asyncio, importlib.abc, json, sys, traceback

first_importer = []


class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not first_importer:
            first_importer.extend(
                f"{frame.filename}:{frame.lineno}" for frame in traceback.extract_stack()
                if "/moereplay/" in frame.filename
            )
        return None


sys.meta_path.insert(0, Watch())

from moereplay.tui.app import MoereplayApp
from moereplay.tui.widgets.browser.call_table import CallTable


async def browse(path):
    app = MoereplayApp.for_capture(path, backend="reference")
    async with app.run_test(size=(100, 30)) as pilot:
        table = app.screen.query_one(CallTable)
        for _ in range(2000):
            if app.catalog.decoded >= 10:
                break
            await pilot.pause(0.005)
        await pilot.press("down", "down")
        await pilot.press("slash", *"layer:1", "enter")
        for _ in range(2000):
            if len(table.rows) != len(app.catalog):
                break
            await pilot.pause(0.005)
        return {"decoded": app.catalog.decoded, "shown": len(table.rows), "screen": type(app.screen).__name__}


found = asyncio.run(browse(sys.argv[1]))
found["torch"] = "torch" in sys.modules
found["first_importer"] = first_importer
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tui-lazy") / "calls.moe.zst"
    weight = torch.zeros(4, 8, dtype=torch.int32)
    ops = ("moe_wna16_marlin_gemm", "fused_marlin_moe", "matmul_ogs")
    with CaptureWriter(path, header={"rank": 0}) as writer:
        for number in range(60):
            index = writer.begin_call(
                ops[number % 3],
                {
                    "input": torch.full((2, 8), float(number), dtype=torch.bfloat16),
                    "b_qweight": weight,
                    "top_k": 2,
                },
                site=f"test:{number % 4}",
                context={"layer": number % 6, "step": number // 6},
                static={"b_qweight"},
            )
            writer.complete_call(index, {"output": torch.zeros(4, 8, dtype=torch.bfloat16)})
    return path


def _browse(path: Path) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_browsing_a_capture_imports_no_torch(capture: Path) -> None:
    found = _browse(capture)
    assert found["screen"] == "BrowserScreen"
    assert found["decoded"] == 60  # the filter walked every row
    assert found["shown"] == 10  # layer 1 of 0..5
    assert found["torch"] is False, f"torch imported via {found['first_importer']}"


def test_tui_command_starts_without_torch(capture: Path) -> None:
    """``moereplay tui FILE`` (backend auto) parses and checks its arguments without torch; the app itself is
    replaced by a stand-in that records what it was given."""
    script = (
        "import json, sys\n"
        "import moereplay.tui\n"
        "given = []\n"
        "moereplay.tui.run_tui = lambda path, *, backend: given.append([str(path), backend])\n"
        "from moereplay.cli import main\n"
        "code = 0\n"
        "try:\n"
        f"    main(['tui', {str(capture)!r}])\n"
        "except SystemExit as exit:\n"
        "    code = exit.code or 0\n"
        "print(json.dumps({'code': code, 'given': given, 'torch': 'torch' in sys.modules}))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found == {"code": 0, "given": [[str(capture), "auto"]], "torch": False}
