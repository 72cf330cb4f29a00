"""A quick proof that a loaded pack's kernels run and compute the right thing (GPU only).

Cost on the H200: ≈ 10 s to import vLLM, plus ≈ 66 s the first time on a fresh machine, when the driver
JIT-compiles the Marlin MoE module from its sm_80 PTX (vLLM 0.25.1 ships no sm_90 code for it); later processes
reuse the driver's compute cache (``~/.nv/ComputeCache``) and finish in ≈ 20 s including start-up.

Three checks, each against plain torch math on the same GPU:

1. ``torch.ops._C.silu_and_mul`` (from ``_C``) on a bf16 [8, 512] input vs ``silu(x[:, :256]) * x[:, 256:]``.
2. ``moe_wna16_marlin_gemm`` (from ``_moe_C``), the way vLLM's first MoE GEMM calls it: int4 GPTQ weights
   (``uint4b8``, group 128) for 4 experts made with vLLM's own ``marlin_quantize``, 16 tokens routed top-2,
   ``moe_align_block_size`` at block 16, ``mul_topk_weights=False``; compared row by row with the dequantised
   weights ``w_ref`` in fp32: output row ``t·2 + j`` must equal ``x[t] @ w_ref[topk_ids[t, j]]``.
3. ``triton_kernels.matmul_ogs`` imports (the vendored Triton MoE GEMM).

Tolerances: bf16 outputs of fp32-accumulated GEMMs over K = 256 differ from the reference by ≲ 1 % of the
largest reference value; the check demands < 2 %.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moereplay.errors import PackError
from moereplay.pack.load import LoadedPack

MARLIN_TOLERANCE = 0.02
SILU_TOLERANCE = 0.02

if TYPE_CHECKING:
    from types import ModuleType

    import torch


@dataclass(frozen=True)
class SmokeResult:
    """Outcome of :func:`smoke_test`: relative errors (max |kernel − reference| / max |reference|)."""

    device: str
    capability: tuple[int, int]
    silu_and_mul_error: float
    marlin_moe_error: float
    marlin_rows: int
    triton_kernels: bool

    @property
    def ok(self) -> bool:
        return (
            self.silu_and_mul_error < SILU_TOLERANCE
            and self.marlin_moe_error < MARLIN_TOLERANCE
            and self.triton_kernels
        )

    def line(self) -> str:
        verdict = "ok" if self.ok else "FAILED"
        return (
            f"{verdict}: {self.device} sm_{self.capability[0]}{self.capability[1]}; "
            f"silu_and_mul rel err {self.silu_and_mul_error:.2e}; "
            f"moe_wna16_marlin_gemm int4 {self.marlin_rows} rows rel err {self.marlin_moe_error:.2e}; "
            f"triton_kernels.matmul_ogs {'imports' if self.triton_kernels else 'MISSING'}"
        )


def smoke_test(pack: LoadedPack, seed: int = 0) -> SmokeResult:
    """Run the three checks on ``cuda:0``; raise PackError if there is no GPU or an op is missing."""
    import torch

    if not torch.cuda.is_available():
        raise PackError("kernels check needs a CUDA GPU")
    ops = pack.custom_ops
    for namespace, op in (("_C", "silu_and_mul"), ("_moe_C", "moe_wna16_marlin_gemm")):
        if not hasattr(getattr(torch.ops, namespace), op):
            raise PackError(f"torch.ops.{namespace}.{op} is not registered after importing vllm._custom_ops")
    device = torch.device("cuda", 0)
    generator = torch.Generator(device=device).manual_seed(seed)
    torch.manual_seed(seed)

    x = torch.randn(8, 512, device=device, dtype=torch.bfloat16, generator=generator)
    out = torch.empty(8, 256, device=device, dtype=torch.bfloat16)
    torch.ops._C.silu_and_mul(out, x)
    wide = x.float()
    expected = torch.nn.functional.silu(wide[:, :256]) * wide[:, 256:]
    silu_error = float((out.float() - expected).abs().max() / expected.abs().max())

    marlin_error, rows = _marlin_moe_error(pack, ops, device, generator)
    triton_ok = pack.import_module("triton_kernels.matmul_ogs") is not None
    torch.cuda.synchronize()
    major, minor = torch.cuda.get_device_capability(device)
    return SmokeResult(
        device=torch.cuda.get_device_name(device),
        capability=(major, minor),
        silu_and_mul_error=silu_error,
        marlin_moe_error=marlin_error,
        marlin_rows=rows,
        triton_kernels=triton_ok,
    )


def _marlin_moe_error(
    pack: LoadedPack, ops: ModuleType, device: torch.device, generator: torch.Generator
) -> tuple[float, int]:
    import torch

    align = pack.import_module("vllm.model_executor.layers.fused_moe.moe_align_block_size")
    marlin_utils = pack.import_module("vllm.model_executor.layers.quantization.utils.marlin_utils")
    marlin_test = pack.import_module("vllm.model_executor.layers.quantization.utils.marlin_utils_test")
    scalar_types = pack.import_module("vllm.scalar_type").scalar_types

    experts, tokens, top_k, size_k, size_n, group, block = 4, 16, 2, 256, 256, 128, 16
    quant_type = scalar_types.uint4b8
    references, weights, scales = [], [], []
    for _ in range(experts):
        dense = torch.randn(size_k, size_n, device=device, dtype=torch.bfloat16, generator=generator) / 16
        w_ref, q_w, scale, _g_idx, _sort, _perm = marlin_test.marlin_quantize(dense, quant_type, group, False)
        references.append(w_ref.float())
        weights.append(q_w)
        scales.append(scale)
    b_qweight = torch.stack(weights).contiguous()
    b_scales = torch.stack(scales).contiguous()
    hidden = torch.randn(tokens, size_k, device=device, dtype=torch.bfloat16, generator=generator)
    logits = torch.randn(tokens, experts, device=device, generator=generator)
    topk_weights, topk_ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    topk_ids = topk_ids.to(torch.int32)
    sorted_ids, expert_ids, padded = align.moe_align_block_size(topk_ids, block, experts)
    output = torch.zeros(tokens * top_k, size_n, device=device, dtype=torch.bfloat16)
    result = ops.moe_wna16_marlin_gemm(
        hidden, output, b_qweight, None, b_scales, None, None, None, None, None,
        marlin_utils.marlin_make_workspace_new(device, 4),
        sorted_ids, expert_ids, padded, topk_weights.float(),
        moe_block_size=block, top_k=top_k, mul_topk_weights=False, b_q_type=quant_type,
        size_m=tokens, size_n=size_n, size_k=size_k, is_k_full=True,
        use_atomic_add=False, use_fp32_reduce=True, is_zp_float=False,
    )  # fmt: skip
    stacked = torch.stack(references)  # [E, K, N]
    expected = torch.einsum("tk,tjkn->tjn", hidden.float(), stacked[topk_ids.long()]).reshape(
        tokens * top_k, size_n
    )
    error = float((result.float() - expected).abs().max() / expected.abs().max())
    return error, tokens * top_k
