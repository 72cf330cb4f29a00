"""Shared helpers: a throwaway module of real CPU "kernels" with vLLM-like signatures, and an armed session."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moereplay.capture import session as session_module
from moereplay.capture.patch_points import CaptureTarget

MODULE = "moereplay_test_kernels"


def gemm(
    input: torch.Tensor,
    output: torch.Tensor | None,
    weight: torch.Tensor,
    topk_weights: torch.Tensor,
    top_k: int,
    mul_topk_weights: bool,
    scale: float = 1.0,
) -> torch.Tensor:
    """A real computation with the shape of a MoE GEMM call: writes ``output`` in place and returns it."""
    if output is None:
        output = torch.empty(input.shape[0], weight.shape[1], dtype=input.dtype)
    torch.matmul(input, weight, out=output)
    if mul_topk_weights:
        output.mul_(topk_weights.reshape(-1, 1)[: output.shape[0]])
    output.mul_(scale)
    return output


def fused(
    hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """A parent calling the kernel twice through the module attribute, as vLLM calls ``ops.…``."""
    module = sys.modules[MODULE]
    cache = torch.empty(hidden.shape[0], w1.shape[1])
    first = module.gemm(hidden, cache, w1, topk_weights, 1, False)
    second = module.gemm(first, None, w2, topk_weights, 1, True, scale=0.5)
    return second


TARGETS = (
    CaptureTarget("gemm", "kernel", MODULE, "gemm", static=("weight",), outputs=("output",)),
    CaptureTarget("fused", "parent", MODULE, "fused", static=("w1", "w2")),
)


@pytest.fixture
def kernels(stand_in_module: Callable[..., types.ModuleType]) -> types.ModuleType:
    return stand_in_module(MODULE, gemm=gemm, fused=fused)


@pytest.fixture
def arm(kernels: types.ModuleType, tmp_path: Path):
    """``arm(**settings)`` → an armed session writing under tmp_path (``directory``: elsewhere — one per session
    where a test arms several: a process names its file by its pid) (disarmed at teardown)."""

    def _arm(targets=TARGETS, sink_factory=None, directory: Path | None = None, **settings: str):
        env = {"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_DIR": str(directory or tmp_path / "captures")}
        env.update({f"MOEREPLAY_{key.upper()}": value for key, value in settings.items()})
        kwargs = {} if sink_factory is None else {"sink_factory": sink_factory}
        session = session_module.arm(env, targets=targets, **kwargs)
        assert session is not None
        return session

    return _arm


INTACT_MODULE = "moereplay_test_intact"


def layer_doubling(hidden: torch.Tensor, w1: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """An intact layer: reads ``hidden``, writes only its output buffer."""
    output.copy_(hidden[:, : output.shape[1]] * 2)
    return output


@pytest.fixture
def arm_intact(arm, stand_in_module: Callable[..., types.ModuleType]):
    """``arm_intact(function, **settings)`` → ``(session, module)``: ``function(hidden, w1, output)`` armed as the
    only target, a layer whose inputs stay intact, ``w1`` static and ``output`` its output buffer; call it as
    ``module.layer``."""

    def _arm(function: Callable[..., torch.Tensor], **settings: str):
        stand_in_module(INTACT_MODULE, layer=function)
        targets = (
            CaptureTarget(
                "layer",
                "parent",
                INTACT_MODULE,
                "layer",
                static=("w1",),
                outputs=("output",),
                inputs_intact=True,
            ),
        )
        return arm(targets=targets, **settings), sys.modules[INTACT_MODULE]

    return _arm


def make_inputs(tokens: int = 5, hidden: int = 8, inner: int = 6, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator)
    w1 = torch.randn(hidden, inner, generator=generator)
    w2 = torch.randn(inner, hidden, generator=generator)
    weights = torch.rand(tokens, generator=generator)
    return x, w1, w2, weights


@pytest.fixture
def inputs():
    """``inputs(tokens=5, hidden=8, inner=6, seed=0)`` → ``(x, w1, w2, topk_weights)`` on CPU."""
    return make_inputs


@pytest.fixture(autouse=True)
def _restore_capture_directory_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arming with the default directory exports MOEREPLAY_DIR for child processes; undo it after each test."""
    monkeypatch.setenv("MOEREPLAY_DIR", "")
    monkeypatch.delenv("MOEREPLAY_DIR")
