"""The memory estimator (pithtrain/tools/memory.py): the parts that can be counted exactly are
counted against real tensors; activations against the GPU peak in test_gpu.py."""

import re

import pytest
import torch
from test_hf_parity import CASES

from pithtrain.config import OptimConfig
from pithtrain.layers.transformer import cast_parameters, init_weights
from pithtrain.models import build_model
from pithtrain.tools.memory import estimate
from pithtrain.train.optim import build_optimizer


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("case", ["qwen3", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_states_are_counted_exactly(case, dtype):
    """Weights, gradients and AdamW moments of the estimate equal the bytes of the tensors a step
    leaves behind, for each family and both parameter dtypes; the meta-device model gives the
    same estimate as the real one."""
    cfg = dict(CASES[case], vocab_size=512)
    model = build_model(cfg)
    init_weights(model, 0)
    if dtype == "bf16":
        cast_parameters(model, torch.bfloat16)
    opt = build_optimizer(model, OptimConfig())
    model(torch.randint(0, 512, (2, 16)), labels=torch.randint(0, 512, (2, 16))).backward()
    opt.step()
    est = estimate(model, tokens=32, param_dtype=dtype, autocast=False)
    assert est.weights == _bytes(model.parameters())
    assert est.gradients == _bytes(p.grad for p in model.parameters())
    assert est.optimizer == _bytes(t for st in opt.state.values() for k, t in st.items() if k != "step")
    with torch.device("meta"):
        meta = build_model(cfg)
    assert estimate(meta, tokens=32, param_dtype=dtype, autocast=False) == est


def test_activations_scale_with_tokens_and_shrink_under_recompute():
    cfg = dict(CASES["deepseek_v3"], vocab_size=512)  # dense and MoE layers, MLA, shared experts
    with torch.device("meta"):
        model = build_model(cfg)
    a, b = (estimate(model, tokens=t, param_dtype="bf16") for t in (1024, 4096))
    assert b.activations == pytest.approx(4 * a.activations) and b.weights == a.weights
    sizes = [estimate(model, tokens=4096, param_dtype="bf16", recompute=r).activations
             for r in ("none", "attention", "experts", "both")]
    assert sizes[0] > sizes[1] > sizes[3] and sizes[0] > sizes[2] > sizes[3]
    fp32 = estimate(model, tokens=4096, param_dtype="fp32", autocast=True)
    assert fp32.compute_copies > 0 and fp32.activations == sizes[0]  # bf16 copies of fp32 matrices
    sharded = estimate(model, tokens=4096, param_dtype="fp32", autocast=True, world=4)
    assert sharded.weights >= fp32.weights / 4 and sharded.compute_copies < fp32.compute_copies


def test_a_step_of_one_micro_batch_walks_the_backward():
    """One micro-batch a step: gradients replace activations layer by layer in backward, so the
    peak is the larger of the backward's start (activations, the head's working set) and its end
    (all gradients), never more than an accumulated step's, which holds both whole."""
    cfg = dict(CASES["deepseek_v3"], vocab_size=512)
    with torch.device("meta"):
        model = build_model(cfg)
    for tokens in (16, 4096, 1 << 20):
        acc = estimate(model, tokens=tokens, param_dtype="bf16")
        one = estimate(model, tokens=tokens, param_dtype="bf16", accumulate=False)
        assert acc.backward_peak is None and one.backward_peak is not None
        assert one.total < acc.total and one.backward_peak >= max(one.gradients, one.activations + one.head)
    assert estimate(model, tokens=16, param_dtype="bf16", accumulate=False).backward_peak == one.gradients
    huge = estimate(model, tokens=1 << 20, param_dtype="bf16", accumulate=False)
    assert huge.backward_peak == pytest.approx(huge.activations + huge.head)  # the start of backward
    assert "at most at once, in backward" in huge.lines()[0]


def test_the_run_config_says_whether_a_step_accumulates():
    import os

    from pithtrain.config import load_config
    from pithtrain.tools.memory import estimate_for_run

    toml = os.path.join(os.path.dirname(__file__), "..", "examples", "demo", "demo.toml")

    def run(global_batch: int, **ranks):
        cfg = load_config(toml, ["data.micro_batch_size=4", f"data.global_batch_size={global_batch}"])
        return estimate_for_run(cfg, **ranks)

    assert run(4).backward_peak is not None and run(8).backward_peak is None
    assert run(8, world=2, data_ranks=2).backward_peak is not None  # each rank runs one micro-batch
    graphs = estimate_for_run(load_config(toml, ["data.micro_batch_size=4", "data.global_batch_size=4",
                                                 "train.cuda_graphs=on"]))
    cfg = load_config(toml, [])
    logits = 4 * cfg.data.seq_len * cfg.model.hf["vocab_size"] * 2  # validation's bf16 logits, one chunk
    assert graphs.backward_peak is None and graphs.outside_graphs == logits
    assert graphs.total == run(8).total + logits > run(4).total + logits  # the pool holds gradients and activations
    assert "outside graphs" in graphs.lines()[0] and "outside graphs" not in run(4).lines()[0]


def test_hsdp_replicas_hold_whole_states():
    """Under HSDP the states are sharded within a replica only: dp_replicate=2 on 8 ranks holds
    as much per rank as plain FSDP on 4."""
    import os

    from pithtrain.config import load_config
    from pithtrain.tools.memory import estimate_for_run

    toml = os.path.join(os.path.dirname(__file__), "..", "examples", "demo", "demo.toml")
    hsdp = estimate_for_run(load_config(toml, ["parallel.dp_replicate=2"]), world=8, data_ranks=8)
    fsdp4 = estimate_for_run(load_config(toml, []), world=4, data_ranks=8)
    fsdp8 = estimate_for_run(load_config(toml, []), world=8, data_ranks=8)
    assert hsdp.weights == fsdp4.weights == 2 * fsdp8.weights
    assert hsdp.optimizer == fsdp4.optimizer and hsdp.total == fsdp4.total
    # an accumulating step holds every reduced gradient HSDP's all-reduce keeps (fp32), next to all else
    h = estimate_for_run(load_config(toml, ["parallel.dp_replicate=2", "data.global_batch_size=128"]), world=8,
                         data_ranks=8)
    f = estimate_for_run(load_config(toml, ["data.global_batch_size=128"]), world=4, data_ranks=8)
    assert h.reduce_buffers - f.reduce_buffers == h.weights and h.total == f.total + h.weights
    # one rank per replica is still FSDP: a layer at a time gathered, not autocast copies of every matrix
    pair = estimate_for_run(load_config(toml, ["parallel.dp_replicate=2"]), world=2, data_ranks=2)
    fsdp1 = estimate_for_run(load_config(toml, []), world=1, data_ranks=2, sharded=True)
    alone = estimate_for_run(load_config(toml, []), world=1, data_ranks=1)
    assert pair.compute_copies == fsdp1.compute_copies < alone.compute_copies


def test_hsdp_keeps_reduced_gradients_through_the_backward_walk():
    """One micro-batch a step: with fp32 states HSDP's kept fp32 reduction is the gradient itself;
    with bf16 states it is 4 bytes per parameter of its own, held from each unit's reduction to the
    end of backward, so it adds to the walk's later stages (all of it at the end), not to its start."""
    cfg = dict(CASES["qwen3"], vocab_size=512, mlp_only_layers=[])
    with torch.device("meta"):
        model = build_model(cfg)
    n = sum(p.numel() for p in model.parameters())
    run = lambda dtype, rep: estimate(model, tokens=1, param_dtype=dtype, world=4, accumulate=False,  # noqa: E731
                                      replicated=rep)
    assert run("fp32", True).backward_peak == run("fp32", False).backward_peak
    h, f = run("bf16", True), run("bf16", False)
    local = h.weights / 2  # this rank's elements (bf16 states)
    assert n / 4 <= local and h.backward_peak == local * (2 + 4) > f.backward_peak  # the end: every gradient and its kept reduction
    assert h.reduce_buffers == f.reduce_buffers


def _fsdp_rank0(cfg: dict, world: int, ep: int):
    """The model of `cfg` sharded as `parallel/fsdp.apply_fsdp` shards it on `world` ranks with `ep`
    (rank 0's view, on torch's fake process group: meta tensors, no communication). Returns
    (rank 0's elements of every parameter, the gathered size of each FSDP unit: its elements in a
    layer outside the experts, the layer's experts, the embedding, the head)."""
    import torch.distributed as dist
    from types import SimpleNamespace
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from pithtrain.parallel.fsdp import apply_fsdp

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with torch.device("meta"):
            model = build_model(cfg)
            for block in model.moe_blocks():
                block.experts = block.experts.local_share(0, ep)
        ranks = torch.arange(world)  # ep innermost: rank 0's experts are sharded over ranks 0, ep, 2ep, ...
        apply_fsdp(model, SimpleNamespace(dense=DeviceMesh("cpu", ranks), experts=DeviceMesh("cpu", ranks[::ep]),
                                          device=torch.device("cpu")), None)
        gathered = lambda params, shards: sum(p.to_local().numel() * shards for p in params)  # noqa: E731
        units = []
        for layer in model.model.layers.values():
            experts = list(layer.mlp.experts.parameters()) if layer.is_moe else []
            units += [gathered([p for p in layer.parameters() if all(p is not e for e in experts)], world),
                      gathered(experts, world // ep)]
        units += [gathered([model.model.embed_tokens.weight], world), gathered([model.lm_head.weight], world)]
        return sum(p.to_local().numel() for p in model.parameters()), units
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case, world, ep", [("qwen3", 4, 1), ("qwen3", 4, 2), ("qwen3", 8, 2), ("qwen3", 3, 1),
                                             ("gpt_oss", 4, 2), ("deepseek_v3", 8, 1)])
def test_fsdp_states_and_buffers_are_those_of_rank_0_as_fsdp_shards(case, world, ep):
    """Against FSDP2's own sharding (fake process group): rank 0 holds a whole chunk of ceil(rows /
    ranks) rows of each parameter, more than 1/world where the rows (6 experts here) do not divide;
    the gathered copies are the two largest layers plus the head and the reduction buffers the
    largest unit's gradient (bf16 under autocast) and reduce-scatter input (fp32), at their padded
    sizes; in the parameters' dtype without autocast."""
    cfg = dict(CASES[case], vocab_size=512, **({"mlp_only_layers": []} if case == "qwen3" else {}))
    with torch.device("meta"):
        model = build_model(cfg)
    local, units = _fsdp_rank0(cfg, world, ep)
    n = sum(p.numel() for p in model.parameters())
    layers = sorted((units[i] + units[i + 1] for i in range(0, len(units) - 2, 2)), reverse=True)
    est = estimate(model, tokens=64, param_dtype="fp32", autocast=True, world=world, ep=ep)
    assert est.weights == est.gradients == 4 * local and est.optimizer == 8 * local
    assert est.compute_copies == 2 * (layers[0] + layers[1] + units[-1])
    assert est.reduce_buffers == (2 + 4) * max(units)
    if case == "qwen3" and world == 4:
        assert local > n / world  # 6 experts over 4 (or 3 over 2) ranks: rank 0 holds 2 (2)
    plain = estimate(model, tokens=64, param_dtype="fp32", autocast=False, world=world, ep=ep)
    assert plain.compute_copies == 4 * (layers[0] + layers[1] + units[-1]) and plain.reduce_buffers == 8 * max(units)
    alone = estimate(model, tokens=64, param_dtype="fp32", autocast=True)
    assert alone.reduce_buffers == 0 and alone.weights == 4 * n

def test_memory_command_follows_the_run_s_compute(capsys):
    """`pithtrain memory` assumes bf16 autocast only where `train` would use it: not with
    train.device=cpu (plain fp32 there), so CPU activations count 4 bytes."""
    import os

    from pithtrain.cli import main

    toml = os.path.join(os.path.dirname(__file__), "..", "examples", "demo", "demo.toml")
    figures = []
    for device in ("auto", "cpu"):
        assert main(["memory", toml, f"train.device={device}", "data.seq_len=1024"]) == 0
        line = capsys.readouterr().out
        figures.append(float(line.split("activations ")[1].split(" GB")[0]))
    assert figures[1] == pytest.approx(2 * figures[0], rel=0.05)
    qwen3 = os.path.join(os.path.dirname(__file__), "..", "examples", "qwen3_30b_a3b", "train.toml")
    for extra in ([], ["--torchrun"]):  # one rank under torchrun is FSDP's: reduction buffers, as train counts them
        assert main(["memory", qwen3, "model.num_hidden_layers=1", *extra]) == 0
        figures.append(float(capsys.readouterr().out.split("reduce buffers ")[1].split(" GB")[0]))
    assert figures[2] == 0 < figures[3]
    for bad, message in ((["--device-gb", "nan"], "--device-gb nan: give the device's memory"),
                         (["train.cuda_graphs=on", "--world", "2"], "train.cuda_graphs = on .* in 2 process"),
                         (["train.cuda_graphs=on", "train.device=cpu"], "train.cuda_graphs = on .* on the CPU")):
        assert main(["memory", toml, *bad]) == 2
        assert re.search(message, capsys.readouterr().err)
