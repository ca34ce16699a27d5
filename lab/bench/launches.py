"""What a GPU would launch for a profiled step, read from its host trace: the GPU harness's count
(lab/bench/gpu.py), the kernel and eager byte benches, and the suite's launch-count tests all use it.

On a CPU the profiler records every aten op the host dispatches; the ops that would launch a GPU kernel
are the ones that are not views or bare allocations (:data:`NO_KERNEL`), plus the compiled regions'
generated kernels (``cpp_fused_*``, recorded under ``torch._inductor.config.cpp.enable_kernel_profile``).
"""

from __future__ import annotations

import torch

from spider_titan.training.cuda_graph import FORWARD_BACKWARD

REGION_PREFIXES = ("Torch-Compiled Region", "CompiledFunctionBackward")
# aten ops that launch no kernel on a GPU: views of the same memory and bare allocations
NO_KERNEL = frozenset(
    f"aten::{op}"
    for op in (
        "view _unsafe_view _reshape_alias view_as detach alias lift_fresh t transpose permute unsqueeze squeeze "
        "expand expand_as slice select narrow as_strided split split_with_sizes chunk unbind unflatten "
        "empty empty_strided empty_like new_empty new_empty_strided"
    ).split()
)
# ops that copy only sometimes (a dtype, device or layout change): a kernel when one runs inside them
MAYBE_COPY = frozenset(f"aten::{op}" for op in "to reshape contiguous flatten type_as".split())


def count_launches(host: list) -> tuple[dict, list]:
    """What a GPU would launch for this host trace (one thread, events sorted by start): aten ops
    outside compiled code (each a kernel or a host op), compiled regions entered (forward and
    backward), and inside them the extern ops (GEMMs, fallbacks) and the generated kernels (recorded
    as ``cpp_fused_*`` under ``torch._inductor.config.cpp.enable_kernel_profile``). An op that only
    makes a view or allocates (``NO_KERNEL``) is not a launch; one that copies only sometimes
    (``MAYBE_COPY``) is when an op inside it is. Returns the counts (``launched`` = outside + inside)
    and the events counted."""
    counted, stack = [], []  # stack: (end, kind) of the open events that matter
    outside = inside = regions = 0
    pending = None  # a MAYBE_COPY op at the top level: (its end, in a region?), counted once a copy runs inside it
    for e in host:
        while stack and stack[-1][0] <= e.start_ns():
            stack.pop()
        name = e.name()
        if pending is not None and e.start_ns() >= pending[0].end_ns():
            pending = None
        in_region = any(kind == "region" for _, kind in stack)
        in_op = any(kind == "op" for _, kind in stack)
        if name.startswith(REGION_PREFIXES):
            if not in_region:
                regions += 1
            stack.append((e.end_ns(), "region"))
        elif name.startswith("aten::") or (in_region and "cpp_fused" in name):
            launches = name not in NO_KERNEL and name not in MAYBE_COPY
            if in_op and pending is not None and launches:  # a copy inside a MAYBE_COPY op: count that op
                counted.append(pending[0])
                inside, outside = inside + pending[1], outside + (not pending[1])
                pending = None
            if not in_op:
                if name in MAYBE_COPY:
                    pending = (e, in_region)
                elif launches:
                    counted.append(e)
                    inside, outside = inside + in_region, outside + (not in_region)
            stack.append((e.end_ns(), "op"))
    return {"launched": outside + inside, "outside": outside, "inside": inside, "regions": regions}, counted


def outside_forward_backward(host: list, ops: list) -> int:
    """How many of the counted ``ops`` (:func:`count_launches`) ran outside the step's forward-backward
    range: what the host still launches when ``training.cuda_graph`` replays that range as one graph."""
    spans = [(e.start_ns(), e.end_ns()) for e in host if e.name() == FORWARD_BACKWARD]
    return sum(not any(a <= e.start_ns() <= b for a, b in spans) for e in ops)


def host_events(prof) -> list:
    """The host (CPU) events of a finished profile, by start time (an enclosing event first)."""
    events = prof.profiler.kineto_results.events()
    return sorted(
        (e for e in events if e.device_type() == torch.autograd.DeviceType.CPU),
        key=lambda e: (e.start_ns(), -e.duration_ns()),
    )
