"""Every model family against its `transformers` implementation: the same random weights, fp32,
the same inputs; logits, loss and every parameter gradient agree to 1e-5 relative."""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pithtrain.models import build_model  # noqa: E402
from pithtrain.layers.transformer import init_weights  # noqa: E402
from conftest import DEEPSEEK_V2, DEEPSEEK_V3, GPT_OSS, QWEN3, ROOT, YARN  # noqa: E402,F401

CASES = {
    "qwen3": QWEN3,
    "qwen3-tied-unnormed": dict(QWEN3, tie_word_embeddings=True, norm_topk_prob=False, pad_token_id=3),
    # transformers moves a top-level original_max_position_embeddings into YaRN's parameters
    "qwen3-yarn-top-level-original": dict(QWEN3, rope_scaling=dict(YARN), original_max_position_embeddings=8),
    "qwen3-sparse-step": dict(QWEN3, decoder_sparse_step=2, mlp_only_layers=[]),
    "deepseek_v2-greedy": DEEPSEEK_V2,
    "deepseek_v2-q_lora-group_limited": dict(DEEPSEEK_V2, q_lora_rank=10, topk_method="group_limited_greedy",
                                             n_group=4, topk_group=2, routed_scaling_factor=16.0,
                                             attention_bias=True),
    "deepseek_v3": DEEPSEEK_V3,
    "deepseek_v3-half_split_rope": dict(DEEPSEEK_V3, rope_interleave=False),
    "gpt_oss": dict(GPT_OSS, pad_token_id=5),  # as the published configs: the pad row gets no gradient
    "gpt_oss-clamped": dict(GPT_OSS, swiglu_limit=0.5),  # the clamps of the SwiGLU bite
    # head_dim and rope_scaling left out: GptOssConfig's defaults (64, YaRN) even with rope_theta given
    "gpt_oss-defaults": {k: v for k, v in GPT_OSS.items() if k not in ("head_dim", "rope_scaling")},
}
for _name in ("config", "deepseek_v3", "gpt_oss"):  # the CPU demo configs of examples/demo
    with open(os.path.join(ROOT, "examples", "demo", f"{_name}.json")) as _f:
        CASES[f"demo-{_name}"] = json.load(_f)
HF_CLASS = {"qwen3_moe": "Qwen3Moe", "deepseek_v2": "DeepseekV2", "deepseek_v3": "DeepseekV3", "gpt_oss": "GptOss"}


def hf_model(cfg: dict):
    name = HF_CLASS[cfg["model_type"]]
    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    config = getattr(transformers, f"{name}Config")(**fields, attn_implementation="eager")
    config._experts_implementation = "eager"
    return getattr(transformers, f"{name}ForCausalLM")(config).float()


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def random_model(cfg: dict, seed: int = 3):
    """Our model with init_weights, then every bias, sink and correction bias made non-zero."""
    torch.manual_seed(0)
    model = build_model(cfg)
    init_weights(model, seed=seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("_bias", ".bias", "sinks")):
                t.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_model_matches_transformers(case):
    cfg = CASES[case]
    ours = random_model(cfg)
    theirs = hf_model(cfg)
    if cfg["model_type"] == "gpt_oss" and theirs.model.layers[0].mlp.experts.limit != cfg["swiglu_limit"]:
        pytest.skip("this transformers version ignores swiglu_limit (fixed at 7.0; 5.24 reads the config)")
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=True)
    assert not missing and not unexpected
    assert set(dict(ours.named_parameters())) == set(dict(theirs.named_parameters()))
    assert any(l.is_moe for l in ours.model.layers.values())

    ids = torch.randint(0, cfg["vocab_size"], (2, 24))
    if cfg.get("pad_token_id") is not None:  # the pad token among the inputs
        ids[:, ::5] = cfg["pad_token_id"]
    labels = torch.randint(0, cfg["vocab_size"], (2, 24))
    labels[0, :3] = -100
    logits = ours(ids)
    hf_out = theirs(input_ids=ids)
    assert rel(logits, hf_out.logits) < 1e-5

    loss = ours(ids, labels=labels) / (labels != -100).sum()
    hf_loss = torch.nn.functional.cross_entropy(hf_out.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert abs(loss.item() - hf_loss.item()) / hf_loss.item() < 1e-5
    loss.backward()
    hf_loss.backward()
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        g = theirs_params[name].grad
        assert p.grad is not None and g is not None, name
        assert rel(p.grad, g) < 1e-5, (name, rel(p.grad, g))


@pytest.mark.parametrize("cfg, field", [(dict(DEEPSEEK_V3, mlp_bias=True), "mlp_bias"),
                                        (dict(QWEN3, attention_dropout=0.1), "attention_dropout"),
                                        (dict(GPT_OSS, attention_dropout=0.5), "attention_dropout"),
                                        (dict(GPT_OSS, sliding_window=0), "sliding_window"),
                                        (dict(GPT_OSS, sliding_window=-3), "sliding_window"),
                                        (dict(GPT_OSS, sliding_window=2.5), "sliding_window"),
                                        (dict(QWEN3, rope_scaling={"type": "yarn"}), "original_max_position_embeddings"),
                                        (dict(QWEN3, rope_scaling=dict(YARN), rope_parameters={"rope_theta": 1e6}),
                                         "rope_scaling and rope_parameters"),
                                        (dict(GPT_OSS, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
                                         "rope_scaling and rope_parameters"),
                                        (dict(QWEN3, pad_token_id=97), "pad_token_id")])
def test_fields_transformers_reads_otherwise_are_refused(cfg, field):
    """A field we would build differently from transformers is refused, never silently dropped."""
    with pytest.raises(ValueError, match=field):
        build_model(cfg)
