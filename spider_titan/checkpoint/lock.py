"""One run per dump folder: ``<dump_folder>/.lock``, held with ``flock`` for the run's lifetime.

Two runs in one folder resume from each other's checkpoints, overwrite them and interleave their
metrics, so the trainer takes this lock before it writes anything there and a second run stops at
once with one line naming the holder. The file holds the holder's pid, host and start time (JSON).
The kernel drops a ``flock`` when its process dies (kill -9 included), so a lock file whose flock
is free was left by a run that did not end cleanly: the next run takes it over with a warning.
Released by :meth:`RunLock.release` (``Trainer.close``), or when the object is collected or the
interpreter exits, whichever comes first.

With several ranks, rank 0 alone takes the lock and broadcasts the outcome before any other
collective, so every rank stops with the same message instead of waiting on rank 0.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import torch.distributed as dist

from spider_titan.errors import describe_os_error

LOCK_FILE = ".lock"

logger = logging.getLogger("spider_titan")


class RunLockedError(ValueError):
    """Another live run holds the dump folder: a user error (one line, exit 2)."""


def _holder(text: str) -> str:
    """'pid 123 on host, started <ISO time>' from a lock file's JSON."""
    try:
        info = json.loads(text)
        return f"pid {info['pid']} on {info['host']}, started {info['start_time']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown: the lock file is empty or unreadable, the run may be starting"


def _unlock(path: Path, file: IO[str]) -> None:
    """Delete the lock file (when it is still ours) and close it, which frees the flock."""
    try:
        if os.stat(path).st_ino == os.fstat(file.fileno()).st_ino:
            path.unlink()
    except OSError:
        pass
    file.close()


class RunLock:
    """The held lock of one dump folder (see the module docstring)."""

    def __init__(self, path: Path, file: IO[str]):
        self.path = path
        self._release = weakref.finalize(self, _unlock, path, file)

    @classmethod
    def acquire(cls, folder: Path) -> RunLock:
        """Lock ``folder`` (created if missing); :class:`RunLockedError` naming the holder and the fix."""
        folder = Path(folder)
        path = folder / LOCK_FILE
        while True:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                file = open(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+")  # noqa: SIM115 (held open for the run)
            except OSError as e:
                raise ValueError(f"job.dump_folder: {describe_os_error(e, path)}") from e
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                file.seek(0)
                holder = _holder(file.read())
                file.close()
                raise RunLockedError(
                    f"job.dump_folder: {folder} is in use by another run ({holder}; lock file {path}); "
                    f"wait for it to finish, or give this run its own folder with --job.dump_folder <path>"
                ) from None
            try:  # the holder before us may have deleted the file between our open and our flock
                same = os.stat(path).st_ino == os.fstat(file.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            file.close()
        file.seek(0)
        previous = file.read()
        if previous.strip():
            logger.warning(
                "run lock: %s was left by a run that ended without releasing it (%s); taking it over",
                path,
                _holder(previous),
            )
        file.seek(0)
        file.truncate()
        start = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "start_time": start}) + "\n")
        file.flush()
        return cls(path, file)

    def release(self) -> None:
        """Give the folder back (idempotent)."""
        self._release()


def acquire_run_lock(
    folder: Path, *, rank: int, distributed: bool, checks: Sequence[Callable[[], None]] = ()
) -> RunLock | None:
    """Rank 0 locks ``folder`` and then runs ``checks`` (each raises ValueError for a folder this
    run must not write into); every rank learns the outcome from one broadcast and raises the same
    error. Returns the lock on rank 0, None on the others."""
    lock, error, message = None, None, None
    if rank == 0:
        try:
            lock = RunLock.acquire(folder)
            for check in checks:
                check()
        except Exception as e:  # noqa: BLE001 (whatever it is, the other ranks must hear of it)
            if lock is not None:
                lock.release()
            error, message = e, str(e)
    if distributed:
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    if error is not None:
        raise error
    if message is not None:
        raise RunLockedError(message)
    return lock
