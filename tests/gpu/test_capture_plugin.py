"""On the H200 with vLLM 0.25.1 (kernel pack on PYTHONPATH): arm through vLLM's own plugin loader, run vLLM's
real ``fused_marlin_moe`` (NVFP4 at gpt-oss shapes, and int4), and replay every captured kernel call with the
same kernel: the outputs must match the captured ones bit for bit. Prints the replay fidelity."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

ENTRY_POINTS = "[vllm.general_plugins]\nmoereplay = moereplay.capture.plugin:register\n"


@pytest.fixture
def loaded_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """vLLM's loader finds the entry point through a temporary dist-info (the pack has none for moereplay)."""
    dist = tmp_path / "site" / "moereplay_capture_probe-0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: moereplay-capture-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("MOEREPLAY_CAPTURE", "1")
    monkeypatch.setenv("MOEREPLAY_DIR", str(tmp_path / "captures"))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    import vllm.plugins as plugins

    from moereplay.capture import session as session_module

    monkeypatch.setattr(plugins, "plugins_loaded", False)
    importlib.import_module("vllm.model_executor.layers.fused_moe.experts.marlin_moe")
    plugins.load_general_plugins()
    session = session_module.current()
    assert session is not None, "vLLM's loader did not arm the moereplay plugin"
    assert "vllm._custom_ops:moe_wna16_marlin_gemm" in session.patcher.sites
    yield session
    session_module.disarm()


def _topk(m: int, experts: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.randn(m, experts, device="cuda", dtype=torch.float32)
    weights, ids = torch.softmax(scores, dim=-1).topk(topk, dim=-1)
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def _nvfp4_experts(experts: int, n: int, k: int):
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import rand_marlin_weight_nvfp4_like

    qweights, scales, global_scales = [], [], []
    for _ in range(experts):
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 20
        _ref, qweight, scale, global_scale = rand_marlin_weight_nvfp4_like(weight, 16)
        qweights.append(qweight)
        scales.append(scale)
        global_scales.append(global_scale)
    return torch.stack(qweights), torch.stack(scales), torch.stack(global_scales).reshape(experts)


def _int4_experts(experts: int, n: int, k: int, group: int):
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import marlin_quantize
    from vllm.scalar_type import scalar_types

    qweights, scales = [], []
    for _ in range(experts):
        weight = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / 20
        _ref, qweight, scale, _g, _s, _p = marlin_quantize(weight, scalar_types.uint4b8, group, False)
        qweights.append(qweight)
        scales.append(scale)
    return torch.stack(qweights), torch.stack(scales)


def _replay_fidelity(path: Path) -> tuple[int, int, list[str]]:
    """Replay each captured moe_wna16_marlin_gemm with torch.ops._moe_C; count bit-exact outputs."""
    from moereplay.format import CaptureReader
    from moereplay.format.schema import CodecValue

    exact = total = 0
    problems: list[str] = []
    with CaptureReader(path) as reader:
        records = list(reader.calls())
        parents = {r.index for r in records if r.op == "fused_marlin_moe"}
        for record in records:
            if record.op != "moe_wna16_marlin_gemm":
                continue
            total += 1
            assert record.status == "completed", record
            assert record.parent in parents, f"call {record.index} has no fused_marlin_moe parent"
            args = reader.load_args(record.index, device="cuda")
            expected = reader.load_outputs(record.index, device="cuda")["output"]
            values = []
            for value in args.values():
                if isinstance(value, CodecValue):  # vLLM ScalarType, recorded with its id
                    tree = value.value
                    value = tree["id"] if isinstance(tree, dict) and "id" in tree else tree
                values.append(value)
            result = torch.ops._moe_C.moe_wna16_marlin_gemm(*values)
            torch.cuda.synchronize()
            if torch.equal(result.view(torch.uint8), expected.view(torch.uint8)):
                exact += 1
            else:
                diff = (result.float() - expected.float()).abs().max().item()
                problems.append(f"call {record.index} (layer {record.layer}): max |diff| {diff:g}")
    return exact, total, problems


def test_marlin_capture_replays_bit_exactly(loaded_plugin) -> None:
    marlin = sys.modules["vllm.model_executor.layers.fused_moe.experts.marlin_moe"]
    from vllm.scalar_type import scalar_types

    torch.manual_seed(0)
    experts, topk, hidden, inner = 32, 4, 2880, 2880
    w1, s1, g1 = _nvfp4_experts(experts, 2 * inner, hidden)
    w2, s2, g2 = _nvfp4_experts(experts, hidden, inner)
    for m in (1, 8, 64):
        x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = _topk(m, experts, topk)
        marlin.fused_marlin_moe(
            x, w1, w2, None, None, s1, s2, weights, ids, scalar_types.float4_e2m1f.id,
            global_scale1=g1, global_scale2=g2,
        )  # fmt: skip
    # int4 (GPTQ uint4b8, group 128)
    e4, k4, n4 = 8, 1024, 512
    q1, t1 = _int4_experts(e4, 2 * n4, k4, 128)
    q2, t2 = _int4_experts(e4, k4, n4, 128)
    for m in (4, 33):
        x = torch.randn(m, k4, device="cuda", dtype=torch.bfloat16)
        weights, ids = _topk(m, e4, 2)
        marlin.fused_marlin_moe(x, w1=q1, w2=q2, bias1=None, bias2=None, w1_scale=t1, w2_scale=t2,
                                topk_weights=weights, topk_ids=ids, quant_type_id=scalar_types.uint4b8.id)  # fmt: skip
    torch.cuda.synchronize()
    session = loaded_plugin
    assert session.flush(timeout=120)
    session.close()
    exact, total, problems = _replay_fidelity(session.path)
    print(
        f"\nmoereplay capture fidelity: {exact}/{total} kernel calls bit-exact ({100.0 * exact / max(total, 1):.1f}%)"
    )
    for line in problems:
        print("  not bit-exact:", line)
    assert total == 2 * 5
    assert exact == total, problems


def test_entry_point_metadata_of_the_installed_package() -> None:
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    assert 'moereplay = "moereplay.capture.plugin:register"' in pyproject.read_text()
    assert os.environ.get("VLLM_PLUGINS") in (None, "") or "moereplay" in os.environ["VLLM_PLUGINS"]
