"""Tests of pithtrain.train.corpus and .data: corpus building, packed loading, batch sampling."""

import argparse
import glob
import json
import logging
import os
import signal
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import zstandard
from tokenizers import Tokenizer

from pithtrain.train import corpus as C
from pithtrain.train import data as D

DOCS = [
    "hello world",
    "  leading spaces and trailing  \n",
    "unicode: héllo wörld, 世界, emoji 🙂🚀",
    "line one\nline two\r\nline three\ttab",
    "a literal <|endoftext|> inside a document stays text",
    "def f(x):\n    return x * 2\n",
] + [f"document number {i}: the quick brown fox {'jumps ' * (i % 7)}over the lazy dog." for i in range(40)]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    C.train_demo_tokenizer(DOCS * 3, 300, path)
    return path


def write_jsonl(path, docs, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({key: d, "id": 1}) + "\n")
    return str(path)


def write_zst(path, docs):
    """JSON lines compressed as two concatenated zstd frames."""
    raw = [("".join(json.dumps({"text": d}) + "\n" for d in part)).encode() for part in (docs[:7], docs[7:])]
    with open(path, "wb") as f:
        f.write(b"".join(zstandard.ZstdCompressor().compress(r) for r in raw))
    return str(path)


def write_txt_zst_dir(path, docs):
    os.makedirs(path)
    for i, d in enumerate(docs):
        (path / f"{i:03d}.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(d.encode()))
    return str(path)


def write_parquet(path, docs):
    pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), path)
    return str(path)


def write_txt_dir(path, docs):
    os.makedirs(path)
    for i, d in enumerate(docs):
        with open(os.path.join(path, f"{i:03d}.txt"), "w", encoding="utf-8", newline="") as f:
            f.write(d)
    return str(path)


def read_docs(out, split):
    """Token documents of a split, cut at the idx offsets."""
    meta = json.load(open(os.path.join(out, "meta.json")))
    tokens = np.fromfile(os.path.join(out, f"{split}.bin"), dtype=meta["dtype"])
    idx = np.load(os.path.join(out, f"{split}.idx.npy"))
    assert idx[0] == 0 and idx[-1] == len(tokens) == meta["splits"][split]["tokens"]
    assert len(idx) == meta["splits"][split]["docs"] + 1
    return [tokens[a:b].tolist() for a, b in zip(idx[:-1], idx[1:], strict=True)]


def decoded_docs(out):
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    eos = json.load(open(os.path.join(out, "meta.json")))["eos_id"]
    texts = []
    for split in ("train", "val"):
        for ids in read_docs(out, split):
            assert ids[-1] == eos and eos not in ids[:-1]
            texts.append(tok.decode(ids[:-1], skip_special_tokens=False))
    return texts


def leftovers(out):
    """The output directory and any temporary siblings (out.tmp-PID) still on disk."""
    return [p for p in [str(out)] + glob.glob(str(out) + ".*") if os.path.exists(p)]


@pytest.mark.parametrize("fmt", ["jsonl", "zst", "parquet", "parquet-dictionary", "txt", "txt.zst"])
def test_round_trip(tmp_path, tok_path, fmt):
    """Every input format; Parquet's text column also dictionary-encoded (what pandas categoricals write)."""
    src = {
        "parquet-dictionary": lambda: pq.write_table(pa.table({"text": pa.array(DOCS).dictionary_encode()}),
                                                     tmp_path / "c.parquet") or str(tmp_path / "c.parquet"),
        "jsonl": lambda: write_jsonl(tmp_path / "d.jsonl", DOCS),
        "zst": lambda: write_zst(tmp_path / "d.jsonl.zst", DOCS),
        "parquet": lambda: write_parquet(tmp_path / "d.parquet", DOCS),
        "txt": lambda: write_txt_dir(tmp_path / "txt", DOCS),
        "txt.zst": lambda: write_txt_zst_dir(tmp_path / "txtzst", DOCS),
    }[fmt]()
    out = str(tmp_path / "corpus")
    meta = C.build_corpus([src], out, tok_path, val_fraction=0.2, workers=1)
    assert sorted(decoded_docs(out)) == sorted(DOCS)
    assert meta["splits"]["val"]["docs"] >= 1 and meta["splits"]["train"]["docs"] >= 1
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 300
    assert sum(s["docs"] for s in meta["sources"]) == len(DOCS)
    assert meta == json.load(open(os.path.join(out, "meta.json")))


def test_demo_tokenizer_trained_when_none(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", DOCS)
    out = str(tmp_path / "corpus")
    meta = C.build_corpus([src], out, None, demo_vocab_size=300, workers=1)
    assert meta["vocab_size"] == 300 and os.path.isfile(os.path.join(out, "tokenizer.json"))
    assert sorted(decoded_docs(out)) == sorted(DOCS)
    # the split guarantees one validation document even with a tiny val_fraction
    assert meta["splits"]["val"]["docs"] >= 1


def test_demo_input(tmp_path, tok_path, monkeypatch):
    monkeypatch.setattr(C, "demo_texts", lambda: DOCS[:10])
    meta = C.build_corpus(["demo"], str(tmp_path / "c"), tok_path, workers=1)
    assert meta["sources"][0]["docs"] == 10


def test_workers_identical(tmp_path, tok_path):
    many = [f"{d} #{i}" for i in range(15) for d in DOCS]  # > 2 tasks of 256 documents
    srcs = [write_jsonl(tmp_path / "a.jsonl", many), write_txt_dir(tmp_path / "t", DOCS[:5])]
    outs = []
    for w in (1, 2):
        outs.append(str(tmp_path / f"c{w}"))
        C.build_corpus(srcs, outs[-1], tok_path, val_fraction=0.1, workers=w)
    for name in ("train.bin", "val.bin", "train.idx.npy", "val.idx.npy", "meta.json", "tokenizer.json"):
        a, b = (open(os.path.join(o, name), "rb").read() for o in outs)
        assert a == b, name


def test_empty_file_skipped(tmp_path, tok_path, caplog):
    good = write_jsonl(tmp_path / "good.jsonl", DOCS)
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with caplog.at_level(logging.WARNING, logger="pithtrain.corpus"):
        meta = C.build_corpus([good, str(tmp_path / "empty.jsonl"), str(tmp_path / "blank.jsonl")],
                              str(tmp_path / "c"), tok_path, workers=1)
    assert "empty.jsonl" in caplog.text and "blank.jsonl" in caplog.text
    assert [os.path.basename(s["path"]) for s in meta["skipped"]] == ["empty.jsonl", "blank.jsonl"]


def bad_jsonl_line(p):
    p.write_text('{"text": "ok"}\n{"text": "ok2"}\n{"text": broken\n')


def bad_key(p):
    p.write_text('{"text": "ok"}\n{"body": "x", "title": "y"}\n')


BAD = {
    "line.jsonl": (bad_jsonl_line, ["line.jsonl", "line 3"]),
    "key.jsonl": (bad_key, ["key.jsonl", "line 2", "'body'", "'title'"]),
    "type.jsonl": (lambda p: p.write_text('{"text": 5}\n'), ["type.jsonl", "line 1", "int"]),
    "bytes.jsonl": (lambda p: p.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n'),
                    ["bytes.jsonl", "line 2", "UTF-8"]),
    "bytes.txt": (lambda p: p.write_bytes(b"fine\nstill fine\n\xff\xfe"), ["bytes.txt", "UTF-8"]),
    "cut.jsonl.zst": (lambda p: p.write_bytes(zstandard.ZstdCompressor().compress(
        b"".join(b'{"text": "doc %d"}\n' % i for i in range(5000)))[:-40]), ["cut.jsonl.zst", "truncated"]),
    "junk.jsonl.zst": (lambda p: p.write_bytes(b"not zstd at all"), ["junk.jsonl.zst"]),
    "bad.parquet": (lambda p: p.write_bytes(b"PAR1 this is not parquet"), ["bad.parquet"]),
    "col.parquet": (lambda p: pq.write_table(pa.table({"body": ["x"]}), p), ["col.parquet", "'body'"]),
}


@pytest.mark.parametrize("tokenizer", ["given", None])
@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_file_raises(tmp_path, tok_path, name, tokenizer):
    make, expected = BAD[name]
    make(tmp_path / name)
    good = write_jsonl(tmp_path / "good.jsonl", DOCS)
    out = tmp_path / "c"
    with pytest.raises(C.CorpusError) as e:
        C.build_corpus([good, str(tmp_path / name)], str(out), tok_path if tokenizer else None,
                       workers=1, demo_vocab_size=300)
    for s in expected:
        assert s in str(e.value), (s, str(e.value))
    assert leftovers(out) == []


@pytest.mark.parametrize("tokenizer", ["given", None])
@pytest.mark.parametrize("name", ["line.jsonl", "cut.jsonl.zst", "bad.parquet"])
def test_skip_bad_files(tmp_path, tok_path, name, tokenizer):
    make, _ = BAD[name]
    make(tmp_path / name)
    good = write_jsonl(tmp_path / "good.jsonl", DOCS)
    small = write_txt_dir(tmp_path / "small", DOCS[:5])  # shares a task batch with the bad file's documents
    out = str(tmp_path / "c")
    meta = C.build_corpus([small, str(tmp_path / name), good], out, tok_path if tokenizer else None,
                          workers=1, skip_bad_files=True, demo_vocab_size=300)
    assert [os.path.basename(s["path"]) for s in meta["skipped"]] == [name]
    assert sorted(decoded_docs(out)) == sorted(DOCS[:5] + DOCS)  # no half of the bad file got in
    assert [s["docs"] for s in meta["sources"]] == [1] * 5 + [len(DOCS)]


def test_bad_file_mid_stream_rolled_back_with_workers(tmp_path, tok_path):
    """A file that fails after several full batches leaves none of its documents behind."""
    p = tmp_path / "late.jsonl"
    write_jsonl(p, [f"late {i}" for i in range(600)])
    with open(p, "a") as f:
        f.write("{oops\n")
    good = write_jsonl(tmp_path / "good.jsonl", DOCS)
    out = str(tmp_path / "c")
    meta = C.build_corpus([str(p), good], out, tok_path, workers=2, skip_bad_files=True)
    assert "line 601" in meta["skipped"][0]["reason"]
    assert sorted(decoded_docs(out)) == sorted(DOCS)
    with pytest.raises(C.CorpusError, match="line 601"):
        C.build_corpus([str(p), good], str(tmp_path / "c2"), tok_path, workers=2)
    assert leftovers(tmp_path / "c2") == []


def test_the_command_line_names_each_skipped_file_once(tmp_path, tok_path, capsys):
    import argparse

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{oops\n')
    good = write_jsonl(tmp_path / "good.jsonl", DOCS)
    parser = argparse.ArgumentParser()
    C.add_build_corpus_args(parser)
    args = parser.parse_args([str(bad), good, "--out", str(tmp_path / "c"), "--tokenizer", tok_path, "--workers", "1"])
    assert C.run_build_corpus(args) == 2
    assert "pass --skip-bad-files" in capsys.readouterr().err
    args.skip_bad_files = True
    assert C.run_build_corpus(args) == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if str(bad) in line]
    assert len(listed) == 1 and listed[0].count(str(bad)) == 1, listed


def test_input_and_output_errors(tmp_path, tok_path):
    good = write_jsonl(tmp_path / "good.jsonl", DOCS)
    with pytest.raises(C.CorpusError, match="nothing_here"):
        C.build_corpus([str(tmp_path / "nothing_here*.jsonl")], str(tmp_path / "c"), tok_path)
    for workers in (0, -1):
        with pytest.raises(C.CorpusError, match=f"workers = {workers}: give 1 or more"):
            C.build_corpus([good], str(tmp_path / "c"), tok_path, workers=workers)
    (tmp_path / "e.txt").write_bytes(b"")
    with pytest.raises(C.CorpusError, match="no documents"):
        C.build_corpus([str(tmp_path / "e.txt")], str(tmp_path / "c"), tok_path, workers=1)
    with pytest.raises(C.CorpusError, match="no documents"):
        C.build_corpus([str(tmp_path / "e.txt")], str(tmp_path / "c"), None, demo_vocab_size=300, workers=1)
    with pytest.raises(C.CorpusError, match="1 document;"):
        C.build_corpus([write_jsonl(tmp_path / "one.jsonl", DOCS[:1])], str(tmp_path / "c"), tok_path, workers=1)
    with pytest.raises(C.CorpusError, match="tokenizer"):
        C.build_corpus([good], str(tmp_path / "c"), str(tmp_path / "missing"), workers=1)
    with pytest.raises(C.CorpusError, match="eos"):
        C.build_corpus([good], str(tmp_path / "c"), tok_path, eos_token="<nope>", workers=1)
    assert leftovers(tmp_path / "c") == []
    out = str(tmp_path / "c")
    C.build_corpus([good], out, tok_path, workers=1)
    with pytest.raises(C.CorpusError, match="already holds a corpus"):
        C.build_corpus([good], out, tok_path, workers=1)
    C.build_corpus([good], out, tok_path, workers=1, overwrite=True, seed=3)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("x")
    with pytest.raises(C.CorpusError, match="not an empty directory"):
        C.build_corpus([good], str(tmp_path / "other"), tok_path, workers=1)
    with pytest.raises(C.CorpusError, match=r"other/x/sub cannot be made \(.*other/x is a file\)"):
        C.build_corpus([good], str(tmp_path / "other" / "x" / "sub"), tok_path, workers=1)


def test_find_eos_and_load_tokenizer(tmp_path, tok_path):
    tok = C.load_tokenizer(os.path.dirname(tok_path))
    assert C.find_eos_id(tok) == tok.token_to_id("<|endoftext|>")
    assert C.find_eos_id(tok, "a") == tok.token_to_id("a")
    (tmp_path / "tokenizer.json").write_text("{nope")
    with pytest.raises(C.CorpusError, match="cannot load"):
        C.load_tokenizer(str(tmp_path))


@pytest.fixture()
def corpus(tmp_path, tok_path):
    docs = [f"{d} {i}" for i in range(4) for d in DOCS]
    out = str(tmp_path / "c")
    C.build_corpus([write_jsonl(tmp_path / "d.jsonl", docs)], out, tok_path, val_fraction=0.3, workers=1)
    return out


def test_packed_dataset(corpus):
    ds = D.PackedDataset(corpus, "train", 16)
    tokens = np.fromfile(os.path.join(corpus, "train.bin"), dtype=ds.meta["dtype"]).astype(np.int64)
    idx = np.load(os.path.join(corpus, "train.idx.npy"))
    assert len(ds) == (len(tokens) - 1) // 16 and ds.vocab_size == 300 and ds.eos_id == 0
    for i in (0, 1, len(ds) - 1):
        w = ds[i]
        assert w.dtype == torch.int64 and w.shape == (17,)
        assert w.tolist() == tokens[i * 16 : i * 16 + 17].tolist()
        starts = ds.doc_starts(i)
        assert starts.tolist() == [s - i * 16 for s in idx[:-1] if i * 16 <= s < i * 16 + 16]
    with pytest.raises(IndexError):
        ds[len(ds)]
    x, y = D.batch_tensors(ds, [2, 0, 5])
    assert x.shape == y.shape == (3, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[1], ds[0][:-1]) and torch.equal(y[1], ds[0][1:])
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert os.path.basename(ds.tokenizer_path) == "tokenizer.json"


def test_packed_dataset_errors(corpus, tmp_path):
    with open(os.path.join(corpus, "train.bin"), "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(C.CorpusError, match="train.bin"):
        D.PackedDataset(corpus, "train", 16)
    with pytest.raises(C.CorpusError, match="meta.json"):
        D.PackedDataset(str(tmp_path / "nope"), "train", 16)
    val = D.PackedDataset(corpus, "val", 100000)
    with pytest.raises(C.CorpusError, match="fewer than seq_len"):
        len(val)


def test_validation_batches(corpus):
    val = D.PackedDataset(corpus, "val", 8)
    n = len(val)
    assert D.validation_batches(val, 2, 4, 1) == [[0, 1], [2, 3]]
    flat = [i for b in D.validation_batches(val, 1, 4, 2) for i in b]
    assert flat == [i for b in D.validation_batches(val, 4, 4, 2) for i in b] == list(range(8))  # any batch size
    assert len(D.validation_batches(val, 2, 4, 10**6)) == n // 4 * 2  # whole global batches only
    assert len(D.validation_batches(val, 1, n + 1, 1)) == n  # less than one global batch: the whole split
    with pytest.raises(C.CorpusError, match="val-fraction.*data.val_batches = 0"):
        D.validation_batches(val, n + 1, n + 1, 1)


def test_sampler_epochs_and_determinism():
    s, t = D.GlobalBatchSampler(23, 5, seed=7), D.GlobalBatchSampler(23, 5, seed=7)
    for epoch in range(3):
        seen = []
        for _ in range(4):  # 4 batches of 5; the tail of 3 is dropped
            b = s.next_batch()
            assert b == t.next_batch() and len(b) == 5 and s.epoch == epoch
            seen += b
        assert len(set(seen)) == 20
        assert seen == np.random.default_rng([7, epoch]).permutation(23)[:20].tolist()
    assert D.GlobalBatchSampler(23, 5, seed=8).next_batch() != D.GlobalBatchSampler(23, 5, seed=7).next_batch()
    with pytest.raises(C.CorpusError):
        D.GlobalBatchSampler(4, 5, seed=0)


def test_sampler_resume():
    ref = D.GlobalBatchSampler(30, 4, seed=1)
    for _ in range(9):
        ref.next_batch()
    sd = json.loads(json.dumps(ref.state_dict()))  # survives a checkpoint round trip
    assert sd == {"epoch": 1, "offset": 8, "seed": 1, "n_samples": 30, "global_batch": 4, "seq_len": None,
                  "tokens": None}
    resumed = D.GlobalBatchSampler(30, 4, seed=1)
    resumed.load_state_dict(sd)
    assert [resumed.next_batch() for _ in range(20)] == [ref.next_batch() for _ in range(20)]
    bigger = D.GlobalBatchSampler(30, 6, seed=1)
    bigger.load_state_dict(sd)
    assert bigger.next_batch() == np.random.default_rng([1, 1]).permutation(30)[8:14].tolist()
    with pytest.raises(C.CorpusError, match="corpus"):
        D.GlobalBatchSampler(31, 4, seed=1).load_state_dict(sd)
    with pytest.raises(C.CorpusError, match="differs from train.seed = 2: resume with train.seed=1"):
        D.GlobalBatchSampler(30, 4, seed=2).load_state_dict(sd)


def test_sampler_resume_refuses_another_seq_len_or_corpus_with_the_same_window_count():
    """9,600 tokens make 95 windows at seq_len 100 and at 101: the window count alone cannot tell."""
    sd = D.GlobalBatchSampler(95, 4, seed=1, seq_len=100, tokens=9600).state_dict()
    with pytest.raises(C.CorpusError, match="data.seq_len=100"):
        D.GlobalBatchSampler(95, 4, seed=1, seq_len=101, tokens=9600).load_state_dict(sd)
    with pytest.raises(C.CorpusError, match="the corpus changed"):
        D.GlobalBatchSampler(95, 4, seed=1, seq_len=100, tokens=9601).load_state_dict(sd)
    D.GlobalBatchSampler(95, 8, seed=1, seq_len=100, tokens=9600).load_state_dict(sd)  # another global batch: fine
    old = {k: v for k, v in sd.items() if k not in ("seq_len", "tokens")}  # a state saved without them
    D.GlobalBatchSampler(95, 4, seed=1, seq_len=101, tokens=9600).load_state_dict(old)


def test_a_folder_named_demo_is_not_taken_for_the_demo_corpus(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "a.txt").write_text("hello")
    with pytest.raises(C.CorpusError, match="pass ./demo"):
        C.build_corpus(["demo"], str(tmp_path / "out"), None, workers=1)
    monkeypatch.setattr(C, "demo_texts", lambda: ["def f():\n    return 1\n"] * 40)  # `pithtrain demo`'s spelling
    meta = C.build_corpus([C.DEMO], str(tmp_path / "out"), None, workers=1, demo_vocab_size=300)
    assert meta["sources"][0]["path"] == C.DEMO


def test_demo_texts():
    a = C.demo_texts()
    assert len(a) > 10 and all(isinstance(t, str) and t for t in a)
    assert sum(len(t.encode()) for t in a) > 1_000_000
    assert sum(len(t.encode()) for t in a) <= C.DEMO_TEXT_CAP
    assert C.demo_texts()[:20] == a[:20]


def test_cli(tmp_path, tok_path, capsys):
    parser = argparse.ArgumentParser()
    C.add_build_corpus_args(parser)
    good = write_jsonl(tmp_path / "good.jsonl", DOCS)
    args = parser.parse_args([good, "--out", str(tmp_path / "c"), "--tokenizer", tok_path, "--workers", "1"])
    assert C.run_build_corpus(args) == 0
    assert "train" in capsys.readouterr().out
    bad_jsonl_line(tmp_path / "bad.jsonl")
    args = parser.parse_args([str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "c2"), "--tokenizer", tok_path])
    assert C.run_build_corpus(args) == 2
    assert "line 3" in capsys.readouterr().err


def test_saved_truncation_and_padding_are_ignored(tmp_path, tok_path):
    """A tokenizer.json saved with truncation / padding settings must not cut documents or write pad tokens."""
    t = Tokenizer.from_file(tok_path)
    t.enable_truncation(max_length=4)
    t.enable_padding(pad_id=0, pad_token="<|endoftext|>")
    t.save(str(tmp_path / "trunc.json"))
    src = write_jsonl(tmp_path / "d.jsonl", DOCS)
    for name, tok in (("plain", tok_path), ("trunc", str(tmp_path / "trunc.json"))):
        C.build_corpus([src], str(tmp_path / name), tok, val_fraction=0.2, workers=1)
    for name in ("train.bin", "val.bin", "train.idx.npy", "val.idx.npy"):
        assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "trunc" / name).read_bytes(), name


def test_tokenizer_fingerprint(tmp_path, tok_path):
    """Same fingerprint => same ids: a normalizer changes it; formatting and truncation settings do not."""
    lower = dict(json.load(open(tok_path)), normalizer={"type": "Lowercase"})
    (tmp_path / "lower.json").write_text(json.dumps(lower))
    assert Tokenizer.from_file(str(tmp_path / "lower.json")).encode("Hello").ids != \
        Tokenizer.from_file(tok_path).encode("Hello").ids
    t = Tokenizer.from_file(tok_path)
    t.enable_truncation(max_length=8)
    t.save(str(tmp_path / "resaved.json"), pretty=False)
    fp = C.tokenizer_fingerprint(tok_path)
    assert C.tokenizer_fingerprint(str(tmp_path / "lower.json")) != fp
    assert C.tokenizer_fingerprint(str(tmp_path / "resaved.json")) == fp


def test_overwrite_replaces_only_a_corpus(tmp_path, tok_path):
    mine = tmp_path / "mine"  # some other tool's meta.json next to the user's files
    mine.mkdir()
    (mine / "meta.json").write_text('{"dataset": "mine"}')
    raw = write_jsonl(mine / "raw.jsonl", DOCS)
    (mine / "NOTES.txt").write_text("notes")
    with pytest.raises(C.CorpusError, match="not an empty directory"):
        C.build_corpus([raw], str(mine), tok_path, workers=1, overwrite=True)
    assert sorted(os.listdir(mine)) == ["NOTES.txt", "meta.json", "raw.jsonl"]
    good = write_jsonl(tmp_path / "good.jsonl", DOCS)
    out = tmp_path / "c"
    C.build_corpus([good], str(out), tok_path, workers=1)
    with pytest.raises(C.CorpusError, match="inside the output"):
        C.build_corpus([str(out)], str(out), tok_path, workers=1, overwrite=True)
    meta = (out / "meta.json").read_text()
    (out / "NOTES.txt").write_text("notes")
    with pytest.raises(C.CorpusError, match=r"other files \['NOTES.txt'\]"):
        C.build_corpus([good], str(out), tok_path, workers=1, overwrite=True, seed=3)
    assert (out / "NOTES.txt").exists() and (out / "meta.json").read_text() == meta


def test_build_into_the_empty_current_directory(tmp_path, tok_path, monkeypatch):
    good = write_jsonl(tmp_path / "good.jsonl", DOCS)
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    with pytest.raises(C.CorpusError, match="eos"):
        C.build_corpus([good], ".", tok_path, eos_token="<nope>", workers=1)
    assert os.listdir(".") == []  # an error leaves it empty
    C.build_corpus([good], ".", tok_path, workers=1)
    assert sorted(os.listdir(".")) == sorted(C.CORPUS_FILES) and sorted(decoded_docs(".")) == sorted(DOCS)
    meta = C.build_corpus([good], ".", tok_path, workers=1, overwrite=True, seed=5)  # replaced in place
    assert sorted(os.listdir(".")) == sorted(C.CORPUS_FILES) and json.load(open("meta.json")) == meta
    assert sorted(os.listdir(tmp_path)) == ["good.jsonl", "here"]
    assert len(D.PackedDataset(".", "train", 8)) > 0


@pytest.mark.parametrize("fmt", ["zst", "parquet"])
def test_missing_optional_package(tmp_path, tok_path, monkeypatch, fmt):
    src = write_zst(tmp_path / "d.jsonl.zst", DOCS) if fmt == "zst" else write_parquet(tmp_path / "d.parquet", DOCS)
    for module in ["zstandard"] if fmt == "zst" else ["pyarrow", "pyarrow.parquet"]:
        monkeypatch.setitem(sys.modules, module, None)  # as if the [data] extra were not installed
    for skip in (False, True):  # not a bad file to skip either
        with pytest.raises(C.CorpusError, match=r"needs the optional package .*pip install -e '\.\[data\]'"):
            C.build_corpus([src], str(tmp_path / "c"), tok_path, workers=1, skip_bad_files=skip)
    assert leftovers(tmp_path / "c") == []


def test_an_empty_split_takes_a_document_and_says_how_much(tmp_path, tok_path, caplog):
    """A val_fraction too small to draw a document leaves validation empty: the last training
    document moves there, with a warning of its size; a validation split too short for a window
    names --val-fraction and data.val_batches = 0. val_fraction 0 asks for no validation: the val
    split stays empty and every document trains."""
    docs = [f"{d} {i}" for i in range(4) for d in DOCS]
    out = str(tmp_path / "c")
    with caplog.at_level("WARNING", logger="pithtrain.corpus"):
        meta = C.build_corpus([write_jsonl(tmp_path / "d.jsonl", docs)], out, tok_path, val_fraction=1e-12, workers=1)
    assert meta["splits"]["val"]["docs"] == 1 and "the val split was empty" in caplog.text
    with pytest.raises(C.CorpusError, match=r"larger --val-fraction, or set data.val_batches = 0"):
        len(D.PackedDataset(out, "val", 4096))
    caplog.clear()
    none = str(tmp_path / "none")
    with caplog.at_level("WARNING", logger="pithtrain.corpus"):
        meta = C.build_corpus([write_jsonl(tmp_path / "d.jsonl", docs)], none, tok_path, val_fraction=0.0, workers=1)
    assert meta["splits"]["val"] == {"tokens": 0, "docs": 0} and meta["splits"]["train"]["docs"] == len(docs)
    assert "split was empty" not in caplog.text
    assert D.PackedDataset(none, "val", 8).n_tokens == 0
    with pytest.raises(C.CorpusError, match="data.val_batches = 0"):
        len(D.PackedDataset(none, "val", 8))


def test_byte_order_marks_are_not_text(tmp_path, tok_path):
    """A JSON-lines or text file that starts with a UTF-8 byte-order mark builds the corpus it would
    without one; a bad byte after the mark is still placed by its offset in the file."""
    plain = [write_jsonl(tmp_path / "a.jsonl", DOCS), write_txt_dir(tmp_path / "t", DOCS[:3])]
    marked = [str(tmp_path / "b.jsonl"), str(tmp_path / "u")]
    (tmp_path / "b.jsonl").write_bytes(b"\xef\xbb\xbf" + open(plain[0], "rb").read())
    os.makedirs(marked[1])
    for name in sorted(os.listdir(plain[1])):
        (tmp_path / "u" / name).write_bytes(b"\xef\xbb\xbf" + (tmp_path / "t" / name).read_bytes())
    for srcs, out in ((plain, "c1"), (marked, "c2")):
        C.build_corpus(srcs, str(tmp_path / out), tok_path, workers=1)
    for name in ("train.bin", "val.bin", "train.idx.npy", "val.idx.npy"):
        assert (tmp_path / "c1" / name).read_bytes() == (tmp_path / "c2" / name).read_bytes(), name
    (tmp_path / "bad.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "caf\xe9"}\n')
    with pytest.raises(C.CorpusError, match=r"line 1: not valid UTF-8 \(byte at column 17\)"):
        C.build_corpus([str(tmp_path / "bad.jsonl"), plain[0]], str(tmp_path / "c3"), tok_path, workers=1)


def _die(texts):
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_tokenizer_worker_that_dies_is_a_corpus_error(tmp_path, tok_path, monkeypatch):
    """A worker killed from outside (the system's out-of-memory killer) ends the build with a
    CorpusError that says what happened and what to change, and leaves nothing behind."""
    monkeypatch.setattr(C, "_worker_encode", _die)
    out = tmp_path / "c"
    with pytest.raises(C.CorpusError, match="tokenizer worker process died.*fewer --workers"):
        C.build_corpus([write_jsonl(tmp_path / "a.jsonl", DOCS)], str(out), tok_path, workers=2)
    assert leftovers(out) == []


def test_the_split_goes_by_content_not_position(tmp_path, tok_path):
    """Copies of a document land in one split, and a file added in front moves no document between
    the splits (the split hashes the seed and the document's tokens)."""
    docs = DOCS + DOCS[6:26]  # 20 documents twice
    one = write_jsonl(tmp_path / "one.jsonl", docs)
    front = write_jsonl(tmp_path / "front.jsonl", [f"another text {i} about a cat" for i in range(30)])
    C.build_corpus([one], str(tmp_path / "a"), tok_path, workers=1, val_fraction=0.3)
    C.build_corpus([front, one], str(tmp_path / "b"), tok_path, workers=1, val_fraction=0.3)
    a = {s: {tuple(d) for d in read_docs(str(tmp_path / "a"), s)} for s in ("train", "val")}
    b = {s: {tuple(d) for d in read_docs(str(tmp_path / "b"), s)} for s in ("train", "val")}
    assert a["val"] and a["train"] and not a["val"] & a["train"]  # no copy on both sides
    assert a["val"] <= b["val"] and a["train"] <= b["train"]
    C.build_corpus([one], str(tmp_path / "c"), tok_path, workers=1, val_fraction=0.3, seed=1)
    assert {tuple(d) for d in read_docs(str(tmp_path / "c"), "val")} != a["val"]  # the seed still draws


def test_a_stopped_build_or_replacement_is_cleaned_up_by_the_next(tmp_path, tok_path):
    good = write_jsonl(tmp_path / "good.jsonl", DOCS)
    out = tmp_path / "c"
    out.mkdir()
    (out / ".tmp-999999999").mkdir()  # a killed build's temporary directory (no such process)
    (out / ".tmp-999999999" / "train.bin").write_bytes(b"\0")
    C.build_corpus([good], str(out), tok_path, workers=1)
    assert sorted(os.listdir(out)) == sorted(C.CORPUS_FILES)
    (tmp_path / "new.tmp-999999999").mkdir()  # beside a new output, where a build into it works
    (tmp_path / "new.tmp-1").mkdir()  # process 1 is alive: not a stopped build's to remove
    C.build_corpus([good], str(tmp_path / "new"), tok_path, workers=1)
    assert not (tmp_path / "new.tmp-999999999").exists() and (tmp_path / "new.tmp-1").exists()
    (out / "meta.json").unlink()  # a replacement stopped after removing the old meta.json
    with pytest.raises(C.CorpusError, match="files of a corpus whose build was stopped.*--overwrite"):
        C.build_corpus([good], str(out), tok_path, workers=1)
    with pytest.raises(C.CorpusError, match="meta.json"):
        D.PackedDataset(str(out), "train", 8)  # no run reads it
    C.build_corpus([good], str(out), tok_path, workers=1, overwrite=True)
    assert sorted(os.listdir(out)) == sorted(C.CORPUS_FILES)
    (out / "NOTES.txt").write_text("notes")
    (out / "meta.json").unlink()  # not a half-replaced corpus once it holds other files
    with pytest.raises(C.CorpusError, match="not an empty directory"):
        C.build_corpus([good], str(out), tok_path, workers=1, overwrite=True)
    assert (out / "NOTES.txt").exists()


def test_ndjson_and_a_json_lines_file_of_only_a_byte_order_mark(tmp_path, tok_path, caplog):
    nd = write_jsonl(tmp_path / "a.ndjson", DOCS)
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf\n")
    with caplog.at_level(logging.WARNING):
        C.build_corpus([nd, str(tmp_path / "bom.jsonl")], str(tmp_path / "c"), tok_path, workers=1)
    assert sorted(decoded_docs(str(tmp_path / "c"))) == sorted(DOCS)
    assert "bom.jsonl" in caplog.text


def test_a_damaged_index_or_meta_is_a_corpus_error(corpus, tmp_path):
    import shutil

    bad = str(tmp_path / "bad")
    shutil.copytree(corpus, bad)
    idx = np.load(os.path.join(bad, "train.idx.npy"))
    idx[2], idx[3] = idx[3], idx[2]  # same length and last offset, no longer rising
    np.save(os.path.join(bad, "train.idx.npy"), idx)
    with pytest.raises(C.CorpusError, match="train.idx.npy: the document offsets .* rebuild"):
        D.PackedDataset(bad, "train", 8)
    meta = json.load(open(os.path.join(corpus, "meta.json")))
    del meta["eos_id"]
    with open(os.path.join(bad, "meta.json"), "w") as f:
        json.dump(meta, f)
    with pytest.raises(C.CorpusError, match="meta.json: unreadable.*eos_id.*rebuild"):
        D.PackedDataset(bad, "val", 8)


def test_a_corpus_is_on_disk_before_it_is_renamed_into_place(tmp_path, tok_path, monkeypatch):
    events = []
    fsync, replace = C.fsync_path, os.replace
    monkeypatch.setattr(C, "fsync_path", lambda p: (events.append(("fsync", os.path.basename(p.rstrip("/")))), fsync(p)))
    monkeypatch.setattr(C.os, "replace", lambda a, b: (events.append(("replace", os.path.basename(b))), replace(a, b)))
    C.build_corpus([write_jsonl(tmp_path / "d.jsonl", DOCS)], str(tmp_path / "c"), tok_path, workers=1)
    first_move = events.index(("replace", "c"))
    assert {n for what, n in events[:first_move] if what == "fsync"} >= set(C.CORPUS_FILES)
    assert ("fsync", "c") in events[first_move:] and ("fsync", tmp_path.name) in events[first_move:]


def test_a_replaced_tokenizer_json_is_refused(corpus, tmp_path):
    import shutil

    bad = str(tmp_path / "bad")
    shutil.copytree(corpus, bad)
    with open(os.path.join(bad, "tokenizer.json"), "a") as f:
        f.write("\n")
    with pytest.raises(C.CorpusError, match="not the tokenizer this corpus was built with"):
        D.PackedDataset(bad, "train", 8)
    D.PackedDataset(corpus, "train", 8)


def test_documents_begin_with_the_bos_of_the_tokenizers_template(tmp_path, tok_path):
    """A tokenizer whose template puts a BOS before a text (DeepSeek's, Llama's): every document
    starts with it (and ends with EOS, once), unless bos=False (--no-bos); the demo tokenizer has none."""
    from tokenizers import AddedToken
    from tokenizers.processors import TemplateProcessing

    tok = Tokenizer.from_file(tok_path)
    tok.add_special_tokens([AddedToken("<s>", special=True)])
    bos = tok.token_to_id("<s>")
    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.enable_padding(length=64)  # a file's padding settings must not hide the template
    tok.save(str(tmp_path / "bos.json"))
    src = write_jsonl(tmp_path / "d.jsonl", DOCS)
    meta = C.build_corpus([src], str(tmp_path / "c"), str(tmp_path / "bos.json"), workers=1)
    assert meta["bos_ids"] == [bos]
    docs = read_docs(str(tmp_path / "c"), "train") + read_docs(str(tmp_path / "c"), "val")
    assert len(docs) == len(DOCS) and all(d[0] == bos and bos not in d[1:] and d[-1] == meta["eos_id"] for d in docs)
    assert C.build_corpus([src], str(tmp_path / "n"), str(tmp_path / "bos.json"), workers=2, bos=False)["bos_ids"] == []
    assert not any(bos in d for d in read_docs(str(tmp_path / "n"), "train"))
    assert C.build_corpus([src], str(tmp_path / "p"), tok_path, workers=1)["bos_ids"] == []


def test_a_demo_vocabulary_beyond_what_it_can_train_is_refused(tmp_path):
    for size in (10, 2**20 + 1):
        with pytest.raises(C.CorpusError, match=f"demo vocab size {size}: .*--vocab-size"):
            C.build_corpus([write_jsonl(tmp_path / "d.jsonl", DOCS)], str(tmp_path / "c"), None, workers=1,
                           demo_vocab_size=size)
    assert not (tmp_path / "c").exists()

