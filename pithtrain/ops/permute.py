"""Gather-based token permutation between token order and expert order.

A routed token appears k times (once per chosen expert). `order` lists the flattened
(token, slot) pairs sorted by expert; `inverse` is its inverse permutation. Both directions are
row gathers, forward and backward: no scatter-add (and so no atomics) on the hot path. The
backward of `permute` sums a token's k copies with a reshape, not with index_add.
"""

import torch


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int):
    """expert_ids [N, k] -> (order, inverse, counts [num_experts]) with a stable sort."""
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.argsort(order)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, inverse, counts


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order, inverse, k):
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, torch.div(order, k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        g = grad.index_select(0, inverse)  # back to (token, slot) order
        return g.view(-1, ctx.k, g.shape[-1]).sum(1), None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, order, inverse):
        ctx.save_for_backward(order)
        return rows.index_select(0, inverse)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return grad.index_select(0, order), None, None


def permute(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """Tokens x [N, H] -> expert-sorted rows [N*k, H]."""
    return _Permute.apply(x, order, inverse, k)


def unpermute(rows: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Expert-sorted rows [N*k, H] -> (token, slot) order [N*k, H]."""
    return _Unpermute.apply(rows, order, inverse)
