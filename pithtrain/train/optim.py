"""AdamW with weight decay on matrices only, and the learning-rate schedule."""

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from pithtrain.config import OptimConfig
from pithtrain.ops import use_triton
from pithtrain.ops.adamw import adamw_update, squares_sum


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _scale_grads(params, scale: torch.Tensor) -> None:
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, scale.to(grads[0].dtype))


def optimizer_step(optimizer, grad_scale: torch.Tensor | None, params: list[torch.Tensor]) -> None:
    """The step with clipping's factor (`clip_grad_norm` over `params`): folded into our AdamW's
    reading of the gradients; any other optimizer (anything with `step()`) gets them scaled first."""
    if isinstance(optimizer, AdamW):
        optimizer.step(grad_scale=grad_scale)
        return
    if grad_scale is not None:
        _scale_grads(params, grad_scale)
    optimizer.step()


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW (same hyperparameters, same state, so the same checkpoints), whose step on
    CUDA runs `ops/adamw.py`'s kernel once per parameter, on the local shard of an FSDP parameter.
    Options the kernel does not cover (amsgrad, maximize, ...) and CPU take torch's own step.
    `step(grad_scale=s)` (a 0-d tensor, clipping's factor) steps as if every gradient were times s:
    the kernel scales each gradient as it reads it; torch's step gets them scaled first.
    `step(lr=t)` (a 0-d tensor on the parameters' device) steps every group at the rate the kernel
    reads from `t` (a captured step then follows the schedule: `train/graphs.py`)."""

    @torch.no_grad()
    def init_state(self) -> None:
        """Zero moments and a step count of 0 for every parameter that has no state yet, in torch's
        format. A checkpoint saved before the first applied step holds these; left empty, torch's
        state-dict API would take a dummy step to make them, leaving counts of 1 that the next
        update would bias-correct as its second."""
        for group in self.param_groups:
            self._new_state(group["params"], group["amsgrad"])

    def _new_state(self, params: list, amsgrad: bool) -> None:
        for p in params:
            if not self.state[p]:  # as torch's fused AdamW: the step count on the parameter's device
                zeros = lambda: torch.zeros_like(p, memory_format=torch.preserve_format)  # noqa: E731
                self.state[p].update(step=torch.zeros((), dtype=torch.float32, device=_local(p).device),
                                     exp_avg=zeros(), exp_avg_sq=zeros())
                if amsgrad:
                    self.state[p]["max_exp_avg_sq"] = zeros()

    @torch.no_grad()
    def step(self, closure=None, grad_scale: torch.Tensor | None = None, lr: torch.Tensor | None = None):
        groups = self.param_groups
        if (closure is not None or any(g["amsgrad"] or g["maximize"] for g in groups)
                or not all(use_triton(_local(p), ndim=None) for g in groups for p in g["params"])):
            if lr is not None:
                raise ValueError("AdamW.step(lr=tensor) takes the kernel's path only (Triton, no amsgrad or maximize)")
            if grad_scale is not None:
                _scale_grads([p for g in groups for p in g["params"]], grad_scale)
            return super().step(closure)
        for group in groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            self._new_state(params, group["amsgrad"])
            torch._foreach_add_([self.state[p]["step"] for p in params], 1.0)
            beta1, beta2 = group["betas"]
            for p in params:
                s = self.state[p]
                adamw_update(_local(p), _local(p.grad), _local(s["exp_avg"]), _local(s["exp_avg_sq"]), s["step"],
                             float(group["lr"]) if lr is None else lr, beta1, beta2, group["eps"],
                             group["weight_decay"], grad_scale)
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
    """Learning rate of 0-based `step`: linear warmup to `lr` (reached at the last warmup step), then
    decay to `min_lr`, reached at the last step (`total - 1`), also when it is the only step after
    warmup; a run of one step and no warmup trains at `lr`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return cfg.lr
    span = total - cfg.warmup_steps - 1
    if span <= 0:
        return cfg.min_lr if cfg.warmup_steps else cfg.lr
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    if cfg.decay == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], max_norm: float, group=None,
                   replicas: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Global gradient norm, and the factor min(1, max_norm / norm) that clips the gradients to
    `max_norm` (None for max_norm 0: no clipping), for `AdamW.step(grad_scale=)` to apply as it
    reads them: the gradients are left as they are, and clipping makes no pass over them of its own.

    The squares are summed in fp32 over the stored values in one read (`ops/adamw.squares_sum`;
    no fp32 copy of them: the estimate of tools/memory.py counts none). Sharded gradients (DTensors
    of FSDP, on any mesh: dense parameters and experts alike) add their local shards' squares; the sum over `group`
    (every rank of the stage) counts each element once, `replicas` times under HSDP, which is
    divided out. One process: `group` None.
    """
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if grads:
        total = squares_sum(grads)
    else:  # nothing here, but the all-reduce below is joined all the same: the other ranks wait on it
        total = torch.zeros((), device=params[0].device if params else "cpu")
    if group is not None:
        dist.all_reduce(total, group=group)
        total = total / replicas
    norm = total.sqrt()
    return norm, (max_norm / (norm + 1e-6)).clamp(max=1.0) if max_norm > 0 else None
