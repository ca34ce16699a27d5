"""SIGTERM / SIGINT on the real command line, at each phase of a run: the final step with a long
validation, a validation mid-run (one process, and two ranks with only one signalled), the
end-of-run export, a save cut short by a second signal, and start-up. Each case times its signal
on the run's own log lines, not on sleeps.

Validation is made long with ``validation.steps`` (thousands of batches, minutes): a run that
ignored the signal there would not end within the seconds these tests allow. The export write and
a save are too short to hit, so those two cases run the real trainer through ``python -c`` with
that one call made to hang (as test_hostile's kill -9 test does); the library has no test hooks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Self

import pytest
import torch

from spider_titan.checkpoint.export import load_export_tensors, read_export_config
from spider_titan.train import main
from tests.integration.test_hostile import MOCK, SPIDER, snapshot
from tests.utils import REPO, check_ok, read_metrics, shown_python

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

LONG_VAL = ["--validation.enable", "true", "--validation.steps", "100000"]  # minutes of validation
CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", "1000"]
# Seconds a test waits for a signalled run to exit: a guard against a hang, not a measure (a step or a
# validation batch takes milliseconds; what the tests check is what the run did and wrote, the long
# validation skipped). Generous, so a loaded machine does not fail a run that stopped correctly.
PROMPT = 300


class Run:
    """The CLI in a subprocess, its stdout and stderr read as they come (threads), so a test can
    wait for a log line and signal the run in the phase that line starts."""

    def __init__(self, args: list[str], *, prefix: list[str] | None = None, env: dict | None = None):
        cmd = [sys.executable, *(prefix or ["-m", "spider_titan.train"]), *args]
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [
            threading.Thread(target=self._read, args=(stream, lines), daemon=True)
            for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream, lines: list[str]) -> None:
        lines.extend(stream)  # line by line, as they come

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait_for(self, text: str, timeout: float = 600) -> None:
        deadline = time.time() + timeout
        while text not in self.stdout:
            assert self.proc.poll() is None, (
                f"exited {self.proc.returncode} before {text!r}:\n{self.stdout[-3000:]}{self.stderr}"
            )
            assert time.time() < deadline, f"no {text!r} within {timeout} s:\n{self.stdout[-3000:]}"
            time.sleep(0.05)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def finish(self, timeout: float = PROMPT) -> int:
        """The exit status (a hang past ``timeout`` seconds fails the test)."""
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self.proc.kill()
        for reader in self.readers:
            reader.join(timeout=10)
        return code

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()


def logged(step: int, total: int) -> str:
    """The start of the log line of training step ``step`` of ``total``."""
    return f"{step}/{total} | elapsed"


def run_here(args: list[str], capsys) -> str:
    """``main(args)`` in this process (no signal handlers; faster than a new interpreter): it must
    succeed; its stdout."""
    capsys.readouterr()
    with torch.random.fork_rng():
        code = main(args)
    out = capsys.readouterr()
    assert code == 0, out.out[-3000:] + out.err
    return out.out


def stderr_lines(run: Run) -> list[str]:
    return [line for line in run.stderr.splitlines() if line.strip()]


def val_rows(dump: Path) -> list[dict]:
    return [row for row in read_metrics(dump) if "val_loss" in row]


def test_sigterm_before_the_last_step_skips_the_long_final_validation_and_resume_finishes_it(
    tmp_path, in_process, capsys
):
    """The signal comes after step 3 of 4 was logged: the last step is trained, its (minutes-long)
    validation and the export are skipped, a full checkpoint at step 4 is saved, exit 143. The same
    command then runs the final validation, final save and export: equal to a run never stopped."""
    dump, ref = tmp_path / "run", tmp_path / "ref"
    common = (
        SPIDER
        + MOCK
        + CKPT
        + ["--training.steps", "4", "--validation.freq", "1000", "--checkpoint.export_at_end", "true"]
    )
    with Run(common + LONG_VAL + ["--job.dump_folder", str(dump)]) as run:
        run.wait_for(logged(3, 4))
        run.signal()
        code = run.finish()
    assert code == 128 + signal.SIGTERM, run.stdout[-3000:] + run.stderr
    # Under load the signal may land after step 4's log line, in the final validation: that one is
    # then abandoned at its first batch; either way the same checkpoint is saved and the resume below
    # runs the end-of-run work.
    stopped = f"SIGTERM: stopped at step 4 with a checkpoint ({dump / 'checkpoint' / 'step-4'}), "
    assert stopped + "the last" in run.stdout or stopped + "during its validation" in run.stdout, run.stdout[-3000:]
    assert not val_rows(dump) and not (dump / "export").exists()
    assert (dump / "checkpoint" / "step-4" / ".metadata").is_file()
    assert "Traceback" not in run.stderr

    # resume (a short validation now: what it measures does not depend on the length it ran before)
    short_val = ["--validation.enable", "true", "--validation.steps", "3"]
    resumed = run_here(common + short_val + ["--job.dump_folder", str(dump)], capsys)
    assert "step 4, the last, is trained: its calibration, validation, final save and export follow" in resumed
    run_here(common + short_val + ["--job.dump_folder", str(ref)], capsys)
    assert [r["val_loss"] for r in val_rows(dump)] == [r["val_loss"] for r in val_rows(ref)]
    assert [r["loss"] for r in read_metrics(dump) if "loss" in r] == [
        r["loss"] for r in read_metrics(ref) if "loss" in r
    ]
    got, want = load_export_tensors(dump / "export"), load_export_tensors(ref / "export")
    assert got.keys() == want.keys() and [k for k in want if not got[k].equal(want[k])] == []


def test_sigterm_during_validation_mid_run_abandons_it_and_saves(tmp_path, in_process, capsys):
    """Validation after step 2 of 6 runs for minutes; a signal there stops it within a batch: no
    val row is written, a checkpoint at step 2 is, exit 143, and the same command resumes at step 3."""
    dump = tmp_path / "run"
    cmd = SPIDER + MOCK + CKPT + ["--training.steps", "6", "--validation.freq", "2", "--job.dump_folder", str(dump)]
    with Run(cmd + LONG_VAL) as run:
        run.wait_for(logged(2, 6))  # the step's log line comes right before its validation
        run.signal()
        code = run.finish()
    assert code == 128 + signal.SIGTERM, run.stdout[-3000:] + run.stderr
    assert "stopped at step 2 with a checkpoint" in run.stdout and "during its validation (not reported)" in run.stdout
    assert not val_rows(dump)
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2"]
    run_here(cmd + ["--validation.enable", "false"], capsys)
    assert [r["step"] for r in read_metrics(dump) if "loss" in r][-4:] == [3, 4, 5, 6]


def worker_pid(launcher: int, rank: int) -> int:
    """The pid of torchrun's worker with ``RANK=rank``."""
    children = [
        int(pid) for task in Path(f"/proc/{launcher}/task").iterdir() for pid in (task / "children").read_text().split()
    ]
    for pid in children:
        if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            return pid
    raise AssertionError(f"no worker with RANK={rank} among {children}")


@pytest.mark.slow
@pytest.mark.skipif(
    not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists(),
    reason="finds torchrun's workers through /proc/<pid>/task/<tid>/children",
)
def test_sigterm_to_one_rank_during_validation_stops_both_at_the_same_batch(tmp_path):
    """Only rank 1 is signalled: the stop flag is all-reduced before every validation batch, so
    rank 0 abandons the same validation, both write the step-2 checkpoint together, both exit 143."""
    dump = tmp_path / "run"
    cmd = (
        SPIDER
        + MOCK
        + CKPT
        + LONG_VAL
        + ["--training.steps", "6", "--validation.freq", "2", "--job.dump_folder", str(dump)]
    )
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "spider_titan.train"]
    with Run(cmd, prefix=torchrun) as run:
        run.wait_for(logged(2, 6))
        os.kill(worker_pid(run.proc.pid, 1), signal.SIGTERM)
        run.finish()
    assert "[rank1]" in run.stdout and "SIGTERM received: stopping" in run.stdout
    assert "[rank0] " in run.stdout and "SIGTERM: stopped at step 2 with a checkpoint" in run.stdout, run.stdout[-3000:]
    assert "exitcode  : 143" in run.stderr, run.stderr[-3000:]  # torchrun's summary of the failed workers
    assert not val_rows(dump)
    assert (dump / "checkpoint" / "step-2" / ".metadata").is_file()


# The real trainer, with a safetensors writer that writes its file and then hangs: the test's
# signal lands inside the export writer, its temporary folder half done.
SLOW_EXPORT_TRAINER = """
import os, sys, time
import safetensors.torch
from spider_titan import train

real_save_file = safetensors.torch.save_file

def save_file(*args, **kwargs):
    real_save_file(*args, **kwargs)
    print("EXPORT WRITING", flush=True)
    time.sleep(float(os.environ.get("EXPORT_HANGS_S", "600")))

safetensors.torch.save_file = save_file
sys.exit(train.main())
"""


@pytest.mark.slow
def test_sigterm_during_the_final_export_exits_0_with_the_checkpoint_and_the_command(tmp_path, in_process, capsys):
    """A finished run interrupted inside its export: exit 0, the final checkpoint saved, one line
    saying the export is incomplete with the command that writes it; the previous export stays
    byte-identical and nothing half-written is left beside it. The command printed then works."""
    dump = tmp_path / "run"
    cmd = (
        SPIDER
        + MOCK
        + CKPT
        + [
            "--checkpoint.export_at_end",
            "true",
            "--checkpoint.last_save_model_only",
            "false",
            "--job.dump_folder",
            str(dump),
        ]
    )
    run_here(cmd + ["--training.steps", "2"], capsys)
    previous = snapshot(dump / "export")
    with Run(cmd + ["--training.steps", "4"], prefix=["-c", SLOW_EXPORT_TRAINER]) as run:
        run.wait_for("EXPORT WRITING")
        run.signal()
        code = run.finish()
    assert code == 0, run.stdout[-3000:] + run.stderr
    final = dump / "checkpoint" / "step-4"
    assert (final / ".metadata").is_file() and (final / "meta.json").is_file()
    lines = [line for line in run.stdout.splitlines() if "export is incomplete" in line]
    assert len(lines) == 1 and str(final) in lines[0], run.stdout[-3000:]
    assert snapshot(dump / "export") == previous
    assert sorted(p.name for p in dump.iterdir() if p.name.startswith("export")) == ["export"]
    assert "Traceback" not in run.stderr, run.stderr

    write = lines[0].split("write it with: ", 1)[1]
    done = subprocess.run(write, shell=True, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    check_ok(done)
    assert read_export_config(dump / "export")["step"] == 4


@pytest.mark.slow  # starts a process
def test_sigterm_during_the_export_without_checkpoints_finishes_it(tmp_path):
    """Checkpoints off (make train's config): the export is all the run keeps, so a SIGTERM inside it
    lets it finish (here it takes 3 s more), and the run ends with 0 and a loadable export."""
    dump = tmp_path / "run"
    cmd = (
        SPIDER + MOCK + ["--checkpoint.export_at_end", "true", "--training.steps", "2", "--job.dump_folder", str(dump)]
    )
    with Run(cmd, prefix=["-c", SLOW_EXPORT_TRAINER], env={"EXPORT_HANGS_S": "3"}) as run:
        run.wait_for("EXPORT WRITING")
        run.signal()
        code = run.finish()
    assert code == 0, run.stdout[-3000:] + run.stderr
    assert "SIGTERM received during the end-of-run export: the export was finished first" in run.stdout
    assert read_export_config(dump / "export")["step"] == 2 and load_export_tensors(dump / "export")
    assert sorted(p.name for p in dump.iterdir() if "export" in p.name) == ["export"]
    assert "Traceback" not in run.stderr, run.stderr


@pytest.mark.slow  # starts a process
def test_sigterm_mid_run_without_checkpoints_exports_the_weights(tmp_path):
    """Checkpoints off: a stop mid-run exports the weights of the step it stopped at (exit 143)."""
    dump = tmp_path / "run"
    cmd = SPIDER + MOCK + ["--checkpoint.export_at_end", "true", "--training.steps", "100000"]
    with Run(cmd + ["--job.dump_folder", str(dump)]) as run:
        run.wait_for(logged(3, 100000))
        run.signal()
        code = run.finish()
    assert code == 128 + signal.SIGTERM, run.stdout[-3000:] + run.stderr
    stopped = max(row["step"] for row in read_metrics(dump))
    assert f"stopped at step {stopped}; its weights are exported to {dump / 'export'}" in run.stdout
    assert read_export_config(dump / "export")["step"] == stopped
    assert stderr_lines(run) == [], run.stderr


# The real trainer, whose last act (collecting the model's reference cycles) hangs until a signal.
SLOW_CLOSE_TRAINER = """
import sys, time, types
from spider_titan import train

def collect():
    print("COLLECTING", flush=True)
    time.sleep(600)

train.gc = types.SimpleNamespace(collect=collect)
sys.exit(train.main())
"""


@pytest.mark.slow  # starts a process
def test_ctrl_c_while_closing_is_one_line(tmp_path):
    """A stop (Ctrl-C), then a second Ctrl-C while the process closes: one line, exit 130, no
    KeyboardInterrupt traceback; the first stop's checkpoint is complete."""
    dump = tmp_path / "run"
    cmd = SPIDER + MOCK + CKPT + ["--training.steps", "100000", "--job.dump_folder", str(dump)]
    with Run(cmd, prefix=["-c", SLOW_CLOSE_TRAINER]) as run:
        run.wait_for(logged(2, 100000))
        run.signal(signal.SIGINT)
        run.wait_for("COLLECTING")
        run.signal(signal.SIGINT)
        code = run.finish()
    assert code == 128 + signal.SIGINT, run.stdout[-3000:] + run.stderr
    assert stderr_lines(run) == ["SIGINT received while closing the run: stopped at once; what it saved is complete"]
    stopped = max(row["step"] for row in read_metrics(dump))
    assert (dump / "checkpoint" / f"step-{stopped}" / ".metadata").is_file()
    assert f"resume with: {shown_python()} -m spider_titan.train " in run.stdout, run.stdout[-2000:]


# The real trainer with a save that writes half a shard and hangs, from its second save on: the
# first signal's stop save hangs there, and the second signal must end the process at once.
SLOW_SAVE_TRAINER = """
import os, sys, time
import torch.distributed.checkpoint as dcp
from spider_titan import train

real_save, calls = dcp.save, []

def save(state_dict, *, checkpoint_id, **kwargs):
    calls.append(checkpoint_id)
    if len(calls) >= 2:
        os.makedirs(checkpoint_id, exist_ok=True)
        with open(os.path.join(checkpoint_id, "__0_0.distcp"), "wb") as f:
            f.write(b"half a shard")
        print("SAVING", flush=True)
        time.sleep(600)
    return real_save(state_dict, checkpoint_id=checkpoint_id, **kwargs)

dcp.save = save
sys.exit(train.main())
"""


def test_a_second_sigterm_exits_at_once_without_a_traceback_and_keeps_the_last_checkpoint(tmp_path, in_process, capsys):
    dump = tmp_path / "run"
    cmd = SPIDER + MOCK + ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--job.dump_folder", str(dump)]
    with Run(cmd + ["--training.steps", "100000"], prefix=["-c", SLOW_SAVE_TRAINER]) as run:
        run.wait_for(f"saved {dump / 'checkpoint' / 'step-2'}")
        kept = snapshot(dump / "checkpoint" / "step-2")
        run.signal()
        run.wait_for("SAVING")  # the stop save (or the next interval's) hangs half-written
        run.signal()
        code = run.finish()
    assert code == 128 + signal.SIGTERM, run.stdout[-3000:] + run.stderr
    lines = stderr_lines(run)
    assert len(lines) == 1 and lines[0].startswith("SIGTERM received again: stopped at once"), run.stderr
    assert str(dump / "checkpoint") in lines[0]
    partial = [p for p in (dump / "checkpoint").iterdir() if ".tmp-" in p.name]
    assert partial, "the save cut short is left as a temporary folder"
    assert snapshot(dump / "checkpoint" / "step-2") == kept

    resumed = run_here(cmd + ["--training.steps", "3"], capsys)
    assert "left by an interrupted save" in resumed
    assert f"from {dump / 'checkpoint' / 'step-2'} (step 2)" in resumed
    assert [r["step"] for r in read_metrics(dump) if "loss" in r][-1] == 3


@pytest.mark.slow  # starts a process
def test_sigint_during_start_up_is_one_line(tmp_path):
    """Ctrl-C while the built-in corpus is being built (a fresh cache): one line, exit 130, no
    traceback, and no half-built corpus left in the cache."""
    cache = tmp_path / "cache"
    args = SPIDER + ["--training.dataset", "builtin", "--job.dump_folder", str(tmp_path / "run")]
    with Run(args, env={"SPIDER_TITAN_CACHE": str(cache)}) as run:
        run.wait_for("building the built-in corpus")
        run.signal(signal.SIGINT)
        code = run.finish()
    assert code == 128 + signal.SIGINT, run.stdout[-3000:] + run.stderr
    lines = stderr_lines(run)
    assert len(lines) == 1 and lines[0].startswith("SIGINT received during start-up"), run.stderr
    assert list(cache.iterdir()) == []
