"""The kernels check's line is assembled from the families' declared smoke checks (CPU: no check is run here)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

from moereplay.ops.surface import SmokeCheck, smoke_checks
from moereplay.pack.smoke import SmokeResult


def test_each_declared_smoke_check_is_a_function_of_its_family() -> None:
    declared = dict(smoke_checks())
    assert list(declared) == ["marlin", "ogs"]
    for target in declared.values():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function))


def test_the_line_keeps_its_shape() -> None:
    checks = (
        SmokeCheck(True, "moe_wna16_marlin_gemm int4 32 rows rel err 3.10e-03"),
        SmokeCheck(True, "triton_kernels.matmul_ogs imports"),
    )
    result = SmokeResult("NVIDIA H200", (9, 0), 1.5e-3, checks)
    assert result.ok
    assert result.line() == (
        "ok: NVIDIA H200 sm_90; silu_and_mul rel err 1.50e-03; moe_wna16_marlin_gemm int4 32 rows rel err "
        "3.10e-03; triton_kernels.matmul_ogs imports"
    )
    failed = SmokeResult("NVIDIA H200", (9, 0), 1.5e-3, (*checks[:1], SmokeCheck(False, "x MISSING")))
    assert not failed.ok and failed.line().startswith("FAILED: ")


def test_the_import_check_asks_the_pack() -> None:
    from moereplay.ops.ogs_smoke import smoke

    asked: list[str] = []
    pack = SimpleNamespace(import_module=lambda name: asked.append(name) or object())
    assert smoke(pack, None, None) == SmokeCheck(True, "triton_kernels.matmul_ogs imports")
    assert asked == ["triton_kernels.matmul_ogs"]
