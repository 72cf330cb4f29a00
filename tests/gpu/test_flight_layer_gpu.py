"""The layer-scope flight recorder on the GPU: the ring's Triton kernel (one launch per layer call) and vLLM's real
``fused_marlin_moe`` (kernel pack, gpt-oss NVFP4 shapes).

- stand-in CUDA layers: a NaN at step k writes the layer calls up to it, bit for bit; thousands of steps through
  a small ring (it laps hundreds of times) lose no check and never write a call whose bytes were overwritten;
- vLLM 0.25.1's ``fused_marlin_moe`` at decode (M = 8) with the capture armed as the plugin arms it
  (``MOEREPLAY_TRIGGER=flight``, default scope ``layer``): no kernel call is copied; a NaN entering layer call 15
  writes calls 0–15 as parent records without children, each input and output bit-exact with what vLLM saw.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from moereplay.capture import flight_layer
from moereplay.capture import session as session_module
from moereplay.capture.device_ring import DeviceRing, byte_fingerprint, decode_word, over_bits
from moereplay.capture.patch_points import CaptureTarget
from moereplay.format import CaptureReader
from moereplay.format.schema import Unsupported

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MODULE = "moereplay_gpu_layer_kernels"
MARLIN_MODULE = "vllm.model_executor.layers.fused_moe.experts.marlin_moe"


def gemm(input, output, weight, topk_weights, top_k, mul_topk_weights, scale=1.0):
    torch.matmul(input, weight, out=output)
    if mul_topk_weights:
        output.mul_(topk_weights.reshape(-1, 1)[: output.shape[0]])
    output.mul_(scale)
    return output


def fused(hidden, w1, w2, topk_weights, output):
    module = sys.modules[MODULE]
    cache = torch.empty(hidden.shape[0], w1.shape[1], device=hidden.device)
    first = module.gemm(hidden, cache, w1, topk_weights, 1, False)
    return module.gemm(first, output, w2, topk_weights, 1, True, scale=0.5)


TARGETS = (
    CaptureTarget("gemm", "kernel", MODULE, "gemm", static=("weight",), outputs=("output",)),
    CaptureTarget(
        "fused", "parent", MODULE, "fused", static=("w1", "w2"), outputs=("output",), inputs_intact=True
    ),
)


@pytest.fixture
def kernels(stand_in_module: Callable[..., types.ModuleType]) -> Iterator[types.ModuleType]:
    try:
        yield stand_in_module(MODULE, gemm=gemm, fused=fused)
    finally:
        session_module.disarm()


def _arm(tmp_path: Path, targets=TARGETS, **settings: str) -> session_module.Session:
    env = {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_DIR": str(tmp_path / "captures"),
        "MOEREPLAY_TRIGGER": "flight",
    }
    env.update({f"MOEREPLAY_{key.upper()}": value for key, value in settings.items()})
    session = session_module.arm(env, targets=targets)
    assert session is not None and session.recorder.layer_scope
    return session


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().cpu().view(torch.uint8)


def _run(kernels, steps: int, bad_step: int | None, tokens: int = 5):
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, 8, device="cuda", generator=generator)
    w1 = torch.randn(8, 6, device="cuda", generator=generator)
    w2 = torch.randn(6, 8, device="cuda", generator=generator)
    weights = torch.rand(tokens, device="cuda", generator=generator)
    out = torch.empty(
        tokens, 8, device="cuda"
    )  # one output buffer, overwritten every step (as vLLM's workspace)
    seen = []
    for step in range(steps):
        value = x + step
        if step == bad_step:
            value[1, 2] = float("nan")
        result = kernels.fused(value, w1, w2, weights, out)
        seen.append((value.clone(), result.clone()))
    return seen


def test_the_ring_kernel_is_what_copies(kernels, tmp_path: Path) -> None:
    session = _arm(tmp_path)
    _run(kernels, 2, None)
    torch.cuda.synchronize()
    rings = list(session.recorder.flight._rings.values())  # type: ignore[union-attr]
    assert rings and rings[0].launcher is not None, "Triton ring kernel not in use on this GPU"
    session.flush()
    session.close()


@pytest.mark.parametrize("stream_stores", [False, True])
def test_the_ring_kernel_publishes_finished_words_to_host_memory(
    tmp_path: Path, monkeypatch, stream_stores: bool
) -> None:
    """The kernel's last program stores each finished tag word into host-mapped memory: after the stream
    finishes, the host word equals the device word for every dtype, several programs or one, NaN and Inf
    included — what the writer thread reads without a CUDA call. The check reduced from the checked tensor's
    copied words (fused) and by a second pass over it agree, and the fused one leaves out the bytes of its last
    word past the tensor (NaN here: counted, they would turn every word into NaN). The same with the ring's
    stores marked streaming (MOEREPLAY_FLIGHT_STREAM_STORES)."""
    from moereplay.capture import device_ring
    from moereplay.capture.device_ring import DeviceRing, decode_word

    ring = DeviceRing(1 << 26, torch.device("cuda", 0), stream_stores=stream_stores)
    assert ring.launcher is not None and ring.host_words is not None
    assert ring.launcher.stream_stores is stream_stores
    for fused in (True, False):
        monkeypatch.setattr(device_ring, "FUSED_CHECK", fused)
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for n in (1, 2880, 2048 * 2880 + 3):  # one program, a few, every one the launch may take
                for special in (None, float("nan"), float("inf")):
                    storage = torch.full((n + 8,), float("nan"), device="cuda", dtype=dtype)
                    x = storage[:n].copy_(torch.randn(n, device="cuda").to(dtype))  # NaN right after it
                    if special is not None:
                        x[n // 2] = special
                    odd = torch.zeros(n * 2 + 3, dtype=torch.uint8, device="cuda")
                    starts, _, _, tag = ring.record([odd, x], x, True)
                    assert tag is not None
                    torch.cuda.synchronize()
                    mode = 3 if fused else 2
                    code = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}[dtype]
                    # this dtype's own variant ran
                    assert (1, code, mode) in ring.launcher._variants, (fused, dtype)
                    device_word = int(ring.words[tag[0]])
                    assert int(ring.host_words[tag[0]]) == device_word, (dtype, n, special)
                    state, value = decode_word(device_word, tag[1])
                    expect = float(torch.linalg.vector_norm(x.float(), ord=math.inf))
                    assert state == "ok" and (value == expect or (math.isnan(value) and math.isnan(expect))), (
                        fused, dtype, n, special, value, expect,
                    )  # fmt: skip
                    assert torch.equal(ring.view(starts[1], x.nbytes), x.view(torch.uint8))  # copied whole
    assert int(ring.done.sum()) == 0  # every slot's counter reset by its last program


@pytest.mark.parametrize(
    ("stream_stores", "inline"),
    [("0", "1"), ("1", "1"), ("0", "0")],
    ids=["plain-stores", "stream-stores", "no-inline-checks"],
)
def test_nan_writes_the_layer_calls_bit_exact(
    kernels, tmp_path: Path, stream_stores: str, inline: str
) -> None:
    """(``inline`` 0: MOEREPLAY_FLIGHT_INLINE_CHECKS=0, the writer's polls alone check the calls.)"""
    session = _arm(
        tmp_path, flight_calls="6", flight_stream_stores=stream_stores, flight_inline_checks=inline
    )
    seen = _run(kernels, 40, bad_step=30)
    rings = list(session.recorder.flight._rings.values())  # type: ignore[union-attr]
    assert rings and rings[0].launcher is not None
    assert rings[0].launcher.stream_stores is (stream_stores == "1")  # the setting reached the kernel
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        counters = reader.footer["counters"]
        assert [r.context["call"] for r in records] == list(range(25, 31)), counters
        assert {r.op for r in records} == {"fused"} and all(r.parent is None for r in records)
        assert records[-1].context["flight"]["trigger"] and counters["flight_lost"] == 0
        assert counters["flight_checked"] == 40 and counters["recorder_seen"] == 40
        assert (counters.get("flight_inline_checks", 0) == 0) == (inline == "0"), counters
        for record in records:
            value, result = seen[record.context["call"]]
            args = reader.load_args(record.index)
            outputs = reader.load_outputs(record.index)
            assert torch.equal(_bits(args["hidden"]), _bits(value))
            assert torch.equal(_bits(outputs["output"]), _bits(result))


@pytest.mark.parametrize("inline", ["1", "0"], ids=["inline-checks", "no-inline-checks"])
def test_a_lapping_ring_loses_no_check_and_writes_nothing_overwritten(
    kernels, tmp_path: Path, inline: str
) -> None:
    # one layer call = hidden + topk + output, three 256-byte spans (tokens 5 × 8 floats): a 16 KiB ring laps
    # every ~21 calls; 3000 steps lap it ~140 times while the writer polls (without inline checks, the writer's
    # polls alone check the calls, and the serving thread past NEW_BOUND of them)
    session = _arm(tmp_path, flight_calls="8", flight_bytes="16K", flight_inline_checks=inline)
    seen = _run(kernels, 3000, bad_step=2999)
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        counters = reader.footer["counters"]
        assert counters["flight_checked"] == 3000 and counters["flight_unchecked"] == 0, counters
        # the setting reached the recorder: without inline checks the serving thread checks only past NEW_BOUND
        # calls waiting for the writer; with them after (almost) every call (not when the writer holds the lock)
        inline_checks = counters.get("flight_inline_checks", 0)
        if inline == "0":
            assert inline_checks <= 3000 // flight_layer.NEW_BOUND, counters
        else:
            assert inline_checks > 1500, counters
        assert records and records[-1].context["call"] == 2999 and records[-1].context["flight"]["trigger"]
        for record in records:  # whatever was written is exact (overwritten calls are counted lost instead)
            value, result = seen[record.context["call"]]
            assert torch.equal(_bits(reader.load_args(record.index)["hidden"]), _bits(value))
            assert torch.equal(_bits(reader.load_outputs(record.index)["output"]), _bits(result))
        assert len(records) + counters["flight_lost"] == 8


@pytest.mark.parametrize(
    "beside", ["events", "driver", "driver-on-a-stream", "off"], ids=lambda b: f"beside-{b}"
)
def test_large_inputs_copied_beside_the_call_are_ordered_with_the_serving_stream(
    kernels, tmp_path: Path, monkeypatch, beside: str
) -> None:
    """Inputs past MOEREPLAY_FLIGHT_BESIDE_BYTES are copied on a side stream while the call runs. Here the side
    stream is held back after its wait for the serving stream (a sleep queued right before each side copy), the
    serving stream writes the hidden states late (a longer sleep before it) and rewrites them as soon as the
    call returns: without the side copy's wait for the work queued before the call (the fork) it would copy
    them before they are written, and without the serving stream's wait for the copy (the join) after they
    were rewritten. Either way a written call would differ from what the layer saw. ``driver``: the fork and the
    join are the driver's calls on the side stream's two reused events (MOEREPLAY_FLIGHT_BESIDE_DRIVER), the copy
    launched on the side stream's handle; ``driver-on-a-stream``: the same with the layer served on a stream of its
    own, as vLLM serves (not the legacy default stream, whose handle is 0)."""
    tokens = 4096  # hidden states 4096 x 8 float32: 128 KiB, past the 64 KiB threshold
    by_driver = beside.startswith("driver")
    session = _arm(
        tmp_path,
        flight_calls="4",
        flight_beside_bytes="0" if beside == "off" else "64K",
        flight_beside_driver="1" if by_driver else "0",
    )
    serving = contextlib.ExitStack()
    if beside == "driver-on-a-stream":
        serving.enter_context(torch.cuda.stream(torch.cuda.Stream()))
        assert torch._C._cuda_getCurrentRawStream(0) != 0
    flight = session.recorder.flight
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, 8, device="cuda", generator=generator)
    w1 = torch.randn(8, 6, device="cuda", generator=generator)
    w2 = torch.randn(6, 8, device="cuda", generator=generator)
    weights = torch.rand(tokens, device="cuda", generator=generator)
    out = torch.empty(tokens, 8, device="cuda")
    hidden = torch.empty(tokens, 8, device="cuda")
    kernels.fused(x.clone(), w1, w2, weights, out)  # the ring and its side stream exist from here
    torch.cuda.synchronize()
    side = flight._besides.get(0)  # type: ignore[union-attr]
    driver = flight._driver_besides.get(0)  # type: ignore[union-attr]
    assert (side is not None, driver is not None) == (beside == "events", by_driver)
    holds = []
    if beside != "off":
        ring = next(iter(flight._rings.values()))  # type: ignore[union-attr]
        record = ring.record

        def held(*args, **kwargs):
            on_side = (
                kwargs.get("stream") == driver.raw
                if driver is not None
                else torch.cuda.current_stream(0) == side
            )
            if on_side:  # after the side stream's wait for the fork
                holds.append(1)
                with torch.cuda.stream(driver.stream if driver is not None else side):
                    torch.cuda._sleep(10_000_000)
            return record(*args, **kwargs)

        monkeypatch.setattr(ring, "record", held)
    seen = []
    for step in range(6):
        torch.cuda._sleep(30_000_000)  # longer than the side copy's hold: the hidden states are written late
        hidden.copy_(x + step)
        if step == 5:
            hidden[1, 2] = float("nan")
        result = kernels.fused(hidden, w1, w2, weights, out)
        seen.append((hidden.clone(), result.clone()))
        hidden.fill_(-1.0)  # rewritten as soon as the call returns (vLLM's in-place residual add)
    serving.close()
    assert len(holds) == (0 if beside == "off" else 6)  # every side copy was held back
    if (
        driver is not None
    ):  # every call's fork and join went through the reused pair (none fell back to events)
        assert 0 not in flight._besides and not driver.claim.locked()  # type: ignore[union-attr]
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        counters = reader.footer["counters"]
        assert counters["flight_beside"] == (0 if beside == "off" else 7), counters
        assert [r.context["call"] for r in records] == [3, 4, 5, 6], counters
        for record in records:
            value, result = seen[record.context["call"] - 1]
            assert torch.equal(_bits(reader.load_args(record.index)["hidden"]), _bits(value)), record.index
            assert torch.equal(_bits(reader.load_outputs(record.index)["output"]), _bits(result))


def test_a_call_too_large_for_the_ring_lets_the_driver_pair_go(kernels, tmp_path: Path) -> None:
    """MOEREPLAY_FLIGHT_BESIDE_DRIVER: a call whose inputs pass the beside threshold but not the ring (TooLarge
    from the side copy's reservation) is not kept, and the fork/join pair it claimed is let go — the calls after it
    still go through the driver, none falls back to events of its own, and a trigger writes them bit-exact."""
    session = _arm(
        tmp_path, flight_calls="4", flight_bytes="256K", flight_beside_bytes="16K", flight_beside_driver="1"
    )
    flight = session.recorder.flight
    generator = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(8, 6, device="cuda", generator=generator)
    w2 = torch.randn(6, 8, device="cuda", generator=generator)
    # 512 KiB of hidden states: past the ring
    huge = torch.randn(16384, 8, device="cuda", generator=generator)
    kernels.fused(huge, w1, w2, torch.rand(16384, device="cuda", generator=generator), torch.empty_like(huge))
    driver = flight._driver_besides.get(0)  # type: ignore[union-attr]
    assert driver is not None and not driver.claim.locked()
    assert flight.counters.too_large == 1  # type: ignore[union-attr]
    seen = []
    for step in range(3):
        x = torch.randn(1024, 8, device="cuda", generator=generator)  # 32 KiB: beside, and fits
        if step == 2:
            x[1, 2] = float("nan")  # the trigger: the three calls after the one not kept are written
        weights = torch.rand(1024, device="cuda", generator=generator)
        result = kernels.fused(x, w1, w2, weights, torch.empty_like(x))
        seen.append((x.clone(), result.clone()))
    assert not driver.claim.locked() and 0 not in flight._besides  # type: ignore[union-attr]
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        counters = reader.footer["counters"]
        assert counters["flight_beside"] == 3 and counters["flight_too_large"] == 1, counters
        records = list(reader.calls())
        assert [r.context["call"] for r in records] == [1, 2, 3], counters
        for record, (value, result) in zip(records, seen, strict=True):
            assert torch.equal(_bits(reader.load_args(record.index)["hidden"]), _bits(value))
            assert torch.equal(_bits(reader.load_outputs(record.index)["output"]), _bits(result))


def fresh_layer(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Returns a fresh output each call, as vLLM's ``triton_kernel_moe_forward`` does."""
    return torch.matmul(hidden, weight) * 0.5


@pytest.mark.parametrize("keeping", ["kept", "checked-only", "lean"], ids=lambda k: f"outputs-{k}")
def test_prefill_sized_calls_hold_no_memory_and_are_written_bit_exact(
    stand_in_module: Callable[..., types.ModuleType], tmp_path: Path, monkeypatch, keeping: str
) -> None:
    """A call whose copies take at least RELEASE_BYTES lets go of its tensors when it returns: twelve calls on
    fresh 16 MiB inputs returning fresh 16 MiB outputs leave the allocator where it was, though the history keeps
    four calls for a trigger (held, they would keep 128 MiB). The hidden states come from another stream (a
    producer the serving stream waits for, which never waits for the recorder's side stream), and the side
    stream is held back before each input copy (a sleep queued there): the producer's next fill would take the
    memory let go before the copy read it, unless the release marked it used on the serving stream, which waits
    for the copy. The written calls are bit-exact with what the layer saw and returned only if it did. Lean
    (``MOEREPLAY_FLIGHT_LEAN_BYTES``): nothing is copied beside the call, the bad call alone is written (its bytes
    copied by the launch that found its check bad), the good calls of its history are left out."""
    unkept = keeping == "checked-only"
    module = stand_in_module("moereplay_gpu_release", layer=fresh_layer)
    target = CaptureTarget(
        "layer", "parent", module.__name__, "layer", static=("weight",), inputs_intact=True
    )
    try:
        session = _arm(
            tmp_path,
            targets=(target,),
            flight_calls="4",
            flight_bytes="512M",
            flight_output_bytes="8M" if unkept else "0",  # (checked where it is, not copied)
            flight_lean_bytes="8M" if keeping == "lean" else "0",
        )
        weight = torch.eye(1024, device="cuda")
        module.layer(torch.ones(4096, 1024, device="cuda"), weight)  # the ring and its side stream exist now
        torch.cuda.synchronize()
        flight = session.recorder.flight
        side = flight._besides.get(0)  # type: ignore[union-attr]  # (none when lean)
        ring = next(iter(flight._rings.values()))  # type: ignore[union-attr]
        copy = ring.record
        lean = ring.record_lean

        def held(*args, **kwargs):
            if torch.cuda.current_stream(0) == side:
                torch.cuda._sleep(10_000_000)
            return copy(*args, **kwargs)

        def held_lean(*args, **kwargs):  # the lean launches read the inputs late: their memory must wait
            torch.cuda._sleep(10_000_000)
            return lean(*args, **kwargs)

        monkeypatch.setattr(ring, "record", held)
        monkeypatch.setattr(ring, "record_lean", held_lean)
        baseline = torch.cuda.memory_allocated()
        producer = torch.cuda.Stream()
        for step in range(12):  # no synchronisation: the next call's tensors take the memory let go
            with torch.cuda.stream(producer):
                hidden = _hidden(step)
            torch.cuda.current_stream().wait_stream(producer)
            output = module.layer(hidden, weight)
            del hidden, output
        torch.cuda.synchronize()
        grown = torch.cuda.memory_allocated() - baseline
        assert grown < 8 << 20, f"{grown / 2**20:.0f} MiB still allocated after the calls"
        counters = flight.counters  # type: ignore[union-attr]
        assert counters.beside == (0 if keeping == "lean" else 13) and counters.released == 13
        assert counters.outputs_unkept == (13 if unkept else 0)
        assert counters.lean == (13 if keeping == "lean" else 0)
        session.flush()
        session.close()
    finally:
        session_module.disarm()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        if keeping == "lean":  # the good calls 8-10 had no bytes kept: left out
            assert [r.context["call"] for r in records] == [11]
            assert reader.footer["counters"]["flight_lean_left_out"] == 3
        else:
            assert [r.context["call"] for r in records] == [8, 9, 10, 11]
        assert records[-1].context["flight"]["trigger"]
        for record in records:
            hidden = _hidden(record.context["call"] - 1)
            assert torch.equal(_bits(reader.load_args(record.index)["hidden"]), _bits(hidden)), record.index
            output = reader.load_outputs(record.index)["return"]
            expected = fresh_layer(hidden, weight)
            if unkept:  # the NaN found all the same, by the check of the output where the call left it
                assert isinstance(output, Unsupported) and "not kept" in output.repr_excerpt
                # and the ring kernel's fingerprint of its bytes (mode 4) is the host's of the same bytes
                printed = record.context["flight"]["fingerprint"]
                assert printed == f"{byte_fingerprint(expected):016x}", record.index
                continue
            assert torch.equal(_bits(output), _bits(expected)), record.index


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_record_lean_copies_only_a_call_whose_check_is_over(dtype: torch.dtype) -> None:
    """``DeviceRing.record_lean`` (mode 2 then mode 5): the ring's reserved bytes are written exactly when the
    output's largest magnitude is over ``over_bits(absmax)`` — NaN, Inf, or above absmax — and the finished word is
    published either way (its magnitude the output's)."""
    ring = DeviceRing(1 << 26, torch.device("cuda", 0))
    hidden = torch.randn(3000, 1001, device="cuda").to(dtype)
    routing = torch.arange(4001, dtype=torch.int32, device="cuda")  # (bytes past its last whole word)
    cases = [  # (largest |output|, absmax, kept)
        (5.0, None, False),
        (float("inf"), None, True),
        (float("nan"), None, True),
        (5.0, 4.0, True),
        (5.0, 6.0, False),
        (4.0, 4.0, False),
    ]
    for largest, absmax, kept in cases:
        ring.buffer.fill_(0xAB)
        output = torch.full((3000, 999), 0.5, device="cuda", dtype=dtype)
        output[2999, 998] = -largest
        starts, leads, sizes, tag = ring.record_lean([hidden, routing, output], output, over_bits(absmax))
        torch.cuda.synchronize()
        assert tag is not None and ring.host_words is not None
        state, value = decode_word(int(ring.host_words[tag[0]]), tag[1])
        assert state == "ok" and (math.isnan(value) if math.isnan(largest) else value == largest), (
            largest,
            value,
        )
        for tensor, start, lead, size in zip([hidden, routing, output], starts, leads, sizes, strict=True):
            held = ring.view(start + lead, size - lead)
            if kept:
                assert torch.equal(held.cpu(), _bits(tensor).reshape(-1)), (largest, absmax)
            else:
                assert bool((held == 0xAB).all()), (largest, absmax)


def _hidden(step: int) -> torch.Tensor:
    hidden = torch.full((4096, 1024), float(step + 1), device="cuda")
    if step == 10:
        hidden[4095, 3] = float("nan")
    return hidden


# --- vLLM's real fused_marlin_moe ----------------------------------------------------------------------------------


def test_real_fused_marlin_moe_layer_calls_are_kept_bit_exact(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper (sm_90+) GPU")
    marlin = importlib.import_module(MARLIN_MODULE)
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import rand_marlin_weight_nvfp4_like
    from vllm.scalar_type import scalar_types

    def experts(n: int, k: int):
        q, s, g = [], [], []
        for _ in range(32):
            _ref, qweight, scale, global_scale = rand_marlin_weight_nvfp4_like(
                torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 20, 16
            )
            q.append(qweight)
            s.append(scale)
            g.append(global_scale)
        return torch.stack(q), torch.stack(s), torch.stack(g).reshape(32)

    torch.manual_seed(0)
    (w1, s1, g1), (w2, s2, g2) = experts(2 * 2944, 2880), experts(2880, 2944)
    session = session_module.arm(
        {"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_DIR": str(tmp_path / "captures"), "MOEREPLAY_TRIGGER": "flight"}
    )
    assert session is not None
    try:
        assert session.recorder.layer_scope
        out = torch.empty(8, 2880, device="cuda", dtype=torch.bfloat16)
        seen = []
        for step in range(20):
            x = torch.randn(8, 2880, device="cuda", dtype=torch.bfloat16)
            if step == 15:
                x[3, 7] = float("nan")
            scores = torch.randn(8, 32, device="cuda")
            weights, ids = torch.softmax(scores, -1).topk(4)
            weights, ids = weights.contiguous(), ids.to(torch.int32).contiguous()
            result = marlin.fused_marlin_moe(
                x, w1, w2, None, None, s1, s2, weights, ids, scalar_types.float4_e2m1f.id,
                global_scale1=g1, global_scale2=g2, output=out,
            )  # fmt: skip
            seen.append((x.clone(), weights.clone(), ids.clone(), result.clone()))
        torch.cuda.synchronize()
        assert session.flush(timeout=120)
    finally:
        session_module.disarm()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        counters = reader.footer["counters"]
        print(
            f"\nlayer-scope flight, real fused_marlin_moe: {len(records)} layer calls written, counters {counters}"
        )
        assert [r.op for r in records] == ["fused_marlin_moe"] * 16
        assert records[-1].context["flight"]["trigger"] and records[-1].context["call"] == 15
        assert counters["recorder_seen"] == 20 and counters["flight_checked"] == 20
        for record in records:
            x, weights, ids, result = seen[record.context["call"]]
            args = reader.load_args(record.index)
            outputs = reader.load_outputs(record.index)
            assert torch.equal(_bits(args["hidden_states"]), _bits(x))
            assert torch.equal(_bits(args["topk_weights"]), _bits(weights))
            assert torch.equal(_bits(args["topk_ids"]), _bits(ids))
            assert torch.equal(_bits(outputs["output"]), _bits(result))
            assert args["w1"].shape == w1.shape  # weights: stored once per file
