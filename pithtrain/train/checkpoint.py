"""Checkpoints: torch.distributed.checkpoint (DCP) directories, written atomically.

Layout of `<dir>/step-NNNNNNNN/`:
  *.distcp, .metadata     model and optimizer state (DCP; loads into any sharding)
  rng-rank{R}.pt          each rank's RNG states
  trainer.json            step, data position, LR schedule state, anything else of the loop
  complete.json           written last: the file list with sizes; its presence marks completion
A save goes to `.tmp-step-NNNNNNNN/` and is renamed when complete, so a save killed at any point
leaves the earlier checkpoints untouched and the partial one ignored (and removed at the next
start). Only the newest `keep` complete checkpoints are kept.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

STEP_DIR = re.compile(r"^step-(\d{8})$")
MARKER = "complete.json"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt; the message names its path."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def fault_point(name: str, step: int) -> None:
    """Fault injection for tests: PITHTRAIN_FAULT=<name>:<step> kills the process right here."""
    if os.environ.get("PITHTRAIN_FAULT") == f"{name}:{step}":
        os._exit(137)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
def _quiet():
    """DCP warns when it runs without a process group, which is how a single process uses it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|not initialized).*")
        warnings.filterwarnings("ignore", message=".*process group.*")
        yield


def save(root: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         trainer_state: dict, keep: int) -> str:
    """Write checkpoint `step` under `root` atomically and prune to the newest `keep`."""
    final = os.path.join(root, f"step-{step:08d}")
    tmp = os.path.join(root, f".tmp-step-{step:08d}")
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _quiet():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    fault_point("save-after-tensors", step)
    rng_path = os.path.join(tmp, f"rng-rank{_rank()}.pt")
    torch.save(rng_state(), rng_path)
    with open(rng_path, "rb+") as f:
        os.fsync(f.fileno())
    _barrier()
    if _rank() == 0:
        _write_json(os.path.join(tmp, "trainer.json"), {"step": step, **trainer_state})
        files = {name: os.path.getsize(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}
        fault_point("save-before-marker", step)
        _write_json(os.path.join(tmp, MARKER), {"step": step, "files": files})
        _fsync_dir(tmp)
        if os.path.exists(final):  # the same step saved again (e.g. a rerun): replace it whole
            old = os.path.join(root, f".old-step-{step:08d}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
        prune(root, keep)
    _barrier()
    return final


def verify(path: str) -> dict:
    """Check a checkpoint directory against its completion marker; return the marker."""
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        raise CheckpointError(f"checkpoint {path} is incomplete: {MARKER} is missing")
    try:
        with open(marker) as f:
            info = json.load(f)
        files = info["files"]
    except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path}: {MARKER} is corrupt ({e})") from None
    for name, size in files.items():
        p = os.path.join(path, name)
        if not os.path.isfile(p):
            raise CheckpointError(f"checkpoint {path} is missing {name}")
        if os.path.getsize(p) != size:
            raise CheckpointError(f"checkpoint {path}: {name} has {os.path.getsize(p)} bytes, expected {size}")
    return info


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint under `root` that verifies, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        if m:
            path = os.path.join(root, name)
            try:
                verify(path)
            except CheckpointError:
                continue
            found.append((int(m.group(1)), path))
    return sorted(found)


def clean_partial(root: str) -> list[str]:
    """Remove the leftovers of interrupted saves; return what was removed (rank 0 only)."""
    removed = []
    if _rank() == 0 and os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith((".tmp-step-", ".old-step-")):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                removed.append(name)
    _barrier()
    return removed


def prune(root: str, keep: int) -> None:
    for _, path in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def latest(root: str) -> str | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """Load model (and optimizer) state from checkpoint `path`; return its trainer state."""
    verify(path)
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    try:
        with _quiet():
            dcp.load(state, checkpoint_id=path)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} does not match this model and optimizer: {e}") from None
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng_path = os.path.join(path, f"rng-rank{_rank()}.pt")
    if os.path.isfile(rng_path):
        set_rng_state(torch.load(rng_path, weights_only=False))
    with open(os.path.join(path, "trainer.json")) as f:
        return json.load(f)
