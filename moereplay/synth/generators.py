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

The two weight generators draw their codes one expert at a time and pack (swizzle) each on a worker thread while the
next is drawn (:mod:`moereplay.synth.expert_pipeline`): the same stream in the same order, so the same bytes as
drawing every tensor whole — which they still do where an expert's codes are not one piece of the stream (FP8's
magnitudes then signs) or its rows move (act order). A gpt-oss w13 set then costs about its serial draw (1.5 s of
half a billion codes on one core) and little more than its packed bytes of memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moereplay.errors import SettingsError
from moereplay.format.tensors import torch_dtype
from moereplay.reference.marlin_formats import MarlinWeightFormat
from moereplay.synth.expert_pipeline import ExpertPipeline, SliceDigests
from moereplay.synth.recipe import Drawn, register_generator


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
drawn as bytes and its float draws are per group (measured, interpreter included: a whole draw — FP8, act order —
peaks at 6–9 bytes per element; the streamed draw of the bundled gpt-oss sets at about 1, their packed output plus a
few experts' codes)."""


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
    return uint8_randint(gen, low, high, torch.empty(shape, dtype=torch.uint8))


def uint8_randint(gen: torch.Generator, low: int, high: int, out: torch.Tensor) -> torch.Tensor:
    """``torch.randint(low, high, generator=gen, out=out)`` for a uint8 ``out``: the same values, and ``gen`` left
    in the same state. With ``low`` 0 and ``high`` a power of two up to 256 on a CPU generator, drawn 1.5x faster:
    both draws take one 32-bit word per element, in the same order; randint keeps its remainder by ``high``, the
    full-range uint8 draw its low 8 bits, and masking those to ``high - 1`` is the same remainder."""
    fast = (
        low == 0
        and 0 < high <= 256
        and high & (high - 1) == 0
        and out.dtype == torch.uint8
        and out.device.type == "cpu"
        and gen.device.type == "cpu"
    )
    if not fast:
        return torch.randint(low, high, out.shape, generator=gen, out=out)
    out.random_(generator=gen)
    if high < 256:
        out.bitwise_and_(high - 1)
    return out


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
    return _marlin_experts(params, streamed=True)


@dataclass(frozen=True)
class _MarlinDraw:
    """The parameters of one ``marlin_experts`` call, checked, and how each expert's drawn values are laid out."""

    fmt: MarlinWeightFormat
    experts: int
    size_k: int
    size_n: int
    group_size: int
    report: bool
    pad_k: int | None
    shards: int
    pad_n: int | None
    order: torch.Tensor | None  # the w13 column order, None when the columns stay as drawn

    @property
    def groups(self) -> int:
        return self.size_k // self.group_size

    @property
    def drawn_k(self) -> int:
        """Rows of codes drawn per expert: the report draws over the padded K."""
        return self.pad_k if self.report and self.pad_k is not None else self.size_k

    @property
    def packed_pad_k(self) -> int | None:
        """Rows the codes are padded to after drawing (the report's padding is drawn, then zeroed)."""
        return None if self.report else self.pad_k

    def interior(self, padded: torch.Tensor, rows: int) -> torch.Tensor:
        """The ``[rows, shards, n]`` view of one expert's padded ``[R, N]`` codes (or scales) that its ``rows``
        drawn rows fill (the rest is padding)."""
        width = self.size_n // self.shards
        if self.pad_n is None:
            return padded[:rows].view(rows, self.shards, width)
        return padded[:rows].view(rows, self.shards, self.pad_n)[..., :width]

    def arrange(self, values: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """``[..., r, n]`` drawn values (codes, scales, zero points) → columns in the w13 layout, each shard padded
        to ``pad_n`` and (``rows``) zero rows appended; any leading dimensions (all experts, or one)."""
        lead = values.shape[:-2]
        values = values.reshape(-1, *values.shape[-2:])
        if self.order is not None:
            values = values[..., self.order]
        if self.pad_n is not None:
            values = _pad_shards(values, self.shards, self.pad_n)
        if rows is not None:
            values = _pad_rows(values, rows)
        return values.reshape(*lead, *values.shape[-2:])


def _marlin_draw(params: Mapping[str, Any]) -> _MarlinDraw:
    fmt = MarlinWeightFormat(params["format"])
    experts, size_k, size_n = int(params["experts"]), int(params["size_k"]), int(params["size_n"])
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
    if style == "report" and fmt is not MarlinWeightFormat.NVFP4:
        raise SettingsError("style 'report' draws NVFP4 weights only")
    order = None
    layout = params.get("w13_layout")
    if layout is not None:
        # codes, scales and bias are drawn as [gate; up] along N; their columns are laid out as asked
        from moereplay.reference.activation import W13Layout, w13_permutation

        order = w13_permutation(size_n, W13Layout.GATE_UP_CONCAT, W13Layout(layout))
    pad_n = params.get("pad_n")
    return _MarlinDraw(
        fmt,
        experts,
        size_k,
        size_n,
        group_size,
        style == "report",
        None if pad_k is None else int(pad_k),
        int(params.get("shards", 1)),
        None if pad_n is None else int(pad_n),
        order,
    )


def _marlin_experts(params: Mapping[str, Any], *, streamed: bool) -> dict[str, torch.Tensor]:
    """``marlin_experts``: ``streamed`` draws and packs the codes one expert at a time (NVFP4 scales too) where the
    format draws its codes in one piece (not FP8/MXFP8: magnitudes then signs) and rows keep their order (no act
    order); otherwise — and for the tests that compare the two — every tensor is drawn whole and packed after."""
    from moereplay.reference.marlin_formats import pack_experts

    draw = _marlin_draw(params)
    fmt = draw.fmt
    gen = _generator(params)
    activation_dtype = _dtype(params.get("activation_dtype", "bfloat16"))
    act_order = bool(params.get("act_order")) and not draw.report  # the report's draw has no act order
    if act_order and (not fmt.supports_act_order or draw.groups < 2):
        raise SettingsError("act order needs a GPTQ format with more than one group")
    two_draws = fmt in (MarlinWeightFormat.FP8, MarlinWeightFormat.MXFP8)
    if streamed and not two_draws and not act_order:
        return _marlin_streamed(draw, gen, activation_dtype, params)

    experts, size_k, size_n, groups = draw.experts, draw.size_k, draw.size_n, draw.groups
    shape_codes = (experts, size_k, size_n)
    shape_scales = (experts, groups, size_n)
    zero_points = global_scale = g_idx = None
    if draw.report:
        # The published report's draw: every code/scale over the padded K first, then the padding zeroed.
        codes = uint8_randint(gen, 0, 16, torch.empty((experts, draw.drawn_k, size_n), dtype=torch.uint8))
        codes[:, size_k:, :] = 0
        scales = _report_scales(gen, draw, (experts,))
        global_scale = torch.rand(experts, generator=gen) * 0.002 + 1e-4
    else:
        if two_draws:
            codes = _integers(gen, 0, 0x7F, shape_codes) | (_integers(gen, 0, 2, shape_codes) << 7)
        else:
            codes = _integers(gen, 0, _code_bound(fmt), shape_codes)
        if fmt is MarlinWeightFormat.NVFP4:
            scales = _nvfp4_scales(gen, shape_scales)
            global_scale = _uniform(gen, (experts,), 1e-5, 1e-3).to(torch.float32)
        else:
            scales, zero_points = _other_scales(gen, fmt, shape_scales)
        if act_order:
            rows = torch.arange(size_k) // draw.group_size
            g_idx = torch.stack([rows[torch.randperm(size_k, generator=gen)] for _ in range(experts)]).to(
                torch.int32
            )
    bias = _bias(gen, params, experts, size_n)
    pad_k = draw.packed_pad_k
    codes = draw.arrange(codes, pad_k)
    scales = draw.arrange(scales, None if pad_k is None else pad_k // draw.group_size)  # zero scales: padding
    if zero_points is not None:
        zero_points = draw.arrange(zero_points, None if pad_k is None else pad_k // draw.group_size)
    packed = pack_experts(
        fmt,
        codes,
        scales,
        activation_dtype=activation_dtype,
        global_scale=global_scale,
        zero_points=zero_points,
        g_idx=g_idx,
        bias=None if bias is None else draw.arrange(bias.unsqueeze(1)).squeeze(1),
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


def _marlin_streamed(
    draw: _MarlinDraw, gen: torch.Generator, activation_dtype: torch.dtype, params: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """The streamed ``marlin_experts`` (see there): the same draws in the same order, each expert's codes packed
    straight into ``b_qweight`` (and its NVFP4 scales rounded and laid out) on a worker while the next expert is
    drawn."""
    from moereplay.reference import marlin_layout
    from moereplay.reference.marlin_formats import pack_bias, pack_scales

    fmt, experts, size_n = draw.fmt, draw.experts, draw.size_n
    pad_k = draw.packed_pad_k
    scale_rows = None if pad_k is None else pad_k // draw.group_size
    final_k = pad_k if pad_k is not None else draw.drawn_k
    final_n = draw.shards * draw.pad_n if draw.pad_n is not None else size_n
    marlin_layout.pack_weights(
        torch.empty(0, final_k, final_n, dtype=torch.uint8), fmt.num_bits
    )  # checks K, N
    b_qweight = torch.empty((experts, final_k // 16, final_n * 16 // (32 // fmt.num_bits)), dtype=torch.int32)

    # Fixed buffers, not a fresh allocation per expert (a few hundred MB of freed 17 MB blocks would stay with the
    # allocator): two to draw into — expert e + 2 reuses e's, which the pipeline has packed by then — and, when the
    # codes are padded, one zeroed buffer whose interior the worker overwrites with each expert's codes.
    drawn = [torch.empty((draw.drawn_k, size_n), dtype=torch.uint8) for _ in range(2)]
    padded = None
    if (final_k, final_n) != (draw.drawn_k, size_n):
        padded = torch.zeros((final_k, final_n), dtype=torch.uint8)

    hashes = SliceDigests()

    def pack(expert: int, codes: torch.Tensor) -> None:
        if draw.order is not None:
            codes = codes[:, draw.order]
        if padded is not None:
            draw.interior(padded, draw.drawn_k).copy_(codes.view(draw.drawn_k, draw.shards, -1))
            codes = padded
        marlin_layout.pack_weights(codes, fmt.num_bits, out=b_qweight[expert])
        hashes.add(b_qweight[expert])

    zero_points = global_scale = None
    with ExpertPipeline() as pipeline:
        for expert in range(experts):
            codes = uint8_randint(gen, 0, _code_bound(fmt), drawn[expert % 2])
            if draw.report:
                codes[draw.size_k :] = 0
            pipeline.submit(pack, expert, codes)
        # the code buffers (two or three experts' worth: 51 MB at gpt-oss shapes) go before the scales are drawn
        pipeline.wait()
        codes = torch.empty(0, dtype=torch.uint8)
        drawn.clear()
        padded = None
        if fmt is MarlinWeightFormat.NVFP4:
            rows = draw.drawn_k // 16 if scale_rows is None else scale_rows
            scales = torch.zeros((experts, rows, final_n), dtype=torch.float8_e4m3fn)  # padding stays zero

            def place(expert: int, uniform: torch.Tensor) -> None:
                values = _report_scale_values(draw, uniform) if draw.report else _nvfp4_scale_values(uniform)
                if draw.order is not None:
                    values = values[..., draw.order]
                # rounded to e4m3 by the copy (the report's float32), as pack_scales would round them
                draw.interior(scales[expert], values.shape[0]).copy_(
                    values.view(values.shape[0], draw.shards, -1)
                )

            for expert in range(experts):  # one expert's draw at a time: the stream is serial
                if draw.report:
                    uniform = _report_scale_draw(gen, draw, ())
                else:
                    uniform = torch.rand((draw.groups, size_n), generator=gen, dtype=torch.float64)
                pipeline.submit(place, expert, uniform)
            if draw.report:
                global_scale = torch.rand(experts, generator=gen) * 0.002 + 1e-4
            else:
                global_scale = _uniform(gen, (experts,), 1e-5, 1e-3).to(torch.float32)
        else:
            scales, zero_points = _other_scales(gen, fmt, (experts, draw.groups, size_n))
            scales = draw.arrange(scales, scale_rows)
            if zero_points is not None:
                zero_points = draw.arrange(zero_points, scale_rows)
        bias = _bias(gen, params, experts, size_n)
    side = pack_scales(
        fmt,
        scales,
        activation_dtype=activation_dtype,
        global_scale=global_scale,
        zero_points=zero_points,
        with_dense=False,
    )
    b_bias, _ = pack_bias(
        None if bias is None else draw.arrange(bias.unsqueeze(1)).squeeze(1), activation_dtype
    )
    outputs = {
        "b_qweight": b_qweight,
        "b_scales": side.b_scales,
        "global_scale": side.global_scale,
        "b_qzeros": side.b_qzeros,
        "b_bias": b_bias,
    }
    kept = {name: value.contiguous() for name, value in outputs.items() if value is not None}
    return Drawn(kept, {"b_qweight": hashes.digests()})


def _code_bound(fmt: MarlinWeightFormat) -> int:
    """One past the largest code a format's single-draw codes take (fp4 bit patterns: 16)."""
    if fmt in (MarlinWeightFormat.NVFP4, MarlinWeightFormat.MXFP4):
        return 16
    return 1 << fmt.num_bits


def _nvfp4_scales(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """NVFP4 scales: uniform in [0.5, 440] rounded to e4m3 (as float32)."""
    return _nvfp4_scale_values(torch.rand(shape, generator=gen, dtype=torch.float64)).to(torch.float32)


def _nvfp4_scale_values(uniform: torch.Tensor) -> torch.Tensor:
    """:func:`_nvfp4_scales` from its float64 draw, as e4m3 (what :func:`_uniform` does with it, then the rounding)."""
    return (uniform * (440.0 - 0.5) + 0.5).to(torch.float8_e4m3fn)


def _report_scales(gen: torch.Generator, draw: _MarlinDraw, lead: tuple[int, ...]) -> torch.Tensor:
    """The report's float32 scales over the padded K (``lead``: all experts, or one), the padding's zeroed."""
    return _report_scale_values(draw, _report_scale_draw(gen, draw, lead))


def _report_scale_draw(gen: torch.Generator, draw: _MarlinDraw, lead: tuple[int, ...]) -> torch.Tensor:
    return torch.rand(*lead, draw.drawn_k // 16, draw.size_n, generator=gen)


def _report_scale_values(draw: _MarlinDraw, uniform: torch.Tensor) -> torch.Tensor:
    scales = uniform * 3 + 0.5
    scales[..., draw.size_k // 16 :, :] = 0
    return scales


def _other_scales(
    gen: torch.Generator, fmt: MarlinWeightFormat, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales (and zero points) of every format but NVFP4, drawn whole (at most an eighth of the codes)."""
    if fmt in (MarlinWeightFormat.MXFP4, MarlinWeightFormat.MXFP8):
        return _integers(gen, 118, 130, shape), None
    scales = _uniform(gen, shape, 1e-3, 2e-2)
    if fmt is MarlinWeightFormat.AWQ_INT4:
        return scales, _integers(gen, 0, 16, shape)
    if fmt is MarlinWeightFormat.AWQ_INT4_FZP:
        return scales, _uniform(gen, shape, 0.0, 15.0)
    return scales, None


def _bias(gen: torch.Generator, params: Mapping[str, Any], experts: int, size_n: int) -> torch.Tensor | None:
    return _uniform(gen, (experts, size_n), -1.0, 1.0) if params.get("bias") else None


# ---------------------------------------------------------------------------------------------------------------
# Hopper MXFP4 for matmul_ogs
# ---------------------------------------------------------------------------------------------------------------


_SWIZZLE_ROWS = 512
"""Rows of one expert's ``[N, K/2]`` bytes swizzled at a time by the streamed ``hopper_mxfp4`` (a multiple of 16)."""


@register_generator("hopper_mxfp4", _hopper_bytes)
def hopper_mxfp4(params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return _hopper_mxfp4(params, streamed=True)


def _hopper_mxfp4(params: Mapping[str, Any], *, streamed: bool) -> dict[str, torch.Tensor]:
    """``hopper_mxfp4``: ``streamed`` draws the values and then the scales one expert at a time and swizzles each on
    a worker while the next is drawn (:func:`_hopper_streamed`); otherwise — for the tests that compare the two —
    they are drawn whole and swizzled after."""
    from moereplay.reference.hopper_mxfp4 import swizzle_hopper_scales, swizzle_hopper_values

    gen = _generator(params)
    experts, k, n = int(params["experts"]), int(params["k"]), int(params["n"])
    if k % 32:
        raise SettingsError(f"MXFP4 needs K a multiple of 32, got {k}")
    low, high = int(params.get("scale_low", 121)), int(params.get("scale_high", 127))
    mma_version, num_warps = int(params.get("mma_version", 3)), int(params.get("num_warps", 8))
    order = None
    layout = params.get("w13_layout")
    if layout is not None:
        # rows drawn as [gate; up] along N, laid out as asked (a fused w13)
        from moereplay.reference.activation import W13Layout, w13_permutation

        order = w13_permutation(n, W13Layout.GATE_UP_CONCAT, W13Layout(layout))
    if streamed:
        return _hopper_streamed(gen, (experts, k, n), (low, high), mma_version, num_warps, order)
    values = uint8_randint(gen, 0, 256, torch.empty((experts, n, k // 2), dtype=torch.uint8))
    scales = torch.randint(low, high, (experts, n, k // 32), generator=gen, dtype=torch.uint8)
    if order is not None:
        values, scales = values[:, order], scales[:, order]
    return Drawn(
        {
            "values": swizzle_hopper_values(values.transpose(1, 2), 1, mma_version),
            "scales": swizzle_hopper_scales(scales.transpose(1, 2), 1, num_warps),
        }
    )


_SWIZZLE_ROWS = 512
"""Rows of one expert's ``[N, K/2]`` value bytes the streamed ``hopper_mxfp4`` swizzles at a time (a multiple of
16: 16 rows fill 4 swizzled ones), so its temporaries are a few hundred KB, not a few times the expert."""


def _hopper_streamed(
    gen: torch.Generator,
    shape: tuple[int, int, int],
    scale_range: tuple[int, int],
    mma_version: int,
    num_warps: int,
    order: torch.Tensor | None,
) -> Drawn:
    """The streamed ``hopper_mxfp4``: the draws of the whole-tensor one in the same order (every expert's values,
    then every expert's scales: a draw of ``[E, ...]`` is its experts' draws one after the other), each expert
    swizzled straight into the outputs on a worker — the values a block of rows at a time, hashed once final."""
    from moereplay.reference.hopper_mxfp4 import (
        HopperScaleShape,
        HopperValueShape,
        swizzle_hopper_scales,
        swizzle_hopper_value_matrix,
    )

    experts, k, n = shape
    rows_pad, cols_pad = HopperValueShape((experts, k // 2, n), 1, mma_version).padded_rows_cols
    values = torch.empty((experts, rows_pad // 4, cols_pad * 4), dtype=torch.uint8)
    scale_rows, scale_cols = HopperScaleShape((k // 32, n), 0, num_warps).padded_rows_cols
    scales = torch.empty((experts, scale_rows // 32, scale_cols * 32), dtype=torch.uint8)
    drawn = [torch.empty((n, k // 2), dtype=torch.uint8) for _ in range(2)]  # expert e + 2 reuses e's
    hashes = SliceDigests()

    def swizzle(expert: int, rows: torch.Tensor) -> None:
        for first in range(0, n, _SWIZZLE_ROWS):
            block = (
                rows[first : first + _SWIZZLE_ROWS]
                if order is None
                else rows[order[first : first + _SWIZZLE_ROWS]]
            )
            target = values[expert, first // 4 : first // 4 + 4 * -(-block.shape[0] // 16)]
            swizzle_hopper_value_matrix(block, target, mma_version)
        hashes.add(values[expert], values[expert].mT)

    def swizzle_scales(expert: int, drawn_scales: torch.Tensor) -> None:
        ordered = drawn_scales if order is None else drawn_scales[order]
        scales[expert].copy_(swizzle_hopper_scales(ordered.mT, 0, num_warps).mT)

    with ExpertPipeline() as pipeline:
        for expert in range(experts):
            rows = uint8_randint(gen, 0, 256, drawn[expert % 2])
            pipeline.submit(swizzle, expert, rows)
        for expert in range(experts):
            drawn_scales = torch.randint(*scale_range, (n, k // 32), generator=gen, dtype=torch.uint8)
            pipeline.submit(swizzle_scales, expert, drawn_scales)
    # the transposed views swizzle_hopper_values / swizzle_hopper_scales hand back
    return Drawn({"values": values.mT, "scales": scales.mT}, {"values": hashes.digests()})


from moereplay.synth import triton_generators  # noqa: E402, F401 - registers triton_moe_experts
