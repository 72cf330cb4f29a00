"""A Triton kernel for the GPU side of the Triton fused MoE reference: stored expert weights dequantised to dense
float32 in one pass (imported only where Triton and a GPU are; :mod:`.dequant_dense` decides).

One program dequantises a ``BLOCK_N × BLOCK_K`` tile of one chosen expert ``experts[g]`` into ``out[g]``, with the
same float32 operations, in the same order, as the torch path applies to each element: the code converted to
float32; ``MODE`` 1: times its scale; ``MODE`` 2: ``(code − zero) · scale``, then rounded through ``ROUND``'s dtype
(round to nearest even). A scale (or zero point) of weight ``(n, k)`` sits at ``(n // group_n) · stride_sn +
(k // group_k) · stride_sk`` of the expert's scales, which covers per-tensor (both strides 0), per-channel
(``group_n = 1``, ``stride_sk = 0``), per-block and per-group scales. ``INT4``: weight ``(n, k)`` is nibble
``k % 2`` (low first) of byte ``(n, k // 2)``; ``ZP_INT4``: zero point ``(n, g)`` is nibble ``n % 2`` of byte
``(n // 2, g)``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dequant_dense(
    w_ptr,
    out_ptr,
    experts_ptr,
    scale_ptr,
    zp_ptr,
    N,
    K,
    swe,
    swn,
    swk,
    sog,
    son,
    sok,
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
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    e = tl.load(experts_ptr + g).to(tl.int64)
    inside = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    n64 = offs_n[:, None].to(tl.int64)
    if INT4:
        byte = tl.load(w_ptr + e * swe + n64 * swn + (offs_k[None, :] // 2) * swk, mask=inside).to(tl.int32)
        w = ((byte >> ((offs_k[None, :] % 2) * 4)) & 0xF).to(tl.float32)
    else:
        w = tl.load(w_ptr + e * swe + n64 * swn + offs_k[None, :] * swk, mask=inside).to(tl.float32)
    if MODE != 0:
        s_at = scale_ptr + e * sse + (offs_n[:, None] // group_n).to(tl.int64) * ssn
        s = tl.load(s_at + (offs_k[None, :] // group_k) * ssk, mask=inside).to(tl.float32)
        if MODE == 1:
            w = w * s
        else:
            if HAS_ZP:
                if ZP_INT4:
                    z_at = zp_ptr + e * sze + (offs_n[:, None] // 2).to(tl.int64) * szn
                    z_byte = tl.load(z_at + (offs_k[None, :] // group_k) * szk, mask=inside).to(tl.int32)
                    z = ((z_byte >> ((offs_n[:, None] % 2) * 4)) & 0xF).to(tl.float32)
                else:
                    z_at = zp_ptr + e * sze + n64 * szn
                    z = tl.load(z_at + (offs_k[None, :] // group_k) * szk, mask=inside).to(tl.float32)
                w = (w - z) * s
            else:
                w = (w - zero_default) * s
            if ROUND == 1:
                w = w.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
            if ROUND == 2:
                w = w.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)
    tl.store(out_ptr + g * sog + n64 * son + offs_k[None, :] * sok, w, mask=inside)
