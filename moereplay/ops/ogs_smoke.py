"""The matmul_ogs family's kernel-pack smoke check: the pack's vendored ``triton_kernels.matmul_ogs`` imports
(declared as ``FamilySurface.smoke``; no launch — its kernels JIT-compile through Triton)."""

from __future__ import annotations

from typing import Any

from moereplay.ops.surface import SmokeCheck


def smoke(pack: Any, device: Any, generator: Any) -> SmokeCheck:
    """Import the GEMM's module from the loaded pack ``pack`` (``import_module`` checks where it came from)."""
    imported = pack.import_module("triton_kernels.matmul_ogs") is not None
    return SmokeCheck(imported, f"triton_kernels.matmul_ogs {'imports' if imported else 'MISSING'}")
