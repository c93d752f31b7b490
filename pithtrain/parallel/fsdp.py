"""Building a model for a parallel layout: local experts, process groups, FSDP2, initialisation.

`build_parallel` runs in this order on every rank:
1. build the model on the meta device (no memory), replace each MoE block's experts by this
   rank's share (`GroupedExperts.local_share`) and hand the blocks their groups (expert
   exchange, statistics, context-parallel sequence group) and the model its cp group;
2. `fully_shard` the experts of each layer over the ranks that hold the same experts
   (`mesh.experts`), then each decoder layer, the embedding and the head over all ranks of the
   stage (`mesh.dense`), then the root. On the GPU parameters are gathered in bf16 and gradients
   reduced in fp32 (`MixedPrecisionPolicy`); on the CPU everything stays fp32;
3. allocate the shards (`to_empty`) and initialise them with `init_weights`, which draws each
   parameter (each expert) from its global name (global id) and keeps the local shard: every
   layout starts from the numbers of the single-process model.

Gradient scale: FSDP would average gradients over each group, and the two groups differ in size
(dp*cp*ep for dense parameters, dp*cp for experts). Both are set to plain sums instead; the loop
divides the loss by the global token count, so every gradient is the single-process gradient of
the same global batch, experts and the rest alike.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from pithtrain.layers.transformer import CausalLM, init_weights
from pithtrain.parallel.expert import ExpertGroup
from pithtrain.parallel.mesh import Mesh


def attach_groups(model: CausalLM, mesh: Mesh) -> None:
    """Give every MoE block its experts' share and groups; give the model its cp group."""
    L = mesh.layout
    for block in model.moe_blocks():
        block.stats_group = mesh.data_group
        if L.cp > 1:
            block.seq_group = mesh.group("cp")
        if L.ep > 1:
            block.ep = ExpertGroup(mesh.group("ep"), L.ep, mesh.coord("ep"), block.num_experts)
            block.experts = block.experts.local_share(mesh.coord("ep"), L.ep)
    if L.cp > 1:
        from pithtrain.parallel.context import ContextGroup

        model.cp = ContextGroup(mesh.group("cp"), L.cp, mesh.coord("cp"))


def apply_fsdp(model: CausalLM, mesh: Mesh, param_dtype: torch.dtype | None) -> None:
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for layer in model.model.layers.values():
        if layer.is_moe:
            fully_shard(layer.mlp.experts, mesh=mesh.experts, mp_policy=mp)
        fully_shard(layer, mesh=mesh.dense, mp_policy=mp)
    if model.lm_head.weight is not model.model.embed_tokens.weight:  # tied: both stay with the root
        fully_shard(model.model.embed_tokens, mesh=mesh.dense, mp_policy=mp)
        fully_shard(model.lm_head, mesh=mesh.dense, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh.dense, mp_policy=mp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sums, see the module docstring
            if mesh.device.type == "cpu":
                module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-scaled sum


def build_parallel(build, mesh: Mesh, seed: int, param_dtype: torch.dtype | None) -> CausalLM:
    """`build()` makes the full model (called under the meta device); returns it sharded and initialised."""
    with torch.device("meta"):
        model = build()
        attach_groups(model, mesh)
    apply_fsdp(model, mesh, param_dtype)
    model.to_empty(device=mesh.device)
    init_weights(model, seed)
    if mesh.layout.ep > 1:
        model.expert_store = mesh.expert_store  # how checkpoints see the experts (train/checkpoint.py)
    return model
