"""Write a tiny, randomly initialised Mixtral-style MoE model and its tokenizer to a directory — no hub access.

Run with the Python of the environment that serves it (it needs transformers, tokenizers and safetensors, which
vLLM depends on)::

    /work/venv-vllmcpu/bin/python tools/serve/make_tiny_moe.py DIR

Shape: hidden 128, 2 layers, 4 experts, top-2, 4 attention heads of 32 (vLLM's CPU attention refuses head
dimension 16 at the first request), a 260-word word-level tokenizer; about 2 MB of float32 weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

WORDS = 256
SPECIAL = ("<unk>", "<s>", "</s>", "<pad>")


def build_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL)}
    for index in range(WORDS):
        vocab[f"w{index}"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.model_max_length = 256
    fast.save_pretrained(str(directory))


def build_model(directory: Path, vocab_size: int, seed: int) -> None:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = MixtralForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(directory), safe_serialization=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    options.directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(options.directory)
    build_model(options.directory, len(SPECIAL) + WORDS, options.seed)
    size = sum(path.stat().st_size for path in options.directory.iterdir() if path.is_file())
    print(json.dumps({"model": str(options.directory), "bytes": size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
