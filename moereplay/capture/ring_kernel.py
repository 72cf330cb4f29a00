"""The Triton kernel behind :class:`moereplay.capture.device_ring.DeviceRing` (imported only where Triton is).

One launch: up to 24 byte spans copied (source address, target address, size — plain 64-bit integers, so the caller
makes no tensor objects), then optionally one contiguous float tensor reduced to its largest magnitude and folded
into a 64-bit tag word by ``atomic_max`` (see the device_ring module docstring for the encoding). When that tensor
is itself copied (a layer call's output, in 8-byte words from its own first byte), the caller passes its span last
(``MODE`` 3) and the magnitudes come from the words the copy loads: its bytes are read once, not twice (at prefill
the output is a fifth of the launch's memory traffic). Every program then counts itself done on the slot's counter
(a fenced atomic, after its copies); the last one resets the counter and stores the finished word into the slot's
*host* word — pinned host memory mapped into the device, one aligned 8-byte store — so the writer thread reads a
finished check with a plain memory read, no CUDA call.

:func:`compile_variant` compiles one variant (``aligned``: 8-byte words instead of bytes; ``code``: the checked
dtype, 0 for none; ``mode``: 0 no tag word, 1 tag word without a check, 2 tag word with the check, 3 tag word with
the check of the last span's words, 4 tag word with the check and fingerprint of words read where they are — the
last span's source; its target the fingerprint's device cell, its size the address of two host words — and 5 the
spans copied only if the tag word, finished by an earlier launch on the stream, holds a check whose bits are above
``check`` (then passed a limit, not an address): nothing folded, the word published as it is) with every
integer argument typed int64 and never specialised, and returns ``launch(programs, stream, args)``: the driver's
``cuLaunchKernel`` called through ctypes with a prepared parameter block (no binding, no specialisation lookup, no
Python-side argument conversion per call: measured on the H200 host, Triton's own launcher path cost ~17 µs per
call, a torch operation ~9 µs).
"""

from __future__ import annotations

import ctypes
import struct
import threading
from typing import Any

import triton
import triton.language as tl

BLOCK = 1024
"""Elements per program and loop step (bytes, or 8-byte words when aligned)."""

SPANS = 24
"""Spans one launch copies (the host's ``device_ring.MAX_SPANS``)."""

_INTS = [name for i in range(SPANS) for name in (f"s{i}", f"t{i}", f"n{i}")] + [
    "check", "numel", "word", "generation", "done", "host",
]  # fmt: skip


@triton.jit
def _store(pointer, value, mask, STREAM: tl.constexpr):
    """A store into the ring: with ``STREAM``, marked as written once and not read again (``st.global.cs``: its
    lines are the first L2 evicts), so a prefill's ~100 MB of ring writes per layer call need not push out of L2
    what the kernels after the launch read — the call's output among them."""
    if STREAM:
        tl.store(pointer, value, mask=mask, cache_modifier=".cs")
    else:
        tl.store(pointer, value, mask=mask)


@triton.jit
def _copy_span(
    source, target, size, pid, programs, ALIGNED: tl.constexpr, BLOCK: tl.constexpr, STREAM: tl.constexpr
):
    if ALIGNED:
        src = source.to(tl.pointer_type(tl.int64))
        dst = target.to(tl.pointer_type(tl.int64))
        count = size // 8
    else:
        src = source.to(tl.pointer_type(tl.uint8))
        dst = target.to(tl.pointer_type(tl.uint8))
        count = size
    offsets = tl.arange(0, BLOCK).to(tl.int64)
    for start in range(pid * BLOCK, count, programs * BLOCK):
        index = start + offsets
        mask = index < count
        _store(dst + index, tl.load(src + index, mask=mask), mask, STREAM)


@triton.jit
def _word_max(best, words, index, numel, CODE: tl.constexpr):
    """``best`` raised per lane to the largest magnitude's bits among the elements (of dtype ``CODE``) that the
    8-byte words at ``index`` hold, of the first ``numel`` — the |x| bit patterns of IEEE floats order as integers
    (NaN above Inf, as the separate reduction's float32 bits do); bytes of the last word past the tensor are not
    its elements and are left out."""
    if CODE == 3:  # two float32 per word
        low = tl.where(index * 2 < numel, words & 0x7FFFFFFF, 0)
        high = tl.where(index * 2 + 1 < numel, (words >> 32) & 0x7FFFFFFF, 0)
        best = tl.maximum(best, tl.maximum(low, high))
    else:  # four 16-bit floats per word
        for k in tl.static_range(4):
            half = tl.where(index * 4 + k < numel, (words >> (16 * k)) & 0x7FFF, 0)
            best = tl.maximum(best, half)
    return best


@triton.jit
def _copy_span_max(
    source, target, size, numel, pid, programs, CODE: tl.constexpr, BLOCK: tl.constexpr, STREAM: tl.constexpr
):
    """:func:`_copy_span` of 8-byte words, returning per lane the largest magnitude's bits among the first
    ``numel`` elements (of dtype ``CODE``) the words hold (:func:`_word_max`)."""
    src = source.to(tl.pointer_type(tl.int64))
    dst = target.to(tl.pointer_type(tl.int64))
    count = size // 8
    offsets = tl.arange(0, BLOCK).to(tl.int64)
    best = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(pid * BLOCK, count, programs * BLOCK):
        index = start + offsets
        mask = index < count
        words = tl.load(src + index, mask=mask, other=0)
        _store(dst + index, words, mask, STREAM)
        best = _word_max(best, words, index, numel, CODE)
    return best


GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
MIX1 = tl.constexpr(0xBF58476D1CE4E5B9)
MIX2 = tl.constexpr(0x94D049BB133111EB)
"""The fingerprint's constants (``device_ring.byte_fingerprint``: splitmix64's increment and finalizer)."""


@triton.jit
def _scan_words(source, numel, pid, programs, CODE: tl.constexpr, BLOCK: tl.constexpr):
    """``MODE`` 4: the checked tensor's words read where they are (not copied), returning per lane the largest
    magnitude's bits (as :func:`_copy_span_max`) and the sum of each word's mix — ``device_ring.byte_fingerprint``'s
    terms: the word (its bytes past the tensor zeroed) plus its 1-based index times ``GOLDEN``, through
    splitmix64's finalizer; sums wrap modulo 2**64, so the programs' parts add up in any order."""
    src = source.to(tl.pointer_type(tl.int64))
    nbytes = numel * 4 if CODE == 3 else numel * 2
    count = (nbytes + 7) // 8
    offsets = tl.arange(0, BLOCK).to(tl.int64)
    best = tl.zeros([BLOCK], dtype=tl.int64)
    total = tl.zeros([BLOCK], dtype=tl.uint64)
    for start in range(pid * BLOCK, count, programs * BLOCK):
        index = start + offsets
        mask = index < count
        left = tl.minimum(tl.maximum(nbytes - index * 8, 0), 8)  # the tensor's bytes in this word
        # (the shift never reaches 64: a whole word keeps every byte by the where's other side)
        keep = tl.where(left >= 8, -1, (tl.full([BLOCK], 1, tl.int64) << (tl.minimum(left, 7) * 8)) - 1)
        words = tl.load(src + index, mask=mask, other=0) & keep
        best = _word_max(best, words, index, numel, CODE)
        mixed = words.to(tl.uint64, bitcast=True) + (index + 1).to(tl.uint64) * GOLDEN
        mixed = (mixed ^ (mixed >> 30)) * MIX1
        mixed = (mixed ^ (mixed >> 27)) * MIX2
        mixed = mixed ^ (mixed >> 31)
        total += tl.where(mask, mixed, 0)
    return best, total


@triton.jit(do_not_specialize=_INTS)
def ring_copy(
    s0, t0, n0, s1, t1, n1, s2, t2, n2, s3, t3, n3, s4, t4, n4, s5, t5, n5,
    s6, t6, n6, s7, t7, n7, s8, t8, n8, s9, t9, n9, s10, t10, n10, s11, t11, n11,
    s12, t12, n12, s13, t13, n13, s14, t14, n14, s15, t15, n15, s16, t16, n16, s17, t17, n17,
    s18, t18, n18, s19, t19, n19, s20, t20, n20, s21, t21, n21, s22, t22, n22, s23, t23, n23,
    check, numel, word, generation, done, host,
    ALIGNED: tl.constexpr, CODE: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr, STREAM: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0).to(tl.int64)
    if (
        MODE == 5
    ):  # the spans copied only if the tag word's finished check (an earlier launch's) is over ``check``
        checked = tl.load(word.to(tl.pointer_type(tl.int64)))
        keep = ((checked & 0xFFFFFFFF) > check).to(tl.int64)
    else:
        keep = 1
    _copy_span(s0, t0, n0 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s1, t1, n1 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s2, t2, n2 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s3, t3, n3 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s4, t4, n4 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s5, t5, n5 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s6, t6, n6 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s7, t7, n7 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s8, t8, n8 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s9, t9, n9 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s10, t10, n10 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s11, t11, n11 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s12, t12, n12 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s13, t13, n13 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s14, t14, n14 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s15, t15, n15 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s16, t16, n16 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s17, t17, n17 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s18, t18, n18 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s19, t19, n19 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s20, t20, n20 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s21, t21, n21 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    _copy_span(s22, t22, n22 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    if MODE == 3:  # the checked tensor's own words: reduced as they are copied
        fused = tl.max(_copy_span_max(s23, t23, n23, numel, pid, programs, CODE, BLOCK, STREAM), axis=0)
    elif MODE == 4:  # the checked tensor's words at s23, not copied: its check and fingerprint (cell t23)
        scanned, printed = _scan_words(s23, numel, pid, programs, CODE, BLOCK)
        fused = tl.max(scanned, axis=0)
        part = tl.sum(printed, axis=0).to(tl.int64, bitcast=True)
        tl.atomic_add(t23.to(tl.pointer_type(tl.int64)), part, sem="relaxed")
    else:
        _copy_span(s23, t23, n23 * keep, pid, programs, ALIGNED, BLOCK, STREAM)
    if MODE != 0:
        tag = word.to(tl.pointer_type(tl.int64))
        folded = generation << 32
        if MODE == 3 or MODE == 4:
            if CODE == 2:  # bfloat16: the high half of a float32
                folded = folded | (fused << 16)
            elif CODE == 1:  # float16: its largest magnitude as a float32's bits
                widened = fused.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
                folded = folded | widened.to(tl.int32, bitcast=True).to(tl.int64)
            else:
                folded = folded | fused
        elif MODE == 2:
            if CODE == 1:
                values = check.to(tl.pointer_type(tl.float16))
            elif CODE == 2:
                values = check.to(tl.pointer_type(tl.bfloat16))
            else:
                values = check.to(tl.pointer_type(tl.float32))
            offsets = tl.arange(0, BLOCK).to(tl.int64)
            best = tl.zeros([BLOCK], dtype=tl.int32)
            for start in range(pid * BLOCK, numel, programs * BLOCK):
                index = start + offsets
                x = tl.load(values + index, mask=index < numel, other=0.0).to(tl.float32)
                best = tl.maximum(best, tl.abs(x).to(tl.int32, bitcast=True))
            largest = tl.max(best, axis=0)
            folded = folded | largest.to(tl.int64)
        if MODE != 5:  # (mode 5 folds nothing: the word is finished, its host word is published below)
            tl.atomic_max(tag, folded, sem="relaxed")
        tl.debug_barrier()  # this program's copies (every thread's) before the fenced atomic below
        counter = done.to(tl.pointer_type(tl.int32))
        arrived = tl.atomic_add(counter, 1)  # acq_rel: this program's copies and max before its "done"
        if arrived == programs - 1:  # the last program: every other one's max is in the word
            finished = tl.atomic_add(tag, 0, sem="relaxed")
            if MODE == 4:  # the fingerprint, in two host words tagged with the generation (n23), cell reset
                fingerprint = tl.atomic_xchg(t23.to(tl.pointer_type(tl.int64)), 0, sem="relaxed")
                halves = n23.to(tl.pointer_type(tl.int64))
                tl.store(halves, (generation << 32) | (fingerprint & 0xFFFFFFFF))
                tl.store(halves + 1, (generation << 32) | ((fingerprint >> 32) & 0xFFFFFFFF))
            # the reset releases at system scope: every copy this program acquired above is visible to the
            # host (and the copy engine) before the word it stores next — a plain store, no atomic over PCIe
            tl.atomic_xchg(counter, 0, sem="release", scope="sys")
            tl.store(host.to(tl.pointer_type(tl.int64)), finished)


_BIG = 1 << 40  # warm-up values: every integer argument compiles as int64


class _Params(threading.local):
    """Per thread: a kernel's parameter block (``count`` integers, then Triton's two scratch pointers, left 0)
    and the array of pointers to each parameter that ``cuLaunchKernel`` takes."""

    def __init__(self, count: int) -> None:
        self.block = (ctypes.c_int64 * (count + 2))()
        base = ctypes.addressof(self.block)
        self.pointers = (ctypes.c_void_p * (count + 2))(*[base + 8 * i for i in range(count + 2)])


_DRIVER: Any = None


def _driver() -> Any:
    global _DRIVER
    if _DRIVER is None:
        # PyDLL: the call keeps the GIL (a CDLL call releases it, and on a serving thread every release lets
        # another thread — the writer's poll, vLLM's own — take it for up to the 5 ms switch interval;
        # cuLaunchKernel queues the launch and returns in microseconds, as torch's own launches do with the GIL)
        library = ctypes.PyDLL("libcuda.so.1")
        launch = library.cuLaunchKernel
        launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        launch.restype = ctypes.c_int
        _DRIVER = launch
    return _DRIVER


def compile_variant(aligned: int, code: int, mode: int, device_index: int, stream: bool = False) -> Any:
    """Compile one variant of :func:`ring_copy` on ``device_index`` and return ``launch(programs, stream, args)``
    (see :func:`compile_launcher`); ``stream``: the ring's stores marked streaming (see :func:`_store`)."""
    constants = {"ALIGNED": aligned, "CODE": code or 3, "MODE": mode, "BLOCK": BLOCK, "STREAM": int(stream)}
    return compile_launcher(ring_copy, len(_INTS), constants, device_index, name="ring copy", timed=True)


def compile_launcher(
    kernel: Any,
    count: int,
    constants: dict[str, int],
    device_index: int,
    *,
    name: str,
    num_warps: int | None = None,
    timed: bool = False,
) -> Any:
    """Compile ``kernel`` (``count`` integer arguments, all int64 and never specialised, then ``constants``) on
    ``device_index`` and return ``launch(programs, stream, args)``.

    The launch goes straight to the driver's ``cuLaunchKernel`` with a parameter block filled by one
    ``struct.pack_into`` (the compiled kernel takes the ``count`` integers, then Triton's global and profile scratch
    pointers, both unused here: checked). Where that does not hold (a Triton whose kernels need scratch), it
    falls back to Triton's own compiled launcher. A launch on a stream that is capturing a CUDA graph is captured
    (its arguments are copied into the graph). ``timed``: the driver call goes through ``device_ring.DRIVER_TIMER``
    when it is set (the eager ring's variants, under ``MOEREPLAY_TIMERS``)."""
    import torch

    options = {} if num_warps is None else {"num_warps": num_warps}
    with torch.cuda.device(device_index):
        compiled = kernel.warmup(*([_BIG] * count), **constants, **options, grid=(1,))
        if hasattr(compiled, "result"):  # an asynchronous compile
            compiled = compiled.result()
        run = compiled.run  # loads the module: ``function`` is set from here on
        function = compiled.function
        metadata = compiled.packed_metadata
    values = tuple(constants.values())
    info = compiled.metadata
    direct = (
        getattr(info, "global_scratch_size", 0) == 0
        and getattr(info, "profile_scratch_size", 0) == 0
        and getattr(info, "num_ctas", 1) == 1
        and not getattr(info, "launch_cooperative_grid", False)
        and not getattr(info, "launch_pdl", False)
    )
    if not direct:

        def launch_via_triton(programs: int, stream: int, args: list[int]) -> None:
            run(programs, 1, 1, stream, function, metadata, None, None, None, *args, *values)

        return launch_via_triton

    driver = _driver()
    if timed:  # the eager ring's launches: under MOEREPLAY_TIMERS, the driver call timed on its own
        from moereplay.capture import device_ring

        timer = device_ring.DRIVER_TIMER
        if timer is not None:
            driver = timer(driver)
    threads = 32 * int(info.num_warps)
    shared = int(info.shared)
    params = _Params(count)
    pack = struct.Struct("<" + "q" * count).pack_into

    def launch(programs: int, stream: int, args: list[int]) -> None:
        local = params
        pack(local.block, 0, *args)
        status = driver(function, programs, 1, 1, threads, 1, 1, shared, stream, local.pointers, None)
        if status:
            raise RuntimeError(f"cuLaunchKernel failed with CUresult {status} ({name} kernel)")

    return launch
