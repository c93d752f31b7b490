"""Run under torchrun (2 ranks, gloo) by test_distributed.py: `clip_grad_norm` on a rank that holds
no gradient still joins the norm's all-reduce (it used to return early, leaving the other rank
waiting), and both ranks get the global norm and factor."""

from datetime import timedelta

import torch
import torch.distributed as dist

from pithtrain.train.optim import clip_grad_norm

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
p = torch.nn.Parameter(torch.zeros(4))
if dist.get_rank() == 0:
    p.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
norm, factor = clip_grad_norm([p], 1.0, group=dist.group.WORLD)
assert abs(norm.item() - 5.0) < 1e-5, norm
assert abs(factor.item() - 0.2) < 1e-5, factor
dist.destroy_process_group()
