"""Bit-for-bit snapshot of the exact references' answers, for changes that must not change them (speed work).

``record DIR`` runs every case below on the CPU and keeps what each reference returned — every tensor field of the
result (output, ingredients, row maps, coefficient sources), its non-tensor fields, or the one-line error it raised —
in ``DIR/snapshot.pt`` (tensors only: loaded with ``weights_only=True``) and ``DIR/snapshot.json``. ``compare DIR``
re-runs them with the code as it is now and reports every case whose answer differs in a single bit (float tensors
are compared as their bit patterns: NaN positions, NaN payloads and the sign of zero included), whose error changed,
or whose inputs changed (each built case records a sha256 of its input tensors, so a change to a builder is told
apart from a change to a reference).

Cases:

- every kernel call of the bundled captures (``captures/*.moe.zst``), through the op's ``reference``;
- synth presets with small overrides (Triton fused MoE bf16/fp16 with and without ``mul_routed_weight`` and biases,
  int4/int8 weight-only with and without zero points, fp8 block-128 with an expert map; Marlin NVFP4/MXFP4/GPTQ
  (act order, channel-wise)/fp8; ``matmul_ogs`` w13/w2/layer), written to ``DIR/synth/`` by ``record`` and read
  back by ``compare`` (the synth outputs come from the reference, so they are not rebuilt);
- edge cases built here from seeded data and passed to the reference functions directly: NaN/Inf inputs, zero
  rows, ``-1`` experts, naive block assignment, duplicate rows, every Triton quantisation mode, every Marlin weight
  format with and without biases and ``mul_topk_weights``, ``matmul_ogs`` gather/scatter/fused-scatter/split-k,
  flex scales, extreme and 0xff e8m0 scales, K not a multiple of 32, plain weights.

Cost: about half a minute and 1.5 GB on a 2-core machine (the gpt-oss-sized bundled captures dominate).

Usage (repository root)::

    python3 tools/reference_snapshot.py record /tmp/refsnap     # before the change
    python3 tools/reference_snapshot.py compare /tmp/refsnap    # after it: exit 1 on any difference
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

REPOSITORY = Path(__file__).resolve().parents[1]
if str(REPOSITORY) not in sys.path:  # run as a script from anywhere: import this checkout's moereplay
    sys.path.insert(0, str(REPOSITORY))

from moereplay.errors import MoereplayError  # noqa: E402

Case = Callable[[], tuple[Any, str]]
"""A case returns (the reference's result, sha256 of its inputs or "")."""


# --------------------------------------------------------------------------------------------------------------
# flattening a result into tensors and plain values
# --------------------------------------------------------------------------------------------------------------


def flatten(value: Any, prefix: str, tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    """Every tensor reachable from ``value`` into ``tensors`` and every other leaf into ``plain``, by path."""
    if isinstance(value, torch.Tensor):
        tensors[prefix] = value.detach().cpu().contiguous().clone()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        plain[prefix + "#type"] = type(value).__name__
        for field in dataclasses.fields(value):
            flatten(getattr(value, field.name), f"{prefix}.{field.name}", tensors, plain)
    elif isinstance(value, Mapping):
        plain[prefix + "#keys"] = sorted(str(key) for key in value)
        for key, item in value.items():
            flatten(item, f"{prefix}[{key}]", tensors, plain)
    elif isinstance(value, (list, tuple)):
        plain[prefix + "#len"] = len(value)
        for index, item in enumerate(value):
            flatten(item, f"{prefix}[{index}]", tensors, plain)
    elif isinstance(value, enum.Enum):
        plain[prefix] = f"{type(value).__name__}.{value.name}"
    elif value is None or isinstance(value, (bool, int, str)):
        plain[prefix] = value
    elif isinstance(value, float):
        plain[prefix] = repr(value)
    else:
        plain[prefix] = repr(value)


def digest(values: Any) -> str:
    """sha256 over every tensor reachable from ``values`` (shape, dtype, bytes) in a fixed order."""
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, Any] = {}
    flatten(values, "in", tensors, plain)
    hasher = hashlib.sha256(json.dumps(plain, sort_keys=True, default=str).encode())
    for name in sorted(tensors):
        tensor = tensors[name]
        hasher.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        hasher.update(bits(tensor).numpy().tobytes() if tensor.numel() else b"")
    return hasher.hexdigest()


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (bool as uint8): equal iff bit-identical."""
    if tensor.dtype == torch.bool:
        return tensor.to(torch.uint8)
    return tensor.contiguous().view(_BITS[tensor.element_size()])


# --------------------------------------------------------------------------------------------------------------
# cases: bundled captures and synth presets (through the op's reference)
# --------------------------------------------------------------------------------------------------------------

SYNTH: tuple[tuple[str, str, tuple[str, ...], bool | None], ...] = (
    (
        "qwen-bf16",
        "qwen3-30b-a3b-bf16-w13",
        ("tokens=8", "experts=16", "hidden=256", "intermediate=64"),
        None,
    ),
    (
        "qwen-bf16-mul-bias-fp16",
        "qwen3-30b-a3b-bf16-w13",
        ("tokens=8", "experts=16", "hidden=256", "intermediate=64", "mul_routed_weight=1", "dtype=float16"),
        True,
    ),
    (
        "qwen-bf16-mid",
        "qwen3-30b-a3b-bf16-w13",
        ("tokens=64", "experts=32", "hidden=1024", "intermediate=256", "block_m=32"),
        None,
    ),
    (
        "qwen-int4",
        "qwen3-30b-a3b-int4-w13",
        ("tokens=8", "experts=16", "hidden=256", "intermediate=64"),
        None,
    ),
    (
        "qwen-int4-zp",
        "qwen3-30b-a3b-int4-w13",
        ("tokens=8", "experts=16", "hidden=256", "intermediate=64", "zero_points=1"),
        None,
    ),
    (
        "qwen-int8-zp-fp16",
        "qwen3-30b-a3b-int4-w13",
        (
            "tokens=8",
            "experts=16",
            "hidden=256",
            "intermediate=64",
            "bits=8",
            "zero_points=1",
            "dtype=float16",
        ),
        None,
    ),
    (
        "deepseek-fp8",
        "deepseek-v3-fp8-w13",
        ("tokens=8", "global_experts=32", "experts=8", "rank=1", "hidden=512", "intermediate=128"),
        None,
    ),
    ("triton-layer", "triton-bf16-layer", (), None),
    ("gptq-int4", "gptq-int4-marlin", (), None),
    ("gptq-int4-act-order", "gptq-int4-marlin", ("act_order=1",), None),
    ("gptq-int4-channel", "gptq-int4-marlin", ("group_size=-1", "dtype=bfloat16"), None),
    ("fp8-marlin", "fp8-marlin", (), None),
    ("fp8-marlin-group", "fp8-marlin", ("group_size=128", "dtype=float16"), None),
    (
        "nvfp4-report-small",
        "marlin-nvfp4-report",
        ("tokens=8", "experts=8", "n=256", "k=256", "weights_dtype=float32"),
        None,
    ),
    (
        "nvfp4-gemm1-small",
        "gpt-oss-20b-nvfp4-gemm1",
        ("tokens=8", "experts=8", "hidden=256", "intermediate=256"),
        None,
    ),
    (
        "nvfp4-gemm2-small",
        "gpt-oss-20b-nvfp4-gemm2",
        ("tokens=8", "experts=8", "hidden=256", "intermediate=256"),
        None,
    ),
    ("nvfp4-layer", "marlin-nvfp4-layer", (), None),
    (
        "ogs-w13-small",
        "gpt-oss-20b-mxfp4-w13",
        ("tokens=8", "experts=8", "hidden=256", "intermediate=256"),
        None,
    ),
    (
        "ogs-w2-small",
        "gpt-oss-20b-mxfp4-w2",
        ("tokens=8", "experts=8", "hidden=256", "intermediate=256"),
        None,
    ),
    ("ogs-layer", "gpt-oss-20b-mxfp4-layer", (), None),
)


def capture_cases(paths: list[Path]) -> Iterator[tuple[str, Case]]:
    """Every call of each capture whose op has a reference, as ``<file>#<call>``."""
    from moereplay.format import CaptureReader
    from moereplay.ops import known_op_names

    for path in paths:
        with CaptureReader(path) as reader:
            indices = [call.index for call in reader.calls() if call.op in known_op_names()]
        for index in indices:
            yield f"{path.name}#{index}", _capture_case(path, index)


def _capture_case(path: Path, index: int) -> Case:
    def run() -> tuple[Any, str]:
        from moereplay.replay.source import load_call

        call = load_call(path, index)
        return call.op.reference(call.args), ""

    return run


def synthesize_all(directory: Path) -> None:
    from moereplay.synth.build import synthesize

    directory.mkdir(parents=True, exist_ok=True)
    for name, preset, overrides, bias in SYNTH:
        synthesize(preset, directory / f"{name}.moe.zst", overrides=overrides, bias=bias, store="bytes")


# --------------------------------------------------------------------------------------------------------------
# cases: the Triton fused MoE reference, called directly
# --------------------------------------------------------------------------------------------------------------


def _routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=gen), -1), top_k, dim=-1)
    return weights.contiguous(), ids.to(torch.int32)


def triton_cases() -> Iterator[tuple[str, Case]]:
    from moereplay.reference.fused_moe_triton import (
        reference_fused_moe_kernel,
        reference_fused_moe_kernel_gptq_awq,
    )
    from moereplay.reference.moe_align import moe_align_block_size

    tokens, experts, top_k, n, k = 5, 6, 2, 32, 64
    flags = {"use_fp8_w8a8": False, "use_int8_w8a8": False, "use_int8_w8a16": False, "use_int4_w4a16": False}

    def base(
        seed: int, block: int = 16, expert_map: torch.Tensor | None = None, **extra: Any
    ) -> dict[str, Any]:
        weights, ids = _routing(tokens, experts, top_k, seed)
        sorted_ids, expert_ids, padded = moe_align_block_size(ids, block, experts, expert_map)
        return {
            "topk_weights": weights,
            "sorted_token_ids": sorted_ids,
            "expert_ids": expert_ids,
            "num_tokens_post_padded": padded,
            "mul_routed_weight": False,
            "top_k": top_k,
            "block_size_m": block,
            "compute_type": "bfloat16",
            **extra,
        }

    def plain(
        seed: int, dtype: torch.dtype = torch.bfloat16, *, bias: bool = False, **extra: Any
    ) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(seed)
        kwargs = base(seed, **extra)
        kwargs.update(
            A=torch.randn(tokens, k, generator=gen).to(dtype),
            B=(torch.randn(experts, n, k, generator=gen) * 0.1).to(dtype),
            A_scale=None,
            B_scale=None,
            per_channel_quant=False,
            B_bias=torch.randn(experts, n, generator=gen).to(dtype) if bias else None,
            **flags,
        )
        if dtype != torch.bfloat16 and "compute_type" not in extra:
            kwargs["compute_type"] = str(dtype).removeprefix("torch.")
        return kwargs

    def fused(make: Callable[[], dict[str, Any]]) -> Case:
        def run() -> tuple[Any, str]:
            kwargs = make()
            return reference_fused_moe_kernel(**kwargs), digest(kwargs)

        return run

    def gptq(make: Callable[[], dict[str, Any]]) -> Case:
        def run() -> tuple[Any, str]:
            kwargs = make()
            return reference_fused_moe_kernel_gptq_awq(**kwargs), digest(kwargs)

        return run

    for mul in (False, True):
        for bias in (False, True):
            yield (
                f"triton/bf16-mul{int(mul)}-bias{int(bias)}",
                fused(lambda m=mul, b=bias: plain(1, bias=b, mul_routed_weight=m)),
            )
    yield "triton/fp16", fused(lambda: plain(2, torch.float16, mul_routed_weight=True))
    yield "triton/fp32", fused(lambda: plain(3, torch.float32, bias=True))
    yield "triton/block32", fused(lambda: plain(4, block=32, mul_routed_weight=True))

    def nonfinite() -> dict[str, Any]:
        kwargs = plain(5, bias=True, mul_routed_weight=True)
        kwargs["A"][1, 3] = float("nan")
        kwargs["A"][2, 0] = float("inf")
        kwargs["B"][0, 4, 7] = float("-inf")
        kwargs["B"][3, 0, 0] = float("nan")
        kwargs["topk_weights"] = kwargs["topk_weights"].clone()
        kwargs["topk_weights"][4, 1] = float("nan")
        return kwargs

    yield "triton/nonfinite", fused(nonfinite)

    def zero_rows() -> dict[str, Any]:
        kwargs = plain(6)
        kwargs["num_tokens_post_padded"] = torch.zeros(1, dtype=torch.int32)
        return kwargs

    yield "triton/zero-rows", fused(zero_rows)

    def expert_map() -> dict[str, Any]:
        mapping = torch.tensor([0, -1, 1, -1, 2, 3], dtype=torch.int32)
        kwargs = plain(7, expert_map=mapping, mul_routed_weight=True)
        kwargs["B"] = kwargs["B"][:4].contiguous()
        return kwargs

    yield "triton/expert-map", fused(expert_map)

    def minus_one() -> dict[str, Any]:
        kwargs = plain(8, bias=True)
        kwargs["expert_ids"] = kwargs["expert_ids"].clone()
        kwargs["expert_ids"][0] = -1
        return kwargs

    yield "triton/minus-one-block", fused(minus_one)

    def naive() -> dict[str, Any]:
        kwargs = plain(9, mul_routed_weight=True)
        _, ids = _routing(tokens, experts, top_k, 9)
        kwargs["sorted_token_ids"] = None
        kwargs["expert_ids"] = ids.reshape(-1).contiguous()
        kwargs["num_tokens_post_padded"] = torch.tensor([tokens * top_k * 16], dtype=torch.int32)
        return kwargs

    yield "triton/naive-blocks", fused(naive)

    def duplicate() -> dict[str, Any]:
        kwargs = plain(10)
        ids = kwargs["sorted_token_ids"].clone()
        ids[1] = ids[0]
        kwargs["sorted_token_ids"] = ids
        return kwargs

    yield "triton/duplicate-row", fused(duplicate)

    def lone_rows() -> dict[str, Any]:  # one token: every expert has exactly one row (a 1-row product)
        gen = torch.Generator().manual_seed(11)
        weights, ids = _routing(1, experts, top_k, 11)
        sorted_ids, expert_ids, padded = moe_align_block_size(ids, 16, experts)
        return {
            "A": torch.randn(1, k, generator=gen).to(torch.bfloat16),
            "B": torch.randn(experts, n, k, generator=gen).to(torch.bfloat16),
            "A_scale": None,
            "B_scale": None,
            "topk_weights": weights,
            "sorted_token_ids": sorted_ids,
            "expert_ids": expert_ids,
            "num_tokens_post_padded": padded,
            "mul_routed_weight": True,
            "top_k": top_k,
            "block_size_m": 16,
            "compute_type": "bfloat16",
            "per_channel_quant": False,
            **flags,
        }

    yield "triton/lone-rows", fused(lone_rows)

    def strided_weights() -> dict[str, Any]:
        kwargs = plain(12, mul_routed_weight=True)
        wide = torch.zeros(tokens, top_k * 2)
        wide[:, ::2] = kwargs["topk_weights"]
        kwargs["topk_weights"] = wide[:, ::2]
        return kwargs

    yield "triton/strided-topk-weights", fused(strided_weights)

    def w8a8(seed: int, mode: str, int8: bool = False, one_d: bool = False) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(seed)
        kwargs = base(seed, mul_routed_weight=True)
        if int8:
            a = torch.randint(-127, 128, (tokens, k), generator=gen, dtype=torch.int8)
            b = torch.randint(-127, 128, (experts, n, k), generator=gen, dtype=torch.int8)
        else:
            a = (torch.randn(tokens, k, generator=gen) * 8).to(torch.float8_e4m3fn)
            b = (torch.randn(experts, n, k, generator=gen) * 8).to(torch.float8_e4m3fn)
        shape = None
        if mode == "block":
            shape = [16, 32]
            a_scale = torch.rand(tokens, k // 32, generator=gen) + 0.5
            b_scale = torch.rand(experts, n // 16, k // 32, generator=gen) + 0.5
        elif mode == "channel":
            a_scale = torch.rand(tokens, 1, generator=gen) + 0.5
            b_scale = torch.rand(experts, n, 1, generator=gen) + 0.5
        else:
            a_scale = torch.rand(1, generator=gen) + 0.5
            b_scale = torch.rand(experts, generator=gen) + 0.5
        if one_d:
            a_scale = torch.rand(tokens, generator=gen) + 0.5
        kwargs.update(
            A=a,
            B=b,
            A_scale=a_scale,
            B_scale=b_scale,
            per_channel_quant=mode == "channel",
            block_shape=shape,
            B_bias=torch.randn(experts, n, generator=gen) if mode == "tensor" else None,
            **{**flags, "use_int8_w8a8" if int8 else "use_fp8_w8a8": True},
        )
        return kwargs

    for mode in ("block", "channel", "tensor"):
        yield f"triton/fp8-{mode}", fused(lambda m=mode: w8a8(20, m))
    yield "triton/int8-w8a8-channel", fused(lambda: w8a8(21, "channel", int8=True))
    yield "triton/fp8-channel-1d-a-scale", fused(lambda: w8a8(22, "channel", one_d=True))

    def w8a16(three_d: bool) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(23)
        kwargs = plain(23, mul_routed_weight=True)
        kwargs["B"] = torch.randint(-127, 128, (experts, n, k), generator=gen, dtype=torch.int8)
        scale = torch.rand(experts, n, generator=gen) * 0.01
        kwargs["B_scale"] = scale[:, :, None] if three_d else scale
        kwargs["use_int8_w8a16"] = True
        return kwargs

    yield "triton/int8-w8a16", fused(lambda: w8a16(False))
    yield "triton/int8-w8a16-3d-scale", fused(lambda: w8a16(True))

    def wna16(
        seed: int, bits: int, zp: bool, group: int, compute: str = "bfloat16", **extra: Any
    ) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(seed)
        kwargs = base(seed, compute_type=compute, **extra)
        dtype = getattr(torch, compute)
        packed_k = k // 2 if bits == 4 else k
        groups = -(-k // group)
        kwargs.update(
            A=torch.randn(tokens, k, generator=gen).to(dtype),
            B=torch.randint(0, 256, (experts, n, packed_k), generator=gen, dtype=torch.uint8),
            B_scale=(torch.rand(experts, n, groups, generator=gen) * 0.02).to(dtype),
            B_zp=(
                torch.randint(
                    0, 256, (experts, n // 2 if bits == 4 else n, groups), generator=gen, dtype=torch.uint8
                )
                if zp
                else None
            ),
            use_int4_w4a16=bits == 4,
            use_int8_w8a16=bits == 8,
            block_shape=[0, group],
        )
        return kwargs

    for bits_ in (4, 8):
        for zp in (False, True):
            yield (
                f"gptq/int{bits_}-zp{int(zp)}",
                gptq(lambda b=bits_, z=zp: wna16(30 + b, b, z, 32, mul_routed_weight=z)),
            )
    yield "gptq/int4-fp16-group48", gptq(lambda: wna16(40, 4, True, 48, "float16"))
    yield (
        "gptq/int8-zero-rows",
        gptq(
            lambda: {**wna16(41, 8, False, 32), "num_tokens_post_padded": torch.zeros(1, dtype=torch.int32)}
        ),
    )

    def gptq_nonfinite() -> dict[str, Any]:
        kwargs = wna16(42, 4, False, 32, mul_routed_weight=True)
        kwargs["A"][0, 0] = float("nan")
        kwargs["B_scale"][1, 2, 0] = float("inf")
        return kwargs

    yield "gptq/nonfinite", gptq(gptq_nonfinite)

    def gptq_minus_one() -> dict[str, Any]:
        kwargs = wna16(43, 4, True, 32)
        kwargs["expert_ids"] = kwargs["expert_ids"].clone()
        kwargs["expert_ids"][1] = -1
        return kwargs

    yield "gptq/minus-one-block", gptq(gptq_minus_one)
    yield (
        "triton/error-expert-out-of-range",
        fused(lambda: {**plain(44), "expert_ids": torch.full((64,), 9, dtype=torch.int32)}),
    )


# --------------------------------------------------------------------------------------------------------------
# cases: the Marlin reference, called directly
# --------------------------------------------------------------------------------------------------------------


def marlin_cases() -> Iterator[tuple[str, Case]]:
    from moereplay.reference.marlin_formats import MarlinWeightFormat as F
    from moereplay.reference.marlin_formats import random_experts
    from moereplay.reference.marlin_moe import ExpertWeightCache, reference_moe_wna16_marlin_gemm
    from moereplay.reference.moe_align import moe_align_block_size

    experts, k, n, m, top_k = 6, 128, 64, 7, 3
    formats = (
        (F.NVFP4, None, torch.bfloat16, False),
        (F.NVFP4, None, torch.float16, False),
        (F.MXFP4, None, torch.bfloat16, False),
        (F.MXFP8, None, torch.bfloat16, False),
        (F.FP8, -1, torch.bfloat16, False),
        (F.FP8, 128, torch.float16, False),
        (F.GPTQ_INT4, 32, torch.bfloat16, False),
        (F.GPTQ_INT4, 32, torch.float16, True),
        (F.GPTQ_INT4, -1, torch.float16, False),
        (F.GPTQ_INT8, 64, torch.bfloat16, False),
        (F.AWQ_INT4, 32, torch.float16, False),
        (F.AWQ_INT4_FZP, 32, torch.float16, False),
    )

    def make(
        fmt: Any, group: int | None, dtype: torch.dtype, act_order: bool, *, mul: bool, bias: bool, seed: int,
        tokens: int = m, gemm2: bool = False, block: int = 16,
    ) -> dict[str, Any]:  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        packed = random_experts(
            fmt, experts, k, n, group_size=group, activation_dtype=dtype, act_order=act_order,
            with_bias=True, with_dense=False, generator=gen,
        )  # fmt: skip
        weights, ids = _routing(tokens, experts, top_k, seed)
        sorted_ids, expert_ids, total = moe_align_block_size(ids, block, experts)
        rows = tokens * top_k if gemm2 else tokens
        kwargs = packed.kernel_kwargs()
        if not bias:
            kwargs["b_bias"] = None
        return {
            "input": torch.randn(rows, k, generator=gen).to(dtype),
            "output": None,
            "a_scales": None,
            "workspace": None,
            "sorted_token_ids": sorted_ids,
            "expert_ids": expert_ids,
            "num_tokens_past_padded": total,
            "topk_weights": weights.to(torch.float32),
            "moe_block_size": block,
            "top_k": 1 if gemm2 else top_k,
            "mul_topk_weights": mul,
            "size_m": rows,
            **kwargs,
        }

    def case(make_kwargs: Callable[[], dict[str, Any]], cache: bool = False) -> Case:
        def run() -> tuple[Any, str]:
            kwargs = make_kwargs()
            extra = {"weight_cache": ExpertWeightCache()} if cache else {}
            return reference_moe_wna16_marlin_gemm(**kwargs, **extra), digest(kwargs)

        return run

    for index, (fmt, group, dtype, act_order) in enumerate(formats):
        for mul in (False, True):
            name = f"marlin/{fmt.value}-g{group}-{str(dtype)[6:]}-act{int(act_order)}-mul{int(mul)}"
            yield (
                name,
                case(
                    lambda f=fmt, g=group, d=dtype, a=act_order, mu=mul, s=index: make(
                        f, g, d, a, mul=mu, bias=mu, seed=50 + s, gemm2=mu
                    ),
                    cache=bool(index % 2),
                ),
            )

    def nonfinite() -> dict[str, Any]:
        kwargs = make(F.NVFP4, None, torch.bfloat16, False, mul=True, bias=True, seed=70)
        kwargs["input"][0, 1] = float("nan")
        kwargs["input"][3, 2] = float("inf")
        return kwargs

    yield "marlin/nonfinite", case(nonfinite)

    def zero_rows() -> dict[str, Any]:
        return {
            **make(F.MXFP4, None, torch.bfloat16, False, mul=False, bias=True, seed=71),
            "num_tokens_past_padded": torch.zeros(1, dtype=torch.int32),
        }

    yield "marlin/zero-rows", case(zero_rows)

    def odd_blocks() -> dict[str, Any]:
        kwargs = make(F.GPTQ_INT4, 32, torch.float16, False, mul=True, bias=False, seed=72, block=8)
        experts_ = kwargs["expert_ids"].clone()
        experts_[0] = -1
        experts_[1] = 99
        ids = kwargs["sorted_token_ids"].clone()
        ids[9] = ids[8]  # a duplicate slot
        ids[16] = 10_000  # padding before a valid entry
        kwargs.update(expert_ids=experts_, sorted_token_ids=ids)
        kwargs["topk_weights"] = kwargs["topk_weights"].to(torch.bfloat16)
        return kwargs

    yield "marlin/odd-blocks", case(odd_blocks)
    yield (
        "marlin/one-token",
        case(lambda: make(F.NVFP4, None, torch.bfloat16, False, mul=True, bias=True, seed=73, tokens=1)),
    )


# --------------------------------------------------------------------------------------------------------------
# cases: the matmul_ogs reference, called directly
# --------------------------------------------------------------------------------------------------------------


def ogs_cases() -> Iterator[tuple[str, Case]]:
    from types import SimpleNamespace

    from moereplay.reference.hopper_mxfp4 import swizzle_hopper_scales, swizzle_hopper_values
    from moereplay.reference.matmul_ogs import (
        ActivationSpec,
        ExptDataSpec,
        GatherIndxSpec,
        LayoutSpec,
        PrecisionSpec,
        RoutingDataSpec,
        ScatterIndxSpec,
        TensorSpec,
        reference_matmul_ogs,
    )

    def weights(
        experts: int, k: int, n: int, seed: int, low: int = 118, high: int = 126
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        codes = torch.randint(0, 16, (experts, n, k), generator=gen)
        scales = torch.randint(low, high, (experts, n, -(-k // 32)), generator=gen).to(torch.uint8)
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
        return packed.transpose(1, 2), scales.transpose(1, 2)  # [E, K/2, N], [E, K/32, N]

    def hopper(values: torch.Tensor, scales: torch.Tensor) -> tuple[TensorSpec, TensorSpec]:
        e, kb, n = values.shape
        w = TensorSpec(
            swizzle_hopper_values(values, 1),
            LayoutSpec("HOPPER_VALUE", (e, kb, n), mx_axis=1),
            (e, 2 * kb, n),
            "fp4",
        )
        s = TensorSpec(
            swizzle_hopper_scales(scales, 1, 8),
            LayoutSpec("HOPPER_SCALE", tuple(scales.shape), mx_axis=1, num_warps=8),
            tuple(scales.shape),
            torch.uint8,
        )
        return w, s

    def routing(
        tokens: int, experts: int, top_k: int, seed: int, drop: tuple[tuple[int, int], ...] = ()
    ) -> Any:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
        gate = torch.rand(tokens, top_k, generator=gen, dtype=torch.float64) + 0.1
        gate = (gate / gate.sum(dim=1, keepdim=True)).to(torch.bfloat16)
        for t, s in drop:
            ids[t, s] = -1
        flat = ids.reshape(-1)
        order = torch.argsort(torch.where(flat < 0, experts, flat), stable=True)
        valid = int((flat >= 0).sum())
        topk_indx = torch.where(torch.arange(order.numel()) < valid, order, -1).to(torch.int32)
        gate_indx = torch.full_like(topk_indx, -1)
        gate_indx[order[:valid]] = torch.arange(valid, dtype=torch.int32)
        hist = torch.bincount(flat[flat >= 0], minlength=experts).to(torch.int32)
        offs = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(hist, 0).to(torch.int32)])
        scal = torch.where(
            torch.arange(order.numel()) < valid,
            gate.reshape(-1)[order],
            torch.zeros((), dtype=torch.bfloat16),
        )
        spec = RoutingDataSpec(scal, hist, experts, top_k, ExptDataSpec(hist, offs))
        return spec, GatherIndxSpec(topk_indx, gate_indx), ScatterIndxSpec(gate_indx, topk_indx)

    swiglu = ActivationSpec("swiglu", (1.702, 7.0), 2)

    def case(make_kwargs: Callable[[], dict[str, Any]]) -> Case:
        def run() -> tuple[Any, str]:
            kwargs = make_kwargs()
            return reference_matmul_ogs(**kwargs), digest(kwargs)

        return run

    def w13(
        seed: int, k: int, layout: str, *, low: int = 118, high: int = 126, tokens: int = 5, **extra: Any
    ) -> dict[str, Any]:
        experts, top_k, n = 4, 2, 48
        values, scales = weights(experts, k, n, seed, low, high)
        gen = torch.Generator().manual_seed(seed + 1)
        spec, gather, _ = routing(tokens, experts, top_k, seed + 2, extra.pop("drop", ()))
        w, s = hopper(values, scales) if layout == "hopper" else (values, scales)
        return {
            "x": torch.randn(tokens, k, generator=gen).to(torch.bfloat16),
            "w": w,
            "bias": torch.randn(experts, n, generator=gen),
            "routing_data": spec,
            "gather_indx": gather,
            "precision_config": PrecisionSpec(weight_scale=s),
            "fused_activation": swiglu,
            **extra,
        }

    for k in (64, 96, 160):
        for layout in ("strided", "hopper"):
            yield f"ogs/w13-k{k}-{layout}", case(lambda kk=k, ly=layout: w13(80 + kk, kk, ly))
    yield "ogs/w13-k48", case(lambda: w13(81, 48, "strided"))
    yield "ogs/w13-extreme-scales", case(lambda: w13(82, 64, "hopper", low=0, high=256))
    yield (
        "ogs/w13-split-k",
        case(
            lambda: w13(
                83,
                64,
                "strided",
                split_k=2,
                gammas=torch.rand(10, generator=torch.Generator().manual_seed(1)) + 0.5,
            )
        ),
    )
    yield "ogs/w13-dropped", case(lambda: w13(84, 64, "hopper", drop=((1, 0), (2, 1))))
    yield "ogs/w13-one-token", case(lambda: w13(85, 64, "hopper", tokens=1))

    def nonfinite() -> dict[str, Any]:
        kwargs = w13(86, 64, "strided")
        kwargs["x"][0, 5] = float("nan")
        kwargs["x"][3, 1] = float("-inf")
        return kwargs

    yield "ogs/w13-nonfinite", case(nonfinite)

    def w2(
        seed: int, *, top_k: int = 3, round_scratchpad: bool = False, drop: tuple[tuple[int, int], ...] = ()
    ) -> dict[str, Any]:
        experts, tokens, k, n = 4, 6, 64, 40
        values, scales = weights(experts, k, n, seed)
        gen = torch.Generator().manual_seed(seed + 1)
        spec, _, scatter = routing(tokens, experts, top_k, seed + 2, drop)
        return {
            "x": torch.randn(tokens * top_k, k, generator=gen).to(torch.bfloat16),
            "w": values,
            "bias": torch.randn(experts, n, generator=gen),
            "routing_data": spec,
            "scatter_indx": scatter,
            "precision_config": PrecisionSpec(weight_scale=scales),
            "gammas": spec.gate_scal,
            "round_scratchpad": round_scratchpad,
        }

    yield "ogs/w2-top-k-sum", case(lambda: w2(90))
    yield "ogs/w2-round-scratchpad", case(lambda: w2(91, round_scratchpad=True))
    yield "ogs/w2-dropped", case(lambda: w2(92, drop=((1, 0), (1, 1), (2, 2))))

    def fused_scatter() -> dict[str, Any]:
        kwargs = w2(93, top_k=2)
        spec = kwargs["routing_data"]
        kwargs["routing_data"] = RoutingDataSpec(spec.gate_scal, spec.expt_hist, 4, 1, spec.expt_data)
        return kwargs

    yield "ogs/fused-scatter", case(fused_scatter)

    def flex() -> dict[str, Any]:
        gen = torch.Generator().manual_seed(94)
        spec, gather, _ = routing(3, 2, 1, 95)
        precision = SimpleNamespace(
            weight_scale=None,
            flex_ctx=SimpleNamespace(
                lhs_data=SimpleNamespace(scale=torch.tensor([2.0])),
                rhs_data=SimpleNamespace(scale=torch.tensor([3.0, 5.0])),
                out_data=SimpleNamespace(expected_scale=None),
            ),
            out_dtype=None,
            act_scale=None,
            out_scale=None,
        )
        return {
            "x": torch.randn(3, 32, generator=gen),
            "w": torch.randn(2, 32, 4, generator=gen),
            "bias": torch.randn(2, 4, generator=gen),
            "routing_data": spec,
            "gather_indx": gather,
            "precision_config": precision,
            "betas": torch.tensor([0.5, 2.0, -1.0]),
            "out_alpha": 0.5,
        }

    yield "ogs/flex-betas-alpha", case(flex)
    yield (
        "ogs/dense",
        case(
            lambda: {
                "x": torch.randn(5, 16, generator=torch.Generator().manual_seed(96)),
                "w": torch.randn(16, 3, generator=torch.Generator().manual_seed(2)),
                "bias": None,
            }
        ),
    )
    yield (
        "ogs/plain-bf16-experts",
        case(
            lambda: {
                **w13(97, 64, "strided"),
                "w": torch.randn(4, 64, 48, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16),
                "precision_config": None,
            }
        ),
    )
    yield (
        "ogs/error-gather-outside",
        case(
            lambda: {
                **w13(98, 64, "strided"),
                "gather_indx": GatherIndxSpec(
                    torch.full((10,), 100, dtype=torch.int32), torch.zeros(10, dtype=torch.int32)
                ),
            }
        ),
    )


# --------------------------------------------------------------------------------------------------------------
# record / compare
# --------------------------------------------------------------------------------------------------------------


def all_cases(directory: Path) -> Iterator[tuple[str, Case]]:
    captures = sorted((REPOSITORY / "captures").glob("*.moe.zst"))
    yield from capture_cases(captures)
    yield from (
        (f"synth/{name}", case)
        for name, case in capture_cases(sorted((directory / "synth").glob("*.moe.zst")))
    )
    yield from triton_cases()
    yield from marlin_cases()
    yield from ogs_cases()


def run_case(case: Case) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, Any] = {}
    try:
        result, inputs = case()
    except MoereplayError as error:
        return {}, {"error": f"{type(error).__name__}: {error}"}
    flatten(result, "out", tensors, plain)
    plain["inputs"] = inputs
    return tensors, plain


def record(directory: Path, only: str | None) -> int:
    synthesize_all(directory / "synth")
    tensors: dict[str, torch.Tensor] = {}
    plains: dict[str, Any] = {}
    for name, case in all_cases(directory):
        if only and only not in name:
            continue
        start = time.perf_counter()
        found, plain = run_case(case)
        tensors.update({f"{name}::{key}": value for key, value in found.items()})
        plains[name] = plain
        print(
            f"recorded {name} ({time.perf_counter() - start:.2f} s){' ' + plain['error'] if 'error' in plain else ''}"
        )
    torch.save(tensors, directory / "snapshot.pt")
    (directory / "snapshot.json").write_text(json.dumps(plains, indent=1, sort_keys=True))
    print(f"{len(plains)} cases, {len(tensors)} tensors in {directory}")
    return 0


def compare(directory: Path, only: str | None) -> int:
    saved = torch.load(directory / "snapshot.pt", weights_only=True)
    plains = json.loads((directory / "snapshot.json").read_text())
    problems = 0
    seen = 0
    total = 0.0
    for name, case in all_cases(directory):
        if only and only not in name:
            continue
        if name not in plains:
            print(f"NEW      {name} (not in the snapshot)")
            continue
        seen += 1
        start = time.perf_counter()
        found, plain = run_case(case)
        elapsed = time.perf_counter() - start
        total += elapsed
        differences = _differences(name, found, plain, saved, plains[name])
        problems += bool(differences)
        status = "DIFFERS " if differences else "same    "
        print(f"{status} {name} ({elapsed:.2f} s)")
        for line in differences[:8]:
            print(f"           {line}")
    wanted = [name for name in plains if not only or only in name]
    print(f"{seen} cases compared, {problems} differ; reference time {total:.1f} s")
    if seen < len(wanted):
        print(f"{len(wanted) - seen} recorded cases were not run")
        problems += 1
    return 1 if problems else 0


def _differences(
    name: str,
    found: dict[str, torch.Tensor],
    plain: dict[str, Any],
    saved: dict[str, torch.Tensor],
    recorded: dict[str, Any],
) -> list[str]:
    lines = []
    if plain.get("inputs") != recorded.get("inputs"):
        lines.append("the case's INPUTS changed (a builder changed, not the reference)")
    for key in sorted(set(plain) | set(recorded)):
        if key != "inputs" and plain.get(key) != recorded.get(key):
            lines.append(f"{key}: {recorded.get(key)!r} -> {plain.get(key)!r}")
    old = {key.split("::", 1)[1]: value for key, value in saved.items() if key.startswith(name + "::")}
    for key in sorted(set(found) | set(old)):
        if key not in found or key not in old:
            lines.append(f"{key}: {'missing now' if key not in found else 'new'}")
            continue
        a, b = old[key], found[key]
        if a.dtype != b.dtype or a.shape != b.shape:
            lines.append(f"{key}: {a.dtype}{tuple(a.shape)} -> {b.dtype}{tuple(b.shape)}")
        elif not torch.equal(bits(a), bits(b)):
            count = int((bits(a) != bits(b)).sum())
            detail = ""
            if a.is_floating_point():
                delta = (a.double() - b.double()).abs()
                detail = f", max |diff| {float(delta[torch.isfinite(delta)].max()) if torch.isfinite(delta).any() else 'nan'}"
            lines.append(f"{key}: {count} of {a.numel()} elements differ in their bits{detail}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("record", "compare"))
    parser.add_argument("directory", type=Path)
    parser.add_argument("--only", help="run only the cases whose name contains this text")
    options = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    if options.action == "record":
        options.directory.mkdir(parents=True, exist_ok=True)
        return record(options.directory, options.only)
    return compare(options.directory, options.only)


if __name__ == "__main__":
    sys.exit(main())
