"""Run under torchrun (2 ranks, gloo) by test_distributed.py: one train_step of a tiny DeepSeek-V2
under context parallelism (cp=2) with the sequence balancing loss and the z-loss, on labels whose
middle half is ignored (-100): cp rank 1's two blocks hold no target. argv: the run's TOML, the
output file; rank 0 saves loss, grad norm and every full gradient there, for the test to compare
with one process."""

import sys

import torch
import torch.distributed as dist

from conftest import masked_middle_batches
from pithtrain.config import load_config
from pithtrain.parallel.context import block_positions, shard_sequence
from pithtrain.parallel.mesh import init_distributed, plan_layout
from pithtrain.train.loop import build_for_training, train_step


class Keep:
    """Stands in for the optimizer: keeps every full gradient when the step is taken."""

    def __init__(self, model):
        self.model, self.grads = model, {}

    def step(self):
        self.grads = {n: p.grad.full_tensor().clone() for n, p in self.model.named_parameters() if p.grad is not None}

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=True)


torch.set_num_threads(1)
cfg = load_config(sys.argv[1], ["parallel.cp=2"])
mesh = init_distributed(plan_layout(cfg, 2), "cpu", 120.0)
model = build_for_training(cfg, torch.device("cpu"), mesh)
keep, r = Keep(model), mesh.coord("cp")
mine = [(shard_sequence(ids, 2, r), shard_sequence(labels, 2, r), block_positions(ids.shape[1], 2, r).expand(2, -1), None)
        for ids, labels in masked_middle_batches(cfg.model.hf["vocab_size"], 2, 32, 2)]
out = train_step(model, keep, mine, 0.0, torch.device("cpu"), None, mesh)
if dist.get_rank() == 0:
    torch.save({"loss": out["loss"].item(), "grad_norm": out["grad_norm"].item(), "grads": keep.grads}, sys.argv[2])
dist.barrier()
dist.destroy_process_group()
