"""Weight init is layout-independent; gradient accumulation equals one big batch."""

import copy

import pytest
import torch

from conftest import TINY_MODEL
from pithtrain.layers.moe import BalanceOptions, GroupedExperts
from pithtrain.layers.transformer import init_weights
from pithtrain.models import build_model
from pithtrain.train.loop import train_step


def test_init_depends_only_on_seed_and_global_name():
    full = build_model(TINY_MODEL)
    init_weights(full, seed=5)
    part = build_model(TINY_MODEL, layer_ids=[2])  # e.g. the last pipeline stage
    init_weights(part, seed=5)
    full_params = dict(full.named_parameters())
    for name, p in part.named_parameters():
        assert torch.equal(p, full_params[name]), name
    # an expert-parallel rank holding experts 2..3 of layer 2 draws the same numbers as the full model
    layer = part.model.layers["2"]
    layer.mlp.experts = GroupedExperts(2, TINY_MODEL["hidden_size"], TINY_MODEL["moe_intermediate_size"], first_expert=2)
    init_weights(part, seed=5)
    for key in ("gate_up_proj", "down_proj"):
        local = getattr(layer.mlp.experts, key)
        assert torch.equal(local, full_params[f"model.layers.2.mlp.experts.{key}"][2:4])
    other = build_model(TINY_MODEL)
    init_weights(other, seed=6)
    assert not torch.equal(other.lm_head.weight, full.lm_head.weight)


@pytest.mark.parametrize("balance", [None, dict(aux_loss="sequence", aux_loss_coef=0.1, z_loss_coef=0.01)])
def test_accumulation_matches_one_batch(balance):
    """Two micro-batches step as one batch; with the balancing losses that do not depend on the split
    too (`sequence`, the z-loss; docs/architecture.md says which do)."""
    torch.manual_seed(0)
    model = build_model(TINY_MODEL, BalanceOptions(**balance) if balance else None)
    init_weights(model, seed=0)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, TINY_MODEL["vocab_size"], (4, 16))
    labels = torch.randint(0, TINY_MODEL["vocab_size"], (4, 16))
    labels[0, :5] = -100  # micro-batches with unequal token counts
    # SGD with lr 1 makes each parameter change equal its (clipped) gradient; Adam would amplify
    # rounding in near-zero gradients and hide what is compared.
    one = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), [(ids, labels)], 1.0,
                     torch.device("cpu"), None)
    two = train_step(twin, torch.optim.SGD(twin.parameters(), lr=1.0),
                     [(ids[:2], labels[:2]), (ids[2:], labels[2:])], 1.0, torch.device("cpu"), None)
    assert torch.allclose(one["loss"], two["loss"], rtol=1e-6)
    assert torch.allclose(one["grad_norm"], two["grad_norm"], rtol=1e-5)
    twin_params = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        assert torch.allclose(p, twin_params[name], rtol=1e-5, atol=1e-7), name


def test_clipping_matches_torch():
    """train_step's clipping (the factor handed to the optimizer, not a pass over the gradients)
    steps as torch.nn.utils.clip_grad_norm_ then the optimizer: SGD and our AdamW."""
    from pithtrain.config import OptimConfig
    from pithtrain.train.optim import build_optimizer

    torch.manual_seed(1)
    ids = torch.randint(0, TINY_MODEL["vocab_size"], (2, 16))
    labels = torch.randint(0, TINY_MODEL["vocab_size"], (2, 16))
    model = build_model(TINY_MODEL)
    init_weights(model, seed=0)
    for make in (lambda m: torch.optim.SGD(m.parameters(), lr=1.0),
                 # eps 1: AdamW's step follows the gradient's size, so a missed factor shows
                 lambda m: build_optimizer(m, OptimConfig(lr=1e-2, weight_decay=0.1, eps=1.0))):
        ours, ref = copy.deepcopy(model), copy.deepcopy(model)
        out = train_step(ours, make(ours), [(ids, labels)], 0.05, torch.device("cpu"), None)
        (ref(ids, labels=labels) / labels.numel()).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        make(ref).step()
        assert norm > 0.5 and torch.allclose(out["grad_norm"], norm, rtol=1e-5)  # clipping was active
        ref_params = dict(ref.named_parameters())
        for name, p in ours.named_parameters():
            assert torch.allclose(p, ref_params[name], rtol=1e-5, atol=1e-7), name


def test_train_step_with_a_bare_optimizer_and_no_targets():
    """Any object with step() and zero_grad() serves as the optimizer, clipping included (the
    gradients are scaled before its step); a step whose every label is ignored is refused."""
    import pytest

    model = build_model(TINY_MODEL)
    init_weights(model, seed=0)
    ids = torch.randint(0, TINY_MODEL["vocab_size"], (2, 16))
    labels = torch.randint(0, TINY_MODEL["vocab_size"], (2, 16))
    seen = {}

    class Bare:
        def step(self):
            seen["norm"] = torch.sqrt(sum(p.grad.square().sum() for p in model.parameters() if p.grad is not None))

        def zero_grad(self, set_to_none=True):
            model.zero_grad(set_to_none=True)

    out = train_step(model, Bare(), [(ids, labels)], 0.01, torch.device("cpu"), None)
    assert out["grad_norm"] > 0.1 and torch.allclose(seen["norm"], torch.tensor(0.01), rtol=1e-4)
    with pytest.raises(ValueError, match="every label of the step is -100"):
        train_step(model, Bare(), [(ids, torch.full_like(labels, -100))], 1.0, torch.device("cpu"), None)
