"""Seeded expert weights for vLLM's Triton fused MoE kernels, in the layouts its launchers read (never rename a
generator or change what it draws for given parameters: names and parameters are recorded in captures).

``triton_moe_experts`` — parameters ``seed``, ``experts``, ``n``, ``k``, ``format`` and per format:

- ``bf16`` / ``fp16`` / ``fp32``: ``B`` ``[E, N, K]`` of that dtype, ``std · N(0, 1)``;
- ``fp8_tensor`` / ``fp8_channel`` / ``fp8_block``: ``B`` e4m3 bytes drawn uniformly over the finite codes
  (no NaN), ``B_scale`` float32 ``[E]``, ``[E, N, 1]`` or ``[E, cdiv(N, block_n), cdiv(K, block_k)]`` (vLLM's
  ``block_shape = [block_n, block_k]``), scales ``uniform(0.5, 1.5) / 448 · 0.05``;
- ``int8_w8a16``: ``B`` int8 ``[E, N, K]``, ``B_scale`` ``[E, N]`` in ``dtype`` (per channel, no group);
- ``int4_group`` / ``int8_group``: ``B`` uint8 ``[E, N, K/2]`` (two codes per byte along K, low first) or
  ``[E, N, K]``, ``B_scale`` ``[E, N, K/group_size]`` in ``dtype``; with ``zero_points``: ``B_zp`` uint8
  ``[E, N/2, K/group]`` (int4, two per byte along N) or ``[E, N, K/group]``;
- ``bias``: ``B_bias`` ``[E, N]`` in ``dtype`` (not for the weight-only group formats: their kernel has no bias).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from moereplay.errors import SettingsError
from moereplay.synth.recipe import register_generator

FORMATS = (
    "bf16",
    "fp16",
    "fp32",
    "fp8_tensor",
    "fp8_channel",
    "fp8_block",
    "int8_w8a16",
    "int4_group",
    "int8_group",
)
_FLOAT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FP8_MAX = 448.0


def _dtype(name: Any) -> torch.dtype:
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise SettingsError(f"{name!r} is not a torch dtype")
    return value


def _scales(gen: torch.Generator, shape: tuple[int, ...], base: float) -> torch.Tensor:
    return (torch.rand(shape, generator=gen) + 0.5) * base


def fp8_codes(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Uniform finite e4m3 bytes: magnitude codes 0..0x7e (0x7f is NaN), random sign."""
    magnitude = torch.randint(0, 0x7F, shape, generator=gen, dtype=torch.int16)
    sign = torch.randint(0, 2, shape, generator=gen, dtype=torch.int16) * 0x80
    return (magnitude | sign).to(torch.uint8).view(torch.float8_e4m3fn)


_DRAW_BYTES = 24
"""Transient bytes a draw allocates per element (torch's generator paths), as ``moereplay.synth.generators``'s."""


def _triton_bytes(params: Mapping[str, Any]) -> int:
    """Bytes the generator allocates at most: its weight draws (fp8 draws magnitude and sign), before the tensor."""
    elements = 1
    for key in ("experts", "n", "k"):
        size = int(params[key])
        if size < 0:
            raise SettingsError(f"triton_moe_experts: negative {key} {size}")
        elements *= size
    return 2 * elements * _DRAW_BYTES


@register_generator("triton_moe_experts", _triton_bytes)
def triton_moe_experts(params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    seed = params.get("seed")
    if type(seed) is not int or seed < 0:
        raise SettingsError(f"a generator needs a non-negative integer seed, got {seed!r}")
    gen = torch.Generator().manual_seed(seed)
    fmt = str(params["format"])
    if fmt not in FORMATS:
        raise SettingsError(f"triton_moe_experts: format {fmt!r} is not one of {', '.join(FORMATS)}")
    experts, n, k = int(params["experts"]), int(params["n"]), int(params["k"])
    dtype = _dtype(params.get("dtype", "bfloat16"))
    out: dict[str, torch.Tensor] = {}
    if fmt in _FLOAT:
        std = float(params.get("std", 0.05))
        out["B"] = (torch.randn(experts, n, k, generator=gen) * std).to(_FLOAT[fmt])
    elif fmt.startswith("fp8"):
        out["B"] = fp8_codes(gen, (experts, n, k))
        base = 0.05 / FP8_MAX * 8
        if fmt == "fp8_tensor":
            out["B_scale"] = _scales(gen, (experts,), base)
        elif fmt == "fp8_channel":
            out["B_scale"] = _scales(gen, (experts, n, 1), base)
        else:
            block_n, block_k = int(params.get("block_n", 128)), int(params.get("block_k", 128))
            out["B_scale"] = _scales(gen, (experts, -(-n // block_n), -(-k // block_k)), base)
    elif fmt == "int8_w8a16":
        out["B"] = torch.randint(-128, 128, (experts, n, k), generator=gen, dtype=torch.int16).to(torch.int8)
        out["B_scale"] = _scales(gen, (experts, n), 0.05 / 128).to(dtype)
    else:
        group = int(params.get("group_size", 128))
        if k % group:
            raise SettingsError(f"K={k} is not a multiple of group_size={group}")
        int4 = fmt == "int4_group"
        width = k // 2 if int4 else k
        out["B"] = torch.randint(0, 256, (experts, n, width), generator=gen, dtype=torch.int16).to(
            torch.uint8
        )
        out["B_scale"] = _scales(gen, (experts, n, k // group), 0.05 / (8 if int4 else 128)).to(dtype)
        if params.get("zero_points"):
            rows = -(-n // 2) if int4 else n
            out["B_zp"] = torch.randint(
                0, 256, (experts, rows, k // group), generator=gen, dtype=torch.int16
            ).to(torch.uint8)
    if params.get("bias") and fmt not in ("int4_group", "int8_group"):
        out["B_bias"] = (torch.randn(experts, n, generator=gen) * 0.1).to(dtype)
    return {name: value.contiguous() for name, value in out.items()}
