"""Model construction: the model family is chosen by `model_type` of the HF config, explicitly."""

from pithtrain.layers.moe import BalanceOptions
from pithtrain.layers.transformer import CausalLM

SUPPORTED = ["qwen3_moe"]


def build_model(hf: dict, balance: BalanceOptions | None = None, layer_ids: list[int] | None = None) -> CausalLM:
    balance = balance or BalanceOptions()
    match hf.get("model_type"):
        case "qwen3_moe":
            from pithtrain.models import qwen3_moe

            return qwen3_moe.build(hf, balance, layer_ids)
        case other:
            raise ValueError(f"model_type {other!r} in config.json is not supported; supported: {SUPPORTED}")
