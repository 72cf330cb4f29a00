"""The routing vLLM's gpt-oss layer computes from its router logits is bit-identical run to run on this GPU.

Recording gpt-oss one level up (``triton_kernel_moe_forward``: hidden states and logits, not the 16 tensors of
RoutingData / GatherIndx / ScatterIndx) is only sound if a replay that recomputes the routing from the recorded
logits gets the routing the served call got. ``tools/gpu/routing_determinism.py`` runs vLLM 0.25.1's own
``triton_kernel_moe_forward`` with its fused-experts call replaced by a stand-in that keeps the routing, repeatedly,
for random and tied logits at decode and prefill sizes; this runs a smaller set of its cases and wants them all
bit-identical.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::Warning:vllm.*"),
    pytest.mark.filterwarnings("ignore::Warning:triton.*"),
    pytest.mark.filterwarnings("ignore::Warning:torch.*"),
]

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu" / "routing_determinism.py"


def test_gpt_oss_routing_is_bit_identical_run_to_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton_kernels", reason="needs triton_kernels (a kernel pack or vLLM's wheel)")
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM 0.25.1: set MOEREPLAY_PACK or install vLLM")
    spec = importlib.util.spec_from_file_location("routing_determinism", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = tmp_path / "routing.json"
    monkeypatch.setattr(sys, "argv", ["routing_determinism", "--tokens", "1,32,2048", "--repeats", "6",
                                      "--json", str(report)])  # fmt: skip
    code = module.main()
    result = json.loads(report.read_text())
    assert len(result["cases"]) == 12 and all(case["runs"] == 6 for case in result["cases"])
    assert all(len(case["tensors"]) >= 2 for case in result["cases"])  # the routing objects were reached
    assert code == 0 and result["verdict"] == "deterministic", [c for c in result["cases"] if c["differ"]]
