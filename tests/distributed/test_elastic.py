"""A lost rank under torchrun's elastic agent (``--max-restarts``): 2 CPU ranks on gloo.

A rank killed with SIGKILL between two checkpoints makes torchrun restart the job, which resumes
from the newest complete checkpoint and ends with the weights of a run that was never interrupted,
bit for bit; with the rendezvous's own store shared with the workers (torchrun's default,
pytorch/pytorch#135712) and with a fresh store per restart (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
what scripts/run_train.sh sets), standalone and through a c10d rendezvous. A rank stopped with SIGSTOP
makes the other give up after ``comm.train_timeout_seconds`` with one line naming the step and what
it waited on; torchrun then restarts the job from the newest checkpoint.

The fault comes from inside the rank (a launcher wraps ``Trainer.train_step``), at a chosen step of the
first start only, so it lands at the same step however loaded the machine is.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spider_titan.checkpoint.export import load_export_tensors, read_export_config
from tests.utils import REPO, read_metrics, tiny_run

pytestmark = pytest.mark.slow

# train.main() as the command line runs it; on rank FAULT_RANK, in the first start only
# (TORCHELASTIC_RESTART_COUNT 0), the signal FAULT_SIGNAL just before step FAULT_STEP. The time of the
# fault and of the first step of each later start go to TIMES_DIR (for the figures the docs quote).
LAUNCHER = """\
import json, os, signal, sys, time
from pathlib import Path
from spider_titan import train

fault_step = int(os.environ.get("FAULT_STEP", "0"))
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
times = Path(os.environ["TIMES_DIR"]) if os.environ.get("TIMES_DIR") else None
real = train.Trainer.train_step
first = []

def train_step(self, micro_batches, step):
    if restart == 0 and fault_step and step == fault_step and os.environ["RANK"] == os.environ["FAULT_RANK"]:
        if times is not None:
            (times / "fault.json").write_text(json.dumps({"time": time.time(), "step": step}))
        os.kill(os.getpid(), getattr(signal, os.environ["FAULT_SIGNAL"]))
    if restart > 0 and not first and times is not None and os.environ["RANK"] == "0":
        first.append(step)
        (times / f"restart{restart}.json").write_text(json.dumps({"time": time.time(), "step": step}))
    return real(self, micro_batches, step)

train.Trainer.train_step = train_step
sys.exit(train.main())
"""

STEPS, INTERVAL = 6, 3
ARGS = tiny_run(
    training__steps=STEPS, checkpoint__enable=True, checkpoint__interval=INTERVAL, checkpoint__export_at_end=True
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(
    tmp_path: Path, dump: Path, *, rendezvous: str = "standalone", max_restarts: int = 1, env=None, extra=()
) -> tuple[subprocess.CompletedProcess, float]:
    """The launcher under torchrun on 2 ranks; (the finished process, its seconds)."""
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER)
    if rendezvous == "standalone":
        launch = ["--standalone"]
    else:
        endpoint = f"127.0.0.1:{free_port()}"
        launch = ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", tmp_path.name]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launch,
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(max_restarts),
        str(launcher),
        *ARGS,
        *extra,
        "--job.dump_folder",
        str(dump),
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TIMES_DIR": str(tmp_path)}
    full_env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env={**full_env, **(env or {})})
    return proc, time.time() - t0


def report(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-5000:]}\nSTDERR:\n{proc.stderr[-5000:]}"


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]


def restart_figures(tmp_path: Path) -> str:
    fault = json.loads((tmp_path / "fault.json").read_text())
    back = json.loads((tmp_path / "restart1.json").read_text())
    return (
        f"fault before step {fault['step']}, first step after the restart: {back['step']} "
        f"({back['time'] - fault['time']:.1f} s later)"
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The same run on 2 ranks, never interrupted: the weights every restarted run must end with."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    proc, _ = torchrun(tmp, tmp / "run", max_restarts=0)
    assert proc.returncode == 0, report(proc)
    return tmp / "run"


@pytest.mark.parametrize(
    "rendezvous, fresh_store",
    [("standalone", False), ("c10d", True)],
    ids=["standalone-shared-store", "c10d-fresh-store"],
)
def test_sigkill_of_a_rank_restarts_and_ends_with_the_uninterrupted_weights(
    rendezvous, fresh_store, tmp_path, uninterrupted, capsys
):
    """Rank 1 is killed (SIGKILL) just before step 5, two steps past checkpoint step-3: torchrun
    restarts both ranks, they resume from step-3 and finish; exit 0, no traceback, and the export
    equals the uninterrupted run's exactly."""
    dump = tmp_path / "run"
    env = {"FAULT_STEP": "5", "FAULT_RANK": "1", "FAULT_SIGNAL": "SIGKILL"}
    if fresh_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    proc, _ = torchrun(tmp_path, dump, rendezvous=rendezvous, env=env)
    assert proc.returncode == 0, report(proc)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, report(proc)
    assert f"from {dump / 'checkpoint' / 'step-3'} (step 3)" in out, report(proc)
    # rank 0 saw its peer go, in step 5, and said so in one line
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: stopped at step 4"), lines
    assert "another rank is gone" in lines[0] and "step 5's collectives" in lines[0], lines
    assert f"the newest complete checkpoint is {dump / 'checkpoint' / 'step-3'}" in lines[0], lines
    assert "while closing" not in out
    assert read_export_config(dump / "export")["step"] == STEPS
    got, want = load_export_tensors(dump / "export"), load_export_tensors(uninterrupted / "export")
    assert got.keys() == want.keys() and [k for k in want if not got[k].equal(want[k])] == []
    losses = {r["step"]: r["loss"] for r in read_metrics(dump) if "loss" in r}  # the last row of each step
    assert losses == {r["step"]: r["loss"] for r in read_metrics(uninterrupted) if "loss" in r}
    with capsys.disabled():
        print(f"\n[{rendezvous}] {restart_figures(tmp_path)}; 1 step recomputed (step 4)")


def test_sigstop_of_a_rank_ends_the_others_within_the_timeout_in_one_line(tmp_path, capsys):
    """Rank 1 stops (SIGSTOP) before step 5: rank 0 waits comm.train_timeout_seconds in step 5's
    collectives, then stops with one line naming the step, what it waited on and the checkpoint kept;
    torchrun ends the stopped rank and restarts the job, which resumes from step-3 and finishes."""
    dump = tmp_path / "run"
    env = {"FAULT_STEP": "5", "FAULT_RANK": "1", "FAULT_SIGNAL": "SIGSTOP"}
    timeouts = ["--comm.train_timeout_seconds", "5", "--comm.init_timeout_seconds", "120"]
    proc, took = torchrun(tmp_path, dump, env=env, extra=timeouts)
    assert proc.returncode == 0, report(proc)
    lines = error_lines(proc)
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: rank 0: stopped at step 4, waiting in step 5's collectives"), lines
    assert "no answer from another rank within comm.train_timeout_seconds = 5 s" in lines[0], lines
    assert f"the newest complete checkpoint is {dump / 'checkpoint' / 'step-3'}" in lines[0], lines
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, report(proc)
    assert f"from {dump / 'checkpoint' / 'step-3'} (step 3)" in out, report(proc)
    assert read_export_config(dump / "export")["step"] == STEPS
    with capsys.disabled():
        print(f"\n[sigstop] {restart_figures(tmp_path)}; whole job {took:.0f} s")


def test_a_failed_job_names_the_rank_that_failed_first(tmp_path):
    """No restart left (--max-restarts 0): rank 1 killed before step 3 ends the job with exit 1. Rank
    0's one line says its rank, its step and that a peer is gone; torchrun's summary, the job's last
    lines, names rank 1 as the first failure (its "Root Cause"), so the trainer adds nothing after it."""
    dump = tmp_path / "run"
    env = {"FAULT_STEP": "3", "FAULT_RANK": "1", "FAULT_SIGNAL": "SIGKILL"}
    proc, _ = torchrun(tmp_path, dump, max_restarts=0, env=env, extra=["--checkpoint.interval", "2"])
    assert proc.returncode == 1, report(proc)
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: stopped at step 2"), lines
    assert "another rank is gone" in lines[0] and str(dump / "checkpoint" / "step-2") in lines[0], lines
    summary = proc.stderr[proc.stderr.rindex("Root Cause (first observed failure)") :]
    assert "rank      : 1 (local_rank: 1)" in summary and "SIGKILL" in summary, summary
    assert summary.rstrip().endswith("=" * 60), summary
