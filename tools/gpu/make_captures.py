"""Make the example captures of ``captures/`` on a Hopper GPU with vLLM 0.25.1's kernels, and record what
``moereplay run`` says about each, on the GPU and offline.

Run on the H200 after the prelude (kernel pack carried as ``.kernelpack``)::

    source tools/gpu/device_setup.sh && python3 tools/gpu/make_captures.py --out "$OUT"

or in parts (``--only NAME…``; the manifest in ``--out`` accumulates), e.g. into a folder that outlives one command.

Writes into ``--out``: one ``.moe.zst`` per capture (big weights as seeded recipes, real kernel outputs), and
``manifest.json`` — per capture: the command that made it, preset and settings, size and sha256, GPU, driver and
versions, and per kernel call the verdicts of ``moereplay run`` with the variants listed below on this GPU and with
the reference offline (the layer capture also gets its layout probe). ``tests/gpu/test_share_gpu.py`` replays every
capture listed there and requires the same verdicts. Also writes ``repro-marlin-nvfp4-report/`` (the failing call's
standalone repro) and ``repro-marlin-nvfp4-report.txt`` (its output, run with the pack and without the repository on
``PYTHONPATH``).

The captures:

- ``marlin-nvfp4-gpt-oss-gemm1`` — a correct Marlin NVFP4 call: gpt-oss-20b gemm1 (E=32, top-4, K 2880, N 2·2944
  padded per gate/up shard), float32 routing weights, expert biases; swept over moe_block_size.
- ``marlin-nvfp4-gpt-oss-gemm2`` — gpt-oss-20b gemm2 (K 2880 padded to 2944, N 2880) with expert biases and
  ``mul_topk_weights=True``, and with the flag flipped: whatever the kernel does with the bias when it folds the
  global scale into the routing weight is recorded as it is.
- ``marlin-nvfp4-report`` — the published report's call, which goes wrong: bf16 routing weights read as float32.
- ``ogs-mxfp4-w13-k2880`` — gpt-oss-20b ``matmul_ogs`` w13 on Hopper MXFP4 at K=2880, with 0xff / 0x00 guard fills.
- ``marlin-gptq-int4`` — a GPTQ uint4b8 Marlin call (group 128, fp16), swept over moe_block_size.
- ``marlin-nvfp4-layer`` — a whole NVFP4 Marlin MoE layer run by vLLM's own ``fused_marlin_moe`` (gemm1 → vLLM's
  ``swigluoai_and_mul`` → gemm2 → top-k sum), parent and both kernel calls recorded, w13 declared ``[g,u]``
  interleaved: ``moereplay layout`` shows which layout vLLM's activation consumed.

``--backend reference`` makes the same files on a machine without a GPU (outputs from the reference; the layer
then comes from ``moereplay synth marlin-nvfp4-layer``) — a dry run of this script, not captures to publish.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
MAX_FILE_BYTES = 8 * 2**20
MAX_TOTAL_BYTES = 40 * 2**20


@dataclass(frozen=True)
class CaptureSpec:
    """One capture to make: a synth preset (or a builder), and the variants its calls are replayed with."""

    name: str
    description: str
    preset: str | None = None
    settings: tuple[str, ...] = ()
    mutations: tuple[str, ...] = ()
    fills: tuple[str, ...] = ()
    builder: Callable[[Path, str, str], dict[str, Any]] | None = None
    layout_probe: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# the fused layer, run by vLLM's own fused_marlin_moe
# ---------------------------------------------------------------------------------------------------------------

LAYER = {"tokens": 16, "experts": 8, "top_k": 4, "hidden": 512, "intermediate": 512, "seed": 7}


def vllm_fused_layer(path: Path, backend: str, device: str) -> dict[str, Any]:
    """Run vLLM's ``fused_marlin_moe`` (activation SWIGLUOAI) on synth-drawn NVFP4 weights whose w13 columns are
    ``[g,u]`` interleaved, record the parent call and both ``moe_wna16_marlin_gemm`` calls, weights as recipes."""
    from moereplay.capture.binding import ArgumentBinder
    from moereplay.format.schema import EnumValue
    from moereplay.replay.backends import load_backend, parse_backend
    from moereplay.synth.build import write_calls
    from moereplay.synth.drawing import Drawer, SynthCall, to_device
    from moereplay.synth.marlin_presets import MOE_ACTIVATION, STATIC
    from moereplay.synth.routing import softmax_topk

    target = torch.device(device)
    kernel = load_backend(parse_backend(backend), target)
    marlin_moe = kernel.module("vllm.model_executor.layers.fused_moe.experts.marlin_moe")
    activation_module = kernel.module("vllm.model_executor.layers.fused_moe.activation")
    ops: Any = kernel.module("vllm._custom_ops")  # its moe_wna16_marlin_gemm is wrapped below
    scalar_types = kernel.module("vllm.scalar_type").scalar_types

    tokens, experts, top_k = LAYER["tokens"], LAYER["experts"], LAYER["top_k"]
    hidden, inter, seed = LAYER["hidden"], LAYER["intermediate"], LAYER["seed"]
    drawer = Drawer()
    common = {"format": "nvfp4", "experts": experts, "bias": True, "activation_dtype": "bfloat16"}
    w13 = drawer.parts(
        "marlin_experts",
        {**common, "seed": seed * 64 + 1, "size_k": hidden, "size_n": 2 * inter, "shards": 2,
         "w13_layout": "gu_interleaved"},
    )  # fmt: skip
    # no w2 bias: with mul_topk_weights the NVFP4 kernel's bias handling is itself under test elsewhere
    # (tests/gpu/test_marlin_reference.py); the layout probe needs a gemm2 that is right
    w2 = drawer.parts(
        "marlin_experts", {**common, "bias": False, "seed": seed * 64 + 4, "size_k": inter, "size_n": hidden}
    )
    x = drawer.draw(
        "normal", {"seed": seed * 64 + 2, "shape": [tokens, hidden], "dtype": "bfloat16", "std": 0.5}
    )
    topk = softmax_topk(tokens, experts, top_k, seed * 64 + 3, renormalize=True)
    moved = to_device(
        {"w13": w13, "w2": w2, "x": x, "weights": topk.weights, "ids": topk.ids}, target, drawer
    )
    w13, w2, x = moved["w13"], moved["w2"], moved["x"]

    weights = {id(t) for part in (w13, w2) for t in part.values()}
    children: list[tuple[dict[str, Any], dict[str, Any]]] = []
    original = ops.moe_wna16_marlin_gemm
    binder = ArgumentBinder.of(original)

    def recording(*args: Any, **kwargs: Any) -> Any:
        bound = binder.bind(args, kwargs)
        snapshot = {
            name: value.clone() if isinstance(value, torch.Tensor) and id(value) not in weights else value
            for name, value in bound.items()
        }
        snapshot["b_q_type"] = int(bound["b_q_type"].id)
        result = original(*args, **kwargs)
        torch.cuda.synchronize()
        children.append((snapshot, {"output": result.clone()}))
        return result

    ops.moe_wna16_marlin_gemm = recording
    try:
        final = marlin_moe.fused_marlin_moe(
            x, w13["b_qweight"], w2["b_qweight"], w13["b_bias"], None, w13["b_scales"], w2["b_scales"],
            moved["weights"], moved["ids"], quant_type_id=scalar_types.float4_e2m1f.id,
            activation=activation_module.MoEActivation.SWIGLUOAI,
            global_scale1=w13["global_scale"], global_scale2=w2["global_scale"],
        )  # fmt: skip
        torch.cuda.synchronize()
    finally:
        ops.moe_wna16_marlin_gemm = original
    if len(children) != 2:
        raise RuntimeError(f"fused_marlin_moe made {len(children)} Marlin calls, expected 2")
    parent_args = {
        "hidden_states": x, "w1": w13["b_qweight"], "w2": w2["b_qweight"], "bias1": w13["b_bias"],
        "bias2": None, "w1_scale": w13["b_scales"], "w2_scale": w2["b_scales"],
        "topk_weights": moved["weights"], "topk_ids": moved["ids"], "quant_type_id": scalar_types.float4_e2m1f.id,
        "apply_router_weight_on_input": False, "global_num_experts": -1,
        "activation": EnumValue(MOE_ACTIVATION, "SWIGLUOAI", "swigluoai"),
        "global_scale1": w13["global_scale"], "global_scale2": w2["global_scale"], "is_k_full": True,
    }  # fmt: skip
    context = {"layer": 0, "w13_layout": "gu_interleaved"}
    site = "vllm.model_executor.layers.fused_moe.experts.marlin_moe:fused_marlin_moe"
    calls = [
        SynthCall("fused_marlin_moe", parent_args, {"return": final.clone()}, site, context, static=STATIC),
        SynthCall("moe_wna16_marlin_gemm", children[0][0], children[0][1], "vllm._custom_ops:moe_wna16_marlin_gemm",
                  {**context, "gemm": "gemm1"}, parent=0, static=STATIC),
        SynthCall("moe_wna16_marlin_gemm", children[1][0], children[1][1], "vllm._custom_ops:moe_wna16_marlin_gemm",
                  {"layer": 0, "gemm": "gemm2"}, parent=0, static=STATIC),
    ]  # fmt: skip
    header = {
        "purpose": "tools/gpu/make_captures.py: a fused NVFP4 Marlin MoE layer run by vLLM's fused_marlin_moe",
        "synth": {
            "preset": None,
            "settings": LAYER,
            "bias": True,
            "store": "recipe",
            "backend": backend,
            "output_source": f"kernel ({backend}): vLLM fused_marlin_moe (swigluoai_and_mul between the GEMMs)",
            "command": None,
        },
    }
    write_calls(path, calls, drawer, "recipe", header)
    return {"settings": LAYER, "runs": "vLLM fused_marlin_moe, activation SWIGLUOAI"}


def synth_layer(path: Path, backend: str, device: str) -> dict[str, Any]:
    """The dry-run stand-in for :func:`vllm_fused_layer` (no vLLM here)."""
    from moereplay.synth import synthesize

    settings = [f"{k}={v}" for k, v in LAYER.items()]
    synthesize("marlin-nvfp4-layer", path, overrides=settings, backend=backend, device=device)
    return {"settings": LAYER, "runs": "moereplay synth marlin-nvfp4-layer"}


CAPTURES: tuple[CaptureSpec, ...] = (
    CaptureSpec(
        "marlin-nvfp4-gpt-oss-gemm1",
        "a correct Marlin NVFP4 call: gpt-oss-20b gemm1 (E=32, top-4, K 2880, N 2·2944 padded per shard), fp32 "
        "routing weights, expert biases",
        preset="gpt-oss-20b-nvfp4-gemm1",
        mutations=("sweep moe_block_size=8,16,32,48,64",),
    ),
    CaptureSpec(
        "marlin-nvfp4-gpt-oss-gemm2",
        "gpt-oss-20b gemm2 (K 2880 padded to 2944, N 2880) with expert biases and mul_topk_weights — the case where "
        "tests/gpu/test_marlin_reference.py saw the kernel scale the bias by the processed global scale",
        preset="gpt-oss-20b-nvfp4-gemm2",
        mutations=("flip mul_topk_weights",),
    ),
    CaptureSpec(
        "marlin-nvfp4-report",
        "the published report's Marlin NVFP4 call (gemm2-style rows, top_k=1, block 16, bf16 routing weights, "
        "mul_topk_weights=True): goes wrong",
        preset="marlin-nvfp4-report",
        mutations=("flip mul_topk_weights", "cast topk_weights=float32"),
        fills=("0xff",),
    ),
    CaptureSpec(
        "ogs-mxfp4-w13-k2880",
        "gpt-oss-20b matmul_ogs w13 on Hopper MXFP4 at K=2880 (gather, fp32 bias, fused swiglu), split_k=1",
        preset="gpt-oss-20b-mxfp4-w13",
        fills=("0xff", "0x00"),
    ),
    CaptureSpec(
        "marlin-gptq-int4",
        "a GPTQ uint4b8 Marlin call (E=8, top-2, K 1024, N 1024, group 128, fp16 activations)",
        preset="gptq-int4-marlin",
        mutations=("sweep moe_block_size=8,16,32",),
    ),
    CaptureSpec(
        "marlin-nvfp4-layer",
        "a fused NVFP4 Marlin MoE layer run by vLLM's fused_marlin_moe (activation swigluoai), w13 declared [g,u] "
        "interleaved: parent + gemm1 + gemm2",
        builder=vllm_fused_layer,
        layout_probe=True,
    ),
)


# ---------------------------------------------------------------------------------------------------------------
# making and judging
# ---------------------------------------------------------------------------------------------------------------


def _isolate() -> bool | None:
    """Kernel replays in a worker process only where the worker can expand recipes (the format's codec registry
    imports the recipe codec on demand); else in this process."""
    probe = "from moereplay.format.codecs import codec_for; import sys; "
    probe += "sys.exit(0 if codec_for('moereplay.synth.recipe.TensorRecipe') else 1)"
    done = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True)
    return None if done.returncode == 0 else False


def verdicts(path: Path, spec: CaptureSpec, backend: str, *, isolate: bool | None) -> dict[str, Any]:
    """``moereplay run``'s verdicts for every kernel call of a capture, with the spec's variants."""
    from moereplay.format import CaptureReader
    from moereplay.ops import known_op_names
    from moereplay.replay import replay

    out: dict[str, Any] = {}
    with CaptureReader(path) as reader:
        indices = [record.index for record in reader.calls() if record.op in known_op_names()]
    for index in indices:
        report = replay(
            path,
            call=index,
            backend=backend,
            mutations=list(spec.mutations),
            fills=list(spec.fills) if backend != "reference" else [],
            isolate=isolate if backend != "reference" else None,
        )
        out[str(index)] = {
            "op": report.op,
            "verdicts": {result.label: result.verdict.value for result in report.results},
            "baseline_bit_exact": report.baseline.bit_exact,
            "findings": [f"[{f.kind.value}] ({f.variant}) {f.message}" for f in report.findings],
        }
    return out


def make(spec: CaptureSpec, out: Path, backend: str, device: str, isolate: bool | None) -> dict[str, Any]:
    from moereplay.synth import synthesize

    path = out / f"{spec.name}.moe.zst"
    started = time.perf_counter()
    command = shlex.join([sys.executable, *sys.argv])
    device = device if backend != "reference" else "cpu"
    if spec.builder is not None:
        builder = spec.builder if backend != "reference" else synth_layer
        made = builder(path, backend, device)
        command_text = f"{command}  # builder {builder.__name__}"
        settings: Any = made["settings"]
    else:
        assert spec.preset is not None
        result = synthesize(
            spec.preset,
            path,
            overrides=list(spec.settings),
            store="recipe",
            backend=backend,
            device=device,
            command=f"moereplay synth {spec.preset} --store recipe --backend {backend} -o {path.name}"
            + "".join(f" --set {item}" for item in spec.settings),
        )
        command_text = result.output_source
        settings = result.settings
    made_s = time.perf_counter() - started
    entry: dict[str, Any] = {
        "file": path.name,
        "description": spec.description,
        "preset": spec.preset,
        "settings": settings,
        "bytes": path.stat().st_size,
        "sha256": _sha256(path),
        "made_by": command_text,
        "made_s": round(made_s, 1),
        "mutations": list(spec.mutations),
        "fills": list(spec.fills),
        "gpu": backend != "reference",
        "calls": verdicts(path, spec, backend, isolate=isolate),
        "offline": verdicts(path, spec, "reference", isolate=None),
    }
    if spec.layout_probe:
        from moereplay.layout import probe_layout

        report = probe_layout(path, 0)
        entry["layout"] = report.to_json()
    return entry


def repro_of_report(out: Path, backend: str, pack: str | None) -> dict[str, Any]:
    """Export the failing call's repro and run it standalone (no repository on PYTHONPATH)."""
    from moereplay.repro import export_repro

    directory = out / "repro-marlin-nvfp4-report"
    spec = next(s for s in CAPTURES if s.name == "marlin-nvfp4-report")
    bundle = export_repro(
        out / "marlin-nvfp4-report.moe.zst",
        0,
        directory,
        mutations=list(spec.mutations),
        fills=list(spec.fills) if backend != "reference" else [],
        overwrite=True,
    )
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    argv = [sys.executable, str(bundle.script)]
    argv += ["--pack", pack] if pack else ["--backend", backend]
    done = subprocess.run(argv, cwd=out, env=env, capture_output=True, text=True, check=False)
    text = done.stdout + (f"\n[stderr]\n{done.stderr}" if done.stderr.strip() else "")
    (out / "repro-marlin-nvfp4-report.txt").write_text(f"$ {shlex.join(argv)}\n{text}", encoding="utf-8")
    return {"directory": directory.name, "exit_status": done.returncode, "command": shlex.join(argv)}


def environment() -> dict[str, Any]:
    from moereplay.format.environment import collect_environment

    env = collect_environment()
    return {key: env.get(key) for key in ("versions", "gpu", "platform", "created")}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "captures-out")))
    parser.add_argument("--pack", default=os.environ.get("MOEREPLAY_PACK"), help="kernel pack directory")
    parser.add_argument("--backend", help="vllm | pack:DIR | reference (default: the pack, else vllm)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--only",
        nargs="*",
        help="make only these captures (names); earlier parts in --out's manifest are kept",
    )
    options = parser.parse_args(argv)
    backend = options.backend or (f"pack:{options.pack}" if options.pack else "vllm")
    pack = options.pack if backend.startswith("pack:") else None
    out: Path = options.out
    out.mkdir(parents=True, exist_ok=True)
    if backend != "reference":
        torch.cuda.init()
    isolate = _isolate()
    print(
        f"make_captures: backend {backend}, kernel replays {'isolated' if isolate is None else 'in-process'}"
    )
    manifest: dict[str, Any] = {"environment": environment(), "backend": backend, "captures": []}
    previous = out / "manifest.json"
    if options.only and previous.is_file():  # a run in parts: keep what earlier parts made
        earlier = json.loads(previous.read_text(encoding="utf-8"))
        if earlier.get("backend") == backend:
            manifest = {**earlier, "environment": manifest["environment"]}
    for spec in CAPTURES:
        if options.only and spec.name not in options.only:
            continue
        entry = make(spec, out, backend, options.device, isolate)
        manifest["captures"] = [e for e in manifest["captures"] if e["file"] != entry["file"]] + [entry]
        print(f"{entry['file']}: {entry['bytes']:,} B in {entry['made_s']} s")
        for index, call in entry["calls"].items():
            print(f"  call {index} {call['op']}: {call['verdicts']} (bit-exact {call['baseline_bit_exact']})")
            for finding in call["findings"]:
                print(f"      {finding}")
        for index, call in entry["offline"].items():
            print(f"  offline call {index}: {call['verdicts']}")
        if "layout" in entry:
            print(f"  layout: {entry['layout']['verdict']}: {'; '.join(entry['layout']['messages'])}")
    if not options.only or "marlin-nvfp4-report" in options.only:
        manifest["repro"] = repro_of_report(out, backend, pack)
        print((out / "repro-marlin-nvfp4-report.txt").read_text(encoding="utf-8"))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n", encoding="utf-8")
    sizes = [entry["bytes"] for entry in manifest["captures"]]
    too_big = [e["file"] for e in manifest["captures"] if e["bytes"] > MAX_FILE_BYTES]
    print(f"total {sum(sizes):,} B in {len(sizes)} captures; over 8 MB: {too_big or 'none'}")
    return 1 if too_big or sum(sizes) > MAX_TOTAL_BYTES else 0


if __name__ == "__main__":
    sys.exit(main())
