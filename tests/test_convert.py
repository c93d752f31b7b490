"""`pithtrain convert`: Hugging Face safetensors <-> DCP for every model family.

Checked here: MXFP4 dequantization against transformers' own; HF -> DCP -> HF is bit-exact
(names, dtypes, values) in bf16 and fp32; `AutoModelForCausalLM.from_pretrained` loads the export
and gives our model's logits; tensors are made one at a time on import; bad checkpoints name
the tensors that are wrong; an existing output is never written over.
"""

import gc
import json
import os
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from conftest import TINY_MODEL, run_cli  # noqa: E402
from test_hf_parity import CASES, hf_model, random_model, rel  # noqa: E402
from pithtrain.models import build_model  # noqa: E402
from pithtrain.train import checkpoint, hf  # noqa: E402
from pithtrain.train.checkpoint import CheckpointError  # noqa: E402

FAMILIES = ["qwen3-tied-unnormed", "deepseek_v2-q_lora-group_limited", "deepseek_v3", "gpt_oss"]


def save_hf(case, folder, dtype=torch.float32):
    """A transformers model with our random weights saved in several shards; returns (ours, theirs).
    `case` names a config of test_hf_parity or is one."""
    cfg = CASES[case] if isinstance(case, str) else case
    ours = random_model(cfg)
    theirs = hf_model(cfg)
    theirs.load_state_dict(ours.state_dict())
    theirs.to(dtype).save_pretrained(folder, max_shard_size="40KB")
    return ours, theirs


def read_folder(folder) -> dict[str, torch.Tensor]:
    out = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            out.update(safetensors_torch.load_file(os.path.join(folder, name)))
    return out


def test_mxfp4_dequantization_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    known = torch.tensor([[[0x21] * 16]], dtype=torch.uint8)  # low nibble 1 (0.5), high nibble 2 (1.0)
    assert torch.equal(hf.dequantize_mxfp4(known, torch.tensor([[128]], dtype=torch.uint8)).float(),
                       torch.tensor([[1.0, 2.0] * 16]))  # scale 2^(128-127)
    assert torch.equal(hf.dequantize_mxfp4(torch.tensor([[[0xF8] * 16]], dtype=torch.uint8),
                                           torch.tensor([[125]], dtype=torch.uint8)).float(),
                       torch.tensor([[-0.0, -6.0 / 4] * 16]))  # nibbles 8 (-0) and 15 (-6), scale 2^-2
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(117, 137, (3, 5, 2), generator=g, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, G*32, rows]
    ours = hf.dequantize_mxfp4(blocks, scales)  # [E, rows, G*32]
    assert torch.equal(ours.transpose(1, 2), theirs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", FAMILIES)
def test_round_trip_is_bit_exact_and_loads_in_transformers(case, dtype, tmp_path):
    src, ckpt, out = tmp_path / "hf", tmp_path / "dcp", tmp_path / "export"
    ours, _ = save_hf(case, src, dtype)
    assert len([n for n in os.listdir(src) if n.endswith(".safetensors")]) > 1
    hf.hf_to_dcp(str(src), str(ckpt))
    hf.dcp_to_hf(str(ckpt), str(out), max_shard_bytes=64 * 1024)
    before, after = read_folder(src), read_folder(out)
    assert sorted(before) == sorted(after)
    for name, t in before.items():
        assert after[name].dtype == t.dtype and torch.equal(after[name], t), name
    index = json.load(open(out / "model.safetensors.index.json"))
    assert set(index["weight_map"]) == set(after) and len(set(index["weight_map"].values())) > 1

    loaded = build_model(CASES[case])
    checkpoint.load_weights(str(ckpt), loaded)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                               attn_implementation="eager")
    ids = torch.randint(0, CASES[case]["vocab_size"], (2, 16))
    with torch.no_grad():
        assert rel(loaded(ids), theirs(input_ids=ids).logits) < 1e-5
    if dtype == torch.float32:  # nothing was rounded: the weights are the original ones
        for name, p in ours.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], p), name


def test_import_makes_one_tensor_at_a_time(tmp_path, monkeypatch):
    src = tmp_path / "hf"
    save_hf("deepseek_v3", src)
    made, most_alive = [], [0]
    original = hf._LazySavePlanner.resolve_data

    def tracked(self, item):
        gc.collect()
        most_alive[0] = max(most_alive[0], sum(r() is not None for r in made))
        t = original(self, item)
        made.append(weakref.ref(t))
        return t

    monkeypatch.setattr(hf._LazySavePlanner, "resolve_data", tracked)
    hf.hf_to_dcp(str(src), str(tmp_path / "dcp"))
    assert len(made) > 20 and most_alive[0] <= 1


def test_mxfp4_checkpoint_is_dequantized_on_import(tmp_path):
    """A GPT-OSS folder whose experts are MXFP4, as released: blocks and scales per projection."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, model_cfg = tmp_path / "hf", dict(CASES["gpt_oss"], intermediate_size=64)  # MXFP4 packs 32 values
    save_hf(model_cfg, src)
    cfg = dict(json.load(open(src / "config.json")), quantization_config={"quant_method": "mxfp4"})
    json.dump(cfg, open(src / "config.json", "w"))
    tensors, g = read_folder(src), torch.Generator().manual_seed(1)
    expected = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, cols, rows = tensors.pop(name).shape  # ours: [E, in, out]; MXFP4 packs along `in`
        blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(120, 130, (E, rows, cols // 32), generator=g, dtype=torch.uint8)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        expected[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    for name in os.listdir(src):
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            os.remove(src / name)
    safetensors_torch.save_file(tensors, str(src / "model.safetensors"))
    hf.hf_to_dcp(str(src), str(tmp_path / "dcp"))
    stored = checkpoint.stored_tensors(str(tmp_path / "dcp"))
    model = build_model(model_cfg)
    checkpoint.load_weights(str(tmp_path / "dcp"), model)
    params = dict(model.named_parameters())
    for name, want in expected.items():
        assert stored[name][1] == torch.bfloat16
        assert torch.equal(params[name].to(torch.bfloat16), want), name
    assert "quantization_config" not in json.load(open(tmp_path / "dcp" / "config.json"))


def test_bad_checkpoints_name_the_tensors(tmp_path):
    src = tmp_path / "hf"
    save_hf("qwen3", src)
    shard = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))[0]
    tensors = safetensors_torch.load_file(str(src / shard))
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    safetensors_torch.save_file(tensors, str(src / shard))
    index = json.load(open(src / "model.safetensors.index.json"))
    index["weight_map"].pop(dropped)
    index["weight_map"]["model.layers.0.extra.weight"] = shard
    json.dump(index, open(src / "model.safetensors.index.json", "w"))
    with pytest.raises(CheckpointError) as e:
        hf.hf_to_dcp(str(src), str(tmp_path / "dcp"))
    assert "missing tensors" in str(e.value) and "model.layers.0.extra.weight" in str(e.value)
    assert not (tmp_path / "dcp").exists()

    src2 = tmp_path / "hf2"
    save_hf("qwen3", src2)
    cfg = json.load(open(src2 / "config.json"))
    json.dump(dict(cfg, moe_intermediate_size=24), open(src2 / "config.json", "w"))
    with pytest.raises(CheckpointError, match=r"experts.gate_up_proj: checkpoint \[6, 32, 32\], config.json \[6, 48, 32\]"):
        hf.hf_to_dcp(str(src2), str(tmp_path / "dcp"))

    json.dump(cfg, open(src2 / "config.json", "w"))
    hf.hf_to_dcp(str(src2), str(tmp_path / "dcp"))
    wrong = build_model(dict(CASES["qwen3"], num_experts=8))
    with pytest.raises(CheckpointError, match=r"mlp.gate.weight: checkpoint \[6, 32\], model \[8, 32\]"):
        checkpoint.load_weights(str(tmp_path / "dcp"), wrong)
    with pytest.raises(CheckpointError, match="already exists"):
        hf.hf_to_dcp(str(src2), str(tmp_path / "dcp"))
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists"):
        hf.dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "export"))
    assert os.listdir(tmp_path / "export") == ["keep.txt"]
    with pytest.raises(CheckpointError, match=r"export/keep.txt/out cannot be made \(.*keep.txt is a file\)"):
        hf.dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "export" / "keep.txt" / "out"))


def test_cli_convert_and_train_from_converted_weights(tiny_corpus, tmp_path):
    """hf-to-dcp, a short run from those weights, and the run's checkpoint exported back in bf16."""
    from conftest import write_run

    src = tmp_path / "hf"
    model = random_model(dict(TINY_MODEL))
    theirs = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **{k: v for k, v in TINY_MODEL.items() if k != "model_type"}))
    theirs.load_state_dict(model.state_dict())
    theirs.save_pretrained(src)
    (src / "tokenizer.json").write_text(open(os.path.join(tiny_corpus, "tokenizer.json")).read())
    run_cli("convert", "hf-to-dcp", str(src), str(tmp_path / "dcp"))
    assert os.path.isfile(tmp_path / "dcp" / "tokenizer.json")
    r = run_cli("convert", "hf-to-dcp", str(src), str(tmp_path / "dcp"), check=False)
    assert r.returncode == 2 and "already exists" in r.stderr

    toml = write_run(tmp_path, tiny_corpus)
    r = run_cli("train", str(toml), "train.steps=2", f"checkpoint.init_from={tmp_path / 'dcp'}")
    assert "initialised from the weights of" in r.stdout + r.stderr
    # resuming from them is refused for what they lack (optimizer state), not for the config.json
    # fields the export wrote there (dtype), which are checked after
    r = run_cli("train", str(toml), "train.steps=2", f"log.run_dir={tmp_path / 'again'}",
                f"checkpoint.resume={tmp_path / 'dcp'}", check=False)
    assert r.returncode == 2 and "holds weights only" in r.stderr and "Traceback" not in r.stderr, r.stderr
    step = checkpoint.latest(str(tmp_path / "run" / "checkpoints"))
    run_cli("convert", "dcp-to-hf", step, str(tmp_path / "export"), "--dtype", "bf16", "--tokenizer", str(src))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    assert back.dtype == torch.bfloat16 and os.path.isfile(tmp_path / "export" / "tokenizer.json")
    trained = build_model(dict(TINY_MODEL))
    checkpoint.load_weights(step, trained)
    moved = (trained.model.embed_tokens.weight - model.model.embed_tokens.weight).abs().max()
    assert 0 < moved < 0.1  # trained two steps from the converted weights, not from scratch
    assert torch.equal(back.model.embed_tokens.weight, trained.model.embed_tokens.weight.to(torch.bfloat16))

    # the training checkpoint holds its corpus's tokenizer, so the export takes it along by default,
    # with a tokenizer_config.json under which transformers encodes text as the corpus did
    assert os.path.isfile(os.path.join(step, "tokenizer.json"))
    run_cli("convert", "dcp-to-hf", step, str(tmp_path / "export2"))
    from tokenizers import Tokenizer
    text = "Some  text,   spaced out: 12345 and MORE words!\nA second line."
    corpus_ids = Tokenizer.from_file(os.path.join(tiny_corpus, "tokenizer.json")).encode(text).ids
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "export2"))
    assert exported(text)["input_ids"] == corpus_ids
    assert exported.eos_token == "<|endoftext|>"  # no eos_token_id in the config: the corpus's end of text
    r = run_cli("convert", "dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "export3"), "--config",
                str(src / "config.json"))
    assert "tokenizer.json" in r.stdout and "tokenizer_config.json" in r.stdout  # the converted DCP's, completed
    os.remove(src / "tokenizer.json")
    run_cli("convert", "hf-to-dcp", str(src), str(tmp_path / "bare"))
    r = run_cli("convert", "dcp-to-hf", str(tmp_path / "bare"), str(tmp_path / "export4"))
    assert "no tokenizer files in" in r.stderr and "pass --tokenizer" in r.stderr
    assert "no token of the vocabulary" not in r.stderr
    for bad in ("", str(tmp_path / "new") + "/."):  # an unset $OUT: refused before anything is written
        r = run_cli("convert", "dcp-to-hf", step, bad, check=False)
        assert r.returncode == 2 and "names no new folder" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".partial-")]
    shrunk = tmp_path / "shrunk.json"  # a full-size config's special ids kept when its vocab_size was shrunk
    shrunk.write_text(json.dumps({**json.loads(open(os.path.join(step, "config.json")).read()),
                                  "eos_token_id": [3, 151645], "bos_token_id": 99999}))
    r = run_cli("convert", "dcp-to-hf", step, str(tmp_path / "export5"), "--config", str(shrunk))
    assert ("bos_token_id = 99999 (vocab_size 512), eos_token_id = 151645 (vocab_size 512): no token of the "
            "vocabulary") in r.stderr, r.stderr


def test_deepseek_v3_prediction_layers_are_ignored_on_import(tmp_path):
    """DeepSeek-V3 releases carry multi-token-prediction layers past num_hidden_layers; transformers
    ignores them, and so does the import (an extra tensor elsewhere is still an error)."""
    src = tmp_path / "hf"
    save_hf("deepseek_v3", src)
    extra = {"model.layers.3.eh_proj.weight": torch.zeros(4, 4), "model.layers.3.enorm.weight": torch.ones(4)}
    safetensors_torch.save_file(extra, str(src / "mtp.safetensors"))
    index = json.load(open(src / "model.safetensors.index.json"))
    index["weight_map"].update({n: "mtp.safetensors" for n in extra})
    json.dump(index, open(src / "model.safetensors.index.json", "w"))
    info = hf.hf_to_dcp(str(src), str(tmp_path / "dcp"))
    assert not any(n.startswith("model.layers.3.") for n in checkpoint.stored_tensors(str(tmp_path / "dcp")))
    assert info["tensors"] == len(checkpoint.stored_tensors(str(tmp_path / "dcp")))


def test_shard_size_parsing():
    from pithtrain.cli import parse_size
    from pithtrain.config import ConfigError

    assert parse_size("5GB") == 5 * 10**9 and parse_size("1.5gib") == 3 * 2**29  # transformers' reading
    assert parse_size("500MB") == 500 * 10**6 and parse_size("4096") == 4096 and parse_size("2KiB") == 2048
    for bad in ["0", "-5GB", "abcGB", "5 GiBs", "", "0MB", "1.5", "infGB", "1e400GB", "nanMB"]:
        with pytest.raises(ConfigError, match="max-shard-size"):
            parse_size(bad)


def test_deepseek_without_shared_experts_round_trips(tmp_path):
    """n_shared_experts = 0: transformers builds (and saves) zero-width shared experts, we build none;
    the import ignores those empty tensors and the export loads back into transformers."""
    cfg = dict(CASES["deepseek_v3"], n_shared_experts=0)
    ours, theirs = random_model(cfg), hf_model(cfg)
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and missing and all(".shared_experts." in n for n in missing)
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    hf.hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"))
    assert not any("shared_experts" in n for n in checkpoint.stored_tensors(str(tmp_path / "dcp")))
    loaded = build_model(cfg)
    checkpoint.load_weights(str(tmp_path / "dcp"), loaded)
    ids = torch.randint(0, cfg["vocab_size"], (2, 12))
    with torch.no_grad():
        assert rel(loaded(ids), theirs(ids).logits) < 1e-5
    hf.dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "out"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    with torch.no_grad():
        assert rel(back(ids).logits, theirs(ids).logits) < 1e-5
    # trained shared experts under a config.json that says none: named, never dropped
    hf_model(dict(CASES["deepseek_v3"], n_shared_experts=1)).save_pretrained(tmp_path / "edited")
    (tmp_path / "edited" / "config.json").write_text(json.dumps(
        {**json.loads((tmp_path / "edited" / "config.json").read_text()), "n_shared_experts": 0}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors .*shared_experts"):
        hf.hf_to_dcp(str(tmp_path / "edited"), str(tmp_path / "dcp2"))


def write_hub(folder, cfg, tweak=lambda tensors: None, file="model.safetensors"):
    """A hub-form folder (one tensor per expert) of a random model of `cfg`, `tweak`ed before saving."""
    os.makedirs(folder, exist_ok=True)
    model, layout = random_model(cfg), hf.expected_tensors(cfg)
    tensors = {}
    for n, t in model.state_dict().items():
        if n in layout:
            tensors.update(hf._hub_tensors(n, t, layout[n][1]))
    tweak(tensors)
    safetensors_torch.save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(folder, file))
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
    return tensors


def test_malformed_hub_folders_are_refused_and_leave_nothing(tmp_path):
    """One expert of another shape, a tied config whose folder holds a different head, a stale
    second file without an index, an index that puts a tensor in the wrong file, MXFP4 scales of
    the wrong shape and a quantization_config that is not an object: each is a CheckpointError that
    says what is wrong, and no output (or temporary folder) is left."""
    qwen = dict(CASES["qwen3"])
    cases = {}

    def narrow(t):
        t["model.layers.0.mlp.experts.3.up_proj.weight"] = t["model.layers.0.mlp.experts.3.up_proj.weight"][:, :-2]
    write_hub(tmp_path / "shape", qwen, narrow)
    cases["shape"] = "experts differ from model.layers.0.mlp.experts.0.gate_proj.weight"

    def other_head(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1
    write_hub(tmp_path / "tied", dict(qwen, tie_word_embeddings=True), other_head)
    cases["tied"] = "lm_head.weight differs from model.embed_tokens.weight; set tie_word_embeddings to false"

    tensors = write_hub(tmp_path / "stale", qwen)
    safetensors_torch.save_file({"model.norm.weight": torch.zeros_like(tensors["model.norm.weight"])},
                                str(tmp_path / "stale" / "model_old.safetensors"))
    cases["stale"] = "model.norm.weight is in both model.safetensors and model_old.safetensors"

    tensors = write_hub(tmp_path / "index", qwen)
    safetensors_torch.save_file({"x": torch.zeros(1)}, str(tmp_path / "index" / "other.safetensors"))
    json.dump({"weight_map": {**{n: "model.safetensors" for n in tensors}, "model.norm.weight": "other.safetensors"}},
              open(tmp_path / "index" / "model.safetensors.index.json", "w"))
    cases["index"] = "puts 1 tensor\\(s\\) in other.safetensors, which lacks them \\(model.norm.weight\\)"

    gpt = dict(CASES["gpt_oss"], intermediate_size=64, quantization_config={"quant_method": "mxfp4"})

    def mxfp4(t):
        for name in [n for n in t if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            E, cols, rows = t.pop(name).shape
            t[name + "_blocks"] = torch.zeros(E, rows, cols // 32, 16, dtype=torch.uint8)
            t[name + "_scales"] = torch.zeros(E, rows, 1, dtype=torch.uint8)  # one group, not cols // 32
    write_hub(tmp_path / "mxfp4", gpt, mxfp4)
    cases["mxfp4"] = "are not MXFP4"

    write_hub(tmp_path / "quant", dict(qwen, quantization_config="fp8"))
    cases["quant"] = "quantization_config is 'fp8', expected an object"

    for name, message in cases.items():
        with pytest.raises(CheckpointError, match=message):
            hf.hf_to_dcp(str(tmp_path / name), str(tmp_path / f"{name}-dcp"))
        assert not [n for n in os.listdir(tmp_path) if n.startswith((f"{name}-dcp", f".partial-{name}-dcp"))], name


def test_export_shards_stay_under_the_limit_and_dcp_options_belong_to_dcp_to_hf(tmp_path):
    """The shard limit counts the tensors written (one expert each), not our stacked ones; an export
    of a model trained with moe.aux_free (a correction bias transformers' Qwen3 has no place for) is
    refused, and such a model starts from converted weights with zero biases; the dcp-to-hf options
    given to hf-to-dcp are refused."""
    from pithtrain.layers.moe import BalanceOptions

    src = tmp_path / "hf"
    write_hub(src, dict(CASES["qwen3"]))
    hf.hf_to_dcp(str(src), str(tmp_path / "dcp"))
    info = hf.dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "out"), max_shard_bytes=8192)
    sizes = [os.path.getsize(tmp_path / "out" / n) for n in os.listdir(tmp_path / "out") if n.endswith(".safetensors")]
    largest = max(t.numel() * t.element_size() for t in read_folder(tmp_path / "out").values())
    assert info["shards"] == len(sizes) > 2 and max(sizes) <= max(8192, largest) + 4096  # + the file's header
    assert read_folder(tmp_path / "out").keys() == read_folder(src).keys()
    mask = os.umask(0)
    os.umask(mask)
    for made in (tmp_path / "out", tmp_path / "dcp"):  # as a plain mkdir / open would make them, not mkdtemp's 0700
        assert os.stat(made).st_mode & 0o777 == 0o777 & ~mask
        assert all(os.stat(made / n).st_mode & 0o777 == 0o666 & ~mask for n in os.listdir(made))

    free = build_model(dict(CASES["qwen3"]), BalanceOptions(aux_free=True))
    checkpoint.load_weights(str(tmp_path / "dcp"), free)
    assert all(m.e_score_correction_bias.abs().sum() == 0 for m in free.modules()
               if getattr(m, "e_score_correction_bias", None) is not None)
    path = checkpoint.save(str(tmp_path / "ckpts"), 1, free, torch.optim.AdamW(free.parameters()), {}, keep=1,
                           hf_config=dict(CASES["qwen3"]))
    with pytest.raises(CheckpointError, match="e_score_correction_bias .* qwen3_moe in transformers has no place"):
        hf.dcp_to_hf(path, str(tmp_path / "free-out"))
    proc = run_cli("convert", "hf-to-dcp", str(src), str(tmp_path / "dcp2"), "--dtype", "bf16", check=False)
    assert proc.returncode == 2 and "--dtype: dcp-to-hf options" in proc.stderr and not (tmp_path / "dcp2").exists()


def test_exports_that_transformers_would_read_otherwise(tmp_path):
    """A DeepSeek config with moe_layer_freq != 1 (transformers ignores the field) is not exported;
    a bf16 export leaves the tensors transformers keeps in fp32 (DeepSeek-V3's router weight and
    correction bias) as stored; a GPT-OSS cut with fewer layers than its layer_types exports one
    type per layer and loads; a tokenizer's folder of chat templates travels both ways."""
    def saved(cfg, name):
        model = build_model(cfg)
        return checkpoint.save(str(tmp_path / name), 1, model, torch.optim.AdamW(model.parameters()), {}, keep=1,
                               hf_config=cfg)

    from conftest import DEEPSEEK_V2, GPT_OSS

    every_other = saved(dict(DEEPSEEK_V2, moe_layer_freq=2, num_hidden_layers=4), "freq")
    with pytest.raises(CheckpointError, match="moe_layer_freq = 2, which transformers ignores"):
        hf.dcp_to_hf(every_other, str(tmp_path / "freq-out"))
    assert not (tmp_path / "freq-out").exists()

    src = tmp_path / "hf"
    save_hf("deepseek_v3", src)
    tok = tmp_path / "tok"
    (tok / "additional_chat_templates").mkdir(parents=True)
    (tok / "tokenizer.json").write_text("{}")
    (tok / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    hf.hf_to_dcp(str(src), str(tmp_path / "dcp"), tokenizer=str(tok))
    checkpoint.verify(str(tmp_path / "dcp"), checksums=True)  # the folder's file is in the marker
    hf.dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "bf16"), dtype=torch.bfloat16)
    assert (tmp_path / "bf16" / "additional_chat_templates" / "tool_use.jinja").read_text() == "{{ tools }}"
    kept = {n: t.dtype for n, t in read_folder(tmp_path / "bf16").items()}
    assert {n for n, d in kept.items() if d == torch.float32} == {
        n for n in kept if n.endswith(("mlp.gate.weight", "e_score_correction_bias"))} != set()
    assert all(d in (torch.float32, torch.bfloat16) for d in kept.values())
    assert json.load(open(tmp_path / "bf16" / "config.json"))["dtype"] == "bfloat16"

    cut = dict(GPT_OSS, num_hidden_layers=2)  # layer_types still lists 3
    hf.dcp_to_hf(saved(cut, "gpt"), str(tmp_path / "gpt-out"))
    assert json.load(open(tmp_path / "gpt-out" / "config.json"))["layer_types"] == GPT_OSS["layer_types"][:2]
    transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "gpt-out"), dtype=torch.float32)
