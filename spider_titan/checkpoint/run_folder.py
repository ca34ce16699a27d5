"""A run folder belongs to one run: ``<dump_folder>/run.json`` names it.

The first run in a folder writes ``run.json``: a run id, the hash of its resolved config, when it
started, the files it writes (relative names) and, once it ends, how (``finished`` / ``stopped``)
and at which step. A later start in the same folder (:func:`claim_run_folder`, under the run lock):

- resumes the run when checkpointing is on and a full or unreadable ``step-<N>`` checkpoint is
  there (the checkpointer loads the newest that loads, or refuses; it never trains over them);
- takes the folder over when the earlier run wrote nothing but its config (it stopped at start-up);
- with ``job.overwrite``, deletes the files the earlier run wrote and starts a new run;
- otherwise refuses with one line naming the run and the two ways on.

A non-empty folder without ``run.json`` was not made by this project and is refused whatever the
flags (a folder of checkpoints written before ``run.json`` existed is adopted).
"""

from __future__ import annotations

import datetime
import json
import logging
import shutil
import uuid
from pathlib import Path
from typing import Any

from spider_titan.checkpoint.layout import STEP_RE, is_model_only, read_meta
from spider_titan.checkpoint.lock import LOCK_FILE
from spider_titan.job_config import JobConfig

RUN_FILE = "run.json"
CONFIG_FILE = "config.toml"
EXPORT_FOLDER = "export"

logger = logging.getLogger("spider_titan")


def run_outputs(cfg: JobConfig) -> list[str]:
    """What a run with ``cfg`` may write in its dump folder, as names (or glob patterns) relative to
    it; folders that ``cfg`` puts outside the dump folder are not listed: they are not the folder's."""
    names = [
        CONFIG_FILE,
        "metrics.jsonl",
        "comm_counts.jsonl",
        cfg.metrics.save_tb_folder,
        cfg.checkpoint.folder,
        EXPORT_FOLDER,
        cfg.profiling.save_traces_folder,
    ]
    if not cfg.metrics.rank_0_only:  # every rank logs: metrics_rank<r>.jsonl (and tb/rank_<r>/)
        names.append("metrics_rank*.jsonl")
    return [n for n in dict.fromkeys(names) if _inside(n)]


def _inside(name: str) -> bool:
    """A relative name that stays inside the folder (no absolute path, no ``..``)."""
    path = Path(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts


def read_run(folder: Path) -> dict[str, Any] | None:
    """The folder's ``run.json``, or None when there is none; ValueError when it is unreadable."""
    file = folder / RUN_FILE
    if not file.is_file():
        return None
    try:
        run = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"job.dump_folder: {file} is unreadable ({e}); move it away if the folder's run is gone"
        ) from e
    if not isinstance(run, dict) or not isinstance(run.get("run_id"), str):
        raise ValueError(f"job.dump_folder: {file} is not a spider_titan run record; move it away if that run is gone")
    return run


def write_run_record(folder: Path, run: dict[str, Any]) -> None:
    """Write ``run.json`` whole (a temporary file renamed over it)."""
    tmp = Path(folder) / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(run, indent=1) + "\n")
    tmp.replace(Path(folder) / RUN_FILE)


def _present(folder: Path, names: list[str]) -> list[str]:
    """Those of ``names`` that exist in ``folder`` and hold something (an empty file or folder is nothing)."""
    found = []
    for path in sorted({p for name in names for p in folder.glob(name)}):
        name = str(path.relative_to(folder))
        if path.is_dir() and not path.is_symlink():
            if any(path.iterdir()):
                found.append(name + "/")
        elif path.is_symlink() or path.stat().st_size > 0:
            found.append(name)
    return found


def _resumable(folder: Path, checkpoint_folder: str) -> bool:
    """A ``step-<N>`` checkpoint the checkpointer would try to resume from: a full one, or one whose
    state cannot be read (the checkpointer then says why; nothing trains over it)."""
    root = folder / checkpoint_folder
    if not root.is_dir():
        return False
    return any(STEP_RE.match(p.name) and p.is_dir() and not is_model_only(p) for p in root.iterdir())


def _legacy_run(folder: Path, checkpoint_folder: str) -> bool:
    """A folder written before ``run.json`` existed: its checkpoint folder holds one of our checkpoints."""
    root = folder / checkpoint_folder
    if not root.is_dir():
        return False
    for path in root.iterdir():
        if STEP_RE.match(path.name) and path.is_dir():
            try:
                read_meta(path)
                return True
            except ValueError:
                continue
    return False


def _listing(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _describe(run: dict[str, Any]) -> str:
    """'run 3f2a9c1e (started <ISO time>, finished at step 300)'."""
    if run.get("state") in ("finished", "stopped") and "step" in run:
        end = f"{run['state']} at step {run['step']}"
    else:
        end = "its end not recorded: it crashed, was killed or is from an older version"
    return f"run {run['run_id']} (started {run.get('started', '?')}, {end})"


def claim_run_folder(folder: Path, cfg: JobConfig, *, config_hash: str) -> dict[str, Any]:
    """Make ``folder`` this run's (see the module docstring); the run record, for the caller to write
    (:func:`write_run_record`) once the run has started: a start that fails leaves the folder as it
    was (but for what ``job.overwrite`` deleted). ValueError with one line when the folder holds
    another run or files this project did not write."""
    folder = Path(folder)
    ck = cfg.checkpoint
    run = read_run(folder)
    others = sorted(p.name for p in folder.iterdir() if p.name not in (LOCK_FILE, f".{RUN_FILE}.tmp"))
    if run is None and others:
        if not _legacy_run(folder, ck.folder):
            raise ValueError(
                f"job.dump_folder: {folder} is not empty and was not made by spider_titan (no {RUN_FILE}; it holds "
                f"{_listing(others)}); give this run a new or empty folder with --job.dump_folder <path>"
            )
        run = {"run_id": "unknown", "started": "before run.json", "outputs": run_outputs(cfg)}
        logger.info("run folder: %s holds checkpoints written before %s existed; adopting it", folder, RUN_FILE)
    if run is not None:
        resume = ck.enable and (ck.load_step >= 0 or _resumable(folder, ck.folder)) and not cfg.job.overwrite
        if resume:
            run.update(state="running", config_hash=config_hash, outputs=run_outputs(cfg))
            run.pop("step", None)
            return run
        outputs = [n for n in run.get("outputs", run_outputs(cfg)) if isinstance(n, str) and _inside(n)]
        written = _present(folder, [n for n in outputs if n != CONFIG_FILE])
        if written and not cfg.job.overwrite:
            why = (
                "no full checkpoint to resume from"
                if ck.enable
                else "checkpoint.enable = false, so nothing to resume from"
            )
            raise ValueError(
                f"job.dump_folder: {folder} holds {_describe(run)} with {_listing(written)} and {why}; give this "
                f"run its own folder with --job.dump_folder <path>, or replace that run with --job.overwrite true "
                f"(deletes what it wrote)"
            )
        for name in written:
            path = folder / name.rstrip("/")
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        if written:
            logger.warning("run folder: job.overwrite: deleted %s of %s", _listing(written, 10), _describe(run))
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    run = {
        "run_id": uuid.uuid4().hex[:8],
        "config_hash": config_hash,
        "started": started,
        "state": "running",
        "outputs": run_outputs(cfg),
    }
    return run


def record_run_end(folder: Path, run: dict[str, Any], *, state: str, step: int) -> None:
    """Write how the run ended (``finished`` / ``stopped``) and its last step into ``run.json``."""
    run.update(state=state, step=step)
    try:
        write_run_record(folder, run)
    except OSError as e:  # a full disk at the very end must not hide how the run itself ended
        logger.warning("run folder: could not record the run's end in %s: %s", Path(folder) / RUN_FILE, e)
