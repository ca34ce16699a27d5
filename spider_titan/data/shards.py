"""Token shards on disk: reading, writing and making them from text.

Two layouts of a ``.bin`` shard are read, told apart by the first int32 word:

* raw (the seed format): little-endian uint16 tokens, no header;
* header (llm.c style): 256 little-endian int32 words, ``[0] = 20240520`` (magic),
  ``[1] = 1`` (version), ``[2] = token count``, the rest zero, then the uint16 tokens.

A raw shard cannot be mistaken for a header shard: its first word would have to hold the
token 44248 (0xACD8), far outside the 272-id byte vocabulary.

A dataset folder holds ``*.bin`` shards (found recursively, in sorted path order), usually in
``train/`` and ``val/`` subfolders, and an optional ``metadata.json``. :func:`prepare_shards`
(behind ``scripts/prepare_data.py``) writes that layout from text files, folders and ``.jsonl``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from spider_titan.models.common import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

logger = logging.getLogger("spider_titan")

HEADER_MAGIC = 20240520
HEADER_VERSION = 1
HEADER_WORDS = 256
HEADER_BYTES = HEADER_WORDS * 4
METADATA_NAME = "metadata.json"
# Suffixes picked up when an input is a folder; a file named explicitly is read whatever its suffix.
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")
# Text files are streamed in chunks of this size, so a multi-GB file never sits in memory whole.
_READ_CHUNK_BYTES = 16 * 1024 * 1024
_LAYOUT_HINT = (
    "expected little-endian uint16 *.bin shards (raw or with the 20240520 header), "
    "optionally in train/ and val/ subfolders; make them with scripts/prepare_data.py"
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
            words = np.zeros(HEADER_WORDS, dtype="<i4")
            words[:3] = (HEADER_MAGIC, HEADER_VERSION, arr.size)
            f.write(words.tobytes())
        f.write(arr.astype("<u2", copy=False).tobytes())
    return path


def read_shard(path: str | Path) -> np.ndarray:
    """The tokens of one shard as a read-only uint16 memmap; the format is detected by the magic.

    Raises ValueError naming the file for an odd byte size, a header whose token count does not
    match the file, or an unknown header version.
    """
    path = Path(path)
    size = path.stat().st_size
    if size % 2:
        raise ValueError(
            f"{path}: {size} bytes is an odd size; a shard holds 2-byte uint16 tokens, "
            "so the file is truncated or not a token shard (rewrite it with scripts/prepare_data.py)"
        )
    offset, count = 0, size // 2
    if size >= HEADER_BYTES:
        words = np.fromfile(path, dtype="<i4", count=3)
        if int(words[0]) == HEADER_MAGIC:
            version, count = int(words[1]), int(words[2])
            if version != HEADER_VERSION:
                raise ValueError(
                    f"{path}: header version {version} is not supported (only {HEADER_VERSION}); "
                    "rewrite the shard with scripts/prepare_data.py"
                )
            offset, available = HEADER_BYTES, (size - HEADER_BYTES) // 2
            if count != available:
                raise ValueError(
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

    Raises FileNotFoundError (one line naming the folder and the expected layout) when there are none.
    """
    folder = Path(folder)
    if folder.is_file() and folder.suffix == ".bin":
        return [folder]
    if not folder.is_dir():
        raise FileNotFoundError(f"dataset folder {folder} does not exist; {_LAYOUT_HINT}")
    shards = sorted(p for p in folder.rglob("*.bin") if p.is_file())
    if not shards:
        raise FileNotFoundError(f"no *.bin token shards under {folder}; {_LAYOUT_HINT}")
    return shards


def write_metadata(folder: str | Path, metadata: dict[str, Any]) -> Path:
    """Write ``metadata`` as ``folder/metadata.json``; returns its path."""
    path = Path(folder) / METADATA_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
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


def find_text_files(inputs: Sequence[str | Path]) -> list[Path]:
    """The text files named by ``inputs``: files as given, folders searched recursively for TEXT_SUFFIXES.

    Folder contents come in sorted path order, so the document order (and the split) is deterministic.
    Raises FileNotFoundError for a path that does not exist or when no file is found at all.
    """
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files.extend(sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES))
        else:
            raise FileNotFoundError(f"input {p} does not exist; pass text files, .jsonl files or folders of them")
    if not files:
        raise FileNotFoundError(
            f"no input files found in {[str(i) for i in inputs]}; folders are searched for {', '.join(TEXT_SUFFIXES)}"
        )
    return files


def iter_documents(files: Sequence[Path]) -> Iterator[Iterator[bytes]]:
    """One item per document, each an iterator over the document's UTF-8 byte chunks.

    A ``.jsonl`` file holds one document per non-empty line (its ``"text"`` field); any other file
    is one document, its bytes as stored. Exhaust each document before asking for the next.
    """
    for path in files:
        if path.suffix.lower() == ".jsonl":
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        yield iter((_jsonl_text(line, path, lineno).encode("utf-8"),))
        else:
            yield _read_chunks(path)


def _jsonl_text(line: str, path: Path, lineno: int) -> str:
    """The ``"text"`` field of one JSON line, with an error naming the file and line otherwise."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e}); each line must be an object with a 'text' field") from e
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise ValueError(f"{path}:{lineno}: no string 'text' field; each line must look like {{\"text\": \"...\"}}")
    return text


def _read_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK_BYTES):
            yield chunk


class ShardWriter:
    """Appends token arrays and writes them out as numbered shards of ``shard_tokens`` tokens.

    Shards are named ``<folder>/<prefix>_000000.bin``, ... ; call :meth:`close` to write the last,
    partial shard.
    """

    def __init__(self, folder: str | Path, prefix: str, *, shard_tokens: int, header: bool):
        self.folder = Path(folder)
        self.prefix = prefix
        self.shard_tokens = shard_tokens
        self.header = header
        self.num_tokens = 0
        self.paths: list[Path] = []
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0

    def add(self, tokens: np.ndarray) -> None:
        """Queue ``tokens`` (uint16) and write every shard that is now full."""
        self._pending.append(tokens)
        self._pending_tokens += tokens.size
        self.num_tokens += tokens.size
        if self._pending_tokens >= self.shard_tokens:
            buf = np.concatenate(self._pending)
            n_full = buf.size // self.shard_tokens
            for i in range(n_full):
                self._write(buf[i * self.shard_tokens : (i + 1) * self.shard_tokens])
            rest = buf[n_full * self.shard_tokens :]
            self._pending, self._pending_tokens = [rest], rest.size

    def close(self) -> None:
        """Write the remaining tokens as a last, shorter shard."""
        if self._pending_tokens:
            self._write(np.concatenate(self._pending))
        self._pending, self._pending_tokens = [], 0

    def _write(self, tokens: np.ndarray) -> None:
        path = self.folder / f"{self.prefix}_{len(self.paths):06d}.bin"
        self.paths.append(write_shard(path, tokens, header=self.header))


def corpus_metadata(writers: dict[str, "ShardWriter"], documents: dict[str, int], fmt: str, **extra) -> dict:
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


def prepare_shards(
    inputs: Sequence[str | Path],
    out: str | Path,
    *,
    val_fraction: float = 0.01,
    shard_tokens: int = 100_000_000,
    fmt: Literal["header", "raw"] = "header",
    seed: int = 0,
    progress_mb: int = 100,
) -> dict[str, Any]:
    """Tokenize text files, folders and ``.jsonl`` into ``out/train/*.bin``, ``out/val/*.bin`` and
    ``out/metadata.json``; returns the metadata written.

    Each document becomes ``[BOS] + bytes + [EOS]``. The split is by document: the first goes to
    train, the second to val (so both splits exist whenever there are two documents and
    ``val_fraction > 0``), every later one to val with probability ``val_fraction`` drawn from
    ``numpy.random.default_rng(seed)``. ``val_fraction = 0`` writes no val split. One line is
    logged every ``progress_mb`` MB of input read.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1); e.g. 0.01 keeps ~1% of documents for val")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens={shard_tokens} must be >= 1 (e.g. 100000000)")
    if progress_mb < 1:
        raise ValueError(f"progress_mb={progress_mb} must be >= 1")
    if fmt not in ("header", "raw"):
        raise ValueError(f"format {fmt!r} is not one of 'header', 'raw'")
    out = Path(out)
    files = find_text_files(inputs)
    for split in ("train", "val"):
        if (out / split).is_dir() and any((out / split).rglob("*.bin")):
            raise ValueError(f"{out / split} already holds shards; write to an empty --out folder or delete it first")

    writers = {
        split: ShardWriter(out / split, split, shard_tokens=shard_tokens, header=fmt == "header")
        for split in ("train", "val")
    }
    documents = {"train": 0, "val": 0}
    rng = np.random.default_rng(seed)
    bos, eos = np.array([BOS_ID], dtype=np.uint16), np.array([EOS_ID], dtype=np.uint16)
    report_bytes = progress_mb * 2**20
    bytes_read, next_report = 0, report_bytes
    for index, chunks in enumerate(iter_documents(files)):
        draw = rng.random()  # drawn for every document so the split of one never shifts the others
        split = "val" if val_fraction > 0 and (index == 1 or (index > 1 and draw < val_fraction)) else "train"
        writer = writers[split]
        writer.add(bos)
        for chunk in chunks:
            writer.add(np.frombuffer(chunk, dtype=np.uint8).astype(np.uint16))
            bytes_read += len(chunk)
            if bytes_read >= next_report:
                logger.info(
                    "prepare_data: %d MB read, %d documents, %d tokens so far",
                    bytes_read // 2**20, index + 1, writers["train"].num_tokens + writers["val"].num_tokens,
                )
                next_report = (bytes_read // report_bytes + 1) * report_bytes
        writer.add(eos)
        documents[split] += 1
    for writer in writers.values():
        writer.close()
    if not documents["train"]:
        raise ValueError(f"the inputs {[str(i) for i in inputs]} hold no documents (empty .jsonl files?)")
    if val_fraction > 0 and not documents["val"]:
        logger.warning("prepare_data: only 1 document, so the val split is empty; pass more files or a .jsonl")

    metadata = corpus_metadata(
        writers, documents, fmt,
        val_fraction=val_fraction, seed=seed, shard_tokens=shard_tokens,
        inputs=[str(i) for i in inputs], files=len(files),
    )
    write_metadata(out, metadata)
    logger.info(
        "prepare_data: wrote %d documents, %d tokens (train %d, val %d) to %s",
        metadata["documents"], metadata["tokens"], writers["train"].num_tokens, writers["val"].num_tokens, out,
    )
    return metadata
