"""The dispatch mode that measures a step on fake tensors: the shared storage counter
(metrics/memory.py) plus the FLOPs of the ops and the planning assumption for host reads."""

from __future__ import annotations

from collections.abc import Callable

import torch

from spider_titan.metrics.memory import StorageCounter


def _flop_formulas() -> dict:
    # imported here: torch.utils.flop_counter imports Triton, which must not happen before a test (or
    # a user) sets TRITON_INTERPRET
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    from spider_titan.moe.layer import grouped_mm_flop, grouped_mm_ops

    return {**flop_registry, **{op: shape_wrapper(grouped_mm_flop) for op in grouped_mm_ops()}}


class _LiveStorages(StorageCounter):
    """The shared storage counter (``live``, ``peak``) that also counts the FLOPs of the ops and answers
    data-dependent host reads with the planning assumption (package docstring)."""

    def __init__(self, known: set[int], int_read: int | None, observer: Callable | None = None):
        super().__init__(known)
        self.observer = observer  # observer(func, args, kwargs, out): each op run outside compiled graphs
        self.int_read = int_read
        self.flops = 0  # by torch.utils.flop_counter's formulas (matmuls, attention) and the grouped GEMM's
        self.formulas = _flop_formulas()
        self.int_reads = 0
        self.paused = False  # while a compiled block traces (CompiledSaves)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        if func is torch.ops.aten._local_scalar_dense.default:
            if args[0].dtype == torch.bool:
                return True  # a validity check: the planned inputs are valid
            if self.int_read is None or args[0].is_floating_point():
                raise RuntimeError(
                    f"plan: the model reads a {args[0].dtype} value back to the host during forward; "
                    "the plan cannot know it (only a segment count is assumed)"
                )
            self.int_reads += 1
            return self.int_read
        out = func(*args, **(kwargs or {}))
        self.count_outputs(out)
        if self.observer is not None:
            self.observer(func, args, kwargs or {}, out)
        count = self.formulas.get(func._overloadpacket)
        if count is not None:
            self.flops += count(*args, **(kwargs or {}), out_val=out)
        return out
