"""Hugging Face safetensors folders <-> PithTrain DCP checkpoints (`pithtrain convert`).

`hf_to_dcp(src, out)`: reads `src/config.json` and the safetensors shards (with or without
`model.safetensors.index.json`), maps every tensor to our parameter names and writes a DCP
checkpoint `out/` holding `model.*` only (plus config.json, tokenizer files, complete.json), which
`checkpoint.init_from` loads into any layout. Tensors are read one at a time from memory-mapped
shards while DCP writes them (`_LazySavePlanner`), so memory holds about one tensor, never the
model. Dtypes are kept as stored; MXFP4 experts (GPT-OSS) become bf16.

`dcp_to_hf(ckpt, out)`: the reverse, from a converted or a training checkpoint, a group of
tensors up to `max_shard_bytes` at a time (counted over the tensors written, one expert each):
sharded safetensors, `model.safetensors.index.json`, config.json and tokenizer files (with a
folder of named chat templates), loadable by `transformers.AutoModelForCausalLM.from_pretrained`.
A `dtype` casts every floating tensor but those transformers keeps in fp32 (`KEEP_AS_STORED`); a
GPT-OSS cut of fewer layers than its `layer_types` exports the first ones; a DeepSeek config with
`moe_layer_freq` != 1, which transformers ignores, is refused.

Name mapping (ours = transformers' in-memory names):
- everything but routed experts: same name;
- Qwen3-MoE / DeepSeek experts: hub checkpoints store each expert (`...experts.{e}.gate_proj.weight`,
  `up_proj`, `down_proj`); ours stack them (`gate_up_proj` [E, 2I, H] = [gate; up], `down_proj`);
  export writes the per-expert form;
- GPT-OSS experts: `gate_up_proj_blocks` / `_scales` (MXFP4) are dequantized and transposed to our
  [E, H, 2I]; bf16 checkpoints already use our names, and export writes those.
Ignored on import: `rotary_emb.inv_freq` buffers, DeepSeek-V3's multi-token-prediction layers
(indices >= num_hidden_layers), which transformers ignores too, and the zero-width shared experts
that transformers saves for a DeepSeek config with `n_shared_experts = 0`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from pithtrain.config import fsync_path, unwritable
from pithtrain.models import build_model
from pithtrain.train.checkpoint import (CheckpointError, check_tensors, finalize_dir, quiet, stored_tensors,
                                       verify)

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json"]
TOKENIZER_FOLDERS = ["additional_chat_templates"]  # transformers 5: one .jinja file per named chat template
GENERATION_CONFIG = "generation_config.json"
# Tensors that transformers keeps in fp32 whatever dtype the model loads in (its _keep_in_fp32_modules_strict):
# an export cast to another dtype leaves them as stored
KEEP_AS_STORED = {"deepseek_v2": ("mlp.gate.weight",), "deepseek_v3": ("mlp.gate.weight", "e_score_correction_bias")}
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "U8": torch.uint8, "I8": torch.int8, "I32": torch.int32, "I64": torch.int64}
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """MXFP4 -> `dtype`. blocks [..., G, 16] uint8 hold 32 FP4 (e2m1) values per group, the low
    nibble first; scales [..., G] uint8 are the groups' power-of-two exponents biased by 127.
    Returns [..., G * 32]. Every result is exact in bf16."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)
    values = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None].float())
    return values.flatten(-2).to(dtype)


# ----------------------------------------------------------------------------------------------
# Reading a Hugging Face folder


class SafetensorsFolder:
    """The tensors of a HF folder by name, read one at a time from memory-mapped shards."""

    def __init__(self, folder: str):
        from safetensors import safe_open

        self.folder, self._open, self._handles = folder, safe_open, {}
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    self.files = dict(json.load(f)["weight_map"])
            except (ValueError, KeyError, TypeError) as e:  # bad JSON, no weight_map
                raise CheckpointError(f"{index} is not a valid safetensors index (a JSON object with a "
                                      f"'weight_map'): {type(e).__name__}: {e}; re-download or repair it") from None
            self._check_index()
        else:
            shards = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
            if not shards:
                raise CheckpointError(f"{folder} holds no .safetensors files")
            self.files = {}
            for shard in shards:
                for name in self._handle(shard).keys():
                    if name in self.files:
                        raise CheckpointError(f"{folder}: {name} is in both {self.files[name]} and {shard} and there "
                                              "is no model.safetensors.index.json to say which is the model's; remove "
                                              "the stale file")
                    self.files[name] = shard

    def _handle(self, shard: str):
        if shard not in self._handles:
            path = os.path.join(self.folder, shard)
            try:
                self._handles[shard] = self._open(path, framework="pt")
            except Exception as e:  # SafetensorError: truncated or not safetensors
                raise CheckpointError(f"{path} is not a readable safetensors file ({e}); it may be truncated: "
                                      f"re-download it") from None
        return self._handles[shard]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.files[name]).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        code = self._handle(self.files[name]).get_slice(name).get_dtype()
        if code not in DTYPES:
            raise CheckpointError(f"{name}: dtype {code} is not supported")
        return DTYPES[code]

    def read(self, name: str) -> torch.Tensor:
        return self._handle(self.files[name]).get_tensor(name)

    def _check_index(self) -> None:
        """Every tensor the index names is in the shard it names (the shards named exist)."""
        missing = sorted({s for s in self.files.values() if not os.path.isfile(os.path.join(self.folder, s))})
        if missing:
            raise CheckpointError(f"{self.folder}: the index names shards that are not there: {missing}")
        for shard in sorted(set(self.files.values())):
            held = set(self._handle(shard).keys())
            lacking = sorted(n for n, s in self.files.items() if s == shard and n not in held)
            if lacking:
                raise CheckpointError(f"{self.folder}: model.safetensors.index.json puts {len(lacking)} tensor(s) in "
                                      f"{shard}, which lacks them ({', '.join(lacking[:5])}); re-download the folder")


class _Source:
    """How one of our tensors is made from HF tensors: `names` read, `make()` builds it."""

    def __init__(self, names: list[str], shape: tuple, dtype: torch.dtype, make):
        self.names, self.shape, self.dtype, self.make = names, shape, dtype, make


def _source(name: str, want: tuple, hf: SafetensorsFolder, transposed: bool) -> _Source | None:
    if name in hf:
        return _Source([name], hf.shape(name), hf.dtype(name), lambda: hf.read(name))
    m = EXPERTS.match(name)
    if m is None:
        return None
    prefix, which = m.groups()
    if f"{name}_blocks" in hf and f"{name}_scales" in hf:  # GPT-OSS MXFP4
        blocks, scales = f"{name}_blocks", f"{name}_scales"
        shape_b, shape_s = hf.shape(blocks), hf.shape(scales)
        if (len(shape_b) != 4 or shape_b[3] != 16 or shape_s != shape_b[:3]
                or {hf.dtype(blocks), hf.dtype(scales)} != {torch.uint8}):
            raise CheckpointError(f"{blocks} {list(shape_b)} / {scales} {list(shape_s)} are not MXFP4 (uint8 blocks "
                                  "[experts, rows, groups, 16] and uint8 scales [experts, rows, groups])")
        E, rows, G, _ = shape_b

        def dequantized():
            b, s = hf.read(blocks), hf.read(scales)
            out = torch.empty(E, G * 32, rows, dtype=torch.bfloat16)
            for e in range(E):
                out[e] = dequantize_mxfp4(b[e], s[e]).T
            return out

        return _Source([blocks, scales], (E, G * 32, rows), torch.bfloat16, dequantized)
    if transposed:
        return None
    parts = ["gate_proj", "up_proj"] if which == "gate_up_proj" else ["down_proj"]
    names = [f"{prefix}.{e}.{p}.weight" for e in range(want[0]) for p in parts]
    if not all(n in hf for n in names):
        return None
    first, dtype = hf.shape(names[0]), hf.dtype(names[0])
    odd = [f"{n} {list(hf.shape(n))} {hf.dtype(n)}" for n in names if hf.shape(n) != first or hf.dtype(n) != dtype]
    if odd:
        raise CheckpointError(f"experts differ from {names[0]} {list(first)} {dtype}: " + ", ".join(odd[:5]))
    shape = (want[0], first[0] * len(parts), first[1])

    def stacked():
        out = torch.empty(shape, dtype=hf.dtype(names[0]))
        for i, n in enumerate(names):
            e, p = divmod(i, len(parts))
            out[e, p * first[0]:(p + 1) * first[0]] = hf.read(n)
        return out

    return _Source(names, shape, hf.dtype(names[0]), stacked)


def _ignored(name: str, hf_config: dict, hf: SafetensorsFolder) -> bool:
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if ".mlp.shared_experts." in name and not hf_config.get("n_shared_experts", 1) and 0 in hf.shape(name):
        return True  # DeepSeek without shared experts: transformers saves them zero-width (others: unexpected)
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return hf_config.get("model_type") == "deepseek_v3" and m is not None and \
        int(m.group(1)) >= hf_config["num_hidden_layers"]


def expected_tensors(hf_config: dict) -> dict[str, tuple[tuple, bool]]:
    """Our state-dict names -> (shape, experts transposed) for this config, on the meta device.
    A tied lm_head is left out: it is the embedding."""
    try:
        with torch.device("meta"):
            model = build_model(hf_config)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"config.json does not describe a supported model: {e}") from None
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    out = {}
    for mod_name, module in model.named_modules():
        transposed = getattr(module, "transposed", False)
        for t_name, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            full = f"{mod_name}.{t_name}" if mod_name else t_name
            if t_name in module._non_persistent_buffers_set or (tied and full == "lm_head.weight"):
                continue
            out.setdefault(full, (tuple(t.shape), transposed))
    return out


def read_hf_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{folder} has no config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except ValueError as e:  # bad JSON or bytes
        raise CheckpointError(f"{path} is not valid JSON ({e}); re-download or repair it") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path} is not a JSON object; re-download or repair it")
    quant = cfg.get("quantization_config") or {}
    if not isinstance(quant, dict):
        raise CheckpointError(f"{path}: quantization_config is {quant!r}, expected an object with a quant_method")
    quant = quant.get("quant_method")
    if quant not in (None, "mxfp4"):
        raise CheckpointError(f"{path}: quantization {quant!r} is not supported; convert a bf16/fp32 checkpoint "
                              f"(MXFP4 GPT-OSS experts are dequantized on import)")
    return cfg


def plan_import(src: str, hf_config: dict) -> dict[str, _Source]:
    """Our name -> source, after checking that the folder has exactly the tensors of the config."""
    hf = SafetensorsFolder(src)
    sources, missing, mismatched, used = {}, [], [], set()
    for name, (shape, transposed) in expected_tensors(hf_config).items():
        s = _source(name, shape, hf, transposed)
        if s is None:
            missing.append(name)
            continue
        used.update(s.names)
        if tuple(s.shape) != shape:
            mismatched.append(f"{name}: checkpoint {list(s.shape)}, config.json {list(shape)}")
        sources[name] = s
    tied_head = hf_config.get("tie_word_embeddings") and "lm_head.weight" in hf
    if tied_head and not torch.equal(hf.read("lm_head.weight"), hf.read("model.embed_tokens.weight")):
        raise CheckpointError(f"{src}: config.json ties the head to the embedding (tie_word_embeddings) but the "
                              "folder's lm_head.weight differs from model.embed_tokens.weight; set "
                              "tie_word_embeddings to false in config.json to keep both")
    unexpected = sorted(n for n in hf.files if n not in used and not _ignored(n, hf_config, hf)
                        and not (tied_head and n == "lm_head.weight"))
    problems = []
    if mismatched:
        problems.append("shapes differ from config.json:\n  " + "\n  ".join(mismatched))
    if missing:
        problems.append(f"missing tensors ({len(missing)}): " + ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else ""))
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): " + ", ".join(unexpected[:20])
                        + (" ..." if len(unexpected) > 20 else ""))
    if problems:
        raise CheckpointError(f"{src} does not match its config.json ({hf_config.get('model_type')}):\n"
                              + "\n".join(problems))
    return sources


class _LazySavePlanner(DefaultSavePlanner):
    """DCP planner over meta-tensor placeholders: each tensor is made when DCP writes it."""

    def __init__(self, sources: dict[str, _Source]):
        super().__init__()
        self.sources = sources

    def resolve_data(self, write_item):
        return self.sources[write_item.index.fqn.removeprefix("model.")].make()


def _settle(folder: str) -> None:
    """Before the rename: give `folder` and its files the permissions a plain mkdir / open would
    (mkdtemp's are 0700), and flush the files to disk, so the renamed folder is never half-written."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(folder, 0o777 & ~mask)
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isdir(path):  # a tokenizer's folder of chat templates
            _settle(path)
        elif os.path.isfile(path):
            os.chmod(path, 0o666 & ~mask)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _fresh_output(out: str) -> str:
    """A new temporary folder beside `out` (its own name, so two conversions never share one)."""
    if os.path.basename(out.rstrip("/")) in ("", ".", ".."):  # an unset $OUT: no folder of that name can be made
        raise CheckpointError(f"output {out!r} names no new folder; give a path such as runs/export (nothing was "
                              "written)")
    if os.path.exists(out):
        raise CheckpointError(f"{out} already exists; choose a new output directory (nothing was written)")
    if why := unwritable(out):
        raise CheckpointError(f"{out} cannot be made ({why}); choose another output directory (nothing was written)")
    parent = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)
        return tempfile.mkdtemp(prefix=f".partial-{os.path.basename(os.path.abspath(out))}-", dir=parent)
    except OSError as e:
        raise CheckpointError(f"{out} cannot be made ({e}); choose another output directory") from None


def _extra_files(src: str, tokenizer: str | None) -> list[str]:
    """Paths of the files to copy along: the tokenizer's from `tokenizer` (default: `src`), which must
    hold some if given, and generation_config.json from `src` (else from `tokenizer`)."""
    folder = tokenizer or src
    found = [os.path.join(folder, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))]
    found += [os.path.join(folder, n) for n in TOKENIZER_FOLDERS if found and os.path.isdir(os.path.join(folder, n))]
    if tokenizer is not None and not found:
        raise CheckpointError(f"--tokenizer {tokenizer} is not a folder holding tokenizer files (looked for "
                              f"{', '.join(TOKENIZER_FILES)}); nothing was written")
    generation = [p for p in (os.path.join(src, GENERATION_CONFIG), os.path.join(folder, GENERATION_CONFIG))
                  if os.path.isfile(p)]
    return found + generation[:1]


def _copy_files(paths: list[str], dst: str) -> list[str]:
    for p in paths:
        (shutil.copytree if os.path.isdir(p) else shutil.copy2)(p, os.path.join(dst, os.path.basename(p)))
    return [os.path.basename(p) for p in paths]


def hf_to_dcp(src: str, out: str, tokenizer: str | None = None) -> dict:
    """Convert a Hugging Face folder to a DCP checkpoint at `out` (which must not exist)."""
    hf_config = read_hf_config(src)
    extra = _extra_files(src, tokenizer)
    sources = plan_import(src, hf_config)
    tmp = _fresh_output(out)
    try:
        state = {"model": {n: torch.empty(s.shape, dtype=s.dtype, device="meta") for n, s in sources.items()}}
        with quiet():
            dcp.save(state, checkpoint_id=tmp, planner=_LazySavePlanner(sources))
        hf_config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
        copied = _copy_files(extra, tmp)
        _settle(tmp)
        finalize_dir(tmp, out, {"source": os.path.abspath(src), "tensors": len(sources)})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"tensors": len(sources), "tokenizer_files": copied}


# ----------------------------------------------------------------------------------------------
# Writing a Hugging Face folder


def check_against_config(ckpt: str, hf_config: dict) -> dict[str, tuple[tuple, torch.dtype]]:
    """The checkpoint's model tensors (shape, dtype), checked against the model of `hf_config`."""
    have = stored_tensors(ckpt)
    if hf_config.get("tie_word_embeddings") and "lm_head.weight" in have and "model.embed_tokens.weight" in have:
        pair = {n: torch.empty(have[n][0], dtype=have[n][1]) for n in ("lm_head.weight", "model.embed_tokens.weight")}
        with quiet():
            dcp.load({"model": pair}, checkpoint_id=ckpt)
        if not torch.equal(*pair.values()):  # a tied export would drop the trained head
            raise CheckpointError(f"{ckpt}: the config ties the head to the embedding (tie_word_embeddings) but the "
                                  "checkpoint's lm_head.weight differs from model.embed_tokens.weight (trained "
                                  "untied); export with a config whose tie_word_embeddings is false to keep both")
        del have["lm_head.weight"]
    expected = expected_tensors(hf_config)
    if hf_config.get("model_type") in ("deepseek_v2", "deepseek_v3") and hf_config.get("moe_layer_freq", 1) != 1:
        raise CheckpointError(f"{ckpt}: its config has moe_layer_freq = {hf_config['moe_layer_freq']}, which "
                              "transformers ignores (it puts experts on every layer from first_k_dense_replace on): "
                              "the exported model would not be this one, so it is not exported")
    biases = sorted(n for n in have if n.endswith(".e_score_correction_bias") and n not in expected)
    if biases:
        raise CheckpointError(f"{ckpt}: its routers carry e_score_correction_bias ({biases[0]}, ...: trained with "
                              f"moe.aux_free=true), which {hf_config.get('model_type')} in transformers has no place "
                              "for: the exported model would choose other experts, so it is not exported")
    check_tensors(ckpt, {n: s for n, (s, _) in have.items()}, {n: s for n, (s, _) in expected.items()})
    return have


def _hub_tensors(name: str, t: torch.Tensor, transposed: bool) -> dict[str, torch.Tensor]:
    m = EXPERTS.match(name)
    if m is None or transposed:
        return {name: t}
    prefix, which = m.groups()
    if which == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": t[e] for e in range(t.shape[0])}
    half = t.shape[1] // 2
    out = {}
    for e in range(t.shape[0]):
        out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :half]
        out[f"{prefix}.{e}.up_proj.weight"] = t[e, half:]
    return out


def dcp_to_hf(ckpt: str, out: str, hf_config: dict | None = None, tokenizer: str | None = None,
              dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 10**9) -> dict:
    """Convert DCP checkpoint `ckpt` to a Hugging Face folder `out` (which must not exist).

    `hf_config` defaults to `ckpt/config.json`; `dtype` (default: as stored) casts floating tensors.
    """
    from safetensors.torch import save_file

    verify(ckpt, checksums=True)
    extra = _extra_files(ckpt, tokenizer)
    if hf_config is None:
        hf_config = read_hf_config(ckpt)
    have = check_against_config(ckpt, hf_config)
    layout = {n: transposed for n, (_, transposed) in expected_tensors(hf_config).items()}
    names = list(layout)
    keep = KEEP_AS_STORED.get(hf_config.get("model_type"), ())
    out_dtype = {n: dtype if dtype is not None and have[n][1].is_floating_point and not n.endswith(keep)
                 else have[n][1] for n in names}
    shards, size = [[]], 0  # planned over the tensors written (one expert each), so no file outgrows the limit
    for n in names:
        meta = torch.empty(have[n][0], dtype=out_dtype[n], device="meta")
        for hub, t in _hub_tensors(n, meta, layout[n]).items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((hub, n))
            size += nbytes
    tmp = _fresh_output(out)
    try:
        weight_map, total, loaded = {}, 0, {}
        for i, group in enumerate(shards):
            needed = [n for n in dict.fromkeys(n for _, n in group) if n not in loaded]
            state = {"model": {n: torch.empty(have[n][0], dtype=have[n][1]) for n in needed}}
            if needed:
                with quiet():
                    dcp.load(state, checkpoint_id=ckpt)
            loaded = {n: loaded[n] for n in loaded if n == group[0][1]}  # a tensor split over files stays
            loaded.update({n: _hub_tensors(n, t.to(out_dtype[n]), layout[n]) for n, t in state["model"].items()})
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {hub: loaded[n][hub].contiguous() for hub, n in group}
            for hub, t in tensors.items():
                weight_map[hub] = file
                total += t.numel() * t.element_size()
            save_file(tensors, os.path.join(tmp, file), metadata={"format": "pt"})
            del state, tensors
        _write_hf_folder_rest(tmp, weight_map, total, hf_config, out_dtype, dtype)
        copied = _copy_files(extra, tmp)
        if "tokenizer.json" in copied and "tokenizer_config.json" not in copied:
            copied.append(_tokenizer_config(tmp, hf_config))
        _settle(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(out):
        raise CheckpointError(f"{out} appeared while converting; the result is left in {tmp}")
    fsync_path(tmp)
    os.replace(tmp, out)
    fsync_path(os.path.dirname(os.path.abspath(out)))
    return {"shards": len(shards), "tensors": len(weight_map), "tokenizer_files": copied,
            "outside_vocab": _special_ids_outside(hf_config)}


def _special_ids_outside(hf_config: dict) -> list[str]:
    """The bos / eos token ids of `hf_config` that name no row of its vocabulary (a full-size config
    whose vocab_size was shrunk keeps its published ids): transformers would never emit or stop on
    them. Training reads neither (the corpus has its own end-of-text), so they are said, not refused."""
    vocab, found = hf_config.get("vocab_size"), []
    for key in ("bos_token_id", "eos_token_id"):
        ids = hf_config.get(key)
        for i in ids if isinstance(ids, list) else [ids]:
            if isinstance(i, int) and isinstance(vocab, int) and not 0 <= i < vocab:
                found.append(f"{key} = {i} (vocab_size {vocab})")
    return found


def _tokenizer_config(folder: str, hf_config: dict) -> str:
    """Write the tokenizer_config.json that a bare tokenizer.json (a corpus's, as training checkpoints
    hold) lacks: without one, transformers picks the tokenizer class of the model type (Qwen2's for
    Qwen3-MoE), which replaces the file's pre-tokenizer with its own and encodes text differently.
    The generic class loads the file as it is; the special tokens are the model config's, and
    without an eos_token_id there, the end-of-text token build-corpus takes (`find_eos_id`)."""
    from tokenizers import Tokenizer

    from pithtrain.train.corpus import CorpusError, find_eos_id

    spec = {"tokenizer_class": "PreTrainedTokenizerFast"}
    try:
        tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    except Exception:  # noqa: BLE001 (the file is copied as given; one transformers cannot read names no tokens)
        tok = None
    for key in ("bos", "eos", "pad"):
        ids = hf_config.get(f"{key}_token_id")
        ids = ids[0] if isinstance(ids, list) and ids else ids
        token = tok.id_to_token(ids) if tok is not None and isinstance(ids, int) and ids >= 0 else None
        if token is None and key == "eos" and tok is not None:
            try:
                token = tok.id_to_token(find_eos_id(tok))
            except CorpusError:
                pass
        if token is not None:
            spec[f"{key}_token"] = token
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(spec, f, indent=1)
    return "tokenizer_config.json"


def _write_hf_folder_rest(tmp: str, weight_map: dict, total: int, hf_config: dict, out_dtype: dict,
                          dtype: torch.dtype | None) -> None:
    """The index and config.json of a Hugging Face folder."""
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    config.setdefault("architectures", [ARCHITECTURES[config["model_type"]]])
    if isinstance(config.get("layer_types"), list):  # a cut of a deeper model (fewer layers): transformers wants one each
        config["layer_types"] = config["layer_types"][:config["num_hidden_layers"]]
    stored = {t for n, t in out_dtype.items() if t.is_floating_point}
    if dtype is not None or len(stored) == 1:
        config["torch_dtype"] = config["dtype"] = str(dtype or stored.pop()).removeprefix("torch.")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
