"""Run by test_marlin_rows_interpreter.py in a child process with ``TRITON_INTERPRET=1``: the packed-code Marlin
kernel executed by Triton's interpreter on the CPU, against the dense path. Prints one line per check and exits 1 on
the first failure."""

from __future__ import annotations

import sys

import torch
import triton.runtime.interpreter as interpreter
from test_marlin_rows import FAST

from moereplay.reference import marlin_rows
from moereplay.reference.marlin_formats import MarlinWeightFormat, random_experts
from moereplay.reference.marlin_moe import reference_moe_wna16_marlin_gemm
from moereplay.reference.moe_align import moe_align_block_size

F = MarlinWeightFormat
EXPERTS, K, N, TOKENS, TOP_K = 6, 512, 192, 12, 3  # K: two splits; N: a partial column block


def _index_first_element() -> None:
    """Triton 3.6's interpreter reads a loop bound with ``int(array)`` of a one-element array, which NumPy 2.4
    refuses; read its element instead (the interpreter only, this process only)."""
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _call(packed, x, ids, weights, fused: bool):  # type: ignore[no-untyped-def]
    sorted_ids, expert_ids, total = moe_align_block_size(ids.to(torch.int32), 8, EXPERTS)
    marlin_rows_available = marlin_rows.available
    if fused:
        marlin_rows.available = lambda device, environ=None: True  # type: ignore[assignment]
    try:
        return reference_moe_wna16_marlin_gemm(
            input=x,
            output=None,
            a_scales=None,
            workspace=None,
            sorted_token_ids=sorted_ids,
            expert_ids=expert_ids,
            num_tokens_past_padded=total,
            topk_weights=weights,
            moe_block_size=8,
            top_k=TOP_K,
            mul_topk_weights=True,
            size_m=x.shape[0],
            **packed.kernel_kwargs(),
        )
    finally:
        marlin_rows.available = marlin_rows_available  # type: ignore[assignment]


def _one_hot_rows(packed, fmt, dtype) -> bool:  # type: ignore[no-untyped-def]
    """Input rows e_0 … e_{K-1}, all on expert 1: each output row is one weight row, so the kernel's weights are
    compared with the dense decoder's bit for bit (an exact product: one nonzero term per row)."""
    x = torch.eye(K).to(dtype)
    ids = torch.ones((K, 1), dtype=torch.int64)
    sorted_ids, expert_ids, total = moe_align_block_size(ids.to(torch.int32), 16, EXPERTS)
    available = marlin_rows.available
    marlin_rows.available = lambda device, environ=None: True  # type: ignore[assignment]
    try:
        result = reference_moe_wna16_marlin_gemm(
            input=x, output=None, a_scales=None, workspace=None, sorted_token_ids=sorted_ids,
            expert_ids=expert_ids, num_tokens_past_padded=total, topk_weights=torch.ones((K, 1)),
            moe_block_size=16, top_k=1, mul_topk_weights=False, size_m=K, **packed.kernel_kwargs(),
        )  # fmt: skip
    finally:
        marlin_rows.available = available  # type: ignore[assignment]
    weights = packed.expert_weights()
    return torch.equal(result.gemm, weights.dequantize(torch.tensor([1]))[0])


def main() -> int:
    _index_first_element()
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(TOKENS, EXPERTS, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), TOP_K)
    for fmt, group_size, dtype in FAST:
        packed = random_experts(
            fmt,
            EXPERTS,
            K,
            N,
            group_size=group_size,
            activation_dtype=dtype,
            with_bias=True,
            with_dense=False,
            generator=torch.Generator().manual_seed(3),
        )
        x = torch.randn(TOKENS, K, generator=gen).to(dtype)
        fused = _call(packed, x, ids, weights, fused=True)
        dense = _call(packed, x, ids, weights, fused=False)
        scale = dense.gemm.double().abs().max()
        relative = float((fused.gemm.double() - dense.gemm.double()).abs().max() / scale)
        same = torch.equal(fused.written, dense.written) and fused.notes == dense.notes
        print(
            f"{fmt.value} group {group_size} {dtype}: max rel {relative:.2e}, written and notes the same: {same}"
        )
        if relative > 1e-5 or not same or marlin_rows._FAILED:
            print(f"the kernel did not run: {marlin_rows._FAILED}" if marlin_rows._FAILED else "differs")
            return 1
        # the epilogue kernel against the torch operations of the dense path, on the kernel's own products
        expected = (fused.gemm + dense.bias_rows) * dense.row_weights[:, None]
        finished = (
            torch.equal(fused.bias_rows, dense.bias_rows)
            and torch.equal(fused.row_weights, dense.row_weights)
            and torch.equal(fused.output, expected)
        )
        print(f"  bias rows, row weights and output the torch epilogue's bit for bit: {finished}")
        if not finished:
            return 1
        exact = _one_hot_rows(packed, fmt, dtype)
        print(f"  one-hot rows are the dense decoder's weights bit for bit: {exact}")
        if not exact:
            return 1
        if fmt not in (F.NVFP4, F.GPTQ_INT8, F.AWQ_INT4) or (dtype != torch.bfloat16 and fmt is F.NVFP4):
            continue
        budget = marlin_rows.PARTIAL_BYTES
        marlin_rows.PARTIAL_BYTES = 20 * N * 4 * marlin_rows.k_splits(K // 16)[0]  # passes of ≤ 20 rows
        try:
            passes = _call(packed, x, ids, weights, fused=True)
        finally:
            marlin_rows.PARTIAL_BYTES = budget
        if not torch.equal(passes.output, fused.output):
            print("a call in passes of at most 20 rows gave other bits")
            return 1
        for tokens in (1, 5):  # fewer rows per expert: other block heights, the same bits
            part = _call(packed, x[:tokens], ids[:tokens], weights[:tokens], fused=True)
            if not torch.equal(part.output, fused.output[: tokens * TOP_K]):
                print(f"rows of the first {tokens} tokens changed")
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
