"""Write a random-weight Qwen3-MoE checkpoint with GPTQ int4 experts that vLLM 0.25.1 serves through Marlin.

    python3 tools/models/make_moe_gptq.py /tmp/models/qwen3-moe-gptq-2l          # 2 layers, 64 experts, top-8
    python3 tools/models/make_moe_gptq.py /tmp/models/qwen3-moe-gptq-24l --layers 24
    python3 tools/models/make_moe_gptq.py /tmp/models/qwen3-moe-bf16-2l --unquantized   # bf16 experts, 1.3 GB

``--unquantized`` writes the same model with bf16 experts and no ``quantization_config``: vLLM 0.25.1 gives its
``FusedMoE`` layers ``UnquantizedFusedMoEMethod``, which on Hopper picks the ``TRITON`` backend (``TritonExperts`` →
``invoke_fused_moe_triton_kernel`` → ``fused_moe_kernel``). Served with ``--quantization moe_wna16``, the GPTQ
checkpoint goes to ``MoeWNA16Method`` → ``fused_experts`` → ``fused_moe_kernel_gptq_awq`` (Triton) for batches of
more than 6 · experts / top_k tokens, the CUDA ``moe_wna16_gemm`` below (``tools/models/README.md``).

Needs torch only; uses the GPU for the random words when there is one (``--device``). Writes ``config.json``
(``Qwen3MoeForCausalLM``, ``quantization_config`` ``gptq`` 4-bit, group 128, symmetric, no act-order),
``generation_config.json``, the tokenizer (``word_tokenizer``), one safetensors shard for the embeddings and head
plus one a layer, and ``model.safetensors.index.json``; prints a JSON summary.

Why Qwen3-MoE: vLLM 0.25.1 maps ``quant_method: gptq`` to ``AutoGPTQConfig`` for every architecture, and its
``AutoGPTQMoEMethod`` picks the ``MARLIN`` WNA16 backend (``MarlinExperts`` → ``fused_marlin_moe`` →
``moe_wna16_marlin_gemm``) for any ``FusedMoE``; Qwen3-MoE has no shared expert, no dense layers
(``decoder_sparse_step`` 1) and is the architecture of the common real GPTQ MoE checkpoints
(Qwen3-30B-A3B-GPTQ-Int4), whose dimensions the defaults follow except the expert count and depth.

Checkpoint tensors (H hidden, I moe_intermediate, E experts; names as Qwen3-MoE GPTQ checkpoints have them):

- bf16: ``model.embed_tokens.weight`` / ``lm_head.weight`` ``[vocab, H]``, ``model.norm.weight``, a layer's
  ``input_layernorm`` / ``post_attention_layernorm`` ``[H]``, ``self_attn.{q,k,v,o}_proj.weight`` (no biases),
  ``self_attn.{q,k}_norm.weight`` ``[head_dim]``, the router ``mlp.gate.weight`` ``[E, H]``;
- per expert ``e`` and projection ``p`` in gate_proj, up_proj (K = H, N = I) and down_proj (K = I, N = H):
  ``mlp.experts.{e}.{p}.qweight`` int32 ``[K/8, N]`` (eight 4-bit codes a word along K, row k = 8r + j in bits
  4j…4j+3), ``.qzeros`` int32 ``[K/128, N/8]`` (0x77777777: zero point 8 stored minus one, as GPTQ v1 writes it;
  vLLM ignores it for symmetric weights), ``.scales`` float16 ``[K/128, N]``, ``.g_idx`` int32 ``[K]`` (= k // 128).
  Value = (code − 8) · scale[k // 128, n] (vLLM's ``uint4b8``).
- attention, router, embeddings and head stay unquantized: ``modules_in_block_to_quantize`` is ``["mlp.experts"]``,
  so ``AutoGPTQConfig`` gives every linear layer whose name does not contain it ``UnquantizedLinearMethod`` (the
  experts are a ``FusedMoE``, always quantized). That keeps the linear path out of the picture (no Machete/Marlin
  dense kernels) and the checkpoint simple.

With ``--unquantized`` each expert projection is one bf16 ``mlp.experts.{e}.{p}.weight`` ``[N, K]`` (``nn.Linear``
layout, as Qwen/Qwen3-30B-A3B has it; vLLM stacks gate and up into ``w13_weight`` ``[E, 2I, H]`` and down into
``w2_weight`` ``[E, H, I]``), normal with the target std below.

Scales: codes are uniform random (rms of code − 8: 4.64); per group the fp16 scale is target std / 4.64 times a
jitter uniform in [0.75, 1.25); target std 1/√H for gate/up and (2·layers)**-0.5/√I for down, the same residual
budget as the gpt-oss generator, so activations stay O(1) at any depth.
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
from word_tokenizer import SpecialTokens, Vocabulary

BITS = 4
PACK = 32 // BITS
GROUP_SIZE = 128
ZERO_WORD = 0x77777777
#: rms of (code − 8) for a code uniform over 0…15.
CODE_RMS = math.sqrt(sum((code - 8) ** 2 for code in range(16)) / 16)
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

SPECIALS = SpecialTokens(
    unk="<unk>", bos="<|endoftext|>", eos="<|im_end|>", pad="<|endoftext|>", extra=("<|im_start|>",)
)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' + message['content'] + '<|im_end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
)


@dataclass(frozen=True)
class MoeShape:
    """Model dimensions; the defaults are Qwen3-30B-A3B's except experts (64, not 128), depth and vocabulary."""

    layers: int = 2
    hidden: int = 2048
    intermediate: int = 768
    experts: int = 64
    top_k: int = 8
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    vocab: int = 4096
    max_position: int = 4096

    def __post_init__(self) -> None:
        if min(asdict(self).values()) < 1:
            raise ValueError(f"every dimension must be positive: {self}")
        # vLLM's check_moe_marlin_supports_layer: hidden % 128 and intermediate % group_size; GPTQ packing: % 8
        if self.hidden % 128 or self.intermediate % GROUP_SIZE:
            raise ValueError(
                f"hidden must be a multiple of 128 and intermediate of {GROUP_SIZE} (Marlin MoE)"
            )
        if self.heads % self.kv_heads:
            raise ValueError("heads must be a multiple of kv_heads")
        if self.experts < self.top_k:
            raise ValueError("experts must be at least top_k")

    @property
    def residual_scale(self) -> float:
        return (2 * self.layers) ** -0.5


def config_json(shape: MoeShape, vocabulary: Vocabulary, *, unquantized: bool = False) -> dict[str, object]:
    """``config.json`` in the form of Qwen/Qwen3-30B-A3B's (transformers 4.51 keys, read by transformers 5); without
    ``quantization_config`` when ``unquantized``."""
    ids = vocabulary.ids
    config: dict[str, object] = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[SPECIALS.bos],
        "eos_token_id": ids[SPECIALS.eos],
        "decoder_sparse_step": 1,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden,
        "initializer_range": 0.02,
        "intermediate_size": 3 * shape.hidden,
        "max_position_embeddings": shape.max_position,
        "max_window_layers": shape.layers,
        "mlp_only_layers": [],
        "moe_intermediate_size": shape.intermediate,
        "norm_topk_prob": True,
        "num_attention_heads": shape.heads,
        "num_experts": shape.experts,
        "num_experts_per_tok": shape.top_k,
        "num_hidden_layers": shape.layers,
        "num_key_value_heads": shape.kv_heads,
        "output_router_logits": False,
        "quantization_config": {
            "quant_method": "gptq",
            "bits": BITS,
            "group_size": GROUP_SIZE,
            "sym": True,
            "desc_act": False,
            "lm_head": False,
            "checkpoint_format": "gptq",
            "modules_in_block_to_quantize": ["mlp.experts"],
        },
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": shape.vocab,
    }
    if unquantized:
        del config["quantization_config"]
    return config


def projection_dims(shape: MoeShape, projection: str) -> tuple[int, int]:
    """(K, N) of an expert projection: the input and output sizes."""
    if projection == "down_proj":
        return shape.intermediate, shape.hidden
    return shape.hidden, shape.intermediate


class Builder:
    """Makes each tensor of the checkpoint on demand (a :class:`TensorPlan` per tensor)."""

    def __init__(self, shape: MoeShape, source: TensorSource, *, unquantized: bool = False) -> None:
        self.shape = shape
        self.source = source
        self.unquantized = unquantized

    def _normal(self, name: str, dims: tuple[int, ...], std: float) -> TensorPlan:
        return TensorPlan(name, torch.bfloat16, dims, lambda: self.source.normal(name, dims, std))

    def _ones(self, name: str, size: int) -> TensorPlan:
        return TensorPlan(name, torch.bfloat16, (size,), lambda: torch.ones(size, dtype=torch.bfloat16))

    def top_plans(self) -> list[TensorPlan]:
        s = self.shape
        return [
            self._normal("model.embed_tokens.weight", (s.vocab, s.hidden), 1.0),
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
            self._normal(f"{prefix}.self_attn.k_proj.weight", (kv_size, s.hidden), read_std),
            self._normal(f"{prefix}.self_attn.v_proj.weight", (kv_size, s.hidden), read_std),
            self._normal(
                f"{prefix}.self_attn.o_proj.weight", (s.hidden, q_size), s.residual_scale / math.sqrt(q_size)
            ),
            self._ones(f"{prefix}.self_attn.q_norm.weight", s.head_dim),
            self._ones(f"{prefix}.self_attn.k_norm.weight", s.head_dim),
            self._normal(f"{prefix}.mlp.gate.weight", (s.experts, s.hidden), read_std),
        ]
        for expert in range(s.experts):
            for projection in PROJECTIONS:
                stem = f"{prefix}.mlp.experts.{expert}.{projection}"
                if self.unquantized:
                    k, n = projection_dims(s, projection)
                    plans.append(self._normal(f"{stem}.weight", (n, k), self._target_std(projection)))
                else:
                    plans += self._gptq_plans(stem, projection)
        return plans

    def _target_std(self, projection: str) -> float:
        """Std of an expert projection's values: 1/√K for gate/up, the residual share over √K for down."""
        k, _ = projection_dims(self.shape, projection)
        return (self.shape.residual_scale if projection == "down_proj" else 1.0) / math.sqrt(k)

    def _gptq_plans(self, prefix: str, projection: str) -> list[TensorPlan]:
        s = self.shape
        k, n = projection_dims(s, projection)
        groups = k // GROUP_SIZE
        target = self._target_std(projection)

        def scales() -> torch.Tensor:
            jitter = self.source.uniform(f"{prefix}.scales", (groups, n), 0.75, 1.25)
            return (jitter * (target / CODE_RMS)).to(torch.float16)

        qweight_name = f"{prefix}.qweight"
        return [
            TensorPlan(
                qweight_name, torch.int32, (k // PACK, n),
                lambda: self.source.random_int32(qweight_name, (k // PACK, n)),
            ),
            TensorPlan(
                f"{prefix}.qzeros", torch.int32, (groups, n // PACK),
                lambda: torch.full((groups, n // PACK), ZERO_WORD, dtype=torch.int32),
            ),
            TensorPlan(f"{prefix}.scales", torch.float16, (groups, n), scales),
            TensorPlan(
                f"{prefix}.g_idx", torch.int32, (k,),
                lambda: torch.arange(k, dtype=torch.int32) // GROUP_SIZE,
            ),
        ]  # fmt: skip

    def shards(self) -> list[list[TensorPlan]]:
        return [self.top_plans()] + [self.layer_plans(index) for index in range(self.shape.layers)]


def make(
    directory: Path,
    shape: MoeShape,
    *,
    seed: int = 0,
    device: torch.device | None = None,
    unquantized: bool = False,
) -> dict[str, object]:
    """Write the whole model directory; a JSON-able summary (what ``main`` prints). ``unquantized``: bf16 experts
    and no ``quantization_config`` instead of GPTQ int4."""
    summary, _vocabulary = write_model_directory(
        directory,
        vocab_size=shape.vocab,
        max_position=shape.max_position,
        specials=SPECIALS,
        chat_template=CHAT_TEMPLATE,
        config=lambda vocabulary: config_json(shape, vocabulary, unquantized=unquantized),
        shards=lambda source: Builder(shape, source, unquantized=unquantized).shards(),
        seed=seed,
        device=device,
    )
    return {**summary, "shape": asdict(shape), "experts": "bf16" if unquantized else "gptq-int4"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("directory", type=Path)
    for field, value in asdict(MoeShape()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=value, help=f"default {value}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto (GPU if present), cpu, cuda, cuda:1 …")
    parser.add_argument(
        "--unquantized",
        action="store_true",
        help="bf16 experts, no quantization_config (vLLM: UnquantizedFusedMoEMethod → Triton fused_moe_kernel)",
    )
    options = parser.parse_args(argv)
    shape = MoeShape(**{field: getattr(options, field) for field in asdict(MoeShape())})
    summary = make(
        options.directory,
        shape,
        seed=options.seed,
        device=pick_device(options.device),
        unquantized=options.unquantized,
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
