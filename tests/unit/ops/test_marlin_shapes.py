"""Shrinking Marlin MoE calls for the shape bisection: legal dimensions, exact re-slicing of every packed tensor,
re-derived routing — and the shape and mutation bisections run end to end on a CPU stand-in of the kernel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import marlin_emulator
import pytest
import torch

from moereplay.errors import ReplayError
from moereplay.ops import get_op
from moereplay.ops.base import contract_violations
from moereplay.ops.marlin_shapes import kept_experts, shape_dimensions, shrink
from moereplay.reference import marlin_layout as layout
from moereplay.reference.marlin_formats import MarlinExpertWeights, MarlinWeightFormat, random_experts
from moereplay.reference.moe_align import moe_align_block_size
from moereplay.reference.scalar_types import as_scalar_type

OP = get_op("moe_wna16_marlin_gemm")
F = MarlinWeightFormat


def marlin_call(
    fmt: MarlinWeightFormat = F.NVFP4,
    *,
    tokens: int = 8,
    routing_top_k: int = 4,
    expanded: bool = True,
    experts: int = 8,
    k: int = 384,
    n: int = 192,
    block: int = 16,
    group_size: int | None = None,
    act_order: bool = False,
    bias: bool = False,
    activation: torch.dtype = torch.bfloat16,
    weights_dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> dict[str, Any]:
    """A Marlin MoE call as vLLM builds it: gemm2 (rows pre-expanded, ``top_k=1``) or gemm1 (``top_k`` choices)."""
    generator = torch.Generator().manual_seed(seed)
    packed = random_experts(
        fmt,
        experts,
        k,
        n,
        group_size=group_size,
        activation_dtype=activation,
        act_order=act_order,
        with_bias=bias,
        with_dense=False,
        generator=generator,
    )
    router = torch.randn(tokens, experts, generator=generator)
    topk_weights, topk_ids = torch.topk(torch.softmax(router, -1), routing_top_k, dim=-1)
    sorted_ids, expert_ids, padded = moe_align_block_size(topk_ids.to(torch.int32), block, experts)
    rows = tokens * routing_top_k
    size_m, top_k = (rows, 1) if expanded else (tokens, routing_top_k)
    args: dict[str, Any] = dict(packed.kernel_kwargs())
    args.update(
        input=(torch.randn(size_m, k, generator=generator) * 0.5).to(activation),
        output=torch.zeros(rows, n, dtype=activation),
        a_scales=None,
        workspace=torch.zeros(132 * 4, dtype=torch.int32),
        sorted_token_ids=sorted_ids,
        expert_ids=expert_ids,
        num_tokens_past_padded=padded,
        topk_weights=topk_weights.to(weights_dtype),
        moe_block_size=block,
        top_k=top_k,
        mul_topk_weights=True,
        size_m=size_m,
        is_k_full=True,
        use_atomic_add=False,
        use_fp32_reduce=True,
        thread_k=-1,
        thread_n=-1,
        blocks_per_sm=-1,
    )
    return args


def dense(args: dict[str, Any]) -> torch.Tensor:
    """The call's dequantised weights ``[E, K, N]`` (float32, original row order)."""
    return MarlinExpertWeights.from_kernel_args(
        b_qweight=args["b_qweight"],
        b_scales=args["b_scales"],
        b_q_type=as_scalar_type(args["b_q_type"]),
        activation_dtype=args["input"].dtype,
        size_k=args["size_k"],
        size_n=args["size_n"],
        global_scale=args["global_scale"],
        b_qzeros=args["b_qzeros"],
        g_idx=args["g_idx"],
        perm=args["perm"],
        is_zp_float=args["is_zp_float"],
    ).dequantize()


# ---------------------------------------------------------------------------------------------------------------
# dimensions
# ---------------------------------------------------------------------------------------------------------------


def test_dimensions_of_a_gemm2_call_are_experts_k_n_and_rows_in_legal_multiples() -> None:
    dimensions = {name: (values, original) for name, values, original in shape_dimensions(marlin_call())}
    assert list(dimensions) == ["experts", "K", "N", "rows"]  # top_k = 1: no top_k dimension
    assert dimensions["experts"] == (tuple(range(1, 9)), 8)
    assert dimensions["K"] == ((128, 256, 384), 384)
    assert dimensions["N"] == ((64, 128, 192), 192)
    assert dimensions["rows"] == (tuple(range(1, 33)), 32)


def test_k_keeps_whole_groups_and_explicit_tiles_and_act_order_fixes_k() -> None:
    grouped = marlin_call(F.GPTQ_INT4, k=768, n=256, group_size=256)
    assert dict((name, values) for name, values, _ in shape_dimensions(grouped))["K"] == (256, 512, 768)
    tiled = {**marlin_call(k=512, n=512), "thread_k": 128, "thread_n": 256}
    assert dict((name, values) for name, values, _ in shape_dimensions(tiled))["N"] == (256, 512)
    ordered = marlin_call(F.GPTQ_INT4, group_size=128, act_order=True, expanded=False)
    names = [name for name, _, _ in shape_dimensions(ordered)]
    assert names == ["experts", "N", "rows", "top_k"]


# ---------------------------------------------------------------------------------------------------------------
# exact re-slicing of the packed tensors
# ---------------------------------------------------------------------------------------------------------------

FORMATS = [
    pytest.param(dict(fmt=F.NVFP4), id="nvfp4"),
    pytest.param(dict(fmt=F.MXFP4), id="mxfp4"),
    pytest.param(dict(fmt=F.GPTQ_INT4, group_size=128, bias=True), id="gptq-int4-g128-bias"),
    pytest.param(dict(fmt=F.GPTQ_INT4, group_size=-1), id="gptq-int4-channel"),
    pytest.param(dict(fmt=F.GPTQ_INT8, group_size=128), id="gptq-int8-g128"),
    pytest.param(dict(fmt=F.AWQ_INT4, group_size=128), id="awq-int4"),
    pytest.param(dict(fmt=F.AWQ_INT4_FZP, group_size=128, activation=torch.float16), id="awq-int4-float-zp"),
    pytest.param(dict(fmt=F.FP8, group_size=-1), id="fp8-channel"),
    pytest.param(dict(fmt=F.MXFP8), id="mxfp8"),
]


@pytest.mark.parametrize("options", FORMATS)
@pytest.mark.parametrize(("k", "n"), [(128, 128), (256, 64), (384, 192)])
def test_shrunk_weights_are_exactly_the_slice_of_the_original_weights(
    options: dict[str, Any], k: int, n: int
) -> None:
    args = marlin_call(**options, experts=4)
    shrunk = shrink(args, {"K": k, "N": n})
    assert (shrunk["size_k"], shrunk["size_n"]) == (k, n)
    assert shrunk["b_qweight"].shape == (4, k // 16, n * 16 // (32 // options["fmt"].num_bits))
    assert torch.equal(dense(shrunk), dense(args)[:, :k, :n])
    if args["b_bias"] is not None:
        assert torch.equal(
            layout.unpermute_bias(shrunk["b_bias"]), layout.unpermute_bias(args["b_bias"])[:, :n]
        )
    assert tuple(shrunk["input"].shape) == (args["size_m"], k)
    assert tuple(shrunk["output"].shape) == (args["size_m"], n)
    assert contract_violations(OP, shrunk, check_device=False) == []


def test_the_scale_order_follows_the_new_group_count() -> None:
    """Two groups of 128 shrunk to one: the kernel then reads the scales in the channel-wise order."""
    args = marlin_call(F.GPTQ_INT4, k=256, n=128, group_size=128, experts=2, routing_top_k=2)
    shrunk = shrink(args, {"K": 128})
    assert shrunk["b_scales"].shape == (2, 1, 128)
    assert torch.equal(dense(shrunk), dense(args)[:, :128, :])


def test_experts_are_kept_used_first_and_dropped_routes_fold_onto_kept_ones() -> None:
    routes = torch.tensor([[5, 2], [2, 7], [-1, 5]])
    kept, mapping = kept_experts(routes, 8, 2)
    assert kept == [2, 5] and mapping[2] == 0 and mapping[5] == 1 and mapping[7] == 0
    kept, mapping = kept_experts(routes, 8, 5)
    assert kept == [0, 1, 2, 5, 7] and mapping.tolist() == [0, 1, 2, -1, -1, 3, -1, 4]


# ---------------------------------------------------------------------------------------------------------------
# routing re-derived
# ---------------------------------------------------------------------------------------------------------------


def test_fewer_rows_and_choices_keep_the_same_rows_and_their_weights() -> None:
    args = marlin_call(expanded=False, tokens=8, routing_top_k=4)
    before = OP.reference(args)
    shrunk = shrink(args, {"rows": 5, "top_k": 3})
    after = OP.reference(shrunk)
    assert shrunk["size_m"] == 5 and shrunk["top_k"] == 3 and shrunk["topk_weights"].numel() == 15
    assert bool(after.written.all())
    for token in range(5):
        for choice in range(3):
            old, new = token * 4 + choice, token * 3 + choice
            # the same fp32 sums; BLAS may block a 5-row product differently from a 32-row one
            torch.testing.assert_close(after.output[new], before.output[old], rtol=1e-5, atol=1e-6)
            assert int(after.rows.expert[new]) == int(before.rows.expert[old])


def test_fewer_experts_than_used_keeps_every_routed_row_routed_and_the_call_valid() -> None:
    args = marlin_call(
        weights_dtype=torch.bfloat16
    )  # the published report's dtype: it must survive shrinking
    shrunk = shrink(args, {"experts": 2, "rows": 7, "K": 128, "N": 64})
    assert shrunk["b_qweight"].shape[0] == 2 and shrunk["global_scale"].shape == (2,)
    assert shrunk["topk_weights"].dtype == torch.bfloat16 and shrunk["topk_weights"].numel() == 7
    assert int(shrunk["expert_ids"].max()) <= 1
    reference = OP.reference(shrunk)
    assert bool(reference.written.all()) and reference.output.shape == (7, 64)
    assert {(v.arg, v.aspect) for v in contract_violations(OP, shrunk, check_device=False)} == {
        ("topk_weights", "dtype")
    }


def test_the_original_shape_is_the_original_call_and_illegal_values_are_refused() -> None:
    args = marlin_call()
    full = {name: original for name, _, original in shape_dimensions(args)}
    same = shrink(args, full)
    assert all(same[name] is value for name, value in args.items())
    with pytest.raises(ReplayError, match="K=200"):
        shrink(args, {"K": 200})
    with pytest.raises(ReplayError, match="unknown"):
        shrink(args, {"M": 3})


# ---------------------------------------------------------------------------------------------------------------
# end to end: the published report's mechanism on the CPU stand-in, bisected by shape and by mutations
# ---------------------------------------------------------------------------------------------------------------


def record(path: Path, args: dict[str, Any]) -> Path:
    from moereplay.format import CaptureWriter

    output = marlin_emulator.moe_wna16_marlin_gemm(**{**args, "output": args["output"].clone()})
    with CaptureWriter(path) as writer:
        index = writer.begin_call(OP.name, args, site="tests:gemm2")
        writer.complete_call(index, {"output": output, "return": output})
    return path


def bisect(capture: Path, *options: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "moereplay", "bisect", str(capture), "--call", "0", "--no-tui", *options],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def published_like(tmp_path_factory: pytest.TempPathFactory) -> Path:
    args = marlin_call(tokens=8, routing_top_k=4, experts=6, k=384, n=192, weights_dtype=torch.bfloat16)
    return record(tmp_path_factory.mktemp("marlin") / "bf16-weights.moe.zst", args)


def test_replay_of_the_published_mechanism_on_the_stand_in(published_like: Path) -> None:
    from moereplay.replay import FindingKind, Verdict, replay

    report = replay(
        published_like,
        backend=marlin_emulator.SPEC,
        device="cpu",
        mutations=["flip mul_topk_weights", "cast topk_weights=float32"],
        isolate=False,
    )
    assert report.baseline.verdict is Verdict.CORRUPT
    # then the fills the bf16 weights' contract predicts reads past their end for (0xff: NaN where they are read);
    # the recording read whatever memory followed the weights in this process, so the fidelity check may add more
    assert [(v.label, v.verdict) for v in report.variants[:4]] == [
        ("flip mul_topk_weights", Verdict.OK),
        ("cast topk_weights=float32", Verdict.OK),
        ("fill 0xff", Verdict.NONFINITE),
        ("fill 0x00", Verdict.CORRUPT),
    ]
    diagnosis = next(
        f for f in report.findings if f.kind is FindingKind.DIAGNOSIS and f.variant == "baseline"
    )
    assert diagnosis.evidence["blame"] == "caller"


def test_shape_bisection_shrinks_the_failing_call(published_like: Path) -> None:
    status, log = bisect(published_like, "--strategy", "shape", "--backend", marlin_emulator.SPEC, "--fresh")
    print(log)
    assert status == 0, log
    minimal = next(line for line in log.splitlines() if line.startswith("minimal failing shape:"))
    shape = dict(item.split("=") for item in minimal.removeprefix("minimal failing shape:").split())
    assert int(shape["experts"]) == 1 and int(shape["K"]) == 128 and int(shape["N"]) == 64
    assert int(shape["rows"]) < 32


def test_mutation_bisection_finds_one_change_that_fixes_the_call(published_like: Path) -> None:
    status, log = bisect(
        published_like,
        "--strategy",
        "mutations",
        "--backend",
        marlin_emulator.SPEC,
        "--fresh",
        "--json",
        "-m",
        "flip use_atomic_add",
        "-m",
        "flip mul_topk_weights",
        "-m",
        "flip use_fp32_reduce",
        "-m",
        "cast topk_weights=float32",
    )
    assert status == 0, log
    summary = json.loads(log[log.index("{") :])["summary"]
    print(json.dumps(summary, indent=2))
    result = summary["result"]
    assert result["status"] == "minimised"
    assert result["minimal"] in (["flip mul_topk_weights"], ["cast topk_weights=float32"])
