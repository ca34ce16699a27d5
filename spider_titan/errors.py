"""One line for the failures a person fixes outside the code: a full or read-only disk, out of memory.

The trainer's ``main`` and the scripts print :func:`describe_os_error` / :func:`describe_out_of_memory`
instead of a traceback. A failed write often does not reach us as an ``OSError``: torch's zip writer
turns a short write into ``RuntimeError: unexpected pos 704 vs 598``, and DCP wraps every rank's
error in a ``CheckpointException``; safetensors (Rust) raises a ``SafetensorError`` whose text holds
the OS error code ("I/O error: No space left on device (os error 28)"). :func:`find_os_error` looks
through all three, and through the free space left on the disk, to name the cause.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

# errno -> (what happened, what to do; {setting} is the flag or key that names the folder)
_OS_ERRORS = {
    errno.ENOSPC: (
        "no space left on device (ENOSPC)",
        "free space on that disk or set {setting} to a folder on another",
    ),
    errno.EDQUOT: ("disk quota exceeded (EDQUOT)", "free space in your quota or set {setting} to a folder outside it"),
    errno.EROFS: ("read-only file system (EROFS)", "set {setting} to a folder on a writable disk"),
    errno.EACCES: ("permission denied (EACCES)", "make it writable for this user or set {setting} to a folder you own"),
    errno.EPERM: (
        "operation not permitted (EPERM)",
        "make it writable for this user or set {setting} to a folder you own",
    ),
}
# A disk with less than this left after a failed write is taken to be full (the write used up the rest).
FULL_DISK_BYTES = 1 << 20
# Rust's std::io::Error in an exception's text: its Display ("... (os error 28)", safetensors 0.8)
# and its Debug form ("IoError(Os { code: 28, kind: StorageFull, ... })", older safetensors).
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)|\bOs \{ code: (\d+)")


def _chain(e: BaseException):
    """``e``, what it wraps (DCP's per-rank failures, causes, contexts), depth first, each once."""
    seen, stack = set(), [e]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.CheckpointException
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        stack += [e.__context__, e.__cause__]


def free_bytes(path: Path) -> int | None:
    """Bytes this user may still write on the disk holding ``path`` (its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def find_os_error(e: BaseException, path: Path | None = None) -> OSError | None:
    """The OSError (with an errno) behind ``e``; failing that, one with the OS error code that a Rust
    library (safetensors) wrote into its message; failing that, ENOSPC when the disk at ``path`` is
    full (torch reports a short write as "unexpected pos"); None when none of these."""
    chain = list(_chain(e))
    for inner in chain:
        if isinstance(inner, OSError) and inner.errno is not None:
            return inner
    for inner in chain:
        found = _RUST_OS_ERROR.search(str(inner))
        if found:
            code = int(found.group(1) or found.group(2))
            return OSError(code, os.strerror(code), None if path is None else str(path))
    if path is not None:
        free = free_bytes(path)
        if free is not None and free < FULL_DISK_BYTES:
            return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({free} bytes free)", str(path))
    return None


def describe_os_error(e: OSError, path: Path | str | None = None, *, setting: str = "job.dump_folder") -> str:
    """``<path>: <what> (<errno>); <fix>``: ``path`` (else the error's own file name) names the place,
    ``setting`` the flag or config key that chooses it."""
    where = path if path is not None else e.filename
    what, fix = _OS_ERRORS.get(e.errno, (None, None))
    if what is None:
        name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno is not None else type(e).__name__
        what, fix = f"{e.strerror or e} ({name})", "check that folder and its disk, or set {setting} to another"
    return f"{where}: {what}; {fix.format(setting=setting)}"


def is_out_of_memory(e: BaseException) -> bool:
    """torch's ``OutOfMemoryError`` (CUDA), the CPU allocator's "can't allocate memory", MemoryError,
    and a tensor too large to even size ("Storage size calculation overflowed": a model dimension
    in the billions, say)."""
    import torch  # late: the scripts import this module before they need torch

    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(e)
    needles = ("can't allocate memory", "not enough memory", "Storage size calculation overflowed")
    return isinstance(e, RuntimeError) and any(n in text for n in needles)


def describe_out_of_memory(e: BaseException, where: str) -> str:
    """``<where>: out of memory (<first line of torch's message>); <the knobs that need less>``."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    # drop the C++ prefix "[enforce fail at alloc_cpu.cpp:127] err == 0. "
    first = re.sub(r"^\[enforce fail at [^\]]*\][^.]*\.\s*", "", first)
    if len(first) > 160:
        first = first[:157] + "..."
    return (
        f"{where}: out of memory ({first}); use less per step: lower training.local_batch_size (raise "
        "training.gradient_accumulation_steps to keep the batch), set activation_checkpoint.mode = full (or, "
        "compiled, memory_budget with a lower activation_checkpoint.memory_budget: python -m spider_titan.plan "
        "finds one that fits), "
        "shorten training.seq_len, or shard over more ranks (parallelism.data_parallel_shard_degree)"
    )


class StateMismatch(ValueError):
    """Saved state that is intact but was written under other settings than this run's (a data
    loader saved at another seq_len, say): the checkpoint is fine, the run's settings differ."""


class WriteFailed(Exception):
    """A checkpoint or export that could not be written for a reason outside the code; the message
    is the one line to print (what was not written, why, the fix, what is still safe)."""


def describe_failure(e: BaseException, where: str) -> str | None:
    """The one line for a failure a person fixes outside the code (``where``: the step or phase, for
    out of memory), or None for anything else (a bug: let its traceback show)."""
    if isinstance(e, WriteFailed):
        return str(e)
    if is_out_of_memory(e):
        return describe_out_of_memory(e, where)
    if isinstance(e, OSError) and e.errno in _OS_ERRORS:
        return describe_os_error(e)
    return None
