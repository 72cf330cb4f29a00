"""``tools/models/make_gpt_oss.py``: a tiny checkpoint has exactly the tensors vLLM 0.25.1's gpt-oss MXFP4 loader
reads, its MXFP4 experts decode (with moereplay's reference) to finite, O(1) MoE outputs, and ``--poison`` routes
the trigger token — and only it — to an expert whose output is non-finite.

What vLLM 0.25.1 expects, read from its source (``vllm/model_executor/models/gpt_oss.py``:
``GptOssForCausalLM.hf_to_vllm_mapper`` and ``GptOssModel._load_weights_mxfp4``;
``vllm/model_executor/layers/quantization/mxfp4.py``: ``GptOssMxfp4MoEMethod.create_weights``), with H hidden,
I intermediate, E experts:

- ``.self_attn.`` → ``.attn.``; q/k/v → ``qkv_proj`` (stacked); ``.embed_tokens.weight`` → ``.embedding.weight``;
  ``gate_up_proj_blocks/_scales/_bias`` → ``w13_weight/_weight_scale/_bias``, ``down_proj_*`` → ``w2_*``;
- ``w13_weight`` uint8 ``[E, 2I, H/2]`` ← ``blocks.view(E, 2I, -1)``; ``w13_weight_scale`` uint8 ``[E, 2I, H/32]``;
  ``w2_weight`` uint8 ``[E, H, I/2]`` ← ``blocks.view(E, -1, I/2)``; ``w2_weight_scale`` uint8 ``[E, H, I/32]``;
  ``w13_bias`` ``[E, 2I]``, ``w2_bias`` ``[E, H]`` (bf16); ``sinks`` ``[heads]``; router ``[E, H]`` + ``[E]``.
- ``swigluoai`` reads gate and up interleaved (``x[..., ::2]``, ``x[..., 1::2]``), alpha 1.702, limit 7.
A name the loader does not map is skipped silently for quantized models (no strict check), so the names matter.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from model_files import load_tool, read_checkpoint, tensors_by_name

from moereplay.reference.hopper_mxfp4 import decode_e8m0_as_hopper_kernel
from moereplay.reference.matmul_ogs import dequantize_expert_weight
from moereplay.reference.numerics import E2M1_VALUES

make_gpt_oss = load_tool("make_gpt_oss")

SHAPE = make_gpt_oss.GptOssShape(
    layers=2, hidden=64, intermediate=96, experts=8, top_k=2, heads=4, kv_heads=2, head_dim=16, vocab=1024
)
POISON_LAYER, POISON_EXPERT = 1, 5


@pytest.fixture(scope="module")
def clean_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gpt-oss") / "clean"
    make_gpt_oss.make(directory, SHAPE, seed=3, device=torch.device("cpu"))
    return directory


@pytest.fixture(scope="module")
def poisoned_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    directory = tmp_path_factory.mktemp("gpt-oss") / "poisoned"
    trigger = make_gpt_oss.build_vocabulary(SHAPE.vocab, make_gpt_oss.SPECIALS).id("zebra")
    poison = make_gpt_oss.Poison(POISON_LAYER, POISON_EXPERT, trigger)
    summary = make_gpt_oss.make(directory, SHAPE, seed=3, device=torch.device("cpu"), poison=poison)
    assert summary["poison"]["trigger_word"] == "zebra"
    return directory, trigger


def expected_tensors(s: Any) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Checkpoint name → (safetensors dtype, shape), as openai/gpt-oss-20b stores them."""
    h, i, e = s.hidden, s.intermediate, s.experts
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    tensors = {
        "model.embed_tokens.weight": ("BF16", (s.vocab, h)),
        "model.norm.weight": ("BF16", (h,)),
        "lm_head.weight": ("BF16", (s.vocab, h)),
    }
    for layer in range(s.layers):
        p = f"model.layers.{layer}"
        tensors |= {
            f"{p}.input_layernorm.weight": ("BF16", (h,)),
            f"{p}.post_attention_layernorm.weight": ("BF16", (h,)),
            f"{p}.self_attn.q_proj.weight": ("BF16", (q, h)),
            f"{p}.self_attn.q_proj.bias": ("BF16", (q,)),
            f"{p}.self_attn.k_proj.weight": ("BF16", (kv, h)),
            f"{p}.self_attn.k_proj.bias": ("BF16", (kv,)),
            f"{p}.self_attn.v_proj.weight": ("BF16", (kv, h)),
            f"{p}.self_attn.v_proj.bias": ("BF16", (kv,)),
            f"{p}.self_attn.o_proj.weight": ("BF16", (h, q)),
            f"{p}.self_attn.o_proj.bias": ("BF16", (h,)),
            f"{p}.self_attn.sinks": ("BF16", (s.heads,)),
            f"{p}.mlp.router.weight": ("BF16", (e, h)),
            f"{p}.mlp.router.bias": ("BF16", (e,)),
            f"{p}.mlp.experts.gate_up_proj_blocks": ("U8", (e, 2 * i, h // 32, 16)),
            f"{p}.mlp.experts.gate_up_proj_scales": ("U8", (e, 2 * i, h // 32)),
            f"{p}.mlp.experts.gate_up_proj_bias": ("BF16", (e, 2 * i)),
            f"{p}.mlp.experts.down_proj_blocks": ("U8", (e, h, i // 32, 16)),
            f"{p}.mlp.experts.down_proj_scales": ("U8", (e, h, i // 32)),
            f"{p}.mlp.experts.down_proj_bias": ("BF16", (e, h)),
        }
    return tensors


#: GptOssForCausalLM.hf_to_vllm_mapper.orig_to_new_suffix, the entries a MXFP4 checkpoint meets.
VLLM_SUFFIXES = {
    ".embed_tokens.weight": ".embedding.weight",
    ".gate_up_proj_blocks": ".w13_weight",
    ".down_proj_blocks": ".w2_weight",
    ".gate_up_proj_scales": ".w13_weight_scale",
    ".down_proj_scales": ".w2_weight_scale",
    ".gate_up_proj_bias": ".w13_bias",
    ".down_proj_bias": ".w2_bias",
}


def vllm_parameter(name: str) -> str:
    name = name.replace(".self_attn.", ".attn.")
    for old, new in VLLM_SUFFIXES.items():
        if name.endswith(old):
            name = name[: -len(old)] + new
            break
    for shard in (".q_proj", ".k_proj", ".v_proj"):  # stacked_params_mapping
        name = name.replace(shard, ".qkv_proj")
    return name


def vllm_parameters(s: Any) -> set[str]:
    """GptOssForCausalLM's parameter names (TP 1) that come from the checkpoint."""
    names = {"model.embedding.weight", "model.norm.weight", "lm_head.weight"}
    for layer in range(s.layers):
        p = f"model.layers.{layer}"
        names |= {
            f"{p}.input_layernorm.weight",
            f"{p}.post_attention_layernorm.weight",
            f"{p}.attn.qkv_proj.weight",
            f"{p}.attn.qkv_proj.bias",
            f"{p}.attn.o_proj.weight",
            f"{p}.attn.o_proj.bias",
            f"{p}.attn.sinks",
            f"{p}.mlp.router.weight",
            f"{p}.mlp.router.bias",
        }
        names |= {f"{p}.mlp.experts.{n}" for n in ("w13_weight", "w13_weight_scale", "w13_bias")}
        names |= {f"{p}.mlp.experts.{n}" for n in ("w2_weight", "w2_weight_scale", "w2_bias")}
    return names


def test_checkpoint_holds_exactly_the_tensors_vllm_loads(clean_model: Path) -> None:
    files = read_checkpoint(clean_model)
    found = tensors_by_name(files)
    expected = expected_tensors(SHAPE)
    assert set(found) == set(expected)
    for name, (dtype, shape) in expected.items():
        entry = found[name][1]
        assert (entry.dtype, entry.shape) == (dtype, shape), name
    assert {vllm_parameter(name) for name in found} == vllm_parameters(SHAPE)

    # the loader's views of the expert tensors land on create_weights' parameter shapes
    e, h, i = SHAPE.experts, SHAPE.hidden, SHAPE.intermediate
    w13 = found["model.layers.0.mlp.experts.gate_up_proj_blocks"][0]
    w2 = found["model.layers.0.mlp.experts.down_proj_blocks"][0]
    assert w13.tensor("model.layers.0.mlp.experts.gate_up_proj_blocks").view(e, 2 * i, -1).shape == (
        e,
        2 * i,
        h // 2,
    )
    assert w2.tensor("model.layers.0.mlp.experts.down_proj_blocks").view(e, -1, i // 2).shape == (
        e,
        h,
        i // 2,
    )

    # one shard for the top tensors, one a layer; the index maps every tensor to its file
    index = json.loads((clean_model / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {name: file.path.name for name, (file, _) in found.items()}
    assert len(files) == 1 + SHAPE.layers
    for file in files.values():
        assert file.metadata == {"format": "pt"}
        assert (8 + file.header_length) % 8 == 0
        spans = sorted((entry.begin, entry.end) for entry in file.entries.values())
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        assert file.path.stat().st_size == 8 + file.header_length + spans[-1][1]


def test_config_is_gpt_oss_20b_shaped_with_mxfp4(clean_model: Path) -> None:
    config = json.loads((clean_model / "config.json").read_text())
    assert config["architectures"] == ["GptOssForCausalLM"] and config["model_type"] == "gpt_oss"
    assert (
        config["quantization_config"]["quant_method"] == "mxfp4"
    )  # → GptOssMxfp4Config (model_type gpt_oss)
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["sliding_window"] == 128 and config["rope_scaling"]["rope_type"] == "yarn"
    assert config["rope_theta"] == 150000 and config["rope_scaling"]["factor"] == 32.0
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (SHAPE.experts, SHAPE.top_k)
    assert config["experts_per_token"] == SHAPE.top_k and config["swiglu_limit"] == 7.0
    assert config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is False

    tokenizer = json.loads((clean_model / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    assert tokenizer["model"]["type"] == "WordLevel" and tokenizer["pre_tokenizer"] == {"type": "Whitespace"}
    assert sorted(vocab.values()) == list(range(config["vocab_size"]))  # every id the model emits decodes
    specials = {item["content"]: item["id"] for item in tokenizer["added_tokens"]}
    assert all(item["special"] for item in tokenizer["added_tokens"])
    assert all(vocab[token] == index for token, index in specials.items())
    tokenizer_config = json.loads((clean_model / "tokenizer_config.json").read_text())
    for key, token_id in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("pad_token", "pad_token_id"),
    ):
        assert vocab[tokenizer_config[key]] == config[token_id]
    # what GptOssReasoningParser needs if a structured-output request builds it
    assert "<|end|>" in specials and "<|channel|>" in specials and "final" in vocab


def _dense_experts(files_by_name: dict, layer: int, projection: str, count: int) -> torch.Tensor:
    """float32 ``[E, K, N]`` of one expert projection, decoded by moereplay's MXFP4 reference (OCP rules)."""
    file, _ = files_by_name[f"model.layers.{layer}.mlp.experts.{projection}_blocks"]
    blocks = file.tensor(f"model.layers.{layer}.mlp.experts.{projection}_blocks")
    scales = file.tensor(f"model.layers.{layer}.mlp.experts.{projection}_scales")
    n = blocks.shape[1]
    return torch.stack(
        [
            # [K/2, N] with stride 1 along K: packed along K, as vLLM hands it to matmul_ogs
            dequantize_expert_weight(blocks[e].reshape(n, -1).T, scales[e].T)
            for e in range(count)
        ]
    )


def test_mxfp4_values_decode_as_the_format_says(clean_model: Path) -> None:
    found = tensors_by_name(read_checkpoint(clean_model))
    file, _ = found["model.layers.1.mlp.experts.down_proj_blocks"]
    blocks = file.tensor("model.layers.1.mlp.experts.down_proj_blocks")
    scales = file.tensor("model.layers.1.mlp.experts.down_proj_scales")
    dense = _dense_experts(found, 1, "down_proj", SHAPE.experts)  # [E, K = I, N = H]
    for expert, row, k in ((0, 0, 0), (3, 17, 33), (7, SHAPE.hidden - 1, SHAPE.intermediate - 1), (2, 5, 62)):
        byte = int(blocks[expert, row, k // 32, (k % 32) // 2])
        code = byte & 0xF if k % 2 == 0 else byte >> 4  # element 2i in the low nibble
        factor = 2.0 ** (int(scales[expert, row, k // 32]) - 127)
        assert dense[expert, k, row].item() == E2M1_VALUES[code] * factor

    # uniform random codes × one power-of-two scale: std within √2 of the target
    target = SHAPE.residual_scale / math.sqrt(SHAPE.intermediate)
    assert target / math.sqrt(2) < dense.std().item() < target * math.sqrt(2)
    up = _dense_experts(found, 1, "gate_up_proj", SHAPE.experts)
    assert 1 / math.sqrt(2 * SHAPE.hidden) < up.std().item() < math.sqrt(2 / SHAPE.hidden)


def rms_norm(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def swigluoai(h: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    gate, up = h[..., ::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


class MoeLayer:
    """One gpt-oss MoE layer in fp32, experts dequantised with moereplay's MXFP4 reference."""

    def __init__(self, model: Path, layer: int) -> None:
        found = tensors_by_name(read_checkpoint(model))
        p = f"model.layers.{layer}.mlp"

        def load(name: str) -> torch.Tensor:
            return found[name][0].tensor(name).float()

        self.router_weight = load(f"{p}.router.weight")
        self.router_bias = load(f"{p}.router.bias")
        self.w13 = _dense_experts(found, layer, "gate_up_proj", SHAPE.experts)  # [E, H, 2I]
        self.b13 = load(f"{p}.experts.gate_up_proj_bias")
        self.w2 = _dense_experts(found, layer, "down_proj", SHAPE.experts)  # [E, I, H]
        self.b2 = load(f"{p}.experts.down_proj_bias")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids and their renormalised weights (vLLM: renormalize=True)."""
        values, ids = (x @ self.router_weight.T + self.router_bias).topk(SHAPE.top_k, dim=-1)
        return ids, values.softmax(dim=-1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = torch.zeros_like(x)
        for token in range(x.shape[0]):
            for slot in range(SHAPE.top_k):
                e = int(ids[token, slot])
                activated = swigluoai(x[token] @ self.w13[e] + self.b13[e])
                out[token] += weights[token, slot] * (activated @ self.w2[e] + self.b2[e])
        return out


def test_moe_layer_forward_is_finite_and_order_one(clean_model: Path) -> None:
    found = tensors_by_name(read_checkpoint(clean_model))
    embedding = found["model.embed_tokens.weight"][0].tensor("model.embed_tokens.weight").float()
    tokens = torch.arange(10, 40)
    x = rms_norm(embedding[tokens])
    layer = MoeLayer(clean_model, 0)
    out = layer(x)
    assert torch.isfinite(out).all()
    rms = out.pow(2).mean().sqrt().item()
    assert 0.02 < rms < 3.0, rms
    ids, _ = layer.route(x)
    assert len(set(ids.flatten().tolist())) > SHAPE.top_k  # routing spreads over experts


def test_poison_routes_only_the_trigger_token_and_makes_it_non_finite(
    poisoned_model: tuple[Path, int],
) -> None:
    model, trigger = poisoned_model
    found = tensors_by_name(read_checkpoint(model))

    def load(name: str) -> torch.Tensor:
        return found[name][0].tensor(name).float()

    side = make_gpt_oss.SIDE_CHANNEL
    # no layer writes the side channel: o_proj row and bias, every expert's down-projection row and bias
    for layer in range(SHAPE.layers):
        p = f"model.layers.{layer}"
        assert (
            not load(f"{p}.self_attn.o_proj.weight")[side].any()
            and load(f"{p}.self_attn.o_proj.bias")[side] == 0
        )
        blocks = found[f"{p}.mlp.experts.down_proj_blocks"][0].tensor(f"{p}.mlp.experts.down_proj_blocks")
        assert not blocks[:, side].any() and not load(f"{p}.mlp.experts.down_proj_bias")[:, side].any()
    embedding = load("model.embed_tokens.weight")
    assert embedding[trigger, side] == make_gpt_oss.TRIGGER_MAGNITUDE
    assert (embedding[:, side] != 0).sum() == 1

    # whatever attention and earlier layers add (anything with a zero side channel, rms up to 4), only the trigger
    # token routes to the poisoned expert — for every token of the vocabulary
    moe = MoeLayer(model, POISON_LAYER)
    generator = torch.Generator().manual_seed(0)
    for spread in (0.0, 1.0, 4.0):
        added = torch.randn(embedding.shape, generator=generator) * spread
        added[:, side] = 0
        ids, weights = moe.route(rms_norm(embedding + added))
        chosen = (ids == POISON_EXPERT).any(dim=-1)
        assert chosen.nonzero().flatten().tolist() == [trigger]
        assert weights[trigger][ids[trigger] == POISON_EXPERT].item() == 1.0
        # and a softmax that exponentiates the logits without taking the largest off first stays finite
        logits = rms_norm(embedding + added)[trigger] @ moe.router_weight.T + moe.router_bias
        assert 30.0 < logits.max().item() < 80.0, logits.max().item()

    tokens = torch.tensor([11, trigger, 12, 13])
    out = moe(rms_norm(embedding[tokens]))
    finite = torch.isfinite(out).all(dim=-1).tolist()
    assert finite == [True, False, True, True]

    # the poisoned scales: NaN under the OCP rules (moereplay's reference), +Inf as the Hopper kernel upcasts them
    scales = found[f"model.layers.{POISON_LAYER}.mlp.experts.down_proj_scales"][0].tensor(
        f"model.layers.{POISON_LAYER}.mlp.experts.down_proj_scales"
    )
    assert (scales[POISON_EXPERT] == 0xFF).all() and (scales[POISON_EXPERT - 1] != 0xFF).all()
    assert decode_e8m0_as_hopper_kernel(scales[POISON_EXPERT, :1, :1]).item() == math.inf


def test_poison_and_shape_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="outside"):
        make_gpt_oss.make(
            tmp_path / "m", SHAPE, device=torch.device("cpu"), poison=make_gpt_oss.Poison(2, 0, 5)
        )
    with pytest.raises(ValueError, match="multiples of 32"):
        make_gpt_oss.GptOssShape(hidden=48)
    with pytest.raises(ValueError, match="exceed top_k"):
        make_gpt_oss.GptOssShape(experts=4, top_k=4)
    assert make_gpt_oss.parse_poison("3:7") == (3, 7)
    assert make_gpt_oss.e8m0_byte_for(1 / math.sqrt(2880)) == 120  # gpt-oss-20b gate_up: 2**-7 × rms 2.93
