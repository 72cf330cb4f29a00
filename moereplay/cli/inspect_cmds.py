"""``moereplay info`` and ``moereplay ls``: look inside a capture file."""

from __future__ import annotations
