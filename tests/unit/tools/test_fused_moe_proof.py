"""``tools/gpu/fused_moe_proof.py`` (issue 18's H200 proof) on a machine without a GPU: it parses its options, says
in one line that it needs CUDA, and its glue — reading a capture's layer calls, replaying them, the sweep, fills and
layout parts, the tables and the JSON summary, catching vLLM's launches for timing — runs on synthesized captures
with the reference backend (the GPU parts themselves run only on the H200)."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from moereplay.format import CaptureReader
from moereplay.replay.source import load_call
from moereplay.synth import synthesize

TOOLS = Path(__file__).resolve().parents[3] / "tools" / "gpu"
SCRIPT = TOOLS / "fused_moe_proof.py"


@pytest.fixture(scope="module")
def tools() -> types.SimpleNamespace:
    sys.path.insert(0, str(TOOLS))
    try:
        import fused_moe_probes
        import fused_moe_proof
        import triton_moe_inputs
    finally:
        sys.path.remove(str(TOOLS))
    return types.SimpleNamespace(proof=fused_moe_proof, probes=fused_moe_probes, inputs=triton_moe_inputs)


def test_help_and_the_one_line_without_cuda(tmp_path: Path) -> None:
    shown = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0 and "--budget-s" in shown.stdout and "--backend" in shown.stdout
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "CUDA" in done.stderr


def _proof(tools: types.SimpleNamespace, out: Path, *options: str) -> Any:
    args = tools.proof.parse_args(["--out", str(out), "--backend", "reference", *options])
    proof = tools.proof.Proof(args)
    proof.device = "cpu"
    return proof


def test_parts_1_to_4_on_synthesized_captures(
    tools: types.SimpleNamespace, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    proof = _proof(tools, tmp_path / "out", "--tokens", "8", "--experts", "8")
    layer = tmp_path / "layer.moe.zst"
    synthesize("triton-bf16-layer", layer, store="bytes")  # fused_experts + gemm1 + gemm2, 8 tokens
    tools.proof.judge_capture(proof, tools.inputs.FORMATS["bf16"], layer, {})
    [row] = proof.summary["part1_capture"]
    assert (row["tokens"], row["calls"], row["kernel"], row["error"]) == (8, 2, "fused_moe_kernel", "")
    assert [r["recorded"] for r in row["replays"]] == ["ok", "ok"]
    assert [r["replayed"] for r in row["replays"]] == ["needs-kernel"] * 2  # no kernel here

    int4 = tmp_path / "int4.moe.zst"
    small = ["experts=8", "hidden=256", "intermediate=128", "tokens=6", "top_k=2"]
    synthesize("qwen3-30b-a3b-int4-w13", int4, overrides=small, store="bytes")
    with CaptureReader(int4) as reader:
        [record] = list(reader.calls())
    proof.captured["int4-w4a16"] = {"path": int4, "parents": {6: (None, [record, record])}}

    tools.probes.layout(proof)
    assert proof.summary["part4_layout"]["consumed"] == "gate_up"
    tools.probes.fills(proof)
    tools.probes.sweep(proof)
    tools.proof.part1_table(proof)
    saved = json.loads(proof.save().read_text())
    assert not saved["failures"], saved["failures"]
    sweeps = {entry["format"]: entry for entry in saved["part2_sweep"]}
    assert set(sweeps) == {"bf16", "int4-w4a16"}
    labels = [result["label"] for result in sweeps["bf16"]["report"]["results"]]
    assert (
        "set BLOCK_SIZE_M=16" not in labels and "set BLOCK_SIZE_M=32" in labels
    )  # the captured value is left out
    assert len(saved["part3_fills"]) == 2
    shown = capsys.readouterr().out
    for title in ("Part 1", "Part 2", "Part 3", "Part 4"):
        assert f"### {title} " in shown


def test_effective_config_of_a_wna16_call_is_what_its_launcher_picks(tools: types.SimpleNamespace) -> None:
    record = types.SimpleNamespace(
        op="fused_moe_kernel_gptq_awq",
        args={"config": {"BLOCK_SIZE_M": 64, "GROUP_SIZE_M": 1, "SPLIT_K": 1}, "A": torch.zeros(128, 8)},
    )
    effective = tools.probes.effective_config(record)
    assert (effective["BLOCK_SIZE_N"], effective["BLOCK_SIZE_K"], effective["num_warps"]) == (64, 32, 4)
    record.args["A"] = torch.zeros(1, 8)
    assert tools.probes.effective_config(record)["BLOCK_SIZE_N"] == 32


def test_timing_catches_vllms_launches_as_replay_arguments(
    tools: types.SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``launches`` wraps the launchers of the module vLLM's dispatcher reads, binds each launch by name, forces
    the Triton wna16 path when asked, and restores everything; the op rebuilds its arguments from a launch."""
    path = tmp_path / "int4.moe.zst"
    synthesize("qwen3-30b-a3b-int4-w13", path, overrides=["experts=8", "hidden=256", "intermediate=128"])
    call = load_call(path, 0)
    launched: list[str] = []

    def invoke_fused_moe_wna16_triton_kernel(
        A, B, C, B_scale, B_zp, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        mul_routed_weight, top_k, config, compute_type, use_int8_w8a16, use_int4_w4a16, block_shape,
    ):  # type: ignore[no-untyped-def]  # fmt: skip
        launched.append("wna16")

    def should_moe_wna16_use_cuda(num_valid_tokens, group_size, num_experts, bit):  # type: ignore[no-untyped-def]
        return True

    module = types.ModuleType(tools.inputs.FUSED_MOE)
    module.invoke_fused_moe_triton_kernel = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    module.invoke_fused_moe_wna16_triton_kernel = invoke_fused_moe_wna16_triton_kernel  # type: ignore[attr-defined]
    module.should_moe_wna16_use_cuda = should_moe_wna16_use_cuda  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, tools.inputs.FUSED_MOE, module)
    originals = dict(vars(module))
    op = call.op
    positional = [call.args[name] for name in ("A", "B", "C", "B_scale", "B_zp", "topk_weights")]
    positional += [call.args[name] for name in ("sorted_token_ids", "expert_ids", "num_tokens_post_padded")]
    config = op.launch_config(call.args)  # type: ignore[attr-defined]

    def dispatch() -> None:  # what vLLM's dispatch_fused_moe_kernel does: module globals, positionally
        if not module.should_moe_wna16_use_cuda(num_valid_tokens=48, group_size=128, num_experts=8, bit=4):
            module.invoke_fused_moe_wna16_triton_kernel(
                *positional, False, call.args["top_k"], config, types.SimpleNamespace(name="bf16"),
                False, True, call.args["block_shape"],
            )  # fmt: skip

    assert tools.probes.launches(tools.inputs, dispatch, force_triton=False) == []
    seen = tools.probes.launches(tools.inputs, dispatch, force_triton=True)
    assert launched == ["wna16"] and vars(module) == originals
    [(name, bound)] = seen
    assert name == "fused_moe_kernel_gptq_awq"
    from moereplay.ops.fused_moe_triton_surface import compute_type_name

    rebuilt = op.recorded_args({**bound, "compute_type": compute_type_name(bound["compute_type"])})  # type: ignore[attr-defined]
    assert set(rebuilt) == set(call.args)
    for key in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "config", "compute_type", "top_k"):
        assert rebuilt[key] == call.args[key], key
