"""Step guards: non-finite values, loss spikes, preemption signals, and test fault injection.

- Non-finite loss or gradient (`train.nonfinite`): checked after backward, before the optimizer
  step, on every rank alike (the flags are all-reduced). `halt` stops the run with the step, the
  ranks whose loss went non-finite and the first module whose forward output did (found by
  running again, with forward hooks, the first micro-batch whose loss went non-finite); `skip`
  drops the step (no update, the gradients are discarded), counts it, and stops when more than
  `train.max_skips` steps in a row are skipped.
- Loss spikes (`train.spike_factor` > 0): a step whose loss exceeds factor x the mean of the last
  `train.spike_window` applied steps is skipped the same way (once the window is full).
- SIGTERM (a preempting scheduler): the handler only sets a flag; every rank learns of it in the
  step's guard all-reduce, and after that step a checkpoint is written and the run ends with exit code 0, so
  `checkpoint.resume=auto` continues it.
- A collective that waits longer than `parallel.timeout_s` (a rank hung or died), or loses its
  connection to a rank that went away, fails with a message that says so and names the ranks that
  never reached it; torchrun then ends the other ranks. Until that message is made, SIGTERM only
  sets the preemption flag, so torchrun's stop does not cut a rank's report short.
- `PITHTRAIN_FAULT=<name>:<step>[:<rank>]` injects a fault for tests: `nan-loss` (the loss of
  that step becomes NaN), `spike-loss` (multiplied by 100), `raise` (an exception at the start of
  the step), `kill` (SIGKILL), `sleep` (the rank stops participating for an hour), and the
  checkpoint kill points of `train/checkpoint.py`.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from pithtrain.tools.memory import GRAPHS_OFF


class TrainingHalted(RuntimeError):
    """The run stopped on purpose (non-finite values, too many skipped steps); the message says why."""


def injected(name: str, step: int) -> bool:
    """Whether PITHTRAIN_FAULT asks for fault `name` at `step` (1-based) on this rank."""
    spec = os.environ.get("PITHTRAIN_FAULT", "").split(":")
    if len(spec) < 2 or spec[0] != name or spec[1] != str(step):
        return False
    rank = dist.get_rank() if dist.is_initialized() else 0
    return len(spec) < 3 or spec[2] == str(rank)


def inject_failure(step: int) -> None:
    """The `raise`, `kill` and `sleep` faults of PITHTRAIN_FAULT, at the start of a step."""
    if injected("raise", step):
        raise RuntimeError(f"injected fault: rank raised at step {step}")
    if injected("kill", step):
        os.kill(os.getpid(), signal.SIGKILL)
    if injected("sleep", step):
        import time

        time.sleep(3600)


def _reduce(t: torch.Tensor, group) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t, group=group)
    return t


class StepGuard:
    """Decides, before each optimizer step, whether the step is applied."""

    def __init__(self, policy: str, max_skips: int, spike_factor: float, spike_window: int):
        self.policy, self.max_skips = policy, max_skips
        self.spike_factor, self.spike_window = spike_factor, spike_window
        self.recent: list[float] = []  # losses of the last applied steps
        self.skipped_in_a_row = self.skipped_total = 0

    def check(self, loss_sum: torch.Tensor, n_tokens: int, grad_norm: torch.Tensor, group,
              stop: bool = False) -> tuple[str | None, list, bool]:
        """(reason to skip or None, ranks whose loss was non-finite, whether any rank asked to stop:
        SIGTERM). One all-reduce and one host synchronisation for all three."""
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        flags = torch.zeros(world + 3, dtype=torch.float64, device=loss_sum.device)
        flags[rank] = (~torch.isfinite(loss_sum)).double()
        flags[world] = torch.nan_to_num(loss_sum.double(), nan=0.0, posinf=0.0, neginf=0.0)
        flags[world + 1] = (~torch.isfinite(grad_norm)).double()
        flags[world + 2] = float(stop)
        values = _reduce(flags, group).tolist()
        bad_ranks = [r for r in range(world) if values[r] > 0]
        loss, stop_all = values[world] / n_tokens, values[world + 2] > 0
        if bad_ranks or values[world + 1] > 0:
            return ("non-finite loss" if bad_ranks else "non-finite gradient"), bad_ranks, stop_all
        if self.spike_factor and len(self.recent) == self.spike_window:
            baseline = sum(self.recent) / len(self.recent)
            if loss > self.spike_factor * baseline:
                return f"loss spike: {loss:.4g} > {self.spike_factor:g} x recent mean {baseline:.4g}", [], stop_all
        self.recent = (self.recent + [loss])[-self.spike_window:]
        return None, [], stop_all

    def state_dict(self) -> dict:
        """What a resumed run needs to decide as this one would (saved in checkpoints)."""
        return {"recent": list(self.recent), "in_a_row": self.skipped_in_a_row, "total": self.skipped_total}

    def load_state_dict(self, sd: dict) -> None:
        self.recent = [float(x) for x in sd["recent"]][-self.spike_window:] if self.spike_window else []
        self.skipped_in_a_row, self.skipped_total = int(sd["in_a_row"]), int(sd["total"])

    def count(self, reason: str | None, step: int) -> None:
        """Book a step's outcome; raise TrainingHalted after too many skips in a row."""
        if reason is None:
            self.skipped_in_a_row = 0
            return
        self.skipped_in_a_row += 1
        self.skipped_total += 1
        if self.skipped_in_a_row > self.max_skips:
            raise TrainingHalted(f"step {step}: {self.skipped_in_a_row} steps in a row were skipped (last: {reason}); "
                                 f"train.max_skips = {self.max_skips}. Lower optim.lr, check the data of these steps, "
                                 "or resume from an earlier checkpoint")


@torch.no_grad()
def first_nonfinite_module(model: torch.nn.Module, forward) -> str | None:
    """Run `forward()` with hooks on every module; the name of the first (in execution order)
    whose output holds a NaN or Inf, or None if the forward stays finite. Every rank must call it
    (the forward may hold collectives)."""
    found: list[str] = []

    def hook(name):
        def check(module, args, output):
            outs = output if isinstance(output, (tuple, list)) else (output,)
            if not found and any(isinstance(o, torch.Tensor) and o.is_floating_point() and
                                 not torch.isfinite(o).all() for o in outs):
                found.append(name)
        return check

    handles = [m.register_forward_hook(hook(n or "model")) for n, m in model.named_modules()]
    try:  # eagerly: the hooks' test depends on the data, which a fullgraph-compiled region cannot trace
        with torch.compiler.set_stance("force_eager"):
            forward()
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def out_of_memory_report(model: torch.nn.Module, optimizer, device: torch.device, error: Exception,
                         estimate=None) -> str:
    """What holds this rank's memory when an allocation failed, the estimator's breakdown
    (`tools/memory.py`), and what to change (turning train.cuda_graphs off first when the estimate
    is of a step under them)."""
    gb = 2**30
    params = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    states = sum(_local_bytes(t) for st in optimizer.state.values() for t in st.values()
                 if isinstance(t, torch.Tensor) and t.dim() > 0)
    lines = [f"out of memory on {device}: {str(error).splitlines()[0][:200]}",
             f"  parameters {params / gb:.2f} GB, gradients {grads / gb:.2f} GB, AdamW states {states / gb:.2f} GB"]
    if device.type == "cuda":
        peak, total = torch.cuda.max_memory_allocated(device), torch.cuda.get_device_properties(device).total_memory
        rest = max(peak - params - grads - states, 0)
        lines.append(f"  activations and workspace (the rest of the peak) {rest / gb:.2f} GB; peak allocated "
                     f"{peak / gb:.2f} GB of the device's {total / gb:.2f} GB")
    first = ""
    if estimate is not None:
        lines += ["  " + line for line in estimate.lines()]
        first = GRAPHS_OFF if estimate.outside_graphs else ""  # a step under train.cuda_graphs
    lines.append("  to fit: " + first + "train.recompute=both (activations), train.param_dtype=bf16 (halves weights, "
                 "gradients and states), a smaller data.micro_batch_size (the global batch stays, by accumulation; the "
                 "micro_batch and global_batch balancing losses then see fewer tokens at once), "
                 "or more ranks (FSDP shards weights, gradients and states)")
    return "\n".join(lines)


# How a failed collective's error reads, by backend: its own timeout, or a peer that went away
# (gloo: "Connection closed by peer", "Connection reset by peer"; NCCL: "remote process exited").
_PEER_GONE = ("closed by peer", "reset by peer", "broken pipe", "remote process exited")


def collective_failure(e: BaseException) -> str | None:
    """"timeout" or "peer" when `e` is a collective that failed waiting for another rank, else None."""
    if not isinstance(e, RuntimeError) or isinstance(e, TrainingHalted):
        return None
    text = str(e).lower()
    if "timed out" in text or "timing out" in text:
        return "timeout"
    return "peer" if any(s in text for s in _PEER_GONE) else None


def silent_ranks(rank: int, world: int, wait_s: float = 5.0) -> list[int] | None:
    """After a collective failed on this rank: the ranks that did not also report a failed
    collective within `wait_s`, i.e. the ones that never reached it (hung or dead). A rank whose
    peer timed out first may see the connection close rather than its own timeout, so both count.
    Each such rank says so in the job's key-value store (torchrun's rendezvous store, reachable by
    every node); None when there is no store to ask."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"pithtrain/collective-failed/{rank}", "1")
        keys = [f"pithtrain/collective-failed/{r}" for r in range(world)]
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.2)
    except Exception:  # no default store, or the store itself went away
        return None


class Preemption:
    """SIGTERM sets `flag`; `StepGuard.check` tells every rank at the step's decision."""

    def __init__(self):
        self.flag = False
        self.previous = None

    def install(self) -> "Preemption":
        def handler(signum, frame):
            self.flag = True

        self.previous = signal.signal(signal.SIGTERM, handler)
        return self

    def uninstall(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
