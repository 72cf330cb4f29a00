"""One Marlin MoE reference call from packed experts, activations and a routing (shared by the GPU tests of the
packed-code reference and of its launch path)."""

from __future__ import annotations

import torch

from moereplay.reference.marlin_formats import PackedExperts
from moereplay.reference.marlin_moe import MarlinReferenceResult, reference_moe_wna16_marlin_gemm
from moereplay.reference.moe_align import moe_align_block_size


def reference_call(packed: PackedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *, top_k: int,
                   block: int, experts: int, mul: bool = True) -> MarlinReferenceResult:  # fmt: skip
    """``reference_moe_wna16_marlin_gemm`` on ``x`` routed to ``ids`` (``[tokens, top_k]``) with routing
    ``weights``, the blocks aligned as vLLM's ``moe_align_block_size`` aligns them."""
    sorted_ids, expert_ids, total = moe_align_block_size(ids.to(torch.int32), block, experts)
    return routed_call(packed, x, sorted_ids, expert_ids, total, weights, top_k=top_k, block=block, mul=mul)


def routed_call(packed: PackedExperts, x: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
                total: torch.Tensor | int, weights: torch.Tensor, *, top_k: int, block: int,
                mul: bool = True) -> MarlinReferenceResult:  # fmt: skip
    """``reference_moe_wna16_marlin_gemm`` on ``x`` with the routing arrays as given."""
    return reference_moe_wna16_marlin_gemm(
        input=x,
        output=None,
        a_scales=None,
        workspace=None,
        sorted_token_ids=sorted_ids,
        expert_ids=expert_ids,
        num_tokens_past_padded=total,
        topk_weights=weights,
        moe_block_size=block,
        top_k=top_k,
        mul_topk_weights=mul,
        size_m=x.shape[0],
        **packed.kernel_kwargs(),
    )


def routing(
    tokens: int, top_k: int, experts: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded softmax top-k routing: float32 weights and int64 expert ids on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=gen), -1), top_k)
    return weights.to(device, torch.float32), ids.to(device)
