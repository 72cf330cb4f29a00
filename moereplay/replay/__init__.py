"""Replay a captured call with mutations on a backend, judge every variant, explain failures.

Public API (imported lazily, so ``import moereplay.replay`` costs nothing)::

    from moereplay.replay import replay
    report = replay("run.moe.zst", call=3, mutations=["flip mul_topk_weights", "cast topk_weights=float32"],
                    fills=["0xff"], backend="pack:/opt/kernelpack", repeat=3)
    report.headline.text                      # "corrupt (recorded)": the worse of recorded and replayed
    report.recorded.verdict, report.baseline.verdict, [r.verdict for r in report.variants], report.findings

    from moereplay.replay import ReplaySession          # one call loaded once, variants judged one at a time
    with ReplaySession("run.moe.zst", call=3, backend="auto") as session:
        session.baseline.verdict
        session.run("flip mul_topk_weights").findings
        session.report()

Modules: ``engine`` (``replay()``), ``session`` (``ReplaySession``: judging variants), ``overreads`` (fill
sensitivity, localising out-of-bounds reads), ``mutations`` (variants, parsing, domains applied), ``memory`` (guard
bands), ``execution`` / ``runner`` / ``worker`` (running kernels, isolated), ``backends``, ``source`` (loading
calls), ``results`` (verdicts and the report), ``findings``, ``localize`` and ``decompose`` (what the findings say),
``sanitize`` (compute-sanitizer).
"""

from __future__ import annotations

import sys
import types
from typing import Any

_EXPORTS = {
    "replay": "moereplay.replay.engine",
    "parse_variants": "moereplay.replay.mutations",
    "ReplaySession": "moereplay.replay.session",
    "VariantOutcome": "moereplay.replay.results",
    "KeptTensors": "moereplay.replay.results",
    "ReplayReport": "moereplay.replay.results",
    "VariantResult": "moereplay.replay.results",
    "Verdict": "moereplay.replay.results",
    "Headline": "moereplay.replay.results",
    "GuardStatus": "moereplay.replay.results",
    "Finding": "moereplay.replay.findings",
    "FindingKind": "moereplay.replay.findings",
    "Variant": "moereplay.replay.mutations",
    "FillPattern": "moereplay.replay.mutations",
    "LoadedCall": "moereplay.replay.source",
    "load_call": "moereplay.replay.source",
    "select_calls": "moereplay.replay.source",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'moereplay.replay' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


class _CallableModule(types.ModuleType):
    """Lets ``moereplay.replay(...)`` call :func:`moereplay.replay.engine.replay` while staying a package."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from moereplay.replay.engine import replay

        return replay(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
