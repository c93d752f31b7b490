"""GPT-OSS (gpt-oss-20b, gpt-oss-120b) from its Hugging Face config (`model_type` gpt_oss).

GQA attention with biases on q/k/v/o, YaRN and one learned sink logit per head; layers follow
`layer_types`: `sliding_attention` (a causal window of `sliding_window` tokens) or
`full_attention` (alternating, sliding first, by default; with `num_hidden_layers` set below
the length of `layer_types`, the first layers'). Every layer is an MoE block: a router
with a bias that takes the top-k logits and softmaxes over those k, and experts with biases in
the transposed layout (gate_up_proj [E, H, 2I], down_proj [E, I, H]) whose activation is the
clamped SwiGLU on interleaved gate/up columns (`ops/swiglu.py`, alpha `swiglu_alpha`, limit
`swiglu_limit`). Parameter names are those of `transformers`' GptOssForCausalLM; checkpoints
that ship MXFP4 experts are dequantized on import (`train/hf.py`).
"""

import functools

from pithtrain.layers.attention import GQAttention
from pithtrain.layers.moe import BalanceOptions, GroupedExperts, MoEBlock, TopKRouter
from pithtrain.layers.rope import RotaryEmbedding, rope_parameters
from pithtrain.layers.transformer import CausalLM, DecoderLayer
from pithtrain.ops.swiglu import clamped_swiglu

# Defaults of transformers' GptOssConfig for fields a config.json may leave out.
DEFAULTS = dict(head_dim=64, sliding_window=128, layer_types=None, swiglu_alpha=1.702, swiglu_limit=7.0,
                attention_bias=True, rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.02,
                hidden_act="silu", max_position_embeddings=131072,
                rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096})
REQUIRED = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "num_local_experts", "num_experts_per_tok"]
LAYER_TYPES = ("sliding_attention", "full_attention")


def settings(hf: dict) -> dict:
    c = {**DEFAULTS, **hf}
    if "num_local_experts" not in hf and "num_experts" in hf:
        c["num_local_experts"] = hf["num_experts"]
    # As GptOssConfig: the given rope_parameters, else an old-style rope_scaling (read by
    # rope_parameters(), which refuses both at once), else the default YaRN; rope_theta from the top
    # level, else 150000.
    if hf.get("rope_scaling"):
        c["rope_theta"], c["rope_parameters"] = hf.get("rope_theta", 150000.0), hf.get("rope_parameters")
    else:
        given = hf.get("rope_parameters") or DEFAULTS["rope_parameters"]
        c["rope_parameters"] = {"rope_theta": hf.get("rope_theta", 150000.0), **given}
    missing = [k for k in REQUIRED if k not in c]
    if missing:
        raise ValueError(f"config.json of this GPT-OSS model lacks the fields {missing}")
    L = c["num_hidden_layers"]
    if c["layer_types"] is None:
        c["layer_types"] = [LAYER_TYPES[i % 2] for i in range(L)]
    c["layer_types"] = c["layer_types"][:L]  # fewer layers (a proxy): the first L of the model
    bad = sorted(set(c["layer_types"]) - set(LAYER_TYPES))
    if len(c["layer_types"]) != L or bad:
        raise ValueError(f"model.layer_types must list {L} entries of {list(LAYER_TYPES)}"
                         + (f"; found {bad}" if bad else f"; found {len(c['layer_types'])} entries"))
    w = c["sliding_window"]
    if "sliding_attention" in c["layer_types"] and w is not None and (isinstance(w, bool) or not isinstance(w, int)
                                                                      or w < 1):
        raise ValueError(f"model.sliding_window = {w!r}: a window of at least 1 token (each token sees itself "
                         "and the window - 1 before it), or null for full attention in every layer")
    return c


def build(hf: dict, balance: BalanceOptions, layer_ids: list[int] | None = None) -> CausalLM:
    """The model of `hf` (a config.json dict); `layer_ids` picks a subset of layers (pipeline)."""
    c = settings(hf)
    H, E, eps = c["hidden_size"], c["num_local_experts"], c["rms_norm_eps"]
    head_dim = c["head_dim"] or H // c["num_attention_heads"]
    activation = functools.partial(clamped_swiglu, alpha=c["swiglu_alpha"], limit=c["swiglu_limit"])
    layers = {}
    for i in range(c["num_hidden_layers"]) if layer_ids is None else layer_ids:
        window = c["sliding_window"] if c["layer_types"][i] == "sliding_attention" else None
        attn = GQAttention(H, c["num_attention_heads"], c["num_key_value_heads"], head_dim, bias=c["attention_bias"],
                           window=window, sinks=True)
        router = TopKRouter(H, E, c["num_experts_per_tok"], score="softmax_topk", bias=True,
                            correction_bias=balance.aux_free)
        experts = GroupedExperts(E, H, c["intermediate_size"], transposed=True, bias=True, activation=activation)
        layers[i] = DecoderLayer(attn, MoEBlock(router, experts, balance, router_name="router"), H, eps)
    rope = RotaryEmbedding(head_dim, rope_parameters(c), c["max_position_embeddings"])
    return CausalLM(c["vocab_size"], H, layers, rope, eps=eps, tie_embeddings=c["tie_word_embeddings"],
                    init_std=c["initializer_range"], pad_token_id=c.get("pad_token_id"))
