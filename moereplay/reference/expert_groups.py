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

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

_T = TypeVar("_T")

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


def on_threads(function: Callable[..., _T], jobs: Sequence[tuple[Any, ...]]) -> list[_T]:
    """``[function(*job) for job in jobs]``, the jobs spread over ``torch.get_num_threads()`` worker threads that
    run torch with one intra-op thread each (restored after), for many small independent jobs — an expert's
    products a slice of columns at a time: each small operator split over the intra-op threads would wait at a
    barrier for all of them, and on a loaded machine (or beside another thread of this process) a barrier waits
    for a descheduled thread's time slice. Results in job order; the first job's error (in job order) is raised."""
    threads = min(torch.get_num_threads(), len(jobs))
    if threads <= 1:
        return [function(*job) for job in jobs]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moereplay-experts") as pool:
            futures = [pool.submit(function, *job) for job in jobs]
            try:
                return [future.result() for future in futures]
            finally:
                for future in futures:
                    future.cancel()
    finally:
        torch.set_num_threads(before)


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


BATCHED_DEVICE_TYPES = frozenset({"cuda"})
"""Device types whose references multiply bucketed experts with one batched product per bucket
(:func:`batched_matmul_into`) instead of one product per expert. On an H200, Qwen3-30B-A3B's gemm1 rows (126 used
experts of 1–11 rows, K 2048, N 1536, weights already float32) take 2.9 ms as 126 ``torch.mm`` calls — host-bound
at about 23 µs of host time each — and 1.0 ms as bucketed ``W_e · x_eᵀ`` batched products
(``tools/bench/expert_matmul_bench.py``). The CPU keeps the per-expert loop: its bits are the recorded snapshots'."""


SMALL_GROUP_ROWS = 16
"""Groups of at most this many rows share one bucket, padded to the largest of them: a product of that few rows
reads each float32 weight for at most 32 flops (16 multiply-adds), below the flops an H200 can do per byte it
reads (about 14 per byte in float32), so the padding costs no time and the decode-shaped calls become one product
over the experts in ascending order (their weights converted in runs of consecutive ids)."""


def row_buckets(counts: tuple[int, ...]) -> dict[int, list[int]]:
    """Group indices by padded row count: groups of at most :data:`SMALL_GROUP_ROWS` rows in one bucket padded to
    the largest of them, a larger group of ``c`` rows in the bucket of the next power of two ≥ ``c`` (at most 2×
    its rows; at most ``log2(max count)`` such buckets). Empty groups are left out."""
    buckets: dict[int, list[int]] = {}
    small = [i for i, count in enumerate(counts) if 0 < count <= SMALL_GROUP_ROWS]
    if small:
        buckets[max(counts[i] for i in small)] = small
    for index, count in enumerate(counts):
        if count > SMALL_GROUP_ROWS:
            buckets.setdefault(1 << (count - 1).bit_length(), []).append(index)
    return dict(sorted(buckets.items()))


def gather_experts(
    source: torch.Tensor, experts: Sequence[int], dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``source[experts]`` along dimension 0 as a fresh contiguous tensor of ``dtype`` (default ``source``'s): one
    copy — converting as it copies — per run of consecutive ids, so a float32 conversion of stored weights is one
    pass over them, with no gathered copy in their own dtype first (a byte-wide gather of fp8 or int8 weights is
    slow on a GPU). Cost: ``len(experts)`` elements written, one launch per run."""
    out = torch.empty((len(experts), *source.shape[1:]), dtype=dtype or source.dtype, device=source.device)
    ids = tuple(int(e) for e in experts)
    for first, length in expert_runs(ids, max(1, len(ids))):
        out.narrow(0, first, length).copy_(source.narrow(0, ids[first], length))
    return out


def batched_matmul_into(
    out: torch.Tensor,
    x: torch.Tensor,
    groups: ExpertGroups,
    members: list[int],
    weights_of: Callable[[tuple[int, ...]], torch.Tensor],
    most_elements: int,
) -> None:
    """``out[rows of g] = x[rows of g] @ W[e_g]ᵀ`` for the groups ``members`` (indices into ``groups.experts``;
    ``out`` and ``x`` hold the rows in group order, ``groups.starts``), one ``torch.bmm`` per bucket of groups of
    similar row counts (:func:`row_buckets`) zero-padded to the bucket's size. ``weights_of(experts)`` (expert ids,
    ascending) gives the ``[G, N, K]`` float weights, at most ``most_elements`` elements of them at a time.

    The product is taken as ``W · x_paddedᵀ`` (``[G, N, pad]``): batched skinny products in that orientation run
    at about three times the speed of ``x · Wᵀ`` on an H200. Every row is still its own float32 dot products
    (padding rows are zeros and are dropped), but the summation order is the batched kernel's, so the bits may
    differ from a per-expert loop by float32 rounding. Cost: the products, plus one gather of the padded rows, one
    transpose of the bucket's result and one scatter per bucket; a few host microseconds per bucket, none per
    expert."""
    device = x.device
    rows, k = int(x.shape[0]), int(x.shape[1])
    n = int(out.shape[1])
    counts = torch.tensor(groups.counts, dtype=torch.long)
    starts = torch.tensor(groups.starts, dtype=torch.long)
    wanted = set(members)
    chosen = row_buckets(tuple(c if i in wanted else 0 for i, c in enumerate(groups.counts)))
    most = max(1, most_elements // max(1, k * n))
    # every part's index vectors on the host first, then one host-to-device copy (a copy from pageable memory
    # waits for the device: one per part would serialise the host's planning with the products)
    plans: list[tuple[int, int, int, tuple[int, ...]]] = []  # (pad, source elements, valid rows, experts)
    pieces: list[torch.Tensor] = []
    for pad, bucket in chosen.items():
        for first in range(0, len(bucket), most):
            part = torch.tensor(bucket[first : first + most], dtype=torch.long)
            slot = torch.arange(pad)
            valid = slot[None, :] < counts[part][:, None]  # [G, pad]
            source = torch.where(valid, starts[part][:, None] + slot[None, :], rows).reshape(-1)
            flat_valid = valid.reshape(-1).nonzero().reshape(-1)
            pieces += [source, flat_valid, source[flat_valid]]
            plans.append(
                (pad, source.numel(), flat_valid.numel(), tuple(groups.experts[i] for i in part.tolist()))
            )
    if not plans:
        return
    on_device = torch.cat(pieces).to(device)
    padded_x = torch.cat((x, x.new_zeros(1, k)))  # row ``rows`` is the zero padding
    at = 0
    for pad, total, live, experts in plans:
        source_d = on_device[at : at + total]
        valid_d = on_device[at + total : at + total + live]
        target_d = on_device[at + total + live : at + total + 2 * live]
        at += total + 2 * live
        activations = padded_x.index_select(0, source_d).view(-1, pad, k)
        product = torch.bmm(weights_of(experts), activations.transpose(1, 2))  # [G, N, pad]
        out.index_copy_(0, target_d, product.transpose(1, 2).reshape(-1, n).index_select(0, valid_d))
        del product
