"""The built-in recipe generators: seeded draws of activations and of quantised expert weights, prepared the way
vLLM 0.25.1 prepares them for its kernels.

Every generator takes plain parameters (a ``seed`` among them), draws on the CPU with one ``torch.Generator`` seeded
from it, in a fixed order, and returns named CPU tensors. The names are recorded in captures: never rename a
generator or change what it draws for given parameters — add a new one instead (the recipe digest would catch the
change, but old captures would no longer load).

- ``normal``: ``mean + std · N(0, 1)`` drawn in float32, cast to ``dtype``; optionally zero from column
  ``zero_from`` on (activations over a zero-padded K).
- ``marlin_experts``: random logical quantised experts of a :class:`MarlinWeightFormat`, optionally zero-padded the
  way vLLM pads (``pad_k``: K rows up to a total; ``pad_n``: each of ``shards`` N shards up to a width), packed by
  :func:`moereplay.reference.marlin_formats.pack_experts` (bit-equal to vLLM's preparation code). Outputs: the
  kernel's weight-side arguments ``b_qweight``, ``b_scales``, ``global_scale``, ``b_qzeros``, ``g_idx``, ``perm``,
  ``b_bias`` (those the format has). ``style="report"`` draws NVFP4 weights as the published bug report did.
- ``hopper_mxfp4``: checkpoint-form MXFP4 experts (``[E, N, K/2]`` e2m1 bytes, ``[E, N, K/32]`` e8m0 scales)
  swizzled for Hopper like vLLM's ``_swizzle_mxfp4`` (``HOPPER_VALUE`` mx_axis 1, ``HOPPER_SCALE`` mx_axis 1 and
  ``num_warps``): outputs ``values`` and ``scales``, the swizzled storages (transposed views, as triton_kernels
  keeps them). ``w13_layout``: the N rows are drawn as ``[gate; up]`` and rearranged into that layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from moereplay.errors import SettingsError
from moereplay.format.tensors import torch_dtype
from moereplay.synth.recipe import register_generator


def _generator(params: Mapping[str, Any]) -> torch.Generator:
    seed = params.get("seed")
    if type(seed) is not int or seed < 0:
        raise SettingsError(f"a generator needs a non-negative integer seed, got {seed!r}")
    return torch.Generator().manual_seed(seed)


def _dtype(name: Any) -> torch.dtype:
    value = torch_dtype(name)
    if value is None:
        raise SettingsError(f"{str(name)[:64]!r} is not a torch dtype")
    return value


_DRAW_BYTES = 24
"""Bytes a generator holds per drawn element at its peak, at most (a float64 draw, its cast, the packed output)."""


def _count(*sizes: Any) -> int:
    total = 1
    for size in sizes:
        total *= max(int(size), 0)
    return total


def _normal_bytes(params: Mapping[str, Any]) -> int:
    return _count(*params["shape"]) * _DRAW_BYTES


_PACKED_DRAW_BYTES = 12
"""Bytes a packed-weight generator (Marlin, Hopper MXFP4) holds per weight element at its peak, at most: its codes are
drawn as bytes and its float draws are per group (measured: expanding the bundled gpt-oss sets peaks at 6–9 bytes
per element, interpreter included)."""


def _marlin_bytes(params: Mapping[str, Any]) -> int:
    size_k = max(int(params["size_k"]), int(params.get("pad_k") or 0))
    size_n = max(int(params["size_n"]), int(params.get("pad_n") or 0) * int(params.get("shards") or 1))
    return _count(params["experts"], size_k, size_n) * _PACKED_DRAW_BYTES


def _hopper_bytes(params: Mapping[str, Any]) -> int:
    return _count(params["experts"], params["k"], params["n"]) * _PACKED_DRAW_BYTES


def _shape(value: Any) -> tuple[int, ...]:
    shape = tuple(int(v) for v in value)
    if any(size < 0 for size in shape):
        raise SettingsError(f"negative size in shape {shape}")
    return shape


@register_generator("normal", _normal_bytes)
def normal(params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    gen = _generator(params)
    shape = _shape(params["shape"])
    values = torch.randn(shape, generator=gen, dtype=torch.float32)
    values = values * float(params.get("std", 1.0)) + float(params.get("mean", 0.0))
    out = values.to(_dtype(params.get("dtype", "float32")))
    zero_from = params.get("zero_from")
    if zero_from is not None:
        out[..., int(zero_from) :] = 0
    return {"": out}


# ---------------------------------------------------------------------------------------------------------------
# Marlin experts
# ---------------------------------------------------------------------------------------------------------------


def _uniform(gen: torch.Generator, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
    return torch.rand(shape, generator=gen, dtype=torch.float64) * (high - low) + low


def _integers(gen: torch.Generator, low: int, high: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=gen, dtype=torch.uint8)


def _pad_shards(values: torch.Tensor, shards: int, width: int) -> torch.Tensor:
    """``[E, rows, shards·n]`` → ``[E, rows, shards·width]``: each shard zero-padded at its end (vLLM's pad_w13)."""
    experts, rows, total = values.shape
    n = total // shards
    if width == n:
        return values
    shaped = values.reshape(experts, rows, shards, n)
    padded = torch.nn.functional.pad(shaped, (0, width - n))
    return padded.reshape(experts, rows, shards * width)


def _pad_rows(values: torch.Tensor, rows: int) -> torch.Tensor:
    """``[E, r, n]`` → ``[E, rows, n]`` with zero rows appended (vLLM's pad_w2 along K)."""
    return torch.nn.functional.pad(values, (0, 0, 0, rows - values.shape[1]))


@register_generator("marlin_experts", _marlin_bytes)
def marlin_experts(params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    from moereplay.reference.marlin_formats import MarlinWeightFormat, pack_experts

    gen = _generator(params)
    fmt = MarlinWeightFormat(params["format"])
    experts, size_k, size_n = int(params["experts"]), int(params["size_k"]), int(params["size_n"])
    activation_dtype = _dtype(params.get("activation_dtype", "bfloat16"))
    style = params.get("style", "uniform")
    group_size = params.get("group_size")
    fixed = fmt.fixed_group_size
    if fixed is not None:
        group_size = fixed
    elif group_size is None or int(group_size) == -1:
        group_size = size_k
    group_size = int(group_size)
    pad_k = params.get("pad_k")
    if pad_k is not None and (int(pad_k) - size_k) % group_size:
        raise SettingsError(f"K padding {size_k} → {pad_k} is not whole groups of {group_size}")
    groups = size_k // group_size
    shape_codes = (experts, size_k, size_n)
    shape_scales = (experts, groups, size_n)
    zero_points = global_scale = g_idx = None

    if style == "report":
        # The published report's draw: every code/scale over the padded K first, then the padding zeroed.
        if fmt is not MarlinWeightFormat.NVFP4:
            raise SettingsError("style 'report' draws NVFP4 weights only")
        total_k = int(pad_k) if pad_k is not None else size_k
        codes = torch.randint(0, 16, (experts, total_k, size_n), generator=gen, dtype=torch.uint8)
        codes[:, size_k:, :] = 0
        scales = torch.rand(experts, total_k // 16, size_n, generator=gen) * 3 + 0.5
        scales[:, size_k // 16 :, :] = 0
        global_scale = torch.rand(experts, generator=gen) * 0.002 + 1e-4
        pad_k = None
    else:
        if fmt in (MarlinWeightFormat.NVFP4, MarlinWeightFormat.MXFP4):
            codes = _integers(gen, 0, 16, shape_codes)
        elif fmt in (MarlinWeightFormat.FP8, MarlinWeightFormat.MXFP8):
            codes = _integers(gen, 0, 0x7F, shape_codes) | (_integers(gen, 0, 2, shape_codes) << 7)
        else:
            codes = _integers(gen, 0, 1 << fmt.num_bits, shape_codes)
        if fmt is MarlinWeightFormat.NVFP4:
            scales = _uniform(gen, shape_scales, 0.5, 440.0).to(torch.float8_e4m3fn).to(torch.float32)
            global_scale = _uniform(gen, (experts,), 1e-5, 1e-3).to(torch.float32)
        elif fmt in (MarlinWeightFormat.MXFP4, MarlinWeightFormat.MXFP8):
            scales = _integers(gen, 118, 130, shape_scales)
        else:
            scales = _uniform(gen, shape_scales, 1e-3, 2e-2)
            if fmt is MarlinWeightFormat.AWQ_INT4:
                zero_points = _integers(gen, 0, 16, shape_scales)
            elif fmt is MarlinWeightFormat.AWQ_INT4_FZP:
                zero_points = _uniform(gen, shape_scales, 0.0, 15.0)
        if params.get("act_order"):
            if not fmt.supports_act_order or groups < 2:
                raise SettingsError("act order needs a GPTQ format with more than one group")
            rows = torch.arange(size_k) // group_size
            g_idx = torch.stack([rows[torch.randperm(size_k, generator=gen)] for _ in range(experts)]).to(
                torch.int32
            )
    bias = _uniform(gen, (experts, size_n), -1.0, 1.0) if params.get("bias") else None

    layout = params.get("w13_layout")
    if layout is not None:
        # codes, scales and bias were drawn as [gate; up] along N; lay their columns out as asked
        from moereplay.reference.activation import W13Layout, w13_permutation

        order = w13_permutation(size_n, W13Layout.GATE_UP_CONCAT, W13Layout(layout))
        codes, scales = codes[..., order], scales[..., order]
        if zero_points is not None:
            zero_points = zero_points[..., order]
        if bias is not None:
            bias = bias[..., order]

    shards = int(params.get("shards", 1))
    pad_n = params.get("pad_n")
    if pad_n is not None:
        width = int(pad_n)
        codes = _pad_shards(codes, shards, width)
        scales = _pad_shards(scales, shards, width)
        if zero_points is not None:
            zero_points = _pad_shards(zero_points, shards, width)
        if bias is not None:
            bias = _pad_shards(bias.unsqueeze(1), shards, width).squeeze(1)
    if pad_k is not None:
        codes = _pad_rows(codes, int(pad_k))
        scales = _pad_rows(scales, int(pad_k) // group_size)  # zero scales: the padded rows weigh nothing
        if zero_points is not None:
            zero_points = _pad_rows(zero_points, int(pad_k) // group_size)
    packed = pack_experts(
        fmt,
        codes,
        scales,
        activation_dtype=activation_dtype,
        global_scale=global_scale,
        zero_points=zero_points,
        g_idx=g_idx,
        bias=bias,
        with_dense=False,
    )
    outputs = {
        "b_qweight": packed.b_qweight,
        "b_scales": packed.b_scales,
        "global_scale": packed.global_scale,
        "b_qzeros": packed.b_qzeros,
        "g_idx": packed.g_idx,
        "perm": packed.perm,
        "b_bias": packed.b_bias,
    }
    return {name: value.contiguous() for name, value in outputs.items() if value is not None}


# ---------------------------------------------------------------------------------------------------------------
# Hopper MXFP4 for matmul_ogs
# ---------------------------------------------------------------------------------------------------------------


@register_generator("hopper_mxfp4", _hopper_bytes)
def hopper_mxfp4(params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    from moereplay.reference.hopper_mxfp4 import swizzle_hopper_scales, swizzle_hopper_values

    gen = _generator(params)
    experts, k, n = int(params["experts"]), int(params["k"]), int(params["n"])
    if k % 32:
        raise SettingsError(f"MXFP4 needs K a multiple of 32, got {k}")
    values = torch.randint(0, 256, (experts, n, k // 2), generator=gen, dtype=torch.uint8)
    low, high = int(params.get("scale_low", 121)), int(params.get("scale_high", 127))
    scales = torch.randint(low, high, (experts, n, k // 32), generator=gen, dtype=torch.uint8)
    layout = params.get("w13_layout")
    if layout is not None:
        # rows drawn as [gate; up] along N, laid out as asked (a fused w13)
        from moereplay.reference.activation import W13Layout, w13_permutation

        order = w13_permutation(n, W13Layout.GATE_UP_CONCAT, W13Layout(layout))
        values, scales = values[:, order], scales[:, order]
    num_warps = int(params.get("num_warps", 8))
    return {
        "values": swizzle_hopper_values(values.transpose(1, 2), 1, int(params.get("mma_version", 3))),
        "scales": swizzle_hopper_scales(scales.transpose(1, 2), 1, num_warps),
    }


from moereplay.synth import triton_generators  # noqa: E402, F401 - registers triton_moe_experts
