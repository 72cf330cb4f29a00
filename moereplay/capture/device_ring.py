"""A circular device buffer that the layer-scope flight recorder copies into with ONE kernel launch per call.

Why: at decode a fused MoE call is a few hundred microseconds of host time; every torch operation added on the
serving thread (an allocation, a view, a multi-tensor copy) costs 5–40 µs there. This ring keeps the per-call
cost to Python arithmetic on data pointers plus one launch of a small Triton kernel through its compiled
launcher (no argument binding, no specialisation lookup, no tensor objects made):

- copy up to :data:`MAX_SPANS` byte spans (the call's dynamic inputs and its outputs) into the ring, 8 bytes at a
  time: every span starts on a 256-byte boundary of its storage and of the ring, and its length is rounded up to
  whole 8-byte words (the last word holds the span's last byte, so it lies in memory that is mapped; the ring
  keeps the span's true size);
- reduce one floating-point output (contiguous float16 / bfloat16 / float32) to its largest magnitude and fold it
  into the entry's 64-bit *tag word* with ``atomic_max``: ``generation << 32 | bits(max |x|)``. Magnitudes are
  non-negative, so their float32 bit patterns order as the values do and a NaN (positive after ``abs``) orders
  above +Inf: the word says "NaN" or "Inf" or the largest finite magnitude, without a second pass. The
  generation (how many times the tag slot has been used) tells a reader whether the word belongs to the entry it
  expects, to an older one (not run yet) or to a newer one (overwritten: lost);
- publish the finished word: the launch's last program stores it into :attr:`DeviceRing.host_words` (pinned
  host memory mapped into the device), so the writer thread reads checks with plain memory reads — no event, no
  copy, no CUDA call per poll.

Positions are absolute byte counts (``head`` only grows); an allocation never straddles the end of the buffer
(the rest of the lap is skipped), and an entry ``[start, end)`` is intact while ``head <= start + capacity``
(checked after copying it out: anything launched later that could overwrite it has moved ``head`` first).

Without Triton (CPU, tests) the same contract is kept with torch operations (several launches: no speed claim).
"""

from __future__ import annotations

import ctypes
import math
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moereplay.capture.snapshot import byte_span

MAX_SPANS = 24
"""Spans one launch copies (``ring_kernel.SPANS``); a call with more is copied by several launches (a gpt-oss
layer call has 18: hidden states, routing data and indices, output)."""

ALIGNMENT = 256
"""Every span starts on a 256-byte boundary of the ring, as the capture format aligns copied spans."""

_CHECK_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
_ITEMSIZE = {1: 2, 2: 2, 3: 4}
_WORD = struct.Struct("<f")


@dataclass(frozen=True, slots=True)
class Measured:
    """:meth:`DeviceRing.measure` of some tensors: per tensor its copy's source address, lead and size; and the
    ring bytes they take together."""

    sources: list[int]
    leads: list[int]
    sizes: list[int]
    total: int

    def overlaps(self, low: int, high: int) -> bool:
        """Whether bytes ``[low, high)`` (device addresses) meet any measured tensor's own bytes (from its first
        byte: the lead before it is not the tensor's — a graph-captured call found overlapping is not kept)."""
        for source, lead, size in zip(self.sources, self.leads, self.sizes, strict=True):
            first = source + lead
            if first < high and low < max(source + size, first + 1):
                return True
        return False


def measure(tensors: list[torch.Tensor], by_address: bool) -> Measured:
    """:meth:`DeviceRing.measure` without a ring (``by_address``: leads from addresses, as the kernel path takes
    them; else from storage offsets). Either way a tensor's own bytes start at ``source + lead``."""
    sources, leads, sizes, total, _ = DeviceRing._measure(tensors, None, by_address)
    return Measured(sources, leads, sizes, total)


class TooLarge(ValueError):
    """A call's copies do not fit the ring (nothing was launched)."""


def checkable_by_kernel(tensor: torch.Tensor) -> bool:
    """Whether the fused kernel can reduce ``tensor`` (contiguous float16 / bfloat16 / float32)."""
    return tensor.dtype in _CHECK_CODES and tensor.is_contiguous()


def decode_word(word: int, generation: int) -> tuple[str, float]:
    """``(state, magnitude)`` of a tag word read for an entry of ``generation``: ``"ok"`` (``magnitude`` is the
    largest |x|, NaN or Inf included), ``"pending"`` (an older generation: the kernel has not run yet) or
    ``"lost"`` (a newer generation overwrote it)."""
    found = word >> 32
    expected = generation & 0x7FFFFFFF
    if found != expected:
        ahead = (found - expected) % (1 << 31)
        return ("lost", math.nan) if 0 < ahead < (1 << 30) else ("pending", math.nan)
    bits = word & 0xFFFFFFFF
    (value,) = _WORD.unpack(struct.pack("<I", bits))
    return "ok", value


class DeviceRing:
    """See the module docstring. ``capacity``: bytes of the buffer; ``tags``: tag words (entries whose check is
    outstanding at once, at most); ``stream_stores``: the kernel's stores into the ring marked as written once
    (``MOEREPLAY_FLIGHT_STREAM_STORES``, see ``ring_kernel._store``)."""

    def __init__(
        self,
        capacity: int,
        device: torch.device,
        *,
        tags: int = 1 << 14,
        use_kernel: bool | None = None,
        stream_stores: bool = False,
    ):
        if capacity < ALIGNMENT:
            raise ValueError("ring capacity must be at least 256 bytes")
        started = time.perf_counter_ns()
        self.device = device
        cuda = device.type == "cuda"
        self.index = (
            (device.index if device.index is not None else torch.cuda.current_device()) if cuda else -1
        )
        self.capacity = capacity - capacity % ALIGNMENT
        self.buffer = torch.empty(self.capacity, dtype=torch.uint8, device=device)
        self.tags = tags
        self.words = torch.zeros(tags, dtype=torch.int64, device=device)
        self.head = 0  # absolute: bytes ever allocated (skipped lap ends included)
        self.issued = 0  # tag words ever handed out
        self._base = self.buffer.data_ptr()
        self._words = self.words.data_ptr()
        self._lock = threading.Lock()
        if use_kernel is None:
            use_kernel = cuda and _kernel_available()
        self.launcher: _Launcher | None = _Launcher(device, stream_stores) if use_kernel else None
        # finished tag words where the writer thread reads them without a CUDA call: on CUDA with the kernel,
        # host-mapped words its last program stores (and per slot a counter of finished programs); on the CPU,
        # the words themselves. None: CUDA without the kernel (read back with an event and a copy).
        self.host_words: np.ndarray | None = None
        self._done = 0
        self._host = 0
        self._sink = 0
        # fingerprints of checked outputs not copied (record's ``fingerprint``): per slot a device cell the
        # kernel's programs add into, and two host words it is published in
        self._prints: torch.Tensor | None = None
        self.host_prints: np.ndarray | None = None
        self._host_prints = 0
        if use_kernel and cuda:
            self.done = torch.zeros(tags, dtype=torch.int32, device=device)
            self._done = self.done.data_ptr()
            self.host_words, self._host = host_words(tags, True)
            self._prints = torch.zeros(tags, dtype=torch.int64, device=device)
            self.host_prints, self._host_prints = host_words(2 * tags, True)
            # where record_lean's check launch stores its word (the copy launch after it publishes it)
            self.sink = torch.zeros(1, dtype=torch.int64, device=device)
            self._sink = self.sink.data_ptr()
        elif not cuda:
            self.host_words = self.words.numpy()
            self.done = torch.zeros(tags, dtype=torch.int32)
            self._done = self.done.data_ptr()
            self._host = self._words
        self.stream_stores = stream_stores
        self._made_ns = time.perf_counter_ns() - started

    def setup_ns(self) -> int:
        """Nanoseconds this ring spent once on its own set-up (allocating its buffers, compiling each ring-kernel
        variant on its first launch) — inside the recorded calls that triggered them, not a per-call cost."""
        return self._made_ns + (self.launcher.compile_ns if self.launcher is not None else 0)

    # --- allocation -------------------------------------------------------------------------------------------

    def intact(self, start: int) -> bool:
        """Whether bytes from absolute ``start`` can still hold what was copied there (nothing allocated since
        has reached them)."""
        return self.head <= start + self.capacity

    def view(self, start: int, size: int) -> torch.Tensor:
        """The ring's bytes ``[start, start + size)`` (absolute start) as a uint8 tensor (no copy)."""
        physical = start % self.capacity
        return self.buffer.narrow(0, physical, size)

    # --- the per-call copy ------------------------------------------------------------------------------------

    def measure(self, tensors: list[torch.Tensor]) -> Measured:
        """Where ``tensors``' copies start, their leads, sizes and ring bytes — what :meth:`record` would measure
        (for a caller that needs the spans before the call, and hands them to ``record`` after it)."""
        return measure(tensors, self.launcher is not None)

    def record(
        self,
        tensors: list[torch.Tensor],
        check: torch.Tensor | None,
        tagged: bool,
        measured: Measured | None = None,
        fingerprint: bool = False,
        stream: int | None = None,
    ) -> tuple[list[int], list[int], list[int], tuple[int, int] | None]:
        """Copy the storage spans of ``tensors`` (each from its first byte rounded down to 256 bytes of its
        storage) into the ring and, when ``tagged``, fold the largest magnitude of ``check`` (or nothing) into a
        new tag word — queued on the current stream. Returns ``(starts, leads, sizes, tag)``: each copy's
        absolute ring start, how many bytes before the tensor's first byte it begins, its size, and the tag
        ``(slot, generation)``. Raises :class:`TooLarge` (nothing launched) when the spans exceed the ring.

        The hot path of the layer-scope flight recorder: per tensor a few metadata reads, then one launch (one
        per :data:`MAX_SPANS` spans). Without the kernel, or for an output it cannot reduce (strided, another
        dtype), the copies and the check are torch operations.

        ``fingerprint`` (a ``check`` that is not copied, with a tag): the same pass over its bytes also reduces
        their :func:`byte_fingerprint`, published beside the tag word (:meth:`fingerprint_of`) — what proves a re-run
        bit-exact where the output's bytes are not kept. Where the kernel cannot (the tensor not 8-byte aligned,
        more spans than one launch takes besides it, CUDA without the kernel) there is none.

        ``stream``: the raw handle of a stream the kernel's launches go to instead of the current one (the side
        stream of a copy beside a call, made without switching the current stream); only where the kernel
        copies — raises ``ValueError`` (nothing reserved) where torch operations would."""
        launcher = self.launcher
        if stream is not None and (launcher is None or check is not None):
            raise ValueError("a ring copy on a given stream takes the kernel and no check")
        sources, leads, sizes, total, check_info = self._measured(tensors, check, measured)
        head, tag = self._reserve(total, tagged)
        starts = _starts(head, sizes)
        word = self._word(tag) if tag is not None else None
        if launcher is None or (check is not None and check_info is None):
            for tensor, start, lead, size in zip(tensors, starts, leads, sizes, strict=True):
                if size:
                    self.view(start, size).copy_(_raw_at(tensor, lead, size))
            if tag is not None:
                self._fold(check, tag)
                if fingerprint and check is not None and not check.is_cuda:
                    self._publish_fingerprint(tag, byte_fingerprint(check))
                if launcher is not None:  # the kernel's host word: a launch without spans publishes what
                    launcher.launch_prepared([], 0, 1, 0, None, word)  # _fold wrote (its atomic_max keeps it)
            return starts, leads, sizes, tag
        target = self._base + head % self.capacity
        count = len(sources)
        if (
            check is not None
            and check_info is not None
            and tag is not None
            and 0 < count <= MAX_SPANS
            and FUSED_CHECK
        ):
            fused = count - 1 if tensors[-1] is check else _position(tensors, check)
            if fused >= 0 and leads[fused] == 0:  # the checked tensor's span is its own bytes, from the first
                spans: list[int] = []
                checked: tuple[int, int, int] = (0, 0, 0)
                chunk = 0
                for position, (source, size) in enumerate(zip(sources, sizes, strict=True)):
                    words = (size + 7) & ~7
                    if position == fused:
                        checked = (source, target, words)
                    else:
                        spans += (source, target, words)
                    chunk += words
                    target += (size + 255) & ~255
                # (count - 1 spans, padding): the checked span goes in the last place
                spans += _PADDING[count]
                spans += checked
                launcher.launch_prepared(spans, MAX_SPANS, 1, chunk, check_info, word, fused=True)
                return starts, leads, sizes, tag
        # the last triple of a fingerprinting launch (mode 4: the checked tensor's words read for its check and
        # fingerprint, not copied — see launch_prepared): one launch, with the spans before it
        printed = (
            (check_info[0], *self._fingerprint_cells(tag[0]))
            if fingerprint
            and FINGERPRINT
            and check_info is not None
            and tag is not None
            and check_info[0] % 8 == 0
            and count < MAX_SPANS
            else None
        )
        for first in range(0, max(count, 1), MAX_SPANS):
            last = first + MAX_SPANS >= count
            end = first + MAX_SPANS
            args, chunk, target = _span_args(sources[first:end], sizes[first:end], target)
            if printed is not None:  # (the one launch: count < MAX_SPANS)
                args += _PADDING[count + 1]
                args += printed
                launcher.launch_prepared(args, MAX_SPANS, 1, chunk, check_info, word, printed=True)
                break
            launcher.launch_prepared(
                args,
                min(MAX_SPANS, count - first),
                1,
                chunk,
                check_info if last else None,
                word if last else None,
                stream=stream,
            )
        return starts, leads, sizes, tag

    def record_lean(
        self,
        tensors: list[torch.Tensor],
        check: torch.Tensor,
        over: int,
        measured: Measured | None = None,
    ) -> tuple[list[int], list[int], list[int], tuple[int, int] | None]:
        """:meth:`record` of ``tensors`` (a call's inputs, then ``check``, its output, last) with the copies made
        only if the check fails: ring room is reserved for every span as ``record`` would, but the bytes are
        copied only if the largest magnitude of ``check`` has float32 bits above ``over`` (:func:`over_bits`: the
        flight recorder's "bad"). Two launches on the current stream: the check where the output is (mode 2, its
        host word not published), then the copy that reads the finished tag word and publishes it (mode 5) —
        so a finished host word says the copies, if any, are done. The ring holds the spans' bytes exactly when
        the call's check is over ``over``. Where that cannot be done in those two launches (CUDA without the
        kernel, more spans than one launch takes, an output the kernel cannot reduce) every span is copied, as
        :meth:`record` does; on the CPU too (its path is synchronous)."""
        launcher = self.launcher
        if launcher is None or not tensors or tensors[-1] is not check or len(tensors) > MAX_SPANS:
            return self.record(tensors, check, True, measured)
        sources, leads, sizes, total, check_info = self._measured(tensors, check, measured)
        if check_info is None:
            return self.record(tensors, check, True, measured)
        head, tag = self._reserve(total, True)
        assert tag is not None
        starts = _starts(head, sizes)
        word = self._word(tag)
        launcher.launch_prepared([], 0, 1, 0, check_info, (*word[:3], self._sink))
        args, chunk, _ = _span_args(sources, sizes, self._base + head % self.capacity)
        launcher.launch_prepared(args, len(sources), 1, chunk, None, word, over=over)
        return starts, leads, sizes, tag

    def _measured(
        self, tensors: list[torch.Tensor], check: torch.Tensor | None, measured: Measured | None
    ) -> tuple[list[int], list[int], list[int], int, tuple[int, int, int] | None]:
        """:meth:`_measure` of ``tensors`` by this ring's rule, reusing ``measured`` for the first of them (measured
        before the call: their addresses do not change)."""
        by_address = self.launcher is not None
        if measured is None:
            return self._measure(tensors, check, by_address)
        done = len(measured.sizes)
        sources, leads, sizes, total, check_info = self._measure(tensors[done:], check, by_address)
        return (
            measured.sources + sources,
            measured.leads + leads,
            measured.sizes + sizes,
            total + measured.total,
            check_info,
        )

    def _word(self, tag: tuple[int, int]) -> tuple[int, int, int, int]:
        """The kernel's ``word`` of ``tag``: its device address, generation, counter and host word addresses."""
        return self._words + 8 * tag[0], tag[1], self._done + 4 * tag[0], self._host + 8 * tag[0]

    @staticmethod
    def _measure(
        tensors: list[torch.Tensor], check: torch.Tensor | None, by_address: bool
    ) -> tuple[list[int], list[int], list[int], int, tuple[int, int, int] | None]:
        """Per tensor the copy's source address, lead and size; the ring bytes they take; and ``(address, numel,
        dtype code)`` of ``check`` when the kernel can reduce it. ``by_address`` (CUDA): storages come from the
        caching allocator, 512-byte aligned, so the lead is the address's remainder — no storage_offset() call
        (every torch call here costs ~0.2 µs of host time); on the CPU it comes from the storage offset."""
        sources = []
        leads = []
        sizes = []
        total = 0
        check_info = None
        for tensor in tensors:
            address = tensor.data_ptr()
            if by_address:
                lead = address & 255
            else:
                offset: int = tensor.storage_offset()  # type: ignore[assignment]  # never symbolic here
                lead = (offset * tensor.element_size()) % ALIGNMENT if offset else 0
            if tensor.is_contiguous():
                nbytes = tensor.nbytes
                if tensor is check:
                    code = _CHECK_CODES.get(tensor.dtype)
                    if code is not None:
                        check_info = (address, nbytes // _ITEMSIZE[code], code)
            else:
                start, end = byte_span(tensor)
                nbytes = end - start
            size = nbytes + lead
            sources.append(address - lead)
            leads.append(lead)
            sizes.append(size)
            total += (size + 255) & ~255
        if check is not None and check_info is None and checkable_by_kernel(check):  # not among ``tensors``
            check_info = (check.data_ptr(), check.numel(), _CHECK_CODES[check.dtype])
        return sources, leads, sizes, total, check_info

    def _reserve(self, total: int, tagged: bool) -> tuple[int, tuple[int, int] | None]:
        """The absolute start of ``total`` bytes (never straddling the end: the rest of a lap is skipped) and,
        when ``tagged``, a new tag ``(slot, generation)``; raises :class:`TooLarge` when ``total`` exceeds the
        ring."""
        capacity = self.capacity
        if total > capacity:
            raise TooLarge(f"{total} bytes do not fit a ring of {capacity}")
        with self._lock:
            head = self.head
            lap_left = capacity - head % capacity
            if total > lap_left:
                head += lap_left
            self.head = head + total
            tag = None
            if tagged:
                issued = self.issued
                self.issued = issued + 1
                # generations start at 1: a word never written (0) reads as "pending", never as "ok, 0.0"
                tag = (issued % self.tags, issued // self.tags + 1)
        return head, tag

    def _fold(self, check: torch.Tensor | None, tag: tuple[int, int]) -> None:
        """The tag word with torch operations (no kernel): the same encoding as the kernel's."""
        slot, generation = tag
        high = (generation & 0x7FFFFFFF) << 32
        word = self.words.narrow(0, slot, 1)
        if check is None or not check.is_floating_point() or check.is_complex() or check.numel() == 0:
            word.fill_(high)
            return
        bits = magnitude(check).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        word.copy_(bits + high)

    def _fingerprint_cells(self, slot: int) -> tuple[int, int]:
        """The device cell the kernel's programs add a slot's fingerprint into (reset by its last program), and the
        slot's two host words it is published in (made with the ring where it has the kernel; on the CPU path on
        first use, under the ring's lock)."""
        if self._prints is None:
            with self._lock:
                if self._prints is None:
                    self.host_prints, self._host_prints = host_words(2 * self.tags, False)
                    self._prints = torch.zeros(self.tags, dtype=torch.int64, device=self.device)
        return self._prints.data_ptr() + 8 * slot, self._host_prints + 16 * slot

    def _publish_fingerprint(self, tag: tuple[int, int], value: int) -> None:
        """The host words of ``tag``'s fingerprint, as the kernel's last program stores them."""
        self._fingerprint_cells(tag[0])
        assert self.host_prints is not None
        high = (tag[1] & 0x7FFFFFFF) << 32
        for half, bits in enumerate((value & 0xFFFFFFFF, value >> 32)):
            self.host_prints[2 * tag[0] + half] = np.int64(np.uint64(high | bits).view(np.int64))

    def fingerprint_of(self, tag: tuple[int, int]) -> int | None:
        """The fingerprint :meth:`record` published for ``tag`` (an unsigned 64-bit integer), or None: none was
        reduced, it is not finished, or a later call of the slot has overwritten it (both halves carry the tag's
        generation)."""
        words = self.host_prints
        if words is None:
            return None
        expected = tag[1] & 0x7FFFFFFF
        low, high = (int(words[2 * tag[0] + half]) & 0xFFFFFFFFFFFFFFFF for half in (0, 1))
        if low >> 32 != expected or high >> 32 != expected:
            return None
        return (high & 0xFFFFFFFF) << 32 | (low & 0xFFFFFFFF)


def _span_args(sources: list[int], sizes: list[int], target: int) -> tuple[list[int], int, int]:
    """The kernel's (source, target, size) triples of spans copied into the ring from device address ``target``,
    the bytes they copy, and the address after them. Sources and targets are 256-byte aligned; sizes whole 8-byte
    words: the last one holds the span's last byte (mapped memory), and the ring's 256-byte slot has room for it."""
    args: list[int] = []
    chunk = 0
    for source, size in zip(sources, sizes, strict=True):
        words = (size + 7) & ~7
        args += (source, target, words)
        chunk += words
        target += (size + 255) & ~255
    return args, chunk, target


def _starts(head: int, sizes: list[int]) -> list[int]:
    """Each span's absolute ring start from ``head`` (every span on a 256-byte boundary)."""
    starts = []
    at = head
    for size in sizes:
        starts.append(at)
        at += (size + 255) & ~255
    return starts


_LARGEST_FINITE = 0x7F7FFFFF  # float32 bits of its largest finite value


def over_bits(absmax: float | None) -> int:
    """The check's float32 bits above which the flight recorder judges a magnitude bad (``_is_bad``: NaN, an
    infinity, or above ``absmax``): the bits of the largest float32 not above ``absmax``, at most the largest
    finite float32's (so NaN and Inf are always over it); -1 (everything over it) for a negative ``absmax``. A
    magnitude ``m`` (a float32) is bad exactly when ``bits(m) > over_bits(absmax)``: non-negative floats order as
    their bits, NaN's above Inf's."""
    if absmax is None or math.isnan(absmax) or absmax >= float(np.finfo(np.float32).max):
        return _LARGEST_FINITE
    if absmax < 0:
        return -1
    value = np.float32(absmax)
    if float(value) > absmax:  # rounded up: the float32 just below it
        value = np.nextafter(value, np.float32(0))
    return int(np.array(value, dtype=np.float32).view(np.uint32)) & 0x7FFFFFFF


FINGERPRINT_CONSTANTS = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
"""``ring_kernel.GOLDEN``, ``MIX1``, ``MIX2``: splitmix64's increment and finalizer multipliers (checked equal when
the kernel is imported)."""


def byte_fingerprint(tensor: torch.Tensor) -> int:
    """A 64-bit fingerprint of a tensor's bytes (row-major, as a contiguous copy holds them): over its
    little-endian 8-byte words (the last padded with zeros), the sum modulo 2**64 of splitmix64's finalizer of
    ``word + (i + 1) · 0x9E3779B97F4A7C15`` (``i`` the word's index). A sum, so the ring kernel's programs reduce
    their parts in any order and add them up; equal bytes give equal fingerprints, and any other bytes a different
    one but with odds of about 2**-64. What the flight recorder keeps of an output it checks but does not copy."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    if len(data) % 8:
        data = np.concatenate([data, np.zeros(8 - len(data) % 8, dtype=np.uint8)])
    words = data.view("<u8")
    golden, first, second = (np.uint64(c) for c in FINGERPRINT_CONSTANTS)
    with np.errstate(over="ignore"):
        mixed = words + np.arange(1, len(words) + 1, dtype=np.uint64) * golden
        mixed = (mixed ^ (mixed >> np.uint64(30))) * first
        mixed = (mixed ^ (mixed >> np.uint64(27))) * second
        mixed ^= mixed >> np.uint64(31)
        return int(mixed.sum(dtype=np.uint64))


def magnitude(tensor: torch.Tensor) -> torch.Tensor:
    """A floating-point tensor's largest |x| as the check computes it, a one-element float32 tensor on its device:
    NaN when it holds one (NaN orders above Inf); float64 values narrowed to float32 first (beyond its range: Inf)."""
    values = tensor.detach()
    if values.dtype == torch.float64:  # (vector_norm will not narrow its result's dtype)
        values = values.float()
    return torch.linalg.vector_norm(values, ord=math.inf, dtype=torch.float32).reshape(1)


def _raw_at(tensor: torch.Tensor, lead: int, size: int) -> torch.Tensor:
    """``size`` bytes from ``lead`` bytes before ``tensor``'s first byte, found by address (the CUDA lead is the
    address's remainder, which the storage offset need not show when a storage is not 256-byte aligned)."""
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    offset = tensor.data_ptr() - tensor.untyped_storage().data_ptr()
    raw.set_(tensor.untyped_storage(), offset - lead, (size,), (1,))
    return raw


_CUDA_HOST_ALLOC_PORTABLE_DEVICEMAP = 0x01 | 0x02


def host_words(count: int, cuda: bool) -> tuple[np.ndarray, int]:
    """``count`` zeroed int64 words the writer thread reads and, on CUDA, the device writes: pinned host memory
    allocated with ``cuMemHostAlloc(PORTABLE | DEVICEMAP)`` (never freed: a kernel still in flight may store into
    it), as a NumPy view and its device address. On the CPU an ordinary array and its own address."""
    if not cuda:
        array = np.zeros(count, dtype=np.int64)
        return array, int(array.ctypes.data)
    driver = ctypes.CDLL("libcuda.so.1")
    nbytes = 8 * count
    host = ctypes.c_void_p()
    status = driver.cuMemHostAlloc(
        ctypes.byref(host), ctypes.c_size_t(nbytes), _CUDA_HOST_ALLOC_PORTABLE_DEVICEMAP
    )
    if status or not host.value:
        raise RuntimeError(f"cuMemHostAlloc failed with CUresult {status}")
    device = ctypes.c_uint64()
    status = driver.cuMemHostGetDevicePointer_v2(ctypes.byref(device), host, ctypes.c_uint(0))
    if status:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed with CUresult {status}")
    ctypes.memset(host.value, 0, nbytes)
    array = np.ctypeslib.as_array((ctypes.c_int64 * count).from_address(host.value))
    return array, int(device.value)


# --- the Triton kernel ------------------------------------------------------------------------------------------

_KERNEL: Any = None
_KERNEL_ERROR: str | None = None


def _kernel_available() -> bool:
    global _KERNEL, _KERNEL_ERROR
    if _KERNEL is not None:
        return True
    if _KERNEL_ERROR is not None:
        return False
    try:
        from moereplay.capture import ring_kernel

        if _BLOCK_BYTES[0] != ring_kernel.BLOCK or ring_kernel.SPANS != MAX_SPANS:
            raise ImportError("ring_kernel's BLOCK or SPANS does not match the launcher's")
        constants = (ring_kernel.GOLDEN, ring_kernel.MIX1, ring_kernel.MIX2)
        if tuple(int(getattr(c, "value", c)) for c in constants) != FINGERPRINT_CONSTANTS:
            raise ImportError("ring_kernel's fingerprint constants do not match byte_fingerprint's")
        _KERNEL = ring_kernel
        return True
    except Exception as error:  # no triton, or one whose language differs
        _KERNEL_ERROR = f"{type(error).__name__}: {error}"
        return False


_PADDING = [(0, 0, 0) * (MAX_SPANS - n) for n in range(MAX_SPANS + 1)]

_STREAM_CALLS: tuple[Callable[[int, int], int], Callable[[int, int, int], int]] | None = None


def driver_stream_calls() -> tuple[Callable[[int, int], int], Callable[[int, int, int], int]]:
    """The driver's ``cuEventRecord(event, stream)`` and ``cuStreamWaitEvent(stream, event, flags)`` on raw handles
    (a CUDA runtime event or stream is the driver's), each returning its ``CUresult`` (0: success). Through
    ``PyDLL``, as the ring kernel's ``cuLaunchKernel`` is: the serving thread keeps the GIL for the few
    microseconds each takes (a ``CDLL`` call releases it, and any other thread may then hold it for up to the
    5 ms switch interval)."""
    global _STREAM_CALLS
    if _STREAM_CALLS is None:
        library = ctypes.PyDLL("libcuda.so.1")
        record = library.cuEventRecord
        record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        record.restype = ctypes.c_int
        wait = library.cuStreamWaitEvent
        wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        wait.restype = ctypes.c_int
        _STREAM_CALLS = (record, wait)
    return _STREAM_CALLS


DRIVER_TIMER: Callable[[Callable[..., int]], Callable[..., int]] | None = None
"""Set by ``MOEREPLAY_TIMERS`` (:func:`moereplay.capture.phase_timers.install`): wraps the driver's
``cuLaunchKernel`` of every eager ring variant compiled from then on (``ring_kernel.compile_variant``), to time the
driver call apart from the Python around it (timer piece ``cu_launch``). None: launches call the driver itself."""

FUSED_CHECK = True
"""Whether a checked tensor that is also copied is reduced from its copy's words (one read of its bytes; see
:mod:`moereplay.capture.ring_kernel`) rather than by a second pass over it. ``tools/bench/ring_bandwidth.py``
turns it off to measure both."""


FINGERPRINT = True
"""Whether :meth:`DeviceRing.record`'s ``fingerprint`` reduces one (mode 4) or only checks the output (mode 2):
``tools/bench/ring_bandwidth.py --unkept`` turns it off to time both."""


def _position(tensors: list[torch.Tensor], tensor: torch.Tensor) -> int:
    for position, candidate in enumerate(tensors):
        if candidate is tensor:
            return position
    return -1


_BLOCK_BYTES = {0: 1024, 1: 8 * 1024}  # ring_kernel.BLOCK elements of a byte / of 8 bytes (checked at import)


class _Launcher:
    """Compiled variants of the ring kernel (alignment × check dtype), launched through Triton's compiled
    launcher with positional arguments only. Compiles lazily, once per variant, on first use."""

    def __init__(self, device: torch.device, stream_stores: bool = False) -> None:
        self.device = device
        # every variant's stores into the ring marked streaming (ring_kernel._store)
        self.stream_stores = stream_stores
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.programs = torch.cuda.get_device_properties(self.index).multi_processor_count * 4
        self._variants: dict[tuple[int, int, int], Any] = {}
        self._get_stream = torch._C._cuda_getCurrentRawStream
        self.compile_ns = 0  # time spent compiling (or loading) variants on their first launch

    def launch_prepared(
        self,
        args: list[int],
        count: int,
        aligned: int,
        total: int,
        check: tuple[int, int, int] | None,
        word: tuple[int, int, int, int] | None,
        *,
        fused: bool = False,
        printed: bool = False,
        over: int | None = None,
        stream: int | None = None,
    ) -> None:
        """One launch. ``args``: ``count`` (source, target, size) triples, flattened (extended here); ``aligned``:
        every size a multiple of 8 (8-byte words); ``total``: bytes copied; ``check``: (address, numel, dtype
        code) of the tensor to reduce, or None; ``word``: (address, generation, finished-programs counter
        address, host word address) of the tag, or None. ``fused``: the checked tensor is the last of
        :data:`MAX_SPANS` triples, copied in words from its first byte — reduced from the words its copy loads.
        ``printed``: the last triple is (the checked tensor's address, its fingerprint's device cell, its two host
        words): read in words where it is, reduced to its check and fingerprint, not copied (mode 4). ``over``
        (with ``word``, no ``check``): the spans are copied only if the tag word's finished check — an earlier
        launch's on the same stream — has float32 bits above ``over``, and the word is published either way
        (mode 5). ``stream``: the raw handle of the stream to launch on (None: the device's current stream)."""
        if count < MAX_SPANS:
            args += _PADDING[count]
        code = 0
        if over is not None and word is not None:
            args += (over, 0, word[0], word[1] & 0x7FFFFFFF, word[2], word[3])
            mode = 5
        elif printed and check is not None and word is not None:
            code = check[2]
            args += (0, check[1], word[0], word[1] & 0x7FFFFFFF, word[2], word[3])
            total += check[1] * _ITEMSIZE[code]
            mode = 4
        elif fused and check is not None and word is not None:
            code = check[2]
            args += (0, check[1], word[0], word[1] & 0x7FFFFFFF, word[2], word[3])
            mode = 3
        elif check is not None and word is not None:
            address, numel, code = check
            args += (address, numel, word[0], word[1] & 0x7FFFFFFF, word[2], word[3])
            total += numel * _ITEMSIZE[code]
            mode = 2
        elif word is not None:
            args += (0, 0, word[0], word[1] & 0x7FFFFFFF, word[2], word[3])
            mode = 1
        else:
            args += (0, 0, 0, 0, 0, 0)
            mode = 0
        key = (aligned, code, mode)
        variant = self._variants.get(key)
        if variant is None:
            started = time.perf_counter_ns()
            variant = self._variants[key] = _KERNEL.compile_variant(
                aligned, code, mode, self.index, self.stream_stores
            )
            self.compile_ns += time.perf_counter_ns() - started
        programs = max(1, min(self.programs, -(-total // _BLOCK_BYTES[aligned])))
        variant(programs, self._get_stream(self.index) if stream is None else stream, args)
