"""Token shards on disk: reading, writing and making them from text.

Two layouts of a ``.bin`` shard are read, told apart by the first int32 word:

* raw (the seed format): little-endian uint16 tokens, no header;
* header (llm.c style): 256 little-endian int32 words, ``[0] = 20240520`` (magic),
  ``[1] = 1`` (version), ``[2] = token count``, the rest zero, then the uint16 tokens.

A raw shard cannot be mistaken for a header shard: its first word would have to hold the
token 44248 (0xACD8), far outside the 272-id byte vocabulary.

A dataset folder holds ``*.bin`` shards (found recursively, in sorted path order), usually in
``train/`` and ``val/`` subfolders, and an optional ``metadata.json``.
:func:`spider_titan.data.ingest.prepare_shards` (behind ``scripts/prepare_data.py``) writes that
layout from files, folders, jsonl, Parquet and stdin.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from spider_titan.vocab import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

HEADER_MAGIC = 20240520
HEADER_VERSION = 1
HEADER_WORDS = 256
HEADER_BYTES = HEADER_WORDS * 4
METADATA_NAME = "metadata.json"
_LAYOUT_HINT = (
    "expected little-endian uint16 *.bin shards (raw or with the 20240520 header), "
    "optionally in train/ and val/ subfolders; make them with scripts/prepare_data.py"
)


class DataError(ValueError):
    """A problem in the data on disk, found while reading it; the message names the file and the fix."""


def bad_token_error(path: str | Path, byte_offset: int, value: int) -> DataError:
    """The one-line error for a token id outside the vocabulary at ``byte_offset`` of the file ``path``."""
    return DataError(
        f"{path}: token id {value} at byte offset {byte_offset} is outside the byte vocabulary (0..{VOCAB_SIZE - 1}), "
        "so the file is not a token shard of this tokenizer (random data, or text renamed .bin?); "
        "re-make the shards from the text with scripts/prepare_data.py"
    )


def write_shard(path: str | Path, tokens: Sequence[int] | np.ndarray, *, header: bool = False) -> Path:
    """Write ``tokens`` as a uint16 shard at ``path`` (raw, or with the 256-word header); returns the path."""
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"write_shard({path}): tokens must be 1-D, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.uint16).max):
        raise ValueError(
            f"write_shard({path}): token ids must fit uint16 (0..65535), got range {arr.min()}..{arr.max()}"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        if header:
            f.write(_header_bytes(arr.size))
        f.write(arr.astype("<u2", copy=False).tobytes())
    return path


def read_shard(path: str | Path) -> np.ndarray:
    """The tokens of one shard as a read-only uint16 memmap; the format is detected by the magic.

    Raises DataError naming the file for an odd byte size, a header whose token count does not
    match the file, an unknown header version, or a file that cannot be read (permissions).
    """
    path = Path(path)
    try:
        return _read_shard(path)
    except (FileNotFoundError, DataError):
        raise
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({os_error_reason(e)}); check its permissions") from e


def _read_shard(path: Path) -> np.ndarray:
    size = path.stat().st_size
    if size % 2:
        raise DataError(
            f"{path}: {size} bytes is an odd size; a shard holds 2-byte uint16 tokens, "
            "so the file is truncated or not a token shard (rewrite it with scripts/prepare_data.py)"
        )
    offset, count = 0, size // 2
    if size >= HEADER_BYTES:
        words = np.fromfile(path, dtype="<i4", count=3)
        if int(words[0]) == HEADER_MAGIC:
            version, count = int(words[1]), int(words[2])
            if version != HEADER_VERSION:
                raise DataError(
                    f"{path}: header version {version} is not supported (only {HEADER_VERSION}); "
                    "rewrite the shard with scripts/prepare_data.py"
                )
            offset, available = HEADER_BYTES, (size - HEADER_BYTES) // 2
            if count != available:
                raise DataError(
                    f"{path}: the header says {count} tokens but the file holds {available}; "
                    "the shard is truncated or corrupted (rewrite it with scripts/prepare_data.py)"
                )
    if count == 0:  # np.memmap cannot map zero bytes
        empty = np.empty(0, dtype=np.uint16)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype="<u2", mode="r", offset=offset, shape=(count,))


def find_shards(folder: str | Path) -> list[Path]:
    """Every ``*.bin`` under ``folder`` (recursive, sorted); a single ``.bin`` file is its own list.

    Raises FileNotFoundError (one line naming the folder and the expected layout) when there are none,
    and when ``folder`` is some other file (a text corpus, say), saying how to make shards from it.
    """
    folder = Path(folder)
    if folder.is_file() and folder.suffix == ".bin":
        return [folder]
    if folder.is_file():
        raise FileNotFoundError(
            f"dataset path {folder} is a file, not a folder of *.bin token shards; make shards from it with "
            f"`python scripts/prepare_data.py --input {folder} --out data/NAME` and pass data/NAME "
            "(or read it as text with training.dataset = 'text')"
        )
    if not folder.is_dir():
        raise FileNotFoundError(
            f"dataset folder {folder} does not exist; prepare *.bin token shards of your corpus in it with "
            f"`python scripts/prepare_data.py --input <your corpus> --out {folder}` "
            "(or train on the built-in corpus: --training.dataset builtin)"
        )
    shards = sorted(p for p in folder.rglob("*.bin") if p.is_file())
    if not shards:
        raise FileNotFoundError(f"no *.bin token shards under {folder}; {_LAYOUT_HINT}")
    return shards


def write_metadata(folder: str | Path, metadata: dict[str, Any]) -> Path:
    """Write ``metadata`` as ``folder/metadata.json``; returns its path."""
    path = Path(folder) / METADATA_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")  # renamed when whole: never a half-written file
    try:
        partial.write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def read_metadata(folder: str | Path) -> dict[str, Any] | None:
    """The contents of ``folder/metadata.json``, or None when the folder has none."""
    path = Path(folder) / METADATA_NAME
    if not path.is_file():
        return None
    try:
        metadata = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); fix or delete the file") from e
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(metadata).__name__}; fix or delete the file")
    return metadata


class ShardWriter:
    """Streams token arrays to disk as numbered shards of ``shard_tokens`` tokens.

    Shards are named ``<folder>/<prefix>_000000.bin``, ... Tokens are written as they are added
    (a header shard gets its token count filled in when it is finished), so memory stays at one added
    array whatever ``shard_tokens`` is: buffering whole 100M-token shards peaked at 1.0 GB RSS on the
    154 MB stdlib, streaming at 0.27 GB (0.22 GB of it the torch import). A shard is written under a
    temporary name (``<name>.partial``, which no reader picks up) and renamed when whole, so a failure
    (disk full) never leaves a short ``.bin``; :meth:`abort` removes what was written. Call
    :meth:`close` to finish the last, partial shard. ``paths`` lists the finished shards.
    """

    def __init__(self, folder: str | Path, prefix: str, *, shard_tokens: int, header: bool):
        self.folder = Path(folder)
        self.prefix = prefix
        self.shard_tokens = shard_tokens
        self.header = header
        self.num_tokens = 0
        self.paths: list[Path] = []
        self._file = None  # the shard being written, or None between shards
        self._partial: Path | None = None  # its temporary path
        self._in_shard = 0

    def add(self, tokens: np.ndarray) -> None:
        """Append ``tokens`` (uint16), finishing every shard that fills up."""
        tokens = np.ascontiguousarray(tokens, dtype="<u2")
        self.num_tokens += tokens.size
        while tokens.size:
            if self._file is None:
                self._open()
            take = min(tokens.size, self.shard_tokens - self._in_shard)
            self._file.write(tokens[:take].data)
            self._in_shard += take
            tokens = tokens[take:]
            if self._in_shard == self.shard_tokens:
                self._finish()

    def close(self) -> None:
        """Finish the last, shorter shard."""
        if self._file is not None:
            self._finish()

    def abort(self) -> None:
        """Remove every shard written, finished or not (after a failure); never raises for the file
        being written, whose close may fail again on a full disk."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
        for path in [*self.paths, self._partial]:
            if path is not None:
                path.unlink(missing_ok=True)
        self.paths, self._partial = [], None

    def _open(self) -> None:
        path = self.folder / f"{self.prefix}_{len(self.paths):06d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._partial = path.with_name(path.name + ".partial")
        self._file = open(self._partial, "wb", buffering=2**20)
        self._in_shard = 0
        if self.header:
            self._file.write(_header_bytes(0))  # the count is filled in by _finish

    def _finish(self) -> None:
        if self.header:
            self._file.seek(0)
            self._file.write(_header_bytes(self._in_shard))
        self._file.close()
        self._file = None
        final = self._partial.with_name(self._partial.name.removesuffix(".partial"))
        os.replace(self._partial, final)
        self.paths.append(final)
        self._partial = None


# errno -> what a person calls it, for messages about a failed write.
_OS_REASONS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOTDIR: "a file where a folder should be",
}


def os_error_reason(e: OSError) -> str:
    """``disk full``, ``read-only file system``, ``permission denied``, ... or the system's own words."""
    return _OS_REASONS.get(e.errno, e.strerror or str(e))


def _header_bytes(num_tokens: int) -> bytes:
    """The 256-word header of a shard of ``num_tokens`` tokens (module docstring)."""
    words = np.zeros(HEADER_WORDS, dtype="<i4")
    words[:3] = (HEADER_MAGIC, HEADER_VERSION, num_tokens)
    return words.tobytes()


def corpus_metadata(writers: dict[str, ShardWriter], documents: dict[str, int], fmt: str, **extra) -> dict:
    """The metadata.json of a corpus written by one ShardWriter per split (plus ``extra`` fields)."""
    return {
        "tokenizer": "bytes",
        "vocab_size": VOCAB_SIZE,
        "pad_id": PAD_ID,
        "bos_id": BOS_ID,
        "eos_id": EOS_ID,
        "dtype": "uint16",
        "format": fmt,
        "documents": sum(documents.values()),
        "tokens": sum(w.num_tokens for w in writers.values()),
        "splits": {
            split: {"documents": documents[split], "tokens": w.num_tokens, "shards": len(w.paths)}
            for split, w in writers.items()
        },
        **extra,
    }
