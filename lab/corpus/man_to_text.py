"""Render manual pages to plain text as a jsonl corpus, one document per page: a held-out corpus of English
technical documentation (command-line manuals) that no config trains on.

    python -m lab.corpus.man_to_text /usr/share/man/man1 --every 12 --exclude gcloud bq gsutil --out data/man.jsonl
    python scripts/prepare_data.py --input data/man.jsonl --out data/man --val_fraction 0.3
    python scripts/evaluate.py --model A/export --model B/export --data data/man

Each page (``.gz`` or plain troff) goes through ``groff -mandoc -Tascii`` without overstrike or colour; runs
of blank lines become one. ``--every N`` keeps every N-th page of the sorted names (a spread across
packages); redirect pages (``.so``) and pages under ``--min_chars`` are left out.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from lab.cli import check_not_negative, check_positive, parser, refuse, write_whole


def page_source(path: Path) -> bytes:
    """A page's troff source, gunzipped where it ends in .gz."""
    data = path.read_bytes()
    return gzip.decompress(data) if path.suffix == ".gz" else data


def render(source: bytes, groff: str = "groff") -> str:
    """Plain ASCII text of one page's troff source (no overstrike, underline or colour), blank runs squeezed."""
    done = subprocess.run([groff, "-mandoc", "-Tascii", "-P-cbou"], input=source, capture_output=True, timeout=60)
    if done.returncode != 0:
        raise ValueError(done.stderr.decode(errors="replace").strip() or f"groff exited with {done.returncode}")
    text = done.stdout.decode("ascii", errors="replace")
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def pages(folders: list[Path], every: int, exclude: tuple[str, ...]) -> list[Path]:
    """Every ``every``-th page file of the folders, by sorted name, leaving out names that start with ``exclude``."""
    found = sorted((p for f in folders for p in f.iterdir() if p.is_file()), key=lambda p: p.name)
    return [p for p in found if not p.name.startswith(exclude)][::every]


PROG = "python -m lab.corpus.man_to_text"


def main(argv: list[str] | None = None) -> None:
    p = parser(PROG, __doc__)
    p.add_argument("folders", nargs="+", type=Path, help="folders of manual pages, e.g. /usr/share/man/man1")
    p.add_argument("--out", required=True, type=Path, help="the jsonl to write (fields text and name)")
    p.add_argument("--every", type=int, default=1, help="keep every N-th page of the sorted names")
    p.add_argument("--exclude", nargs="*", default=[], help="leave out pages whose names start with these")
    p.add_argument("--min_chars", type=int, default=500, help="leave out pages rendered shorter than this")
    args = p.parse_args(argv)
    check_positive(PROG, every=args.every)
    check_not_negative(PROG, min_chars=args.min_chars)
    for folder in args.folders:
        if not folder.is_dir():
            raise refuse(PROG, f"{folder} is not a folder; give folders of manual pages")
    if args.out.is_dir():
        raise refuse(PROG, f"--out {args.out}: is a folder; give the jsonl file to write")
    groff = shutil.which("groff")
    if groff is None:
        raise refuse(PROG, "groff is not installed (Debian/Ubuntu: apt install groff-base)")
    kept = chars = 0

    def write(tmp: Path) -> None:  # --out is replaced only by a whole corpus, and only if a page was kept
        nonlocal kept, chars
        with tmp.open("w") as out:
            for path in pages(args.folders, args.every, tuple(args.exclude)):
                source = page_source(path)
                if source.lstrip().startswith(b".so "):
                    continue  # a redirect to another page
                try:
                    text = render(source, groff)
                except (ValueError, subprocess.TimeoutExpired) as e:
                    print(f"{PROG}: {path.name} left out: {e}", file=sys.stderr)
                    continue
                if len(text) < args.min_chars:
                    continue
                out.write(json.dumps({"text": text, "name": path.name}) + "\n")
                kept, chars = kept + 1, chars + len(text)
        if kept == 0:
            raise refuse(
                PROG,
                f"0 pages kept (--every {args.every}, --min_chars {args.min_chars}); --out {args.out} left as it was",
            )

    write_whole(args.out, write)
    print(f"man_to_text: {kept} pages, {chars:,} characters -> {args.out}")


if __name__ == "__main__":
    main()
