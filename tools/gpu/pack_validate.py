"""Validate a kernel pack on the GPU machine: one line per check, exit 1 if any check fails.

Run after the prelude:  source tools/gpu/device_setup.sh && python3 tools/gpu/pack_validate.py

Checks: vllm._custom_ops imports from the pack; torch.ops._moe_C.moe_wna16_marlin_gemm is registered; vLLM sees a
CUDA platform with Triton on; the pack's smoke test (silu_and_mul, int4 Marlin MoE GEMM, triton_kernels import);
int4 and NVFP4 Marlin MoE GEMMs with and without ``mul_topk_weights``; vLLM's ``fused_marlin_moe`` end to end;
a dense bf16 ``triton_kernels.matmul_ogs``. Every numeric check compares with fp32 torch math on the dequantised
weights and prints max |error| / max |reference|.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from moereplay.pack.load import LoadedPack, load_pack
from moereplay.pack.smoke import smoke_test

FAILURES: list[str] = []


# Callable[..., ...], called with no argument: mypy rejects the callers' lambdas, whose defaults bind loop
# variables, as Callable[[], ...] (python/mypy#15459)
def check(name: str, body: Callable[..., str], gate: bool = True) -> None:
    """Run one check and print one line; an exception fails the run only for gating checks."""
    start = time.perf_counter()
    try:
        message = body()
    except Exception as error:
        if gate:
            FAILURES.append(name)
        print(f"{name}: ERROR {type(error).__name__}: {error}")
        traceback.print_exc(limit=4)
        return
    print(f"{name}: {message} [{time.perf_counter() - start:.1f}s]")


def relative(result: torch.Tensor, expected: torch.Tensor) -> float:
    return float((result.float() - expected).abs().max() / expected.abs().max())


def int4_experts(
    pack: LoadedPack, experts: int, size_k: int, size_n: int, group: int, generator: torch.Generator
):
    """Per-expert int4 GPTQ weights in Marlin layout via vLLM's marlin_quantize: (w_ref [E,K,N] fp32, q, s, type)."""
    marlin_test = pack.import_module("vllm.model_executor.layers.quantization.utils.marlin_utils_test")
    quant_type = pack.import_module("vllm.scalar_type").scalar_types.uint4b8
    refs, weights, scales = [], [], []
    for _ in range(experts):
        dense = (
            torch.randn(size_k, size_n, device="cuda", dtype=torch.bfloat16, generator=generator)
            / size_k**0.5
        )
        w_ref, q_w, scale, *_ = marlin_test.marlin_quantize(dense, quant_type, group, False)
        refs.append(w_ref.float())
        weights.append(q_w)
        scales.append(scale)
    return torch.stack(refs), torch.stack(weights).contiguous(), torch.stack(scales).contiguous(), quant_type


def nvfp4_experts(pack: LoadedPack, experts: int, size_k: int, size_n: int, generator: torch.Generator):
    """Per-expert random NVFP4 weights (group 16, per-expert global scale) via vLLM's marlin_utils_fp4 helper."""
    fp4 = pack.import_module("vllm.model_executor.layers.quantization.utils.marlin_utils_fp4")
    quant_type = pack.import_module("vllm.scalar_type").scalar_types.float4_e2m1f
    refs, weights, scales, globals_ = [], [], [], []
    for _ in range(experts):
        dense = (
            torch.randn(size_n, size_k, device="cuda", dtype=torch.bfloat16, generator=generator)
            / size_k**0.5
        )
        w_ref, q_w, scale, global_scale = fp4.rand_marlin_weight_nvfp4_like(dense, 16)
        refs.append(w_ref.float())
        weights.append(q_w)
        scales.append(scale)
        globals_.append(global_scale.reshape(()))
    stack = [torch.stack(refs), torch.stack(weights).contiguous(), torch.stack(scales).contiguous()]
    return (*stack, torch.stack(globals_).float(), quant_type)


def marlin_moe_case(
    pack: LoadedPack,
    fmt: str,
    top_k: int,
    mul_topk_weights: bool,
    seed: int,
    weights_dtype: torch.dtype = torch.float32,
) -> str:
    """One moe_wna16_marlin_gemm call vs fp32 torch. top_k=1 is gemm2 style (rows pre-expanded); the routing
    weights are passed in ``weights_dtype`` (vLLM passes float32; the published report passed bf16)."""
    ops = pack.custom_ops
    align = pack.import_module("vllm.model_executor.layers.fused_moe.moe_align_block_size")
    marlin_utils = pack.import_module("vllm.model_executor.layers.quantization.utils.marlin_utils")
    generator = torch.Generator(device="cuda").manual_seed(seed)
    experts, tokens, size_k, size_n, block = 8, 32, 512, 384, 16
    global_scale = None
    if fmt == "int4":
        refs, b_q, b_s, quant_type = int4_experts(pack, experts, size_k, size_n, 32, generator)
    else:
        refs, b_q, b_s, global_scale, quant_type = nvfp4_experts(pack, experts, size_k, size_n, generator)
    x = torch.randn(tokens, size_k, device="cuda", dtype=torch.bfloat16, generator=generator)
    probs = torch.softmax(torch.randn(tokens, experts, device="cuda", generator=generator), -1)
    weights, ids = torch.topk(probs, top_k, -1)
    ids = ids.to(torch.int32)
    weights = weights.to(weights_dtype)
    sorted_ids, expert_ids, padded = align.moe_align_block_size(ids, block, experts)
    out = ops.moe_wna16_marlin_gemm(
        x, None, b_q, None, b_s, None, global_scale, None, None, None,
        marlin_utils.marlin_make_workspace_new(x.device, 4), sorted_ids, expert_ids, padded, weights,
        moe_block_size=block, top_k=top_k, mul_topk_weights=mul_topk_weights, b_q_type=quant_type,
        size_m=tokens, size_n=size_n, size_k=size_k, is_k_full=True, use_atomic_add=False,
        use_fp32_reduce=True, is_zp_float=False,
    )  # fmt: skip
    expected = torch.einsum("tk,tjkn->tjn", x.float(), refs[ids.long()])
    if mul_topk_weights:
        expected = expected * weights.float()[..., None]
    expected = expected.reshape(tokens * top_k, size_n)
    row_error = (out.float() - expected).abs().amax(1) / expected.abs().amax()
    bad = int((row_error > 0.02).sum())
    return f"rel err {relative(out, expected):.2e}, rows over 2%: {bad}/{tokens * top_k}"


def fused_marlin_moe(pack: LoadedPack) -> str:
    """vLLM's two-GEMM int4 Marlin MoE (silu_and_mul between) vs fp32 torch."""
    marlin_moe = pack.import_module("vllm.model_executor.layers.fused_moe.experts.marlin_moe")
    generator = torch.Generator(device="cuda").manual_seed(2)
    experts, tokens, top_k, hidden, inter = 8, 32, 2, 512, 256
    r1, w1, s1, quant_type = int4_experts(pack, experts, hidden, 2 * inter, 128, generator)
    r2, w2, s2, _ = int4_experts(pack, experts, inter, hidden, 128, generator)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
    probs = torch.softmax(torch.randn(tokens, experts, device="cuda", generator=generator), -1)
    topk_weights, topk_ids = torch.topk(probs, top_k, -1)
    out = marlin_moe.fused_marlin_moe(
        x, w1, w2, None, None, s1, s2, topk_weights, topk_ids.to(torch.int32), quant_type_id=quant_type.id
    )
    gate_up = torch.einsum("tk,tjkn->tjn", x.float(), r1[topk_ids])
    act = torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    act = act.to(torch.bfloat16).float()  # the kernel stores the activation in bf16
    down = torch.einsum("tjk,tjkn->tjn", act, r2[topk_ids])
    expected = (down * topk_weights[..., None]).sum(1)
    return f"rel err {relative(out, expected):.2e} ({tokens} tokens, top-{top_k}, {experts} experts)"


def matmul_ogs_dense(pack: LoadedPack) -> str:
    matmul_ogs = pack.import_module("triton_kernels.matmul_ogs")
    generator = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, generator=generator)
    w = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
    out = matmul_ogs.matmul_ogs(x, w, None)
    assert matmul_ogs.__file__ is not None  # a module file of the pack
    return f"rel err {relative(out, x.float() @ w.float()):.2e} from {Path(matmul_ogs.__file__).resolve()}"


def main() -> int:
    smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, check=False).stdout.splitlines()
    print(next((line.strip(" |") for line in smi if "Driver Version" in line), "nvidia-smi: no driver line"))
    import triton

    print(
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, python {sys.version.split()[0]}"
    )
    start = time.perf_counter()
    pack = load_pack(os.environ.get("MOEREPLAY_PACK", ".kernelpack"))
    print(f"load_pack: {pack.unpacked.root} [{time.perf_counter() - start:.1f}s]")
    check("import vllm._custom_ops", lambda: f"{pack.custom_ops.__file__}")
    check(
        "torch.ops._moe_C.moe_wna16_marlin_gemm",
        lambda: "registered" if hasattr(torch.ops._moe_C, "moe_wna16_marlin_gemm") else _fail("missing"),
    )

    def platform() -> str:
        platforms = pack.import_module("vllm.platforms")
        triton_utils = pack.import_module("vllm.triton_utils")
        cuda = platforms.current_platform.is_cuda()
        if not (cuda and triton_utils.HAS_TRITON):
            _fail(f"is_cuda={cuda} HAS_TRITON={triton_utils.HAS_TRITON}")
        return f"CUDA platform, HAS_TRITON=True, vllm {pack.import_module('vllm').__version__}"

    check("vllm platform", platform)

    def smoke() -> str:
        result = smoke_test(pack)
        if not result.ok:
            _fail(result.line())
        return result.line()

    check("smoke (kernels check)", smoke)
    for fmt in ("int4", "nvfp4"):
        for top_k, mul in ((2, False), (1, True), (2, True)):
            check(
                f"moe_wna16_marlin_gemm {fmt} top_k={top_k} mul_topk_weights={mul}",
                lambda fmt=fmt, top_k=top_k, mul=mul: marlin_moe_case(
                    pack, fmt, top_k, mul, seed=top_k + 2 * mul
                ),
            )
    check(
        "moe_wna16_marlin_gemm nvfp4 top_k=1 mul_topk_weights=True, routing weights in bf16 (informational)",
        lambda: marlin_moe_case(pack, "nvfp4", 1, True, seed=9, weights_dtype=torch.bfloat16),
        gate=False,
    )
    check("fused_marlin_moe int4", lambda: fused_marlin_moe(pack))
    check("triton_kernels.matmul_ogs bf16", lambda: matmul_ogs_dense(pack))
    print(f"pack_validate: {'FAILED ' + ', '.join(FAILURES) if FAILURES else 'all checks passed'}")
    return 1 if FAILURES else 0


def _fail(message: str) -> str:
    raise AssertionError(message)


if __name__ == "__main__":
    sys.exit(main())
