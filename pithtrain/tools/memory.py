"""Memory estimator: the bytes one rank needs for a training step, before anything is allocated.

`estimate` reads the model's shapes from the modules (build it on the meta device: nothing is
allocated) and adds, per rank:
- weights, gradients and AdamW's two moments: 4 bytes each per parameter in fp32, 2 in bf16
  (`train.param_dtype`), over the `world` ranks that FSDP shards them across;
- compute copies of the weights: in one process under bf16 autocast with fp32 weights, every
  matrix is used as a bf16 copy that backward keeps (2 bytes per parameter of the layers and the
  head); with several ranks, FSDP's all-gathered copies (bf16 under autocast, else in the
  parameters' dtype) of the two largest layers (the one computing, the one prefetched; a layer's
  gathered experts are its rank's 1/ep share under expert parallelism) and of the head, which stays
  gathered from its forward to its backward;
- FSDP's reduction buffers: after a unit's backward (a layer's experts, the rest of the layer, the
  embedding, the head) its unsharded gradient is copied into a reduce-scatter input, fp32 under
  autocast, kept until the next unit reduces; both at once, for the largest unit; under HSDP the
  all-reduce also keeps each unit's reduced gradient (fp32 under autocast) until backward ends,
  which is memory of its own when it is added into a gradient or cast to bf16 parameters;
- activations kept for backward, per token of this rank's micro-batch and per layer, what the
  GPU path saves (compiled dense parts, Triton SwiGLU / permutation, FlexAttention or cuDNN
  attention keeping its output and log-sum-exp): layer input and normed input, q / k / v, the
  attention output, the residual and its norm; for experts each token's k routed rows before and
  after the gate/up projection, after SwiGLU and after the down projection; router scores in fp32.
  `train.recompute` keeps only the layer's input (attention) or the routed rows (experts), and
  one layer's full set exists again while it is recomputed;
- the head: its fused cross-entropy holds one chunk of logits at a time and the weight gradient
  (fp32 when the tokens span several chunks, made in the forward; else in the weight's dtype, made
  in the backward from the logits the forward kept), and the input gradient.

Gradients and activations are held together differently in the two kinds of step:
- a step that accumulates over two or more micro-batches (per rank) holds every gradient next to
  all activations from its second micro-batch on: both are counted whole;
- a step of one micro-batch has no gradients in its forward; its backward frees each layer's
  activations as that layer's gradients appear, from the last layer to the first, so the estimate
  is the largest of the walk's stages: the start of backward (all activations, the head's
  working set), each layer's backward (the gradients made so far, the activations of the layers
  not yet done) and the end (all gradients, no activations);
- a step replayed as CUDA graphs (`train.cuda_graphs`, `graphs`) is counted as one that
  accumulates: in the graphs' memory pool, in the allocator's fixed segments, the gradients do not
  take the freed activations' memory; and validation's forward, eager, allocates its logits (one
  chunk) outside the pool (`outside_graphs`). Qwen3 proxy: 30.81 GB held by the device in training
  and 33.13 after validation, against 30.7 and 33.0 estimated so (24.9 for the eager walk;
  docs/performance.md). In the expandable segments that `train/graphs.py` switches to, the
  gradients do take that memory (26.4 GB held in training), so there this is an upper bound.
Measured against the H200's peak (`tests/test_gpu.py`, and the 4-layer proxies of
docs/performance.md): see the figures there. `check_fits` refuses a run whose estimate exceeds
the device.
"""

from dataclasses import dataclass

import torch
from torch import nn

from pithtrain.config import ConfigError
from pithtrain.ops.cross_entropy import CHUNK

GB = 2**30
GRAPHS_OFF = "train.cuda_graphs=off (their memory pool is held apart from the eager code's memory), "


@dataclass
class MemoryEstimate:
    weights: float
    gradients: float
    optimizer: float
    compute_copies: float
    activations: float
    head: float
    backward_peak: float | None = None  # one micro-batch a step: the most gradients + activations + head
    #                                     held at once in the backward walk; None: all three at once
    reduce_buffers: float = 0.0  # FSDP: one unit's unsharded gradient and reduce-scatter input (+ HSDP's)
    outside_graphs: float = 0.0  # CUDA graphs: validation's logits, allocated outside the graphs' pool

    @property
    def total(self) -> float:
        held = self.gradients + self.activations + self.head if self.backward_peak is None else self.backward_peak
        return self.weights + self.optimizer + self.compute_copies + self.reduce_buffers + held + self.outside_graphs

    def lines(self) -> list[str]:
        parts = ", ".join(f"{name.replace('_', ' ')} {getattr(self, name) / GB:.2f} GB" for name in
                          ("weights", "gradients", "optimizer", "compute_copies", "reduce_buffers", "activations",
                           "head") + (("outside_graphs",) if self.outside_graphs else ()))
        walk = ("" if self.backward_peak is None else f"; one micro-batch a step, so gradients, activations and "
                f"head are {self.backward_peak / GB:.2f} GB at most at once, in backward")
        return [f"estimated peak {self.total / GB:.2f} GB per rank: {parts}{walk}"]


def _attention_bytes(attn: nn.Module, a: int) -> float:
    """Per token: q, k, v and the output (and q/k before their norms, the sink-free output), LSE."""
    from pithtrain.layers.attention import GQAttention

    h = attn.heads
    if isinstance(attn, GQAttention):
        q, kv = h * attn.head_dim, attn.kv_heads * attn.head_dim
        n = q + 2 * kv + q + (q + kv if attn.q_norm is not None else 0) + (q if attn.sinks is not None else 0)
    else:  # MLA: the low-rank latents and their norms, then full-head q, k, v
        qk = attn.nope_dim + attn.rope_dim
        n = 2 * attn.kv_lora_rank + attn.rope_dim + 2 * h * qk + 2 * h * attn.v_dim
        if attn.q_lora:
            n += 2 * attn.q_a_proj.out_features
    return n * a + 4 * h


def _mlp_bytes(mlp: nn.Module, a: int) -> float:
    """A dense SwiGLU MLP per token: gate and up outputs and their product."""
    return 3 * mlp.gate_proj.out_features * a


def layer_activation_bytes(layer: nn.Module, a: int, recompute_attention: bool, recompute_experts: bool) -> float:
    """Bytes per token that one decoder layer keeps for backward (activations of `a` bytes)."""
    hidden = layer.input_layernorm.weight.shape[0]
    attn = 2 * hidden * a if recompute_attention else 4 * hidden * a + _attention_bytes(layer.self_attn, a)
    if not layer.is_moe:
        return attn + _mlp_bytes(layer.mlp, a)
    moe = layer.mlp
    k, width = moe.top_k, moe.experts.intermediate
    experts = k * hidden * a if recompute_experts else k * (2 * hidden + 3 * width) * a
    shared = _mlp_bytes(moe.shared_experts, a) if moe.shared_experts is not None else 0
    return attn + experts + shared + 8 * moe.num_experts


def estimate(model: nn.Module, *, tokens: int, param_dtype: str = "fp32", autocast: bool = True,
             world: int = 1, recompute: str = "none", ce_chunk: int = CHUNK,
             accumulate: bool = True, ep: int = 1, sharded: bool | None = None,
             replicated: bool = False, graphs: bool = False) -> MemoryEstimate:
    """Per-rank estimate for `model` (meta device is enough; all experts, as one process builds it)
    with `tokens` per micro-batch on this rank (micro_batch_size * seq_len / cp), parameters sharded
    over `world` ranks, experts split over `ep` of them; `accumulate`: the step runs two or more
    micro-batches on this rank (else the backward walk of one); `sharded`: FSDP wraps the model
    (default: `world` > 1; also so under HSDP with one rank per replica, or torchrun with one rank);
    `replicated`: HSDP, whose all-reduce keeps every unit's reduced gradient until backward ends;
    `graphs`: the step is replayed as CUDA graphs (counted as accumulating, plus validation's logits)."""
    state = 4 if param_dtype == "fp32" else 2
    a = 2 if (autocast or param_dtype == "bf16") else 4
    accumulate = accumulate or graphs
    layers = list(model.model.layers.values())
    head = model.lm_head.weight
    matrices = sum(p.numel() for layer in layers for p in layer.parameters() if p.ndim >= 2) + head.numel()
    sharded = world > 1 if sharded is None else sharded
    experts_of = {id(p) for layer in layers if layer.is_moe for p in layer.mlp.experts.parameters()}

    def rows(p, padded: bool) -> float:
        """Elements of `p` this rank holds (rank 0, the most): FSDP2 cuts dim 0 of this rank's part
        (1/ep of an expert tensor's experts) into chunks of ceil(rows / shards), rank 0's whole;
        `padded`: the gathered or reduce-scatter buffer instead, shards x that chunk."""
        expert = id(p) in experts_of
        dim0 = p.shape[0] // ep if expert and p.ndim else (p.shape[0] if p.ndim else 1)
        shards = max(world // ep, 1) if expert else world
        if not sharded:
            return p.numel() / (ep if expert else 1)
        chunk = -(-dim0 // shards) * (p.numel() // max(p.shape[0] if p.ndim else 1, 1))
        return chunk * shards if padded else chunk

    n = sum(rows(p, False) for p in model.parameters())  # this rank's elements of every parameter
    reduce_buffers = hsdp_kept = 0.0
    if sharded:  # FSDP gathers a layer's weights (bf16 under autocast) and frees them after use
        def parts(layer):  # (the layer outside its experts, this rank's 1/ep of its experts), padded as gathered
            experts = sum(rows(p, True) for p in layer.mlp.experts.parameters()) if layer.is_moe else 0
            return sum(rows(p, True) for p in layer.parameters() if id(p) not in experts_of), experts

        split = [parts(layer) for layer in layers]
        sizes = sorted((dense + experts for dense, experts in split), reverse=True)
        copies = (2 if autocast else state) * (sum(sizes[:2]) + rows(head, True))
        # After each unit's backward (a layer's experts, the rest of a layer, the embedding, the head)
        # FSDP copies its unsharded gradient (bf16 under autocast) into a reduce-scatter input (fp32
        # under autocast), which it keeps until the next unit's reduction: both at once, for the largest.
        units = [rows(head, True), rows(model.model.embed_tokens.weight, True)] + [u for pair in split for u in pair]
        reduce = 4 if autocast else state
        reduce_buffers = ((2 if autocast else state) + reduce) * max(units)
        if replicated and (accumulate or reduce != state):  # else the reduced gradient is the gradient itself
            hsdp_kept = reduce  # per local element: from its unit's reduction to the end of backward
    else:  # autocast's bf16 copies of fp32 matrices live until backward has used them
        copies = matrices * 2 if (state == 4 and a == 2) else 0
    ra, rx = recompute in ("attention", "both"), recompute in ("experts", "both")
    kept = [layer_activation_bytes(layer, a, ra, rx) for layer in layers]
    full = [layer_activation_bytes(layer, a, False, False) for layer in layers]
    recomputed = tokens * max(f - k for f, k in zip(full, kept))  # the layer being recomputed, in backward
    acts = tokens * sum(kept) + recomputed
    hidden = head.shape[1]
    dw = 4 if tokens > ce_chunk else state  # the head's dW: an fp32 accumulator over several chunks
    logits = min(ce_chunk, tokens) * head.shape[0] * a  # one chunk's
    head_bytes = dw * head.numel() + tokens * hidden * 3 * a + logits
    est = MemoryEstimate(weights=n * state, gradients=n * state, optimizer=2 * n * state,
                         compute_copies=copies, activations=acts, head=head_bytes,
                         reduce_buffers=reduce_buffers + (hsdp_kept * n if accumulate else 0.0),
                         outside_graphs=logits if graphs else 0.0)
    if not accumulate:
        per = state + hsdp_kept  # per local element: its reduced gradient, and what HSDP keeps of it
        grads = [sum(rows(p, False) for p in layer.parameters()) * per for layer in layers]
        held = rows(head, False) * per  # the head's gradient, once its backward is done
        walk = [acts - recomputed + head_bytes, n * per]
        for i in reversed(range(len(layers))):  # layer i's backward: its gradients next to its activations
            walk.append(held + grads[i] + tokens * (sum(kept[:i + 1]) + full[i] - kept[i]))
            held += grads[i]
        est.backward_peak = max(walk)
    return est


def estimate_for_run(cfg, world: int = 1, cp: int = 1, autocast: bool = True, data_ranks: int = 1,
                     sharded: bool | None = None) -> MemoryEstimate:
    """`estimate` for a RunConfig on `world` ranks with context parallel `cp` and `data_ranks`
    ranks that split the global batch: the model built on the meta device (nothing allocated),
    this rank's share of a micro-batch. Under HSDP (`parallel.dp_replicate` > 1) each replica
    holds whole states, so they are sharded over world / dp_replicate ranks; FSDP wraps the model
    whenever `world` > 1 (or `sharded`: one process under torchrun)."""
    from pithtrain.models import build_model

    with torch.device("meta"):
        model = build_model(cfg.model.hf)
    t, d = cfg.train, cfg.data
    return estimate(model, tokens=d.micro_batch_size * d.seq_len // cp, param_dtype=t.param_dtype,
                    autocast=autocast, world=world // cfg.parallel.dp_replicate, recompute=t.recompute,
                    accumulate=d.global_batch_size > d.micro_batch_size * data_ranks, ep=cfg.parallel.ep,
                    sharded=world > 1 if sharded is None else sharded, replicated=cfg.parallel.dp_replicate > 1,
                    graphs=t.cuda_graphs == "on")


def check_fits(est: MemoryEstimate, device_bytes: int | None, world: int = 1, cfg=None) -> None:
    """Refuse, before anything is allocated, a run whose estimated peak exceeds the device; the advice
    leaves out what the run (`cfg`, a RunConfig) already does."""
    if device_bytes is None or est.total <= device_bytes:
        return
    t, d = (cfg.train, cfg.data) if cfg is not None else (None, None)
    if est.weights + est.gradients + est.optimizer > 0.8 * device_bytes:
        options = ["more ranks (torchrun; FSDP shards weights, gradients and AdamW states)"]
        options += [] if t and t.param_dtype == "bf16" else ["train.param_dtype=bf16 (half of each)"]
        options.append("a smaller model")
    else:
        options = [] if t and t.recompute == "both" else ["train.recompute=both (activations)"]
        options += [] if d and d.micro_batch_size == 1 else [
            "a smaller data.micro_batch_size (the global batch stays, by accumulation)"]
        options.append("parallel.cp (each rank holds part of every sequence's activations; more data ranks do not "
                       "shrink them)")
    change = ", ".join(options[:-1]) + ", or " + options[-1] if len(options) > 1 else options[0]
    if est.outside_graphs:
        change = GRAPHS_OFF + change
    raise ConfigError(f"this run does not fit on {world} rank(s): {est.lines()[0]}; the device has "
                      f"{device_bytes / GB:.1f} GB. To fit: {change}")
