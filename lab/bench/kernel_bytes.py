"""Bytes Inductor's kernels move in one compiled training step, by kernel: a CPU proxy for the GPU time
a step spends outside its GEMMs (``python -m lab.bench.benchmark kernel_bytes``).

The step is the reduced-width Spider 1B of the GPU harness (the 1B block, loop and expert structure at
dim 256), static shapes, compiled, bf16, once per ``training.mixed_precision_mode`` (``params`` and
``autocast``). Each graph Inductor compiles is measured as it is built (``GraphLowering.count_bytes``:
every scheduled kernel's reads and writes), and one profiled step counts how often each graph runs, so
a figure is per step. Kernels are split into the generated ones (Inductor's fused pointwise and
reduction code), matmuls (extern kernels), and attention: on a CPU, SDPA runs as math (T x T scores,
softmax, bmm), which a GPU's fused attention kernel never writes, so those are reported apart. Ops that
run outside compiled code are summed from the profiler's input shapes.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import re
from pathlib import Path

import torch

from lab.bench.launches import REGION_PREFIXES, count_launches, host_events
from lab.overrides import trainer_flags

REPO = Path(__file__).resolve().parents[2]
# the harness's reduced widths at dim 256: wide enough that activations, not weights, dominate
WIDTHS = {
    "dim": 256,
    "n_heads": 4,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "inter_dim": 704,
    "moe_inter_dim": 64,
    "engram_buckets": 256,
    "engram_dim": 32,
    "lora_rank": 8,
}
# the dry run's model: the debug flavor with one core block, no byte blocks around it and neither Engram nor byte
# n-grams, one block structure to compile instead of four: the same accounting at a fraction of the compile
REDUCED = {
    "model.n_prelude": 0,
    "model.n_core": 1,
    "model.n_coda": 0,
    "model.engram_layers": [],
    "model.byte_ngram_orders": [],
}
# bytes per element of the profiler's dtype names
ELEMENT_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4, "bool": 1}
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "aten::linear", "aten::matmul"}


def _is_cpu_attention(kind: str, name: str) -> bool:
    """SDPA's CPU math: its T x T softmax, forward and backward, and its batched matmuls."""
    return "safe_softmax" in name or "softmax_backward_data" in name or (kind == "extern" and name.endswith(".bmm"))


class _GraphBytes:
    """Per compiled graph: its kernels' (kind, name, bytes), keyed by the name its calls carry in a profile."""

    def __init__(self):
        from torch._inductor import compile_fx
        from torch._inductor import scheduler as sched
        from torch._inductor.graph import GraphLowering
        from torch._inductor.utils import get_fused_kernel_name

        self.kernels: dict[str, list[tuple[str, str, int]]] = {}
        pending: list[list[tuple[str, str, int]]] = []
        count_bytes, compile_inner = GraphLowering.count_bytes, compile_fx._compile_fx_inner

        def counted(graph):
            rows = []
            for node in graph.scheduler.nodes:
                if isinstance(node, sched.ExternKernelSchedulerNode):
                    kind, name = "extern", str(getattr(node.node, "python_kernel_name", type(node.node).__name__))
                else:
                    kind, name = "generated", get_fused_kernel_name(node.get_nodes(), "original_aten")
                rows.append((kind, name, node.get_read_write_buffers_sizes()))
            pending.append(rows)
            return count_bytes(graph)

        def compiled(*args, **kwargs):
            out = compile_inner(*args, **kwargs)
            key = out._fx_graph_cache_key = f"graph{len(self.kernels)}"  # the name its calls carry
            self.kernels[key] = pending.pop() if pending else []
            return out

        self._undo = [(GraphLowering, "count_bytes", count_bytes), (compile_fx, "_compile_fx_inner", compile_inner)]
        GraphLowering.count_bytes, compile_fx._compile_fx_inner = counted, compiled
        # count_bytes runs when the metrics log is on; the FX graph cache would skip it
        self._cache = torch._inductor.config.fx_graph_cache
        torch._inductor.config.fx_graph_cache = False
        torch._logging.set_logs(inductor_metrics=True)

    def close(self) -> None:
        for owner, name, value in self._undo:
            setattr(owner, name, value)
        torch._inductor.config.fx_graph_cache = self._cache
        torch._logging.set_logs()


def _outside_bytes(host: list) -> int:
    """The inputs read by the ops the GPU harness counts as launched outside compiled code
    (``lab.bench.launches.count_launches``: no views or bare allocations), matmuls left out, from a profile."""
    _, launched = count_launches(host)
    regions = [(e.start_ns(), e.end_ns()) for e in host if e.name().startswith(REGION_PREFIXES)]
    total = 0
    for e in launched:
        if e.name() in MATMULS or any(a <= e.start_ns() <= b for a, b in regions):
            continue
        for shape, dtype in zip(e.shapes(), e.dtypes()):
            if shape and dtype in ELEMENT_BYTES:
                total += ELEMENT_BYTES[dtype] * math.prod(shape)
    return total


def measure(mode: str, batch: int, seq_len: int, out: Path, *, reduced: bool = False) -> dict:
    """One compiled bf16 step of the reduced-width Spider 1B under ``mode``: MiB per step by kind, and
    the generated kernels that move the most."""
    from torch.profiler import ProfilerActivity, profile

    from lab.bench.gpu import warm_router
    from spider_titan.config.manager import parse_args
    from spider_titan.parallel.precision import compute_precision
    from spider_titan.train import Trainer

    argv = trainer_flags(
        {
            # the dry run (``reduced``): the debug model, a few graphs to compile instead of the 1B structure's
            "job.config_file": REPO / "train_configs" / ("debug_model.toml" if reduced else "spider_1b.toml"),
            "training.dataset": "mock",
            "training.target_tokens": 0,
            "training.gradient_accumulation_steps": 1,
            "training.local_batch_size": batch,
            "training.seq_len": seq_len,
            "training.compile": True,
            "training.device": "cpu",
            "moe.backend": "torch",
            "validation.enable": False,
            "checkpoint.enable": False,
            "checkpoint.export_at_end": False,
            "metrics.enable_tensorboard": False,
            "metrics.enable_jsonl": False,
            "training.steps": 3,
            "job.dump_folder": out / f"kernel_bytes_{mode}",
            **(REDUCED if reduced else {f"model.{k}": v for k, v in WIDTHS.items()}),
        }
    )
    torch._dynamo.reset()
    graphs = _GraphBytes()
    trainer = Trainer(parse_args(argv, env={}))
    try:
        run = trainer.run
        # a CPU run computes in fp32; this one casts as a GPU run without FSDP does
        training = dataclasses.replace(run.cfg.training, mixed_precision_mode=mode)
        autocast_dtype, weights = compute_precision(run.model, training, torch.bfloat16)
        trainer.run = dataclasses.replace(run, autocast_dtype=autocast_dtype, compute_weights=weights)
        warm_router(trainer)  # steady-state segments, as the harness's rows
        for step in (1, 2):
            trainer.train_step(trainer.next_micro_batches(), step)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            trainer.train_step(trainer.next_micro_batches(), 3)
    finally:
        trainer.close()
        graphs.close()
    host = host_events(prof)
    calls = collections.Counter(
        m.group(1) for e in host if (m := re.match(r"## Call CompiledFxGraph (\S+) ##", e.name()))
    )
    by_kind: collections.Counter = collections.Counter()
    generated: collections.Counter = collections.Counter()
    for key, n in calls.items():
        for kind, name, nbytes in graphs.kernels.get(key, []):
            kind = "attention (CPU math)" if _is_cpu_attention(kind, name) else kind
            by_kind[kind] += n * nbytes
            if kind == "generated":
                generated[name] += n * nbytes
    mib = 2**20
    return {
        "mib_per_step": {kind: round(v / mib, 1) for kind, v in sorted(by_kind.items())},
        "outside_compiled_mib": round(_outside_bytes(host) / mib, 1),
        "graph_calls": sum(calls.values()),
        "top_generated_mib": [[name[:100], round(v / mib, 1)] for name, v in generated.most_common(8)],
    }


def benchmark_kernel_bytes(args: argparse.Namespace) -> dict:
    """Both precision modes at 2 rows of 1,024 bytes (``args.reduced``: ``params`` alone on the debug model
    trimmed as :data:`REDUCED`, one row of 128 bytes: the suite's dry run)."""
    out = Path(args.dump_folder)
    reduced = getattr(args, "reduced", False)
    batch, seq_len = (1, 128) if reduced else (2, 1024)
    modes = ("params",) if reduced else ("params", "autocast")
    rows = {mode: measure(mode, batch=batch, seq_len=seq_len, out=out, reduced=reduced) for mode in modes}
    if "autocast" in rows:
        params, autocast = (rows[m]["mib_per_step"].get("generated", 0.0) for m in ("params", "autocast"))
        rows["generated_params_over_autocast"] = round(params / autocast, 3) if autocast else None
    return rows
