"""The training step of one process on one GPU, replayed as two CUDA graphs (train.cuda_graphs).

Eager, the host launches the step's kernels one by one, and after the guard's synchronisation
each step starts with a host that must launch the forward's first small kernels (embedding,
norms, RoPE, routing) faster than the GPU runs them, which it cannot. A graph launches the whole
captured sequence at once. Measured on an H100: +0.3-1.8% tokens/s on the three proxies, hence off
by default; and in the allocator's default fixed segments the device memory held (reserved) grows
by 4-7 GB on the Qwen3 proxy, where the allocated peak grows by 0.06 GB, hence expandable segments
(below; docs/performance.md).

- Graph A: every micro-batch's forward and backward from static input buffers, then the
  gradients' norm and clipping's factor.
- The host reads the loss and the norm for the guard (the step's one synchronisation, as eager).
- Graph B: AdamW, at the learning rate read from a device tensor; replayed only for a step the
  guard applies.

What changes from step to step enters as device data copied before A: the micro-batches, 1 / the
step's target count, each micro-batch's share of the balancing losses, the learning rate, and
the loss factor of PITHTRAIN_FAULT's nan-loss / spike-loss (1 otherwise). The MoE statistics and
aux-free bias update (`end_step`), the halt path's forward, validation and checkpoints stay eager.

Capture comes after `WARMUP` eager steps (regions compiled, kernels tuned, the optimizer's state
made) and one forward and backward on the capture stream that changes nothing it keeps (lazy
per-stream state, such as cuBLAS's workspace, is made outside the graph). Gradients are None at
capture, so each replay writes them afresh as an eager step after `zero_grad` does; they live in the
graphs' memory pool, and the allocated peak stays near the eager one (+0.06 GB measured). In fixed
segments the device memory held is larger: the pool is the graphs' own, held beside the blocks that
eager code (the eager steps before capture, validation's forward, checkpoints) allocates and frees,
and in it the gradients sit beside the step's free transient where eagerly they take the memory of
the activations that the backward frees: the pool starts empty, each activation takes a segment of
its own size, and a gradient larger than every freed one (768 MiB for a Qwen3 layer's gate/up
experts) takes a new segment. Qwen3 proxy: 30.8 GB reserved vs 26.3 eagerly, 33.1 once validation
has run (its forward allocates outside the pool). In expandable segments the freed activations are
one range that the gradients reuse: 26.4 GB at the training peak, as eagerly (H100, with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True set before the process started). So `StepGraphs`
switches the caching allocator to expandable segments before its eager steps
(`expandable_segments`), unless the environment names that option or another allocator backend (this
switch from inside the process is not yet measured on a GPU; docs/performance.md). The memory
estimate counts the fixed segments' case, an upper bound: the step as one that accumulates, plus
validation's logits (33.0 GB here); an out-of-memory report names train.cuda_graphs=off first.
The gradients read between replays are this step's. One process only (`train` refuses the
others): FSDP, expert and context parallelism run collectives and host-side split sizes that a
graph cannot hold.
"""

from __future__ import annotations

import os

import torch

from pithtrain.config import ConfigError
from pithtrain.train.data import micro_batch_fields
from pithtrain.train.optim import clip_grad_norm

WARMUP = 2  # eager steps before capture: the first compiles, the second runs as every later step


def expandable_segments() -> bool:
    """Make the caching allocator's new segments expandable (one range of addresses per pool that
    grows and shrinks, so freed neighbours join), keeping the other options of PYTORCH_ALLOC_CONF /
    PYTORCH_CUDA_ALLOC_CONF, and give back the cached free blocks of fixed segments; unless that
    setting names `expandable_segments` or `backend` (the user chose). Returns whether it switched.
    For the rest of the process: the graphs' pool lives as long as it."""
    conf = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    if any(opt.split(":")[0].strip() in ("expandable_segments", "backend") for opt in conf.split(",")):
        return False
    setting = ",".join(filter(None, (conf, "expandable_segments:True")))
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(setting)
    torch.cuda.empty_cache()
    return True


def _layout(micro_batches: list[tuple]) -> list[list]:
    return [[None if t is None else (t.shape, t.dtype) for t in mb] for mb in micro_batches]


class StepGraphs:
    """`loop.train_step`'s forward/backward/norm (`forward_backward`) and AdamW (`update`) as graphs."""

    def __init__(self, model, optimizer, grad_clip: float, device: torch.device, amp: torch.dtype | None):
        self.model, self.optimizer, self.grad_clip, self.device, self.amp = model, optimizer, grad_clip, device, amp
        self.params = list(model.parameters())
        self.eager_steps = 0
        self.graph_a = self.graph_b = None
        self.inputs: list[tuple] = []  # per micro-batch: (ids, labels, positions or None, documents or None)
        self.scalars = None  # [1 / targets, loss factor, lr, share of micro-batch 0, 1, ...]
        if device.type == "cuda":  # before the eager steps, whose blocks the pool's capture would find cut up
            expandable_segments()

    def ready(self) -> bool:
        """Whether this step replays (after the first WARMUP steps, which the caller runs eagerly)."""
        if self.graph_a is None and self.eager_steps < WARMUP:
            self.eager_steps += 1
            return False
        return True

    def forward_backward(self, micro_batches: list, shares: list[float], inv_tokens: float, loss_factor: float):
        """Replay A on this step's data (capturing it first); -> (loss sum, list of each micro-batch's
        loss, gradient norm), copies that outlive the next replay. `inv_tokens`: 1 / the step's
        targets, `shares`: each micro-batch's share of the balancing losses (`train_step`'s)."""
        self._load(micro_batches, self.scalar_values(shares, inv_tokens, loss_factor))
        if self.graph_a is None:
            self._capture()
        self.graph_a.replay()
        return self.loss_sum.clone(), list(self.losses.clone().unbind()), self.norm.clone()

    def update(self) -> None:
        self.graph_b.replay()

    def scalar_values(self, shares: list[float], inv_tokens: float, loss_factor: float) -> torch.Tensor:
        """`self.scalars` of a step, on the host."""
        lr = {g["lr"] for g in self.optimizer.param_groups}
        if len(lr) != 1:
            raise ValueError(f"train.cuda_graphs: the optimizer's groups step at {sorted(lr)}; the graph "
                             "reads one learning rate")
        return torch.tensor([inv_tokens, loss_factor, lr.pop(), *shares], dtype=torch.float32)

    def _load(self, micro_batches: list, scalars: torch.Tensor) -> None:
        batches = [micro_batch_fields(mb) for mb in micro_batches]
        if not self.inputs:
            self.inputs = [tuple(None if t is None else torch.empty(t.shape, dtype=t.dtype, device=self.device)
                                 for t in mb) for mb in batches]
            self.scalars = torch.empty(len(scalars), dtype=torch.float32, device=self.device)
        if len(scalars) != len(self.scalars) or _layout(batches) != _layout(self.inputs):
            raise ValueError("train.cuda_graphs: this step's micro-batches differ in number, shape or dtype from "
                             "the captured ones; every step of a run must have the same; set train.cuda_graphs=off")
        for static, mb in zip(self.inputs, batches):
            for buffer, t in zip(static, mb):
                if buffer is not None:
                    buffer.copy_(t, non_blocking=True)
        self.scalars.copy_(scalars, non_blocking=True)

    def _forward_backward(self) -> None:
        """The body of graph A, the same arithmetic as `loop.train_step`'s eager loop."""
        inv_tokens, factor = self.scalars[0], self.scalars[1]
        self.loss_sum = torch.zeros((), device=self.device)
        losses = []
        for i, (ids, labels, pos, docs) in enumerate(self.inputs):
            with torch.autocast(self.device.type, dtype=self.amp or torch.bfloat16, enabled=self.amp is not None):
                loss = self.model(ids, labels=labels, position_ids=pos, aux_weight=self.scalars[3 + i], doc_ids=docs)
            loss = loss * factor
            (loss * inv_tokens).backward()
            self.loss_sum += loss.detach()
            losses.append(loss.detach())
        self.losses = torch.stack(losses)
        self.norm, self.scale = clip_grad_norm(self.params, self.grad_clip)

    def _capture(self) -> None:
        # The eager steps' cached blocks belong to the default stream; the pass below allocates on its
        # own stream, which cannot reuse them: give them back first, or both sets are held at once.
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # one pass whose effects are undone: gradients, MoE statistics
            self._forward_backward()
            self.optimizer.zero_grad(set_to_none=True)
            for block in self.model.moe_blocks():
                block.end_step(applied=False)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        # AdamW's states exist before capture even when the guard skipped every eager step: made inside
        # graph B they would be zeroed again by every replay (each update bias-corrected as the first)
        self.optimizer.init_state()
        # torch.cuda.graph synchronises and empties the cache on entry: the eager steps' cached blocks go back
        graph_a, graph_b = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph_a, stream=stream, capture_error_mode="thread_local"):
                self._forward_backward()
            with torch.cuda.graph(graph_b, pool=graph_a.pool(), stream=stream, capture_error_mode="thread_local"):
                self.optimizer.step(grad_scale=self.scale, lr=self.scalars[2])
        except torch.OutOfMemoryError:
            raise  # reported as any other (`guard.out_of_memory_report`)
        except Exception as e:
            raise ConfigError(f"train.cuda_graphs = on: the training step could not be captured as a CUDA graph "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:300]}); set train.cuda_graphs=off") from e
        self.graph_a, self.graph_b = graph_a, graph_b
