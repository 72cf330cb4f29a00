"""``tools/models/make_moe_gptq.py``: a tiny Qwen3-MoE GPTQ checkpoint has exactly the tensors vLLM 0.25.1 loads
into ``AutoGPTQMoEMethod`` (Marlin MoE) and unquantized attention, and its experts decode to a finite MoE layer.

What vLLM 0.25.1 expects, read from its source, with H hidden, I moe_intermediate, E experts, G = 128:

- ``quant_method: gptq`` → ``AutoGPTQConfig`` (``quantization/auto_gptq.py``); a ``FusedMoE`` gets
  ``AutoGPTQMoEMethod`` when ``check_moe_marlin_supports_layer`` holds (H % 128 == 0, I % G == 0, G in
  {-1, 32, 64, 128}), which selects the ``MARLIN`` WNA16 backend (``oracle/int_wna16.py``) on CUDA below SM100;
- ``AutoGPTQMoEMethod.create_weights``: ``w13_qweight`` int32 ``[E, H/8, 2I]``, ``w2_qweight`` ``[E, I/8, H]``,
  ``w13_scales`` ``[E, H/G, 2I]``, ``w2_scales`` ``[E, I/G, H]``, ``w13_qzeros`` ``[E, H/G, 2I/8]``, ``w2_qzeros``
  ``[E, I/G, H/8]``, ``w13_g_idx`` ``[E, H]``, ``w2_g_idx`` ``[E, I]``; ``RoutedExperts`` maps the checkpoint's
  ``experts.{e}.gate_proj.`` / ``up_proj.`` to halves of ``w13_*`` (``is_transposed``: the N axis) and
  ``down_proj.`` to ``w2_*``, so a per-expert gate/up tensor is ``[K-ish, I]`` and down ``[…, H]``;
- linear layers are quantized only when ``modules_in_block_to_quantize`` names them (substring match);
  ``Qwen3MoeModel`` maps ``q/k/v_proj`` to ``qkv_proj``; ``mlp.gate`` is the router.
- GPTQ int4 symmetric (``uint4b8``): code c in bits 4j…4j+3 of ``qweight[r, n]`` is row k = 8r + j; value
  (c − 8)·scale[g_idx[k], n].
- ``--unquantized``: no ``quantization_config`` → ``UnquantizedFusedMoEMethod.create_weights``: ``w13_weight`` bf16
  ``[E, 2I, H]``, ``w2_weight`` ``[E, H, I]``; the per-expert checkpoint tensors ``experts.{e}.gate_proj.weight`` /
  ``up_proj.weight`` ``[I, H]`` fill the halves of ``w13_weight[e]`` along dim 0, ``down_proj.weight`` ``[H, I]`` is
  ``w2_weight[e]``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from model_files import load_tool, read_checkpoint, tensors_by_name

make_moe_gptq = load_tool("make_moe_gptq")

SHAPE = make_moe_gptq.MoeShape(
    layers=2, hidden=256, intermediate=128, experts=8, top_k=2, heads=4, kv_heads=2, head_dim=64, vocab=1024
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gptq") / "qwen3-moe"
    make_moe_gptq.make(directory, SHAPE, seed=5, device=torch.device("cpu"))
    return directory


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("bf16") / "qwen3-moe"
    make_moe_gptq.make(directory, SHAPE, seed=5, device=torch.device("cpu"), unquantized=True)
    return directory


def expected_tensors(s: Any, *, unquantized: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    h, i, e, g = s.hidden, s.intermediate, s.experts, 128
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
            f"{p}.self_attn.k_proj.weight": ("BF16", (kv, h)),
            f"{p}.self_attn.v_proj.weight": ("BF16", (kv, h)),
            f"{p}.self_attn.o_proj.weight": ("BF16", (h, q)),
            f"{p}.self_attn.q_norm.weight": ("BF16", (s.head_dim,)),
            f"{p}.self_attn.k_norm.weight": ("BF16", (s.head_dim,)),
            f"{p}.mlp.gate.weight": ("BF16", (e, h)),
        }
        for expert in range(e):
            for projection, (k, n) in (("gate_proj", (h, i)), ("up_proj", (h, i)), ("down_proj", (i, h))):
                x = f"{p}.mlp.experts.{expert}.{projection}"
                if unquantized:
                    tensors[f"{x}.weight"] = ("BF16", (n, k))
                    continue
                tensors |= {
                    f"{x}.qweight": ("I32", (k // 8, n)),
                    f"{x}.qzeros": ("I32", (k // g, n // 8)),
                    f"{x}.scales": ("F16", (k // g, n)),
                    f"{x}.g_idx": ("I32", (k,)),
                }
    return tensors


def test_checkpoint_holds_exactly_the_tensors_vllm_loads(model: Path) -> None:
    files = read_checkpoint(model)
    found = tensors_by_name(files)
    expected = expected_tensors(SHAPE)
    assert set(found) == set(expected)
    for name, (dtype, shape) in expected.items():
        entry = found[name][1]
        assert (entry.dtype, entry.shape) == (dtype, shape), name

    # per-expert tensors are the w13 halves / w2 slices of AutoGPTQMoEMethod's parameters
    h, i, g = SHAPE.hidden, SHAPE.intermediate, 128
    w13 = {
        "qweight": (h // 8, 2 * i),
        "scales": (h // g, 2 * i),
        "qzeros": (h // g, 2 * i // 8),
        "g_idx": (h,),
    }
    w2 = {"qweight": (i // 8, h), "scales": (i // g, h), "qzeros": (i // g, h // 8), "g_idx": (i,)}
    for suffix, param in w13.items():
        checkpoint = found[f"model.layers.0.mlp.experts.0.gate_proj.{suffix}"][1].shape
        halved = param if suffix == "g_idx" else (param[0], param[1] // 2)  # gate and up fill one half each
        assert checkpoint == halved, suffix
    for suffix, param in w2.items():
        assert found[f"model.layers.0.mlp.experts.0.down_proj.{suffix}"][1].shape == param, suffix

    # only expert tensors are integers: what vLLM's safetensors scan would also call the quantized modules
    integer = {name.rsplit(".", 1)[0] for name, (_, entry) in found.items() if entry.dtype == "I32"}
    assert all(".mlp.experts." in name for name in integer)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(found) and len(files) == 1 + SHAPE.layers


def test_config_selects_gptq_marlin_moe_and_leaves_attention_unquantized(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["model_type"] == "qwen3_moe"
    quant = config["quantization_config"]
    assert (quant["quant_method"], quant["bits"], quant["group_size"], quant["sym"], quant["desc_act"]) == (
        "gptq", 4, 128, True, False,
    )  # fmt: skip
    assert quant["lm_head"] is False
    # AutoGPTQConfig: a linear prefix is quantized iff one of these strings is a substring of it
    quantized = quant["modules_in_block_to_quantize"]
    for prefix in (
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.gate",
    ):
        assert not any(layer in prefix for layer in quantized)
    assert config["hidden_size"] % 128 == 0 and config["moe_intermediate_size"] % quant["group_size"] == 0
    assert (config["num_experts"], config["num_experts_per_tok"]) == (SHAPE.experts, SHAPE.top_k)
    assert config["decoder_sparse_step"] == 1 and config["mlp_only_layers"] == [] and config["norm_topk_prob"]
    vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) == config["vocab_size"] and vocab["<|im_end|>"] == config["eos_token_id"]


def unpack_gptq(qweight: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """float32 ``[K, N]``: code j of word r is row 8r + j; value (code − 8) · scale[g_idx[k], n]."""
    words = qweight.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(8) * 4
    codes = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [K/8, 8, N]
    codes = codes.reshape(-1, qweight.shape[1])
    return (codes - 8).float() * scales.float()[g_idx.long()]


def test_experts_decode_to_a_finite_order_one_moe_layer(model: Path) -> None:
    found = tensors_by_name(read_checkpoint(model))

    def load(name: str) -> torch.Tensor:
        return found[name][0].tensor(name)

    p = "model.layers.1.mlp"
    dense: dict[str, list[torch.Tensor]] = {"gate_proj": [], "up_proj": [], "down_proj": []}
    for expert in range(SHAPE.experts):
        for projection, matrices in dense.items():
            stem = f"{p}.experts.{expert}.{projection}"
            k = SHAPE.intermediate if projection == "down_proj" else SHAPE.hidden
            assert (load(f"{stem}.qzeros") == 0x77777777).all()
            assert torch.equal(load(f"{stem}.g_idx"), torch.arange(k, dtype=torch.int32) // 128)
            matrices.append(
                unpack_gptq(load(f"{stem}.qweight"), load(f"{stem}.scales"), load(f"{stem}.g_idx"))
            )
    # bit layout: row 8r + j of column n is nibble j of word (r, n)
    word = int(load(f"{p}.experts.3.down_proj.qweight")[2, 7]) & 0xFFFFFFFF
    scale = load(f"{p}.experts.3.down_proj.scales")[0, 7].float().item()
    assert dense["down_proj"][3][2 * 8 + 5, 7].item() == (((word >> 20) & 0xF) - 8) * scale

    assert_order_one_moe_layer(load, dense)


def assert_order_one_moe_layer(load: Any, dense: dict[str, list[torch.Tensor]]) -> None:
    """Layer 1's MoE on normalised embeddings is finite and O(1) and routes to more than top_k experts
    (``dense``: each projection's float32 ``[K, N]`` per expert)."""
    p = "model.layers.1.mlp"
    up_std = torch.stack(dense["up_proj"]).std().item()
    assert 0.5 / math.sqrt(SHAPE.hidden) < up_std < 2 / math.sqrt(SHAPE.hidden)

    # Qwen3-MoE: softmax over all experts, top-k, renormalised (norm_topk_prob); SiLU(gate) · up → down
    embedding = load("model.embed_tokens.weight").float()
    x = embedding[torch.arange(20, 60)]
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    weights, ids = (x @ load(f"{p}.gate.weight").float().T).softmax(-1).topk(SHAPE.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for slot in range(SHAPE.top_k):
            e = int(ids[token, slot])
            gate, up = x[token] @ dense["gate_proj"][e], x[token] @ dense["up_proj"][e]
            out[token] += weights[token, slot] * (
                (torch.nn.functional.silu(gate) * up) @ dense["down_proj"][e]
            )
    assert torch.isfinite(out).all()
    rms = out.pow(2).mean().sqrt().item()
    assert 0.02 < rms < 3.0, rms
    assert len(set(ids.flatten().tolist())) > SHAPE.top_k


def test_unquantized_checkpoint_holds_the_bf16_experts_vllm_loads(bf16_model: Path) -> None:
    found = tensors_by_name(read_checkpoint(bf16_model))
    expected = expected_tensors(SHAPE, unquantized=True)
    assert set(found) == set(expected)
    for name, (dtype, shape) in expected.items():
        entry = found[name][1]
        assert (entry.dtype, entry.shape) == (dtype, shape), name
    # no integer tensor left: vLLM's safetensors scan finds nothing quantized
    assert {entry.dtype for _, entry in found.values()} == {"BF16"}
    h, i = SHAPE.hidden, SHAPE.intermediate
    # UnquantizedFusedMoEMethod: w13_weight [E, 2I, H] (gate rows, then up rows), w2_weight [E, H, I]
    gate = found["model.layers.0.mlp.experts.0.gate_proj.weight"][1].shape
    up = found["model.layers.0.mlp.experts.0.up_proj.weight"][1].shape
    assert (gate[0] + up[0], gate[1]) == (2 * i, h)
    assert found["model.layers.0.mlp.experts.0.down_proj.weight"][1].shape == (h, i)
    index = json.loads((bf16_model / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(found)


def test_unquantized_config_has_no_quantization(bf16_model: Path, model: Path) -> None:
    config = json.loads((bf16_model / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    gptq = json.loads((model / "config.json").read_text())
    del gptq["quantization_config"]
    assert config == gptq  # the same model otherwise
    assert (bf16_model / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()


def test_unquantized_experts_make_a_finite_order_one_moe_layer(bf16_model: Path, model: Path) -> None:
    found = tensors_by_name(read_checkpoint(bf16_model))

    def load(name: str) -> torch.Tensor:
        return found[name][0].tensor(name)

    dense: dict[str, list[torch.Tensor]] = {"gate_proj": [], "up_proj": [], "down_proj": []}
    for expert in range(SHAPE.experts):
        for projection, matrices in dense.items():
            matrices.append(load(f"model.layers.1.mlp.experts.{expert}.{projection}.weight").float().T)
    down_std = torch.stack(dense["down_proj"]).std().item()
    target = SHAPE.residual_scale / math.sqrt(SHAPE.intermediate)
    assert 0.9 * target < down_std < 1.1 * target
    assert_order_one_moe_layer(load, dense)
    # attention, router and embeddings are the GPTQ model's (same names, same seeds)
    gptq = tensors_by_name(read_checkpoint(model))
    name = "model.layers.1.mlp.gate.weight"
    assert torch.equal(load(name), gptq[name][0].tensor(name))


def test_shape_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        make_moe_gptq.MoeShape(hidden=2000)
    with pytest.raises(ValueError, match="multiple of 128"):
        make_moe_gptq.MoeShape(intermediate=96)
    with pytest.raises(ValueError, match="kv_heads"):
        make_moe_gptq.MoeShape(heads=6, kv_heads=4)
