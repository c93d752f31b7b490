"""Run under torchrun -n 1 on a GPU by test_gpu.py: the sharded path (FSDP2 on one rank) of a 2-layer
Qwen3-30B-A3B cut, micro-batches of 2 x 2048, with train.param_dtype and the number of micro-batches
a step from argv; prints one line, MEMORY and JSON: the peak of each of 4 steps (from what the process held
before the model was built) and tools/memory.py's estimate for the same run."""

import json
import os
import sys

import torch

from pithtrain.config import load_config
from pithtrain.parallel.mesh import init_distributed, plan_layout
from pithtrain.tools.memory import estimate_for_run
from pithtrain.train.loop import build_for_training, resolve_device, train_step
from pithtrain.train.optim import build_optimizer

param_dtype, micro = sys.argv[1], int(sys.argv[2])
toml = os.path.join(os.path.dirname(__file__), "..", "examples", "qwen3_30b_a3b", "train.toml")
cfg = load_config(toml, ["model.num_hidden_layers=2", "data.micro_batch_size=2", "data.seq_len=2048",
                         f"data.global_batch_size={2 * micro}", f"train.param_dtype={param_dtype}"])
device, amp = resolve_device(cfg)
mesh = init_distributed(plan_layout(cfg, 1), "cuda", 300.0)
est = estimate_for_run(cfg, 1, 1, amp is not None, 1, sharded=True)
base = torch.cuda.memory_allocated()
model = build_for_training(cfg, mesh.device, mesh, amp)
opt = build_optimizer(model, cfg.optim)
vocab, peaks = cfg.model.hf["vocab_size"], []
for step in range(1, 5):
    batches = [(ids[:, :-1], ids[:, 1:]) for ids in (torch.randint(0, vocab, (2, 2049)) for _ in range(micro))]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    train_step(model, opt, batches, 1.0, mesh.device, amp, mesh, step=step)
    torch.cuda.synchronize()
    peaks.append(torch.cuda.max_memory_allocated() - base)
print("MEMORY " + json.dumps({"peaks": peaks, "estimate": est.total}))
