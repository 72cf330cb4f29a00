"""Element decoders for the narrow formats MoE kernels read, as exact float32 values.

Written from the formats' definitions (OCP Microscaling spec v1.0; IEEE-style fp8 of the OCP 8-bit spec):

- e2m1 (fp4): 1 sign, 2 exponent (bias 1), 1 mantissa bit; no Inf/NaN. Magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
  Two values share a byte; element ``2i`` sits in the low nibble of byte ``i``.
- e8m0: an unsigned biased exponent (bias 127); value ``2**(b - 127)``; byte 0xff is NaN.
  Kernels that multiply by a decoded 0xff scale turn every product into NaN (0 × NaN = NaN).
- fp8 e4m3fn / e5m2: decoded through torch's own dtypes, which follow the OCP definitions.

All decoders are pure torch, run on any device and return float32.
"""

from __future__ import annotations

import torch

#: The 16 e2m1 codes in order 0b0000 … 0b1111 (sign is the top bit of the nibble).
E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip


def e2m1_lut(device: torch.device | str = "cpu") -> torch.Tensor:
    """The e2m1 code → value table as a float32 tensor of 16 entries."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def decode_e2m1_codes(codes: torch.Tensor) -> torch.Tensor:
    """Decode integer e2m1 codes (0..15, any integer dtype) to float32."""
    return e2m1_lut(codes.device)[codes.long()]


def unpack_e2m1_bytes(packed: torch.Tensor) -> torch.Tensor:
    """Split uint8 bytes holding two e2m1 codes each into codes along the last dim (low nibble first).

    ``[..., n]`` bytes → ``[..., 2n]`` uint8 codes.
    """
    as_bytes = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    low = as_bytes & 0x0F
    high = (as_bytes >> 4) & 0x0F
    return torch.stack((low, high), dim=-1).flatten(-2)


def pack_e2m1_codes(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unpack_e2m1_bytes`: ``[..., 2n]`` codes → ``[..., n]`` uint8 bytes."""
    if codes.shape[-1] % 2:
        raise ValueError(f"e2m1 packing needs an even last dimension, got {codes.shape[-1]}")
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return (pairs[..., 0] & 0x0F) | ((pairs[..., 1] & 0x0F) << 4)


def decode_e8m0(exponents: torch.Tensor) -> torch.Tensor:
    """Decode e8m0 scale bytes (uint8 or torch.float8_e8m0fnu) to float32; 0xff → NaN."""
    raw = exponents.view(torch.uint8) if exponents.dtype != torch.uint8 else exponents
    values = torch.exp2(raw.to(torch.float32) - 127.0)
    return torch.where(raw == 0xFF, torch.full_like(values, float("nan")), values)


def encode_e8m0(values: torch.Tensor) -> torch.Tensor:
    """Exact powers of two → e8m0 bytes (uint8). Non-powers of two are rounded down in exponent."""
    exponent = torch.floor(torch.log2(values.to(torch.float32))) + 127.0
    return exponent.clamp(0, 254).to(torch.uint8)


def decode_fp8(values: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """Decode fp8 bytes (uint8/int8 storage or an fp8 tensor) of the given fp8 dtype to float32."""
    if values.dtype in (torch.uint8, torch.int8):
        values = values.view(dtype)
    return values.to(torch.float32)
