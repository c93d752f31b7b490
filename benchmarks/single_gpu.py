"""PithTrain vs Hugging Face transformers on one GPU, same config, same weights, same process.

    PYTHONPATH=. python benchmarks/single_gpu.py [--model qwen3_30b_a3b] [--layers 4] [--seq 4096]
                                                [--mbs 2] [--steps 5] [--clip 1.0] [--step loop]

Builds a `--layers`-layer proxy of an example model (`examples/<model>/config.json`: Qwen3-30B-A3B,
DeepSeek-V2-Lite, GPT-OSS-20B), initialises ours, loads the same weights into the transformers
model (grouped_mm experts; SDPA attention, flex_attention for GPT-OSS whose SDPA path transformers
does not support), and times training steps of each (AdamW, warm-up steps first, CUDA events,
median) under three protocols (`time_steps`: drained after each step, the headline; the loss read
after backward as a trainer does; no host synchronisation). Ours runs as it trains: fp32 master
weights under bf16 autocast (`--weights fp32`), or with bf16 weights and AdamW states as the HF
side (`--weights bf16`). HF runs as its harness in
docs/performance.md does: bf16 weights, fused AdamW. MFU is given against 989 TFLOP/s (the H200's
dense bf16 figure) and against a bf16 8192^3 matmul measured in the same run; `--clocks` adds the
SM clock, power and clock-event reasons while each protocol ran (`Clocks`).
Model FLOPs per token (training = 3 x forward): 6 * active parameters without the input
embedding + 3 * per layer 2 * keys * heads * (qk_dim + v_dim), keys = S/2 under full causal
attention and the mean keys per query, w - w(w-1)/(2S), under a sliding window of w.
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import statistics
from collections import Counter
from contextlib import nullcontext
from select import select as select_read

import torch

# Run as a script, this folder comes first on sys.path, where kernels.py would stand in for the
# `kernels` package that transformers imports.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
HF_CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
              "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}


def flops_per_token(model, seq: int) -> float:
    from pithtrain.layers.attention import MLAttention

    _, active = model.parameter_counts(count_embedding=False)
    attn = 0.0
    for layer in model.model.layers.values():
        a = layer.self_attn
        qk, v = (a.nope_dim + a.rope_dim, a.v_dim) if isinstance(a, MLAttention) else (a.head_dim, a.head_dim)
        w = getattr(a, "window", None)  # a query sees itself and the w - 1 keys before it
        keys = seq / 2 if w is None or w >= seq else w - w * (w - 1) / (2 * seq)
        attn += 2 * keys * a.heads * (qk + v)
    return 6 * active + 3 * attn


def time_steps(step, warmup: int, steps: int, protocol: str = "step") -> float:
    """Median seconds per step. `step`: the GPU drained after every step (events around it).
    `trainer`: as a training loop runs, `step(True)` reads the loss after backward (the one host
    synchronisation of `pithtrain train` and of HF's Trainer) and nothing waits for the optimizer, so
    the host launches the next forward while the update runs; a step is the time between the
    events recorded at consecutive step starts. `pipelined`: as `trainer` with no host
    synchronisation at all, the bound that a host which never waits would reach."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    if protocol in ("trainer", "pipelined"):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        for i in range(steps):
            events[i].record()
            step(protocol == "trainer")
        events[-1].record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) / 1000 for a, b in zip(events, events[1:]))
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


REASONS = {0x1: "idle", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
           0x80: "hw_power_brake"}  # nvidia-smi's clock-event reason bits (the others: settings, display)


class Clocks:
    """What the GPU ran at while a protocol was timed (`--clocks`): `nvidia-smi` in its own process
    (no share of the host's launches or of the GIL) samples the SM clock, the power draw and the
    clock-event reasons (why the clock is below its maximum: a power cap, a thermal limit) every
    50 ms; `summary()` gives their medians and each reason's share of the samples (the timed steps
    only: `measure` runs the warm-up before sampling starts). The matmul ceiling and both sides move
    with this clock from one machine to the next, so a figure of one run is read beside it. If
    `nvidia-smi` is missing or refuses the query, the summary says so and the timing goes on."""

    QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"

    def __init__(self, command: str = "nvidia-smi"):
        self.command, self.proc, self.lines = command, None, []

    def __enter__(self):
        which = []
        try:  # this process's GPU by its PCI address, however the machine numbers its GPUs
            p = torch.cuda.get_device_properties(torch.cuda.current_device())
            which = ["-i", f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"]
        except (AttributeError, RuntimeError, AssertionError):  # no CUDA, or a torch without these fields
            pass
        try:
            self.proc = subprocess.Popen([self.command, f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                                          "-lms", "50", *which], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True)
        except (OSError, ValueError) as e:
            self.lines = [f"not sampled: {e}"]
            return self
        if select_read([self.proc.stdout], [], [], 10)[0]:  # its first sample (or its error) before the timing starts
            self.lines.append(self.proc.stdout.readline())
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            self.lines += self.proc.communicate()[0].splitlines()

    def summary(self) -> dict:
        rows = [[_number(f) for f in line.split(",")] for line in self.lines]
        rows = [r for r in rows if len(r) == 4 and r[0] is not None]
        if not rows:
            return {"not_sampled": " | ".join(self.lines)[:300] or "no samples"}
        reasons = Counter(name for r in rows for bit, name in REASONS.items() if int(r[3] or 0) & bit)
        power = [r[1] for r in rows if r[1] is not None]
        return dict(samples=len(rows), sm_mhz=statistics.median(r[0] for r in rows),
                    power_w=statistics.median(power) if power else None,
                    max_temp_c=max((r[2] for r in rows if r[2] is not None), default=None),
                    reasons={k: round(v / len(rows), 3) for k, v in reasons.items()})  # share of the samples


def _number(field: str) -> float | None:
    """A field of nvidia-smi's csv (decimal, or hex for the reasons), None for [N/A] and the like."""
    field = field.strip()
    try:
        return float(int(field, 16)) if field.startswith("0x") else float(field)
    except ValueError:
        return None


def ours_step(model, opt, inputs: torch.Tensor, labels: torch.Tensor, step: str = "bench", clip: float = 0.0,
              autocast: bool = False):
    """Our training step as timed; `step(read_loss)` as `time_steps` calls it. `bench`: forward,
    backward, clipping if `clip`, AdamW. `loop`: what `pithtrain train` runs, `train.loop.train_step`
    on a host batch (its upload, the target count, clipping, the guard's decision, one host
    synchronisation, the MoE statistics), so the difference between the two is the loop's own cost.
    `graphs`: `loop` with train.cuda_graphs = on (its warm-up steps are the timing's); its
    `StepGraphs` switches the allocator to expandable segments for the rest of the process, HF's
    side included (unless PYTORCH_CUDA_ALLOC_CONF chose)."""
    from pithtrain.train.graphs import StepGraphs
    from pithtrain.train.guard import StepGuard
    from pithtrain.train.loop import train_step
    from pithtrain.train.optim import clip_grad_norm

    tokens, dev = labels.numel(), inputs.device
    if step in ("loop", "graphs"):
        guard, batch = StepGuard("halt", 0, 0.0, 1), [(inputs.cpu(), labels.cpu())]
        amp = torch.bfloat16 if autocast else None
        graphs = StepGraphs(model, opt, clip, dev, amp) if step == "graphs" else None
        return lambda read_loss=False: train_step(model, opt, batch, clip, dev, amp, guard=guard, graphs=graphs)

    def run(read_loss: bool = False):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(inputs, labels=labels) / tokens
        loss.backward()
        if read_loss:
            loss.item()
        scale = clip_grad_norm(list(model.parameters()), clip)[1] if clip else None
        opt.step(grad_scale=scale)
        opt.zero_grad(set_to_none=True)
    return run


def matmul_ceiling() -> float:
    """bf16 8192^3 matmul TFLOP/s on this GPU now (median of 20): the MFU denominator we can reach."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    t = time_steps(lambda: a @ b, 5, 20)
    return 2 * 8192**3 / t / 1e12


def measure(step, args, tokens: int, fpt: float, ceiling: float) -> dict:
    """The three protocols of `time_steps`; TFLOP/s and MFU are the `step` protocol's, the other
    two protocols' tokens/s beside its own; with `--clocks`, the GPU's clock and power during each."""
    torch.cuda.reset_peak_memory_stats()
    times, clocks = {}, {}
    for protocol, warmup in (("step", args.warmup), ("trainer", 1), ("pipelined", 1)):
        for _ in range(warmup):  # outside the clock sampling: the first ones compile, capture and tune
            step()
        torch.cuda.synchronize()
        with Clocks() if args.clocks else nullcontext() as c:
            times[protocol] = time_steps(step, 0, args.steps, protocol)
        if c is not None:
            clocks[protocol] = c.summary()
    t, t_trainer, t_pipelined = times["step"], times["trainer"], times["pipelined"]
    tflops = fpt * tokens / t / 1e12
    return dict(step_s=t, tokens_per_s=tokens / t, tflops=tflops, mfu_989=tflops / 989, mfu_ceiling=tflops / ceiling,
                trainer_step_s=t_trainer, trainer_tokens_per_s=tokens / t_trainer,
                pipelined_tokens_per_s=tokens / t_pipelined,
                peak_gb=torch.cuda.max_memory_allocated() / 2**30,
                peak_reserved_gb=torch.cuda.max_memory_reserved() / 2**30, **({"clocks": clocks} if clocks else {}))


def profile(step, out_dir: str) -> None:
    """Two profiled steps of the `trainer` protocol (loss read after backward): the CUDA kernel
    table (by total time) printed and saved, a trace, and the GPU's busy time (the union of kernel
    intervals) against the wall time of the steps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as torch_profile

    os.makedirs(out_dir, exist_ok=True)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(2):
            step(True)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=120, max_name_column_width=90)
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    summary = (f"per step: wall {wall / 2 * 1e3:.1f} ms (profiled), GPU busy {busy / 2e3:.1f} ms, "
               f"{len(spans) // 2} kernels")
    with open(os.path.join(out_dir, "kernels.txt"), "w") as f:
        f.write(table + "\n" + summary + "\n")
    print(table)
    print(summary)
    prof.export_chrome_trace(os.path.join(out_dir, "trace.json.gz"))


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--model", default="qwen3_30b_a3b", choices=["qwen3_30b_a3b", "deepseek_v2_lite", "gpt_oss_20b"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--only", choices=["ours", "hf", "both"], default="both")
    p.add_argument("--step", choices=["bench", "loop", "graphs"], default="bench",
                   help="ours: forward, backward, clipping and AdamW (bench), or `pithtrain train`'s train_step "
                        "(loop), with train.cuda_graphs = on (graphs)")
    p.add_argument("--clip", type=float, default=0.0, help="clip the gradients' norm to this, as trainers do "
                   "(both default to 1.0): ours as `pithtrain train` does, HF with torch.nn.utils.clip_grad_norm_")
    p.add_argument("--clocks", action="store_true", help="sample the SM clock, power and clock-event reasons with "
                   "nvidia-smi while each protocol runs (off by default until its effect on the timing is measured)")
    p.add_argument("--profile", default="", help="also profile two steps of each: kernel table + trace in DIR/ours, DIR/hf")
    p.add_argument("--compile", choices=["on", "off"], default="on", help="torch.compile of our dense parts")
    p.add_argument("--hf-compile", action="store_true", help="also torch.compile HF's model (default mode, graph "
                   "breaks allowed), as a user of transformers may; the peer of the headline is eager transformers")
    p.add_argument("--recompute", choices=["none", "attention", "experts", "both"], default="none")
    p.add_argument("--weights", choices=["fp32", "bf16"], default="fp32",
                   help="ours with fp32 master weights under bf16 autocast (as pithtrain train runs), or bf16 weights "
                        "and AdamW states as the HF side")
    p.add_argument("--ce-chunk", type=int, default=0, help="rows per chunk of the fused head + cross-entropy "
                   "(default: ops/cross_entropy.CHUNK)")
    p.add_argument("--order", choices=["ours-first", "hf-first"], default="ours-first", help="which side is timed "
                   "first (on a cooler card: compare both orders to see what the order is worth)")
    args = p.parse_args(argv)
    from pithtrain.ops import cross_entropy
    if args.ce_chunk:
        cross_entropy.CHUNK = args.ce_chunk
    with open(os.path.join(EXAMPLES, args.model, "config.json")) as f:
        cfg = {**json.load(f), "num_hidden_layers": args.layers}
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][:args.layers]
    dev = torch.device("cuda")
    ids = torch.randint(0, cfg["vocab_size"], (args.mbs, args.seq + 1), device=dev)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    tokens = args.mbs * args.seq
    ceiling = matmul_ceiling()
    results = {"matmul_ceiling_tflops": ceiling}

    from pithtrain.layers.transformer import cast_parameters, init_weights
    from pithtrain.models import build_model
    from pithtrain.tools.memory import estimate
    from pithtrain.train.optim import AdamW

    with torch.device(dev):
        ours = build_model(cfg)
    init_weights(ours, 0)
    fpt = flops_per_token(ours, args.seq)
    state = {k: v.to("cpu", torch.bfloat16) for k, v in ours.state_dict().items()}  # HF's copy, off the GPU
    losses = {}  # each side's loss on the batch before its first step: the same weights give the same loss
    if args.only == "hf":
        ours = None
    elif args.order == "hf-first":
        ours.to("cpu")  # off the GPU while HF is measured

    def side_ours():
        nonlocal ours
        ours.to(dev)
        if args.weights == "bf16":
            cast_parameters(ours, torch.bfloat16)
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.weights == "fp32"):
            losses["ours"] = (ours(inputs, labels=labels) / tokens).item()
        ours.set_recompute(args.recompute in ("attention", "both"), args.recompute in ("experts", "both"))
        if args.compile == "on":
            ours.compile_dense()
        opt = AdamW(ours.parameters(), lr=1e-4, fused=True)  # ours: one Triton kernel per parameter
        step_ours = ours_step(ours, opt, inputs, labels, args.step, args.clip, autocast=args.weights == "fp32")
        results["ours"] = measure(step_ours, args, tokens, fpt, ceiling)
        est = estimate(ours, tokens=tokens, param_dtype=args.weights, autocast=args.weights == "fp32",
                       recompute=args.recompute, ce_chunk=cross_entropy.CHUNK, accumulate=False)  # one micro-batch a step
        results["ours"]["estimate_gb"] = est.total / 2**30
        if args.profile:
            profile(step_ours, os.path.join(args.profile, "ours"))
        del opt, step_ours  # the step's closure holds the model and the optimizer
        ours = None

    def side_hf():
        nonlocal state
        import transformers

        attn = "flex_attention" if cfg["model_type"] == "gpt_oss" else "sdpa"
        config = transformers.AutoConfig.for_model(**cfg, attn_implementation=attn)
        config._experts_implementation = "grouped_mm"
        with torch.device(dev):
            hf = getattr(transformers, HF_CLASSES[cfg["model_type"]])(config)
        for p in hf.parameters():  # bf16 weights; buffers (RoPE's inv_freq) stay fp32, as a bf16 load leaves them
            p.data = p.data.to(torch.bfloat16)
        hf.load_state_dict(state, strict=True)
        state = None
        hopt = torch.optim.AdamW(hf.parameters(), lr=1e-4, fused=True)
        held = torch.cuda.memory_allocated() / 2**30  # when HF is measured: its weights and the batch, none of ours
        run_hf = torch.compile(hf) if args.hf_compile else hf

        def hf_loss():  # no name holds the bf16 logits: autograd keeps only the fp32 copy, as transformers' loss
            return torch.nn.functional.cross_entropy(run_hf(input_ids=inputs, use_cache=False).logits.float()
                                                     .flatten(0, 1), labels.flatten())

        def step_hf(read_loss: bool = False):
            loss = hf_loss()
            loss.backward()
            if read_loss:
                loss.item()
            if args.clip:
                torch.nn.utils.clip_grad_norm_(hf.parameters(), args.clip)
            hopt.step()
            hopt.zero_grad(set_to_none=True)

        with torch.no_grad():
            losses["hf"] = hf_loss().item()
        results["hf"] = measure(step_hf, args, tokens, fpt, ceiling)
        results["hf"]["held_before_gb"] = held
        results["hf"]["compiled"] = args.hf_compile
        if args.profile:
            profile(step_hf, os.path.join(args.profile, "hf"))

    sides = {"ours": side_ours, "hf": side_hf}
    order = ["ours", "hf"] if args.order == "ours-first" else ["hf", "ours"]
    for i, name in enumerate(n for n in order if args.only in (n, "both")):
        gc.collect()  # the compiled wrappers hold our layers in reference cycles
        torch.cuda.empty_cache()  # nothing freed so far stays cached in this side's reserved memory
        left = torch.cuda.memory_allocated() - ids.numel() * ids.element_size()
        if (i or name == "hf") and left > 2**30:  # only ours, timed first, starts with its model on the GPU
            raise RuntimeError(f"{left / 2**30:.2f} GB of the other side is still allocated before {name} is measured: "
                               "a reference to its model, optimizer or step is left in main()")
        sides[name]()
    results["loss_before"] = losses
    if len(losses) == 2 and abs(losses["ours"] - losses["hf"]) > 0.01 * abs(losses["hf"]):
        results["loss_mismatch"] = "the two sides' losses on the same batch and weights differ by more than 1%"
    if "ours" in results and "hf" in results:
        results["ratio_tokens_per_s"] = results["ours"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
        for protocol in ("trainer", "pipelined"):
            results[f"ratio_{protocol}_tokens_per_s"] = (results["ours"][f"{protocol}_tokens_per_s"]
                                                         / results["hf"][f"{protocol}_tokens_per_s"])
        results["ratio_peak_mem"] = results["ours"]["peak_gb"] / results["hf"]["peak_gb"]
        # what each process held from the device (allocated + the caching allocator's free blocks;
        # under --step graphs also the graphs' pool, docs/performance.md)
        results["ratio_peak_reserved"] = results["ours"]["peak_reserved_gb"] / results["hf"]["peak_reserved_gb"]
    results["config"] = dict(model=args.model, layers=args.layers, seq=args.seq, mbs=args.mbs, steps=args.steps,
                             weights=args.weights, compile=args.compile, recompute=args.recompute, ce_chunk=args.ce_chunk,
                             clip=args.clip, step=args.step, clocks=args.clocks, order=args.order,
                             flops_per_token=fpt, device=torch.cuda.get_device_name())
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
