"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B and smaller configs) from its Hugging Face config.

GQA attention with per-head q/k RMSNorm and RoPE; an MoE block (softmax top-k router, stacked
SwiGLU experts) on every `decoder_sparse_step`-th layer outside `mlp_only_layers`, a dense SwiGLU
MLP elsewhere. Parameter names are those of `transformers`' Qwen3MoeForCausalLM.
"""

from pithtrain.layers.attention import GQAttention
from pithtrain.layers.mlp import SwiGLUMLP
from pithtrain.layers.moe import BalanceOptions, GroupedExperts, MoEBlock, TopKRouter
from pithtrain.layers.rope import RotaryEmbedding, rope_parameters
from pithtrain.layers.transformer import CausalLM, DecoderLayer

# Defaults of transformers' Qwen3MoeConfig for fields a config.json may leave out.
DEFAULTS = dict(head_dim=None, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False,
                attention_bias=False, tie_word_embeddings=False, rms_norm_eps=1e-6,
                initializer_range=0.02, hidden_act="silu", use_sliding_window=False)


REQUIRED = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "num_experts", "num_experts_per_tok", "moe_intermediate_size"]


def is_moe_layer(hf: dict, i: int) -> bool:
    c = {**DEFAULTS, **hf}
    return (i not in (c["mlp_only_layers"] or []) and c["num_experts"] > 0
            and (i + 1) % c["decoder_sparse_step"] == 0)


def build(hf: dict, balance: BalanceOptions, layer_ids: list[int] | None = None) -> CausalLM:
    """The model of `hf` (a config.json dict); `layer_ids` picks a subset of layers (pipeline)."""
    c = {**DEFAULTS, **hf}
    if "num_experts" not in c and "num_local_experts" in c:  # the name transformers 5 writes
        c["num_experts"] = c["num_local_experts"]
    missing = [k for k in REQUIRED if k not in c]
    if missing:
        raise ValueError(f"config.json of this Qwen3-MoE model lacks the fields {missing}")
    if c["hidden_act"] != "silu":
        raise ValueError(f"model.hidden_act = {c['hidden_act']!r}: Qwen3-MoE here supports 'silu' only")
    if c["use_sliding_window"]:
        raise ValueError("model.use_sliding_window = true is not supported for Qwen3-MoE; set it to false")
    H, eps = c["hidden_size"], c["rms_norm_eps"]
    head_dim = c["head_dim"] or H // c["num_attention_heads"]
    layers = {}
    for i in range(c["num_hidden_layers"]) if layer_ids is None else layer_ids:
        attn = GQAttention(H, c["num_attention_heads"], c["num_key_value_heads"], head_dim,
                           bias=c["attention_bias"], qk_norm=True, eps=eps)
        if is_moe_layer(c, i):
            router = TopKRouter(H, c["num_experts"], c["num_experts_per_tok"], norm_topk_prob=c["norm_topk_prob"],
                                correction_bias=balance.aux_free)
            mlp = MoEBlock(router, GroupedExperts(c["num_experts"], H, c["moe_intermediate_size"]), balance)
        else:
            mlp = SwiGLUMLP(H, c["intermediate_size"])
        layers[i] = DecoderLayer(attn, mlp, H, eps)
    rope = RotaryEmbedding(head_dim, rope_parameters(c), c.get("max_position_embeddings", 32768))
    return CausalLM(c["vocab_size"], H, layers, rope, eps=eps,
                    tie_embeddings=c["tie_word_embeddings"], init_std=c["initializer_range"],
                    pad_token_id=c.get("pad_token_id"))
