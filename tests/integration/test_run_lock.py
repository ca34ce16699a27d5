"""One run per dump folder: a second run on a folder in use stops at once with one line naming the
holder (one process and two ranks); the first runs on untouched; a lock left by a dead run is
taken over with a warning."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest

from spider_titan.checkpoint.lock import (
    LOCK_FILE,
    RunLock,
    RunLockedError,
    acquire_run_lock,
)
from spider_titan.train import main
from tests.utils import REPO, read_metrics, run_train, tiny_run

ARGS = tiny_run(checkpoint__enable=True, checkpoint__interval=4)


def holder_pid(dump) -> int | None:
    try:
        return json.loads((dump / LOCK_FILE).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


@pytest.mark.slow
def test_a_second_run_on_a_folder_in_use_stops_at_once(tmp_path):
    dump = tmp_path / "run"
    cmd = [
        *ARGS,
        "--training.steps",
        "8",
        "--job.dump_folder",
        str(dump),
        "--validation.enable",
        "true",
        "--validation.freq",
        "4",
        "--validation.steps",
        "1",
    ]
    first = subprocess.Popen(
        [sys.executable, "-m", "spider_titan.train", *cmd],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.time() + 600
        while holder_pid(dump) != first.pid:
            assert first.poll() is None and time.time() < deadline, "the first run never held the lock"
            time.sleep(0.05)
        # Paused, the first run holds the lock for as long as the second needs to start, however
        # slow the machine; a stopped process keeps its flock.
        first.send_signal(signal.SIGSTOP)
        try:
            t0 = time.perf_counter()
            second = run_train(cmd, timeout=600)
            second_s = time.perf_counter() - t0
        finally:
            first.send_signal(signal.SIGCONT)
        out, err = first.communicate(timeout=300)
    finally:
        first.kill()
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 2 and len(lines) == 1, second.stderr
    assert lines[0].startswith(
        f"error: job.dump_folder: {dump} is in use by another run (pid {first.pid} on {socket.gethostname()}, started "
    ), lines[0]
    assert "--job.dump_folder <path>" in lines[0] and "wait for it to finish" in lines[0]
    assert "checkpoint: loaded" not in second.stdout and "step " not in second.stdout
    assert first.returncode == 0, err[-3000:]
    rows = read_metrics(dump)
    assert [row["step"] for row in rows if "loss" in row] == list(range(1, 9))  # one run's rows, none twice
    assert [(row["step"], row["total_steps"]) for row in rows if "val_loss" in row] == [(4, 8), (8, 8)]
    assert re.search(r"step 4/8 \| elapsed \S+ \| eta \S+ \| val_loss ", out), out  # validation: step total, eta
    assert not (dump / LOCK_FILE).exists()  # released at exit
    print(f"second run refused in {second_s:.1f} s")
    # the plot command the run prints works as printed, whatever python is first on PATH
    pytest.importorskip("matplotlib")
    plot = shlex.split(out.split("(plot: ")[1].split(")\n")[0])
    proc = subprocess.run(
        plot,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0 and (dump / "metrics.png").is_file(), (plot, proc.stderr)


@pytest.mark.slow
def test_two_ranks_both_stop_on_a_folder_in_use(tmp_path):
    """Rank 0 finds the lock held; rank 1 learns it from the broadcast and stops too, no hang."""
    dump = tmp_path / "run"
    lock = RunLock.acquire(dump)
    try:
        proc = run_train([*ARGS, "--training.steps", "2", "--job.dump_folder", str(dump)], nprocs=2, timeout=600)
    finally:
        lock.release()
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    # rank 0's line always; rank 1's too unless torchrun ends it first (it stops the other ranks at the
    # first failure: on a loaded machine rank 1 may not have printed yet)
    assert 1 <= len(lines) <= 2, proc.stderr
    assert all(f"{dump} is in use by another run (pid {os.getpid()}" in line for line in lines), lines
    assert "spider_titan/" not in proc.stderr  # torchrun reports the exit codes; no trainer traceback
    assert not (dump / "config.toml").exists()


@pytest.mark.slow
def test_a_lock_left_by_a_dead_run_is_taken_over_with_a_warning(tmp_path, caplog):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    old = {"pid": int(dead.stdout), "host": "elsewhere", "start_time": "2026-11-23T01:02:03+00:00"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(old))
    with caplog.at_level(logging.WARNING, logger="spider_titan"):
        lock = acquire_run_lock(tmp_path, rank=0, distributed=False)
    assert [r.getMessage() for r in caplog.records] == [
        (
            f"run lock: {tmp_path / LOCK_FILE} was left by a run that ended without releasing it "
            f"(pid {old['pid']} on elsewhere, started 2026-11-23T01:02:03+00:00); taking it over"
        )
    ]
    assert holder_pid(tmp_path) == os.getpid()
    with pytest.raises(RunLockedError, match=f"in use by another run \\(pid {os.getpid()} on "):
        RunLock.acquire(tmp_path)  # held, even against this same process
    lock.release()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    RunLock.acquire(tmp_path).release()  # free again


def test_a_failed_check_gives_the_folder_back(tmp_path):
    def refuse():
        raise ValueError("no")

    with pytest.raises(ValueError, match="^no$"):
        acquire_run_lock(tmp_path, rank=0, distributed=False, checks=[refuse])
    assert not (tmp_path / LOCK_FILE).exists()
    RunLock.acquire(tmp_path).release()


def test_a_run_whose_export_folder_holds_other_files_stops_before_writing(tmp_path, in_process, capsys):
    """checkpoint.export_at_end would replace <dump>/export: refused at start, not after training
    (here a run resumed from its checkpoint, whose export folder someone filled with notes)."""
    dump = tmp_path / "run"
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.last_save_model_only", "false", "--job.dump_folder", str(dump)]
    assert main([*ARGS, *ckpt, "--training.steps", "1"]) == 0
    (dump / "export").mkdir()
    (dump / "export" / "notes.txt").write_text("mine")
    before = {str(p.relative_to(dump)): p.read_bytes() for p in dump.rglob("*") if p.is_file()}
    capsys.readouterr()
    code = main([*ARGS, *ckpt, "--checkpoint.export_at_end", "true", "--training.steps", "2"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    expected = f"error: checkpoint.export_at_end: {dump / 'export'} holds notes.txt, not an export"
    assert lines[0].startswith(expected), lines
    assert {str(p.relative_to(dump)): p.read_bytes() for p in dump.rglob("*") if p.is_file()} == before
