"""The host side of the ring's one-launch path, on the CPU: :meth:`DeviceRing.record` builds the Triton kernel's
78 integer arguments (24 × source/target/size, check address and length, tag word address and generation, the
slot's finished-programs counter and its host word) and picks its variant; here the "kernel" is an emulator that
does what ``ring_kernel.ring_copy`` does as one program, on host memory through those very addresses
(``ctypes.memmove``; NumPy views for the check), publishing the finished word to the host word last. The device side of the same contract is
``tests/gpu/test_flight_layer_gpu.py`` and ``tools/bench/ring_floor.py``'s correctness pass on the H200."""

from __future__ import annotations

import ctypes
import math
import struct
import sys
import time
import types

import numpy as np
import pytest
import torch
from aligned_pool import AlignedPool
from conftest import layer_doubling

from moereplay.capture import device_ring
from moereplay.capture.device_ring import ALIGNMENT, MAX_SPANS, DeviceRing, byte_fingerprint, decode_word
from moereplay.capture.patch_points import CaptureTarget
from moereplay.format import CaptureReader

_DTYPES = {1: np.float16, 3: np.float32}


class Emulator:
    """One compiled variant: ``(aligned, code, mode)``; records each launch's arguments."""

    def __init__(
        self,
        aligned: int,
        code: int,
        mode: int,
        launches: list,
        held: list | None = None,
        streams: list | None = None,
    ) -> None:
        self.aligned, self.code, self.mode = aligned, code, mode
        self.launches = launches
        self.held = held  # when a list: host-word stores wait there (a launch that has not finished yet)
        self.streams = streams if streams is not None else []  # each launch's stream handle

    def __call__(self, programs: int, stream: int, args: list[int]) -> None:
        assert len(args) == 3 * MAX_SPANS + 6 and programs >= 1
        self.launches.append((self.aligned, self.code, self.mode, list(args)))
        self.streams.append(stream)
        # mode 5: the spans copied only if the finished word's bits are over ``check`` (nothing folded)
        keep = (
            self.mode != 5
            or (ctypes.c_int64.from_address(args[3 * MAX_SPANS + 2]).value & 0xFFFFFFFF)
            > (args[3 * MAX_SPANS])
        )
        # mode 4: the last triple is (checked tensor, fingerprint cell, host words), read, not copied
        for i in range(MAX_SPANS - 1 if self.mode == 4 else MAX_SPANS):
            source, target, size = args[3 * i : 3 * i + 3]
            if self.aligned:
                assert (source | target | size) % 8 == 0, "an aligned variant got unaligned spans"
            if size and keep:
                ctypes.memmove(target, source, size)
        check, numel, word, generation, done, host = args[3 * MAX_SPANS :]
        if self.mode == 0:
            return
        best = 0
        if self.mode == 3:  # the check is the last span's own words: its source, ``numel`` elements of it
            assert check == 0, "a fused check has no address of its own"
            assert self.aligned == 1 and self.code in (1, 2, 3), "a fused check copies whole words of a float"
            check = args[3 * (MAX_SPANS - 1)]
            nbytes = numel * (4 if self.code == 3 else 2)
            last = args[3 * (MAX_SPANS - 1) + 2] - nbytes
            assert 0 <= last < 8, "the last span is the checked tensor's words"
        printed = None
        if self.mode == 4:  # the check and the fingerprint from the tensor's own bytes, where it is
            assert check == 0 and self.aligned == 1, "a fingerprinting check reads words from the last span"
            check, cell, halves = args[3 * (MAX_SPANS - 1) : 3 * MAX_SPANS]
            assert check % 8 == 0, "the checked tensor's words must be aligned"
            nbytes = numel * (4 if self.code == 3 else 2)
            raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(check)).copy()
            part = byte_fingerprint(torch.from_numpy(raw))
            added = ctypes.c_int64.from_address(cell)
            added.value = (added.value + part + (1 << 63)) % (1 << 64) - (1 << 63)  # wraps as the atomic does
            printed = (cell, halves)
        if self.mode in (2, 3, 4):
            if self.code == 2:  # bfloat16: widen through the upper half of a float32
                raw = np.ctypeslib.as_array((ctypes.c_uint16 * numel).from_address(check))
                values = (raw.astype(np.uint32) << 16).view(np.float32)
            else:
                values = (
                    np.ctypeslib.as_array(
                        (ctypes.c_uint8 * (numel * (2 if self.code == 1 else 4))).from_address(check)
                    )
                    .view(_DTYPES[self.code])
                    .astype(np.float32)
                )
            bits = np.abs(values).view(np.int32)
            best = int(bits.max()) if numel else 0
        slot = ctypes.c_int64.from_address(word)
        if self.mode != 5:
            slot.value = max(slot.value, (generation << 32) | best)
        counter = ctypes.c_int32.from_address(done)
        assert counter.value == 0, "the slot's counter was not reset by its last launch"
        finished = slot.value
        if printed is not None:  # the last program: the cell read and reset, both halves tagged and stored
            cell_value = ctypes.c_int64.from_address(printed[0])
            value, cell_value.value = cell_value.value & 0xFFFFFFFFFFFFFFFF, 0
            for half, bits in enumerate((value & 0xFFFFFFFF, value >> 32)):
                word_value = (generation << 32 | bits) & 0xFFFFFFFFFFFFFFFF
                ctypes.c_int64.from_address(printed[1] + 8 * half).value = word_value - (
                    1 << 64 if word_value >> 63 else 0
                )

        def publish() -> None:
            ctypes.c_int64.from_address(host).value = finished

        if self.held is None:
            publish()
        else:
            self.held.append(publish)


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch):
    launches: list = []
    held: list = []
    streams: list = []  # each launch's stream handle (the current stream's: 0 here)
    compiled: list[tuple[int, int, int, bool]] = []  # (aligned, code, mode, stream) of each variant compiled

    def compile_variant(aligned: int, code: int, mode: int, index: int, stream: bool) -> Emulator:
        compiled.append((aligned, code, mode, stream))
        return Emulator(aligned, code, mode, launches, held if make.hold else None, streams)

    kernel = types.SimpleNamespace(BLOCK=1024, SPANS=MAX_SPANS, compile_variant=compile_variant)
    monkeypatch.setattr(device_ring, "_KERNEL", kernel)

    def make(capacity: int = 1 << 16, stream_stores: bool = False) -> DeviceRing:
        ring = DeviceRing(capacity, torch.device("cpu"), use_kernel=False, stream_stores=stream_stores)
        launcher = object.__new__(device_ring._Launcher)
        launcher.device, launcher.index, launcher.programs = torch.device("cpu"), 0, 8
        launcher._variants, launcher.compile_ns = {}, 0
        launcher._get_stream = lambda index: 0
        launcher.stream_stores = stream_stores
        ring.launcher = launcher
        ring.host_words, ring._host = device_ring.host_words(ring.tags, False)  # apart, as on CUDA
        ring.sink, ring._sink = device_ring.host_words(1, False)  # (record_lean's check launch stores there)
        return ring

    # in DeviceRing's place (flight_layer.DeviceRing): the recorder's rings made by ``make``, its options kept
    make.device_ring = lambda capacity, device, **options: make(capacity, **options)  # type: ignore[attr-defined]
    make.launches = launches  # type: ignore[attr-defined]
    make.compiled = compiled  # type: ignore[attr-defined]
    make.streams = streams  # type: ignore[attr-defined]
    make.held = held  # type: ignore[attr-defined]
    make.hold = False  # type: ignore[attr-defined]
    return make


aligned = AlignedPool(1 << 20).take  # (count, dtype, offset): placed as CUDA storages are


def test_one_launch_copies_every_span_and_folds_the_check(emulated) -> None:
    ring = emulated()
    hidden = aligned(2880 * 2, torch.bfloat16).copy_(torch.randn(2880 * 2))
    weights = aligned(8, torch.float32).copy_(torch.rand(8))
    ids = aligned(8, torch.int32).copy_(torch.arange(8))
    out = aligned(2880 * 2, torch.bfloat16).copy_(torch.randn(2880 * 2) * 3)
    out[17] = -1000.0
    starts, leads, sizes, tag = ring.record([hidden, weights, ids, out], out, True)
    assert len(emulated.launches) == 1 and tag is not None
    aligned_flag, code, mode, args = emulated.launches[0]
    # 8-byte words, bfloat16 check, tag word; the output is checked from its copy's words (fused: mode 3)
    assert (aligned_flag, code, mode) == (1, 2, 3)
    assert leads == [0, 0, 0, 0] and sizes == [t.nbytes for t in (hidden, weights, ids, out)]
    slots = (0, 1, 2, MAX_SPANS - 1)  # the checked span goes last, after the unused slots
    for slot, tensor, start in zip(slots, (hidden, weights, ids, out), starts, strict=True):
        assert args[3 * slot : 3 * slot + 3] == [
            tensor.data_ptr(),
            ring._base + start % ring.capacity,
            tensor.nbytes,
        ]
    assert args[9 : 3 * (MAX_SPANS - 1)] == [0] * (3 * (MAX_SPANS - 1) - 9)  # unused span slots
    assert args[3 * MAX_SPANS :] == [
        0, out.numel(), ring._words + 8 * tag[0], tag[1], ring._done + 4 * tag[0], ring._host + 8 * tag[0],
    ]  # fmt: skip
    assert all(start % ALIGNMENT == 0 for start in starts)
    for tensor, start in zip((hidden, weights, ids, out), starts, strict=True):
        assert torch.equal(ring.view(start, tensor.nbytes), tensor.view(torch.uint8))
    assert tag is not None
    assert decode_word(int(ring.words[tag[0]]), tag[1]) == ("ok", 1000.0)


def test_the_check_is_fused_only_where_its_copy_holds_exactly_its_bytes(emulated, monkeypatch) -> None:
    """Mode 3 (the check from the copy's words) where the checked tensor is copied from its own first byte,
    wherever it stands among the tensors; a second pass over it (mode 2) where it is not copied, starts off a
    256-byte boundary (its span's first bytes are not its elements), or fusing is off — the same word each way."""
    ring = emulated()
    out = aligned(99, torch.float16).copy_(torch.randn(99))  # odd: the last word holds a byte past the end
    out[98] = -7.5
    hidden = aligned(40, torch.bfloat16).copy_(torch.randn(40) * 100)
    shifted = aligned(99, torch.float16, offset=6).copy_(out)
    cases = [
        ([out, hidden], out, 3, 0),  # first among the tensors: still fused, moved to the last slot
        ([hidden], out, 2, None),  # not copied
        ([hidden, shifted], shifted, 2, 1),  # a lead of 6 bytes
    ]
    for tensors, check, mode, position in cases:
        starts, leads, _, tag = ring.record(tensors, check, True)
        _, code, used, args = emulated.launches[-1]
        assert (code, used) == (1, mode)
        if mode == 3:
            assert args[3 * (MAX_SPANS - 1)] == check.data_ptr() and args[3 * MAX_SPANS] == 0
            assert args[3 * (MAX_SPANS - 1) + 1] == ring._base + starts[position] % ring.capacity
            assert args[3 * MAX_SPANS + 1] == check.numel()  # elements, not the span's whole words
        # each copy where ``starts`` says
        for tensor, start, lead in zip(tensors, starts, leads, strict=True):
            assert torch.equal(ring.view(start + lead, tensor.nbytes), tensor.view(torch.uint8))
        assert tag is not None and decode_word(int(ring.words[tag[0]]), tag[1]) == ("ok", 7.5)
    # a full launch (24 spans) with the check first: every other span moves up a slot, the ring's layout stays
    many = [aligned(16, torch.float32).fill_(float(i)) for i in range(MAX_SPANS - 1)]
    starts, _, _, tag = ring.record([out, *many], out, True)
    _, _, used, args = emulated.launches[-1]
    assert used == 3 and args[3 * (MAX_SPANS - 1)] == out.data_ptr()
    assert [args[3 * i] for i in range(MAX_SPANS - 1)] == [t.data_ptr() for t in many]
    for tensor, start in zip([out, *many], starts, strict=True):
        assert torch.equal(ring.view(start, tensor.nbytes), tensor.view(torch.uint8))
    assert tag is not None and decode_word(int(ring.words[tag[0]]), tag[1]) == ("ok", 7.5)
    monkeypatch.setattr(device_ring, "FUSED_CHECK", False)
    _, _, _, tag = ring.record([out, hidden], out, True)
    assert emulated.launches[-1][2] == 2 and emulated.launches[-1][3][3 * MAX_SPANS] == out.data_ptr()
    assert tag is not None and decode_word(int(ring.words[tag[0]]), tag[1]) == ("ok", 7.5)


def test_an_output_not_kept_is_checked_and_fingerprinted_by_one_launch(emulated) -> None:
    """``record(..., fingerprint=True)`` with the output not among the copied tensors: one launch (mode 4) copies
    the spans and reads the output's words where they are for its check and fingerprint — the last triple its
    address, the slot's fingerprint cell and host words —, and ``fingerprint_of`` reads back byte_fingerprint's
    value. An output off an 8-byte boundary, or one more span than a launch leaves room for, gets the check
    without a fingerprint (mode 2); a later call of the same slot makes the old tag's fingerprint unreadable."""
    ring = emulated()
    hidden = aligned(2880 * 2, torch.bfloat16).copy_(torch.randn(2880 * 2))
    weights = aligned(8, torch.float32).copy_(torch.rand(8))
    out = aligned(99, torch.bfloat16).copy_(torch.randn(99))  # odd: bytes past it in its last word
    out[40] = -300.0
    starts, _, _, tag = ring.record([hidden, weights], out, True, fingerprint=True)
    assert tag is not None and len(emulated.launches) == 1
    aligned_flag, code, mode, args = emulated.launches[0]
    assert (aligned_flag, code, mode) == (1, 2, 4)
    cell, halves = ring._fingerprint_cells(tag[0])
    assert args[3 * (MAX_SPANS - 1) : 3 * MAX_SPANS] == [out.data_ptr(), cell, halves]
    assert args[3 * MAX_SPANS : 3 * MAX_SPANS + 2] == [0, out.numel()]
    for tensor, start in zip((hidden, weights), starts, strict=True):
        assert torch.equal(ring.view(start, tensor.nbytes), tensor.view(torch.uint8))
    assert decode_word(int(ring.words[tag[0]]), tag[1]) == ("ok", 300.0)
    assert ring.fingerprint_of(tag) == byte_fingerprint(out)
    assert int(ring._prints[tag[0]]) == 0  # the cell reset for the slot's next use

    shifted = aligned(99, torch.bfloat16, offset=6).copy_(out)
    _, _, _, other = ring.record([hidden], shifted, True, fingerprint=True)
    assert other is not None and emulated.launches[-1][2] == 2 and ring.fingerprint_of(other) is None
    many = [aligned(4, torch.float32).fill_(float(i)) for i in range(MAX_SPANS)]
    _, _, _, full = ring.record(many, out, True, fingerprint=True)
    assert full is not None and emulated.launches[-1][2] == 2 and ring.fingerprint_of(full) is None
    ring.issued = tag[0] + ring.tags  # the next tag takes the first call's slot, one generation on
    _, _, _, again = ring.record([], out, True, fingerprint=True)
    assert again is not None and again[0] == tag[0] and again[1] == tag[1] + 1
    assert ring.fingerprint_of(tag) is None and ring.fingerprint_of(again) == byte_fingerprint(out)


@pytest.mark.parametrize("special", [math.nan, math.inf])
def test_non_finite_outputs_read_back_as_such(emulated, special: float) -> None:
    ring = emulated()
    out = aligned(64, torch.float16).copy_(torch.randn(64))
    out[5] = special
    _, _, _, tag = ring.record([out], out, True)
    assert tag is not None
    state, value = decode_word(int(ring.words[tag[0]]), tag[1])
    assert state == "ok" and (math.isnan(value) if math.isnan(special) else value == math.inf)


def test_views_off_a_boundary_copy_from_the_boundary_in_whole_words(emulated) -> None:
    ring = emulated()
    odd = aligned(38, torch.uint8, offset=3).copy_(torch.arange(38, dtype=torch.uint8))
    starts, leads, sizes, tag = ring.record([odd], None, True)
    aligned_flag, _code, mode, args = emulated.launches[-1]
    assert (aligned_flag, mode) == (1, 1)  # 8-byte words; a tag word without a check
    assert leads == [3] and sizes == [41]  # from the boundary: 3 + 38 bytes, the size the ring keeps
    assert args[2] == 48  # copied as whole words: the last one holds byte 41
    assert torch.equal(ring.view(starts[0] + 3, 38), odd)
    assert tag is not None and decode_word(int(ring.words[tag[0]]), tag[1]) == ("ok", 0.0)


def test_more_spans_than_a_launch_takes_several_launches_and_check_in_the_last(emulated) -> None:
    ring = emulated()
    tensors = [aligned(16, torch.float32).fill_(float(i)) for i in range(MAX_SPANS + 3)]
    starts, _, _, tag = ring.record(tensors, tensors[-1], True)
    modes = [launch[2] for launch in emulated.launches]
    assert modes == [0, 2]
    for tensor, start in zip(tensors, starts, strict=True):
        assert torch.equal(ring.view(start, 64), tensor.view(torch.uint8))
    assert tag is not None and decode_word(int(ring.words[tag[0]]), tag[1]) == ("ok", float(MAX_SPANS + 2))


def test_a_strided_output_is_checked_by_the_torch_path(emulated) -> None:
    ring = emulated()
    base = aligned(64, torch.float32).copy_(torch.arange(64, dtype=torch.float32))
    strided = base.view(8, 8).t()  # not contiguous: the kernel's check cannot read it
    strided[3, 2] = float("nan")  # base[2 * 8 + 3]
    starts, leads, sizes, tag = ring.record([strided], strided, True)
    # copied and checked with torch operations instead; one launch without spans publishes the word to the host
    ((_aligned, _code, mode, args),) = emulated.launches
    assert mode == 1 and args[: 3 * MAX_SPANS] == [0] * (3 * MAX_SPANS)
    assert sizes == [256] and leads == [0]
    assert torch.equal(ring.view(starts[0], 256), base.view(torch.uint8))
    assert tag is not None and math.isnan(decode_word(int(ring.words[tag[0]]), tag[1])[1])
    assert ring.host_words is not None and math.isnan(decode_word(int(ring.host_words[tag[0]]), tag[1])[1])


def test_tag_generations_wrap_their_slots_and_never_read_zero_as_done(emulated) -> None:
    ring = emulated()
    ring.tags = 2
    ring.words = torch.zeros(2, dtype=torch.int64)
    ring._words = ring.words.data_ptr()
    ring.host_words, ring._host = device_ring.host_words(2, False)
    ring.done = torch.zeros(2, dtype=torch.int32)
    ring._done = ring.done.data_ptr()
    x = aligned(4, torch.float32).fill_(1.0)
    tags = [ring.record([x], x, True)[3] for _ in range(5)]
    assert tags == [(0, 1), (1, 1), (0, 2), (1, 2), (0, 3)]
    assert decode_word(0, 1)[0] == "pending"
    assert decode_word(int(ring.words[0]), 2)[0] == "lost"  # slot 0 holds generation 3 now
    word = struct.unpack("<q", struct.pack("<q", int(ring.words[0])))[0]
    assert decode_word(word, 3) == ("ok", 1.0)


def test_layer_calls_written_through_the_launch_path_are_exact(
    emulated, arm, kernels, inputs, monkeypatch
) -> None:
    """The whole layer scope over the one-launch path: leads taken from addresses (as on CUDA), so views whose
    storage does not start on a 256-byte boundary are trimmed back when written — the file still holds the bytes."""
    from moereplay.capture import flight_layer
    from moereplay.format import CaptureReader

    monkeypatch.setattr(flight_layer, "DeviceRing", emulated.device_ring)
    session = arm(trigger="flight", flight_calls="3")
    x, w1, w2, weights = inputs()
    seen = []
    for step in range(6):
        value = x + step
        if step == 4:
            value[0, 1] = float("inf")
        seen.append((value.clone(), kernels.fused(value, w1, w2, weights).clone()))
    session.flush()
    session.close()
    assert emulated.launches  # the one-launch path ran
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        assert [r.context["call"] for r in records] == [2, 3, 4]
        assert records[-1].context["flight"]["trigger"]
        for record in records:
            hidden, output = seen[record.context["call"]]
            recorded = reader.load_args(record.index)["hidden"]
            result = reader.load_outputs(record.index)["return"]
            assert torch.equal(recorded.view(torch.uint8), hidden.view(torch.uint8))  # bytes: NaN included
            assert torch.equal(result.view(torch.uint8), output.view(torch.uint8))


@pytest.mark.parametrize("stream_stores", ["0", "1"])
def test_the_stream_stores_setting_reaches_every_variant_compiled(
    emulated, arm, kernels, inputs, monkeypatch, stream_stores: str
) -> None:
    """MOEREPLAY_FLIGHT_STREAM_STORES from the settings to each ring-kernel variant the layer calls compile."""
    from moereplay.capture import flight_layer

    monkeypatch.setattr(flight_layer, "DeviceRing", emulated.device_ring)
    session = arm(trigger="flight", flight_calls="3", flight_stream_stores=stream_stores)
    x, w1, w2, weights = inputs()
    for step in range(3):
        kernels.fused(x + step, w1, w2, weights)
    session.flush()
    session.close()
    assert emulated.compiled and {stream for *_, stream in emulated.compiled} == {stream_stores == "1"}


def test_a_copy_on_a_given_stream_launches_there_and_copies_the_same_bytes(emulated) -> None:
    """``record(..., stream=handle)`` (the copy beside a prefill-sized call, MOEREPLAY_FLIGHT_BESIDE_DRIVER):
    every launch goes to that handle — also when the spans take more than one launch — the current stream's is
    never asked for, and the ring holds the same bytes as a copy on the current stream."""
    ring = emulated()
    ring.launcher._get_stream = lambda index: pytest.fail("the current stream was asked for")  # type: ignore[union-attr]
    tensors = [aligned(64 + i, torch.float32).copy_(torch.randn(64 + i)) for i in range(MAX_SPANS + 3)]
    starts, leads, sizes, tag = ring.record(tensors, None, False, stream=0xBE51DE)
    assert tag is None and len(emulated.launches) == 2 and emulated.streams == [0xBE51DE, 0xBE51DE]
    for tensor, start, lead, size in zip(tensors, starts, leads, sizes, strict=True):
        assert size >= lead + tensor.nbytes
        assert torch.equal(ring.view(start + lead, tensor.nbytes), tensor.view(torch.uint8).flatten())


def test_a_copy_on_a_given_stream_refuses_what_only_torch_operations_do(emulated) -> None:
    """A given stream goes to the kernel's launches only: a check (reduced by torch operations where the kernel
    cannot) or a ring without the kernel is refused before any ring room is reserved."""
    ring = emulated()
    hidden = aligned(64, torch.float32).copy_(torch.randn(64))
    with pytest.raises(ValueError, match="given stream"):
        ring.record([hidden], hidden, True, stream=7)
    ring.launcher = None
    with pytest.raises(ValueError, match="given stream"):
        ring.record([hidden], None, False, stream=7)
    assert ring.head == 0 and ring.issued == 0 and not emulated.launches


def test_the_writer_checks_a_call_only_once_its_host_word_is_published(emulated, monkeypatch) -> None:
    """Host words are read in place, with no event: a launch that has not finished leaves its call unchecked
    (nothing triggers, nothing is lost) until its last program publishes the word."""
    from moereplay.capture import flight_layer

    monkeypatch.setattr(flight_layer, "DeviceRing", emulated.device_ring)
    emulated.hold = True
    flight = flight_layer.LayerFlight(max_calls=4, max_bytes=1 << 16, absmax=None, emit=lambda *a: True)
    flight.inline_window = 0.0  # the writer polls the ring however recently the serving thread checked it
    call = one_layer_call(flight, bad=float("nan"))
    assert len(emulated.held) == 1
    flight.poll(launch=True)
    assert flight.counters.checked == 0 and flight.counters.triggers == 0 and not call.checked
    emulated.held.pop()()  # the launch finishes
    flight.poll(launch=True)
    assert call.checked and flight.counters.checked == 1 and flight.counters.triggers == 1
    assert math.isnan(call.value)


def test_an_intact_layer_through_the_launch_path_reuses_its_measured_spans(
    emulated, arm_intact, monkeypatch
) -> None:
    """An intact layer with an output buffer, over the one-launch path (leads from addresses, as on CUDA): the
    inputs' spans measured before the call go into the one launch after it, with the output's, and every written
    call is bit-exact."""
    from moereplay.capture import flight_layer
    from moereplay.format import CaptureReader

    monkeypatch.setattr(flight_layer, "DeviceRing", emulated.device_ring)
    session, module = arm_intact(layer_doubling, trigger="flight", flight_calls="4")
    w1 = torch.ones(8, 6)
    seen = []
    for step in range(4):
        hidden = aligned(40, torch.float32, offset=16 * step).copy_(torch.arange(40) + 10 * step).view(5, 8)
        if step == 3:
            hidden[0, 1] = float("nan")
        out = aligned(30, torch.float32, offset=8).view(5, 6)
        module.layer(hidden, w1, out)
        seen.append((hidden.clone(), out.clone()))
    session.flush()
    session.close()
    assert [launch[2] for launch in emulated.launches] == [2, 2, 2, 2]  # one launch a call: inputs and output
    for _aligned, _code, _mode, args in emulated.launches:
        assert all(size % 8 == 0 for size in args[2 : 3 * MAX_SPANS : 3])  # whole words
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        assert [r.context["call"] for r in records] == [0, 1, 2, 3] and records[-1].context["flight"][
            "trigger"
        ]
        for record, (hidden, output) in zip(records, seen, strict=True):
            recorded = reader.load_args(record.index)["hidden"]
            result = reader.load_outputs(record.index)["output"]
            assert torch.equal(recorded.view(torch.uint8), hidden.view(torch.uint8))
            assert torch.equal(result.view(torch.uint8), output.view(torch.uint8))


def test_measured_spans_overlap_only_on_the_tensors_own_bytes(emulated) -> None:
    """The overlap check before a call uses the tensors' own bytes, not the lead before them: an output buffer
    just before an input in the same 256-byte block does not overlap it (a graph-captured call found
    overlapping would not be kept); a strided output counts its whole span."""
    from moereplay.capture.device_ring import measure
    from moereplay.capture.flight_layer import _outputs_overlap

    ring = emulated()  # leads from addresses, as on CUDA
    block = aligned(64, torch.float32)
    output, hidden = block[:16], block[16:48]  # the output's last byte is just before the input's first
    measured = ring.measure([hidden])
    assert measured.leads == [64] and not measured.overlaps(
        output.data_ptr(), output.data_ptr() + output.nbytes
    )
    bound = {"output": output}
    assert not _outputs_overlap(("output",), bound, measured)
    assert not _outputs_overlap(
        ("output",), bound, measure([hidden], by_address=False)
    )  # before a ring exists
    grid = aligned(64, torch.float32).view(8, 8)
    strided = grid[:, :2]  # 16 elements, but its bytes run to row 7
    late = grid[6, 4:]  # the input: bytes 208-224, inside the strided view's span (0-232), past its first 64
    bound = {"output": strided}
    assert _outputs_overlap(("output",), bound, ring.measure([late]))
    assert _outputs_overlap(("output",), bound, measure([late], by_address=False))


def test_a_variants_first_launch_is_set_up_time_and_later_launches_are_not(emulated, monkeypatch) -> None:
    """Compiling a ring-kernel variant (slowed to 50 ms here) counts once in the ring's set-up time, which the
    recorder's per-call cost leaves out; later launches of that variant add nothing to it."""
    compile_variant = device_ring._KERNEL.compile_variant

    def slow(*args):
        time.sleep(0.05)
        return compile_variant(*args)

    monkeypatch.setattr(device_ring._KERNEL, "compile_variant", slow)
    ring = emulated()
    made = ring.setup_ns()
    out = aligned(64, torch.bfloat16).copy_(torch.randn(64))
    ring.record([out], out, True)
    first = ring.setup_ns()
    assert first - made >= 50_000_000
    for _ in range(3):
        ring.record([out], out, True)
    assert ring.setup_ns() == first and len(emulated.launches) == 4


def test_the_serving_thread_checks_finished_words_itself_and_leaves_a_bad_one_to_the_writer(
    emulated, monkeypatch
) -> None:
    """After each eager call the serving thread reads the host words that are finished (the calls before it),
    counts the good ones and lets old calls go; while it does, the writer's poll leaves the ring alone. A bad
    word is not handled there: the call stays unchecked (its history kept) until the writer's next poll — even
    one inside the window — triggers on it."""
    from moereplay.capture import flight_layer

    monkeypatch.setattr(flight_layer, "DeviceRing", emulated.device_ring)
    emulated.hold = True
    written: list[object] = []
    flight = flight_layer.LayerFlight(
        max_calls=2, max_bytes=1 << 16, absmax=None, emit=lambda *a: written.append(a) or True
    )
    flight.inline_window = 3600.0  # every writer poll below comes "right after" a serving-thread check

    def one_call(index: int, bad: bool) -> object:
        return one_layer_call(flight, index, float("inf") if bad else None)

    first = one_call(0, False)
    assert flight.counters.inline_checks == 1 and not first.checked  # its own launch has not finished
    emulated.held.pop()()
    one_call(1, False)
    assert first.checked and flight.counters.checked == 1  # checked by the serving thread, at the next call
    for index in range(2, 5):
        emulated.held.pop()()
        one_call(index, False)
    assert flight.counters.checked == 4 and flight.counters.eager_polls == 0
    assert len(flight._history) <= 3 and flight.counters.evicted >= 2  # old calls let go without the writer
    flight.poll(launch=True)
    assert flight.counters.polls == 1  # counted, but inside the window, nothing left: the ring left alone
    assert flight.counters.eager_polls == 0
    emulated.held.pop()()
    bad = one_call(5, True)
    emulated.held.pop()()
    one_call(6, False)  # the serving thread reads call 5's word: bad, left to the writer
    assert not bad.checked and flight.counters.triggers == 0 and not written
    flight.poll(launch=True)  # inside the window, but something was left: the writer triggers
    assert bad.checked and flight.counters.triggers == 1 and flight.counters.eager_polls == 1
    assert math.isinf(bad.value)
    flight.poll(launch=True)  # the copy-out (the CPU's, finished at once) is handed over
    assert [begin.context["call"] for begin, _complete, _delivered in written] == [4, 5]


def test_a_settle_does_not_wait_forever_for_a_check_interrupted_on_the_serving_thread(
    emulated, monkeypatch
) -> None:
    """The serving thread holds the recorder's lock during its own check; a signal handler running inside it
    (vLLM's SIGTERM: the session's flush waits for the writer's settle) keeps it held. The settle stops waiting
    after SETTLE_LOCK_WAIT_S, settles without it — the bad call still triggers and is handed over — and takes the
    lock again at the next settle."""
    import threading
    import time

    from moereplay.capture import flight_layer

    monkeypatch.setattr(flight_layer, "DeviceRing", emulated.device_ring)
    written: list[object] = []
    flight = flight_layer.LayerFlight(
        max_calls=4, max_bytes=1 << 16, absmax=None, emit=lambda *a: written.append(a) or True
    )
    call = one_layer_call(
        flight, bad=float("nan")
    )  # published at once: the serving thread leaves it to the writer
    assert not call.checked and flight.counters.triggers == 0
    results: list[bool] = []
    assert flight._lock.acquire(blocking=False)  # "inside the serving thread's check"
    try:
        started = time.monotonic()
        settling = threading.Thread(target=lambda: results.append(flight.settle(60.0)))
        settling.start()
        settling.join(60.0)
        assert not settling.is_alive() and results == [True]
        assert time.monotonic() - started < 30.0  # SETTLE_LOCK_WAIT_S, not the settle's 60 s
    finally:
        flight._lock.release()
    assert flight.counters.triggers == 1 and [begin.context["call"] for begin, *_ in written] == [0]
    assert not flight._lock_abandoned and not flight._settling
    assert flight._lock.acquire(blocking=False)  # the writer released nothing it did not take
    flight._lock.release()


def one_layer_call(flight: object, index: int = 0, bad: float | None = None) -> object:
    """One eager call of a stand-in layer through ``flight`` (an intact-inputs target: one launch after it),
    its output holding ``bad`` at element 5 when given."""
    from moereplay.capture.patch_points import CaptureTarget

    target = CaptureTarget(op="layer", role="parent", module="test", attribute="layer", inputs_intact=True)
    hidden = aligned(32, torch.float32).fill_(1.0)
    out = aligned(32, torch.float32).fill_(2.0)
    if bad is not None:
        out[5] = bad
    where = types.SimpleNamespace(call=index, as_dict=lambda ranks, index=index: {"call": index})
    call = flight.before(target, {"hidden": hidden}, where, index)  # type: ignore[attr-defined]
    flight.after(call, out, None)  # type: ignore[attr-defined]
    return call


def test_without_inline_checks_the_writer_checks_every_call_and_triggers(emulated, monkeypatch) -> None:
    """MOEREPLAY_FLIGHT_INLINE_CHECKS=0: the serving thread reads no word after a call (no inline check, nothing
    let go by it); every writer poll does the eager work, checks the finished calls, lets old ones go and
    triggers on a bad one with its history — and an idle writer is woken once by the next call."""
    from moereplay.capture import flight_layer

    monkeypatch.setattr(flight_layer, "DeviceRing", emulated.device_ring)
    emulated.hold = True
    written: list[object] = []
    wakes: list[int] = []
    flight = flight_layer.LayerFlight(
        max_calls=2,
        max_bytes=1 << 16,
        absmax=None,
        emit=lambda *a: written.append(a) or True,
        inline_checks=False,
    )
    flight.inline_window = (
        3600.0  # (no serving-thread check ever happens: the window never makes a poll quiet)
    )
    flight.wake = lambda: wakes.append(1)
    for index in range(4):
        one_layer_call(flight, index)
        emulated.held.pop()()
    assert flight.counters.inline_checks == 0 and flight.counters.checked == 0 and len(flight._new) == 4
    assert flight.poll(launch=True) == flight_layer.IDLE_POLL_S  # all four checked: nothing outstanding
    assert flight.counters.checked == 4 and flight.counters.eager_polls == 1 and len(flight._history) <= 3
    bad = one_layer_call(flight, 4, float("nan"))
    assert wakes == [1]  # the idle writer is told at once
    one_layer_call(flight, 5)
    assert wakes == [1]  # once
    emulated.held.pop(0)()  # call 4's launch finishes (call 5's not yet)
    flight.poll(launch=True)
    assert bad.checked and flight.counters.triggers == 1 and math.isnan(bad.value)
    emulated.held.pop()()
    flight.poll(launch=True)  # the copy-out (the CPU's, finished at once) is handed over
    assert [begin.context["call"] for begin, _complete, _delivered in written] == [3, 4]  # max_calls: 2
    assert flight.counters.inline_checks == 0


def test_without_inline_checks_a_busy_writer_leaves_the_history_bounded(emulated, monkeypatch) -> None:
    """MOEREPLAY_FLIGHT_INLINE_CHECKS=0 with a writer that does not poll (busy writing a trigger's calls): past
    NEW_BOUND calls waiting for it, the serving thread takes them in, checks the finished ones and lets old ones
    go itself — the calls it holds stay bounded."""
    from moereplay.capture import flight_layer

    monkeypatch.setattr(flight_layer, "DeviceRing", emulated.device_ring)
    monkeypatch.setattr(flight_layer, "NEW_BOUND", 8)
    flight = flight_layer.LayerFlight(
        max_calls=2, max_bytes=1 << 16, absmax=None, emit=lambda *a: True, inline_checks=False
    )
    for index in range(40):
        one_layer_call(flight, index)
    assert flight.counters.inline_checks > 0 and flight.counters.polls == 0
    assert len(flight._new) <= 9 and len(flight._history) <= 3 and flight.counters.checked >= 30


def test_the_writer_may_wait_longer_while_the_serving_thread_checks_and_is_woken_for_a_bad_call(
    emulated, monkeypatch
) -> None:
    """The writer's poll asks for IDLE_POLL_S while nothing is outstanding, for QUIET_POLL_S while the serving
    thread checks the eager ring itself and a call still waits for its word, and for its interval otherwise (work
    left to it, a stale serving-thread check, a CUDA graph holding ring launches). The serving thread wakes the
    writer once when it leaves it a bad call — not again on every later call while it waits — and once when it
    leaves a call unchecked after an idle poll."""
    from moereplay.capture import flight_layer

    monkeypatch.setattr(flight_layer, "DeviceRing", emulated.device_ring)
    emulated.hold = True  # words are published when the test says (launches that have not finished yet)

    def finish() -> None:
        for publish in emulated.held:
            publish()
        emulated.held.clear()

    flight = flight_layer.LayerFlight(max_calls=4, max_bytes=1 << 16, absmax=None, emit=lambda *a: True)
    flight.inline_window = 3600.0
    wakes: list[int] = []
    flight.wake = lambda: wakes.append(1)
    assert flight.poll(launch=True) == flight_layer.IDLE_POLL_S  # nothing recorded: nothing to look at
    one_layer_call(flight, 0)
    assert wakes == [1]  # left unchecked after an idle poll: the writer polls again from now
    assert flight.poll(launch=True) == flight_layer.QUIET_POLL_S  # pending, but this thread checks the ring
    finish()
    one_layer_call(flight, 1)  # call 0 checked here, call 1 pending: the writer was not idle, no wake
    assert wakes == [1] and flight.poll(launch=True) == flight_layer.QUIET_POLL_S
    finish()
    flight.inline_window = 0.0  # the serving thread's check is too old: the writer checks call 1 itself
    assert flight.poll(launch=True) == flight_layer.IDLE_POLL_S  # and then nothing is outstanding
    flight.inline_window = 3600.0
    one_layer_call(flight, 2, bad=float("nan"))
    assert wakes == [1, 1]  # pending after an idle poll
    finish()
    one_layer_call(flight, 3)  # the bad word is read here and left to the writer: woken once
    finish()
    one_layer_call(flight, 4)
    assert wakes == [1, 1, 1]  # once for the bad call, not again on the next one
    assert flight.poll(launch=True) is None  # it had something to do
    assert flight.counters.triggers == 1
    one_layer_call(flight, 5)
    flight.inline_window = 0.0
    assert flight.poll(launch=True) is None  # pending, and the serving thread's check is too old
    flight.inline_window = 3600.0
    flight.graph = types.SimpleNamespace(
        poll=lambda launch, full: None, counters=types.SimpleNamespace(launches=1)
    )
    finish()
    one_layer_call(flight, 6)
    assert flight.poll(launch=True) is None  # graph replays are found by polls only


def test_a_call_that_finds_an_idle_writer_holding_the_lock_wakes_it(emulated, monkeypatch) -> None:
    """The writer's idle poll may hold the lock when a call joins: the serving thread cannot check it, so it wakes
    the writer instead of leaving the call for IDLE_POLL_S."""
    from moereplay.capture import flight_layer

    monkeypatch.setattr(flight_layer, "DeviceRing", emulated.device_ring)
    emulated.hold = True  # words published late: the calls stay unchecked
    flight = flight_layer.LayerFlight(max_calls=4, max_bytes=1 << 16, absmax=None, emit=lambda *a: True)
    wakes: list[int] = []
    flight.wake = lambda: wakes.append(1)
    assert flight.poll(launch=True) == flight_layer.IDLE_POLL_S
    with flight._lock:  # the writer, between finding nothing and letting go
        one_layer_call(flight, 0)
    assert wakes == [1] and flight.counters.inline_checks == 0
    one_layer_call(flight, 1)
    assert wakes == [1]  # once


def test_a_call_that_joins_while_the_writer_decides_it_is_idle_is_not_left_for_the_idle_wait(
    emulated, monkeypatch
) -> None:
    """The writer reads "nothing outstanding", then a call joins and its serving thread, failing the lock, sees the
    idle flag not yet set (no wake), then the writer sets it: the writer reads the new calls again after setting
    the flag, and polls again at its interval instead of after IDLE_POLL_S. (The serving thread is made to run
    its whole call exactly there, from the writer's read of ``graph`` that follows its idle test.)"""
    import threading

    from moereplay.capture import flight_layer

    monkeypatch.setattr(flight_layer, "DeviceRing", emulated.device_ring)
    emulated.hold = True
    flight = flight_layer.LayerFlight(max_calls=4, max_bytes=1 << 16, absmax=None, emit=lambda *a: True)
    wakes: list[int] = []
    flight.wake = lambda: wakes.append(1)
    flight.inline_window = 0.0  # the writer does the eager work itself (not a quiet poll)
    assert not flight._writer_idle
    ran: list[int] = []
    idle_graph = types.SimpleNamespace(
        poll=lambda launch, full: None, counters=types.SimpleNamespace(launches=0)
    )

    def graph_read(self: object) -> object:
        if not ran:
            ran.append(1)
            serving = threading.Thread(target=lambda: one_layer_call(flight, 0, bad=float("nan")))
            serving.start()
            serving.join()
        return idle_graph

    monkeypatch.setattr(
        flight_layer.LayerFlight, "graph", property(graph_read, lambda self, value: None), raising=False
    )
    wanted = flight.poll(launch=True)
    assert ran and len(flight._new) == 1 and wakes == []  # the call joined in the window, unchecked, no wake
    assert wanted is None and not flight._writer_idle  # so the writer polls again at its interval


@pytest.mark.parametrize("largest", [2.5, math.inf, math.nan, 7.0])
def test_record_lean_copies_in_a_second_launch_only_when_the_check_is_over(emulated, largest: float) -> None:
    """``record_lean``: the check where the output is (mode 2, its word stored in the sink, not the host word),
    then every span's copy in a launch that reads the finished word (mode 5: ``over`` in the check's place, no
    fold) — copying only when its bits are over ``over`` (here ``MOEREPLAY_ABSMAX=5``), and publishing the word
    either way. Room is reserved for every span as ``record`` would."""
    ring = emulated()
    hidden = aligned(99, torch.bfloat16).copy_(torch.randn(99))
    ids = aligned(8, torch.int32).copy_(torch.arange(8))
    out = aligned(99, torch.bfloat16).fill_(0.25)
    out[50] = -largest
    ring.buffer.fill_(0xAB)
    starts, leads, sizes, tag = ring.record_lean([hidden, ids, out], out, device_ring.over_bits(5.0))
    assert tag is not None and [(code, mode) for _, code, mode, _ in emulated.launches] == [(2, 2), (0, 5)]
    check_args, copy_args = emulated.launches[0][3], emulated.launches[1][3]
    assert check_args[: 3 * MAX_SPANS] == [0] * (3 * MAX_SPANS)  # nothing copied by the check
    word, generation, done, host = (
        ring._words + 8 * tag[0],
        tag[1],
        ring._done + 4 * tag[0],
        ring._host + 8 * tag[0],
    )
    assert check_args[3 * MAX_SPANS :] == [out.data_ptr(), out.numel(), word, generation, done, ring._sink]
    assert copy_args[3 * MAX_SPANS :] == [device_ring.over_bits(5.0), 0, word, generation, done, host]
    for slot, (tensor, start) in enumerate(zip((hidden, ids, out), starts, strict=True)):
        assert copy_args[3 * slot : 3 * slot + 3] == [
            tensor.data_ptr(),
            ring._base + start % ring.capacity,
            (tensor.nbytes + 7) & ~7,
        ]
    state, value = decode_word(int(ring.host_words[tag[0]]), tag[1])  # published by the copy launch
    assert state == "ok" and (math.isnan(value) if math.isnan(largest) else value == largest)
    kept = not largest <= 5.0
    for tensor, start, lead in zip((hidden, ids, out), starts, leads, strict=True):
        held = ring.view(start + lead, tensor.nbytes)
        if kept:
            assert torch.equal(held, tensor.view(torch.uint8))
        else:
            assert bool((held == 0xAB).all())
    assert ring.head == starts[-1] + ((sizes[-1] + 255) & ~255)


def copy_out(hidden: torch.Tensor) -> torch.Tensor:
    """An intact layer returning a fresh output: its hidden states, doubled."""
    return hidden * 2.0


def test_a_lean_call_over_absmax_is_written_with_the_bytes_the_device_copied(
    emulated, arm, stand_in_module, monkeypatch
) -> None:
    """``MOEREPLAY_FLIGHT_LEAN_BYTES`` with ``MOEREPLAY_ABSMAX=5`` over the launch path (mode 2, then mode 5): the
    recorder's limit reaches the device's copy — the call whose output is 7 (finite, over absmax) is written with its
    inputs and output bit for bit, as the copy launch kept them; the good calls before it are left out. Were the
    limit passed to the device another than the host's, the call would be written from ring bytes never copied."""
    from moereplay.capture import flight_layer

    monkeypatch.setattr(flight_layer, "DeviceRing", emulated.device_ring)
    stand_in_module("moereplay_test_lean_launch", layer=copy_out)
    target = CaptureTarget("layer", "parent", "moereplay_test_lean_launch", "layer", inputs_intact=True)
    session = arm(targets=(target,), trigger="flight", flight_calls="4", flight_lean_bytes="1", absmax="5")
    module = sys.modules["moereplay_test_lean_launch"]
    seen = []
    for step, largest in enumerate((1.25, 2.5, 2.0, 3.5)):
        hidden = aligned(64, torch.float32).fill_(0.5)
        hidden[7] = -largest
        seen.append((hidden.clone(), module.layer(hidden).clone()))
        if step == 0:  # every later call's spans start over 0xAB: a copy not made leaves them so
            next(iter(session.recorder.flight._rings.values())).buffer.fill_(0xAB)
    session.flush()
    session.close()
    assert [mode for _, _, mode, _ in emulated.launches] == [2, 5] * 4
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        assert [r.context["call"] for r in records] == [3]
        assert records[0].context["flight"]["magnitude"] == 7.0
        assert reader.footer["counters"]["flight_lean_left_out"] == 3
        hidden, output = seen[3]
        assert torch.equal(
            reader.load_args(records[0].index)["hidden"].view(torch.uint8), hidden.view(torch.uint8)
        )
        assert torch.equal(
            reader.load_outputs(records[0].index)["return"].view(torch.uint8), output.view(torch.uint8)
        )


def test_a_lean_call_checked_after_a_later_trigger_still_triggers_and_is_written(
    emulated, monkeypatch
) -> None:
    """Checks finish out of order (calls on other streams): a later lean call's trigger finds an earlier lean call
    still unchecked — it is not written then (its bytes are kept only if its check fails) nor marked written, so
    when its own check comes back bad it triggers and is written with its bytes."""
    from moereplay.capture import flight_layer

    monkeypatch.setattr(flight_layer, "DeviceRing", emulated.device_ring)
    emulated.hold = True
    written: list[int] = []

    def emit(begin, complete, delivered) -> bool:
        written.append(begin.context["call"])
        return True

    flight = flight_layer.LayerFlight(max_calls=4, max_bytes=1 << 16, absmax=None, emit=emit, lean_bytes=1)
    flight.inline_window = 0.0
    first = one_layer_call(flight, 0, bad=float("nan"))
    second = one_layer_call(flight, 1, bad=float("inf"))
    assert first.lean and second.lean and len(emulated.held) == 4  # per call: the check's sink, the host word
    for publish in emulated.held[2:]:  # the second call finishes first
        publish()
    flight.poll(launch=True)
    assert written == [1] and not first.checked and not first.emitted
    for publish in emulated.held[:2]:
        publish()
    flight.poll(launch=True)
    assert written == [1, 0] and flight.counters.triggers == 2 and flight.counters.lean_left_out == 0


def test_without_inline_checks_calls_holding_many_bytes_are_taken_in_by_the_serving_thread(
    emulated, monkeypatch
) -> None:
    """MOEREPLAY_FLIGHT_INLINE_CHECKS=0 and a writer that does not poll: calls under RELEASE_BYTES hold their
    tensors until they leave the history, so past NEW_HELD_BYTES of them waiting for the writer (long before
    NEW_BOUND calls) the serving thread takes them in and lets old ones go itself; calls that let go of their
    tensors at once (RELEASE_BYTES) hold nothing and are not counted."""
    from moereplay.capture import flight_layer

    monkeypatch.setattr(flight_layer, "DeviceRing", emulated.device_ring)
    monkeypatch.setattr(flight_layer, "NEW_BOUND", 10**6)
    per_call = 2 * 32 * 4  # hidden and output, 32 float32 each
    monkeypatch.setattr(flight_layer, "NEW_HELD_BYTES", 4 * per_call)
    flight = flight_layer.LayerFlight(
        max_calls=2, max_bytes=1 << 16, absmax=None, emit=lambda *a: True, inline_checks=False
    )
    for index in range(4):
        one_layer_call(flight, index)
    assert flight.counters.inline_checks == 0 and flight._new_held == 4 * per_call
    one_layer_call(flight, 4)  # past the bound: taken in, checked, old calls let go
    assert flight.counters.inline_checks == 1 and not flight._new and flight._new_held == 0
    assert len(flight._history) <= 3
    for index in range(5, 40):
        one_layer_call(flight, index)
    assert len(flight._new) <= 5 and len(flight._history) <= 3 and flight.counters.polls == 0
    released = flight_layer.LayerFlight(
        max_calls=2,
        max_bytes=1 << 16,
        absmax=None,
        emit=lambda *a: True,
        inline_checks=False,
        release_bytes=per_call,
    )
    for index in range(40):
        one_layer_call(released, index)
    assert released._new_held == 0 and len(released._new) == 40 and released.counters.inline_checks == 0


def test_without_inline_checks_a_poll_after_a_bounded_serving_thread_check_is_not_quiet(
    emulated, monkeypatch
) -> None:
    """Without inline checks the serving thread checks only past NEW_BOUND calls: a poll right after that check
    must still look at the calls made since (with inline checks on, that poll may stay quiet, as the serving
    thread checks the next call's end)."""
    from moereplay.capture import flight_layer

    monkeypatch.setattr(flight_layer, "DeviceRing", emulated.device_ring)
    monkeypatch.setattr(flight_layer, "NEW_BOUND", 2)
    emulated.hold = True
    flight = flight_layer.LayerFlight(
        max_calls=4, max_bytes=1 << 16, absmax=None, emit=lambda *a: True, inline_checks=False
    )
    flight.inline_window = 3600.0  # the bounded check stays "recent" for the whole test
    for index in range(3):
        one_layer_call(flight, index)
    assert flight.counters.inline_checks == 1  # the third call passed the bound
    bad = one_layer_call(flight, 3, bad=float("nan"))
    for publish in emulated.held:
        publish()
    emulated.held.clear()
    flight.poll(launch=True)
    assert bad.checked and flight.counters.triggers == 1 and flight.counters.eager_polls == 1


def _driver_pair(monkeypatch: pytest.MonkeyPatch, fail: str | None = None) -> tuple[list[tuple], object]:
    """The driver's event calls replaced by recorders of their arguments (``fail``: the one that returns a
    CUresult of 1, or "load": the library does not load), the serving stream's handle 77, and a driver pair of
    side stream 5 with fork event 11 and join event 12."""
    import threading

    from moereplay.capture import flight_layer

    calls: list[tuple] = []

    def record(event: int, stream: int) -> int:
        calls.append(("record", event, stream))
        return 1 if fail == f"record {event}" else 0

    def wait(stream: int, event: int, flags: int) -> int:
        calls.append(("wait", stream, event, flags))
        return 1 if fail == f"wait {event}" else 0

    def driver_stream_calls() -> tuple:
        if fail == "load":
            raise OSError("libcuda.so.1: cannot open shared object file")
        return record, wait

    monkeypatch.setattr(flight_layer, "driver_stream_calls", driver_stream_calls)
    monkeypatch.setattr(flight_layer, "_serving_stream", lambda index: 77)
    beside = object.__new__(flight_layer._Beside)
    beside.raw, beside.fork_raw, beside.join_raw = 5, 11, 12
    beside.claim = threading.Lock()
    return calls, beside


def _beside_call(flight: object, ring: object) -> tuple[object, list[torch.Tensor], object]:
    target = CaptureTarget(op="layer", role="parent", module="test", attribute="layer", inputs_intact=True)
    hidden = aligned(32, torch.float32).fill_(1.0)
    where = types.SimpleNamespace(call=0, as_dict=lambda ranks: {"call": 0})
    call, copy_first = flight.collect(target, {"hidden": hidden}, where, 0)  # type: ignore[attr-defined]
    assert not copy_first
    call.ring = ring
    return call, [hidden], ring.measure([hidden])  # type: ignore[attr-defined]


def test_the_driver_beside_copy_forks_launches_on_the_side_stream_and_joins(emulated, monkeypatch) -> None:
    """MOEREPLAY_FLIGHT_BESIDE_DRIVER: cuEventRecord(fork, serving), cuStreamWaitEvent(side, fork, 0), the ring's
    launch on the side stream's handle, cuEventRecord(join, side); after the call cuStreamWaitEvent(serving, join,
    0) — the pair claimed from the fork to that join, then free for the next call."""
    from moereplay.capture import flight_layer

    monkeypatch.setattr(flight_layer, "DeviceRing", emulated.device_ring)
    calls, beside = _driver_pair(monkeypatch)
    flight = flight_layer.LayerFlight(
        max_calls=4, max_bytes=1 << 16, absmax=None, emit=lambda *a: True, beside_driver=True
    )
    ring = flight._ring(aligned(32, torch.float32))
    flight._driver_besides[ring.index] = beside
    for _ in range(2):
        calls.clear()
        call, tensors, measured = _beside_call(flight, ring)
        flight._copy_beside(call, ring, tensors, measured)
        assert calls == [("record", 11, 77), ("wait", 5, 11, 0), ("record", 12, 5)]
        assert emulated.streams[-1] == 5 and call.joined is beside and beside.claim.locked()
        assert call.input_copy is not None
        flight.join(call)
        assert calls[-1] == ("wait", 77, 12, 0) and call.joined is None and not beside.claim.locked()
        flight.join(call)  # once only
        assert len(calls) == 4
    assert flight.counters.beside == 2


@pytest.mark.parametrize("fail", ["record 11", "wait 11", "record 12", "load"])
def test_a_failed_driver_beside_copy_still_joins_and_lets_the_pair_go(emulated, monkeypatch, fail) -> None:
    """Whatever fails between the claim and the join — the fork's record or wait, the join's record, the driver
    library not loading — raises out of the copy, and the join that ``before`` then makes lets the pair go (a
    pair left claimed would send every later call quietly down the events path)."""
    from moereplay.capture import flight_layer

    monkeypatch.setattr(flight_layer, "DeviceRing", emulated.device_ring)
    calls, beside = _driver_pair(monkeypatch, fail)
    flight = flight_layer.LayerFlight(
        max_calls=4, max_bytes=1 << 16, absmax=None, emit=lambda *a: True, beside_driver=True
    )
    ring = flight._ring(aligned(32, torch.float32))
    flight._driver_besides[ring.index] = beside
    call, tensors, measured = _beside_call(flight, ring)
    with pytest.raises((RuntimeError, OSError)):
        flight._copy_beside(call, ring, tensors, measured)
    assert beside.claim.locked() and call.joined is beside
    if fail == "load":
        with pytest.raises(
            OSError
        ):  # the join cannot reach the driver either: the pair is let go all the same
            flight.join(call)
    else:
        flight.join(call)
        assert calls[-1] == ("wait", 77, 12, 0)
    assert not beside.claim.locked() and call.joined is None and flight.counters.beside == 0
