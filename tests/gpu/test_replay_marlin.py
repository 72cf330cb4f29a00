"""Replay of vLLM 0.25.1's Marlin MoE GEMM on the GPU: the published bug report's case, and a correct call swept.

Run on the H200 with a kernel pack (or an installed vLLM 0.25.1)::

    MOEREPLAY_PACK=/path/to/pack python -m pytest tests/gpu/test_replay_marlin.py -q -rA -s

1. The published report's case, built as the report built it: random NVFP4 weights (E=32, N=2880, K=2880 padded
   to 2944 with zero codes and scales, group 16, per-expert global scale), prepared by vLLM's own functions
   (``marlin_inputs.vllm_prepare``); 32 tokens × top-4 rows pre-expanded (gemm2: ``top_k=1``, ``size_m=128``),
   ``moe_block_size=16``, routing weights from a softmax top-k cast to the activation dtype (bf16),
   ``mul_topk_weights=True``. The call runs once on the kernel and is recorded with ``CaptureWriter``; then
   ``replay`` runs it as captured, with ``--flip mul_topk_weights``, with a 0xff guard fill, and with whatever the
   findings suggest. The table and findings are printed. The assertions check that the evidence is consistent —
   whichever way it points — not which cause it names.
2. A correct call (float32 routing weights) swept over block sizes, tiles and reduction flags: every variant ok.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # pragma: no cover - the gpu conftest skips these anyway
    pytest.skip("needs CUDA", allow_module_level=True)

DEVICE = torch.device("cuda")
E, N, K_RAW, K = 32, 2880, 2880, 2944
TOKENS, TOP_K, BLOCK = 32, 4, 16


def _backend() -> str:
    pack = os.environ.get("MOEREPLAY_PACK")
    if pack:
        from moereplay.pack import load_pack

        load_pack(pack)  # vLLM's preparation functions (marlin_inputs) run in this process too
        return f"pack:{pack}"
    pytest.importorskip("vllm._custom_ops", reason="needs vLLM 0.25.1: set MOEREPLAY_PACK or install vLLM")
    return "vllm"


BACKEND = _backend()

from marlin_inputs import vllm_prepare  # noqa: E402

from moereplay.format import CaptureWriter  # noqa: E402
from moereplay.reference.marlin_formats import LogicalExperts, MarlinWeightFormat  # noqa: E402
from moereplay.replay import FindingKind, ReplayReport, Verdict, replay  # noqa: E402


def show(report: ReplayReport, capsys: pytest.CaptureFixture[str]) -> None:
    from moereplay.cli.run_cmd import render_reports

    with capsys.disabled():
        print()
        render_reports([report])


def nvfp4_weights(experts: int, size_k: int, size_n: int, k_used: int, seed: int) -> Any:
    """Random NVFP4 experts as the report made them (codes and scales zero on the K padding), through vLLM."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (experts, size_k, size_n), generator=generator, dtype=torch.uint8)
    codes[:, k_used:, :] = 0
    scales = torch.rand(experts, size_k // 16, size_n, generator=generator) * 3 + 0.5
    scales[:, k_used // 16 :, :] = 0
    global_scale = torch.rand(experts, generator=generator) * 0.002 + 1e-4
    logical = LogicalExperts(MarlinWeightFormat.NVFP4, codes, scales, global_scale, None, None, None)
    return vllm_prepare(logical.to(DEVICE), torch.bfloat16)


def gemm2_args(
    weights: Any,
    *,
    experts: int,
    size_k: int,
    size_n: int,
    k_used: int,
    weights_dtype: torch.dtype,
    seed: int,
) -> dict[str, Any]:
    """The gemm2 call ``fused_marlin_moe`` makes (rows pre-expanded, ``top_k=1``), routing aligned by vLLM."""
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_make_workspace_new
    from vllm.scalar_type import scalar_types

    generator = torch.Generator().manual_seed(seed)
    router = torch.randn(TOKENS, experts, generator=generator).to(DEVICE)
    topk_weights, topk_ids = torch.topk(torch.softmax(router, -1), TOP_K, dim=-1)
    sorted_ids, expert_ids, padded = moe_align_block_size(topk_ids.to(torch.int32), BLOCK, experts)
    rows = TOKENS * TOP_K
    activations = (torch.randn(rows, size_k, generator=generator) * 0.5).to(DEVICE, torch.bfloat16)
    activations[:, k_used:] = 0
    return {
        "input": activations,
        "output": torch.zeros(rows, size_n, dtype=torch.bfloat16, device=DEVICE),
        "b_qweight": weights.b_qweight,
        "b_bias": None,
        "b_scales": weights.b_scales,
        "a_scales": None,
        "global_scale": weights.global_scale,
        "b_qzeros": None,
        "g_idx": None,
        "perm": None,
        "workspace": marlin_make_workspace_new(DEVICE, 4),
        "sorted_token_ids": sorted_ids,
        "expert_ids": expert_ids,
        "num_tokens_past_padded": padded,
        "topk_weights": topk_weights.to(weights_dtype),
        "moe_block_size": BLOCK,
        "top_k": 1,
        "mul_topk_weights": True,
        "b_q_type": scalar_types.float4_e2m1f.id,
        "size_m": rows,
        "size_n": size_n,
        "size_k": size_k,
        "is_k_full": True,
        "use_atomic_add": False,
        "use_fp32_reduce": True,
        "is_zp_float": False,
        "thread_k": -1,
        "thread_n": -1,
        "blocks_per_sm": -1,
    }


def record(path: Path, args: dict[str, Any]) -> Path:
    """Run the call once on the kernel and record it as the capture plugin would: inputs, run, outputs."""
    import vllm._custom_ops as ops
    from vllm.scalar_type import ScalarType

    with CaptureWriter(path, header={"purpose": "tests/gpu/test_replay_marlin.py"}) as writer:
        index = writer.begin_call(
            "moe_wna16_marlin_gemm",
            args,
            site="tests/gpu:gemm2",
            static=("b_qweight", "b_scales", "global_scale"),
        )
        kwargs = dict(args, b_q_type=ScalarType.from_id(args["b_q_type"]))
        output = ops.moe_wna16_marlin_gemm(**kwargs)
        torch.cuda.synchronize()
        writer.complete_call(index, {"output": args["output"], "return": output})
    return path


def result(report: ReplayReport, label: str):  # type: ignore[no-untyped-def]
    return next(item for item in report.results if item.label == label)


@pytest.fixture(scope="module")
def published_case(tmp_path_factory: pytest.TempPathFactory) -> Path:
    weights = nvfp4_weights(E, K, N, K_RAW, seed=0)
    args = gemm2_args(
        weights, experts=E, size_k=K, size_n=N, k_used=K_RAW, weights_dtype=torch.bfloat16, seed=1
    )
    return record(tmp_path_factory.mktemp("marlin") / "published.moe.zst", args)


def test_published_report_case(published_case: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = replay(
        published_case,
        call=0,
        backend=BACKEND,
        mutations=["flip mul_topk_weights"],
        fills=["0xff"],
        follow_suggestions=True,
    )
    show(report, capsys)

    # the published symptom: the call as captured is wrong; with the flag off the kernel's product is right
    assert report.baseline.verdict is not Verdict.OK
    assert result(report, "flip mul_topk_weights").verdict is Verdict.OK

    # the findings explain the failure, with a stated blame
    diagnoses = [f for f in report.findings if f.kind is FindingKind.DIAGNOSIS and f.variant == "baseline"]
    assert diagnoses, "no diagnosis for a failing call"
    diagnosis = diagnoses[0]
    blame = diagnosis.evidence["blame"]
    assert blame in ("caller", "kernel", "undecided")
    with capsys.disabled():
        print(f"\ndiagnosis ({blame}, confidence {diagnosis.confidence:.2f}): {diagnosis.message}")

    if blame == "caller":
        # the argument the diagnosis blames breaks a contract, and the suggested fix was run and is ok
        argument = diagnosis.evidence["argument"]
        assert any(
            f.kind is FindingKind.CONTRACT_VIOLATION and f.evidence["argument"] == argument
            for f in report.findings
        )
        assert diagnosis.suggestions
        for suggestion in diagnosis.suggestions:
            assert result(report, suggestion).verdict is Verdict.OK, (
                f"suggested {suggestion} does not fix the call"
            )
        summary = [f for f in report.findings if f.variant == "all" and f.kind is FindingKind.DIAGNOSIS]
        assert summary and summary[0].evidence.get("confirmed")
    elif blame == "kernel":
        # no change of the arguments' types fixes a kernel fault
        assert all(r.verdict is not Verdict.OK for r in report.variants if r.label.startswith("cast"))

    # if the decomposition says rows read past the end of an argument, the guard fills must name that argument
    past_end = [
        f for f in report.findings if f.kind is FindingKind.OOB_READ and "argument_bytes" in f.evidence
    ]
    fill_reads = [f for f in report.findings if f.kind is FindingKind.OOB_READ and "fills" in f.evidence]
    for finding in past_end:
        named = {item["argument"] for read in fill_reads for item in read.evidence.get("arguments", [])}
        assert finding.evidence["argument"] in named, (
            "decomposition and guard fills disagree on what is over-read"
        )


def test_correct_call_sweeps_block_sizes_tiles_and_reductions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """gpt-oss shape (N=2880: only the (thread_k=128, thread_n=64) tile divides N) with float32 routing weights,
    plus a smaller shape where every instantiated tile is legal at every block size."""
    weights = nvfp4_weights(E, K, N, K_RAW, seed=2)
    args = gemm2_args(
        weights, experts=E, size_k=K, size_n=N, k_used=K_RAW, weights_dtype=torch.float32, seed=3
    )
    path = record(tmp_path / "correct.moe.zst", args)
    blocks = "8,16,32,48,64"
    report = replay(
        path,
        call=0,
        backend=BACKEND,
        mutations=[
            f"sweep moe_block_size={blocks}",
            f"sweep moe_block_size={blocks}+thread_k=128,128,128,128,128+thread_n=64,64,64,64,64",
            "set thread_k=128+thread_n=64+blocks_per_sm=1",
        ],
        repeat=2,
    )
    show(report, capsys)
    assert [r.label for r in report.results if r.verdict is not Verdict.OK] == []

    # reduction modes change rounding (bf16 partial sums), not meaning: they must run and stay close
    reductions = replay(
        path,
        call=0,
        backend=BACKEND,
        mutations=[
            "flip use_atomic_add",
            "flip use_fp32_reduce",
            "set use_atomic_add=true+use_fp32_reduce=false",
        ],
        repeat=2,
    )
    show(reductions, capsys)
    for item in reductions.variants:
        assert item.verdict in (Verdict.OK, Verdict.CORRUPT), (
            f"{item.label}: {item.verdict.value} {item.reason}"
        )
        assert item.max_rel < 0.1 and item.nan == 0 and item.inf == 0, item.label

    small = nvfp4_weights(8, 1024, 1024, 1024, seed=4)
    small_args = gemm2_args(
        small, experts=8, size_k=1024, size_n=1024, k_used=1024, weights_dtype=torch.float32, seed=5
    )
    small_path = record(tmp_path / "small.moe.zst", small_args)
    triples = [(b, k, n) for b in (8, 16) for k, n in ((128, 128), (64, 128), (128, 64))]
    triples += [(b, k, n) for b in (32, 48, 64) for k, n in ((64, 256), (64, 128), (128, 64))]
    sweep = "sweep " + "+".join(
        f"{name}={','.join(str(t[i]) for t in triples)}"
        for i, name in enumerate(("moe_block_size", "thread_k", "thread_n"))
    )
    small_report = replay(small_path, call=0, backend=BACKEND, mutations=[sweep])
    show(small_report, capsys)
    assert len(small_report.variants) == len(triples)
    assert [r.label for r in small_report.results if r.verdict is not Verdict.OK] == []
