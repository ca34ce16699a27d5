"""What the product's scripts share on their command line: argparse mistakes in one line, output paths
checked before any work, files written whole or not at all, and a quiet end on a closed or full stdout.

A script builds its parser with :class:`ArgumentParser` (a wrong flag or value is ``prog: error: ...``
on one line, exit 2, instead of the usage block), checks every output with :func:`check_output_file` /
:func:`check_output_folder` before it reads or computes anything, writes a file through
:func:`replace_file` (a temporary sibling renamed over the target once complete), and runs its ``main``
under :func:`quiet_stdout_errors`.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line: ``prog: error: <what>; see prog --help`` and exit 2."""

    def error(self, message: str):  # argparse's own wording of the flag and value, without the usage block
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def at_least(low: int | float, flag: str, value: int | float, what: str = "") -> None:
    """ValueError ``--flag V: must be >= low`` (with ``what`` it takes) unless ``value >= low``."""
    if not value >= low:  # also refuses NaN
        raise ValueError(f"{flag} {value}: must be >= {low}{f' ({what})' if what else ''}")


def same_path(a: str | Path, b: str | Path) -> bool:
    """Whether ``a`` and ``b`` name the same file or folder (through links, ``..`` and relative paths)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist: compare the names the OS would resolve
        return os.path.realpath(a) == os.path.realpath(b)


def inside(path: str | Path, folder: str | Path) -> bool:
    """Whether ``path`` is ``folder`` or lies somewhere under it."""
    path, folder = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    return path == folder or folder in path.parents


def _can_make_in(out: Path, flag: str) -> None:
    """ValueError (one line) unless the folder ``out`` goes in exists or can be made: the nearest existing
    folder on its path is a folder (not a file) that this user may create entries in."""
    nearest = out.parent if str(out.parent) else Path(".")
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    if not nearest.is_dir():
        raise ValueError(f"{flag} {out}: {nearest} is a file, not a folder; choose a path in a folder")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ValueError(
            f"{flag} {out}: cannot write in {nearest} (permission denied); choose a folder you can write to"
        )


def check_output_file(out: str | Path, flag: str, inputs: Iterable[str | Path] = ()) -> Path:
    """``out`` as a Path, or ValueError in one line (before any work): it is one of ``inputs`` or an
    existing folder, or its folder cannot be made (a file on its path, no permission). Missing folders
    on its path are made when it is written (:func:`replace_file`)."""
    out = Path(out)
    for source in inputs:
        if same_path(out, source):
            raise ValueError(f"{flag} {out} is also an input ({source}); writing it would replace what is read")
    if out.is_dir():
        raise ValueError(f"{flag} {out} is a folder; name a file in it")
    _can_make_in(out, flag)
    return out


def check_output_folder(out: str | Path, flag: str, inputs: Iterable[str | Path] = ()) -> Path:
    """``out`` as a Path, or ValueError in one line (before any work): it is or lies inside one of
    ``inputs`` (``-``, standard input, is none), is a file, or cannot be made (a file on its path, no
    permission). A folder that does not exist yet is made when written, with its missing parents."""
    out = Path(out)
    for source in inputs:
        if str(source) != "-" and inside(out, source):
            how = "is" if same_path(out, source) else "lies inside"
            raise ValueError(
                f"{flag} {out} {how} the input {source}; what is written would mix with what is read: "
                "choose a folder of its own"
            )
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {out} is a file, not a folder; name a new or empty folder")
    _can_make_in(out, flag)
    return out


def replace_file(out: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` into a temporary sibling of ``out``, then rename it over ``out``: ``out`` is either
    as it was or complete, whatever happens during the write (an error, a full disk, Ctrl-C)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600: give it the mode of any other file written
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _stdout_gone(e: BaseException) -> bool:
    return isinstance(e, BrokenPipeError) or (isinstance(e, OSError) and e.errno == errno.EPIPE)


@contextlib.contextmanager
def quiet_stdout_errors(prog: str) -> Iterator[None]:
    """Around a script's ``main``: a closed stdout (``| head``) ends it quietly with 141 (128 + SIGPIPE,
    what a shell reports for a program killed by it), a full one (``> /dev/full``) with one line and 1."""
    try:
        yield
        sys.stdout.flush()
    except OSError as e:
        if _stdout_gone(e):
            _silence_stdout()
            raise SystemExit(128 + signal.SIGPIPE) from None
        if e.errno in (errno.ENOSPC, errno.EDQUOT) and e.filename is None:
            _silence_stdout()
            print(
                f"{prog}: error: standard output: {os.strerror(e.errno)}; write it to a disk with room", file=sys.stderr
            )
            raise SystemExit(1) from None
        raise


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's own flush at exit finds nothing to write."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (a test's capture): nothing to flush at exit
        pass
