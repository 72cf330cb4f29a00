"""Inputs for triton_kernels ``matmul_ogs`` built the way vLLM 0.25.1 builds them for gpt-oss on Hopper.

- triton_kernels: an installed ``triton_kernels``, else the copy vendored in the vLLM tree
  (``vllm/third_party/triton_kernels``, put on ``sys.path`` as the top-level ``triton_kernels`` — the name vLLM
  aliases it to), found without importing vLLM.
- weights: checkpoint-form MXFP4 (``[E, N, K/2]`` e2m1 bytes, ``[E, N, K/32]`` e8m0 scales), swizzled by vLLM's own
  ``mxfp4_utils._swizzle_mxfp4`` when vLLM imports, else by the same triton_kernels calls it makes (transpose,
  ``convert_layout`` to the default Hopper value/scale layouts with mx_axis=1, num_warps=8, opt_flags split_k=1).
- routing: ``triton_kernels.routing.routing(logits, top_k, sm_first=False)`` — what vLLM's
  ``triton_kernel_moe_forward`` calls with the bundled (legacy) triton_kernels and no expert map.
- the fused activation: ``FusedActivation(FnSpecs("swiglu", swiglu_fn, ("alpha", "limit")), (1.702, 7.0), 2)``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def import_triton_kernels() -> tuple[ModuleType | None, str]:
    """(the ``triton_kernels`` package, where it came from) or (None, why not)."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return None, f"triton does not import: {e}"
    try:
        return importlib.import_module("triton_kernels"), "installed triton_kernels"
    except ImportError:
        pass
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None, "neither triton_kernels nor vllm (for vllm/third_party/triton_kernels) is importable"
    third_party = Path(next(iter(spec.submodule_search_locations))) / "third_party"
    if not (third_party / "triton_kernels" / "matmul_ogs.py").is_file():
        return None, f"no vendored triton_kernels under {third_party}"
    sys.path.insert(0, str(third_party))
    try:
        return importlib.import_module("triton_kernels"), f"vendored triton_kernels from {third_party}"
    except Exception as e:  # surfaced as a skip reason
        return None, f"vendored triton_kernels failed to import: {type(e).__name__}: {e}"


@dataclass
class CheckpointMx:
    """MXFP4 expert weights in checkpoint form."""

    values: torch.Tensor  # uint8 [E, N, K/2], element 2i in the low nibble
    scales: torch.Tensor  # uint8 [E, N, K/32]
    bias: torch.Tensor  # fp32 [E, N]


def random_checkpoint(experts: int, n: int, k: int, *, seed: int, device: str = "cuda") -> CheckpointMx:
    """Random codes, scales around 2**-4 (keeps K=3072 dot products O(1..10)), fp32 bias."""
    g = torch.Generator(device=device).manual_seed(seed)
    values = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, generator=g, device=device)
    scales = torch.randint(120, 126, (experts, n, k // 32), dtype=torch.uint8, generator=g, device=device)
    bias = torch.randn(experts, n, generator=g, device=device) * 0.5
    return CheckpointMx(values, scales, bias)


def swizzle_like_vllm(tk: ModuleType, ckpt: CheckpointMx) -> tuple[Any, Any, Any, str]:
    """(w Tensor, InFlexData, w_scale Tensor, which code did it) as vLLM's Hopper preparation leaves them."""
    try:
        from vllm.model_executor.layers.quantization.utils.mxfp4_utils import _swizzle_mxfp4

        w, flex, scale = _swizzle_mxfp4(ckpt.values, ckpt.scales, num_warps=8)
        return w, flex, scale, "vllm _swizzle_mxfp4"
    except Exception as e:  # vLLM absent or unimportable here: same recipe through triton_kernels
        reason = f"{type(e).__name__}"
    opt_flags = importlib.import_module("triton_kernels.matmul_ogs_details.opt_flags")
    numerics = importlib.import_module("triton_kernels.numerics")
    tensor = importlib.import_module("triton_kernels.tensor")
    layout = importlib.import_module("triton_kernels.tensor_details.layout")
    value_layout, value_opts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
    scale_layout, scale_opts = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
    opt_flags.update_opt_flags_constraints({"split_k": 1})
    w = tensor.convert_layout(
        tensor.wrap_torch_tensor(ckpt.values.transpose(-2, -1), dtype=tensor.FP4), value_layout, **value_opts
    )
    scale = tensor.convert_layout(
        tensor.wrap_torch_tensor(ckpt.scales.transpose(-2, -1)), scale_layout, **scale_opts
    )
    return w, numerics.InFlexData(), scale, f"triton_kernels convert_layout (vLLM recipe; vLLM: {reason})"


def precision_config(tk: ModuleType, flex: Any, scale: Any) -> Any:
    matmul_ogs = importlib.import_module("triton_kernels.matmul_ogs")
    return matmul_ogs.PrecisionConfig(weight_scale=scale, flex_ctx=matmul_ogs.FlexCtx(rhs_data=flex))


def swiglu_activation(tk: ModuleType) -> Any:
    matmul_ogs = importlib.import_module("triton_kernels.matmul_ogs")
    swiglu = importlib.import_module("triton_kernels.swiglu")
    specs = matmul_ogs.FnSpecs("swiglu", swiglu.swiglu_fn, ("alpha", "limit"))
    return matmul_ogs.FusedActivation(specs, (SWIGLU_ALPHA, SWIGLU_LIMIT), 2)


def make_routing(tk: ModuleType, tokens: int, experts: int, top_k: int, *, seed: int) -> tuple[Any, Any, Any]:
    """(routing_data, gather_indx, scatter_indx) from bf16 router logits, as vLLM's legacy path builds them."""
    routing = importlib.import_module("triton_kernels.routing")
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g).to(device="cuda", dtype=torch.bfloat16)
    return routing.routing(logits, top_k, sm_first=False)


def scale_in_filled_buffer(tk: ModuleType, scale: Any, fill: int, extra: int = 4096) -> Any:
    """A copy of the swizzled scale Tensor whose storage is followed by ``extra`` bytes of ``fill``.

    The swizzled storage is a transposed view of a contiguous block; the copy keeps the same shape and strides,
    so the kernel indexes it identically and any load past the block's end reads ``fill``.
    """
    tensor = importlib.import_module("triton_kernels.tensor")
    data = scale.storage.data
    base = data.mT
    if not base.is_contiguous() or base.storage_offset() != 0:
        raise RuntimeError("unexpected swizzled scale storage: not a transposed contiguous block")
    raw = base.view(torch.uint8)
    buffer = torch.full((raw.numel() + extra,), fill, dtype=torch.uint8, device=raw.device)
    block = buffer[: raw.numel()].view(raw.shape)
    block.copy_(raw)
    storage = tensor.Storage(block.view(base.dtype).mT, scale.storage.layout)
    return tensor.Tensor(storage, dtype=scale.dtype, shape=list(scale.shape), shape_max=list(scale.shape_max))


@dataclass(frozen=True)
class GptOssMxfp4Layer:
    """One gpt-oss MoE layer's MXFP4 weights as vLLM 0.25.1 prepares them on Hopper, and its quant config."""

    w13: Any
    w2: Any
    quant_config: Any


def gpt_oss_mxfp4_layer(
    module: Callable[[str], ModuleType],
    experts: int,
    hidden: int,
    intermediate: int,
    generator: torch.Generator,
) -> GptOssMxfp4Layer:
    """Checkpoint-form random MXFP4 w13 / w2 (scales 2^-6 … 2^-1: no 0x00 / 0xff) and fp32 biases, swizzled by vLLM's
    ``_swizzle_mxfp4`` (num_warps 8) and wrapped in ``mxfp4_w4a16_moe_quant_config``. ``module`` imports a module by
    name (``importlib.import_module``, or a kernel backend's ``module``)."""
    mxfp4_utils = module("vllm.model_executor.layers.quantization.utils.mxfp4_utils")
    config = module("vllm.model_executor.layers.fused_moe.config")
    matmul = module("triton_kernels.matmul_ogs")

    def checkpoint(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        values = torch.randint(0, 256, (experts, n, k // 2), device="cuda", generator=generator)
        scales = torch.randint(121, 127, (experts, n, k // 32), device="cuda", generator=generator)
        return values.to(torch.uint8), scales.to(torch.uint8)

    w13_values, w13_scales = checkpoint(2 * intermediate, hidden)
    w2_values, w2_scales = checkpoint(hidden, intermediate)
    w13_bias = torch.randn(experts, 2 * intermediate, device="cuda", generator=generator) * 0.1
    w2_bias = torch.randn(experts, hidden, device="cuda", generator=generator) * 0.1
    w13, w13_flex, w13_scale = mxfp4_utils._swizzle_mxfp4(w13_values, w13_scales, num_warps=8)
    w2, w2_flex, w2_scale = mxfp4_utils._swizzle_mxfp4(w2_values, w2_scales, num_warps=8)
    quant_config = config.mxfp4_w4a16_moe_quant_config(
        w1_scale=matmul.PrecisionConfig(weight_scale=w13_scale, flex_ctx=matmul.FlexCtx(rhs_data=w13_flex)),
        w2_scale=matmul.PrecisionConfig(weight_scale=w2_scale, flex_ctx=matmul.FlexCtx(rhs_data=w2_flex)),
        w1_bias=w13_bias,
        w2_bias=w2_bias,
    )
    return GptOssMxfp4Layer(w13, w2, quant_config)
