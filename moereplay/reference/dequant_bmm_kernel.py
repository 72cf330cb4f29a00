"""A Triton kernel for the GPU side of the Triton fused MoE reference: batched ``x · dequant(W[e])ᵀ`` in float32
without dense weights in memory (imported only where Triton and a GPU are; :mod:`.dequant_bmm` decides).

One program computes a ``BLOCK_M × BLOCK_N`` tile of one bucket member ``g`` (expert ``experts[g]``): for each
``BLOCK_K`` slice it loads the stored weight codes, dequantises them in registers exactly as the torch path does
element by element — the code converted to float32; ``MODE`` 1: times its scale; ``MODE`` 2: ``(code − zero) ·
scale`` then rounded through ``ROUND``'s dtype — and adds ``x_tile · w_tileᵀ`` in IEEE float32
(``input_precision="ieee"``: fused multiply-adds on the CUDA cores, no TF32). A scale (or zero point) of weight
``(n, k)`` sits at ``(n // group_n) · stride_sn + (k // group_k) · stride_sk`` of the expert's scales, which covers
per-tensor (both strides 0), per-channel (``group_n = 1``, ``stride_sk = 0``), per-block and per-group scales.
``INT4``: weight ``(n, k)`` is nibble ``k % 2`` (low first) of byte ``(n, k // 2)``; ``ZP_INT4``: zero point
``(n, g)`` is nibble ``n % 2`` of byte ``(n // 2, g)``. Weights outside ``N × K`` are zeroed after dequantisation,
so no padding element (loaded masked, undefined) reaches a sum.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dequant_bmm(
    x_ptr,
    w_ptr,
    out_ptr,
    experts_ptr,
    scale_ptr,
    zp_ptr,
    pad,
    N,
    K,
    sxg,
    sxm,
    sxk,
    swe,
    swn,
    swk,
    sog,
    som,
    son,
    sse,
    ssn,
    ssk,
    sze,
    szn,
    szk,
    group_n,
    group_k,
    zero_default,
    MODE: tl.constexpr,
    INT4: tl.constexpr,
    HAS_ZP: tl.constexpr,
    ZP_INT4: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    pid_m = tl.program_id(2)
    e = tl.load(experts_ptr + g).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < pad
    n_ok = offs_n < N
    x_base = x_ptr + g * sxg + offs_m[:, None].to(tl.int64) * sxm
    w_base = w_ptr + e * swe + offs_n[:, None].to(tl.int64) * swn
    s_base = scale_ptr + e * sse + (offs_n[:, None] // group_n).to(tl.int64) * ssn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_base + offs_k[None, :] * sxk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        inside = n_ok[:, None] & k_ok[None, :]
        if INT4:
            byte = tl.load(w_base + (offs_k[None, :] // 2) * swk, mask=inside).to(tl.int32)
            w = ((byte >> ((offs_k[None, :] % 2) * 4)) & 0xF).to(tl.float32)
        else:
            w = tl.load(w_base + offs_k[None, :] * swk, mask=inside).to(tl.float32)
        if MODE == 1:
            s = tl.load(s_base + (offs_k[None, :] // group_k) * ssk, mask=inside).to(tl.float32)
            w = w * s
        if MODE == 2:
            s = tl.load(s_base + (offs_k[None, :] // group_k) * ssk, mask=inside).to(tl.float32)
            if HAS_ZP:
                if ZP_INT4:
                    z_at = zp_ptr + e * sze + (offs_n[:, None] // 2).to(tl.int64) * szn
                    z_byte = tl.load(z_at + (offs_k[None, :] // group_k) * szk, mask=inside).to(tl.int32)
                    z = ((z_byte >> ((offs_n[:, None] % 2) * 4)) & 0xF).to(tl.float32)
                else:
                    z_at = zp_ptr + e * sze + offs_n[:, None].to(tl.int64) * szn
                    z = tl.load(z_at + (offs_k[None, :] // group_k) * szk, mask=inside).to(tl.float32)
                w = (w - z) * s
            else:
                w = (w - zero_default) * s
            if ROUND == 1:
                w = w.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
            if ROUND == 2:
                w = w.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)
        w = tl.where(inside, w, 0.0)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    out = out_ptr + g * sog + offs_m[:, None].to(tl.int64) * som + offs_n[None, :] * son
    tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])
