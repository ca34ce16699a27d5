"""Device-independent activation memory: bytes that forward leaves alive for backward.

A TorchDispatchMode records a weak reference to the storage of every tensor an op creates during
forward; when forward ends, the storages still alive are what the step holds until backward:
tensors autograd saved, block inputs kept by activation checkpointing, outputs cached by
selective checkpointing, and the forward's own output. (Counting with saved_tensors_hooks alone
would miss the last two kinds.) Parameters and the inputs existing before forward are excluded,
so does the device: the same count on CPU and GPU.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass
class LiveBytes:
    """``total``: bytes of storages created in the block and still alive at its end."""

    total: int = 0
    storages: dict = field(default_factory=dict)


class _StorageRecorder(TorchDispatchMode):
    def __init__(self, known: set[int]):
        super().__init__()
        self.known = known
        self.refs: dict[int, tuple[int, int]] = {}  # data_ptr -> (weak ref handle, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if not ptr or ptr in self.known:
                    continue
                old = self.refs.get(ptr)
                if old is not None:
                    if not torch.UntypedStorage._expired(old[0]):
                        continue  # the same storage again (a view, or an in-place op)
                    torch.UntypedStorage._free_weak_ref(old[0])  # freed; its address was reused
                self.refs[ptr] = (st._weak_ref(), st.nbytes())
        return out


@contextmanager
def count_live_activation_bytes(*exclude: torch.Tensor | torch.nn.Module):
    """Yields a LiveBytes filled in at exit; ``exclude``: modules (their parameters and buffers)
    and tensors whose storages were allocated before and must not count."""
    known = set()
    for obj in exclude:
        tensors = list(obj.parameters()) + list(obj.buffers()) if isinstance(obj, torch.nn.Module) else [obj]
        known.update(t.untyped_storage().data_ptr() for t in tensors)
    result = LiveBytes()
    recorder = _StorageRecorder(known)
    with recorder:
        yield result
    gc.collect()  # storages held only by reference cycles are garbage, not activations
    for ptr, (ref, nbytes) in recorder.refs.items():
        if not torch.UntypedStorage._expired(ref):
            result.storages[ptr] = nbytes
            result.total += nbytes
        torch.UntypedStorage._free_weak_ref(ref)
