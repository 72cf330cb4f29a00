"""``moereplay kernels …``: build and inspect kernel packs."""

from __future__ import annotations
