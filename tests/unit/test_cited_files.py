"""Every docs/ or lab/ file the repository's code and docs cite exists: a study's write-up or a doc that
moves leaves no reference behind it (the package once cited docs/experiments.md for months after the
history moved to lab/log/)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.utils import REPO

# docs/<file>.md, lab/<...>/<file>.md, and a log entry by its dated name alone (2026-11-29-one-core-loop.md)
CITED = re.compile(r"(?<![\w/.-])((?:docs|lab)/[\w./-]+\.md|20\d\d-\d\d-\d\d-[\w-]+\.md)")
TEXT = (".py", ".md", ".toml")


def tracked_text_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [name for name in listed.splitlines() if name.endswith(TEXT) and (REPO / name).is_file()]


def dangling(name: str, text: str) -> list[str]:
    """The cited files of ``text`` (from file ``name``) that are not in the repository."""
    missing = []
    for cited in CITED.findall(text):
        if "/" in cited:
            found = (REPO / cited).exists() or (REPO / name).parent.joinpath(cited).exists()
        else:
            found = (REPO / "lab" / "log" / cited).exists()
        if not found:
            missing.append(cited)
    return missing


def test_every_cited_file_exists():
    this = str(Path(__file__).resolve().relative_to(REPO))  # its examples of a missing file are on purpose
    files = [name for name in tracked_text_files() if name != this]
    missing = {name: m for name in files if (m := dangling(name, (REPO / name).read_text()))}
    assert not missing, missing


def test_the_check_catches_a_moved_file():
    assert dangling("spider_titan/x.py", 'see docs/experiments.md, "Test-time depth"') == ["docs/experiments.md"]
    assert dangling("spider_titan/x.py", "lab/log/2026-11-29-one-core-loop.md") == []
    assert dangling("spider_titan/x.py", "(2026-01-01-no-such-study.md)") == ["2026-01-01-no-such-study.md"]
