"""Capture proof on the H200 with vLLM 0.25.1 (kernel pack on PYTHONPATH, ``tools/gpu/device_setup.sh``).

The plugin is armed through vLLM's own plugin loader (``vllm.plugins.load_general_plugins`` finding the
``vllm.general_plugins`` entry point), then vLLM's real MoE code runs exactly as its model layers call it:

- Marlin: ``fused_marlin_moe`` at gpt-oss NVFP4 shapes (E = 32, top-4, hidden = 2880, intermediate 2880 padded to
  2944 as vLLM pads it for Marlin — the kernel has no tile for N = K = 2880; M = 1, 8, 64)
  and GPTQ int4 (uint4b8, group 128; M = 4, 33) — two ``moe_wna16_marlin_gemm`` calls per layer;
- gpt-oss Triton: ``triton_kernel_fused_experts`` with MXFP4 weights prepared by vLLM's ``_swizzle_mxfp4`` (Hopper
  value/scale layouts, num_warps 8; it pins the opt_flags constraint ``split_k=1``), biases and a
  ``mxfp4_w4a16_moe_quant_config``, routing by vLLM's ``make_routing_data`` (M = 1, 64) — two ``matmul_ogs`` calls
  per layer (w13 with gather and fused SwiGLU, w2 with scatter and the routing weights as gammas).

Every kernel call must be in the capture with its parent (``fused_marlin_moe`` / ``triton_kernel_fused_experts``).
After disarming, each captured kernel call is replayed with the same kernel through its OpSpec
(``MarlinMoeOp.run`` / ``MatmulOgsOp.run``: the recorded arguments as loaded, the matmul_ogs process state — the
recorded opt_flags constraints — set for the call and restored after), into the recorded output buffer as it was
before the call. Printed: the replay fidelity (bit-exact calls / calls) and, for a call that is not bit-exact, how
many elements differ, by how much, in which rows — and for matmul_ogs whether the flags triton_kernels chose at
replay equal the flags recorded at capture (different tiles or split-K would explain a different rounding).

Cost on a fresh H200: the first Marlin launch JIT-compiles its PTX (~90 s, then cached in ~/.nv/ComputeCache);
the Triton kernels compile once per block_m (~10 s each, cached in ~/.triton).
"""

from __future__ import annotations

import importlib
import os
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from ogs_inputs import gpt_oss_mxfp4_layer

vllm = pytest.importorskip("vllm")

pytestmark = [
    pytest.mark.filterwarnings("ignore::Warning:vllm.*"),
    pytest.mark.filterwarnings("ignore::Warning:triton.*"),
    pytest.mark.filterwarnings("ignore::Warning:torch.*"),
    pytest.mark.filterwarnings("ignore::Warning:triton_kernels.*"),
]

ENTRY_POINTS = "[vllm.general_plugins]\nmoereplay = moereplay.capture.plugin:register\n"
MARLIN_MODULE = "vllm.model_executor.layers.fused_moe.experts.marlin_moe"
GPT_OSS_MODULE = "vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe"
EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 32, 4, 2880, 2880
# vLLM rounds the intermediate size up to a multiple of 128 for its Marlin MoE backends (an unpadded 2880 × 2880
# gemm2 has no legal thread tile: the kernel raises "Invalid thread config"); the triton path keeps 2880.
INTERMEDIATE_MARLIN = 2944


@dataclass(frozen=True)
class Backend:
    """The running vLLM (from the pack on PYTHONPATH) as a ``KernelBackend``."""

    name: str
    device: torch.device

    def module(self, name: str) -> types.ModuleType:
        return importlib.import_module(name)


@pytest.fixture
def loaded_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """vLLM's loader finds the entry point through a temporary dist-info (the pack has none for moereplay)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper (sm_90+) GPU")
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
    importlib.import_module(MARLIN_MODULE)
    importlib.import_module(GPT_OSS_MODULE)
    plugins.load_general_plugins()
    session = session_module.current()
    assert session is not None, "vLLM's loader did not arm the moereplay plugin"
    for site in (
        "vllm._custom_ops:moe_wna16_marlin_gemm",
        f"{MARLIN_MODULE}:fused_marlin_moe",
        f"{GPT_OSS_MODULE}:matmul_ogs",
        f"{GPT_OSS_MODULE}:triton_kernel_fused_experts",
    ):
        assert site in session.patcher.sites, (site, session.patcher.sites)
    yield session
    session_module.disarm()


def _finish(session: Any) -> Path:
    """Drain the writer, close the file, restore vLLM (the replays below must not be recorded)."""
    from moereplay.capture import session as session_module

    torch.cuda.synchronize()
    assert session.flush(timeout=300)
    assert session.recorder.active, session.recorder.disabled_reason
    session_module.disarm()
    counters = session.writer.counters
    assert counters.dropped_queue_full == counters.outputs_dropped == counters.write_errors == 0, counters
    return session.path


def _topk(m: int, experts: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.randn(m, experts, device="cuda", dtype=torch.float32)
    weights, ids = torch.softmax(scores, dim=-1).topk(topk, dim=-1)
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def _difference(result: torch.Tensor, expected: torch.Tensor) -> str:
    """Where and how much two outputs differ (rows = first dimension after flattening leading ones)."""
    if result.shape != expected.shape:
        return f"shape {tuple(result.shape)} vs captured {tuple(expected.shape)}"
    a = result.reshape(-1, result.shape[-1]).float()
    b = expected.reshape(-1, expected.shape[-1]).float()
    differs = (a != b) & ~(a.isnan() & b.isnan())
    rows = differs.any(dim=1).nonzero().flatten().tolist()
    scale = b.abs().max().clamp_min(1e-30)
    worst = (a - b).abs().nan_to_num(float("inf")).max()
    shown = ",".join(map(str, rows[:12])) + (" …" if len(rows) > 12 else "")
    return (
        f"{int(differs.sum())} of {differs.numel()} elements differ in {len(rows)} rows [{shown}], "
        f"max |diff| {float(worst):.3g} ({float(worst / scale):.2e} of max |captured|)"
    )


def _report(kind: str, exact: int, total: int, problems: list[str]) -> None:
    print(
        f"\nmoereplay capture fidelity ({kind}): {exact}/{total} kernel calls bit-exact "
        f"({100.0 * exact / max(total, 1):.1f}%)"
    )
    for line in problems:
        print("  not bit-exact:", line)


def _replay_calls(path: Path, kernel_op: str, parent_op: str) -> tuple[int, int, list[str], list[Any]]:
    """Replay every captured ``kernel_op`` call with the same kernel through its OpSpec; count bit-exact ones."""
    from moereplay.format import CaptureReader
    from moereplay.replay.source import load_call

    backend = Backend("vllm", torch.device("cuda"))
    exact = total = 0
    problems: list[str] = []
    records = []
    with CaptureReader(path) as reader:
        calls = list(reader.calls())
    parents = {record.index for record in calls if record.op == parent_op}
    assert parents, f"no {parent_op} call was captured"
    for record in calls:
        if record.op != kernel_op:
            continue
        total += 1
        records.append(record)
        assert record.status == "completed", record
        assert record.parent in parents, f"call {record.index} has no {parent_op} parent"
        loaded = load_call(path, record.index, device="cuda")
        assert loaded.captured_output is not None
        args = dict(loaded.args)
        buffer = args[loaded.op.output_name]  # the output buffer as it was before the call
        result = loaded.op.run(args, backend)
        torch.cuda.synchronize()
        captured = loaded.captured_output
        replayed = buffer if captured.shape == buffer.shape else result.reshape(captured.shape)
        note = ""
        if kernel_op == "matmul_ogs":
            note = _flags_note(record, loaded.op)
        if _same_bits(replayed, captured):
            exact += 1
            if note:
                problems.append(f"call {record.index}: bit-exact, but {note}")
        else:
            problems.append(
                f"call {record.index} (parent {record.parent}, rows {tuple(captured.shape)}): "
                f"{_difference(replayed, captured)}{'; ' + note if note else ''}"
            )
    return exact, total, problems, records


def _flags_note(record: Any, op: Any) -> str:
    """'' when the flags chosen at replay equal the recorded ones, else what differs."""
    recorded = record.outputs.get("opt_flags")
    chosen = op.last_flags
    if recorded is None or chosen is None:
        return f"flags not comparable (recorded {recorded is not None}, replayed {chosen is not None})"
    differ = [
        f"{name} {recorded.get(name)}→{getattr(chosen, name)}"
        for name in ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages", "is_persistent")
        if recorded.get(name) != getattr(chosen, name)
    ]
    return f"replay chose other opt_flags: {', '.join(differ)}" if differ else ""


# ---------------------------------------------------------------------------------------------------------------
# Marlin
# ---------------------------------------------------------------------------------------------------------------


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


def test_marlin_capture_replays_bit_exactly(loaded_plugin) -> None:
    marlin = importlib.import_module(MARLIN_MODULE)
    from vllm.scalar_type import scalar_types

    torch.manual_seed(0)
    w1, s1, g1 = _nvfp4_experts(EXPERTS, 2 * INTERMEDIATE_MARLIN, HIDDEN)
    w2, s2, g2 = _nvfp4_experts(EXPERTS, HIDDEN, INTERMEDIATE_MARLIN)
    for m in (1, 8, 64):
        x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        weights, ids = _topk(m, EXPERTS, TOP_K)
        marlin.fused_marlin_moe(
            x, w1, w2, None, None, s1, s2, weights, ids, scalar_types.float4_e2m1f.id,
            global_scale1=g1, global_scale2=g2,
        )  # fmt: skip
    e4, k4, n4 = 8, 1024, 512  # int4 (GPTQ uint4b8, group 128)
    q1, t1 = _int4_experts(e4, 2 * n4, k4, 128)
    q2, t2 = _int4_experts(e4, k4, n4, 128)
    for m in (4, 33):
        x = torch.randn(m, k4, device="cuda", dtype=torch.bfloat16)
        weights, ids = _topk(m, e4, 2)
        marlin.fused_marlin_moe(x, w1=q1, w2=q2, bias1=None, bias2=None, w1_scale=t1, w2_scale=t2,
                                topk_weights=weights, topk_ids=ids, quant_type_id=scalar_types.uint4b8.id)  # fmt: skip
    path = _finish(loaded_plugin)
    exact, total, problems, records = _replay_calls(path, "moe_wna16_marlin_gemm", "fused_marlin_moe")
    _report("Marlin moe_wna16_marlin_gemm", exact, total, problems)
    assert total == 2 * 5
    assert {type(r.args["b_q_type"]).__name__ for r in records} == {"CodecValue"}  # id + name, as recorded
    assert exact == total, problems


# ---------------------------------------------------------------------------------------------------------------
# gpt-oss Triton (matmul_ogs, MXFP4)
# ---------------------------------------------------------------------------------------------------------------


def test_gpt_oss_triton_capture_replays_with_its_process_state(loaded_plugin) -> None:
    from moereplay.format import CaptureReader, CodecValue, Unsupported

    moe = importlib.import_module(GPT_OSS_MODULE)
    activation = importlib.import_module("vllm.model_executor.layers.fused_moe.activation")

    g = torch.Generator(device="cuda").manual_seed(2880)
    layer = gpt_oss_mxfp4_layer(importlib.import_module, EXPERTS, HIDDEN, INTERMEDIATE, g)
    w13, w2, quant_config = layer.w13, layer.w2, layer.quant_config
    expected_layers = 0
    for tokens in (1, 64):
        hidden = (torch.randn(tokens, HIDDEN, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
        logits = torch.randn(tokens, EXPERTS, device="cuda", generator=g)
        topk_weights, topk_ids = torch.topk(torch.softmax(logits, dim=-1), TOP_K, dim=-1)
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        routing_data, gather, scatter = moe.make_routing_data(topk_ids, topk_weights, EXPERTS)
        output = torch.empty_like(hidden)
        moe.triton_kernel_fused_experts(
            output, hidden, w13, w2, routing_data, gather, scatter, topk=TOP_K,
            activation=activation.MoEActivation.SWIGLUOAI, quant_config=quant_config,
        )  # fmt: skip
        expected_layers += 1
    path = _finish(loaded_plugin)

    with CaptureReader(path) as reader:
        parents = list(reader.select(op="triton_kernel_fused_experts"))
        assert len(parents) == expected_layers
        for parent in parents:
            for name in ("w1", "w2", "routing_data", "quant_config"):
                assert isinstance(parent.args[name], CodecValue), (name, parent.args[name])
            assert not isinstance(parent.args["activation"], Unsupported)
            assert "output_tensor" in parent.output_tensors
    exact, total, problems, records = _replay_calls(path, "matmul_ogs", "triton_kernel_fused_experts")
    _report("gpt-oss matmul_ogs", exact, total, problems)
    for record in records:
        print(
            f"  call {record.index}: recorded constraints split_k={record.args['split_k']} "
            f"block_m={record.args['block_m']}; chosen {record.outputs.get('opt_flags')}"
        )
    assert total == 2 * expected_layers
    for record in records:
        assert record.args["split_k"] == 1  # vLLM's Hopper constraint, recorded as process state
        assert record.outputs.get("opt_flags") is not None
        for name in ("w", "precision_config", "routing_data"):
            assert isinstance(record.args[name], CodecValue), (name, record.args[name])
    assert exact == total, problems


def test_entry_point_metadata_of_the_installed_package() -> None:
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    assert 'moereplay = "moereplay.capture.plugin:register"' in pyproject.read_text()
    assert os.environ.get("VLLM_PLUGINS") in (None, "") or "moereplay" in os.environ["VLLM_PLUGINS"]
