"""Run named benchmark scenarios and print JSON; with two scenarios, also their ratio.

    python -m lab.bench.benchmark dense_debug spider_debug --steps 20 --warmup 3
    python -m lab.bench.benchmark dense_debug --set training.seq_len=1024 --markdown docs/benchmarks.md

A *training* scenario is a config plus overrides, run in this process for ``--warmup`` steps
(not timed) and then ``--steps`` timed steps: tokens/s, step time median/min/max, peak memory.
Other scenarios (one MoE layer, activation memory, checkpoint I/O) are functions registered in
SCENARIOS. Scenarios given together run in this one process, one after the other, so a ratio
compares like with like on the same machine. ``--markdown FILE`` appends the command, the machine
and the results to FILE.

``python -m lab.bench.benchmark gpu_1b [--help]`` is the GPU harness of Spider 1B against dense 1B
(lab/bench/gpu.py): its own flags, one markdown table and one JSON. ``python -m lab.bench.benchmark
quantize --model EXPORT [--help]`` is the quality and size table of an export in fp32, bf16, int8 and
int4 (lab/bench/quantize.py), also with its own flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lab.bench.machine import machine
from lab.cli import check_not_negative, check_output_file, check_positive, parser, refuse, write_whole
from lab.overrides import parse_sets, trainer_flags

REPO = Path(__file__).resolve().parents[2]

# name -> (config file, trainer overrides)
TRAIN_SCENARIOS: dict[str, tuple[str, dict[str, object]]] = {
    "dense_debug": ("train_configs/debug_dense.toml", {}),
    "spider_debug": ("train_configs/debug_model.toml", {}),
    "spider_debug_compiled": ("train_configs/debug_model.toml", {"training.compile": True}),
}

# name -> function(args) -> dict of results
SCENARIOS: dict[str, Callable[[argparse.Namespace], dict]] = {}


def scenario(name: str):
    def register(fn):
        SCENARIOS[name] = fn
        return fn

    return register


def run_training(config: str, overrides: dict[str, object], args: argparse.Namespace) -> dict:
    """Build a Trainer in-process, run warm-up steps, then time ``args.steps`` train steps."""
    from spider_titan.config.manager import parse_args
    from spider_titan.metrics.logger import memory_gib
    from spider_titan.train import Trainer

    argv = trainer_flags(
        {
            "job.config_file": config,
            "job.dump_folder": args.dump_folder,
            "metrics.enable_tensorboard": False,
            "metrics.enable_jsonl": False,
            "validation.enable": False,
            "checkpoint.enable": False,
            "training.steps": args.warmup + args.steps,
            **overrides,
            **parse_sets(args.set or []),
        }
    )
    cfg = parse_args(argv)
    trainer = Trainer(cfg)
    try:
        run = trainer.run
        for step in range(1, args.warmup + 1):
            trainer.train_step(trainer.next_micro_batches(), step)
        if run.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for step in range(args.warmup + 1, args.warmup + args.steps + 1):
            batches = trainer.next_micro_batches()
            if run.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            metrics = trainer.train_step(batches, step)
            float(metrics["ce_sum"])  # wait for the step
            times.append(time.perf_counter() - t0)
        t = cfg.training
        tokens = t.local_batch_size * t.gradient_accumulation_steps * t.seq_len * run.parallel_dims.dp_degree
        median = statistics.median(times)
        return {
            "device": str(run.device),
            "params_m": round(sum(p.numel() for p in run.model.parameters()) / 1e6, 3),
            "tokens_per_step": tokens,
            "tokens_per_s": round(tokens / median, 1),
            "step_time_s": {"median": round(median, 4), "min": round(min(times), 4), "max": round(max(times), 4)},
            # CUDA: this scenario's peak allocation. CPU: the process's peak resident set so far,
            # which includes the scenarios that ran before this one in the same process.
            ("peak_memory_gib" if run.device.type == "cuda" else "process_peak_rss_gib_so_far"): round(
                memory_gib(run.device), 3
            ),
        }
    finally:
        trainer.close()


def flavor(args: argparse.Namespace) -> str:
    """The flavor whose shapes a scenario measures: 1B, or debug under ``--reduced`` (the suite's dry run)."""
    return "debug" if args.reduced else "1B"


def token_counts(args: argparse.Namespace, default: str) -> list[int]:
    """``--tokens`` as counts (checked positive by the command line), else ``default`` (16 ``--reduced``)."""
    return [int(t) for t in (args.tokens or ("16" if args.reduced else default)).split(",")]


def _timed(fn, *, repeats: int, warmup: int, device: torch.device) -> list[float]:
    times = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


@scenario("moe_layer")
def moe_layer(args: argparse.Namespace) -> dict:
    """One MoE layer at the 1B flavor's shapes (dim 2048, 32 experts, top-2, expert inter 528):
    the seed's Python loop over experts vs the torch backend (vs the Triton backend on GPU),
    forward and forward+backward, tokens/s and achieved TFLOP/s, for each ``--tokens`` (default 512)."""
    from spider_titan.models.spider.args import SPIDER_FLAVORS
    from spider_titan.moe.layer import MoE
    from spider_titan.moe.python_loop import python_loop_moe

    a = SPIDER_FLAVORS[flavor(args)]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = (
        args.moe_backends.split(",")
        if args.moe_backends
        else (["python_loop", "torch", "triton"] if device.type == "cuda" else ["python_loop", "torch"])
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        layer = MoE(a.dim, a.n_experts, a.top_k, a.moe_inter_dim)
    layer.to_empty(device=device)
    layer.init_weights(0.02, 0.02)
    layer.to(dtype)
    # matmul FLOPs per token: k experts x 3 projections x 2*dim*inter, plus the router
    fwd_flops_per_token = a.top_k * 3 * 2 * a.dim * a.moe_inter_dim + 2 * a.dim * a.n_experts
    out = {
        "shapes": f"dim {a.dim}, {a.n_experts} experts, top-{a.top_k}, inter {a.moe_inter_dim}, {dtype}".replace(
            "torch.", ""
        )
    }
    for tokens in token_counts(args, "512"):
        x = torch.randn(tokens, a.dim, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        row = {}
        # the seed keeps one module per expert: give the loop per-expert leaf weights
        per_expert = [
            [w.detach().clone().requires_grad_() for w in getattr(layer.experts, n)] for n in ("w1", "w3", "w2")
        ]
        for name in backends:
            if name == "python_loop":

                def forward():
                    _, idx, w = layer.route(x)
                    return python_loop_moe(x, idx, w, *per_expert)
            else:
                from spider_titan import registry

                layer.backend = registry.get("moe_backend", name)()
                forward = lambda: layer(x)[0]

            def fwd_only():
                with torch.no_grad():
                    forward()

            def fwd_bwd():
                forward().backward(dy)

            res = {}
            for label, fn, mult in (("fwd", fwd_only, 1), ("fwd_bwd", fwd_bwd, 3)):
                t = statistics.median(_timed(fn, repeats=args.steps, warmup=args.warmup, device=device))
                res[label] = {
                    "ms": round(1e3 * t, 2),
                    "tokens_per_s": round(tokens / t, 1),
                    "tflops": round(mult * fwd_flops_per_token * tokens / t / 1e12, 4),
                }
            row[name] = res
        base = row.get("torch")
        if base:
            row["speedup_vs_python_loop"] = {
                n: {k: round(row["python_loop"][k]["ms"] / row[n][k]["ms"], 3) for k in ("fwd", "fwd_bwd")}
                for n in backends
                if n != "python_loop" and "python_loop" in row
            }
        out[f"tokens_{tokens}"] = row
    return out


@scenario("attention")
def attention(args: argparse.Namespace) -> dict:
    """MLA's causal attention at the 1B flavor's shapes (16 heads, qk 192, v 128; seq from
    ``--tokens``, default 512), forward+backward, with each SDPA backend forced alone and with the trainer's
    priority list (models/common.py SDPA_PRIORITY); a backend that refuses the shapes is reported
    as such. Meant for GPUs; on CPU only flash (CPU) and math run."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from spider_titan.models.common import causal_sdpa
    from spider_titan.models.spider.args import SPIDER_FLAVORS

    a = SPIDER_FLAVORS[flavor(args)]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    qk, vd = a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim
    out = {"shapes": f"{a.n_heads} heads, qk {qk}, v {vd}, {dtype}".replace("torch.", "")}
    for seq in token_counts(args, "512"):
        q = torch.randn(1, a.n_heads, seq, qk, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(1, a.n_heads, seq, qk, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(1, a.n_heads, seq, vd, device=device, dtype=dtype, requires_grad=True)
        row = {}
        for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", "priority"):

            def run():
                if name == "priority":
                    y = causal_sdpa(q, k, v)
                else:
                    with sdpa_kernel([getattr(SDPBackend, name)]):
                        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                y.sum().backward()

            try:
                t = statistics.median(_timed(run, repeats=args.steps, warmup=args.warmup, device=device))
                row[name.lower()] = {"ms_fwd_bwd": round(1e3 * t, 3)}
            except RuntimeError as e:
                row[name.lower()] = {"refused": str(e).splitlines()[0][:120]}
        out[f"seq_{seq}"] = row
    return out


@scenario("packed_rows")
def packed_rows(args: argparse.Namespace) -> dict:
    """The core attention's layout changes at the 1B shapes: q, k (16 x 192) and v (16 x 128) padded from
    packed positions to (B, S) slots and the output (16 x 128) packed back, compiled, forward+backward.
    4 rows of 4096 bytes at 4 bytes per segment: 1.3 slots and 1.15 packed positions (the harness's
    --packed), 95 % of the slots real."""
    from spider_titan.models.spider.args import SPIDER_FLAVORS
    from spider_titan.models.spider.attention import PackedRows

    a = SPIDER_FLAVORS[flavor(args)]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    qk, vd, h = a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim, a.n_heads
    rows, segments = (2, 64 // 4) if args.reduced else (4, 4096 // 4)
    slots, positions = int(1.3 * segments), int(1.15 * segments) * rows
    g = torch.Generator().manual_seed(0)
    packed = PackedRows.fixed((torch.rand(rows, slots, generator=g) < 0.95).to(device), positions)

    def step(q, k, v):
        q, k, v = packed.pad(q), packed.pad(k), packed.pad(v)
        return (packed.pack(q[..., :vd] * k[..., :vd] + v) * 1.5).float().sum()  # stands in for attention

    q, k = (torch.randn(1, positions, h, qk, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(1, positions, h, vd, device=device, dtype=dtype, requires_grad=True)
    compiled = torch.compile(step, backend="eager" if args.reduced else "inductor")  # the dry run: no codegen
    t = statistics.median(
        _timed(lambda: compiled(q, k, v).backward(), repeats=args.steps, warmup=args.warmup, device=device)
    )
    return {
        "shapes": f"{rows} rows x {slots} slots, {positions} positions, {h} heads, {dtype}",
        "ms_fwd_bwd": round(1e3 * t, 2),
    }


@scenario("pooling_memory")
def pooling_memory(args: argparse.Namespace) -> dict:
    """Spider's segment pooling (downsample + upsample) at T 4096, dim 2048, fp32: bytes alive after
    forward for the scatter/gather implementation vs the former dense (B, S, T) matrices + bmm."""
    from spider_titan.metrics.memory import count_live_activation_bytes
    from spider_titan.models.spider.segmentation import downsample, segment_bytes, upsample

    def dense(x, y, seg):  # the pre-2026-11-23 pooling
        S = seg.num_segments
        member = seg.seg_id[:, None, :] == torch.arange(S)[None, :, None]
        w = member.float()
        w = w / w.sum(-1, keepdim=True).clamp(min=1.0)
        prev = (seg.seg_id[:, :, None] - 1) == torch.arange(S)[None, None, :]
        return torch.bmm(w, x), torch.bmm(prev.float(), y)

    torch.manual_seed(0)
    T, D = (256, 64) if args.reduced else (4096, 2048)
    ids = torch.randint(0, 256, (1, T))
    seg = segment_bytes(torch.randn(1, T), ids, max_segment_bytes=16)
    x = torch.randn(1, T, D, requires_grad=True)
    y = torch.randn(1, seg.num_segments, D, requires_grad=True)
    out = {"shape": f"T {T}, S {seg.num_segments}, dim {D}, fp32"}  # the shape the figures hold for
    for name, fn in (("scatter", lambda: (downsample(x, seg), upsample(y, seg))), ("dense", lambda: dense(x, y, seg))):
        with count_live_activation_bytes(x, y) as live:
            result = fn()
        out[f"{name}_live_mib"] = round(live.total / 2**20, 1)
        del result
    out["ratio"] = round(out["dense_live_mib"] / out["scatter_live_mib"], 2)
    return out


@scenario("ac_memory")
def ac_memory(args: argparse.Namespace) -> dict:
    """Bytes of activations forward leaves alive for backward, per activation-checkpoint mode,
    counted on the device-independent level (metrics/memory.py): the whole debug flavor for
    n_loops 2/4/8, and one 1B core block at 2048 positions."""
    from spider_titan.components.builder import build_model, materialize
    from spider_titan.config.manager import parse_args
    from spider_titan.metrics.memory import count_live_activation_bytes
    from spider_titan.parallel.activation_checkpoint import apply_ac

    modes = [("none", "op"), ("full", "op"), ("selective", "op"), ("selective", "2"), ("recurrent", "op")]
    mib = lambda b: round(b / 2**20, 2)  # noqa: E731
    out: dict = {"debug_flavor_B4_T512": {}}
    torch.manual_seed(0)
    x = torch.randint(0, 256, (4, 512))
    for n_loops in (2,) if args.reduced else (2, 4, 8):
        row = {}
        for mode, option in modes:
            cfg = parse_args(
                [
                    "--model.name",
                    "spider",
                    "--model.n_loops",
                    str(n_loops),
                    "--model.max_loops",
                    "8",
                    "--activation_checkpoint.mode",
                    mode,
                    "--activation_checkpoint.selective_ac_option",
                    option,
                ],
                env={},
            )
            _, _, model = build_model(cfg)
            materialize(model, torch.device("cpu"), 0)
            torch.manual_seed(1)
            with count_live_activation_bytes(model, x) as live:
                result = model(x)
            result.logits.sum().backward()
            row[mode if mode != "selective" else f"selective_{option}"] = mib(live.total)
        row["none/recurrent"] = round(row["none"] / row["recurrent"], 2)
        out["debug_flavor_B4_T512"][f"n_loops_{n_loops}"] = row

    # One 1B core block: (1, 2048 positions, dim 2048), fp32 on CPU.
    from spider_titan.models.spider.args import SPIDER_FLAVORS
    from spider_titan.models.spider.model import SPIDER_SPEC

    block_row = {}
    block_flavor, block_seq = (flavor(args), 64 if args.reduced else 2048)
    for mode, option in [("none", "op"), ("full", "op"), ("selective", "op")]:
        model = SPIDER_SPEC.build_on_meta(SPIDER_FLAVORS[block_flavor])
        apply_ac(
            model,
            SPIDER_SPEC,
            parse_args(
                ["--activation_checkpoint.mode", mode, "--activation_checkpoint.selective_ac_option", option], env={}
            ).activation_checkpoint,
        )
        block = model.core.layers[0]
        block.to_empty(device="cpu")
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02)
        block_row[mode if mode != "selective" else "selective_op"] = mib(
            _core_block_live_bytes(block, SPIDER_FLAVORS[block_flavor], seq=block_seq)
        )
    out[f"{block_flavor}_core_block_S{block_seq}"] = block_row
    return out


def _core_block_live_bytes(block, args, *, seq: int) -> int:
    """Live bytes after one core block's forward on (1, seq, dim) segments (loop 0)."""
    from spider_titan.metrics.memory import count_live_activation_bytes
    from spider_titan.models.common import rope_frequencies

    torch.manual_seed(0)
    h = torch.randn(1, seq, args.dim, requires_grad=True)
    freqs = rope_frequencies(args.qk_rope_head_dim, seq, args.rope_theta)
    buckets = torch.randint(0, args.engram_buckets, (1, seq, 2))
    mask = torch.ones(1, seq, dtype=torch.bool)
    loop = torch.tensor(0)  # the loop index, a 0-dim tensor as the core passes it
    # the block's Engram memory (what the core computes once per step for every loop), when it has one
    memory = None if block.engram is None else block.engram.memory(buckets, h.dtype).detach()
    known = [x for x in (block, h, freqs, memory, mask) if x is not None]
    with count_live_activation_bytes(*known) as live:
        out, aux, _ = block(h, loop, freqs, memory, mask)
    (out.sum() + aux).backward()
    return live.total


@scenario("comm")
def comm(args: argparse.Namespace) -> dict:
    """Bytes all-gathered / reduce-scattered / all-to-all'd per step on 2 gloo ranks: core bytes
    vs n_loops, fp8 vs bf16 all-gather, expert parallel (lab/bench/comm.py)."""
    from lab.bench.comm import benchmark_comm

    return benchmark_comm(argparse.Namespace(**vars(args), comm_steps=1) if args.reduced else args)


@scenario("generate")
def generate_speed(args: argparse.Namespace) -> dict:
    """Sampling speed of the debug Spider (random weights, fp32, max_seq_len 8192), cached
    (models/spider/decode.py) vs recomputing the context every byte, at several context lengths
    (``--tokens``, default 256,1024,4096): bytes/s of each and their ratio, in one process. The
    context is filled first (untimed); then ``new`` bytes are timed, greedy."""
    from spider_titan.generation import sample_next
    from spider_titan.models.spider import SPIDER_FLAVORS, Spider
    from spider_titan.models.spider.decode import decode, new_cache

    contexts = token_counts(args, "256,1024,4096")
    torch.manual_seed(0)
    model = Spider(dataclasses.replace(SPIDER_FLAVORS["debug"], max_seq_len=max(contexts) + 256))
    model.init_weights()
    model.eval()
    text = (Path(__file__).resolve().read_bytes() * 8)[: max(contexts)]
    results = {}
    with torch.no_grad():
        for ctx in contexts:
            ids = [257, *text[: ctx - 1]]
            cache = new_cache(model, 1)
            last = decode(model, torch.tensor([ids]), cache)[0, -1]
            new = 4 if args.reduced else 64
            t0 = time.perf_counter()
            for _ in range(new):
                nxt = sample_next(last, temperature=0)
                last = decode(model, torch.tensor([[nxt]]), cache)[0, -1]
            cached = new / (time.perf_counter() - t0)
            steps = 2 if args.reduced else max(2, min(16, 16384 // ctx))
            window = list(ids)
            t0 = time.perf_counter()
            for _ in range(steps):
                logits = model(torch.tensor([window])).logits[0, -1]
                window.append(sample_next(logits, temperature=0))
            recompute = steps / (time.perf_counter() - t0)
            results[str(ctx)] = {
                "cached_bytes_per_s": round(cached, 1),
                "recompute_bytes_per_s": round(recompute, 2),
                "ratio": round(cached / recompute, 1),
                "timed_bytes": {"cached": new, "recompute": steps},
            }
    return {
        "model": "spider debug, random weights, fp32, 1 row",
        "contexts": results,
        "generate_py": _time_generate_script(model, text[: 64 if args.reduced else 1000], args.model, args.reduced),
    }


def _time_generate_script(model: torch.nn.Module, prompt: bytes, export: str | None, reduced: bool) -> dict:
    """``scripts/generate.py`` itself, cached and with ``--no_cache``: ``prompt`` (1,000 bytes), 200 new
    bytes (8 ``reduced``; seeded sampling), on ``export`` (default: ``model`` written as an export to a
    temporary folder): the wall time of each command and the bytes/s it reports (its prompt and sampling)."""
    import re
    import subprocess
    import tempfile

    from spider_titan.checkpoint.export import write_export
    from spider_titan.checkpoint.layout import ModelIdentity

    label = export or "the random model, exported"
    with tempfile.TemporaryDirectory() as tmp:
        if export is None:
            export = str(Path(tmp) / "export")
            identity = ModelIdentity.of("spider", "debug", model.args)
            write_export(model.state_dict(), identity, Path(export), dtype=torch.float32)
        (Path(tmp) / "prompt").write_bytes(prompt)
        base = [sys.executable, str(REPO / "scripts" / "generate.py"), "--model", export, "--report"]
        new = 8 if reduced else 200
        base += ["--prompt_file", str(Path(tmp) / "prompt"), "--max_new_bytes", str(new), "--device", "cpu"]
        row = {"model": label, "prompt_bytes": len(prompt), "new_bytes": new}
        for name, extra in (("cached", []), ("no_cache", ["--no_cache"])):
            t0 = time.perf_counter()
            done = subprocess.run(base + extra, capture_output=True, text=True, check=True)
            wall = time.perf_counter() - t0
            rate = re.search(r"\(([\d.]+) bytes/s", done.stderr)
            row[name] = {"wall_s": round(wall, 2), "reported_bytes_per_s": float(rate.group(1)) if rate else None}
        row["ratio"] = round(row["cached"]["reported_bytes_per_s"] / row["no_cache"]["reported_bytes_per_s"], 1)
    return row


@scenario("ep_capacity")
def ep_capacity(args: argparse.Namespace) -> dict:
    """Expert-parallel all-to-all bytes and dropped pairs: dynamic vs fixed-capacity dispatch at several
    capacity factors, on 2 gloo ranks training the debug model (lab/bench/comm.py)."""
    from lab.bench.comm import benchmark_ep_capacity

    return benchmark_ep_capacity(args)


@scenario("checkpoint_io")
def checkpoint_io(args: argparse.Namespace) -> dict:
    """DCP save/load time and size for the debug flavors, and the 1B flavors estimated from a
    meta-device model and the measured disk bandwidth (lab/bench/checkpoint.py)."""
    from lab.bench.checkpoint import benchmark_checkpoint_io

    return benchmark_checkpoint_io(args)


@scenario("kernel_bytes")
def kernel_bytes(args: argparse.Namespace) -> dict:
    """Bytes Inductor's kernels move per compiled step of the reduced-width Spider 1B (bf16, CPU), by
    kernel, under each training.mixed_precision_mode: a proxy for a GPU step's non-GEMM time
    (lab/bench/kernel_bytes.py)."""
    from lab.bench.kernel_bytes import benchmark_kernel_bytes

    return benchmark_kernel_bytes(args)


@scenario("eager_bytes")
def eager_bytes(args: argparse.Namespace) -> dict:
    """Bytes the ops outside compiled code move per step of ``--config`` (default: the one-GPU Spider 1B)
    at its real width, on fake tensors, by op and by source line (lab/bench/eager_bytes.py)."""
    from lab.bench.eager_bytes import benchmark_eager_bytes

    return benchmark_eager_bytes(args)


PROG = "python -m lab.bench.benchmark"
MOE_BACKENDS = ("python_loop", "torch", "triton")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, checked before any scenario runs: a mistake is one line and exit status 1 or 2."""
    p = parser(PROG, __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "scenarios",
        nargs="+",
        help=f"one or two of: {', '.join(sorted(TRAIN_SCENARIOS) + sorted(SCENARIOS))}; or gpu_1b or quantize "
        "first, with their own flags (gpu_1b --help)",
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps (repeats of the other scenarios; default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a trainer override (repeatable) for the training scenarios, eager_bytes and ep_capacity, "
        "e.g. --set training.seq_len=1024",
    )
    p.add_argument("--dump_folder", default="./outputs/benchmark", help="folder for the runs' files")
    p.add_argument("--markdown", help="append the command, the machine and the results to this markdown file")
    p.add_argument(
        "--tokens",
        default=None,
        help="comma-separated counts: moe_layer's tokens and attention's sequence lengths (default 512), "
        "generate's contexts (default 256,1024,4096)",
    )
    p.add_argument("--model", help="generate: time scripts/generate.py on this export (default: the random model)")
    p.add_argument("--moe_backends", default="", help=f"moe_layer: comma-separated, of {', '.join(MOE_BACKENDS)}")
    p.add_argument("--config", help="eager_bytes: the training config (default: train_configs/spider_1b_1gpu.toml)")
    p.add_argument(
        "--bandwidth_tbs", type=float, default=4.0, help="eager_bytes: the memory bandwidth its milliseconds assume"
    )
    p.add_argument("--top", type=int, default=25, help="eager_bytes: the source lines to list (default 25)")
    p.add_argument(
        "--reduced",
        action="store_true",
        help="tiny shapes and single repeats, the same code paths: the suite's dry run (its figures mean nothing)",
    )
    args = p.parse_args(argv)
    known = sorted(TRAIN_SCENARIOS) + sorted(SCENARIOS)
    own = [s for s in args.scenarios if s in ("gpu_1b", "quantize")]
    if own:
        raise refuse(PROG, f"{own[0]} has its own command line: give it first and alone ({PROG} {own[0]} --help)")
    unknown = [s for s in args.scenarios if s not in known]
    if unknown:
        raise refuse(PROG, f"unknown scenario(s) {unknown}; choose from {', '.join(known)}")
    if len(args.scenarios) > 2:
        raise refuse(PROG, f"{len(args.scenarios)} scenarios: give one, or two to compare")
    check_positive(PROG, steps=args.steps, bandwidth_tbs=args.bandwidth_tbs, top=args.top)
    check_not_negative(PROG, warmup=args.warmup)
    if args.tokens is not None:
        counts = args.tokens.split(",")
        if not all(c.strip().isdigit() and int(c) > 0 for c in counts):
            raise refuse(PROG, f"--tokens {args.tokens}: give positive whole numbers, comma-separated, e.g. 256,1024")
    backends = [b for b in args.moe_backends.split(",") if b]
    wrong = [b for b in backends if b not in MOE_BACKENDS]
    if wrong:
        raise refuse(PROG, f"--moe_backends: unknown {wrong}; choose from {', '.join(MOE_BACKENDS)}")
    if "triton" in backends and not torch.cuda.is_available():
        raise refuse(PROG, "--moe_backends triton: torch sees no CUDA device here; leave triton out")
    if args.config is not None and not Path(args.config).is_file():
        raise refuse(PROG, f"--config {args.config}: no such file; give a training config (train_configs/*.toml)")
    if args.model is not None and not Path(args.model).is_dir():
        raise refuse(PROG, f"--model {args.model}: no such folder; give an export (scripts/export_safetensors.py)")
    check_output_file(PROG, "--markdown", args.markdown)
    if Path(args.dump_folder).exists() and not Path(args.dump_folder).is_dir():
        raise refuse(PROG, f"--dump_folder {args.dump_folder}: is a file; give a folder")
    try:
        parse_sets(args.set)
    except ValueError as e:
        raise refuse(PROG, str(e)) from None
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu_1b"]:  # the GPU harness has its own command line (gpu.py)
        from lab.bench.gpu import main as gpu_1b

        return gpu_1b(argv[1:])
    if argv[:1] == ["quantize"]:  # exports in four formats, its own command line (quantize.py)
        from lab.bench.quantize import main as quantize

        return quantize(argv[1:])
    args = parse_args(argv)
    results = {}
    for name in args.scenarios:
        if name in TRAIN_SCENARIOS:
            results[name] = run_training(*TRAIN_SCENARIOS[name], args)
        else:
            results[name] = SCENARIOS[name](args)
    report = {"machine": machine(), "results": results}
    if len(args.scenarios) == 2:
        a, b = (results[n] for n in args.scenarios)
        if "tokens_per_s" in a and "tokens_per_s" in b:
            report["ratio_tokens_per_s"] = {
                f"{args.scenarios[0]}/{args.scenarios[1]}": round(a["tokens_per_s"] / b["tokens_per_s"], 3)
            }
    text = json.dumps(report, indent=2)
    print(text)
    if args.markdown:  # appended: the file's text and the new section, written whole
        before = Path(args.markdown).read_text() if Path(args.markdown).exists() else ""
        command = " ".join([PROG, *argv])
        section = f"\n### `{command}`\n\nMachine: {report['machine']}. Date: {time.strftime('%Y-%m-%d')}.\n\n"
        write_whole(args.markdown, before + section + f"```json\n{text}\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
