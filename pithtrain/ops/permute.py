"""Gather-based token permutation between token order and expert order.

A routed token has k slots (one per chosen expert); slot j of token t is pair p = t * k + j.
`order` [M] lists the pairs that become rows, sorted by expert (or by destination rank); `pos`
[N * k] gives each pair's row, or M for a pair that has no row (a duplicate that expert
parallelism does not send twice, or a slot owned by another rank). With every pair kept
(M = N * k, one rank) `pos` is simply the inverse permutation of `order`.

Both directions are row gathers, forward and backward: no scatter-add (and so no atomics) on
the hot path. Where a direction must sum (a token's k copies), the rows are gathered into a
[N, k, H] block, with a zero row standing in for missing pairs, and summed over k.
"""

import torch


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int):
    """expert_ids [N, k] -> (order, inverse, counts [num_experts]) with a stable sort."""
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.argsort(order)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, inverse, counts


def _gather_slots(rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """rows [M, H] -> [len(pos), H]; entries of pos equal to M give zero rows."""
    if pos.shape[0] != rows.shape[0]:  # some pairs have no row: append the zero row they point at
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
    return rows.index_select(0, pos)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order, pos, k):
        ctx.save_for_backward(pos)
        ctx.k = k
        return x.index_select(0, torch.div(order, k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad):
        (pos,) = ctx.saved_tensors
        g = _gather_slots(grad, pos)  # back to (token, slot) order, zeros for pairs without a row
        return g.view(-1, ctx.k, g.shape[-1]).sum(1), None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, order, pos):
        ctx.save_for_backward(order)
        return _gather_slots(rows, pos)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return grad.index_select(0, order), None, None


def permute(x: torch.Tensor, order: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
    """Tokens x [N, H] -> rows [M, H], row i a copy of token order[i] // k."""
    return _Permute.apply(x, order, pos, k)


def unpermute(rows: torch.Tensor, order: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rows [M, H] -> (token, slot) order [N * k, H], zero for pairs without a row."""
    return _Unpermute.apply(rows, order, pos)
