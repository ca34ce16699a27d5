"""Metric loggers: one console line per ``metrics.log_freq`` steps and the same scalars to TensorBoard.

A logger backend is anything with ``log(step, scalars)`` and ``close()``; the trainer holds a
:class:`MetricLogger` fanning out to the backends the config enabled (registry kind
``metric_logger``). Throughput, MFU and memory helpers live here too.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import shlex
import sys
import time
from pathlib import Path

import torch

from spider_titan.errors import WriteFailed, describe_os_error
from spider_titan.job_config import Metrics
from spider_titan.protocol import FLOPS_PER_BYTE

logger = logging.getLogger("spider_titan")

# Dense bf16 peak TFLOP/s by device name substring, for MFU (vendor datasheets, no sparsity).
_PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "B200": 2250.0, "A100": 312.0, "L40S": 362.0, "4090": 165.0}

# Console: these fields first, in this order, on the step line; the rest (the model's own figures)
# on indented lines below it, packed to at most CONSOLE_WIDTH characters each.
_CONSOLE_ORDER = (
    "elapsed_s",
    "eta_s",
    "loss",
    "bpb",
    "val_loss",
    "val_bpb",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "tflops",
    "mfu",
    "memory_gib",
)
CONSOLE_WIDTH = 143  # + the 17-character "[rank0] HH:MM:SS " prefix: a line fits 160 columns


def setup_logging(rank: int) -> None:
    """One stream handler for the package logger; ranks other than 0 only log warnings."""
    log = logging.getLogger("spider_titan")
    if log.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"[rank{rank}] %(asctime)s %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of ``device`` when known (None on CPU and unknown GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in _PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def memory_gib(device: torch.device) -> float:
    """Peak memory: CUDA max allocated, or this process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``: short and fixed-width enough for progress lines."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _fmt(key: str, value: float) -> str:
    if key == "lr":
        return f"{key} {value:.2e}"
    if key == "tokens_per_s":
        return f"tok/s {value:,.0f}"
    if key == "memory_gib":
        return f"mem {value:.2f}GiB"
    if key == "mfu":
        return f"mfu {100 * value:.1f}%"
    if key == "elapsed_s":
        return f"elapsed {format_duration(value)}"
    if key == "eta_s":
        return f"eta {format_duration(value)}"
    if isinstance(value, float) and (abs(value) >= 1e4 or (value != 0 and abs(value) < 1e-3)):
        return f"{key} {value:.3e}"
    return f"{key} {value:.4f}" if isinstance(value, float) else f"{key} {value}"


def _pack(parts: list[str], *, indent_first: bool) -> list[str]:
    """``parts`` joined by `` | `` into lines of at most CONSOLE_WIDTH characters, the lines after
    the first (and the first with ``indent_first``) indented under the step line."""
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + 3 + len(part) <= CONSOLE_WIDTH:
            lines[-1] += " | " + part
        else:
            lines.append(("    " if lines or indent_first else "") + part)
    return lines


class ConsoleLogger:
    """``step N/total | elapsed | eta | loss ...``, then the model's own figures on indented lines
    under it. Counters meant for plots (tokens seen, cumulative and per-byte FLOPs) are left to
    metrics.jsonl and TensorBoard."""

    hidden = ("total_steps", "tokens_seen", "train_flops", FLOPS_PER_BYTE, f"val_{FLOPS_PER_BYTE}")

    def lines(self, step: int, scalars: dict[str, float]) -> list[str]:
        """The console lines for one log call, none longer than ``CONSOLE_WIDTH``."""
        first = [k for k in _CONSOLE_ORDER if k in scalars]
        # a variant's val_loss is its val_bpb times ln 2: the console shows the bpb only
        rest = sorted(
            k
            for k in scalars
            if k not in _CONSOLE_ORDER
            and k not in self.hidden
            and not (k.startswith("val_loss_") and "val_bpb_" + k[len("val_loss_") :] in scalars)
        )
        total = scalars.get("total_steps")
        head = f"step {step:>{len(str(int(total)))}}/{int(total)}" if total else f"step {step}"
        return _pack([head] + [_fmt(k, scalars[k]) for k in first], indent_first=False) + _pack(
            [_fmt(k, scalars[k]) for k in rest], indent_first=True
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for line in self.lines(step, scalars):
            logger.info(line)

    def close(self) -> None:
        pass


def shell_command(*args: str | Path) -> str:
    """A command line that works when pasted in the current folder: paths inside it are shown
    relative to it (``.venv/bin/python scripts/plot.py outputs/run``), others absolute, each
    quoted for the shell. Pass ``sys.executable`` first so the interpreter that runs this program
    (a venv's, with torch) is the one named, not whatever ``python`` is first on PATH."""
    cwd = Path.cwd()
    shown = []
    for arg in args:
        if isinstance(arg, Path):
            path = Path(os.path.abspath(arg))
            arg = str(path.relative_to(cwd)) if path.is_relative_to(cwd) else str(path)
        shown.append(arg)
    return shlex.join(shown)


class TensorBoardLogger:
    """TensorBoard scalars under ``log_dir``; its event file is created by the first log, so a run
    that stops before logging leaves no file behind."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.writer = None
        logger.info("TensorBoard: %s", log_dir)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.log_dir))
        for key, value in scalars.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(key.replace(".", "/"), value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _ends_mid_line(path: Path) -> bool:
    """Whether ``path`` exists, is not empty and does not end with a newline."""
    try:
        with path.open("rb") as f:
            if f.seek(0, 2) == 0:
                return False
            f.seek(-1, 2)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


class JsonlLogger:
    """One JSON object per logged step in ``metrics.jsonl`` (easy to plot or compare runs with),
    opened for appending at the first log (a resumed run continues the file).

    A row is written whole or not at all: a write that fails part-way (a full disk, a quota) is cut
    back to the end of the previous row and raises :class:`~spider_titan.errors.WriteFailed` with one
    line naming the file; the logger writes nothing after that."""

    def __init__(self, path: Path):
        self.path = path
        self.file = None
        self.failed = False

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if self.failed:
            return
        row = (json.dumps({"step": step, **scalars}) + "\n").encode()
        try:
            if self.file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                cut = _ends_mid_line(self.path)
                self.file = open(self.path, "ab", buffering=0)  # unbuffered: each row reaches the file at once
                if cut:  # a row cut short by a crash stays a line of its own
                    row = b"\n" + row
            end = os.fstat(self.file.fileno()).st_size
            _write_all(self.file, row, end)
        except OSError as e:
            self.failed = True
            raise WriteFailed(
                f"metrics of step {step} not written: {describe_os_error(e, self.path)}; the rows before it "
                "are complete"
            ) from e

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _write_all(file, data: bytes, end: int) -> None:
    """Write all of ``data`` at the end of ``file`` (at ``end``), or cut the file back to ``end`` and re-raise."""
    view = memoryview(data)
    try:
        while view:
            view = view[file.write(view) :]
    except OSError:
        try:
            os.ftruncate(file.fileno(), end)  # needs no space: the torn row goes, the rows before it stay
        except OSError:
            pass
        raise


def build_jsonl_logger(cfg: Metrics, *, log_dir: Path, rank: int) -> JsonlLogger:
    return JsonlLogger(log_dir / ("metrics.jsonl" if cfg.rank_0_only else f"metrics_rank{rank}.jsonl"))


def build_console_logger(cfg: Metrics, *, log_dir: Path, rank: int) -> ConsoleLogger:
    return ConsoleLogger()


def build_tensorboard_logger(cfg: Metrics, *, log_dir: Path, rank: int) -> TensorBoardLogger:
    return TensorBoardLogger(log_dir / (f"rank_{rank}" if not cfg.rank_0_only else ""))


class MetricLogger:
    """Fans scalars out to the enabled backends; a no-op on ranks that don't log."""

    def __init__(self, backends: list):
        self.backends = backends

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for b in self.backends:
            b.log(step, scalars)

    def close(self) -> None:
        for b in self.backends:
            b.close()


class Throughput:
    """Tokens/s and step time between two log points (wall clock, after a device sync)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.steps = 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens
        self.steps += 1

    def rates(self) -> tuple[float, float]:
        """(tokens per second, seconds per step) since the last reset."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = max(time.perf_counter() - self.t0, 1e-9)
        return self.tokens / dt, dt / max(self.steps, 1)
