"""The Triton fused MoE ops: loading (config pseudo-arguments), contracts, mutations and re-derived routing, shape
shrinking, synth presets, an offline ``moereplay run``, and the capture targets against vLLM 0.25.1's sources."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from moereplay.ops import get_op
from moereplay.ops.base import argument_names, contract_violations
from moereplay.ops.fused_moe_triton_surface import (
    CONFIG_KEYS,
    FAMILY,
    GPTQ_AWQ_LAUNCHER,
    PARENT_OP,
    TRITON_LAUNCHER,
)
from moereplay.replay.mutations import apply_variant, parse_option
from moereplay.replay.source import load_call
from moereplay.synth import synthesize

TRITON = get_op("fused_moe_kernel")
GPTQ = get_op("fused_moe_kernel_gptq_awq")
SMALL = ["experts=8", "hidden=128", "intermediate=64", "tokens=6", "top_k=2"]
VLLM = Path("/tmp/vw/src/vllm/model_executor/layers/fused_moe")


@pytest.fixture(scope="module")
def captures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("triton")
    made = {}
    for preset, extra in (
        ("qwen3-30b-a3b-bf16-w13", ["mul_routed_weight=1"]),
        ("qwen3-30b-a3b-int4-w13", ["zero_points=1", "group_size=32"]),
        (
            "deepseek-v3-fp8-w13",
            ["global_experts=16", "rank=1", "hidden=256", "intermediate=128", "tokens=8"],
        ),
    ):
        path = folder / f"{preset}.moe.zst"
        synthesize(preset, path, overrides=[*SMALL, *extra], store="bytes")
        made[preset] = path
    return made


def loaded_args(path: Path) -> dict[str, Any]:
    return dict(load_call(path, 0).args)


def test_config_is_split_into_pseudo_arguments_and_rebuilt(captures: dict[str, Path]) -> None:
    args = loaded_args(captures["qwen3-30b-a3b-bf16-w13"])
    assert {key: args[key] for key in CONFIG_KEYS} == {
        "BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
        "num_stages": 3,
    }  # fmt: skip
    assert args["config"] is None and args["compute_type"] == "bfloat16"
    assert TRITON.recorded_args(args) == args  # type: ignore[attr-defined]
    assert TRITON.launch_config(args)["BLOCK_SIZE_M"] == 16  # type: ignore[attr-defined]


def test_every_preset_capture_matches_its_reference(captures: dict[str, Path]) -> None:
    for path in captures.values():
        call = load_call(path, 0)
        reference = call.op.reference(call.args)
        assert call.captured_output is not None
        written = reference.written
        torch.testing.assert_close(
            call.captured_output.float()[written], reference.output[written], rtol=2e-2, atol=2e-2
        )
    deepseek = load_call(captures["deepseek-v3-fp8-w13"], 0)
    written = deepseek.op.reference(deepseek.args).written
    assert 0 < int(written.sum()) < written.numel()  # rows routed to other ranks are not this rank's


def test_block_size_m_mutation_rederives_the_routing_and_keeps_the_answer(captures: dict[str, Path]) -> None:
    args = loaded_args(captures["qwen3-30b-a3b-int4-w13"])
    [variant] = parse_option(GPTQ, "set", "BLOCK_SIZE_M=64")
    applied = apply_variant(GPTQ, args, variant)
    assert applied.invalid_reason is None
    new = applied.args
    assert int(new["num_tokens_post_padded"][0]) % 64 == 0
    assert not contract_violations(GPTQ, new, check_device=False)
    before, after = GPTQ.reference(args), GPTQ.reference(new)
    assert torch.equal(before.written, after.written)
    torch.testing.assert_close(before.output, after.output)


def test_domains_refuse_illegal_launch_settings(captures: dict[str, Path]) -> None:
    args = loaded_args(captures["qwen3-30b-a3b-int4-w13"])
    for text in ("num_warps=3", "BLOCK_SIZE_M=8", "use_int4_w4a16=false"):
        [variant] = parse_option(GPTQ, "set", text)
        assert apply_variant(GPTQ, args, variant).invalid_reason is not None, text
    [both] = parse_option(GPTQ, "set", "use_int4_w4a16=false+use_int8_w8a16=true")
    assert apply_variant(GPTQ, args, both).invalid_reason is None


def test_contracts_name_row_addressing_padding_and_flat_weights(captures: dict[str, Path]) -> None:
    args = loaded_args(captures["qwen3-30b-a3b-bf16-w13"])
    assert not contract_violations(TRITON, args, check_device=False)
    c = args["C"]
    bad_c = torch.zeros(c.shape[1], c.shape[0], c.shape[2], dtype=c.dtype).transpose(0, 1)
    found = {(v.arg, v.aspect) for v in contract_violations(TRITON, {**args, "C": bad_c}, check_device=False)}
    assert ("C", "contiguity") in found
    misaligned = {**args, "BLOCK_SIZE_M": 32}  # arrays aligned for 16
    found = {v.arg for v in contract_violations(TRITON, misaligned, check_device=False)}
    assert "num_tokens_post_padded" in found
    weights = args["topk_weights"]
    strided = torch.zeros(weights.shape[0], weights.shape[1] * 2)[:, ::2]
    found = {
        v.arg for v in contract_violations(TRITON, {**args, "topk_weights": strided}, check_device=False)
    }
    assert "topk_weights" in found
    fp32_a = {**args, "A": args["A"].float()}
    assert any(v.aspect == "dtype" for v in contract_violations(TRITON, fp32_a, check_device=False))


@pytest.mark.parametrize(
    "preset", ["qwen3-30b-a3b-bf16-w13", "qwen3-30b-a3b-int4-w13", "deepseek-v3-fp8-w13"]
)
def test_shrink_gives_a_valid_call_whose_answer_is_the_original_cut(
    captures: dict[str, Path], preset: str
) -> None:
    op = get_op(load_call(captures[preset], 0).op.name)
    args = loaded_args(captures[preset])
    dims = {name: values for name, values, _ in op.shape_dimensions(args)}  # type: ignore[attr-defined]
    assert {"experts", "K", "N", "rows"} <= set(dims)
    full_experts = int(args["B"].shape[0])
    shape = {"K": dims["K"][0], "N": dims["N"][0], "rows": 3, "experts": full_experts}
    small = op.shrink(args, shape)  # type: ignore[attr-defined]
    assert not contract_violations(op, small, check_device=False)
    cut, whole = op.reference(small), op.reference({**args, **_cut_k(op, args, shape)})
    rows = 3 * int(args["top_k"])
    torch.testing.assert_close(cut.output, whole.output[:rows, : shape["N"]])
    tiny = op.shrink(args, {"experts": 1})  # type: ignore[attr-defined]
    assert int(tiny["B"].shape[0]) == 1 and bool(op.reference(tiny).written.any())


def _cut_k(op: Any, args: dict[str, Any], shape: dict[str, int]) -> dict[str, Any]:
    """The original call with K cut alone (rows and N are compared by slicing)."""
    return op.shrink(args, {"K": shape["K"]})  # type: ignore[no-any-return]


def test_offline_run_judges_the_capture_and_a_flag_flip(captures: dict[str, Path]) -> None:
    from moereplay.cli import app

    result = CliRunner().invoke(
        app, ["run", str(captures["qwen3-30b-a3b-bf16-w13"]), "--flip", "mul_routed_weight", "--json"]
    )
    assert result.exit_code in (0, 1), result.output
    assert '"recorded"' in result.output and '"ok"' in result.output and '"corrupt"' in result.output


def test_the_family_surface_declares_its_targets_without_torch() -> None:
    import subprocess
    import sys

    script = (
        "import sys\nimport moereplay.ops.fused_moe_triton_surface as s\n"
        "from moereplay.capture.patch_points import TARGETS\n"
        "sites = {t.site for t in TARGETS}\n"
        "assert 'vllm.model_executor.layers.fused_moe.experts.triton_moe:invoke_fused_moe_triton_kernel' in sites\n"
        "assert 'vllm.model_executor.layers.fused_moe:fused_experts' in sites\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
    assert set(FAMILY.kernel_ops) == {"fused_moe_kernel", "fused_moe_kernel_gptq_awq"}
    assert PARENT_OP in FAMILY.parent_ops


def _signature(source: Path, name: str) -> list[str]:
    tree = ast.parse(source.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return [arg.arg for arg in (*node.args.args, *node.args.kwonlyargs)]
    raise AssertionError(f"{name} not in {source}")


@pytest.mark.skipif(not VLLM.is_dir(), reason="vLLM 0.25.1 sources not unpacked here")
def test_launcher_signatures_and_patch_points_match_vllm_sources() -> None:
    """The op schemas are the launchers' own parameters, with config split into its keys."""
    fused = VLLM / "fused_moe.py"
    for op, launcher in ((TRITON, TRITON_LAUNCHER), (GPTQ, GPTQ_AWQ_LAUNCHER)):
        params = _signature(fused, launcher)
        names = [name for name in argument_names(op) if name not in CONFIG_KEYS]
        assert names == params, (op.name, params)
    assert "fused_experts" in [
        n.name for n in ast.parse(fused.read_text()).body if isinstance(n, ast.FunctionDef)
    ]
    experts_module = (VLLM / "experts" / "triton_moe.py").read_text()
    assert TRITON_LAUNCHER in experts_module and GPTQ_AWQ_LAUNCHER in experts_module
    assert "fused_experts" in (VLLM / "__init__.py").read_text()
