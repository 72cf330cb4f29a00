"""synth, trim, repro and layout are core code: importing them pulls in no UI or CLI library."""

from __future__ import annotations

import json
import subprocess
import sys

MODULES = (
    "moereplay.synth",
    "moereplay.synth.build",
    "moereplay.synth.marlin_presets",
    "moereplay.synth.ogs_presets",
    "moereplay.trim",
    "moereplay.repro",
    "moereplay.repro.export",
    "moereplay.repro.runtime",
    "moereplay.layout",
)
FORBIDDEN = ("textual", "rich", "typer", "click")


def test_share_modules_import_no_ui_library() -> None:
    script = (
        "import importlib, json, sys\n"
        f"for name in {MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_the_cli_module_imports_no_torch() -> None:
    script = "import sys, moereplay.cli.share_cmds\nprint('torch' in sys.modules)\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
