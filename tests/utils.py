"""Helpers to run the trainer's CLI in subprocesses and read what it logged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

DEBUG_SPIDER = "train_configs/debug_model.toml"
DEBUG_DENSE = "train_configs/debug_dense.toml"

# The tests' shared tiny run: the debug Spider on mock data, 2 steps of 2 samples of 64 bytes, every
# step logged, no validation, no TensorBoard, no export at the end: nothing but metrics.jsonl written
# (and config.toml). The smallest real run, for tests of the loop around the model. tiny_run() turns
# it into trainer flags; a test that needs another value names it there (tiny_run(training__steps=5)).
TINY_RUN: dict[str, object] = {
    "job.config_file": DEBUG_SPIDER,
    "training.dataset": "mock",
    "training.steps": 2,
    "training.seq_len": 64,
    "training.local_batch_size": 2,
    "metrics.log_freq": 1,
    "metrics.enable_tensorboard": False,
    "validation.enable": False,
    "checkpoint.export_at_end": False,
}


# For a compiled run whose test reads no kernel launches (graph breaks, recompiles, compiled against eager):
# inductor's C++ wrapper, which builds a graph's kernels and its wrapper as one C++ module, one g++ call,
# where the Python wrapper builds one module per kernel (about 1 s each on the 2-core machine, mostly loading
# the precompiled header). The kernels are the same; a launch count needs the Python wrapper, whose calls
# the profiler sees (lab/bench/launches.py), and the expert-parallel graphs need it too (the C++ wrapper
# cannot call the dispatch's custom op: "arg type Any is not yet supported"). Measured (2026-12-02, 2 cores,
# cold cache): the torch compiled-against-eager case 92 s against 67 s wall, 74 against 61 CPU-seconds.
ONE_MODULE_PER_GRAPH = {"TORCHINDUCTOR_CPP_WRAPPER": "1"}


def flag_value(value: object) -> str:
    """A Python value as the trainer's CLI spells it: ``true``/``false`` for a bool, else ``str``."""
    return str(value).lower() if isinstance(value, bool) else str(value)


# One block structure for the compile tests: a single core block, no byte blocks around it, no Engram and no
# byte n-grams; inductor builds one set of kernels where the debug model's five blocks take three or four.
# The whole debug model compiles in tests/integration/test_recompiles.py. Keys as tiny_run() takes them, so
# a test adds what it varies: tiny_run(**ONE_BLOCK, moe__backend="triton"), or as bare flags: flags(**ONE_BLOCK).
ONE_BLOCK: dict[str, object] = {
    "model__n_prelude": 0,
    "model__n_core": 1,
    "model__n_coda": 0,
    "model__engram_layers": [],
    "model__byte_ngram_orders": [],
}


def flags(**settings: object) -> list[str]:
    """``section__key=value`` settings as trainer flags (``--section.key value``), in their order."""
    return _as_flags(_merged({}, settings, "flags"))


def tiny_run(**overrides: object) -> list[str]:
    """The trainer flags of :data:`TINY_RUN` with ``overrides`` applied, each given as
    ``section__key=value`` (``training__steps=5``, ``job__config_file=DEBUG_DENSE``): a key of the
    tiny run takes the new value in place, a new key is added after them, and ``None`` drops a key
    (the TOML's value then holds: ``training__dataset=None`` trains on the config's corpus). The
    result is a fresh list, so a test may append flags of its own."""
    if overrides.get("job__config_file", DEBUG_SPIDER) is None:
        raise TypeError("tiny_run: a tiny run needs a config file (job__config_file=DEBUG_DENSE)")
    return _as_flags(_merged(TINY_RUN, overrides, "tiny_run"))


def _merged(base: dict[str, object], overrides: dict[str, object], caller: str) -> dict[str, object]:
    """``base`` (dotted keys) with ``overrides`` (``section__key``) set in place or added; ``None`` drops a key."""
    settings = dict(base)
    for name, value in overrides.items():
        section, sep, key = name.partition("__")
        if not sep or not key:
            raise TypeError(f"{caller}: {name!r} is not section__key (e.g. training__steps=5)")
        if value is None:
            settings.pop(f"{section}.{key}", None)
        else:
            settings[f"{section}.{key}"] = value
    return settings


def _as_flags(settings: dict[str, object]) -> list[str]:
    return [part for dotted, value in settings.items() for part in (f"--{dotted}", flag_value(value))]


def run_train(
    args: list[str],
    *,
    nprocs: int = 1,
    timeout: int = 600,
    env: dict | None = None,
    script: Path | None = None,
) -> subprocess.CompletedProcess:
    """``python -m spider_titan.train ARGS`` (under torchrun when nprocs > 1); output captured.
    ``script``: a launcher run in its place (one that patches something, then calls ``train.main``)."""
    program = [str(script)] if script is not None else ["-m", "spider_titan.train"]
    if nprocs > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}"]
    else:
        cmd = [sys.executable]
    cmd += [*program, *args]
    # A script's own folder, not the repository, heads its sys.path: it imports the project from REPO.
    path = {"PYTHONPATH": str(REPO)} if script is not None else {}
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **path, **(env or {})}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)


def shown_python() -> str:
    """This interpreter as the trainer's printed commands name it from the repository root
    (metrics.logger.shell_command): relative inside the repository, else absolute."""
    python = Path(os.path.abspath(sys.executable))
    return str(python.relative_to(REPO) if python.is_relative_to(REPO) else python)


def read_metrics(dump_folder: Path) -> list[dict]:
    """The rows of ``metrics.jsonl`` a run wrote (training steps and validation rows)."""
    path = Path(dump_folder) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_losses(dump_folder: Path) -> dict[int, float]:
    """step -> training loss, from ``metrics.jsonl``."""
    return {row["step"]: row["loss"] for row in read_metrics(dump_folder) if "loss" in row}


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    )
