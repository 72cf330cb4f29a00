"""vLLM 0.25.1 Triton fused MoE layers built as vLLM's quantisation methods build them, run by vLLM's own
``fused_experts``, with moereplay's capture armed through vLLM's plugin loader.

Shared by ``tools/gpu/fused_moe_proof.py`` and ``tests/gpu/test_fused_moe_triton_gpu.py`` (import after putting
``tools/gpu`` on ``sys.path``). Needs CUDA and vLLM (installed, or a kernel pack on ``PYTHONPATH``); nothing here
runs at import. Facts used, from vLLM 0.25.1's sources:

- ``fused_moe.fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input,
  global_num_experts, expert_map, quant_config)`` → ``torch.ops.vllm.fused_experts`` → ``fused_experts_impl`` →
  ``dispatch_fused_moe_kernel`` (looks the launchers up as module globals) → ``invoke_fused_moe_triton_kernel`` or,
  for int4/int8 weight-only with ``block_shape = [0, group]``, ``invoke_fused_moe_wna16_triton_kernel`` — unless
  ``should_moe_wna16_use_cuda`` (4-bit, group 32/64/128, ``tokens · top_k / experts <= 6``) sends it to the CUDA
  ``moe_wna16_gemm``, which is not a patch point (:func:`wna16_uses_cuda`).
- weights ``w1 [E, 2N, K]`` (gate rows first), ``w2 [E, K, N]``; quant configs from ``fused_moe.config``:
  ``fp8_w8a8_moe_quant_config`` (per-tensor scales ``[E]`` and dynamic per-tensor activations; per-channel
  ``[E, n, 1]`` with per-token activations; 128×128 blocks ``[E, n/128, k/128]`` with per-token-group
  activations), ``int8_w8a16_moe_quant_config`` (per-row float32 scales ``[E, n]`` and int8 weights as
  ``quantization/online/int8.py`` makes them; or, with ``block_shape = [0, 128]``, ``moe_wna16.py``'s uint8 codes
  and ``[E, n, k/128]`` scales), ``int4_w4a16_moe_quant_config`` (``moe_wna16.py``: uint8 ``[E, n, k/2]``, low
  nibble first, scales ``[E, n, k/128]`` in the activation dtype, zero points ``[E, n/2, k/128]``);
- expert parallelism: ``global_num_experts`` and an int32 ``expert_map`` (global id → local id, ``-1`` elsewhere).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PACKAGE = "vllm.model_executor.layers.fused_moe"
FUSED_MOE = f"{PACKAGE}.fused_moe"
CONFIG = f"{PACKAGE}.config"
ACTIVATION = f"{PACKAGE}.activation"
GROUP = 128
FP8_MAX = 448.0
ENTRY_POINTS = "[vllm.general_plugins]\nmoereplay = moereplay.capture.plugin:register\n"


@dataclass(frozen=True)
class Shape:
    """A layer: ``experts`` local experts of ``hidden`` (K) → 2·``intermediate`` (w13) → ``hidden`` (w2)."""

    experts: int
    hidden: int
    intermediate: int
    top_k: int


@dataclass
class Layer:
    """What ``fused_experts`` takes besides the tokens and the routing."""

    w1: torch.Tensor
    w2: torch.Tensor
    quant_config: Any
    global_experts: int
    expert_map: torch.Tensor | None = None
    apply_router_weight_on_input: bool = False
    top_k: int | None = None  # None: the shape's


@dataclass(frozen=True)
class Format:
    """One weight format and how vLLM runs it. ``kernel``: the op the Triton path records."""

    name: str
    description: str
    kernel: str
    build: Callable[[Shape, torch.Generator], Layer]
    bits: int | None = None  # wna16: 4 or 8 (decides the CUDA / Triton choice)


def _config() -> Any:
    return importlib.import_module(CONFIG)


def _float_weights(experts: int, rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(experts, rows, cols, device="cuda", generator=g, dtype=torch.bfloat16) / math.sqrt(
        cols
    )


def _bf16(shape: Shape, g: torch.Generator) -> Layer:
    w1 = _float_weights(shape.experts, 2 * shape.intermediate, shape.hidden, g)
    w2 = _float_weights(shape.experts, shape.hidden, shape.intermediate, g)
    return Layer(w1, w2, None, shape.experts)


def _expert_parallel(shape: Shape, g: torch.Generator) -> Layer:
    """Rank 1 of 2-way expert parallelism: it holds global experts E … 2E-1 as local 0 … E-1."""
    layer = _bf16(shape, g)
    expert_map = torch.full((2 * shape.experts,), -1, dtype=torch.int32, device="cuda")
    expert_map[shape.experts :] = torch.arange(shape.experts, dtype=torch.int32, device="cuda")
    layer.global_experts, layer.expert_map = 2 * shape.experts, expert_map
    return layer


def _router_on_input(shape: Shape, g: torch.Generator) -> Layer:
    """Top-1 routing with the weight applied to the input (gemm1 multiplies, gemm2 does not)."""
    layer = _bf16(shape, g)
    layer.apply_router_weight_on_input, layer.top_k = True, 1
    return layer


def _fp8(weights: torch.Tensor, scale_shape: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 codes and float32 scales: ``tensor`` ``[E]``, ``channel`` ``[E, n, 1]``, ``block`` 128×128."""
    experts, rows, cols = weights.shape
    w = weights.float()
    if scale_shape == "block":  # rows and cols are multiples of 128
        w = w.view(experts, rows // GROUP, GROUP, cols // GROUP, GROUP)
        scale = (w.abs().amax(dim=(2, 4)) / FP8_MAX).clamp(min=1e-12)
        expanded = scale[:, :, None, :, None]
    elif scale_shape == "channel":
        scale = (w.abs().amax(dim=2, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        expanded = scale
    else:
        scale = (w.abs().amax(dim=(1, 2)) / FP8_MAX).clamp(min=1e-12)
        expanded = scale[:, None, None]
    codes = (w / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(experts, rows, cols)
    return codes.contiguous(), scale.float().contiguous()


def _fp8_layer(kind: str) -> Callable[[Shape, torch.Generator], Layer]:
    def build(shape: Shape, g: torch.Generator) -> Layer:
        base = _bf16(shape, g)
        (w1, s1), (w2, s2) = _fp8(base.w1, kind), _fp8(base.w2, kind)
        extra: dict[str, Any] = {}
        if kind == "channel":
            extra = {"per_act_token_quant": True, "per_out_ch_quant": True}
        elif kind == "block":
            extra = {"block_shape": [GROUP, GROUP]}
        quant = _config().fp8_w8a8_moe_quant_config(
            w1_scale=s1, w2_scale=s2, a1_scale=None, a2_scale=None, **extra
        )
        return Layer(w1, w2, quant, shape.experts)

    return build


def _int8_channel(shape: Shape, g: torch.Generator) -> Layer:
    """int8 weights with per-row float32 scales (``quantization/online/int8.py``), bf16 activations."""
    base = _bf16(shape, g)
    quantized = []
    for weights in (base.w1, base.w2):
        scale = (weights.float().abs().amax(dim=2) / 127.0).clamp(min=1e-12)
        quantized.append(
            ((weights.float() / scale[:, :, None]).round().clamp(-127, 127).to(torch.int8), scale)
        )
    (w1, s1), (w2, s2) = quantized
    quant = _config().int8_w8a16_moe_quant_config(w1_scale=s1, w2_scale=s2, w1_zp=None, w2_zp=None)
    return Layer(w1, w2, quant, shape.experts)


def _codes(experts: int, rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (experts, rows, cols), device="cuda", generator=g, dtype=torch.uint8)


def _group_scales(experts: int, rows: int, k: int, bits: int, g: torch.Generator) -> torch.Tensor:
    """Positive scales so that a dequantised weight is ~ 1/sqrt(k) in size."""
    levels = 8 if bits == 4 else 128
    spread = torch.rand(experts, rows, k // GROUP, device="cuda", generator=g) + 0.5
    return (spread / (levels * math.sqrt(k))).to(torch.bfloat16)


def _wna16(bits: int, zero_points: bool) -> Callable[[Shape, torch.Generator], Layer]:
    """``moe_wna16.py``'s layout: uint8 codes ``[E, n, k·bits/8]``, scales ``[E, n, k/128]``, zero points
    ``[E, n·bits/8, k/128]``; ``block_shape = [0, 128]``."""

    def build(shape: Shape, g: torch.Generator) -> Layer:
        pack = 8 // bits
        k1, n1, k2, n2 = shape.hidden, 2 * shape.intermediate, shape.intermediate, shape.hidden
        w1, w2 = _codes(shape.experts, n1, k1 // pack, g), _codes(shape.experts, n2, k2 // pack, g)
        s1, s2 = _group_scales(shape.experts, n1, k1, bits, g), _group_scales(shape.experts, n2, k2, bits, g)
        z1 = _codes(shape.experts, n1 // pack, k1 // GROUP, g) if zero_points else None
        z2 = _codes(shape.experts, n2 // pack, k2 // GROUP, g) if zero_points else None
        helper = _config().int4_w4a16_moe_quant_config if bits == 4 else _config().int8_w8a16_moe_quant_config
        quant = helper(w1_scale=s1, w2_scale=s2, w1_zp=z1, w2_zp=z2, block_shape=[0, GROUP])
        return Layer(w1, w2, quant, shape.experts)

    return build


TRITON, GPTQ = "fused_moe_kernel", "fused_moe_kernel_gptq_awq"
FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("bf16", "bf16 weights and activations", TRITON, _bf16),
        Format("int4-w4a16", "GPTQ int4, group 128, no zero points (moe_wna16)", GPTQ, _wna16(4, False), 4),
        Format(
            "fp8-block128",
            "fp8 w8a8, 128×128 weight blocks, per-token-group acts",
            TRITON,
            _fp8_layer("block"),
        ),
        Format("bf16-ep", "bf16 on rank 1 of 2-way EP (expert_map)", TRITON, _expert_parallel),
        Format(
            "fp8-tensor", "fp8 w8a8, per-tensor scales, dynamic per-tensor acts", TRITON, _fp8_layer("tensor")
        ),
        Format("fp8-channel", "fp8 w8a8, per-channel scales, per-token acts", TRITON, _fp8_layer("channel")),
        Format("int8-w8a16", "int8 weight-only, per-row scales (online int8)", TRITON, _int8_channel),
        Format("int8-w8a16-g128", "int8 weight-only, group 128 (moe_wna16)", GPTQ, _wna16(8, False), 8),
        Format("int4-w4a16-zp", "AWQ-style int4, group 128, zero points", GPTQ, _wna16(4, True), 4),
        Format("bf16-top1-input", "bf16 top-1, router weight on the input", TRITON, _router_on_input),
    )
}
"""In the order the proof runs them (most telling first, in case its time runs out)."""


def wna16_uses_cuda(fmt: Format, tokens: int, top_k: int, experts: int) -> bool:
    """vLLM 0.25.1's ``should_moe_wna16_use_cuda`` for this format (both GEMMs decide alike)."""
    return fmt.bits == 4 and tokens * top_k / experts <= 6


def routing(tokens: int, experts: int, top_k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Renormalised softmax top-k as vLLM's ``fused_topk``: float32 weights, int32 ids."""
    logits = torch.randn(tokens, experts, device="cuda", generator=g)
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    if top_k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def run_fused_experts(layer: Layer, shape: Shape, tokens: int, g: torch.Generator) -> torch.Tensor:
    """One call of vLLM's ``fused_experts``, looked up on the package at call time (the capture wraps it there)."""
    package = importlib.import_module(PACKAGE)
    activation = importlib.import_module(ACTIVATION).MoEActivation.SILU
    top_k = layer.top_k or shape.top_k
    hidden = (torch.randn(tokens, shape.hidden, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    weights, ids = routing(tokens, layer.global_experts, top_k, g)
    out = package.fused_experts(
        hidden, layer.w1, layer.w2, weights, ids, activation=activation,
        apply_router_weight_on_input=layer.apply_router_weight_on_input,
        global_num_experts=layer.global_experts, expert_map=layer.expert_map, quant_config=layer.quant_config,
    )  # fmt: skip
    torch.cuda.synchronize()
    return out


@contextlib.contextmanager
def armed_capture(directory: Path) -> Iterator[Any]:
    """Arm moereplay's capture through vLLM's own plugin loader (``vllm.plugins.load_general_plugins`` finding the
    ``vllm.general_plugins`` entry point of a temporary dist-info, as ``tests/gpu/test_capture_plugin.py`` does);
    yields the session; at exit drains the writer, closes the file and restores vLLM. The capture file is
    ``session.path``."""
    from moereplay.capture import session as session_module

    site = directory / "site"
    dist = site / "moereplay_capture_probe-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: moereplay-capture-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    saved = {name: os.environ.get(name) for name in ("MOEREPLAY_CAPTURE", "MOEREPLAY_DIR", "VLLM_PLUGINS")}
    sys.path.insert(0, str(site))
    os.environ.update(MOEREPLAY_CAPTURE="1", MOEREPLAY_DIR=str(directory / "capture"))
    os.environ.pop("VLLM_PLUGINS", None)
    try:
        plugins: Any = importlib.import_module("vllm.plugins")  # its plugins_loaded is reset below
        importlib.import_module(FUSED_MOE)  # imported first: the capture wraps what is there at once
        importlib.import_module(PACKAGE)
        plugins.plugins_loaded = False
        plugins.load_general_plugins()
        session = session_module.current()
        if session is None:
            raise RuntimeError("vLLM's plugin loader did not arm moereplay's capture")
        yield session
        torch.cuda.synchronize()
        if not session.flush(timeout=300):
            raise RuntimeError("the capture writer did not drain within 300 s")
        if not session.recorder.active:
            raise RuntimeError(f"the capture disabled itself: {session.recorder.disabled_reason}")
    finally:
        session_module.disarm()
        sys.path.remove(str(site))
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
