"""Parts 2-5 of ``tools/gpu/fused_moe_proof.py`` (see its docstring): the launch-config sweep, the guard fills, the
w13 layout probe, and kernel vs reference time. Each takes the proof's state (``fused_moe_proof.Proof``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from proof_report import number, say, table

TIMED_SKIP = ("bf16-ep", "bf16-top1-input")  # the bf16 kernel again
SWEEP: dict[str, tuple[int, ...]] = {
    "BLOCK_SIZE_M": (16, 32, 64, 128),
    "BLOCK_SIZE_N": (32, 64, 128),
    "BLOCK_SIZE_K": (32, 64, 128),
    "GROUP_SIZE_M": (1, 8),
    "num_warps": (2, 4, 8),
    "num_stages": (2, 3, 4),
}
"""Values per launch setting (all in the op's domains); the value the captured call ran with is left out."""
TRITON_LAUNCH_DEFAULTS = {"num_warps": 4, "num_stages": 3}
"""What Triton launches with when the config does not say (vLLM's wna16 configs do not)."""


def first_call(proof: Any, name: str, gemm: int = 0) -> tuple[Path, int] | None:
    """The captured file of format ``name`` and the ``gemm``-th kernel call of its first layer call with both
    (16 tokens or more first: the aligned path)."""
    entry = proof.captured.get(name)
    if entry is None:
        say(f"  no {name} capture (part 1 did not capture it)")
        return None
    for tokens in sorted(entry["parents"], key=lambda t: (t < 16, t)):
        _parent, children = entry["parents"][tokens]
        if len(children) == 2:
            return entry["path"], children[gemm].index
    say(f"  no {name} layer call with two kernel calls was captured")
    return None


# ---------------------------------------------------------------------------------------------------------------
# parts 2-4: sweep, fills, layout
# ---------------------------------------------------------------------------------------------------------------


VARIANT_HEADERS: tuple[str, ...] = ("call", "variant", "verdict", "bad rows", "max rel", "rms rel")
VARIANT_HEADERS += ("same bits as captured", "guard", "reason")


def variant_rows(name: str, report: Any) -> list[list[Any]]:
    return [
        [
            name,
            r.label,
            r.verdict.value,
            f"{r.bad_rows}/{r.rows}",
            number(r.max_rel),
            number(r.rms_rel),
            r.bit_exact,
            r.guard.value,
            r.reason[:100],
        ]
        for r in (report.baseline, *report.variants)
    ]


def effective_config(record: Any) -> dict[str, Any]:
    """The launch settings a captured call ran with: its config, Triton's launch defaults, and for the wna16
    launcher the tiles it picks itself when the config has not both (vLLM 0.25.1's get_moe_wna16_block_config)."""
    config = dict(record.args.get("config") or {})
    effective = {**TRITON_LAUNCH_DEFAULTS, **config}
    if record.op.endswith("gptq_awq") and not ("BLOCK_SIZE_N" in config and "BLOCK_SIZE_K" in config):
        from moereplay.ops.fused_moe_triton import wna16_default_tiles

        effective.update(wna16_default_tiles(record.args))
    return effective


def sweep_one(proof: Any, name: str, path: Path, call: int, mutations: list[str]) -> Any:
    """One call's sweep, variant by variant (the budget is checked before each: a compile costs seconds)."""
    from moereplay.replay import ReplaySession

    with ReplaySession(
        path, call=call, backend=proof.args.backend, device=proof.device, isolate=proof.args.isolate,
        explain_fidelity=False,
    ) as session:  # fmt: skip
        for mutation in mutations:
            if proof.over_budget(f"sweep {name}: {mutation}"):
                break
            outcome = session.run(mutation)
            say(f"    {name} {mutation}: {outcome.verdict.value}")
        return session.report()


def sweep(proof: Any) -> None:
    from moereplay.format import CaptureReader

    rows, results = [], proof.summary.setdefault("part2_sweep", [])
    for name in ("int4-w4a16", "bf16"):  # the wna16 launcher first: its config is the one that lacked SPLIT_K
        found = first_call(proof, name)
        if found is None or proof.over_budget(f"sweep {name}"):
            continue
        path, call = found
        with CaptureReader(path) as reader:
            record = reader.call(call)
        effective = effective_config(record)
        mutations = [
            f"set {key}={v}" for key, values in SWEEP.items() for v in values if effective.get(key) != v
        ]
        say(f"  sweep {name} call {call} ({record.op}, ran with {effective}): {len(mutations)} variants")
        job = (proof, name, path, call, mutations)
        report = proof.attempt(f"sweep {name}", lambda job=job: sweep_one(*job))
        if report is not None:
            rows += variant_rows(f"{name} #{call}", report)
            results.append({"format": name, "call": call, "effective": effective, "report": report.to_json()})
    table("Part 2 — launch-config sweep (each variant against its own reference)", VARIANT_HEADERS, rows)


def fills(proof: Any) -> None:
    from moereplay.replay import replay

    rows, results = [], proof.summary.setdefault("part3_fills", [])
    for gemm in (0, 1):
        found = first_call(proof, "int4-w4a16", gemm)
        if found is None or proof.over_budget(f"fills int4 gemm{gemm + 1}"):
            continue
        path, call = found

        def run(path: Path = path, call: int = call) -> Any:
            return replay(
                path, call=call, fills=["0xff", "0x00"], backend=proof.args.backend, device=proof.device,
                isolate=proof.args.isolate,
            )  # fmt: skip

        report = proof.attempt(f"fills int4 call {call}", run)
        if report is not None:
            rows += variant_rows(f"int4 gemm{gemm + 1} #{call}", report)
            results.append({"call": call, "report": report.to_json()})
            for finding in report.findings[:3]:
                say(f"    finding (call {call}): [{finding.kind.value}] {finding.message[:200]}")
    table("Part 3 — guard fills on the int4 (fused_moe_kernel_gptq_awq) calls", VARIANT_HEADERS, rows)


def layout(proof: Any) -> None:
    from moereplay.layout import probe_layout
    from moereplay.layout.probe import LAYOUT_NAMES

    entry = proof.captured.get("bf16")
    parents = [] if entry is None else [p for p, kids in entry["parents"].values() if len(kids) == 2]
    if not parents:
        say("  no captured bf16 fused_experts call with both kernel calls")
        return
    report = probe_layout(entry["path"], call=parents[-1], device=proof.device)
    proof.summary["part4_layout"] = report.to_json()

    def name(layout: Any) -> str:
        return "unknown" if layout is None else LAYOUT_NAMES[layout]

    calls = report.calls
    row = [calls.parent, calls.gemm1, calls.gemm2, report.activation, name(report.consumed)]
    row += [name(report.declared), name(report.expected), report.verdict.value]
    headers = (
        "parent",
        "gemm1",
        "gemm2",
        "activation",
        "consumed",
        "declared",
        "vLLM kernel reads",
        "verdict",
    )
    table("Part 4 — w13 layout probe on a captured fused_experts call", headers, [row])
    for message in report.messages:
        say(f"  {message}")


# ---------------------------------------------------------------------------------------------------------------
# part 5: kernel vs reference time
# ---------------------------------------------------------------------------------------------------------------

LAUNCHERS = ("invoke_fused_moe_triton_kernel", "invoke_fused_moe_wna16_triton_kernel")


def launches(inputs: Any, action: Callable[[], Any], force_triton: bool) -> list[tuple[str, dict[str, Any]]]:
    """Run ``action`` with vLLM's two Triton launchers wrapped (in memory, no capture file): each launch's
    arguments bound by name, in order. ``force_triton``: vLLM's ``should_moe_wna16_use_cuda`` answers no."""
    import importlib

    from moereplay.capture.binding import ArgumentBinder

    module: Any = importlib.import_module(inputs.FUSED_MOE)  # its functions are replaced below
    saved = {name: getattr(module, name) for name in (*LAUNCHERS, "should_moe_wna16_use_cuda")}
    seen: list[tuple[str, dict[str, Any]]] = []

    def wrap(op: str, original: Callable[..., Any]) -> Callable[..., Any]:
        binder = ArgumentBinder.of(original)

        def launcher(*args: Any, **kwargs: Any) -> Any:
            seen.append((op, binder.bind(args, kwargs)))
            return original(*args, **kwargs)

        return launcher

    try:
        for name, op in zip(LAUNCHERS, (inputs.TRITON, inputs.GPTQ), strict=True):
            setattr(module, name, wrap(op, saved[name]))
        if force_triton:
            module.should_moe_wna16_use_cuda = lambda *args, **kwargs: False
        action()
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
    return seen


# Callable[..., ...], called with no argument: mypy rejects the callers' lambdas, whose defaults bind loop
# variables, as Callable[[], ...] (python/mypy#15459)
def median_s(action: Callable[..., Any], runs: int) -> float:
    """Median wall seconds of ``action`` (synchronised), after one untimed run: the reference bench's timer."""
    bench = str(Path(__file__).resolve().parents[1] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from reference_bench import wall_ms

    return float(wall_ms(action, runs)) / 1e3


def time_format(proof: Any, fmt: Any, backend: Any, rows: list[list[Any]]) -> None:
    """Both launches of one vLLM ``fused_experts`` call at part 5's shape: kernel (through the op, as replay
    launches it) against the reference."""
    import torch

    from moereplay.ops import get_op
    from moereplay.ops.fused_moe_triton import TritonMoeOp
    from moereplay.ops.fused_moe_triton_surface import compute_type_name

    args = proof.args
    shape = proof.inputs.Shape(args.time_experts, args.hidden, args.intermediate, args.top_k)
    g = torch.Generator(device="cuda").manual_seed(30)
    layer = fmt.build(shape, g)
    forced = fmt.bits == 4  # there vLLM would run the CUDA moe_wna16_gemm instead
    seen = launches(
        proof.inputs, lambda: proof.inputs.run_fused_experts(layer, shape, args.time_tokens, g), forced
    )
    for gemm, (op_name, bound) in enumerate(seen[:2], start=1):
        op = cast(TritonMoeOp, get_op(op_name))  # the two Triton launchers' ops
        call = op.recorded_args({**bound, "compute_type": compute_type_name(bound["compute_type"])})
        kernel = median_s(lambda op=op, call=call: op.run(call, backend), args.runs)
        reference = median_s(lambda op=op, call=call: op.reference(call), max(1, args.runs // 2))
        label = f"gemm{gemm}" + (" (Triton forced)" if forced else "")
        rows.append([fmt.name, label, op_name, f"{kernel * 1e3:.3f}", f"{reference * 1e3:.2f}"])
        rows[-1].append(f"{reference / kernel:.1f}×")
        result = {
            "format": fmt.name,
            "gemm": gemm,
            "op": op_name,
            "kernel_s": kernel,
            "reference_s": reference,
        }
        proof.summary.setdefault("part5_timing", []).append(result)
        say(f"  timing {fmt.name} {label}: kernel {kernel * 1e3:.3f} ms, reference {reference * 1e3:.2f} ms")


def timing(proof: Any) -> None:
    import torch

    from moereplay.replay.backends import load_backend, parse_backend

    args = proof.args
    backend = load_backend(parse_backend(args.backend), "cuda")
    rows: list[list[Any]] = []
    for fmt in proof.formats:
        if fmt.name in TIMED_SKIP or proof.over_budget(f"timing {fmt.name}"):
            continue
        proof.attempt(f"timing {fmt.name}", lambda fmt=fmt: time_format(proof, fmt, backend, rows))
        torch.cuda.empty_cache()
    title = f"Part 5 — kernel vs reference time (E={args.time_experts}, K={args.hidden}, N=2·{args.intermediate}, "
    title += f"top-{args.top_k}, {args.time_tokens} tokens; median of {args.runs})"
    table(title, ("format", "gemm", "op", "kernel ms", "reference ms", "reference / kernel"), rows)
