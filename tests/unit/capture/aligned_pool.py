"""Fresh CPU tensors placed as CUDA storages are: a byte ``offset`` past a 256-byte boundary, one boundary apart
(the rings take a source's lead from its address, so a test tensor must sit where a device one would)."""

from __future__ import annotations

import torch

from moereplay.capture.device_ring import ALIGNMENT


class AlignedPool:
    """``take(count, dtype, offset)``: a tensor of ``count`` elements from one preallocated byte pool."""

    def __init__(self, nbytes: int) -> None:
        self.pool = torch.zeros(nbytes, dtype=torch.uint8)
        self.at = 0

    def take(self, count: int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        base = self.pool.data_ptr()
        itemsize = torch.empty(0, dtype=dtype).element_size()
        start = -(-(base + self.at) // ALIGNMENT) * ALIGNMENT - base + offset
        self.at = start + count * itemsize + ALIGNMENT
        assert self.at < self.pool.numel(), "the test pool is full"
        return self.pool[start : start + count * itemsize].view(dtype)
