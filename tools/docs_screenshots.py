"""Export SVG screenshots of every TUI screen to ``docs/`` (for the README), from small real captures.

The captures are the TUI tests' (``tests/tui/tui_captures.py``): real ``moe_wna16_marlin_gemm`` calls whose recorded
outputs were damaged the way a faulty kernel would (a row tripled; for the heat map also NaN columns and a blown-up
value), replayed offline with the ``reference`` backend — so this runs on any machine, in a few seconds.

Usage::

    python tools/docs_screenshots.py [--out docs] [--width 100 --height 30]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "tui"))

from tui_captures import OP, marlin_call, write_marlin_capture  # noqa: E402
from tui_helpers import settle  # noqa: E402

from moereplay.format import CaptureWriter  # noqa: E402
from moereplay.tui.app import MoereplayApp  # noqa: E402


def write_damaged_call(path: Path) -> Path:
    """One Marlin call: row 1 tripled, NaN in row 5 columns 16–23, one value of row 6 blown up 10⁴×."""
    args, output = marlin_call(3)
    output[1] *= 3
    output[5, 16:24] = math.nan
    output[6, 40] = output[6, 40] * 1e4
    with CaptureWriter(path, header={"rank": 0}) as writer:
        index = writer.begin_call(OP, args, site="fused_marlin_moe:docs", context={"layer": 11, "step": 42})
        writer.complete_call(index, {"output": output, "return": output})
    return path


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
    options = parser.parse_args()
    out = options.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    size = (options.width, options.height)
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as folder:
        stream = write_marlin_capture(
            Path(folder) / "serve-rank0.moe.zst", calls=12, bad_from=7, context_call=True
        )
        damaged = write_damaged_call(Path(folder) / "layer11.moe.zst")
        written += asyncio.run(
            shoot(
                MoereplayApp.for_capture(stream, backend="reference"),
                size,
                [
                    ("press", ["R"]),
                    ("press", ["home", "n"]),
                    ("shot", "tui-browser"),
                    ("press", ["end", "b"]),
                    ("press", ["tab", "enter"]),  # enter in the call field submits the form
                    ("press", ["space"]),
                    ("press", ["space"]),
                    ("press", ["e"]),
                    ("shot", "tui-bisect"),
                    ("press", ["p"]),
                    ("shot", "tui-bisect-done"),
                ],
                out,
            )
        )
        written += asyncio.run(
            shoot(
                MoereplayApp.for_capture(damaged, backend="reference"),
                size,
                [
                    ("press", ["enter"]),
                    ("call", lambda app: app.screen.add_mutation("flip mul_topk_weights")),
                    ("call", lambda app: app.screen.add_mutation("sweep moe_block_size=8,64")),
                    ("press", ["r"]),
                    ("shot", "tui-call-variants"),
                    ("press", ["1"]),
                    ("shot", "tui-call-arguments"),
                    ("press", ["4", *["down"] * 5, *["right"] * 18]),
                    ("shot", "tui-heatmap"),
                    ("press", ["enter"]),
                    ("shot", "tui-diff"),
                    ("press", ["5"]),
                    ("shot", "tui-findings"),
                    ("press", ["question_mark"]),
                    ("shot", "tui-help"),
                ],
                out,
            )
        )
        os.chdir(ROOT)
    for path in written:
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


if __name__ == "__main__":
    main()
