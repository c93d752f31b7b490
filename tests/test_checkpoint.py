"""Checkpoint edge cases, in process: pruning after resuming an earlier step, every refused
checkpoint reported, clear errors for weights-only and mismatched checkpoints, tied embeddings,
saves cut short, damaged markers, folders that are not checkpoints, and bad Hugging Face folders (`pithtrain convert`)."""

import json
import logging
import os
import re
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from conftest import QWEN3
from pithtrain.layers.transformer import init_weights
from pithtrain.models import build_model
from pithtrain.train import checkpoint, hf
from pithtrain.train.checkpoint import CheckpointError


def model_and_optimizer(seed: int = 1, **cfg):
    model = build_model(dict(QWEN3, **cfg))
    init_weights(model, seed=seed)
    return model, torch.optim.AdamW(model.parameters())


def save(root, step, model_opt, keep=5, **trainer):
    return checkpoint.save(str(root), step, *model_opt, {"data": {}, **trainer}, keep=keep, hf_config=QWEN3)


def names(root):
    return sorted(os.listdir(root))


def test_saving_after_resuming_an_earlier_step_sets_the_newer_timeline_aside(tmp_path, caplog):
    """Resumed from step 10 while 20 exists: saving 11 keeps 11 (even with keep=1), moves 20 aside
    (not deleted, not resumed by resume=auto, not removed at start) and counts only steps <= 11."""
    mo = model_and_optimizer()
    for s in (5, 10, 20):
        save(tmp_path, s, mo)
    (tmp_path / "final").mkdir()  # a user's own folder is never touched
    with caplog.at_level(logging.WARNING, logger="pithtrain.checkpoint"):
        path = save(tmp_path, 11, mo, keep=2)
    assert os.path.isdir(path)
    assert names(tmp_path) == [".abandoned-step-00000020", "final", "step-00000010", "step-00000011"]
    assert [r.getMessage() for r in caplog.records if ".abandoned-step-00000020" in r.getMessage()]
    assert checkpoint.newest_valid(str(tmp_path)) == (path, [])
    assert checkpoint.clean_partial(str(tmp_path)) == []
    save(tmp_path, 20, mo, keep=1)  # the new timeline reaches 20: the old 20 stays aside
    save(tmp_path, 12, mo, keep=1)  # a second rewind: its 20 goes aside next to the first
    assert names(tmp_path) == [".abandoned-step-00000020", ".abandoned-step-00000020-1", "final", "step-00000012"]


def test_every_refused_checkpoint_is_reported(tmp_path):
    """A truncated file, a missing marker and a flipped byte are each reported with the path; a
    partial `.tmp-` save is not a checkpoint and is not reported."""
    mo = model_and_optimizer()
    for s in (10, 20, 30, 40):
        save(tmp_path, s, mo)
    distcp = next(p for p in (tmp_path / "step-00000040").iterdir() if p.suffix == ".distcp")
    os.truncate(distcp, distcp.stat().st_size // 2)
    os.remove(tmp_path / "step-00000030" / "complete.json")
    trainer = tmp_path / "step-00000020" / "trainer.json"
    data = bytearray(trainer.read_bytes())
    data[3] ^= 1
    trainer.write_bytes(bytes(data))
    (tmp_path / ".tmp-step-00000050").mkdir()
    path, refused = checkpoint.newest_valid(str(tmp_path))
    assert path == str(tmp_path / "step-00000010")
    assert len(refused) == 3, refused
    assert f"step-00000040: {distcp.name} has" in refused[0] and "expected" in refused[0]
    assert "step-00000030 is incomplete: complete.json is missing" in refused[1]
    assert "step-00000020: trainer.json is corrupt" in refused[2]


def test_resuming_from_weights_only_or_another_optimizer_is_a_clear_error(tmp_path):
    """DCP's CheckpointException is a BaseException: it must come out as a CheckpointError."""
    model, opt = model_and_optimizer()
    weights = str(tmp_path / "weights")  # the form `convert hf-to-dcp` writes: model.* only
    os.makedirs(tmp_path / "tmp")
    with checkpoint.quiet():
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(tmp_path / "tmp"))
    checkpoint.finalize_dir(str(tmp_path / "tmp"), weights, {"tensors": 0})
    with pytest.raises(CheckpointError, match=f"{weights} holds weights only.*checkpoint.init_from={weights}"):
        checkpoint.load(weights, *model_and_optimizer())
    checkpoint.load_weights(weights, build_model(dict(QWEN3)))  # what init_from does

    path = save(tmp_path / "run", 1, (model, opt))
    other = build_model(dict(QWEN3))
    sgd = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    for p in other.parameters():
        p.grad = torch.ones_like(p)
    sgd.step()
    with pytest.raises(CheckpointError, match="does not match this model and optimizer: rank 0: .*momentum_buffer"):
        checkpoint.load(path, other, sgd)


def test_a_tied_model_never_loads_the_head_into_its_embedding(tmp_path):
    """An untied checkpoint is refused by a tied model (it would overwrite the shared embedding with
    the head); a tied checkpoint, which stores both, loads with the embedding intact."""
    untied = model_and_optimizer()
    path = save(tmp_path / "untied", 1, untied)
    tied = build_model(dict(QWEN3, tie_word_embeddings=True))
    for load in (lambda: checkpoint.load_weights(path, tied),
                 lambda: checkpoint.load(path, tied, torch.optim.AdamW(tied.parameters()))):
        with pytest.raises(CheckpointError, match="is untied .* model.tie_word_embeddings=false"):
            load()

    source = model_and_optimizer(seed=2, tie_word_embeddings=True)
    path = save(tmp_path / "tied", 1, source)
    assert "lm_head.weight" in checkpoint.stored_tensors(path)
    for resume in (False, True):
        fresh = build_model(dict(QWEN3, tie_word_embeddings=True))
        if resume:
            checkpoint.load(path, fresh, torch.optim.AdamW(fresh.parameters()))
        else:
            checkpoint.load_weights(path, fresh)
        assert torch.equal(fresh.model.embed_tokens.weight, source[0].model.embed_tokens.weight)
        assert fresh.lm_head.weight is fresh.model.embed_tokens.weight


@pytest.mark.parametrize("cut", ["before-marker", "before-rename"])
def test_a_save_cut_short_never_hands_the_abandoned_timeline_to_resume(tmp_path, monkeypatch, cut):
    """Resumed from step 10 while 20 exists, the save of 15 is killed before its marker or between
    its marker and its rename: step 20 was set aside when the save began, so resume=auto takes 10
    (or 15, which the next start moves in when its marker was written), never the old 20."""
    mo = model_and_optimizer()
    save(tmp_path, 10, mo, mark=1)
    save(tmp_path, 20, mo, mark=1)
    replace, write = os.replace, checkpoint._write_json

    def killed_rename(src, dst):
        if os.path.basename(dst) == "step-00000015":
            raise KeyboardInterrupt  # the process dies here
        replace(src, dst)

    def killed_marker(path, data):
        if os.path.basename(path) == checkpoint.MARKER:
            raise KeyboardInterrupt
        write(path, data)

    if cut == "before-rename":
        monkeypatch.setattr(checkpoint.os, "replace", killed_rename)
    else:
        monkeypatch.setattr(checkpoint, "_write_json", killed_marker)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 15, mo, mark=2)
    monkeypatch.undo()
    assert names(tmp_path) == [".abandoned-step-00000020", ".tmp-step-00000015", "step-00000010"]
    assert checkpoint.newest_valid(str(tmp_path)) == (str(tmp_path / "step-00000010"), [])
    removed = checkpoint.clean_partial(str(tmp_path))
    if cut == "before-rename":  # complete: moved in
        assert removed == [] and checkpoint.newest_valid(str(tmp_path))[0] == str(tmp_path / "step-00000015")
    else:
        assert removed == [".tmp-step-00000015"]
        assert checkpoint.newest_valid(str(tmp_path))[0] == str(tmp_path / "step-00000010")


def test_a_save_of_an_existing_step_keeps_the_old_copy_aside(tmp_path):
    """After a rewind the new timeline saves a step the old one had: the old copy is kept as
    `.abandoned-step-N` (with the old timeline's later ones), not deleted; the new one is step-N."""
    mo = model_and_optimizer()
    for s in (10, 20, 30):
        save(tmp_path, s, mo, mark=1)
    save(tmp_path, 20, mo, mark=2)
    assert names(tmp_path) == [".abandoned-step-00000020", ".abandoned-step-00000030", "step-00000010",
                               "step-00000020"]
    mark = lambda d: json.load(open(tmp_path / d / "trainer.json"))["mark"]  # noqa: E731
    assert mark("step-00000020") == 2 and mark(".abandoned-step-00000020") == 1
    leftover = tmp_path / ".old-step-00000040"  # left by a killed same-step save of earlier versions
    shutil.copytree(tmp_path / ".abandoned-step-00000030", leftover)
    assert checkpoint.clean_partial(str(tmp_path)) == [] and os.path.isdir(tmp_path / "step-00000040")


MARKER_DAMAGE = {
    "not JSON": lambda raw: raw[:-5],
    "not UTF-8": lambda raw: raw.replace(b'"step"', b'"st\xf4p"', 1),
    "a key renamed": lambda raw: raw.replace(b'"bytes"', b'"bytds"', 1),
    "files a list": lambda raw: json.dumps({"step": 20, "files": ["a"]}).encode(),
    "not an object": lambda raw: b"[1, 2]",
}


@pytest.mark.parametrize("damage", sorted(MARKER_DAMAGE))
def test_a_damaged_marker_is_refused_and_passed_over(tmp_path, damage):
    """A complete.json that is not JSON, not UTF-8 or not of the marker's form is a CheckpointError
    naming the checkpoint: resume=auto passes over it, and a later save (which prunes) still works."""
    mo = model_and_optimizer()
    for s in (10, 20):
        save(tmp_path, s, mo)
    marker = tmp_path / "step-00000020" / checkpoint.MARKER
    marker.write_bytes(MARKER_DAMAGE[damage](marker.read_bytes()))
    with pytest.raises(CheckpointError, match="step-00000020: complete.json is corrupt"):
        checkpoint.verify(str(tmp_path / "step-00000020"))
    path, refused = checkpoint.newest_valid(str(tmp_path))
    assert path == str(tmp_path / "step-00000010") and len(refused) == 1 and "complete.json is corrupt" in refused[0]
    save(tmp_path, 11, mo, keep=1)
    assert checkpoint.newest_valid(str(tmp_path))[0] == str(tmp_path / "step-00000011")


def test_a_checkpoint_that_cannot_be_read_is_passed_over(tmp_path, monkeypatch):
    """An I/O error while the newest checkpoint is checked refuses it like damage: resume=auto falls back."""
    mo = model_and_optimizer()
    for s in (10, 20):
        save(tmp_path, s, mo)
    crc = checkpoint._crc32

    def failing(path):
        if "step-00000020" in path:
            raise OSError(5, "Input/output error", path)
        return crc(path)

    monkeypatch.setattr(checkpoint, "_crc32", failing)
    path, refused = checkpoint.newest_valid(str(tmp_path))
    assert path == str(tmp_path / "step-00000010") and len(refused) == 1
    assert "step-00000020 cannot be read ([Errno 5] Input/output error" in refused[0]


def test_a_folder_that_is_not_a_checkpoint_says_what_to_name(tmp_path, hf_folder):
    """The checkpoints folder (or the run folder above it) and an unconverted Hugging Face folder
    are each refused with what to set instead."""
    save(tmp_path / "run" / "checkpoints", 10, model_and_optimizer())
    checkpoints = str(tmp_path / "run" / "checkpoints")
    for where in (tmp_path / "run" / "checkpoints", tmp_path / "run"):
        with pytest.raises(CheckpointError, match=rf"name one of the step-N folders in {re.escape(checkpoints)} \(to "
                                                  r"continue a run, checkpoint.resume=auto takes"):
            checkpoint.verify(str(where))
    with pytest.raises(CheckpointError, match="Hugging Face folder: convert it with `pithtrain convert hf-to-dcp"):
        checkpoint.verify(str(hf_folder))


@pytest.fixture
def hf_folder(tmp_path):
    """A Hugging Face folder of QWEN3 (one shard, our names), a generation config and a tokenizer."""
    from safetensors.torch import save_file

    src = tmp_path / "hf"
    src.mkdir()
    model = build_model(dict(QWEN3))
    save_file({n: t.contiguous() for n, t in model.state_dict().items()}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(QWEN3))
    (src / "generation_config.json").write_text('{"eos_token_id": 1}')
    (src / "tokenizer.json").write_text('{"src": true}')
    return src


def test_bad_hugging_face_files_are_named(hf_folder, tmp_path):
    shard = hf_folder / "model.safetensors"
    good = shard.read_bytes()
    shard.write_bytes(good[:len(good) // 2])
    with pytest.raises(CheckpointError, match=f"{shard} is not a readable safetensors file.*re-download"):
        hf.hf_to_dcp(str(hf_folder), str(tmp_path / "out"))
    shard.write_bytes(good)

    index = hf_folder / "model.safetensors.index.json"
    index.write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match=f"{index} is not a valid safetensors index.*weight_map"):
        hf.hf_to_dcp(str(hf_folder), str(tmp_path / "out"))
    index.unlink()

    (hf_folder / "config.json").write_text('{"model_type": "qwen3_moe",')
    with pytest.raises(CheckpointError, match=f"{hf_folder / 'config.json'} is not valid JSON.*repair"):
        hf.hf_to_dcp(str(hf_folder), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_tokenizer_folder_must_hold_a_tokenizer_and_generation_config_comes_from_src(hf_folder, tmp_path):
    with pytest.raises(CheckpointError, match="--tokenizer .*nope is not a folder holding tokenizer files"):
        hf.hf_to_dcp(str(hf_folder), str(tmp_path / "out"), tokenizer=str(tmp_path / "nope"))
    assert names(tmp_path) == ["hf"]  # nothing written, not even a partial folder
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"tok": true}')
    (tok / "added_tokens.json").write_text('{"<x>": 5}')
    (tok / "chat_template.json").write_text('{"chat_template": "t"}')
    info = hf.hf_to_dcp(str(hf_folder), str(tmp_path / "out"), tokenizer=str(tok))
    assert sorted(info["tokenizer_files"]) == ["added_tokens.json", "chat_template.json", "generation_config.json",
                                               "tokenizer.json"]
    assert json.load(open(tmp_path / "out" / "tokenizer.json")) == {"tok": True}
    assert json.load(open(tmp_path / "out" / "generation_config.json")) == {"eos_token_id": 1}
    checkpoint.verify(str(tmp_path / "out"), checksums=True)

    shutil.rmtree(tok)
    with pytest.raises(CheckpointError, match="--tokenizer"):
        hf.dcp_to_hf(str(tmp_path / "out"), str(tmp_path / "back"), tokenizer=str(tok))
    info = hf.dcp_to_hf(str(tmp_path / "out"), str(tmp_path / "back"))
    assert sorted(info["tokenizer_files"]) == ["added_tokens.json", "chat_template.json", "generation_config.json",
                                               "tokenizer.json", "tokenizer_config.json"]
    # made for the bare tokenizer.json (no special tokens named: this one is no tokenizer transformers can read)
    assert json.load(open(tmp_path / "back" / "tokenizer_config.json")) == {"tokenizer_class": "PreTrainedTokenizerFast"}


def test_a_resume_reads_the_checkpoint_for_its_checksums_once(tiny_corpus, tmp_path, monkeypatch):
    """resume=auto checks the newest checkpoint's CRC-32s while finding it and not again to load it
    (each check reads every byte: on a large model, minutes); a checkpoint named by path is checked once."""
    from conftest import write_run
    from pithtrain.config import load_config
    from pithtrain.train.loop import train

    toml = write_run(tmp_path, tiny_corpus)
    train(load_config(toml, ["train.steps=2", "train.device=cpu"]))
    saved = checkpoint.latest(str(tmp_path / "run" / "checkpoints"))
    assert saved is not None and os.path.basename(saved) == "step-00000002", saved
    read = []
    crc32s = checkpoint._checksums
    monkeypatch.setattr(checkpoint, "_checksums", lambda folder, names: read.append(folder) or crc32s(folder, names))
    for resume in ("auto", saved):
        read.clear()
        train(load_config(toml, ["train.steps=3", "train.device=cpu", f"checkpoint.resume={resume}",
                                 "checkpoint.save_final=false"]))
        assert read.count(saved) == 1, (resume, read)


def test_checkpoints_of_another_aux_free_setting_or_head_say_which_setting_to_change(tmp_path):
    """A checkpoint trained with moe.aux_free (its routers' correction biases) met by a model without
    it, and the reverse on resume, name moe.aux_free; an untied checkpoint exported with a config
    that ties the head is refused (the export would drop the trained head), a tied one exports."""
    from pithtrain.layers.moe import BalanceOptions

    free = build_model(dict(QWEN3), BalanceOptions(aux_free=True))
    with_bias = save(tmp_path / "free", 1, (free, torch.optim.AdamW(free.parameters())))
    without = save(tmp_path / "plain", 1, model_and_optimizer())
    plain = model_and_optimizer()
    for load in (lambda: checkpoint.load_weights(with_bias, plain[0]), lambda: checkpoint.load(with_bias, *plain)):
        with pytest.raises(CheckpointError, match="trained with moe.aux_free .*set moe.aux_free=true as it was"):
            load()
    with pytest.raises(CheckpointError, match="trained without moe.aux_free .*set moe.aux_free=false as it was"):
        checkpoint.load(without, free, torch.optim.AdamW(free.parameters()))

    with pytest.raises(CheckpointError, match="lm_head.weight differs .* tie_word_embeddings is false"):
        hf.dcp_to_hf(without, str(tmp_path / "tied-out"), hf_config=dict(QWEN3, tie_word_embeddings=True))
    assert not (tmp_path / "tied-out").exists()
    tied = model_and_optimizer(tie_word_embeddings=True)
    path = save(tmp_path / "tied", 1, tied)
    hf.dcp_to_hf(path, str(tmp_path / "tied-hf"), hf_config=dict(QWEN3, tie_word_embeddings=True))
    index = json.load(open(tmp_path / "tied-hf" / "model.safetensors.index.json"))["weight_map"]
    assert "lm_head.weight" not in index and "model.embed_tokens.weight" in index


def test_a_prune_killed_midway_leaves_no_torn_checkpoint(tmp_path, monkeypatch):
    """A pruned checkpoint is renamed .pruning-step-N before it is deleted: a kill during the delete
    leaves that name (removed by the next start), never a step-N with files missing."""
    mo = model_and_optimizer()
    save(tmp_path, 10, mo)
    rmtree = shutil.rmtree

    def killed(path, ignore_errors=False):  # the prune's delete: one file, then the process dies
        if ".pruning-" not in str(path):
            return rmtree(path, ignore_errors=ignore_errors)
        os.remove(os.path.join(path, sorted(os.listdir(path))[0]))
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 20, mo, keep=1)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)
    assert sorted(os.listdir(tmp_path)) == [".pruning-step-00000010", "step-00000020"]
    assert checkpoint.newest_valid(str(tmp_path)) == (str(tmp_path / "step-00000020"), [])
    assert checkpoint.clean_partial(str(tmp_path)) == [".pruning-step-00000010"]
    assert os.listdir(tmp_path) == ["step-00000020"]


def test_taking_up_an_abandoned_timeline_makes_it_the_one_resume_auto_continues(tmp_path):
    """Timeline A reached step 4, a rewind to 2 set A's 3 and 4 aside and B reached 4; resuming A's
    step 4 by its path sets B's 4 aside and brings A's back as step-4, so a crash before the next
    save resumes A (B's step 4 kept aside, never deleted)."""
    import glob

    mo = model_and_optimizer()
    for s in (2, 3, 4):
        save(tmp_path, s, mo, branch="A")
    checkpoint.set_aside(str(tmp_path), 3)  # the rewind to step 2
    for s in (3, 4):
        save(tmp_path, s, mo, branch="B")
    branch = lambda p: json.load(open(os.path.join(p, "trainer.json")))["branch"]  # noqa: E731
    a4 = next(p for p in glob.glob(str(tmp_path / ".abandoned-step-00000004*")) if branch(p) == "A")
    checkpoint.take_up(str(tmp_path), a4, 4)
    assert branch(checkpoint.newest_valid(str(tmp_path))[0]) == "A"
    assert sorted(branch(p) for p in glob.glob(str(tmp_path / ".abandoned-step-00000004*"))) == ["B"]
    checkpoint.take_up(str(tmp_path), str(tmp_path / "step-00000002"), 2)  # a plain rewind: later ones aside
    assert [s for s, _ in checkpoint.step_dirs(str(tmp_path))] == [2]
