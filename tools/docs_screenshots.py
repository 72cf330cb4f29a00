"""Export SVG screenshots of every TUI screen to ``docs/`` (for the README), from the bundled captures.

The app is shown as a user sees it on a machine without a GPU (``--backend reference``), on files in ``captures/``:

- ``marlin-nvfp4-layer`` (vLLM's ``fused_marlin_moe`` and its two Marlin GEMM calls) for the call browser, every call
  replayed;
- ``marlin-nvfp4-report`` (the published report's call: bf16 routing weights a float32-reading kernel took as
  float32) for the call view — variant matrix, arguments with the contract violation, heat map, diff, findings —
  and for a bisect over its calls.

Offline, rows only a kernel can answer say ``needs-kernel``; the screenshots show that as it is. The app runs in a
scratch working directory with no ``MOEREPLAY_STATE_DIR``, so bisect logs show the path a user sees
(``moereplay-captures/bisect/…``) and nothing is written into the repository. The first run expands the captures'
weight recipes, as ``moereplay run`` does the first time (the README's costs table); later runs take about 20 s.

Usage::

    python tools/docs_screenshots.py [--out docs] [--width 100 --height 30]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "tui"))

from tui_helpers import settle  # noqa: E402

from moereplay.tui.app import MoereplayApp  # noqa: E402

CAPTURES = ROOT / "captures"
BROWSER_CAPTURE = CAPTURES / "marlin-nvfp4-layer.moe.zst"
CALL_CAPTURE = CAPTURES / "marlin-nvfp4-report.moe.zst"


async def shoot(
    app: MoereplayApp, size: tuple[int, int], steps: list[tuple[str, Any]], out: Path
) -> list[Path]:
    """Run ``app`` headless; each step is ("press", keys) / ("call", function(app)) / ("shot", name)."""
    written: list[Path] = []
    async with app.run_test(size=size) as pilot:
        await settle(pilot)
        for kind, value in steps:
            if kind == "press":
                await pilot.press(*value)
                await settle(pilot)
            elif kind == "call":
                value(app)
                await settle(pilot)
            else:
                app.clear_notifications()
                await pilot.pause()
                app.save_screenshot(f"{value}.svg", path=str(out))
                written.append(out / f"{value}.svg")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--width", type=int, default=100)
    parser.add_argument("--height", type=int, default=30)
    parser.add_argument(
        "--served",
        type=Path,
        default=None,
        help="instead: the call browser on this capture (e.g. one a served model wrote, brought back from the GPU "
        "machine), every call judged offline, as tui-served-browser.svg",
    )
    options = parser.parse_args()
    out = options.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    size = (options.width, options.height)
    os.environ.pop("MOEREPLAY_STATE_DIR", None)
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)  # state (bisect logs) goes to ./moereplay-captures here, not into the repository
        browse = [("press", ["R"]), ("press", ["home"])]  # replay every shown call, back to the top
        sessions: list[tuple[Path, list[tuple[str, Any]]]] = (
            [(options.served.resolve(), [*browse, ("shot", "tui-served-browser")])]
            if options.served is not None
            else [(BROWSER_CAPTURE, [*browse, ("shot", "tui-browser")])]
        )
        if options.served is None:
            sessions += [
                (
                    CALL_CAPTURE,
                    [
                        ("press", ["enter"]),
                        ("call", lambda app: app.screen.add_mutation("flip mul_topk_weights")),
                        ("call", lambda app: app.screen.add_mutation("cast topk_weights=float32")),
                        ("press", ["r"]),
                        ("shot", "tui-call-variants"),
                        ("press", ["1"]),
                        ("shot", "tui-call-arguments"),
                        ("press", ["4", *["down"] * 3, *["right"] * 6]),
                        ("shot", "tui-heatmap"),
                        ("press", ["enter"]),
                        ("shot", "tui-diff"),
                        ("press", ["5"]),
                        ("shot", "tui-findings"),
                        ("press", ["question_mark"]),
                        ("shot", "tui-help"),
                    ],
                ),
                (
                    CALL_CAPTURE,
                    [
                        ("press", ["b"]),
                        ("shot", "tui-bisect"),
                        ("press", ["tab", "enter"]),  # enter in the call field submits the form
                        ("press", ["p"]),
                        ("shot", "tui-bisect-done"),
                    ],
                ),
            ]
        for capture, steps in sessions:
            written += asyncio.run(
                shoot(MoereplayApp.for_capture(capture, backend="reference"), size, steps, out)
            )
        os.chdir(ROOT)
    for path in written:
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


if __name__ == "__main__":
    main()
