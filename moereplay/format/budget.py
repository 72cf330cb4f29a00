"""How many bytes loading one call may allocate: the reader's memory budget.

A capture file is small on disk and can still describe huge tensors — a blob of zeros compresses about 32,000:1, so
a 400 KB file can hold a valid, correctly hashed 4 GB storage. Before a reader allocates anything for a call it adds
up what the call needs (each distinct blob once, each codec value's own estimate, e.g. a recipe's expanded tensor)
and refuses with :class:`~moereplay.errors.MemoryBudgetError` when that exceeds the budget.

The budget is ``MOEREPLAY_LOAD_BUDGET`` (a size: ``512M``, ``8G``, ``4096``) when set, else three quarters of the
memory the system reports available when the reader is opened (``MemAvailable`` on Linux).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from moereplay.errors import SettingsError

BUDGET_VARIABLE = "MOEREPLAY_LOAD_BUDGET"
FALLBACK_BUDGET = 8 * 2**30
"""Used when the system does not say how much memory is available."""


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?", re.IGNORECASE)
_FACTORS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_budget(text: str) -> int:
    """``"512M"``, ``"8G"``, ``"1.5GiB"``, ``"4096"`` → bytes (binary units); at least one byte.

    (The format package reads no capture settings, so it parses this one size itself.)"""
    match = _SIZE.fullmatch(text.strip())
    value = int(float(match.group(1)) * _FACTORS[match.group(2).lower()]) if match else 0
    if value < 1:
        raise SettingsError(f"{BUDGET_VARIABLE}={text!r}: not a size of at least one byte (e.g. 512M, 8G)")
    return value


def available_memory() -> int | None:
    """Bytes of memory the system can hand out now without swapping, or ``None`` when it does not say."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def default_memory_budget(environ: Mapping[str, str] | None = None) -> int:
    """The budget from the environment (raises :class:`~moereplay.errors.SettingsError` when malformed), else ¾ of
    the available memory."""
    text = (os.environ if environ is None else environ).get(BUDGET_VARIABLE, "").strip()
    if text:
        return parse_budget(text)
    available = available_memory()
    return FALLBACK_BUDGET if available is None else max(available * 3 // 4, 1)
