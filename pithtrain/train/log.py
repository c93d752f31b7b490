"""Run logging: console lines, a progress bar, metrics.jsonl, TensorBoard / wandb, the loss plot."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import uuid

import torch


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated CUDA memory, or on CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def format_record(r: dict, total: int) -> str:
    parts = [f"step {r['step']}/{total}", f"loss {r['loss']:.4f}"]
    if "val_loss" in r:
        parts.append(f"val {r['val_loss']:.4f}")
    parts += [f"lr {r['lr']:.2e}", f"grad {r['grad_norm']:.3f}"]
    if r.get("aux_loss"):
        parts.append(f"aux {r['aux_loss']:.4f}")
    if "expert_load_imbalance" in r:
        parts.append(f"imb {r['expert_load_imbalance']:.2f}")
    parts += [f"{r['tokens_per_s']:,.0f} tok/s", f"{r['step_time_s']:.2f} s/step", f"mem {r['peak_mem_gb']:.1f} GB"]
    return " | ".join(parts)


class RunLog:
    """Writes what the training loop reports. Only rank 0 makes one."""

    def __init__(self, run_dir: str, total_steps: int, start_step: int, *, progress: bool,
                 tensorboard: bool, wandb: bool, wandb_project: str, config: dict):
        os.makedirs(run_dir, exist_ok=True)
        self.total = total_steps
        self.path = os.path.join(run_dir, "metrics.jsonl")
        torn = self._truncate_after(start_step)
        self.file = open(self.path, "a")
        self.bar = None
        if torn:
            self.say(f"{self.path}: dropped {torn} line(s) that were not whole records (a write cut short)")
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                            file=sys.stderr, mininterval=1.0 if sys.stderr.isatty() else 30.0)
        self.tb = self.wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # on resume, events of the steps after the checkpoint (an earlier try's) are dropped
                self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=start_step + 1)
            except ImportError:
                self.say("log.tensorboard = true but tensorboard is not installed; pip install tensorboard")
        if wandb:
            try:
                import wandb as wandb_lib
            except ImportError:
                self.say("log.wandb = true but wandb is not installed; pip install wandb")
            else:
                # Each invocation is its own wandb run, in one group per training run (kept in the run
                # dir): a resume from step N logs steps N+1.. afresh, where continuing the earlier wandb
                # run would drop them (wandb ignores steps below the last one it holds).
                group = self._wandb_group(run_dir, start_step)
                try:
                    self.wandb = wandb_lib.init(project=wandb_project, dir=run_dir, config=config, group=group,
                                                name=f"{group}-from-step-{start_step}")
                except Exception as e:  # no login, no network, ...: training goes on, metrics.jsonl has it all
                    self.say(f"log.wandb = true but wandb did not start ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}); training goes on without it "
                             "(every record is in metrics.jsonl); run `wandb login` or set log.wandb=false")

    @staticmethod
    def _wandb_group(run_dir: str, start_step: int) -> str:
        """The run's wandb group: read back on resume, new for a run from step 0."""
        path = os.path.join(run_dir, "wandb_group")
        if start_step and os.path.isfile(path):
            with open(path) as f:
                group = f.read().strip()
            if group:
                return group
        group = f"{os.path.basename(os.path.abspath(run_dir))}-{uuid.uuid4().hex[:8]}"
        with open(path, "w") as f:
            f.write(group + "\n")
        return group

    def _truncate_after(self, step: int) -> int:
        """On resume, drop records of steps after the checkpoint, so the log continues cleanly, and
        lines that are not whole records (a write cut short by a crash or a full disk); returns how
        many of those. The file is replaced atomically."""
        if not os.path.exists(self.path):
            return 0
        keep, torn = [], 0
        with open(self.path, errors="replace") as f:
            for line in f:
                try:
                    record_step = json.loads(line)["step"]
                except (ValueError, KeyError, TypeError):
                    torn += bool(line.strip())
                    continue
                if record_step <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")  # the next record starts a line
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        return torn

    def say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def record(self, r: dict, console: bool = True) -> None:
        # NaN and Inf (a non-finite step) as null: strict JSON readers (jq) refuse NaN
        self.file.write(json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v
                                    for k, v in r.items()}) + "\n")
        self.file.flush()
        if console:
            self.say(format_record(r, self.total))
        scalars = {k: v for k, v in r.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, r["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=r["step"])

    def sync(self) -> None:
        """Flush the records to disk; called before each checkpoint, so a checkpoint that survives a
        crash or power loss never has a gap before it in metrics.jsonl."""
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


class QuietLog:
    """What ranks other than 0 log: nothing."""

    def say(self, text: str) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass

    def record(self, r: dict, console: bool = True) -> None:
        pass

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_losses(metrics_path: str, out_png: str, vocab_size: int | None = None) -> str:
    """Train and validation loss against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", markersize=3)
    if vocab_size:
        ax.axhline(math.log(vocab_size), color="gray", linestyle=":", label="ln(vocab)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return out_png
