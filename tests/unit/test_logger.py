"""Console lines: the step line and its continuation lines fit 160 columns, counters stay in the
files; printed commands name this interpreter and paths that work from the current folder."""

from __future__ import annotations

import errno
import json
import os
import shlex
import sys
from pathlib import Path

import pytest

from spider_titan.metrics.logger import CONSOLE_WIDTH, ConsoleLogger, shell_command

PREFIX = len("[rank0] 20:04:15 ")


def test_a_step_with_many_figures_is_split_into_short_lines():
    scalars = {
        "loss": 3.0466,
        "bpb": 4.3954,
        "lr": 2.82e-3,
        "grad_norm": 0.2543,
        "tokens_per_s": 10128.0,
        "tflops": 0.0364,
        "memory_gib": 0.57,
        "elapsed_s": 15.0,
        "eta_s": 46.0,
        "total_steps": 300,
        "tokens_seen": 153600,
        "train_flops": 5.369e11,
        "flops_per_byte": 3.577e6,
    }
    figures = {f"model_figure_{i}": i / 7 for i in range(12)}
    lines = ConsoleLogger().lines(75, {**scalars, **figures})
    gpu = ConsoleLogger().lines(75, {**scalars, "mfu": 0.412})  # the core fields wrap too
    assert gpu[0].endswith("| mfu 41.2%") and gpu[1:] == ["    mem 0.57GiB"]
    assert lines[0] == (
        "step  75/300 | elapsed 15s | eta 46s | loss 3.0466 | bpb 4.3954 | lr 2.82e-03 | "
        "grad_norm 0.2543 | tok/s 10,128 | tflops 0.0364 | mem 0.57GiB"
    )
    assert all(len(line) <= CONSOLE_WIDTH for line in lines) and PREFIX + CONSOLE_WIDTH <= 160
    assert len(lines) > 2 and all(line.startswith("    model_figure_") for line in lines[1:])
    shown = " | ".join(lines)
    assert all(f"{key} {value:.4f}" in shown for key, value in figures.items())  # every figure, in order
    assert [part.split()[0] for part in " | ".join(x.strip() for x in lines[1:]).split(" | ")] == sorted(figures)
    for counter in ("tokens_seen", "train_flops", "flops_per_byte", "total_steps"):
        assert counter not in shown


def test_a_validation_line_has_the_step_total_and_eta():
    val = {
        "val_loss": 2.9865,
        "val_bpb": 4.3086,
        "val_loss_loops1": 2.9862,
        "val_bpb_loops1": 4.3082,
        "val_mean_loops": 2.0,
        "elapsed_s": 21.0,
        "eta_s": 41.0,
        "total_steps": 300,
        "tokens_seen": 1,
        "train_flops": 7.2e11,
    }
    lines = ConsoleLogger().lines(100, val)
    assert lines == [
        "step 100/300 | elapsed 21s | eta 41s | val_loss 2.9865 | val_bpb 4.3086",
        "    val_bpb_loops1 4.3082 | val_mean_loops 2.0000",
    ]  # a variant's loss is its bpb x ln 2


def test_shell_command_names_paths_that_work_from_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    inside = tmp_path / ".venv" / "bin" / "python"
    outside = Path("/opt/other env/bin/python")
    assert shell_command(inside, tmp_path / "scripts" / "plot.py", Path("out dir")) == (
        ".venv/bin/python scripts/plot.py 'out dir'"
    )
    assert shell_command(outside, "--prompt", "def ") == "'/opt/other env/bin/python' --prompt 'def '"
    assert shlex.split(shell_command(Path(sys.executable), "-c", "pass"))[0] == sys.executable


def test_jsonl_logger_writes_nothing_until_its_first_row_and_never_glues_to_a_cut_row(tmp_path):
    """No file until the first row (a start refused before logging leaves none); appended to a file
    whose last row a crash cut short, the new row starts a line of its own."""
    from spider_titan.metrics.logger import JsonlLogger

    path = tmp_path / "metrics.jsonl"
    logger = JsonlLogger(path)
    assert not path.exists()
    logger.log(1, {"loss": 2.0})
    logger.close()
    with path.open("a") as f:
        f.write('{"step": 2, "lo')  # the crash
    again = JsonlLogger(path)
    again.log(2, {"loss": 1.5})
    again.close()
    assert path.read_text().splitlines() == ['{"step": 1, "loss": 2.0}', '{"step": 2, "lo', '{"step": 2, "loss": 1.5}']


class _FillsUp:
    """A file whose writes stop after ``room`` bytes: the one that crosses it is cut short (a short
    write, as a disk that fills up mid-row gives), the next raises ``err``."""

    def __init__(self, f, room: int, err: int):
        self.f, self.room, self.err = f, room, err

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if self.room <= 0:
            raise OSError(self.err, os.strerror(self.err))
        n = self.f.write(data[: self.room])
        self.room -= n
        return n

    def __getattr__(self, name):
        return getattr(self.f, name)


@pytest.mark.parametrize(
    "err, named", [(errno.ENOSPC, "no space left on device (ENOSPC)"), (errno.EDQUOT, "disk quota exceeded (EDQUOT)")]
)
def test_a_row_that_does_not_fit_is_cut_back_and_named_in_one_line(err, named, tmp_path, monkeypatch):
    """The disk fills up in the middle of a row: the file ends with the last whole row (no torn one),
    the error is one line naming the file and the step, and later rows (the trainer's close) write
    nothing instead of failing again."""
    from spider_titan.errors import WriteFailed
    from spider_titan.metrics import logger as logger_module
    from spider_titan.metrics.logger import JsonlLogger

    path = tmp_path / "metrics.jsonl"
    log = JsonlLogger(path)
    log.log(1, {"loss": 2.0})
    log.close()
    whole = path.read_bytes()
    monkeypatch.setattr(logger_module, "open", lambda *a, **k: _FillsUp(open(*a, **k), 30, err), raising=False)
    log = JsonlLogger(path)
    log.log(2, {"loss": 1.5})  # 25 bytes: fits
    with pytest.raises(WriteFailed) as e:
        log.log(3, {"loss": 1.25, "bpb": 1.8})  # crosses the end of the room
    assert str(e.value).startswith(f"metrics of step 3 not written: {path}: {named}"), e.value
    assert "\n" not in str(e.value)
    log.log(4, {"loss": 1.0})
    log.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert path.read_bytes().startswith(whole) and [r["step"] for r in rows] == [1, 2]
