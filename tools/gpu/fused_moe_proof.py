"""Issue 18's H200 proof: vLLM 0.25.1's Triton fused MoE, captured from vLLM's own ``fused_experts`` and replayed.

Run on the GPU machine, the kernel pack carried as ``.kernelpack``, in one call (≈ 200 s on a warm H200)::

    source tools/gpu/device_setup.sh && python3 tools/gpu/fused_moe_proof.py --out "$OUT/proof"

Parts (each case in its own try/except: a failure prints one line and the rest goes on; output is flushed as it
goes and ``--out``/fused_moe_proof.json is rewritten after every part, so a call cut at its limit keeps both; the
capture files, hundreds of MB, go to ``--captures``, by default under /tmp, not into what comes back):

1. capture fidelity — per weight format (:data:`triton_moe_inputs.FORMATS`: bf16, fp8 per-tensor / per-channel /
   block-128, int8 weight-only per-row and group-128, GPTQ int4 with and without zero points, expert parallelism,
   top-1 with the router weight on the input) and token count, moereplay's capture is armed through vLLM's plugin
   loader and vLLM's ``fused_experts`` runs; every captured kernel call is replayed with ``moereplay.replay.replay``
   on ``--backend`` (default ``pack:$MOEREPLAY_PACK``): which kernel ran, calls, bit-exact count, the recorded
   output's verdict against the reference and its max / RMS relative error;
2. a launch-config sweep (``BLOCK_SIZE_M/N/K``, ``GROUP_SIZE_M``, ``num_warps``, ``num_stages``) of one captured
   bf16 and one captured int4 gemm1 → verdict per variant;
3. guard fills ``0xff`` / ``0x00`` on the captured int4 calls;
4. the w13 layout probe on a captured bf16 ``fused_experts`` call;
5. kernel vs reference time per format at a Qwen3-30B-A3B shape (E=128, K=2048, N=2·768, top-8, 64 tokens; the
   GPTQ formats are sent to the Triton kernel, which vLLM would replace with the CUDA ``moe_wna16_gemm`` there).

Order: part 1 for bf16 and int4, parts 4, 3, 2 (they need only those), part 1 for the other formats (until 80 % of
``--budget-s`` is spent: the rest is part 5's), part 5. No case starts once ``--budget-s`` (190 s) is spent; what
was skipped is listed at the end, with the command that captures the missing formats in another call. Kernels of
parts 1 and 5 run in this process (parts 2 and 3 too, unless ``--isolate``): a kernel that breaks the CUDA context
makes every later case fail, one line each; what was printed and saved before stays.

Shapes (parts 1-4): ``--experts`` 32, ``--hidden`` 2048, ``--intermediate`` 768, top-8, ``--tokens`` 1,16,128. With
32 experts vLLM sends GPTQ int4 at 1 and 16 tokens to the CUDA ``moe_wna16_gemm`` (``tokens · 8 / 32 <= 6``), which
is no patch point: those rows say so; 128 tokens run the Triton kernel.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# the repository (not some installed moereplay) and tools/gpu (the sibling modules) first
for _path in (str(HERE.parents[1]), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from proof_report import Run, finite, number, one_line, say, table  # noqa: E402

FIRST = ("bf16", "int4-w4a16")  # captured first: parts 2-4 use them
PART5_SHARE = 0.2  # of the budget, kept for part 5 when part 1's other formats run


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Issue 18's H200 proof: vLLM 0.25.1's Triton fused MoE captured from vLLM's fused_experts "
        "and replayed (see the module docstring)."
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for fused_moe_proof.json")
    parser.add_argument(
        "--captures",
        type=Path,
        default=Path("/tmp/moereplay-fused-moe-proof"),
        help="folder for the capture files (hundreds of MB: keep it out of what comes back from the GPU machine)",
    )
    pack = os.environ.get("MOEREPLAY_PACK")
    parser.add_argument("--backend", default=f"pack:{pack}" if pack else "vllm", help="replay backend")
    parser.add_argument("--formats", default="", help="comma-separated format names (default: all)")
    parser.add_argument("--tokens", default="1,16,128", help="token counts per format (part 1)")
    parser.add_argument("--experts", type=int, default=32, help="parts 1-4: experts")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--time-experts", type=int, default=128, help="part 5: experts")
    parser.add_argument("--time-tokens", type=int, default=64, help="part 5: tokens")
    parser.add_argument("--runs", type=int, default=5, help="part 5: timed runs (median)")
    parser.add_argument("--parts", default="1,2,3,4,5", help="which parts to run")
    parser.add_argument("--budget-s", type=float, default=190.0, help="start no case after this many seconds")
    parser.add_argument("--isolate", action="store_true", help="parts 2-3: kernels in a worker process")
    return parser.parse_args(argv)


class Proof(Run):
    """The run (clock, failures, summary) plus the proof's settings and what part 1 captured."""

    def __init__(self, args: argparse.Namespace) -> None:
        import triton_moe_inputs as inputs

        super().__init__(args.out, "fused_moe_proof", args.budget_s, vars(args))
        self.args, self.inputs = args, inputs
        names = [n for n in args.formats.split(",") if n] or list(inputs.FORMATS)
        unknown = [n for n in names if n not in inputs.FORMATS]
        if unknown:
            raise SystemExit(
                f"fused_moe_proof: unknown formats {unknown}; known: {', '.join(inputs.FORMATS)}"
            )
        self.formats = [inputs.FORMATS[n] for n in names]
        self.tokens = [int(t) for t in args.tokens.split(",") if t]
        self.parts = {int(p) for p in args.parts.split(",") if p}
        self.shape = inputs.Shape(args.experts, args.hidden, args.intermediate, args.top_k)
        self.device = "cuda"  # where replays and references run (a CPU test of this script sets "cpu")
        self.captured: dict[str, dict[str, Any]] = {}
        """format → {"path": capture file, "parents": {tokens: (parent index, [kernel call records])}}"""


# ---------------------------------------------------------------------------------------------------------------
# part 1: capture fidelity
# ---------------------------------------------------------------------------------------------------------------


def run_layers(proof: Proof, fmt: Any) -> tuple[Path, dict[int, str]]:
    """vLLM's ``fused_experts`` for ``fmt`` at every token count, captured; (the file, errors by token count)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(18)
    layer = fmt.build(proof.shape, g)
    errors: dict[int, str] = {}
    with proof.inputs.armed_capture(proof.args.captures / fmt.name) as session:
        for tokens in proof.tokens:
            try:
                out = proof.inputs.run_fused_experts(layer, proof.shape, tokens, g)
                if not bool(out.isfinite().all()):
                    errors[tokens] = "vLLM's output is not finite"
            except Exception as error:
                errors[tokens] = f"fused_experts raised {one_line(error)}"
    return Path(session.path), errors


def capture(proof: Proof, fmt: Any) -> None:
    """Part 1 for one format: capture, then replay every captured kernel call (one row per token count)."""
    path, errors = run_layers(proof, fmt)
    judge_capture(proof, fmt, path, errors)


def judge_capture(proof: Proof, fmt: Any, path: Path, errors: dict[int, str]) -> None:
    """Each ``fused_experts`` call of the capture (by its token count), its kernel calls, each replayed."""
    from moereplay.format import CaptureReader

    with CaptureReader(path) as reader:
        calls = list(reader.calls())
    parents = {
        int(record.args["hidden_states"].shape[0]): (
            record.index,
            [r for r in calls if r.parent == record.index],
        )
        for record in calls
        if record.op == "fused_experts"
    }
    proof.captured[fmt.name] = {"path": path, "parents": parents}
    top_k = 1 if fmt.name == "bf16-top1-input" else proof.shape.top_k
    for tokens in proof.tokens:
        cuda = proof.inputs.wna16_uses_cuda(fmt, tokens, top_k, proof.shape.experts)
        parent, children = parents.get(tokens, (None, []))
        ran = ", ".join(sorted({c.op for c in children})) or "none captured"
        row: dict[str, Any] = {
            "format": fmt.name,
            "tokens": tokens,
            "file": str(path),
            "parent": parent,
            "kernel": "CUDA moe_wna16_gemm (no patch point)" if cuda and not children else ran,
            "calls": len(children),
            "configs": [c.args.get("config") for c in children],  # what vLLM chose for each launch
            "error": errors.get(tokens, ""),
        }
        if not cuda and [c.op for c in children] != [fmt.kernel, fmt.kernel]:
            row["error"] += f" expected two {fmt.kernel} calls under parent {parent}"
        row["replays"] = [
            proof.attempt(f"replay {fmt.name} call {c.index}", lambda c=c: replay_one(proof, path, c.index))
            for c in children
        ]
        proof.summary.setdefault("part1_capture", []).append(row)
        done = [r for r in row["replays"] if r]
        exact = sum(1 for r in done if r["bit_exact"])
        recorded = sorted({str(r["recorded"]) for r in done})
        say(
            f"  {fmt.name} tokens={tokens}: {row['kernel']}; {exact}/{len(children)} bit-exact; recorded {recorded}"
        )
        if row["error"]:
            say(f"    problem: {row['error']}")


def replay_one(proof: Proof, path: Path, call: int) -> dict[str, Any]:
    from moereplay.replay import replay

    report = replay(path, call=call, backend=proof.args.backend, device=proof.device, isolate=False)
    recorded = report.recorded
    findings = (
        [] if not report.failed else [f"[{f.kind.value}] {f.message}"[:300] for f in report.findings[:4]]
    )
    return {
        "call": call,
        "op": report.op,
        "bit_exact": report.baseline.bit_exact,
        "replayed": report.baseline.verdict.value,
        "recorded": None if recorded is None else recorded.verdict.value,
        "max_rel": None if recorded is None else finite(recorded.max_rel),
        "rms_rel": None if recorded is None else finite(recorded.rms_rel),
        "findings": findings,
    }


def part1_table(proof: Proof) -> None:
    lines = []
    for row in proof.summary.get("part1_capture", []):
        done = [r for r in row["replays"] if r]
        worst: dict[str, Any] = max(done, key=lambda r: r["max_rel"] or 0.0, default={})
        lines.append(
            [
                row["format"],
                row["tokens"],
                row["kernel"],
                row["calls"],
                f"{sum(1 for r in done if r['bit_exact'])}/{row['calls']}",
                ",".join(sorted({r["replayed"] for r in done})) or "-",
                ",".join(sorted({str(r["recorded"]) for r in done})) or "-",
                number(worst.get("max_rel")),
                number(worst.get("rms_rel")),
                row["error"],
            ]
        )
    headers: tuple[str, ...] = ("format", "tokens", "kernel that ran", "kernel calls", "bit-exact")
    headers += ("replay verdict", "recorded vs reference", "max rel", "rms rel", "problem")
    table("Part 1 — capture fidelity through vLLM's fused_experts", headers, lines)


# ---------------------------------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    import importlib.metadata

    import torch
    import triton

    try:
        vllm_version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        vllm_version = "unknown"
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "vllm": vllm_version, "gpu": torch.cuda.get_device_name(0)}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("fused_moe_proof: needs a CUDA GPU (torch.cuda.is_available() is False here)", file=sys.stderr)
        return 2
    import triton_moe_inputs

    try:
        __import__(triton_moe_inputs.FUSED_MOE)
    except ImportError as error:
        print(
            f"fused_moe_proof: no vLLM ({one_line(error)}); source tools/gpu/device_setup.sh", file=sys.stderr
        )
        return 2
    import fused_moe_probes as probes

    proof = Proof(args)
    proof.summary["environment"] = environment()
    say(
        f"fused_moe_proof: {proof.summary['environment']}, backend {args.backend}, {proof.shape}, tokens {proof.tokens}"
    )
    first = [f for f in proof.formats if f.name in FIRST]
    rest = [f for f in proof.formats if f.name not in FIRST]
    if proof.parts & {1, 2, 3, 4}:
        say(f"\n## part 1: {', '.join(f.name for f in first)} first (parts 4, 3, 2 use them)")
    for fmt in first if proof.parts & {1, 2, 3, 4} else ():
        if not proof.over_budget(f"capture {fmt.name}"):
            proof.attempt(f"capture {fmt.name}", lambda fmt=fmt: capture(proof, fmt))
    proof.save()
    for part, run in ((4, probes.layout), (3, probes.fills), (2, probes.sweep)):
        if part in proof.parts and not proof.over_budget(f"part {part}"):
            say(f"\n## part {part} ({proof.elapsed():.0f} s)")
            proof.attempt(f"part {part}", lambda run=run: run(proof))
            proof.save()
    if 1 in proof.parts:
        say(f"\n## part 1: the other formats ({proof.elapsed():.0f} s)")
        spare = PART5_SHARE * args.budget_s if 5 in proof.parts else 0.0
        for fmt in rest:
            if not proof.over_budget(f"capture {fmt.name}", spare):
                proof.attempt(f"capture {fmt.name}", lambda fmt=fmt: capture(proof, fmt))
            proof.save()
        part1_table(proof)
    if 5 in proof.parts and not proof.over_budget("part 5"):
        say(f"\n## part 5 ({proof.elapsed():.0f} s)")
        proof.attempt("part 5", lambda: probes.timing(proof))
    path = proof.save()
    formats = [what.removeprefix("capture ") for what in proof.skipped if what.startswith("capture ")]
    if formats:
        say(f"not captured for lack of time: {', '.join(formats)} — run them in another call: ")
        say(f"  python3 tools/gpu/fused_moe_proof.py --out DIR --parts 1 --formats {','.join(formats)}")
    failures = len(proof.summary["failures"])
    say(f"fused_moe_proof: done in {proof.elapsed():.0f} s; {failures} failures or skips; summary {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
