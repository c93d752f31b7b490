"""Our Qwen3-MoE against transformers' Qwen3MoeForCausalLM: same weights, fp32, same inputs."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pithtrain.models import build_model  # noqa: E402
from pithtrain.layers.transformer import init_weights  # noqa: E402

TINY = dict(model_type="qwen3_moe", vocab_size=97, hidden_size=32, intermediate_size=48,
            moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[1], max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
            tie_word_embeddings=False)


def hf_model(cfg: dict):
    config = transformers.Qwen3MoeConfig(**cfg, attn_implementation="eager")
    config._experts_implementation = "eager"
    return transformers.Qwen3MoeForCausalLM(config).float()


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True, "norm_topk_prob": False},
                                       {"decoder_sparse_step": 2, "mlp_only_layers": []}])
def test_qwen3_moe_matches_transformers(overrides):
    cfg = {**TINY, **overrides}
    torch.manual_seed(0)
    ours = build_model(cfg)
    init_weights(ours, seed=3)
    theirs = hf_model(cfg)
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=True)
    assert not missing and not unexpected
    assert set(dict(ours.named_parameters())) == set(dict(theirs.named_parameters()))
    assert any(l.is_moe for l in ours.model.layers.values()) and not all(l.is_moe for l in ours.model.layers.values())

    ids = torch.randint(0, cfg["vocab_size"], (2, 24))
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
