"""torch.compile of the dense parts (CausalLM.compile_dense) and activation recompute, on CPU:
the compiled model gives the eager model's loss and gradients; after the first training and
evaluation steps nothing compiles again (dynamo's counters); layers share compiled code, so a
deeper model compiles no more graphs; recompute changes no number."""

import copy

import pytest
import torch

from conftest import GPT_OSS, QWEN3


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def run_steps(model, ids, labels, steps: int, between=None) -> list:
    """SGD steps; returns (loss, grads) per step; `between()` runs after each step (e.g. an eval)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for _ in range(steps):
        loss = model(ids, labels=labels, aux_weight=1.0) / labels.numel()
        loss.backward()
        out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if between is not None:
            between()
    return out


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("cfg", [QWEN3, GPT_OSS], ids=["qwen3", "gpt_oss"])
def test_compiled_model_matches_eager_and_compiles_once(cfg):
    from test_hf_parity import random_model

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 97, (2, 24), generator=gen), torch.randint(0, 97, (2, 24), generator=gen)
    eager = random_model(cfg)
    compiled = copy.deepcopy(eager)
    compiled.compile_dense()
    want = run_steps(eager, ids, labels, 3)

    seen = []

    def evaluate():
        compiled.eval()
        with torch.no_grad():
            compiled(ids, labels=labels)
        compiled.train()
        seen.append(compiled_graphs())

    got = run_steps(compiled, ids, labels, 3, between=evaluate)
    assert seen[0] > 0 and seen[0] == seen[1] == seen[2], seen  # compiled in step 1 (+ eval), never again
    for (loss, grads), (want_loss, want_grads) in zip(got, want):
        assert abs(loss - want_loss) < 1e-5 * abs(want_loss)
        for name, g in want_grads.items():
            assert rel(grads[name], g) < 1e-4, name


def test_layers_share_compiled_code():
    from test_hf_parity import random_model

    gen = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 97, (2, 16), generator=gen), torch.randint(0, 97, (2, 16), generator=gen)
    counts = []
    for layers in (3, 7):
        torch._dynamo.reset()
        start = compiled_graphs()
        model = random_model(dict(QWEN3, num_hidden_layers=layers, mlp_only_layers=[1]))
        model.compile_dense()
        run_steps(model, ids, labels, 1)
        counts.append(compiled_graphs() - start)
    assert counts[0] > 0 and counts[0] == counts[1], counts  # compiled, and no more for more layers


@pytest.mark.parametrize("cfg", [QWEN3, GPT_OSS], ids=["qwen3", "gpt_oss"])
def test_recompute_changes_nothing(cfg):
    from test_hf_parity import random_model

    gen = torch.Generator().manual_seed(2)
    ids, labels = torch.randint(0, 97, (2, 24), generator=gen), torch.randint(0, 97, (2, 24), generator=gen)
    plain = random_model(cfg)
    again = copy.deepcopy(plain)
    again.set_recompute(attention=True, experts=True)
    assert all(layer.recompute_attention for layer in again.model.layers.values())
    calls = {"attention": 0, "experts": 0}

    def counted(fn, key):
        def run(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return run

    for layer in again.model.layers.values():
        layer.attention_block = counted(layer.attention_block, "attention")
        if layer.is_moe:
            layer.mlp.compute = counted(layer.mlp.compute, "experts")
    (loss, grads), = run_steps(plain, ids, labels, 1)
    (loss2, grads2), = run_steps(again, ids, labels, 1)
    n, moe = len(again.model.layers), len(again.moe_blocks())
    assert calls == {"attention": 2 * n, "experts": 2 * moe}, calls  # each ran again in backward
    assert loss2 == pytest.approx(loss, rel=1e-6)
    for name, g in grads.items():
        assert rel(grads2[name], g) < 1e-6, name
    loads = [b.load.sum().item() for b in again.moe_blocks()]
    assert loads == [b.load.sum().item() for b in plain.moe_blocks()]  # the router ran once per token
