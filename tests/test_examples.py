"""Full-size example configs build (on the meta device) with the published parameter counts."""

import json
import os

import pytest
import torch

from conftest import ROOT
from pithtrain.config import load_config
from pithtrain.models import build_model

# (config folder, published total, published active, whether the active figure counts the input
# embedding): Qwen's model card counts it, DeepSeek's and OpenAI's do not. Within 2%, but for
# DeepSeek-V2-Lite's active count: its exact value is 2.451B, which the card gives as 2.4B (2.1%).
PUBLISHED = [("qwen3_30b_a3b", 30.5e9, 3.3e9, True), ("deepseek_v2_lite", 15.7e9, 2.4e9, False),
             ("gpt_oss_20b", 20.9e9, 3.6e9, False), ("gpt_oss_120b", 116.8e9, 5.1e9, False)]


@pytest.mark.parametrize("name, total, active, with_embedding", PUBLISHED)
def test_parameter_counts(name, total, active, with_embedding):
    with open(os.path.join(ROOT, "examples", name, "config.json")) as f:
        hf = json.load(f)
    with torch.device("meta"):
        model = build_model(hf)
    ours_total, ours_active = model.parameter_counts(count_embedding=with_embedding)
    assert abs(ours_total - total) / total < 0.02, ours_total
    assert abs(ours_active - active) / active < (0.022 if name == "deepseek_v2_lite" else 0.02), ours_active


@pytest.mark.parametrize("name", [p[0] for p in PUBLISHED])
def test_example_toml_loads(name):
    cfg = load_config(os.path.join(ROOT, "examples", name, "train.toml"))
    assert cfg.model.hf["model_type"] and cfg.data.seq_len <= cfg.model.hf["max_position_embeddings"]
