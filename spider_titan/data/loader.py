"""Token datasets and the stateful, rank-aware loader that cuts them into training batches.

A :class:`TokenDataset` is a list of token arrays (shard memmaps or in-memory documents) read as
one concatenated stream. The four dataset builders registered in ``registry.py``
(``bytes``, ``text``, ``builtin``, ``mock``) share one signature,
``(path, *, split, seed) -> TokenDataset``.

:class:`ByteDataLoader` turns a dataset into ``(input_ids, labels)`` batches:

* sample ``i`` is the window of ``seq_len + 1`` tokens starting at ``i * seq_len`` (windows do not
  overlap as inputs); ``labels`` are the inputs shifted by one, with PAD mapped to IGNORE_INDEX;
* the samples of epoch ``e`` come in the order ``numpy.random.default_rng(seed + e).permutation``;
  epochs follow each other without a gap, so a global batch may straddle two epochs;
* global batch ``g`` is global samples ``[g * B * W, (g + 1) * B * W)`` (B = local batch size,
  W = data-parallel world size) and rank ``r`` takes its ``r``-th contiguous slice of ``B``: the
  ranks read disjoint slices that together cover the data;
* the state is the number of global samples consumed, which does not depend on the world size:
  a run resumed on a different number of ranks with the same global batch continues the same
  sample sequence.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from spider_titan.data.builtin_corpus import builtin_corpus_dir
from spider_titan.data.ingest import read_documents
from spider_titan.data.shards import DataError, bad_token_error, find_shards, read_metadata, read_shard
from spider_titan.data.tokenizer import encode_bytes
from spider_titan.errors import StateMismatch
from spider_titan.vocab import IGNORE_INDEX, PAD_ID, VOCAB_SIZE

logger = logging.getLogger("spider_titan")

Split = Literal["train", "val"]
SPLITS = ("train", "val")
# build_text_dataset: document i goes to val when i % TEXT_VAL_EVERY == 1 (doc 0 is always train).
TEXT_VAL_EVERY = 20
# build_mock_dataset sizes (tokens); a few MB, generated in well under a second.
MOCK_TOKENS = {"train": 2 * 2**20, "val": 128 * 2**10}


class TokenDataset:
    """Token arrays read as one concatenated stream of ``num_tokens`` uint16 tokens.

    ``description`` names the data in error messages. Arrays that are shard memmaps are pickled
    as their paths and reopened (DataLoader workers started with spawn never copy the data).
    """

    def __init__(self, arrays: Sequence[np.ndarray], *, description: str):
        self.arrays = [a for a in arrays if a.size]
        self.description = description
        self._starts = np.cumsum([0] + [a.size for a in self.arrays], dtype=np.int64)
        if not any(holds_labels(a) for a in self.arrays):
            raise ValueError(
                f"{description}: no tokens other than PAD ({self.num_tokens} tokens in all), "
                "so there is nothing to learn; check the data path and how it was prepared"
            )

    @property
    def num_tokens(self) -> int:
        """Total tokens over all arrays."""
        return int(self._starts[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        """A copy of tokens ``[start, start + length)`` of the stream, across array borders."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"window [{start}, {start + length}) is outside {self.description} (0..{self.num_tokens})")
        out = np.empty(length, dtype=np.uint16)
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos, filled = start - int(self._starts[i]), 0
        while filled < length:
            piece = self.arrays[i][pos : pos + length - filled]
            out[filled : filled + piece.size] = piece
            filled += piece.size
            i, pos = i + 1, 0
        return out

    def raise_bad_token(self, start: int, tokens: np.ndarray) -> None:
        """Raise DataError naming the file and byte offset of the first id >= VOCAB_SIZE in ``tokens``,
        the window of the stream that starts at ``start`` (the slow path after a failed batch check)."""
        k = int(np.argmax(tokens >= VOCAB_SIZE))
        pos = start + k
        i = int(np.searchsorted(self._starts, pos, side="right")) - 1
        array, index = self.arrays[i], pos - int(self._starts[i])
        if isinstance(array, np.memmap) and array.filename:
            raise bad_token_error(array.filename, array.offset + 2 * index, int(tokens[k]))
        raise DataError(
            f"{self.description}: token id {int(tokens[k])} at token {pos} is outside the byte "
            f"vocabulary (0..{VOCAB_SIZE - 1}); check how the data was made"
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["arrays"] = [
            Path(a.filename) if isinstance(a, np.memmap) and a.filename else np.asarray(a) for a in self.arrays
        ]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["arrays"] = [read_shard(a) if isinstance(a, Path) else a for a in state["arrays"]]
        self.__dict__.update(state)


# Start-up checks read blocks of this many tokens, evenly spaced (16 x 128 KB of a shard, whatever its
# size); only a shard with no real token in any of them is read in full for the all-PAD check.
_PROBE_BLOCK, _PROBE_COUNT = 1 << 16, 16


def _probe_starts(n: int) -> range:
    """Start offsets of the sampled blocks of an ``n``-token array."""
    return range(0, n, max(n // _PROBE_COUNT, 1))


def check_shard(path: Path, tokens: np.ndarray) -> None:
    """Start-up check of one shard from its sampled blocks: DataError naming the file for an id
    outside the vocabulary (random data, a text file renamed .bin) or a shard of nothing but PAD.
    Ids deeper in the file are caught when a batch reads them (``_Sampler.local_batch``)."""
    for start in _probe_starts(tokens.size):
        block = tokens[start : start + _PROBE_BLOCK]
        if block.size and int(block.max()) >= VOCAB_SIZE:
            k = int(np.argmax(block >= VOCAB_SIZE))
            raise bad_token_error(path, getattr(tokens, "offset", 0) + 2 * (start + k), int(block[k]))
    if not holds_labels(tokens):
        raise DataError(
            f"{path}: every token is PAD ({tokens.size} tokens), so it holds nothing to learn; "
            "remove the shard or re-make it with scripts/prepare_data.py"
        )


def holds_labels(tokens: np.ndarray) -> bool:
    """Whether ``tokens`` holds any token other than PAD (PAD targets are ignored by the loss)."""
    n = tokens.size
    if n == 0:
        return False
    for start in _probe_starts(n):
        if (tokens[start : start + _PROBE_BLOCK] != PAD_ID).any():
            return True
    for start in range(0, n, 1 << 24):  # every probe was PAD: read it all before saying no
        if (tokens[start : start + (1 << 24)] != PAD_ID).any():
            return True
    return False


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")


def build_bytes_dataset(path: str | None, *, split: Split, seed: int) -> TokenDataset:
    """The ``split`` shards of the dataset folder ``path`` (``seed`` is unused: shards are read in order).

    Split rule: if ``path`` has both ``train/`` and ``val/`` subfolders, the split is every
    ``*.bin`` under ``path/<split>``; otherwise every ``*.bin`` under ``path`` whose file name
    contains ``"val"`` is val and the rest is train. A split without shards raises
    FileNotFoundError. A ``metadata.json`` whose ``vocab_size`` exceeds the model's is refused.
    """
    _check_split(split)
    if path is None:
        raise ValueError(
            "dataset 'bytes' needs training.dataset_path: a folder of *.bin shards (make one with scripts/prepare_data.py)"
        )
    root = Path(path)
    if (root / "train").is_dir() and (root / "val").is_dir():
        files = find_shards(root / split)
    else:
        files = [f for f in find_shards(root) if ("val" in f.name) == (split == "val")]
        if not files:
            raise FileNotFoundError(
                f"no {split} shards under {root}: put them in {root}/train/ and {root}/val/, "
                f"or name val shards with 'val' in the file name (e.g. data_val_000000.bin)"
            )
    metadata = read_metadata(root) or {}
    vocab = metadata.get("vocab_size")
    if isinstance(vocab, int) and vocab > VOCAB_SIZE:
        raise ValueError(
            f"{root}/metadata.json: vocab_size {vocab} > the byte vocabulary ({VOCAB_SIZE}); these shards hold "
            "another tokenizer's ids. Re-make them from text with scripts/prepare_data.py"
        )
    arrays = []
    for f in files:
        tokens = read_shard(f)
        if tokens.size == 0:
            logger.warning("%s: empty shard (0 tokens), skipped", f)
        else:
            check_shard(f, tokens)
        arrays.append(tokens)
    return TokenDataset(arrays, description=f"{split} shards under {root}")


def build_text_dataset(path: str | None, *, split: Split, seed: int) -> TokenDataset:
    """The documents at ``path``, tokenized in memory: a file, a folder, ``.jsonl`` (``"text"`` field),
    ``.gz`` / ``.zst``, Parquet, read by :func:`spider_titan.data.ingest.read_documents` exactly as
    ``scripts/prepare_data.py`` reads them.

    Each document is ``[BOS] + bytes + [EOS]``. Document ``i`` is val when ``i % 20 == 1``, so with
    two or more documents both splits are non-empty; a single document is cut instead, its last 5%
    of tokens being val. ``seed`` is unused: the split must not change with the training seed.
    """
    _check_split(split)
    if path is None:
        raise ValueError("dataset 'text' needs training.dataset_path: a text file, a .jsonl file or a folder of them")
    try:
        docs = read_documents([path])
    except ModuleNotFoundError as e:  # pyarrow / zstandard for Parquet / .zst: a setup problem, one line
        raise ValueError(f"training.dataset_path {path}: {e}") from e
    if len(docs) == 1:
        cut = docs[0].size - docs[0].size // TEXT_VAL_EVERY
        chosen = [docs[0][cut:] if split == "val" else docs[0][:cut]]
    else:
        chosen = [d for i, d in enumerate(docs) if (i % TEXT_VAL_EVERY == 1) == (split == "val")]
    return TokenDataset(chosen, description=f"{split} split of the text at {path}")


def build_builtin_dataset(path: str | None, *, split: Split, seed: int) -> TokenDataset:
    """The built-in corpus (Python stdlib sources and help topics), built once into the cache.

    ``path``, when given, overrides the cache folder (default ``$SPIDER_TITAN_CACHE`` or
    ``~/.cache/spider_titan``); ``seed`` is unused.
    """
    return build_bytes_dataset(str(builtin_corpus_dir(path)), split=split, seed=seed)


def build_mock_dataset(path: str | None, *, split: Split, seed: int) -> TokenDataset:
    """Synthetic text a model can learn, made from ``seed`` alone (``path`` is unused).

    A lexicon of 512 distinct random lowercase words, each followed by one of 4 fixed successor words
    (a Markov chain), written as documents of 256 words: the next byte is predictable inside a
    word and partly across words, so the loss falls well below log(26). Train and val share the
    lexicon and differ in their walks. About 2M train / 128K val tokens.
    """
    _check_split(split)
    lexicon_rng = np.random.default_rng([seed, 0])
    n_words, words_per_doc = 512, 256
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    lexicon: dict[bytes, None] = {}  # distinct words, in the order drawn
    while len(lexicon) < n_words:
        lexicon[letters[lexicon_rng.integers(0, 26, size=int(lexicon_rng.integers(2, 9)))].tobytes()] = None
    words = list(lexicon)
    successors = lexicon_rng.integers(0, n_words, size=(n_words, 4)).tolist()

    walk_rng = np.random.default_rng([seed, 1 + SPLITS.index(split)])
    n_steps = MOCK_TOKENS[split] // 6  # ~6 bytes per word with its space
    word, walk = 0, []
    for choice in walk_rng.integers(0, 4, size=n_steps).tolist():
        word = successors[word][choice]
        walk.append(word)
    docs = [
        encode_bytes(b" ".join(words[w] for w in walk[i : i + words_per_doc]) + b".")
        for i in range(0, len(walk), words_per_doc)
    ]
    return TokenDataset(docs, description=f"mock {split} data (seed {seed})")


class _Sampler:
    """Maps global sample positions to token windows and builds one rank's batches (picklable)."""

    def __init__(
        self, dataset: TokenDataset, *, seq_len: int, local_batch_size: int, dp_rank: int, dp_world_size: int, seed: int
    ):
        self.dataset = dataset
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.global_batch_size = local_batch_size * dp_world_size
        self.rank_offset = dp_rank * local_batch_size
        self.seed = seed
        self.num_windows = max(0, (dataset.num_tokens - 1) // seq_len)
        self._perm: tuple[int, np.ndarray] | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        """The window order of ``epoch`` (cached for the current epoch)."""
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng(self.seed + epoch).permutation(self.num_windows))
        return self._perm[1]

    def local_batch(self, first_sample: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the global batch that starts at global sample ``first_sample``."""
        start = first_sample + self.rank_offset
        windows = np.empty((self.local_batch_size, self.seq_len + 1), dtype=np.uint16)
        starts = np.empty(self.local_batch_size, dtype=np.int64)  # stream offset of each row
        for row, s in enumerate(range(start, start + self.local_batch_size)):
            epoch, pos = divmod(s, self.num_windows)
            w = int(self.permutation(epoch)[pos])
            windows[row] = self.dataset.window(w * self.seq_len, self.seq_len + 1)
            starts[row] = w * self.seq_len
        # A bad id deep in a shard (past the start-up probe) would crash the embedding (a device-side
        # assert on GPU). One vectorised max over the host batch, no device sync: measured 1.7 us for
        # 8 x 513 tokens and 2.5 us for 16 x 4097, against 72 us and 317 us to build those batches.
        if int(windows.max()) >= VOCAB_SIZE:
            row = int(np.argmax((windows >= VOCAB_SIZE).any(axis=1)))
            self.dataset.raise_bad_token(int(starts[row]), windows[row])
        tokens = torch.from_numpy(windows.astype(np.int64))
        input_ids = tokens[:, :-1].contiguous()  # (B, seq_len)
        # clone, not contiguous(): with B = 1 the slice already counts as contiguous, so the PAD
        # masking below would write into the inputs through the shared storage
        labels = tokens[:, 1:].clone()  # (B, seq_len)
        labels[labels == PAD_ID] = IGNORE_INDEX
        return input_ids, labels


class _WorkerBatches(IterableDataset):
    """Worker ``w`` of ``n`` builds global batches ``w, w + n, w + 2n, ...`` counted from ``first_sample``.

    torch's DataLoader takes one item from each worker in turn, so the batches arrive in the
    same order as with no workers.
    """

    def __init__(self, sampler: _Sampler, first_sample: int):
        self.sampler = sampler
        self.first_sample = first_sample

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        g = self.sampler.global_batch_size
        for k in itertools.count(worker, num_workers):
            try:
                yield self.sampler.local_batch(self.first_sample + k * g)
            except DataError as e:  # sent as a value: a raise would come back wrapped in a worker traceback
                yield e
                return


class ByteDataLoader(Stateful):
    """An endless, deterministic, rank-aware stream of ``(input_ids, labels)`` LongTensors (B, seq_len).

    See the module docstring for the sampling order. Iterating starts at the current state and
    advances it by one global batch per batch yielded; use one iterator at a time. With
    ``num_workers > 0`` batches are built in torch DataLoader workers and arrive in the same order.
    With ``pin_memory`` (the builder sets it for a CUDA run) batches and sample ids come in pinned
    host memory, so the train loop's ``non_blocking`` copies to the GPU do not wait on the host.
    """

    def __init__(
        self,
        dataset: TokenDataset,
        *,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_world_size: int,
        seed: int,
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        problems = []
        if seq_len < 1:
            problems.append(f"seq_len={seq_len} must be >= 1")
        if local_batch_size < 1:
            problems.append(f"local_batch_size={local_batch_size} must be >= 1")
        if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
            problems.append(f"dp_rank={dp_rank} must be in [0, dp_world_size={dp_world_size})")
        if num_workers < 0:
            problems.append(f"num_workers={num_workers} must be >= 0")
        if problems:
            raise ValueError("ByteDataLoader: " + "; ".join(problems))
        self.dataset = dataset
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.seed = seed
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self._sampler = _Sampler(
            dataset,
            seq_len=seq_len,
            local_batch_size=local_batch_size,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            seed=seed,
        )
        if self.num_windows < self.global_batch_size:
            raise ValueError(
                f"{dataset.description}: {dataset.num_tokens} tokens give {self.num_windows} samples of "
                f"seq_len+1={seq_len + 1} tokens (stride {seq_len}), fewer than one global batch of "
                f"local_batch_size({local_batch_size}) * dp_world_size({dp_world_size}) = {self.global_batch_size}; "
                "use more data or lower training.seq_len / training.local_batch_size"
            )
        self.samples_consumed = 0

    @property
    def num_windows(self) -> int:
        """Samples per epoch: ``(num_tokens - 1) // seq_len``."""
        return self._sampler.num_windows

    @property
    def global_batch_size(self) -> int:
        """``local_batch_size * dp_world_size``: samples consumed per step over all ranks."""
        return self._sampler.global_batch_size

    @property
    def epoch(self) -> int:
        """The epoch of the next sample to be read."""
        return self.samples_consumed // self.num_windows

    def next_sample_ids(self) -> torch.Tensor:
        """(local_batch_size,) int64: the global sample indices of the rows of the next batch this
        rank's iterator yields (call it before ``next``). Independent of world size and workers."""
        first = self.samples_consumed + self.dp_rank * self.local_batch_size
        ids = torch.arange(first, first + self.local_batch_size, dtype=torch.int64)
        return ids.pin_memory() if self.pin_memory else ids

    def upcoming(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next ``n`` batches this rank's iterator would yield, read without consuming them (the
        position stays where it is): data the model has not been trained on yet, for calibration."""
        first, g = self.samples_consumed, self.global_batch_size
        return [self._sampler.local_batch(first + k * g) for k in range(n)]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        first, g = self.samples_consumed, self.global_batch_size
        if self.num_workers == 0:
            batches = (self._sampler.local_batch(first + k * g) for k in itertools.count())
        else:
            batches = iter(
                DataLoader(_WorkerBatches(self._sampler, first), batch_size=None, num_workers=self.num_workers)
            )
        try:
            for batch in batches:
                if isinstance(batch, DataError):  # from a worker (_WorkerBatches)
                    raise batch
                self.samples_consumed += g
                yield tuple(t.pin_memory() for t in batch) if self.pin_memory else batch
        finally:
            # Closing this generator drops the last reference to the workers' iterator, which ends them
            # now. Left to a gc.collect of the whole run, the iterator's queues can be finalised before
            # it, its stop message is never sent, and each worker waits out a 5 s timeout.
            del batches

    def state_dict(self) -> dict[str, Any]:
        """The position in global samples (the same on every rank and for every world size)."""
        return {
            "samples_consumed": self.samples_consumed,
            "epoch": self.epoch,
            "num_windows": self.num_windows,
            "seq_len": self.seq_len,
            "seed": self.seed,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the saved position; ValueError when the state was saved with another seq_len or seed."""
        missing = [k for k in ("samples_consumed", "seq_len", "seed") if k not in state_dict]
        if missing:
            raise ValueError(
                f"dataloader state is missing {missing}; it was not written by ByteDataLoader.state_dict()"
            )
        problems = [
            f"{key}={int(state_dict[key])} in the checkpoint but {key}={mine} in this run"
            for key, mine in (("seq_len", self.seq_len), ("seed", self.seed))
            if int(state_dict[key]) != mine
        ]
        if problems:
            raise StateMismatch(
                "dataloader state does not match this run: "
                + "; ".join(problems)
                + "; resume with the saved values or load the model only (checkpoint.initial_load_model_only)"
            )
        saved_windows = state_dict.get("num_windows")
        if saved_windows is not None and int(saved_windows) != self.num_windows:
            logger.warning(
                "dataloader: the checkpoint was read from %d samples per epoch, this dataset has %d; "
                "continuing at global sample %d of a different order",
                int(saved_windows),
                self.num_windows,
                int(state_dict["samples_consumed"]),
            )
        self.samples_consumed = int(state_dict["samples_consumed"])
