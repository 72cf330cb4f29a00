"""A small word-level Hugging Face tokenizer written as plain JSON: ``tokenizer.json`` + ``tokenizer_config.json``.

vLLM loads it with ``--tokenizer DIR`` through ``AutoTokenizer`` (a ``PreTrainedTokenizerFast`` over the
``tokenizers`` model below); nothing here needs ``tokenizers`` or ``transformers`` to write it.

- model: ``WordLevel`` over a fixed vocabulary of exactly ``vocab_size`` entries, in this order: the special tokens
  (ids 0…), about 250 common English words (the chat roles and harmony channel names among them), punctuation, the
  numbers 0–99, then pronounceable filler words (``baba``, ``babe``, … consonant–vowel syllables) until the
  vocabulary is full. A word outside it becomes the unknown token.
- pre-tokenizer ``Whitespace`` (splits on ``\\w+|[^\\w\\s]+``); special tokens are matched before it, so
  ``<|start|>user<|message|>`` is three tokens.
- decoder ``WordPiece`` with prefix ``##`` (joins tokens with spaces, as a word-level vocabulary needs; no token
  carries the prefix, so no word is glued to the previous one).
- no post-processor: no BOS is added to prompts.

The config's vocabulary size equals the tokenizer's, so every id a model can emit decodes to a token.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_COMMON_WORDS_TEXT = """
    the of and to in is it you that he was for on are with as his they be at one have this from or had by hot
    word but what some we can out other were all there when up use your how said an each she which do their time
    if will way about many then them write would like so these her long make thing see him two has look more day
    could go come did number sound no most people my over know water than call first who may down side been now
    find any new work part take get place made live where after back little only round man year came show every
    good me give our under name very through just form sentence great think say help low line differ turn cause
    much mean before move right boy old too same tell does set three want air well also play small end put home
    read hand port large spell add even land here must big high such follow act why ask men change went light
    kind off need house picture try us again animal point mother world near build self earth father head stand
    own page should country found answer school grow study still learn plant cover food sun four between state
    keep eye never last let thought city tree cross farm hard start might story saw far sea draw left late run
    while press close night real life few north open seem together next white children begin got walk example
    ease paper group always music those both mark often letter until mile river car feet care second book carry
    took science eat room friend began idea fish mountain stop once base hear horse cut sure watch color face
    wood main enough plain girl usual young ready above ever red list though feel talk bird soon body dog family
    direct pose leave song measure door product black short numeral class wind question happen complete ship
    area half rock order fire south problem piece told knew pass since top whole king space heard best hour
    better true during hundred five remember step early hold west ground interest reach fast verb sing listen
    six table travel less morning ten simple several vowel toward war lay against pattern slow center love
    person money serve appear road map rain rule govern pull cold notice voice unit power town fine certain fly
    fall lead cry dark machine note wait plan figure star box noun field rest correct able pound done beauty
    drive stood contain front teach week final gave green oh quick develop ocean warm free minute strong
    special mind behind clear tail produce fact street inch multiply nothing course stay wheel full force blue
    object decide surface deep moon island foot system busy test record boat common gold possible plane stead
    dry wonder laugh thousand ago ran check game shape equate miss brought heat snow tire bring yes distant
    fill east paint language among a i hello zebra user assistant developer analysis commentary
"""
COMMON_WORDS: tuple[str, ...] = tuple(_COMMON_WORDS_TEXT.split())

PUNCTUATION: tuple[str, ...] = tuple(".,!?:;'\"-()/&%$#")

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def filler_words() -> Iterator[str]:
    """Pronounceable words of two, then three consonant–vowel syllables, in a fixed order."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    for count in itertools.count(2):
        for parts in itertools.product(syllables, repeat=count):
            yield "".join(parts)


@dataclass(frozen=True)
class SpecialTokens:
    """The special tokens of a tokenizer, in id order: ``unk``, ``bos``, ``eos``, ``pad`` (each once), then ``extra``."""

    unk: str
    bos: str
    eos: str
    pad: str
    extra: tuple[str, ...] = ()

    def ordered(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.unk, self.bos, self.eos, self.pad, *self.extra)))


@dataclass(frozen=True)
class Vocabulary:
    """Token strings by id; ``ids`` maps them back."""

    tokens: tuple[str, ...]
    specials: SpecialTokens

    def __post_init__(self) -> None:
        if len(set(self.tokens)) != len(self.tokens):
            raise ValueError("the vocabulary repeats a token")

    @property
    def ids(self) -> dict[str, int]:
        return {token: index for index, token in enumerate(self.tokens)}

    def id(self, token: str) -> int:
        try:
            return self.tokens.index(token)
        except ValueError as error:
            raise KeyError(f"{token!r} is not in the vocabulary") from error

    def encode_words(self, text: str) -> list[int]:
        """Ids of whitespace-separated words (unknown words → the unknown token); enough for plain test prompts."""
        ids = self.ids
        unknown = ids[self.specials.unk]
        return [ids.get(word, unknown) for word in text.split()]


def build_vocabulary(vocab_size: int, specials: SpecialTokens) -> Vocabulary:
    """Exactly ``vocab_size`` tokens: specials, common words, punctuation, numbers, fillers (see the module doc)."""
    fixed = list(
        dict.fromkeys((*specials.ordered(), *COMMON_WORDS, *PUNCTUATION, *(str(n) for n in range(100))))
    )
    if vocab_size < len(fixed):
        raise ValueError(f"vocab_size {vocab_size} is below the {len(fixed)} fixed tokens")
    taken = set(fixed)
    fillers = (word for word in filler_words() if word not in taken)
    return Vocabulary(tuple(fixed + list(itertools.islice(fillers, vocab_size - len(fixed)))), specials)


def tokenizer_json(vocabulary: Vocabulary) -> dict[str, object]:
    """The ``tokenizers`` serialisation (``tokenizer.json``) of the word-level tokenizer."""
    specials = vocabulary.specials.ordered()
    ids = vocabulary.ids
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": ids[token],
                "content": token,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for token in specials
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {"type": "WordLevel", "vocab": ids, "unk_token": vocabulary.specials.unk},
    }


def tokenizer_config_json(
    vocabulary: Vocabulary, chat_template: str, model_max_length: int
) -> dict[str, object]:
    """``tokenizer_config.json`` for ``PreTrainedTokenizerFast`` (transformers 4.x and 5.x read the same keys)."""
    specials = vocabulary.specials
    ids = vocabulary.ids
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": specials.bos,
        "eos_token": specials.eos,
        "pad_token": specials.pad,
        "unk_token": specials.unk,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(ids[token]): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for token in specials.ordered()
        },
        "chat_template": chat_template,
    }


def write_tokenizer(
    directory: Path,
    vocab_size: int,
    specials: SpecialTokens,
    chat_template: str,
    model_max_length: int,
) -> Vocabulary:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``; the vocabulary."""
    vocabulary = build_vocabulary(vocab_size, specials)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json(vocabulary), ensure_ascii=False))
    config = tokenizer_config_json(vocabulary, chat_template, model_max_length)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map = {
        "bos_token": specials.bos,
        "eos_token": specials.eos,
        "pad_token": specials.pad,
        "unk_token": specials.unk,
    }
    (directory / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return vocabulary
