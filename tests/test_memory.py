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
    assert sharded.weights == fp32.weights / 4 and sharded.compute_copies < fp32.compute_copies


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
    assert h.backward_peak == n * (2 + 4) / 4 > f.backward_peak  # the end: every gradient and its kept reduction
    assert h.reduce_buffers == f.reduce_buffers


def test_fsdp_gathers_the_local_experts_and_the_head():
    """Several ranks: the gathered copies are the two largest layers (with this rank's 1/ep of the
    experts) plus the head, which stays gathered between its forward and backward; in bf16 under
    autocast, else in the parameters' dtype. The reduction buffers are the largest FSDP unit's
    unsharded gradient (bf16 under autocast) and reduce-scatter input (fp32 under autocast)."""
    cfg = dict(CASES["qwen3"], vocab_size=512, mlp_only_layers=[])  # every layer alike
    with torch.device("meta"):
        model = build_model(cfg)
    layers = list(model.model.layers.values())
    experts = sum(p.numel() for p in layers[0].mlp.experts.parameters())
    dense = sum(p.numel() for p in layers[0].parameters()) - experts
    head = model.lm_head.weight.numel()
    for ep in (1, 2, 4):
        est = estimate(model, tokens=64, param_dtype="fp32", autocast=True, world=4, ep=ep)
        assert est.compute_copies == 2 * (2 * (dense + experts / ep) + head)
        assert est.reduce_buffers == (2 + 4) * max(dense, experts / ep, head)
    fp32 = estimate(model, tokens=64, param_dtype="fp32", autocast=False, world=4, ep=2)
    assert fp32.compute_copies == 4 * (2 * (dense + experts / 2) + head)
    assert fp32.reduce_buffers == (4 + 4) * max(dense, experts / 2, head)
    alone = estimate(model, tokens=64, param_dtype="fp32", autocast=True)
    assert alone.reduce_buffers == 0 and fp32.total > fp32.weights + fp32.optimizer + fp32.compute_copies + \
        fp32.gradients + fp32.activations + fp32.head
    assert fp32.weights == estimate(model, tokens=64, param_dtype="fp32", autocast=False, world=4).weights


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
    for bad, message in ((["--device-gb", "nan"], "--device-gb nan: give the device's memory"),
                         (["train.cuda_graphs=on", "--world", "2"], "train.cuda_graphs = on .* in 2 process"),
                         (["train.cuda_graphs=on", "train.device=cpu"], "train.cuda_graphs = on .* on the CPU")):
        assert main(["memory", toml, *bad]) == 2
        assert re.search(message, capsys.readouterr().err)
