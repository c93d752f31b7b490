"""Document masking of packed sequences: a packed sequence with doc_ids gives, at every position,
the logits of its document run alone (attention inside the document only, positions restarting),
for every family (GQA, MLA, sliding windows and sinks); the data side gives the documents the
corpus holds; and the run config refuses what it cannot do."""

import numpy as np
import pytest
import torch

from conftest import DEEPSEEK_V2, GPT_OSS, QWEN3, write_run
from pithtrain.config import ConfigError, load_config
from pithtrain.layers.transformer import document_positions
from pithtrain.train.data import PackedDataset, document_ids

FAMILIES = {"qwen3": QWEN3, "deepseek_v2": DEEPSEEK_V2, "gpt_oss": GPT_OSS}


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def test_document_positions_restart_at_each_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_documents_match_each_document_alone(family):
    from test_hf_parity import random_model

    model = random_model(FAMILIES[family])
    model.eval()
    lengths = [[5, 9, 2], [11, 5]]  # two sequences of 16 tokens, packed differently
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (2, 16), generator=gen)
    docs = torch.tensor([sum([[d] * n for d, n in enumerate(row)], []) for row in lengths])
    with torch.no_grad():
        packed = model(ids, doc_ids=docs)
        plain = model(ids)
        for b, row in enumerate(lengths):
            start = 0
            for n in row:
                alone = model(ids[b:b + 1, start:start + n])[0]
                assert rel(packed[b, start:start + n], alone) < 1e-5, (family, b, start)
                start += n
    # Without the mask the later documents see the earlier ones: the option changes the result.
    assert rel(packed[0, 5:], plain[0, 5:]) > 1e-2
    assert rel(packed[0, :5], plain[0, :5]) < 1e-5


def test_document_ids_follow_the_corpus_documents(tiny_corpus):
    ds = PackedDataset(tiny_corpus, "train", 64)
    found = 0
    for i in range(len(ds)):
        window = ds.window(i)[:-1]
        ids = document_ids(ds, [i])[0].numpy()
        # A new document begins right after each end-of-document token, and nowhere else.
        after_eos = np.concatenate([[False], window[:-1] == ds.eos_id])
        changes = np.concatenate([[False], ids[1:] != ids[:-1]])
        assert np.array_equal(changes, after_eos), i
        assert ids[0] == 0 and np.all(np.diff(ids) >= 0)
        found += int(changes.sum())
    assert found > 0  # the windows looked at do cross document boundaries


def test_document_mask_trains_and_refuses_context_parallel(tiny_corpus, tmp_path, monkeypatch):
    """data.document_mask hands the model each sequence's document ids and the run trains; without
    it the model gets none; context parallel refuses it."""
    from pithtrain.layers.transformer import CausalLM
    from pithtrain.train.loop import train

    seen = []
    forward = CausalLM.forward

    def spy(self, *args, doc_ids=None, **kwargs):
        seen.append(doc_ids)
        return forward(self, *args, doc_ids=doc_ids, **kwargs)

    monkeypatch.setattr(CausalLM, "forward", spy)
    toml = write_run(tmp_path, tiny_corpus)
    summary = train(load_config(toml, ["train.steps=3", "data.document_mask=true", "train.device=cpu"]))
    assert np.isfinite(summary["train_loss"])
    assert seen and all(d is not None and d.shape == (2, 32) for d in seen), seen
    seen.clear()
    train(load_config(toml, ["train.steps=1", "optim.warmup_steps=1", "train.device=cpu",
                             f"log.run_dir={tmp_path}/plain"]))
    assert seen and all(d is None for d in seen)
    with pytest.raises(ConfigError, match="document_mask"):
        load_config(toml, ["data.document_mask=true", "parallel.cp=2"])
