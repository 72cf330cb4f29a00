"""The Marlin MoE op module: schema, contracts, re-derived routing, scratch, the reference adapter, and an offline
replay of a Marlin-shaped capture (CPU; the kernel itself is tested in tests/gpu/test_replay_marlin.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from moereplay.ops import get_op
from moereplay.ops.base import ArgKind, argument_names, check_contracts
from moereplay.ops.marlin_moe import captured_block_size, scalar_type_id
from moereplay.ops.surface import family_of
from moereplay.reference.marlin_formats import MarlinWeightFormat, random_experts
from moereplay.reference.moe_align import moe_align_block_size
from moereplay.replay.mutations import apply_variant, parse_option

OP = get_op("moe_wna16_marlin_gemm")


def gemm2_call(
    *,
    tokens: int = 8,
    top_k: int = 4,
    experts: int = 8,
    k: int = 128,
    n: int = 128,
    block: int = 16,
    weights_dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> dict[str, Any]:
    """A gpt-oss-style gemm2 call (rows pre-expanded, ``top_k=1``) on random NVFP4 experts, as vLLM builds it."""
    generator = torch.Generator().manual_seed(seed)
    packed = random_experts(MarlinWeightFormat.NVFP4, experts, k, n, generator=generator)
    router = torch.randn(tokens, experts, generator=generator)
    topk_weights, topk_ids = torch.topk(torch.softmax(router, -1), top_k, dim=-1)
    sorted_ids, expert_ids, padded = moe_align_block_size(topk_ids.to(torch.int32), block, experts)
    rows = tokens * top_k
    args: dict[str, Any] = dict(packed.kernel_kwargs())
    args.update(
        input=(torch.randn(rows, k, generator=generator) * 0.5).to(torch.bfloat16),
        output=torch.zeros(rows, n, dtype=torch.bfloat16),
        a_scales=None,
        workspace=torch.zeros(132 * 4, dtype=torch.int32),
        sorted_token_ids=sorted_ids,
        expert_ids=expert_ids,
        num_tokens_past_padded=padded,
        topk_weights=topk_weights.to(weights_dtype),
        moe_block_size=block,
        top_k=1,
        mul_topk_weights=True,
        size_m=rows,
        is_k_full=True,
        use_atomic_add=False,
        use_fp32_reduce=True,
        thread_k=-1,
        thread_n=-1,
        blocks_per_sm=-1,
    )
    return args


def test_schema_is_the_vllm_0_25_1_signature() -> None:
    assert argument_names(OP) == (
        "input",
        "output",
        "b_qweight",
        "b_bias",
        "b_scales",
        "a_scales",
        "global_scale",
        "b_qzeros",
        "g_idx",
        "perm",
        "workspace",
        "sorted_token_ids",
        "expert_ids",
        "num_tokens_past_padded",
        "topk_weights",
        "moe_block_size",
        "top_k",
        "mul_topk_weights",
        "b_q_type",
        "size_m",
        "size_n",
        "size_k",
        "is_k_full",
        "use_atomic_add",
        "use_fp32_reduce",
        "is_zp_float",
        "thread_k",
        "thread_n",
        "blocks_per_sm",
    )
    (b_q_type,) = [spec for spec in OP.arguments if spec.name == "b_q_type"]
    assert b_q_type.kind is ArgKind.ENUM
    family = family_of(OP.name)  # where vLLM calls it: the family's declaration, not the OpSpec
    assert family is not None and (0, 25) in family.vllm_series and (0, 24) not in family.vllm_series
    assert "vllm._custom_ops:moe_wna16_marlin_gemm" in {target.site for target in family.targets}


def test_scalar_type_ids_are_read_from_every_recorded_form() -> None:
    from moereplay.format import CodecValue

    class Fake:
        id = 1234

    assert scalar_type_id(7) == 7
    assert scalar_type_id({"id": 9, "name": "x"}) == 9
    assert scalar_type_id(Fake()) == 1234
    assert scalar_type_id(CodecValue("vllm.scalar_type.ScalarType", {"id": 11, "name": "float4_e2m1f"})) == 11


def test_bf16_routing_weights_break_an_unchecked_contract() -> None:
    violations = check_contracts(OP.contracts, gemm2_call(weights_dtype=torch.bfloat16), check_device=False)
    (violation,) = violations
    assert (violation.arg, violation.aspect, violation.expected, violation.actual) == (
        "topk_weights",
        "dtype",
        "float32",
        "bfloat16",
    )
    assert not violation.host_checked and "past the end" in violation.consequence
    # 4 bytes read per 2-byte element: as many bytes past the end as the tensor holds
    weights = gemm2_call(weights_dtype=torch.bfloat16)["topk_weights"]
    assert violation.reads_past_end == weights.numel() * 2 and violation.predicts_memory_dependence
    assert check_contracts(OP.contracts, gemm2_call(), check_device=False) == []


def test_contracts_follow_the_flags_nothing_for_what_the_kernel_does_not_read() -> None:
    """bf16 routing weights break no contract while ``mul_topk_weights`` is off (the kernel never loads them); act-order
    indices and zero points are read only when the host code turns those modes on."""
    unread = gemm2_call(weights_dtype=torch.bfloat16)
    unread["mul_topk_weights"] = False
    assert check_contracts(OP.contracts, unread, check_device=False) == []

    def dtype_violations(**changes: Any) -> set[str]:
        args = {**gemm2_call(), **changes}
        return {v.arg for v in check_contracts(OP.contracts, args, check_device=False) if v.aspect == "dtype"}

    k = 128
    wrong_g_idx, wrong_perm = torch.zeros(8, k, dtype=torch.int64), torch.zeros(8, k, dtype=torch.int64)
    assert dtype_violations(g_idx=wrong_g_idx, perm=wrong_perm, is_k_full=False) == {"g_idx", "perm"}
    # with a full K the main kernel runs without act order: perm is read (to permute input), g_idx is not
    assert dtype_violations(g_idx=wrong_g_idx, perm=wrong_perm, is_k_full=True) == {"perm"}
    assert dtype_violations(g_idx=wrong_g_idx, perm=torch.empty(8, 0, dtype=torch.int32)) == set()
    assert dtype_violations(b_qzeros=torch.empty(8, 0, dtype=torch.float16)) == set()
    assert dtype_violations(b_qzeros=torch.zeros(8, 1, 16, dtype=torch.float16)) == {"b_qzeros"}


def test_host_checked_contracts_are_marked() -> None:
    args = gemm2_call()
    args["global_scale"] = args["global_scale"].to(torch.bfloat16)
    args["input"] = args["input"][:, :64].contiguous()
    found = {
        (v.arg, v.aspect): v.host_checked for v in check_contracts(OP.contracts, args, check_device=False)
    }
    assert found == {("global_scale", "dtype"): True, ("input", "shape"): True}


def test_the_captured_block_size_is_recognised() -> None:
    for block in (8, 16, 32, 64):
        assert captured_block_size(gemm2_call(block=block)) == block


@pytest.mark.parametrize("block", [8, 32, 48, 64])
def test_changing_the_block_size_rederives_the_same_routing(block: int) -> None:
    args = gemm2_call()
    applied = apply_variant(OP, args, parse_option(OP, "set", f"moe_block_size={block}")[0])
    assert applied.invalid_reason is None
    new_ids, new_experts = applied.args["sorted_token_ids"], applied.args["expert_ids"]
    assert int(applied.args["num_tokens_past_padded"][0]) % block == 0
    assert new_experts.numel() == -(-new_ids.numel() // block)
    before, after = OP.reference(args), OP.reference(applied.args)
    assert torch.equal(before.written, after.written)
    assert torch.equal(before.output, after.output)
    assert torch.equal(before.rows.expert, after.rows.expert)


def test_scratch_is_fresh_zeroed_and_shaped_like_the_capture() -> None:
    args = gemm2_call()
    args["output"] = torch.full((64, 256), 3.0, dtype=torch.bfloat16)[:, :128]  # a strided view, not zeros
    scratch = OP.make_scratch(args, torch.device("cpu"))
    assert scratch["output"].stride() == (256, 1) and scratch["output"].shape == (64, 128)
    assert not scratch["output"].any() and not scratch["workspace"].any()
    assert (
        scratch["workspace"].dtype == torch.int32
        and scratch["workspace"].numel() >= args["workspace"].numel()
    )


def test_reference_adapter_exposes_ingredients_sources_and_scales() -> None:
    args = gemm2_call()
    reference = OP.reference(args)
    assert set(reference.terms) == {"gemm"}
    assert torch.allclose(reference.output, reference.terms["gemm"] * reference.coefficients["gemm"][:, None])
    source = reference.sources["gemm"]
    assert (source.arg, source.read_as) == ("topk_weights", torch.float32)
    assert torch.equal(source.index, torch.arange(32))
    assert torch.equal(reference.coefficients["gemm"], args["topk_weights"].reshape(-1))
    experts = reference.rows.expert
    assert torch.equal(reference.scales["global_scale"], args["global_scale"][experts])
    flag_off = OP.reference({**args, "mul_topk_weights": False})
    assert flag_off.sources == {} and torch.equal(flag_off.coefficients["gemm"], torch.ones(32))


def test_offline_replay_of_a_capture_with_the_published_symptom(tmp_path: Path) -> None:
    """The capture holds an output built from the reference's ingredients the way a float32 read of bf16 routing
    weights would scale them (rows past the data read zeros) — a synthetic output, judged offline."""
    from moereplay.format import CaptureWriter
    from moereplay.replay import FindingKind, Verdict, replay

    args = gemm2_call(weights_dtype=torch.bfloat16)
    reference = OP.reference(args)
    raw = torch.cat([args["topk_weights"].reshape(-1).view(torch.uint8), torch.zeros(256, dtype=torch.uint8)])
    applied = raw[: 32 * 4].view(torch.float32).to(torch.bfloat16).float()
    output = (reference.terms["gemm"] * applied[:, None]).to(torch.bfloat16)
    path = tmp_path / "marlin.moe.zst"
    with CaptureWriter(path) as writer:
        index = writer.begin_call(OP.name, args, site="test:gemm2")
        writer.complete_call(index, {"output": output, "return": output})
    report = replay(path, backend="reference", device="cpu", mutations=["sweep moe_block_size=16,32"])
    assert report.recorded is not None and report.recorded.verdict is Verdict.CORRUPT
    assert report.baseline.verdict is Verdict.NEEDS_KERNEL and report.headline.text == "corrupt (recorded)"
    diagnosis = next(
        f for f in report.findings if f.kind is FindingKind.DIAGNOSIS and f.variant == "recorded"
    )
    assert diagnosis.evidence["blame"] == "caller" and diagnosis.suggestions == ("cast topk_weights=float32",)
    # a block size changes how the kernel runs, not what the call computes: offline only a kernel can answer; so
    # do the guard fills the bf16 weights' contract makes the replay add unasked
    labels = ["set moe_block_size=16", "set moe_block_size=32", "fill 0xff", "fill 0x00"]
    assert [v.label for v in report.variants] == labels
    assert [v.verdict for v in report.variants] == [Verdict.NEEDS_KERNEL] * 4
