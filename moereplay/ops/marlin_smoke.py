"""The Marlin family's kernel-pack smoke check: one ``moe_wna16_marlin_gemm`` the way vLLM's first MoE GEMM calls
it, against the dequantised weights in fp32 (GPU only; declared as ``FamilySurface.smoke``).

int4 GPTQ weights (``uint4b8``, group 128) for 4 experts made with vLLM's own ``marlin_quantize``, 16 tokens routed
top-2, ``moe_align_block_size`` at block 16, ``mul_topk_weights=False``; output row ``t·2 + j`` must equal
``x[t] @ w_ref[topk_ids[t, j]]``. bf16 outputs of fp32-accumulated GEMMs over K = 256 differ from the reference
by ≲ 1 % of the largest reference value; the check demands < 2 %.

Cost on the H200: the first run on a fresh machine waits ≈ 66 s while the driver JIT-compiles the Marlin MoE
module from its sm_80 PTX (vLLM 0.25.1 ships no sm_90 code for it); later processes reuse the compute cache.
"""

from __future__ import annotations

from typing import Any

import torch

from moereplay.errors import PackError
from moereplay.ops.surface import SmokeCheck

TOLERANCE = 0.02


def smoke(pack: Any, device: torch.device, generator: torch.Generator) -> SmokeCheck:
    """Run the check on ``device`` with the loaded pack ``pack`` (``custom_ops``, ``import_module``)."""
    error, rows = marlin_moe_error(pack, device, generator)
    return SmokeCheck(error < TOLERANCE, f"moe_wna16_marlin_gemm int4 {rows} rows rel err {error:.2e}")


def marlin_moe_error(pack: Any, device: torch.device, generator: torch.Generator) -> tuple[float, int]:
    """(max |kernel − reference| / max |reference|, rows compared)."""
    ops = pack.custom_ops
    if not hasattr(torch.ops._moe_C, "moe_wna16_marlin_gemm"):
        raise PackError(
            "torch.ops._moe_C.moe_wna16_marlin_gemm is not registered after importing vllm._custom_ops"
        )
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
