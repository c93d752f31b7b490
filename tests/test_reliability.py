"""Reliability promises, each by fault injection: a non-finite loss halts the run naming the step,
the rank and the first module that went non-finite, or is skipped (counted, stopped after
train.max_skips in a row); a loss spike is skipped; SIGTERM saves a checkpoint at the next step
boundary and exits 0, and the run resumes from it; the same under torchrun with two ranks."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, TINY_MODEL, run_cli, write_run
from pithtrain.config import ConfigError, load_config
from pithtrain.layers.transformer import init_weights
from pithtrain.models import build_model
from pithtrain.train.guard import StepGuard, TrainingHalted, collective_failure, first_nonfinite_module
from pithtrain.train.loop import train_step


def tiny():
    torch.manual_seed(0)
    model = build_model(TINY_MODEL)
    init_weights(model, seed=0)
    ids = torch.randint(0, TINY_MODEL["vocab_size"], (2, 16))
    return model, [(ids, torch.roll(ids, -1, 1))]


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_nonfinite_step_is_skipped_and_the_next_one_applied(monkeypatch):
    model, batch = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = StepGuard("skip", 3, 0.0, 20)
    before = params(model)
    monkeypatch.setenv("PITHTRAIN_FAULT", "nan-loss:1")
    out = train_step(model, opt, batch, 1.0, torch.device("cpu"), None, guard=guard, step=1)
    assert out["skipped"] == "non-finite loss"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # no update at all
    assert all(p.grad is None for p in model.parameters()) and not opt.state  # nothing carried over
    out = train_step(model, opt, batch, 1.0, torch.device("cpu"), None, guard=guard, step=2)
    assert out["skipped"] is None and torch.isfinite(out["loss"])
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_skips_in_a_row_stop_the_run():
    guard = StepGuard("skip", 2, 0.0, 20)
    guard.count("non-finite loss", 5)
    guard.count(None, 6)  # an applied step resets the run of skips
    guard.count("non-finite loss", 7)
    guard.count("non-finite gradient", 8)
    with pytest.raises(TrainingHalted, match="step 9: 3 steps in a row were skipped"):
        guard.count("non-finite loss", 9)
    assert guard.skipped_total == 4


def test_loss_spike_is_skipped_once_the_window_is_full():
    guard = StepGuard("halt", 3, 3.0, 3)
    norm = torch.tensor(1.0)
    for loss in (2.0, 9.0, 1.0, 5.0):  # 9.0 came before the window was full; 5.0 < 3 x mean(2, 9, 1)
        assert guard.check(torch.tensor(loss * 10), 10, norm, None) == (None, [], False)
    reason, _, _ = guard.check(torch.tensor(30.0 * 10), 10, norm, None)  # 30 > 3 x mean(9, 1, 5)
    assert reason == "loss spike: 30 > 3 x recent mean 5"
    assert guard.recent == [9.0, 1.0, 5.0]  # a skipped step does not enter the baseline
    assert guard.check(torch.tensor(1.0), 1, torch.tensor(float("inf")), None)[0] == "non-finite gradient"
    assert guard.check(torch.tensor(1.0), 1, norm, None, stop=True)[2] is True


def test_first_nonfinite_module_is_named():
    model, batch = tiny()
    with torch.no_grad():
        model.model.layers["2"].self_attn.o_proj.weight[0, 0] = float("nan")
    assert first_nonfinite_module(model, lambda: model(batch[0][0])) == "model.layers.2.self_attn.o_proj"
    with torch.no_grad():
        model.model.layers["2"].self_attn.o_proj.weight[0, 0] = 0.0
    assert first_nonfinite_module(model, lambda: model(batch[0][0])) is None


def test_first_nonfinite_module_is_named_when_the_dense_parts_are_compiled():
    """The hooks' finiteness test is data-dependent: inside a fullgraph-compiled region it would fail
    to trace, so the search forward runs eagerly."""
    torch._dynamo.reset()
    model, batch = tiny()
    model.compile_dense()
    with torch.no_grad():
        model(batch[0][0])  # compiled without hooks
        model.model.layers["1"].self_attn.o_proj.weight[0, 0] = float("nan")
    assert first_nonfinite_module(model, lambda: model(batch[0][0])) == "model.layers.1.self_attn.o_proj"


def test_halt_runs_again_the_micro_batch_that_went_non_finite():
    """The NaN sits in an embedding row that only the second micro-batch looks up: the halt names
    that micro-batch and the embedding, not a finite forward of the first."""
    model, _ = tiny()
    first = torch.full((2, 16), 1)
    second = first.clone()
    second[1, 5] = 2
    with torch.no_grad():
        model.model.embed_tokens.weight[2, 0] = float("nan")
    batches = [(first, first), (second, second)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TrainingHalted, match="micro-batch 2 of 2: model.embed_tokens"):
        train_step(model, opt, batches, 1.0, torch.device("cpu"), None, guard=StepGuard("halt", 3, 0.0, 20), step=1)


def test_halt_is_reported_when_the_search_for_the_module_fails(monkeypatch):
    """The search's eager forward can run out of memory (FlexAttention's scores materialise): the
    run still halts with the step's reason, and says the search failed."""
    import pithtrain.train.loop as loop

    def no_memory(model, forward):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB")

    monkeypatch.setattr(loop, "first_nonfinite_module", no_memory)
    model, batch = tiny()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = float("nan")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want = (r"step 1: non-finite loss on rank\(s\) \[0\]; the search for the first non-finite module in "
            r"micro-batch 1 of 1 failed \(OutOfMemoryError: CUDA out of memory")
    with pytest.raises(TrainingHalted, match=want):
        train_step(model, opt, batch, 1.0, torch.device("cpu"), None, guard=StepGuard("halt", 3, 0.0, 20), step=1)


def test_sigterm_during_a_step_stops_after_that_step():
    """The flag is read at the step's decision, not when the step starts."""
    from pithtrain.train.guard import Preemption

    model, batch = tiny()
    preemption = Preemption()
    handle = model.model.norm.register_forward_hook(lambda *a: setattr(preemption, "flag", True))
    out = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, 1.0, torch.device("cpu"), None,
                     guard=StepGuard("halt", 3, 0.0, 20), step=1, preemption=preemption)
    handle.remove()
    assert out["stop"] is True and out["skipped"] is None


def test_halt_names_step_rank_and_module(tiny_corpus, tmp_path):
    toml = write_run(tmp_path, tiny_corpus)
    proc = run_cli("train", toml, "train.steps=6", "train.device=cpu", "log.every=1",
                   env={"PITHTRAIN_FAULT": "nan-loss:3"}, check=False)
    assert proc.returncode == 3, proc.stderr
    assert "training halted (rank 0): step 3: non-finite loss on rank(s) [0]" in proc.stderr
    assert "forward of micro-batch 1 of 2 stays finite" in proc.stderr  # the NaN was put into the loss
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        assert max(json.loads(line)["step"] for line in f) <= 2  # nothing was logged for step 3


def test_skip_and_spike_policies_through_the_loop(tiny_corpus, tmp_path, monkeypatch):
    from pithtrain.train.loop import train

    toml = write_run(tmp_path, tiny_corpus)
    monkeypatch.setenv("PITHTRAIN_FAULT", "nan-loss:3")
    summary = train(load_config(toml, ["train.steps=5", "train.device=cpu", "train.nonfinite=skip",
                                       f"log.run_dir={tmp_path}/skip"]))
    assert summary["skipped_steps"] == 1 and math.isfinite(summary["train_loss"])
    monkeypatch.setenv("PITHTRAIN_FAULT", "spike-loss:6")
    summary = train(load_config(toml, ["train.steps=7", "train.device=cpu", "train.spike_factor=5",
                                       "train.spike_window=3", f"log.run_dir={tmp_path}/spike"]))
    assert summary["skipped_steps"] == 1
    with pytest.raises(ConfigError, match="spike_factor"):
        load_config(toml, ["train.spike_factor=0.5"])


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4: the parent's pid
                found.append(int(entry))
    return found


def _wait_for_step(metrics: str, proc, timeout: float = 120) -> None:
    end = time.time() + timeout
    while time.time() < end:
        assert proc.poll() is None, proc.communicate()
        if os.path.exists(metrics) and os.path.getsize(metrics) > 0:
            return
        time.sleep(0.2)
    raise AssertionError("no step was logged in time")


@pytest.mark.parametrize("ranks", [1, 2])
def test_sigterm_saves_and_exits_cleanly_then_resumes(tiny_corpus, tmp_path, ranks):
    from conftest import losses

    toml = write_run(tmp_path, tiny_corpus, "device = \"cpu\"\n")
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "pithtrain"] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m", "pithtrain"]
    proc = subprocess.Popen(launch + ["train", toml, "train.steps=500", "log.every=1"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _wait_for_step(str(run_dir / "metrics.jsonl"), proc)
    t0 = time.time()
    if ranks == 1:
        os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler signals the job's processes
    else:  # the ranks only: torchrun's agent, signalled itself, exits 1 whatever its workers do
        for pid in _children(proc.pid):
            os.kill(pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    took = time.time() - t0
    saved = sorted(p for p in os.listdir(run_dir / "checkpoints") if p.startswith("step-"))
    assert len(saved) == 1 and os.path.exists(run_dir / "checkpoints" / saved[0] / "complete.json"), (out, err)
    step = int(saved[0].split("-")[1])
    assert 1 <= step < 500 and f"SIGTERM: checkpoint of step {step} saved" in out, (out, err)
    assert proc.returncode == 0, err  # every rank exited 0 (and so did torchrun)
    assert took < 60
    resume = ["train.steps=500", f"train.stop_at={step + 2}", "log.every=1"]
    resumed = run_cli("train", toml, *resume, "checkpoint.resume=auto")
    assert "resumed from" in resumed.stdout and step + 2 in losses(str(run_dir))
    if ranks == 1:  # the same losses as a run that was never signalled
        run_cli("train", toml, *resume, f"log.run_dir={tmp_path}/straight")
        assert losses(str(run_dir)) == losses(f"{tmp_path}/straight")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.parametrize("fault", ["raise", "kill", "sleep"])
def test_a_failing_rank_ends_the_whole_job(tiny_corpus, tmp_path, fault):
    """4 ranks (dp2 x ep2) under torchrun; rank 2 raises, is SIGKILLed, or stops participating at
    step 3. Every process is gone within 60 s of step 2's record, the job exits non-zero, and the
    output names the rank and the cause (the traceback for `raise`, the collective timeout and
    the rank that never reached it for `sleep`)."""
    toml = write_run(tmp_path, tiny_corpus, "device = \"cpu\"\n")
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "PITHTRAIN_FAULT": f"{fault}:3:2"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                             "-m", "pithtrain", "train", toml, "train.steps=50", "log.every=1", "parallel.ep=2",
                             "parallel.timeout_s=10", "data.global_batch_size=8"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    metrics = str(run_dir / "metrics.jsonl")
    end = time.time() + 180
    while time.time() < end and proc.poll() is None:
        if os.path.exists(metrics) and any(json.loads(line)["step"] >= 2 for line in open(metrics)):
            break
        time.sleep(0.1)
    t0 = time.time()
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    took = time.time() - t0
    deadline = time.time() + 10
    while _group_alive(proc.pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not _group_alive(proc.pid), "ranks are still running"
    assert proc.returncode != 0
    assert took < 60, took
    text = out + err
    assert "Failed to parse reply file" not in text, text[-3000:]  # no error file cut short by torchrun's stop
    if fault == "raise":  # the failing rank is listed with its exception and traceback
        assert re.search(r"rank      : 2 \(local_rank: 2\)\s+exitcode  : 1 ", text), text[-3000:]
        assert "injected fault: rank raised at step 3" in text and "Traceback" in text
    if fault in ("raise", "kill"):  # a survivor whose collective lost rank 2 names it (with any rank still blocked)
        named = [m.split(", ") for m in re.findall(r"a collective lost its connection .*?rank\(s\) ([\d, ]+) did not", text)]
        assert any("2" in ranks for ranks in named), text[-3000:]
    if fault == "kill":  # listed with its signal (root cause or not: a survivor's broken collective can be seen first)
        assert re.search(r"rank      : 2 \(local_rank: 2\)\s+exitcode  : -9 .*SIGKILL", text), text[-3000:]
    if fault == "sleep":  # the others time out and say so; the hung rank is the one torchrun must SIGKILL
        assert "waited longer than parallel.timeout_s = 10 s" in text, text[-3000:]
        assert "rank(s) 2 did not reach it" in text, text[-3000:]  # named by the ranks whose collective failed
        killed = [block for block in text.split("[") if "SIGKILL" in block and "rank      :" in block]
        assert killed and all("rank      : 2" in block for block in killed), text[-3000:]
    print(f"{fault}: all ranks gone {took:.1f} s after step 2's record")


@pytest.mark.parametrize("point", ["save-after-tensors", "save-before-marker"])
def test_killed_saves_and_corrupt_checkpoints(tiny_corpus, tmp_path, point):
    """A save killed at either point leaves the previous checkpoint; the partial one is ignored and
    removed. A flipped byte (same size) and a truncated file are refused with the path and file
    named; resume=auto passes over them, says so, and continues from the newest valid one."""
    from pithtrain.train import checkpoint

    toml = write_run(tmp_path, tiny_corpus, "device = \"cpu\"\n")
    ckdir = tmp_path / "run" / "checkpoints"
    base = ["train.steps=6", "checkpoint.every=2", "checkpoint.keep=5"]
    proc = run_cli("train", toml, *base, env={"PITHTRAIN_FAULT": f"{point}:4"}, check=False)
    assert proc.returncode == 137
    assert checkpoint.newest_valid(str(ckdir)) == (str(ckdir / "step-00000002"), [])
    run_cli("train", toml, *base, "checkpoint.resume=auto")
    assert sorted(os.listdir(ckdir)) == ["step-00000002", "step-00000004", "step-00000006"]  # partial removed
    flipped = next(p for p in (ckdir / "step-00000006").iterdir() if p.suffix == ".distcp")
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    truncated = next(p for p in (ckdir / "step-00000004").iterdir() if p.suffix == ".distcp")
    truncated.write_bytes(truncated.read_bytes()[:100])
    with pytest.raises(checkpoint.CheckpointError, match=f"step-00000006: {flipped.name} is corrupt"):
        checkpoint.verify(str(ckdir / "step-00000006"), checksums=True)
    proc = run_cli("train", toml, "train.steps=8", f"checkpoint.resume={ckdir}/step-00000006", check=False)
    assert proc.returncode == 2 and f"step-00000006: {flipped.name} is corrupt" in proc.stderr
    out = run_cli("train", toml, "train.steps=8", "checkpoint.every=2", "checkpoint.keep=5", "checkpoint.resume=auto")
    assert f"passed over: checkpoint {ckdir}/step-00000006: {flipped.name} is corrupt" in out.stdout
    assert f"passed over: checkpoint {ckdir}/step-00000004: {truncated.name} has 100 bytes" in out.stdout
    assert f"resumed from {ckdir}/step-00000002 at step 2" in out.stdout


def test_exact_resume_after_a_crash_under_dp2_x_ep2(tiny_corpus, tmp_path):
    """dp2 x ep2 (4 gloo ranks, fp32): a run killed at step 5 (rank 1, SIGKILL) and resumed with
    resume=auto from its step-3 checkpoint logs the uninterrupted run's losses, bit for bit."""
    from conftest import losses

    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}

    def torchrun(run_dir, *extra, fault=None):
        e = {**env, "PITHTRAIN_FAULT": fault} if fault else env
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                               "-m", "pithtrain", "train", toml, "train.steps=6", "log.every=1", "parallel.ep=2",
                               "data.global_batch_size=8", "checkpoint.every=3", f"log.run_dir={run_dir}", *extra],
                              cwd=ROOT, env=e, capture_output=True, text=True, timeout=600)

    toml = write_run(tmp_path, tiny_corpus, "device = \"cpu\"\n")
    whole = torchrun(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    crashed = torchrun(tmp_path / "crashed", fault="kill:5:1")
    assert crashed.returncode != 0 and max(losses(str(tmp_path / "crashed"))) == 4
    resumed = torchrun(tmp_path / "crashed", "checkpoint.resume=auto")
    assert resumed.returncode == 0 and "at step 3" in resumed.stdout, resumed.stderr[-3000:]
    a, b = losses(str(tmp_path / "whole")), losses(str(tmp_path / "crashed"))
    assert sorted(a) == sorted(b) == list(range(1, 7)) and a == b  # floats compared exactly


def test_out_of_memory_is_reported_with_a_breakdown(tiny_corpus, tmp_path, monkeypatch):
    from pithtrain.layers.transformer import CausalLM
    from pithtrain.train.loop import train

    toml = write_run(tmp_path, tiny_corpus, "device = \"cpu\"\n")
    forward = CausalLM.forward
    calls = []

    def failing(self, *a, **kw):
        calls.append(1)
        if len(calls) > 3:  # after the first step: AdamW states exist
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return forward(self, *a, **kw)

    monkeypatch.setattr(CausalLM, "forward", failing)
    with pytest.raises(TrainingHalted) as e:
        train(load_config(toml, ["train.steps=4", "data.val_every=0"]))
    text = str(e.value)
    assert "out of memory on cpu: CUDA out of memory. Tried to allocate 20.00 GiB" in text
    assert "parameters 0.00 GB, gradients" in text and "AdamW states" in text and "train.recompute=both" in text
    assert "estimated peak" in text and "activations" in text  # the estimator's breakdown
    assert "cuda_graphs" not in text  # off in this run
    calls.clear()  # the same during validation (eval mode), after the first step; the SIGTERM handler goes

    def failing_in_eval(self, *a, **kw):
        if not self.training:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.32 GiB")
        return forward(self, *a, **kw)

    monkeypatch.setattr(CausalLM, "forward", failing_in_eval)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingHalted, match="out of memory on cpu: .* 2.32 GiB"):
        train(load_config(toml, ["train.steps=4", "data.val_every=2", f"log.run_dir={tmp_path}/val"]))
    assert signal.getsignal(signal.SIGTERM) == handler
    from pithtrain.tools.memory import MemoryEstimate
    from pithtrain.train.guard import out_of_memory_report
    model, error = torch.nn.Linear(2, 2), torch.OutOfMemoryError("CUDA out of memory")
    under_graphs = MemoryEstimate(*[0.0] * 6, outside_graphs=2.0 * 2**30)  # the estimate of a step under the graphs
    text = out_of_memory_report(model, torch.optim.AdamW(model.parameters()), torch.device("cpu"), error, under_graphs)
    assert "to fit: train.cuda_graphs=off (their memory pool is held apart" in text


def test_a_corpus_from_another_tokenizer_is_refused(tiny_corpus, tmp_path):
    """Resuming on a corpus built with another tokenizer, starting from a training checkpoint on one,
    or starting from weights that come with a different tokenizer, stops before training with both
    named."""
    import shutil

    from pithtrain.train import checkpoint
    from pithtrain.train.corpus import build_corpus, demo_texts
    from pithtrain.train.loop import train

    other = tmp_path / "other"
    src = tmp_path / "src"
    src.mkdir()
    for i, text in enumerate(demo_texts()[:120]):
        (src / f"{i}.txt").write_text(text)
    build_corpus([str(src)], str(other), None, workers=1, demo_vocab_size=300, val_fraction=0.1)
    toml = write_run(tmp_path, tiny_corpus, "device = \"cpu\"\n")
    train(load_config(toml, ["train.steps=2", "optim.warmup_steps=1"]))
    with pytest.raises(ConfigError, match="another tokenizer"):
        train(load_config(toml, ["train.steps=3", "optim.warmup_steps=1", "checkpoint.resume=auto",
                                 f"data.corpus={other}"]))
    weights = tmp_path / "run" / "checkpoints" / "step-00000002"
    with pytest.raises(ConfigError, match="comes with a tokenizer"):  # the corpus's tokenizer.json, which it holds
        train(load_config(toml, ["train.steps=2", "optim.warmup_steps=1", f"checkpoint.init_from={weights}",
                                 f"log.run_dir={tmp_path}/fresh", f"data.corpus={other}"]))
    os.remove(weights / "tokenizer.json")  # as checkpoints were saved before they held it: trainer.json says
    marker = json.loads((weights / "complete.json").read_text())
    del marker["files"]["tokenizer.json"]
    (weights / "complete.json").write_text(json.dumps(marker))
    with pytest.raises(ConfigError, match="was trained on a corpus with another tokenizer"):
        train(load_config(toml, ["train.steps=2", "optim.warmup_steps=1", f"checkpoint.init_from={weights}",
                                 f"log.run_dir={tmp_path}/fresh", f"data.corpus={other}"]))
    shutil.copy(other / "tokenizer.json", weights / "tokenizer.json")  # as `convert` stores a model's tokenizer
    marker["files"]["tokenizer.json"] = {"bytes": os.path.getsize(weights / "tokenizer.json"),
                                         "crc32": checkpoint._crc32(str(weights / "tokenizer.json"))}
    (weights / "complete.json").write_text(json.dumps(marker))
    with pytest.raises(ConfigError, match="comes with a tokenizer"):
        train(load_config(toml, ["train.steps=2", "optim.warmup_steps=1", f"checkpoint.init_from={weights}",
                                 f"log.run_dir={tmp_path}/fresh"]))


def test_a_checkpoint_with_the_vocabulary_only_fingerprint_resumes(tiny_corpus, tmp_path, monkeypatch):
    """Checkpoints that hold the older fingerprint (the vocabulary alone) resume on their corpus."""
    from pithtrain.train import loop
    from pithtrain.train.corpus import vocabulary_fingerprint

    toml = write_run(tmp_path, tiny_corpus, "device = \"cpu\"\n")
    with monkeypatch.context() as m:
        m.setattr(loop, "tokenizer_fingerprint", vocabulary_fingerprint)  # as the checkpoints were written then
        loop.train(load_config(toml, ["train.steps=2", "optim.warmup_steps=1"]))
    summary = loop.train(load_config(toml, ["train.steps=3", "optim.warmup_steps=1", "checkpoint.resume=auto"]))
    assert summary["start_step"] == 2 and math.isfinite(summary["train_loss"])


def test_resume_refuses_another_seq_len_or_model_and_notes_another_global_batch(tiny_corpus, tmp_path, capsys):
    from pithtrain.train.corpus import CorpusError
    from pithtrain.train.loop import train

    toml = write_run(tmp_path, tiny_corpus, "device = \"cpu\"\n")
    train(load_config(toml, ["train.steps=2", "optim.warmup_steps=1"]))
    with pytest.raises(CorpusError, match="data.seq_len=32"):
        train(load_config(toml, ["train.steps=3", "optim.warmup_steps=1", "checkpoint.resume=auto", "data.seq_len=33"]))
    with pytest.raises(ConfigError, match=r"another model config \(rms_norm_eps: 1e-06 there, 0.001 now\)"):
        train(load_config(toml, ["train.steps=3", "optim.warmup_steps=1", "checkpoint.resume=auto",
                                 "model.rms_norm_eps=0.001"]))  # same shapes, other maths
    capsys.readouterr()  # a new run from those weights may change the maths (a longer RoPE, ...): said, not refused
    train(load_config(toml, ["train.steps=1", "optim.warmup_steps=1", "model.rms_norm_eps=0.001",
                             f"checkpoint.init_from={tmp_path}/run/checkpoints/step-00000002", f"log.run_dir={tmp_path}/i"]))
    assert ("was saved with another model config (rms_norm_eps: 1e-06 there, 0.001 now): its weights train under "
            "this run's") in capsys.readouterr().out
    model_json = tmp_path / "config.json"  # the model's config re-saved: only the file's metadata differs
    model_json.write_text(json.dumps({**json.loads(model_json.read_text()), "transformers_version": "9.9.9",
                                      "architectures": ["Qwen3MoeForCausalLM"], "use_cache": False}))
    capsys.readouterr()
    train(load_config(toml, ["train.steps=3", "optim.warmup_steps=1", "checkpoint.resume=auto",
                             "data.global_batch_size=8"]))
    assert "data.global_batch_size changed from 4 to 8" in capsys.readouterr().out
    train(load_config(toml, ["train.steps=1", "optim.warmup_steps=1", "data.val_batches=1000", f"log.run_dir={tmp_path}/v"]))
    assert "data.val_batches = 1000, but the validation split holds" in capsys.readouterr().out


def test_resume_keeps_the_spike_window_and_refuses_a_finished_run(tiny_corpus, tmp_path, monkeypatch):
    """The guard's recent losses and skip counts are in the checkpoint: a run paused at step 3 and
    resumed skips the spike of step 5 as the run that never stopped does, with the same losses
    after it. Resuming a run already at train.steps is an error, not a silent no-op."""
    from conftest import losses
    from pithtrain.train.loop import train

    toml = write_run(tmp_path, tiny_corpus, "device = \"cpu\"\n")
    monkeypatch.setenv("PITHTRAIN_FAULT", "spike-loss:5")
    common = ["train.steps=6", "optim.warmup_steps=1", "train.spike_factor=5", "train.spike_window=2", "log.every=1"]
    whole = train(load_config(toml, common + [f"log.run_dir={tmp_path}/whole"]))
    train(load_config(toml, common + [f"log.run_dir={tmp_path}/parts", "train.stop_at=3"]))
    parts = train(load_config(toml, common + [f"log.run_dir={tmp_path}/parts", "checkpoint.resume=auto"]))
    assert whole["skipped_steps"] == parts["skipped_steps"] == 1
    assert losses(f"{tmp_path}/parts")[6] == losses(f"{tmp_path}/whole")[6]
    with pytest.raises(ConfigError, match="the run is done"):
        train(load_config(toml, common + [f"log.run_dir={tmp_path}/parts", "checkpoint.resume=auto"]))


def test_a_pause_after_a_skipped_first_step_resumes_exactly(tiny_corpus, tmp_path, monkeypatch):
    """A checkpoint saved when every step so far was skipped (AdamW has no state yet) holds step
    counts of 0, so the resumed run's first update is bias-corrected as the first, as straight through."""
    from conftest import losses
    from pithtrain.train.loop import train

    toml = write_run(tmp_path, tiny_corpus, "device = \"cpu\"\n")
    monkeypatch.setenv("PITHTRAIN_FAULT", "nan-loss:1")
    common = ["train.steps=4", "optim.warmup_steps=1", "train.nonfinite=skip", "log.every=1"]
    whole = train(load_config(toml, common + [f"log.run_dir={tmp_path}/whole"]))
    train(load_config(toml, common + [f"log.run_dir={tmp_path}/parts", "train.stop_at=1"]))
    parts = train(load_config(toml, common + [f"log.run_dir={tmp_path}/parts", "checkpoint.resume=auto"]))
    assert whole["skipped_steps"] == parts["skipped_steps"] == 1
    assert losses(f"{tmp_path}/parts") == losses(f"{tmp_path}/whole")


def test_deterministic_switch(tiny_corpus, tmp_path):
    """train.deterministic turns on torch's deterministic algorithms; on CPU two runs are equal."""
    from conftest import losses

    toml = write_run(tmp_path, tiny_corpus, "device = \"cpu\"\ndeterministic = true\n")
    for name in ("a", "b"):
        run_cli("train", toml, "train.steps=3", "log.every=1", f"log.run_dir={tmp_path}/{name}")
    assert losses(f"{tmp_path}/a") == losses(f"{tmp_path}/b")
    try:
        from pithtrain.train.loop import set_deterministic

        set_deterministic()
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_the_deterministic_option_reaches_the_switch(tiny_corpus, tmp_path, monkeypatch):
    """train() calls set_deterministic when train.deterministic is on, and only then."""
    from pithtrain.train import loop

    switched = []
    monkeypatch.setattr(loop, "set_deterministic", lambda: switched.append(True))
    toml = write_run(tmp_path, tiny_corpus, "device = \"cpu\"\n")
    for flag in ("false", "true"):
        loop.train(load_config(toml, ["train.steps=1", "optim.warmup_steps=1", f"train.deterministic={flag}",
                                      f"log.run_dir={tmp_path}/{flag}"]))
    assert switched == [True]


def test_a_run_that_cannot_fit_is_refused_before_allocation():
    """The memory estimate (tools/memory.py) against a 139 GB device: Qwen3-30B-A3B (30.5 B
    parameters, built on the meta device) cannot train on one GPU (the states alone: more ranks or
    bf16), fits on 8 ranks at micro-batch 1 x 4096, and at micro-batch 8 its activations do not
    (recompute or a smaller micro-batch); a device that holds the eager step of one micro-batch does
    not hold it under train.cuda_graphs, and the message names turning them off first; each
    message gives the numbers and what to change."""
    from pithtrain.config import load_config
    from pithtrain.tools.memory import GB, check_fits, estimate_for_run

    toml = os.path.join(ROOT, "examples", "qwen3_30b_a3b", "train.toml")
    h200 = int(139 * GB)
    one = estimate_for_run(load_config(toml, []), world=1)
    assert abs(one.weights / 4 - 30.53e9) < 0.01e9  # fp32 weights, counted exactly
    with pytest.raises(ConfigError, match=r"does not fit on 1 rank\(s\): estimated peak 5\d\d\.\d\d GB .*"
                                          r"weights 113\.74 GB.*To fit: more ranks"):
        check_fits(one, h200, 1)
    eight = estimate_for_run(load_config(toml, []), world=8, data_ranks=8)  # dp8, as the loop passes it
    check_fits(eight, h200, 8)
    assert 60 * GB < eight.total < 139 * GB
    big = estimate_for_run(load_config(toml, ["data.micro_batch_size=8", "data.global_batch_size=64"]), world=8,
                          data_ranks=8)  # one micro-batch a step per rank: the backward walk
    assert big.activations == pytest.approx(8 * eight.activations)
    with pytest.raises(ConfigError, match=r"on 8 rank.*To fit: train.recompute=both .*parallel.cp"):
        check_fits(big, h200, 8)
    done = load_config(toml, ["data.micro_batch_size=8", "data.global_batch_size=64", "train.recompute=both"])
    with pytest.raises(ConfigError, match=r"To fit: a smaller data.micro_batch_size .*, or parallel.cp") as e:
        check_fits(big, h200, 8, done)  # the advice leaves out what the run already does
    assert "train.recompute=both" not in str(e.value).split("To fit:")[1]
    bf16 = load_config(toml, ["train.param_dtype=bf16"])
    with pytest.raises(ConfigError, match=r"To fit: more ranks .*, or a smaller model") as e:
        check_fits(one, h200, 1, bf16)
    assert "param_dtype" not in str(e.value).split("To fit:")[1]
    check_fits(one, None)  # no device to compare with (CPU): nothing to say
    one_mb = ["train.param_dtype=bf16", "data.global_batch_size=1"]  # graphs: one process, one micro-batch a step
    eager = estimate_for_run(load_config(toml, one_mb))
    graphs = estimate_for_run(load_config(toml, one_mb + ["train.cuda_graphs=on"]))
    check_fits(eager, int(eager.total) + 1)
    with pytest.raises(ConfigError, match=r"To fit: train.cuda_graphs=off \(their memory pool"):
        check_fits(graphs, int(eager.total) + 1)


def test_collective_failures_are_told_from_other_errors():
    """A collective's own timeout and a peer that went away (gloo's and NCCL's wording) are
    collective failures, which the loop reports with the ranks that never reached them; anything
    else, a halt of ours included, is not."""
    assert collective_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Timed out waiting 10000ms")) == "timeout"
    assert collective_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:1")) == "peer"
    assert collective_failure(RuntimeError("NCCL error: remote process exited or there was a network error")) == "peer"
    assert collective_failure(RuntimeError("Connection reset by peer")) == "peer"
    assert collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert collective_failure(TrainingHalted("a collective timed out earlier")) is None
    assert collective_failure(ValueError("timed out")) is None


def test_a_resume_under_another_aux_free_setting_or_parameter_dtype_is_named(tiny_corpus, tmp_path, capsys):
    """DeepSeek-V3's routers hold their correction bias with or without moe.aux_free, so the tensors
    cannot tell; trainer.json does: a resume under the other setting is refused naming it. A changed
    train.param_dtype is converted, and said."""
    from conftest import DEEPSEEK_V3
    from pithtrain.train.loop import train

    toml = write_run(tmp_path, tiny_corpus, "device = \"cpu\"\n", **dict(DEEPSEEK_V3, vocab_size=512))
    train(load_config(toml, ["train.steps=2", "optim.warmup_steps=1", "moe.aux_free=true"]))
    with pytest.raises(ConfigError, match="trained with moe.aux_free = true: set moe.aux_free=true as it was"):
        train(load_config(toml, ["train.steps=3", "optim.warmup_steps=1", "checkpoint.resume=auto"]))
    capsys.readouterr()
    train(load_config(toml, ["train.steps=3", "optim.warmup_steps=1", "checkpoint.resume=auto", "moe.aux_free=true",
                             "train.param_dtype=bf16"]))
    assert "train.param_dtype changed from fp32 to bf16" in capsys.readouterr().out
