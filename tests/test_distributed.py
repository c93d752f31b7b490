"""Every parallel layout against one process: torchrun starts N gloo processes (one thread each)
running `pithtrain train`, validating after each step; three steps must give the single-process losses,
gradient norms (a validation's forward must not hide a parameter from clipping) and validation losses (1e-5 relative) and
parameters (1e-5) of the same global batch. The single-process run uses micro-batches of
micro_batch_size * dp * ep sequences: that is what one micro-batch of all data ranks together is.
Also: deduplicated expert dispatch (row counts and numerics), resharding checkpoints across
layouts, and layouts that cannot work."""

import json
import re
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import DEEPSEEK_V2, GPT_OSS, ROOT, TINY_MODEL, losses, run_cli, write_run
from pithtrain.config import ConfigError, load_config
from pithtrain.parallel.mesh import plan_layout
from pithtrain.train import checkpoint

FAMILIES = {
    "qwen3": (TINY_MODEL, "z_loss_coef = 1e-3\n"),  # global_batch balancing loss (the default)
    "deepseek_v2": (dict(DEEPSEEK_V2, vocab_size=512, initializer_range=0.02), 'aux_loss = "sequence"\n'),
    "gpt_oss": (dict(GPT_OSS, vocab_size=512, initializer_range=0.02), 'aux_loss = "micro_batch"\n'),
}
MICRO, GLOBAL, STEPS = 2, 8, 3


def torchrun(n: int, toml: str, *overrides: str, check: bool = True, command: str = "train") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                           "-m", "pithtrain", command, toml, *overrides], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun -n {n} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def stored_model(path: str) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint, read whole in this process."""
    meta = dcp.FileSystemReader(path).read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
             if k.startswith("model.") and hasattr(v, "size")}
    with checkpoint.quiet():
        dcp.load(state, checkpoint_id=path)
    return state


def metrics(run_dir: str) -> dict[int, dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def final_checkpoint(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints", f"step-{STEPS:08d}")


def family_run(tmp_path, corpus: str, family: str) -> str:
    """run.toml + config.json of a tiny `family` model: 3 steps, global batch 8, micro-batch 2."""
    model, moe = FAMILIES[family]
    toml = write_run(tmp_path, corpus, f"steps = {STEPS}\ndevice = \"cpu\"\n[moe]\n{moe}")  # gloo, also on GPU hosts
    (tmp_path / "config.json").write_text(json.dumps(model))
    text = open(toml).read().replace("global_batch_size = 4", f"global_batch_size = {GLOBAL}")
    open(toml, "w").write(text.replace("val_every = 4", "val_every = 1"))  # a forward alone before each step
    return toml


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_corpus):
    """Single-process runs, one per (family, data ranks), made when first asked for."""
    made = {}

    def get(family: str, data_ranks: int) -> str:
        if (family, data_ranks) not in made:
            d = tmp_path_factory.mktemp(f"ref-{family}-{data_ranks}")
            toml = family_run(d, tiny_corpus, family)
            run_cli("train", toml, f"data.micro_batch_size={MICRO * data_ranks}")
            made[family, data_ranks] = str(d / "run")
        return made[family, data_ranks]

    return get


LAYOUTS = [  # (family, name, processes, overrides, data ranks dp * ep)
    ("qwen3", "dp2", 2, [], 2),
    ("qwen3", "ep2", 2, ["parallel.ep=2"], 2),
    ("qwen3", "ep4", 4, ["parallel.ep=4"], 4),
    ("qwen3", "cp2", 2, ["parallel.cp=2"], 1),
    ("qwen3", "dp2xep2", 4, ["parallel.ep=2"], 4),
    ("qwen3", "cp2xep2", 4, ["parallel.cp=2", "parallel.ep=2"], 2),
    ("qwen3", "dp2xcp2", 4, ["parallel.cp=2"], 2),
    ("qwen3", "hsdp2xep2", 4, ["parallel.ep=2", "parallel.dp_replicate=2"], 4),
    ("qwen3", "torchrun-1", 1, [], 1),  # one process under torchrun: FSDP on a single rank
    ("deepseek_v2", "ep2", 2, ["parallel.ep=2"], 2),
    ("deepseek_v2", "cp2", 2, ["parallel.cp=2"], 1),
    ("gpt_oss", "ep2", 2, ["parallel.ep=2"], 2),
    ("gpt_oss", "cp2", 2, ["parallel.cp=2"], 1),
]


@pytest.mark.parametrize("family,name,n,overrides,data_ranks", LAYOUTS, ids=[f"{f}-{n}" for f, n, *_ in LAYOUTS])
def test_layout_matches_single_process(tmp_path, tiny_corpus, reference, family, name, n, overrides, data_ranks):
    ref = reference(family, data_ranks)
    toml = family_run(tmp_path, tiny_corpus, family)
    torchrun(n, toml, *overrides)
    run = str(tmp_path / "run")
    want, got = metrics(ref), metrics(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in want:  # the gradients' norm too: clipping sees every parameter, also after validation
        for key in ("loss", "grad_norm", "val_loss"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5), (step, key, got[step], want[step])
    a, b = stored_model(final_checkpoint(ref)), stored_model(final_checkpoint(run))
    assert a.keys() == b.keys() and len(a) > 10
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
    from pithtrain.layers.transformer import init_weights
    from pithtrain.models import build_model

    start = build_model(FAMILIES[family][0])
    init_weights(start, 0)  # the runs' seed: the weights both began from
    moved = [k for k, t in start.state_dict().items() if f"model.{k}" in a and not torch.equal(a[f"model.{k}"], t)]
    assert len(moved) > len(a) // 2, moved  # the runs trained: the comparison above is not of initial weights


def run_worker(n: int, script: str, *args) -> None:
    """torchrun `n` gloo processes of tests/`script` with `args`; it must exit 0."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                           os.path.join(ROOT, "tests", script), *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_deduplicated_dispatch_rows_and_numerics(tmp_path):
    """Two ranks, a routing where tokens pick 1 or 2 distinct ranks for their 3 experts: 8 rows sent
    instead of 15, and output plus gradients equal the single-rank MoE (checked in the worker)."""
    out = tmp_path / "counts.json"
    run_worker(2, "ep_worker.py", out)
    counts = json.loads(out.read_text())
    assert counts["send_splits"] == [4, 4] and counts["recv_splits"] == [4, 4]
    assert counts["counted"] == [15, 8]


def test_clip_norm_joined_by_a_rank_without_gradients():
    """A rank with no gradient joins the norm's all-reduce, and gets the global norm (the worker checks)."""
    run_worker(2, "clip_worker.py")


def test_balancing_losses_with_ignored_labels_under_cp(tmp_path):
    """cp=2 where one rank's blocks hold no target (labels -100): the sequence balancing loss (an
    all-reduce over the cp ranks) and the z-loss run on both ranks (a rank with no targets skipped
    the all-reduce and the step hung), and loss, grad norm and gradients equal one process (each
    rank's balancing losses were weighted by its own targets, off by up to 29%)."""
    from conftest import masked_middle_batches
    from pithtrain.train.loop import build_for_training, train_step

    model, _ = FAMILIES["deepseek_v2"]
    toml = write_run(tmp_path, "unused", "device = \"cpu\"\n[moe]\naux_loss = \"sequence\"\naux_loss_coef = 0.1\n"
                     "z_loss_coef = 0.1\n")
    (tmp_path / "config.json").write_text(json.dumps(model))
    run_worker(2, "aux_worker.py", toml, tmp_path / "cp2.pt")
    got = torch.load(tmp_path / "cp2.pt")
    cfg = load_config(toml)
    one = build_for_training(cfg, torch.device("cpu"))
    grads = {}

    class Keep:
        def step(self):
            grads.update({n: p.grad.clone() for n, p in one.named_parameters() if p.grad is not None})

        def zero_grad(self, set_to_none=True):
            one.zero_grad(set_to_none=True)

    batches = [(ids, labels, None, None) for ids, labels in masked_middle_batches(model["vocab_size"], 2, 32, 2)]
    out = train_step(one, Keep(), batches, 0.0, torch.device("cpu"), None)
    assert got["loss"] == pytest.approx(out["loss"].item(), rel=1e-5)
    assert got["grad_norm"] == pytest.approx(out["grad_norm"].item(), rel=1e-5)
    assert got["grads"].keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_dispatch_row_count_formula():
    from pithtrain.parallel.expert import dispatch_rows

    ids = torch.tensor([[0, 1, 2, 3], [0, 4, 5, 7], [6, 7, 4, 5]])  # 8 experts on 4 ranks (2 each)
    assert dispatch_rows(ids, 8, 4) == (12, 2 + 3 + 2)  # ranks {0,1}, {0,2,3}, {3,2}
    assert dispatch_rows(ids, 8, 1) == (12, 3)


def test_direct_callers_get_errors_for_uneven_splits():
    """The splits that plan_layout checks for runs are also checked for direct callers: a sequence
    that 2 x cp blocks do not divide, a cp rank out of range, experts that ep does not divide."""
    from pithtrain.parallel.context import shard_sequence
    from pithtrain.parallel.expert import ExpertGroup

    t = torch.arange(12).view(1, 12)
    assert shard_sequence(t, 2, 1).tolist() == [[3, 4, 5, 6, 7, 8]]  # blocks 1 and 2 of 4
    with pytest.raises(ValueError, match="length 10 must be a multiple of 2 x cp = 4"):
        shard_sequence(torch.arange(10).view(1, -1), 2, 0)
    with pytest.raises(ValueError, match="rank 2 is not in"):
        shard_sequence(t, 2, 2)
    assert ExpertGroup(None, 4, 3, 8).per_rank == 2
    with pytest.raises(ValueError, match="choose an ep that divides"):
        ExpertGroup(None, 3, 0, 8)
    with pytest.raises(ValueError, match="rank 5 is not in"):
        ExpertGroup(None, 4, 5, 8)


def test_checkpoint_reshards_across_layouts(tmp_path, tiny_corpus):
    """Saved under dp2 x ep2 after 2 steps; step 3 continued under ep4 and under one process equals the
    uninterrupted dp2 x ep2 run (and the continuing runs equal each other)."""
    base = tmp_path / "base"
    base.mkdir()
    toml = family_run(base, tiny_corpus, "qwen3")
    torchrun(4, toml, "parallel.ep=2", "checkpoint.every=2", "checkpoint.keep=3")
    full = losses(str(base / "run"))
    saved = os.path.join(base / "run", "checkpoints", f"step-{2:08d}")
    results = {}
    for name, launch in (("ep4", lambda t, *o: torchrun(4, t, "parallel.ep=4", *o)),
                         ("single", lambda t, *o: run_cli("train", t, f"data.micro_batch_size={MICRO * 4}", *o))):
        d = tmp_path / name
        d.mkdir()
        t = family_run(d, tiny_corpus, "qwen3")
        launch(t, f"checkpoint.resume={saved}")
        results[name] = str(d / "run")
        got = losses(results[name])
        assert sorted(got) == [3], got
        assert got[3] == pytest.approx(full[3], rel=1e-5)
    a, b = stored_model(final_checkpoint(results["ep4"])), stored_model(final_checkpoint(results["single"]))
    c = stored_model(final_checkpoint(str(base / "run")))
    for key in c:
        torch.testing.assert_close(a[key], c[key], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b[key], c[key], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world,overrides,message", [
    (3, ["parallel.ep=2"], "world size 3 is not a multiple"),
    (4, ["parallel.ep=4", "model.num_experts=6"], "6 routed experts cannot be split"),
    (2, ["parallel.cp=2", "data.seq_len=30"], "not a multiple of 2 * parallel.cp"),
    (4, ["parallel.ep=2", "data.global_batch_size=4"], "global_batch_size = 4 is not a multiple"),
    (4, ["parallel.dp_replicate=3"], "dp_replicate = 3 does not divide"),
    (2, ["parallel.pp=2"], "pipeline parallelism is not available"),
    (2, ["parallel.ep=2", "model.mlp_only_layers=[0, 1, 2]"], "no MoE layers"),
])
def test_impossible_layouts_fail_before_building(tmp_path, tiny_corpus, world, overrides, message):
    cfg = load_config(family_run(tmp_path, tiny_corpus, "qwen3"), overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan_layout(cfg, world)


def test_single_process_with_a_parallel_layout_is_an_error(tmp_path, tiny_corpus):
    proc = run_cli("train", family_run(tmp_path, tiny_corpus, "qwen3"), "parallel.ep=2", check=False)
    assert proc.returncode != 0
    assert "world size 1 is not a multiple" in proc.stderr + proc.stdout
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


def test_a_stray_launch_environment_is_named(tmp_path, tiny_corpus, monkeypatch):
    """WORLD_SIZE without the rest of torchrun's variables, or not a number, is a config error
    (not a rendezvous that waits or a traceback); a stray RANK in one process is ignored."""
    from pithtrain.parallel.mesh import process_rank, world_size

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "1")
    assert world_size() == 1 and process_rank() == 0
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="WORLD_SIZE=2 is set but MASTER_ADDR, MASTER_PORT not: launch"):
        world_size()
    monkeypatch.setenv("WORLD_SIZE", "abc")
    with pytest.raises(ConfigError, match="WORLD_SIZE='abc' is not an integer"):
        world_size()
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    proc = run_cli("train", family_run(tmp_path, tiny_corpus, "qwen3"), env={"WORLD_SIZE": "2"}, check=False)
    assert proc.returncode == 2 and "unset WORLD_SIZE" in proc.stderr and "Traceback" not in proc.stderr


def test_eval_in_parallel_layouts_equals_one_process(tmp_path, tiny_corpus, reference):
    """`pithtrain eval` of a single-process checkpoint under ep2 and cp2 reads its loss in one process,
    and every rank exits 0 (the process groups are destroyed)."""
    weights = final_checkpoint(reference("qwen3", 2))
    toml = family_run(tmp_path, tiny_corpus, "qwen3")
    value = lambda out: float(re.search(r"validation loss of .*: (\S+) \(perplexity", out).group(1))  # noqa: E731
    one = value(run_cli("eval", toml, weights, f"data.micro_batch_size={MICRO * 2}").stdout)
    for overrides in (["parallel.ep=2"], ["parallel.cp=2"]):
        proc = torchrun(2, toml, weights, *overrides, command="eval")
        assert value(proc.stdout) == pytest.approx(one, abs=2e-4), (overrides, proc.stdout)


def test_init_from_single_process_weights_under_ep2(tmp_path, tiny_corpus, reference):
    """`checkpoint.init_from` (weights only, as `pithtrain convert hf-to-dcp` writes them) of a
    single-process checkpoint under ep2: the first step equals the single-process run from the
    same weights."""
    weights = final_checkpoint(reference("qwen3", 2))
    runs = {}
    for name in ("single", "ep2"):
        d = tmp_path / name
        d.mkdir()
        toml = family_run(d, tiny_corpus, "qwen3")
        if name == "single":
            run_cli("train", toml, "data.micro_batch_size=4", f"checkpoint.init_from={weights}")
        else:
            torchrun(2, toml, "parallel.ep=2", f"checkpoint.init_from={weights}")
        runs[name] = losses(str(d / "run"))
    for step in runs["single"]:
        assert runs["ep2"][step] == pytest.approx(runs["single"][step], rel=1e-5)


def test_every_process_group_times_out_after_parallel_timeout_s(tmp_path):
    """Not only the world group: the ep, dp, HSDP and expert-sharding groups that the meshes make
    also give up after parallel.timeout_s (2 s here), not torch's default (30 min on gloo)."""
    out = tmp_path / "waited.json"
    run_worker(4, "mesh_worker.py", out)
    waited = [(rank, name, s) for rank in (0, 1, 2) for name, s in json.loads(open(f"{out}.{rank}").read()).items()]
    assert {"world ep", "dense replicate", "dense shard", "data"} <= {name for _, name, _ in waited}, waited
    assert all(1.5 < s < 15 for _, _, s in waited), waited


def test_layout_description_names_hsdp():
    from pithtrain.parallel.mesh import Layout

    assert Layout(world=8, dp=4, ep=2, dp_replicate=2).describe() == "dp4 (2 replicas x 2) x ep2"
    assert Layout(world=4, dp=2, cp=2).describe() == "dp2 x cp2" and Layout(world=1).describe() == "single process"
