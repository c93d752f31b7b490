"""Run configuration: dataclasses loaded from TOML, `section.key=value` overrides, strict checks.

A run config has one TOML table per dataclass below. The `[model]` table is special: its `config`
key names a Hugging Face `config.json` (relative to the TOML file), and every other key overrides a
field of that JSON (`model.num_hidden_layers=2`). Anything unknown, mistyped or contradictory raises
`ConfigError` with the key and what would be valid, before any model or data is touched.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import tomllib
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and what to change."""


@dataclass
class TrainConfig:
    steps: int = 100  # length of the whole run (the LR schedule spans it)
    stop_at: int = 0  # end this invocation after this step, to resume later (0: run to train.steps)
    seed: int = 0  # >= 0: data order, weight init
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    # Parameters, gradients and AdamW states: fp32 (master weights; bf16 compute under autocast) or
    # bf16 (half the memory; updates below bf16's resolution of a weight are lost).
    param_dtype: Literal["fp32", "bf16"] = "fp32"
    compile: Literal["auto", "on", "off"] = "auto"  # torch.compile of the dense parts; auto: on with CUDA
    recompute: Literal["none", "attention", "experts", "both"] = "none"  # activation recompute in backward
    # One process on one GPU: replay each step as CUDA graphs after 2 eager steps (train/graphs.py).
    cuda_graphs: Literal["off", "on"] = "off"
    # A non-finite loss or gradient: halt (stop, naming the step, the ranks and the first module whose
    # output went non-finite) or skip the step (stop when more than max_skips steps in a row are skipped).
    nonfinite: Literal["halt", "skip"] = "halt"
    deterministic: bool = False  # bitwise repeatable runs: deterministic kernels only (slower; errors name an op without one)
    max_skips: int = 3
    spike_factor: float = 0.0  # > 1: skip a step whose loss exceeds this x the mean of the last spike_window
    spike_window: int = 20
    threads: int = 0  # torch intra-op threads on CPU; 0 leaves torch's default


@dataclass
class DataConfig:
    corpus: str = ""  # directory written by `pithtrain build-corpus`
    seq_len: int = 256
    micro_batch_size: int = 4  # sequences per forward/backward
    global_batch_size: int = 8  # sequences per optimizer step (micro_batch_size * accumulation)
    val_every: int = 50  # validation every N steps (0: only at the end)
    val_batches: int = 4  # validation set: the first val_batches global batches of the val split (0: none)
    document_mask: bool = False  # attention stays inside each packed document; positions restart per document


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5  # floor the decay ends at (cosine and linear)
    warmup_steps: int = 10
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = 0.1  # applied to matrices only (not norms, biases, router bias)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global grad-norm clip; 0 disables


@dataclass
class MoEConfig:
    aux_loss: Literal["none", "global_batch", "micro_batch", "sequence"] = "global_batch"
    aux_loss_coef: float = 1e-3
    z_loss_coef: float = 0.0
    aux_free: bool = False  # DeepSeek-V3 auxiliary-loss-free balancing with a per-expert bias
    aux_free_rate: float = 1e-3  # bias update speed (gamma)


@dataclass
class ParallelConfig:
    """Degrees of parallelism; dp is what the world size leaves (see `parallel/mesh.py`)."""

    pp: int = 1  # pipeline stages
    cp: int = 1  # context parallel: ranks that split each sequence (ring attention)
    ep: int = 1  # expert parallel: ranks that split the routed experts
    dp_replicate: int = 1  # HSDP: replicas of the FSDP-sharded model (e.g. one per node); 1: plain FSDP
    timeout_s: float = 600.0  # a collective that waits longer (a rank hung or died) fails the run


@dataclass
class CheckpointConfig:
    dir: str = ""  # default: <run_dir>/checkpoints
    every: int = 0  # save every N steps (0: only at the end)
    keep: int = 2  # keep the newest K complete checkpoints
    resume: str = "none"  # "none", "auto" (newest complete checkpoint) or a checkpoint path
    init_from: str = ""  # a fresh run starts from these weights (`pithtrain convert hf-to-dcp` output)
    save_final: bool = True


@dataclass
class LogConfig:
    run_dir: str = "runs/run"
    every: int = 1
    progress: bool = True
    plot: bool = True
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "pithtrain"


@dataclass
class ModelConfig:
    config: str = ""  # path of the Hugging Face config.json
    hf: dict = field(default_factory=dict)  # the resolved HF fields, overrides applied


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.log.run_dir, "checkpoints")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = [f.name for f in dataclasses.fields(RunConfig)]
_PATH_KEYS = {("model", "config"), ("data", "corpus"), ("log", "run_dir"), ("checkpoint", "dir"),
              ("checkpoint", "init_from"), ("checkpoint", "resume")}
_NOT_PATHS = ("none", "auto")  # checkpoint.resume's words


def parse_value(text: str) -> Any:
    """A command-line value as TOML (`3`, `1e-3`, `true`, `[1, 2]`, `"x"`), else the plain string."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    return text if isinstance(value, (datetime.date, datetime.time)) else value  # run_dir=2024-06-01: a name


def _check_type(key: str, value: Any, annotation: Any) -> Any:
    """Return `value` as the annotated type, or raise ConfigError naming the key."""
    if get_origin(annotation) is Literal:
        choices = get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{key} = {value!r} is not valid; choose one of {list(choices)}")
        return value
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is bool and not isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r} must be true or false")
    if annotation in (int, float, str) and (not isinstance(value, annotation) or isinstance(value, bool)):
        raise ConfigError(f"{key} = {value!r} must be of type {annotation.__name__}")
    if annotation is float and not math.isfinite(value):
        raise ConfigError(f"{key} = {value}: give a finite number")
    return value


def _annotation(section: str, key: str) -> Any:
    """The declared type of `section.key` (None for an unknown key)."""
    return typing.get_type_hints(type(getattr(RunConfig(), section))).get(key)


# config.json fields that transformers reads and this library does not, and the setting that does the same
NOT_READ = {"router_aux_loss_coef": "moe.aux_loss_coef"}


def _hf_override(key: str, base: dict, value: Any) -> Any:
    if key not in base:
        hint = ""
        if "." in key and isinstance(base.get(key.split(".")[0]), dict):
            first = key.split(".")[0]
            hint = f"; for a field inside {first}, give the table: model.{first}={{{key.split('.', 1)[1]} = ...}}"
        raise ConfigError(f"model.{key} is not a field of the model's config.json{hint}; valid fields: {sorted(base)}")
    if key in NOT_READ:
        raise ConfigError(f"model.{key} is not read by this library: set {NOT_READ[key]} instead")
    old = base[key]
    if old is None or value is None:
        return value
    if isinstance(old, dict) and isinstance(value, dict):  # a table of a nested field: its keys over the file's
        return {**old, **value}
    if isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(old) is int and isinstance(value, float) and value.is_integer():  # rope_theta=1e6 where the file has 10000
        return int(value)
    if type(old) is not type(value):
        raise ConfigError(
            f"model.{key} = {value!r} has type {type(value).__name__}, config.json has "
            f"{type(old).__name__} ({old!r})"
        )
    return value


def load_config(path: str | None, overrides: list[str] = (), base: dict | None = None) -> RunConfig:
    """Load a TOML run config (or start from `base`, a dict of the same shape) and apply overrides.

    Relative paths inside the TOML are resolved against the TOML's directory; relative paths given
    as overrides are taken from the current directory.
    """
    raw: dict = {}
    root = os.getcwd()
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {path} is a folder; name the run's .toml file") from None
        except OSError as e:
            raise ConfigError(f"config file {path} cannot be read: {e}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:  # TOML is UTF-8
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
        root = os.path.dirname(os.path.abspath(path))
    if base:
        raw = {**{k: dict(v) for k, v in base.items()}, **raw}
    for section, table in raw.items():
        if section not in SECTIONS:
            if not isinstance(table, dict):
                raise ConfigError(f"{section} = {table!r} stands outside any [section] table; move it under its "
                                  f"section (one of {SECTIONS})")
            raise ConfigError(f"unknown section [{section}]; valid sections: {SECTIONS}")
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] must be a table of key = value pairs")
        for key in table:
            if (section, key) in _PATH_KEYS and isinstance(table[key], str) and table[key] not in ("", *_NOT_PATHS):
                table[key] = os.path.join(root, os.path.expanduser(table[key]))

    for item in overrides:
        name, eq, text = item.partition("=")
        section, dot, key = name.partition(".")
        if not eq or not dot or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        if section not in SECTIONS:
            raise ConfigError(f"unknown section in override {item!r}; valid sections: {SECTIONS}")
        value = parse_value(text)
        if not isinstance(value, str) and section != "model" and _annotation(section, key) is str:
            value = text  # a name stays as written: log.run_dir=42, log.wandb_project=2025
        if (section, key) in _PATH_KEYS and isinstance(value, str) and value not in ("", *_NOT_PATHS):
            value = os.path.abspath(os.path.expanduser(value))
        raw.setdefault(section, {})[key] = value
    return build_config(raw)


def build_config(raw: dict) -> RunConfig:
    """Turn a {section: {key: value}} dict into a checked RunConfig."""
    cfg = RunConfig()
    for section, table in raw.items():
        if section == "model":
            continue
        target = getattr(cfg, section)
        types = typing.get_type_hints(type(target))
        for key, value in table.items():
            if key not in types:
                raise ConfigError(f"unknown key {section}.{key}; valid keys of [{section}]: {sorted(types)}")
            setattr(target, key, _check_type(f"{section}.{key}", value, types[key]))

    model = dict(raw.get("model", {}))
    cfg.model.config = model.pop("config", "")
    if not cfg.model.config:
        raise ConfigError("model.config is missing: name the Hugging Face config.json of the model")
    if not isinstance(cfg.model.config, str):
        raise ConfigError(f"model.config = {cfg.model.config!r}: name the path of the model's config.json")
    if os.path.isdir(cfg.model.config):  # a Hugging Face model folder: its config.json
        cfg.model.config = os.path.join(cfg.model.config, "config.json")
    try:
        with open(cfg.model.config) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"model.config: {cfg.model.config} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"model.config: {cfg.model.config} cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"model.config: {cfg.model.config} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"model.config: {cfg.model.config} holds a JSON {type(hf).__name__}, not the object "
                          "{...} of a Hugging Face config.json")
    hf.pop("hf", None)
    for key, value in model.items():
        hf[key] = _hf_override(key, hf, value)
    cfg.model.hf = hf
    validate(cfg)
    check_model(hf, cfg.model.config)
    return cfg


def fsync_path(path: str) -> None:
    """Flush a file's or a folder's (its entries') writes to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unwritable(path: str) -> str | None:
    """Why a folder cannot be made or filled at `path` (its nearest existing part is a file or not
    writable), or None."""
    part = os.path.abspath(path)
    while not os.path.lexists(part):
        part = os.path.dirname(part)
    if os.path.islink(part) and not os.path.exists(part):
        return f"{part} is a link to nothing"
    if not os.path.isdir(part):
        return f"{part} is a file" if part != os.path.abspath(path) else "it is a file"
    if not os.access(part, os.W_OK | os.X_OK):
        return f"{part} is not writable here"
    return None


def check_model(hf: dict, path: str) -> None:
    """Build the model on the meta device, so that a bad model config fails here, by name."""
    import torch

    from pithtrain.models import build_model

    try:
        with torch.device("meta"):
            build_model(hf)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"model ({path} with its model.* overrides): {e}") from None
    if hf.get("output_router_logits"):  # under it, transformers trains with its own balancing loss
        raise ConfigError(f"model.output_router_logits = true ({path}): transformers then adds router_aux_loss_coef "
                          "x its load-balancing loss to the training loss, which this library does not read; set it "
                          "to false (model.output_router_logits=false) and choose the balancing loss with "
                          "moe.aux_loss / moe.aux_loss_coef")


def validate(cfg: RunConfig) -> None:
    """Checks across keys; each error names the keys involved and a value that would work."""
    d, o, t = cfg.data, cfg.optim, cfg.train
    for key, value in [("train.steps", t.steps), ("data.seq_len", d.seq_len),
                       ("data.micro_batch_size", d.micro_batch_size),
                       ("data.global_batch_size", d.global_batch_size), ("log.every", cfg.log.every),
                       ("checkpoint.keep", cfg.checkpoint.keep)]:
        if value < 1:
            raise ConfigError(f"{key} = {value} must be at least 1")
    for key, value in [("data.val_every", d.val_every), ("data.val_batches", d.val_batches),
                       ("checkpoint.every", cfg.checkpoint.every),
                       ("optim.warmup_steps", o.warmup_steps), ("optim.grad_clip", o.grad_clip),
                       ("optim.weight_decay", o.weight_decay), ("moe.aux_loss_coef", cfg.moe.aux_loss_coef),
                       ("moe.z_loss_coef", cfg.moe.z_loss_coef), ("moe.aux_free_rate", cfg.moe.aux_free_rate),
                       ("train.threads", t.threads),
                       ("train.max_skips", t.max_skips), ("train.seed", t.seed)]:
        if value < 0:
            raise ConfigError(f"{key} = {value} must not be negative")
    if d.global_batch_size % d.micro_batch_size:
        raise ConfigError(
            f"data.global_batch_size = {d.global_batch_size} is not a multiple of "
            f"data.micro_batch_size = {d.micro_batch_size}"
        )
    if not 0 <= t.stop_at <= t.steps:
        raise ConfigError(f"train.stop_at = {t.stop_at} must lie between 0 and train.steps = {t.steps}")
    if o.warmup_steps > t.steps:
        raise ConfigError(f"optim.warmup_steps = {o.warmup_steps} exceeds train.steps = {t.steps}")
    if not 0 < o.lr or not 0 <= o.min_lr or (o.decay != "constant" and o.min_lr > o.lr):
        raise ConfigError(f"need 0 <= optim.min_lr <= optim.lr and lr > 0 (got lr={o.lr}, min_lr={o.min_lr}; "
                          "min_lr is the end of a cosine or linear decay)")
    if not (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1) or o.eps <= 0:
        raise ConfigError("optim.beta1 and optim.beta2 must lie in [0, 1) and optim.eps must be > 0")
    if not cfg.log.run_dir:
        raise ConfigError("log.run_dir is empty; name the folder the run's logs and checkpoints go to")
    for key, path in (("log.run_dir", cfg.log.run_dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(f"{key} = {path!r} is a file; name a folder (new or one of this run)")
    res = cfg.checkpoint.resume
    if res not in ("none", "auto") and not os.path.isdir(res):
        raise ConfigError(f"checkpoint.resume = {res!r}: use 'none', 'auto' or an existing checkpoint directory")
    init = cfg.checkpoint.init_from
    if init and not os.path.isdir(init):
        raise ConfigError(f"checkpoint.init_from = {init!r} is not a directory; name a checkpoint written by "
                          f"`pithtrain convert hf-to-dcp` or by training")
    hf = cfg.model.hf
    for key in ("num_attention_heads", "num_key_value_heads"):
        if key in hf and (not isinstance(hf[key], int) or hf[key] < 1):
            raise ConfigError(f"model.{key} = {hf[key]!r} must be a positive integer")
    if "num_key_value_heads" in hf and hf["num_attention_heads"] % hf["num_key_value_heads"]:
        raise ConfigError(
            f"model.num_attention_heads = {hf['num_attention_heads']} is not a multiple of "
            f"model.num_key_value_heads = {hf['num_key_value_heads']}"
        )
    if "num_experts" in hf and hf["num_experts"] and hf.get("num_experts_per_tok", 1) > hf["num_experts"]:
        raise ConfigError(
            f"model.num_experts_per_tok = {hf['num_experts_per_tok']} exceeds model.num_experts = "
            f"{hf['num_experts']}"
        )
    if not 0 < cfg.parallel.timeout_s <= 1e9:  # inf or more overflows the process group's timedelta
        raise ConfigError(f"parallel.timeout_s = {cfg.parallel.timeout_s} must be positive and at most 1e9 (seconds; "
                          "1e9 for no practical limit)")
    if (t.spike_factor and t.spike_factor <= 1) or t.spike_window < 1:
        raise ConfigError(f"train.spike_factor = {t.spike_factor} must be above 1 (or 0: off) and train.spike_window "
                          f"= {t.spike_window} at least 1")
    if t.param_dtype == "bf16" and t.dtype == "fp32":
        raise ConfigError("train.param_dtype = 'bf16' needs bf16 compute: set train.dtype to 'bf16' or 'auto'")
    if d.document_mask and cfg.parallel.cp > 1:
        raise ConfigError(f"data.document_mask is not supported with parallel.cp = {cfg.parallel.cp} (ring "
                          "attention has no document masks); use parallel.cp=1 or data.document_mask=false")
    if d.seq_len > hf.get("max_position_embeddings", d.seq_len):
        raise ConfigError(
            f"data.seq_len = {d.seq_len} exceeds model.max_position_embeddings = {hf['max_position_embeddings']}"
        )
