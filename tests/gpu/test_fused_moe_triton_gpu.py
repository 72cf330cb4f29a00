"""vLLM 0.25.1's Triton fused MoE kernels on a GPU against moereplay's reference (needs an H200/H100 with vLLM 0.25.1
installed or its kernel pack in ``MOEREPLAY_PACK``). The reference's speed against the kernel is measured by
``tools/bench/reference_bench.py`` (a bench prints ratios; tests assert no timings).

- each synth preset (bf16, int4/int8 weight-only with zero points, fp8 block-128 with an expert map) synthesized
  with the kernel backend, replayed baseline + BLOCK_SIZE_M / BLOCK_SIZE_N / num_warps variants: ``ok``;
- ``mul_routed_weight`` flipped: ``ok`` against the flipped call's reference, and every routed row differs from the
  baseline's (the kernel honours the flag);
- capture fidelity through vLLM's own ``fused_experts`` (bf16, and GPTQ int4 on the Triton wna16 path): every
  kernel call captured under its parent and replayed bit-exactly (``tools/gpu/fused_moe_proof.py`` covers every
  format).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # pragma: no cover - the gpu conftest marks these; no CUDA, nothing to run
    pytest.skip("needs CUDA", allow_module_level=True)


def _backend() -> str:
    pack = os.environ.get("MOEREPLAY_PACK")
    if pack:
        from moereplay.pack import load_pack

        load_pack(pack)
        return f"pack:{pack}"
    pytest.importorskip(
        "vllm.model_executor.layers.fused_moe.fused_moe", reason="needs vLLM 0.25.1 or MOEREPLAY_PACK"
    )
    return "vllm"


BACKEND = _backend()

from moereplay.replay import replay  # noqa: E402
from moereplay.synth import synthesize  # noqa: E402

PRESETS = {
    "qwen3-30b-a3b-bf16-w13": ["experts=32", "tokens=32"],
    "qwen3-30b-a3b-int4-w13": ["experts=32", "tokens=32", "zero_points=1"],
    "deepseek-v3-fp8-w13": ["tokens=16", "experts=8", "global_experts=64"],
}


@pytest.mark.gpu
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_kernel_matches_reference_under_launch_mutations(tmp_path: Path, preset: str) -> None:
    path = tmp_path / f"{preset}.moe.zst"
    synthesize(preset, path, overrides=PRESETS[preset], store="bytes", backend=BACKEND)
    report = replay(
        path,
        call=0,
        backend=BACKEND,
        mutations=["set BLOCK_SIZE_M=64", "set BLOCK_SIZE_N=128", "set num_warps=8"],
    )
    verdicts = {result.label: result.verdict.value for result in (report.baseline, *report.variants)}
    assert set(verdicts.values()) == {"ok"}, verdicts


@pytest.mark.gpu
def test_flipped_routed_weight_is_honoured(tmp_path: Path) -> None:
    """Each variant is judged against the reference of its own (mutated) call, so ``flip mul_routed_weight`` is
    ``ok`` when the kernel honours the flag; what shows the flag mattered is the output: every routed row differs
    from the baseline's."""
    path = tmp_path / "bf16.moe.zst"
    synthesize("qwen3-30b-a3b-bf16-w13", path, overrides=["experts=32"], store="bytes", backend=BACKEND)
    report = replay(path, call=0, backend=BACKEND, mutations=["flip mul_routed_weight"], keep_tensors=True)
    [flipped] = [r for r in report.variants if r.label == "flip mul_routed_weight"]
    assert report.baseline.verdict.value == "ok" and flipped.verdict.value == "ok", report.to_json()
    base, flip = report.tensors["baseline"], report.tensors[flipped.label]
    written = base.written & flip.written
    assert bool(written.any())
    differs = (flip.output[written].float() != base.output[written].float()).any(dim=1)
    assert bool(differs.all()), f"{int((~differs).sum())} routed rows unchanged by the flag"


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("name", "tokens"),
    [("bf16", 16), ("int4-w4a16", 64)],  # int4: 64 · 8 / 8 experts > 6, so vLLM takes the Triton wna16 kernel
)
def test_capture_through_vllm_fused_experts_replays_bit_exactly(
    tmp_path: Path, name: str, tokens: int
) -> None:
    """vLLM's own ``fused_experts`` with the capture armed through vLLM's plugin loader: both kernel launches are
    recorded under their ``fused_experts`` parent and each replays bit-exactly, ``ok`` against the reference."""
    pytest.importorskip("vllm.plugins", reason="needs vLLM 0.25.1 (installed or from MOEREPLAY_PACK)")
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "gpu"))
    try:
        import triton_moe_inputs as inputs
    finally:
        sys.path.pop(0)
    from moereplay.format import CaptureReader

    fmt = inputs.FORMATS[name]
    shape = inputs.Shape(experts=8, hidden=512, intermediate=256, top_k=8)
    g = torch.Generator(device="cuda").manual_seed(18)
    layer = fmt.build(shape, g)
    with inputs.armed_capture(tmp_path) as session:
        out = inputs.run_fused_experts(layer, shape, tokens, g)
        path = session.path
    assert bool(out.isfinite().all())
    with CaptureReader(path) as reader:
        calls = list(reader.calls())
    [parent] = [record for record in calls if record.op == "fused_experts"]
    children = [record for record in calls if record.parent == parent.index]
    assert [record.op for record in children] == [fmt.kernel, fmt.kernel], [r.op for r in calls]
    for record in children:
        report = replay(path, call=record.index, backend=BACKEND)
        assert report.baseline.bit_exact is True, report.to_json()
        assert report.baseline.verdict.value == "ok" and report.recorded is not None
        assert report.recorded.verdict.value == "ok", report.to_json()
