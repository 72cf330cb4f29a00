"""The call browser on a synthetic 10,000-call capture: time to first paint and memory, from one run.

Writes the capture with ``CaptureWriter`` in a child process (writing needs torch; browsing must not: small tensors,
a [4, 16] bf16 input per call and one shared int32 weight, three op names, 24 layers per step), then, in this
process, starts the app headless at 80×24 the way ``moereplay tui`` does and measures:

- ``import_s`` / ``rss_after_import_mib``: importing Textual and the app (paid before any file is opened);
- ``first_paint_s``: from opening the capture (index read, no call decoded) until the browser's table has drawn its
  first screenful of rows — issue 5 asks for under 1 s;
- ``rss_first_paint_mib`` and, after a filter that decodes every row (``filter_all_s``) and a jump to the last call,
  ``rss_all_rows_mib``; ``rss_peak_mib`` is the process's peak — issue 5 asks for at most ~200 MB;
- ``torch_imported``: 1 when something on the browse path imported torch (``import torch`` alone is ~200 MB
  resident on CPU builds, so the memory target holds only without it).

Usage::

    python tools/bench/tui_bench.py [--calls 10000] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START = time.perf_counter()


def rss_mib() -> float:
    """Resident set size now (Linux ``/proc/self/statm``), MiB."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


RSS_TARGET_MB = 200.0
"""Issue 5's memory target for the whole browsing process, in MB (10⁶ bytes; the ``*_mib`` figures are 2²⁰)."""
FIRST_PAINT_TARGET_S = 1.0


def write_capture(path: Path, calls: int) -> None:
    """Runs in the child (``--write PATH``)."""
    import torch

    from moereplay.format import CaptureWriter

    weight = torch.zeros(4, 8, 4, dtype=torch.int32)
    ops = ("moe_wna16_marlin_gemm", "matmul_ogs", "fused_marlin_moe")
    with CaptureWriter(path, header={"rank": 0}) as writer:
        for number in range(calls):
            hidden = torch.full((4, 16), float(number % 7), dtype=torch.bfloat16)
            index = writer.begin_call(
                ops[number % 3],
                {"input": hidden, "b_qweight": weight, "top_k": 2, "mul_topk_weights": True},
                site=f"bench:{number % 5}",
                context={"layer": number % 24, "step": number // 24},
                static={"b_qweight"},
            )
            writer.complete_call(index, {"output": torch.zeros(8, 16, dtype=torch.bfloat16)})


async def measure(path: Path, calls: int) -> dict[str, float]:
    from moereplay.tui.app import MoereplayApp
    from moereplay.tui.widgets.browser.call_table import CallTable

    results: dict[str, float] = {}
    opened = time.perf_counter()
    app = MoereplayApp.for_capture(path, backend="reference")
    catalog = app.catalog
    assert catalog is not None
    results["open_index_s"] = time.perf_counter() - opened
    async with app.run_test(size=(80, 24)) as pilot:
        table = app.screen.query_one(CallTable)
        visible = table.scrollable_content_region.height - 1
        while catalog.decoded < min(visible, calls):  # rows are decoded only when the table draws them
            await asyncio.sleep(0.0005)
        results["first_paint_s"] = time.perf_counter() - opened
        results["rows_decoded_at_first_paint"] = catalog.decoded
        results["rss_first_paint_mib"] = rss_mib()
        results["torch_imported_at_first_paint"] = float("torch" in sys.modules)
        started = time.perf_counter()
        await pilot.press("slash", *"layer:3", "enter")
        while list(table.rows) == list(catalog.indices):
            await pilot.pause(0.001)
        results["filter_all_s"] = time.perf_counter() - started
        results["filter_matches"] = len(table.rows)
        await pilot.press("escape", "end")
        await pilot.pause()
        results["rows_decoded"] = catalog.decoded
        results["rss_all_rows_mib"] = rss_mib()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--write", type=Path, help=argparse.SUPPRESS)  # the child: write the capture, exit
    options = parser.parse_args()
    if options.write is not None:
        write_capture(options.write, options.calls)
        return

    import textual.app  # noqa: F401

    import moereplay.tui.app  # noqa: F401

    results: dict[str, float] = {"calls": options.calls}
    results["import_s"] = time.perf_counter() - START
    results["rss_after_import_mib"] = rss_mib()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "bench.moe.zst"
        written = time.perf_counter()
        command = [sys.executable, __file__, "--calls", str(options.calls), "--write", str(path)]
        subprocess.run(command, check=True)
        results["write_capture_s"] = time.perf_counter() - written
        results["file_mib"] = path.stat().st_size / 2**20
        results.update(asyncio.run(measure(path, options.calls)))
    results["rss_peak_mib"] = peak_mib()
    results["torch_imported"] = float("torch" in sys.modules)
    if options.json:
        print(json.dumps({key: round(value, 4) for key, value in results.items()}, indent=2))
        return
    counts: tuple[str, ...] = ("calls", "rows_decoded", "rows_decoded_at_first_paint", "filter_matches")
    counts += ("torch_imported", "torch_imported_at_first_paint")
    width = max(len(key) for key in results)
    for key, value in results.items():
        shown = f"{value:,.0f}" if key in counts else f"{value:.3f}"
        print(f"{key.ljust(width)}  {shown}")
    paint = "ok" if results["first_paint_s"] < FIRST_PAINT_TARGET_S else "SLOW"
    print(
        f"first paint {results['first_paint_s']:.3f} s for {options.calls:,} calls: {paint} "
        f"(target < {FIRST_PAINT_TARGET_S:g} s)"
    )
    peak_mb = results["rss_peak_mib"] * 2**20 / 1e6
    memory = "ok" if peak_mb <= RSS_TARGET_MB else "OVER"
    torch_note = "; torch was imported while browsing" if results["torch_imported"] else ""
    print(
        f"peak RSS {results['rss_peak_mib']:.1f} MiB = {peak_mb:.1f} MB: {memory} "
        f"(target <= {RSS_TARGET_MB:g} MB{torch_note})"
    )


if __name__ == "__main__":
    main()
