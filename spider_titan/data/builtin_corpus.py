"""The built-in default corpus: this Python's own standard library, so a first run works offline.

Documents, in a fixed order: every topic of the interactive help (``pydoc_data.topics``, the
prose of the language reference), then every ``.py`` file under the stdlib folder in sorted path
order, skipping ``site-packages`` and test folders. Each document is ``[BOS] + bytes + [EOS]``;
documents stop being added once ~24M tokens are collected (CPython 3.11's stdlib is about half
that). Every 50th document (index % 50 == 0) goes to val, the rest to train, written as
header-format shards under ``train/`` and ``val/`` with a ``metadata.json``. While building, a
progress line (documents, MB, MB/s, ETA) is logged every second and a summary with the rate at the end.

The corpus is built once into ``<cache>/builtin_v1`` (``$SPIDER_TITAN_CACHE`` or
``~/.cache/spider_titan``). It is written into a temporary folder beside it and renamed into
place, so concurrent builders (torchrun ranks) never read a half-written corpus; the first
rename wins and the others discard their copy.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

from spider_titan.data.ingest import IngestProgress
from spider_titan.data.shards import METADATA_NAME, ShardWriter, corpus_metadata, write_metadata
from spider_titan.data.tokenizer import encode_bytes

logger = logging.getLogger("spider_titan")

CORPUS_NAME = "builtin_v1"
MAX_TOKENS = 24 * 2**20
VAL_EVERY = 50
SHARD_TOKENS = 8 * 2**20
PROGRESS_EVERY_S = 1.0  # the build takes 0.3-1.5 s here (CPython 3.11, warm disk), longer on a cold one
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def default_cache_dir() -> Path:
    """``$SPIDER_TITAN_CACHE``, else ``~/.cache/spider_titan``."""
    env = os.environ.get("SPIDER_TITAN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "spider_titan"


def builtin_corpus_dir(cache_dir: str | None = None) -> Path:
    """The folder of the built-in corpus (``<cache_dir>/builtin_v1``), building it on first use.

    ``cache_dir`` overrides the default cache folder (see :func:`default_cache_dir`).
    """
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    final = root / CORPUS_NAME
    if (final / METADATA_NAME).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    logger.info("building the built-in corpus (once) from the Python standard library at %s into %s", stdlib, final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{CORPUS_NAME}.tmp-", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the renamed corpus should read like any cache folder
    try:
        metadata = _build(tmp, stdlib)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process renamed its copy first (the target exists and is not empty): use that one.
            if not (final / METADATA_NAME).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info(
        "built-in corpus: %d documents, %d tokens (train %d, val %d) in %s",
        metadata["documents"],
        metadata["tokens"],
        metadata["splits"]["train"]["tokens"],
        metadata["splits"]["val"]["tokens"],
        final,
    )
    return final


def _documents(sources: list[Path]) -> Iterator[bytes]:
    """The corpus documents in their fixed order: help topics, then the stdlib ``sources``."""
    import pydoc_data.topics

    for key in sorted(pydoc_data.topics.topics):
        yield pydoc_data.topics.topics[key].encode("utf-8")
    topics_file = Path(pydoc_data.topics.__file__).resolve()
    for path in sources:
        if path.resolve() != topics_file:  # already included above, as text
            yield path.read_bytes()


def _stdlib_sources(stdlib: Path) -> list[Path]:
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(stdlib).parts)


def _build(folder: Path, stdlib: Path) -> dict:
    writers = {
        split: ShardWriter(folder / split, split, shard_tokens=SHARD_TOKENS, header=True) for split in ("train", "val")
    }
    documents = {"train": 0, "val": 0}
    total = 0
    sources = _stdlib_sources(stdlib)
    # The source files' size (the help topics, ~1 MB, are left out) capped at MAX_TOKENS: enough for an ETA.
    expected = min(MAX_TOKENS, sum(p.stat().st_size for p in sources))
    progress = IngestProgress("built-in corpus", total_bytes=expected, every_s=PROGRESS_EVERY_S)
    for index, data in enumerate(_documents(sources)):
        tokens = encode_bytes(data)
        if total + tokens.size > MAX_TOKENS:
            break
        split = "val" if index % VAL_EVERY == 0 else "train"
        writers[split].add(tokens)
        documents[split] += 1
        total += tokens.size
        progress.update(len(data), index + 1, total)
    for writer in writers.values():
        writer.close()
    logger.info("%s", progress.summary())
    metadata = corpus_metadata(
        writers,
        documents,
        "header",
        name=CORPUS_NAME,
        source=f"Python {sys.version.split()[0]} standard library ({stdlib}) and pydoc_data help topics",
        val_every=VAL_EVERY,
    )
    write_metadata(folder, metadata)
    return metadata
