"""Kernel micro-benchmarks on one GPU, each against the ceiling measured in the same run.

    PYTHONPATH=. python benchmarks/kernels.py [--tokens 8192] [--json OUT.json]

Shapes are a Qwen3-30B-A3B micro-batch (8192 tokens, hidden 2048, 128 experts top-8, expert width
768) unless stated. Memory-bound kernels (SwiGLU, permute / combine) report GB/s (bytes each must
read and write once) against a device copy (`clone` of 1 GiB, read + write); grouped GEMM reports
TFLOP/s against a bf16 8192^3 matmul; attention reports fwd+bwd TFLOP/s per backend (causal
FLOPs: 4 * B * H * S^2 / 2 * D forward, 3x that for forward + backward, the model-FLOP count
without the backward's recomputation of the scores). Each figure is the
median over 10 windows of 10 back-to-back calls (`timed`).
"""

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

BACK_TO_BACK = 10


def timed(fn, warmup: int = 3, reps: int = 10) -> float:
    """Median seconds of one call of `fn` over `reps` windows of BACK_TO_BACK calls, CUDA events
    around each window, one call already queued when it opens. The host enqueues while the GPU
    runs, as inside a training step; a single call between two synchronisations would also count
    the host's launch latency (tens of us, a third of a 70 us kernel)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        start.record()
        for _ in range(BACK_TO_BACK):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000 / BACK_TO_BACK)
    return statistics.median(times)


def ceilings() -> dict:
    x = torch.empty(2**29, dtype=torch.bfloat16, device="cuda")
    copy = 2 * x.nbytes / timed(lambda: x.clone()) / 1e9
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mm = 2 * 8192**3 / timed(lambda: a @ b) / 1e12
    return {"copy_GBps": copy, "matmul_TFLOPs": mm}


def gbps(nbytes: int, fn) -> float:
    return nbytes / timed(fn) / 1e9


def swiglu_bench(rows: int, width: int) -> dict:
    from pithtrain.ops.swiglu import clamped_swiglu, clamped_swiglu_reference, swiglu, swiglu_reference

    x = torch.randn(rows, 2 * width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    fwd_bytes = x.nbytes + dout.nbytes  # read the projection, write the output
    bwd_bytes = 2 * x.nbytes + dout.nbytes  # read the projection and dout, write dx
    out = {}
    for name, fn in [("swiglu", swiglu), ("swiglu_eager", swiglu_reference),
                     ("clamped", lambda t: clamped_swiglu(t, 1.702, 7.0)),
                     ("clamped_eager", lambda t: clamped_swiglu_reference(t, 1.702, 7.0))]:
        y = fn(x)
        out[name + "_fwd_GBps"] = gbps(fwd_bytes, lambda: fn(x.detach()))
        out[name + "_bwd_GBps"] = gbps(bwd_bytes, lambda: torch.autograd.grad(y, x, dout, retain_graph=True))
    return out


def permute_bench(tokens: int, hidden: int, experts: int, k: int) -> dict:
    from pithtrain.ops.permute import combine, permute, scatter_rows_reference, sort_by_expert, sum_slots_reference

    ids = torch.rand(tokens, experts, device="cuda").topk(k, dim=-1).indices
    order, inverse, _ = sort_by_expert(ids, experts)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    rows = torch.randn(tokens * k, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(tokens, k, device="cuda")
    moved = rows.nbytes + x.nbytes  # each row read or written once, each token once
    r, wr = rows.clone().requires_grad_(), w.clone().requires_grad_()
    y = combine(r, order, inverse, k, wr)
    dy = torch.randn_like(y)
    return {
        "permute_GBps": gbps(moved, lambda: permute(x, order, inverse, k)),
        "permute_eager_GBps": gbps(moved, lambda: scatter_rows_reference(x, inverse, k, rows.shape[0])),
        "combine_GBps": gbps(moved, lambda: combine(rows, order, inverse, k, w)),
        "combine_eager_GBps": gbps(moved, lambda: sum_slots_reference(rows, inverse, k, w)),
        # backward: rows read for the weights' gradient, their gradient written, each token read once
        "combine_backward_GBps": gbps(2 * rows.nbytes + x.nbytes, lambda: torch.autograd.grad(y, (r, wr), dy, retain_graph=True)),
    }


def grouped_mm_bench(tokens: int, hidden: int, experts: int, k: int, width: int) -> dict:
    """Grouped GEMM TFLOP/s with every expert given tokens * k / experts rows (`balanced`), and with
    the counts of uniform random routing (`routed`, each token picks k distinct experts), as a model
    with a fresh router sees them: counts that are not multiples of the 128-row tile waste part of a
    tile per expert."""
    gen = torch.Generator().manual_seed(0)
    routed = torch.rand(tokens, experts, generator=gen).topk(k, dim=-1).indices.flatten()
    variants = {"balanced": torch.full((experts,), tokens * k // experts),
                "routed": torch.bincount(routed, minlength=experts)}
    out = {}
    for kind, counts in variants.items():
        offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
        rows = int(counts.sum())
        for name, (kin, kout) in {"gate_up": (hidden, 2 * width), "down": (width, hidden)}.items():
            x = torch.randn(rows, kin, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            w = torch.randn(experts, kout, kin, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            flops = 2 * rows * kin * kout
            y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
            dy = torch.randn_like(y)
            key = f"{kind}_{name}"
            out[key + "_fwd_TFLOPs"] = flops / timed(lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs)) / 1e12
            out[key + "_bwd_TFLOPs"] = 2 * flops / timed(
                lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True)) / 1e12
        out[kind + "_count_range"] = [int(counts.min()), int(counts.max())]
    return out


def adamw_bench(dtype: torch.dtype, layers: int = 1) -> dict:
    """One AdamW step over the Qwen3 proxy's largest tensors (embedding, head, `layers` layers of
    experts): ours (`train/optim.AdamW`, one Triton kernel per parameter) and torch's fused
    multi-tensor kernel. Bytes: weight, gradient and both moments read, weight and moments written."""
    from pithtrain.train.optim import AdamW

    shapes = [(151936, 2048)] * 2 + [(128, 1536, 2048), (128, 2048, 768)] * layers
    out = {}
    for name, cls, kw in [("ours", AdamW, {}), ("torch_fused", torch.optim.AdamW, {"fused": True})]:
        ps = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype)) for s in shapes]
        for q in ps:
            q.grad = torch.randn_like(q)
        opt = cls(ps, lr=1e-4, weight_decay=0.1, **kw)
        n = sum(q.numel() for q in ps)
        out[name + "_GBps"] = gbps(7 * n * ps[0].element_size(), opt.step)
        del opt, ps
    return out


def grad_norm_bench(layers: int = 4) -> dict:
    """Clipping's sum of squares over the Qwen3 proxy's gradients (bf16; embedding, head, `layers`
    layers of experts, attention projections, routers and norms: 3.1 B elements in 47 tensors): ours
    (`ops/adamw.squares_sum`) and torch's `_foreach_norm` (its twin). Bytes: each gradient read once."""
    from pithtrain.ops.adamw import squares_sum, squares_sum_reference

    shapes = [(151936, 2048)] * 2 + [(2048,)] + [(128, 1536, 2048), (128, 2048, 768), (4096, 2048), (512, 2048),
                                                 (512, 2048), (2048, 4096), (128, 2048), (2048,), (2048,), (128,),
                                                 (128,)] * layers
    gs = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
    nbytes = sum(g.nbytes for g in gs)
    out = {}
    for name, fn in [("ours", squares_sum), ("torch_foreach", squares_sum_reference)]:
        t = timed(lambda: fn(gs))
        out[name + "_ms"], out[name + "_GBps"] = t * 1e3, nbytes / t / 1e9
    return out


def embedding_bench(tokens: int, vocab: int, hidden: int) -> dict:
    """The embedding table's gradient (bf16, Qwen3's 151,936 x 2048) from `tokens` rows: ours
    (`ops/embedding.py`: sort, zero fill, one Triton kernel) and torch's dense backward, in ms and as
    GB/s of the fewest bytes (the table written once, the gradient rows read once). `zipf`: ids drawn
    with a Zipf-like skew, so common ids form long runs, as in real text."""
    from pithtrain.ops.embedding import embedding_backward

    grad = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    nbytes = vocab * hidden * 2 + grad.nbytes
    ranks = torch.arange(1, vocab + 1, device="cuda", dtype=torch.float32)
    out = {}
    for kind, ids in [("uniform", torch.randint(0, vocab, (tokens,), device="cuda")),
                      ("zipf", torch.multinomial(1 / ranks, tokens, replacement=True))]:
        for name, fn in [("ours", lambda: embedding_backward(grad, ids, vocab, torch.bfloat16)),
                         ("torch", lambda: torch.ops.aten.embedding_dense_backward(grad, ids, vocab, -1, False))]:
            t = timed(fn)
            out[f"{kind}_{name}_ms"], out[f"{kind}_{name}_GBps"] = t * 1e3, nbytes / t / 1e9
    return out


def ce_bench(rows: int, vocab: int) -> dict:
    """The head's cross-entropy over one chunk of bf16 logits: the log-sum-exp pass and the gradient
    pass (`ce_forward` + `ce_backward`, as the head runs them). GB/s counts one read and one write
    of the logits: what a kernel that read each row from memory once would move (the passes read
    them twice; one persistent kernel that re-read each row from L2 was slower: docs/performance.md)."""
    from pithtrain.ops import cross_entropy as ce

    buf = (torch.randn(rows, vocab, device="cuda") * 4).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    one = torch.ones((), device="cuda")
    nbytes = 2 * buf.nbytes
    return {"two_passes_GBps": gbps(nbytes, lambda: ce.ce_backward(buf, ce.ce_forward(buf, labels, -100)[1], labels,
                                                                    -100, one))}


def sweep() -> dict:
    """GB/s of each memory-bound kernel under several tiles (programs' rows x columns, warps), to
    choose the defaults in ops/swiglu.py, ops/permute.py and ops/adamw.py (AdamW, squares_sum) for this GPU."""
    from pithtrain.ops import adamw, permute, swiglu

    res = {}
    base = dict(swiglu.TILE)
    for rows, block, warps in [(1, 1024, 4), (1, 1024, 8), (1, 256, 2), (2, 256, 4), (4, 256, 4), (8, 256, 8),
                               (2, 512, 4), (4, 512, 8), (2, 1024, 8), (1, 512, 4), (8, 128, 4), (16, 128, 8)]:
        swiglu.TILE.update(rows=rows, block=block, warps=warps)
        r = swiglu_bench(65536, 768)
        res[f"swiglu r{rows} b{block} w{warps}"] = {k: round(v) for k, v in r.items() if "eager" not in k}
    swiglu.TILE.update(base)
    base = dict(permute.TILE)
    for block, warps in [(1024, 4), (1024, 8), (2048, 4), (2048, 8), (512, 4), (512, 2), (256, 2), (2048, 16)]:
        permute.TILE.update(block=block, warps=warps)
        r = permute_bench(8192, 2048, 128, 8)
        res[f"permute b{block} w{warps}"] = {k: round(v) for k, v in r.items() if "eager" not in k}
    permute.TILE.update(base)
    base = adamw.BLOCK, adamw.WARPS
    for block, warps in [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]:
        adamw.BLOCK, adamw.WARPS = block, warps
        res[f"adamw b{block} w{warps}"] = {k: round(v) for k, v in adamw_bench(torch.bfloat16).items()}
    adamw.BLOCK, adamw.WARPS = base
    base = adamw.SQ_BLOCK, adamw.SQ_WARPS
    for block, warps in [(2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 8), (16384, 16)]:
        adamw.SQ_BLOCK, adamw.SQ_WARPS = block, warps
        res[f"squares b{block} w{warps}"] = {k: round(v, 2) for k, v in grad_norm_bench().items() if "ours" in k}
    adamw.SQ_BLOCK, adamw.SQ_WARPS = base
    return res


def attention_bench(batch: int, seq: int, heads: int, kv_heads: int, dim: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    dout = torch.randn_like(q)
    flops = 3 * 4 * batch * heads * seq * seq / 2 * dim
    out = {}
    for name, backend in [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
        def step():
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.autograd.grad(o, (q, k, v), dout)  # no accumulation into .grad inside the timing
        try:
            out[name + "_TFLOPs"] = flops / timed(step) / 1e12
        except RuntimeError as e:  # a backend that does not take these inputs
            out[name + "_TFLOPs"] = f"unavailable: {str(e).splitlines()[0][:120]}"
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--json", default="")
    p.add_argument("--sweep", action="store_true", help="only the tile sweep of the memory-bound kernels")
    p.add_argument("--only", nargs="*", default=[], help="run only these groups (swiglu permute adamw_bf16 "
                   "adamw_fp32 grad_norm grouped_mm attention_qwen3 embedding ce)")
    args = p.parse_args()
    res = {"device": torch.cuda.get_device_name(), "ceilings": ceilings()}
    if args.sweep:
        res["sweep"] = sweep()
        print(json.dumps(res, indent=1))
        return
    benches = {"swiglu": lambda: swiglu_bench(args.tokens * 8, 768),
               "permute": lambda: permute_bench(args.tokens, 2048, 128, 8),
               "adamw_bf16": lambda: adamw_bench(torch.bfloat16),
               "adamw_fp32": lambda: adamw_bench(torch.float32),
               "grad_norm": grad_norm_bench,
               "grouped_mm": lambda: grouped_mm_bench(args.tokens, 2048, 128, 8, 768),
               "attention_qwen3": lambda: attention_bench(2, 4096, 32, 4, 128),
               "embedding": lambda: embedding_bench(args.tokens, 151936, 2048),
               "ce": lambda: ce_bench(args.tokens, 151936)}
    for name, bench in benches.items():
        if not args.only or name in args.only:
            res[name] = bench()
    c = res["ceilings"]
    for group in ("swiglu", "permute", "adamw_bf16", "adamw_fp32", "grad_norm", "embedding", "ce"):
        for key, val in list(res.get(group, {}).items()):
            if key.endswith("GBps"):
                res[group][key.replace("GBps", "of_copy")] = val / c["copy_GBps"]
    for key, val in list(res.get("grouped_mm", {}).items()):
        if key.endswith("TFLOPs"):
            res["grouped_mm"][key.replace("TFLOPs", "of_matmul")] = val / c["matmul_TFLOPs"]
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
