"""Model construction: the model family is chosen by `model_type` of the HF config, explicitly."""

from pithtrain.layers.moe import BalanceOptions
from pithtrain.layers.transformer import CausalLM

SUPPORTED = ["qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss"]
SIZES = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "n_routed_experts",
         "num_local_experts", "num_experts_per_tok", "decoder_sparse_step", "moe_layer_freq", "q_lora_rank",
         "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"]  # where present (and not null), counts of at least 1
COUNTS = ["n_shared_experts", "first_k_dense_replace", "qk_nope_head_dim"]  # where present, at least 0


def build_model(hf: dict, balance: BalanceOptions | None = None, layer_ids: list[int] | None = None) -> CausalLM:
    balance = balance or BalanceOptions()
    for key in SIZES:
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"model.{key} = {value!r} must be a positive integer")
    for key in COUNTS:
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"model.{key} = {value!r} must be an integer of at least 0")
    std = hf.get("initializer_range", 0.02)
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not std >= 0:
        raise ValueError(f"model.initializer_range = {std!r} must be a number of at least 0 (the init std)")
    if hf.get("attention_dropout"):  # every family here trains without attention dropout
        raise ValueError(f"model.attention_dropout = {hf['attention_dropout']}: attention dropout is not "
                         "supported; set it to 0.0")
    match hf.get("model_type"):
        case "qwen3_moe":
            from pithtrain.models import qwen3_moe

            return qwen3_moe.build(hf, balance, layer_ids)
        case "deepseek_v2" | "deepseek_v3":
            from pithtrain.models import deepseek_v2

            return deepseek_v2.build(hf, balance, layer_ids)
        case "gpt_oss":
            from pithtrain.models import gpt_oss

            return gpt_oss.build(hf, balance, layer_ids)
        case other:
            raise ValueError(f"model_type {other!r} in config.json is not supported; supported: {SUPPORTED}")
