"""The balancing formulas, checked against hand computation, and the permutation / grouped GEMM ops."""

import math

import pytest
import torch

from pithtrain.layers.moe import (BalanceOptions, GroupedExperts, MoEBlock, TopKRouter, aux_free_update, load_fraction,
                                  micro_batch_aux_loss, sequence_aux_loss, z_loss)
from pithtrain.ops.grouped_mm import grouped_mm_reference
from pithtrain.ops.permute import combine, permute, sort_by_expert
from pithtrain.config import OptimConfig
from pithtrain.train.optim import lr_at


def test_load_fraction_is_one_when_balanced():
    assert torch.equal(load_fraction(torch.tensor([3.0, 3.0, 3.0])), torch.ones(3))
    assert torch.allclose(load_fraction(torch.tensor([6.0, 0.0, 0.0])), torch.tensor([3.0, 0.0, 0.0]))


def test_micro_batch_aux_loss_by_hand():
    # 2 tokens, 3 experts, top-1: token 0 -> expert 0, token 1 -> expert 0
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.7, 0.2, 0.1]])
    counts = torch.tensor([2.0, 0.0, 0.0])
    # f = E * c / (k N) = [3, 0, 0]; P = [0.6, 0.25, 0.15]; aux = 3 * 0.6
    assert micro_batch_aux_loss(probs, counts).item() == pytest.approx(1.8)
    # uniform probabilities and balanced counts give exactly 1
    assert micro_batch_aux_loss(torch.full((4, 4), 0.25), torch.tensor([2.0, 2, 2, 2])).item() == pytest.approx(1.0)


def test_sequence_aux_loss_by_hand():
    probs = torch.tensor([[[0.9, 0.1], [0.8, 0.2]], [[0.5, 0.5], [0.5, 0.5]]])  # B=2, S=2, E=2
    ids = torch.tensor([[[0], [0]], [[0], [1]]])  # top-1
    # seq 0: f = [2, 0], P = [0.85, 0.15] -> 1.7 ; seq 1: f = [1, 1], P = [0.5, 0.5] -> 1.0
    assert sequence_aux_loss(probs, ids).item() == pytest.approx((1.7 + 1.0) / 2)


def test_z_loss_by_hand():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    expected = (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2
    assert z_loss(logits).item() == pytest.approx(expected)


def test_aux_free_update_moves_toward_balance():
    bias = torch.zeros(3)
    aux_free_update(bias, torch.tensor([10.0, 4.0, 1.0]), rate=0.1)
    assert torch.allclose(bias, torch.tensor([-0.1, 0.1, 0.1]))


def _block(**balance):
    torch.manual_seed(0)
    balance = BalanceOptions(**balance)
    router = TopKRouter(8, 4, 2, norm_topk_prob=True, correction_bias=balance.aux_free)
    block = MoEBlock(router, GroupedExperts(4, 8, 16), balance)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return block


def test_global_batch_aux_uses_the_step_counts():
    block = _block(aux_loss="global_batch", aux_loss_coef=1.0)
    x1, x2 = torch.randn(1, 6, 8), torch.randn(1, 6, 8)
    block.route(x1, aux_weight=0.5)
    counts1 = block.load.clone()
    block.route(x2, aux_weight=0.5)
    _, probs, _, ids = block.topk_router(x2.reshape(-1, 8))
    counts2 = torch.bincount(ids.flatten(), minlength=4).float()
    assert torch.equal(block.load, counts1 + counts2)
    first = micro_batch_aux_loss(block.topk_router(x1.reshape(-1, 8))[1], counts1)
    second = micro_batch_aux_loss(probs, counts1 + counts2)
    assert block.aux_total.item() == pytest.approx(0.5 * (first + second).item(), rel=1e-6)
    stats = block.end_step()
    assert torch.equal(stats["load"], counts1 + counts2) and block.load.sum() == 0


def test_aux_loss_gradient_reaches_the_router():
    block = _block(aux_loss="micro_batch", aux_loss_coef=1.0)
    x = torch.randn(2, 5, 8, requires_grad=True)
    rows, plan = block.route(x, aux_weight=1.0)
    rows.sum().backward()  # rows do not depend on router weights: only the aux loss reaches them
    assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0
    ref = _block(aux_loss="micro_batch", aux_loss_coef=1.0)
    logits, probs, _, ids = ref.gate(x.detach().reshape(-1, 8))
    micro_batch_aux_loss(probs, torch.bincount(ids.flatten(), minlength=4)).backward()
    assert torch.allclose(block.gate.weight.grad, ref.gate.weight.grad, atol=1e-6)


def test_aux_free_bias_changes_selection_not_weights():
    block = _block(aux_free=True)
    x = torch.randn(10, 8)
    _, probs, w0, ids0 = block.topk_router(x)
    block.gate.e_score_correction_bias[:] = torch.tensor([-10.0, -10.0, 0.0, 0.0])
    _, probs1, w1, ids1 = block.topk_router(x)
    assert set(ids1.flatten().tolist()) == {2, 3}
    expected = probs.gather(1, ids1)
    assert torch.allclose(w1, expected / expected.sum(-1, keepdim=True))


def test_permute_roundtrip_and_backward():
    torch.manual_seed(1)
    N, k, H, E = 7, 3, 5, 4
    x = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(N)])
    order, inverse, counts = sort_by_expert(ids, E)
    rows = permute(x, order, inverse, k)
    assert torch.equal(rows, x.repeat_interleave(k, 0)[order])
    assert torch.equal(ids.flatten()[order], torch.sort(ids.flatten(), stable=True).values)
    w = torch.rand(N, k, dtype=torch.float64, requires_grad=True)
    back = combine(rows, order, inverse, k, w)
    assert torch.allclose(back, x * w.sum(1, keepdim=True))
    torch.autograd.gradcheck(lambda t: permute(t, order, inverse, k), (x,))
    r = torch.randn(N * k, H, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t, u: combine(t, order, inverse, k, u), (r, w))
    # Pairs without a row (pos = M): zero contributions, zero gradients.
    keep = order[: N * k - 4]
    pos = torch.full((N * k,), keep.shape[0], dtype=torch.long)
    pos[keep] = torch.arange(keep.shape[0])
    r2 = torch.randn(keep.shape[0], H, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t, u: combine(t, keep, pos, k, u), (r2, w))
    torch.autograd.gradcheck(lambda t: permute(t, keep, pos, k), (x,))


@pytest.mark.parametrize("E", [8, 40000])  # int16 sort keys, and int64 past int16's range
def test_sort_by_expert_is_a_stable_sort_with_its_inverse(E):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, E, (500, 4), generator=gen)
    ids[:100] = E - 1  # many ties
    order, inverse, counts = sort_by_expert(ids, E)
    assert torch.equal(order, torch.argsort(ids.flatten(), stable=True))
    assert torch.equal(inverse[order], torch.arange(ids.numel()))
    assert torch.equal(counts, torch.bincount(ids.flatten(), minlength=E))


def test_grouped_mm_reference_with_empty_groups():
    x = torch.randn(6, 4)
    w = torch.randn(3, 4, 2)
    offsets = torch.tensor([2, 2, 6], dtype=torch.int32)
    out = grouped_mm_reference(x, w, offsets)
    assert torch.allclose(out, torch.cat([x[:2] @ w[0], x[2:] @ w[2]]))


def test_lr_schedule():
    c = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, decay="cosine")
    assert [lr_at(s, 14, c) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, 14, c) == pytest.approx(1.0) and lr_at(13, 14, c) == pytest.approx(0.1)
    assert lr_at(4 + 9 // 2, 14, c) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 9)))
    lin = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, decay="linear")
    assert lr_at(0, 11, lin) == 1.0 and lr_at(5, 11, lin) == pytest.approx(0.5) and lr_at(10, 11, lin) == 0.0
    # one step after warmup: it is the last, at min_lr (warmup reached lr at its own last step)
    assert [lr_at(s, 5, c) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, pytest.approx(0.1)]
    assert lr_at(0, 1, lin) == 1.0
    const = OptimConfig(lr=1.0, warmup_steps=2, decay="constant")
    assert lr_at(1, 10, const) == 1.0 and lr_at(9, 10, const) == 1.0


@pytest.mark.parametrize("heads,kv_heads,dim,v_dim,window,sinks", [
    (4, 2, 8, 8, None, False),  # GQA, causal
    (4, 4, 12, 6, None, False),  # MLA-like: value size differs from key size
    (4, 1, 8, 8, 5, True),  # GPT-OSS: sliding window across block edges, sinks
    (2, 2, 8, 8, 3, False),
])
def test_ring_attention_block_math_matches_attend(heads, kv_heads, dim, v_dim, window, sinks):
    """The ring's blockwise forward (LSE merging, skipped blocks) and hand-written backward on one
    rank equal SDPA through `attend`: outputs and the gradients of q, k, v and the sinks."""
    from pithtrain.layers.attention import attend
    from pithtrain.parallel.context import ContextGroup, ring_attention

    gen = torch.Generator().manual_seed(3)
    B, S = 2, 16
    q = torch.randn(B, heads, S, dim, generator=gen, requires_grad=True)
    k = torch.randn(B, kv_heads, S, dim, generator=gen, requires_grad=True)
    v = torch.randn(B, kv_heads, S, v_dim, generator=gen, requires_grad=True)
    s = torch.randn(heads, generator=gen, requires_grad=True) if sinks else None
    scale = 0.3
    ours = ring_attention(q, k, v, ContextGroup(None, 1, 0), scale=scale, window=window, sinks=s)
    ours = ours.transpose(1, 2).reshape(B, S, -1)
    ref = attend(q, k, v, scale=scale, window=window, sinks=s)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ref)
    inputs = [q, k, v] + ([s] if sinks else [])
    got = torch.autograd.grad((ours * g).sum(), inputs)
    want = torch.autograd.grad((ref * g).sum(), inputs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the training forward runs; backward outside it
        under = ring_attention(q, k, v, ContextGroup(None, 1, 0), scale=scale, window=window, sinks=s)
    torch.testing.assert_close(under.transpose(1, 2).reshape(B, S, -1), ref, rtol=1e-5, atol=1e-5)
    got = torch.autograd.grad((under.transpose(1, 2).reshape(B, S, -1) * g).sum(), inputs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
