"""Extract the prose of HTML books into a jsonl corpus: one document per section, paragraphs only.

    python -m lab.corpus.html_to_prose ~/.rustup/toolchains/*/share/doc/rust/html/{book,nomicon,reference}/print.html \
        --out data/prose.jsonl
    python scripts/prepare_data.py --input data/prose.jsonl --out data/prose

Keeps the text of ``<p>``, ``<li>`` and ``<blockquote>`` elements (inline ``<code>`` words stay, code
blocks in ``<pre>`` go), so the result is English prose, a corpus of a different kind than the built-in
one (Python source). A new ``<h1>``/``<h2>`` starts a new document. Used for the second corpus of the
quality study (docs/benchmarks.md); the standard library's ``html.parser`` does the parsing.
"""

from __future__ import annotations

import json
import os
import re
from html.parser import HTMLParser
from pathlib import Path

from lab.cli import parser as cli_parser
from lab.cli import refuse, write_whole

PROSE_TAGS = {"p", "li", "blockquote"}
SECTION_TAGS = {"h1", "h2"}
SKIP_TAGS = {"pre", "script", "style", "nav", "head"}


class _Prose(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.documents: list[list[str]] = [[]]
        self._prose_depth = 0
        self._skip_depth = 0
        self._paragraph: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in SKIP_TAGS:
            self._skip_depth += 1
        elif tag in SECTION_TAGS and self.documents[-1]:
            self.documents.append([])
        elif tag in PROSE_TAGS:
            if self._prose_depth == 0:
                self._paragraph = []
            self._prose_depth += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in SKIP_TAGS:
            self._skip_depth = max(0, self._skip_depth - 1)
        elif tag in PROSE_TAGS and self._prose_depth:
            self._prose_depth -= 1
            if self._prose_depth == 0:
                text = re.sub(r"\s+", " ", "".join(self._paragraph)).strip()
                if len(text) >= 40:  # drops navigation crumbs and one-word list items
                    self.documents[-1].append(text)

    def handle_data(self, data: str) -> None:
        if self._prose_depth and not self._skip_depth:
            self._paragraph.append(data)


PROG = "python -m lab.corpus.html_to_prose"


def main(argv: list[str] | None = None) -> None:
    parser = cli_parser(PROG, __doc__)
    parser.add_argument("html", nargs="+", type=Path, help="HTML files (e.g. mdBook print.html pages)")
    parser.add_argument("--out", type=Path, required=True, help="jsonl file to write ({'text': ...} per line)")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.html if not p.is_file()]
    if missing:
        raise refuse(PROG, f"not a file: {', '.join(missing)}; give HTML files")
    if args.out.is_dir():
        raise refuse(PROG, f"--out {args.out}: is a folder; give the jsonl file to write")
    same = [str(p) for p in args.html if args.out.exists() and os.path.samefile(p, args.out)]
    if same:
        raise refuse(PROG, f"--out {args.out}: is the input {same[0]}; write the corpus to another file")
    n_docs = n_bytes = 0

    def write(tmp: Path) -> None:  # --out is replaced only by a whole corpus, and only if it holds prose
        nonlocal n_docs, n_bytes
        with tmp.open("w", encoding="utf-8") as f:
            for path in args.html:
                prose = _Prose()
                prose.feed(path.read_text(encoding="utf-8", errors="replace"))
                for paragraphs in prose.documents:
                    if paragraphs:
                        text = "\n\n".join(paragraphs)
                        f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                        n_docs, n_bytes = n_docs + 1, n_bytes + len(text.encode())
        if n_docs == 0:
            raise refuse(
                PROG,
                f"no prose (<p>, <li>, <blockquote> of 40+ characters) in {len(args.html)} files; "
                f"--out {args.out} left as it was",
            )

    write_whole(args.out, write)
    print(f"{args.out}: {n_docs} documents, {n_bytes / 1e6:.2f} MB of prose from {len(args.html)} files")


if __name__ == "__main__":
    main()
