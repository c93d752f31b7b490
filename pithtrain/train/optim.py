"""AdamW with weight decay on matrices only, and the learning-rate schedule."""

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from pithtrain.config import OptimConfig
from pithtrain.ops import use_triton
from pithtrain.ops.adamw import adamw_update


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW (same hyperparameters, same state, so the same checkpoints), whose step on
    CUDA runs `ops/adamw.py`'s kernel once per parameter, on the local shard of an FSDP parameter.
    Options the kernel does not cover (amsgrad, maximize, ...) and CPU take torch's own step."""

    @torch.no_grad()
    def step(self, closure=None):
        groups = self.param_groups
        if (closure is not None or any(g["amsgrad"] or g["maximize"] for g in groups)
                or not all(use_triton(_local(p), ndim=None) for g in groups for p in g["params"])):
            return super().step(closure)
        for group in groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if not self.state[p]:  # as torch's fused AdamW: the step count on the parameter's device
                    self.state[p].update(step=torch.zeros((), dtype=torch.float32, device=_local(p).device),
                                         exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                                         exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
            torch._foreach_add_([self.state[p]["step"] for p in params], 1.0)
            beta1, beta2 = group["betas"]
            for p in params:
                s = self.state[p]
                adamw_update(_local(p), _local(p.grad), _local(s["exp_avg"]), _local(s["exp_avg_sq"]), s["step"],
                             float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"])
        return None


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> AdamW:
    """Matrices (projections, experts, embeddings) get weight decay; norms, sinks and biases
    (GPT-OSS's per-expert biases [E, n] too) do not."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in params if p.ndim >= 2 and not n.endswith("bias")]
    no_decay = [p for n, p in params if p.ndim < 2 or n.endswith("bias")]
    fused = all(p.is_cuda for _, p in params)
    optimizer = AdamW([{"params": decay}, {"params": no_decay}], lr=cfg.lr, fused=fused or None)
    set_hyperparameters(optimizer, cfg)
    return optimizer


def set_hyperparameters(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> None:
    """The config's betas, eps and weight decay on the groups of `build_optimizer`: a resumed
    optimizer state brings the saved ones, and the run follows its config (as it does for lr)."""
    for group, weight_decay in zip(optimizer.param_groups, (cfg.weight_decay, 0.0), strict=True):
        group.update(betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=weight_decay)


def lr_at(step: int, total: int, cfg: OptimConfig) -> float:
    """Learning rate of 0-based `step`: linear warmup to `lr`, then decay to `min_lr` at the end."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return cfg.lr
    span = max(total - cfg.warmup_steps - 1, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    if cfg.decay == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], max_norm: float, group=None, replicas: int = 1) -> torch.Tensor:
    """Global gradient norm, and gradients scaled down to `max_norm` if above (0: no clipping).

    Sharded gradients (DTensors of FSDP, on any mesh: dense parameters and experts alike) add
    their local shards' squares; the sum over `group` (every rank of the stage) counts each
    element once, `replicas` times under HSDP, which is divided out. One process: `group` None.
    """
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.stack([g.float().square().sum() for g in grads]).sum()
    if group is not None:
        dist.all_reduce(total, group=group)
        total = total / replicas
    norm = total.sqrt()
    if max_norm > 0:
        torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0).to(grads[0].dtype))
    return norm
