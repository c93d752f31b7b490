"""Mixture-of-experts building blocks: router, grouped experts, load balancing, the MoE block.

The MoE block is run by the decoder layer in stages (see `layers/transformer.py`):
`route` (router, top-k, balancing losses, permutation into expert order), `dispatch` (rows to the
ranks that own the experts; local here), `compute` (grouped GEMMs), `combine` (rows back; local
here) and `aggregate` (back to token order, weighted sum over the k experts of each token).

Load balancing (`BalanceOptions`). With E experts, top-k, N tokens, counts c_i (token-expert
assignments to expert i) and router probabilities p:
    f_i = E * c_i / (k * N)          (1 for every expert when the load is uniform)
    P_i = mean over tokens of p_i
    aux = sum_i f_i * P_i            (1 at perfect balance)
- `micro_batch`: f and P over the tokens of the micro-batch.
- `sequence`: f and P per sequence, aux averaged over sequences (DeepSeek-V3's sequence-wise loss).
- `global_batch`: f from the counts of every micro-batch of the optimizer step seen so far (the
  current one included) and P from the current micro-batch: the balance is asked of the whole
  step, not of each micro-batch. Counts are kept per step in the `load` buffer.
- z-loss: mean over tokens of logsumexp(router logits)^2.
- aux-free: a per-expert bias added to the scores for expert selection only (never to the
  weights); after each optimizer step it moves by `rate * sign(mean load - load_i)`.
Loss gradients enter through `attach_aux_loss`, so no loss has to travel to the end of the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pithtrain.layers.mlp import SwiGLUMLP
from pithtrain.ops.grouped_mm import grouped_mm
from pithtrain.ops.permute import permute, sort_by_expert, unpermute


@dataclass
class BalanceOptions:
    aux_loss: str = "none"  # none | global_batch | micro_batch | sequence
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    aux_free: bool = False
    aux_free_rate: float = 1e-3


def load_fraction(counts: torch.Tensor) -> torch.Tensor:
    """counts [..., E] of token-expert assignments -> f [..., E], 1 everywhere when balanced."""
    counts = counts.float()
    return counts * counts.shape[-1] / counts.sum(-1, keepdim=True).clamp(min=1)


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """expert_ids [B, S, k] -> counts [B, num_experts] per sequence."""
    B = expert_ids.shape[0]
    flat = expert_ids.reshape(B, -1)
    return torch.zeros(B, num_experts, device=flat.device).scatter_add_(1, flat, torch.ones_like(flat, dtype=torch.float))


def micro_batch_aux_loss(probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """probs [N, E], counts [E] of the same tokens (or of the whole step, for global_batch)."""
    return (load_fraction(counts) * probs.mean(0)).sum()


def sequence_aux_loss(probs: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """probs [B, S, E], expert_ids [B, S, k]: the balance loss of each sequence, averaged."""
    counts = expert_counts(expert_ids, probs.shape[-1])
    return (load_fraction(counts) * probs.mean(1)).sum(-1).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


@torch.no_grad()
def aux_free_update(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """Raise the bias of under-loaded experts and lower it for over-loaded ones."""
    bias.add_(rate * torch.sign(load.float().mean() - load.float()))


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `x`; in backward it also starts the backward of `loss` with gradient 1."""

    @staticmethod
    def forward(ctx, x, loss):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), device=grad.device)


def attach_aux_loss(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    return _AttachAuxLoss.apply(x, loss.float())


class TopKRouter(nn.Module):
    """Softmax router: probabilities over all experts, top-k chosen, optionally renormalised."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool, aux_free: bool):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        if aux_free:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor):
        """x [N, H] -> logits [N, E], probs [N, E] (fp32), weights [N, k], expert ids [N, k]."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        scores = probs if self.e_score_correction_bias is None else probs + self.e_score_correction_bias
        ids = torch.topk(scores, self.top_k, dim=-1).indices
        weights = probs.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, probs, weights.to(logits.dtype), ids


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked 3D weights (HF layout: gate_up_proj [E, 2I, H] with the
    gate half first, down_proj [E, H, I]). `first_expert` is the global id of local expert 0."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, first_expert: int = 0):
        super().__init__()
        self.num_experts, self.first_expert = num_experts, first_expert
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        gate, up = grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offsets).chunk(2, dim=-1)
        return grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offsets)


@dataclass
class RoutePlan:
    """What the later stages need to know about one micro-batch's routing."""

    order: torch.Tensor  # [N*k] (token, slot) pairs sorted by expert
    inverse: torch.Tensor  # inverse permutation of order
    offsets: torch.Tensor  # [E] int32 cumulative row counts per expert
    weights: torch.Tensor  # [N, k] routing weights
    shape: torch.Size  # [B, S, H] of the layer input


class MoEBlock(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, *,
                 norm_topk_prob: bool, balance: BalanceOptions, shared_intermediate: int = 0):
        super().__init__()
        self.num_experts, self.top_k, self.balance = num_experts, top_k, balance
        self.gate = TopKRouter(hidden, num_experts, top_k, norm_topk_prob, balance.aux_free)
        self.experts = GroupedExperts(num_experts, hidden, intermediate)
        self.shared_experts = SwiGLUMLP(hidden, shared_intermediate) if shared_intermediate else None
        # Step statistics (not saved): assignments per expert, weighted balancing loss.
        self.register_buffer("load", torch.zeros(num_experts), persistent=False)
        self.register_buffer("aux_total", torch.zeros(()), persistent=False)

    def route(self, x: torch.Tensor, aux_weight: float) -> tuple[torch.Tensor, RoutePlan]:
        """x [B, S, H] (normed) -> expert-sorted rows [N*k, H] and the plan.

        `aux_weight` scales the balancing losses of this micro-batch (its share of the step's
        tokens); 0 turns them off (evaluation).
        """
        B, S, H = x.shape
        flat = x.reshape(-1, H)
        logits, probs, weights, ids = self.gate(flat)
        order, inverse, counts = sort_by_expert(ids, self.num_experts)
        with torch.no_grad():
            if self.training:
                self.load += counts
        loss = self._balance_loss(logits, probs, ids, counts, B) if aux_weight and self.training else None
        if loss is not None:
            loss = loss * aux_weight
            self.aux_total += loss.detach()
            flat = attach_aux_loss(flat, loss)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        rows = permute(flat, order, inverse, self.top_k)
        return rows, RoutePlan(order, inverse, offsets, weights, x.shape)

    def _balance_loss(self, logits, probs, ids, counts, batch: int):
        b, loss = self.balance, None
        if b.aux_loss != "none" and b.aux_loss_coef:
            if b.aux_loss == "micro_batch":
                aux = micro_batch_aux_loss(probs, counts)
            elif b.aux_loss == "global_batch":
                aux = micro_batch_aux_loss(probs, self.load)
            elif b.aux_loss == "sequence":
                aux = sequence_aux_loss(probs.view(batch, -1, self.num_experts), ids.view(batch, -1, self.top_k))
            else:
                raise ValueError(f"unknown aux_loss {b.aux_loss!r}")
            loss = b.aux_loss_coef * aux
        if b.z_loss_coef:
            z = b.z_loss_coef * z_loss(logits)
            loss = z if loss is None else loss + z
        return loss

    def dispatch(self, rows: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
        return rows  # single rank: every expert is local

    def compute(self, rows: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
        return self.experts(rows, plan.offsets)

    def combine(self, rows: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
        return rows

    def aggregate(self, rows: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
        """Expert outputs back to token order and summed with the routing weights -> [B, S, H]."""
        B, S, H = plan.shape
        per_slot = unpermute(rows, plan.order, plan.inverse).view(B * S, self.top_k, H)
        out = torch.bmm(plan.weights.unsqueeze(1).to(per_slot.dtype), per_slot)
        return out.view(B, S, H)

    @torch.no_grad()
    def end_step(self) -> dict:
        """Read and reset the step statistics; apply the aux-free bias update."""
        load = self.load.clone()
        stats = {"load": load, "aux": self.aux_total.clone()}
        if self.balance.aux_free:
            aux_free_update(self.gate.e_score_correction_bias, load, self.balance.aux_free_rate)
        self.load.zero_()
        self.aux_total.zero_()
        return stats
