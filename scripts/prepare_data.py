"""Turn text into token shards: ``out/train/*.bin``, ``out/val/*.bin`` and ``out/metadata.json``.

    python scripts/prepare_data.py --input corpus.jsonl notes/ --out data/my_corpus

Inputs are text files, ``.jsonl`` files (one document per line, in its ``"text"`` field) and
folders searched recursively for .txt/.md/.rst/.py/.jsonl. Each file or jsonl line becomes one
document ``[BOS] + UTF-8 bytes + [EOS]``. The work is done by
:func:`spider_titan.data.shards.prepare_shards`; train on the result with
``training.dataset = "bytes"`` and ``training.dataset_path = <out>``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

# Run from a checkout without `pip install -e .`: make the repository root importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spider_titan.data.shards import prepare_shards  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, documented by ``--help``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="text files, .jsonl files (a 'text' field per line) or folders of them")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (train/, val/, metadata.json)")
    p.add_argument("--val_fraction", type=float, default=0.01,
                   help="fraction of documents kept for val, in [0, 1) (default 0.01)")
    p.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per shard (default 100M)")
    p.add_argument("--format", choices=("header", "raw"), default="header",
                   help="header: 256-word llm.c header + uint16 tokens; raw: uint16 tokens only (default header)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val document split (default 0)")
    p.add_argument("--progress_mb", type=int, default=100, help="log progress every this many MB read (default 100)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Parse the flags and write the shards; a user error exits with status 1 and one line."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        prepare_shards(
            args.input, args.out, val_fraction=args.val_fraction, shard_tokens=args.shard_tokens,
            fmt=args.format, seed=args.seed, progress_mb=args.progress_mb,
        )
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"prepare_data: error: {e}")


if __name__ == "__main__":
    main()
