"""DeepSeek-V2 / V2-Lite (`model_type` deepseek_v2) and DeepSeek-V3-style routing (deepseek_v3).

Multi-head latent attention with YaRN (`layers/attention.py`, `layers/rope.py`); the first
`first_k_dense_replace` layers (and those off `moe_layer_freq`) use a dense SwiGLU MLP, the
others an MoE block with `n_shared_experts` shared experts (one SwiGLU of n_shared * I, always
applied) and routed experts. Routing, by `topk_method`:
- `greedy`: softmax over all experts, top-k (DeepSeek-V2-Lite);
- `group_limited_greedy`: softmax, then only the `topk_group` of `n_group` groups with the
  highest best-expert score are eligible (DeepSeek-V2);
- `noaux_tc` (deepseek_v3): sigmoid scores; `e_score_correction_bias` added for the choice
  only; groups ranked by the sum of their two best biased scores; weights from the unbiased
  scores, normalised if `norm_topk_prob`.
The weights are multiplied by `routed_scaling_factor`. Parameter names are those of
`transformers`' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM. `moe_layer_freq` is honoured as in
DeepSeek's own code (transformers ignores it; with the published value 1 the two agree).
`mlp_bias` is refused for deepseek_v3, whose MLPs in transformers have no biases.
"""

from pithtrain.layers.attention import MLAttention
from pithtrain.layers.mlp import SwiGLUMLP
from pithtrain.layers.moe import BalanceOptions, GroupedExperts, MoEBlock, TopKRouter
from pithtrain.layers.rope import RotaryEmbedding, rope_parameters, yarn_softmax_scale
from pithtrain.layers.transformer import CausalLM, DecoderLayer

# Defaults of transformers' DeepseekV2Config / DeepseekV3Config for fields a config.json may omit.
DEFAULTS = {
    "deepseek_v2": dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, n_shared_experts=2, first_k_dense_replace=0, moe_layer_freq=1,
                        n_group=None, topk_group=None, topk_method="greedy", scoring_func="softmax",
                        norm_topk_prob=False, routed_scaling_factor=1.0, attention_bias=False, mlp_bias=False,
                        rope_interleave=True, max_position_embeddings=2048),
    "deepseek_v3": dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, n_shared_experts=1, first_k_dense_replace=3, moe_layer_freq=1,
                        n_group=8, topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid",
                        norm_topk_prob=True, routed_scaling_factor=2.5, attention_bias=False, mlp_bias=False,
                        rope_interleave=True, max_position_embeddings=4096),
}  # as transformers' DeepseekV2Config / DeepseekV3Config
COMMON = dict(tie_word_embeddings=False, rms_norm_eps=1e-6, initializer_range=0.02, hidden_act="silu")
REQUIRED = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "n_routed_experts", "num_experts_per_tok"]


def settings(hf: dict) -> dict:
    """The config with defaults filled in and checked; raises ValueError naming the field."""
    kind = hf.get("model_type")
    c = {**COMMON, **DEFAULTS[kind], **hf}
    for alias in ("num_experts", "num_local_experts"):
        if "n_routed_experts" not in hf and alias in hf:
            c["n_routed_experts"] = hf[alias]
    missing = [k for k in REQUIRED if k not in c]
    if missing:
        raise ValueError(f"config.json of this {kind} model lacks the fields {missing}")
    if c["hidden_act"] != "silu":
        raise ValueError(f"model.hidden_act = {c['hidden_act']!r}: only 'silu' is supported")
    method = c["topk_method"]
    wanted = ["greedy", "group_limited_greedy"] if kind == "deepseek_v2" else ["noaux_tc"]
    if method not in wanted:
        raise ValueError(f"model.topk_method = {method!r} is not {kind} routing; use one of {wanted}")
    score = "softmax" if kind == "deepseek_v2" else "sigmoid"
    if c["scoring_func"] != score:
        raise ValueError(f"model.scoring_func = {c['scoring_func']!r}: {kind} scores with {score!r}")
    if kind == "deepseek_v2" and c["norm_topk_prob"]:
        raise ValueError("model.norm_topk_prob = true is not applied by deepseek_v2 routing in transformers; "
                         "set it to false (or use model_type deepseek_v3)")
    if kind == "deepseek_v3" and c["mlp_bias"]:
        raise ValueError("model.mlp_bias = true: transformers' DeepseekV3 MLPs have no biases; set it to false")
    if method == "greedy":
        c["n_group"] = c["topk_group"] = 1
    elif not c["n_group"] or not c["topk_group"]:
        raise ValueError(f"topk_method {method!r} needs model.n_group and model.topk_group")
    return c


def is_moe_layer(c: dict, i: int) -> bool:
    return i >= c["first_k_dense_replace"] and i % c["moe_layer_freq"] == 0


def build(hf: dict, balance: BalanceOptions, layer_ids: list[int] | None = None) -> CausalLM:
    """The model of `hf` (a config.json dict); `layer_ids` picks a subset of layers (pipeline)."""
    c = settings(hf)
    v3 = c["model_type"] == "deepseek_v3"
    H, E, eps = c["hidden_size"], c["n_routed_experts"], c["rms_norm_eps"]
    rope = rope_parameters(c)
    nope, rope_dim = c["qk_nope_head_dim"], c["qk_rope_head_dim"]
    scale = yarn_softmax_scale(rope, nope + rope_dim, c["max_position_embeddings"])
    layers = {}
    for i in range(c["num_hidden_layers"]) if layer_ids is None else layer_ids:
        attn = MLAttention(H, c["num_attention_heads"], q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"],
                           nope_dim=nope, rope_dim=rope_dim, v_dim=c["v_head_dim"], scale=scale,
                           bias=c["attention_bias"], interleaved=c["rope_interleave"] or not v3)
        if is_moe_layer(c, i):
            router = TopKRouter(H, E, c["num_experts_per_tok"], score="sigmoid" if v3 else "softmax",
                                norm_topk_prob=c["norm_topk_prob"], scaling_factor=c["routed_scaling_factor"],
                                n_group=c["n_group"], topk_group=c["topk_group"],
                                group_score="top2_sum" if v3 else "max", correction_bias=v3 or balance.aux_free)
            shared = c["n_shared_experts"] or 0
            mlp = MoEBlock(router, GroupedExperts(E, H, c["moe_intermediate_size"]), balance,
                           shared_experts=SwiGLUMLP(H, c["moe_intermediate_size"] * shared, bias=c["mlp_bias"])
                           if shared else None)
        else:
            mlp = SwiGLUMLP(H, c["intermediate_size"], bias=c["mlp_bias"])
        layers[i] = DecoderLayer(attn, mlp, H, eps)
    return CausalLM(c["vocab_size"], H, layers, RotaryEmbedding(rope_dim, rope, c["max_position_embeddings"]),
                    eps=eps, tie_embeddings=c["tie_word_embeddings"], init_std=c["initializer_range"],
                    pad_token_id=c.get("pad_token_id"))
