"""Guard-banded materialisation of a call's tensors.

Every tensor gets its own allocation — every top-level tensor argument, and every tensor *leaf* inside an opaque
argument for ops that name them (``op.tensor_leaves``: ``precision_config.weight_scale.storage`` …): ``guard``
bytes of fill pattern, the bytes of the storage span its view covers, ``guard`` bytes of fill pattern. The view keeps its shape, strides and its position relative to the
span, so a kernel sees the same layout it saw when captured; what it reads outside the span is the fill pattern,
and what it writes there shows up in :meth:`GuardedArgs.damage`.

Arguments that are views of one storage (aliasing) share one allocation covering the union of their spans, so
aliasing survives the replay. Cost: one allocation + one copy per storage; the guard check is two comparisons per
allocation on the allocation's device (one host sync for all of them).

A :class:`BufferPool` makes a sweep cheap without weakening "every run starts from fresh buffers": allocations are
reused across runs (no allocator calls, no host→device guard copies — the guard patterns stay on the device), but
every byte of a reused allocation is rewritten before the kernel sees it: both guard bands from the pattern, the
span from the argument's source tensor (the loaded call's pristine copy, never handed to a kernel). So a kernel that
scribbles on an input, inside its span or in its guards, changes nothing the next run sees; its guard writes are
still reported by :meth:`GuardedArgs.damage` of the run that made them. Re-copying every input (weights included)
is deliberate: a device-to-device copy costs about what a checksum proving "unchanged" would (both read every
byte), and unlike a checksum it cannot miss a write.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from moereplay.replay.mutations import FillPattern

DEFAULT_GUARD_BYTES = 4096
"""Bytes of guard band on each side: a multiple of every element size and of 16-byte vector loads, and larger than
the over-reads a tile-based kernel makes past a short buffer (one tile row)."""


@dataclass(frozen=True)
class GuardDamage:
    """Guard bytes that changed: an out-of-bounds write by the kernel.

    ``first``/``last`` are byte offsets relative to the argument's span: negative before its first byte (``-1`` is the
    byte just before), ``>= span_bytes`` after its end. ``count`` is the number of changed bytes.
    """

    arg: str
    side: Literal["before", "after"]
    first: int
    last: int
    count: int
    span_bytes: int

    def describe(self) -> str:
        if self.side == "after":
            lo, hi = self.first - self.span_bytes, self.last - self.span_bytes
            where = f"bytes {lo}..{hi} past the end"
        else:
            where = f"bytes {-self.last}..{-self.first} before the start"
        return f"{self.arg}: {self.count} guard bytes written, {where} (span {self.span_bytes} bytes)"


def _span_elements(tensor: torch.Tensor) -> tuple[int, int]:
    """(first element offset in storage, number of elements) covered by the view."""
    if tensor.numel() == 0:
        return int(tensor.storage_offset()), 0
    extent = 1 + sum(
        (size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return int(tensor.storage_offset()), int(extent)


@dataclass
class _Allocation:
    """One guarded allocation holding one storage's span (possibly shared by several argument views)."""

    names: tuple[str, ...]
    buffer: torch.Tensor  # uint8: guard | span | guard
    guard: int
    span_bytes: int
    before: torch.Tensor  # expected guard bytes (on the buffer's device)
    after: torch.Tensor

    def damage(self) -> list[GuardDamage]:
        head = self.buffer[: self.guard]
        tail = self.buffer[self.guard + self.span_bytes :]
        found: list[GuardDamage] = []
        label = "+".join(self.names)
        for side, region, expected in (("before", head, self.before), ("after", tail, self.after)):
            changed = torch.nonzero(region != expected).flatten()
            if changed.numel() == 0:
                continue
            first, last = int(changed[0]), int(changed[-1])
            if side == "after":
                found.append(
                    GuardDamage(
                        label,
                        "after",
                        first + self.span_bytes,
                        last + self.span_bytes,
                        changed.numel(),
                        self.span_bytes,
                    )
                )
            else:
                # offsets relative to the span start: -1 is the byte just before it
                found.append(
                    GuardDamage(
                        label,
                        "before",
                        first - self.guard,
                        last - self.guard,
                        changed.numel(),
                        self.span_bytes,
                    )
                )
        return found


@dataclass(frozen=True)
class GuardWindow:
    """Fill only bytes ``[start, stop)`` of one side of one argument's guard with ``pattern`` (the rest of the guard
    keeps the call's fill). Used to find which argument a kernel over-reads, and how far."""

    arg: str
    side: Literal["before", "after"]
    start: int
    stop: int
    pattern: FillPattern


class BufferPool:
    """Guarded allocations and guard patterns kept on one device between runs (see the module docstring).

    :func:`materialise` takes buffers of the exact size it needs from here and :meth:`GuardedArgs.release` gives
    them back once the run's output and guards have been read. ``reused``/``allocated`` count buffers.
    """

    def __init__(self, max_bytes: int = 16 << 30) -> None:
        self.max_bytes = max_bytes
        self._free: dict[tuple[str, int], list[torch.Tensor]] = {}
        self._patterns: dict[tuple[Any, ...], torch.Tensor] = {}
        self._bytes = 0
        self.reused = 0
        self.allocated = 0

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        free = self._free.get((str(device), nbytes))
        if free:
            self.reused += 1
            self._bytes -= nbytes
            return free.pop()
        self.allocated += 1
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        nbytes = buffer.numel()
        if self._bytes + nbytes > self.max_bytes:
            return  # over budget: let the allocator have it back
        self._free.setdefault((str(buffer.device), nbytes), []).append(buffer)
        self._bytes += nbytes

    def pattern(self, key: tuple[Any, ...], make: Any, device: torch.device) -> torch.Tensor:
        """The guard pattern ``make()`` on ``device``, made once per ``key`` (never written: compared and copied)."""
        full = (*key, str(device))
        found = self._patterns.get(full)
        if found is None:
            found = make().to(device)
            self._patterns[full] = found
        return found

    def clear(self) -> None:
        self._free.clear()
        self._patterns.clear()
        self._bytes = 0


class GuardedArgs:
    """A call's arguments with every tensor in a guarded allocation on ``device``."""

    def __init__(
        self, args: dict[str, Any], allocations: list[_Allocation], pool: BufferPool | None = None
    ) -> None:
        self.args = args
        self._allocations = allocations
        self._pool = pool

    def release(self) -> None:
        """Give the allocations back to the pool they came from (after the run's output was copied out and its
        guards checked); this object's tensors must not be used afterwards."""
        if self._pool is not None:
            for allocation in self._allocations:
                self._pool.give(allocation.buffer)
        self._allocations = []
        self.args = {}

    def damage(self) -> list[GuardDamage]:
        """Every changed guard region (out-of-bounds writes). One device sync when nothing changed."""
        if not self._allocations:
            return []
        counts = torch.stack(
            [
                (a.buffer[: a.guard] != a.before).sum()
                + (a.buffer[a.guard + a.span_bytes :] != a.after).sum()
                for a in self._allocations
            ]
        ).tolist()
        found: list[GuardDamage] = []
        for allocation, count in zip(self._allocations, counts, strict=True):
            if count:
                found.extend(allocation.damage())
        return found

    def allocation_of(self, name: str) -> _Allocation:
        for allocation in self._allocations:
            if name in allocation.names:
                return allocation
        raise KeyError(name)


def _guard_pattern(
    dtype: torch.dtype,
    guard: int,
    fill: FillPattern,
    windows: list[GuardWindow],
    side: Literal["before", "after"],
) -> torch.Tensor:
    pattern = fill.pattern(dtype, guard).clone()
    for window in windows:
        if window.side != side:
            continue
        start, stop = max(0, window.start), min(guard, window.stop)
        if start < stop:
            # window offsets count outward from the span: "after" from its end, "before" from its start
            alternative = window.pattern.pattern(dtype, guard)
            if side == "after":
                pattern[start:stop] = alternative[start:stop]
            else:
                pattern[guard - stop : guard - start] = alternative[guard - stop : guard - start]
    return pattern


def storage_groups(args: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """Names of the tensors in ``args`` grouped by the storage they view, in argument order.

    Views of one storage (an output buffer that is also an input, ``gammas`` that *is* ``routing_data.gate_scal``)
    form one group: replay gives each group one allocation, so one guard band, named by all of its names.
    """
    groups: dict[tuple[str, int], list[str]] = {}
    for name, value in args.items():
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            key = (str(value.device), storage.data_ptr()) if storage.nbytes() else (name, id(value))
            groups.setdefault(key, []).append(name)
    return [tuple(names) for names in groups.values()]


def materialise(
    args: Mapping[str, Any],
    device: torch.device | str,
    fill: FillPattern,
    *,
    guard: int = DEFAULT_GUARD_BYTES,
    fills: Mapping[str, FillPattern] | None = None,
    windows: list[GuardWindow] | None = None,
    pool: BufferPool | None = None,
) -> GuardedArgs:
    """Copy every tensor in ``args`` into a guarded allocation on ``device``; other values pass through.

    ``fills`` overrides the fill of single arguments (by name); ``windows`` refine the guard content further.
    Views sharing a storage share one allocation (see :func:`storage_groups`); a fill given for any of their names
    applies to it (the first one in argument order when several are given). With ``pool`` the allocations and the
    device copies of the guard patterns come from (and go back to, :meth:`GuardedArgs.release`) the pool; every
    byte of each allocation is rewritten here either way.
    """
    device = torch.device(device)
    fills = dict(fills or {})
    windows = list(windows or [])
    out: dict[str, Any] = dict(args)
    allocations: list[_Allocation] = []
    for names in storage_groups(args):
        tensors = [args[name] for name in names]
        # union of the byte spans, in bytes from the storage start
        spans = []
        for tensor in tensors:
            start, count = _span_elements(tensor)
            spans.append((start * tensor.element_size(), (start + count) * tensor.element_size()))
        lo = min(s for s, _ in spans)
        hi = max(e for _, e in spans)
        span_bytes = hi - lo
        unit = max(t.element_size() for t in tensors)
        padded_span = -(-span_bytes // unit) * unit
        group_fill = next((fills[name] for name in names if name in fills), fill)
        group_windows = [w for w in windows if w.arg in names]
        dtype = tensors[0].dtype
        after_len = guard + padded_span - span_bytes

        def make_before(
            dtype: torch.dtype = dtype,
            fill: FillPattern = group_fill,
            windows: list[GuardWindow] = group_windows,
        ) -> torch.Tensor:
            return _guard_pattern(dtype, guard, fill, windows, "before")

        def make_after(
            dtype: torch.dtype = dtype,
            fill: FillPattern = group_fill,
            windows: list[GuardWindow] = group_windows,
            after_len: int = after_len,
        ) -> torch.Tensor:
            after = _guard_pattern(dtype, guard, fill, windows, "after")
            if after_len != guard:
                after = torch.cat([fill.pattern(torch.uint8, after_len - guard), after])
            return after

        if pool is not None:
            pattern_key = (dtype, guard, group_fill, tuple(group_windows))
            before = pool.pattern(("before", *pattern_key), make_before, device)
            after = pool.pattern(("after", after_len, *pattern_key), make_after, device)
            buffer = pool.take(guard + span_bytes + after_len, device)
        else:
            before, after = make_before(), make_after()
            buffer = torch.empty(guard + span_bytes + after_len, dtype=torch.uint8, device=device)
        buffer[:guard].copy_(before)
        buffer[guard + span_bytes :].copy_(after)
        if span_bytes:
            source = tensors[0]
            nbytes = source.untyped_storage().nbytes()
            storage_bytes = torch.empty(0, dtype=torch.uint8, device=source.device).set_(
                source.untyped_storage(), 0, (nbytes,), (1,)
            )
            buffer[guard : guard + span_bytes].copy_(storage_bytes[lo:hi])
        for name, tensor in zip(names, tensors, strict=True):
            size = tensor.element_size()
            offset_bytes = guard + tensor.storage_offset() * size - lo
            if offset_bytes % size:
                raise ValueError(f"{name}: view offset is not aligned to its element size")
            typed = buffer.view(torch.uint8)[: (buffer.numel() // size) * size].view(tensor.dtype)
            out[name] = torch.as_strided(
                typed, tuple(tensor.shape), tuple(tensor.stride()), offset_bytes // size
            )
        allocations.append(
            _Allocation(tuple(names), buffer, guard, span_bytes, before.to(device), after.to(device))
        )
    return GuardedArgs(out, allocations, pool)
