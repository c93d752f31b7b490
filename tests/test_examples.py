"""Full-size example configs build (on the meta device) with the published parameter counts."""

import json
import os

import pytest
import torch

from conftest import ROOT
from pithtrain.config import load_config
from pithtrain.models import build_model

# (config folder, published total, published active), in parameters
PUBLISHED = [("qwen3_30b_a3b", 30.5e9, 3.3e9)]


@pytest.mark.parametrize("name, total, active", PUBLISHED)
def test_parameter_counts(name, total, active):
    with open(os.path.join(ROOT, "examples", name, "config.json")) as f:
        hf = json.load(f)
    with torch.device("meta"):
        model = build_model(hf)
    ours_total, ours_active = model.parameter_counts()
    assert abs(ours_total - total) / total < 0.02, ours_total
    assert abs(ours_active - active) / active < 0.02, ours_active


@pytest.mark.parametrize("name", [n for n, _, _ in PUBLISHED])
def test_example_toml_loads(name):
    cfg = load_config(os.path.join(ROOT, "examples", name, "train.toml"))
    assert cfg.model.hf["model_type"] and cfg.data.seq_len <= cfg.model.hf["max_position_embeddings"]
