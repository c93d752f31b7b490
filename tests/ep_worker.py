"""Run under torchrun (2 ranks, gloo) by test_distributed.py: the expert exchange on a routing with
known overlap. Checks the rows each rank sends, and that output and gradients equal the local
(single-rank) MoE computation of the same tokens. Writes rank 0's counts to argv[1] as JSON."""

import json
import os
import sys

import torch
import torch.distributed as dist

from pithtrain.layers.moe import GroupedExperts
from pithtrain.layers.transformer import _seed
from pithtrain.ops.permute import combine, permute, sort_by_expert
from pithtrain.parallel import expert

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
E, k, H, N = 6, 3, 6, 5  # experts 0-2 on rank 0, 3-5 on rank 1
# A token's 3 experts; rows it sends (one per distinct rank): 1, 2, 2, 1, 2 -> 8 of 15 (4 to each rank).
IDS = torch.tensor([[0, 1, 2], [3, 4, 0], [1, 0, 5], [5, 4, 3], [0, 4, 2]])
ids = IDS if rank == 0 else IDS.flip(0)
gen = torch.Generator().manual_seed(_seed(1, "tokens", rank))
x = torch.randn(N, H, generator=gen, requires_grad=True)
w = torch.rand(N, k, generator=gen, requires_grad=True)

full = GroupedExperts(E, H, 4)
for i, p in enumerate(full.parameters()):
    p.data.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
local = full.local_share(rank, world)
local.gate_up_proj.data.copy_(full.gate_up_proj.data[rank * 3:(rank + 1) * 3])
local.down_proj.data.copy_(full.down_proj.data[rank * 3:(rank + 1) * 3])
group = expert.ExpertGroup(dist.group.WORLD, world, rank, E)

rows, plan = expert.plan(x, ids, w, group, torch.Size((1, N, H)))
got = expert.aggregate(expert.combine(expert.compute(expert.dispatch(rows, plan, group), plan, group, local),
                                      plan, group), plan).view(N, H)
grad_out = torch.randn(N, H, generator=gen)
(got * grad_out).sum().backward()
gx, gw = x.grad.clone(), w.grad.clone()
g_up = [torch.zeros_like(local.gate_up_proj.grad) for _ in range(world)]
dist.all_gather(g_up, local.gate_up_proj.grad)

# The local reference on the same tokens with all experts.
x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
order, inverse, counts = sort_by_expert(ids, E)
out = full(permute(x2, order, inverse, k), torch.cumsum(counts, 0).to(torch.int32))
ref = combine(out, order, inverse, k, w2)
(ref * grad_out).sum().backward()
torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
torch.testing.assert_close(gx, x2.grad, rtol=1e-5, atol=1e-6)
torch.testing.assert_close(gw, w2.grad, rtol=1e-5, atol=1e-6)
ref_up = [torch.zeros_like(full.gate_up_proj.grad) for _ in range(world)]
dist.all_gather(ref_up, full.gate_up_proj.grad)
torch.testing.assert_close(torch.cat(g_up), sum(ref_up), rtol=1e-5, atol=1e-6)
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"send_splits": plan.send_splits, "recv_splits": plan.recv_splits,
                   "counted": expert.dispatch_rows(ids, E, world)}, f)
dist.barrier()  # both ranks tear down together: a rank leaving early once made the other abort in gloo's teardown
dist.destroy_process_group()
# Every check above has passed. Leave without the interpreter's finalization: under load, gloo's
# threads still held work with tensors there and a rank aborted ("terminate called without an
# active exception", about 1 run in 12 on 2 busy cores), failing a test whose checks had passed.
sys.stdout.flush()
os._exit(0)
