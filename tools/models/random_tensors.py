"""Seeded random tensors for the checkpoint generators: one generator per tensor name, vectorised, on any device.

Each tensor's content depends only on (seed, tensor name, device kind), not on the order tensors are made in, so a
shard can be rewritten alone and two generators agree tensor by tensor. CUDA and CPU generators differ: a model
made with ``--device cuda`` has other weights than one made on the CPU from the same seed (both are valid).

Cost: random bytes come from 64-bit draws viewed as bytes (8 bytes a draw: ~0.4 GB/s a CPU core, far more on a
GPU); normals are drawn in float32 and rounded to the target dtype once.
"""

from __future__ import annotations

import hashlib
import math

import torch


class TensorSource:
    """Random tensors for a seed on a device; every method takes the tensor's name."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed = seed
        self.device = device

    def generator(self, name: str) -> torch.Generator:
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        generator = torch.Generator(device=self.device)
        generator.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        return generator

    def normal(
        self, name: str, shape: tuple[int, ...], std: float, dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        values = torch.randn(shape, generator=self.generator(name), device=self.device, dtype=torch.float32)
        return (values * std).to(dtype)

    def random_bytes(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Uniform bytes 0…255 (so each 4-bit nibble is uniform over 0…15)."""
        count = math.prod(shape)
        words = torch.randint(
            -(2**63), 2**63 - 1, (-(-count // 8),), generator=self.generator(name), device=self.device,
            dtype=torch.int64,
        )  # fmt: skip
        return words.view(torch.uint8)[:count].reshape(shape)

    def random_int32(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Uniform 32-bit words (eight uniform 4-bit nibbles each)."""
        count = math.prod(shape)
        return self.random_bytes(name, (count * 4,)).view(torch.int32).reshape(shape)

    def uniform(self, name: str, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
        values = torch.rand(shape, generator=self.generator(name), device=self.device, dtype=torch.float32)
        return low + (high - low) * values


def pick_device(name: str) -> torch.device:
    """``auto`` → the GPU when there is one (generation is then a few seconds), else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
