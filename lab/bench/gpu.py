"""The GPU harness of Spider 1B against dense 1B: one command, one markdown table and one JSON.

    python -m lab.bench.benchmark gpu_1b --out outputs/gpu_1b                # one H100/H200, at most ~8 minutes
    python -m lab.bench.benchmark gpu_1b --reduced --compile false --out DIR # the same code path at tiny shapes (CPU)

Rows (each a real ``Trainer`` built from ``train_configs/spider_1b.toml`` on mock data, one micro-batch of
``--batch`` x ``--seq`` bytes, no validation or checkpoints): ``dense_1b`` (bf16, activation checkpointing off),
``spider_1b`` (the config with dynamic shapes, as it shipped until 2026-11-27: bf16, Triton MoE, recurrent
AC, bucket 64), ``spider_1b_static`` (the same with ``model.segment_capacity`` ``--capacity``: static
shapes, no host sync), ``spider_1b_packed``
(static with the capacities of ``--packed``: fewer slots per row, and the core's projections and experts on
the batch's segments packed into fewer positions), ``spider_1b_shipped`` (the config as it ships: its
static shapes and its micro-batch of 16 rows, which ``--batch`` does not change; one GPU, no FSDP),
``spider_1b_graph`` (``spider_1b_packed``, and the
step's forward and backward replayed as one CUDA graph: ``training.cuda_graph``; CUDA only),
``spider_1b_planned`` (``train_configs/spider_1b_1gpu.toml``'s shapes: 16 rows, slots 1.5, packed 1.35,
graphed, with activation checkpointing only if the planner finds the micro-batch needs it on this GPU's
memory, and then the largest compiled memory budget it finds fits; the planner runs beside the first
rows, in its own process), ``--variant
rows (static with more flags), ``spider_1b_fp8`` (``spider_1b_graph`` with the float8 converter;
skipped with the reason where torchao or the GPU cannot run it) and ``spider_1b_graph_autocast``
(``spider_1b_graph`` with fp32 parameters under autocast, as one GPU computed before
``training.mixed_precision_mode = "params"`` became the default). Every Spider row starts at steady-state
segmentation: before any timed step its boundary predictor's threshold is set by bisection to within
5 % of the target rate on the run's own first batch (``warm_router``), so the timed steps see ~4 bytes
per segment from the first, not the 16-byte cap an untrained predictor starts at on 1B.

Per row: bytes/s, TFLOP/s and MFU by the trainer's own FLOPs count (Spider's ``aux["flops_per_byte"]``:
the segments and loops actually run), peak memory, compile time (the first step), recompiles with
their reasons, the slowest step against the median, bytes/s with the steps run back to back
(``run_ahead_bytes_per_s``: the timed steps each wait to read their loss, the trainer's loop does not),
and from one profiled step the kernels launched
(CPU: the ops dispatched), the device-busy fraction, the top kernels, and the time of each part of the
forward (named ranges ``spider.*``: byte blocks, segmentation and pooling, core, dechunk and head; the
optimizer step) beside its share of the FLOPs. A timed step slower than 2x the median is listed with
what happened during it (``slow_steps``: dynamo recompiles, Triton JIT compiles of the MoE kernels, the
CUDA allocator's new allocations and retries), so a stall names its cause. A row stops taking steps
once it has used its time budget (``--budget_s``), so a slow row cannot eat the run, and the whole run
stops at ``--total_s``. The rows run most telling first: dense, graph, planned, shipped, fp8, graph
under autocast, packed, static, dynamic, then the variants.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from lab.bench.launches import count_launches, host_events, outside_forward_backward
from lab.bench.machine import machine
from lab.cli import check_not_negative, check_positive, parser, refuse, write_whole
from lab.overrides import parse_sets, trainer_flags
from spider_titan.vocab import PAD_ID

CONFIG = Path(__file__).resolve().parents[2] / "train_configs" / "spider_1b.toml"
ONE_GPU_CONFIG = CONFIG.with_name("spider_1b_1gpu.toml")
# Reduced width, the real structure: blocks, loops, experts and top-k of the 1B flavors, every width small.
REDUCED_SPIDER = {
    "dim": 64,
    "n_heads": 2,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "inter_dim": 128,
    "moe_inter_dim": 32,
    "engram_buckets": 256,
    "engram_dim": 16,
    "lora_rank": 4,
}
REDUCED_DENSE = {"dim": 64, "n_heads": 4, "n_kv_heads": 2, "inter_dim": 128}
# The forward's named ranges (Spider.forward) and the FLOPs parts (models/spider/flops.py) each covers.
COMPONENTS = {
    "spider.byte_blocks": ("byte_blocks", "byte_attention_scores"),
    "spider.segmentation": ("boundary_predictor",),
    "spider.core": (
        "core_attention_proj",
        "core_attention_scores",
        "core_lora",
        "moe_router",
        "moe_experts",
        "engram",
        "inject_up_proj",
    ),
    "spider.dechunk_head": ("dechunk_smoothing", "residual_proj", "lm_head"),
}


def shipped_config(path: Path = CONFIG):
    """The config file ``path`` as it ships, parsed (a fresh copy per call)."""
    from spider_titan.config.manager import parse_args

    return parse_args(["--job.config_file", str(path)], env={})


def start_planner() -> subprocess.Popen | None:
    """``python -m spider_titan.plan`` of ``ONE_GPU_CONFIG`` for this GPU's memory, in its own process
    (it takes seconds of CPU on fake tensors while the first rows use the GPU); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    cmd = [sys.executable, "-m", "spider_titan.plan", "--job.config_file", str(ONE_GPU_CONFIG), "--ngpu", "1"]
    cmd += ["--gpu_memory_gib", f"{gib:.1f}"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def planned_checkpointing(planner: subprocess.Popen | None, timeout: float) -> tuple[dict[str, str], str]:
    """(trainer overrides, what the planner said) for ``spider_1b_planned``: checkpointing off when the
    plan finds the micro-batch fits without it (plan.CHECKPOINTING_NOT_NEEDED), else the compiled
    memory budget it finds fits (plan.MEMORY_BUDGET_FITS), else the config's."""
    from spider_titan.plan import CHECKPOINTING_NOT_NEEDED, MEMORY_BUDGET_FITS

    if planner is None:
        return {}, "the planner runs for a GPU only: the config's checkpointing"
    try:
        out, _ = planner.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        planner.kill()
        return {}, f"the planner took over {timeout:.0f} s: the config's checkpointing"
    lines = out.splitlines()
    line = next((x for x in lines if x.startswith("checkpointing")), "no checkpointing line")
    if line.startswith(CHECKPOINTING_NOT_NEEDED):
        return {"activation_checkpoint.mode": "none"}, line
    budget = next((x for x in lines if x.startswith(MEMORY_BUDGET_FITS)), None)
    if budget is not None:  # the planner prints the flags: --activation_checkpoint.mode memory_budget ...
        words = budget.rpartition(": ")[2].split()
        return {flag.removeprefix("--"): value for flag, value in zip(words[::2], words[1::2])}, f"{line}; {budget}"
    return {}, line


def dense_config(out: Path) -> Path:
    """``CONFIG`` for the dense row, written into ``out``: everything but the [model] keys only Spider has
    (its segment capacities), so both models share the data, optimizer and schedule of the file."""
    from spider_titan.config.help import to_toml

    cfg = shipped_config()
    cfg.model.overrides = {}
    path = Path(out) / "dense_1b.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, to_toml(cfg))
    return path


def rows(args: argparse.Namespace) -> list[tuple[str, dict[str, object]]]:
    """(name, trainer overrides) of every row."""
    common: dict[str, object] = {
        "training.dataset": "mock",
        "training.target_tokens": 0,
        "training.gradient_accumulation_steps": 1,
        "training.local_batch_size": args.batch,
        "training.seq_len": args.seq,
        "training.compile": args.compile,
        "validation.enable": False,
        "checkpoint.enable": False,
        "checkpoint.export_at_end": False,
        "metrics.enable_tensorboard": False,
        "metrics.enable_jsonl": False,
    }
    if not torch.cuda.is_available():  # CPU: fp32, the torch MoE (Triton's interpreter is minutes per step)
        common |= {"training.mixed_precision_param": "float32", "moe.backend": "torch"}
    base = {"job.config_file": CONFIG, **common}
    spider = {f"model.{k}": v for k, v in REDUCED_SPIDER.items()} if args.reduced else {}
    dense = {f"model.{k}": v for k, v in REDUCED_DENSE.items()} if args.reduced else {}
    shipped = shipped_config()
    dense_row = {"job.config_file": dense_config(args.out), **common}
    dense_row |= {"model.name": "dense", "model.flavor": "1B", "activation_checkpoint.mode": "none"}
    spider |= args.set
    dynamic = {"model.segment_capacity": 0, "model.packed_capacity": 0}  # the segments counted per batch
    static = {"model.segment_capacity": args.capacity, "model.packed_capacity": 0}
    slots, positions = args.packed
    packed = {"model.segment_capacity": slots, "model.packed_capacity": positions}
    graph = {"training.cuda_graph": True} if torch.cuda.is_available() else {}  # a CUDA graph needs CUDA
    fp8 = {"model.converters": ["float8"], "float8.fallback": "error"}
    one = shipped_config(ONE_GPU_CONFIG)
    one_gpu = {"training.local_batch_size": one.training.local_batch_size}
    one_gpu |= {f"model.{k}": one.model.overrides[k] for k in ("segment_capacity", "packed_capacity")}
    # the order they run in, most telling first, so that --total_s cuts the references of earlier runs
    out = [
        ("dense_1b", dense_row | dense),
        ("spider_1b_graph", base | spider | packed | graph),
        # spider_1b_1gpu.toml's micro-batch and shapes; the planner's checkpointing is added when the row runs
        ("spider_1b_planned", base | spider | one_gpu | graph),
        # the 8-GPU config's shapes and micro-batch (the planner's pick) as shipped, on one GPU (no FSDP)
        ("spider_1b_shipped", base | spider | {"training.local_batch_size": shipped.training.local_batch_size}),
        ("spider_1b_fp8", base | spider | packed | graph | fp8),
        # spider_1b_graph as one GPU computed before 2026-11-28: fp32 parameters, autocast
        ("spider_1b_graph_autocast", base | spider | packed | graph | {"training.mixed_precision_mode": "autocast"}),
        ("spider_1b_packed", base | spider | packed),
        ("spider_1b_static", base | spider | static),
        ("spider_1b", base | spider | dynamic),
    ]
    skip = {"spider_1b_graph", "spider_1b_graph_autocast"} if not graph else set()
    skip |= {"spider_1b_fp8"} if args.no_fp8 else set()
    out = [(name, flags) for name, flags in out if name not in skip]
    for name, flags in args.variant.items():  # NAME=section.key=value: spider_1b_static with more overrides
        out.append((name, base | spider | static | flags))
    return out


WARM_TOLERANCE = 0.05


def warm_router(trainer, iterations: int = 40) -> float:
    """Set the boundary predictor's threshold by bisection on the trainer's next batch until the batch's
    bytes per segment is within ``WARM_TOLERANCE`` of the target (the rate grows with the threshold;
    every other weight untouched); the bytes per segment reached. Shapes of a run past its first
    hundred steps, without training the rest of the model. (The boundary loss cannot do it: inside the
    ratio loss's band it does not pull.)"""
    model = trainer.run.model
    predictor = getattr(model, "boundary_predictor", None)
    if predictor is None:
        return float("nan")
    a, chunker = model.args, model.chunker
    ids = trainer.next_micro_batches()[0][0]
    target = a.target_bytes_per_segment
    # in the step's own precision: at dim 2048 the predictor's scores lie close together, so the rate
    # reached in fp32 need not hold in bf16 (the first H200 runs warmed in fp32 to 3.92 bytes per
    # segment and timed their steps at 2.6)
    rate, low, high = float("nan"), -8.0, 8.0  # thresholds on causally standardised scores
    with trainer._eval_precision(), torch.no_grad():  # entered once: it casts every matmul weight on entry
        x = model.byte_states(ids)
        for _ in range(iterations):
            seg = chunker.segment(chunker.logits(predictor, x), ids)
            rate = float((ids != PAD_ID).sum()) / max(float(seg.seg_real.sum()), 1.0)
            if abs(rate / target - 1.0) <= WARM_TOLERANCE:
                break
            mid = float(predictor.threshold)
            low, high = (mid, high) if rate < target else (low, mid)
            predictor.threshold.fill_((low + high) / 2)
    return rate


class _Recompiles(logging.Handler):
    """Dynamo's recompile messages (their reasons), while the row runs."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage().splitlines()[0][:200])


class StepEvents:
    """What happened during each step that can stall one: dynamo (re)compiles (their log lines), Triton
    JIT compiles of the hand-written kernels (a new specialisation, e.g. of the MoE kernels as row counts
    change: ``triton.knobs.runtime.jit_post_compile_hook``), and on CUDA the allocator's new device
    allocations and its retries after freeing its cache. ``take()`` returns the counts since the last call."""

    def __init__(self, recompiles: _Recompiles, cuda: bool):
        self.recompiles, self.cuda, self.seen = recompiles, cuda, 0
        self.triton_compiles, self._knobs, self._old_hook = 0, None, None
        try:
            import triton.knobs as knobs

            self._knobs, self._old_hook = knobs, knobs.runtime.jit_post_compile_hook
            knobs.runtime.jit_post_compile_hook = self._on_compile
        except (ImportError, AttributeError):  # an older Triton, or none: no JIT compile count
            pass
        self._alloc = self._allocator()

    def _on_compile(self, *args, **kwargs):
        self.triton_compiles += 1
        return self._old_hook(*args, **kwargs) if self._old_hook is not None else None

    def _allocator(self) -> tuple[int, int]:
        if not self.cuda:
            return 0, 0
        stats = torch.cuda.memory_stats()
        return stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0)

    def take(self) -> dict:
        new = self.recompiles.messages[self.seen :]
        self.seen = len(self.recompiles.messages)
        alloc = self._allocator()
        out = {
            "recompiles": sum(m.startswith("Recompiling") for m in new),
            "triton_compiles": self.triton_compiles,
            "device_allocs": alloc[0] - self._alloc[0],
            "alloc_retries": alloc[1] - self._alloc[1],
        }
        self.triton_compiles, self._alloc = 0, alloc
        return out

    def close(self) -> None:
        if self._knobs is not None:
            self._knobs.runtime.jit_post_compile_hook = self._old_hook


def slow_steps(times: list[float], events: list[dict], first_step: int) -> list[dict]:
    """The timed steps slower than 2x the median, each with what happened during it (:class:`StepEvents`)."""
    median = statistics.median(times)
    return [
        {"step": first_step + i, "over_median": round(dt / median, 2), **{k: v for k, v in ev.items() if v}}
        for i, (dt, ev) in enumerate(zip(times, events))
        if dt > 2 * median
    ]


def run_ahead(trainer, first_step: int, steps: int, cuda: bool) -> float:
    """Seconds per step over ``steps`` training steps run back to back, waiting for the device only
    after the last: the trainer's own loop, which reads nothing back per step with static shapes, so
    its host runs ahead into the next step (the timed steps wait for each step to read its loss)."""
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for step in range(first_step, first_step + steps):
        trainer.train_step(trainer.next_micro_batches(), step)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps


def profile_step(trainer, step: int) -> dict:
    """One profiled training step: kernels (CUDA) or top-level ops (CPU: aten ops not inside another)
    launched, the device-busy fraction, the top kernels, and the time each named range (``spider.*``,
    the optimizer step) took: on CUDA the kernels launched inside it, on CPU its wall time. Read from
    the profiler's raw events (building its Python event tree costs ~100 us an op)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.run.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    batches = trainer.next_micro_batches()
    with profile(activities=activities) as prof:
        metrics = trainer.train_step(batches, step)
        float(metrics["ce_sum"])
    events = prof.profiler.kineto_results.events()
    host = host_events(prof)
    ranges = [(e.start_ns(), e.end_ns(), _range_name(e.name())) for e in host if _range_name(e.name())]
    top, per_range = Counter(), Counter()
    counts: dict = {}
    if cuda:
        on_gpu = [e for e in events if e.device_type() == torch.autograd.DeviceType.CUDA]
        # a named range also shows on the GPU timeline (a user annotation): its span, not a kernel
        kernels = [e for e in on_gpu if not e.is_user_annotation()]
        spans_ms = Counter()
        for e in on_gpu:
            if e.is_user_annotation() and _range_name(e.name()):
                spans_ms[_range_name(e.name())] += e.duration_ns() / 1e6
        counts = {"range_spans_ms": {k: round(v, 3) for k, v in sorted(spans_ms.items())}}
        launches = {e.correlation_id(): e.start_ns() for e in host if e.name().startswith(("cuda", "cu"))}
        # what the host asked of the GPU: kernel and graph launches, copies and fills (one graph launch
        # stands for all the kernels captured in it)
        counts["host_launches"] = sum(e.name().startswith(HOST_LAUNCH) for e in host)
        spans = sorted((k.start_ns(), k.end_ns()) for k in kernels)
        busy, end = 0, -1
        for start, stop in spans:  # the union of the kernels' intervals
            busy += max(0, stop - max(start, end))
            end = max(end, stop)
        span = spans[-1][1] - spans[0][0] if spans else 0
        for k in kernels:
            top[k.name()[:80]] += k.duration_ns()
            launched_at = launches.get(k.correlation_id())
            for name in _containing(ranges, launched_at):
                per_range[name] += k.duration_ns()
        launched, busy_fraction = len(kernels), round(busy / span, 3) if span else None
        counts["step_gpu_ms"] = round(span / 1e6, 3)
        counts["kinds"] = kernel_kinds([(k.name(), k.duration_ns()) for k in kernels])
    else:
        counts, ops = count_launches(host)
        # training.cuda_graph replays the forward-backward range as one graph: what the host would still
        # launch is the ops outside it, the graph, each micro-batch's three input copies and one output copy
        outside = counts["outside_forward_backward"] = outside_forward_backward(host, ops)
        counts["with_cuda_graph"] = outside + 1 + 3 * len(batches) + 1
        for e in ops:
            top[e.name()] += e.duration_ns()
        for start, stop, name in ranges:
            per_range[name] += stop - start
        launched, busy_fraction = counts.pop("launched"), None
    return {
        "launched": launched,
        **(counts if cuda else {"launch_parts": counts}),
        "busy_fraction": busy_fraction,
        "top": [(name, round(ns / 1e6, 3)) for name, ns in top.most_common(10)],
        "ranges_ms": {k: round(v / 1e6, 3) for k, v in sorted(per_range.items())},
    }


# GPU kernels by kind, first match wins: what a name contains (lower case) -> the kind
KERNEL_KINDS = (
    ("grouped_gemm", ("groupproblemshape", "grouped")),
    ("attention", ("sdpa", "flash", "fmha", "attention")),
    ("gemm", ("nvjet", "gemm", "xmma", "cutlass", "cublas")),
    ("optimizer", ("multi_tensor_apply", "adam")),
    ("inductor_reduction", ("triton_per_", "triton_red_")),
    ("inductor_pointwise", ("triton_poi_",)),
    ("copy_fill", ("copy", "memcpy", "memset", "fill")),
    (
        "moe_triton",
        (
            "_expand_kernel",
            "_reduce_kernel",
            "_weight_grad_kernel",
            "_histogram_kernel",
            "_offsets_kernel",
            "_positions_kernel",
        ),
    ),
)
SMALL_KERNEL_US = 10  # a kernel shorter than this is mostly launch latency and tail
KIND_TOP = 6  # kernels named per kind
MIN_ROW_S = 20  # no row starts with less of the run's time left (--total_s)


def kernel_kinds(kernels: list[tuple[str, int]]) -> dict[str, dict]:
    """GPU time and count per kind of kernel (``KERNEL_KINDS``; the rest ``other``) of (name, ns)
    pairs, plus ``small``: the kernels under ``SMALL_KERNEL_US``, whatever their kind (the tail that
    fusion or a graph, not a faster GEMM, would shorten). Each kind also names its ``KIND_TOP`` kernels
    by time, as [name, ms, count], so a kind's time can be traced to the code that launches it."""
    ns_by: dict[str, Counter] = {}  # kind -> kernel name -> ns
    n_by: dict[str, Counter] = {}  # kind -> kernel name -> launches

    def add(kind: str, name: str, ns: int) -> None:
        ns_by.setdefault(kind, Counter())[name[:100]] += ns
        n_by.setdefault(kind, Counter())[name[:100]] += 1

    for name, ns in kernels:
        low = name.lower()
        add(next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other"), name, ns)
        if ns < SMALL_KERNEL_US * 1000:
            add("small", name, ns)
    out = {
        kind: {
            "n": n_by[kind].total(),
            "ms": round(times.total() / 1e6, 3),
            "top": [[name, round(ns / 1e6, 3), n_by[kind][name]] for name, ns in times.most_common(KIND_TOP)],
        }
        for kind, times in ns_by.items()
    }
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))


HOST_LAUNCH = ("cudaLaunch", "cuLaunch", "cudaGraphLaunch", "cudaMemcpy", "cudaMemset")


def _range_name(name: str) -> str | None:
    """The range a host event opens (a named range of the forward, or the optimizer step), or None."""
    if name.startswith("spider."):
        return name
    return "optimizer" if name.startswith("Optimizer.step#") else None


def _containing(ranges: list[tuple[int, int, str]], at: int | None) -> set[str]:
    """The names of the ranges open at time ``at``."""
    if at is None:
        return set()
    return {name for start, stop, name in ranges if start <= at <= stop}


def run_row(name: str, overrides: dict[str, object], args: argparse.Namespace, budget: float) -> dict:
    """One row: build its trainer, warm the router, time its steps until ``budget`` seconds (compile
    included) have passed; while time is left, as many steps again back to back, then one profiled."""
    from spider_titan.config.manager import parse_args
    from spider_titan.metrics.logger import peak_flops
    from spider_titan.train import Trainer

    total_steps = args.warmup + 2 * args.steps + 1  # timed, run ahead, profiled
    argv = trainer_flags(overrides | {"training.steps": total_steps, "job.dump_folder": Path(args.out) / name})
    started = time.perf_counter()
    try:
        cfg = parse_args(argv)
        trainer = Trainer(cfg)
    except Exception as e:  # noqa: BLE001 (a row that cannot run is reported, the others go on)
        return {"skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # CPU: the generated kernels record themselves in the profile, so the launch count sees them; for this
    # row only (config.patch), not for whatever runs next in the process
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": not torch.cuda.is_available()}):
        recompiles = _Recompiles()
        dynamo_log = logging.getLogger("torch._dynamo")
        torch._logging.set_logs(recompiles=True)
        dynamo_log.addHandler(recompiles)
        result: dict = {}
        watch = None
        try:
            run = trainer.run
            cuda = run.device.type == "cuda"
            rate = warm_router(trainer)
            if rate == rate:
                result["warm_bytes_per_segment"] = round(rate, 2)
            tokens = cfg.training.local_batch_size * cfg.training.seq_len
            times, flops_per_byte, bps, drops, events = [], [], [], [], []
            watch = StepEvents(recompiles, cuda)
            for step in range(1, args.warmup + args.steps + 1):
                if time.perf_counter() - started > budget:
                    result["budget_hit"] = f"stopped after {step - 1} steps ({budget:g} s)"
                    break
                batches = trainer.next_micro_batches()
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                metrics = trainer.train_step(batches, step)
                float(metrics["ce_sum"])  # wait for the step
                dt = time.perf_counter() - t0
                happened = watch.take()
                if step == 1:
                    result["compile_s"] = round(dt, 2)
                    result["compile_events"] = happened  # e.g. Triton JIT and autotune compiles in step 1
                    if cuda:
                        torch.cuda.reset_peak_memory_stats()
                if step > args.warmup:
                    times.append(dt)
                    events.append(happened)
                    fpb = metrics.get("aux.flops_per_byte")
                    flops_per_byte.append(
                        float(fpb)
                        if fpb is not None
                        else run.spec.flops_per_token(run.model_args, cfg.training.seq_len)
                    )
                    bpseg = metrics.get("aux.bytes_per_segment")
                    if bpseg is not None:
                        bps.append(float(bpseg))
                    dropped = metrics.get("aux.segments_dropped")  # under a segment capacity
                    if dropped is not None:
                        drops.append(float(dropped))
            if times:
                median = statistics.median(times)
                fpb = statistics.fmean(flops_per_byte)
                peak = peak_flops(run.device)
                result.update(
                    bytes_per_s=round(tokens / median, 1),
                    step_s={"median": round(median, 4), "max": round(max(times), 4)},
                    slowest_over_median=round(max(times) / median, 2),
                    tflops=float(f"{fpb * tokens / median / 1e12:.4g}"),
                    mfu=None if peak is None else round(fpb * tokens / median / peak, 4),
                    flops_per_byte=round(fpb, 1),
                    slow_steps=slow_steps(times, events, args.warmup + 1),
                    timed_step_events={k: sum(e[k] for e in events) for k in events[0]},
                )
                if bps:
                    result["bytes_per_segment"] = round(statistics.fmean(bps), 2)
                if drops:
                    result["segments_dropped"] = round(statistics.fmean(drops), 4)
                if cuda:
                    result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                if time.perf_counter() - started < budget:
                    per_step = run_ahead(trainer, args.warmup + args.steps + 1, args.steps, cuda)
                    result["run_ahead_bytes_per_s"] = round(tokens / per_step, 1)
                if time.perf_counter() - started < budget:
                    result["profile"] = profile_step(trainer, args.warmup + 2 * args.steps + 1)
            result["recompiles"] = [m for m in recompiles.messages if m.startswith("Recompiling")]
            result["graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            if "profile" in result and name != "dense_1b":
                result["flops_share"] = flops_shares(
                    run.model_args, cfg.training.seq_len, result.get("bytes_per_segment")
                )
        finally:
            if watch is not None:
                watch.close()
            dynamo_log.removeHandler(recompiles)
            torch._logging.set_logs()
            trainer.close()
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def flops_shares(args, seq_len: int, bytes_per_segment: float | None) -> dict[str, float]:
    """Each named range's share of the training FLOPs (models/spider/flops.py's parts)."""
    from spider_titan.models.spider.flops import spider_flops_breakdown

    parts = spider_flops_breakdown(args, seq_len, bytes_per_segment=bytes_per_segment)
    total = sum(parts.values())
    return {rng: round(sum(parts.get(p, 0.0) for p in names) / total, 3) for rng, names in COMPONENTS.items()}


def table(report: dict) -> str:
    """The markdown table of the rows, then each profiled row's parts."""
    head = (
        "| row | bytes/s | TFLOP/s | MFU | peak GiB | compile s | slowest/median | recompiles | kernels/step | busy |"
    )
    lines = [head, "|" + "---|" * 10]
    for name, r in report["rows"].items():
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} |" + " |" * 8)
            continue
        p = r.get("profile", {})
        lines.append(
            f"| {name} | {r.get('bytes_per_s', '-')} | {r.get('tflops', '-')} | {r.get('mfu', '-')} | "
            f"{r.get('peak_memory_gib', '-')} | {r.get('compile_s', '-')} | {r.get('slowest_over_median', '-')} | "
            f"{len(r.get('recompiles', []))} | {p.get('launched', '-')} | {p.get('busy_fraction', '-')} |"
        )
    lines += [f"\n{name}, the planner: {r['planner']}" for name, r in report["rows"].items() if "planner" in r]
    for name, r in report["rows"].items():
        p = r.get("profile")
        if not p:
            continue
        lines += ["", f"**{name}**: time by part (ms) beside its FLOPs share; top kernels", ""]
        share = r.get("flops_share", {})
        spans = p.get("range_spans_ms", {})  # CUDA: the range's span on the GPU timeline
        lines += [
            f"- {k}: {v} ms"
            + (f" of kernels in a {spans[k]} ms span" if k in spans else "")
            + (f", {100 * share[k]:.0f} % of FLOPs" if k in share else "")
            for k, v in p["ranges_ms"].items()
        ]
        if "run_ahead_bytes_per_s" in r:
            lines.append(f"- run ahead (no wait between steps): {r['run_ahead_bytes_per_s']} bytes/s")
        if "step_gpu_ms" in p:
            lines.append(
                f"- the step on the GPU: {p['step_gpu_ms']} ms, {p['launched']} kernels, "
                f"{p.get('host_launches', '-')} launches from the host"
            )
        if "kinds" in p:
            lines.append("- by kind: " + ", ".join(f"{k} {v['ms']} ms ({v['n']})" for k, v in p["kinds"].items()))
        lines += [f"- `{k}`: {v} ms" for k, v in p["top"][:5]]
        if "launch_parts" in p:
            lines.append(f"- launches: {p['launch_parts']}")
        for slow in r.get("slow_steps", []):  # what a stall coincided with (StepEvents)
            lines.append(f"- slow step: {slow}")
    return "\n".join(lines) + "\n"


PROG = "python -m lab.bench.benchmark gpu_1b"
ROW_NAMES = (
    "dense_1b",
    "spider_1b_graph",
    "spider_1b_planned",
    "spider_1b_shipped",
    "spider_1b_fp8",
    "spider_1b_graph_autocast",
    "spider_1b_packed",
    "spider_1b_static",
    "spider_1b",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before any work: a mistake is one line and exit status 1 or 2."""
    p = parser(PROG, __doc__)
    p.add_argument(
        "--out", default="outputs/gpu_1b", help="folder for gpu_1b.md, gpu_1b.json and the rows' run folders"
    )
    p.add_argument(
        "--reduced", action="store_true", help="reduced widths, the 1B structure: the dry run (runs without CUDA)"
    )
    p.add_argument("--batch", type=int, default=4, help="rows per micro-batch (default 4)")
    p.add_argument("--seq", type=int, default=4096, help="bytes per row (default 4096)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps, the first of them compiles (default 3)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row (default 10)")
    p.add_argument(
        "--compile", choices=("true", "false"), default="true", help="torch.compile every row (default true)"
    )
    p.add_argument("--no_fp8", action="store_true", help="leave out the fp8 row")
    p.add_argument(
        "--capacity", type=float, default=1.5, help="spider_1b_static's model.segment_capacity (default 1.5)"
    )
    p.add_argument(
        "--packed",
        default="1.3,1.15",
        help="SLOTS,POSITIONS: spider_1b_packed's and spider_1b_graph's model.segment_capacity and "
        "model.packed_capacity (default 1.3,1.15: what trained models needed on real text, docs/benchmarks.md)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a trainer override for every Spider row (repeatable), e.g. --set model.segment_bucket=0",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=SECTION.KEY=VALUE",
        help="one more row, spider_1b_static with this override (repeatable; the same NAME gathers several), "
        "e.g. --variant no_ac=activation_checkpoint.mode=none",
    )
    p.add_argument("--rows", default="", help=f"comma-separated rows to run (default: all): {', '.join(ROW_NAMES)}")
    p.add_argument("--budget_s", type=float, default=60.0, help="seconds a row may take, compile included (60)")
    p.add_argument(
        "--fp8_budget_s",
        type=float,
        default=220.0,
        help="the fp8 row's budget (220: its compile took 146 s on an H200)",
    )
    p.add_argument(
        "--total_s",
        type=float,
        default=450.0,
        help="seconds for all rows together (450: the issue's 8 minutes with start-up); a row gets at most what "
        "is left, and none starts with under 20 s left",
    )
    args = p.parse_args(argv)
    if not args.reduced and not torch.cuda.is_available():
        raise refuse(
            PROG,
            "torch sees no CUDA device: the harness times the 1B models on a GPU; "
            "--reduced runs its dry run at tiny widths here",
        )
    check_positive(PROG, batch=args.batch, seq=args.seq, steps=args.steps, capacity=args.capacity)
    check_positive(PROG, budget_s=args.budget_s, fp8_budget_s=args.fp8_budget_s, total_s=args.total_s)
    check_not_negative(PROG, warmup=args.warmup)
    try:
        slots, positions = (float(x) for x in args.packed.split(","))
    except ValueError:
        raise refuse(PROG, f"--packed {args.packed}: give SLOTS,POSITIONS, two numbers, e.g. 1.3,1.15") from None
    check_positive(PROG, packed=min(slots, positions))
    args.packed, args.compile = (slots, positions), args.compile == "true"
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise refuse(PROG, f"--out {args.out}: is a file; give a folder")
    try:
        args.set = parse_sets(args.set)
        variants: dict[str, dict[str, str]] = {}
        for item in args.variant:
            name, eq, override = item.partition("=")
            if not (name and eq) or name in ROW_NAMES:
                raise ValueError(f"--variant {item!r}: expected NAME=SECTION.KEY=VALUE with a new row NAME")
            variants.setdefault(name, {}).update(parse_sets([override], "--variant NAME="))
        args.variant = variants
    except ValueError as e:
        raise refuse(PROG, str(e)) from None
    unknown = [r for r in args.rows.split(",") if r and r not in ROW_NAMES and r not in args.variant]
    if unknown:
        raise refuse(PROG, f"--rows: unknown {unknown}; choose from {', '.join((*ROW_NAMES, *args.variant))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(), "args": vars(args), "rows": {}}
    chosen = [r for r in args.rows.split(",") if r]
    planned_rows = rows(args)  # the configs parsed before the clock starts: --total_s is the rows' time
    deadline = time.perf_counter() + args.total_s
    planner = start_planner() if not chosen or "spider_1b_planned" in chosen else None
    for name, overrides in planned_rows:
        if chosen and name not in chosen:
            continue
        left = deadline - time.perf_counter()
        if left < MIN_ROW_S:
            report["rows"][name] = {"skipped": f"the run's {args.total_s:g} s (--total_s) were spent"}
            continue
        budget = args.fp8_budget_s if name.endswith("fp8") else args.budget_s  # fp8 compiles for longer
        said = None
        if name == "spider_1b_planned":
            flags, said = planned_checkpointing(planner, timeout=min(120.0, left - MIN_ROW_S))
            overrides = overrides | flags
            left = deadline - time.perf_counter()
        try:
            report["rows"][name] = run_row(name, overrides, args, min(budget, left))
            if said is not None:
                report["rows"][name]["planner"] = said
        except Exception as e:  # noqa: BLE001 (a row that breaks mid-run, e.g. out of memory, is reported)
            report["rows"][name] = {"skipped": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            logging.getLogger("spider_titan").exception("row %s failed", name)
        if torch.cuda.is_available():  # the next row starts from an empty cache, not this row's blocks
            gc.collect()
            torch.cuda.empty_cache()
        write_whole(out / "gpu_1b.json", json.dumps(report, indent=1))  # what finished survives a later crash
    rows_done = report["rows"]
    dense = rows_done.get("dense_1b", {}).get("bytes_per_s")
    ratios = {
        name: round(row["bytes_per_s"] / dense, 3)
        for name, row in rows_done.items()
        if dense and name != "dense_1b" and "bytes_per_s" in row
    }
    if "spider_1b" in ratios:
        report["spider_over_dense_bytes_per_s"] = ratios["spider_1b"]
    report["over_dense_bytes_per_s"] = ratios
    write_whole(out / "gpu_1b.json", json.dumps(report, indent=1))
    text = f"Machine: {report['machine']}\n\n" + table(report)
    for name, ratio in ratios.items():
        text += f"\n{name} / dense_1b bytes/s: {ratio}"
    text += "\n" if ratios else ""
    write_whole(out / "gpu_1b.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
