"""The process layout: world = pp * dp * cp * ep, checked before anything is built, and its meshes.

Rank order is row-major over (pp, dp, cp, ep): expert-parallel ranks are neighbours (one node's
fast links carry the all-to-all), then context-parallel ranks, then data-parallel ranks. `dp` is
what the world size leaves: dp = world / (pp * cp * ep). Roles:
- each (dp, ep) coordinate reads its own sequences; the `dp * ep` of them are the *data ranks*;
- the cp ranks of one data rank split its sequences (ring attention, `parallel/context.py`);
- the ep ranks of one (dp, cp) coordinate split the experts (`parallel/expert.py`);
- parameters other than the experts are sharded by FSDP over all dp * cp * ep ranks of a stage,
  the experts over the dp * cp ranks that hold the same experts (`parallel/fsdp.py`);
- `dp_replicate` > 1 makes FSDP hybrid (HSDP): dp splits into dp_replicate groups (e.g. nodes)
  that each hold a full sharded copy, gradients all-reduced between them.
Multi-node runs use torchrun's rendezvous (and SLURM through it); this module only reads the
environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; the training
loop also reads TORCHELASTIC_RUN_ID to know it runs under torchrun).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from pithtrain.config import ConfigError, RunConfig


@dataclass(frozen=True)
class Layout:
    world: int
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    dp_replicate: int = 1

    @property
    def data_ranks(self) -> int:
        return self.dp * self.ep

    def describe(self) -> str:
        parts = [f"{n}{v}" for n, v in (("pp", self.pp), ("dp", self.dp), ("cp", self.cp), ("ep", self.ep)) if v > 1]
        if self.dp_replicate > 1:  # HSDP
            parts[parts.index(f"dp{self.dp}")] += f" ({self.dp_replicate} replicas x {self.dp // self.dp_replicate})"
        return " x ".join(parts) or "single process"


def num_routed_experts(hf: dict) -> int:
    """Routed experts of the model (0 for a dense model), read from a meta-device build."""
    from pithtrain.models import build_model

    with torch.device("meta"):
        model = build_model(hf)
    blocks = model.moe_blocks()
    return blocks[0].num_experts if blocks else 0


def plan_layout(cfg: RunConfig, world: int) -> Layout:
    """The layout of `cfg.parallel` on `world` processes; every impossible one is a ConfigError."""
    p, d = cfg.parallel, cfg.data
    for key, value in (("pp", p.pp), ("cp", p.cp), ("ep", p.ep), ("dp_replicate", p.dp_replicate)):
        if value < 1:
            raise ConfigError(f"parallel.{key} = {value} must be at least 1")
    if p.pp > 1:
        raise ConfigError(f"parallel.pp = {p.pp}: pipeline parallelism is not available yet; set parallel.pp=1")
    fixed = p.pp * p.cp * p.ep
    if world % fixed:
        raise ConfigError(f"the world size {world} is not a multiple of parallel.pp * parallel.cp * parallel.ep = "
                          f"{p.pp} * {p.cp} * {p.ep} = {fixed}; launch a multiple of {fixed} processes "
                          f"(torchrun --nproc-per-node=...) or change the layout")
    layout = Layout(world, p.pp, world // fixed, p.cp, p.ep, p.dp_replicate)
    if layout.dp % p.dp_replicate:
        raise ConfigError(f"parallel.dp_replicate = {p.dp_replicate} does not divide the data-parallel degree "
                          f"dp = {layout.dp} (world {world} / (pp * cp * ep) = {fixed})")
    if p.ep > 1:
        experts = num_routed_experts(cfg.model.hf)
        if experts == 0:
            raise ConfigError(f"parallel.ep = {p.ep} but the model has no MoE layers; set parallel.ep=1")
        if experts % p.ep:
            raise ConfigError(f"the model's {experts} routed experts cannot be split evenly over parallel.ep = "
                              f"{p.ep} ranks; choose an ep that divides {experts}")
    if p.cp > 1 and d.seq_len % (2 * p.cp):
        raise ConfigError(f"data.seq_len = {d.seq_len} is not a multiple of 2 * parallel.cp = {2 * p.cp} "
                          f"(each context-parallel rank holds two equal blocks of every sequence)")
    step = d.micro_batch_size * layout.data_ranks
    if d.global_batch_size % step:
        raise ConfigError(f"data.global_batch_size = {d.global_batch_size} is not a multiple of data.micro_batch_size"
                          f" * dp * ep = {d.micro_batch_size} * {layout.dp} * {layout.ep} = {step} (sequences of one "
                          f"micro-batch over all data ranks)")
    return layout


@dataclass
class Mesh:
    """This rank's place in the layout and the process groups each parallel feature uses."""

    layout: Layout
    rank: int
    device: torch.device
    world: DeviceMesh  # (pp, dp, cp, ep)
    dense: DeviceMesh  # FSDP of non-expert parameters: (shard) or (replicate, shard)
    experts: DeviceMesh  # FSDP of expert parameters over the ranks holding the same experts
    expert_store: DeviceMesh  # (ep, shard) or (ep, replicate, shard): how checkpoints see the experts
    data_group: dist.ProcessGroup  # every rank of this pipeline stage (loss and statistics sums)

    def coord(self, dim: str) -> int:
        return self.world.get_local_rank(dim)

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.world.get_group(dim)

    @property
    def data_rank(self) -> int:
        """Index of this rank's sequences among the dp * ep data ranks."""
        return self.coord("dp") * self.layout.ep + self.coord("ep")


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"environment variable {name}={text!r} is not an integer: launch with torchrun, which "
                          f"sets it, or unset it") from None


def world_size() -> int:
    """WORLD_SIZE as torchrun sets it (1 when unset). More than one process needs the rest of
    torchrun's environment: a WORLD_SIZE left over in a shell or container is named, not waited on."""
    n = _env_int("WORLD_SIZE", 1)
    if n < 1:
        raise ConfigError(f"environment variable WORLD_SIZE={n}: launch with torchrun, or unset it for one process")
    if n > 1:
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]  # LOCAL_RANK: 0
        if missing:
            raise ConfigError(f"WORLD_SIZE={n} is set but {', '.join(missing)} not: launch with `torchrun "
                              f"--nproc-per-node=N -m pithtrain train ...` (it sets them all), or unset WORLD_SIZE "
                              "to train in one process")
        rank = _env_int("RANK", 0)
        if not 0 <= rank < n:
            raise ConfigError(f"environment variable RANK={rank} lies outside 0..{n - 1} (WORLD_SIZE={n})")
        _env_int("LOCAL_RANK", 0)  # a bad one named now, before the data and model are built
    return n


def process_rank() -> int:
    """This process's rank: RANK under a launch of several processes, 0 for one process."""
    return _env_int("RANK", 0) if world_size() > 1 else 0


def init_distributed(layout: Layout, device_type: str, timeout_s: float = 600) -> Mesh:
    """Join the torchrun job (NCCL on CUDA, gloo on CPU) and build the meshes of `layout`."""
    local = _env_int("LOCAL_RANK", 0)
    if device_type == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=timeout,
                                device_id=device if device_type == "cuda" else None)
    L = layout
    rep, shard_dp = L.dp_replicate, L.dp // L.dp_replicate
    ranks = torch.arange(L.world).view(L.pp, rep, shard_dp, L.cp, L.ep)
    kind = device.type
    world = DeviceMesh(kind, ranks.reshape(L.pp, L.dp, L.cp, L.ep), mesh_dim_names=("pp", "dp", "cp", "ep"))
    dense_all = DeviceMesh(kind, ranks.reshape(L.pp, rep, -1), mesh_dim_names=("pp", "replicate", "shard"))
    exp_all = DeviceMesh(kind, ranks.permute(0, 4, 1, 2, 3).reshape(L.pp, L.ep, rep, -1),
                         mesh_dim_names=("pp", "ep", "replicate", "shard"))
    data = DeviceMesh(kind, ranks.reshape(L.pp, -1), mesh_dim_names=("pp", "data"))
    for mesh in (world, dense_all, exp_all, data):  # new groups would get torch's default timeout
        for group in mesh.get_all_groups():
            dist.distributed_c10d._set_pg_timeout(timeout, group)
    fsdp_dims = ("replicate", "shard") if rep > 1 else ("shard",)
    return Mesh(L, dist.get_rank(), device, world, dense_all[fsdp_dims], exp_all[fsdp_dims],
                exp_all[("ep", *fsdp_dims)], data.get_group("data"))
