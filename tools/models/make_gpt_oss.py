"""Write a random-weight gpt-oss checkpoint with MXFP4 experts that vLLM 0.25.1 loads and serves — no hub access.

    python3 tools/models/make_gpt_oss.py /tmp/models/gpt-oss-2l                 # gpt-oss-20b shapes, 2 layers
    python3 tools/models/make_gpt_oss.py /tmp/models/gpt-oss-24l --layers 24    # the full depth, ~11 GB
    python3 tools/models/make_gpt_oss.py /tmp/models/gpt-oss-bad --poison 1:5  # expert 5 of layer 1 → NaN

Needs torch only (numpy through torch); uses the GPU for the random bytes when there is one (``--device``).
Writes ``config.json``, ``generation_config.json``, the tokenizer (``word_tokenizer``), one safetensors shard for
the embeddings and head plus one a layer, and ``model.safetensors.index.json``; prints a JSON summary.

The checkpoint (names, dtypes and shapes as in openai/gpt-oss-20b, read by vLLM's ``GptOssModel._load_weights_mxfp4``
and ``GptOssMxfp4MoEMethod.create_weights``), with H = hidden, I = intermediate, E = experts:

- ``model.embed_tokens.weight`` and ``lm_head.weight`` bf16 ``[vocab, H]``; ``model.norm.weight`` bf16 ``[H]``;
- a layer: ``input_layernorm`` / ``post_attention_layernorm`` bf16 ``[H]``; ``self_attn.{q,k,v,o}_proj`` weights and
  biases bf16 (``q`` ``[heads·head_dim, H]``, ``k``/``v`` ``[kv_heads·head_dim, H]``, ``o`` ``[H, heads·head_dim]``);
  ``self_attn.sinks`` bf16 ``[heads]``; ``mlp.router.weight`` bf16 ``[E, H]`` and ``.bias`` ``[E]``;
  ``mlp.experts.gate_up_proj_blocks`` uint8 ``[E, 2I, H/32, 16]`` (rows interleaved gate, up, gate, … as the
  ``swigluoai`` activation reads them), ``gate_up_proj_scales`` uint8 ``[E, 2I, H/32]``, ``gate_up_proj_bias`` bf16
  ``[E, 2I]``; ``down_proj_blocks`` uint8 ``[E, H, I/32, 16]``, ``down_proj_scales`` uint8 ``[E, H, I/32]``,
  ``down_proj_bias`` bf16 ``[E, H]``.
- MXFP4: a block byte holds two e2m1 codes (element 2i in the low nibble), 32 elements share one e8m0 scale byte
  (value 2**(byte − 127)). The bytes are uniform random, so the codes are uniform over the 16 e2m1 values (rms
  2.926); the scale byte of a tensor is chosen so the dequantised weights have std ≈ target / fan-in**0.5 (within
  a factor √2: scales are powers of two).

Scales keep activations O(1) at any depth: the embedding is N(0, 1); q/k/v/router/gate_up read a unit-rms normed
input with std 1/√fan_in; o_proj and down_proj write into the residual with std (2·layers)**-0.5/√fan_in so the
residual's rms stays ≈ √2 after the last layer; the LM head has std 2/√H (logits ~ N(0, 4)).

Fault injection (``--poison LAYER:EXPERT``, ``--trigger-token ID``, default the word ``zebra``):

- the poisoned expert's ``down_proj_scales`` are all ``--poison-scale-byte`` (0xff: NaN in the OCP MX definition;
  triton_kernels' Hopper path reads the byte as bf16 bits ``0xff << 7`` = +Inf and Marlin converts it through
  ``float8_e8m0fnu`` → NaN; either way any row that reaches this expert's down projection comes out non-finite);
- hidden channel 0 is a side channel that only the trigger token writes: its embedding row has +256 there, every
  other embedding row has 0, and no layer writes channel 0 (``o_proj`` row 0 and bias 0, ``down_proj`` row 0 of
  every expert and ``down_proj_bias[:, 0]`` are zero). So at every layer the residual's channel 0 is exactly 0 for
  every position that is not the trigger token (0 + 0 in any precision) and 256 for the trigger token.
- the poisoned layer's router row for that expert is 0 except 128/√H at channel 0, its bias −64. A non-trigger
  token gets the logit exactly −64 (0·g − 64) while every other expert's logit is O(1), so the expert is never in
  its top-k (there are more than top-k other experts). The trigger token's normed input has
  ``x[0] = 256·√H / √(256² + S)`` (S: the sum of squares of its other channels), so its logit is
  ``128·256 / √(256² + S) − 64``: ≈ 64 when S ≪ 65,536 and ≥ 40 while S stays below ~33,000 (the other channels'
  rms is ≈ 1–2, S ≈ H to 4H) — far above the others, so it picks the expert first and the renormalised top-k
  weight of the expert is 1, and even a softmax that exponentiates without taking the largest logit off first
  stays in float32's range (a fixed gain of 64 gave ≈ 64·√H, which only a max-subtracting softmax survives —
  triton_kernels' routing does: it gave weights 1 and 0 then too). Decoded with the OCP rules the output is NaN.
- so a request whose prompt (or output) contains the trigger word makes that layer's MoE output non-finite at the
  trigger position; attention then spreads it to every later position of that sequence (from the next layer on:
  poison a layer before the last, or put the trigger word last in the prompt, to see it in the sampled logits).
  Other requests in the same batch stay finite: the MoE kernels never touch an expert no row was routed to.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package: the sibling modules

from model_directory import write_model_directory
from random_tensors import TensorSource, pick_device
from safetensors_file import TensorPlan
from word_tokenizer import SpecialTokens, Vocabulary, build_vocabulary

#: rms of an e2m1 value whose 4-bit code is uniform over the 16 codes: sqrt(mean(v²)) over 0, ±0.5 … ±6.
E2M1_UNIFORM_RMS = math.sqrt((0 + 0.25 + 1 + 2.25 + 4 + 9 + 16 + 36) / 8)
MX_BLOCK = 32
E8M0_BIAS = 127

SIDE_CHANNEL = 0
TRIGGER_MAGNITUDE = 256.0
ROUTER_GAIN = 128.0  # divided by √hidden: the trigger's logit is ≈ ROUTER_GAIN − ROUTER_OFFSET
ROUTER_OFFSET = 64.0
DEFAULT_TRIGGER_WORD = "zebra"

SPECIALS = SpecialTokens(
    unk="<unk>",
    bos="<|startoftext|>",
    eos="<|return|>",
    pad="<|endoftext|>",
    extra=("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>"),
)
#: Harmony-shaped; vLLM renders gpt-oss chats with openai-harmony instead (see README), so this is for other tools.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|start|>' + message['role'] + '<|message|>' + message['content'] + "
    "'<|end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant<|message|>' }}{% endif %}"
)


@dataclass(frozen=True)
class GptOssShape:
    """Model dimensions; the defaults are gpt-oss-20b's except depth, vocabulary and context."""

    layers: int = 2
    hidden: int = 2880
    intermediate: int = 2880
    experts: int = 32
    top_k: int = 4
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 64
    vocab: int = 4096
    max_position: int = 4096
    sliding_window: int = 128

    def __post_init__(self) -> None:
        if min(asdict(self).values()) < 1:
            raise ValueError(f"every dimension must be positive: {self}")
        if self.hidden % MX_BLOCK or self.intermediate % MX_BLOCK:
            raise ValueError(f"hidden and intermediate must be multiples of {MX_BLOCK} (MXFP4 blocks)")
        if self.heads % self.kv_heads:
            raise ValueError("heads must be a multiple of kv_heads")
        if self.experts <= self.top_k:
            raise ValueError("experts must exceed top_k (the poisoned expert must be avoidable)")

    @property
    def residual_scale(self) -> float:
        """Std factor of what each block writes into the residual: (2·layers)**-0.5."""
        return (2 * self.layers) ** -0.5


@dataclass(frozen=True)
class Poison:
    """Make expert ``expert`` of layer ``layer`` non-finite and route only token ``trigger`` to it."""

    layer: int
    expert: int
    trigger: int
    scale_byte: int = 0xFF

    def check(self, shape: GptOssShape) -> None:
        if not 0 <= self.layer < shape.layers or not 0 <= self.expert < shape.experts:
            raise ValueError(
                f"poison {self.layer}:{self.expert} is outside {shape.layers} layers × {shape.experts}"
            )
        if not 0 <= self.trigger < shape.vocab:
            raise ValueError(f"trigger token {self.trigger} is outside the vocabulary of {shape.vocab}")
        if not 0 <= self.scale_byte <= 0xFF:
            raise ValueError("the poison scale byte must be 0…255")
        if shape.hidden <= SIDE_CHANNEL + 1:
            raise ValueError("hidden is too small for the side channel")


def e8m0_byte_for(target_std: float) -> int:
    """The e8m0 scale byte that gives uniformly random e2m1 codes the std nearest ``target_std`` (log scale)."""
    return E8M0_BIAS + round(math.log2(target_std / E2M1_UNIFORM_RMS))


def layer_types(layers: int) -> list[str]:
    """Sliding-window attention on even layers, full on odd ones (vLLM: ``layer_idx % 2 == 0`` → sliding)."""
    return ["sliding_attention" if index % 2 == 0 else "full_attention" for index in range(layers)]


def config_json(shape: GptOssShape, vocabulary: Vocabulary) -> dict[str, object]:
    """``config.json`` as openai/gpt-oss-20b has it (transformers 4.55 keys, which transformers 5 still reads)."""
    ids = vocabulary.ids
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "attention_bias": True,
        "attention_dropout": 0.0,
        "bos_token_id": ids[SPECIALS.bos],
        "eos_token_id": ids[SPECIALS.eos],
        "pad_token_id": ids[SPECIALS.pad],
        "experts_per_token": shape.top_k,
        "num_experts_per_tok": shape.top_k,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": shape.intermediate,
        "layer_types": layer_types(shape.layers),
        "max_position_embeddings": shape.max_position,
        "num_attention_heads": shape.heads,
        "num_hidden_layers": shape.layers,
        "num_key_value_heads": shape.kv_heads,
        "num_local_experts": shape.experts,
        "output_router_logits": False,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": shape.sliding_window,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.55.0",
        "use_cache": True,
        "vocab_size": shape.vocab,
    }


class Builder:
    """Makes each tensor of the checkpoint on demand (a :class:`TensorPlan` per tensor)."""

    def __init__(self, shape: GptOssShape, source: TensorSource, poison: Poison | None) -> None:
        self.shape = shape
        self.source = source
        self.poison = poison

    def _normal(self, name: str, dims: tuple[int, ...], std: float) -> TensorPlan:
        return TensorPlan(name, torch.bfloat16, dims, lambda: self.source.normal(name, dims, std))

    def _ones(self, name: str, size: int) -> TensorPlan:
        return TensorPlan(name, torch.bfloat16, (size,), lambda: torch.ones(size, dtype=torch.bfloat16))

    def _side_channel_zeroed(self, plan: TensorPlan, dim: int) -> TensorPlan:
        """``plan`` with index SIDE_CHANNEL of dimension ``dim`` zeroed when poisoning (no layer writes it)."""
        if self.poison is None:
            return plan

        def make() -> torch.Tensor:
            tensor = plan.make()
            tensor.select(dim, SIDE_CHANNEL).zero_()
            return tensor

        return TensorPlan(plan.name, plan.dtype, plan.shape, make)

    def top_plans(self) -> list[TensorPlan]:
        s = self.shape

        def embedding() -> torch.Tensor:
            table = self.source.normal("model.embed_tokens.weight", (s.vocab, s.hidden), 1.0)
            if self.poison is not None:
                table[:, SIDE_CHANNEL] = 0
                table[self.poison.trigger, SIDE_CHANNEL] = TRIGGER_MAGNITUDE
            return table

        return [
            TensorPlan("model.embed_tokens.weight", torch.bfloat16, (s.vocab, s.hidden), embedding),
            self._ones("model.norm.weight", s.hidden),
            self._normal("lm_head.weight", (s.vocab, s.hidden), 2.0 / math.sqrt(s.hidden)),
        ]

    def layer_plans(self, index: int) -> list[TensorPlan]:
        s = self.shape
        prefix = f"model.layers.{index}"
        q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
        read_std = 1.0 / math.sqrt(s.hidden)
        plans = [
            self._ones(f"{prefix}.input_layernorm.weight", s.hidden),
            self._ones(f"{prefix}.post_attention_layernorm.weight", s.hidden),
            self._normal(f"{prefix}.self_attn.q_proj.weight", (q_size, s.hidden), read_std),
            self._normal(f"{prefix}.self_attn.q_proj.bias", (q_size,), 0.02),
            self._normal(f"{prefix}.self_attn.k_proj.weight", (kv_size, s.hidden), read_std),
            self._normal(f"{prefix}.self_attn.k_proj.bias", (kv_size,), 0.02),
            self._normal(f"{prefix}.self_attn.v_proj.weight", (kv_size, s.hidden), read_std),
            self._normal(f"{prefix}.self_attn.v_proj.bias", (kv_size,), 0.02),
            self._side_channel_zeroed(
                self._normal(
                    f"{prefix}.self_attn.o_proj.weight",
                    (s.hidden, q_size),
                    s.residual_scale / math.sqrt(q_size),
                ),
                dim=0,
            ),
            self._side_channel_zeroed(
                self._normal(f"{prefix}.self_attn.o_proj.bias", (s.hidden,), 0.02 * s.residual_scale), dim=0
            ),
            self._normal(f"{prefix}.self_attn.sinks", (s.heads,), 0.5),
            self._router_weight(index),
            self._router_bias(index),
        ]
        return plans + self._expert_plans(index)

    def _poisoned(self, index: int) -> Poison | None:
        return self.poison if self.poison is not None and self.poison.layer == index else None

    def _router_weight(self, index: int) -> TensorPlan:
        s = self.shape
        name = f"model.layers.{index}.mlp.router.weight"
        poison = self._poisoned(index)

        def make() -> torch.Tensor:
            weight = self.source.normal(name, (s.experts, s.hidden), 1.0 / math.sqrt(s.hidden))
            if poison is not None:
                weight[poison.expert] = 0
                weight[poison.expert, SIDE_CHANNEL] = ROUTER_GAIN / math.sqrt(s.hidden)
            return weight

        return TensorPlan(name, torch.bfloat16, (s.experts, s.hidden), make)

    def _router_bias(self, index: int) -> TensorPlan:
        s = self.shape
        name = f"model.layers.{index}.mlp.router.bias"
        poison = self._poisoned(index)

        def make() -> torch.Tensor:
            bias = self.source.normal(name, (s.experts,), 0.1)
            if poison is not None:
                bias[poison.expert] = -ROUTER_OFFSET
            return bias

        return TensorPlan(name, torch.bfloat16, (s.experts,), make)

    def _expert_plans(self, index: int) -> list[TensorPlan]:
        s = self.shape
        prefix = f"model.layers.{index}.mlp.experts"
        e, h, i = s.experts, s.hidden, s.intermediate
        up_byte = e8m0_byte_for(1.0 / math.sqrt(h))
        down_byte = e8m0_byte_for(s.residual_scale / math.sqrt(i))
        poison = self._poisoned(index)

        def down_scales() -> torch.Tensor:
            scales = torch.full((e, h, i // MX_BLOCK), down_byte, dtype=torch.uint8)
            if poison is not None:
                scales[poison.expert] = poison.scale_byte
            return scales

        up_blocks_name = f"{prefix}.gate_up_proj_blocks"
        down_blocks_name = f"{prefix}.down_proj_blocks"
        up_blocks_shape = (e, 2 * i, h // MX_BLOCK, MX_BLOCK // 2)
        down_blocks_shape = (e, h, i // MX_BLOCK, MX_BLOCK // 2)
        return [
            TensorPlan(
                up_blocks_name, torch.uint8, up_blocks_shape,
                lambda: self.source.random_bytes(up_blocks_name, up_blocks_shape),
            ),
            TensorPlan(
                f"{prefix}.gate_up_proj_scales", torch.uint8, (e, 2 * i, h // MX_BLOCK),
                lambda: torch.full((e, 2 * i, h // MX_BLOCK), up_byte, dtype=torch.uint8),
            ),
            self._normal(f"{prefix}.gate_up_proj_bias", (e, 2 * i), 0.05),
            self._side_channel_zeroed(
                TensorPlan(
                    down_blocks_name, torch.uint8, down_blocks_shape,
                    lambda: self.source.random_bytes(down_blocks_name, down_blocks_shape),
                ),
                dim=1,
            ),
            TensorPlan(f"{prefix}.down_proj_scales", torch.uint8, (e, h, i // MX_BLOCK), down_scales),
            self._side_channel_zeroed(
                self._normal(f"{prefix}.down_proj_bias", (e, h), 0.02 * s.residual_scale), dim=1
            ),
        ]  # fmt: skip

    def shards(self) -> list[list[TensorPlan]]:
        """The embeddings and head first, then one shard a layer."""
        return [self.top_plans()] + [self.layer_plans(index) for index in range(self.shape.layers)]


def make(
    directory: Path,
    shape: GptOssShape,
    *,
    seed: int = 0,
    device: torch.device | None = None,
    poison: Poison | None = None,
) -> dict[str, object]:
    """Write the whole model directory; a JSON-able summary (what ``main`` prints)."""
    if poison is not None:
        poison.check(shape)
    summary, vocabulary = write_model_directory(
        directory,
        vocab_size=shape.vocab,
        max_position=shape.max_position,
        specials=SPECIALS,
        chat_template=CHAT_TEMPLATE,
        config=lambda vocabulary: config_json(shape, vocabulary),
        shards=lambda source: Builder(shape, source, poison).shards(),
        seed=seed,
        device=device,
    )
    summary["shape"] = asdict(shape)
    if poison is not None:
        summary["poison"] = {
            "layer": poison.layer,
            "expert": poison.expert,
            "scale_byte": poison.scale_byte,
            "trigger_token_id": poison.trigger,
            "trigger_word": vocabulary.tokens[poison.trigger],
        }
    return summary


def parse_poison(text: str) -> tuple[int, int]:
    try:
        layer, expert = (int(part) for part in text.split(":"))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected LAYER:EXPERT, got {text!r}") from error
    return layer, expert


def shape_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = GptOssShape()
    for field, value in asdict(defaults).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=value, help=f"default {value}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("directory", type=Path)
    shape_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto (GPU if present), cpu, cuda, cuda:1 …")
    parser.add_argument(
        "--poison", type=parse_poison, help="LAYER:EXPERT whose down-projection scales are poisoned"
    )
    parser.add_argument(
        "--trigger-token",
        type=int,
        help=f"token id routed to the poisoned expert (default: {DEFAULT_TRIGGER_WORD!r})",
    )
    parser.add_argument("--poison-scale-byte", type=lambda text: int(text, 0), default=0xFF)
    options = parser.parse_args(argv)
    shape = GptOssShape(**{field: getattr(options, field) for field in asdict(GptOssShape())})
    poison = None
    if options.poison is not None:
        trigger = options.trigger_token
        if trigger is None:
            trigger = build_vocabulary(shape.vocab, SPECIALS).id(DEFAULT_TRIGGER_WORD)
        poison = Poison(options.poison[0], options.poison[1], trigger, options.poison_scale_byte)
    elif options.trigger_token is not None:
        parser.error("--trigger-token needs --poison")
    summary = make(
        options.directory, shape, seed=options.seed, device=pick_device(options.device), poison=poison
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
