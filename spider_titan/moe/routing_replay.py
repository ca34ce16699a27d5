"""Routing decisions made once per forward and replayed when activation checkpointing recomputes.

Activation checkpointing re-runs a block's forward inside backward. For a MoE layer that re-run
would route again: top-k over the router scores and, under expert parallel, the counts
all-to-all and its ``.tolist()`` that size the token all-to-alls. A tie broken the other way, or
any nondeterminism, then changes the routing between forward and recompute: under expert
parallel the split sizes no longer match the other ranks' (a crash or a hang), without it the
gradients are silently those of another routing. torchtitan avoids this by saving the top-k and
all-to-all outputs in its selective-AC policy; here the decisions themselves are kept.

One :class:`RoutingReplay` per checkpointed call (made by ``parallel/activation_checkpoint.py``
around the wrapped block; it lives in the closure the checkpoint keeps for backward, so it is
freed with the graph after backward). The block runs inside :meth:`RoutingReplay.activate`: the
first time (the forward) every decision is recorded, in call order; every later time (the
recompute, once per backward) they are handed back in the same order. The decisions are small:
``topk_idx (T, k)`` per MoE call and, under expert parallel, the host-side split sizes and the
``(ep * E/ep,)`` received counts. The token all-to-alls themselves run again in recompute, with
the recorded splits (same inputs, same sizes: the same bytes as in forward).

Outside a checkpointed call, or while torch.compile traces (the compiled graph's own recompute
does not re-enter Python), :func:`replay_or_record` just computes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

T = TypeVar("T")

_active = threading.local()  # .stack: the RoutingReplay objects entered on this thread, innermost last


class RoutingReplay:
    """The routing decisions of one checkpointed call, in the order they were made."""

    def __init__(self) -> None:
        self.decisions: list[Any] = []
        self.entered = 0  # 0 before the forward; >= 1 after it, so later entries replay
        self.cursor = 0

    @property
    def replaying(self) -> bool:
        return self.entered > 1

    @contextmanager
    def activate(self) -> Iterator[RoutingReplay]:
        self.entered += 1
        self.cursor = 0
        stack = _stack()
        stack.append(self)
        try:
            yield self
        finally:
            stack.pop()

    def next(self, compute: Callable[[], T]) -> T:
        if not self.replaying:
            value = compute()
            self.decisions.append(value)
            return value
        if self.cursor >= len(self.decisions):
            raise RuntimeError(
                f"routing replay: the recompute asked for routing decision {self.cursor + 1} but the forward "
                f"made {len(self.decisions)}; the checkpointed block must run the same MoE calls both times"
            )
        value = self.decisions[self.cursor]
        self.cursor += 1
        return value


def _stack() -> list[RoutingReplay]:
    if not hasattr(_active, "stack"):
        _active.stack = []
    return _active.stack


def _current() -> RoutingReplay | None:
    if torch.compiler.is_compiling():
        return None
    stack = _stack()
    return stack[-1] if stack else None


def replay_or_record(compute: Callable[[], T]) -> T:
    """``compute()``, recorded in forward and replayed in recompute inside a checkpointed call."""
    replay = _current()
    return compute() if replay is None else replay.next(compute)


def is_recomputing() -> bool:
    """True while activation checkpointing re-runs a forward (inside a replaying call)."""
    replay = _current()
    return replay is not None and replay.replaying
