"""Small capture files for the TUI tests, the screenshots and the benchmark, written with CaptureWriter.

``write_marlin_capture``: real ``moe_wna16_marlin_gemm`` calls (GPTQ int4 experts packed the way vLLM packs them,
``moe_align_block_size`` routing) whose recorded outputs are the fp32 reference rounded to bf16 — except from call
``bad_from`` on, where output row 1 was scaled by 3, the signature of a kernel applying a wrong routing weight. The
``reference`` backend judges them offline, so replays and bisects run on the CPU.
``write_synthetic_capture``: many tiny calls (for the browser: filtering, laziness, the benchmark).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moereplay.format import CaptureWriter

EXPERTS, SIZE_K, SIZE_N, TOKENS, TOP_K = 4, 128, 64, 4, 2
OP = "moe_wna16_marlin_gemm"


def marlin_call(
    seed: int, *, topk_weights_dtype: torch.dtype = torch.float32
) -> tuple[dict[str, Any], torch.Tensor]:
    """The arguments of one small Marlin MoE call and its exact output (bf16)."""
    from moereplay.reference.marlin_formats import MarlinWeightFormat, random_experts
    from moereplay.reference.marlin_moe import reference_moe_wna16_marlin_gemm
    from moereplay.reference.moe_align import moe_align_block_size

    generator = torch.Generator().manual_seed(seed)
    packed = random_experts(
        MarlinWeightFormat.GPTQ_INT4,
        EXPERTS,
        SIZE_K,
        SIZE_N,
        group_size=32,
        activation_dtype=torch.bfloat16,
        generator=generator,
    )
    hidden = torch.randn(TOKENS, SIZE_K, generator=generator).to(torch.bfloat16)
    logits = torch.randn(TOKENS, EXPERTS, generator=generator)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), TOP_K)
    sorted_ids, expert_ids, padded = moe_align_block_size(ids, 16, EXPERTS)
    args: dict[str, Any] = dict(
        input=hidden,
        output=torch.zeros(TOKENS * TOP_K, SIZE_N, dtype=torch.bfloat16),
        a_scales=None,
        workspace=torch.zeros(64, dtype=torch.int32),
        sorted_token_ids=sorted_ids,
        expert_ids=expert_ids,
        num_tokens_past_padded=padded,
        topk_weights=weights.to(torch.float32),
        moe_block_size=16,
        top_k=TOP_K,
        mul_topk_weights=True,
        size_m=TOKENS,
        is_k_full=True,
        use_atomic_add=False,
        use_fp32_reduce=True,
        thread_k=-1,
        thread_n=-1,
        blocks_per_sm=-1,
        **packed.kernel_kwargs(),
    )
    plain = {
        key: value for key, value in args.items() if key not in ("thread_k", "thread_n", "blocks_per_sm")
    }
    output = reference_moe_wna16_marlin_gemm(**plain).output.to(torch.bfloat16)
    args["topk_weights"] = args["topk_weights"].to(topk_weights_dtype)
    return args, output


def write_marlin_capture(
    path: Path, *, calls: int = 1, bad_from: int | None = 0, context_call: bool = False, **call_options: Any
) -> Path:
    """``calls`` Marlin calls (layer = call number, step 0); from ``bad_from`` on row 1 of the output is ×3.

    ``context_call``: first record an enclosing ``fused_marlin_moe`` call (no ops module: not replayable).
    """
    with CaptureWriter(path, header={"rank": 0}) as writer:
        parent = None
        if context_call:
            parent = writer.begin_call(
                "fused_marlin_moe", {"top_k": TOP_K}, site="tests.tui", context={"step": 0}
            )
        for number in range(calls):
            args, output = marlin_call(number, **call_options)
            if bad_from is not None and number >= bad_from:
                output[1] *= 3
            index = writer.begin_call(
                OP, args, site="tests.tui:marlin", context={"layer": number, "step": 0}, parent=parent
            )
            writer.complete_call(index, {"output": output, "return": output})
    return path


def write_synthetic_capture(path: Path, calls: int, *, layers: int = 24) -> Path:
    """``calls`` tiny calls cycling through three op names, ``layers`` layers per step, every tenth cut short."""
    weight = torch.zeros(4, 8, 4, dtype=torch.int32)
    ops = (OP, "matmul_ogs", "fused_marlin_moe")
    with CaptureWriter(path, header={"rank": 0}) as writer:
        for number in range(calls):
            hidden = torch.full((4, 16), float(number % 7), dtype=torch.bfloat16)
            index = writer.begin_call(
                ops[number % 3],
                {"input": hidden, "b_qweight": weight, "top_k": 2, "mul_topk_weights": True},
                site=f"synthetic:{number % 5}",
                context={"layer": number % layers, "step": number // layers},
                static={"b_qweight"},
            )
            if number % 10 != 9:
                writer.complete_call(index, {"output": torch.zeros(8, 16, dtype=torch.bfloat16)})
    return path
