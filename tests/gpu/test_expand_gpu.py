"""``moereplay expand`` on the H200 with vLLM 0.25.1's own ``fused_marlin_moe`` (kernel pack, ``$MOEREPLAY_PACK``).

A layer call at gpt-oss NVFP4 shapes (E = 32, top-4, hidden 2880, intermediate 2944 as vLLM pads it for Marlin,
activation SWIGLUOAI, M = 8) is captured in full (the parent and its two ``moe_wna16_marlin_gemm`` calls); a copy
keeps only the parent — what the layer-scope flight recorder writes — and expand re-runs it with the pack's
``fused_marlin_moe`` under a capture session. The re-run must be bit-exact with the recorded layer output, and each
regenerated kernel call's output must equal the originally captured kernel call's bytes. When the capture settings
know ``MOEREPLAY_FLIGHT_SCOPE``, a layer-scope flight record (every output triggers) is expanded the same way.

Run: ``source tools/gpu/device_setup.sh && python3 -m pytest -q tests/gpu/test_expand_gpu.py`` (first Marlin
launch on a fresh machine: ~90 s of JIT; then well under a minute).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from moereplay.capture import session as session_module
from moereplay.format import CaptureReader
from moereplay.replay.expand import ExpandVerdict, expand_capture
from moereplay.trim import trim_capture

MARLIN_MODULE = "vllm.model_executor.layers.fused_moe.experts.marlin_moe"
EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, TOKENS = 32, 4, 2880, 2944, 8
REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.filterwarnings("ignore::Warning:vllm.*"),
    pytest.mark.filterwarnings("ignore::Warning:triton.*"),
    pytest.mark.filterwarnings("ignore::Warning:torch.*"),
]


def _backend() -> str:
    pack = os.environ.get("MOEREPLAY_PACK")
    if pack:
        from moereplay.pack import load_pack

        load_pack(pack)  # vLLM's weight preparation runs in this process too
        return f"pack:{pack}"
    pytest.importorskip("vllm._custom_ops", reason="needs vLLM 0.25.1: set MOEREPLAY_PACK or install vLLM")
    return "vllm"


@pytest.fixture(scope="module")
def layer() -> dict[str, Any]:
    """NVFP4 experts and one batch, prepared by vLLM's own test helper; the backend spec."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper (sm_90+) GPU")
    backend = _backend()
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import rand_marlin_weight_nvfp4_like
    from vllm.scalar_type import scalar_types

    def experts(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qweights, scales, global_scales = [], [], []
        for _ in range(EXPERTS):
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 20
            _ref, qweight, scale, global_scale = rand_marlin_weight_nvfp4_like(weight, 16)
            qweights.append(qweight)
            scales.append(scale)
            global_scales.append(global_scale)
        return torch.stack(qweights), torch.stack(scales), torch.stack(global_scales).reshape(EXPERTS)

    torch.manual_seed(0)
    w1, s1, g1 = experts(2 * INTERMEDIATE, HIDDEN)
    w2, s2, g2 = experts(HIDDEN, INTERMEDIATE)
    scores = torch.randn(TOKENS, EXPERTS, device="cuda")
    weights, ids = torch.softmax(scores, dim=-1).topk(TOP_K, dim=-1)
    activation = importlib.import_module("vllm.model_executor.layers.fused_moe.activation")
    return {
        "backend": backend,
        "args": {
            "hidden_states": torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16),
            "w1": w1, "w2": w2, "bias1": None, "bias2": None, "w1_scale": s1, "w2_scale": s2,
            "topk_weights": weights.contiguous(), "topk_ids": ids.to(torch.int32).contiguous(),
            "quant_type_id": scalar_types.float4_e2m1f.id, "global_scale1": g1, "global_scale2": g2,
            "activation": activation.MoEActivation.SWIGLUOAI,
        },
    }  # fmt: skip


def _capture(directory: Path, layer: dict[str, Any], **settings: str) -> Path:
    marlin = importlib.import_module(MARLIN_MODULE)
    environment = {"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_DIR": str(directory), **settings}
    session = session_module.arm(environment)
    assert session is not None
    try:
        output = torch.empty_like(layer["args"]["hidden_states"])
        marlin.fused_marlin_moe(**layer["args"], output=output)
        torch.cuda.synchronize()
        assert session.flush(timeout=300)
        assert session.recorder.active, session.recorder.disabled_reason
    finally:
        session_module.disarm()
    return session.path


def test_a_layer_call_without_its_kernel_calls_is_expanded_bit_exactly(layer, tmp_path: Path) -> None:
    full = _capture(tmp_path / "full", layer)
    with CaptureReader(full) as reader:
        assert [(record.op, record.parent) for record in reader.calls()] == [
            ("fused_marlin_moe", None),
            ("moe_wna16_marlin_gemm", 0),
            ("moe_wna16_marlin_gemm", 0),
        ]
    layer_only = trim_capture(full, [0], tmp_path / "layer.moe.zst").path
    report = expand_capture(layer_only, tmp_path / "out.moe.zst", backend=layer["backend"], device="cuda")
    for line in report.notes + tuple(report.lines()):
        print(line)
    (call,) = report.calls
    assert call.verdict is ExpandVerdict.BIT_EXACT, call.line("out.moe.zst")
    assert call.kernel_calls == (1, 2)
    with CaptureReader(report.output) as out, CaptureReader(full) as original:
        for new, old in zip(call.kernel_calls, (1, 2), strict=True):
            regenerated, captured = out.load_outputs(new), original.load_outputs(old)
            assert out.call(new).op == "moe_wna16_marlin_gemm"
            same_output = torch.equal(
                regenerated["output"].view(torch.uint8), captured["output"].view(torch.uint8)
            )
            assert same_output, f"kernel call {new} differs from the captured kernel call {old}"
            args, recorded = out.load_args(new), original.load_args(old)
            for name in ("input", "topk_weights", "b_qweight", "b_scales", "global_scale"):
                same = torch.equal(args[name].view(torch.uint8), recorded[name].view(torch.uint8))
                print(f"  kernel call {new} argument {name}: {'same bytes' if same else 'DIFFERENT'}")

    # the full capture expands too, and its kernel calls are compared with the recorded ones
    again = expand_capture(full, tmp_path / "again.moe.zst", backend=layer["backend"], device="cuda")
    (call,) = again.calls
    print(call.line("again.moe.zst"))
    assert call.verdict is ExpandVerdict.BIT_EXACT
    assert [pair.bit_exact for pair in call.kernel_comparisons] == [True, True]


def test_the_bundled_layer_capture_expands(layer, tmp_path: Path) -> None:
    """``captures/marlin-nvfp4-layer.moe.zst`` (made with this pack): weights as recipes, kernel calls recorded."""
    report = expand_capture(
        REPO / "captures" / "marlin-nvfp4-layer.moe.zst", tmp_path / "out.moe.zst", backend=layer["backend"]
    )
    (call,) = report.calls
    print(call.line("out.moe.zst"))
    assert call.verdict is not ExpandVerdict.RAISED
    assert len(call.kernel_calls) == 2 and call.recorded_kernel_calls == (1, 2)


def test_a_layer_scope_flight_record_expands(layer, tmp_path: Path) -> None:
    from moereplay.capture.settings import KNOWN_VARIABLES

    if "FLIGHT_SCOPE" not in KNOWN_VARIABLES:
        pytest.skip("this moereplay has no MOEREPLAY_FLIGHT_SCOPE")
    path = _capture(
        tmp_path / "flight",
        layer,
        MOEREPLAY_TRIGGER="flight",
        MOEREPLAY_FLIGHT_SCOPE="layer",
        MOEREPLAY_ABSMAX="1e-30",  # every output triggers
    )
    with CaptureReader(path) as reader:
        records = list(reader.calls())
    assert [record.op for record in records] == ["fused_marlin_moe"], [record.op for record in records]
    assert records[0].context["flight"]["scope"] == "layer"
    report = expand_capture(path, tmp_path / "out.moe.zst", backend=layer["backend"], device="cuda")
    for line in report.notes + tuple(report.lines()):
        print(line)
    (call,) = report.calls
    assert call.verdict is ExpandVerdict.BIT_EXACT, call.line("out.moe.zst")
    assert call.kernel_calls == (1, 2)
