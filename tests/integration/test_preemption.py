"""SIGTERM (preemption) mid-run: the step finishes, a checkpoint is written, exit 143, resume works."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.utils import REPO, check_ok, read_metrics, run_train


def test_sigterm_saves_a_checkpoint_and_the_run_resumes(tmp_path):
    dump = tmp_path / "run"
    args = ["--job.config_file", "train_configs/debug_model.toml", "--training.dataset", "mock",
            "--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
            "--validation.enable", "false", "--metrics.enable_tensorboard", "false",
            "--checkpoint.enable", "true", "--checkpoint.interval", "1000", "--checkpoint.export_at_end", "false",
            "--job.dump_folder", str(dump)]
    proc = subprocess.Popen([sys.executable, "-m", "spider_titan.train", *args, "--training.steps", "100000"],
                            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            if (dump / "metrics.jsonl").exists() and len(read_metrics(dump)) >= 3:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    stopped = max(row["step"] for row in read_metrics(dump))
    assert (dump / "checkpoint" / f"step-{stopped}").is_dir(), out[-3000:]
    assert f"stopped at step {stopped} with a checkpoint" in out

    resumed = run_train(args + ["--training.steps", str(stopped + 2)])
    check_ok(resumed)
    steps = [row["step"] for row in read_metrics(dump)]
    assert steps[-2:] == [stopped + 1, stopped + 2]
