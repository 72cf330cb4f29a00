"""Fixtures of the TUI tests: small real captures in a temporary directory that is also the working directory
(so every path the screens show is short and the same from run to run)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tui_captures import write_marlin_capture, write_synthetic_capture


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def marlin_capture(workdir: Path) -> Path:
    """One Marlin call whose output row 1 is three times too large."""
    return write_marlin_capture(Path("marlin.moe.zst"), calls=1, bad_from=0)


@pytest.fixture
def stream_capture(workdir: Path) -> Path:
    """An enclosing call, then eight Marlin calls (layers 0..7): calls of layers 5.. are bad."""
    return write_marlin_capture(Path("stream.moe.zst"), calls=8, bad_from=5, context_call=True)


@pytest.fixture
def violation_capture(workdir: Path) -> Path:
    """One Marlin call with bf16 routing weights, which the kernel reads as float32."""
    import torch

    return write_marlin_capture(
        Path("weights.moe.zst"), calls=1, bad_from=None, topk_weights_dtype=torch.bfloat16
    )


@pytest.fixture
def synthetic_capture(workdir: Path) -> Path:
    """300 tiny calls over three ops, 24 layers per step; every tenth has no output."""
    return write_synthetic_capture(Path("synthetic.moe.zst"), 300)
