"""The capture hot path's shortcuts: precomputed binding, reused copy buffers, device-side magnitude slots."""

from __future__ import annotations

import inspect
import math
import types

import pytest
import torch

from moereplay.capture.binding import ArgumentBinder
from moereplay.capture.flight import MagnitudeSlots
from moereplay.capture.snapshot import BufferPool, TensorCopy, bucket_size, snapshot
from moereplay.format import CaptureReader

MARLIN_0_25 = (
    "input, output, b_qweight, b_bias, b_scales, a_scales, global_scale, b_qzeros, g_idx, perm, workspace, "
    "sorted_token_ids, expert_ids, num_tokens_past_padded, topk_weights, moe_block_size, top_k, "
    "mul_topk_weights, b_q_type, size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce, "
    "is_zp_float, thread_k=-1, thread_n=-1, blocks_per_sm=-1"
)
# vLLM main (vllm/_custom_ops.py at 0002bde5) drops g_idx, perm and is_k_full
MARLIN_MAIN = MARLIN_0_25.replace("g_idx, perm, ", "").replace("is_k_full, ", "")
FUSED_MARLIN_0_25 = (
    "hidden_states, w1, w2, bias1, bias2, w1_scale, w2_scale, topk_weights, topk_ids, quant_type_id, "
    "apply_router_weight_on_input=False, global_num_experts=-1, activation='silu', activation_func=None, "
    "moe_sum=None, expert_map=None, input_global_scale1=None, input_global_scale2=None, global_scale1=None, "
    "global_scale2=None, g_idx1=None, g_idx2=None, sort_indices1=None, sort_indices2=None, w1_zeros=None, "
    "w2_zeros=None, workspace=None, intermediate_cache13=None, intermediate_cache2=None, is_k_full=True, "
    "output=None, input_dtype=None, clamp_limit=None, gemm1_alpha=1.0, gemm1_beta=0.0"
)


def function(parameters: str) -> types.FunctionType:
    namespace: dict[str, object] = {}
    exec(f"def kernel({parameters}):\n    return None\n", namespace)
    return namespace["kernel"]  # type: ignore[return-value]


@pytest.mark.parametrize("parameters", [MARLIN_0_25, MARLIN_MAIN, FUSED_MARLIN_0_25])
@pytest.mark.parametrize("split", [0, 3, 10, 26, None])
def test_binder_binds_exactly_like_inspect(parameters: str, split: int | None) -> None:
    kernel = function(parameters)
    signature = inspect.signature(kernel)
    names = list(signature.parameters)
    required = [n for n, p in signature.parameters.items() if p.default is p.empty]
    values = {name: object() for name in names}
    passed = required if split != 26 else names[: max(len(required), 26)]
    cut = len(passed) if split is None else min(split, len(passed))
    args = tuple(values[name] for name in passed[:cut])
    kwargs = {name: values[name] for name in passed[cut:]}
    if split == 3:  # one defaulted parameter passed by keyword out of order
        kwargs[names[-1]] = values[names[-1]]
    expected = signature.bind(*args, **kwargs)
    expected.apply_defaults()
    bound = ArgumentBinder.of(kernel).bind(args, kwargs)
    assert list(bound) == list(expected.arguments) or set(bound) == set(expected.arguments)
    assert all(bound[name] is expected.arguments[name] for name in expected.arguments)


def test_bucket_sizes_cover_the_request_with_little_slack() -> None:
    for nbytes in (1, 4096, 4097, 10_000, 2**20 + 1, 96 * 2**20 + 12345):
        size = bucket_size(nbytes)
        assert size >= nbytes and (nbytes <= 4096 or size <= nbytes * 1.125 + 1)


def test_pool_reuses_a_given_back_buffer_and_caps_what_it_keeps() -> None:
    pool = BufferPool(max_free_bytes=8192)
    lease = pool.take(torch.device("cpu"), 5000, pinned=False)
    buffer = lease.buffer
    lease.give_back()
    lease.give_back()  # once only
    again = pool.take(torch.device("cpu"), 5100, pinned=False)
    assert again.buffer is buffer and pool.reused == 1 and pool.allocated == 1
    other = pool.take(torch.device("cpu"), 5000, pinned=False)
    assert other.buffer is not buffer
    again.give_back()
    other.give_back()  # over the cap: freed, not kept
    assert pool.take(torch.device("cpu"), 5000, pinned=False).buffer is buffer
    assert pool.take(torch.device("cpu"), 5000, pinned=False).buffer is not buffer


def test_snapshots_in_reused_buffers_hold_each_calls_own_bytes() -> None:
    pool = BufferPool(1 << 20)
    storage = torch.zeros(64)
    trees = []
    for step in range(4):
        storage.copy_(torch.arange(64.0) + step)
        values = {"a": storage[3:9], "b": storage[40:50].view(torch.int32), "n": step}
        taken = snapshot(values, pool=pool)
        copies = {k: v for k, v in taken.tree.items() if isinstance(v, TensorCopy)}
        assert torch.equal(copies["a"].view(), torch.arange(3.0, 9.0) + step)
        assert torch.equal(copies["b"].view(), (torch.arange(40.0, 50.0) + step).view(torch.int32))
        assert copies["a"].data.untyped_storage().data_ptr() == copies["b"].data.untyped_storage().data_ptr()
        trees.append(taken)
        taken.release()
    assert pool.allocated == 1 and pool.reused == 3


def test_magnitude_slots_on_cpu_propagate_nan_and_detect_reuse() -> None:
    slots = MagnitudeSlots(4)  # call 3 takes no slot
    finite = slots.record(0, [torch.tensor([1.0, -5.0]), torch.tensor([2], dtype=torch.int32)])
    nan = slots.record(1, [torch.tensor([7.0]), torch.tensor([float("nan"), 1.0])])
    inf = slots.record(2, [torch.tensor([float("-inf")], dtype=torch.bfloat16)])
    assert slots.record(3, [torch.tensor([1, 2])]) is None  # nothing floating point to check
    fp8 = slots.record(4, [torch.tensor([2.0, -4.0]).to(torch.float8_e4m3fn)])
    assert fp8 is not None and slots.read(4, fp8) == 4.0
    assert finite is not None and nan is not None and inf is not None
    assert slots.read(0, finite) == 5.0
    assert math.isnan(slots.read(1, nan))  # type: ignore[arg-type]
    assert slots.read(2, inf) == math.inf
    slots.record(5, [torch.tensor([1.0])])  # wraps around onto call 0's slot
    with pytest.raises(LookupError):
        slots.read(0, finite)


def test_flight_ring_reuses_its_buffers_and_writes_nothing_while_outputs_stay_finite(
    arm, kernels: types.ModuleType, inputs
) -> None:
    session = arm(trigger="flight", flight_calls="4")
    x, w1, w2, weights = inputs()
    for step in range(40):
        kernels.fused(x + step, w1, w2, weights)
    pool = session.recorder.pool
    assert pool.reused > pool.allocated  # ring entries leaving the ring hand their buffers to new calls
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        assert len(reader) == 0
        assert reader.footer["counters"]["flight_checked"] == 120


def test_flight_trigger_after_buffer_reuse_writes_the_right_bytes(
    arm, kernels: types.ModuleType, inputs
) -> None:
    session = arm(trigger="flight", flight_calls="6")
    x, w1, w2, weights = inputs()
    for step in range(30):
        value = x + step
        if step == 25:
            value = value.clone()
            value[0, 0] = float("inf")
        kernels.fused(value, w1, w2, weights)
    assert session.recorder.pool.reused > 0
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        assert records and records[-1].context["flight"]["trigger"]
        for record in records:
            step = record.context["call"] // 3
            args = reader.load_args(record.index)
            if record.op == "fused":
                expected = x + step
                if step == 25:
                    expected = expected.clone()
                    expected[0, 0] = float("inf")
                assert torch.equal(args["hidden"], expected)
            else:
                assert torch.equal(args["weight"], w1 if record.context["call"] % 3 == 1 else w2)


def test_full_capture_staging_buffers_are_reused_and_every_call_keeps_its_bytes(
    arm, kernels: types.ModuleType, inputs
) -> None:
    session = arm()
    x, w1, w2, weights = inputs()
    for step in range(20):
        kernels.fused(x + step, w1, w2, weights)
        session.flush()  # the writer gives each call's staging buffers back before the next call
    assert session.recorder.pool.reused > 0
    session.close()
    with CaptureReader(session.path) as reader:
        parents = [r for r in reader.calls() if r.op == "fused"]
        assert len(parents) == 20
        for step, record in enumerate(parents):
            assert torch.equal(reader.load_args(record.index)["hidden"], x + step)
            assert torch.equal(
                reader.load_outputs(record.index)["return"], kernels.fused(x + step, w1, w2, weights)
            )


def test_writer_hash_threads_store_the_same_verified_and_deduplicated_blobs(tmp_path) -> None:
    from moereplay.format import CaptureWriter
    from moereplay.format.schema import TensorBytes

    generator = torch.Generator().manual_seed(1)
    spans = [torch.randint(0, 255, (n,), dtype=torch.uint8, generator=generator) for n in (3 << 20, 1 << 20)]
    spans.append(spans[0].clone())  # same bytes, another storage: one blob
    args = {
        f"t{i}": TensorBytes(torch.uint8, (span.numel(),), (1,), 0, "cpu", ("s", i), 0, span)
        for i, span in enumerate(spans)
    }
    files = {}
    for hash_threads in (0, 2):
        path = tmp_path / f"h{hash_threads}.zst"
        with CaptureWriter(path, hash_threads=hash_threads) as writer:
            writer.begin_call("op", args)
            files[hash_threads] = writer.blob_count
        with CaptureReader(path) as reader:
            loaded = reader.load_args(0)  # every blob's sha256 is checked on load
            assert all(torch.equal(loaded[f"t{i}"], span) for i, span in enumerate(spans))
    assert files == {0: 2, 2: 2}
