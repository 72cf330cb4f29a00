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
    required_config_keys,
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
    assert args["config"] == {"SPLIT_K": 1} and args["compute_type"] == "bfloat16"
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


def test_vllm_s_gemm2_output_split_is_no_contract_violation(captures: dict[str, Path]) -> None:
    # vLLM's fused_experts runs gemm2 with top_k=1 on A of M·topk rows and writes C = intermediate_cache3
    # [M, topk, K]: the kernel's row ids (M·topk of them) land at id · C.stride(1), which that split addresses
    # flat. The H200 proof run flagged it (shape "expects (1024, 1, 2048)", stride(0) == top_k · stride(1)).
    args = loaded_args(captures["qwen3-30b-a3b-bf16-w13"])
    c, a, top_k = args["C"], args["A"], int(args["top_k"])
    rows = a.shape[0] * top_k
    gemm2_like = {
        **args,
        "A": torch.zeros(rows, a.shape[1], dtype=a.dtype),
        "top_k": 1,
        "C": torch.zeros(a.shape[0], top_k, c.shape[2], dtype=c.dtype),
    }
    assert not contract_violations(TRITON, gemm2_like, check_device=False)
    short = {**gemm2_like, "C": torch.zeros(a.shape[0] - 1, top_k, c.shape[2], dtype=c.dtype)}
    assert ("C", "shape") in {
        (v.arg, v.aspect) for v in contract_violations(TRITON, short, check_device=False)
    }


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


# ---------------------------------------------------------------------------------------------------------------
# the config dict reaches the kernel whole (issue 18's first H200 run: the wna16 launch lacked SPLIT_K)
# ---------------------------------------------------------------------------------------------------------------


def test_synthesized_calls_carry_every_config_key_their_launcher_needs(captures: dict[str, Path]) -> None:
    """Every preset's call, as captured and under launch mutations, gives its launcher each constexpr the
    launcher does not fill in itself — ``SPLIT_K`` for the wna16 launcher above all."""
    for path in captures.values():
        call = load_call(path, 0)
        op = call.op
        required = set(required_config_keys(op.name))
        assert set(op.launch_config(call.args)) >= required, op.name  # type: ignore[attr-defined]
        assert not [v for v in contract_violations(op, call.args, check_device=False) if v.arg == "config"]
        for text in ("BLOCK_SIZE_M=64", "BLOCK_SIZE_N=128", "num_warps=8", "GROUP_SIZE_M=8"):
            [variant] = parse_option(op, "set", text)
            applied = apply_variant(op, call.args, variant)
            assert applied.invalid_reason is None, text
            config = op.launch_config(applied.args)  # type: ignore[attr-defined]
            assert set(config) >= required and config["SPLIT_K"] == 1, (op.name, text, config)
            key, value = text.split("=")
            assert config[key] == int(value)


def test_a_wna16_config_without_split_k_is_named_as_rejected(captures: dict[str, Path]) -> None:
    args = loaded_args(captures["qwen3-30b-a3b-int4-w13"])
    found = [
        v
        for v in contract_violations(GPTQ, {**args, "config": None}, check_device=False)
        if v.arg == "config"
    ]
    assert len(found) == 1 and found[0].host_checked and "SPLIT_K" in found[0].actual
    triton_args = loaded_args(captures["qwen3-30b-a3b-bf16-w13"])
    assert (
        not [  # the non-wna16 launcher sets SPLIT_K itself
            v
            for v in contract_violations(TRITON, {**triton_args, "config": None}, check_device=False)
            if v.arg == "config"
        ]
    )


def test_a_wna16_tile_mutation_runs_with_the_launchers_choice_of_the_other_tile(
    captures: dict[str, Path],
) -> None:
    """vLLM's default wna16 config has neither tile (the launcher picks both unless the config has both): setting
    one must not make the launcher drop it."""
    args = {**loaded_args(captures["qwen3-30b-a3b-int4-w13"]), "BLOCK_SIZE_N": None, "BLOCK_SIZE_K": None}
    assert "BLOCK_SIZE_N" not in GPTQ.launch_config(args)  # type: ignore[attr-defined]
    [variant] = parse_option(GPTQ, "set", "BLOCK_SIZE_N=128")
    config = GPTQ.launch_config(apply_variant(GPTQ, args, variant).args)  # type: ignore[attr-defined]
    assert (config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"], config["SPLIT_K"]) == (128, 32, 1)
    one_token = {**args, "A": args["A"][:1], "BLOCK_SIZE_K": 128}
    assert GPTQ.launch_config(one_token)["BLOCK_SIZE_N"] == 32  # type: ignore[attr-defined]


class _Launched(Exception):
    """Raised by the stand-in kernels with what they were launched with (no tensors are computed)."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        super().__init__("launched")
        self.kwargs = kwargs


def _stand_in_fused_moe_module() -> Any:
    """``fused_moe.py``'s launchers as vLLM 0.25.1 writes them, around kernels whose keyword parameters are the
    0.25.1 kernels' meta-parameters (read off the source; Triton, too, rejects a missing constexpr and an unknown
    keyword)."""
    import types

    def fused_moe_kernel(
        *, group_n: int, group_k: int, naive_block_assignment: bool, BLOCK_SIZE_M: int, BLOCK_SIZE_N: int,
        BLOCK_SIZE_K: int, GROUP_SIZE_M: int, SPLIT_K: int, MUL_ROUTED_WEIGHT: bool, top_k: int,
        compute_type: Any, use_fp8_w8a8: bool, use_int8_w8a8: bool, use_int8_w8a16: bool, per_channel_quant: bool,
        HAS_BIAS: bool, SWAP_AB: bool, num_warps: int = 4, num_stages: int = 3,
    ) -> None:  # fmt: skip
        raise _Launched(dict(locals()))

    def fused_moe_kernel_gptq_awq(
        *, block_k_diviable: bool, group_size: int, BLOCK_SIZE_M: int, BLOCK_SIZE_N: int, BLOCK_SIZE_K: int,
        GROUP_SIZE_M: int, SPLIT_K: int, MUL_ROUTED_WEIGHT: bool, top_k: int, compute_type: Any, has_zp: bool,
        use_int4_w4a16: bool, use_int8_w8a16: bool, num_warps: int = 4, num_stages: int = 3,
    ) -> None:  # fmt: skip
        raise _Launched(dict(locals()))

    def invoke_fused_moe_wna16_triton_kernel(
        A, B, C, B_scale, B_zp, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        mul_routed_weight, top_k, config, compute_type, use_int8_w8a16, use_int4_w4a16, block_shape,
    ):  # type: ignore[no-untyped-def]  # fmt: skip
        config = config.copy()
        if not ("BLOCK_SIZE_N" in config and "BLOCK_SIZE_K" in config):
            config.update({"BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32})
        fused_moe_kernel_gptq_awq(
            block_k_diviable=A.size(1) % config["BLOCK_SIZE_K"] == 0, group_size=block_shape[1],
            MUL_ROUTED_WEIGHT=mul_routed_weight, top_k=top_k, compute_type=compute_type, has_zp=B_zp is not None,
            use_int4_w4a16=use_int4_w4a16, use_int8_w8a16=use_int8_w8a16, **config,
        )  # fmt: skip

    def invoke_fused_moe_triton_kernel(
        A, B, C, A_scale, B_scale, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        mul_routed_weight, top_k, config, compute_type, use_fp8_w8a8, use_int8_w8a8, use_int8_w8a16,
        use_int4_w4a16, per_channel_quant, block_shape=None, B_bias=None,
    ):  # type: ignore[no-untyped-def]  # fmt: skip
        config = config.copy()
        config["SPLIT_K"] = 1
        block_k = config.pop("BLOCK_SIZE_K")
        if block_shape is not None:
            block_k = min(block_k, min(block_shape[0], block_shape[1]))
        fused_moe_kernel(
            group_n=0 if block_shape is None else block_shape[0],
            group_k=0 if block_shape is None else block_shape[1],
            MUL_ROUTED_WEIGHT=mul_routed_weight, top_k=top_k, compute_type=compute_type,
            use_fp8_w8a8=use_fp8_w8a8, use_int8_w8a8=use_int8_w8a8, use_int8_w8a16=use_int8_w8a16,
            per_channel_quant=per_channel_quant, naive_block_assignment=sorted_token_ids is None,
            HAS_BIAS=B_bias is not None, BLOCK_SIZE_K=block_k, SWAP_AB=False, **config,
        )  # fmt: skip

    module = types.ModuleType("stand_in_fused_moe")
    module.tl = types.SimpleNamespace(bfloat16="tl.bfloat16", float16="tl.float16", float32="tl.float32")  # type: ignore[attr-defined]
    module.invoke_fused_moe_triton_kernel = invoke_fused_moe_triton_kernel  # type: ignore[attr-defined]
    module.invoke_fused_moe_wna16_triton_kernel = invoke_fused_moe_wna16_triton_kernel  # type: ignore[attr-defined]
    return module


def test_run_gives_the_launcher_what_the_0_25_1_kernels_declare(captures: dict[str, Path]) -> None:
    """``op.run`` through stand-ins of the 0.25.1 launchers: every preset's call launches, with and without a
    mutated tile (before the fix the wna16 one failed like the H200 run: ``missing … 'SPLIT_K'``)."""
    from moereplay.ops.fused_moe_triton_surface import FUSED_MOE_MODULE
    from moereplay.replay.backends import ModuleBackend

    backend = ModuleBackend.of_modules(
        "python:stand-in", "cpu", {FUSED_MOE_MODULE: _stand_in_fused_moe_module()}
    )
    for path in captures.values():
        call = load_call(path, 0)
        for text in (None, "BLOCK_SIZE_N=128", "BLOCK_SIZE_K=64"):
            args = dict(call.args)
            if text is not None:
                [variant] = parse_option(call.op, "set", text)
                args = apply_variant(call.op, args, variant).args
            with pytest.raises(_Launched) as launched:
                call.op.run(args, backend)
            kernel = launched.value.kwargs
            assert kernel["SPLIT_K"] == 1 and kernel["compute_type"] == "tl.bfloat16", call.op.name
            if text is not None:
                key, value = text.split("=")
                blocks = args.get("block_shape")
                expected = (
                    min(int(value), 128) if key == "BLOCK_SIZE_K" and blocks and blocks[0] else int(value)
                )
                assert kernel[key] == expected, (call.op.name, text, kernel)


def _kernel_constexprs(tree: ast.Module, name: str) -> list[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return [
                arg.arg
                for arg in node.args.args
                if arg.annotation is not None and ast.unparse(arg.annotation) == "tl.constexpr"
            ]
    raise AssertionError(f"{name} not found")


def _launches(tree: ast.Module, launcher: str, kernel: str) -> ast.Call:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == launcher:
            for call in ast.walk(node):
                if (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Subscript)
                    and ast.unparse(call.func.value) == kernel
                ):
                    return call
    raise AssertionError(f"{launcher} does not launch {kernel}")


@pytest.mark.skipif(not VLLM.is_dir(), reason="vLLM 0.25.1 sources not unpacked here")
def test_config_constexprs_match_the_vllm_kernels() -> None:
    """The constexprs each 0.25.1 kernel takes from ``**config`` (declared, not passed by name or position) are
    :data:`CONFIG_CONSTEXPRS`, and those its launcher does not fill in are the op's required config keys."""
    from moereplay.ops.fused_moe_triton_surface import (
        CONFIG_CONSTEXPRS,
        GPTQ_AWQ_OP,
        LAUNCHER_SUPPLIED,
        TRITON_OP,
    )

    tree = ast.parse((VLLM / "fused_moe.py").read_text())
    for op, launcher, kernel in (
        (TRITON_OP, TRITON_LAUNCHER, "fused_moe_kernel"),
        (GPTQ_AWQ_OP, GPTQ_AWQ_LAUNCHER, "fused_moe_kernel_gptq_awq"),
    ):
        params = [arg.arg for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == kernel
                  for arg in node.args.args]  # fmt: skip
        call = _launches(tree, launcher, kernel)
        by_position = set(params[: len(call.args)])
        by_name = {keyword.arg for keyword in call.keywords if keyword.arg is not None}
        from_config = [p for p in _kernel_constexprs(tree, kernel) if p not in by_position | by_name]
        assert from_config == [k for k in CONFIG_CONSTEXPRS if k not in by_name], (kernel, from_config)
        assert "SPLIT_K" in from_config
        source = ast.unparse(
            next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == launcher)
        )
        for key in LAUNCHER_SUPPLIED[op]:
            assert key in source, (launcher, key)
        assert set(from_config) - LAUNCHER_SUPPLIED[op] <= set(required_config_keys(op))
