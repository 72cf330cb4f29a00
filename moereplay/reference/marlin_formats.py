"""The weight formats of vLLM 0.25.1's Marlin MoE kernel: exact dequantisation from Marlin-packed tensors, and the
forward direction (logical quantised experts → the tensors vLLM's preparation code hands the kernel).

Formats (``b_q_type`` / scale dtype / extras), and the value of one weight element as the kernel means it:

==============  ==========================  ==============================================================
format          scales                      element value
==============  ==========================  ==============================================================
``NVFP4``       fp8 bytes, group 16,        ``e2m1(q) * s0e5m3(byte) * global_scale[e] * 2**-b``
                "S0E5M3" (see below)        with ``b`` = 126 (bf16 activations) or 14 (fp16)
``MXFP4``       e8m0, group 32 (bf16 only)  ``e2m1(q) * 2**(byte - 127)``
``GPTQ_INT4``   16-bit, channel/group       ``(q - 8) * s``; optional act order (``g_idx``, ``perm``)
``GPTQ_INT8``   16-bit, channel/group       ``(q - 128) * s``; optional act order
``AWQ_INT4``    16-bit + int zero points    ``(q - z) * s``
``AWQ_INT4_FZP`` 16-bit + fp16 zero points  ``(q - z) * s`` (``is_zp_float``; fp16 activations only)
``FP8``         16-bit, channel or group    ``e4m3(q) * s * 2**-b`` with ``b`` = 120 (bf16) or 8 (fp16):
                128, exponent bias fused    vLLM multiplies the stored scales by ``2**b``
``MXFP8``       e8m0, group 32 (bf16 only)  ``e4m3(q) * 2**(byte - 127)``
==============  ==========================  ==============================================================

NVFP4 scales: vLLM converts each fp8-e4m3 scale ``s`` to fp16, multiplies it by ``2**7`` and a power-of-two
``scale_factor`` shared by all experts (chosen so the largest is near 448 * 2**7; 1 for fp16 activations), zeroes
values below 2, shifts the fp16 bits left by one and keeps the high byte: an unsigned 5-bit-exponent (bias 15),
3-bit-mantissa number whose top bit is 1 for every non-zero scale. The global scale is stored multiplied by
``2**(b - 7) / scale_factor`` so that the product above is ``e2m1 * s * global``. The fp16 kernel reads the byte as
that fp16 value; the bf16 kernel maps the exponent to ``128 + low 4 bits``, which is the same number whenever the top
bit is 1 (and ``2**-112`` times smaller when it is not — :func:`dequant_notes` reports such bytes).

Dequantisation is exact in float32 except NVFP4 and FP8, whose per-expert/group factor product rounds once (≤ 1 ulp).
Weights come back dense ``float32[experts, K, N]`` in the *original* row order (act order undone).
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass

import torch

from moereplay.errors import ReferenceError_
from moereplay.reference import marlin_decode
from moereplay.reference import marlin_layout as layout
from moereplay.reference import scalar_types as st
from moereplay.reference.dequant_dense import to_device_async
from moereplay.reference.numerics import decode_e8m0, e2m1_lut


class MarlinWeightFormat(enum.Enum):
    """The weight format of one Marlin MoE call, as the kernel dispatches on it."""

    NVFP4 = "nvfp4"
    MXFP4 = "mxfp4"
    GPTQ_INT4 = "uint4b8"
    GPTQ_INT8 = "uint8b128"
    AWQ_INT4 = "uint4"
    AWQ_INT4_FZP = "uint4-float-zp"
    FP8 = "fp8"
    MXFP8 = "mxfp8"

    @property
    def num_bits(self) -> int:
        return (
            8
            if self in (MarlinWeightFormat.GPTQ_INT8, MarlinWeightFormat.FP8, MarlinWeightFormat.MXFP8)
            else 4
        )

    @property
    def scalar_type(self) -> st.ScalarType:
        return {
            MarlinWeightFormat.NVFP4: st.float4_e2m1f,
            MarlinWeightFormat.MXFP4: st.float4_e2m1f,
            MarlinWeightFormat.GPTQ_INT4: st.uint4b8,
            MarlinWeightFormat.GPTQ_INT8: st.uint8b128,
            MarlinWeightFormat.AWQ_INT4: st.uint4,
            MarlinWeightFormat.AWQ_INT4_FZP: st.uint4,
            MarlinWeightFormat.FP8: st.float8_e4m3fn,
            MarlinWeightFormat.MXFP8: st.float8_e4m3fn,
        }[self]

    @property
    def fixed_group_size(self) -> int | None:
        """The only group size the format allows, or None when channel-wise and several group sizes are legal."""
        return {MarlinWeightFormat.NVFP4: 16, MarlinWeightFormat.MXFP4: 32, MarlinWeightFormat.MXFP8: 32}.get(
            self
        )

    @property
    def has_zero_points(self) -> bool:
        return self in (MarlinWeightFormat.AWQ_INT4, MarlinWeightFormat.AWQ_INT4_FZP)

    @property
    def supports_act_order(self) -> bool:
        return self in (MarlinWeightFormat.GPTQ_INT4, MarlinWeightFormat.GPTQ_INT8)


ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)

_E8M0_DTYPES = (torch.uint8, torch.float8_e8m0fnu)
_FP8_BYTE_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn)


def detect_format(
    b_q_type: st.ScalarType,
    b_scales: torch.Tensor,
    *,
    has_zero_points: bool,
    is_zp_float: bool,
    has_global_scale: bool,
) -> MarlinWeightFormat:
    """Which format a call means, by the kernel's own dispatch (weight type, then the scale dtype)."""
    name = b_q_type.name
    if b_q_type == st.float4_e2m1f:
        if b_scales.dtype == torch.float8_e4m3fn:
            if not has_global_scale:
                raise ReferenceError_("NVFP4 (float4_e2m1f with fp8 scales) needs global_scale")
            return MarlinWeightFormat.NVFP4
        if b_scales.dtype == torch.float8_e8m0fnu:
            return MarlinWeightFormat.MXFP4
        raise ReferenceError_(
            f"float4_e2m1f needs float8_e4m3fn or float8_e8m0fnu scales, got {b_scales.dtype}"
        )
    if has_global_scale:
        raise ReferenceError_(f"global_scale is only used by NVFP4, not by {name}")
    if b_q_type == st.float8_e4m3fn:
        if has_zero_points:
            raise ReferenceError_("float8_e4m3fn weights take no zero points")
        return MarlinWeightFormat.MXFP8 if b_scales.dtype == torch.float8_e8m0fnu else MarlinWeightFormat.FP8
    if b_q_type == st.uint4:
        if not has_zero_points:
            raise ReferenceError_("uint4 weights need zero points (b_qzeros)")
        return MarlinWeightFormat.AWQ_INT4_FZP if is_zp_float else MarlinWeightFormat.AWQ_INT4
    if has_zero_points:
        raise ReferenceError_(f"{name} weights take no zero points")
    if b_q_type == st.uint4b8:
        return MarlinWeightFormat.GPTQ_INT4
    if b_q_type == st.uint8b128:
        return MarlinWeightFormat.GPTQ_INT8
    raise ReferenceError_(f"the Marlin MoE kernel has no weight format {name}")


def fp4_exponent_compensation(activation_dtype: torch.dtype) -> int:
    """``b`` of the NVFP4 row above: the exponent shift of the kernel's fp4 → 16-bit bit trick."""
    _check_activation_dtype(activation_dtype)
    return 126 if activation_dtype == torch.bfloat16 else 14


def fp8_exponent_compensation(activation_dtype: torch.dtype) -> int:
    """``b`` of the FP8 row above (vLLM's ``fp8_fused_exponent_bias_into_scales``)."""
    _check_activation_dtype(activation_dtype)
    return 120 if activation_dtype == torch.bfloat16 else 8


def _check_activation_dtype(dtype: torch.dtype) -> None:
    if dtype not in ACTIVATION_DTYPES:
        raise ReferenceError_(f"the reference supports 16-bit activations only, got {dtype}")


def decode_s0e5m3(codes: torch.Tensor) -> torch.Tensor:
    """NVFP4 Marlin scale bytes → float32: unsigned, exponent 5 bits (bias 15), mantissa 3 bits, no Inf/NaN."""
    raw = (codes.view(torch.uint8) if codes.dtype != torch.uint8 else codes).to(torch.int32)
    exponent = raw >> 3
    mantissa = (raw & 7).to(torch.float32)
    normal = (mantissa + 8.0) * torch.exp2(exponent.to(torch.float32) - 18.0)
    return torch.where(exponent > 0, normal, mantissa * 2.0**-17)


def encode_s0e5m3(values: torch.Tensor) -> torch.Tensor:
    """vLLM's NVFP4 byte extraction from (already ``* 2**7``-ed) 16-bit values: fp16 bits shifted left once, high
    byte. Values below 2 become 0, as vLLM zeroes them first."""
    half = values.to(torch.float16)
    half = torch.where(half < 2, torch.zeros_like(half), half)
    bits = half.view(torch.int16).to(torch.int32) & 0x7FFF
    return ((bits >> 7) & 0xFF).to(torch.uint8)


def _bytes(values: torch.Tensor, allowed: tuple[torch.dtype, ...], what: str) -> torch.Tensor:
    if values.dtype not in allowed:
        raise ReferenceError_(f"{what} must be one of {[str(d) for d in allowed]}, got {values.dtype}")
    return values if values.dtype == torch.uint8 else values.view(torch.uint8)


@dataclass(frozen=True)
class MarlinExpertWeights:
    """The weight-side arguments of one Marlin MoE call, checked and classified (no tensor is copied)."""

    format: MarlinWeightFormat
    activation_dtype: torch.dtype
    b_qweight: torch.Tensor
    b_scales: torch.Tensor
    global_scale: torch.Tensor | None
    b_qzeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    perm: torch.Tensor | None
    size_k: int
    size_n: int

    @property
    def num_experts(self) -> int:
        return int(self.b_qweight.shape[0])

    @property
    def num_groups(self) -> int:
        return int(self.b_scales.shape[1])

    @property
    def has_act_order(self) -> bool:
        return self.g_idx is not None and self.perm is not None

    @property
    def group_size(self) -> int:
        """Rows per scale group (``size_k`` when channel-wise)."""
        return self.size_k // self.num_groups

    @classmethod
    def from_kernel_args(
        cls,
        *,
        b_qweight: torch.Tensor,
        b_scales: torch.Tensor,
        b_q_type: st.ScalarType,
        activation_dtype: torch.dtype,
        size_k: int,
        size_n: int,
        global_scale: torch.Tensor | None = None,
        b_qzeros: torch.Tensor | None = None,
        g_idx: torch.Tensor | None = None,
        perm: torch.Tensor | None = None,
        is_zp_float: bool = False,
    ) -> MarlinExpertWeights:
        _check_activation_dtype(activation_dtype)
        if b_qzeros is not None and b_qzeros.numel() == 0:
            b_qzeros = None
        act_order = g_idx is not None and perm is not None and g_idx.shape[-1] > 0 and perm.shape[-1] > 0
        if not act_order:
            g_idx = perm = None
        fmt = detect_format(
            b_q_type,
            b_scales,
            has_zero_points=b_qzeros is not None,
            is_zp_float=is_zp_float,
            has_global_scale=global_scale is not None and global_scale.numel() > 0,
        )
        bits = fmt.num_bits
        if b_qweight.dim() != 3 or b_qweight.dtype != torch.int32:
            raise ReferenceError_(
                f"b_qweight must be int32 [E, K/16, N*16/pack], got {b_qweight.dtype} {tuple(b_qweight.shape)}"
            )
        num_experts = int(b_qweight.shape[0])
        k, n = layout.marlin_weight_extent(b_qweight, bits)
        if (k, n) != (size_k, size_n):
            raise ReferenceError_(
                f"b_qweight holds K={k} N={n} for {fmt.value}, but size_k={size_k} size_n={size_n}"
            )
        if b_scales.dim() != 3 or b_scales.shape[0] != num_experts or b_scales.shape[2] != size_n:
            raise ReferenceError_(
                f"b_scales must be [E={num_experts}, groups, N={size_n}], got {tuple(b_scales.shape)}"
            )
        groups = int(b_scales.shape[1])
        if groups < 1 or size_k % groups:
            raise ReferenceError_(f"size_k={size_k} is not divisible by the {groups} scale groups")
        fixed = fmt.fixed_group_size
        if fixed is not None and size_k // groups != fixed:
            raise ReferenceError_(f"{fmt.value} needs group size {fixed}, scales give {size_k // groups}")
        if fmt in (MarlinWeightFormat.MXFP4, MarlinWeightFormat.MXFP8) and activation_dtype != torch.bfloat16:
            raise ReferenceError_(f"{fmt.value} is only built for bfloat16 activations")
        if fmt in (MarlinWeightFormat.NVFP4,):
            _bytes(b_scales, _FP8_BYTE_DTYPES, "NVFP4 scales")
        elif fmt in (MarlinWeightFormat.MXFP4, MarlinWeightFormat.MXFP8):
            _bytes(b_scales, _E8M0_DTYPES, "e8m0 scales")
        elif b_scales.dtype not in ACTIVATION_DTYPES:
            raise ReferenceError_(f"{fmt.value} scales must be float16/bfloat16, got {b_scales.dtype}")
        if fmt is MarlinWeightFormat.NVFP4:
            assert global_scale is not None
            if global_scale.numel() != num_experts:
                raise ReferenceError_(
                    f"NVFP4 global_scale needs one value per expert ({num_experts}), got {global_scale.numel()}"
                )
        else:
            global_scale = None
        if b_qzeros is not None:
            if fmt is MarlinWeightFormat.AWQ_INT4_FZP:
                expected = (num_experts, groups, size_n)
            else:
                expected = (num_experts, groups, size_n // layout.pack_factor(bits))
            if tuple(b_qzeros.shape) != expected:
                raise ReferenceError_(
                    f"b_qzeros must be {expected} for {fmt.value}, got {tuple(b_qzeros.shape)}"
                )
        if act_order:
            assert g_idx is not None and perm is not None
            if not fmt.supports_act_order:
                raise ReferenceError_(f"act order (g_idx/perm) is not supported for {fmt.value}")
            if tuple(g_idx.shape) != (num_experts, size_k) or tuple(perm.shape) != (num_experts, size_k):
                raise ReferenceError_(
                    f"g_idx and perm must be [E={num_experts}, K={size_k}], got {tuple(g_idx.shape)} and {tuple(perm.shape)}"
                )
        return cls(
            fmt, activation_dtype, b_qweight, b_scales, global_scale, b_qzeros, g_idx, perm, size_k, size_n
        )

    def dequantize(
        self,
        experts: torch.Tensor | None = None,
        *,
        max_chunk_elements: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Dense ``float32[len(experts), K, N]`` weights (all experts when ``experts`` is None), original row order;
        written into ``out`` when it is a contiguous float32 tensor of that shape (a buffer kept between calls
        saves the page faults of a fresh one).

        Works expert chunk by expert chunk so that no temporary exceeds ~``max_chunk_elements`` elements (default:
        2**26 on the CPU, 2**28 on a GPU — fewer, larger launches). Reads ``experts`` once (one device sync).
        """
        device = self.b_qweight.device
        if experts is None:
            experts = torch.arange(self.num_experts)
        chosen = [int(e) for e in experts.reshape(-1).tolist()]
        if chosen and (min(chosen) < 0 or max(chosen) >= self.num_experts):
            raise ReferenceError_(f"expert index out of range [0, {self.num_experts})")
        if max_chunk_elements is None:
            max_chunk_elements = 1 << (26 if device.type == "cpu" else 28)
        chunk = max(1, max_chunk_elements // max(1, self.size_k * self.size_n))
        shape = (len(chosen), self.size_k, self.size_n)
        if out is None or tuple(out.shape) != shape or out.dtype != torch.float32 or not out.is_contiguous():
            out = torch.empty(shape, dtype=torch.float32, device=device)
        for start in range(0, len(chosen), chunk):
            selected = chosen[start : start + chunk]
            self._dequantize_into(out[start : start + len(selected)], selected)
        return out

    def fast_kind(self) -> str | None:
        """The :mod:`marlin_decode` value kind of this format, or None where only the general decoder applies
        (act order, float zero points)."""
        if self.has_act_order or self.format is MarlinWeightFormat.AWQ_INT4_FZP:
            return None
        return {
            MarlinWeightFormat.NVFP4: "e2m1",
            MarlinWeightFormat.MXFP4: "e2m1",
            MarlinWeightFormat.GPTQ_INT4: "uint4b8",
            MarlinWeightFormat.AWQ_INT4: "uint4",
            MarlinWeightFormat.FP8: "e4m3",
            MarlinWeightFormat.MXFP8: "e4m3",
            MarlinWeightFormat.GPTQ_INT8: "uint8b128",
        }[self.format]

    def _dequantize_into(self, out: torch.Tensor, experts: list[int]) -> None:
        """Dense weights of ``experts`` into ``out`` (``float32[len(experts), K, N]``, contiguous)."""
        device = self.b_qweight.device
        run = experts == list(range(experts[0], experts[0] + len(experts)))
        if run:  # made on the device: no host-to-device copy, no sync
            index = torch.arange(experts[0], experts[0] + len(experts), device=device)
        else:
            index = to_device_async(torch.tensor(experts, dtype=torch.long), device)
        kind = self.fast_kind()
        if kind is None:
            out.copy_(self._dequantize_general(index))
            return
        if run:
            packed = self.b_qweight.narrow(0, experts[0], len(experts))  # no copy
        else:
            packed = self.b_qweight.index_select(0, index)
        scales, zero_points = self.fast_scales(index)
        rows = marlin_decode.slice_rows(self.size_k, self.group_size, self.size_n, device)
        if rows >= self.size_k:
            values = marlin_decode.logical_values(packed, self.format.num_bits, kind)
            marlin_decode.dequantize_into(out, values, scales, zero_points)
            return
        # one expert and a slice of K tiles at a time: the decoder's temporaries stay a few MB on the CPU
        per_group = self.group_size
        for position in range(len(experts)):
            for first in range(0, self.size_k, rows):
                count = min(rows, self.size_k - first)
                groups = slice(first // per_group, -(-(first + count) // per_group))
                values = marlin_decode.logical_values(
                    packed[
                        position : position + 1,
                        first // marlin_decode.TILE_K : (first + count) // marlin_decode.TILE_K,
                    ],
                    self.format.num_bits,
                    kind,
                )
                marlin_decode.dequantize_into(
                    out[position : position + 1, first : first + count],
                    values,
                    scales[position : position + 1, groups],
                    None if zero_points is None else zero_points[position : position + 1, groups],
                )

    def dequantize_columns(
        self,
        expert: int,
        first: int,
        count: int,
        factors: tuple[torch.Tensor, torch.Tensor | None],
    ) -> torch.Tensor:
        """Dense ``float32[K, count]``: columns ``first .. first + count`` of ``expert``'s weight, original row
        order, the same numbers as the same columns of :meth:`dequantize` (each element is one elementwise product
        of one code value and one scale). ``first`` and ``count`` are multiples of 64 (Marlin tiles are 64
        columns wide, and a tile's bytes are one contiguous run of its 16-row slab); ``factors`` is
        :meth:`fast_scales` of ``[expert]``, worked out once for all its column slices. Formats
        :meth:`fast_kind` does not cover raise :class:`ReferenceError_`. Temporaries: about three times the
        result's bytes."""
        kind = self.fast_kind()
        if kind is None:
            raise ReferenceError_(f"{self.format.value} with act order has no column-slice decoder")
        tile_n = 64
        if first % tile_n or count % tile_n or count <= 0 or first + count > self.size_n:
            raise ReferenceError_(
                f"columns {first}..{first + count} are not whole {tile_n}-column tiles of N={self.size_n}"
            )
        bits = self.format.num_bits
        words = tile_n * marlin_decode.TILE_K * bits // 32  # int32 words of one 16 x 64 tile
        packed = self.b_qweight[
            expert : expert + 1, :, first // tile_n * words : (first + count) // tile_n * words
        ]
        values = marlin_decode.logical_values(packed, bits, kind)
        scales, zero_points = factors
        out = torch.empty((1, self.size_k, count), dtype=torch.float32, device=self.b_qweight.device)
        marlin_decode.dequantize_into(
            out,
            values,
            scales[..., first : first + count],
            None if zero_points is None else zero_points[..., first : first + count],
        )
        return out[0]

    def fast_scales(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logical float32 ``[e, G, N]`` scales of ``experts`` (NVFP4: times the expert's factor, one rounding, as
        the general path) and integer zero points (or None), as the fast decoder applies them
        (:meth:`dequantize_columns` takes them)."""
        scales = self._logical_scales(experts)
        if self.format is MarlinWeightFormat.NVFP4:
            scales = scales * self.expert_multipliers(experts).view(-1, 1, 1)
        return scales, self._logical_zero_points(experts)

    def fast_factors(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(scales, offsets)``, float32 ``[e, G, N]`` in logical order for ``experts`` (device ids): the fast
        decoder's weight of code value ``q`` in group ``g``, column ``n`` is ``q * scales[., g, n]``, plus
        ``offsets[., g, n]`` (``−zero · scale``) with integer zero points (None without)."""
        scales, zero_points = self.fast_scales(experts)
        if zero_points is None:
            return scales, None
        return scales, -zero_points * scales

    def dequantize_general(self, experts: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`dequantize` by the general (slow, format-agnostic) decoder; for tests of the fast one."""
        device = self.b_qweight.device
        if experts is None:
            experts = torch.arange(self.num_experts, device=device)
        return self._dequantize_general(experts.to(device=device, dtype=torch.long))

    def _dequantize_general(self, experts: torch.Tensor) -> torch.Tensor:
        fmt = self.format
        bits = fmt.num_bits
        codes = layout.unpack_weights(
            self.b_qweight.index_select(0, experts), bits
        )  # uint8 [e, K, N], packed rows
        values = _decode_codes(fmt, codes)
        del codes
        groups = self.num_groups
        scales = self._logical_scales(experts)  # float32 [e, G, N]
        if fmt is MarlinWeightFormat.NVFP4:  # fold the per-expert factor into the (small) scale tensor
            scales = scales * self.expert_multipliers(experts).view(-1, 1, 1)
        zero_points = self._logical_zero_points(experts)  # float32 [e, G, N] or None
        count, k, n = values.shape
        if self.has_act_order:
            assert self.g_idx is not None and self.perm is not None
            group_of_row = self.g_idx.index_select(0, experts).to(torch.long)  # [e, K], per packed row
            if int(group_of_row.min()) < 0 or int(group_of_row.max()) >= groups:
                raise ReferenceError_(f"g_idx holds a group outside [0, {groups})")
            index = group_of_row.unsqueeze(-1).expand(count, k, n)
            row_scales = torch.gather(scales, 1, index)
            if zero_points is not None:
                values -= torch.gather(zero_points, 1, index)
            values *= row_scales
            del row_scales, index
            # packed row r holds original row perm[r]: scatter back to the original order.
            perm = self.perm.index_select(0, experts).to(torch.long)
            original = torch.empty_like(values)
            original.scatter_(1, perm.unsqueeze(-1).expand(count, k, n), values)
            values = original
        else:
            grouped = values.view(count, groups, k // groups, n)
            if zero_points is not None:
                grouped -= zero_points.unsqueeze(2)
            grouped *= scales.unsqueeze(2)
        return values

    def expert_multipliers(self, experts: torch.Tensor) -> torch.Tensor:
        """NVFP4: ``global_scale[e] * 2**-b`` per expert (float32, from a float64 product); ones otherwise."""
        if self.format is not MarlinWeightFormat.NVFP4:
            return torch.ones(experts.numel(), dtype=torch.float32, device=experts.device)
        assert self.global_scale is not None
        compensation = 2.0 ** -fp4_exponent_compensation(self.activation_dtype)
        chosen = self.global_scale.reshape(-1).index_select(0, experts.to(self.global_scale.device))
        return (chosen.to(torch.float64) * compensation).to(torch.float32).to(experts.device)

    def _logical_scales(self, experts: torch.Tensor) -> torch.Tensor:
        raw = self.b_scales.index_select(0, experts)
        if not self.scales_are_bytes:
            return self._order_scales(self._decode_scales(raw))
        # one-byte codes: reordered as bytes, then decoded through a 256-entry table of this same decoder's values
        # (it works element by element): the same float32 values, with a fraction of the float temporaries
        if self.format is MarlinWeightFormat.NVFP4:
            codes = _bytes(raw, _FP8_BYTE_DTYPES, "NVFP4 scales")
        else:
            codes = _bytes(raw, _E8M0_DTYPES, "e8m0 scales")
        ordered = self._order_scales(codes)
        index = ordered.reshape(-1).to(torch.int32)
        return torch.index_select(self._byte_scale_table(codes.device), 0, index).view(ordered.shape)

    def _byte_scale_table(self, device: torch.device | None = None) -> torch.Tensor:
        """float32 ``[256]``: the value of each one-byte scale code (NVFP4 S0E5M3, e8m0), by the element decoder."""
        return self._decode_scales(torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8))

    @property
    def scales_are_bytes(self) -> bool:
        """Whether the scales are one-byte codes (NVFP4 S0E5M3, e8m0) rather than float16/bfloat16 values."""
        return self.format in (MarlinWeightFormat.NVFP4, MarlinWeightFormat.MXFP4, MarlinWeightFormat.MXFP8)

    def _decode_scales(self, raw: torch.Tensor) -> torch.Tensor:
        """Stored scales (any shape, Marlin order) → float32 values, element by element (FP8: with its exponent
        compensation)."""
        fmt = self.format
        if fmt is MarlinWeightFormat.NVFP4:
            return decode_s0e5m3(_bytes(raw, _FP8_BYTE_DTYPES, "NVFP4 scales"))
        if fmt in (MarlinWeightFormat.MXFP4, MarlinWeightFormat.MXFP8):
            return decode_e8m0(_bytes(raw, _E8M0_DTYPES, "e8m0 scales"))
        scales = raw.to(torch.float32)
        if fmt is MarlinWeightFormat.FP8:
            scales = scales * self._fp8_scale_factor()
        return scales

    def _fp8_scale_factor(self) -> float:
        return 2.0 ** -fp8_exponent_compensation(self.activation_dtype)

    def _order_scales(self, scales: torch.Tensor) -> torch.Tensor:
        """Marlin-ordered ``[..., G, N]`` → logical order (a permutation of each row's columns)."""
        grouped = layout.scales_are_grouped(self.num_groups)
        if self.scales_are_bytes:  # the FP4/MX fragment order swaps the middle two of every 4 first
            scales = layout.swap_scale_pairs(scales)
        return layout.unpermute_scales(scales, grouped)

    def scale_layout(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """How the fast decoder's logical scale of group ``g``, column ``n`` is read from the stored ``b_scales``,
        for a kernel that reads them itself: ``(table, columns)``, on the CPU, with ``columns`` (int64 ``[N]``) the
        stored column of logical column ``n`` (in the same row ``g``) and the value ``table[byte]`` (float32
        ``[256]``, byte formats) or the stored float16/bfloat16 value as float32 (``table`` None), then times
        :meth:`scale_multipliers` — the same float32 operations as :meth:`fast_factors`' scales. Depends only on
        the format, the activation dtype, the number of groups and N."""
        order = torch.arange(self.size_n, dtype=torch.float32).view(1, 1, self.size_n)
        columns = self._order_scales(order)[0, 0].to(torch.int64)
        table = None
        if self.scales_are_bytes:
            table = self._byte_scale_table()
        return table, columns

    def all_scale_multipliers(self) -> torch.Tensor:
        """:meth:`scale_multipliers` of every expert in order, on the weights' device, in one launch or none:
        NVFP4's factors from the whole ``global_scale`` (float32 scales: one float32 product by the power of two,
        correctly rounded like the float64 product's rounding — the same bits), the other formats' constant kept
        per device (shared: read it, do not write it)."""
        per_expert, factor = self.scale_multiplier_parts()
        return per_expert * factor if factor != 1.0 else per_expert

    def scale_multiplier_parts(self) -> tuple[torch.Tensor, float]:
        """``(per_expert, factor)`` with :meth:`all_scale_multipliers` ``= per_expert · factor`` (one float32
        product; factor 1: ``per_expert`` itself), without the launch: a kernel multiplies as it reads. NVFP4's
        float32 ``global_scale`` and the power of two of its exponent compensation; else the multipliers and 1."""
        device = self.b_qweight.device
        if self.format is MarlinWeightFormat.NVFP4:
            assert self.global_scale is not None
            scales = self.global_scale.reshape(-1).to(device)
            if scales.dtype != torch.float32:
                return self.expert_multipliers(torch.arange(self.num_experts, device=device)), 1.0
            # a kernel reads them by expert index: in order, whatever the caller's strides
            return scales.contiguous(), 2.0 ** -fp4_exponent_compensation(self.activation_dtype)
        return _constant_multipliers(self.num_experts, self._constant_multiplier(), device), 1.0

    def scale_multipliers(self, experts: torch.Tensor) -> torch.Tensor:
        """float32 per expert of ``experts`` (on their device) that :meth:`scale_layout`'s values are multiplied by:
        NVFP4's per-expert factor, FP8's exponent compensation, else 1."""
        if self.format is MarlinWeightFormat.NVFP4:
            return self.expert_multipliers(experts)
        return torch.full(
            (experts.numel(),), self._constant_multiplier(), dtype=torch.float32, device=experts.device
        )

    def _constant_multiplier(self) -> float:
        """:meth:`scale_multipliers`' one value for every expert of a format without per-expert factors."""
        return self._fp8_scale_factor() if self.format is MarlinWeightFormat.FP8 else 1.0

    def _logical_zero_points(self, experts: torch.Tensor) -> torch.Tensor | None:
        if self.b_qzeros is None:
            return None
        raw = self.b_qzeros.index_select(0, experts)
        if self.format is MarlinWeightFormat.AWQ_INT4_FZP:
            return layout.unpermute_float_zero_points(raw.to(torch.float32))
        return layout.unpack_zero_points(raw, self.format.num_bits).to(torch.float32)


@functools.cache
def _constant_multipliers(count: int, value: float, device: torch.device) -> torch.Tensor:
    return torch.full((count,), value, dtype=torch.float32, device=device)


def _decode_codes(fmt: MarlinWeightFormat, codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes → float32 values before scales and zero points (integer bias already removed)."""
    if fmt in (MarlinWeightFormat.NVFP4, MarlinWeightFormat.MXFP4):
        return torch.take(e2m1_lut(codes.device), codes.to(torch.long))
    if fmt in (MarlinWeightFormat.FP8, MarlinWeightFormat.MXFP8):
        return codes.view(torch.float8_e4m3fn).to(torch.float32)
    values = codes.to(torch.float32)
    bias = fmt.scalar_type.bias
    if bias:
        values -= float(bias)
    return values


SCAN_BYTES = {"cpu": 1 << 22}
"""Scale bytes examined per pass of torch operations by :func:`dequant_notes`, per device type (the CPU's: 4 MB,
so its boolean temporaries stay small; other devices: every used expert at once). On a GPU with Triton the count
is one kernel pass instead (:func:`marlin_rows.count_scale_bytes`)."""


def _is_e8m0_nan(raw: torch.Tensor) -> torch.Tensor:
    return raw == 0xFF


def _is_fp8_top_bit_clear(raw: torch.Tensor) -> torch.Tensor:
    return ((raw & 0x80) == 0) & (raw != 0)


def _count_scale_bytes(
    weights: MarlinExpertWeights,
    experts: torch.Tensor,
    allowed: tuple[torch.dtype, ...],
    what: str,
    e8m0_nan: bool,
) -> torch.Tensor:
    """How many scale bytes of ``experts`` are e8m0 NaNs (0xFF, ``e8m0_nan``) or non-zero NVFP4 scales with the
    top bit clear: a 0-d int64 on the scales' device, no sync (one Triton pass on a GPU, else torch operations a
    few experts at a time)."""
    predicate = _is_e8m0_nan if e8m0_nan else _is_fp8_top_bit_clear
    scales = weights.b_scales
    per_expert = max(1, scales[0].numel() if scales.shape[0] else 1)
    step = max(1, SCAN_BYTES.get(scales.device.type, 1 << 62) // per_expert)
    if scales.device.type == "cuda":  # one Triton pass where it can run
        from moereplay.reference import marlin_rows

        counted = marlin_rows.count_scale_bytes(_bytes(scales, allowed, what), experts, e8m0_nan)
        if counted is not None:
            return counted
    total = torch.zeros((), dtype=torch.long, device=scales.device)
    experts = experts[experts >= 0]  # a device-routed list ends in −1 entries (no expert)
    for first in range(0, max(int(experts.numel()), 1), step):
        raw = _bytes(scales.index_select(0, experts[first : first + step]), allowed, what)
        total += torch.count_nonzero(predicate(raw))
    return total


@dataclass(frozen=True)
class CountedNote:
    """A :func:`dequant_notes` observation that holds when ``count`` (a 0-d tensor, maybe still being computed on
    the device) is non-zero; ``message`` has a ``{count}`` field."""

    code: str
    message: str
    count: torch.Tensor


Note = tuple[str, str]
"""A weight note: (code, message)."""


def deferred_dequant_notes(weights: MarlinExpertWeights, experts: torch.Tensor) -> list[Note | CountedNote]:
    """:func:`dequant_notes` without waiting for the device, in their order: the notes known now and those that
    depend on counts queued on the device (:func:`resolve_notes` reads all counts with one sync)."""
    notes: list[Note | CountedNote] = []
    fmt = weights.format
    experts = experts.to(weights.b_scales.device, torch.long)
    if fmt is MarlinWeightFormat.NVFP4 and weights.activation_dtype == torch.bfloat16:
        low_count = _count_scale_bytes(weights, experts, _FP8_BYTE_DTYPES, "NVFP4 scales", e8m0_nan=False)
        notes.append(
            CountedNote(
                "nvfp4_scale_top_bit_clear",
                "{count} non-zero NVFP4 scale bytes have the top bit clear; the bf16 kernel reads them 2**-112 "
                "times smaller than their S0E5M3 value",
                low_count,
            )
        )
    if fmt in (MarlinWeightFormat.MXFP4, MarlinWeightFormat.MXFP8):
        nan_count = _count_scale_bytes(weights, experts, _E8M0_DTYPES, "e8m0 scales", e8m0_nan=True)
        notes.append(
            CountedNote(
                "e8m0_nan_scale",
                "{count} e8m0 scale bytes are 0xFF (NaN); the kernel reads them as +Inf",
                nan_count,
            )
        )
    if weights.global_scale is not None and weights.global_scale.dtype != torch.float32:
        notes.append(
            ("global_scale_dtype", f"global_scale is {weights.global_scale.dtype}; the kernel reads float32")
        )
    if (
        fmt not in (MarlinWeightFormat.NVFP4, MarlinWeightFormat.MXFP4, MarlinWeightFormat.MXFP8)
        and weights.b_scales.dtype != weights.activation_dtype
    ):
        notes.append(
            (
                "scale_dtype",
                f"b_scales are {weights.b_scales.dtype} but the activations are {weights.activation_dtype}; "
                "the kernel reads scales as the activation type",
            )
        )
    if weights.has_act_order:
        assert weights.g_idx is not None
        g_idx = weights.g_idx.index_select(0, experts.to(weights.g_idx.device)).to(torch.long)
        uniform = torch.arange(weights.size_k, device=g_idx.device) // weights.group_size
        notes.append(
            CountedNote(
                "g_idx_not_uniform",
                "sorted g_idx is not k // group_size; with is_k_full the kernel uses k // group_size instead",
                (g_idx != uniform).any().to(torch.long),
            )
        )
    return notes


def resolve_notes(notes: list[Note | CountedNote]) -> list[Note]:
    """``notes`` in order, each counted note as its (code, message) when its count is non-zero and left out when
    it is zero (one read of all counts)."""
    return resolve_notes_reading(notes)[0]


def resolve_notes_reading(
    notes: list[Note | CountedNote], extra: torch.Tensor | None = None
) -> tuple[list[Note], list[int]]:
    """:func:`resolve_notes`, and the values of ``extra`` (a 1-d integer tensor, e.g. a device routing's summary)
    read in the same read as the counts (one sync for both)."""
    counted = [note for note in notes if isinstance(note, CountedNote)]
    extra_values: list[int] = []
    if extra is not None:
        parts = [extra.reshape(-1).to(torch.long)]
        parts += [note.count.reshape(1).to(device=extra.device, dtype=torch.long) for note in counted]
        read = torch.cat(parts).tolist()
        extra_values, values = read[: extra.numel()], read[extra.numel() :]
    elif len(counted) > 1:
        values = torch.stack([note.count.to(counted[0].count.device) for note in counted]).tolist()
    else:  # the usual one count (or none): read as it is
        values = [note.count.item() for note in counted]
    counts = iter(values)
    resolved: list[Note] = []
    for note in notes:
        if not isinstance(note, CountedNote):
            resolved.append(note)
        elif count := next(counts):
            resolved.append((note.code, note.message.format(count=count)))
    return resolved, extra_values


def dequant_notes(weights: MarlinExpertWeights, experts: torch.Tensor) -> list[Note]:
    """(code, message) observations about the weight tensors of ``experts`` that the kernel may read differently."""
    return resolve_notes(deferred_dequant_notes(weights, experts))


# ------------------------------------------------------------------------------------------- forward direction


@dataclass(frozen=True)
class PackedExperts:
    """Kernel-ready weight tensors for one Marlin MoE GEMM, plus the exact weights they stand for.

    ``dense`` (float64 ``[E, K, N]``, None when not asked for) is computed directly from the logical quantised values
    (never through the Marlin layout), so comparing it with :meth:`MarlinExpertWeights.dequantize` checks the packing
    and the decoding independently.
    """

    format: MarlinWeightFormat
    activation_dtype: torch.dtype
    b_qweight: torch.Tensor
    b_scales: torch.Tensor
    global_scale: torch.Tensor | None
    b_qzeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    perm: torch.Tensor | None
    b_bias: torch.Tensor | None
    dense: torch.Tensor | None
    dense_bias: torch.Tensor | None
    size_k: int
    size_n: int

    @property
    def is_zp_float(self) -> bool:
        return self.format is MarlinWeightFormat.AWQ_INT4_FZP

    def expert_weights(self) -> MarlinExpertWeights:
        """These tensors as the reference reads them (:meth:`MarlinExpertWeights.from_kernel_args`)."""
        return MarlinExpertWeights.from_kernel_args(
            b_qweight=self.b_qweight,
            b_scales=self.b_scales,
            b_q_type=self.format.scalar_type,
            activation_dtype=self.activation_dtype,
            size_k=self.size_k,
            size_n=self.size_n,
            global_scale=self.global_scale,
            b_qzeros=self.b_qzeros,
            g_idx=self.g_idx,
            perm=self.perm,
            is_zp_float=self.is_zp_float,
        )

    def kernel_kwargs(self) -> dict[str, object]:
        """The weight-side keyword arguments of ``moe_wna16_marlin_gemm``."""
        return {
            "b_qweight": self.b_qweight,
            "b_bias": self.b_bias,
            "b_scales": self.b_scales,
            "global_scale": self.global_scale,
            "b_qzeros": self.b_qzeros,
            "g_idx": self.g_idx,
            "perm": self.perm,
            "b_q_type": self.format.scalar_type.id,
            "is_zp_float": self.is_zp_float,
            "size_k": self.size_k,
            "size_n": self.size_n,
        }


def nvfp4_scale_factor(scales: torch.Tensor, activation_dtype: torch.dtype) -> float:
    """vLLM's shared power-of-two NVFP4 rescale: largest ``s * 2**7 * f`` just below ``448 * 2**7``; 1 for fp16."""
    if activation_dtype == torch.float16:
        return 1.0
    top = scales.to(torch.float32) * 2.0**7
    if top.numel() == 0:
        return 1.0
    peak = float(
        top.max()
    )  # the largest positive scale whenever there is one (a masked copy cost 1.5 s per layer)
    if math.isnan(peak):  # NaN scales take no part: the largest of the positive ones
        positive = top[top > 0]
        if positive.numel() == 0:
            return 1.0
        peak = float(positive.max())
    if peak <= 0:
        return 1.0
    if peak >= 448 * 2.0**7:
        return 1.0
    return float(
        2.0 ** torch.floor(torch.log2(torch.tensor(448 * 2.0**7 / peak, dtype=torch.float64))).item()
    )


def nvfp4_scale_bytes(
    activation_dtype: torch.dtype, factor: float, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """uint8[256]: the Marlin scale byte vLLM 0.25.1 stores for each e4m3 scale byte (``table[b]``), given the
    shared rescale factor (:func:`nvfp4_scale_factor`): the scale as the activation type, then fp16, times the
    factor (through float32), times ``2**7``, the byte of :func:`encode_s0e5m3`."""
    values = torch.arange(256, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    marlin = values.to(activation_dtype).to(torch.float16)
    if factor > 1.0:
        marlin = (marlin.to(torch.float32) * factor).to(torch.float16)
    return encode_s0e5m3(marlin * 2.0**7)


@dataclass(frozen=True)
class PackedScales:
    """The scale side of :func:`pack_experts`: kernel-ready ``b_scales``, ``global_scale`` (NVFP4) and ``b_qzeros``,
    and (when asked for) the exact float64 scale and zero point of every ``(group, n)``."""

    b_scales: torch.Tensor
    global_scale: torch.Tensor | None
    b_qzeros: torch.Tensor | None
    scale_dense: torch.Tensor | None
    zp_dense: torch.Tensor | None


def pack_scales(
    fmt: MarlinWeightFormat,
    scales: torch.Tensor,
    *,
    activation_dtype: torch.dtype = torch.bfloat16,
    global_scale: torch.Tensor | None = None,
    zero_points: torch.Tensor | None = None,
    with_dense: bool = True,
) -> PackedScales:
    """Logical ``[E, groups, N]`` scales (and global scales, zero points) → what vLLM 0.25.1 gives the kernel; the
    arguments are :func:`pack_experts`' (NVFP4 scales may also come as ``float8_e4m3fn`` already). ``with_dense``:
    also the exact float64 scales and zero points (an ``[E, groups, N]`` float64 pass or two; skipped otherwise)."""
    _check_activation_dtype(activation_dtype)
    if scales.dim() != 3:
        raise ReferenceError_("scales must be [E, groups, N]")
    num_experts, groups = scales.shape[:2]
    grouped = layout.scales_are_grouped(groups)
    global_out: torch.Tensor | None = None
    zp_out: torch.Tensor | None = None
    zp_dense: torch.Tensor | None = None
    scale_dense: torch.Tensor | None = None
    if fmt is MarlinWeightFormat.NVFP4:
        if global_scale is None:
            raise ReferenceError_("NVFP4 needs global_scale")
        s_fp8 = scales.to(torch.float8_e4m3fn)
        raw = s_fp8.view(torch.uint8)
        # The rescale factor depends only on which scale values occur, and the stored byte of a scale only on its
        # value and the factor: both are worked out once per e4m3 value (256 of them) — the same operations on the
        # same values as over every scale — and the scales then go through a byte table and the two reorders.
        present = torch.zeros(256, dtype=torch.bool, device=raw.device)
        for expert in range(num_experts):
            present |= torch.bincount(raw[expert].reshape(-1), minlength=256) > 0
        values = torch.arange(256, dtype=torch.uint8, device=raw.device).view(torch.float8_e4m3fn)
        factor = nvfp4_scale_factor(values[present].to(activation_dtype), activation_dtype)
        table = nvfp4_scale_bytes(activation_dtype, factor, raw.device)
        codes = torch.empty(raw.shape, dtype=torch.uint8, device=raw.device)
        for expert in range(num_experts):  # int64 indices of one expert at a time
            stored = torch.take(table, raw[expert].to(torch.int64))
            codes[expert] = layout.swap_scale_pairs(layout.permute_scales(stored, grouped))
        b_scales = codes.view(torch.float8_e4m3fn)
        shift = fp4_exponent_compensation(activation_dtype) - 7
        gs32 = global_scale.to(torch.float32).reshape(num_experts)
        global_out = (gs32 * 2.0**shift) / factor
        if with_dense:
            kept = s_fp8.to(torch.float64) * factor * 2.0**7 >= 2  # vLLM zeroes scales below 2 after * 2**7
            scale_dense = torch.where(kept, s_fp8.to(torch.float64), 0.0) * gs32.to(torch.float64).view(
                -1, 1, 1
            )
    elif fmt in (MarlinWeightFormat.MXFP4, MarlinWeightFormat.MXFP8):
        e8m0 = _bytes(scales, _E8M0_DTYPES, "e8m0 scales") if scales.dtype in _E8M0_DTYPES else None
        if e8m0 is None:
            raise ReferenceError_("MX scales must be e8m0 bytes (uint8 or float8_e8m0fnu)")
        b_scales = layout.swap_scale_pairs(layout.permute_scales(e8m0, grouped)).view(torch.float8_e8m0fnu)
        if with_dense:
            scale_dense = decode_e8m0(e8m0).to(torch.float64)
    else:
        s_16 = scales.to(activation_dtype)
        permuted = layout.permute_scales(s_16, grouped)
        if fmt is MarlinWeightFormat.FP8:
            b_scales = (permuted.to(torch.float32) * 2.0 ** fp8_exponent_compensation(activation_dtype)).to(
                activation_dtype
            )
        else:
            b_scales = permuted
        if with_dense:
            scale_dense = s_16.to(torch.float64)
        if fmt.has_zero_points:
            if zero_points is None:
                raise ReferenceError_(f"{fmt.value} needs zero points")
            if fmt is MarlinWeightFormat.AWQ_INT4_FZP:
                zp_16 = zero_points.to(torch.float16)
                zp_out = layout.permute_float_zero_points(zp_16)
                zp_dense = zp_16.to(torch.float64) if with_dense else None
            else:
                zp_out = layout.pack_zero_points(zero_points.to(torch.uint8), fmt.num_bits)
                zp_dense = zero_points.to(torch.float64) if with_dense else None
    return PackedScales(b_scales.contiguous(), global_out, zp_out, scale_dense, zp_dense)


def pack_experts(
    fmt: MarlinWeightFormat,
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    activation_dtype: torch.dtype = torch.bfloat16,
    global_scale: torch.Tensor | None = None,
    zero_points: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    with_dense: bool = True,
) -> PackedExperts:
    """Logical quantised experts → the tensors vLLM 0.25.1's preparation code gives the kernel.

    ``codes`` uint8/int ``[E, K, N]`` are stored codes (GPTQ: ``q + bias``; fp4/fp8: bit patterns); ``scales``
    ``[E, groups, N]`` are the logical scales: fp8-e4m3 values (NVFP4), e8m0 bytes (MX formats) or real numbers
    (rounded to the activation dtype, as vLLM stores them). ``global_scale`` float32 ``[E]`` (NVFP4),
    ``zero_points`` ``[E, groups, N]`` (int codes, or floats for ``AWQ_INT4_FZP``), ``g_idx`` int ``[E, K]``
    (act order: group of each original row), ``bias`` ``[E, N]``. The parts: :func:`pack_scales`,
    :func:`marlin_layout.pack_weights <moereplay.reference.marlin_layout.pack_weights>`, :func:`pack_bias`.
    """
    _check_activation_dtype(activation_dtype)
    if codes.dim() != 3 or scales.dim() != 3:
        raise ReferenceError_("codes must be [E, K, N] and scales [E, groups, N]")
    _, k, n = codes.shape
    groups = scales.shape[1]
    if k % groups:
        raise ReferenceError_(f"K={k} is not divisible by {groups} groups")
    group_size = k // groups
    codes = codes.to(torch.uint8)
    side = pack_scales(
        fmt,
        scales,
        activation_dtype=activation_dtype,
        global_scale=global_scale,
        zero_points=zero_points,
        with_dense=with_dense,
    )
    if g_idx is not None and not fmt.supports_act_order:
        raise ReferenceError_(f"act order is not supported for {fmt.value}")
    dense = None
    if with_dense:
        assert side.scale_dense is not None
        dense = _dense_weights(fmt, codes, side.scale_dense, side.zp_dense, g_idx, group_size)

    g_idx_out: torch.Tensor | None = None
    perm_out: torch.Tensor | None = None
    stored = codes
    if g_idx is not None:
        g_idx_out, perm_out = layout.sort_act_order(g_idx.to(torch.int32))
        stored = layout.act_order_rows(codes, perm_out)
    b_qweight = layout.pack_weights(stored, fmt.num_bits)
    bias_out, bias_dense = pack_bias(bias, activation_dtype)

    return PackedExperts(
        format=fmt,
        activation_dtype=activation_dtype,
        b_qweight=b_qweight,
        b_scales=side.b_scales,
        global_scale=side.global_scale,
        b_qzeros=side.b_qzeros,
        g_idx=g_idx_out,
        perm=perm_out,
        b_bias=bias_out,
        dense=dense,
        dense_bias=bias_dense,
        size_k=k,
        size_n=n,
    )


def pack_bias(
    bias: torch.Tensor | None, activation_dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Logical ``[E, N]`` bias → (``b_bias`` in the kernel's order and dtype, its exact float64 values)."""
    if bias is None:
        return None, None
    bias_16 = bias.to(activation_dtype)
    return layout.permute_bias(bias_16), bias_16.to(torch.float64)


def _dense_weights(
    fmt: MarlinWeightFormat,
    codes: torch.Tensor,
    scale_dense: torch.Tensor,
    zp_dense: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """float64 ``[E, K, N]`` weights in the original row order, straight from the logical values."""
    num_experts, k, n = codes.shape
    if fmt in (MarlinWeightFormat.NVFP4, MarlinWeightFormat.MXFP4):
        values = e2m1_lut(codes.device).to(torch.float64)[codes.to(torch.long)]
    elif fmt in (MarlinWeightFormat.FP8, MarlinWeightFormat.MXFP8):
        values = codes.view(torch.float8_e4m3fn).to(torch.float64)
    else:
        values = codes.to(torch.float64) - float(fmt.scalar_type.bias)
    if g_idx is not None:
        group_of_row = g_idx.to(torch.long)
    else:
        group_of_row = (torch.arange(k, device=codes.device) // group_size).expand(num_experts, k)
    index = group_of_row.unsqueeze(-1).expand(num_experts, k, n)
    if zp_dense is not None:
        values = values - torch.gather(zp_dense, 1, index)
    return values * torch.gather(scale_dense, 1, index)


@dataclass(frozen=True)
class LogicalExperts:
    """Quantised experts before any Marlin processing: the arguments of :func:`pack_experts` (see there)."""

    format: MarlinWeightFormat
    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None
    zero_points: torch.Tensor | None
    g_idx: torch.Tensor | None
    bias: torch.Tensor | None

    @property
    def group_size(self) -> int:
        return int(self.codes.shape[1] // self.scales.shape[1])

    def to(self, device: torch.device | str) -> LogicalExperts:
        def move(value: torch.Tensor | None) -> torch.Tensor | None:
            return None if value is None else value.to(device)

        return LogicalExperts(
            self.format,
            self.codes.to(device),
            self.scales.to(device),
            move(self.global_scale),
            move(self.zero_points),
            move(self.g_idx),
            move(self.bias),
        )

    def pack(
        self, activation_dtype: torch.dtype = torch.bfloat16, *, with_dense: bool = True
    ) -> PackedExperts:
        return pack_experts(
            self.format,
            self.codes,
            self.scales,
            activation_dtype=activation_dtype,
            global_scale=self.global_scale,
            zero_points=self.zero_points,
            g_idx=self.g_idx,
            bias=self.bias,
            with_dense=with_dense,
        )


def random_logical_experts(
    fmt: MarlinWeightFormat,
    num_experts: int,
    size_k: int,
    size_n: int,
    *,
    group_size: int | None = None,
    act_order: bool = False,
    with_bias: bool = False,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> LogicalExperts:
    """Random quantised experts of one format, drawn on ``device`` (with a ``generator`` of that device).

    ``group_size`` None → the format's fixed size, else channel-wise (integer formats: -1, 32, 64, 128; FP8: -1
    or 128 in the kernel). Scales are drawn so that vLLM's processing loses nothing (NVFP4 scales well above the
    zeroing threshold, e8m0 exponents near 1).
    """
    device = torch.device(device)
    gen = generator if generator is not None else torch.Generator(device).manual_seed(0)
    fixed = fmt.fixed_group_size
    if fixed is not None:
        if group_size not in (None, fixed):
            raise ReferenceError_(f"{fmt.value} has group size {fixed}")
        group_size = fixed
    elif group_size is None or group_size == -1:
        group_size = size_k
    groups = size_k // group_size
    shape_codes = (num_experts, size_k, size_n)
    shape_scales = (num_experts, groups, size_n)

    def uniform(shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
        return torch.rand(shape, generator=gen, dtype=torch.float64, device=device) * (high - low) + low

    def integers(low: int, high: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=gen, dtype=torch.uint8, device=device)

    zero_points = None
    global_scale = None
    g_idx = None
    if fmt in (MarlinWeightFormat.NVFP4, MarlinWeightFormat.MXFP4):
        codes = integers(0, 16, shape_codes)
    elif fmt in (MarlinWeightFormat.FP8, MarlinWeightFormat.MXFP8):
        codes = integers(0, 0x7F, shape_codes) | (integers(0, 2, shape_codes) << 7)  # no NaN (0x7F, 0xFF)
    else:
        codes = integers(0, 1 << fmt.num_bits, shape_codes)
    if fmt is MarlinWeightFormat.NVFP4:
        scales = uniform(shape_scales, 0.5, 440.0).to(torch.float8_e4m3fn).to(torch.float32)
        global_scale = uniform((num_experts,), 1e-5, 1e-3).to(torch.float32)
    elif fmt in (MarlinWeightFormat.MXFP4, MarlinWeightFormat.MXFP8):
        scales = integers(118, 130, shape_scales)
    else:
        scales = uniform(shape_scales, 1e-3, 2e-2)
        if fmt is MarlinWeightFormat.AWQ_INT4:
            zero_points = integers(0, 16, shape_scales)
        elif fmt is MarlinWeightFormat.AWQ_INT4_FZP:
            zero_points = uniform(shape_scales, 0.0, 15.0)
    if act_order:
        if not fmt.supports_act_order or groups < 2:
            raise ReferenceError_("act order needs a GPTQ format with more than one group")
        rows = torch.arange(size_k, device=device) // group_size
        g_idx = torch.stack(
            [rows[torch.randperm(size_k, generator=gen, device=device)] for _ in range(num_experts)]
        ).to(torch.int32)
    bias = uniform((num_experts, size_n), -1.0, 1.0) if with_bias else None
    return LogicalExperts(fmt, codes, scales, global_scale, zero_points, g_idx, bias)


def random_experts(
    fmt: MarlinWeightFormat,
    num_experts: int,
    size_k: int,
    size_n: int,
    *,
    group_size: int | None = None,
    activation_dtype: torch.dtype = torch.bfloat16,
    act_order: bool = False,
    with_bias: bool = False,
    with_dense: bool = True,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> PackedExperts:
    """Random experts of one format, packed like vLLM (for tests and benchmarks); see
    :func:`random_logical_experts`. Packing runs on ``device``."""
    logical = random_logical_experts(
        fmt,
        num_experts,
        size_k,
        size_n,
        group_size=group_size,
        act_order=act_order,
        with_bias=with_bias,
        generator=generator,
    )
    return logical.to(device).pack(activation_dtype, with_dense=with_dense)
