"""End-to-end training on CPU: learning, exact resume, a killed save, bad input."""

import json
import os
import re
import shutil

import pytest
import torch

from conftest import losses, run_cli, write_run
from pithtrain.config import ConfigError, load_config
from pithtrain.layers.moe import BalanceOptions
from pithtrain.models import build_model
from pithtrain.train import checkpoint
from pithtrain.train.loop import train


def test_training_learns_and_logs(tiny_corpus, tmp_path):
    toml = write_run(tmp_path, tiny_corpus)
    summary = train(load_config(toml, ["train.steps=40", "optim.lr=1e-2", "log.plot=true", "moe.aux_loss=sequence",
                                       "moe.z_loss_coef=1e-3", "moe.aux_free=true"]))
    run = summary["run_dir"]
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == list(range(1, 41))
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_mem_gb",
                "aux_loss", "expert_load_imbalance"):
        assert key in rows[-1], key
    assert rows[-1]["expert_load_imbalance"] >= 1.0 and rows[-1]["aux_loss"] > 0
    # the summary's throughput leaves out the first logged interval (compilation, warm-up)
    later = rows[1:]
    tokens, seconds = sum(r["tokens_per_s"] * r["step_time_s"] for r in later), sum(r["step_time_s"] for r in later)
    assert summary["tokens_per_s"] == pytest.approx(tokens / seconds, rel=1e-6)
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(vals) == 10 and vals[-1] < vals[0]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert os.path.getsize(summary["plot"]) > 1000
    saved = json.load(open(os.path.join(run, "run_config.json")))
    assert saved["moe"]["aux_loss"] == "sequence" and saved["model"]["hf"]["num_experts"] == 4
    # the aux-free bias moved and is part of the checkpoint
    ckpt = checkpoint.latest(os.path.join(run, "checkpoints"))
    assert ckpt.endswith("step-00000040")
    model = build_model(load_config(toml).model.hf, BalanceOptions(aux_free=True))
    checkpoint.load(ckpt, model, None)
    biases = [b.gate.e_score_correction_bias for b in model.moe_blocks()]
    assert len(biases) == 2 and all(b.abs().sum() > 0 for b in biases)


def test_exact_resume_in_a_new_process(tiny_corpus, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    straight = write_run(tmp_path / "a", tiny_corpus)
    run_cli("train", straight, "train.steps=12", "moe.aux_free=true")
    split = write_run(tmp_path / "b", tiny_corpus)
    run_cli("train", split, "train.steps=12", "train.stop_at=6", "moe.aux_free=true")
    out = run_cli("train", split, "train.steps=12", "checkpoint.resume=auto", "moe.aux_free=true")
    assert "resumed from" in out.stdout and "step-00000006" in out.stdout
    a, b = losses(str(tmp_path / "a" / "run")), losses(str(tmp_path / "b" / "run"))
    assert list(a) == list(range(1, 13)) and a == b  # bit-identical: floats compared exactly


def test_killed_save_leaves_previous_checkpoint(tiny_corpus, tmp_path):
    toml = write_run(tmp_path, tiny_corpus)
    ckdir = tmp_path / "run" / "checkpoints"
    proc = run_cli("train", toml, "train.steps=6", "checkpoint.every=2", "checkpoint.keep=3",
                   env={"PITHTRAIN_FAULT": "save-before-marker:4"}, check=False)
    assert proc.returncode == 137
    assert sorted(os.listdir(ckdir)) == [".tmp-step-00000004", "step-00000002"]
    assert checkpoint.latest(str(ckdir)).endswith("step-00000002")
    out = run_cli("train", toml, "train.steps=6", "checkpoint.every=2", "checkpoint.keep=3",
                  "checkpoint.resume=auto")
    assert "step-00000002" in out.stdout
    assert sorted(os.listdir(ckdir)) == ["step-00000002", "step-00000004", "step-00000006"]
    # a truncated tensor file is refused by name, and auto-resume falls back to an older checkpoint
    newest = ckdir / "step-00000006"
    victim = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    victim.write_bytes(victim.read_bytes()[:10])
    with pytest.raises(checkpoint.CheckpointError, match=victim.name):
        checkpoint.verify(str(newest))
    assert checkpoint.latest(str(ckdir)).endswith("step-00000004")


def test_tokenizer_larger_than_model_vocab(tiny_corpus, tmp_path):
    toml = write_run(tmp_path, tiny_corpus)
    with pytest.raises(ConfigError, match="model.vocab_size = 100"):
        train(load_config(toml, ["model.vocab_size=100", "train.steps=2", "optim.warmup_steps=1"]))


def test_cuda_graphs_are_refused_off_a_single_gpu(tiny_corpus, tmp_path, monkeypatch):
    """train.cuda_graphs = on: on the CPU, or in a run under torchrun (FSDP), a config error that
    says to turn it off, before anything is written (the graphed step itself: tests/test_gpu.py)."""
    from pithtrain.train import loop

    toml = write_run(tmp_path, tiny_corpus)
    with pytest.raises(ConfigError, match="this run is on the CPU .*set train.cuda_graphs=off"):
        train(load_config(toml, ["train.steps=2", "train.cuda_graphs=on"]))
    monkeypatch.setattr(loop, "resolve_device", lambda cfg: (torch.device("cuda"), torch.bfloat16))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    with pytest.raises(ConfigError, match=r"this run is in 1 process\(es\) under torchrun .*cuda_graphs=off"):
        train(load_config(toml, ["train.steps=2", "train.cuda_graphs=on"]))
    assert not (tmp_path / "run").exists()


def test_the_captured_body_is_the_eager_step_on_cpu():
    """What `train/graphs.py` captures as graph A, run directly on the CPU from its static buffers
    and device scalars, gives the eager `train_step`'s gradients (as the optimizer sees them, clipped),
    losses, norm and MoE statistics bit for bit: three micro-batches with ignored labels (each one's
    share of the balancing losses, of the step's tokens; 1 / the step's targets), clipping, and the spike-loss factor."""
    import copy

    from conftest import TINY_MODEL, masked_middle_batches
    from pithtrain.layers.transformer import init_weights
    from pithtrain.train.graphs import StepGraphs
    from pithtrain.train.loop import train_step

    class Recorder:  # an optimizer that keeps the gradients it is handed
        param_groups = [{"lr": 1e-3}]

        def __init__(self, model):
            self.model = model

        def step(self):
            self.grads = [p.grad.clone() for p in self.model.parameters()]

        def zero_grad(self, set_to_none=True):
            for p in self.model.parameters():
                p.grad = None

    torch.manual_seed(0)
    eager = build_model(dict(TINY_MODEL), BalanceOptions("micro_batch", 0.01, 0.001))
    init_weights(eager, 0)
    graphed = copy.deepcopy(eager)
    micro = masked_middle_batches(TINY_MODEL["vocab_size"], 2, 16, 3)
    micro[1][1][0, :3] = -100  # micro-batches of different target counts
    counts = [int((labels != -100).sum()) for _, labels in micro]
    rec = Recorder(eager)
    for factor, spike in ((1.0, ""), (100.0, "spike-loss:1")):
        os.environ["PITHTRAIN_FAULT"] = spike
        try:
            out = train_step(eager, rec, micro, 0.5, torch.device("cpu"), None, step=1)
        finally:
            del os.environ["PITHTRAIN_FAULT"]
        body = StepGraphs(graphed, Recorder(graphed), 0.5, torch.device("cpu"), None)
        inv = (torch.ones(()) / sum(counts)).item()
        sizes = [labels.numel() for _, labels in micro]  # the balancing losses' shares: of all tokens
        body._load(micro, body.scalar_values([n / sum(sizes) for n in sizes], inv, factor))
        body._forward_backward()
        stats = [b.end_step() for b in graphed.moe_blocks()]  # eager's: read by train_step into `out`
        assert torch.equal(out["loss"] * sum(counts), body.loss_sum) and torch.equal(out["grad_norm"], body.norm)
        for want, p in zip(rec.grads, graphed.parameters()):
            assert torch.equal(want, p.grad * body.scale)
        loads = torch.stack([st["load"] for st in stats])
        assert torch.equal(out["aux_loss"], torch.stack([st["aux"] for st in stats]).sum()) and out["aux_loss"] > 0
        assert torch.equal(out["expert_load_imbalance"], (loads.max(1).values / loads.mean(1).clamp(min=1e-9)).mean())
        graphed.zero_grad(set_to_none=True)


def test_cuda_graphs_turn_on_expandable_segments_unless_the_user_chose(monkeypatch):
    """`StepGraphs` on a CUDA device switches the caching allocator to expandable segments, keeping
    the other options of the environment's setting; a setting that names expandable_segments or
    an allocator backend is the user's choice and stays; on the CPU nothing is switched."""
    from pithtrain.train import graphs

    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    assert graphs.expandable_segments() and calls == ["expandable_segments:True", "empty_cache"]
    cases = [("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512", "max_split_size_mb:512,expandable_segments:True"),
             ("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.8", "garbage_collection_threshold:0.8,"
                                                                         "expandable_segments:True"),
             ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512, expandable_segments:False", None),
             ("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync", None)]
    for name, conf, want in cases:
        monkeypatch.setenv(name, conf)
        calls.clear()
        assert graphs.expandable_segments() == (want is not None)
        assert calls == ([want, "empty_cache"] if want else [])
        monkeypatch.delenv(name)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls.clear()
    graphs.StepGraphs(model, opt, 1.0, torch.device("cpu"), None)
    assert calls == []
    graphs.StepGraphs(model, opt, 1.0, torch.device("cuda"), None)  # built only: nothing runs on the device
    assert calls == ["expandable_segments:True", "empty_cache"]


def test_fresh_run_refuses_an_existing_run_dir(tiny_corpus, tmp_path):
    toml = write_run(tmp_path, tiny_corpus)
    train(load_config(toml, ["train.steps=2", "optim.warmup_steps=1"]))
    before = open(tmp_path / "run" / "metrics.jsonl").read()
    with pytest.raises(ConfigError, match="already holds a run.*checkpoint.resume=auto"):
        train(load_config(toml, ["train.steps=2", "optim.warmup_steps=1"]))
    assert open(tmp_path / "run" / "metrics.jsonl").read() == before
    assert checkpoint.latest(str(tmp_path / "run" / "checkpoints")).endswith("step-00000002")
    with pytest.raises(ConfigError, match=r"checkpoint.dir .*run/checkpoints already holds a run .* another checkpoint.dir"):
        train(load_config(toml, ["train.steps=2", "optim.warmup_steps=1", f"log.run_dir={tmp_path}/new",
                                 f"checkpoint.dir={tmp_path}/run/checkpoints"]))
    # going on from another run's checkpoint (resume=PATH) in a run_dir that holds a run: refused
    other = ["train.steps=2", "optim.warmup_steps=1", f"log.run_dir={tmp_path}/other"]
    train(load_config(toml, other))
    kept = open(tmp_path / "other" / "metrics.jsonl").read()
    step2 = checkpoint.latest(str(tmp_path / "run" / "checkpoints"))
    with pytest.raises(ConfigError, match=f"already holds a run .*to go on from {re.escape(step2)}, name another"):
        train(load_config(toml, other[1:] + ["train.steps=4", f"checkpoint.resume={step2}"]))
    assert open(tmp_path / "other" / "metrics.jsonl").read() == kept
    # the checkpoints folder itself is not a checkpoint: the message says what to name instead
    with pytest.raises(checkpoint.CheckpointError, match="holds checkpoints rather than being one"):
        train(load_config(toml, other[1:] + ["train.steps=4", f"checkpoint.resume={tmp_path}/other/checkpoints"]))
    # a copy of the run's own checkpoint, restored from elsewhere, continues the run (same run id)
    shutil.copytree(tmp_path / "other" / "checkpoints" / "step-00000002", tmp_path / "backup" / "step-00000002")
    train(load_config(toml, other[1:] + ["train.steps=4", f"checkpoint.resume={tmp_path}/backup/step-00000002"]))
    assert checkpoint.latest(str(tmp_path / "other" / "checkpoints")).endswith("step-00000004")
    # metrics but no checkpoint: resume=auto has nothing to continue and must not write over them either
    nock = ["train.steps=2", "optim.warmup_steps=1", f"log.run_dir={tmp_path}/nock", "checkpoint.every=0",
            "checkpoint.save_final=false"]
    train(load_config(toml, nock))
    before = open(tmp_path / "nock" / "metrics.jsonl").read()
    for resume in ("none", "auto"):
        with pytest.raises(ConfigError, match=r"metrics.jsonl\) with no checkpoint to continue from"):
            train(load_config(toml, nock + [f"checkpoint.resume={resume}"]))
    assert open(tmp_path / "nock" / "metrics.jsonl").read() == before


def test_a_rewind_sets_the_later_timeline_aside_at_once_and_a_branch_is_a_run_of_its_own(tiny_corpus, tmp_path,
                                                                                          monkeypatch):
    """resume=PATH of an earlier step moves the later checkpoints aside when the run resumes: a crash
    before its first save leaves resume=auto the rewound timeline, and pruning never deletes the old
    one. A run started from another run's checkpoint gets its own run id, so that run's later
    checkpoints are not taken for its own. A complete `.tmp-step-N`, a run's only checkpoint, resumes."""
    toml = write_run(tmp_path, tiny_corpus)
    ckpts = tmp_path / "run" / "checkpoints"
    base = ["train.steps=6", "optim.warmup_steps=1", "checkpoint.every=2", "checkpoint.keep=2"]
    train(load_config(toml, base))
    run_id = lambda path: json.load(open(path / "trainer.json"))["run"]  # noqa: E731
    first = run_id(ckpts / "step-00000006")
    monkeypatch.setenv("PITHTRAIN_FAULT", "raise:5")  # fails before the rewound run's first save
    with pytest.raises(RuntimeError, match="injected fault"):
        train(load_config(toml, base + [f"checkpoint.resume={ckpts}/step-00000004", "checkpoint.every=3"]))
    monkeypatch.delenv("PITHTRAIN_FAULT")
    assert sorted(os.listdir(ckpts)) == [".abandoned-step-00000006", "step-00000004"]  # step 2 pruned by the first run
    train(load_config(toml, base + ["checkpoint.resume=auto", "checkpoint.keep=1"]))
    assert sorted(os.listdir(ckpts)) == [".abandoned-step-00000006", "step-00000006"]
    assert run_id(ckpts / "step-00000006") == first == run_id(ckpts / ".abandoned-step-00000006")

    branch = ["train.steps=6", "optim.warmup_steps=1", f"log.run_dir={tmp_path}/branch"]
    train(load_config(toml, branch + [f"checkpoint.resume={ckpts}/.abandoned-step-00000006", "train.steps=8"]))
    assert run_id(tmp_path / "branch" / "checkpoints" / "step-00000008") != first
    before = open(tmp_path / "branch" / "metrics.jsonl").read()
    with pytest.raises(ConfigError, match="branch already holds a run"):
        train(load_config(toml, branch + [f"checkpoint.resume={ckpts}/step-00000006", "train.steps=8"]))
    assert open(tmp_path / "branch" / "metrics.jsonl").read() == before

    os.rename(ckpts / "step-00000006", ckpts / ".tmp-step-00000006")  # a save killed after its marker, before its rename
    train(load_config(toml, base + ["checkpoint.resume=auto", "train.steps=7"]))
    assert checkpoint.latest(str(ckpts)).endswith("step-00000007")
    assert run_id(ckpts / "step-00000007") == first


def test_init_from_a_damaged_checkpoint_names_the_damage(tiny_corpus, tmp_path):
    """checkpoint.init_from of a checkpoint whose trainer.json (read for its tokenizer) is cut short:
    the verification's error naming the file, before anything reads it; nothing is written."""
    toml = write_run(tmp_path, tiny_corpus)
    train(load_config(toml, ["train.steps=2", "optim.warmup_steps=1"]))
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "run" / "checkpoints" / "step-00000002", damaged)
    text = (damaged / "trainer.json").read_text()
    (damaged / "trainer.json").write_text(text[:len(text) // 2])
    with pytest.raises(checkpoint.CheckpointError, match=r"damaged: trainer.json has \d+ bytes, expected"):
        train(load_config(toml, ["train.steps=2", f"log.run_dir={tmp_path}/new", f"checkpoint.init_from={damaged}"]))
    assert not (tmp_path / "new" / "metrics.jsonl").exists()


def test_paths_and_sizes_that_cannot_work_are_config_errors(tiny_corpus, tmp_path):
    """An empty log.run_dir, a log.run_dir or checkpoint.dir that is a file, `memory --world 0`,
    `bench` without CUDA and a checkpoint path that does not exist: each an error that says so."""
    toml = write_run(tmp_path, tiny_corpus)
    for override, message in (("log.run_dir=", "log.run_dir is empty"),
                              (f"log.run_dir={toml}", "log.run_dir = .* is a file"),
                              (f"checkpoint.dir={toml}", "checkpoint.dir = .* is a file")):
        with pytest.raises(ConfigError, match=message):
            load_config(toml, [override])
    with pytest.raises(ConfigError, match=r"log.run_dir = .*run.toml/run: the run cannot write there \(.*run.toml is "
                                          r"a file\)"):
        train(load_config(toml, [f"log.run_dir={toml}/run"]))
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    with pytest.raises(ConfigError, match=r"the run cannot write there \(.*dangling is a link to nothing\)"):
        train(load_config(toml, [f"log.run_dir={tmp_path}/dangling"]))
    proc = run_cli("memory", toml, "--world", "0", check=False)
    assert proc.returncode == 2 and "--world 0" in proc.stderr and "Traceback" not in proc.stderr
    if not torch.cuda.is_available():
        proc = run_cli("bench", check=False)
        assert proc.returncode == 2 and "CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr
        proc = run_cli("bench", "--help")  # the options are listed all the same
        assert "--weights" in proc.stdout and "--model" in proc.stdout
        assert proc.stdout.startswith("usage: pithtrain bench")  # not the script's file name
    with pytest.raises(checkpoint.CheckpointError, match="does not exist"):
        checkpoint.verify(str(tmp_path / "nowhere"))


def test_cli_reports_config_errors(tiny_corpus, tmp_path):
    toml = write_run(tmp_path, tiny_corpus)
    proc = run_cli("train", toml, "optim.lrate=1", check=False)
    assert proc.returncode == 2 and "unknown key optim.lrate" in proc.stderr and "Traceback" not in proc.stderr


def test_stop_at_saves_and_a_resume_follows_the_optim_config(tiny_corpus, tmp_path, monkeypatch):
    """An invocation ended by train.stop_at saves even with save_final off; a resume at or past
    stop_at is refused (the run's run_config.json untouched); the resumed optimizer takes the config's betas, eps and weight decay, not
    the ones saved with its state."""
    from pithtrain.train import loop

    toml = write_run(tmp_path, tiny_corpus)
    base = ["train.steps=6", "optim.warmup_steps=1", "checkpoint.save_final=false"]
    train(load_config(toml, base + ["train.stop_at=3"]))
    assert checkpoint.latest(str(tmp_path / "run" / "checkpoints")).endswith("step-00000003")
    saved = open(tmp_path / "run" / "run_config.json").read()
    with pytest.raises(ConfigError, match="stop_at = 3 but .* already at step 3"):
        train(load_config(toml, base + ["train.stop_at=3", "checkpoint.resume=auto", "optim.lr=1.0"]))
    assert open(tmp_path / "run" / "run_config.json").read() == saved  # a refused command writes nothing
    seen, real = [], loop.train_step

    def spy(model, optimizer, *args, **kwargs):
        seen.append([(g["weight_decay"], g["betas"], g["eps"]) for g in optimizer.param_groups])
        return real(model, optimizer, *args, **kwargs)

    monkeypatch.setattr(loop, "train_step", spy)
    train(load_config(toml, base + ["checkpoint.resume=auto", "optim.weight_decay=0.5", "optim.beta2=0.9",
                                    "optim.eps=1e-6"]))
    assert len(seen) == 3 and seen[0] == [(0.5, (0.9, 0.9), 1e-6), (0.0, (0.9, 0.9), 1e-6)]


def test_a_pause_logs_and_validates_as_an_uninterrupted_run(tiny_corpus, tmp_path):
    """train.stop_at ends an invocation with a checkpoint and nothing else: metrics.jsonl of the run
    paused and resumed holds the records (and val_loss) of the run that went straight through."""
    toml = write_run(tmp_path, tiny_corpus)
    common = ["train.steps=10", "optim.warmup_steps=1", "log.every=5", "data.val_every=0"]
    train(load_config(toml, common + [f"log.run_dir={tmp_path}/whole"]))
    paused = train(load_config(toml, common + [f"log.run_dir={tmp_path}/parts", "train.stop_at=3"]))
    assert paused["paused_at"] == 3 and "train_loss" not in paused
    train(load_config(toml, common + [f"log.run_dir={tmp_path}/parts", "checkpoint.resume=auto"]))
    read = lambda name: [{k: v for k, v in json.loads(line).items() if k not in ("tokens_per_s", "step_time_s", "peak_mem_gb")}  # noqa: E731
                         for line in open(tmp_path / name / "metrics.jsonl")]
    whole = read("whole")
    assert [r["step"] for r in whole] == [5, 10] and "val_loss" in whole[1] and "val_loss" not in whole[0]
    assert read("parts") == whole


def test_auto_resume_never_starts_over_on_unreadable_checkpoints(tiny_corpus, tmp_path):
    toml = write_run(tmp_path, tiny_corpus)
    train(load_config(toml, ["train.steps=2", "optim.warmup_steps=1"]))
    ckpt = checkpoint.latest(str(tmp_path / "run" / "checkpoints"))
    shard = next(os.path.join(ckpt, f) for f in sorted(os.listdir(ckpt)) if f.endswith(".distcp"))
    with open(shard, "r+b") as f:  # one byte changed: the size still matches, the CRC does not
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    before = open(tmp_path / "run" / "metrics.jsonl").read()
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint .* passes verification"):
        train(load_config(toml, ["train.steps=4", "optim.warmup_steps=1", "checkpoint.resume=auto"]))
    assert open(tmp_path / "run" / "metrics.jsonl").read() == before and os.path.isdir(ckpt)


def test_a_run_that_failed_before_its_first_step_may_start_again(tiny_corpus, tmp_path):
    toml = write_run(tmp_path, tiny_corpus)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")  # what a run that failed while starting leaves
    assert train(load_config(toml, ["train.steps=1", "optim.warmup_steps=1"]))["train_loss"] > 0


def test_the_validation_set_does_not_depend_on_the_micro_batch(tiny_corpus, tmp_path):
    """val_loss is measured on the first data.val_batches global batches whatever the micro-batch
    (nearly no training, lr 1e-9: only the validation set could differ)."""
    vals = []
    for micro in (1, 2, 4):
        toml = write_run(tmp_path / f"m{micro}", tiny_corpus) if (tmp_path / f"m{micro}").mkdir() is None else None
        summary = train(load_config(toml, ["train.steps=1", "optim.warmup_steps=1", "optim.lr=1e-9",
                                           "optim.min_lr=0", f"data.micro_batch_size={micro}"]))
        vals.append(summary["val_loss"])
    assert max(vals) - min(vals) < 1e-5 * vals[0], vals


def test_training_without_validation(tmp_path):
    """data.val_batches = 0 trains with no validation (no val_loss), on a corpus built with
    --val-fraction 0; a run that asks for validation on that corpus is refused, naming the key."""
    from pithtrain.train.corpus import build_corpus, demo_texts

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t, _ in zip(demo_texts(), range(20))))
    corpus = str(tmp_path / "c")
    build_corpus([str(src)], corpus, None, workers=1, demo_vocab_size=512, val_fraction=0.0)
    (tmp_path / "r").mkdir()
    toml = write_run(tmp_path / "r", corpus)
    with pytest.raises(Exception, match="data.val_batches = 0"):
        train(load_config(toml, ["train.steps=2", "optim.warmup_steps=1"]))
    summary = train(load_config(toml, ["train.steps=2", "optim.warmup_steps=1", "data.val_batches=0",
                                       "data.val_every=1"]))
    rows = [json.loads(line) for line in open(os.path.join(summary["run_dir"], "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2] and not any("val_loss" in r for r in rows)
    assert summary["val_loss"] is None and summary["train_loss"] > 0


def test_resumed_log_drops_later_steps_and_a_torn_line(tmp_path, capsys):
    """On resume at step 2 the records of steps 3.. go, and so does a last line cut short by a crash."""
    from pithtrain.train.log import RunLog

    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    log = RunLog(str(tmp_path), 10, 2, progress=False, tensorboard=False, wandb=False, wandb_project="",
                 config={})
    log.record({"step": 3, "loss": 0.5}, console=False)
    log.close()
    steps = [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")]
    assert steps == [1, 2, 3] and "dropped 1 line(s)" in capsys.readouterr().out
    assert not os.path.exists(tmp_path / "metrics.jsonl.tmp")
    # a whole record cut before its newline stays, and the next one starts a line of its own;
    # a non-finite loss is written as null (strict JSON), and the plot skips it
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 1, "loss": 1.0}) + "\n" + json.dumps({"step": 2, "loss": 0.9}))
    log = RunLog(str(tmp_path), 10, 2, progress=False, tensorboard=False, wandb=False, wandb_project="",
                 config={})
    log.record({"step": 3, "loss": float("nan"), "grad_norm": float("inf")}, console=False)
    log.close()
    text = open(tmp_path / "metrics.jsonl").read()
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} is not JSON")) for line in text.splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["loss"] is None and rows[2]["grad_norm"] is None
    from pithtrain.train.log import plot_losses

    assert os.path.getsize(plot_losses(str(tmp_path / "metrics.jsonl"), str(tmp_path / "loss.png"))) > 0


def test_wandb_runs_of_one_training_run_share_a_group(tmp_path, monkeypatch, capsys):
    """Each invocation is a wandb run of its own in the training run's group (read back on resume,
    new from step 0); a wandb.init that fails (no login) is said, and logging goes on without it."""
    import sys
    import types

    from pithtrain.train.log import RunLog

    calls = []

    def init(**kw):
        calls.append(kw)
        if kw["name"].endswith("-7"):
            raise RuntimeError("No API key configured\nmore")
        return types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))

    def open_log(start):
        log = RunLog(str(tmp_path), 10, start, progress=False, tensorboard=False, wandb=True, wandb_project="p",
                     config={})
        log.record({"step": start + 1, "loss": 1.0}, console=False)
        log.close()

    open_log(0)
    open_log(3)
    open_log(7)
    open_log(0)
    groups = [c["group"] for c in calls]
    assert groups[0] == groups[1] == groups[2] != groups[3]
    assert [c["name"].rsplit("-", 1)[1] for c in calls] == ["0", "3", "7", "0"]
    assert "wandb did not start (RuntimeError: No API key configured)" in capsys.readouterr().out


def _benchmark_module():
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("single_gpu", os.path.join(ROOT, "benchmarks", "single_gpu.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_benchmark_clock_sampler(tmp_path):
    """The benchmark's `Clocks` reads nvidia-smi's csv while a protocol is timed (here a stand-in
    script that prints four samples and waits to be stopped): medians of the SM clock and power, the
    hottest temperature, each clock-event reason's share of the samples; [N/A] fields are skipped.
    A command that cannot be started leaves the timing alone and says why in the summary."""
    import time

    bench = _benchmark_module()
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n"
                    "echo '1980, 690.5, 61, 0x0000000000000000'\n"
                    "echo '1755, 700.1, 66, 0x0000000000000004'\n"
                    "echo '1740, [N/A], 67, 0x0000000000000004'\n"
                    "echo '1980, 650.0, 64, 0x0000000000000001'\n"
                    "exec sleep 60\n")
    fake.chmod(0o755)
    with bench.Clocks(str(fake)) as c:
        time.sleep(0.3)
    got = c.summary()
    assert got == dict(samples=4, sm_mhz=1867.5, power_w=690.5, max_temp_c=67.0,
                       reasons={"sw_power_cap": 0.5, "idle": 0.25}), got
    with bench.Clocks(str(tmp_path / "absent")) as c:
        pass
    assert "not_sampled" in c.summary() and "absent" in c.summary()["not_sampled"]


def test_benchmark_steps_train_on_cpu():
    """benchmarks/single_gpu.py's two forms of our step (`bench`: forward, backward, clipping, AdamW;
    `loop`: train_step as `pithtrain train` runs it) take the same step with the same clipping, and
    one without clipping differs (AdamW's eps of 1 keeps the update proportional to the gradient)."""
    from conftest import TINY_MODEL
    from pithtrain.layers.transformer import init_weights
    from pithtrain.models import build_model
    from pithtrain.train.optim import AdamW

    bench = _benchmark_module()
    ids = torch.randint(0, TINY_MODEL["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(0))
    after = []
    for form, clip in (("bench", 0.05), ("loop", 0.05), ("bench", 0.0)):
        model = build_model(TINY_MODEL)
        init_weights(model, 0)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = AdamW(model.parameters(), lr=1e-1, eps=1.0)
        bench.ours_step(model, opt, ids[:, :-1], ids[:, 1:], form, clip=clip)(True)
        assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n.endswith("proj.weight"))
        after.append(dict(model.named_parameters()))
    for name, p in after[0].items():
        torch.testing.assert_close(p, after[1][name], rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.allclose(after[0]["lm_head.weight"], after[2]["lm_head.weight"], rtol=1e-3, atol=1e-6)


def test_eval_gives_a_checkpoints_validation_loss_without_training(tiny_corpus, tmp_path):
    """`pithtrain eval` of a step-N checkpoint reads the validation loss training logged at step N,
    also from the same weights exported to HF and imported back; what cannot be evaluated is named."""
    from pithtrain.train import hf
    from pithtrain.train.loop import evaluate_checkpoint

    toml = write_run(tmp_path, tiny_corpus, "[checkpoint]\nevery = 4\n")
    train(load_config(toml, ["train.steps=4"]))
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        logged = [r["val_loss"] for r in map(json.loads, f) if r["step"] == 4 and r.get("val_loss") is not None]
    step = checkpoint.latest(str(tmp_path / "run" / "checkpoints"))
    assert step.endswith("step-00000004") and len(logged) == 1
    before = sorted(os.listdir(tmp_path / "run"))
    r = evaluate_checkpoint(load_config(toml, []), step)
    assert r["val_loss"] == pytest.approx(logged[0], rel=1e-6) and r["windows"] == 8
    hf.dcp_to_hf(step, str(tmp_path / "hf"))
    hf.hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "back"))
    assert evaluate_checkpoint(load_config(toml, []), str(tmp_path / "back"))["val_loss"] == pytest.approx(logged[0],
                                                                                                             rel=1e-6)
    proc = run_cli("eval", toml, step)
    assert f"validation loss of {step}: {logged[0]:.4f}" in proc.stdout
    assert sorted(os.listdir(tmp_path / "run")) == before  # nothing written
    with pytest.raises(ConfigError, match="was trained with moe.aux_free = false: set moe.aux_free=false"):
        evaluate_checkpoint(load_config(toml, ["moe.aux_free=true"]), step)
    with pytest.raises(ConfigError, match="data.val_batches = 0"):
        evaluate_checkpoint(load_config(toml, ["data.val_batches=0"]), step)
    notes = evaluate_checkpoint(load_config(toml, ["train.param_dtype=bf16"]), step)["notes"]
    assert len(notes) == 1 and "trained with train.param_dtype = fp32 and is evaluated in bf16" in notes[0]
    proc = run_cli("eval", toml, str(tmp_path / "run"), check=False)
    assert proc.returncode == 2 and "name one of the step-N folders" in proc.stderr and "Traceback" not in proc.stderr


def test_the_summary_says_which_step_its_train_loss_is_of(capsys):
    """A run stopped (SIGTERM, stop_at) between logged steps reports the last logged loss as such."""
    from pithtrain.cli import print_summary

    base = {"run_dir": "r", "steps": 500, "train_loss": 6.7, "val_loss": None, "tokens_per_s": 1.0}
    print_summary({**base, "logged_step": 15, "preempted_at": 17})
    print_summary({**base, "logged_step": 17, "preempted_at": 17})
    print_summary({**base, "logged_step": 20, "paused_at": 20})
    print_summary({**base, "logged_step": 500})
    lines = [line for line in capsys.readouterr().out.splitlines() if "train loss" in line]
    assert [line.split(" train loss")[0] for line in lines] == ["last logged (step 15)", "final", "final", "final"]
