"""The training loop: build, resume, step, validate, log, checkpoint.

One optimizer step takes a global batch of `data.global_batch_size` sequences in micro-batches of
`data.micro_batch_size`. The loss of every micro-batch is its summed token cross-entropy divided
by the number of target tokens of the whole global batch, so accumulation gives exactly the mean
over the global batch; the balancing losses of a micro-batch are weighted by its share of tokens.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time

import torch

from pithtrain.config import ConfigError, RunConfig
from pithtrain.layers.moe import BalanceOptions
from pithtrain.layers.transformer import CausalLM, init_weights
from pithtrain.models import build_model
from pithtrain.train import checkpoint
from pithtrain.train.data import GlobalBatchSampler, PackedDataset, batch_tensors, validation_batches
from pithtrain.train.log import RunLog, peak_memory_gb, plot_losses
from pithtrain.train.optim import build_optimizer, lr_at, set_lr


def resolve_device(cfg: RunConfig) -> tuple[torch.device, torch.dtype | None]:
    """The device and the autocast dtype (None: plain fp32)."""
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but no CUDA device is visible; use train.device=cpu")
    device = torch.device("cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu")
    dtype = cfg.train.dtype
    if dtype == "auto":
        dtype = "bf16" if device.type == "cuda" else "fp32"
    return device, (torch.bfloat16 if dtype == "bf16" else None)


def autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def balance_options(cfg: RunConfig) -> BalanceOptions:
    m = cfg.moe
    return BalanceOptions(m.aux_loss, m.aux_loss_coef, m.z_loss_coef, m.aux_free, m.aux_free_rate)


def build_for_training(cfg: RunConfig, device: torch.device) -> CausalLM:
    with torch.device(device):
        model = build_model(cfg.model.hf, balance_options(cfg))
    init_weights(model, cfg.train.seed)
    return model


def open_data(cfg: RunConfig) -> tuple[PackedDataset, PackedDataset]:
    d = cfg.data
    if not d.corpus:
        raise ConfigError("data.corpus is empty: name a directory written by `pithtrain build-corpus`")
    train_ds = PackedDataset(d.corpus, "train", d.seq_len)
    val_ds = PackedDataset(d.corpus, "val", d.seq_len)
    vocab = cfg.model.hf["vocab_size"]
    if train_ds.vocab_size > vocab:
        raise ConfigError(
            f"the corpus tokenizer has {train_ds.vocab_size} tokens but model.vocab_size = {vocab}; "
            f"set model.vocab_size={train_ds.vocab_size} (or larger) or rebuild the corpus"
        )
    return train_ds, val_ds


@torch.no_grad()
def evaluate(model: CausalLM, ds: PackedDataset, batches: list[list[int]], device, amp) -> float:
    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float64)
    count = 0
    for idx in batches:
        ids, labels = (t.to(device) for t in batch_tensors(ds, idx))
        with autocast(device, amp):
            total += model(ids, labels=labels).double()
        count += int((labels != -100).sum())
    model.train()
    return (total / count).item()


def train_step(model: CausalLM, optimizer, micro_batches: list, grad_clip: float, device, amp) -> dict:
    """Forward/backward over the micro-batches, clip, step. Returns device tensors (no sync)."""
    counts = [int((labels != -100).sum()) for _, labels in micro_batches]  # on the host, before upload
    n_tokens = sum(counts)
    loss_sum = torch.zeros((), device=device)
    for (ids, labels), count in zip(micro_batches, counts):
        ids, labels = ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        share = count / n_tokens
        with autocast(device, amp):
            loss = model(ids, labels=labels, aux_weight=share)
        (loss / n_tokens).backward()
        loss_sum += loss.detach()
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    out = {"loss": loss_sum / n_tokens, "grad_norm": grad_norm, "tokens": n_tokens}
    stats = [block.end_step() for block in model.moe_blocks()]
    if stats:
        out["aux_loss"] = torch.stack([s["aux"] for s in stats]).sum()
        loads = torch.stack([s["load"] for s in stats])
        out["expert_load_imbalance"] = (loads.max(1).values / loads.mean(1).clamp(min=1e-9)).mean()
    return out


def refuse_to_overwrite(run_dir: str, ckpt_dir: str) -> None:
    """A fresh run (resume = none) must not write over the metrics or checkpoints of another."""
    found = checkpoint.complete_checkpoints(ckpt_dir)
    if found or os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        what = f"checkpoints up to step {found[-1][0]}" if found else "metrics.jsonl"
        raise ConfigError(
            f"log.run_dir {run_dir} already holds a run ({what}); continue it with checkpoint.resume=auto "
            f"or start a new one in another log.run_dir"
        )


def save_run_config(cfg: RunConfig) -> None:
    os.makedirs(cfg.log.run_dir, exist_ok=True)
    with open(os.path.join(cfg.log.run_dir, "run_config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=2)


def train(cfg: RunConfig) -> dict:
    """Run the configured training; return a summary (run dir, losses, throughput, plot path)."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device, amp = resolve_device(cfg)
    train_ds, val_ds = open_data(cfg)
    d = cfg.data
    val_idx = validation_batches(val_ds, d.micro_batch_size, d.val_batches)
    sampler = GlobalBatchSampler(len(train_ds), d.global_batch_size, cfg.train.seed)
    model = build_for_training(cfg, device)
    optimizer = build_optimizer(model, cfg.optim)

    ckpt_dir, start = cfg.checkpoint_dir, 0
    resume = cfg.checkpoint.resume
    if resume == "none":
        refuse_to_overwrite(cfg.log.run_dir, ckpt_dir)
    save_run_config(cfg)
    checkpoint.clean_partial(ckpt_dir)
    path = checkpoint.latest(ckpt_dir) if resume == "auto" else (None if resume == "none" else resume)
    if path is not None:
        state = checkpoint.load(path, model, optimizer)
        start = state["step"]
        sampler.load_state_dict(state["data"])
    elif cfg.checkpoint.init_from:
        checkpoint.load_weights(cfg.checkpoint.init_from, model)
    log = RunLog(cfg.log.run_dir, cfg.train.steps, start, progress=cfg.log.progress,
                 tensorboard=cfg.log.tensorboard, wandb=cfg.log.wandb, wandb_project=cfg.log.wandb_project,
                 config=cfg.to_dict())
    if path is not None:
        log.say(f"resumed from {path} at step {start}")
    elif cfg.checkpoint.init_from:
        log.say(f"initialised from the weights of {cfg.checkpoint.init_from}")
    n_micro = d.global_batch_size // d.micro_batch_size
    last, tokens_since, t_since = {}, 0, time.perf_counter()
    run_tokens, run_time = 0, 0.0
    record, first_loss = {}, None
    end = cfg.train.stop_at or cfg.train.steps
    for step in range(start, end):
        lr = lr_at(step, cfg.train.steps, cfg.optim)
        set_lr(optimizer, lr)
        idx = sampler.next_batch()
        micro = [batch_tensors(train_ds, idx[i * d.micro_batch_size:(i + 1) * d.micro_batch_size])
                 for i in range(n_micro)]
        last = train_step(model, optimizer, micro, cfg.optim.grad_clip, device, amp)
        tokens_since += last["tokens"]
        done = step + 1
        is_last = done == end
        validate = is_last or (d.val_every and done % d.val_every == 0)
        if done % cfg.log.every == 0 or validate or is_last:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - t_since
            steps_since = done - (record.get("step", start))
            record = {"step": done, "loss": last["loss"].item(), "lr": lr, "grad_norm": last["grad_norm"].item(),
                      "tokens_per_s": tokens_since / elapsed, "step_time_s": elapsed / steps_since,
                      "peak_mem_gb": peak_memory_gb(device), "epoch": sampler.epoch}
            for key in ("aux_loss", "expert_load_imbalance"):
                if key in last:
                    record[key] = last[key].item()
            if validate:
                record["val_loss"] = evaluate(model, val_ds, val_idx, device, amp)
            log.record(record)
            first_loss = record["loss"] if first_loss is None else first_loss
            run_tokens, run_time = run_tokens + tokens_since, run_time + elapsed
            tokens_since, t_since = 0, time.perf_counter()  # validation time is not step time
        log.advance()
        every = cfg.checkpoint.every
        if (every and done % every == 0) or (is_last and cfg.checkpoint.save_final):
            t_save = time.perf_counter()
            checkpoint.save(ckpt_dir, done, model, optimizer, {"data": sampler.state_dict(), "lr": lr},
                            cfg.checkpoint.keep, hf_config=cfg.model.hf)
            t_since += time.perf_counter() - t_save  # nor is saving
    log.close()
    summary = {"run_dir": cfg.log.run_dir, "steps": cfg.train.steps, "start_step": start}
    if record:
        summary.update(first_loss=first_loss, train_loss=record["loss"], val_loss=record.get("val_loss"),
                       tokens_per_s=run_tokens / run_time)
    metrics = os.path.join(cfg.log.run_dir, "metrics.jsonl")
    if cfg.log.plot and os.path.exists(metrics):
        summary["plot"] = plot_losses(metrics, os.path.join(cfg.log.run_dir, "loss.png"), train_ds.vocab_size)
    return summary
