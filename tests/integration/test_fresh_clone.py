"""A fresh clone holds no data: the 1B configs read ``data/pretrain``, a folder the user prepares; without
it the trainer stops in one line that says how to prepare it, and git tracks nothing under ``data/``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spider_titan import train
from tests.utils import REPO

PREPARE = "python scripts/prepare_data.py --input <your corpus> --out data/pretrain"


def clone_without_data(root: Path) -> Path:
    """What a fresh clone has for the trainer's command: the configs, no ``data/``."""
    shutil.copytree(REPO / "train_configs", root / "train_configs", ignore=shutil.ignore_patterns("__pycache__"))
    assert not (root / "data").exists()
    return root


def check_refusal(lines: list[str]) -> None:
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: dataset folder data/pretrain does not exist"), lines
    assert f"`{PREPARE}`" in lines[0], lines


@pytest.mark.slow  # starts a process
def test_the_1b_command_on_a_fresh_clone_stops_in_one_line(tmp_path):
    """``python -m spider_titan.train --job.config_file train_configs/spider_1b.toml``, run where the
    repository's files are but no data: exit 2, one line naming the folder and the prepare command,
    nothing else on stdout or stderr (no traceback, no log line before it)."""
    root = clone_without_data(tmp_path)
    cmd = [sys.executable, "-m", "spider_titan.train", "--job.config_file", "train_configs/spider_1b.toml"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    check_refusal(proc.stderr.splitlines())


def test_the_one_gpu_1b_config_on_a_fresh_clone_stops_in_one_line(tmp_path, in_process, monkeypatch, capsys):
    monkeypatch.chdir(clone_without_data(tmp_path))
    assert train.main(["--job.config_file", "train_configs/spider_1b_1gpu.toml"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    check_refusal(err.splitlines())


def test_git_tracks_no_data_and_ignores_the_data_folder():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60)

    assert git("ls-files", "data").stdout == ""
    assert git("check-ignore", "-q", "--no-index", "data/pretrain/train/train_000000.bin").returncode == 0
    # the package's own data/ folder is not caught by the pattern
    assert git("check-ignore", "-q", "--no-index", "spider_titan/data/loader.py").returncode == 1
