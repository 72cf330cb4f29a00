"""Synth presets: calls built the way vLLM builds them, recorded as bytes or recipes, judged offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from moereplay.cli import app
from moereplay.errors import SettingsError
from moereplay.format import CaptureReader
from moereplay.ops import ogs_codecs
from moereplay.reference import marlin_formats as mf
from moereplay.replay import FindingKind, Verdict, replay
from moereplay.synth import all_presets, get_preset, synthesize
from moereplay.synth.generators import marlin_experts
from moereplay.synth.marlin_presets import nvfp4_marlin_intermediate
from moereplay.synth.routing import marlin_block_size, ogs_routing, softmax_topk

SMALL: dict[str, list[str]] = {
    "gpt-oss-20b-nvfp4-gemm1": ["tokens=4", "experts=4", "hidden=320", "intermediate=192"],
    "gpt-oss-20b-nvfp4-gemm2": ["tokens=4", "experts=4", "hidden=320", "intermediate=192"],
    "marlin-nvfp4-report": ["tokens=4", "experts=4", "n=256", "k=256"],
    "gptq-int4-marlin": ["hidden=256", "intermediate=128", "act_order=1"],
    "fp8-marlin": ["hidden=256", "intermediate=128"],
    "marlin-nvfp4-layer": [],
    "gpt-oss-20b-mxfp4-w13": ["tokens=4", "experts=4", "hidden=256", "intermediate=128"],
    "gpt-oss-20b-mxfp4-w2": ["tokens=4", "experts=4", "hidden=256", "intermediate=128"],
    "gpt-oss-20b-mxfp4-layer": [],
    "qwen3-30b-a3b-bf16-w13": ["tokens=4", "experts=8", "hidden=128", "intermediate=64"],
    "qwen3-30b-a3b-int4-w13": ["tokens=4", "experts=8", "hidden=128", "intermediate=64", "group_size=32"],
    "deepseek-v3-fp8-w13": ["tokens=4", "experts=8", "global_experts=16", "hidden=256", "intermediate=128"],
    "triton-bf16-layer": [],
}
KERNEL_OPS = ("moe_wna16_marlin_gemm", "matmul_ogs", "fused_moe_kernel", "fused_moe_kernel_gptq_awq")


def leaves(value: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in leaves(item, f"{prefix}.{key}").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in leaves(item, f"{prefix}[{i}]").items()}
    return ogs_codecs.tensor_leaves(value, prefix) if hasattr(value, "__dataclass_fields__") else {}


def test_every_preset_has_a_small_setting_here() -> None:
    assert {preset.name for preset in all_presets()} == set(SMALL)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_each_preset_synthesizes_and_its_kernel_calls_judge_ok_offline(name: str, tmp_path: Path) -> None:
    result = synthesize(name, tmp_path / f"{name}.moe.zst", overrides=SMALL[name])
    assert result.recipes > 0 and result.file_bytes < result.recipe_bytes
    with CaptureReader(result.path) as reader:
        header = reader.header["synth"]
        kernel_calls = [record.index for record in reader.calls() if record.op in KERNEL_OPS]
    assert header["preset"] == name and header["output_source"].startswith("reference")
    assert kernel_calls
    for index in kernel_calls:
        report = replay(result.path, call=index, backend="reference")
        recorded = report.recorded
        assert recorded is not None and recorded.verdict is Verdict.OK, (index, recorded)
        assert recorded.rows > 0 and recorded.max_rel < 0.02


def test_bytes_and_recipes_record_the_same_arguments(tmp_path: Path) -> None:
    settings = SMALL["gpt-oss-20b-mxfp4-w13"]
    as_bytes = synthesize("gpt-oss-20b-mxfp4-w13", tmp_path / "b.moe.zst", overrides=settings, store="bytes")
    as_recipe = synthesize("gpt-oss-20b-mxfp4-w13", tmp_path / "r.moe.zst", overrides=settings)
    assert as_bytes.recipes == 0 and as_recipe.file_bytes * 3 < as_bytes.file_bytes
    with CaptureReader(as_bytes.path) as a, CaptureReader(as_recipe.path) as b:
        left, right = leaves(a.load_args(0)), leaves(b.load_args(0))
        assert a.stats().unique_blob_bytes > 10 * b.stats().unique_blob_bytes
    assert left.keys() == right.keys()
    for path, tensor in left.items():
        assert tensor.dtype == right[path].dtype and tensor.stride() == right[path].stride(), path
        assert torch.equal(tensor.view(torch.uint8), right[path].view(torch.uint8)), path


def test_the_report_preset_is_the_published_call(tmp_path: Path) -> None:
    result = synthesize("marlin-nvfp4-report", tmp_path / "r.moe.zst", overrides=["tokens=2", "experts=4"])
    with CaptureReader(result.path) as reader:
        args = reader.load_args(0)
    assert (args["size_n"], args["size_k"], args["top_k"], args["size_m"]) == (2880, 2944, 1, 8)
    assert args["moe_block_size"] == 16 and args["mul_topk_weights"] is True
    assert args["topk_weights"].dtype == torch.bfloat16 and args["topk_weights"].shape == (2, 4)
    assert bool((args["input"][:, 2880:] == 0).all())
    weights = mf.MarlinExpertWeights.from_kernel_args(
        b_qweight=args["b_qweight"], b_scales=args["b_scales"], b_q_type=mf.st.float4_e2m1f,
        activation_dtype=torch.bfloat16, size_k=2944, size_n=2880, global_scale=args["global_scale"],
    )  # fmt: skip
    dense = weights.dequantize()
    assert bool((dense[:, 2880:, :] == 0).all()) and bool((dense[:, :2880, :] != 0).any())
    report = replay(result.path, call=0, backend="reference")
    assert any(
        f.kind is FindingKind.CONTRACT_VIOLATION and "topk_weights" in f.message for f in report.findings
    )


def test_nvfp4_padding_follows_vllms_marlin_rule() -> None:
    assert nvfp4_marlin_intermediate(2880, 2880) == 2944  # hidden % 128 != 0: round up to 128
    assert nvfp4_marlin_intermediate(4096, 2880) == 2880  # hidden % 128 == 0: round up to 64
    assert nvfp4_marlin_intermediate(4096, 2900) == 2944
    with pytest.raises(SettingsError, match="multiple of 64"):
        nvfp4_marlin_intermediate(100, 64)


def test_gemm1_pads_each_gate_up_shard_like_pad_w13(tmp_path: Path) -> None:
    result = synthesize(
        "gpt-oss-20b-nvfp4-gemm1", tmp_path / "g1.moe.zst", overrides=SMALL["gpt-oss-20b-nvfp4-gemm1"]
    )
    with CaptureReader(result.path) as reader:
        args = reader.load_args(0)
    assert (args["size_k"], args["size_n"], args["top_k"]) == (320, 512, 4)  # 192 → 256 per shard
    weights = mf.MarlinExpertWeights.from_kernel_args(
        b_qweight=args["b_qweight"], b_scales=args["b_scales"], b_q_type=mf.st.float4_e2m1f,
        activation_dtype=torch.bfloat16, size_k=320, size_n=512, global_scale=args["global_scale"],
    )  # fmt: skip
    dense = weights.dequantize()
    padding = torch.zeros(512, dtype=torch.bool)
    padding[192:256] = padding[448:512] = True
    assert bool((dense[..., padding] == 0).all()) and bool((dense[..., ~padding] != 0).any())
    bias = mf.layout.unpermute_bias(args["b_bias"])
    assert bool((bias[..., padding] == 0).all())


def test_marlin_generator_is_pack_experts_of_its_logical_draw() -> None:
    params = {"seed": 5, "format": "uint4b8", "experts": 2, "size_k": 256, "size_n": 128, "group_size": 64}
    out = marlin_experts(params)
    codes = mf.layout.unpack_weights(out["b_qweight"], 4)
    gen = torch.Generator().manual_seed(5)
    expected = torch.randint(0, 16, (2, 256, 128), generator=gen, dtype=torch.uint8)
    assert torch.equal(codes, expected)
    assert set(out) == {"b_qweight", "b_scales"}


def test_routing_is_vllms() -> None:
    topk = softmax_topk(16, 8, 2, seed=1, renormalize=True)
    assert topk.weights.dtype == torch.float32 and topk.ids.dtype == torch.int32
    assert torch.allclose(topk.weights.sum(-1), torch.ones(16))
    assert marlin_block_size(32, 4, 32) == 8 and marlin_block_size(512, 4, 8) == 64
    routing, gather, scatter = ogs_routing(topk, 8)
    flat = topk.ids.reshape(-1).long()
    assert torch.equal(flat[gather.src_indx.long()], torch.sort(flat, stable=True).values)
    assert torch.equal(gather.src_indx[scatter.src_indx.long()], torch.arange(32, dtype=torch.int32))
    assert routing.gate_scal.dtype == torch.bfloat16
    for block, tile_map in routing.expt_data.block_pid_map.items():
        expected = []
        for expert in range(8):
            expected += [(b << 16) + expert for b in range(-(-int(routing.expt_hist[expert]) // block))]
        assert tile_map[: len(expected)].tolist() == expected and bool(
            (tile_map[len(expected) :] == -1).all()
        )


def test_settings_are_checked() -> None:
    preset = get_preset("marlin-nvfp4-report")
    assert preset.resolve(["tokens=8", "weights_dtype=float32"])["tokens"] == 8
    with pytest.raises(SettingsError, match="has no such setting"):
        preset.resolve(["nope=1"])
    with pytest.raises(SettingsError, match="expected int"):
        preset.resolve(["tokens=many"])
    with pytest.raises(SettingsError, match="expected one of"):
        preset.resolve(["weights_dtype=int8"])
    with pytest.raises(SettingsError, match="no synth preset"):
        get_preset("gpt-5")
    with pytest.raises(SettingsError, match="--store"):
        synthesize("marlin-nvfp4-report", "unused.moe.zst", store="pickle")  # type: ignore[arg-type]


def test_kernel_backends_need_cuda_here() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SettingsError, match="no CUDA device"):
        synthesize("marlin-nvfp4-report", "unused.moe.zst", backend="vllm")


def test_cli_synth_writes_a_capture_and_lists_presets(tmp_path: Path) -> None:
    runner = CliRunner()
    listed = runner.invoke(app, ["synth", "--list"])
    assert (
        listed.exit_code == 0
        and "marlin-nvfp4-report" in listed.output
        and "--set tokens=32" in listed.output
    )
    path = tmp_path / "cli.moe.zst"
    args = [
        "synth",
        "fp8-marlin",
        "-o",
        str(path),
        "--set",
        "hidden=256",
        "--set",
        "intermediate=128",
        "--bias",
    ]
    made = runner.invoke(app, [*args, "--store", "bytes"])
    assert made.exit_code == 0, made.output
    assert ": 1 call (" in made.output and "biases on" in made.output
    with CaptureReader(path) as reader:
        assert reader.header["synth"]["bias"] is True and reader.load_args(0)["b_bias"] is not None


def test_cli_synth_refuses_an_existing_output_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from moereplay.cli import main

    path = tmp_path / "taken.moe.zst"
    path.write_bytes(b"keep me")
    args = ["synth", "fp8-marlin", "-o", str(path), "--set", "hidden=256", "--set", "intermediate=128"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in error
    assert error == f"moereplay: {path} exists; choose another -o or pass --force to replace it"
    assert path.read_bytes() == b"keep me"
    made = CliRunner().invoke(app, [*args, "--force"])
    assert made.exit_code == 0, made.output
    with CaptureReader(path) as reader:
        assert len(reader) == 1
