"""Serving-thread cost of the layer-scope flight recorder per gpt-oss layer call, on the CPU (no GPU, no vLLM).

The layer recorder's host work per outermost call is Python: binding, the walk of triton_kernels' routing objects
through their codecs, measuring the copy spans, building the launch's arguments. This times exactly that work —
``LayerFlight.before`` and ``after`` — on a call shaped like vLLM 0.25.1's ``triton_kernel_fused_experts`` at
decode (hidden states, RoutingData with its ExptData block maps, GatherIndx, ScatterIndx, the output buffer; the
weights static), with the ring's launch replaced by a no-op that takes the same arguments (the launch itself is
``capture_bench --phases``' business, on the GPU). The routing objects are moereplay's plain specs of them, which
go through the same codecs.

Prints µs per layer call (median of rounds) for that call and for the one the recorder keeps for gpt-oss since
2026-12-06, ``triton_kernel_moe_forward`` (hidden states and router logits; the routing objects are made inside
it), timed in interleaved rounds, with their ratio; with ``--pieces``, where the first one's time goes. Run it before and after a
change to the recorder's serving path: the ratio between two runs on one machine is the measurement.

Then ``triton_kernel_moe_forward`` at a prefill of ``--prefill`` tokens, with and without letting go of its tensors
after the copy (``LayerFlight.release``, for calls of at least ``flight_layer.RELEASE_BYTES``), interleaved: what
reading the tensors' metadata on the serving thread costs a call that keeps the device busy for a millisecond or
more.

With ``--gc``, the interpreter's collections per generation over as many recorded calls, after freezing the heap
as vLLM does (on the development CPU, 2026-12-07: none in 14,000 recorded calls — the recorder's objects are freed
by reference counting as calls leave the history).

With ``--whole``, instead: the whole serving-thread path the plugin installs per wrapped
``triton_kernel_moe_forward`` call — its wrapper, ``where`` in a forward context shaped as vLLM 0.25.1's, the
binding, the recorder's before and after — less the bare stand-in's own, at decode and at ``--prefill`` tokens
(on the development CPU, 2026-12-08: 21.6–26.5 µs at 32 tokens, 28.8–31.5 µs at 2,048). The served footer's
figure for the same path was 376 µs per prefill call on an H100 host (2026-12-08): the same pieces' timers read
about 5× the development CPU's for pure Python (``where`` 25.1 against 4.4 µs, ``bind`` 9.1 against 1.7), before
the launches and the stream calls.

    python tools/bench/layer_recorder_bench.py [--calls 2000] [--rounds 7] [--pieces] [--prefill 2048] [--gc]
    python tools/bench/layer_recorder_bench.py --whole [--pieces]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moereplay.capture import device_ring, flight_layer
from moereplay.capture.context import Where
from moereplay.ops import (
    matmul_ogs,  # noqa: F401  (registers the triton_kernels codecs)
    ogs_codecs,
)
from moereplay.ops.surface import CaptureTarget

TOKENS, TOP_K, EXPERTS, HIDDEN = 32, 4, 32, 2880


def layer_call_arguments() -> dict[str, object]:
    """Bound arguments shaped as vLLM's gpt-oss layer call at decode (CPU tensors)."""
    rows = TOKENS * TOP_K

    def ints(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int32)

    blocks = (16, 32, 64, 128)
    expt = ogs_codecs.ExptDataSpec(
        hist=ints(EXPERTS),
        token_offs_raw=ints(EXPERTS + 1),
        token_offs_pad={block: ints(EXPERTS + 1) for block in blocks},
        block_pid_map={block: ints(rows // block + EXPERTS) for block in blocks},
    )
    routing = ogs_codecs.RoutingSpec(
        gate_scal=torch.rand(rows), expt_hist=ints(EXPERTS), n_expts_tot=EXPERTS, n_expts_act=TOP_K,
        expt_data=expt, expected_tokens_per_expt=None,
    )  # fmt: skip
    return {
        "output_tensor": torch.zeros(TOKENS, HIDDEN, dtype=torch.bfloat16),
        "hidden_states": torch.randn(TOKENS, HIDDEN).to(torch.bfloat16),
        "w1": torch.zeros(8, 8),
        "w2": torch.zeros(8, 8),
        "routing_data": routing,
        "gather_indx": ogs_codecs.GatherSpec(ints(rows), ints(rows)),
        "scatter_indx": ogs_codecs.ScatterSpec(ints(rows), ints(rows)),
        "topk": TOP_K,
        "activation": "swigluoai",
        "quant_config": None,
        "apply_router_weight_on_input": False,
        "global_num_experts": EXPERTS,
        "expert_map": None,
        "intermediate_cache": torch.zeros(rows, 2 * HIDDEN, dtype=torch.bfloat16),
        "a1q_scale": None,
    }


class NoLaunch:
    """Stands in for a compiled ring variant: takes the launch's arguments, copies nothing, and publishes the tag
    word as the kernel's last program does (generation, magnitude 0) — the serving thread's check after the call
    then finds finished words, as it does on the GPU."""

    def __call__(self, programs: int, stream: int, args: list[int]) -> None:
        host, generation = args[-1], args[-3]
        if host:
            ctypes.c_int64.from_address(host).value = generation << 32


def flight_with_a_no_op_launch() -> flight_layer.LayerFlight:
    def ring(capacity: int, device: torch.device, **options: object) -> device_ring.DeviceRing:
        made = device_ring.DeviceRing(capacity, torch.device("cpu"), use_kernel=False)
        launcher = object.__new__(device_ring._Launcher)
        launcher.device, launcher.index, launcher.programs = torch.device("cpu"), 0, 264
        variants = ((a, c, m) for a in (0, 1) for c in (0, 1, 2, 3) for m in (0, 1, 2, 3))
        launcher._variants = {key: NoLaunch() for key in variants}
        launcher._get_stream = lambda device: 0
        launcher.stream_stores = False
        launcher.compile_ns = 0
        made.launcher = launcher
        if hasattr(device_ring, "host_words"):  # (absent before 2026-12-04: lets the bench time older trees)
            made.host_words, made._host = device_ring.host_words(made.tags, False)
        return made

    flight_layer.DeviceRing = ring  # type: ignore[misc,assignment]
    return flight_layer.LayerFlight(max_calls=16, max_bytes=1 << 26, absmax=None, emit=lambda *a: True)


def moe_forward_arguments(fused: dict[str, object]) -> dict[str, object]:
    """Bound arguments of the call one level up, ``triton_kernel_moe_forward`` (what the layer-scope flight recorder
    now keeps for gpt-oss): the same hidden states and weights, the router logits instead of the routing objects."""
    return {
        "hidden_states": fused["hidden_states"], "w1": fused["w1"], "w2": fused["w2"],
        "gating_output": torch.randn(TOKENS, EXPERTS), "topk": TOP_K, "renormalize": True,
        "activation": "swigluoai", "quant_config": None, "apply_router_weight_on_input": False,
        "global_num_experts": EXPERTS, "expert_map": None, "unpadded_N_w1": None, "unpadded_K_w1": None,
        "unpadded_N_w2": None, "unpadded_K_w2": None,
    }  # fmt: skip


def report(label: str, samples: dict[str, list[float]], calls: int) -> dict[str, float]:
    """Print each setting's median µs per layer call (with the rounds' range); return the medians."""
    medians = {name: statistics.median(values) for name, values in samples.items()}
    for name, values in samples.items():
        print(
            f"layer_recorder_bench: {label}{name}: {medians[name]:.1f} µs of serving-thread time per layer call "
            f"(min {min(values):.1f}, max {max(values):.1f}; {len(values)} rounds of {calls})"
        )
    return medians


def time_release(
    flight: flight_layer.LayerFlight, target: CaptureTarget, where: Where, options: argparse.Namespace
) -> None:
    """µs per prefill-sized ``triton_kernel_moe_forward`` call with its tensors let go after the copy and kept."""
    tokens = options.prefill
    arguments = moe_forward_arguments(
        {
            "hidden_states": torch.randn(tokens, HIDDEN).to(torch.bfloat16),
            "w1": torch.zeros(8, 8),
            "w2": torch.zeros(8, 8),
        }
    )
    arguments["gating_output"] = torch.randn(tokens, EXPERTS).to(torch.bfloat16)
    output = torch.zeros(tokens, HIDDEN, dtype=torch.bfloat16)
    settings = {"released": flight_layer.RELEASE_BYTES, "kept": 0}
    calls = max(1, options.calls // 4)
    samples: dict[str, list[float]] = {name: [] for name in settings}
    for round_ in range(options.rounds + 1):  # the first round warms up
        for name, release_bytes in settings.items():
            flight.release_bytes = release_bytes
            started = time.perf_counter()
            for i in range(calls):
                call = flight.before(target, dict(arguments), where, i)
                flight.after(call, output, None)
            if round_:
                samples[name].append((time.perf_counter() - started) / calls * 1e6)
    flight.release_bytes = flight_layer.RELEASE_BYTES
    medians = report(f"{tokens} tokens, triton_kernel_moe_forward, tensors ", samples, calls)
    print(
        f"layer_recorder_bench: {tokens} tokens, released − kept = {medians['released'] - medians['kept']:.1f} µs"
    )


STAND_IN = "moereplay_bench_gpt_oss"
"""The module holding the stand-in ``triton_kernel_moe_forward`` the whole-path timing wraps."""


def _stand_in_forward(
    hidden_states: torch.Tensor,
    w1: object,
    w2: object,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    activation: object = "swigluoai",
    quant_config: object = None,
    apply_router_weight_on_input: bool = False,
    global_num_experts: int = -1,
    expert_map: torch.Tensor | None = None,
    unpadded_N_w1: object = None,
    unpadded_K_w1: object = None,
    unpadded_N_w2: object = None,
    unpadded_K_w2: object = None,
) -> torch.Tensor:
    """vLLM 0.25.1's ``triton_kernel_moe_forward`` signature; allocates its output as the real one does, and
    computes nothing (the kernels are the GPU's business)."""
    return torch.empty(hidden_states.shape, dtype=hidden_states.dtype)


def vllm_forward_context(layers: int) -> types.ModuleType:
    """A stand-in ``vllm.forward_context`` module whose forward context is shaped as vLLM 0.25.1's while serving
    gpt-oss: ``no_compile_layers`` holding an attention and an MoE module per layer (the recorder finds the MoE
    layers' names there, and reads each one's parallel configuration), ``all_moe_layers`` unset (vLLM sets it only
    with ``fast_moe_cold_start``), attention metadata present, the CUDA-graph mode ``NONE`` (an eager step)."""

    class Attention(torch.nn.Module):
        pass

    class RoutedExperts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("_expert_map", None)  # no expert parallelism

        @property
        def expert_map(self) -> torch.Tensor | None:
            return self._buffers["_expert_map"]

    class MoERunner(torch.nn.Module):
        """As vLLM 0.25.1's: ``expert_map`` a property reaching the routed experts' buffer."""

        def __init__(self) -> None:
            super().__init__()
            self.routed_experts = RoutedExperts()
            parallel = types.SimpleNamespace(
                tp_rank=0, tp_size=1, ep_rank=0, ep_size=1, dp_rank=0, dp_size=1, use_ep=False
            )
            self.moe_config = types.SimpleNamespace(
                moe_parallel_config=parallel, num_experts=EXPERTS, num_local_experts=EXPERTS
            )

        @property
        def expert_map(self) -> torch.Tensor | None:
            return self.routed_experts.expert_map

    modules: dict[str, torch.nn.Module] = {}
    for layer in range(layers):
        modules[f"model.layers.{layer}.self_attn.attn"] = Attention()
        modules[f"model.layers.{layer}.mlp.experts"] = MoERunner()
    module = types.ModuleType("vllm.forward_context")
    module._forward_context = None  # type: ignore[attr-defined]
    module.is_forward_context_available = lambda: module._forward_context is not None  # type: ignore[attr-defined]
    module.get_forward_context = lambda: module._forward_context  # type: ignore[attr-defined]

    def new_step() -> None:
        module._forward_context = types.SimpleNamespace(  # type: ignore[attr-defined]
            no_compile_layers=modules,
            all_moe_layers=None,
            attn_metadata={"model.layers.0.self_attn.attn": object()},
            cudagraph_runtime_mode=types.SimpleNamespace(name="NONE"),
        )

    module.new_step = new_step  # type: ignore[attr-defined]
    return module


@contextlib.contextmanager
def _stand_ins(stand_in: types.ModuleType, context: types.ModuleType) -> Iterator[None]:
    """The no-op launch ring in ``flight_layer.DeviceRing``'s place and the stand-in modules in ``sys.modules``
    for the duration; whatever was there before is put back (a real ``vllm.forward_context`` included)."""
    names = (STAND_IN, "vllm.forward_context")
    saved = {name: sys.modules.get(name) for name in names}
    original_ring = flight_layer.DeviceRing
    try:
        flight_with_a_no_op_launch()
        sys.modules[STAND_IN] = stand_in
        sys.modules["vllm.forward_context"] = context
        yield
    finally:
        flight_layer.DeviceRing = original_ring  # type: ignore[misc]
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@contextlib.contextmanager
def _armed(target: CaptureTarget, directory: str) -> Iterator[Any]:
    """The flight recorder armed for ``target`` alone (its layer scope), disarmed afterwards whatever happens."""
    from moereplay.capture import session as session_module

    env = {"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_TRIGGER": "flight", "MOEREPLAY_DIR": directory}
    session = session_module.arm(env, targets=(target,))
    try:
        if session is None or not isinstance(session.recorder.flight, flight_layer.LayerFlight):
            raise RuntimeError("the layer-scope flight recorder did not arm")
        yield session
    finally:
        session_module.disarm()


def time_whole(options: argparse.Namespace) -> dict[str, float]:
    """µs per wrapped ``triton_kernel_moe_forward`` call over the whole serving-thread path the plugin installs —
    the wrapper, ``where`` (in a vLLM-shaped forward context), binding, the flight recorder's before and after —
    less the same loop calling the stand-in unwrapped, at decode (``TOKENS``) and at ``--prefill`` tokens, steps of
    24 layer calls in one forward context each. The ring's launch is the no-op one above and the tensors are the
    CPU's, so what it times is the Python: on a GPU host add the launches, ``record_stream`` and, for a
    prefill-sized call, the copy beside it (a side stream's fork and join, served: 154 + 21 µs a call)."""
    import dataclasses
    import tempfile

    from moereplay.capture import session as session_module
    from moereplay.ops import matmul_ogs_surface

    (real,) = (
        target
        for target in session_module.TARGETS
        if target.op == matmul_ogs_surface.FORWARD_PARENT_OP
        and target.module == "vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe"
    )
    target = dataclasses.replace(real, module=STAND_IN, attribute="triton_kernel_moe_forward")
    stand_in = types.ModuleType(STAND_IN)
    stand_in.triton_kernel_moe_forward = _stand_in_forward  # type: ignore[attr-defined]
    layers = 24
    context = vllm_forward_context(layers)
    weights = {"w1": torch.zeros(8, 8), "w2": torch.zeros(8, 8)}
    shapes = {}
    for tokens in (TOKENS, options.prefill):
        if tokens:
            shapes[f"{tokens} tokens"] = (
                torch.randn(tokens, HIDDEN).to(torch.bfloat16),
                torch.randn(tokens, EXPERTS).to(torch.bfloat16),
            )

    def steps(count: int, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        forward = stand_in.triton_kernel_moe_forward
        for _ in range(count):
            context.new_step()
            for _ in range(layers):
                forward(
                    hidden_states=hidden, w1=weights["w1"], w2=weights["w2"], gating_output=logits, topk=TOP_K,
                    renormalize=True, global_num_experts=EXPERTS, expert_map=None, quant_config=None,
                    apply_router_weight_on_input=False,
                )  # fmt: skip

    count = max(1, options.calls // layers)
    samples: dict[str, dict[str, list[float]]] = {name: {"bare": [], "armed": []} for name in shapes}
    with _stand_ins(stand_in, context), tempfile.TemporaryDirectory() as directory:
        for round_ in range(options.rounds + 1):  # the first round warms up
            for name, (hidden, logits) in shapes.items():
                started = time.perf_counter()
                steps(count, hidden, logits)
                bare = time.perf_counter() - started
                with _armed(target, directory) as session:
                    steps(2, hidden, logits)  # its ring made, its plans built
                    started = time.perf_counter()
                    steps(count, hidden, logits)
                    armed = time.perf_counter() - started
                    # every call went through the recorder's whole path (else this times nothing)
                    selected = session.recorder.counters.selected
                    if selected != (count + 2) * layers:
                        raise RuntimeError(
                            f"the armed session selected {selected} of {(count + 2) * layers} calls"
                        )
                if round_:
                    samples[name]["bare"].append(bare / (count * layers) * 1e6)
                    samples[name]["armed"].append(armed / (count * layers) * 1e6)
    medians = {}
    for name, by_mode in samples.items():
        extra = [armed - bare for armed, bare in zip(by_mode["armed"], by_mode["bare"], strict=True)]
        medians[name] = statistics.median(extra)
        print(
            f"layer_recorder_bench: whole path, {name}: {statistics.median(extra):.1f} µs of serving-thread time "
            f"per wrapped layer call more than unwrapped (min {min(extra):.1f}, max {max(extra):.1f}; "
            f"{len(extra)} rounds of {count * layers} calls; unwrapped {statistics.median(by_mode['bare']):.1f} µs)"
        )
    if options.pieces:
        import cProfile
        import pstats

        hidden, logits = shapes[list(shapes)[-1]]
        profiler = cProfile.Profile()
        with (
            _stand_ins(stand_in, context),
            tempfile.TemporaryDirectory() as directory,
            _armed(target, directory),
        ):
            steps(2, hidden, logits)
            profiler.enable()
            try:
                steps(count, hidden, logits)
            finally:
                profiler.disable()
        print(f"--- whole path, {list(shapes)[-1]}, cProfile (tottime) ---")
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(25)
    return medians


def count_collections(
    one: Callable[[int, CaptureTarget, dict[str, object]], None],
    shape: tuple[CaptureTarget, dict[str, object]],
    calls: int,
) -> None:
    """Print the collections each generation made over ``calls`` recorded calls, after ``gc.freeze()``, and over
    as many turns of a loop that records nothing (a copy of the arguments and a new tensor a turn)."""
    target, arguments = shape
    counts = {}
    for label, recording in (("recorded", True), ("not recorded", False)):
        gc.collect()
        gc.freeze()
        before = [generation["collections"] for generation in gc.get_stats()]
        for i in range(calls):
            if recording:
                one(i, target, arguments)
            else:
                dict(arguments)["hidden_states"] = torch.empty(1)
        after = [generation["collections"] for generation in gc.get_stats()]
        gc.unfreeze()
        counts[label] = [b - a for a, b in zip(before, after, strict=True)]
    print(
        f"layer_recorder_bench: collections per generation (0, 1, 2) over {calls} calls after gc.freeze(): "
        + "; ".join(f"{label} {count}" for label, count in counts.items())
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--pieces", action="store_true", help="also time the recorder's pieces (cProfile)")
    parser.add_argument("--prefill", type=int, default=2048, help="tokens of the prefill call (0: not timed)")
    parser.add_argument(
        "--gc",
        action="store_true",
        help="also count the interpreter's collections per generation over --calls × --rounds recorded "
        "triton_kernel_moe_forward calls, after freezing the heap as vLLM does once ready to serve: whether the "
        "recorder's objects outlive reference counting and bring collections on",
    )
    parser.add_argument(
        "--whole",
        action="store_true",
        help="time only the whole serving-thread path the plugin installs (wrapper, where, binding, before, "
        "after) per wrapped triton_kernel_moe_forward call, at decode and at --prefill tokens (with --pieces: "
        "where the prefill call's time goes)",
    )
    options = parser.parse_args()
    if options.whole:
        time_whole(options)
        return 0
    fused_target = CaptureTarget(
        "triton_kernel_fused_experts", "parent", "bench", "triton_kernel_fused_experts",
        static=("w1", "w2", "quant_config"), outputs=("output_tensor",), scratch=("intermediate_cache",),
        inputs_intact=True,
    )  # fmt: skip
    forward_target = CaptureTarget(
        "triton_kernel_moe_forward", "parent", "bench", "triton_kernel_moe_forward",
        static=("w1", "w2", "quant_config", "expert_map"), inputs_intact=True,
    )  # fmt: skip
    bound = layer_call_arguments()
    output = bound["output_tensor"]
    shapes = {
        "triton_kernel_fused_experts": (fused_target, bound),
        "triton_kernel_moe_forward": (forward_target, moe_forward_arguments(bound)),
    }
    flight = flight_with_a_no_op_launch()
    where = Where(0, 1, 0, "model.layers.0.mlp.experts", "run", "NONE")
    inline_absent = not hasattr(flight, "_check_inline")  # before 2026-12-06 the writer thread read the words

    def one(sequence: int, target: CaptureTarget, arguments: dict[str, object]) -> None:
        call = flight.before(target, dict(arguments), where, sequence)
        flight.after(call, output, None)
        if inline_absent and sequence % 64 == 63:  # older trees: the writer thread's share, off the clock
            flight._new.clear()

    for i in range(200):
        for target, arguments in shapes.values():
            one(i, target, arguments)
    samples: dict[str, list[float]] = {name: [] for name in shapes}
    for _ in range(options.rounds):  # interleaved rounds: both shapes see the same machine
        for name, (target, arguments) in shapes.items():
            started = time.perf_counter()
            for i in range(options.calls):
                one(i, target, arguments)
            samples[name].append((time.perf_counter() - started) / options.calls * 1e6)
    medians = report(f"{torch.__version__}, {TOKENS} tokens, top-{TOP_K}, ", samples, options.calls)
    print(
        "layer_recorder_bench: triton_kernel_moe_forward / triton_kernel_fused_experts = "
        f"{medians['triton_kernel_moe_forward'] / medians['triton_kernel_fused_experts']:.2f}"
    )
    if options.prefill:
        time_release(flight, forward_target, where, options)
    if options.gc:
        count_collections(one, shapes["triton_kernel_moe_forward"], options.calls * options.rounds)
    if options.pieces:
        import cProfile
        import pstats

        target, arguments = shapes["triton_kernel_fused_experts"]
        profiler = cProfile.Profile()
        profiler.enable()
        for i in range(options.calls):
            one(i, target, arguments)
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(18)
    return 0


if __name__ == "__main__":
    sys.exit(main())
