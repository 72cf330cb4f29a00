"""Generators that draw one expert at a time (finishing each on a worker thread) give the bytes of the whole draw:
the recorded digests of every capture depend on it."""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import pytest
import torch

from moereplay.synth import generators
from moereplay.synth.expert_pipeline import ExpertPipeline
from moereplay.synth.recipe import Drawn, tensor_digest

BASE: dict[str, Any] = {"seed": 3, "experts": 3, "size_k": 256, "size_n": 256}
MARLIN = [
    *(
        dict(BASE, format=name)
        for name in ("nvfp4", "mxfp4", "uint4b8", "uint8b128", "uint4", "uint4-float-zp")
    ),
    dict(BASE, format="nvfp4", bias=True, shards=2, pad_n=192, w13_layout="gu_interleaved"),
    dict(BASE, format="mxfp4", bias=True, shards=2, pad_n=160),
    dict(BASE, format="uint4", group_size=64, pad_k=320, activation_dtype="float16"),
    dict(BASE, format="uint8b128", group_size=64, size_n=128, bias=True, w13_layout="up_gate"),
    dict(BASE, format="nvfp4", pad_k=320),
    dict(BASE, format="nvfp4", style="report", pad_k=320, bias=True),
    dict(BASE, format="nvfp4", style="report", pad_k=320, shards=2, pad_n=192, w13_layout="gu_interleaved"),
    dict(BASE, format="fp8", group_size=64),  # magnitudes then signs: drawn whole either way
    dict(BASE, format="uint4b8", group_size=64, act_order=True),  # rows reordered: drawn whole either way
    {"seed": 9, "format": "nvfp4", "experts": 2, "size_k": 2880, "size_n": 5760, "shards": 2, "pad_n": 2944},
]
HOPPER = [
    {"seed": 1, "experts": 3, "k": 256, "n": 256},
    {"seed": 3, "experts": 2, "k": 96, "n": 100, "num_warps": 4},  # padded rows and columns
    {"seed": 4, "experts": 2, "k": 128, "n": 64, "mma_version": 2, "w13_layout": "gu_interleaved"},
    {"seed": 2, "experts": 2, "k": 2880, "n": 5760, "w13_layout": "gu_interleaved"},
    {"seed": 5, "experts": 2, "k": 96, "n": 1030},  # swizzled a block of rows at a time, the last one padded
    {"seed": 6, "experts": 2, "k": 64, "n": 600, "num_warps": 4, "w13_layout": "gu_interleaved"},
]


def _same(streamed: dict[str, torch.Tensor], whole: dict[str, torch.Tensor]) -> None:
    assert list(streamed) == list(whole)
    for name, tensor in whole.items():
        ours = streamed[name]
        assert ours.dtype == tensor.dtype and ours.shape == tensor.shape and ours.stride() == tensor.stride()
        assert torch.equal(ours.contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)), name


def _hashed_as_written(outputs: dict[str, torch.Tensor]) -> None:
    """The digests a generator worked out expert by expert are those of the finished tensors (a whole draw has
    none: its expansion hashes the tensors)."""
    digests = outputs.digests if isinstance(outputs, Drawn) else {}
    for part, (elements, storage) in digests.items():
        tensor = outputs[part]
        raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
        assert elements == tensor_digest(tensor) and storage == hashlib.sha256(raw.numpy().data).hexdigest()


@pytest.mark.parametrize("params", MARLIN, ids=lambda p: "-".join(str(v) for v in p.values()))
def test_marlin_experts_streamed_are_the_whole_draw(params: dict[str, Any]) -> None:
    streamed = generators._marlin_experts(params, streamed=True)
    _same(streamed, generators._marlin_experts(params, streamed=False))
    _hashed_as_written(streamed)


@pytest.mark.parametrize("params", HOPPER, ids=lambda p: "-".join(str(v) for v in p.values()))
def test_hopper_mxfp4_streamed_is_the_whole_draw(params: dict[str, Any]) -> None:
    streamed = generators._hopper_mxfp4(params, streamed=True)
    _same(streamed, generators._hopper_mxfp4(params, streamed=False))
    _hashed_as_written(streamed)
    assert set(streamed.digests) == {"values"}  # the transposed view: its elements and its storage differ


def test_the_cpu_generator_draws_a_tensor_piece_by_piece_as_it_draws_it_whole() -> None:
    """What streaming rests on: torch's CPU draws (randint, rand in float32 and float64) take the stream element by
    element, so consecutive draws of the pieces of a tensor — into fresh tensors or given buffers — are that
    tensor, and the generator ends where it would."""
    shape = (4, 48, 40)
    draws = [
        lambda gen, size, out=None: torch.randint(0, 16, size, generator=gen, dtype=torch.uint8, out=out),
        lambda gen, size, out=None: torch.rand(size, generator=gen, dtype=torch.float64, out=out),
        lambda gen, size, out=None: torch.rand(size, generator=gen, out=out),
    ]
    for draw in draws:
        gen = torch.Generator().manual_seed(5)
        whole, after = draw(gen, shape), torch.rand(3, generator=gen)
        gen = torch.Generator().manual_seed(5)
        pieces = [draw(gen, shape[1:]) for _ in range(2)]
        buffer = torch.empty(shape[1:], dtype=whole.dtype)
        pieces += [draw(gen, shape[1:], buffer).clone() for _ in range(2)]
        assert torch.equal(torch.stack(pieces), whole) and torch.equal(torch.rand(3, generator=gen), after)


def test_the_pipeline_runs_jobs_in_order_one_at_a_time_and_raises_their_errors() -> None:
    seen: list[int] = []
    workers: set[int] = set()

    def job(index: int) -> None:
        workers.add(threading.get_ident())
        seen.append(index)

    with ExpertPipeline() as pipeline:
        for index in range(20):
            pipeline.submit(job, index)
    assert seen == list(range(20)) and len(workers) == 1 and threading.get_ident() not in workers

    def fails(index: int) -> None:
        if index == 3:
            raise ValueError("expert 3")

    with pytest.raises(ValueError, match="expert 3"), ExpertPipeline() as pipeline:
        for index in range(6):
            pipeline.submit(fails, index)
