"""Rows grouped by expert, multiplied one used expert at a time: the inner loop the MoE references share.

A MoE reference multiplies each output row by its expert's weight. Done row by row, or expert by expert with a
host sync and a handful of launches per expert, a GPU spends its time waiting for the host (vLLM's Triton fused
MoE reference took 85× the kernel's time at Qwen3-30B-A3B shapes, 128 experts). Here the rows are sorted by
expert once on the host (the routing arrays are small and already there), the operands are gathered and converted
once per run of experts, and the loop issues exactly one matmul per used expert into a preallocated output: no
sync, no temporaries per expert.

Why still one matmul per expert and not one batched product: a BLAS library picks its kernel — and with it the
summation order of every output element — by the operands' shapes, strides and alignment. A reference whose bits
must not change with an optimisation (and rows whose value must not depend on the other rows of the call) keeps
the product it had: ``x[rows of e] @ W[e]`` with the same shapes and strides, on operands aligned like fresh
allocations (:func:`matmul_into`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

ALIGNMENT_BYTES = {"cpu": 64, "cuda": 512}
"""Where fresh tensors start, per device type: the CPU allocator hands out 64-byte multiples, CUDA's caching
allocator 512-byte ones (other device types: 512). A view at another offset is copied before a product reads or
writes it, so a kernel chosen by alignment is the one a fresh per-expert tensor gets."""


def _alignment(tensor: torch.Tensor) -> int:
    return ALIGNMENT_BYTES.get(tensor.device.type, 512)


@dataclass(frozen=True)
class ExpertGroups:
    """Rows stable-sorted by expert: ``order`` (int64 ``[R]``, CPU) lists row positions expert by expert;
    ``experts`` the used experts ascending, ``counts`` their row counts and ``starts`` where each group begins in
    ``order``."""

    order: torch.Tensor
    experts: tuple[int, ...]
    counts: tuple[int, ...]
    starts: tuple[int, ...]


def group_by_expert(expert: torch.Tensor) -> ExpertGroups:
    """Group rows by their expert (int64 ``[R]`` on the CPU, every entry ≥ 0). Cost: one sort of ``R`` ints."""
    order = torch.argsort(expert, stable=True)
    used, counts = torch.unique_consecutive(expert[order], return_counts=True)
    count_list = tuple(int(c) for c in counts.tolist())
    starts, run = [], 0
    for count in count_list:
        starts.append(run)
        run += count
    return ExpertGroups(order, tuple(int(e) for e in used.tolist()), count_list, tuple(starts))


def expert_runs(experts: tuple[int, ...], most: int) -> Iterator[tuple[int, int]]:
    """``(first, length)`` index ranges of ``experts`` (ascending ids) where the ids are consecutive, at most
    ``most`` long: each run's weights are one contiguous slice of the expert dimension (a view, one conversion)."""
    most = max(1, most)
    first = 0
    for index in range(1, len(experts) + 1):
        if index == len(experts) or experts[index] != experts[index - 1] + 1 or index - first == most:
            yield first, index - first
            first = index


def aligned(tensor: torch.Tensor, alignment: int | None = None) -> torch.Tensor:
    """``tensor``, or a fresh contiguous copy when it does not start where a fresh tensor would
    (:data:`ALIGNMENT_BYTES`; ``alignment`` overrides the device's)."""
    if tensor.data_ptr() % (alignment or _alignment(tensor)) == 0:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def matmul_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """``out[:] = x @ weight`` (float matrices, ``out`` contiguous), computed as ``x @ weight`` on freshly aligned
    operands computes it: the same kernel and summation order as the per-expert product of a plain loop. Host
    cost: a few microseconds beyond the matmul's launch."""
    alignment = _alignment(out)
    x = aligned(x, alignment)
    if weight.data_ptr() % alignment:
        weight = aligned(weight.mT, alignment).mT if weight.mT.is_contiguous() else aligned(weight, alignment)
    if out.data_ptr() % alignment == 0:
        torch.mm(x, weight, out=out)
    else:
        out.copy_(torch.mm(x, weight))
