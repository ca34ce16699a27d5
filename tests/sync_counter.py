"""Count host reads of device values (what would be a host-device sync on a GPU), by call site.

On a CPU every tensor is on the host, so nothing ever waits; the counter therefore counts the *calls*
that would wait on a GPU: reading a value (``item``, ``tolist``, ``bool()`` / ``int()`` / ``float()``
of a tensor), data-dependent shapes (``nonzero``, boolean-mask indexing, ``masked_select``,
``unique``, ``repeat_interleave`` without ``output_size``) and copies to another device without
``non_blocking=True`` (``cpu``, ``numpy``, ``to`` / ``copy_`` across devices; on a CPU run there are
none of the latter, so the train loop's copies are checked by their flags in tests/unit/test_loader.py).

It is a ``TorchFunctionMode``. It counts the calls spider_titan's own code makes (the call site,
``file:line``, is in the package), not those inside torch's Python code that spider_titan called
(the optimizer's host-side step counters, ``get_total_norm``: torch's design, not this project's),
nor C++-level syncs. ``spider_titan/data/`` is left out: the loader builds batches on the host,
before the copy to the device.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

PACKAGE = str(Path(__file__).resolve().parents[1] / "spider_titan")

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}
DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "unique_consecutive", "argwhere"}
COPIES = {"to", "copy_"}
HOST_SIDE = str(Path(PACKAGE) / "data")


def _name(func) -> str:
    return getattr(func, "__name__", str(func))


def _is_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _moves_device(args, kwargs) -> bool:
    """A blocking ``to``/``copy_`` between two devices."""
    if kwargs.get("non_blocking", False) or not args or not isinstance(args[0], torch.Tensor):
        return False
    targets = [kwargs.get("device")] + list(args[1:])
    for t in targets:
        if isinstance(t, torch.Tensor):
            t = t.device
        if isinstance(t, (str, torch.device)):
            try:
                if torch.device(t).type != args[0].device.type:
                    return True
            except RuntimeError:  # a dtype name, not a device
                continue
    return False


def is_sync(func, args, kwargs) -> bool:
    name = _name(func)
    if name in READS or name in DATA_DEPENDENT:
        return True
    if name in ("__getitem__", "__setitem__") and len(args) > 1:
        return _is_bool_index(args[1])
    if name == "repeat_interleave":
        return "output_size" not in kwargs
    if name in COPIES:
        return _moves_device(args, kwargs)
    return False


class SyncCounter(TorchFunctionMode):
    """``with SyncCounter() as c: ...`` then ``c.sites``: ``Counter({"path.py:123 item": n, ...})``."""

    def __init__(self):
        super().__init__()
        self.sites: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_sync(func, args, kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(PACKAGE) and not caller.startswith(HOST_SIDE):
                self.sites[f"{_site()} {_name(func)}"] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.sites.values())


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(PACKAGE):
            return f"{Path(frame.f_code.co_filename).relative_to(Path(PACKAGE).parent)}:{frame.f_lineno}"
        frame = frame.f_back
    return "(outside spider_titan)"
