"""Kernel inputs for the Marlin MoE GPU tests, prepared by vLLM 0.25.1's own Python preparation code.

Every weight tensor handed to ``moe_wna16_marlin_gemm`` here comes from vLLM's functions (``gptq_marlin_repack``,
``marlin_permute_scales``, ``nvfp4_marlin_process_scales`` …), called step by step the way the MoE preparation
functions (``prepare_nvfp4_moe_layer_for_marlin``, ``prepare_moe_mxfp4_layer_for_marlin``,
``prepare_mxfp8_moe_layer_for_marlin``, ``prepare_fp8_moe_layer_for_marlin``, the int wna16 oracle) call them, from
checkpoint-layout tensors derived from moereplay's random logical experts. moereplay's own forward packing is then
compared with them bit for bit, and the reference is run on vLLM's tensors.

Needs CUDA and an importable vLLM (a kernel pack on ``PYTHONPATH``); the importing test module skips otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moereplay.reference import marlin_layout as layout
from moereplay.reference.marlin_formats import LogicalExperts, MarlinWeightFormat, PackedExperts
from moereplay.reference.numerics import pack_e2m1_codes

F = MarlinWeightFormat


@dataclass(frozen=True)
class VllmWeights:
    """Weight-side kernel arguments as vLLM prepares them."""

    b_qweight: torch.Tensor
    b_scales: torch.Tensor
    global_scale: torch.Tensor | None
    b_qzeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    perm: torch.Tensor | None
    b_bias: torch.Tensor | None


def _fp4_checkpoint(codes: torch.Tensor) -> torch.Tensor:
    """Logical e2m1 codes [E, K, N] → checkpoint bytes [E, N, K/2] (element 2i in the low nibble of byte i)."""
    return pack_e2m1_codes(codes.transpose(1, 2).contiguous())


def _repack(
    checkpoint_rows: torch.Tensor, perm: torch.Tensor | None, size_k: int, size_n: int, bits: int
) -> torch.Tensor:
    """Per expert ``ops.gptq_marlin_repack`` of GPTQ-layout int32 [E, K/pack, N] (as ``gptq_marlin_moe_repack``)."""
    import vllm._custom_ops as ops

    empty = torch.empty(0, dtype=torch.int32, device=checkpoint_rows.device)
    out = []
    for expert in range(checkpoint_rows.shape[0]):
        out.append(
            ops.gptq_marlin_repack(
                checkpoint_rows[expert].contiguous(),
                perm[expert] if perm is not None else empty,
                size_k,
                size_n,
                bits,
            )
        )
    return torch.stack(out)


def vllm_prepare(logical: LogicalExperts, activation_dtype: torch.dtype) -> VllmWeights:
    """The kernel's weight arguments for ``logical`` (on CUDA), made by vLLM's preparation functions."""
    from vllm.model_executor.layers.quantization.utils import marlin_utils as mu
    from vllm.model_executor.layers.quantization.utils import marlin_utils_fp4 as mu4
    from vllm.model_executor.layers.quantization.utils import marlin_utils_fp8 as mu8

    fmt = logical.format
    codes = logical.codes
    num_experts, size_k, size_n = codes.shape
    group = logical.group_size
    group_arg = -1 if group == size_k else group
    device = codes.device
    global_scale = zero_points = g_idx = perm = bias = None

    if fmt in (F.NVFP4, F.MXFP4):
        checkpoint = _fp4_checkpoint(codes)  # [E, N, K/2]
        rows = torch.stack([checkpoint[e].view(torch.int32).T.contiguous() for e in range(num_experts)])
        b_qweight = _repack(rows, None, size_k, size_n, 4)
        if fmt is F.NVFP4:
            ckpt_scales = (
                logical.scales.transpose(1, 2).to(torch.float8_e4m3fn).to(activation_dtype)
            )  # [E, N, K/16]
            factor = mu4._nvfp4_compute_scale_factor(ckpt_scales, activation_dtype)
            processed = []
            for e in range(num_experts):
                permuted = mu.marlin_permute_scales(
                    s=ckpt_scales[e].T, size_k=size_k, size_n=size_n, group_size=16
                )
                scales_e, _ = mu4.nvfp4_marlin_process_scales(
                    permuted, scale_factor=factor, a_dtype=activation_dtype
                )
                processed.append(scales_e)
            b_scales = torch.stack(processed)
            assert logical.global_scale is not None
            global_scale = (
                mu4.nvfp4_marlin_process_global_scale(
                    logical.global_scale.to(torch.float32), activation_dtype
                )
                / factor
            )
        else:
            ckpt_scales = (
                logical.scales.transpose(1, 2).contiguous().view(torch.float8_e8m0fnu).to(activation_dtype)
            )
            b_scales = torch.stack(
                [
                    mu4.mxfp4_marlin_process_scales(
                        mu.marlin_permute_scales(
                            s=ckpt_scales[e].T, size_k=size_k, size_n=size_n, group_size=32
                        ),
                        input_dtype=None,
                    )
                    for e in range(num_experts)
                ]
            )
    elif fmt in (F.FP8, F.MXFP8):
        weight = codes.transpose(1, 2).contiguous().view(torch.float8_e4m3fn)  # checkpoint [E, N, K]
        rows = torch.stack(
            [mu8.pack_fp8_to_int32(weight[e], size_k_first=False).T.contiguous() for e in range(num_experts)]
        )
        b_qweight = _repack(rows, None, size_k, size_n, 8)
        if fmt is F.MXFP8:
            ckpt = logical.scales.transpose(1, 2).contiguous()  # uint8 [E, N, K/32]
            b_scales = torch.stack(
                [
                    mu8.mxfp8_marlin_process_scales(
                        mu.marlin_permute_scales(
                            s=ckpt[e].view(torch.float8_e8m0fnu).to(activation_dtype).T.contiguous(),
                            size_k=size_k,
                            size_n=size_n,
                            group_size=32,
                        )
                    )
                    for e in range(num_experts)
                ]
            )
        else:
            scales = logical.scales.to(activation_dtype)
            permuted = torch.stack(
                [
                    mu.marlin_permute_scales(s=scales[e], size_k=size_k, size_n=size_n, group_size=group_arg)
                    for e in range(num_experts)
                ]
            )
            b_scales = mu8.fp8_fused_exponent_bias_into_scales(permuted)
    else:
        from vllm.model_executor.layers.quantization.utils.quant_utils import pack_rows

        bits = fmt.num_bits
        rows = torch.stack(
            [pack_rows(codes[e].to(torch.int32), bits, size_k, size_n) for e in range(num_experts)]
        )
        if logical.g_idx is not None:
            perm = torch.stack([torch.argsort(logical.g_idx[e]).to(torch.int32) for e in range(num_experts)])
            g_idx = torch.stack([logical.g_idx[e][perm[e].long()] for e in range(num_experts)]).to(
                torch.int32
            )
        b_qweight = _repack(rows.to(device), perm, size_k, size_n, bits)
        b_scales = mu.marlin_moe_permute_scales(
            s=logical.scales.to(activation_dtype), size_k=size_k, size_n=size_n, group_size=group_arg
        )
        if fmt is F.AWQ_INT4:
            assert logical.zero_points is not None
            zero_points = torch.stack(
                [
                    mu.marlin_zero_points(
                        logical.zero_points[e].to(torch.int32), size_k // group, size_n, bits
                    )
                    for e in range(num_experts)
                ]
            ).to(device)
        elif fmt is F.AWQ_INT4_FZP:
            assert logical.zero_points is not None
            zp = logical.zero_points.to(torch.float16)
            zero_points = torch.stack(
                [
                    mu.marlin_permute_scales(s=zp[e], size_k=size_k, size_n=size_n, group_size=group)
                    for e in range(num_experts)
                ]
            )
    if logical.bias is not None:
        bias16 = logical.bias.to(activation_dtype)
        bias = torch.stack([mu.marlin_permute_bias(bias16[e]) for e in range(num_experts)])
    return VllmWeights(b_qweight, b_scales, global_scale, zero_points, g_idx, perm, bias)


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bit-for-bit equality of two optional tensors (fp8/e8m0 compared as bytes)."""
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.element_size() != b.element_size():
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int).cpu(), b.contiguous().view(as_int).cpu())


def compare_with_ours(vllm: VllmWeights, ours: PackedExperts) -> list[str]:
    """Names of the tensors where moereplay's forward packing differs from vLLM's (empty = identical)."""
    pairs = {
        "b_scales": (vllm.b_scales, ours.b_scales),
        "global_scale": (vllm.global_scale, ours.global_scale),
        "b_qzeros": (vllm.b_qzeros, ours.b_qzeros),
        "b_bias": (vllm.b_bias, ours.b_bias),
        "g_idx": (vllm.g_idx, ours.g_idx),
    }
    # act order: vLLM's (unstable) argsort may store the rows of one group in another order than ours; the math is
    # the same and the reference test on vLLM's tensors covers it
    if vllm.perm is None:
        pairs["b_qweight"] = (vllm.b_qweight, ours.b_qweight)
    return [name for name, (a, b) in pairs.items() if not same_bits(a, b)]


def layout_mismatches(device: torch.device) -> list[str]:
    """Our Marlin weight packing against ``ops.gptq_marlin_repack`` for 4/8-bit, both activation widths."""
    import vllm._custom_ops as ops

    gen = torch.Generator().manual_seed(123)
    problems = []
    for bits in (4, 8):
        for is_a_8bit in (False, True):
            k, n = 128, 256
            codes = torch.randint(0, 1 << bits, (k, n), generator=gen, dtype=torch.uint8)
            rows = layout.pack_rows(codes, bits).to(device)
            theirs = ops.gptq_marlin_repack(
                rows, torch.empty(0, dtype=torch.int32, device=device), k, n, bits, is_a_8bit
            )
            ours = layout.pack_weights(codes.to(device), bits, is_a_8bit)
            if not same_bits(theirs, ours):
                problems.append(f"{bits}-bit is_a_8bit={is_a_8bit}")
    return problems
