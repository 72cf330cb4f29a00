"""``tools/gpu/serve_gpu.py``'s fault prompts (the server runs only on the GPU machine): the served proof of a
fault that first appears at prefill needs the poisoned word exactly once in every prompt, and prompts long enough
to be prefilled outside any CUDA graph."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from model_files import load_tool

SERVE = Path(__file__).resolve().parents[3] / "tools" / "gpu" / "serve_gpu.py"


@pytest.fixture(scope="module")
def serve_gpu() -> types.ModuleType:
    sys.path.insert(0, str(SERVE.parent))  # its own imports (harness) live beside it
    return load_tool("serve_gpu", SERVE.parent)


def test_fault_prompts_hold_the_word_once_in_the_middle(serve_gpu: types.ModuleType) -> None:
    words = ["zebra", *(f"w{index}" for index in range(30))]  # the word among the vocabulary's own
    built = serve_gpu.fault_prompts(words, "zebra", 3, 161, offset=17)
    assert len(built) == 3 and len(set(built)) == 3
    for text in built:
        tokens = text.split(" ")
        assert len(tokens) == 161
        assert tokens.count("zebra") == 1 and tokens.index("zebra") == 80


def test_fault_prompts_are_longer_than_the_largest_graph(serve_gpu: types.ModuleType) -> None:
    command = serve_gpu.serve_command(Path("/m"), 1, "graph", [], 1024)
    assert json.dumps({"cudagraph_capture_sizes": serve_gpu.CAPTURE_SIZES}) in command
    assert (
        max(serve_gpu.CAPTURE_SIZES) < serve_gpu.FAULT_PROMPT_WORDS
    )  # an eager prefill, where lean calls are made
