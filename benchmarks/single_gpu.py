"""PithTrain vs Hugging Face transformers on one GPU, same config, same weights, same process.

    PYTHONPATH=. python benchmarks/single_gpu.py [--layers 4] [--seq 4096] [--mbs 2] [--steps 5]

Builds the Qwen3-30B-A3B-shaped proxy (hidden 2048, 128 experts top-8, expert width 768, 32/4
heads of 128, vocab 151,936, untied head) with `--layers` layers, initialises ours, loads the same
weights into `Qwen3MoeForCausalLM` (grouped_mm experts, SDPA), and times training steps of each
(AdamW, warm-up steps first, CUDA events, median). Ours runs as it trains: fp32 master weights
under bf16 autocast. HF runs as its harness in docs/performance.md does: bf16 weights, fused AdamW.
Model FLOPs per token (training = 3 x forward): 6 * (active matmul parameters: attention projections,
router, top-k experts, head) + 6 * layers * S * heads * head_dim (QK^T and PV over the causal half).
"""

import argparse
import json
import statistics

import torch

QWEN3_30B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                 moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)


def flops_per_token(c: dict, layers: int, seq: int) -> float:
    H, d = c["hidden_size"], c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    attn_params = H * (d + 2 * kv) + d * H
    expert_params = c["num_experts_per_tok"] * 3 * H * c["moe_intermediate_size"] + H * c["num_experts"]
    dense = layers * (attn_params + expert_params) + H * c["vocab_size"]
    return 6 * dense + 6 * layers * seq * d


def time_steps(step, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def measure(step, args, tokens: int, fpt: float) -> dict:
    torch.cuda.reset_peak_memory_stats()
    t = time_steps(step, args.warmup, args.steps)
    return dict(step_s=t, tokens_per_s=tokens / t, tflops=fpt * tokens / t / 1e12,
                peak_gb=torch.cuda.max_memory_allocated() / 2**30)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--only", choices=["ours", "hf", "both"], default="both")
    args = p.parse_args()
    cfg = {**QWEN3_30B, "num_hidden_layers": args.layers}
    dev = torch.device("cuda")
    ids = torch.randint(0, cfg["vocab_size"], (args.mbs, args.seq + 1), device=dev)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    tokens = args.mbs * args.seq
    fpt = flops_per_token(cfg, args.layers, args.seq)
    results = {}

    from pithtrain.layers.transformer import init_weights
    from pithtrain.models import build_model

    with torch.device(dev):
        ours = build_model(cfg)
    init_weights(ours, 0)
    state = {k: v.to(torch.bfloat16) for k, v in ours.state_dict().items()}

    if args.only in ("ours", "both"):
        opt = torch.optim.AdamW(ours.parameters(), lr=1e-4, fused=True)

        def step_ours():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ours(inputs, labels=labels) / tokens
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        results["ours"] = measure(step_ours, args, tokens, fpt)
        del opt
    del ours
    torch.cuda.empty_cache()

    if args.only in ("hf", "both"):
        import transformers

        config = transformers.Qwen3MoeConfig(**cfg, attn_implementation="sdpa")
        config._experts_implementation = "grouped_mm"
        with torch.device(dev):
            hf = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
        hf.load_state_dict(state, strict=True)
        del state
        hopt = torch.optim.AdamW(hf.parameters(), lr=1e-4, fused=True)

        def step_hf():
            logits = hf(input_ids=inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
            loss.backward()
            hopt.step()
            hopt.zero_grad(set_to_none=True)

        results["hf"] = measure(step_hf, args, tokens, fpt)
    if "ours" in results and "hf" in results:
        results["ratio_tokens_per_s"] = results["ours"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
        results["ratio_peak_mem"] = results["ours"]["peak_gb"] / results["hf"]["peak_gb"]
    results["config"] = dict(layers=args.layers, seq=args.seq, mbs=args.mbs, steps=args.steps,
                             flops_per_token=fpt, device=torch.cuda.get_device_name())
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
