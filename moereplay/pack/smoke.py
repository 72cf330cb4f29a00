"""A quick proof that a loaded pack's kernels run and compute the right thing (GPU only).

Cost on the H200: ≈ 10 s to import vLLM, plus ≈ 66 s the first time on a fresh machine, when the driver
JIT-compiles the Marlin MoE module from its sm_80 PTX (vLLM 0.25.1 ships no sm_90 code for it); later processes
reuse the driver's compute cache (``~/.nv/ComputeCache``) and finish in ≈ 20 s including start-up.

The checks, each against plain torch math on the same GPU:

1. ``torch.ops._C.silu_and_mul`` (from ``_C``) on a bf16 [8, 512] input vs ``silu(x[:, :256]) * x[:, 256:]``
   (< 2 % of the largest reference value);
2. each kernel family's own check, declared as ``FamilySurface.smoke`` (:mod:`moereplay.ops.surface`), in family
   order: the Marlin family runs an int4 ``moe_wna16_marlin_gemm`` as vLLM's first MoE GEMM calls it
   (:mod:`moereplay.ops.marlin_smoke`), the matmul_ogs family imports the vendored ``triton_kernels.matmul_ogs``
   (:mod:`moereplay.ops.ogs_smoke`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from moereplay.errors import PackError
from moereplay.ops.surface import SmokeCheck, smoke_checks
from moereplay.pack.load import LoadedPack

SILU_TOLERANCE = 0.02


@dataclass(frozen=True)
class SmokeResult:
    """Outcome of :func:`smoke_test`: ``silu_and_mul``'s relative error (max |kernel − reference| /
    max |reference|) and each family's :class:`SmokeCheck`, in family order."""

    device: str
    capability: tuple[int, int]
    silu_and_mul_error: float
    checks: tuple[SmokeCheck, ...] = ()

    @property
    def ok(self) -> bool:
        return self.silu_and_mul_error < SILU_TOLERANCE and all(check.passed for check in self.checks)

    def line(self) -> str:
        verdict = "ok" if self.ok else "FAILED"
        parts = [
            f"{verdict}: {self.device} sm_{self.capability[0]}{self.capability[1]}",
            f"silu_and_mul rel err {self.silu_and_mul_error:.2e}",
            *(check.text for check in self.checks),
        ]
        return "; ".join(parts)


def smoke_test(pack: LoadedPack, seed: int = 0) -> SmokeResult:
    """Run the checks on ``cuda:0``; raise PackError if there is no GPU or an op is missing."""
    import torch

    if not torch.cuda.is_available():
        raise PackError("kernels check needs a CUDA GPU")
    pack.custom_ops  # noqa: B018 - loads both CUDA libraries and registers torch.ops._C / _moe_C
    if not hasattr(torch.ops._C, "silu_and_mul"):
        raise PackError("torch.ops._C.silu_and_mul is not registered after importing vllm._custom_ops")
    device = torch.device("cuda", 0)
    generator = torch.Generator(device=device).manual_seed(seed)
    torch.manual_seed(seed)

    x = torch.randn(8, 512, device=device, dtype=torch.bfloat16, generator=generator)
    out = torch.empty(8, 256, device=device, dtype=torch.bfloat16)
    torch.ops._C.silu_and_mul(out, x)
    wide = x.float()
    expected = torch.nn.functional.silu(wide[:, :256]) * wide[:, 256:]
    silu_error = float((out.float() - expected).abs().max() / expected.abs().max())

    checks = []
    for _family, declared in smoke_checks():
        module, _, function = declared.partition(":")
        checks.append(getattr(importlib.import_module(module), function)(pack, device, generator))
    torch.cuda.synchronize()
    major, minor = torch.cuda.get_device_capability(device)
    return SmokeResult(
        device=torch.cuda.get_device_name(device),
        capability=(major, minor),
        silu_and_mul_error=silu_error,
        checks=tuple(checks),
    )
