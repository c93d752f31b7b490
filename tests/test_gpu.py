"""CUDA checks (skipped without a GPU): grouped GEMM against its twin, bf16 model against fp32,
every model family in fp32 on CUDA against CPU and learning under bf16, and a short bf16 training
run through the real loop."""

import copy

import pytest
import torch

from pithtrain.layers.transformer import init_weights
from pithtrain.models import build_model
from pithtrain.ops.grouped_mm import grouped_mm, grouped_mm_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROXY = dict(model_type="qwen3_moe", vocab_size=4096, hidden_size=256, intermediate_size=512,
             moe_intermediate_size=128, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
             head_dim=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[0],
             max_position_embeddings=1024, rope_theta=10000.0)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def test_grouped_mm_cuda_matches_twin_with_empty_groups():
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 17, 1, 0, 41])
    offsets = torch.cumsum(counts, 0).to(torch.int32).cuda()
    x = torch.randn(int(counts.sum()), 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(6, 96, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = grouped_mm(x, w.transpose(1, 2), offsets)
    g = torch.randn_like(out)
    out.backward(g)
    x2, w2 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = grouped_mm_reference(x2, w2.transpose(1, 2), offsets.cpu())
    ref.backward(g.float())
    assert rel(out, ref) < 1e-2 and rel(x.grad, x2.grad) < 1e-2 and rel(w.grad, w2.grad) < 1e-2
    assert w.grad[1].abs().sum() == 0 and w.grad[4].abs().sum() == 0


def test_bf16_autocast_model_close_to_fp32(monkeypatch):
    """bf16 autocast on CUDA against fp32 on CPU, with the routing of the fp32 run replayed.

    bf16 rounding flips near-tie top-k choices for a few tokens (1 and 7 of 256 per MoE layer
    here), and a flipped token moves whole expert gradients (0.10 relative measured). With the
    fp32 routing replayed the worst gradient differs by ~2e-2; so the routing is replayed, and
    the number of tokens whose choice differs is checked to be small.
    """
    from pithtrain.layers import moe

    torch.manual_seed(0)
    model = build_model(PROXY)
    init_weights(model, seed=1)
    ids = torch.randint(0, PROXY["vocab_size"], (2, 128))
    labels = torch.randint(0, PROXY["vocab_size"], (2, 128))
    router_forward, recorded, replay, flips = moe.TopKRouter.forward, [], [], []

    def forward(self, x):
        logits, probs, weights, sel = router_forward(self, x)
        if not replay:
            recorded.append(sel)
            return logits, probs, weights, sel
        forced = replay.pop(0)
        flips.append((forced.sort(-1).values != sel.sort(-1).values).any(-1).sum().item())
        w = probs.gather(1, forced)
        return logits, probs, (w / w.sum(-1, keepdim=True)).to(logits.dtype), forced

    monkeypatch.setattr(moe.TopKRouter, "forward", forward)
    ref_loss = model(ids, labels=labels)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    replay.extend(r.cuda() for r in recorded)
    gpu = copy.deepcopy(model).cuda()
    gpu.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = gpu(ids.cuda(), labels=labels.cuda())
    loss.backward()
    assert len(flips) == 2 and max(flips) <= 0.05 * ids.numel()
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-2
    for name, p in gpu.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
        assert rel(p.grad.cpu(), ref_grads[name]) < 5e-2, name


def test_training_on_cuda(tiny_corpus, tmp_path):
    from conftest import write_run
    from pithtrain.config import load_config
    from pithtrain.train.loop import train

    toml = write_run(tmp_path, tiny_corpus, hidden_size=128, moe_intermediate_size=64, num_experts=8)
    cfg = load_config(toml, ["train.steps=40", "train.device=cuda", "data.seq_len=128", "checkpoint.every=20",
                             "data.micro_batch_size=8", "data.global_batch_size=16"])
    summary = train(cfg)
    first = summary["first_loss"]
    assert summary["train_loss"] < 0.8 * first, summary
    resumed = train(load_config(toml, ["train.steps=40", "train.device=cuda", "data.seq_len=128",
                                       "data.micro_batch_size=8", "data.global_batch_size=16",
                                       "checkpoint.resume=auto"]))
    assert resumed["start_step"] == 40


FAMILIES = ["deepseek_v2-q_lora-group_limited", "deepseek_v3", "gpt_oss"]


@pytest.mark.parametrize("case", FAMILIES)
def test_family_on_cuda(case):
    """fp32 on CUDA equals fp32 on CPU (same kernels' maths: grouped_mm, SDPA with masks and sinks),
    and a few bf16 autocast steps on one batch lower its loss."""
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from test_hf_parity import CASES, random_model

    cfg = dict(CASES[case], num_hidden_layers=4)
    cfg.pop("layer_types", None)  # GPT-OSS: the default, alternating
    cpu = random_model(cfg)
    ids = torch.randint(0, cfg["vocab_size"], (2, 64))
    labels = torch.randint(0, cfg["vocab_size"], (2, 64))
    ref = cpu(ids, labels=labels)
    ref.backward()
    gpu = copy.deepcopy(cpu).cuda()
    gpu.zero_grad(set_to_none=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    loss = gpu(ids.cuda(), labels=labels.cuda())
    loss.backward()
    assert abs(loss.item() - ref.item()) / ref.item() < 1e-4
    grads = dict(cpu.named_parameters())
    for name, p in gpu.named_parameters():
        assert rel(p.grad.cpu(), grads[name].grad) < 1e-3, name
    gpu.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(gpu.parameters(), lr=1e-2)
    first = None
    for _ in range(30):  # fp32 on CPU: 4.7 -> 0.3 (DeepSeek-V2), 0.05 (V3)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = gpu(ids.cuda(), labels=labels.cuda()) / labels.numel()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        first = loss.item() if first is None else first
    assert torch.isfinite(loss) and loss.item() < 0.5 * first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_attention_block_math_on_cuda(dtype):
    """The ring's block math on CUDA (one rank) against SDPA through `attend`: GQA with a sliding
    window and sinks, forward and backward."""
    from pithtrain.layers.attention import attend
    from pithtrain.parallel.context import ContextGroup, ring_attention

    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator("cuda").manual_seed(0)
    B, S, Hq, Hk, D = 2, 256, 8, 2, 64
    q, k, v = (torch.randn(B, h, S, D, device="cuda", generator=gen).to(dtype).requires_grad_() for h in (Hq, Hk, Hk))
    sinks = torch.randn(Hq, device="cuda", generator=gen).requires_grad_()
    ours = ring_attention(q, k, v, ContextGroup(None, 1, 0), scale=D ** -0.5, window=40, sinks=sinks)
    ours = ours.transpose(1, 2).reshape(B, S, -1)
    ref = attend(q, k, v, window=40, sinks=sinks)
    g = torch.randn_like(ref)
    got = torch.autograd.grad((ours.float() * g).sum(), [q, k, v, sinks])
    want = torch.autograd.grad((ref.float() * g).sum(), [q, k, v, sinks])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert rel(ours, ref) < tol
    for a, b in zip(got, want):
        assert rel(a, b) < tol


def test_fsdp_bf16_under_torchrun_close_to_plain_bf16(tmp_path, tiny_corpus):
    """One GPU under torchrun takes the sharded path (NCCL, FSDP2 with bf16 parameters and fp32
    gradient reduction, meta-device init); its losses track the plain bf16-autocast run."""
    import os
    import subprocess
    import sys

    from conftest import ROOT, losses, run_cli, write_run

    toml = write_run(tmp_path, tiny_corpus, "steps = 6\ndevice = \"cuda\"\n")
    run_cli("train", toml, f"log.run_dir={tmp_path}/plain")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                           "-m", "pithtrain", "train", toml, f"log.run_dir={tmp_path}/fsdp"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "parallel layout: single process, 1 process(es) on cuda" in proc.stdout
    a, b = losses(f"{tmp_path}/plain"), losses(f"{tmp_path}/fsdp")
    assert a.keys() == b.keys() == set(range(1, 7))
    for step in a:
        assert abs(a[step] - b[step]) / a[step] < 2e-2, (step, a[step], b[step])
    assert b[6] < b[1]


def test_moe_layer_has_no_host_synchronisation():
    """Forward and backward of an MoE decoder layer on one GPU never wait for the device
    (torch.cuda.set_sync_debug_mode('error') raises on any synchronising call)."""
    model = build_model(PROXY).cuda()
    init_weights(model, seed=0)
    layer = model.model.layers["1"]
    x = torch.randn(2, 128, PROXY["hidden_size"], device="cuda", requires_grad=True)
    ctx = model.context(torch.zeros(2, 128, dtype=torch.long, device="cuda"), None, 0.1, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(x, ctx)
        out.float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x.grad).all()


def test_triton_kernels_match_twins_on_cuda():
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import kernel_checks

    kernel_checks.run_all("cuda")


def test_linear_cross_entropy_on_cuda_bf16():
    """The chunked head + cross-entropy under bf16 autocast against the full-logits twin."""
    from pithtrain.ops.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference

    gen = torch.Generator("cuda").manual_seed(0)
    h = torch.randn(3000, 256, device="cuda", generator=gen, requires_grad=True)
    w = (torch.randn(50000, 256, device="cuda", generator=gen) * 0.05).requires_grad_()
    labels = torch.randint(0, 50000, (3000,), device="cuda", generator=gen)
    labels[::7] = -100
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = linear_cross_entropy(h, w, labels, chunk=1024)
        want = linear_cross_entropy_reference(h, w, labels)
    gh, gw = torch.autograd.grad(got, [h, w])
    rh, rw = torch.autograd.grad(want, [h, w])
    assert abs(got.item() - want.item()) / want.item() < 1e-3
    assert rel(gh, rh) < 1e-2 and rel(gw, rw) < 1e-2
