"""Expert parallelism: routed token rows travel to the ranks that own their experts and back.

The `ep` ranks of a group split the E routed experts evenly: rank r owns the global experts
[r * E / ep, (r + 1) * E / ep). A token routed to k experts would, sent naively, cross the network
k times. Here it crosses once per destination *rank*:

  plan      (sender)    per token, the distinct destination ranks among its k experts; one row
                        per (token, destination), sorted by destination (`ops/permute.permute`),
                        with the token's k global expert ids (masked to the experts of that
                        destination) and routing weights. Row counts are exchanged (one small
                        all-to-all; the only host synchronisation of the layer, because the
                        all-to-all needs its split sizes on the host).
  dispatch  (network)   all-to-all of rows, weights and ids.
  compute   (receiver)  each received row is expanded to one copy per local expert it wants
                        (written into expert order), grouped GEMMs, then the copies of a row
                        are summed with their routing weights: one row per received row.
  combine   (network)   all-to-all back: one row per (token, destination), the mirror image.
  aggregate (sender)    a token sums the rows that came back from its destination ranks.

`permute` writes each token to its slots' rows (each row written once, no atomics) and `combine`
gathers them back; each is the other's backward. The all-to-alls are autograd functions
whose backward is the reverse all-to-all, so gradients (of the rows, and of the routing weights)
take the same deduplicated paths back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pithtrain.ops.permute import combine as combine_rows, count, permute


@dataclass
class ExpertGroup:
    """The expert-parallel group of this rank."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    num_experts: int  # global

    def __post_init__(self):
        if self.num_experts % self.size:
            raise ValueError(f"{self.num_experts} experts cannot be split evenly over ep = {self.size} ranks: "
                             "choose an ep that divides the number of experts")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"expert-parallel rank {self.rank} is not in [0, ep = {self.size})")

    @property
    def per_rank(self) -> int:
        return self.num_experts // self.size


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows x[sum(in_splits)] -> rows from every rank, `out_splits[r]` of them from rank r."""
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def all_to_all_grad(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


@dataclass
class ExchangePlan:
    """One micro-batch's expert-parallel routing (both the sender's and the receiver's side)."""

    k: int
    shape: torch.Size  # [B, S, H] of the layer input
    send_order: torch.Tensor  # [R_send] (token, slot) pairs that become sent rows, by destination
    send_pos: torch.Tensor  # [N * k] row of each pair, R_send for duplicates
    send_splits: list[int]  # rows to each rank
    recv_splits: list[int]  # rows from each rank
    recv_pairs: int  # (row, local expert) pairs this rank computes
    send_ids: torch.Tensor  # [R_send, k] global expert ids, -1 where the expert is on another rank
    send_weights: torch.Tensor  # [R_send, k] the token's routing weights
    recv_weights: torch.Tensor | None = None
    recv_ids: torch.Tensor | None = None


def plan(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ep: ExpertGroup,
         shape: torch.Size) -> tuple[torch.Tensor, ExchangePlan]:
    """Tokens x [N, H] with expert ids / weights [N, k] -> the rows to send [R_send, H] and the plan."""
    N, k = ids.shape
    dest = torch.div(ids, ep.per_rank, rounding_mode="floor")  # [N, k] destination rank per slot
    earlier = (dest[:, :, None] == dest[:, None, :]).tril(-1).any(-1)  # same rank chosen by an earlier slot
    key = torch.where(earlier, ep.size, dest).reshape(-1)  # duplicates sort last, past every rank
    order = torch.argsort(key, stable=True)
    counts = count(key, ep.size + 1)
    pairs = count(dest, ep.size)
    recv = torch.empty(2 * ep.size, dtype=counts.dtype, device=counts.device)
    dist.all_to_all_single(recv, torch.stack([counts[:ep.size], pairs], 1).reshape(-1).contiguous(), group=ep.group)
    # the one host synchronisation: the split sizes the all-to-all needs on the host
    sizes = torch.cat([counts[:ep.size], recv]).tolist()
    send_splits, recv = sizes[:ep.size], [sizes[ep.size + 2 * r:ep.size + 2 * r + 2] for r in range(ep.size)]
    n_send = sum(send_splits)
    order = order[:n_send]
    pos = torch.full((N * k,), n_send, dtype=order.dtype, device=order.device)
    pos[order] = torch.arange(n_send, device=order.device)
    tok, to = torch.div(order, k, rounding_mode="floor"), key[order]
    # The token's k ids, -1 where the expert lives elsewhere; its weights travel whole (the receiver
    # multiplies the slots it does not own by zero rows, so their weights get zero gradient there).
    send_ids = torch.where(dest[tok] == to[:, None], ids[tok], -1)
    send_weights = weights[tok]
    rows = permute(x, order, pos, k)
    return rows, ExchangePlan(k, shape, order, pos, send_splits, [r[0] for r in recv], sum(r[1] for r in recv),
                              send_ids, send_weights)


def dispatch(rows: torch.Tensor, p: ExchangePlan, ep: ExpertGroup) -> torch.Tensor:
    """Sent rows -> received rows [R_recv, H]; weights and ids travel with them."""
    p.recv_weights = all_to_all_grad(p.send_weights, p.recv_splits, p.send_splits, ep.group)
    p.recv_ids = all_to_all(p.send_ids, p.recv_splits, p.send_splits, ep.group)
    return all_to_all_grad(rows, p.recv_splits, p.send_splits, ep.group)


def compute(rows: torch.Tensor, p: ExchangePlan, ep: ExpertGroup, experts) -> torch.Tensor:
    """Received rows -> one weighted sum over their local experts per row [R_recv, H]."""
    R, k = p.recv_ids.shape
    local = p.recv_ids - ep.rank * ep.per_rank
    valid = (local >= 0) & (local < ep.per_rank)
    key = torch.where(valid, local, ep.per_rank).reshape(-1)
    order = torch.argsort(key, stable=True)[:p.recv_pairs]
    pos = torch.full((R * k,), p.recv_pairs, dtype=order.dtype, device=order.device)
    pos[order] = torch.arange(p.recv_pairs, device=order.device)
    offsets = torch.cumsum(count(key, ep.per_rank + 1)[:ep.per_rank], 0).to(torch.int32)
    out = experts(permute(rows, order, pos, k), offsets)
    return combine_rows(out, order, pos, k, p.recv_weights)


def combine(rows: torch.Tensor, p: ExchangePlan, ep: ExpertGroup) -> torch.Tensor:
    """Per received row results -> back to the senders [R_send, H]."""
    return all_to_all_grad(rows, p.send_splits, p.recv_splits, ep.group)


def aggregate(rows: torch.Tensor, p: ExchangePlan) -> torch.Tensor:
    """Rows that came back -> [B, S, H]: each token sums one row per destination rank it used."""
    return combine_rows(rows, p.send_order, p.send_pos, p.k).view(p.shape)


def dispatch_rows(ids: torch.Tensor, num_experts: int, ep_size: int) -> tuple[int, int]:
    """(rows sent without deduplication, rows sent with it) for expert ids [N, k] on ep ranks:
    every (token, slot) pair versus every distinct (token, destination rank) pair. Rows that stay
    on the sending rank count too (they go through the same all-to-all)."""
    dest = torch.div(ids, num_experts // ep_size, rounding_mode="floor")
    distinct = torch.zeros(ids.shape[0], ep_size, dtype=torch.bool, device=ids.device)
    distinct.scatter_(1, dest, True)
    return ids.numel(), int(distinct.sum())
