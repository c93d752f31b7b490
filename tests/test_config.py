import json
import os

import pytest

from pithtrain.config import ConfigError, load_config

HF = {"model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 32, "num_attention_heads": 4,
      "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 512,
      "rope_theta": 10000.0, "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2}


@pytest.fixture
def toml(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF))

    def write(body: str = "") -> str:
        p = tmp_path / "run.toml"
        p.write_text('[model]\nconfig = "config.json"\n' + body)
        return str(p)

    return write


def test_load_and_override(toml):
    cfg = load_config(toml("[optim]\nlr = 1e-3\n[data]\nseq_len = 64\n"),
                      ["optim.lr=2e-3", "model.num_experts=8", "train.steps=70", "log.run_dir=somewhere"])
    assert cfg.optim.lr == 2e-3 and cfg.data.seq_len == 64 and cfg.train.steps == 70
    assert cfg.model.hf["num_experts"] == 8 and cfg.model.hf["hidden_size"] == 32
    assert os.path.isabs(cfg.model.config) and cfg.log.run_dir == os.path.abspath("somewhere")


def test_float_field_accepts_int(toml):
    assert load_config(toml("[optim]\nlr = 1\nmin_lr = 0\n")).optim.lr == 1.0


@pytest.mark.parametrize("body, overrides, message", [
    ("[optim]\nlearning_rate = 1e-3\n", [], "unknown key optim.learning_rate"),
    ("", ["optim.lrr=1"], "valid keys of [optim]"),
    ("[trainer]\nsteps = 1\n", [], "unknown section [trainer]"),
    ("", ["data.seq_len=long"], "data.seq_len = 'long' must be of type int"),
    ("", ["optim.decay=exp"], "choose one of ['cosine', 'linear', 'constant']"),
    ("", ["log.plot=1"], "must be true or false"),
    ("", ["model.hidden=64"], "model.hidden is not a field"),
    ("", ["model.hidden_size=big"], "model.hidden_size = 'big' has type str"),
    ("", ["data.global_batch_size=10", "data.micro_batch_size=4"], "not a multiple of data.micro_batch_size"),
    ("", ["model.num_experts_per_tok=8"], "exceeds model.num_experts"),
    ("", ["model.num_key_value_heads=3"], "not a multiple of model.num_key_value_heads"),
    ("", ["data.seq_len=1024"], "exceeds model.max_position_embeddings"),
    ("", ["train.steps=5", "optim.warmup_steps=6"], "exceeds train.steps"),
    ("", ["checkpoint.resume=/no/such/dir"], "checkpoint.resume"),
    ("", ["optim.lr"], "must look like section.key=value"),
    ("", ["train.seed=-1"], "train.seed = -1 must not be negative"),
    ("", ["model.num_hidden_layers=0"], "model.num_hidden_layers = 0 must be a positive integer"),
    ("", ["model.num_experts_per_tok=0"], "model.num_experts_per_tok = 0 must be a positive integer"),
    ("", ["model.hidden_size=0"], "model.hidden_size = 0 must be a positive integer"),
    ("", ["model.rope_theta.x=1"], "model.rope_theta.x is not a field"),
    ("", ["optim.lr=1e-5"], "need 0 <= optim.min_lr <= optim.lr"),  # cosine decays to min_lr 3e-5
    ("", ["optim.grad_clip=nan"], "optim.grad_clip = nan: give a finite number"),
    ("", ["parallel.timeout_s=inf"], "parallel.timeout_s = inf: give a finite number"),
    ("", ["parallel.timeout_s=2e9"], "must be positive and at most 1e9 (seconds"),
    ("", ["optim.lr=inf"], "optim.lr = inf: give a finite number"),
    ("", ["moe.aux_free_rate=-1"], "moe.aux_free_rate = -1.0 must not be negative"),
    ("", ["train.spike_window=0"], "train.spike_window = 0 at least 1"),
    ("", ["model.hidden_size=32.5"], "model.hidden_size = 32.5 has type float"),
])
def test_errors_name_the_key(toml, body, overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(toml(body), overrides)
    assert message in str(e.value)


def test_overrides_of_fields_this_library_reads_otherwise(tmp_path):
    """An integral float where config.json holds an int is that int; router_aux_loss_coef (read by
    transformers, not here) names moe.aux_loss_coef; a rope_scaling table without its type, or not
    a table, is refused rather than read as no scaling."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**HF, "rope_theta": 10000, "rope_scaling": None, "router_aux_loss_coef": 0.001}))
    cfg = load_config(None, [f"model.config={path}", "model.rope_theta=1e6"])
    assert cfg.model.hf["rope_theta"] == 1000000 and type(cfg.model.hf["rope_theta"]) is int
    for override, message in (("model.router_aux_loss_coef=0.1", "not read by this library: set moe.aux_loss_coef"),
                              ("model.rope_scaling={factor = 4.0}", "must be a table that names its rope_type"),
                              ("model.rope_scaling=yarn", "rope_scaling = 'yarn' must be a table")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, [f"model.config={path}", override])
    yarn = load_config(None, [f"model.config={path}", "model.rope_scaling={type = 'yarn', factor = 4.0, "
                                                      "original_max_position_embeddings = 128}"])
    assert yarn.model.hf["rope_scaling"]["factor"] == 4.0


def test_a_key_outside_any_table_is_named(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text("steps = 3\n[train]\nseed = 1\n")
    with pytest.raises(ConfigError, match=r"steps = 3 stands outside any \[section\] table; move it under"):
        load_config(str(p))


def test_missing_model_config(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text("[train]\nsteps = 1\n")
    with pytest.raises(ConfigError, match="model.config is missing"):
        load_config(str(p))
    p.write_text('[model]\nconfig = "nope.json"\n')
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(p))


@pytest.mark.parametrize("field, value, message", [
    ("model_type", "llama", "model_type 'llama' in config.json is not supported"),
    ("hidden_act", "gelu", "only 'silu'|supports 'silu' only"),
    ("num_experts_per_tok", 9, "exceeds model.num_experts"),
    ("decoder_sparse_step", 0, "model.decoder_sparse_step = 0 must be a positive integer"),
    ("head_dim", 9, "the rotary dimension 9 is odd"),
    ("initializer_range", -0.02, "model.initializer_range = -0.02 must be a number of at least 0"),
    ("output_router_logits", True, "output_router_logits = true .* moe.aux_loss / moe.aux_loss_coef"),
])
def test_bad_model_config_is_a_config_error(tmp_path, field, value, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**HF, field: value}))
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"model.config={path}"])


@pytest.mark.parametrize("field, value, message", [
    ("moe_layer_freq", 0, "model.moe_layer_freq = 0 must be a positive integer"),
    ("kv_lora_rank", 0, "model.kv_lora_rank = 0 must be a positive integer"),
    ("qk_rope_head_dim", 7, "the rotary dimension 7 is odd"),
    ("n_shared_experts", -1, "model.n_shared_experts = -1 must be an integer of at least 0"),
])
def test_bad_deepseek_fields_are_named(field, value, message):
    from conftest import DEEPSEEK_V2
    from pithtrain.models import build_model

    with pytest.raises(ValueError, match=message):
        build_model({**DEEPSEEK_V2, field: value})


def test_model_config_may_name_a_model_folder_and_must_hold_an_object(tmp_path):
    """A Hugging Face model folder stands for its config.json; a folder as the run's TOML, a
    config.json that is not a JSON object and a non-path model.config are errors that say so."""
    (tmp_path / "config.json").write_text(json.dumps(HF))
    assert load_config(None, [f"model.config={tmp_path}"]).model.hf["hidden_size"] == 32
    with pytest.raises(ConfigError, match="is a folder; name the run's .toml file"):
        load_config(str(tmp_path))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="holds a JSON list, not the object"):
        load_config(None, [f"model.config={tmp_path / 'list.json'}"])
    (tmp_path / "run.toml").write_text("[model]\nconfig = 5\n")
    with pytest.raises(ConfigError, match="model.config = 5: name the path"):
        load_config(str(tmp_path / "run.toml"))


def test_paths_and_names(toml, tmp_path, monkeypatch):
    """checkpoint.resume in the TOML is a path from the TOML's directory (its words 'auto' and
    'none' stay words); a value that TOML reads as a date stays the name it was written as."""
    (tmp_path / "ck" / "step-00000004").mkdir(parents=True)
    monkeypatch.chdir("/")
    cfg = load_config(toml('[checkpoint]\nresume = "ck/step-00000004"\n'))
    assert cfg.checkpoint.resume == str(tmp_path / "ck" / "step-00000004")
    assert load_config(toml('[checkpoint]\nresume = "auto"\n'), ["checkpoint.resume=none"]).checkpoint.resume == "none"
    assert load_config(toml(), ["log.run_dir=2024-06-01"]).log.run_dir == "/2024-06-01"


def test_names_empty_paths_constant_lr_and_nested_model_tables(tmp_path, monkeypatch):
    """A name that TOML would read as a number stays the name; an empty path override leaves the
    setting empty (its default), not the current directory; a constant LR needs no min_lr below it;
    a nested model table updates the file's table rather than replacing it."""
    cfg_json = {**HF, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}
    (tmp_path / "config.json").write_text(json.dumps(cfg_json))
    run = tmp_path / "run.toml"
    run.write_text('[model]\nconfig = "config.json"\n[model.rope_scaling]\nfactor = 8.0\n')
    monkeypatch.chdir(tmp_path)
    cfg = load_config(str(run), ["log.run_dir=42", "log.wandb_project=2025", "checkpoint.dir="])
    assert cfg.log.run_dir == str(tmp_path / "42") and cfg.log.wandb_project == "2025"
    assert cfg.checkpoint.dir == "" and cfg.checkpoint_dir == os.path.join(cfg.log.run_dir, "checkpoints")
    assert cfg.model.hf["rope_scaling"] == {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128}
    with pytest.raises(ConfigError, match="give the table: model.rope_scaling="):
        load_config(str(run), ["model.rope_scaling.factor=2.0"])
    assert load_config(str(run), ["optim.lr=1e-5", "optim.decay=constant"]).optim.lr == 1e-5


def test_overrides_may_follow_options(toml, capsys):
    from pithtrain.cli import main

    assert main(["memory", toml(), "--world", "2", "data.seq_len=16", "data.micro_batch_size=2"]) == 0
    with pytest.raises(SystemExit):
        main(["memory", toml(), "--world", "2", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_biases_and_norms_get_no_weight_decay():
    """GPT-OSS's per-expert biases are 2-D ([E, n]) and still biases: no weight decay."""
    from conftest import GPT_OSS
    from pithtrain.config import OptimConfig
    from pithtrain.models import build_model
    from pithtrain.train.optim import build_optimizer

    model = build_model(GPT_OSS)
    groups = build_optimizer(model, OptimConfig(weight_decay=0.25)).param_groups
    assert [g["weight_decay"] for g in groups] == [0.25, 0.0]
    names = {id(p): n for n, p in model.named_parameters()}
    decayed, kept = ({names[id(p)] for p in g["params"]} for g in groups)
    assert decayed | kept == set(dict(model.named_parameters())) and not decayed & kept
    layer = "model.layers.0."
    assert {layer + n for n in ("self_attn.sinks", "self_attn.q_proj.bias", "input_layernorm.weight", "mlp.router.bias",
                                "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias")} <= kept
    assert {layer + n for n in ("self_attn.q_proj.weight", "mlp.router.weight", "mlp.experts.gate_up_proj",
                                "mlp.experts.down_proj")} | {"model.embed_tokens.weight", "lm_head.weight"} <= decayed


def test_a_run_toml_that_is_not_utf8_is_a_config_error(tmp_path):
    p = tmp_path / "run.toml"
    p.write_bytes(b"\xff\xfe[train]\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(str(p))

