"""Per-rank captures of one Marlin MoE layer call, made the way vLLM's TP / EP ranks see it (no GPU, no vLLM).

One logical layer (GPTQ int4, channel-wise scales, gate/up concatenated, SiLU) is drawn once; each rank then gets
what vLLM 0.25.1 would load on it and records ``fused_marlin_moe`` with the rank's output before the all-reduce:

- ``tp``: every expert, the rank's 1/tp slice of the gate columns and of the up columns (w13 holds
  ``[gate slice r | up slice r]``) and the matching rows of w2;
- ``ep``: whole experts, ``expert_map`` from vLLM's linear placement (``determine_expert_map``: rank r holds a
  contiguous run, the first ``E % ep`` ranks one more), -1 for the others.

The recorded output is the rank's layer computed as vLLM's chain stores it (GEMM 1, the activation, the weighted
per-slot results and their sum each rounded to the activation dtype: what a correct kernel chain returns). ``corrupt`` = (rank, row) scales that rank's recorded row by 1.5, a bad partial for the
check to find. Returns the paths written and the single-GPU layer output (fp64, from the unsliced dense weights,
independently of the per-rank packing) so tests can hold the check against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from moereplay.errors import SettingsError
from moereplay.format.schema import EnumValue
from moereplay.ops.marlin_layer import MarlinLayerReference
from moereplay.reference.activation import GatedActivation, W13Layout, apply_gated_activation
from moereplay.reference.marlin_formats import MarlinWeightFormat, random_logical_experts

MOE_ACTIVATION = "vllm.model_executor.layers.fused_moe.activation.MoEActivation"
LAYER_NAME = "model.layers.0.mlp.experts"


@dataclass(frozen=True)
class RankCaptures:
    paths: tuple[Path, ...]
    single_gpu: torch.Tensor  # float64 [tokens, hidden]: the unsplit layer's output


def linear_expert_map(experts: int, ep_size: int, ep_rank: int) -> torch.Tensor:
    """vLLM's linear placement (``determine_expert_map``), written from its documented rule."""
    base, extra = divmod(experts, ep_size)
    count = base + (1 if ep_rank < extra else 0)
    start = ep_rank * base + min(ep_rank, extra)
    mapping = torch.full((experts,), -1, dtype=torch.int32)
    mapping[start : start + count] = torch.arange(count, dtype=torch.int32)
    return mapping


def _routing(
    tokens: int, experts: int, top_k: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, experts, generator=generator)
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


def write_rank_captures(
    directory: str | Path,
    mode: Literal["tp", "ep"],
    *,
    ranks: int = 2,
    tokens: int = 16,
    experts: int = 4,
    top_k: int = 2,
    hidden: int = 128,
    intermediate: int = 128,
    seed: int = 0,
    corrupt: tuple[int, int] | None = None,
) -> RankCaptures:
    from moereplay.format import CaptureWriter

    if mode not in ("tp", "ep"):
        raise SettingsError(f"mode must be tp or ep, not {mode!r}")
    if mode == "tp" and intermediate % (ranks * 64):
        raise SettingsError(f"intermediate {intermediate} must split into {ranks} slices of a multiple of 64")
    if mode == "ep" and experts < ranks:
        raise SettingsError(f"{experts} experts cannot spread over {ranks} EP ranks")
    fmt = MarlinWeightFormat.GPTQ_INT4
    generator = torch.Generator().manual_seed(seed)
    w13 = random_logical_experts(fmt, experts, hidden, 2 * intermediate, generator=generator)
    w2 = random_logical_experts(fmt, experts, intermediate, hidden, generator=generator)
    x = (torch.randn(tokens, hidden, generator=generator) * 0.5).to(torch.bfloat16)
    topk_weights, topk_ids = _routing(tokens, experts, top_k, generator)
    dense1, dense2 = w13.pack().dense, w2.pack().dense
    assert dense1 is not None and dense2 is not None  # packed with_dense (the default)
    single = _single_gpu(dense1, dense2, x, topk_weights, topk_ids)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    layer = MarlinLayerReference()
    paths = []
    for rank in range(ranks):
        if mode == "tp":
            width = intermediate // ranks
            columns = torch.cat(
                [
                    torch.arange(rank * width, (rank + 1) * width),
                    intermediate + torch.arange(rank * width, (rank + 1) * width),
                ]
            )
            packed1 = _pack(fmt, w13.codes[:, :, columns], w13.scales[:, :, columns])
            rows = slice(rank * width, (rank + 1) * width)
            packed2 = _pack(fmt, w2.codes[:, rows, :], w2.scales)  # channel-wise scales: one group, all rows
            expert_map = None
            parallel: dict[str, Any] = {"tp": rank, "tp_size": ranks, "ep": 0, "ep_size": 1, "use_ep": False}
        else:
            expert_map = linear_expert_map(experts, ranks, rank)
            held = torch.nonzero(expert_map >= 0).reshape(-1)
            packed1 = _pack(fmt, w13.codes[held], w13.scales[held])
            packed2 = _pack(fmt, w2.codes[held], w2.scales[held])
            parallel = {"tp": 0, "tp_size": 1, "ep": rank, "ep_size": ranks, "use_ep": True}
            parallel["expert_map"] = [int(v) for v in expert_map.tolist()]
        args: dict[str, Any] = {
            "hidden_states": x,
            "w1": packed1.b_qweight,
            "w2": packed2.b_qweight,
            "w1_scale": packed1.b_scales,
            "w2_scale": packed2.b_scales,
            "topk_weights": topk_weights,
            "topk_ids": topk_ids,
            "quant_type_id": fmt.scalar_type.id,
            "apply_router_weight_on_input": False,
            "global_num_experts": experts,
            "activation": EnumValue(MOE_ACTIVATION, "SILU", "silu"),
            "expert_map": expert_map,
            "is_k_full": True,
        }
        context = {
            "step": 0,
            "layer": 0,
            "layer_name": LAYER_NAME,
            "tag": "run",
            "ranks": {"world": rank, "tp": rank, "tp_size": ranks, "world_size": ranks},
            "parallel": {**parallel, "dp": 0, "dp_size": 1, "global_experts": experts,
                         "local_experts": int(packed1.b_qweight.shape[0])},
        }  # fmt: skip
        output = layer.reference(args, context, store=torch.bfloat16).to(torch.bfloat16)
        if corrupt is not None and corrupt[0] == rank:
            output[corrupt[1]] *= 1.5
        path = directory / f"rank{rank}-pid{1000 + rank}.zst"
        with CaptureWriter(
            path, header={"synth": f"marlin-layer-{mode}{ranks}", "rank": {"rank": str(rank)}}
        ) as writer:
            index = writer.begin_call(
                "fused_marlin_moe",
                args,
                site="synth:ranks",
                context=context,
                static=("w1", "w2", "w1_scale", "w2_scale"),
            )
            writer.complete_call(index, {"return": output})
        paths.append(path)
    return RankCaptures(tuple(paths), single)


def _pack(fmt: MarlinWeightFormat, codes: torch.Tensor, scales: torch.Tensor) -> Any:
    from moereplay.reference.marlin_formats import pack_experts

    return pack_experts(fmt, codes.contiguous(), scales.contiguous(), activation_dtype=torch.bfloat16)


def _single_gpu(
    w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The unsplit layer from dense fp64 weights, token by token (independent of the reference's grouping)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    xs = x.double()
    for token in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            expert = int(ids[token, slot])
            gate_up = xs[token : token + 1] @ w1[expert].double()
            activated = apply_gated_activation(
                gate_up, GatedActivation.SILU, W13Layout.GATE_UP_CONCAT
            ).double()
            out[token] += (activated @ w2[expert].double())[0] * float(weights[token, slot])
    return out
