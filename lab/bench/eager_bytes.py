"""Bytes the ops outside compiled code move in one training step at a config's real width, on fake
tensors (``python -m lab.bench.benchmark eager_bytes --config train_configs/spider_1b_1gpu.toml``).

``kernel_bytes`` measures a compiled step at reduced width, where the weights weigh more against the
activations than at 1B. This runs the planner's step instead (spider_titan/plan/: the config's width,
batch and sequence, its checkpointing and compiled blocks, the one-GPU cast of every parameter to
bf16; no memory, no compute) and adds up, for each op that runs outside the compiled graphs, the bytes
of its tensor inputs and outputs: what an eager GPU kernel reads and writes. Views, allocations and
matmuls (their own kernels, timed as GEMMs) are left out. An eager RMSNorm whose input and weight
share a dtype runs as CUDA runs it, one fused kernel each way (torch's ``rms_norm``), not as the
CPU's composite. Backward ops are named by the forward line that made them (autograd's anomaly mode
keeps it). The milliseconds assume ``--bandwidth_tbs``: an estimate, not a measurement.
"""

from __future__ import annotations

import argparse
import collections
import re
import traceback
from collections.abc import Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from lab.bench.launches import NO_KERNEL  # ops that launch no kernel: views, bare allocations
from lab.overrides import parse_sets, trainer_flags

REPO = Path(__file__).resolve().parents[2]
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm"}


FRAME = re.compile(r'File "[^"]*spider_titan/([^"]+)", line (\d+), in (\S+)')


def _source() -> str:
    """Where the op comes from, as ``path:line (function)``: for an autograd node in backward, the forward
    line that made it, else the calling line (the planner's own frames skipped)."""
    node = torch._C._current_autograd_node()
    if node is not None:
        stack = "".join(node.metadata.get("traceback_", []))
        frames = [f"{p}:{n} ({fn})" for p, n, fn in FRAME.findall(stack) if not p.startswith("plan/")]
        return f"backward {node.name()} of {frames[-1] if frames else '?'}"
    frames = [
        f for f in traceback.extract_stack() if "spider_titan/" in f.filename and "spider_titan/plan/" not in f.filename
    ]
    if not frames:
        return "forward ?"
    f = frames[-1]
    return f"forward {f.filename.split('spider_titan/')[-1]}:{f.lineno} ({f.name})"


class _FusedRMSNorm(torch.autograd.Function):
    """CUDA's fused RMSNorm: ``aten._fused_rms_norm`` forward, ``_fused_rms_norm_backward`` backward."""

    observer: EagerBytes | None = None  # the step's observer: the forward is one kernel, not the CPU's composite

    @staticmethod
    def forward(ctx, x, weight, shape, eps):
        seen = _FusedRMSNorm.observer
        with seen.hidden() if seen is not None else nullcontext():
            y, rstd = torch.ops.aten._fused_rms_norm(x, shape, weight, eps)
        if seen is not None:
            seen.record("_fused_rms_norm", (x, weight, y, rstd))
        ctx.save_for_backward(x, rstd, weight)
        ctx.shape = shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x, rstd, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]]
        dx, dw = torch.ops.aten._fused_rms_norm_backward(dy, x, ctx.shape, rstd, weight, mask)
        return dx, dw, None, None


@contextmanager
def gpu_rms_norm():
    """``F.rms_norm`` as on CUDA: fused where input and weight share a dtype, the composite otherwise."""
    composite = F.rms_norm

    def rms_norm(x, normalized_shape, weight=None, eps=None):
        if torch.compiler.is_compiling() or (weight is not None and weight.dtype != x.dtype):
            return composite(x, normalized_shape, weight, eps)  # inside a compiled block, or unfused on CUDA
        return _FusedRMSNorm.apply(x, weight, list(normalized_shape), eps)

    F.rms_norm = rms_norm
    try:
        yield
    finally:
        F.rms_norm = composite


class EagerBytes:
    """The planner's observer: bytes of each eager op, by op name and by (source, op)."""

    def __init__(self):
        self.by_op: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.by_source: collections.Counter = collections.Counter()
        self.hiding = 0

    @contextmanager
    def hidden(self):
        """Ops inside are not counted (one fused kernel stands for them: :meth:`record`)."""
        self.hiding += 1
        try:
            yield
        finally:
            self.hiding -= 1

    def record(self, name: str, tensors) -> None:
        """One kernel ``name`` that reads or writes ``tensors`` (each storage view once)."""
        seen, nbytes = set(), 0
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor) and t.numel():
                key = (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape))
                if key not in seen:
                    seen.add(key)
                    nbytes += t.numel() * t.element_size()
        self.by_op[name] += nbytes
        self.calls[name] += 1
        self.by_source[(_source(), name)] += nbytes

    def __call__(self, func, args, kwargs, out) -> None:
        name = func._overloadpacket.__name__
        node = torch._C._current_autograd_node()
        if node is not None and node.name() == "torch::autograd::AccumulateGrad":
            return  # the planner's gradients exist before the step; a step's first micro-batch steals its own
        if self.hiding or func.is_view or func.namespace == "prim" or f"aten::{name}" in NO_KERNEL or name in MATMULS:
            return
        self.record(name, (args, kwargs, out))


def measure(config: str, overrides: Mapping[str, object], param_dtype: torch.dtype = torch.bfloat16) -> EagerBytes:
    """One micro-batch's forward and backward of ``config`` (with trainer ``overrides``) on one GPU (no
    FSDP), observed."""
    from spider_titan import plan

    _, cfg = plan.parse_plan_args([*trainer_flags({"job.config_file": config, **overrides}), "--ngpu", "1"])
    t = cfg.training
    seen = EagerBytes()
    _FusedRMSNorm.observer = seen
    try:
        with torch.autograd.detect_anomaly(check_nan=False), gpu_rms_norm():  # anomaly mode keeps the forward stacks
            plan.measure_activation_bytes(
                cfg, batch=t.local_batch_size, seq_len=t.seq_len, param_dtype=param_dtype, fsdp=False, observer=seen
            )
    finally:
        _FusedRMSNorm.observer = None
    return seen


def benchmark_eager_bytes(args: argparse.Namespace) -> dict:
    default = "debug_model.toml" if getattr(args, "reduced", False) else "spider_1b_1gpu.toml"  # the dry run: debug
    config = args.config or str(REPO / "train_configs" / default)
    seen = measure(config, parse_sets(args.set or []))
    total = sum(seen.by_op.values())
    gb = 1e9
    return {
        "config": config,
        "gb_per_step": round(total / gb, 2),
        "ops_per_step": sum(seen.calls.values()),
        f"ms_at_{args.bandwidth_tbs}_tb_per_s": round(total / (args.bandwidth_tbs * 1e12) * 1e3, 1),
        "by_op_gb": {name: [round(b / gb, 2), seen.calls[name]] for name, b in seen.by_op.most_common(12)},
        "top_sources_gb": [[src, op, round(b / gb, 2)] for (src, op), b in seen.by_source.most_common(args.top)],
    }
