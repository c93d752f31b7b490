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

Distributed (set by `parallel/fsdp.py`): the counts behind f are summed over `stats_group` (every
rank of the stage) for `micro_batch` / `global_batch`, and over `seq_group` (the context-parallel
ranks that share a sequence) for `sequence`; P stays local, weighted by the rank's token share.
The sum of every rank's loss is then the single-process loss of the same global micro-batches.
With `ep` set, the experts here are this rank's share and stages 2-5 go through
`parallel/expert.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pithtrain.ops.expert_bias import add_expert_bias
from pithtrain.ops.grouped_mm import grouped_mm
from pithtrain.ops.swiglu import swiglu
from pithtrain.ops.permute import combine, count, permute, sort_by_expert
from pithtrain.parallel import expert as ep_exchange


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


def sequence_aux_loss(probs: torch.Tensor, expert_ids: torch.Tensor, group=None) -> torch.Tensor:
    """probs [B, S, E], expert_ids [B, S, k]: the balance loss of each sequence, averaged. With
    `group` (context parallel) the counts are summed over the ranks that hold parts of the sequences."""
    counts = expert_counts(expert_ids, probs.shape[-1])
    if group is not None:
        dist.all_reduce(counts, group=group)
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


class _RouterLogits(torch.autograd.Function):
    """x [N, H] @ w [E, H]^T (+ b) -> fp32 logits, for bf16 x and w on CUDA: a bf16 tensor-core GEMM
    that accumulates and writes fp32, the same products and sums as the fp32 GEMM (bf16 values are
    exact in fp32) at a tenth of its time. The backward's GEMMs take the fp32 gradient rounded to
    bf16, as every other bf16 layer's backward does. 3 fp32 GEMMs took 0.34 ms per Qwen3 layer."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.bias_dtype = None if b is None else b.dtype
        logits = torch.mm(x, w.t(), out_dtype=torch.float32)
        return logits if b is None else logits + b.float()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        g = grad.to(x.dtype)
        return g @ w, g.t() @ x, None if ctx.bias_dtype is None else grad.sum(0).to(ctx.bias_dtype)


def router_logits(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """fp32 router logits; see `_RouterLogits`. Elsewhere (CPU, fp32 weights): an fp32 F.linear."""
    if x.is_cuda and x.dtype == w.dtype == torch.bfloat16:
        return _RouterLogits.apply(x, w, b)
    return F.linear(x.float(), w.float(), None if b is None else b.float())


class TopKRouter(nn.Module):
    """Scores every expert for each token and picks `top_k` of them; computed in fp32 (the logits
    by `router_logits`).

    `score`: `softmax` over all experts (Qwen3, DeepSeek-V2), `sigmoid` (DeepSeek-V3), or
    `softmax_topk`: the top-k is taken on the logits and the softmax over the k chosen ones
    gives the weights (GPT-OSS). Options, in the order they apply:
    - `correction_bias`: a per-expert buffer added to the scores for the choice only (DeepSeek-V3's
      `e_score_correction_bias`; the aux-free balancing moves it);
    - `n_group` / `topk_group`: experts split into groups, the best `topk_group` groups kept
      (a group's score: its best expert, `group_score="max"`, DeepSeek-V2's group_limited_greedy;
      or its best two summed, `"top2_sum"`, DeepSeek-V3's noaux_tc), the top-k taken inside them;
    - `norm_topk_prob`: the k weights renormalised to sum to 1;
    - `scaling_factor`: the weights multiplied by it (DeepSeek's routed_scaling_factor).
    `probs` (for the balancing losses) are the softmax over all logits, or for `sigmoid` the
    scores normalised to sum to 1.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, score: str = "softmax",
                 norm_topk_prob: bool = False, scaling_factor: float = 1.0, n_group: int = 1,
                 topk_group: int = 1, group_score: str = "max", bias: bool = False, correction_bias: bool = False):
        super().__init__()
        if score not in ("softmax", "sigmoid", "softmax_topk"):
            raise ValueError(f"router score {score!r}: use softmax, sigmoid or softmax_topk")
        if num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"{num_experts} experts cannot form {n_group} groups with topk_group={topk_group}")
        if top_k > num_experts // n_group * topk_group:
            raise ValueError(f"top_k={top_k} is more than the {num_experts // n_group * topk_group} experts "
                             f"in the {topk_group} kept groups")
        self.num_experts, self.top_k, self.score, self.norm_topk_prob = num_experts, top_k, score, norm_topk_prob
        self.scaling_factor, self.n_group, self.topk_group, self.group_score = scaling_factor, n_group, topk_group, group_score
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None
        if correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        else:
            self.e_score_correction_bias = None

    def _keep_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        groups = choice.view(choice.shape[0], self.n_group, -1)
        if self.group_score == "max":
            group_scores = groups.max(-1).values
        else:
            group_scores = groups.topk(2, dim=-1).values.sum(-1)
        best = group_scores.topk(self.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return groups.masked_fill(~keep[..., None], float("-inf")).view_as(choice)

    def forward(self, x: torch.Tensor):
        """x [N, H] -> logits [N, E], probs [N, E], weights [N, k] (all fp32), expert ids [N, k]."""
        with torch.autocast(x.device.type, enabled=False):
            logits = router_logits(x, self.weight, self.bias)
        if self.score == "sigmoid":
            scores = logits.sigmoid()
            probs = scores / scores.sum(-1, keepdim=True)
        else:
            scores = probs = torch.softmax(logits, dim=-1)
        choice = logits if self.score == "softmax_topk" else scores
        if self.e_score_correction_bias is not None:
            choice = choice + self.e_score_correction_bias
        if self.n_group > 1:
            choice = self._keep_best_groups(choice)
        ids = torch.topk(choice, self.top_k, dim=-1).indices
        if self.score == "softmax_topk":
            weights = torch.softmax(logits.gather(1, ids), dim=-1)
        else:
            weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if self.scaling_factor != 1.0:
            weights = weights * self.scaling_factor
        return logits, probs, weights, ids


class GroupedExperts(nn.Module):
    """E gated-MLP experts stored as stacked 3D weights, run by grouped GEMMs.

    Layouts (HF in-memory names): by default gate_up_proj [E, 2I, H] and down_proj [E, H, I]
    (Qwen3, DeepSeek); `transposed`: gate_up_proj [E, H, 2I] and down_proj [E, I, H] (GPT-OSS).
    `bias` adds gate_up_proj_bias [E, 2I] and down_proj_bias [E, H]. `activation` maps the
    [rows, 2I] gate/up projection to [rows, I] (see `ops/swiglu.py`). `first_expert` is the
    global id of local expert 0.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, first_expert: int = 0, *,
                 transposed: bool = False, bias: bool = False, activation=swiglu):
        super().__init__()
        self.num_experts, self.first_expert, self.transposed, self.activation = num_experts, first_expert, transposed, activation
        self.hidden, self.intermediate, self.bias = hidden, intermediate, bias
        up_shape = (hidden, 2 * intermediate) if transposed else (2 * intermediate, hidden)
        down_shape = (intermediate, hidden) if transposed else (hidden, intermediate)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, *up_shape))
        self.down_proj = nn.Parameter(torch.empty(num_experts, *down_shape))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None

    def local_share(self, rank: int, ranks: int) -> "GroupedExperts":
        """The experts rank `rank` of `ranks` owns, as a new module on the same device (unset weights)."""
        n = self.num_experts // ranks
        return GroupedExperts(n, self.hidden, self.intermediate, self.first_expert + rank * n,
                              transposed=self.transposed, bias=self.bias, activation=self.activation).to(
                                  self.gate_up_proj.device)

    def _weight(self, w: torch.Tensor) -> torch.Tensor:  # -> [E, in, out] for grouped_mm
        return w if self.transposed else w.transpose(1, 2)

    def forward(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        h = grouped_mm(rows, self._weight(self.gate_up_proj), offsets)
        if self.gate_up_proj_bias is not None:
            h = add_expert_bias(h, self.gate_up_proj_bias, offsets)
        out = grouped_mm(self.activation(h), self._weight(self.down_proj), offsets)
        if self.down_proj_bias is not None:
            out = add_expert_bias(out, self.down_proj_bias, offsets)
        return out


@dataclass
class RoutePlan:
    """What the later stages need to know about one micro-batch's routing."""

    order: torch.Tensor  # [N*k] (token, slot) pairs sorted by expert
    inverse: torch.Tensor  # inverse permutation of order
    offsets: torch.Tensor  # [E] int32 cumulative row counts per expert
    weights: torch.Tensor  # [N, k] routing weights
    shape: torch.Size  # [B, S, H] of the layer input


class MoEBlock(nn.Module):
    """Routed experts (+ optional shared experts, always applied). The router is registered under
    `router_name` (HF: `gate` for Qwen3 / DeepSeek, `router` for GPT-OSS) and read as `topk_router`."""

    def __init__(self, router: TopKRouter, experts: GroupedExperts, balance: BalanceOptions, *,
                 shared_experts: nn.Module | None = None, router_name: str = "gate"):
        super().__init__()
        self.num_experts, self.top_k, self.balance = router.num_experts, router.top_k, balance
        if balance.aux_free and router.e_score_correction_bias is None:
            raise ValueError("moe.aux_free needs a router with a correction bias (correction_bias=True)")
        self.router_name = router_name
        self.add_module(router_name, router)
        self.experts = experts
        self.shared_experts = shared_experts
        self.ep: ep_exchange.ExpertGroup | None = None  # expert parallelism (parallel/fsdp.py sets these)
        self.stats_group = self.seq_group = None
        # Step statistics (not saved): assignments per expert, weighted balancing loss.
        self.register_buffer("load", torch.zeros(router.num_experts), persistent=False)
        self.register_buffer("aux_total", torch.zeros(()), persistent=False)

    @property
    def topk_router(self) -> TopKRouter:
        return self._modules[self.router_name]

    def select(self, flat: torch.Tensor):
        """Router on flat [N, H], then the expert order of the (token, slot) pairs and the int32
        cumulative counts (local experts), or only the counts (expert parallel): one compiled graph
        (`CausalLM.compile_dense`), which saves the host the launches of the sort's bookkeeping."""
        logits, probs, weights, ids = self.topk_router(flat)
        if self.ep is not None:
            return logits, probs, weights, ids, None, None, count(ids, self.num_experts), None
        order, inverse, counts = sort_by_expert(ids, self.num_experts)
        return logits, probs, weights, ids, order, inverse, counts, torch.cumsum(counts, 0).to(torch.int32)

    def route(self, x: torch.Tensor, aux_weight: float | None) -> tuple[torch.Tensor, RoutePlan]:
        """x [B, S, H] (normed) -> expert-sorted rows [N*k, H] and the plan.

        `aux_weight` scales the balancing losses of this micro-batch (`loop.train_step`); None turns
        them off. A weight of 0 still computes them (their collectives run on every rank alike).
        """
        B, S, H = x.shape
        flat = x.reshape(-1, H)
        logits, probs, weights, ids, order, inverse, local_counts, offsets = self.select(flat)
        counts = local_counts
        if self.training:
            with torch.no_grad():
                if self.stats_group is not None:  # the counts of every rank's tokens
                    counts = counts.float()
                    dist.all_reduce(counts, group=self.stats_group)
                self.load += counts
        loss = self._balance_loss(logits, probs, ids, counts, B) if aux_weight is not None and self.training else None
        if loss is not None:
            loss = loss * aux_weight
            self.aux_total += loss.detach()
            flat = attach_aux_loss(flat, loss)
        if self.ep is not None:
            return ep_exchange.plan(flat, ids, weights, self.ep, x.shape)
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
                aux = sequence_aux_loss(probs.view(batch, -1, self.num_experts), ids.view(batch, -1, self.top_k),
                                        self.seq_group)
            else:
                raise ValueError(f"unknown aux_loss {b.aux_loss!r}")
            loss = b.aux_loss_coef * aux
        if b.z_loss_coef:
            z = b.z_loss_coef * z_loss(logits)
            loss = z if loss is None else loss + z
        return loss

    def dispatch(self, rows: torch.Tensor, plan) -> torch.Tensor:
        return rows if self.ep is None else ep_exchange.dispatch(rows, plan, self.ep)

    def compute(self, rows: torch.Tensor, plan) -> torch.Tensor:
        if self.ep is None:
            return self.experts(rows, plan.offsets)
        return ep_exchange.compute(rows, plan, self.ep, self.experts)

    def combine(self, rows: torch.Tensor, plan) -> torch.Tensor:
        return rows if self.ep is None else ep_exchange.combine(rows, plan, self.ep)

    def aggregate(self, rows: torch.Tensor, plan) -> torch.Tensor:
        """Expert outputs back to token order and summed with the routing weights -> [B, S, H]."""
        if self.ep is not None:
            return ep_exchange.aggregate(rows, plan)
        return combine(rows, plan.order, plan.inverse, self.top_k, plan.weights).view(plan.shape)

    @torch.no_grad()
    def end_step(self, applied: bool = True) -> dict:
        """Read and reset the step statistics; apply the aux-free bias update (not for a step
        the guards skipped, `applied=False`)."""
        load = self.load.clone()
        stats = {"load": load, "aux": self.aux_total.clone()}
        if self.balance.aux_free and applied:
            aux_free_update(self.topk_router.e_score_correction_bias, load, self.balance.aux_free_rate)
        self.load.zero_()
        self.aux_total.zero_()
        return stats
