"""Stop signals: SIGTERM / SIGINT (preemption, Ctrl-C) end the run at a step boundary with a
checkpoint; a second signal, or one that cannot wait (start-up, the end-of-run export), ends it at
once with one line and exit status 128 + the signal.

:class:`StopSignal` is the trainer's (the loop asks it at every step); :class:`ProgramSignals` holds
the signals for the command line (``train.main``) before the trainer exists and after it has closed.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from spider_titan.training.progress import TrainState

logger = logging.getLogger("spider_titan")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(KeyboardInterrupt):
    """A stop signal that does not wait for a step boundary (the end-of-run export, see
    :meth:`StopSignal.at_once`); the process ends with 128 + ``signum``."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_now(signum: int, line: str) -> None:
    """Write ``line`` to stderr and end the process with 128 + ``signum`` at once: no traceback and no
    clean-up that could hang (a save in flight, collectives with ranks that are gone: the launcher
    stops those). A save cut short stays ``step-N.tmp-*``, which is never loaded and removed at start."""
    for sig in STOP_SIGNALS:  # a third signal cannot interrupt the exit
        signal.signal(sig, signal.SIG_IGN)
    try:
        sys.stdout.flush()
    except (OSError, RuntimeError, ValueError):  # the signal may land inside a write to stdout
        pass
    os.write(2, (line + "\n").encode())
    os._exit(128 + signum)


class StopSignal:
    """SIGTERM / SIGINT (preemption, Ctrl-C) ask the run to stop at the next step boundary.

    The handler only sets a flag; the train loop finishes its step (validation: its batch), every
    rank agrees on the same stop point (a max all-reduce over a CPU gloo group, so no GPU sync per
    step), a checkpoint is written, and the process exits with 128 + the signal. A second signal
    exits at once with one line (:func:`exit_now`); inside :meth:`at_once` the first one raises
    :class:`Interrupted`. Handlers are installed by the command-line entry point only
    (:meth:`install`): a Trainer built inside another program (a test suite, a notebook) leaves
    that program's signals alone.
    """

    def __init__(self, world_size: int, *, second_line: Callable[[str], str] | None = None):
        self.signum: int | None = None  # the stop asked for, here or (after :meth:`requested`) on another rank
        self.received = 0  # signals this process got: another rank's does not make ours the second
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None
        self.previous = {}
        self.raise_at_once = False
        # second_line(signal name): the line a second signal prints (:func:`second_signal_line`)
        self.second_line = second_line or (lambda name: f"{name} received again: stopped at once")

    def install(self) -> None:
        """Handle SIGTERM and SIGINT (from the main thread; elsewhere signals cannot be handled)."""
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        self.received += 1
        if self.received > 1:  # the second one: stop now
            exit_now(signum, self.second_line(name))
        self.signum = signum
        if self.raise_at_once:
            raise Interrupted(signum)
        logger.warning("%s received: stopping after this step or validation batch (a second one stops at once)", name)

    @contextmanager
    def at_once(self):
        """A first signal inside this block raises :class:`Interrupted` instead of waiting for a step
        boundary: for work with no boundary to wait for (the end-of-run export)."""
        self.raise_at_once = True
        try:
            yield
        finally:
            self.raise_at_once = False

    def requested(self) -> bool:
        flag = torch.tensor([self.signum or 0], dtype=torch.int64)
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() and self.signum is None:
            self.signum = int(flag.item())  # another rank was signalled
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


def second_signal_line(name: str, *, state: TrainState, checkpoints: Path | None, command: str) -> str:
    """The line a second ``name`` signal prints as it ends the run at once: the step trained, and the
    newest complete checkpoint in ``checkpoints`` (None: the run saves none) with ``command`` to resume."""
    saved = (
        f"the newest complete checkpoint in {checkpoints} is kept (a save in progress is not); resume with: {command}"
        if checkpoints is not None
        else "nothing saved"
    )
    return f"{name} received again: stopped at once after step {state.step}; {saved}"


def closing(signum, frame) -> None:
    """A signal while the run closes: end the process now (what the run saved is complete)."""
    exit_now(
        signum,
        f"{signal.Signals(signum).name} received while closing the run: stopped at once; what it saved is complete",
    )


def quiet_exit(signum, frame) -> None:
    """A signal after the run has said why it ended (a lost or silent rank): the launcher stopping the
    job's workers. End the process now without a second line."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, RuntimeError, ValueError):
        pass
    os._exit(128 + signum)


class ProgramSignals:
    """SIGTERM / SIGINT for the command line, while the trainer's :class:`StopSignal` does not hold
    them. During start-up a signal unwinds it (:class:`Interrupted` is raised: start-up removes what
    it had begun; a second signal exits at once); once the trainer is built (:meth:`hand_over`) its
    StopSignal stops at a step boundary, and when it has closed (:meth:`take_back`) a signal ends the
    process at once in one line (no KeyboardInterrupt in the middle of a garbage collection).
    ``install=False`` (a Trainer driven from Python: a test suite, a notebook) touches no handler."""

    def __init__(self, *, install: bool):
        self.enabled = install
        self.built = False  # the trainer exists: a signal here may not unwind anything
        self.said = False  # the run has printed the line that says why it ended (a lost rank): no other
        self.previous = {sig: signal.signal(sig, self._start_up) for sig in STOP_SIGNALS} if install else {}

    def _start_up(self, signum, frame) -> None:
        if self.built:  # just built, or just closed (StopSignal.restore put this handler back)
            (quiet_exit if self.said else closing)(signum, frame)
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda s, f: exit_now(s, f"{signal.Signals(s).name} received again: stopped at once"))
        raise Interrupted(signum)

    def hand_over(self, stop: StopSignal) -> None:
        """The trainer is built: its ``stop`` holds the signals until it closes (``StopSignal.restore``)."""
        self.built = True
        if self.enabled:
            stop.install()

    def take_back(self) -> None:
        """The trainer has closed: from now on a signal ends the process at once (:func:`closing`)."""
        if self.enabled:
            for sig in STOP_SIGNALS:
                signal.signal(sig, quiet_exit if self.said else closing)

    def restore(self) -> None:
        """The program's own handlers again, as they were before."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}
