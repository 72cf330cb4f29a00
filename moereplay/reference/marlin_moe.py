"""Exact fp32 reference for vLLM 0.25.1's ``moe_wna16_marlin_gemm`` (``torch.ops._moe_C``), needing no kernel.

What one call computes (facts from ``csrc/libtorch_stable/moe/marlin_moe_wna16`` and its callers):

- Work is ``num_tokens_past_padded // moe_block_size`` blocks of ``moe_block_size`` entries of
  ``sorted_token_ids``; block ``b`` uses expert ``expert_ids[b]``. An entry ``id < size_m * top_k`` is a slot:
  output row ``id`` is written, from input row ``id // top_k`` (``top_k`` > 1: gemm1, one input row per token;
  ``top_k == 1``: gemm2, pre-expanded rows). Other entries are padding; their rows are not written.
- ``row = input[id // top_k] @ W[expert]`` with ``W`` the dequantised weight (all scales, zero points and, for
  NVFP4, the per-expert global scale; act order uses ``perm`` to pick the input columns).
- Then ``+ b_bias[expert]`` (when given), then ``* topk_weights.flatten()[id]`` when ``mul_topk_weights``:
  ``output[id] = (row + bias) * weight``. The kernel reads ``topk_weights`` as float32 by flat slot index.
- Launch and precision arguments (``workspace``, ``use_atomic_add``, ``use_fp32_reduce``, ``thread_k``,
  ``thread_n``, ``blocks_per_sm``, ``is_k_full``) change how the kernel rounds, not what it means.

The reference computes that mathematics in float32 from the decoded quantised weights (no TF32) and reports which
rows a correct kernel writes, what each row is made of, and any argument the kernel may read differently from its
meaning (:class:`ReferenceNote`). It runs on the inputs' device; only experts that some row uses are dequantised
(:mod:`moereplay.reference.marlin_decode`: three narrow passes over ``used * K * N`` elements), then each used
expert's rows are one float32 matmul (``rows * K * N`` multiply-adds, no TF32). With an :class:`ExpertWeightCache`
a repeated call on the same weight tensors skips the dequantisation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import torch

from moereplay.errors import ReferenceError_
from moereplay.reference import marlin_rows
from moereplay.reference import scalar_types as st
from moereplay.reference.marlin_formats import (
    MarlinExpertWeights,
    MarlinWeightFormat,
    deferred_dequant_notes,
    resolve_notes_reading,
)
from moereplay.reference.marlin_layout import unpermute_bias

#: The block sizes the kernel accepts (8, then multiples of 16 up to 64).
SUPPORTED_BLOCK_SIZES: tuple[int, ...] = (8, 16, 32, 48, 64)


@dataclass(frozen=True)
class ReferenceNote:
    """An observation about the arguments: something the kernel may read differently from what it means.

    ``code`` is a stable identifier (for findings and tests), ``message`` one human sentence.
    """

    code: str
    message: str


@dataclass(frozen=True)
class RowMap:
    """What each output row is, per row of ``output`` (``size_m * top_k`` rows); -1 where the row is not written.

    ``input_row`` is the row of ``input`` it multiplies (the token for gemm1; the expanded slot for gemm2),
    ``expert`` the (local) expert, ``k_slot`` the position among the token's ``top_k`` choices (``id % top_k``),
    ``block`` the moe block that writes it. All int64.
    """

    input_row: torch.Tensor
    expert: torch.Tensor
    k_slot: torch.Tensor
    block: torch.Tensor

    def as_tensor(self) -> torch.Tensor:
        """``int64[rows, 3]`` columns (input_row, expert, k_slot)."""
        return torch.stack((self.input_row, self.expert, self.k_slot), dim=1)


@dataclass(frozen=True)
class MarlinReferenceResult:
    """The reference outcome of one call. All float tensors are float32 on the inputs' device.

    ``output[r] = (gemm[r] + bias_rows[r]) * row_weights[r]`` for written rows, 0 elsewhere.
    """

    output: torch.Tensor
    written: torch.Tensor
    row_map: RowMap
    gemm: torch.Tensor
    bias_rows: torch.Tensor | None
    row_weights: torch.Tensor
    format: MarlinWeightFormat
    activation_dtype: torch.dtype
    experts_used: torch.Tensor
    notes: tuple[ReferenceNote, ...]

    def note_codes(self) -> frozenset[str]:
        return frozenset(note.code for note in self.notes)


class ExpertWeightCache:
    """Keeps dequantised experts between calls on the *same* weight tensor objects (identity + version counter).

    A replay that re-materialises its tensors gets no hits but never stale weights. ``max_bytes`` bounds the
    float32 data kept (least recently used experts go first).
    """

    def __init__(self, max_bytes: int = 8 << 30) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[tuple[object, ...], int], torch.Tensor] = OrderedDict()
        self._sources: dict[int, tuple[weakref.ref[torch.Tensor], ...]] = {}
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _tensors(weights: MarlinExpertWeights) -> tuple[torch.Tensor | None, ...]:
        return (
            weights.b_qweight,
            weights.b_scales,
            weights.global_scale,
            weights.b_qzeros,
            weights.g_idx,
            weights.perm,
        )

    def _key(self, weights: MarlinExpertWeights) -> tuple[object, ...]:
        parts: list[object] = [weights.format, weights.activation_dtype]
        for tensor in self._tensors(weights):
            parts.append(None if tensor is None else (id(tensor), tensor._version))
        return tuple(parts)

    @staticmethod
    def _identity(key: tuple[object, ...]) -> tuple[object, ...]:
        return tuple(part[0] if isinstance(part, tuple) else part for part in key)

    def _alive(self, key: tuple[object, ...], weights: MarlinExpertWeights) -> bool:
        refs = self._sources.get(hash(key))
        if refs is None:
            return False
        current = [t for t in self._tensors(weights) if t is not None]
        return len(refs) == len(current) and all(ref() is t for ref, t in zip(refs, current, strict=True))

    def get(self, weights: MarlinExpertWeights, experts: torch.Tensor) -> torch.Tensor:
        """Dense ``float32[len(experts), K, N]``, from the cache where possible (one copy of the selected experts;
        :meth:`get_each` avoids it)."""
        each = self.get_each(weights, experts)
        if not each:
            return torch.empty(
                (0, weights.size_k, weights.size_n), dtype=torch.float32, device=weights.b_qweight.device
            )
        return torch.stack(each)

    def get_each(self, weights: MarlinExpertWeights, experts: torch.Tensor) -> list[torch.Tensor]:
        """Dense ``float32[K, N]`` of each expert in ``experts`` (cached tensors, not copies: do not modify)."""
        key = self._key(weights)
        if not self._alive(key, weights):
            self._drop_key(key)
            # entries of the same tensors at an older version counter can never be hit again
            identity = self._identity(key)
            for stale in {entry[0] for entry in self._entries if self._identity(entry[0]) == identity}:
                self._drop_key(stale)
            self._sources[hash(key)] = tuple(weakref.ref(t) for t in self._tensors(weights) if t is not None)
        wanted = [int(e) for e in experts.tolist()]
        missing = [e for e in wanted if (key, e) not in self._entries]
        self.hits += len(wanted) - len(missing)
        self.misses += len(missing)
        if missing:
            fresh = weights.dequantize(torch.tensor(missing, device=weights.b_qweight.device))
            for index, expert in enumerate(missing):
                self._entries[(key, expert)] = fresh[index]
                self._bytes += fresh[index].numel() * 4
        for expert in wanted:
            self._entries.move_to_end((key, expert))
        result = [self._entries[(key, expert)] for expert in wanted]
        while self._bytes > self.max_bytes and self._entries:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.numel() * 4
        return result

    def _drop_key(self, key: tuple[object, ...]) -> None:
        for entry in [entry for entry in self._entries if entry[0] == key]:
            self._bytes -= self._entries.pop(entry).numel() * 4
        self._sources.pop(hash(key), None)

    def clear(self) -> None:
        self._entries.clear()
        self._sources.clear()
        self._bytes = 0


@contextlib.contextmanager
def exact_fp32_matmul() -> Iterator[None]:
    """Run float32 matmuls without TF32 (restoring the caller's setting afterwards)."""
    previous = torch.get_float32_matmul_precision()
    if previous == "highest" and not torch.backends.cuda.matmul.allow_tf32:
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(previous)


@dataclass(frozen=True)
class _Rows:
    slot: torch.Tensor  # int64 [R] output row
    expert: torch.Tensor  # int64 [R]
    block: torch.Tensor  # int64 [R]


def _scalar(value: torch.Tensor | int, name: str) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() < 1:
            raise ReferenceError_(f"{name} is empty")
        return int(value.reshape(-1)[0])
    return int(value)


def _route(
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_past_padded: torch.Tensor | int,
    moe_block_size: int,
    num_slots: int,
    num_experts: int,
    notes: list[ReferenceNote],
) -> _Rows:
    """The rows the kernel writes, on the host (numpy: a few thousand integers, each step about a microsecond where
    a torch operation costs several), sorted by output row; the contract checks as notes."""
    total = _scalar(num_tokens_past_padded, "num_tokens_past_padded")
    if total % moe_block_size:
        notes.append(
            ReferenceNote(
                "padded_total_not_multiple",
                f"num_tokens_past_padded={total} is not a multiple of moe_block_size={moe_block_size}; "
                "the kernel processes only whole blocks",
            )
        )
    blocks = max(total // moe_block_size, 0)
    available = min(sorted_token_ids.numel() // moe_block_size, expert_ids.numel())
    if blocks > available:
        notes.append(
            ReferenceNote(
                "padded_total_exceeds_buffers",
                f"num_tokens_past_padded={total} needs {blocks} blocks but the buffers hold {available}; "
                "the kernel reads past them",
            )
        )
        blocks = available
    ids = _host_longs(sorted_token_ids, blocks * moe_block_size).reshape(blocks, moe_block_size)
    block_experts = _host_longs(expert_ids, blocks)
    valid = (ids >= 0) & (ids < num_slots)
    # each check is one cheap test; its details are worked out only when it fails (a note)
    if ids.size and ids.min() < 0:
        notes.append(
            ReferenceNote(
                "negative_sorted_id",
                f"{int((ids < 0).sum())} sorted_token_ids entries are negative; the kernel counts them as rows",
            )
        )
    after_padding = valid[:, 1:] > valid[:, :-1]  # a valid entry right after padding in its block
    if after_padding.any():
        notes.append(
            ReferenceNote(
                "padding_inside_block",
                f"blocks {_short_list(np.flatnonzero(after_padding.any(axis=1)))} have padding before a valid "
                "entry; the kernel writes only the first `count` entries of a block",
            )
        )
    bad_expert = (block_experts < 0) | (block_experts >= num_experts)
    if bad_expert.any():
        dropped = valid & bad_expert[:, None]
        if dropped.any():
            bad_blocks = np.flatnonzero(dropped.any(axis=1))
            notes.append(
                ReferenceNote(
                    "invalid_block_expert",
                    f"blocks {_short_list(bad_blocks)} name an expert outside [0, {num_experts}) "
                    f"({_short_list(block_experts[bad_blocks])}); their rows are left unwritten here",
                )
            )
        valid &= ~bad_expert[:, None]
    positions = np.flatnonzero(valid)
    slot = ids.reshape(-1)[positions]
    # each output row once, from the last block that writes it (the largest position), in row order
    last = np.full(num_slots, -1, dtype=np.int64)
    np.maximum.at(last, slot, positions)
    written = np.flatnonzero(last >= 0)
    if written.size != slot.size:
        counts = np.bincount(slot, minlength=num_slots)
        notes.append(
            ReferenceNote(
                "duplicate_slot",
                f"output rows {_short_list(np.flatnonzero(counts > 1))} are written by more than one block (the "
                "kernel's result depends on timing); the last block is used here",
            )
        )
    block = last[written] // moe_block_size
    return _Rows(torch.from_numpy(written), torch.from_numpy(block_experts[block]), torch.from_numpy(block))


def _host_longs(values: torch.Tensor, count: int) -> np.ndarray:
    """The first ``count`` elements of ``values`` as a host int64 array (a copy where it is not already one)."""
    if values.device.type == "cpu" and values.dtype == torch.long and values.is_contiguous():
        return values.detach().numpy().reshape(-1)[:count]  # no copy (_route only reads it)
    return values.detach().reshape(-1)[:count].to("cpu", torch.long).numpy()


def _row_tables(rows: _Rows, top_k: int, num_slots: int) -> np.ndarray:
    """int64 ``[5, num_slots]`` from the host rows: per output row its :class:`RowMap` fields (input row, expert, k
    slot, block; -1 where no row writes it) and whether it is written (0/1)."""
    slot = rows.slot.numpy()
    tables = np.full((5, num_slots), -1, dtype=np.int64)
    tables[0, slot] = slot // top_k
    tables[1, slot] = rows.expert.numpy()
    tables[2, slot] = slot % top_k
    tables[3, slot] = rows.block.numpy()
    tables[4] = tables[3] >= 0
    return tables


def _fetch_routing(
    sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor, num_tokens_past_padded: torch.Tensor | int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | int]:
    """The routing arguments on the host, those on one device read in one copy (one sync): int64 values (what
    :func:`_route` reads them as), the scalar's first element only."""
    parts: list[torch.Tensor] = [sorted_token_ids.reshape(-1), expert_ids.reshape(-1)]
    scalar = isinstance(num_tokens_past_padded, torch.Tensor) and num_tokens_past_padded.numel() > 0
    if scalar:
        assert isinstance(num_tokens_past_padded, torch.Tensor)
        parts.append(num_tokens_past_padded.reshape(-1)[:1])
    on_device = [i for i, part in enumerate(parts) if part.device.type != "cpu"]
    if len(on_device) < 2 or len({parts[i].device for i in on_device}) > 1:  # nothing to merge
        return sorted_token_ids, expert_ids, num_tokens_past_padded
    # one dtype (int32, as vLLM makes them): one launch joins them and the host widens them
    same = len({parts[i].dtype for i in on_device}) == 1
    host = torch.cat([parts[i] if same else parts[i].to(torch.long) for i in on_device]).cpu().to(torch.long)
    fetched = list(parts)
    at = 0
    for i in on_device:
        fetched[i] = host[at : at + parts[i].numel()]
        at += parts[i].numel()
    return fetched[0], fetched[1], (fetched[2] if scalar else num_tokens_past_padded)


def _short_list(values: torch.Tensor | np.ndarray, limit: int = 8) -> str:
    items = [int(v) for v in values.reshape(-1)[: limit + 1].tolist()]
    text = ",".join(str(v) for v in items[:limit])
    return text + (",…" if len(items) > limit else "")


def _row_weight_notes(topk_weights: torch.Tensor, num_slots: int, notes: list[ReferenceNote]) -> None:
    """The notes on how the kernel reads ``topk_weights`` (flat by slot, as float32 bytes)."""
    if topk_weights.dtype != torch.float32:
        notes.append(
            ReferenceNote(
                "topk_weights_dtype",
                f"topk_weights is {topk_weights.dtype}; the kernel reads its bytes as float32",
            )
        )
    if not topk_weights.is_contiguous():
        notes.append(
            ReferenceNote(
                "topk_weights_layout", "topk_weights is not contiguous; the kernel reads its storage flat"
            )
        )
    if topk_weights.numel() < num_slots:
        notes.append(
            ReferenceNote(
                "topk_weights_short",
                f"topk_weights has {topk_weights.numel()} values for {num_slots} slots; the kernel reads past it",
            )
        )


def _finish_rows(
    gemm: torch.Tensor,
    tables: torch.Tensor,
    b_bias: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(total, bias rows, row weights, written)`` from the product rows with torch operations (what
    :func:`marlin_rows.finish_rows` computes in one launch): ``total = (gemm + bias rows) · row weights``; the row
    weight is ``topk_weights`` read flat by slot (NaN past its end) or 1 (``topk_weights`` None), 0 for rows not
    written; ``tables`` the row tables on ``gemm``'s device (:func:`_row_tables`)."""
    num_slots, size_n = gemm.shape
    written = tables[4].to(torch.bool)
    bias_rows: torch.Tensor | None = None
    # each row its expert's bias row; unwritten rows the zero row after the last expert
    if b_bias is not None:
        bias = unpermute_bias(b_bias.to(gemm.device, torch.float32))
        bias_index = torch.where(tables[1] >= 0, tables[1], bias.shape[0])
        bias_rows = torch.cat((bias, bias.new_zeros((1, size_n)))).index_select(0, bias_index)
    if topk_weights is None:
        row_weights = tables[4].to(torch.float32)  # 1 where written, else 0
        return (gemm.clone() if bias_rows is None else gemm + bias_rows), bias_rows, row_weights, written
    flat = topk_weights.reshape(-1).to(device=gemm.device, dtype=torch.float32)
    if flat.numel() < num_slots:
        flat = torch.cat((flat, flat.new_full((num_slots - flat.numel(),), float("nan"))))
    row_weights = torch.where(written, flat[:num_slots], 0.0)
    weights_column = row_weights.unsqueeze(1)
    total = gemm * weights_column if bias_rows is None else (gemm + bias_rows).mul_(weights_column)
    return total, bias_rows, row_weights, written


def _to_device_together(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Host int64 arrays on ``device`` in one copy (no wait: from a pinned buffer on a GPU), by name, shapes kept.
    Each starts on a 16-byte boundary of the copy (an even element): a kernel given one is compiled for aligned
    pointers whatever the other arrays' sizes, not once more when their parity changes."""
    starts, at = [], 0
    for array in arrays.values():
        starts.append(at)
        at += array.size + array.size % 2
    if device.type == "cuda":
        slot, staging = _STAGING.take(at)
        flat = staging.numpy()
    else:
        flat = np.zeros(at, dtype=np.int64)
    for start, array in zip(starts, arrays.values(), strict=True):
        flat[start : start + array.size] = array.reshape(-1)
    if device.type == "cuda":
        moved = staging[:at].to(device, non_blocking=True)
        _STAGING.copied(slot, device)
    else:
        moved = torch.from_numpy(flat).to(device)
    tensors: dict[str, torch.Tensor] = {}
    for start, (name, array) in zip(starts, arrays.items(), strict=True):
        tensors[name] = moved[start : start + array.size].view(array.shape)
    return tensors


class _PinnedStaging(threading.local):
    """Pinned host buffers (int64) the host tables are written into and copied to a GPU from, reused in turn (one
    set a thread): a buffer is written again only after the copy that read it has run (an event recorded after the
    copy), so reuse never races a queued copy — no pinning and no allocation a call. A call whose buffer's copy of
    four calls back has not run yet waits for it (the reference itself syncs once a call where it reads the
    routing or the weight notes' counts, so it rarely does)."""

    BUFFERS = 4

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.events: list[tuple[torch.cuda.Event, torch.device] | None] = []
        self.turn = 0

    def take(self, count: int) -> tuple[int, torch.Tensor]:
        """(slot, a pinned buffer of at least ``count`` elements) free to write; hand the slot to :meth:`copied`."""
        slot = self.turn
        self.turn = (slot + 1) % self.BUFFERS
        while len(self.buffers) <= slot:
            self.buffers.append(torch.empty(0, dtype=torch.long))
            self.events.append(None)
        recorded = self.events[slot]
        if recorded is not None:
            recorded[0].synchronize()
        if self.buffers[slot].numel() < count:
            size = max(count, 2 * self.buffers[slot].numel(), 4096)
            self.buffers[slot] = torch.empty(0, dtype=torch.long)  # the old one goes first
            self.buffers[slot] = self._allocate(size)
        return slot, self.buffers[slot]

    def _allocate(self, count: int) -> torch.Tensor:
        """A pinned int64 buffer of ``count`` elements."""
        return torch.empty(count, dtype=torch.long, pin_memory=True)

    def copied(self, slot: int, device: torch.device) -> None:
        """Mark the copy just queued from ``slot``'s buffer on ``device``'s current stream."""
        recorded = self.events[slot]
        if recorded is None or recorded[1] != device:
            recorded = (torch.cuda.Event(), device)
            self.events[slot] = recorded
        recorded[0].record(torch.cuda.current_stream(device))


_STAGING = _PinnedStaging()


def reference_moe_wna16_marlin_gemm(
    input: torch.Tensor,
    output: torch.Tensor | None,
    b_qweight: torch.Tensor,
    b_bias: torch.Tensor | None,
    b_scales: torch.Tensor,
    a_scales: torch.Tensor | None,
    global_scale: torch.Tensor | None,
    b_qzeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    perm: torch.Tensor | None,
    workspace: torch.Tensor | None,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_past_padded: torch.Tensor | int,
    topk_weights: torch.Tensor,
    moe_block_size: int,
    top_k: int,
    mul_topk_weights: bool,
    b_q_type: int | st.ScalarType | object,
    size_m: int,
    size_n: int,
    size_k: int,
    is_k_full: bool = True,
    use_atomic_add: bool = False,
    use_fp32_reduce: bool = True,
    is_zp_float: bool = False,
    thread_k: int = -1,
    thread_n: int = -1,
    blocks_per_sm: int = -1,
    *,
    weight_cache: ExpertWeightCache | None = None,
) -> MarlinReferenceResult:
    """The exact result of one ``moe_wna16_marlin_gemm`` call; the arguments are the kernel's, by name and order.

    ``output``, ``workspace`` and the launch/precision arguments are accepted and ignored. Raises
    :class:`ReferenceError_` (one line) for calls the reference cannot compute: 8-bit activations, unknown types,
    inconsistent shapes.
    """
    del output, workspace, use_atomic_add, use_fp32_reduce, thread_k, thread_n, blocks_per_sm, is_k_full
    quant_type = st.as_scalar_type(b_q_type)
    if a_scales is not None and a_scales.numel() > 0:
        raise ReferenceError_("8-bit activations (a_scales) are not supported by the Marlin reference")
    activation_dtype = input.dtype
    if activation_dtype not in (torch.float16, torch.bfloat16):
        raise ReferenceError_(f"the Marlin reference needs float16/bfloat16 input, got {activation_dtype}")
    if moe_block_size < 1:
        raise ReferenceError_(f"moe_block_size={moe_block_size} must be positive")
    if top_k < 1 or size_m < 1:
        raise ReferenceError_(f"top_k={top_k} and size_m={size_m} must be positive")
    if tuple(input.shape) != (size_m, size_k):
        raise ReferenceError_(f"input is {tuple(input.shape)}, expected (size_m={size_m}, size_k={size_k})")
    device = input.device
    weights = MarlinExpertWeights.from_kernel_args(
        b_qweight=b_qweight,
        b_scales=b_scales,
        b_q_type=quant_type,
        activation_dtype=activation_dtype,
        size_k=size_k,
        size_n=size_n,
        global_scale=global_scale,
        b_qzeros=b_qzeros,
        g_idx=g_idx,
        perm=perm,
        is_zp_float=is_zp_float,
    )
    if b_qweight.device != device:
        raise ReferenceError_(f"input is on {device} but b_qweight on {b_qweight.device}")
    num_experts = weights.num_experts
    num_slots = size_m * top_k
    notes: list[ReferenceNote] = []
    if moe_block_size not in SUPPORTED_BLOCK_SIZES:
        notes.append(
            ReferenceNote(
                "unsupported_block_size",
                f"moe_block_size={moe_block_size} is not one the kernel accepts {SUPPORTED_BLOCK_SIZES}",
            )
        )
    if is_zp_float and activation_dtype != torch.float16:
        notes.append(
            ReferenceNote("zp_float_dtype", "the kernel accepts float zero points with float16 input only")
        )

    if b_bias is not None and b_bias.numel() > 0:
        if b_bias.dim() != 2 or tuple(b_bias.shape) != (num_experts, size_n):
            raise ReferenceError_(f"b_bias must be [E={num_experts}, N={size_n}], got {tuple(b_bias.shape)}")
    else:
        b_bias = None

    routing_notes_at = len(notes)
    routed = None
    if (
        marlin_rows.available(device)
        and marlin_rows.usable(weights)
        and weights.b_qzeros is None
        and sorted_token_ids.device == device
    ):
        # routed where the products run: no host round trip before the first launch; the routing notes (rare)
        # are worked out on the host at the end, when the summary read with the call's one sync asks for them
        routed = marlin_rows.route_on_device(
            sorted_token_ids,
            expert_ids,
            num_tokens_past_padded,
            moe_block_size,
            num_slots,
            top_k,
            num_experts,
            size_k,
            size_n,
        )
    routed_gemm = None
    if routed is not None:
        routed_gemm = marlin_rows.expert_rows(
            input,
            weights,
            routed.used,
            routed.plan,
            routed.fields,
            routed.source,
            routed.destination,
            num_slots,
        )
    if routed is not None and routed_gemm is not None:
        gemm = routed_gemm
        experts_used = routed.used  # −1 after the used ones until the summary is read
        tables = routed.tables
        row_experts: torch.Tensor | None = routed.row_experts
    else:  # not routed here, or the products kernel cannot run: the host path from the start
        routed = None
        experts_used, tables, row_experts, gemm = _host_routed_rows(
            input,
            weights,
            sorted_token_ids,
            expert_ids,
            num_tokens_past_padded,
            moe_block_size,
            top_k,
            num_slots,
            notes,
            weight_cache,
        )
    weight_notes_at = len(notes)
    # the weight notes' counts queue behind the products; read at the end with one sync
    weight_notes = deferred_dequant_notes(weights, experts_used)
    if b_bias is not None and b_bias.dtype != activation_dtype:
        notes.append(
            ReferenceNote(
                "bias_dtype", f"b_bias is {b_bias.dtype}; the kernel reads it as {activation_dtype}"
            )
        )
    if mul_topk_weights:
        _row_weight_notes(topk_weights, num_slots, notes)
    # the kernel's order: (row + bias) * weight; unwritten rows are 0 + 0 (times 0)
    finished = None
    if row_experts is not None:  # the products came from the packed-code kernel: its epilogue as well
        finished = marlin_rows.finish_rows(
            gemm, row_experts, b_bias, topk_weights if mul_topk_weights else None
        )
    if finished is not None:
        total, bias_rows, row_weights, written = finished
    else:
        total, bias_rows, row_weights, written = _finish_rows(
            gemm, tables, b_bias, topk_weights if mul_topk_weights else None
        )

    resolved, summary = resolve_notes_reading(weight_notes, routed.summary if routed is not None else None)
    notes[weight_notes_at:weight_notes_at] = [ReferenceNote(code, m) for code, m in resolved]
    if routed is not None:
        read = routed.summary_of(summary)
        experts_used = routed.used[: read["used"]]
        if _routing_needs_notes(read):
            routing_notes: list[ReferenceNote] = []
            _route(
                sorted_token_ids,
                expert_ids,
                num_tokens_past_padded,
                moe_block_size,
                num_slots,
                num_experts,
                routing_notes,
            )
            notes[routing_notes_at:routing_notes_at] = routing_notes
    return MarlinReferenceResult(
        output=total,
        written=written,
        row_map=RowMap(tables[0], tables[1], tables[2], tables[3]),
        gemm=gemm,
        bias_rows=bias_rows,
        row_weights=row_weights,
        format=weights.format,
        activation_dtype=activation_dtype,
        experts_used=experts_used,
        notes=tuple(notes),
    )


def _routing_needs_notes(summary: dict[str, int]) -> bool:
    """Whether a device routing's summary shows anything :func:`_route` has a note for."""
    return bool(
        summary["negative"]
        or summary["after_padding"]
        or summary["dropped"]
        or summary["kept"] != summary["written"]
        or summary["past_buffers"]
        or summary["not_multiple"]
    )


def _host_routed_rows(
    input: torch.Tensor,
    weights: MarlinExpertWeights,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_past_padded: torch.Tensor | int,
    moe_block_size: int,
    top_k: int,
    num_slots: int,
    notes: list[ReferenceNote],
    weight_cache: ExpertWeightCache | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The call routed on the host and its product rows: ``(experts used, row tables, row experts for the
    packed-code epilogue — None where the products came from dense weights —, gemm)``, the routing's notes appended
    to ``notes``."""
    device = input.device
    size_k, size_n = weights.size_k, weights.size_n
    # the routing arrays are small: on a GPU they are read once and routed on the host (numpy: no launch, no
    # sync per step); what the device needs of it goes back in one copy
    if device.type != "cpu":
        sorted_token_ids, expert_ids, num_tokens_past_padded = _fetch_routing(
            sorted_token_ids, expert_ids, num_tokens_past_padded
        )
    rows = _route(
        sorted_token_ids,
        expert_ids,
        num_tokens_past_padded,
        moe_block_size,
        num_slots,
        weights.num_experts,
        notes,
    )
    grouping = _group_rows(rows)
    # every host table goes to the device in one copy; the products are launched right after it
    host_tables = _row_tables(rows, top_k, num_slots)
    tables_on_host = {
        "experts_used": grouping.experts_used.numpy(),
        "slot": rows.slot.numpy(),
        "order": grouping.order.numpy(),
        "tables": host_tables,
        # each row's expert again, on its own: an aligned start for the epilogue kernel whatever the row count
        "row_experts": host_tables[1],
    }
    plan = None
    if marlin_rows.available(device) and marlin_rows.usable(weights):
        # no dense weights: one kernel reads the packed codes (the same weights, a fixed float32 sum order)
        plan = marlin_rows.plan_rows(grouping.per_expert, grouping.experts, size_k, size_n)
        grouped_slots = rows.slot.numpy()[grouping.order.numpy()]
        assert plan.fields is not None
        tables_on_host.update(source=grouped_slots // top_k, destination=grouped_slots, fields=plan.fields)
    moved = _to_device_together(tables_on_host, device)
    experts_used = moved["experts_used"]
    gemm = None
    if plan is not None:
        gemm = marlin_rows.expert_rows(
            input,
            weights,
            experts_used,
            plan,
            moved["fields"],
            moved["source"],
            moved["destination"],
            num_slots,
            every_row=rows.slot.numel() == num_slots,
        )
    if gemm is not None:
        return experts_used, moved["tables"], moved["row_experts"], gemm
    dense: torch.Tensor | Sequence[torch.Tensor] | _ExpertColumns
    dense_bytes = int(experts_used.numel()) * size_k * size_n * 4
    budget = DENSE_BYTES_AT_ONCE.get(device.type, DENSE_BYTES_AT_ONCE["cpu"])
    if weight_cache is not None and dense_bytes <= budget:
        dense = weight_cache.get_each(weights, experts_used)
    elif dense_bytes <= budget:
        dense = weights.dequantize(experts_used)
    elif device.type == "cpu" and weights.fast_kind() is not None and size_n % 64 == 0:
        dense = _ExpertColumns(weights, grouping.experts)
    else:
        dense = _ExpertsInChunks(weights, experts_used, budget // 4)
    slot = moved["slot"]
    grouping = dataclasses.replace(grouping, order=moved["order"])
    gemm = torch.zeros((num_slots, size_n), dtype=torch.float32, device=device)
    gemm[slot] = _expert_rows_matmul(input, slot, top_k, grouping, dense, size_n)
    return experts_used, moved["tables"], None, gemm


@dataclass(frozen=True)
class _Grouping:
    order: torch.Tensor  # int64 [R]: rows sorted by expert (stable)
    experts_used: torch.Tensor  # int64 [U]: the experts rows use, ascending (on the rows' device)
    experts: list[int]  # the same on the host
    per_expert: list[int]  # rows of each used expert, in experts_used order


def _group_rows(rows: _Rows) -> _Grouping:
    """The used experts, their row counts and the rows' stable order by expert, from the host rows."""
    expert = rows.expert.numpy()
    experts_used, counts = np.unique(expert, return_counts=True)
    order = np.argsort(expert, kind="stable")
    return _Grouping(
        torch.from_numpy(order), torch.from_numpy(experts_used), experts_used.tolist(), counts.tolist()
    )


DENSE_BYTES_AT_ONCE = {"cpu": 256 << 20, "cuda": 8 << 30}
"""Largest dense float32 weight set (bytes) dequantized at once, and cached, per device type. A bigger one (a
gpt-oss layer on the CPU: 32 experts × 2880 × 5888 × 4 B = 2.2 GB) is decoded while the matmuls consume it: on the
CPU a 4 MB column slice of one expert at a time (:class:`_ExpertColumns`) for the formats the fast decoder covers,
else a quarter of the budget at a time (:class:`_ExpertsInChunks`: act order, float zero points). On the 2-CPU
development machine 256 MB rather than 512 MB took the report capture's offline run from 0.61 to 0.49 GB peak at the
same speed."""


class _ExpertsInChunks(Sequence[torch.Tensor]):
    """The dense ``float32[K, N]`` of ``experts[index]``, dequantized a chunk of experts at a time (at most
    ``chunk_bytes`` of them, at least one) when first asked for; only the current chunk is kept. Indices are read in
    order by the matmul loop, so each expert is dequantized once."""

    def __init__(self, weights: MarlinExpertWeights, experts: torch.Tensor, chunk_bytes: int) -> None:
        self._weights = weights
        self._experts = experts
        self._per_chunk = max(1, chunk_bytes // (weights.size_k * weights.size_n * 4))
        self._start = -1
        self._chunk: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self._experts.numel())

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[torch.Tensor]: ...

    def __getitem__(self, index: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if self._chunk is None or not self._start <= index < self._start + self._chunk.shape[0]:
            # the next chunk overwrites the previous one's buffer (same size: no fresh pages), else replaces it
            self._start = index - index % self._per_chunk
            wanted = min(self._per_chunk, len(self) - self._start)
            if self._chunk is not None and self._chunk.shape[0] != wanted:
                self._chunk = None  # a shorter last chunk: free the full one before allocating it
            self._chunk = self._weights.dequantize(
                self._experts[self._start : self._start + self._per_chunk], out=self._chunk
            )
        return self._chunk[index - self._start]


COLUMN_SLICE_BYTES = 4 << 20
"""Dense float32 bytes of one column slice of an expert that :class:`_ExpertColumns` decodes (whole 64-column
tiles, at least one)."""


class _ExpertColumns:
    """The dense weights of the used experts (host order ``experts``), decoded a column slice at a time, for weight
    sets too big to decode whole on the CPU: one slice of :data:`COLUMN_SLICE_BYTES` and its decoder temporaries
    (about three times that) at a time instead of a whole expert (68 MB at gpt-oss shapes). The columns of a
    product are the same numbers as the whole product's (the float32 sum over K of each output element does not
    depend on the other columns). Decoding stays on the calling thread with its intra-op threads: on worker
    threads with one intra-op thread each it took 1.7–2.3× longer on a 2-CPU machine (the products' OpenMP
    threads spin between them)."""

    def __init__(self, weights: MarlinExpertWeights, experts: list[int]) -> None:
        self._weights = weights
        self._experts = experts
        tiles = max(1, COLUMN_SLICE_BYTES // (weights.size_k * 4 * 64))
        self.width = min(weights.size_n, tiles * 64)

    def __len__(self) -> int:
        return len(self._experts)

    def slices(self, index: int) -> Iterator[tuple[int, torch.Tensor]]:
        """``(first column, float32[K, width])`` of ``experts[index]``, left to right."""
        weights = self._weights
        expert = self._experts[index]
        factors = weights.fast_scales(torch.tensor([expert]))
        for first in range(0, weights.size_n, self.width):
            yield (
                first,
                weights.dequantize_columns(expert, first, min(self.width, weights.size_n - first), factors),
            )


def _expert_rows_matmul(
    input: torch.Tensor,
    slot: torch.Tensor,
    top_k: int,
    grouping: _Grouping,
    dense: torch.Tensor | Sequence[torch.Tensor] | _ExpertColumns,
    size_n: int,
) -> torch.Tensor:
    """``input[slot // top_k] @ dense[expert]`` for every row (``slot``: the rows' output rows, on the device): the
    rows grouped by expert, one float32 matmul per used expert (no TF32), reading each expert's dense weight once
    and copying none. No device sync.

    A row's result should depend as little as possible on which other rows the call has: BLAS libraries compute a
    one-row product on a GEMV path that sums differently from their GEMM path, so a lone row is multiplied as a
    two-row matrix with a zero row. Beyond that the library picks its kernel by the row count too (MKL: row 0 of an
    M-row product differs in its last bits from the two-row product for M ≥ 4 at K 2944), so a row of an expert
    with many rows may round differently from the same row alone; the shape bisection judges each call against its
    own reference, with tolerances, and does not depend on it.
    """
    count = slot.numel()
    if count == 0:
        return torch.zeros((0, size_n), dtype=torch.float32, device=input.device)
    order = grouping.order
    x_rows = input.index_select(0, slot[order] // top_k).to(torch.float32)
    grouped = torch.empty((count, size_n), dtype=torch.float32, device=input.device)
    lone = torch.empty((2, size_n), dtype=torch.float32, device=input.device)
    pair = torch.zeros((2, input.shape[1]), dtype=torch.float32, device=input.device)
    operand = pair
    start = 0
    with exact_fp32_matmul():
        for index, rows_of_expert in enumerate(grouping.per_expert):
            if isinstance(dense, _ExpertColumns):
                operand = pair if rows_of_expert == 1 else x_rows[start : start + rows_of_expert]
                if rows_of_expert == 1:
                    pair[0] = x_rows[start]
                for first, columns in dense.slices(index):
                    part = torch.mm(operand, columns)
                    grouped[start : start + rows_of_expert, first : first + columns.shape[1]] = part[
                        :rows_of_expert
                    ]
            elif rows_of_expert == 1:
                pair[0] = x_rows[start]
                torch.mm(pair, dense[index], out=lone)
                grouped[start] = lone[0]
            elif rows_of_expert:
                torch.mm(
                    x_rows[start : start + rows_of_expert],
                    dense[index],
                    out=grouped[start : start + rows_of_expert],
                )
            start += rows_of_expert
    x_rows = operand = torch.empty(0)  # the gathered rows go before the ordered copy
    product = torch.empty_like(grouped)
    product[order] = grouped
    return product
