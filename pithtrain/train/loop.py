"""The training loop: build, resume, step, validate, log, checkpoint.

One optimizer step takes a global batch of `data.global_batch_size` sequences. Micro-batch i of
the step is sequences [i*m*D, (i+1)*m*D) of it (m = `data.micro_batch_size`, D = dp * ep data
ranks); data rank d takes the d-th m of them, and context-parallel ranks their blocks of each
sequence. The loss of every micro-batch is its summed token cross-entropy divided by the number
of target tokens of the whole global batch (summed over all ranks), and gradients are summed over
ranks, so the step sees exactly the mean over the global batch: the same gradient as one process
with micro-batches of m*D sequences. The balancing losses of a micro-batch are weighted by its
share of the step's tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid

import torch
import torch.distributed as dist

from pithtrain.config import ConfigError, RunConfig, unwritable
from pithtrain.layers.moe import BalanceOptions
from pithtrain.layers.transformer import CausalLM, cast_parameters, init_weights
from pithtrain.models import build_model
from pithtrain.parallel.context import block_positions, shard_sequence
from pithtrain.parallel.fsdp import build_parallel
from pithtrain.parallel.mesh import Layout, Mesh, init_distributed, plan_layout, world_size
from pithtrain.tools.memory import check_fits, estimate_for_run
from pithtrain.train import checkpoint
from pithtrain.train.graphs import StepGraphs
from pithtrain.train.guard import (Preemption, StepGuard, TrainingHalted, collective_failure, first_nonfinite_module,
                                   silent_ranks, inject_failure, injected, out_of_memory_report)
from pithtrain.train.corpus import tokenizer_fingerprint, vocabulary_fingerprint
from pithtrain.train.data import (GlobalBatchSampler, PackedDataset, batch_tensors, document_ids, micro_batch_fields,
                                  validation_batches)
from pithtrain.train.hf import read_hf_config
from pithtrain.train.log import QuietLog, RunLog, peak_memory_gb, plot_losses
from pithtrain.train.optim import build_optimizer, clip_grad_norm, lr_at, optimizer_step, set_hyperparameters, set_lr


def autocast_dtype(cfg: RunConfig, device_type: str) -> torch.dtype | None:
    """train.dtype on this kind of device: bf16 autocast, or None for plain fp32 (`auto`: bf16 on CUDA)."""
    dtype = cfg.train.dtype
    return torch.bfloat16 if dtype == "bf16" or (dtype == "auto" and device_type == "cuda") else None


def resolve_device(cfg: RunConfig) -> tuple[torch.device, torch.dtype | None]:
    """The device and the autocast dtype (None: plain fp32)."""
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but no CUDA device is visible; use train.device=cpu")
    device = torch.device("cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu")
    return device, autocast_dtype(cfg, device.type)


def set_deterministic() -> None:
    """train.deterministic: every kernel deterministic (cuBLAS with a fixed workspace, cuDNN without
    autotuning, torch's deterministic algorithms, which raise on an op that has none), so two runs
    of the same config give the same bits. Our Triton kernels use no atomics: they are deterministic
    as written."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False


def autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def balance_options(cfg: RunConfig) -> BalanceOptions:
    m = cfg.moe
    return BalanceOptions(m.aux_loss, m.aux_loss_coef, m.z_loss_coef, m.aux_free, m.aux_free_rate)


def build_for_training(cfg: RunConfig, device: torch.device, mesh: Mesh | None = None,
                       amp: torch.dtype | None = None) -> CausalLM:
    """The model, initialised, with train.param_dtype, train.recompute and train.compile applied."""
    t = cfg.train

    def build():
        model = build_model(cfg.model.hf, balance_options(cfg))
        if t.param_dtype == "bf16":
            cast_parameters(model, torch.bfloat16)
        return model

    if mesh is not None:  # sharded: bf16 parameters under FSDP on the GPU, fp32 on the CPU
        model = build_parallel(build, mesh, t.seed, amp if device.type == "cuda" else None)
    else:
        with torch.device(device):
            model = build()
        init_weights(model, t.seed)
    model.set_recompute(t.recompute in ("attention", "both"), t.recompute in ("experts", "both"))
    if t.compile == "on" or (t.compile == "auto" and device.type == "cuda"):
        model.compile_dense()
    return model


def rank_batches(ds: PackedDataset, idx: list[int], micro: int, mesh: Mesh | None,
                 documents: bool = False) -> list[tuple]:
    """This rank's micro-batches (input_ids, labels, position_ids or None, doc_ids or None) of the
    global batch `idx`; doc_ids with `documents` (data.document_mask)."""
    D, d = (mesh.layout.data_ranks, mesh.data_rank) if mesh is not None else (1, 0)
    out = []
    for start in range(0, len(idx), micro * D):
        mine = idx[start + d * micro:start + (d + 1) * micro]
        ids, labels = batch_tensors(ds, mine)
        docs = document_ids(ds, mine) if documents else None
        pos = None
        if mesh is not None and mesh.layout.cp > 1:
            cp, r = mesh.layout.cp, mesh.coord("cp")
            pos = block_positions(ids.shape[1], cp, r).expand(ids.shape[0], -1)
            ids, labels = shard_sequence(ids, cp, r), shard_sequence(labels, cp, r)
        out.append((ids, labels, pos, docs))
    return out


def _sum(t: torch.Tensor, mesh: Mesh | None) -> torch.Tensor:
    if mesh is not None:
        dist.all_reduce(t, group=mesh.data_group)
    return t


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
def evaluate(model: CausalLM, micro_batches: list[list[tuple]], device, amp, mesh: Mesh | None = None) -> float:
    model.eval()
    total = torch.zeros(2, device=device, dtype=torch.float64)  # summed loss, tokens
    for batch in micro_batches:
        for ids, labels, pos, docs in batch:
            ids, labels = ids.to(device), labels.to(device)
            pos, docs = (None if t is None else t.to(device) for t in (pos, docs))
            with autocast(device, amp):
                total[0] += model(ids, labels=labels, position_ids=pos, doc_ids=docs).double()
            total[1] += (labels != -100).sum()
    model.train()
    total = _sum(total, mesh)
    return (total[0] / total[1]).item()


def _device_batch(mb: tuple, device) -> tuple:
    return tuple(t.to(device, non_blocking=True) if t is not None else None for t in micro_batch_fields(mb))


def train_step(model: CausalLM, optimizer, micro_batches: list, grad_clip: float, device, amp,
               mesh: Mesh | None = None, guard: StepGuard | None = None, step: int = 0,
               preemption: Preemption | None = None, graphs: StepGraphs | None = None) -> dict:
    """Forward/backward over this rank's micro-batches (input_ids, labels[, position_ids[, doc_ids]]),
    clip, and the optimizer step unless `guard` skips it (`out["skipped"]`: the reason) or halts
    the run (non-finite values under train.nonfinite = halt). `step` is 1-based; `out["stop"]`: some
    rank was asked to stop (SIGTERM: `preemption.flag`, read at the guard's all-reduce, so a signal
    that arrives during this step's forward or backward stops the run after this step).
    `graphs` (train.cuda_graphs, one process): after its warm-up steps, the forward, backward and
    norm, then the optimizer step, are replayed as CUDA graphs (`train/graphs.py`), the rest as here.
    Returns device tensors; host synchronisations: the global token count (distributed) and the
    guard's decision."""
    counts = [int((mb[1] != -100).sum()) for mb in micro_batches]  # on the host, before upload
    ranks = 1
    if mesh is not None:  # each micro-batch's targets on every rank of the stage (the same micro-batches)
        counts = [int(c) for c in _sum(torch.tensor(counts, device=device, dtype=torch.float64), mesh).tolist()]
        ranks = dist.get_world_size(mesh.data_group)
    n_tokens = sum(counts)
    if n_tokens == 0:
        raise ValueError(f"step {step}: every label of the step is -100 (ignored): there is nothing to train on")
    inject_failure(step)
    factor = float("nan") if injected("nan-loss", step) else 100.0 if injected("spike-loss", step) else None
    inv_tokens = (torch.ones((), dtype=torch.float32) / n_tokens).item()  # fp32's 1/n, the graphed step's too
    # Balancing losses: micro-batch i weighs its share of the step's tokens (ignored labels included:
    # every token is routed, and P and the z-loss are means over all of them), so that `sequence` and
    # the z-loss give one batch's gradients whatever the split; each rank holds as many tokens, so
    # 1/ranks of the share.
    sizes = [mb[1].numel() for mb in micro_batches]
    shares = [size / sum(sizes) / ranks for size in sizes]
    if graphs is not None and graphs.ready():
        loss_sum, losses, grad_norm = graphs.forward_backward(micro_batches, shares, inv_tokens, factor or 1.0)
    else:
        loss_sum = torch.zeros((), device=device)
        losses = []  # each micro-batch's loss (detached; looked at only if the step halts)
        for mb, share in zip(micro_batches, shares):
            ids, labels, pos, docs = _device_batch(mb, device)
            with autocast(device, amp):
                loss = model(ids, labels=labels, position_ids=pos, aux_weight=share, doc_ids=docs)
            if factor is not None:
                loss = loss * factor
            (loss * inv_tokens).backward()
            loss_sum += loss.detach()
            losses.append(loss.detach())
        replicas = mesh.layout.dp_replicate if mesh is not None else 1
        # all (a rank without gradients still needs the device of its all-reduce), and taken after backward:
        # FSDP has resharded every module by then, so these hold the gradients (a forward alone, as
        # validation's, leaves the head and the root unsharded, their parameters swapped for others)
        params = list(model.parameters())
        grad_norm, clip = clip_grad_norm(params, grad_clip, mesh.data_group if mesh is not None else None, replicas)
        graphs = None  # this step is eager throughout
    stop_requested = preemption is not None and preemption.flag
    reason, bad_ranks, stop = (guard.check(loss_sum, n_tokens, grad_norm, None, stop_requested) if guard is not None
                               else (None, [], False))
    if reason is not None and reason.startswith("non-finite") and guard.policy == "halt":
        optimizer.zero_grad(set_to_none=True)
        # run again the first micro-batch whose loss went non-finite on this rank (the first one if none
        # did: the gradient went non-finite, or another rank's loss did); every rank runs one forward
        finite = torch.isfinite(torch.stack(losses)).tolist() if losses else []
        first_bad = next((i for i, ok in enumerate(finite) if not ok), 0)
        ids, labels, pos, docs = _device_batch(micro_batches[first_bad], device)

        def forward():
            with autocast(device, amp):
                model(ids, labels=labels, position_ids=pos, doc_ids=docs)

        which = f"micro-batch {first_bad + 1} of {len(micro_batches)}"
        # a diagnosis whose forward runs eagerly (FlexAttention then materialises its scores): its failure
        # must not hide the halt
        try:
            where = first_nonfinite_module(model, forward)
            found = (f"the first module whose output went non-finite in {which}: {where}" if where else
                     f"the forward of {which} stays finite: the values went non-finite in the loss or the backward")
        except Exception as e:
            found = (f"the search for the first non-finite module in {which} failed "
                     f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})")
        raise TrainingHalted(f"step {step}: {reason}" + (f" on rank(s) {bad_ranks}" if bad_ranks else "") +
                             f"; {found}. Set train.nonfinite=skip to skip such steps, lower optim.lr, or resume "
                             "from an earlier checkpoint")
    if reason is None and graphs is not None:
        graphs.update()
    elif reason is None:
        optimizer_step(optimizer, clip, params)
    if graphs is None:  # replays write the gradients afresh, in the graphs' memory
        optimizer.zero_grad(set_to_none=True)
    stats = [block.end_step(applied=reason is None) for block in model.moe_blocks()]
    aux = torch.stack([s["aux"] for s in stats]).sum() if stats else torch.zeros((), device=device)
    sums = _sum(torch.stack([loss_sum, aux.to(loss_sum.dtype)]), mesh)
    out = {"loss": sums[0] / n_tokens, "grad_norm": grad_norm, "tokens": n_tokens, "skipped": reason, "stop": stop}
    if stats:
        out["aux_loss"] = sums[1]
        loads = torch.stack([s["load"] for s in stats])
        out["expert_load_imbalance"] = (loads.max(1).values / loads.mean(1).clamp(min=1e-9)).mean()
    return out


def same_tokenizer(saved: str | None, corpus_tokenizer: str | None, ds: PackedDataset) -> bool:
    """Whether a checkpoint's stored tokenizer fingerprint is the corpus's (checkpoints of earlier
    versions hold the vocabulary-only fingerprint, which counts too)."""
    return saved == corpus_tokenizer or (corpus_tokenizer is not None
                                         and saved == vocabulary_fingerprint(ds.tokenizer_path))


def check_tokenizer_matches(init_from: str, ds: PackedDataset, corpus_tokenizer: str | None,
                            named: str | None = None) -> None:
    """Weights must meet a corpus made with their tokenizer: the one a converted HF checkpoint comes
    with or a training checkpoint holds, or for a training checkpoint saved before checkpoints held
    their corpus's tokenizer.json, the fingerprint in its trainer.json."""
    theirs = os.path.join(init_from, "tokenizer.json")
    trainer = os.path.join(init_from, "trainer.json")
    if corpus_tokenizer is not None and not os.path.isfile(theirs) and os.path.isfile(trainer):  # training checkpoint
        with open(trainer) as f:
            saved = json.load(f).get("tokenizer") or corpus_tokenizer
        if not same_tokenizer(saved, corpus_tokenizer, ds):
            raise ConfigError(f"{named or 'checkpoint.init_from = ' + init_from} was trained on a corpus with "
                              "another tokenizer "
                              f"(fingerprint {saved}) than the one of data.corpus ({ds.tokenizer_path}): its token ids "
                              "would meet other embeddings; use a corpus built with the checkpoint's tokenizer")
    if corpus_tokenizer is None or not os.path.isfile(theirs):
        return
    if tokenizer_fingerprint(theirs) != corpus_tokenizer:
        raise ConfigError(f"{named or 'checkpoint.init_from = ' + init_from} comes with a tokenizer ({theirs}) "
                          "that differs from "
                          f"the one data.corpus was built with ({ds.tokenizer_path}); rebuild the corpus with "
                          f"`pithtrain build-corpus ... --tokenizer {theirs}`")


def refuse_to_overwrite(run_dir: str, ckpt_dir: str, source: str | None = None) -> None:
    """A fresh run (resume = none), or one that continues `source`, a checkpoint of another run
    (resume = PATH outside `ckpt_dir`), must not write over the metrics or checkpoints of another."""
    found = checkpoint.complete_checkpoints(ckpt_dir)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if found:
        inside = os.path.abspath(ckpt_dir).startswith(os.path.abspath(run_dir) + os.sep)
        key, folder = ("log.run_dir", run_dir) if inside else ("checkpoint.dir", ckpt_dir)
        todo = (f"to go on from {source}, name another {key} (or continue this run with checkpoint.resume=auto)"
                if source else
                f"continue it with checkpoint.resume=auto or start a new one in another {key}")
        raise ConfigError(f"{key} {folder} already holds a run (checkpoints up to step {found[-1][0]}); {todo}")
    if os.path.exists(metrics) and os.path.getsize(metrics):  # empty: a run that failed before step 1
        todo = f"to go on from {source}, name" if source else "start a new one in"
        raise ConfigError(f"log.run_dir {run_dir} already holds a run (metrics.jsonl) with no checkpoint to continue "
                          f"from; {todo} another log.run_dir (or move that one aside)")


def of_this_run(path: str, ckpt_dir: str) -> bool:
    """Whether checkpoint `path` belongs to the run whose checkpoints `ckpt_dir` holds: it lies
    there (or is that folder), or it carries the run id of the newest checkpoint there (a copy
    restored from elsewhere)."""
    real, root = os.path.realpath(path), os.path.realpath(ckpt_dir)
    if real == root or real.startswith(root + os.sep):
        return True
    found = checkpoint.complete_checkpoints(ckpt_dir)
    ours = checkpoint.run_id(found[-1][1]) if found else None
    return ours is not None and ours == checkpoint.run_id(path)


# config.json fields that describe the file, not the model's maths (a re-downloaded or re-saved config
# changes them): a resume does not compare them
CONFIG_METADATA = {"transformers_version", "_name_or_path", "architectures", "torch_dtype", "dtype", "use_cache"}


def model_config_diff(path: str, hf: dict) -> list[str]:
    """Each field of checkpoint `path`'s stored config.json that differs from `hf` (top-k, rope_theta,
    eps, ... change the maths without changing a tensor shape), the file's metadata
    (`CONFIG_METADATA`) aside; none for checkpoints of earlier versions, which store no config."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return []
    saved, now = read_hf_config(path), json.loads(json.dumps(hf))
    missing = object()
    keys = sorted((saved.keys() | now.keys()) - CONFIG_METADATA)
    return [f"{k}: {saved.get(k, '(unset)')!r} there, {now.get(k, '(unset)')!r} now"
            for k in keys if saved.get(k, missing) != now.get(k, missing)]


def _listed(diff: list[str]) -> str:
    return "; ".join(diff[:8]) + ("; ..." if len(diff) > 8 else "")


def check_same_model(path: str, hf: dict) -> None:
    """A resume continues the model it was saved with: any differing field is an error."""
    if diff := model_config_diff(path, hf):
        raise ConfigError(f"checkpoint {path} was saved with another model config ({_listed(diff)}): resume with the "
                          "model settings it was saved with (its config.json), or, where its tensors fit the new "
                          "config, start a new run from its weights with checkpoint.init_from")


def save_run_config(cfg: RunConfig) -> None:
    os.makedirs(cfg.log.run_dir, exist_ok=True)
    with open(os.path.join(cfg.log.run_dir, "run_config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=2)


def check_graphs(cfg: RunConfig, device_type: str, world: int, launched: bool) -> None:
    """train.cuda_graphs = on needs one process on one GPU."""
    if cfg.train.cuda_graphs == "on" and (device_type != "cuda" or launched):
        where = "on the CPU" if device_type != "cuda" else f"in {world} process(es) under torchrun"
        raise ConfigError(f"train.cuda_graphs = on replays the step of one process on one GPU, and this run is {where} "
                          "(FSDP, expert and context parallelism run collectives a graph cannot hold); "
                          "set train.cuda_graphs=off")


def start_process(cfg: RunConfig) -> tuple[torch.device, torch.dtype | None, Layout, bool]:
    """What `train` and `evaluate_checkpoint` set up first: threads, determinism, the device, the
    layout, and whether this process runs under torchrun (the sharded path, also for one process)."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if cfg.train.deterministic:
        set_deterministic()
    device, amp = resolve_device(cfg)
    layout = plan_layout(cfg, world_size())
    return device, amp, layout, "TORCHELASTIC_RUN_ID" in os.environ or layout.world > 1


def corpus_fingerprint(ds: PackedDataset) -> str | None:
    """The fingerprint of the corpus's tokenizer.json; None for a corpus without one."""
    return tokenizer_fingerprint(ds.tokenizer_path) if os.path.isfile(ds.tokenizer_path) else None


def check_aux_free(saved: dict, cfg: RunConfig, path: str) -> None:
    """A checkpoint trained under the other `moe.aux_free` (recorded in trainer.json) is refused."""
    if saved.get("aux_free", cfg.moe.aux_free) != cfg.moe.aux_free:  # DeepSeek-V3's routers always hold the bias
        was = "true" if saved["aux_free"] else "false"
        raise ConfigError(f"checkpoint {path} was trained with moe.aux_free = {was}: set moe.aux_free={was} "
                          "as it was (its routers' correction biases are moved only under it)")


def evaluate_checkpoint(cfg: RunConfig, path: str) -> dict:
    """`pithtrain eval`: the validation loss of the weights of checkpoint `path` (a training or a
    converted one) on data.corpus's validation split, as validation in training computes it (the
    first data.val_batches global batches), in the run's layout, with nothing written."""
    d = cfg.data
    if not d.val_batches:
        raise ConfigError("data.val_batches = 0: evaluation reads that many global batches of the validation split; "
                          "set data.val_batches=N")
    device, amp, layout, launched = start_process(cfg)
    train_ds, val_ds = open_data(cfg)
    val_idx = validation_batches(val_ds, d.micro_batch_size * layout.data_ranks, d.global_batch_size, d.val_batches)
    mesh = init_distributed(layout, device.type, cfg.parallel.timeout_s) if launched else None
    try:  # the process groups end with the evaluation, refused or not (a rank left with them can abort at exit)
        device = mesh.device if mesh is not None else device
        checkpoint.verify_everywhere(path)
        check_same_model(path, cfg.model.hf)
        check_tokenizer_matches(path, train_ds, corpus_fingerprint(train_ds), named=f"checkpoint {path}")
        saved, notes = os.path.join(path, "trainer.json"), []
        if os.path.isfile(saved):
            with open(saved) as f:
                state = json.load(f)
            check_aux_free(state, cfg, path)
            if (was := state.get("param_dtype", cfg.train.param_dtype)) != cfg.train.param_dtype:
                notes.append(f"{path} was trained with train.param_dtype = {was} and is evaluated in "
                             f"{cfg.train.param_dtype}: set train.param_dtype={was} for the numbers of its training")
        model = build_for_training(cfg, device, mesh, amp)
        checkpoint.load_weights(path, model, verified=True)
        batches = [rank_batches(val_ds, idx, d.micro_batch_size, mesh, d.document_mask) for idx in val_idx]
        loss = evaluate(model, batches, device, amp, mesh)
    finally:
        if mesh is not None:
            dist.destroy_process_group()
    return {"checkpoint": path, "val_loss": loss, "windows": sum(map(len, val_idx)), "seq_len": d.seq_len,
            "notes": notes}


def train(cfg: RunConfig) -> dict:
    """Run the configured training; return a summary (run dir, losses, throughput, plot path)."""
    device, amp, layout, launched = start_process(cfg)
    for key, folder in (("log.run_dir", cfg.log.run_dir), ("checkpoint.dir", cfg.checkpoint_dir)):
        if why := unwritable(folder):  # before the data is opened and the model built
            raise ConfigError(f"{key} = {folder}: the run cannot write there ({why}); name another folder")
    train_ds, val_ds = open_data(cfg)
    d = cfg.data
    corpus_tokenizer = corpus_fingerprint(train_ds)
    D = layout.data_ranks
    val_idx = []  # data.val_batches = 0: no validation
    if d.val_batches:
        val_idx = validation_batches(val_ds, d.micro_batch_size * D, d.global_batch_size, d.val_batches)
    notes = []
    if d.val_batches and len(val_ds) < d.global_batch_size:
        notes.append(f"the validation split holds {len(val_ds)} windows, fewer than one global batch "
                     f"({d.global_batch_size}): val_loss covers the first {sum(map(len, val_idx))}, a number that "
                     "depends on the micro-batch size and rank count; rebuild the corpus with a larger --val-fraction "
                     "to compare val_loss across layouts")
    elif d.val_batches and len(val_ds) // d.global_batch_size < d.val_batches:
        notes.append(f"data.val_batches = {d.val_batches}, but the validation split holds "
                     f"{len(val_ds) // d.global_batch_size} global batches: val_loss uses those")
    sampler = GlobalBatchSampler(len(train_ds), d.global_batch_size, cfg.train.seed, d.seq_len, train_ds.n_tokens)
    check_graphs(cfg, device.type, layout.world, launched)
    mesh = init_distributed(layout, device.type, cfg.parallel.timeout_s) if launched else None
    device = mesh.device if mesh is not None else device
    rank0 = mesh is None or mesh.rank == 0
    val_batches = [rank_batches(val_ds, idx, d.micro_batch_size, mesh, d.document_mask) for idx in val_idx]
    memory = estimate_for_run(cfg, layout.world, layout.cp, amp is not None, layout.data_ranks, sharded=launched)
    if device.type == "cuda":  # before anything is allocated
        check_fits(memory, torch.cuda.get_device_properties(device).total_memory, layout.world, cfg)
    model = build_for_training(cfg, device, mesh, amp)
    optimizer = build_optimizer(model, cfg.optim)

    ckpt_dir, start = cfg.checkpoint_dir, 0
    run = uuid.uuid4().hex  # this run's id, saved in its checkpoints; a resume of this run keeps the saved one
    resume = cfg.checkpoint.resume
    checkpoint.clean_partial(ckpt_dir)  # first: a save killed after its marker leaves a checkpoint to find
    if resume == "none" or (resume == "auto" and not checkpoint.step_dirs(ckpt_dir)):
        refuse_to_overwrite(cfg.log.run_dir, ckpt_dir)  # auto with nothing to resume starts afresh: the same rule
    elif resume != "auto" and not of_this_run(resume, ckpt_dir):
        refuse_to_overwrite(cfg.log.run_dir, ckpt_dir, source=resume)  # another run's checkpoint
    if mesh is not None:
        dist.barrier()  # every rank has looked before rank 0 writes
    refused = []
    if resume == "auto":
        path, refused = checkpoint.newest_valid(ckpt_dir)
        if path is None and refused:  # never start over on top of checkpoints that could not be read
            raise checkpoint.CheckpointError(
                f"checkpoint.resume = auto: no checkpoint in {ckpt_dir} passes verification ({'; '.join(refused)}); "
                "name one with checkpoint.resume=PATH, or move the directory aside to start anew")
    else:
        path = None if resume == "none" else resume
    if path is not None:
        checkpoint.require_optimizer_state(path)  # before the config comparison: the plainer reason
        check_same_model(path, cfg.model.hf)
        state = checkpoint.load(path, model, optimizer, verified=resume == "auto")
        if not same_tokenizer(state.get("tokenizer", corpus_tokenizer), corpus_tokenizer, train_ds):
            raise ConfigError(f"checkpoint {path} was trained on a corpus with another tokenizer (fingerprint "
                              f"{state['tokenizer']}) than data.corpus = {d.corpus} ({corpus_tokenizer}); resume "
                              "with the corpus it was trained on")
        start = state["step"]
        check_aux_free(state, cfg, path)
        if state.get("param_dtype", cfg.train.param_dtype) != cfg.train.param_dtype:
            notes.append(f"train.param_dtype changed from {state['param_dtype']} to {cfg.train.param_dtype}: the "
                         "checkpoint's weights and AdamW moments were converted to it")
        if resume == "auto" or of_this_run(path, ckpt_dir):  # else a new run that starts from another's checkpoint
            run = state.get("run", run)
        sampler.load_state_dict(state["data"])
        if state["data"]["global_batch"] != d.global_batch_size:
            notes.append(f"data.global_batch_size changed from {state['data']['global_batch']} to "
                           f"{d.global_batch_size}: training goes on from the same data position"
                           + ("; the validation set (the first data.val_batches global batches) changes with it"
                              if d.val_batches else ""))
        set_hyperparameters(optimizer, cfg.optim)
        if start >= cfg.train.steps:
            raise ConfigError(f"{path} is at step {start}, train.steps = {cfg.train.steps}: the run is done; raise "
                              "train.steps to train further (the schedule is recomputed for the new length)")
        if cfg.train.stop_at and start >= cfg.train.stop_at:
            raise ConfigError(f"train.stop_at = {cfg.train.stop_at} but {path} is already at step {start}: "
                              "raise train.stop_at, or set it to 0 to run to train.steps")
        if rank0:  # later checkpoints are off this run's timeline from now on, not from its first save
            checkpoint.take_up(ckpt_dir, path, start)
    elif cfg.checkpoint.init_from:
        checkpoint.verify_everywhere(cfg.checkpoint.init_from)  # before its trainer.json is read
        check_tokenizer_matches(cfg.checkpoint.init_from, train_ds, corpus_tokenizer)
        checkpoint.load_weights(cfg.checkpoint.init_from, model, verified=True)
        if diff := model_config_diff(cfg.checkpoint.init_from, cfg.model.hf):  # allowed (e.g. a longer RoPE), said
            notes.append(f"checkpoint.init_from {cfg.checkpoint.init_from} was saved with another model config "
                         f"({_listed(diff)}): its weights train under this run's")
    if rank0:  # once every check has passed: a refused command writes nothing
        save_run_config(cfg)
    log = RunLog(cfg.log.run_dir, cfg.train.steps, start, progress=cfg.log.progress,
                 tensorboard=cfg.log.tensorboard, wandb=cfg.log.wandb, wandb_project=cfg.log.wandb_project,
                 config=cfg.to_dict()) if rank0 else QuietLog()
    if mesh is not None:
        log.say(f"parallel layout: {layout.describe()}, {layout.world} process(es) on {device.type}")
    for reason in refused:
        log.say(f"passed over: {reason}")
    for note in notes:
        log.say(note)
    if path is not None:
        log.say(f"resumed from {path} at step {start}")
    elif cfg.checkpoint.init_from:
        log.say(f"initialised from the weights of {cfg.checkpoint.init_from}")
    t = cfg.train
    guard = StepGuard(t.nonfinite, t.max_skips, t.spike_factor, t.spike_window)
    if path is not None and "guard" in state:  # the spike window and skip counts go on as if never stopped
        guard.load_state_dict(state["guard"])
    graphs = StepGraphs(model, optimizer, cfg.optim.grad_clip, device, amp) if t.cuda_graphs == "on" else None
    preemption = Preemption().install()
    preempted = None
    last, tokens_since, t_since = {}, 0, time.perf_counter()
    run_tokens, run_time = 0, 0.0  # over the logged intervals after this invocation's first (compile, warm-up)
    first_tokens, first_time = 0, 0.0
    record, first_loss, paused_at = {}, None, None
    end = cfg.train.stop_at or cfg.train.steps
    for step in range(start, end):
        lr = lr_at(step, cfg.train.steps, cfg.optim)
        set_lr(optimizer, lr)
        done = step + 1
        try:  # the step, its validation and its checkpoint: an out-of-memory or a failed collective is reported
            micro = rank_batches(train_ds, sampler.next_batch(), d.micro_batch_size, mesh, d.document_mask)
            last = train_step(model, optimizer, micro, cfg.optim.grad_clip, device, amp, mesh, guard, done,
                              preemption, graphs)
            if last["skipped"] is not None:
                log.say(f"step {done}: skipped ({last['skipped']}); {guard.skipped_in_a_row + 1} in a row, "
                        f"{guard.skipped_total + 1} in all")
            guard.count(last["skipped"], done)
            tokens_since += last["tokens"]
            is_last = done == end
            final = done == cfg.train.steps  # the run's last step; a pause (train.stop_at) logs as any other step
            validate = bool(val_batches) and (final or (d.val_every and done % d.val_every == 0))
            if done % cfg.log.every == 0 or validate or final:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - t_since
                steps_since = done - (record.get("step", start))
                record = {"step": done, "loss": last["loss"].item(), "lr": lr, "grad_norm": last["grad_norm"].item(),
                          "tokens_per_s": tokens_since / elapsed, "step_time_s": elapsed / steps_since,
                          "peak_mem_gb": peak_memory_gb(device), "epoch": sampler.epoch,
                          "skipped_steps": guard.skipped_total}
                for key in ("aux_loss", "expert_load_imbalance"):
                    if key in last:
                        record[key] = last[key].item()
                if validate:
                    record["val_loss"] = evaluate(model, val_batches, device, amp, mesh)
                log.record(record)
                first_loss = record["loss"] if first_loss is None else first_loss
                if first_time:
                    run_tokens, run_time = run_tokens + tokens_since, run_time + elapsed
                else:
                    first_tokens, first_time = tokens_since, elapsed
                tokens_since, t_since = 0, time.perf_counter()  # validation time is not step time
            log.advance()
            every = cfg.checkpoint.every
            stop = not is_last and last["stop"]
            paused = is_last and done < cfg.train.steps  # stop_at: always saved, to resume from
            paused_at = done if paused else None
            if (every and done % every == 0) or (final and cfg.checkpoint.save_final) or paused or stop:
                t_save = time.perf_counter()
                log.sync()
                checkpoint.save(ckpt_dir, done, model, optimizer,
                                {"data": sampler.state_dict(), "lr": lr, "tokenizer": corpus_tokenizer,
                                 "guard": guard.state_dict(), "run": run, "aux_free": cfg.moe.aux_free,
                                 "param_dtype": cfg.train.param_dtype},
                                cfg.checkpoint.keep, hf_config=cfg.model.hf,
                                tokenizer=train_ds.tokenizer_path if corpus_tokenizer is not None else None)
                t_since += time.perf_counter() - t_save  # nor is saving
        except BaseException as e:
            log.close()
            try:  # SIGTERM (torchrun ending the job) only sets the flag until the report is made
                if isinstance(e, torch.OutOfMemoryError):
                    raise TrainingHalted(out_of_memory_report(model, optimizer, device, e, memory)) from e
                kind = collective_failure(e) if mesh is not None else None
                if kind is None:
                    raise
                silent = silent_ranks(mesh.rank, layout.world, min(3.0, cfg.parallel.timeout_s / 4))
                who = (f"rank(s) {', '.join(map(str, silent))} did not reach it (every other rank's collective "
                       "failed waiting for them): they hung or died" if silent else "another rank hung or died")
                what = (f"a collective waited longer than parallel.timeout_s = {cfg.parallel.timeout_s:g} s"
                        if kind == "timeout" else "a collective lost its connection to a rank that went away")
                raise TrainingHalted(f"rank {mesh.rank}, step {done}: {what}; {who}; "
                                     f"{str(e).splitlines()[0][:200]}") from e
            finally:
                preemption.uninstall()
        if stop:
            preempted = done
            log.say(f"SIGTERM: checkpoint of step {done} saved; resume with checkpoint.resume=auto")
            break
    preemption.uninstall()
    log.close()
    summary = {"run_dir": cfg.log.run_dir, "steps": cfg.train.steps, "start_step": start, "preempted_at": preempted,
               "paused_at": paused_at, "skipped_steps": guard.skipped_total}
    if record:
        summary.update(first_loss=first_loss, train_loss=record["loss"], val_loss=record.get("val_loss"),
                       logged_step=record["step"],
                       tokens_per_s=run_tokens / run_time if run_time else first_tokens / first_time)
    metrics = os.path.join(cfg.log.run_dir, "metrics.jsonl")
    if mesh is not None:
        dist.barrier()
        dist.destroy_process_group()
    if rank0 and cfg.log.plot and os.path.exists(metrics):
        summary["plot"] = plot_losses(metrics, os.path.join(cfg.log.run_dir, "loss.png"), train_ds.vocab_size)
    return summary
