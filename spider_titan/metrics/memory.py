"""Device-independent activation memory: bytes that forward leaves alive for backward.

:class:`StorageCounter`, a TorchDispatchMode, follows the storage of every tensor an op creates:
a storage keeps its Python object while it lives, so a weak reference to it calls back exactly
when it dies, on real tensors of any device and on fake ones alike (the run planner,
spider_titan/plan/, counts its fake step with it). When forward ends, the storages still alive are
what the step holds until backward: tensors autograd saved, block inputs kept by activation
checkpointing, outputs cached by selective checkpointing, and the forward's own output. (Counting
with saved_tensors_hooks alone would miss the last two kinds.) Parameters and the inputs existing
before forward are excluded, so does the device: the same count on CPU and GPU.
"""

from __future__ import annotations

import gc
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def storage_key(t: torch.Tensor) -> int:
    """What identifies ``t``'s storage while it lives (views and in-place results share it)."""
    return t.untyped_storage()._cdata


class StorageCounter(TorchDispatchMode):
    """Counts the storages the ops run under it create, each once: ``live``, the bytes of those still
    alive, and ``peak``, their high-water mark; ``refs``: storage key -> (weak reference, bytes) of the
    live ones. ``known``: storage keys (:func:`storage_key`) that never count."""

    def __init__(self, known: set[int]):
        super().__init__()
        self.known = known
        self.refs: dict[int, tuple[weakref.ref, int]] = {}
        self.live = 0
        self.peak = 0

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self.known or key in self.refs:
            return
        nbytes = storage.nbytes()

        def died(_, key=key, nbytes=nbytes):
            self.refs.pop(key, None)
            self.live -= nbytes

        self.refs[key] = (weakref.ref(storage, died), nbytes)
        self.live += nbytes

    def count_outputs(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t.untyped_storage())
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count_outputs(out)
        return out


@dataclass
class LiveBytes:
    """``total``: bytes of storages created in the block and still alive at its end; ``storages``:
    storage key -> bytes of each."""

    total: int = 0
    storages: dict = field(default_factory=dict)


@contextmanager
def count_live_activation_bytes(*exclude: torch.Tensor | torch.nn.Module):
    """Yields a LiveBytes filled in at exit; ``exclude``: modules (their parameters and buffers)
    and tensors whose storages were allocated before and must not count."""
    known = set()
    for obj in exclude:
        tensors = list(obj.parameters()) + list(obj.buffers()) if isinstance(obj, torch.nn.Module) else [obj]
        known.update(storage_key(t) for t in tensors)
    result = LiveBytes()
    counter = StorageCounter(known)
    with counter:
        yield result
    gc.collect()  # storages held only by reference cycles are garbage, not activations
    result.storages = {key: nbytes for key, (_, nbytes) in counter.refs.items()}
    result.total = counter.live
