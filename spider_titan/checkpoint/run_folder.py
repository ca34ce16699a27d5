"""A run folder belongs to one run: ``<dump_folder>/run.json`` names it.

The first run in a folder writes ``run.json``: a run id, the hash of its resolved config, when it
started, the files it writes (relative names) and, once it ends, how (``finished`` / ``stopped``)
and at which step. A later start in the same folder (:func:`claim_run_folder`, under the run lock):

- resumes the run when checkpointing is on and a full or unreadable ``step-<N>`` checkpoint is
  there (the checkpointer loads the newest that loads, or refuses; it never trains over them);
- starts it again from step 0 when it is a restart of the same launch by torchrun (``--max-restarts``:
  the same ``TORCHELASTIC_RUN_ID`` and config, its end not recorded) before its first full checkpoint;
- takes the folder over when the earlier run wrote nothing but its config (it stopped at start-up);
- with ``job.overwrite``, deletes the files the earlier run wrote and starts a new run;
- otherwise refuses with one line naming the run and the two ways on.

A non-empty folder without ``run.json`` was not made by this project and is refused whatever the
flags (a folder of checkpoints written before ``run.json`` existed is adopted).

What is deleted is named exactly: each entry of ``run.json``'s ``outputs`` is a plain relative name
in the folder (no pattern, no ``..``, no absolute path, not the lock or ``run.json`` itself, not
reached through a symbolic link); a ``run.json`` with any other entry is refused, nothing deleted.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
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


def run_outputs(cfg: JobConfig, world_size: int = 1) -> list[str]:
    """What a run with ``cfg`` on ``world_size`` ranks may write in its dump folder, as exact names
    relative to it; folders that ``cfg`` puts outside the dump folder are not listed: they are not the folder's."""
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
        names += [f"metrics_rank{r}.jsonl" for r in range(world_size)]
    return [n for n in dict.fromkeys(names) if _inside(n)]


def _inside(name: str) -> bool:
    """A relative name that stays inside the folder (no absolute path, no ``..``)."""
    path = Path(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts


# The one pattern earlier versions of this project wrote into run.json, and the names it stood for.
_LEGACY_RANK_METRICS = "metrics_rank*.jsonl"
_RANK_METRICS = re.compile(r"metrics_rank\d+\.jsonl")

# A name run.json may list: the folder's own files (the lock, the record) are never outputs.
_NOT_OUTPUTS = (LOCK_FILE, RUN_FILE, f".{RUN_FILE}.tmp")


def _plain_name_problem(folder: Path, name: Any) -> str | None:
    """Why ``name`` (an entry of run.json's ``outputs``) is not a plain name of something in ``folder``
    that a run wrote, or None when it is one."""
    if not isinstance(name, str) or not name:
        return "not a name"
    if any(c in name for c in "*?[]"):
        return "a pattern, not a name"
    path = Path(name)
    if path.is_absolute() or ".." in path.parts or "." in path.parts or name != path.as_posix():
        return "not a plain relative name inside the folder"
    if path.parts[0] in _NOT_OUTPUTS:
        return "the folder's own lock or run record"
    parent = folder
    for part in path.parts[:-1]:  # a link on the way would lead out of the folder
        parent = parent / part
        if parent.is_symlink():
            return f"reached through the symbolic link {parent}"
    return None


def _outputs(folder: Path, run: dict[str, Any], cfg: JobConfig) -> list[str]:
    """The names run.json says its run wrote; ValueError naming the first entry that is not a plain name."""
    outputs = run.get("outputs", run_outputs(cfg))
    if not isinstance(outputs, list):
        raise ValueError(
            f"job.dump_folder: {folder / RUN_FILE} lists its outputs as a {type(outputs).__name__}, not a list of "
            "names; nothing deleted: fix or move that file away"
        )
    names = []
    for name in outputs:
        if name == _LEGACY_RANK_METRICS:  # written by versions before exact names: the files it stood for
            names += sorted(p.name for p in folder.iterdir() if _RANK_METRICS.fullmatch(p.name))
            continue
        names.append(name)
        problem = _plain_name_problem(folder, name)
        if problem is not None:
            raise ValueError(
                f"job.dump_folder: {folder / RUN_FILE} lists the output {json.dumps(name)}, {problem}; only exact "
                "names of files a run wrote are deleted, so nothing was: fix that entry or move the file away"
            )
    return names


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
    """Those of ``names`` (exact names) that exist in ``folder`` and hold something (an empty file or
    folder is nothing)."""
    found = []
    for name in sorted(set(names)):
        path = folder / name
        if not os.path.lexists(path):
            continue
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


def elastic_launch() -> str | None:
    """The torchrun launch this process belongs to (its ``TORCHELASTIC_RUN_ID``: one per ``torchrun
    --standalone``, the ``--rdzv-id`` with a c10d rendezvous), shared by its restarts; None outside torchrun."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or None


def claim_run_folder(folder: Path, cfg: JobConfig, *, config_hash: str, world_size: int = 1) -> dict[str, Any]:
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
        run = {"run_id": "unknown", "started": "before run.json", "outputs": run_outputs(cfg, world_size)}
        logger.info("run folder: %s holds checkpoints written before %s existed; adopting it", folder, RUN_FILE)
    if run is not None:
        resume = ck.enable and (ck.load_step >= 0 or _resumable(folder, ck.folder)) and not cfg.job.overwrite
        if resume:  # what it wrote before stays listed (another world size wrote other rank files)
            outputs = [*_outputs(folder, run, cfg), *run_outputs(cfg, world_size)]
            run.update(state="running", config_hash=config_hash, outputs=list(dict.fromkeys(outputs)))
            run.pop("step", None)
            run.pop("launch", None)
            if elastic_launch() is not None:
                run["launch"] = elastic_launch()
            return run
        outputs = _outputs(folder, run, cfg)
        written = _present(folder, [n for n in outputs if n != CONFIG_FILE])
        # torchrun restarting this very launch before its first full checkpoint: the same run, again from step 0
        restart = (
            run.get("state") == "running"
            and elastic_launch() is not None
            and run.get("launch") == elastic_launch()
            and run.get("config_hash") == config_hash
        )
        if restart:
            for name in written:
                path = folder / name.rstrip("/")
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            logger.warning(
                "run folder: torchrun restarted run %s before its first full checkpoint: it starts again from step 0%s",
                run["run_id"],
                f" (deleted {_listing(written, 10)})" if written else "",
            )
            run.update(outputs=run_outputs(cfg, world_size))
            return run
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
        "outputs": run_outputs(cfg, world_size),
    }
    if elastic_launch() is not None:
        run["launch"] = elastic_launch()
    return run


def record_run_end(folder: Path, run: dict[str, Any], *, state: str, step: int) -> None:
    """Write how the run ended (``finished`` / ``stopped``) and its last step into ``run.json``."""
    run.update(state=state, step=step)
    try:
        write_run_record(folder, run)
    except OSError as e:  # a full disk at the very end must not hide how the run itself ended
        logger.warning("run folder: could not record the run's end in %s: %s", Path(folder) / RUN_FILE, e)
