"""Checkpoints: torch.distributed.checkpoint (DCP) directories, written atomically.

Layout of `<dir>/step-NNNNNNNN/`:
  *.distcp, .metadata     model and optimizer state (DCP; loads into any sharding)
  rng-rank{R}.pt          each rank's RNG states
  trainer.json            step, data position, LR schedule state, anything else of the loop
  config.json             the model's Hugging Face config
  tokenizer.json          the corpus's tokenizer (when it has one), for `convert dcp-to-hf`
  complete.json           written last: each file's size and CRC-32; its presence marks completion
A save goes to `.tmp-step-NNNNNNNN/` and is renamed when complete, so a save killed at any point
leaves the earlier checkpoints untouched and the partial one ignored (and removed at the next
start). When a run resumes from step S, checkpoints after S (a timeline abandoned by resuming an
earlier checkpoint, or ones passed over as invalid), and when a save starts, those of its step or
later, are renamed to `.abandoned-step-NNNNNNNN/` (kept, not resumed by `resume=auto`, never
pruned); after a save, the newest `keep` checkpoints up to its step stay. Listing checks sizes;
loading checks every CRC (rank 0 reads the files, the verdict goes to all ranks), so a truncated or
corrupted checkpoint is refused with its path and file named, and `resume=auto` passes over it to
the newest valid one (`newest_valid`).

Resharding: every tensor is stored whole (DCP records each rank's piece of it), so a checkpoint
loads into any layout. FSDP-sharded parameters are DTensors already; under expert parallelism a
rank's experts are E/ep of them, so those tensors (and their optimizer states) are presented as
DTensors over (ep, FSDP dims) with the global expert dimension (`_global_experts`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from pithtrain.config import fsync_path
from pithtrain.train.guard import injected

STEP_DIR = re.compile(r"^step-(\d{8})$")
MARKER = "complete.json"
logger = logging.getLogger("pithtrain.checkpoint")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt; the message names its path."""


WRITE_THREADS = 8


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def fault_point(name: str, step: int) -> None:
    """Fault injection for tests: PITHTRAIN_FAULT=<name>:<step>[:<rank>] kills the process (of that
    rank, else any that gets here) right here."""
    if injected(name, step):
        os._exit(137)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def quiet():
    """DCP warns when it runs without a process group, which is how a single process uses it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|not initialized).*")
        warnings.filterwarnings("ignore", message=".*process group.*")
        yield


def _global_experts(state, model: torch.nn.Module, path: str = ""):
    """`state` (a model or optimizer state dict) with each rank's experts seen as part of all E.
    Returns the new dict and the (view, original) pairs whose data must be copied back after a load."""
    mesh = getattr(model, "expert_store", None)
    pairs = []
    if mesh is None:
        return state, pairs

    def walk(obj, path):
        if isinstance(obj, dict):
            return {k: walk(v, f"{path}.{k}") for k, v in obj.items()}
        if isinstance(obj, DTensor) and ".mlp.experts." in path:
            local = obj.to_local()
            shape = torch.Size((obj.shape[0] * mesh.size(0), *obj.shape[1:]))
            view = DTensor.from_local(local, mesh, [Shard(0), *obj.placements], run_check=False, shape=shape,
                                      stride=torch.empty(shape, device="meta").stride())
            pairs.append((view, local))
            return view
        return obj

    return walk(state, path), pairs


def _copy_back(pairs) -> None:
    for view, local in pairs:
        if view.to_local().data_ptr() != local.data_ptr():
            local.copy_(view.to_local())


def save(root: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         trainer_state: dict, keep: int, hf_config: dict | None = None, tokenizer: str | None = None) -> str:
    """Write checkpoint `step` under `root` atomically and prune (`prune`).
    `hf_config` (the model's config.json) and `tokenizer` (the corpus's tokenizer.json) are stored
    with it, so the checkpoint describes itself (`convert dcp-to-hf` takes both along)."""
    final = os.path.join(root, f"step-{step:08d}")
    tmp = os.path.join(root, f".tmp-step-{step:08d}")
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        set_aside(root, step)  # first: a save cut short anywhere must not leave them to resume=auto
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    if hasattr(optimizer, "init_state"):  # our AdamW: every step so far skipped leaves no state to save
        optimizer.init_state()
    state, _ = _global_experts(dict(zip(("model", "optim"), get_state_dict(model, optimizer))), model)
    with quiet():  # several files per rank, written by as many threads (and checksummed in parallel)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, thread_count=WRITE_THREADS))
    fault_point("save-after-tensors", step)
    rng_path = os.path.join(tmp, f"rng-rank{_rank()}.pt")
    torch.save(rng_state(), rng_path)
    with open(rng_path, "rb+") as f:
        os.fsync(f.fileno())
    _barrier()
    if _rank() == 0:
        _write_json(os.path.join(tmp, "trainer.json"), {"step": step, **trainer_state})
        if hf_config is not None:
            _write_json(os.path.join(tmp, "config.json"), hf_config)
        if tokenizer is not None:
            shutil.copyfile(tokenizer, os.path.join(tmp, "tokenizer.json"))
        fault_point("save-before-marker", step)
        finalize_dir(tmp, final, {"step": step})
        prune(root, keep, step)
    _barrier()
    return final


def _crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _checksums(folder: str, names: list[str]) -> dict[str, str]:
    """CRC-32 of each file, several at a time (zlib releases the GIL): ~1 GB/s per thread."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        return dict(zip(names, pool.map(lambda n: _crc32(os.path.join(folder, n)), names)))


def finalize_dir(tmp: str, final: str, info: dict) -> None:
    """Mark the finished directory `tmp` complete (each file's size and CRC-32, also of files in its
    folders, named by their path inside it) and move it to `final`."""
    names = sorted(os.path.relpath(os.path.join(d, n), tmp) for d, _, files in os.walk(tmp) for n in files)
    crcs = _checksums(tmp, names)
    files = {n: {"bytes": os.path.getsize(os.path.join(tmp, n)), "crc32": crcs[n]} for n in names}
    _write_json(os.path.join(tmp, MARKER), {**info, "files": files})
    fsync_path(tmp)
    if os.path.exists(final):
        raise CheckpointError(f"{final} exists; it is not replaced")
    os.replace(tmp, final)
    fsync_path(os.path.dirname(os.path.abspath(final)))


def _what_it_is(path: str) -> str:
    """For a folder without a marker: what it looks like and what to name instead."""
    names = os.listdir(path)
    holds_steps = any(STEP_DIR.match(n) for n in names)
    if holds_steps or os.path.isdir(os.path.join(path, "checkpoints")):
        where = path if holds_steps else os.path.join(path, "checkpoints")
        return (f"; it holds checkpoints rather than being one: name one of the step-N folders in {where} (to "
                "continue a run, checkpoint.resume=auto takes the newest valid one of checkpoint.dir)")
    if any(n.endswith(".safetensors") for n in names):
        return (f"; it is a Hugging Face folder: convert it with `pithtrain convert hf-to-dcp {path} OUT` and name "
                "OUT")
    return ""


def verify(path: str, checksums: bool = False) -> dict:
    """Check a checkpoint directory against its completion marker (every file present with its
    size; with `checksums` also its CRC-32, which reads every byte); return the marker. A read that
    fails (an I/O error) refuses the checkpoint like damage does, so `resume=auto` passes it over."""
    try:
        return _verify(path, checksums)
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be read ({e}); resume from another checkpoint") from None


def _verify(path: str, checksums: bool) -> dict:
    marker = os.path.join(path, MARKER)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a folder)")
    if not os.path.isfile(marker):
        raise CheckpointError(f"checkpoint {path} is incomplete: {MARKER} is missing{_what_it_is(path)}")
    try:
        with open(marker, "rb") as f:
            info = json.loads(f.read())
        files = info["files"]
        sizes = {n: int(e["bytes"] if isinstance(e, dict) else e) for n, e in files.items()}  # older: sizes only
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # not JSON, not UTF-8, not the marker's form
        raise CheckpointError(f"checkpoint {path}: {MARKER} is corrupt ({type(e).__name__}: {e}); "
                              "resume from another checkpoint") from None
    for name, size in sizes.items():
        p = os.path.join(path, name)
        if not os.path.isfile(p):
            raise CheckpointError(f"checkpoint {path} is missing {name}")
        if os.path.getsize(p) != size:
            raise CheckpointError(f"checkpoint {path}: {name} has {os.path.getsize(p)} bytes, expected {size}")
    if checksums:
        want = {n: e["crc32"] for n, e in files.items() if isinstance(e, dict) and "crc32" in e}
        for name, crc in _checksums(path, sorted(want)).items():
            if crc != want[name]:
                raise CheckpointError(f"checkpoint {path}: {name} is corrupt (CRC-32 {crc}, expected {want[name]}); "
                                      "resume from another checkpoint")
    return info


def verify_everywhere(path: str) -> None:
    """Full verification (checksums) by rank 0 alone, its verdict shared with every rank, so all
    raise the same CheckpointError or none does."""
    if not dist.is_initialized():
        verify(path, checksums=True)
        return
    verdict = [None]
    if _rank() == 0:
        try:
            verify(path, checksums=True)
        except CheckpointError as e:
            verdict[0] = str(e)
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise CheckpointError(verdict[0])


def newest_valid(root: str) -> tuple[str | None, list[str]]:
    """The newest checkpoint under `root` that passes full verification, and why every `step-*`
    directory that fails was refused (newer ones by full verification, older ones by their sizes):
    a torn, truncated or corrupted checkpoint is reported, never loaded."""
    refused, found = [], None
    for _, path in reversed(step_dirs(root)):
        try:
            if found is None:
                verify_everywhere(path)
                found = path
            else:
                verify(path)
        except CheckpointError as e:
            refused.append(str(e))
    return found, refused


def step_dirs(root: str) -> list[tuple[int, str]]:
    """(step, path) of every `step-*` directory under `root`, verified or not, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted((int(m.group(1)), os.path.join(root, n)) for n in os.listdir(root) if (m := STEP_DIR.match(n)))


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint under `root` that verifies (sizes), oldest first."""
    found = []
    for step, path in step_dirs(root):
        try:
            verify(path)
        except CheckpointError:
            continue
        found.append((step, path))
    return found


def _passes(path: str) -> bool:
    try:
        verify(path, checksums=True)
        return True
    except CheckpointError:
        return False


def clean_partial(root: str) -> list[str]:
    """Remove the leftovers of interrupted saves; return what was removed (rank 0 only). A save
    killed after its marker but before its rename leaves a complete `.tmp-step-N`: it is moved in
    (later checkpoints set aside first, as its save would have). `.old-step-N` (left by a killed
    same-step save of earlier versions, which replaced the old copy) is moved back when no
    `step-N` exists and it verifies. `.pruning-step-N` (a prune killed mid-delete) is removed."""
    removed = []
    if _rank() == 0 and os.path.isdir(root):
        for name in sorted(os.listdir(root), key=lambda n: not n.startswith(".tmp-")):  # the new copy first
            if name.startswith(".pruning-step-"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                removed.append(name)
                continue
            if not name.startswith((".tmp-step-", ".old-step-")):
                continue
            path, final = os.path.join(root, name), os.path.join(root, name[5:])
            if not os.path.exists(final) and _passes(path):
                set_aside(root, int(name[-8:]) + 1)  # as a save does when it starts (earlier versions did later)
                os.replace(path, final)
                fsync_path(root)
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    _barrier()
    return removed


def set_aside(root: str, step: int) -> list[str]:
    """When checkpoint `step` is saved, or a run resumes from `step` - 1: every `step-M` with
    M >= step is not on this run's timeline (the run resumed from an earlier step, or passed over
    them as invalid), so each is renamed to `.abandoned-step-M` (kept, never deleted, not resumed by
    `resume=auto`)."""
    moved = []
    for s, path in step_dirs(root):
        if s >= step:
            aside, n = os.path.join(root, f".abandoned-{os.path.basename(path)}"), 1
            while os.path.exists(aside):  # abandoned before: keep every copy
                aside, n = os.path.join(root, f".abandoned-{os.path.basename(path)}-{n}"), n + 1
            os.replace(path, aside)
            moved.append(os.path.basename(aside))
    if moved:
        fsync_path(root)
        logger.warning("checkpoints at or after step %d are not on this run's timeline (it resumed from an earlier "
                       "step, or passed over them as invalid); moved aside in %s: %s", step, root, ", ".join(moved))
    return moved


def take_up(root: str, path: str, step: int) -> None:
    """After a resume from `path` at `step` (rank 0): the live checkpoints after it are off this
    run's timeline (`set_aside`). A resumed `.abandoned-step-S` of `root` (a timeline left earlier,
    taken up again) sets aside the live `step-S` too and becomes `step-S` again, so a crash before
    the first save resumes it, not the timeline it replaces. (Checkpoints of that timeline older
    than S stay: without a record of each one's parent they cannot be told from this one's.)"""
    name = os.path.basename(os.path.normpath(path))
    if (re.fullmatch(r"\.abandoned-step-\d+(-\d+)?", name) and os.path.isdir(root)
            and os.path.samefile(os.path.dirname(os.path.abspath(path)), root)):
        set_aside(root, step)
        os.replace(path, os.path.join(root, f"step-{step:08d}"))
        fsync_path(root)
    else:
        set_aside(root, step + 1)


def prune(root: str, keep: int, step: int) -> None:
    """After saving `step` (never deleted): keep the newest `keep` checkpoints up to it, counting it
    (later ones were set aside when its save began, `set_aside`)."""
    older = [path for s, path in complete_checkpoints(root) if s < step]
    for path in older[:max(len(older) - (keep - 1), 0)]:
        doomed = os.path.join(root, ".pruning-" + os.path.basename(path))  # a delete killed midway: no torn step-N
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def latest(root: str) -> str | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def _metadata(path: str):
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # missing or unreadable .metadata
        raise CheckpointError(f"{path} is not a readable DCP checkpoint: {e}") from None


def stored_tensors(path: str) -> dict[str, tuple[tuple, torch.dtype]]:
    """The model tensors of checkpoint `path` -> (shape, dtype), read from its metadata only."""
    return {k.removeprefix("model."): (tuple(v.size), v.properties.dtype)
            for k, v in _metadata(path).state_dict_metadata.items() if k.startswith("model.") and hasattr(v, "size")}


def check_tensors(path: str, have: dict[str, tuple], want: dict[str, tuple]) -> None:
    """Raise a CheckpointError naming every tensor whose shape differs, that is missing or extra."""
    lines = []
    mismatched = [f"{n}: checkpoint {list(have[n])}, model {list(s)}" for n, s in want.items()
                  if n in have and tuple(have[n]) != tuple(s)]
    missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if mismatched:
        lines.append("shapes differ:\n  " + "\n  ".join(mismatched[:20]))
    for what, names in (("missing", missing), ("unexpected", unexpected)):
        if names:
            lines.append(f"{what} tensors ({len(names)}): " + ", ".join(names[:20]) + (" ..." if len(names) > 20 else ""))
    if lines and not mismatched and all(n.endswith(".e_score_correction_bias") for n in missing + unexpected):
        saved = "with" if unexpected else "without"  # the routers' biases of moe.aux_free, and nothing else
        raise CheckpointError(f"checkpoint {path} was trained {saved} moe.aux_free (its routers' correction biases): "
                              f"set moe.aux_free={'true' if unexpected else 'false'} as it was\n" + "\n".join(lines))
    if lines:
        raise CheckpointError(f"checkpoint {path} does not match the model (check model.config and its "
                              f"overrides):\n" + "\n".join(lines))


def _untied(model: torch.nn.Module, state: dict, stored: dict) -> tuple[dict, torch.Tensor | None]:
    """What to load into a tied model (tie_word_embeddings): DCP would write the stored head into the
    embedding, the one tensor both share. The head goes to a scratch tensor (returned, to be compared
    with the embedding after loading), or is left out where the checkpoint has none."""
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        return state, None
    state = {n: t for n, t in state.items() if n != "lm_head.weight"}
    if "lm_head.weight" not in stored:
        return state, None
    head = torch.empty_like(state["model.embed_tokens.weight"])
    return {**state, "lm_head.weight": head}, head


def _check_tied(path: str, head: torch.Tensor | None, embedding: torch.Tensor) -> None:
    if head is None:
        return
    local = [t.to_local() if isinstance(t, DTensor) else t for t in (head, embedding)]
    same = torch.tensor(float(torch.equal(*local)), device=local[0].device)
    if dist.is_initialized():  # each rank compared its shard
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if not same.item():
        raise CheckpointError(f"checkpoint {path} is untied (its lm_head.weight differs from "
                              "model.embed_tokens.weight) but the model config ties them (tie_word_embeddings = "
                              "true); set model.tie_word_embeddings=false")


def _dcp_load(state: dict, path: str, what: str) -> None:
    try:
        with quiet():
            dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        if isinstance(e, CheckpointException):  # name each rank's error, not DCP's tracebacks
            e = "; ".join(f"rank {r}: {exc}" for r, (exc, _) in sorted(e.failures.items()))
        raise CheckpointError(f"checkpoint {path} does not match this {what}: {e}") from None


def load_weights(path: str, model: torch.nn.Module, verified: bool = False) -> None:
    """Load only the model weights of `path`: a converted Hugging Face checkpoint or a training one.
    `verified`: the caller has just verified it in full (`verify_everywhere`)."""
    if not verified:
        verify_everywhere(path)
    state = get_model_state_dict(model)
    stored = stored_tensors(path)
    view, pairs = _global_experts(state, model, "model")
    view, head = _untied(model, view, stored)
    fresh = [n for n in view if n.endswith(".e_score_correction_bias") and n not in stored]
    if fresh:  # moe.aux_free on weights trained without it: its biases start at zero, as in a new run
        logger.info("%s has no e_score_correction_bias; moe.aux_free starts its %d routers' biases at zero", path,
                    len(fresh))
        view = {n: t for n, t in view.items() if n not in fresh}
    check_tensors(path, {n: s for n, (s, _) in stored.items()}, {n: t.shape for n, t in view.items()})
    _dcp_load({"model": view}, path, "model")
    _copy_back(pairs)
    _check_tied(path, head, view["model.embed_tokens.weight"])
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


def require_optimizer_state(path: str) -> None:
    """A run resumes only from a complete checkpoint (sizes checked) with optimizer state (read from
    its metadata)."""
    verify(path)
    if not any(k.startswith("optim.") for k in _metadata(path).state_dict_metadata):
        raise CheckpointError(f"checkpoint {path} holds weights only, no optimizer state (e.g. made by `pithtrain "
                              f"convert hf-to-dcp`), so a run cannot resume from it; start from its weights with "
                              f"checkpoint.init_from={path}")


def run_id(path: str) -> str | None:
    """The id of the run that saved checkpoint `path` (trainer.json's "run"); None if it has none."""
    try:
        with open(os.path.join(path, "trainer.json")) as f:
            return json.load(f).get("run")
    except (OSError, ValueError, AttributeError):
        return None


def load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, verified: bool = False) -> dict:
    """Load model (and optimizer) state from checkpoint `path`; return its trainer state. `verified`:
    the caller has just verified it in full (`newest_valid`), so its bytes are not read twice."""
    if not verified:
        verify_everywhere(path)
    if optimizer is not None:
        require_optimizer_state(path)
    stored = {n: s for n, (s, _) in stored_tensors(path).items()}
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    view, pairs = _global_experts(state, model)
    model_view, head = _untied(model, view["model"], stored)
    view = {**view, "model": model_view}  # `state` keeps every name for set_state_dict
    check_tensors(path, stored, {n: t.shape for n, t in view["model"].items()})
    _dcp_load(view, path, "model and optimizer")
    _copy_back(pairs)
    _check_tied(path, head, view["model"]["model.embed_tokens.weight"])
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    # Training draws no random numbers (no dropout; weights and data order are seeded), so a rank with
    # no saved state (a resume on more ranks) keeps its own; the states serve code that does draw.
    rng_path = os.path.join(path, f"rng-rank{_rank()}.pt")
    if os.path.isfile(rng_path):
        set_rng_state(torch.load(rng_path, weights_only=False))
    with open(os.path.join(path, "trainer.json")) as f:
        return json.load(f)
