"""``--backend`` specs: parsing, and what ``auto`` resolves to (``$MOEREPLAY_PACK``, then vLLM, then reference)."""

from __future__ import annotations

import pytest

from moereplay.errors import SettingsError
from moereplay.replay.backends import BackendSpec, auto_backend, parse_backend


def test_explicit_specs_parse() -> None:
    assert parse_backend("reference") == BackendSpec("reference")
    assert parse_backend(" vllm ") == BackendSpec("vllm")
    assert parse_backend("pack:/opt/pack") == BackendSpec("pack", "/opt/pack")
    assert parse_backend("python:mod#k").text == "python:mod#k"
    assert parse_backend("pack:/opt/pack").needs_cuda and not parse_backend("reference").runs_kernels
    for bad in ("pack:", "cuda", "python: "):
        with pytest.raises(SettingsError):
            parse_backend(bad)


def test_auto_prefers_the_pack_named_by_the_environment_then_vllm_then_the_reference() -> None:
    pack = {"MOEREPLAY_PACK": "/opt/kernelpack"}
    assert auto_backend(pack, cuda=True, vllm=True) == BackendSpec("pack", "/opt/kernelpack")
    assert auto_backend({"MOEREPLAY_PACK": "  "}, cuda=True, vllm=True) == BackendSpec("vllm")
    assert auto_backend({}, cuda=True, vllm=True) == BackendSpec("vllm")
    assert auto_backend({}, cuda=True, vllm=False) == BackendSpec("reference")


def test_auto_without_cuda_is_the_offline_reference_even_with_a_pack() -> None:
    assert auto_backend({"MOEREPLAY_PACK": "/opt/kernelpack"}, cuda=False, vllm=True) == BackendSpec(
        "reference"
    )


def test_auto_reads_the_environment_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("MOEREPLAY_PACK", "/somewhere/pack")
    assert parse_backend("auto") == BackendSpec("pack", "/somewhere/pack")
    monkeypatch.delenv("MOEREPLAY_PACK")
    assert parse_backend("auto", {"MOEREPLAY_PACK": "/other"}) == BackendSpec("pack", "/other")
