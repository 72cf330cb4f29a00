"""Repro export: one captured call as a directory that reruns it without moereplay installed.

``export_repro(capture, call, directory, mutations=[...])`` writes ``repro.py`` (the script), ``call.moe.zst`` (the
call, trimmed), ``support/moereplay`` (moereplay's own modules the replay needs, unmodified), ``README.md`` and
``MANIFEST.sha256``. Running ``python repro.py [--pack DIR | --backend reference]`` prints the provenance, the
verdict table and the findings of ``moereplay run`` for that call and those variants.

Modules: ``export`` (the exporter), ``bundle`` (the import closure and the copy), ``templates`` (script and README
text), ``runtime`` (what the script runs: replay and a plain-text table; travels inside every bundle, so this package
imports nothing eagerly).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ReproBundle", "export_repro"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(".export", __name__), name)
    raise AttributeError(f"module 'moereplay.repro' has no attribute {name!r}")
