"""Turn any corpus into token shards: ``out/train/*.bin``, ``out/val/*.bin`` and ``out/metadata.json``.

    python scripts/prepare_data.py --input corpus.jsonl.zst notes/ fineweb/*.parquet --out data/my_corpus
    python scripts/prepare_data.py --input perl-src/ --glob '*.pm' '*.pod' --out data/perl --workers 2
    zcat dump.jsonl.gz | python scripts/prepare_data.py --input - --stdin_jsonl --out data/dump

Inputs are files, folders (searched recursively for the ``--glob`` patterns) and ``-`` (standard
input: refused when empty or a terminal, since nothing was piped in). Inputs without any text (no
documents, or only empty ones) are an error, not an empty dataset. A plain file is one document; ``.jsonl`` / ``.jsonl.gz`` / ``.jsonl.xz`` / ``.jsonl.zst`` hold one document
per line (the ``--text_key`` field); ``.parquet`` one per row (the ``--text_key`` column); other
``.gz`` / ``.xz`` / ``.zst`` files are one document, decompressed. Each document becomes ``[BOS] + UTF-8
bytes + [EOS]``. The input is streamed (memory does not grow with the corpus), jsonl and Parquet are
parsed by ``--workers`` processes, and the shards do not depend on the number of workers. Parquet and ``.zst`` need the
``data`` extra: ``pip install -e '.[data]'``. The work is done by
:func:`spider_titan.data.ingest.prepare_shards`; train on the result with
``training.dataset = "bytes"`` and ``training.dataset_path = <out>``.
"""

from __future__ import annotations

import argparse
import logging
import sys

from spider_titan.cli import ArgumentParser, at_least, check_output_folder
from spider_titan.data.ingest import DEFAULT_GLOBS, default_workers, prepare_shards


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, documented by ``--help``."""
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="files, folders and - (standard input), read in the order given",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (train/, val/, metadata.json)")
    p.add_argument(
        "--glob",
        nargs="+",
        default=list(DEFAULT_GLOBS),
        metavar="PATTERN",
        help="file-name patterns picked up inside folders, case-insensitive; a pattern with a / "
        f"matches the path relative to the folder (default: {' '.join(DEFAULT_GLOBS)})",
    )
    p.add_argument(
        "--text_key", default="text", help="the jsonl field / Parquet column holding the text (default text)"
    )
    p.add_argument(
        "--stdin_jsonl",
        action="store_true",
        help="read standard input as jsonl, one document per line; without it all of stdin is one document",
    )
    p.add_argument(
        "--val_fraction",
        type=float,
        default=0.01,
        help="fraction of documents kept for val, in [0, 1); with >= 2 documents val gets at least one (default 0.01)",
    )
    p.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per shard (default 100M)")
    p.add_argument(
        "--format",
        choices=("header", "raw"),
        default="header",
        help="header: 256-word llm.c header + uint16 tokens; raw: the seed's headerless uint16 tokens (default header)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val document split (default 0)")
    p.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        help="processes that parse jsonl blocks and Parquet row groups (plain files are framed by the "
        "main process); the shards do not depend on it (default "
        f"{default_workers()}: more pay off only with cores to spare)",
    )
    p.add_argument(
        "--progress_s",
        type=float,
        default=10.0,
        help="log a progress line (docs, MB, MB/s, ETA) at most every this many seconds (default 10)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Parse the flags and write the shards; a user error (a bad input, an unwritable or full --out)
    exits with status 1 and one line on stderr. Progress goes to stdout."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    try:  # before any input is read
        at_least(0, "--progress_s", args.progress_s, "seconds between progress lines")
        check_output_folder(args.out, "--out", args.input)
        prepare_shards(
            args.input,
            args.out,
            val_fraction=args.val_fraction,
            shard_tokens=args.shard_tokens,
            fmt=args.format,
            seed=args.seed,
            globs=args.glob,
            text_key=args.text_key,
            stdin_jsonl=args.stdin_jsonl,
            workers=args.workers,
            progress_s=args.progress_s,
        )
    except (FileNotFoundError, ValueError, ModuleNotFoundError) as e:
        sys.exit(f"prepare_data: error: {e}")


if __name__ == "__main__":
    main()
