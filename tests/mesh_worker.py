"""Run under torchrun (4 ranks, gloo) by test_distributed.py: every process group that
`init_distributed` builds (dp2 with dp_replicate=2, x ep2) times out after parallel.timeout_s.
Rank 3 never joins; each other rank runs an all-reduce in every group it shares with rank 3 and
records how long it waited, written to argv[1] + ".<rank>" as JSON {group: seconds}."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from pithtrain.parallel.mesh import Layout, init_distributed

TIMEOUT = 2.0
mesh = init_distributed(Layout(world=4, dp=2, ep=2, dp_replicate=2), "cpu", timeout_s=TIMEOUT)
groups = {"world ep": mesh.group("ep"), "world dp": mesh.group("dp"), "data": mesh.data_group}
for name, m in (("dense", mesh.dense), ("experts", mesh.experts), ("expert_store", mesh.expert_store)):
    for dim in m.mesh_dim_names:
        groups[f"{name} {dim}"] = m.get_group(dim)
waited, seen = {}, set()
if mesh.rank != 3:
    for name, g in groups.items():
        if 3 not in dist.get_process_group_ranks(g) or g in seen:  # meshes share dims' groups: once each
            continue
        seen.add(g)
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=g)
        except RuntimeError:
            pass
        waited[name] = time.monotonic() - start
if mesh.rank != 3:
    with open(f"{sys.argv[1]}.{mesh.rank}", "w") as f:
        json.dump(waited, f)
else:  # stay alive (an exited peer fails the others at once) until they are done
    end = time.monotonic() + 120
    while time.monotonic() < end and not all(os.path.exists(f"{sys.argv[1]}.{r}") for r in range(3)):
        time.sleep(0.2)
os._exit(0)  # the groups are broken by design; no orderly shutdown
