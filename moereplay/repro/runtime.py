"""What a repro script runs: replay its one call and print the verdict table and findings as plain text.

This module travels inside every repro bundle, so it needs nothing beyond the replay engine: no rich, no typer. The
table has the columns of ``moereplay run`` (variant, verdict, bad/rows, max rel, rms rel, max abs, NaN, Inf,
bit-exact, guard, time; the recorded output's row first), the call's verdict (the worse of recorded and replayed),
then the reasons for ``invalid``/``crash``/``needs-kernel`` verdicts, the findings (with the mutations they
suggest) and the engine's notes.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moereplay.replay.results import ReplayReport

COLUMNS = (
    "variant",
    "verdict",
    "bad/rows",
    "max rel",
    "rms rel",
    "max abs",
    "NaN",
    "Inf",
    "bit-exact",
    "guard",
    "time",
)
_RIGHT = frozenset({"bad/rows", "max rel", "rms rel", "max abs", "NaN", "Inf", "time"})


def _number(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return f"{value:.2e}"


def table_rows(report: ReplayReport) -> list[tuple[str, ...]]:
    """One tuple of cell texts per variant, in :data:`COLUMNS` order."""
    rows: list[tuple[str, ...]] = []
    for result in report.results:
        rows.append(
            (
                result.label,
                result.verdict.value,
                f"{result.bad_rows}/{result.rows}" if result.rows else "-",
                _number(result.max_rel),
                _number(result.rms_rel),
                _number(result.max_abs),
                str(result.nan),
                str(result.inf),
                "-" if result.bit_exact is None else ("yes" if result.bit_exact else "no"),
                result.guard.value,
                "-" if result.elapsed_s is None else f"{result.elapsed_s * 1e3:.2f} ms",
            )
        )
    return rows


def render_text(report: ReplayReport) -> str:
    """The verdict table, reasons, notes and findings of one report, as plain text."""
    rows = table_rows(report)
    widths = [max(len(column), *(len(row[i]) for row in rows)) for i, column in enumerate(COLUMNS)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.rjust(width) if column in _RIGHT else cell.ljust(width)
            for cell, width, column in zip(cells, widths, COLUMNS, strict=True)
        ).rstrip()

    title = f"call #{report.call} · {report.op}" + (f" · {report.site}" if report.site else "")
    out = [title, line(COLUMNS), line(["-" * width for width in widths])]
    out.extend(line(row) for row in rows)
    out.append(f"backend {report.backend} on {report.device}")
    out.append(f"  verdict {report.headline.text}")
    for result in report.results:
        if result.reason:
            out.append(f"  {result.label}: {result.verdict.value} — {result.reason}")
    out.extend(f"  note: {note}" for note in report.notes)  # as `moereplay run`: context before the findings
    if report.findings:
        out.append("findings")
    for finding in report.findings:
        where = f" ({finding.variant})" if finding.variant != "baseline" else ""
        confidence = f"  (confidence {finding.confidence:.2f})" if finding.confidence < 1.0 else ""
        out.append(f"  [{finding.kind.value}]{where} {finding.message}{confidence}")
        out.extend(f"      try: --{suggestion}" for suggestion in finding.suggestions)
    return "\n".join(out)


def provenance_lines(provenance: Mapping[str, Any]) -> list[str]:
    """The provenance block the script prints first (what recorded the call, and what exported it)."""
    capture = provenance.get("capture", {})
    versions = capture.get("versions") or {}
    gpu = capture.get("gpu") or {}
    lines = [
        f"moereplay repro of call {provenance.get('call')} ({provenance.get('op')}) of {provenance.get('source')}",
        f"  exported by moereplay {provenance.get('moereplay')}: {provenance.get('command')}",
        "  captured with vLLM {vllm}, torch {torch}, triton {triton}, CUDA {cuda}, driver {driver}".format(
            **{key: versions.get(key) or "-" for key in ("vllm", "torch", "triton", "cuda", "driver")}
        ),
        f"  on {gpu.get('name') or 'no GPU recorded'}"
        + (f" (sm {gpu['compute_capability']})" if gpu.get("compute_capability") else "")
        + (f", {capture['created']}" if capture.get("created") else ""),
    ]
    synth = capture.get("synth")
    if isinstance(synth, Mapping):
        lines.append(
            f"  synthesized: preset {synth.get('preset')}, outputs from {synth.get('output_source')}"
        )
    return lines


def _holds_recipes(capture: Path) -> bool:
    from moereplay.format import CaptureReader
    from moereplay.format.schema import CodecValue
    from moereplay.synth.recipe import RECIPE_TYPE

    def walk(value: Any) -> bool:
        if isinstance(value, CodecValue):
            return value.type_name == RECIPE_TYPE or walk(value.value)
        if isinstance(value, dict):
            return any(walk(item) for item in value.values())
        if isinstance(value, (list, tuple)):
            return any(walk(item) for item in value)
        return False

    with CaptureReader(capture) as reader:
        return any(walk(record.args) for record in reader.calls())


def run_repro(
    capture: Path,
    *,
    backend: str,
    mutations: Sequence[str],
    fills: Sequence[str],
    provenance: Mapping[str, Any],
    device: str | None = None,
    follow_suggestions: bool = False,
    follow_evidence: bool = True,
    as_json: bool = False,
    support: Path | None = None,
) -> int:
    """Replay call 0 of ``capture``; print provenance, table and findings (or JSON). Returns the exit status:
    0 when every variant is ``ok``, 1 otherwise. ``follow_evidence``: run the variants the call's contracts and a
    replay that is not bit-exact with the recording call for (the guard fills, the fidelity check's variants);
    ``False`` replays the call as captured and nothing else."""
    import moereplay
    from moereplay.replay.engine import replay
    from moereplay.synth.recipe import register

    register()
    if support is not None:
        # a worker process (kernel isolation) must import this very code
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(support), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        )
    recipes = _holds_recipes(capture)
    report = replay(
        capture,
        call=0,
        mutations=list(mutations),
        fills=list(fills),
        backend=backend,
        device=device,
        follow_suggestions=follow_suggestions,
        follow_evidence=follow_evidence,
        explain_fidelity=follow_evidence,
        isolate=False if recipes else None,  # recipes expand where their codec is registered: this process
    )
    if as_json:
        document = {"provenance": dict(provenance), "report": report.to_json()}
        sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")
    else:
        for text in provenance_lines(provenance):
            print(text)
        print(f"  replayed by moereplay {moereplay.__version__} from {Path(moereplay.__file__).parent}")
        print()
        print(render_text(report))
    return 1 if report.failed else 0
