"""Corpus building (`pithtrain build-corpus`).

``build_corpus`` turns text files (JSON lines, zstd-compressed JSON lines, Parquet, plain text) into a
directory holding one flat token stream per split (``train.bin`` / ``val.bin``), document start offsets
(``*.idx.npy``), the tokenizer and ``meta.json``; ``train/data.py`` reads it.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib
import json
import logging
import multiprocessing
import os
import shutil
import sys
import sysconfig
from array import array
from collections import deque
from collections.abc import Iterable, Iterator
from codecs import BOM_UTF8 as BOM
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import ExitStack
from typing import TYPE_CHECKING

import numpy as np

from pithtrain.config import fsync_path, unwritable

if TYPE_CHECKING:  # tokenizers is imported lazily so that `pithtrain --help` starts fast
    from tokenizers import Tokenizer

logger = logging.getLogger("pithtrain.corpus")
DEMO = "demo:python-stdlib"  # the demo corpus as an input (plain "demo" too, unless a path of that name exists)

FORMAT = 1
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")
DEMO_TEXT_CAP = 24 * 1024 * 1024  # bytes of UTF-8 text demo_texts() returns at most
DOCS_PER_TASK = 256  # documents per encode_batch call (one worker task)
CORPUS_FILES = ("meta.json", "tokenizer.json", "train.bin", "val.bin", "train.idx.npy", "val.idx.npy")
SKIP_HINT = "fix or remove the file, or pass --skip-bad-files (build_corpus(skip_bad_files=True)) to skip it"


class CorpusError(ValueError):
    """Bad corpus input or output; the message names the file and says what to change."""


# ----------------------------------------------------------------------------- tokenizer


def load_tokenizer(path: str) -> Tokenizer:
    """Load a ``tokenizers`` tokenizer from a tokenizer.json file or a directory holding one."""
    from tokenizers import Tokenizer

    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        where = f"directory {path} has no tokenizer.json" if os.path.isdir(path) else f"{path} does not exist"
        raise CorpusError(f"tokenizer: {where}; pass a tokenizer.json file (Hugging Face 'fast' format) or a "
                          "directory holding one, or no tokenizer to train a demo tokenizer")
    try:
        return Tokenizer.from_file(file)
    except Exception as e:
        raise CorpusError(f"tokenizer: cannot load {file} ({e}); it must be a `tokenizers` tokenizer.json") from e


def tokenizer_fingerprint(path: str) -> str:
    """A short hash of the parts of a tokenizer.json that decide the ids (model: vocabulary and merges,
    normalizer, pre-tokenizer, added tokens), as canonical JSON: two files with the same fingerprint encode text
    to the same ids. Left out: the file's formatting, and truncation / padding / post-processor / decoder, which
    do not change the ids the corpus builder writes (it encodes without them)."""
    spec = json.loads(load_tokenizer(path).to_str())
    parts = {k: spec.get(k) for k in ("model", "normalizer", "pre_tokenizer", "added_tokens")}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def vocabulary_fingerprint(path: str) -> str:
    """The older, vocabulary-only fingerprint (tokens and ids, added tokens included) that checkpoints
    written before `tokenizer_fingerprint` covered merges and normalizers still hold; resume accepts it."""
    vocab = load_tokenizer(path).get_vocab(with_added_tokens=True)
    return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]


def find_eos_id(tok: Tokenizer, eos_token: str | None = None) -> int:
    """Id of the end-of-document token: ``eos_token`` if given, else the first usual EOS name in the vocab."""
    for name in [eos_token] if eos_token is not None else EOS_CANDIDATES:
        tid = tok.token_to_id(name)
        if tid is not None:
            return tid
    if eos_token is not None:
        raise CorpusError(f"eos token {eos_token!r} is not in the tokenizer's vocabulary; pass one that is")
    raise CorpusError(f"the tokenizer has none of the usual end-of-text tokens {list(EOS_CANDIDATES)}; "
                      "name the one it uses with eos_token= (--eos-token)")


def train_demo_tokenizer(texts: Iterable[str], vocab_size: int, out_path: str) -> Tokenizer:
    """Train a byte-level BPE tokenizer (special token ``<|endoftext|>``) on ``texts``; save it at ``out_path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if not len(alphabet) + 1 <= vocab_size <= 2**20:
        raise CorpusError(f"demo vocab size {vocab_size}: byte-level BPE needs {len(alphabet) + 1} or more, and "
                          "this demo tokenizer trains at most 2^20 (1,048,576) tokens (--vocab-size)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(out_path)
    return tok


def demo_texts() -> list[str]:
    """The Python standard library's .py sources (at most ~24 MB), one document per file, sorted by path."""
    skip_dirs = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    paths = []
    for dirpath, dirnames, filenames in os.walk(sysconfig.get_paths()["stdlib"]):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs]
        paths += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    texts, total = [], 0
    for path in sorted(paths):
        try:
            with open(path, "rb") as f:
                raw = f.read()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if total + len(raw) > DEMO_TEXT_CAP:
            break
        if text:
            texts.append(text)
            total += len(raw)
    return texts


# ----------------------------------------------------------------------------- readers


def _expand_inputs(inputs: list[str]) -> list[str]:
    """Files named by ``inputs`` (files, directories walked in sorted order, glob patterns), de-duplicated."""

    def walk(d: str) -> list[str]:
        out = []
        for dirpath, dirnames, filenames in os.walk(d):
            dirnames[:] = sorted(n for n in dirnames if not n.startswith("."))
            out += [os.path.join(dirpath, f) for f in sorted(filenames) if not f.startswith(".")]
        return out

    files, seen = [], set()
    for item in inputs:
        if os.path.isfile(item):
            found = [item]
        elif os.path.isdir(item):
            found = walk(item)
        else:
            matches = sorted(glob.glob(item, recursive=True))
            if not matches:
                raise CorpusError(f"input {item!r}: no such file or directory, and no file matches it as a glob")
            found = [f for m in matches for f in (walk(m) if os.path.isdir(m) else [m])]
        for f in found:
            if os.path.realpath(f) not in seen:
                seen.add(os.path.realpath(f))
                files.append(f)
    return files


def _zst_lines(path: str) -> Iterator[bytes]:
    """Lines of a (possibly multi-frame) .zst file; a stream cut off mid-frame is an error."""
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    dobj, fed, rest = dctx.decompressobj(), False, b""
    try:
        with open(path, "rb") as f:
            while data := f.read(1 << 20):
                while data:
                    lines = (rest + dobj.decompress(data)).split(b"\n")
                    rest, fed = lines.pop(), True
                    yield from lines
                    if dobj.eof:  # frame finished; what follows belongs to the next frame
                        data, dobj, fed = dobj.unused_data, dctx.decompressobj(), False
                    else:
                        data = b""
    except zstandard.ZstdError as e:
        raise CorpusError(f"{path}: corrupt zstd data ({e}); re-download or recompress the file") from e
    if fed and not dobj.eof:
        raise CorpusError(f"{path}: truncated zstd stream (ends mid-frame); re-download or recompress the file")
    yield rest  # even when empty, so that b"\n".join() restores the text exactly


def _json_lines(path: str, lines: Iterable[bytes], text_key: str) -> Iterator[str]:
    """Documents of a JSON-lines stream: the string ``text_key`` of each JSON object."""
    for lineno, raw in enumerate(lines, 1):
        bom = len(BOM) if lineno == 1 and raw.startswith(BOM) else 0  # a byte-order mark is not text
        if not raw[bom:].strip():
            continue
        where = f"{path}: line {lineno}"
        try:
            line = raw[bom:].decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorpusError(f"{where}: not valid UTF-8 (byte at column {bom + e.start + 1}); "
                              "re-encode the file as UTF-8") from e
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            hint = " (a JSON array? JSON lines wants one object per line)" if line.lstrip().startswith("[") else ""
            raise CorpusError(f"{where}: invalid JSON ({e.msg} at column {e.colno}){hint}") from e
        if not isinstance(obj, dict):
            raise CorpusError(f"{where}: a JSON {type(obj).__name__}, expected an object with a {text_key!r} key")
        if text_key not in obj:
            raise CorpusError(f"{where}: no {text_key!r} key (keys present: {sorted(obj)[:20]}); "
                              "name the text field with text_key= (--text-key)")
        text = obj[text_key]
        if not isinstance(text, str):
            raise CorpusError(f"{where}: {text_key!r} is a {type(text).__name__}, expected a string")
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise CorpusError(f"{where}: {text_key!r} holds an unpaired surrogate escape, not valid text") from e
        if text:
            yield text


def _pool_result(future):
    try:
        return future.result()
    except BrokenProcessPool as e:
        raise CorpusError("a tokenizer worker process died (killed from outside, most often by the system for want of "
                          "memory); nothing was written to the output; run again with fewer --workers") from e


def _plain_text(path: str, raw: bytes) -> Iterator[str]:
    """The whole file as one document."""
    bom = len(BOM) if raw.startswith(BOM) else 0  # a byte-order mark is not text
    try:
        text = raw[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: bom + e.start].count(b"\n") + 1
        raise CorpusError(f"{path}: line {line}: not valid UTF-8 (byte offset {bom + e.start}); re-encode the file as "
                          "UTF-8, or leave binary files out of the inputs") from e
    if text:
        yield text


def _parquet(path: str, text_key: str) -> Iterator[str]:
    """Documents of a Parquet file: the string column ``text_key``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except (pa.ArrowException, OSError) as e:
        raise CorpusError(f"{path}: not a readable Parquet file ({e})") from e
    if text_key not in schema.names:
        raise CorpusError(f"{path}: no column {text_key!r} (columns: {schema.names}); "
                          "name the text column with text_key= (--text-key)")
    typ = schema.field(text_key).type
    strings = lambda t: pa.types.is_string(t) or pa.types.is_large_string(t) or str(t) == "string_view"  # noqa: E731
    if not (strings(typ) or (pa.types.is_dictionary(typ) and strings(typ.value_type))):  # dictionary: categoricals
        raise CorpusError(f"{path}: column {text_key!r} has type {typ}, expected strings (columns: {schema.names})")
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=1024, columns=[text_key]):
            for text in batch.column(0).to_pylist():
                row += 1
                if text is None:
                    raise CorpusError(f"{path}: row {row}: {text_key!r} is null; drop or fill null rows")
                if text:
                    yield text
    except (pa.ArrowException, OSError) as e:
        raise CorpusError(f"{path}: corrupt Parquet data after row {row} ({e})") from e


def _read_documents(path: str, text_key: str) -> Iterator[str]:
    """Documents of one file, by name: *.jsonl/*.ndjson/*.json, *.parquet, else plain text; *.zst decompressed first."""
    name = path.lower()
    zst = name.endswith(".zst")
    try:
        if name.endswith(".parquet"):
            yield from _parquet(path, text_key)
        elif name.removesuffix(".zst").endswith((".jsonl", ".ndjson", ".json")):
            if zst:
                yield from _json_lines(path, _zst_lines(path), text_key)
            else:
                with open(path, "rb") as f:
                    yield from _json_lines(path, f, text_key)
        elif zst:
            yield from _plain_text(path, b"\n".join(_zst_lines(path)))
        else:
            with open(path, "rb") as f:
                raw = f.read()
            yield from _plain_text(path, raw)
    except OSError as e:
        raise CorpusError(f"{path}: cannot read ({e})") from e


# ----------------------------------------------------------------------------- tokenization


def bos_ids(tok: "Tokenizer") -> list[int]:
    """The ids that the tokenizer's template (post-processor) puts before a text: DeepSeek's and
    Llama's BOS; none for Qwen3, GPT-OSS or a demo tokenizer. What it puts after a text is left out:
    the corpus ends each document with its own EOS."""
    tok = type(tok).from_str(tok.to_str())  # a copy without the file's padding and truncation settings
    tok.no_padding()
    tok.no_truncation()
    plain, full = (tok.encode("a b", add_special_tokens=special).ids for special in (False, True))
    starts = [i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain]
    return full[:starts[0]] if starts else []


class _Encoder:
    """Tokenizes a list of documents into one flat token array (``bos`` before and EOS after each) plus
    per-document lengths."""

    def __init__(self, tokenizer_json: str, eos_id: int, dtype: str, bos: list[int]):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_str(tokenizer_json)
        self.tok.encode_special_tokens = True  # "<|endoftext|>" written inside a document stays plain text
        self.tok.no_truncation()  # settings saved in a tokenizer.json would cut documents short
        self.tok.no_padding()  # ... or write pad tokens into the corpus
        self.eos_id, self.dtype, self.bos = eos_id, dtype, bos

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, list[int]]:
        flat: list[int] = []
        lengths = []
        for enc in getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)(texts, add_special_tokens=False):
            flat += self.bos
            flat += enc.ids
            flat.append(self.eos_id)
            lengths.append(len(self.bos) + len(enc.ids) + 1)
        return np.array(flat, dtype=self.dtype), lengths


_worker_encoder: _Encoder | None = None


def _worker_init(tokenizer_json: str, eos_id: int, dtype: str, bos: list[int]) -> None:
    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the parallelism comes from the process pool
    _worker_encoder = _Encoder(tokenizer_json, eos_id, dtype, bos)


def _worker_encode(texts: list[str]) -> tuple[np.ndarray, list[int]]:
    return _worker_encoder(texts)


def _is_val(seed: int, tokens: np.ndarray, val_fraction: float) -> bool:
    """Deterministic document-level split: hash (seed, the document's token ids) into [0, 1). By content,
    not position: copies of a document land in the same split, and adding or reordering inputs moves
    no document between the splits."""
    h = hashlib.blake2b(tokens.astype(np.int64).tobytes(), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(h, "little") / 2.0**64 < val_fraction


class _SplitWriter:
    """Appends documents to ``<split>.bin``, keeping their start offsets; can drop documents from the end."""

    def __init__(self, directory: str, split: str, dtype: str):
        self.idx_path = os.path.join(directory, f"{split}.idx.npy")
        self.f = open(os.path.join(directory, f"{split}.bin"), "w+b")
        self.dtype, self.offsets = np.dtype(dtype), array("q", [0])

    n_docs = property(lambda self: len(self.offsets) - 1)
    n_tokens = property(lambda self: self.offsets[-1])

    def add(self, tokens: np.ndarray) -> None:
        self.f.write(tokens.tobytes())
        self.offsets.append(self.offsets[-1] + len(tokens))

    def truncate(self, n_docs: int, read: bool = False) -> np.ndarray | None:
        """Keep the first ``n_docs`` documents; returns the dropped tokens if ``read``."""
        del self.offsets[n_docs + 1 :]
        self.f.seek(self.n_tokens * self.dtype.itemsize)
        dropped = np.frombuffer(self.f.read(), dtype=self.dtype) if read else None
        self.f.seek(self.n_tokens * self.dtype.itemsize)
        self.f.truncate()
        return dropped

    def close(self) -> None:
        self.f.close()
        np.save(self.idx_path, np.frombuffer(self.offsets, dtype=np.int64))


def build_corpus(inputs: list[str], out_dir: str, tokenizer: str | None, *, text_key: str = "text",
                 val_fraction: float = 0.01, workers: int = 2, eos_token: str | None = None,
                 skip_bad_files: bool = False, demo_vocab_size: int = 4096, seed: int = 0,
                 overwrite: bool = False, bos: bool = True) -> dict:
    """Tokenize ``inputs`` into the packed corpus directory ``out_dir``; returns its meta dict.

    ``inputs`` are files, directories or glob patterns, or ``["demo"]`` (``[DEMO]``, which no path shadows)
    for the standard-library demo text.
    ``tokenizer`` None trains a byte-level BPE tokenizer of ``demo_vocab_size`` tokens on the inputs.
    Everything is written to a temporary directory whose files become ``out_dir``'s only when complete (a new
    ``out_dir`` is renamed into place; into an existing one the files are moved, the old ``meta.json`` removed first
    and the new one moved last), so an error leaves nothing behind, or, if it stops the moves, a corpus without
    ``meta.json`` that no run reads and ``overwrite`` replaces; a killed build's ``.tmp-PID`` is removed by the
    next.  ``overwrite`` allows replacing a previous corpus (never other files).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise CorpusError(f"val_fraction {val_fraction} must be in [0, 1)")
    if workers < 1:
        raise CorpusError(f"workers = {workers}: give 1 or more tokenizer processes (--workers)")
    out_dir = os.path.abspath(out_dir)  # "." has no name to make a sibling of; messages say where
    existing = os.listdir(out_dir) if os.path.isdir(out_dir) else None
    # the temporary directories of builds that were killed, inside the output or beside it: ours to remove
    for path in glob.glob(glob.escape(out_dir) + ".tmp-*") + [os.path.join(out_dir, n) for n in existing or []]:
        if _stale_tmp(path, out_dir):
            logger.warning("removing %s, left by a build that was stopped", path)
            shutil.rmtree(path, ignore_errors=True)
            if os.path.dirname(path) == out_dir:
                existing.remove(os.path.basename(path))
    if os.path.exists(out_dir) and existing is None:
        raise CorpusError(f"output {out_dir} exists and is not a directory; pass a new output directory")
    if why := unwritable(out_dir):
        raise CorpusError(f"output {out_dir} cannot be {'written' if existing is not None else 'made'} ({why}); "
                          "pass another output directory")
    if existing:
        # a corpus whose replacement was stopped: its files and no meta.json (removed first, written last)
        half = "meta.json" not in existing and not set(existing) - set(CORPUS_FILES)
        if not _is_corpus(out_dir) and not half:
            raise CorpusError(f"output {out_dir} exists and is not an empty directory (nor a corpus): it holds "
                              f"{sorted(existing)[:10]}; pass a new or empty output directory")
        if not overwrite:
            what = "the files of a corpus whose build was stopped" if half else "a corpus"
            raise CorpusError(f"output {out_dir} already holds {what}; pass a new output directory "
                              "(or overwrite=True / --overwrite to replace it)")
        if extra := sorted(set(existing) - set(CORPUS_FILES)):
            raise CorpusError(f"output {out_dir} holds a corpus and other files {extra[:10]}, which overwriting "
                              "would delete; move them elsewhere, or pass a new output directory")
    if inputs in (["demo"], [DEMO]):
        if inputs == ["demo"] and os.path.exists("demo"):
            raise CorpusError("'demo' names both the demo corpus and the path ./demo here; pass ./demo for that "
                              "path, or run from another directory for the demo corpus")
        sources = [(DEMO, lambda: iter(demo_texts()))]
    elif inputs:
        files = _expand_inputs(inputs)
        inside = [f for f in files if os.path.realpath(f).startswith(os.path.join(os.path.realpath(out_dir), ""))]
        if inside:
            raise CorpusError(f"input {inside[0]} lies inside the output directory {out_dir}, which the corpus "
                              "replaces; pass inputs from elsewhere, or another output directory")
        for ext, module in ((".zst", "zstandard"), (".parquet", "pyarrow.parquet")):  # the [data] extra
            named = [f for f in files if f.lower().endswith(ext)]
            try:
                if named:
                    importlib.import_module(module)
            except ImportError as e:  # said once, up front: a missing package is not a bad file to skip
                pkg = module.partition(".")[0]
                raise CorpusError(f"{named[0]}: reading {ext} files needs the optional package {pkg}, which is "
                                  f"not installed; pip install -e '.[data]' (or pip install {pkg})") from e
        sources = [(p, lambda p=p: _read_documents(p, text_key)) for p in files]
    else:
        raise CorpusError("no inputs given; pass files, directories or glob patterns (or 'demo')")

    # An existing directory (empty, or a corpus to replace) may be the current one, or one whose parent is not
    # writable: its files are replaced one by one, built in a temporary directory inside it.
    tmp = os.path.join(out_dir, f".tmp-{os.getpid()}") if existing is not None else f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        meta = _build(sources, tmp, tokenizer, val_fraction, workers, eos_token, skip_bad_files, demo_vocab_size,
                      seed, bos)
        for name in os.listdir(tmp) + [""]:  # on disk before meta.json can name it complete (the folder last)
            fsync_path(os.path.join(tmp, name))
        if existing is None:
            os.replace(tmp, out_dir)
        else:
            if "meta.json" in existing:
                os.remove(os.path.join(out_dir, "meta.json"))  # the old corpus is incomplete from here on
            for name in sorted(os.listdir(tmp), key=lambda n: n == "meta.json"):  # meta.json marks it complete
                os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
            os.rmdir(tmp)
        fsync_path(out_dir)
        fsync_path(os.path.dirname(out_dir))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("corpus written to %s: %s", out_dir, meta["splits"])
    return meta


def _stale_tmp(path: str, out_dir: str) -> bool:
    """Whether ``path`` is the temporary directory of a build into ``out_dir`` (``out_dir/.tmp-PID``, or
    ``out_dir.tmp-PID`` beside a new one) whose process is gone."""
    pid = next((path[len(p):] for p in (os.path.join(out_dir, ".tmp-"), out_dir + ".tmp-") if path.startswith(p)), "")
    if not pid.isdigit() or not os.path.isdir(path):
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        pass
    return False


def _is_corpus(directory: str) -> bool:
    """Whether ``directory`` holds a corpus: a meta.json written by build_corpus, not just any file of that name."""
    try:
        with open(os.path.join(directory, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def _build(sources, tmp, tokenizer, val_fraction, workers, eos_token, skip_bad_files, demo_vocab_size, seed, bos):
    """The body of build_corpus, writing into the temporary directory ``tmp``; returns the meta dict."""
    skipped: list[tuple[int, str]] = []  # (source index, reason)

    def bad_file(i: int, err: CorpusError) -> None:
        if not skip_bad_files:
            raise CorpusError(f"{err}; {SKIP_HINT}") from err
        logger.warning("skipping bad file: %s", err)
        skipped.append((i, str(err)))

    tok_path = os.path.join(tmp, "tokenizer.json")
    if tokenizer is None:
        # Each file is read whole before the trainer sees it, so a bad file never half-trains the tokenizer.
        # A fatal error ends the text stream and is raised after training, not thrown through the trainer.
        errors: list[CorpusError] = []

        def training_texts() -> Iterator[str]:
            for i, (_, read) in enumerate(sources):
                try:
                    docs = list(read())
                except CorpusError as e:
                    if not skip_bad_files:
                        errors.append(e)
                        return
                    bad_file(i, e)
                    continue
                yield from docs

        tok = train_demo_tokenizer(training_texts(), demo_vocab_size, tok_path)
        if errors:
            raise CorpusError(f"{errors[0]}; {SKIP_HINT}") from errors[0]
    else:
        tok = load_tokenizer(tokenizer)
        shutil.copyfile(os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) else tokenizer,
                        tok_path)
    eos_id = find_eos_id(tok, eos_token)
    vocab_size = max(tok.get_vocab_size(), max(tok.get_vocab().values()) + 1)  # both count added tokens
    dtype = "uint16" if vocab_size <= 65536 else "uint32"
    known_bad = {i for i, _ in skipped}
    writers = {s: _SplitWriter(tmp, s, dtype) for s in ("train", "val")}
    doc_count: dict[int, int] = {}  # source index -> documents written
    state = {"file": -1, "start": (0, 0)}  # last file written, (train docs, val docs) before it

    def tasks() -> Iterator[tuple[str, object, object]]:
        """("docs", source indices, texts) batches (small files share one), ("empty", i, None), ("bad", i, error)."""
        ids: list[int] = []
        batch: list[str] = []
        for i, (_, read) in enumerate(sources):
            if i in known_bad:
                continue
            n = 0
            try:
                for text in read():
                    ids.append(i)
                    batch.append(text)
                    n += 1
                    if len(batch) >= DOCS_PER_TASK:
                        yield "docs", ids, batch
                        ids, batch = [], []
            except CorpusError as e:
                keep = len(ids) - min(n, len(ids))  # this file's unsent documents are dropped
                if keep:
                    yield "docs", ids[:keep], batch[:keep]
                ids, batch = [], []
                yield "bad", i, e
                continue
            if n == 0:
                yield "empty", i, None
        if batch:
            yield "docs", ids, batch

    def handle(kind: str, i, payload) -> None:
        """Write one task's result, in input order; a bad file's documents written so far are rolled back."""
        if kind == "docs":
            tokens, lengths = payload
            for f, end, n in zip(i, np.cumsum(lengths).tolist(), lengths, strict=True):
                if f != state["file"]:
                    state["file"], state["start"] = f, (writers["train"].n_docs, writers["val"].n_docs)
                doc = tokens[end - n : end]
                writers["val" if _is_val(seed, doc, val_fraction) else "train"].add(doc)
                doc_count[f] = doc_count.get(f, 0) + 1
        elif kind == "bad":
            if state["file"] == i:
                n_train, n_val = state["start"]
                writers["train"].truncate(n_train)
                writers["val"].truncate(n_val)
                state["file"] = -1
                del doc_count[i]
            bad_file(i, payload)
        else:
            logger.warning("skipping empty file %s (no documents)", sources[i][0])
            skipped.append((i, "empty: no documents"))

    bos = bos_ids(tok) if bos else []
    enc_args = (tok.to_str(), eos_id, dtype, bos)
    try:
        with ExitStack() as stack:
            if workers <= 1:
                submit, result, ahead = _Encoder(*enc_args), (lambda r: r), 0
            else:  # spawn, not fork: safe with threads, and a worker that dies raises BrokenProcessPool
                pool = ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"), _worker_init, enc_args)
                stack.callback(pool.shutdown, wait=True, cancel_futures=True)  # on error: drop queued work
                submit, result, ahead = (lambda t: pool.submit(_worker_encode, t)), _pool_result, 4 * workers
            pending: deque = deque()  # bounded look-ahead: flat memory, results handled in input order
            for task in tasks():
                pending.append((task[0], task[1], submit(task[2]) if task[0] == "docs" else task[2]))
                while len(pending) > ahead:
                    kind, i, p = pending.popleft()
                    handle(kind, i, result(p) if kind == "docs" else p)
            for kind, i, p in pending:
                handle(kind, i, result(p) if kind == "docs" else p)
        total = writers["train"].n_docs + writers["val"].n_docs
        if total < 1 + (val_fraction > 0):
            raise CorpusError(f"the inputs hold {total or 'no'} document{'s' * (total != 1)}; at least "
                              + ("2 are needed (one for train, one for validation)" if val_fraction > 0 else "1 is needed")
                              + ": pass files with text in them")
        # Neither split may be empty, except validation when none was asked for (val_fraction 0).
        for a, b in (("train", "val"), ("val", "train"))[val_fraction == 0:]:
            if writers[b].n_docs == 0:
                doc = writers[a].truncate(writers[a].n_docs - 1, read=True)
                writers[b].add(doc)
                logger.warning("the %s split was empty: moved the last %s document into it (%d tokens, %.0f%% of "
                               "the corpus); pass a --val-fraction that holds out more documents for a better split",
                               b, a, len(doc), 100 * len(doc) / max(writers[a].n_tokens + len(doc), 1))
    finally:
        for w in writers.values():
            w.close()

    with open(tok_path, "rb") as f:
        tok_sha = hashlib.sha256(f.read()).hexdigest()
    meta = {"format": FORMAT, "vocab_size": vocab_size, "eos_id": eos_id, "bos_ids": bos, "dtype": dtype,
            "tokenizer_sha256": tok_sha,
            "splits": {s: {"tokens": w.n_tokens, "docs": w.n_docs} for s, w in writers.items()},
            "sources": [{"path": sources[i][0], "docs": n} for i, n in sorted(doc_count.items())],
            "skipped": [{"path": sources[i][0], "reason": r} for i, r in sorted(skipped, key=lambda s: s[0])]}
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return meta


# ----------------------------------------------------------------------------- CLI


def add_build_corpus_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `pithtrain build-corpus`."""
    add = parser.add_argument
    add("inputs", nargs="+", help="files, directories or glob patterns (*.jsonl / *.ndjson / *.json, *.zst of "
        "them, *.parquet, plain text); 'demo' for the Python standard library sources")
    add("--out", required=True, help="output corpus directory (new or empty)")
    add("--tokenizer", default=None, help="tokenizer.json or a directory holding one (default: train a demo BPE)")
    add("--text-key", default="text", help="JSON key / Parquet column holding the text (default: text)")
    add("--val-fraction", type=float, default=0.01,
        help="share of documents held out for validation (0: none, for runs with data.val_batches = 0)")
    add("--workers", type=int, default=min(4, os.cpu_count() or 1), help="tokenizer processes")
    add("--eos-token", default=None, help="end-of-document token (default: auto-detect)")
    add("--skip-bad-files", action="store_true", help="skip unreadable or malformed files instead of failing")
    add("--vocab-size", type=int, default=4096, help="vocab size of the demo tokenizer (default: 4096)")
    add("--seed", type=int, default=0, help="seed of the train/validation split (default: 0)")
    add("--overwrite", action="store_true", help="replace an existing corpus in --out")
    add("--no-bos", dest="bos", action="store_false", help="leave out the tokens the tokenizer's template puts "
        "before a text (DeepSeek's BOS; Qwen3's and GPT-OSS's tokenizers put none), which each document gets "
        "by default")


def run_build_corpus(args: argparse.Namespace) -> int:
    """Run build_corpus from parsed CLI args: 0 on success, 2 (message on stderr) on bad input."""
    try:
        meta = build_corpus(args.inputs, args.out, args.tokenizer, text_key=args.text_key,
                            val_fraction=args.val_fraction, workers=args.workers, eos_token=args.eos_token,
                            skip_bad_files=args.skip_bad_files, demo_vocab_size=args.vocab_size, seed=args.seed,
                            overwrite=getattr(args, "overwrite", False), bos=getattr(args, "bos", True))
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"corpus written to {args.out} (vocab {meta['vocab_size']}, {meta['dtype']}, eos id {meta['eos_id']}, "
          f"each document begins with {meta['bos_ids'] or 'no BOS'})")
    for split, s in meta["splits"].items():
        print(f"  {split:5s} {s['docs']:>10,d} docs {s['tokens']:>14,d} tokens")
    if meta["skipped"]:
        print(f"  skipped {len(meta['skipped'])} file(s):")
        for s in meta["skipped"]:
            print(f"    {s['reason'] if s['reason'].startswith(s['path']) else s['path'] + ': ' + s['reason']}")
    return 0
