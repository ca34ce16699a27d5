"""Any corpus in, token shards out: the readers, the worker pool and :func:`prepare_shards`.

Every document becomes ``[BOS] + UTF-8 bytes + [EOS]``. What a document is depends on the input:

* a plain file (any suffix not listed below): one document, its bytes as stored;
* ``*.gz`` / ``*.xz`` / ``*.zst`` (other than jsonl): one document, the decompressed bytes;
* ``*.jsonl`` / ``*.jsonl.gz`` / ``*.jsonl.xz`` / ``*.jsonl.zst``: one document per non-blank line, the string field
  ``text_key`` of the JSON object on that line;
* ``*.parquet``: one document per row, the string column ``text_key`` (FineWeb-Edu's layout), read
  one row group at a time;
* ``-``: standard input, one document (or, with ``stdin_jsonl``, one per line as in a jsonl file);
  empty standard input, or a terminal, is refused: nothing was piped in;
* a folder: the files under it, recursively and in sorted path order, whose name (or path relative
  to the folder, for a pattern with a ``/``) matches one of ``globs``, case-insensitively.

Streaming and workers. The inputs are cut, in corpus order, into *tasks* of bounded size: a batch of
small files, a 16 MB range of a big file, a block of ~4 MB of jsonl lines, one Parquet row group, a
16 MB chunk of a compressed stream or of stdin. ``workers`` processes run the tasks that parse (jsonl
blocks, Parquet row groups; the rest only frame bytes and run in the main process, see
:func:`encode_in_order`), and the main process writes the results strictly in task order with at
most ``2 * workers + 2`` tasks in flight, so memory does not grow with the corpus and the shards
are byte-identical for any number of workers. Limits: one jsonl line and one Parquet row group are
held in memory whole.

The train/val split is by document and drawn in the main process, in corpus order: document 0 goes to
train, document 1 to val (so both splits exist whenever there are two documents and
``val_fraction > 0``), every later one to val with probability ``val_fraction`` drawn from
``numpy.random.default_rng(seed)``.

Optional packages: Parquet needs ``pyarrow`` and ``.zst`` needs ``zstandard`` (``pip install -e '.[data]'``);
``.gz`` and ``.xz`` need none (the standard library's ``gzip`` and ``lzma``).
"""

from __future__ import annotations

import errno
import fnmatch
import gzip
import importlib
import io
import json
import logging
import lzma
import multiprocessing
import os
import signal
import sys
import time
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, ClassVar, Literal

import numpy as np

from spider_titan.data.shards import ShardWriter, corpus_metadata, os_error_reason, write_metadata
from spider_titan.vocab import BOS_ID, EOS_ID

logger = logging.getLogger("spider_titan")

STDIN = "-"
_PIPE_HINT = "pipe the corpus in (cat corpus.txt | python scripts/prepare_data.py --input - --out DIR) or name files"
# Folder files picked up by default (by prepare_data and the ``text`` dataset): text and structured corpora.
DEFAULT_GLOBS = ("*.txt", "*.md", "*.rst", "*.py", "*.jsonl", "*.jsonl.gz", "*.jsonl.xz", "*.jsonl.zst", "*.parquet")
# Bytes per range of a big file / chunk of a stream; also the size above which a file is "big".
_CHUNK_BYTES = 16 * 2**20
# Small files and jsonl lines are grouped into tasks of about this much input, so that the per-task
# overhead (a pool round trip, a framing call) is paid per few MB, not per tiny file or line.
_BATCH_BYTES = 4 * 2**20
_BATCH_FILES = 256
_INSTALL_HINT = "pip install -e '.[data]'"

Kind = Literal["plain", "compressed", "jsonl", "parquet"]


@dataclass(frozen=True)
class Source:
    """One input stream: a file (``path``) or standard input (``path is None``)."""

    path: Path | None
    kind: Kind
    compression: Literal["", "gz", "xz", "zst"]
    size: int | None  # bytes on disk; None for stdin

    @property
    def name(self) -> str:
        return "<stdin>" if self.path is None else str(self.path)


def source_kind(name: str) -> tuple[Kind, Literal["", "gz", "xz", "zst"]]:
    """How the file ``name`` is read, from its suffixes: ``(kind, compression)``."""
    name = name.lower()
    compression: Literal["", "gz", "xz", "zst"] = ""
    for ext in ("gz", "xz", "zst"):
        if name.endswith("." + ext):
            compression, name = ext, name[: -len(ext) - 1]  # type: ignore[assignment]
    if name.endswith(".parquet") and not compression:
        return "parquet", ""
    if name.endswith(".jsonl"):
        return "jsonl", compression
    return ("compressed" if compression else "plain"), compression


def find_sources(
    inputs: Sequence[str | Path],
    *,
    globs: Sequence[str] = DEFAULT_GLOBS,
    text_key: str = "text",
    stdin_jsonl: bool = False,
) -> list[Source]:
    """The input streams named by ``inputs`` (files, folders, ``-``), checked before anything is read.

    Raises FileNotFoundError for a missing path or when nothing matches, ValueError for a Parquet
    file without a string ``text_key`` column or for ``-`` when standard input is a terminal (nothing
    piped in: reading would wait for typing), and ModuleNotFoundError (naming the package and the
    pip extra) when a format's optional package is missing.
    """
    sources: list[Source] = []
    for item in inputs:
        if str(item) == STDIN:
            if sys.stdin is not None and sys.stdin.isatty():
                raise ValueError(f"--input - reads standard input, which is a terminal here, not a pipe; {_PIPE_HINT}")
            sources.append(Source(None, "jsonl" if stdin_jsonl else "plain", "", None))
            continue
        p = Path(item)
        if p.is_file():
            sources.append(_file_source(p))
        elif p.is_dir():
            sources.extend(_file_source(f) for f in _find_files(p, globs))
        else:
            raise FileNotFoundError(f"input {p} does not exist; pass files, folders or - (standard input)")
    if not sources:
        raise FileNotFoundError(
            f"no input matched: {[str(i) for i in inputs]} hold no files matching {' '.join(globs)}; "
            "choose the file names with --glob (e.g. --glob '*.pm' '*.pod')"
        )
    if any(s.kind == "parquet" for s in sources):
        _require("pyarrow", ".parquet files")
    if any(s.compression == "zst" for s in sources):
        _require("zstandard", ".zst files")
    for s in sources:
        if s.kind == "parquet":
            _check_parquet_column(s.path, text_key)
    return sources


def _file_source(path: Path) -> Source:
    kind, compression = source_kind(path.name)
    return Source(path, kind, compression, path.stat().st_size)


def _find_files(folder: Path, globs: Sequence[str]) -> list[Path]:
    """The files under ``folder`` matching ``globs`` (module docstring), in sorted path order."""
    patterns = [g.lower() for g in globs]
    found = []
    # os.walk (scandir) rather than Path.rglob + is_file: 1.2 s -> 0.6 s on the 13k-file stdlib tree here.
    for dirpath, _, filenames in os.walk(folder):
        rel_dir = PurePosixPath(Path(dirpath).relative_to(folder))
        for name in filenames:
            rel = (rel_dir / name).as_posix().lower()
            if any(fnmatch.fnmatchcase(rel if "/" in g else name.lower(), g) for g in patterns):
                found.append(Path(dirpath) / name)
    return sorted(f for f in found if f.is_file())


def _require(module: str, what: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ModuleNotFoundError(
            f"reading {what} needs the optional package {module}: {_INSTALL_HINT} (or pip install {module})"
        ) from e


def _check_parquet_column(path: Path, key: str) -> None:
    pa = _require("pyarrow", ".parquet files")
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except pa.ArrowException as e:
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from e
    if key not in schema.names:
        raise ValueError(
            f"{path}: no column {key!r} (columns: {', '.join(schema.names)}); name the text column with --text_key"
        )
    t = schema.field(key).type
    if not (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or getattr(pa.types, "is_string_view", lambda _: False)(t)
    ):
        raise ValueError(f"{path}: column {key!r} has type {t}, not a string; name the text column with --text_key")


@contextmanager
def _reading(name: str, compression: str = "") -> Iterator[None]:
    """Turn a failure to read the input ``name`` (missing, unreadable, truncated or corrupt
    compressed data) into one ValueError that names it and says what to do."""
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error, lzma.LZMAError)
    if compression == "zst":
        errors += (_require("zstandard", ".zst files").ZstdError,)
    try:
        yield
    except errors as e:
        if isinstance(e, OSError) and e.errno is not None:
            reason = os_error_reason(e)
            raise ValueError(f"{name}: cannot read it ({reason}); check the path and its permissions") from e
        what = (
            "ends before the end of its compressed stream, so it is truncated"
            if isinstance(e, EOFError)
            else f"is not valid .{compression} data ({e})"
        )
        tool = {"gz": "gzip", "xz": "xz", "zst": "zstd"}.get(compression, "gzip")
        raise ValueError(
            f"{name}: {what}; test it with `{tool} -t {name}` and download or compress it again "
            f"(a file that is not compressed must not be named .{compression or 'gz'})"
        ) from e


def _jsonl_text(line: str | bytes, path: str | Path, lineno: int, key: str = "text") -> str:
    """The string field ``key`` of one JSON line, with an error naming the file and line otherwise."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{path}:{lineno}: not valid JSON ({e}); each line must be an object with a {key!r} field"
        ) from e
    text = record.get(key) if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise ValueError(f'{path}:{lineno}: no string {key!r} field; each line must look like {{"{key}": "..."}}')
    return text


# ---------------------------------------------------------------------------------------------------
# Tasks: each ``run()`` returns ``(tokens, starts)``: uint16 tokens and the offsets in them where a new
# document begins. Tokens before ``starts[0]`` (or all of them, when ``starts`` is empty) continue the
# previous task's last document. The tasks that parse (``parses``) also have ``parse()``, run on the
# worker pool: it returns whole documents as ``(bytes, lengths)``, and ``run() = frame(*parse())``, the
# framing being left to the main process so that only bytes, not uint16 tokens, come back through the pipe.
Encoded = tuple[np.ndarray, np.ndarray]
Docs = tuple[np.ndarray, np.ndarray]  # (uint8 bytes of the documents end to end, int64 lengths)


def frame(data: np.ndarray, lengths: np.ndarray) -> Encoded:
    """Documents of ``lengths`` bytes laid end to end in ``data`` (uint8) as ``[BOS] + doc + [EOS]`` each."""
    ends = np.cumsum(lengths + 2, dtype=np.int64)  # exclusive end of each framed document
    starts = ends - lengths - 2
    out = np.empty(int(ends[-1]) if lengths.size else 0, dtype=np.uint16)
    body = np.ones(out.size, dtype=bool)
    body[starts] = body[ends - 1] = False
    out[body] = data
    out[starts], out[ends - 1] = BOS_ID, EOS_ID
    return out, starts


def _piece(data: bytes, first: bool, last: bool) -> Encoded:
    """A piece of one document: BOS in front when ``first``, EOS behind when ``last``."""
    out = np.empty(len(data) + first + last, dtype=np.uint16)
    out[first : first + len(data)] = np.frombuffer(data, dtype=np.uint8)
    if first:
        out[0] = BOS_ID
    if last:
        out[-1] = EOS_ID
    return out, np.zeros(1 if first else 0, dtype=np.int64)


@dataclass(frozen=True)
class _FilesTask:
    parses: ClassVar[bool] = False
    paths: tuple[Path, ...]  # small files, each one whole document
    in_bytes: int

    def run(self) -> Encoded:
        docs = []
        for p in self.paths:
            with _reading(str(p)):
                docs.append(p.read_bytes())
        lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
        return frame(np.frombuffer(b"".join(docs), dtype=np.uint8), lengths)


@dataclass(frozen=True)
class _RangeTask:
    parses: ClassVar[bool] = False
    path: Path  # bytes [start, start + in_bytes) of a big file, one document
    start: int
    in_bytes: int
    first: bool
    last: bool

    def run(self) -> Encoded:
        with _reading(str(self.path)), open(self.path, "rb") as f:
            f.seek(self.start)
            return _piece(f.read(self.in_bytes), self.first, self.last)


@dataclass(frozen=True)
class _BytesTask:
    parses: ClassVar[bool] = False
    data: bytes  # a chunk of a decompressed stream or of stdin, one document
    first: bool
    last: bool
    in_bytes: int

    def run(self) -> Encoded:
        return _piece(self.data, self.first, self.last)


@dataclass(frozen=True)
class _JsonlTask:
    parses: ClassVar[bool] = True
    name: str
    first_lineno: int
    lines: tuple[bytes, ...]
    key: str
    in_bytes: int

    def run(self) -> Encoded:
        return frame(*self.parse())

    def parse(self) -> Docs:
        texts = [
            _jsonl_text(line, self.name, self.first_lineno + i, self.key).encode("utf-8", "replace")
            for i, line in enumerate(self.lines)
            if line.strip()
        ]
        lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        return np.frombuffer(b"".join(texts), dtype=np.uint8), lengths


@dataclass(frozen=True)
class _ParquetTask:
    parses: ClassVar[bool] = True
    path: Path
    row_group: int
    key: str
    in_bytes: int

    def run(self) -> Encoded:
        return frame(*self.parse())

    def parse(self) -> Docs:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            column = pq.ParquetFile(self.path).read_row_group(self.row_group, columns=[self.key]).column(0)
        except (OSError, pa.ArrowException) as e:
            raise ValueError(
                f"{self.path}: row group {self.row_group} cannot be read ({e}); the Parquet file is "
                "damaged or truncated: download or write it again"
            ) from e
        if column.null_count:
            raise ValueError(
                f"{self.path}: row group {self.row_group} has {column.null_count} null {self.key!r} values; "
                "drop those rows first"
            )
        # The column's own buffers (offsets + UTF-8 bytes) go straight to numpy: no Python str per row.
        wide = (
            pa.large_binary()
            if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)
            else pa.large_string()
        )
        arr = column.cast(wide).combine_chunks()
        _, offsets_buf, data_buf = arr.buffers()
        offsets = np.frombuffer(offsets_buf, dtype=np.int64)[arr.offset : arr.offset + len(arr) + 1]
        data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.empty(0, np.uint8)
        return data[offsets[0] : offsets[-1]], np.diff(offsets)


def _parse(task) -> Docs:
    return task.parse()


# Workers come from a fork server (a fresh, single-threaded process), not from a fork of the caller,
# which hands each worker its threads' held locks and its Python signal handlers. Seen with forks: the
# full test suite hung in ``Pool.terminate()`` after a parse error, joining a worker that sat on the task
# queue's lock with SIGTERM at its default action (why the SIGTERM did not end it was not established);
# earlier, a raising SIGTERM handler hung the stdin test in 2 of 20 runs.
_POOL_CONTEXT = multiprocessing.get_context("forkserver")


def _init_worker() -> None:
    """Signals in a pool worker: SIGTERM kills at once, SIGINT is left to the main process (with no
    Python code run on SIGTERM, a worker cannot be caught unwinding while it holds a queue lock)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def iter_tasks(sources: Sequence[Source], *, text_key: str = "text") -> Iterator[Any]:
    """The tasks of ``sources`` in corpus order (module docstring); streams are read here, lazily."""
    small: list[Path] = []
    small_bytes = 0
    for src in sources:
        if src.kind == "plain" and src.path is not None and src.size <= _CHUNK_BYTES:
            small.append(src.path)
            small_bytes += src.size
            if small_bytes >= _BATCH_BYTES or len(small) >= _BATCH_FILES:
                yield _FilesTask(tuple(small), small_bytes)
                small, small_bytes = [], 0
            continue
        if small:
            yield _FilesTask(tuple(small), small_bytes)
            small, small_bytes = [], 0
        if src.kind == "plain" and src.path is not None:
            for start in range(0, src.size, _CHUNK_BYTES):
                length = min(_CHUNK_BYTES, src.size - start)
                yield _RangeTask(src.path, start, length, first=start == 0, last=start + length == src.size)
        elif src.kind == "parquet":
            yield from _parquet_tasks(src, text_key)
        else:
            with _reading(src.name, src.compression), ExitStack() as stack:
                stream, raw = _open_stream(src, stack)
                if src.kind == "jsonl":
                    tasks = _jsonl_tasks(src.name, stream, raw, text_key)
                else:
                    tasks = _chunk_tasks(stream, raw)
                yield from (_refuse_empty_stdin(tasks) if src.path is None else tasks)
    if small:
        yield _FilesTask(tuple(small), small_bytes)


def _open_stream(src: Source, stack: ExitStack) -> tuple[BinaryIO, BinaryIO]:
    """``(decompressed stream, raw stream)``; the raw stream's position measures progress."""
    if src.path is None:
        return sys.stdin.buffer, sys.stdin.buffer
    raw = stack.enter_context(open(src.path, "rb"))
    if src.compression == "gz":
        return stack.enter_context(gzip.GzipFile(fileobj=raw)), raw
    if src.compression == "xz":
        return stack.enter_context(lzma.LZMAFile(raw)), raw
    if src.compression == "zst":
        zstandard = _require("zstandard", ".zst files")
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        return stack.enter_context(io.BufferedReader(reader)), raw
    return raw, raw


class _Position:
    """Bytes consumed from a raw stream since the last call (counts what was read for stdin)."""

    def __init__(self, raw: BinaryIO):
        self.raw = raw
        self.seekable = raw.seekable()
        self.last = raw.tell() if self.seekable else 0

    def advance(self, fallback: int) -> int:
        if not self.seekable:
            return fallback
        now = self.raw.tell()
        delta, self.last = now - self.last, now
        return delta


def _jsonl_tasks(name: str, stream: BinaryIO, raw: BinaryIO, key: str) -> Iterator[_JsonlTask]:
    position = _Position(raw)
    lines: list[bytes] = []
    size, first = 0, 1
    for lineno, line in enumerate(stream, 1):
        lines.append(line)
        size += len(line)
        if size >= _BATCH_BYTES:
            yield _JsonlTask(name, first, tuple(lines), key, position.advance(size))
            lines, size, first = [], 0, lineno + 1
    if lines:
        yield _JsonlTask(name, first, tuple(lines), key, position.advance(size))


def _refuse_empty_stdin(tasks: Iterator[Any]) -> Iterator[Any]:
    """``tasks`` of standard input, which must not be empty: nothing piped in is a mistake (a command
    before the pipe that failed or printed nothing), not one empty document."""
    first = next(tasks, None)
    if first is None or (isinstance(first, _BytesTask) and not first.data):
        raise ValueError(f"standard input is empty (0 bytes), so there are no documents to write; {_PIPE_HINT}")
    yield first
    yield from tasks


def _chunk_tasks(stream: BinaryIO, raw: BinaryIO) -> Iterator[_BytesTask]:
    # One chunk of look-ahead tells whether the current chunk is the document's last.
    position = _Position(raw)
    chunk, first = stream.read(_CHUNK_BYTES), True
    while True:
        nxt = stream.read(_CHUNK_BYTES) if chunk else b""
        yield _BytesTask(chunk, first, not nxt, position.advance(len(chunk)))
        if not nxt:
            return
        chunk, first = nxt, False


def _parquet_tasks(src: Source, key: str) -> Iterator[_ParquetTask]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(src.path).metadata
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"{src.path}: not a readable Parquet file ({e}); download or write it again") from e
    rows = max(meta.num_rows, 1)
    done = 0
    for i in range(meta.num_row_groups):
        # IngestProgress counts the file's bytes in proportion to rows; the last group takes the rest.
        share = src.size - done if i == meta.num_row_groups - 1 else src.size * meta.row_group(i).num_rows // rows
        done += share
        yield _ParquetTask(src.path, i, key, share)


class _Done:
    """A task run in the main process, with the ``get()`` of a pool result."""

    def __init__(self, value: Encoded):
        self.value = value

    def get(self) -> Encoded:
        return self.value


class _Framed:
    """The pool result of a ``parse()``, framed on ``get()``."""

    def __init__(self, result):
        self.result = result

    def get(self) -> Encoded:
        return frame(*self.result.get())


def encode_in_order(tasks: Iterator[Any], workers: int) -> Iterator[tuple[int, Encoded]]:
    """``(input bytes, encoded)`` per task, in task order.

    Tasks that parse (jsonl blocks, Parquet row groups) run on a pool of ``workers`` processes,
    started at the first such task; tasks that only frame bytes (files, ranges, stream chunks) run
    here, because sending their tokens back through a pipe costs more than framing them: on the
    stdlib's 154 MB of .py files, 264 MB/s in the main process against 80 MB/s through 2 workers.
    At most ``2 * workers + 2`` tasks are in flight (``Pool.imap`` would read ahead without bound).
    """
    with ExitStack() as stack:
        pool = None
        pending: deque = deque()
        for task in tasks:
            if workers == 1 or not task.parses:
                pending.append((task.in_bytes, _Done(task.run())))
            else:
                if pool is None:
                    pool = stack.enter_context(_POOL_CONTEXT.Pool(workers, initializer=_init_worker))
                pending.append((task.in_bytes, _Framed(pool.apply_async(_parse, (task,)))))
            while pending and (len(pending) >= 2 * workers + 2 or isinstance(pending[0][1], _Done)):
                in_bytes, result = pending.popleft()
                yield in_bytes, result.get()
        while pending:
            in_bytes, result = pending.popleft()
            yield in_bytes, result.get()


def read_documents(inputs: Sequence[str | Path], *, text_key: str = "text") -> list[np.ndarray]:
    """Every document of ``inputs`` (module docstring: files, folders, jsonl, .gz / .xz / .zst, Parquet) as
    its tokens ``[BOS] + bytes + [EOS]``, in corpus order, in memory (the ``text`` dataset)."""
    pieces, starts, size = [], [], 0
    tasks = iter_tasks(find_sources(inputs, text_key=text_key), text_key=text_key)
    for _, (tokens, doc_starts) in encode_in_order(tasks, workers=1):
        pieces.append(tokens)
        starts.append(doc_starts + size)
        size += tokens.size
    if not pieces:
        return []
    bounds = np.concatenate(starts)
    return np.split(np.concatenate(pieces), bounds[1:]) if bounds.size else []


class IngestProgress:
    """Logs ``<what>: N docs, X of T MB (p%), R MB/s, ETA m:ss`` at most every ``every_s`` seconds.

    MB are input bytes as stored (compressed for .gz/.xz/.zst/Parquet), which is what the ETA needs.
    ``total_bytes`` is None when unknown (stdin): the line then has no percentage and no ETA.
    """

    def __init__(self, what: str, *, total_bytes: int | None, every_s: float):
        self.what = what
        self.total = total_bytes
        self.every_s = every_s
        self.start = self.last = time.perf_counter()
        self.bytes = 0
        self.docs = 0
        self.tokens = 0

    def update(self, nbytes: int, docs: int, tokens: int) -> None:
        """Count ``nbytes`` more input; ``docs`` and ``tokens`` are the totals so far."""
        self.bytes += nbytes
        self.docs, self.tokens = docs, tokens
        now = time.perf_counter()
        if now - self.last >= self.every_s:
            self.last = now
            logger.info("%s", self.line())

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def rate(self) -> float:
        """Input MB per second so far."""
        return self.bytes / 2**20 / max(self.elapsed(), 1e-9)

    def line(self) -> str:
        mb = self.bytes / 2**20
        text = f"{self.what}: {self.docs:,} docs, {mb:,.1f}"
        if self.total:
            left_s = (self.total - self.bytes) / 2**20 / max(self.rate(), 1e-9)
            text += f" of {self.total / 2**20:,.1f} MB ({100 * self.bytes / self.total:.0f}%)"
            text += f", {self.rate():,.1f} MB/s, ETA {int(left_s) // 60}:{int(left_s) % 60:02d}"
        else:
            text += f" MB, {self.rate():,.1f} MB/s"
        return text

    def summary(self) -> str:
        """The closing line: ``<what>: N docs, K tokens from X MB in S s (R MB/s, tokens/s)``."""
        elapsed = self.elapsed()
        tokens_per_s = self.tokens / max(elapsed, 1e-9)
        return (
            f"{self.what}: {self.docs:,} docs, {self.tokens:,} tokens from {self.bytes / 2**20:,.1f} MB "
            f"in {elapsed:.1f} s ({self.rate():,.1f} MB/s, {tokens_per_s / 1e6:,.1f}M tokens/s)"
        )


def prepare_shards(
    inputs: Sequence[str | Path],
    out: str | Path,
    *,
    val_fraction: float = 0.01,
    shard_tokens: int = 100_000_000,
    fmt: Literal["header", "raw"] = "header",
    seed: int = 0,
    globs: Sequence[str] = DEFAULT_GLOBS,
    text_key: str = "text",
    stdin_jsonl: bool = False,
    workers: int = 1,
    progress_s: float = 10.0,
) -> dict[str, Any]:
    """Tokenize ``inputs`` (module docstring) into ``out/train/*.bin``, ``out/val/*.bin`` and
    ``out/metadata.json``; returns the metadata written.

    ``fmt`` is ``header`` (256-word llm.c header + uint16 tokens) or ``raw`` (the seed's headerless
    uint16). ``val_fraction = 0`` writes no val split. A progress line is logged at most every
    ``progress_s`` seconds. Each shard is written under a temporary name and renamed when whole,
    and metadata.json last: on any error (a bad input, a full or read-only disk, Ctrl-C) everything
    written so far, and the folders made for it, are removed. A failed write raises ValueError naming
    ``out`` and the cause (``disk full``, ``read-only file system``, ``permission denied``).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1); e.g. 0.01 keeps ~1% of documents for val")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens={shard_tokens} must be >= 1 (e.g. 100000000)")
    if fmt not in ("header", "raw"):
        raise ValueError(f"format {fmt!r} is not one of 'header', 'raw'")
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder; name a new or empty folder for the shards")
    sources = find_sources(inputs, globs=globs, text_key=text_key, stdin_jsonl=stdin_jsonl)
    for split in ("train", "val"):
        if (out / split).is_dir() and any((out / split).rglob("*.bin")):
            raise ValueError(f"{out / split} already holds shards; write to an empty --out folder or delete it first")

    sizes = [s.size for s in sources]
    total = None if None in sizes else sum(sizes)
    logger.info(
        "prepare_data: %d input(s)%s, %d worker(s) -> %s",
        len(sources),
        "" if total is None else f", {total / 2**20:,.1f} MB",
        workers,
        out,
    )
    writers = {
        split: ShardWriter(out / split, split, shard_tokens=shard_tokens, header=fmt == "header")
        for split in ("train", "val")
    }
    # Removed again on failure, deepest first: the folders the shards go in and any parent of --out made for them.
    made = [d for d in (*reversed(out.parents), out, out / "train", out / "val") if not d.exists()]
    try:
        documents = _write_split(
            encode_in_order(iter_tasks(sources, text_key=text_key), workers),
            writers,
            val_fraction,
            seed,
            IngestProgress("prepare_data", total_bytes=total, every_s=progress_s),
        )
        names = ["<stdin>" if str(i) == STDIN else str(i) for i in inputs]
        if not documents["train"]:
            raise ValueError(f"the inputs {names} hold no documents (empty .jsonl files, or only blank lines?)")
        count = documents["train"] + documents["val"]
        if writers["train"].num_tokens + writers["val"].num_tokens == 2 * count:  # BOS + EOS each: no text
            what = "its one document is empty" if count == 1 else f"all {count} documents are empty"
            raise ValueError(f"the inputs {names} hold no text ({what}: 0 bytes); pass files that have content")
        metadata = corpus_metadata(
            writers,
            documents,
            fmt,
            val_fraction=val_fraction,
            seed=seed,
            shard_tokens=shard_tokens,
            inputs=[str(i) for i in inputs],
            files=len(sources),
            text_key=text_key,
        )
        write_metadata(out, metadata)
    except OSError as e:  # the reads raise ValueError (_reading): this is a write under --out
        _remove_written(writers, made)
        raise ValueError(_write_error(out, e)) from e
    except BaseException:
        _remove_written(writers, made)
        raise
    if val_fraction > 0 and not documents["val"]:
        logger.warning("prepare_data: only 1 document, so the val split is empty; pass more files or a .jsonl")
    logger.info(
        "prepare_data: wrote %d documents, %d tokens (train %d, val %d) to %s",
        metadata["documents"],
        metadata["tokens"],
        writers["train"].num_tokens,
        writers["val"].num_tokens,
        out,
    )
    return metadata


def _remove_written(writers: dict[str, ShardWriter], made: list[Path]) -> None:
    """After a failure: every shard written (finished or partial), then the folders made for them."""
    for writer in writers.values():
        writer.abort()
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:
            pass  # not empty (something else wrote there) or never made


def _write_error(out: Path, e: OSError) -> str:
    """One line for a failed write under ``out``: the cause by name and what to do."""
    reason = os_error_reason(e)
    where = f": {e.filename}" if e.filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free some space or choose another --out"
    elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = "choose an --out folder you can write to"
    else:
        fix = "check the --out folder"
    return f"--out {out}: cannot write the shards ({reason}{where}); {fix}. Nothing was kept"


def _write_split(
    encoded: Iterator[tuple[int, Encoded]],
    writers: dict[str, ShardWriter],
    val_fraction: float,
    seed: int,
    progress: IngestProgress,
) -> dict[str, int]:
    """Route every document of ``encoded`` to its split's writer; returns documents per split."""
    documents = {"train": 0, "val": 0}
    rng = np.random.default_rng(seed)
    index = 0  # documents seen so far
    current = "train"  # split of the document that is still open
    for in_bytes, (tokens, starts) in encoded:
        n = starts.size
        if n == 0:
            writers[current].add(tokens)
        else:
            # One draw per document, for every document, so the split of one never shifts the others.
            draws = rng.random(n)
            ids = index + np.arange(n)
            is_val = (val_fraction > 0) & ((ids == 1) | ((ids > 1) & (draws < val_fraction)))
            if starts[0]:
                writers[current].add(tokens[: starts[0]])
            bounds = np.append(starts, tokens.size)
            change = np.flatnonzero(np.diff(is_val)) + 1  # runs of documents bound for the same split
            for a, b in zip(np.concatenate(([0], change)), np.append(change, n)):
                current = "val" if is_val[a] else "train"
                writers[current].add(tokens[bounds[a] : bounds[b]])
                documents[current] += int(b - a)
            index += n
        progress.update(in_bytes, index, writers["train"].num_tokens + writers["val"].num_tokens)
    for writer in writers.values():
        writer.close()
    logger.info("%s", progress.summary())
    return documents


def default_workers() -> int:
    """The CLI's default number of worker processes: 1. On the 2-core machine this project is
    tested on, 2 workers were slower than 1 for every format (jsonl 103 -> 48 MB/s, Parquet
    27-33 -> 10-12 MB/s: shipping tokens through pipes costs more than parsing); ``--workers N``
    is there for machines with cores to spare."""
    return 1
