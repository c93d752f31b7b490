"""Packed-token data loading from a corpus that `train/corpus.py` built.

``PackedDataset`` memory-maps one split and cuts it into windows of ``seq_len + 1`` tokens;
``GlobalBatchSampler`` shuffles those windows epoch after epoch, with a position that a checkpoint
saves and restores exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING

import numpy as np

from pithtrain.train.corpus import FORMAT, CorpusError

if TYPE_CHECKING:
    import torch


class PackedDataset:
    """Memory-mapped packed token stream of one split; samples are windows of seq_len+1 tokens."""

    def __init__(self, corpus_dir: str, split: str, seq_len: int):
        meta_path = os.path.join(corpus_dir, "meta.json")
        if not os.path.isfile(meta_path):
            raise CorpusError(f"{meta_path} not found; data.corpus must name a directory written by "
                              "`pithtrain build-corpus`")
        try:
            with open(meta_path) as f:
                meta = json.load(f)
            fmt, splits = meta.get("format"), meta["splits"]
            if fmt != FORMAT or meta.get("dtype") not in ("uint16", "uint32"):
                raise CorpusError(f"{meta_path}: corpus format {fmt!r} / dtype {meta.get('dtype')!r} is not "
                                  f"format {FORMAT} uint16/uint32; rebuild the corpus with this version")
            if split not in splits:
                raise CorpusError(f"{meta_path}: no split {split!r} (splits: {sorted(splits)})")
            self.vocab_size, self.eos_id = int(meta["vocab_size"]), int(meta["eos_id"])
            self.n_tokens, n_docs = int(splits[split]["tokens"]), int(splits[split]["docs"])
        except CorpusError:
            raise
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
            raise CorpusError(f"{meta_path}: unreadable ({e!r}); rebuild the corpus") from e
        if seq_len < 1:
            raise CorpusError(f"seq_len must be at least 1, got {seq_len}")
        self.meta, self.split, self.seq_len = meta, split, seq_len
        self.tokenizer_path = os.path.join(corpus_dir, "tokenizer.json")
        if meta.get("tokenizer_sha256") and os.path.isfile(self.tokenizer_path):
            with open(self.tokenizer_path, "rb") as f:
                if hashlib.sha256(f.read()).hexdigest() != meta["tokenizer_sha256"]:
                    raise CorpusError(f"{self.tokenizer_path} is not the tokenizer this corpus was built with (its "
                                      "sha256 differs from meta.json's): restore that file, or rebuild the corpus")
        dtype = np.dtype(meta["dtype"])
        bin_path = os.path.join(corpus_dir, f"{split}.bin")
        size = os.path.getsize(bin_path) if os.path.isfile(bin_path) else None
        if size != self.n_tokens * dtype.itemsize:
            raise CorpusError(f"{bin_path} {'is missing' if size is None else f'has {size} bytes'}, but meta.json "
                              f"says {self.n_tokens} {dtype} tokens ({self.n_tokens * dtype.itemsize} bytes); "
                              "the corpus is incomplete or was modified: rebuild it")
        idx_path = os.path.join(corpus_dir, f"{split}.idx.npy")
        try:
            self.offsets = np.load(idx_path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise CorpusError(f"{idx_path}: unreadable ({e}); rebuild the corpus") from e
        if self.offsets.shape != (n_docs + 1,) or int(self.offsets[-1]) != self.n_tokens:
            raise CorpusError(f"{idx_path}: {len(self.offsets)} offsets do not match meta.json's {n_docs} docs and "
                              f"{self.n_tokens} tokens; rebuild the corpus")
        if int(self.offsets[0]) != 0 or (np.diff(self.offsets) < 0).any():  # document masks would come out wrong
            raise CorpusError(f"{idx_path}: the document offsets do not start at 0 and rise; the file is damaged: "
                              "rebuild the corpus")
        self.tokens = np.memmap(bin_path, dtype=dtype, mode="r") if self.n_tokens else np.zeros(0, dtype)

    def __len__(self) -> int:
        n = max(self.n_tokens - 1, 0) // self.seq_len
        if n == 0:
            raise CorpusError(f"corpus split {self.split} has {self.n_tokens} tokens, fewer than "
                              f"seq_len+1={self.seq_len + 1}; lower data.seq_len or add data"
                              + (", or rebuild the corpus with a larger --val-fraction, or set data.val_batches = 0 "
                                 "to train without validation" if self.split == "val" else ""))
        return n

    def _start(self, i: int) -> int:
        """First token of window ``i`` (a negative ``i`` counts from the end)."""
        n, i = len(self), int(i)
        if not -n <= i < n:
            raise IndexError(f"window {i} out of range: split {self.split} has {n} windows")
        return (i % n) * self.seq_len

    def window(self, i: int) -> np.ndarray:
        """The seq_len+1 tokens of window ``i``, a read-only view of the memory map."""
        start = self._start(i)
        return self.tokens[start : start + self.seq_len + 1]

    def __getitem__(self, i: int) -> torch.Tensor:
        import torch

        return torch.from_numpy(self.window(i).astype(np.int64))

    def doc_starts(self, i: int) -> np.ndarray:
        """Offsets, relative to window ``i``, of the documents starting at one of its seq_len input positions."""
        start = self._start(i)
        a, b = np.searchsorted(self.offsets, [start, start + self.seq_len], side="left")
        return np.asarray(self.offsets[a:b], dtype=np.int64) - start


class GlobalBatchSampler:
    """Seeded global shuffle over dataset windows, epoch after epoch; yields the window indices of one global
    batch at a time. Its position is a small dict saved in checkpoints and restored exactly."""

    def __init__(self, n_samples: int, global_batch: int, seed: int, seq_len: int | None = None,
                 tokens: int | None = None):
        if not 1 <= global_batch <= n_samples:
            raise CorpusError(f"global batch {global_batch} must be between 1 and the dataset's {n_samples} windows; "
                              "lower the batch size or data.seq_len, or add data")
        self.n_samples, self.global_batch, self.seed = n_samples, global_batch, seed
        self.seq_len, self.tokens = seq_len, tokens  # the windows' length and the split's size, checked on resume
        self._epoch, self._offset, self._perm = 0, 0, None

    @property
    def epoch(self) -> int:
        return self._epoch

    def next_batch(self) -> list[int]:
        """Window indices of the next global batch; an epoch's tail shorter than a batch is dropped."""
        if self._offset + self.global_batch > self.n_samples:
            self._epoch, self._offset, self._perm = self._epoch + 1, 0, None
        if self._perm is None:
            # permutation(n)'s order, shuffled in int32 where it fits: half the memory (1 GB per rank at 2^28 windows)
            perm = np.arange(self.n_samples, dtype=np.int32 if self.n_samples < 2**31 else np.int64)
            np.random.default_rng([self.seed, self._epoch]).shuffle(perm)
            self._perm = perm
        self._offset += self.global_batch
        return self._perm[self._offset - self.global_batch : self._offset].tolist()

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "offset": self._offset, "seed": self.seed,
                "n_samples": self.n_samples, "global_batch": self.global_batch,
                "seq_len": self.seq_len, "tokens": self.tokens}

    def load_state_dict(self, sd: dict) -> None:
        """Restore a position; the corpus (its tokens and n_samples), seq_len and seed must match (a
        state without seq_len / tokens checks n_samples alone), the global batch may differ."""
        if None not in (sd.get("seq_len"), self.seq_len) and sd["seq_len"] != self.seq_len:
            raise CorpusError(f"the checkpoint was trained with data.seq_len = {sd['seq_len']}, the config says "
                              f"{self.seq_len}: resume with data.seq_len={sd['seq_len']}, or start from its weights "
                              "with checkpoint.init_from")
        if None not in (sd.get("tokens"), self.tokens) and sd["tokens"] != self.tokens:
            raise CorpusError(f"the checkpoint's training split had {sd['tokens']} tokens, data.corpus's has "
                              f"{self.tokens}: the corpus changed since the checkpoint; resume with the corpus it was "
                              "trained on, or start from its weights with checkpoint.init_from")
        if sd["n_samples"] != self.n_samples:
            raise CorpusError(f"the checkpoint's sampler saw {sd['n_samples']} windows, the dataset now has "
                              f"{self.n_samples}: the corpus or data.seq_len changed since the checkpoint")
        if sd["seed"] != self.seed:
            raise CorpusError(f"the checkpoint's sampler seed {sd['seed']} differs from train.seed = {self.seed}: "
                              f"resume with train.seed={sd['seed']}, or start from its weights with "
                              "checkpoint.init_from")
        if not 0 <= sd["offset"] <= self.n_samples or sd["epoch"] < 0:
            raise CorpusError(f"the checkpoint's sampler position {sd} is invalid")
        self._epoch, self._offset, self._perm = int(sd["epoch"]), int(sd["offset"]), None


def batch_tensors(dataset: PackedDataset, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack windows into (input_ids, labels), both int64 [B, seq_len]; labels are the next tokens."""
    import torch

    windows = torch.from_numpy(np.stack([dataset.window(i) for i in indices]).astype(np.int64))
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def micro_batch_fields(mb: tuple) -> tuple:
    """A micro-batch as all four fields (input_ids, labels, position_ids, doc_ids); missing ones are None."""
    return tuple((list(mb) + [None, None])[:4])


def document_ids(dataset: PackedDataset, indices: list[int]) -> torch.Tensor:
    """[B, seq_len] int64: which document of its window each input token belongs to (0, 1, ...; a new
    document starts at the token after an end-of-document token), for document masking."""
    import torch

    out = np.zeros((len(indices), dataset.seq_len), np.int64)
    positions = np.arange(dataset.seq_len)
    for row, i in enumerate(indices):
        starts = dataset.doc_starts(i)
        out[row] = np.searchsorted(starts[starts > 0], positions, side="right")
    return torch.from_numpy(out)


def validation_batches(dataset: PackedDataset, batch_size: int, global_batch: int, n_global: int) -> list[list[int]]:
    """Fixed, unshuffled validation batches of `batch_size` (a micro-batch on every data rank): the first
    `n_global` global batches of windows, whole ones only, so the windows are the same for any micro-batch size
    and rank count and val_loss compares across layouts. A split of less than one global batch gives as many
    whole batches as it holds, which does depend on the layout (the training loop says so)."""
    n = len(dataset)
    if n < batch_size:
        raise CorpusError(f"the {dataset.split} split has {n} windows of seq_len {dataset.seq_len}, fewer than one "
                          f"batch of {batch_size} (data.micro_batch_size x data ranks); lower data.micro_batch_size "
                          "or data.seq_len, rebuild the corpus with a larger --val-fraction, or set "
                          "data.val_batches = 0 to train without validation")
    windows = min(n_global, n // global_batch) * global_batch or n
    return [list(range(b * batch_size, (b + 1) * batch_size)) for b in range(windows // batch_size)]
