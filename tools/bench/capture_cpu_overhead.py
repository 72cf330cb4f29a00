"""Capture overhead per wrapped call on the CPU: the serving-thread Python cost of the recorder, without a GPU.

A throwaway module holds a ``moe_wna16_marlin_gemm`` with vLLM 0.25.1's 29-parameter signature (26 passed, the
launch defaults left out, as vLLM calls it) and a ``fused_marlin_moe`` parent that calls it twice, wrapped with
the real patch points' static and output names (3 wrapped calls per layer call, as at gpt-oss decode). The
"kernels" do almost nothing (one small in-place write), so the time measured is the capture's own cost. The
weights are large (``--weight-mb``): they must be found by identity, never copied per call.

Modes, in one run: ``off`` (nothing wrapped); ``bare wrapper`` (a plain Python pass-through wrapper per call);
``extra op`` (that wrapper plus one tiny torch op per call: the per-launch floor's CPU analogue);
``armed nothing selected`` (capture armed, ``MOEREPLAY_OPS_EXCLUDE=*``: the recorder's bookkeeping alone);
``flight`` (``MOEREPLAY_TRIGGER=flight``) and ``full`` (every call written). Prints µs per layer call and
capture overhead per wrapped call. On a CPU the copies and the magnitude reductions are real (tiny) CPU work
where a GPU host pays a launch each; pinned allocations and CUDA events do not exist here at all.

    python tools/bench/capture_cpu_overhead.py [--calls 2000] [--tokens 1] [--profile] [--modes off,flight]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from moereplay.capture import session as session_module
from moereplay.capture.patch_points import CaptureTarget
from moereplay.ops.marlin_surface import FUSED_MARLIN_SCRATCH, FUSED_MARLIN_STATIC, MARLIN_GEMM_STATIC

MODULE = "moereplay_bench_kernels"
EXPERTS, TOP_K, HIDDEN, INNER = 32, 4, 2880, 2944


def moe_wna16_marlin_gemm(
    input, output, b_qweight, b_bias, b_scales, a_scales, global_scale, b_qzeros, g_idx, perm, workspace,
    sorted_token_ids, expert_ids, num_tokens_past_padded, topk_weights, moe_block_size, top_k,
    mul_topk_weights, b_q_type, size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce,
    is_zp_float, thread_k=-1, thread_n=-1, blocks_per_sm=-1,
):  # fmt: skip
    if output is None:
        output = torch.zeros(size_m * top_k, size_n, dtype=input.dtype)
    output[:1, :1].fill_(1.0)
    return output


def fused_marlin_moe(
    hidden_states, w1, w2, bias1, bias2, w1_scale, w2_scale, topk_weights, topk_ids, quant_type_id,
    apply_router_weight_on_input=False, global_num_experts=-1, activation="silu", activation_func=None,
    moe_sum=None, expert_map=None, input_global_scale1=None, input_global_scale2=None, global_scale1=None,
    global_scale2=None, g_idx1=None, g_idx2=None, sort_indices1=None, sort_indices2=None, w1_zeros=None,
    w2_zeros=None, workspace=None, intermediate_cache13=None, intermediate_cache2=None, is_k_full=True,
    output=None, input_dtype=None, clamp_limit=None, gemm1_alpha=1.0, gemm1_beta=0.0,
):  # fmt: skip
    module = sys.modules[MODULE]
    m = hidden_states.shape[0]
    block = 16
    padded = max(EXPERTS * block, m * TOP_K + EXPERTS * (block - 1))
    sorted_ids = torch.zeros(padded, dtype=torch.int32)
    expert_ids = torch.zeros(padded // block, dtype=torch.int32)
    past = torch.tensor([padded], dtype=torch.int32)
    cache13 = torch.zeros(m * TOP_K * max(2 * INNER, HIDDEN), dtype=hidden_states.dtype)
    cache2 = torch.zeros(m * TOP_K, INNER, dtype=hidden_states.dtype)
    if workspace is None:
        workspace = torch.zeros(528, dtype=torch.int32)
    first = cache13[: m * TOP_K * 2 * INNER].view(m * TOP_K, 2 * INNER)
    module.moe_wna16_marlin_gemm(
        hidden_states, first, w1, bias1, w1_scale, None, global_scale1, w1_zeros, g_idx1, sort_indices1,
        workspace, sorted_ids, expert_ids, past, topk_weights, block, TOP_K, False, quant_type_id, m,
        2 * INNER, HIDDEN, is_k_full, False, True, False,
    )  # fmt: skip
    cache2.copy_(first[:, :INNER])
    second = cache13[: m * TOP_K * HIDDEN].view(m * TOP_K, HIDDEN)
    module.moe_wna16_marlin_gemm(
        cache2, second, w2, bias2, w2_scale, None, global_scale2, w2_zeros, g_idx2, sort_indices2,
        workspace, sorted_ids, expert_ids, past, topk_weights, block, 1, True, quant_type_id, m * TOP_K,
        HIDDEN, INNER, is_k_full, False, True, False,
    )  # fmt: skip
    result = output if output is not None else torch.zeros(m, HIDDEN, dtype=hidden_states.dtype)
    result.copy_(second.view(m, TOP_K, HIDDEN).sum(1))
    return result


TARGETS = (
    CaptureTarget(
        "moe_wna16_marlin_gemm", "kernel", MODULE, "moe_wna16_marlin_gemm",
        static=MARLIN_GEMM_STATIC, outputs=("output", "workspace"),
    ),
    CaptureTarget(
        "fused_marlin_moe", "parent", MODULE, "fused_marlin_moe", static=FUSED_MARLIN_STATIC, outputs=("output",),
        scratch=FUSED_MARLIN_SCRATCH, inputs_intact=True,
    ),  # as the real patch point declares it (capture/patch_points.py)
)  # fmt: skip


def install() -> types.ModuleType:
    module = types.ModuleType(MODULE)
    module.moe_wna16_marlin_gemm = moe_wna16_marlin_gemm  # type: ignore[attr-defined]
    module.fused_marlin_moe = fused_marlin_moe  # type: ignore[attr-defined]
    sys.modules[MODULE] = module
    return module


def weights(weight_mb: int) -> dict[str, torch.Tensor]:
    """NVFP4-like packed weights (int32), scales (fp8 as uint8 here) and global scales; ``weight_mb`` per w."""
    words = weight_mb * 2**20 // 4
    per_expert = max(words // EXPERTS, 1)
    return {
        "w1": torch.randint(-(2**31), 2**31 - 1, (EXPERTS, per_expert), dtype=torch.int32),
        "w2": torch.randint(-(2**31), 2**31 - 1, (EXPERTS, per_expert), dtype=torch.int32),
        "w1_scale": torch.randint(0, 255, (EXPERTS, HIDDEN // 16, 2 * INNER), dtype=torch.uint8),
        "w2_scale": torch.randint(0, 255, (EXPERTS, INNER // 16, HIDDEN), dtype=torch.uint8),
        "global_scale1": torch.rand(EXPERTS),
        "global_scale2": torch.rand(EXPERTS),
    }


def layer_inputs(tokens: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(count):
        x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16)
        scores, ids = torch.softmax(torch.randn(tokens, EXPERTS), -1).topk(TOP_K)
        out.append((x, scores.contiguous(), ids.to(torch.int32)))
    return out


def run_calls(module, w, inputs, calls: int) -> float:
    """Serving-thread CPU seconds per layer call (``time.thread_time``: what the thread itself spent, so other
    processes on a shared machine disturb it less than wall time)."""
    started = time.thread_time()
    for i in range(calls):
        x, scores, ids = inputs[i % len(inputs)]
        module.fused_marlin_moe(
            x, w["w1"], w["w2"], None, None, w["w1_scale"], w["w2_scale"], scores, ids, 17,
            global_scale1=w["global_scale1"], global_scale2=w["global_scale2"],
        )  # fmt: skip
    return (time.thread_time() - started) / calls


def measure(mode: str, env: dict[str, str], module, w, inputs, calls: int, out: Path, profile: bool):
    session = None
    if env:
        full = {"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_DIR": str(out / mode.replace(" ", "-")), **env}
        session = session_module.arm(full, targets=TARGETS)
    run_calls(module, w, inputs, 20)  # warm-up: static weights stored, ring slots allocated
    if session is not None:
        session.flush(timeout=600)
    before = session.writer.counters.copied_bytes if session is not None else 0
    profiler = cProfile.Profile() if profile and session is not None else None
    if profiler is not None:
        profiler.enable()
    started = time.perf_counter()
    per_layer = run_calls(module, w, inputs, calls)
    serving = time.perf_counter() - started
    if profiler is not None:
        profiler.disable()
    drained = serving
    copied = 0
    if session is not None:
        session.flush(timeout=600)
        drained = time.perf_counter() - started
        copied = session.writer.counters.copied_bytes - before
        session_module.disarm()
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
        print(f"--- cProfile {mode} (tottime) ---\n" + "\n".join(text.getvalue().splitlines()[6:32]))
    return per_layer, copied, drained


def wrap_plain(module: types.ModuleType, scratch: torch.Tensor | None) -> None:
    """Replace both stand-ins with a plain pass-through wrapper (plus one tiny op when ``scratch`` is given)."""
    for name in ("moe_wna16_marlin_gemm", "fused_marlin_moe"):
        original = globals()[name]

        def wrapper(*args, __original=original, **kwargs):
            if scratch is not None:
                scratch.add_(1)
            return __original(*args, **kwargs)

        setattr(module, name, wrapper)


MODES = {
    "off": None,
    "bare wrapper": None,
    "extra op": None,
    "armed nothing selected": {"MOEREPLAY_OPS_EXCLUDE": "*"},
    "flight": {"MOEREPLAY_TRIGGER": "flight"},
    "full": {"MOEREPLAY_QUEUE_CALLS": "100000", "MOEREPLAY_QUEUE_BYTES": "8G"},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="layer calls per mode")
    parser.add_argument("--tokens", type=int, default=1, help="M: tokens per layer call")
    parser.add_argument("--weight-mb", type=int, default=64, help="size of each of w1, w2")
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES)
    )
    parser.add_argument("--profile", action="store_true", help="print a cProfile of each armed mode")
    parser.add_argument("--repeat", type=int, default=3, help="best of this many runs per mode")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (the serving thread's view)"
    )
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    torch.manual_seed(0)
    w = weights(options.weight_mb)
    inputs = layer_inputs(options.tokens, 64)
    out = Path(tempfile.mkdtemp(prefix="capture-overhead-"))
    print(
        f"capture_cpu_overhead: torch {torch.__version__}, M={options.tokens}, {options.calls} layer calls "
        f"(3 wrapped calls each), weights {options.weight_mb} MB each, best of {options.repeat}"
    )
    results: dict[str, float] = {}
    for mode in options.modes.split(","):
        mode = mode.strip()
        env = MODES[mode]
        module = install()
        if mode == "bare wrapper":
            wrap_plain(module, None)
        elif mode == "extra op":
            wrap_plain(module, torch.zeros(1))
        best = float("inf")
        for attempt in range(options.repeat):
            per_layer, _copied, _drained = measure(
                mode, env or {}, module, w, inputs, options.calls, out, options.profile and attempt == 0
            )
            best = min(best, per_layer)
        results[mode] = best
        base = results.get("off", best)
        print(
            f"{mode:>24}: {best * 1e6:8.1f} µs serving-thread CPU per layer call, "
            f"{(best - base) / 3 * 1e6:7.1f} µs per wrapped call over off",
            flush=True,
        )
    sys.modules.pop(MODULE, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
