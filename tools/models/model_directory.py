"""Writing one model directory — tokenizer, ``config.json``, ``generation_config.json``, safetensors shards —
the same way for every generator in tools/models/; each generator supplies its config and its tensors."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from random_tensors import TensorSource, pick_device
from safetensors_file import TensorPlan, write_checkpoint
from word_tokenizer import SpecialTokens, Vocabulary, write_tokenizer


def generation_config_json(vocabulary: Vocabulary, specials: SpecialTokens) -> dict[str, object]:
    """vLLM stops at ``eos`` and at the padding token; ``bos`` starts a sequence."""
    ids = vocabulary.ids
    return {
        "bos_token_id": ids[specials.bos],
        "eos_token_id": [ids[specials.eos], ids[specials.pad]],
        "pad_token_id": ids[specials.pad],
    }


def write_model_directory(
    directory: Path,
    *,
    vocab_size: int,
    max_position: int,
    specials: SpecialTokens,
    chat_template: str,
    config: Callable[[Vocabulary], dict[str, object]],
    shards: Callable[[TensorSource], Sequence[Sequence[TensorPlan]]],
    seed: int,
    device: torch.device | None,
) -> tuple[dict[str, object], Vocabulary]:
    """Write the whole directory; the summary ``make`` returns (model, bytes, seconds, device) and the
    vocabulary written."""
    started = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    vocabulary = write_tokenizer(directory, vocab_size, specials, chat_template, max_position)
    (directory / "config.json").write_text(json.dumps(config(vocabulary), indent=2) + "\n")
    (directory / "generation_config.json").write_text(
        json.dumps(generation_config_json(vocabulary, specials), indent=2) + "\n"
    )
    source = TensorSource(seed, device or pick_device("auto"))
    written = write_checkpoint(directory, shards(source))
    summary: dict[str, object] = {
        "model": str(directory),
        "bytes": written,
        "seconds": round(time.perf_counter() - started, 2),
        "device": str(source.device),
    }
    return summary, vocabulary
