"""lab/corpus/man_to_text.py: manual pages to a jsonl corpus of plain text."""

from __future__ import annotations

import gzip
import json
import shutil

import pytest

from lab.corpus import man_to_text

PAGE = b""".TH FROB 1
.SH NAME
frob \\- turn the \\fBknob\\fR
.SH DESCRIPTION
.B frob
turns the knob by one notch.


Options come later.
"""

pytestmark = pytest.mark.skipif(shutil.which("groff") is None, reason="needs groff")


def test_pages_render_to_plain_text_one_document_each(tmp_path, capsys):
    """A gzipped and a plain page become one document each, as text without troff requests or overstrike;
    a redirect page, an excluded name and a page under --min_chars are left out; --every thins by name."""
    man = tmp_path / "man1"
    man.mkdir()
    (man / "frob.1.gz").write_bytes(gzip.compress(PAGE))
    (man / "grub.1").write_bytes(PAGE.replace(b"frob", b"grub").replace(b"FROB", b"GRUB"))
    (man / "link.1").write_bytes(b".so man1/frob.1\n")
    (man / "skip-me.1").write_bytes(PAGE)
    out = tmp_path / "man.jsonl"
    man_to_text.main([str(man), "--exclude", "skip", "--min_chars", "50", "--out", str(out)])
    docs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [d["name"] for d in docs] == ["frob.1.gz", "grub.1"]
    text = docs[0]["text"]
    assert "frob - turn the knob" in text and "turns the knob by one notch." in text
    assert "\b" not in text and ".SH" not in text and "\\f" not in text and "\n\n\n" not in text
    assert "2 pages" in capsys.readouterr().out
    before = out.read_text()
    with pytest.raises(SystemExit, match="0 pages kept .*left as it was"):  # nothing to write: --out kept
        man_to_text.main([str(man), "--exclude", "skip", "--min_chars", "5000", "--out", str(out)])
    assert out.read_text() == before and [p.name for p in tmp_path.iterdir() if p.is_file()] == ["man.jsonl"]
    man_to_text.main([str(man), "--every", "3", "--min_chars", "50", "--out", str(out)])  # the 1st and 4th of four
    assert [json.loads(line)["name"] for line in out.read_text().splitlines()] == ["frob.1.gz", "skip-me.1"]
