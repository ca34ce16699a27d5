"""Stop signals: SIGTERM / SIGINT (preemption, Ctrl-C) end the run at a step boundary with a
checkpoint; a second signal, or one that cannot wait (start-up, the end-of-run export), ends it at
once with one line and exit status 128 + the signal."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist

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

    def __init__(self, world_size: int):
        self.signum: int | None = None  # the stop asked for, here or (after :meth:`requested`) on another rank
        self.received = 0  # signals this process got: another rank's does not make ours the second
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None
        self.previous = {}
        self.raise_at_once = False
        self.second_line: Callable[[str], str] = lambda name: f"{name} received again: stopped at once"

    def install(self, second_line: Callable[[str], str] | None = None) -> None:
        """Handle SIGTERM and SIGINT; ``second_line(signal name)`` is the line a second signal prints."""
        if second_line is not None:
            self.second_line = second_line
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
