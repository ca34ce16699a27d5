"""The device corpus (issue 74): ~150 MB of text this machine holds offline, as two xz-compressed jsonl files
small enough to travel to the lent GPU machine (64 MiB in all, the repository included).

    python -m lab.corpus.device_corpus --out outputs/device_corpus          # 147 MB of training text + 8 MB held out
    python -m lab.corpus.device_corpus --out DIR --scale 0.01                # the same recipe at 1 % (tests)

Writes ``train.jsonl.xz`` (the mix every run trains on; its val split is drawn by prepare_data),
``held_out.jsonl.xz`` (text of another source that no run trains on) and ``manifest.json`` (each source's
folders, caps, documents and bytes, each file's sha256, the machine). ``scripts/prepare_data.py`` reads both
with the standard library alone (``lzma``), so the device machine needs no extra package:

    python scripts/prepare_data.py --input DIR/train.jsonl.xz --out data/device_train --val_fraction 0.01
    python scripts/prepare_data.py --input DIR/held_out.jsonl.xz --out data/device_held_out --val_fraction 0.25

Sources (``SOURCES``), each a set of folders and file patterns with a cap in MB: Debian's package
documentation (``/usr/share/doc``: changelogs, copyright files, READMEs, NEWS; gzipped ones decompressed),
C headers (``/usr/include``), Python source (``/usr/lib/python3/dist-packages``), Perl modules and pod
(``/usr/share/perl``, ``/usr/share/perl5``), GNU info manuals (``/usr/share/info``) and the common licenses.
Held out: English manual pages of sections 1-8 (``/usr/share/man/man[1-8]``, the Google Cloud SDK's
thousands of generated pages left out), rendered by ``groff -mandoc -Tascii``. The Python standard library
(the built-in corpus) is in neither.

Reproducible: within a source the files are taken in the order of the SHA-1 of their path (a fixed
shuffle, so a cap keeps a spread across packages, not the alphabet's first), each document is cut at
``--doc_kb`` at a line end, documents under 200 characters, not UTF-8 or holding NUL bytes are left out, and
the xz stream is written at preset 9e with no timestamp: the same machine gives the same bytes.
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import hashlib
import json
import lzma
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MIN_CHARS = 200


@dataclass(frozen=True)
class Source:
    name: str
    folders: tuple[str, ...]
    patterns: tuple[str, ...]
    cap_mb: float
    what: str
    man: bool = False  # troff pages rendered by groff


SOURCES = (
    Source(
        "debian_docs",
        ("/usr/share/doc",),
        ("changelog*", "copyright", "readme*", "news*", "*.txt", "*.md", "*.rst", "*.txt.gz", "*.md.gz"),
        70,
        "Debian package documentation: changelogs, copyright files, READMEs, NEWS",
    ),
    Source("c_headers", ("/usr/include",), ("*.h",), 60, "C and C++ headers"),
    Source("python_source", ("/usr/lib/python3/dist-packages",), ("*.py",), 17, "Python packages' source"),
    Source("perl", ("/usr/share/perl", "/usr/share/perl5"), ("*.pm", "*.pod"), 12, "Perl modules and pod"),
    Source("info_manuals", ("/usr/share/info",), ("*.info*",), 5, "GNU info manuals"),
    Source("licenses", ("/usr/share/common-licenses",), ("*",), 1, "the common licenses"),
)
HELD_OUT = Source(
    "man_pages",
    tuple(f"/usr/share/man/man{i}" for i in range(1, 9)),
    ("*",),
    8,
    "English manual pages, sections 1-8, without the Google Cloud SDK's (gcloud, bq, gsutil)",
    man=True,
)
MAN_EXCLUDE = ("gcloud", "bq", "gsutil")


def candidates(src: Source) -> list[Path]:
    """The source's files, in the order of the SHA-1 of their path."""
    found = []
    for folder in map(Path, src.folders):
        if not folder.is_dir():
            continue
        for path in folder.rglob("*"):
            name = path.name.lower()
            if not path.is_file() or path.is_symlink() or not any(fnmatch.fnmatch(name, p) for p in src.patterns):
                continue
            if src.man and name.startswith(MAN_EXCLUDE):
                continue
            found.append(path)
    return sorted(found, key=lambda p: hashlib.sha1(str(p).encode()).hexdigest())


def render_man(source: bytes, groff: str) -> str | None:
    """A manual page's plain ASCII text (no overstrike, underline or colour), or None for a redirect or a
    page groff cannot render."""
    if source.lstrip().startswith(b".so "):
        return None
    try:
        done = subprocess.run([groff, "-mandoc", "-Tascii", "-P-cbou"], input=source, capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        return None
    return done.stdout.decode("ascii", errors="replace") if done.returncode == 0 else None


def document(path: Path, src: Source, doc_bytes: int, groff: str | None) -> str | None:
    """One file's text, cut at ``doc_bytes`` at a line end; None when it is not text worth keeping."""
    try:
        data = path.read_bytes()
        if path.name.endswith(".gz"):
            data = gzip.decompress(data)
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    if src.man:
        text = render_man(data, groff or "groff")
        if text is None:
            return None
    else:
        if b"\x00" in data:
            return None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return None
    text = re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"
    if len(text.encode()) > doc_bytes:
        cut = text.encode()[:doc_bytes].decode("utf-8", errors="ignore")
        text = cut[: cut.rfind("\n") + 1] or cut
    return text if len(text) >= MIN_CHARS else None


def documents(src: Source, cap_bytes: int, doc_bytes: int, groff: str | None) -> Iterator[tuple[Path, str]]:
    """The source's documents in its order until their UTF-8 bytes reach ``cap_bytes``."""
    total = 0
    for path in candidates(src):
        if total >= cap_bytes:
            return
        text = document(path, src, doc_bytes, groff)
        if text is not None:
            total += len(text.encode())
            yield path, text


def write_corpus(path: Path, sources: tuple[Source, ...], scale: float, doc_bytes: int, groff: str | None) -> dict:
    """One xz jsonl of ``sources`` (each capped at ``cap_mb * scale`` MB); returns its manifest entry."""
    stats = []
    raw = 0
    comp = lzma.LZMACompressor(format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9 | lzma.PRESET_EXTREME)
    digest = hashlib.sha256()
    with path.open("wb") as out:
        for src in sources:
            docs = nbytes = 0
            for file, text in documents(src, int(src.cap_mb * scale * 1e6), doc_bytes, groff):
                line = (json.dumps({"text": text, "source": src.name, "path": str(file)}) + "\n").encode()
                block = comp.compress(line)
                out.write(block)
                digest.update(block)
                docs, nbytes, raw = docs + 1, nbytes + len(text.encode()), raw + len(line)
            stats.append(
                {"source": src.name, "what": src.what, "folders": list(src.folders), "patterns": list(src.patterns)}
                | {"cap_mb": src.cap_mb * scale, "documents": docs, "text_mb": round(nbytes / 1e6, 3)}
            )
            print(f"{path.name}: {src.name}: {docs} documents, {nbytes / 1e6:.1f} MB of text", flush=True)
        block = comp.flush()
        out.write(block)
        digest.update(block)
    return {
        "file": path.name,
        "sources": stats,
        "text_mb": round(sum(s["text_mb"] for s in stats), 3),
        "jsonl_mb": round(raw / 1e6, 3),
        "xz_mb": round(path.stat().st_size / 1e6, 3),
        "sha256": digest.hexdigest(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="folder for train.jsonl.xz, held_out.jsonl.xz, manifest")
    p.add_argument("--scale", type=float, default=1.0, help="every source's cap times this (default 1; tests: 0.01)")
    p.add_argument("--doc_kb", type=int, default=128, help="longest document in KB; longer files are cut (128)")
    args = p.parse_args(argv)
    if not 0 < args.scale <= 10:
        print(f"device_corpus: --scale {args.scale}: give a factor in (0, 10]", file=sys.stderr)
        return 2
    groff = shutil.which("groff")
    if groff is None:
        print(
            "device_corpus: groff is not installed (the held-out manual pages need it: apt install groff-base)",
            file=sys.stderr,
        )
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    doc_bytes = args.doc_kb * 1000
    files = [
        write_corpus(args.out / "train.jsonl.xz", SOURCES, args.scale, doc_bytes, groff),
        write_corpus(args.out / "held_out.jsonl.xz", (HELD_OUT,), args.scale, doc_bytes, groff),
    ]
    empty = [s["source"] for f in files for s in f["sources"] if not s["documents"]]
    manifest = {
        "recipe": "python -m lab.corpus.device_corpus " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.node()} {platform.platform()}",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "seconds": round(time.time() - t0, 1),
        "files": files,
        "empty_sources": empty,
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for f in files:
        print(f"{f['file']}: {f['text_mb']:.1f} MB of text, {f['xz_mb']:.1f} MB compressed")
    if empty:
        print(f"device_corpus: no documents on this machine for {empty}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
