"""`pithtrain demo` end to end, with fewer steps than `make demo` runs."""

import json
import math
import os
import re

from conftest import run_cli


def test_demo_short(tmp_path):
    out = run_cli("demo", "--work-dir", str(tmp_path), "--workers", "1", "train.steps=60",
                  "optim.warmup_steps=5", "data.val_every=30", "checkpoint.every=0", "log.progress=false",
                  "train.threads=2").stdout
    run_dir = re.search(r"run directory: (\S+)", out).group(1)
    train_loss, val_loss = map(float, re.search(r"final train loss: (\S+)\s+validation loss: (\S+)", out).groups())
    assert re.search(r"throughput: [\d,]+ tokens/s", out)
    png = re.search(r"loss curve: (\S+)", out).group(1)
    assert os.path.isfile(png) and os.path.isfile(os.path.join(run_dir, "metrics.jsonl"))
    # 60 steps take the loss well below a uniform guess over the 4096-token vocabulary
    assert val_loss < 0.85 * math.log(4096) and train_loss < 0.85 * math.log(4096)
    assert os.path.isdir(os.path.join(run_dir, "checkpoints", "step-00000060"))
    # a second demo replaces its own previous run instead of refusing or appending to it
    again = run_cli("demo", "--work-dir", str(tmp_path), "train.steps=2", "optim.warmup_steps=1",
                    "checkpoint.every=0", "log.progress=false").stdout
    assert "removing the previous demo run" in again
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [2]  # log.every = 10: only the last step
    # asked to resume it, the demo keeps its run; asked to start from its weights, or over a folder
    # that is not a demo run, it refuses before removing anything
    resumed = run_cli("demo", "--work-dir", str(tmp_path), "train.steps=3", "optim.warmup_steps=1",
                      "checkpoint.resume=auto", "log.progress=false").stdout
    assert "removing" not in resumed and "resumed from" in resumed, resumed
    step3 = os.path.join(run_dir, "checkpoints", "step-00000003")
    proc = run_cli("demo", "--work-dir", str(tmp_path), f"checkpoint.init_from={step3}", check=False)
    assert proc.returncode == 2 and "lies in the previous demo run" in proc.stderr and os.path.isdir(step3)
    os.rename(os.path.join(run_dir, "run_config.json"), os.path.join(run_dir, "notes.txt"))
    proc = run_cli("demo", "--work-dir", str(tmp_path), check=False)
    assert proc.returncode == 2 and "is not a demo run" in proc.stderr and os.path.isdir(step3), proc.stderr
    os.rename(os.path.join(run_dir, "notes.txt"), os.path.join(run_dir, "run_config.json"))
    # a run directory of the user's is not the demo's own: neither it nor the demo's is removed
    mine = ["demo", "--work-dir", str(tmp_path), "train.steps=1", "optim.warmup_steps=1", "log.progress=false",
            f"log.run_dir={tmp_path}/mine"]
    assert "removing" not in run_cli(*mine).stdout and os.path.isdir(run_dir)
    proc = run_cli(*mine, check=False)
    assert proc.returncode == 2 and "mine already holds a run" in proc.stderr, proc.stderr
    assert os.path.isdir(os.path.join(tmp_path, "mine", "checkpoints", "step-00000001")) and os.path.isdir(run_dir)


def test_demo_checks_its_overrides_before_building_the_corpus(tmp_path):
    proc = run_cli("demo", "--work-dir", str(tmp_path), "data.seqlen=3", check=False)
    assert proc.returncode == 2 and "unknown key data.seqlen" in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / "demo-corpus")
    launched = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    proc = run_cli("demo", "--work-dir", str(tmp_path), env=launched, check=False)  # under torchrun: refused
    assert proc.returncode == 2 and "runs in one process" in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / "demo-corpus")
    # a corpus of the user's: trained on, and the demo's own not built (a missing one says so)
    proc = run_cli("demo", "--work-dir", str(tmp_path), f"data.corpus={tmp_path}/mine", check=False)
    assert proc.returncode == 2 and "mine" in proc.stderr and "building the demo corpus" not in proc.stdout, proc.stderr
    assert not os.path.exists(tmp_path / "demo-corpus")
