"""Plan a run before paying for it: per-rank memory, communication, FLOPs and step time at N GPUs.

    python -m spider_titan.plan --job.config_file train_configs/spider_1b.toml --ngpu 8
    python -m spider_titan.plan --job.config_file X --ngpu 64 --training.local_batch_size 8 --mfu 0.35

No GPU and no weights: the model is built on the meta device by the builder's own steps 3-7
(``build_model``: converters, MoE backend, activation checkpointing), and the REAL parallelize
component (expert parallel, then FSDP2 / HSDP, the units of parallel/parallelize.py) is applied to
it under torch.distributed's ``fake`` process group of N ranks with the config's mesh
(``ParallelDims``). Every per-rank size below is then read from what FSDP2 built, not divided by
hand: the local shards of the DTensor parameters, and each unit's FSDP parameter groups (padded
shard sizes, param / reduce dtypes, shard mesh, whether it reshards after forward).

Per rank, for one optimizer step (``accumulation`` micro-batches of ``local_batch_size x seq_len``):

* parameters, gradients (sharded, fp32 like the sharded parameters), optimizer state (AdamW: two
  moments per parameter; Muon: one momentum buffer for its matrices, AdamW's two for the rest),
  counted on the optimizer the config names, built on the sharded meta parameters;
* the unsharded accumulated gradient: with ``gradient_accumulation_steps > 1`` FSDP2's gradient
  sync is off for all but the last micro-batch (fsdp.maybe_no_grad_sync), so every unit's
  unsharded gradient stays alive, in the reduce dtype (FSDP2 keeps ``unsharded_accumulated_grad``
  in ``reduce_dtype`` when it differs from the param dtype);
* gathered FSDP units at the peak: the root (never resharded), the units kept gathered from forward
  to backward (the recurrent core under ``fsdp_keep_core_gathered_fraction`` of ``--gpu_memory_gib``),
  and the two largest other units (the one computing and the one prefetched), in their all-gather dtype;
* activations and backward transients, MEASURED by running one micro-batch's forward, loss and
  backward at the config's real width, batch and sequence on fake tensors (no memory, no compute),
  under the config's activation checkpointing, counting the storages alive: "activations" is what
  forward and loss leave for backward, "backward transients" what the step's high-water mark holds
  beyond them (recomputed blocks, activation gradients). The blocks the trainer compiles run as
  torch.compile partitions them (:class:`CompiledSaves`: AOT autograd, Inductor's decompositions and
  min-cut partitioner), each compiled graph counted by what it returns, as its fused kernels keep
  little else. Without FSDP the step runs as the builder sets it up on a GPU: fp32 parameters cast
  once per step ("compute weights"), all of them (``mixed_precision_mode = "params"``) or the matmul
  weights under autocast. Assumptions, each stated in the output:
  - the one data-dependent host read of the forward (Spider's segment count S) returns
    ``ceil(seq_len * moe_tokens_per_byte)`` of the model's spec (Spider: one segment per
    ``target_bytes_per_segment`` bytes); boolean checks read "true";
  - attention saves what the GPU kernels save (q, k, v, output, fp32 logsumexp), not the T x T
    matrix of the CPU math fallback (MLA's qk and v head dims differ, which CPU flash refuses);
  - the MoE backend is ``torch`` (the Triton kernels do not run on fake CPU tensors);
  - under ``mixed_precision_mode = "autocast"``, autocast is the CPU's (its fp32 op list is shorter than CUDA's);
* reduce-scatter staging: the largest unit's reduce-scatter input (its unsharded gradient, reduce dtype);
* collectives per step, by kind and FSDP unit / MoE layer, with the CommCounter's conventions
  (parallel/comm_counter.py): all-gather = gathered output, reduce-scatter = input, all-to-all =
  what this rank sends, plus HSDP's all-reduce of the sharded gradient (not counted by the counter);
* FLOPs per step from the model spec's ``flops_per_token``; step time and tokens/s at ``--mfu`` of
  ``--peak_tflops`` (default: H100 bf16 dense 989 TFLOP/s, x2 when the float8 converter is on);
* the micro-batch: the split of the rows per step with the most rows per micro-batch that fits with
  room to spare (:func:`largest_micro_batch`), as the flags that ask for it; and whether that
  micro-batch needs activation checkpointing at all (:func:`without_checkpointing`: the same step
  measured with it off, and the share of matmul FLOPs its recompute costs); where it does and blocks
  are compiled, the largest compiled memory budget that fits (:func:`budget_that_fits`, ``--search_budget``).

Not counted: CUDA context and NCCL buffers (~1-3 GiB), the caching allocator's fragmentation.
Validated against real gloo runs at debug size (tests/distributed/test_plan_validation.py), real
compiled and eager CPU steps (tests/unit/test_plan.py) and three peaks of Spider 1B on an H200
(docs/benchmarks.md, "The planner's peak").
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import operator
import sys
import typing
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from spider_titan import registry
from spider_titan.config.manager import ConfigError
from spider_titan.config.parse import convert, field_docs, parse, show, split_cli, type_name
from spider_titan.config.validate import field_range, validate
from spider_titan.job_config import JobConfig, Range, ranged
from spider_titan.parallel.fsdp import keep_gathered
from spider_titan.parallel.mesh import ParallelDims, destroy_process_groups, use_fsdp
from spider_titan.parallel.parallelize import _loop_owners, fsdp_units
from spider_titan.protocol import DTYPES

logger = logging.getLogger("spider_titan")

GIB = 2**30
H100_BF16_DENSE_TFLOPS = 989.0
USAGE = (
    "usage: python -m spider_titan.plan --job.config_file FILE --ngpu N [--mfu 0.4] [--gpu_memory_gib 80] "
    "[--peak_tflops T] [--section.key value ...]"
)


@dataclass
class PlanOptions:
    """The plan's own flags: ``--key value``, ``--key=value`` or ``--plan.key value``, read with the
    config parser's own splitting and conversion (config/parse.py); every other flag is the training
    config's ``--section.key value``."""

    ngpu: int = field(metadata={"range": Range(low=1)})
    """GPUs (ranks) to plan for; required."""
    mfu: float = ranged(0.4, low=0, high=1, low_open=True)
    """Model FLOPs utilisation the step time assumes, a fraction (e.g. 0.4)."""
    gpu_memory_gib: float = ranged(80.0, low=0, low_open=True)
    """Memory of one GPU, GiB: the budget of the verdict and of keeping the recurrent core gathered."""
    peak_tflops: float | None = field(default=None, metadata={"range": Range(low=0, low_open=True)})
    """Peak dense TFLOP/s of one GPU; none: H100 bf16 (989), doubled with the float8 converter."""
    search_budget: bool = True
    """When checkpointing is needed and blocks are compiled: find the largest compiled memory budget
    (``activation_checkpoint.mode = "memory_budget"``) that fits, a measurement per budget tried."""


PLAN_SECTION = "plan"


def parse_plan_args(argv: list[str]) -> tuple[PlanOptions, JobConfig]:
    """The plan's flags and the training config ``argv`` asks for; ConfigError with every problem of
    both, one line each (the config is validated for ``--ngpu`` ranks once that is known)."""
    hints = typing.get_type_hints(PlanOptions)
    # the plan's flags are keys of a [plan] section, so the config's splitter reads both in one pass
    named = [f"--{PLAN_SECTION}.{a[2:]}" if a[:2] == "--" and a[2:].partition("=")[0] in hints else a for a in argv]
    pairs, problems = split_cli(named)
    problems = [p.replace(f"--{PLAN_SECTION}.", "--") for p in problems]
    values: dict[str, Any] = {}
    rest: list[str] = []
    for dotted, raw in pairs:
        section, _, key = dotted.partition(".")
        if section != PLAN_SECTION:
            rest.append(f"--{dotted}={raw}")
        elif key not in hints:
            problems.append(f"--{dotted}: unknown plan flag; plan flags: {', '.join('--' + k for k in hints)}")
        else:
            try:
                values[key] = convert(raw, hints[key], from_cli=True)
            except ValueError as e:
                problems.append(f"--{key}: {e}")
    for f in dataclasses.fields(PlanOptions):
        value = values.get(f.name)
        if value is not None and not field_range(f).allows(value):
            problems.append(f"--{f.name} {show(value)} is not allowed; use {field_range(f).describe(hints[f.name])}")
            del values[f.name]
    if "ngpu" not in values and not any(p.startswith("--ngpu") for p in problems):
        problems.append(f"--ngpu: required, the number of GPUs (ranks) to plan for ({USAGE})")
    cfg, config_problems = parse(rest)
    if cfg is not None and "ngpu" in values:  # the parallelism checks need the world size
        config_problems += validate(cfg, env={"WORLD_SIZE": str(values["ngpu"])})
    problems += config_problems
    if problems:
        raise ConfigError(problems)
    return PlanOptions(**values), cfg


def plan_flags_help() -> str:
    """``--help``'s lines for the plan's own flags, from their docstrings."""
    docs, hints = field_docs(PlanOptions), typing.get_type_hints(PlanOptions)
    lines = ["plan flags (--key value, --key=value or --plan.key value):"]
    for f in dataclasses.fields(PlanOptions):
        allowed = field_range(f).text()
        default = "" if f.default is dataclasses.MISSING else f", default {show(f.default)}"
        lines.append(
            f"  --{f.name} ({type_name(hints[f.name])}{' ' + allowed if allowed else ''}{default}): {docs[f.name]}"
        )
    lines.append("every other flag is the training config's: python -m spider_titan.train --help")
    return "\n".join(lines)


# ---------------------------------------------------------------- the sharded model under a fake PG


@contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """torch.distributed's ``fake`` backend as the default group: collectives return at once,
    nothing is sent, so the real parallelize runs on one CPU for any world size."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("plan: a process group is already initialised; run the plan in its own process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        destroy_process_groups()


def planning_config(cfg: JobConfig) -> JobConfig:
    """A copy of ``cfg`` for meta builds: no torch.compile (Dynamo cannot trace under the measuring
    dispatch mode; the activation measurement stands in for it with :class:`CompiledSaves`)."""
    cfg = copy.deepcopy(cfg)
    cfg.training.compile = False
    return cfg


def keep_gathered_overrides(
    cfg: JobConfig, spec, model: nn.Module, param_dtype: torch.dtype, gpu_memory_bytes: float
) -> list[str]:
    """fsdp.py's keep-the-core-gathered rule decided for the GPU's memory (on the meta device
    parallelize would ask the host's), as ``FQN=true|false`` entries the config's own
    ``fsdp_reshard_after_forward_units`` still override."""
    par = cfg.parallelism
    if par.fsdp_reshard_after_forward != "default" or par.fsdp_keep_core_gathered_fraction <= 0:
        return []
    out = []
    for owner in _loop_owners(spec):
        if owner:
            kept = keep_gathered(
                model.get_submodule(owner), param_dtype, gpu_memory_bytes, par.fsdp_keep_core_gathered_fraction
            )
            out.append(f"{owner}={'false' if kept else 'true'}")
    return out


def build_sharded_model(cfg: JobConfig, ngpu: int, gpu_memory_bytes: float):
    """(spec, args, model, dims, units) with the real parallelize applied at ``ngpu`` ranks on
    meta; call inside :func:`fake_process_group` (units: the FSDP units, [] without FSDP)."""
    from spider_titan.components.builder import build_model

    cfg = planning_config(cfg)
    param_dtype, reduce_dtype = DTYPES[cfg.training.mixed_precision_param], DTYPES[cfg.training.mixed_precision_reduce]
    dims = ParallelDims.from_config(cfg.parallelism, ngpu)
    spec, args, model = build_model(cfg)
    cfg.parallelism.fsdp_reshard_after_forward_units = keep_gathered_overrides(
        cfg, spec, model, param_dtype, gpu_memory_bytes
    ) + list(cfg.parallelism.fsdp_reshard_after_forward_units)
    cfg.parallelism.comm_counter = False
    meshes = dims.build_meshes("cpu") if ngpu > 1 else None
    name = cfg.parallelism.name
    registry.get("parallelize", name)(
        model,
        spec,
        dims,
        meshes,
        registry.section("parallelize", name, cfg),
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
    )
    units = fsdp_units(spec, model) if ngpu > 1 and use_fsdp(cfg.parallelism, dims) else []
    return spec, args, model, dims, units


@dataclass
class UnitGroup:
    """One FSDP parameter group of one unit (a unit has two under expert parallel: dense, experts)."""

    tag: str  # the CommCounter's tag: unit FQN ("root"), "<unit>.experts" for expert weights
    shard_size: int  # ranks the group is sharded over
    replicas: int  # HSDP replicas (1 without)
    reshard_after_forward: bool
    gathered_bytes: int  # the unsharded parameters in their all-gather dtype (padded)
    reduce_scatter_bytes: int  # the reduce-scatter input: padded unsharded gradient, reduce dtype
    accumulated_grad_bytes: int  # the unsharded gradient kept between micro-batches


def fsdp_groups(model: nn.Module, units: list[tuple[str, nn.Module]]) -> list[UnitGroup]:
    """Every FSDP unit's parameter groups as FSDP2 built them (sizes padded the way it pads)."""
    out = []
    for fqn, module in [*units, ("root", model)]:
        state = module._get_fsdp_state()
        n_groups = len(state._fsdp_param_groups)
        for group in state._fsdp_param_groups:
            info = group.mesh_info
            shard = info.shard_mesh_size
            replicas = getattr(info, "replicate_mesh_size", 1)
            gathered = rs = acc = 0
            for fp in group.fsdp_params:
                padded = fp.padded_sharded_param_size.numel() * shard
                # what lazy init will resolve (fp.param_dtype / reduce_dtype are set at the first forward)
                param_dtype = fp.mp_policy.param_dtype or fp.sharded_param.dtype
                # a float8 weight (torchao's fsdp_pre_all_gather) is gathered as 1-byte float8
                ag_itemsize = 1 if hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather") else param_dtype.itemsize
                reduce_dtype = fp.mp_policy.reduce_dtype or param_dtype
                gathered += padded * ag_itemsize
                rs += padded * reduce_dtype.itemsize
                acc += math.prod(fp._orig_size) * reduce_dtype.itemsize
            # expert weights form their own group only when they live on another mesh (expert parallel)
            is_expert = n_groups > 1 and all(".experts." in n for n in _group_param_names(module, group))
            out.append(
                UnitGroup(
                    tag=f"{fqn}.experts" if is_expert else fqn,
                    shard_size=shard,
                    replicas=replicas,
                    reshard_after_forward=group.post_forward_mesh_info is not None,
                    gathered_bytes=gathered,
                    reduce_scatter_bytes=rs,
                    accumulated_grad_bytes=acc,
                )
            )
    return out


def _group_param_names(module: nn.Module, group) -> list[str]:
    ids = {id(fp.sharded_param) for fp in group.fsdp_params}
    return [n for n, p in module.named_parameters() if id(p) in ids]


def local_bytes(tensors) -> dict[str, int]:
    """{dtype name: bytes} of the local shards of ``tensors`` (DTensor or plain)."""
    out: dict[str, int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        key = str(local.dtype).replace("torch.", "")
        out[key] = out.get(key, 0) + local.numel() * local.element_size()
    return out


def optimizer_state_bytes(model: nn.Module, cfg: JobConfig) -> int:
    """Bytes of the optimizer's per-parameter state on this rank, from the optimizer the config
    names built on the (sharded, meta) parameters: AdamW keeps ``exp_avg`` and ``exp_avg_sq`` like
    the parameter, Muon one ``momentum_buffer`` (its AdamW part two moments)."""
    optimizer = registry.get("optimizer", cfg.optimizer.name)(model, cfg.optimizer)
    inner = [optimizer.muon, optimizer.adamw] if hasattr(optimizer, "muon") else [optimizer]
    total = 0
    for opt in inner:
        states = 1 if isinstance(opt, torch.optim.Muon) else 2
        for group in opt.param_groups:
            total += states * sum(sum(local_bytes([p]).values()) for p in group["params"])
    return total


# ---------------------------------------------------------------- activations, measured on fake tensors


def _flop_formulas() -> dict:
    # imported here: torch.utils.flop_counter imports Triton, which must not happen before a test (or
    # a user) sets TRITON_INTERPRET
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    from spider_titan.moe.layer import grouped_mm_flop, grouped_mm_ops

    return {**flop_registry, **{op: shape_wrapper(grouped_mm_flop) for op in grouped_mm_ops()}}


class _LiveStorages(TorchDispatchMode):
    """Counts the bytes of the storages ops create that are still alive, their high-water mark and the
    FLOPs of the ops.
    A storage keeps its Python object while it lives, so a weak reference to it calls back exactly
    when it dies. Answers data-dependent host reads with the planning assumption (module docstring)."""

    def __init__(self, known: set[int], int_read: int | None, observer: Callable | None = None):
        super().__init__()
        self.observer = observer  # observer(func, args, kwargs, out): each op run outside compiled graphs
        self.known = known
        self.int_read = int_read
        self.refs: dict[int, weakref.ref] = {}
        self.live = 0
        self.peak = 0
        self.flops = 0  # by torch.utils.flop_counter's formulas (matmuls, attention) and the grouped GEMM's
        self.formulas = _flop_formulas()
        self.int_reads = 0
        self.paused = False  # while a compiled block traces (CompiledSaves)

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self.known or key in self.refs:
            return
        nbytes = storage.nbytes()

        def died(_, key=key, nbytes=nbytes):
            self.refs.pop(key, None)
            self.live -= nbytes

        self.refs[key] = weakref.ref(storage, died)
        self.live += nbytes

    def count_outputs(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t.untyped_storage())
        self.peak = max(self.peak, self.live)

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


def _efficient_attention(
    q, k, v, *, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, **_
) -> torch.Tensor:
    """The GPU's fused attention as the plan sees it: memory-efficient attention's own op. Its autograd
    saves q, k, v, the output and an fp32 logsumexp per query, never the T x T scores; it runs on fake
    tensors through its meta kernel, and a compiled block's partitioner sees one opaque op. Grouped
    keys and values (``enable_gqa``, the dense model) are repeated to the query heads first, as that
    kernel needs them (an upper bound where a GPU kernel reads the groups in place)."""
    if enable_gqa and k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, is_causal=is_causal, scale=scale
    )[0]


@contextmanager
def _gpu_attention() -> Iterator[None]:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _efficient_attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa


@contextmanager
def _compiling() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` reads True, as while Dynamo traces: the blocks skip their
    host-side checks (moe/base.py) exactly as in a compiled run."""
    flag = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = flag


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _is(node: torch.fx.Node, tag: torch.Tag) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and tag in node.target.tags


def _fused_nodes(nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """The call_function nodes Inductor computes inside other kernels instead of into a buffer of their
    own: views, and pointwise ops whose every reader is a reduction or is itself computed inline (a graph
    output, a matmul's or any other extern op's input is a buffer)."""
    inline: set[torch.fx.Node] = set()  # nodes whose every reader computes them inline
    fused: set[torch.fx.Node] = set()
    for node in reversed(nodes):
        if node.op != "call_function":
            continue
        view = node.target is operator.getitem or getattr(node.target, "is_view", False)
        if all(u.op == "call_function" and (_is(u, torch.Tag.reduction) or u in inline) for u in node.users):
            if view or _is(node, torch.Tag.pointwise):
                inline.add(node)
        if view or node in inline:
            fused.add(node)
    return fused


def _bytes_of(val) -> int:
    return sum(t.untyped_storage().nbytes() for t in tree_flatten(val)[0] if isinstance(t, torch.Tensor))


class _Buffers:
    """The buffers a graph's own kernels write as it runs, its outputs included: each op that is not
    fused (:func:`_fused_nodes`) writes one, freed after the last kernel that reads it, directly or through
    fused ops. :meth:`peak` is the most they hold at once above what was alive as the graph started,
    given which of its inputs die when the graph drops them (then at their last read, as in Inductor's
    code). Matters where backward recomputes (a memory budget): the recomputed buffers live only in there."""

    def __init__(self, gm: torch.fx.GraphModule):
        nodes = list(gm.graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        outputs = set(next(n for n in reversed(nodes) if n.op == "output").all_input_nodes)
        fused = _fused_nodes(nodes)
        read_at: dict[torch.fx.Node, int] = {}  # when a node's value is read: its own kernel, or its consumers'
        for node in reversed(nodes):
            read_at[node] = max((read_at[u] for u in node.users), default=index[node]) if node in fused else index[node]
        last_read = {n: max((read_at[u] for u in n.users), default=index[n]) for n in nodes}
        self.inputs_read = [last_read[n] for n in nodes if n.op == "placeholder"]  # by input position
        # (position, bytes) as the graph runs: a buffer is written at its op's index and freed just after
        # its last reader's (an output is never freed here)
        self.events: list[tuple[float, int]] = []
        for node in nodes:
            if node.op == "call_function" and node not in fused:
                nbytes = _bytes_of(node.meta.get("val"))
                self.events.append((index[node], nbytes))
                if node not in outputs:
                    self.events.append((last_read[node] + 0.5, -nbytes))
        self.events.sort()

    def peak(self, dying: dict[int, int]) -> int:
        """``dying``: input position -> bytes freed once read for the last time."""
        freed = [(self.inputs_read[position] + 0.5, -nbytes) for position, nbytes in dying.items()]
        live = peak = 0
        for _, nbytes in sorted(self.events + freed) if freed else self.events:
            live += nbytes
            peak = max(peak, live)
        return peak


class _OneOp:
    """A traced graph as one opaque op on fake tensors: its outputs are made from the metadata the trace
    left on them (new storages, or views of the inputs they alias), and its FLOPs are counted once from
    the same metadata; none of its ops runs."""

    def __init__(self, gm: torch.fx.GraphModule, formulas: dict):
        nodes = list(gm.graph.nodes)
        inputs = [n.meta.get("val") for n in nodes if n.op == "placeholder"]
        aliased = {t.untyped_storage()._cdata: i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)}
        self.outputs: list[tuple | None] = []  # (input index or None, storage group, the output's metadata)
        groups: dict[int, int] = {}
        for node in next(n for n in reversed(nodes) if n.op == "output").args[0]:
            val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
            if not isinstance(val, torch.Tensor):
                self.outputs.append(None)
                continue
            key = val.untyped_storage()._cdata
            self.outputs.append((aliased.get(key), groups.setdefault(key, len(groups)), val))
        self.flops = 0
        for node in nodes:
            count = formulas.get(getattr(node.target, "_overloadpacket", None)) if node.op == "call_function" else None
            if count is not None:
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
                self.flops += count(*args, **kwargs, out_val=node.meta.get("val"))
        self.buffers = _Buffers(gm)

    def __call__(self, inputs: list) -> list:
        bases: dict[int, torch.Tensor] = {}
        out = []
        for spec in self.outputs:
            if spec is None:
                out.append(None)
                continue
            index, group, val = spec
            if index is not None:
                base = inputs[index]
            elif group in bases and bases[group].dtype == val.dtype:
                base = bases[group]
            else:
                nbytes = val.untyped_storage().nbytes()
                base = bases[group] = torch.empty(nbytes // val.element_size(), dtype=val.dtype)
            out.append(base.as_strided(val.shape, val.stride(), val.storage_offset()))
        return out


_PASSED = object()  # CompiledSaves: a tensor argument, passed to the trace (the others are bound)


class CompiledSaves(nn.Module):
    """Runs ``block`` as torch.compile partitions it for backward: AOT autograd with Inductor's
    decompositions and its min-cut partitioner (Inductor recomputes cheap ops in backward instead of
    saving them). Each graph, forward and backward, is one opaque op (:class:`_OneOp`) for ``recorder``:
    what it returns is counted, not its intermediates, which Inductor's fused kernels mostly never
    write. Blocks alike (same class, weights and inputs) share one trace in ``traced``."""

    def __init__(self, block: nn.Module, recorder: _LiveStorages, traced: dict):
        super().__init__()
        self.block = block
        self.recorder = recorder
        self.traced = traced

    def _as_one_op(self, gm: torch.fx.GraphModule, example_inputs) -> Callable:
        """AOT's "compiler" (boxed): :class:`_OneOp` of the graph, counted by ``recorder``."""
        recorder = self.recorder
        op = _OneOp(gm, recorder.formulas)

        def run(args):
            live = recorder.live
            storages = [t.untyped_storage() if isinstance(t, torch.Tensor) else None for t in args]
            keys = [None if u is None else u._cdata for u in storages]
            sizes = {k: u.nbytes() for k, u in zip(keys, storages, strict=True) if k in recorder.refs}
            del storages
            inputs = list(args)
            args.clear()  # the inputs the outputs do not alias die here, as in Inductor's code
            paused, recorder.paused = recorder.paused, True  # the outputs' allocations: counted below
            try:
                out = op(inputs)
            finally:
                recorder.paused = paused
            del inputs
            if not recorder.paused:
                recorder.flops += op.flops
                # the graph's own buffers while it ran, above what was alive as it started; an input that
                # died with it was freed at its last read (once per storage)
                dying = {}
                for position, key in enumerate(keys):
                    if key in sizes and key not in recorder.refs:
                        dying[position] = sizes.pop(key)
                recorder.peak = max(recorder.peak, live + op.buffers.peak(dying))
                recorder.count_outputs(out)
            return out

        run._boxed_call = True
        return run

    def _call(self, bound: tuple, weights, *args, **kwargs):
        given = iter(args)
        args = tuple(next(given) if b is _PASSED else b for b in bound)
        return torch.func.functional_call(self.block, weights, args, kwargs)

    def forward(self, *args, **kwargs):
        from torch._functorch.aot_autograd import aot_function
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        from torch._inductor.decomposition import select_decomp_table

        weights = {**dict(self.block.named_parameters()), **dict(self.block.named_buffers())}
        # AOT makes a graph input of every argument, a None (a core block's Engram memory) or a number (the
        # byte n-grams' first byte) too, one without a value that the budget partitioner cannot size: those
        # are bound, the tensors passed
        bound = tuple(_PASSED if isinstance(a, torch.Tensor) else a for a in args)
        args = tuple(a for a in args if isinstance(a, torch.Tensor))
        leaves = tree_flatten((args, kwargs, weights))[0]
        key = (type(self.block), repr(bound), *weights, *(_signature(t) for t in leaves))
        fn = self.traced.get(key)
        if fn is None:
            fn = self.traced[key] = aot_function(
                functools.partial(self._call, bound),
                fw_compiler=self._as_one_op,
                bw_compiler=self._as_one_op,
                partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
                decompositions=select_decomp_table(),
            )
            self.recorder.paused = True
            try:  # the first call traces; what it saves is hidden from an enclosing checkpoint, and dies here
                with _compiling(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
                    fn(weights, *args, **kwargs)
            finally:
                self.recorder.paused = False
        with _compiling():
            return fn(weights, *args, **kwargs)


def _signature(x) -> tuple | str:
    return (tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else repr(x)


def compile_like_trainer(model: nn.Module, spec, recorder: _LiveStorages) -> None:
    """Puts :class:`CompiledSaves` in place of each block the trainer compiles (parallel/compile.py). A
    checkpointed block keeps its wrapper, which keeps the block's inputs, and runs its block compiled
    inside: the recompute in backward then holds what the compiled block saves. The spec's
    ``compiled_modules`` are wrapped as well."""
    traced: dict = {}
    for fqn, block in spec.blocks(model) + spec.compiled_extras(model):
        if isinstance(block, CheckpointWrapper):
            block._checkpoint_wrapped_module = CompiledSaves(block._checkpoint_wrapped_module, recorder, traced)
        else:
            container, _, name = fqn.rpartition(".")
            model.get_submodule(container).register_module(name, CompiledSaves(block, recorder, traced))


@dataclass
class ActivationMeasure:
    bytes: int  # alive at the end of forward and loss: what backward reads
    segments: int | None  # the assumed segment count S (None: the model read none)
    notes: list[str] = field(default_factory=list)
    peak: int = 0  # the most alive at once over forward, loss and (when run) backward
    cast_bytes: int = 0  # the matmul weights cast once per step, held through it (no FSDP)
    flops: int = 0  # matmul and attention FLOPs the step runs, activation checkpointing's recompute included


_MEASURED: dict[tuple, ActivationMeasure] = {}  # plans at several rank counts measure the same micro-batch


def measure_activation_bytes(
    cfg: JobConfig,
    *,
    batch: int,
    seq_len: int,
    param_dtype: torch.dtype,
    gpu_attention: bool = True,
    backward: bool = True,
    fsdp: bool = True,
    observer: Callable | None = None,
) -> ActivationMeasure:
    """Bytes one micro-batch's forward and loss leave alive for backward, and the most alive at once
    over forward and (``backward``) backward, at the config's width, with its converters, activation
    checkpointing and compiled blocks, on fake tensors (module docstring). Without ``fsdp`` and with a
    ``param_dtype`` below fp32, the step runs as the builder sets it up on a GPU: fp32 parameters cast
    once per step (``mixed_precision_mode``: all of them, or the matmul weights under autocast; their
    copies: ``cast_bytes``). ``observer(func, args, kwargs, out)`` sees each op run outside compiled
    graphs (scripts/bench_eager_bytes.py); a step observed is measured afresh, not cached."""
    if observer is not None:
        return _measure(cfg, batch, seq_len, param_dtype, gpu_attention, backward, fsdp, observer)
    key = (repr(cfg), batch, seq_len, param_dtype, gpu_attention, backward, fsdp)
    if key not in _MEASURED:
        if len(_MEASURED) >= 16:
            _MEASURED.clear()
        _MEASURED[key] = _measure(cfg, batch, seq_len, param_dtype, gpu_attention, backward, fsdp)
    return _MEASURED[key]


def _measure(cfg, batch, seq_len, param_dtype, gpu_attention, backward, fsdp, observer=None) -> ActivationMeasure:
    from spider_titan.components.builder import build_model
    from spider_titan.moe.layer import MoE
    from spider_titan.parallel.precision import compute_precision

    compiled = cfg.training.compile
    casts = not fsdp and param_dtype != torch.float32
    cfg = planning_config(cfg)
    notes = []
    if cfg.moe.backend != "torch":
        notes.append(f"activations measured with the torch MoE backend (config: {cfg.moe.backend!r})")
        cfg.moe.backend = "torch"
    spec, args, model = build_model(cfg)
    model.train()
    per_byte = spec.moe_tokens_per_byte(args) if spec.moe_tokens_per_byte is not None else None
    # rounded first: in floats 129 * (1 / 3) is not 43 exactly
    segments = math.ceil(round(seq_len * per_byte, 9)) if per_byte is not None else None
    weight_dtype = torch.float32 if casts else param_dtype
    with FakeTensorMode(allow_non_fake_inputs=True):
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    dtype = weight_dtype if p.is_floating_point() else p.dtype
                    module._parameters[name] = nn.Parameter(
                        torch.empty(p.shape, dtype=dtype), requires_grad=p.requires_grad
                    )
                    if backward and p.requires_grad:  # gradients are planned on their own
                        module._parameters[name].grad = torch.zeros_like(module._parameters[name])
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
        inputs = torch.zeros(batch, seq_len, dtype=torch.long)
        labels = torch.zeros(batch, seq_len, dtype=torch.long)
        extra = {"sample_ids": torch.arange(batch)} if "sample_ids" in spec.train_inputs else {}
        before = [*model.parameters(), *model.buffers(), inputs, labels, *extra.values()]
        known = {
            t.untyped_storage()._cdata for t in before + [p.grad for p in model.parameters() if p.grad is not None]
        }
        recorder = _LiveStorages(known, segments, observer)
        if compiled:
            compile_like_trainer(model, spec, recorder)
            # A compiled memory budget saves the MoE top-k in a selective-checkpoint region, which Dynamo
            # numbers and these AOT traces cannot; here it is recomputed (T x k int64 indices per call, 0.3 MiB at 1B).
            for module in model.modules():
                if isinstance(module, MoE):
                    module.save_selection = False
        autocast_dtype, weights = compute_precision(model, cfg.training, param_dtype if casts else None)
        with (
            warnings.catch_warnings(),  # RMSNorm's fp32 weight under autocast: the GPU run warns once itself
            _gpu_attention() if gpu_attention else _nothing(),
            recorder,
            torch.autocast("cpu", dtype=param_dtype, enabled=autocast_dtype is not None),
            weights() if weights is not None else _nothing(),
        ):
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
            cast = recorder.live
            loss = spec.loss_sum(model(inputs, **extra).logits, labels)  # the logits die here, as in training
            saved = recorder.live - cast
            if backward:
                loss.backward()
        del loss
    if recorder.int_reads == 0:
        segments = None
    return ActivationMeasure(saved, segments, notes, peak=recorder.peak - cast, cast_bytes=cast, flops=recorder.flops)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


# ---------------------------------------------------------------- the plan


@dataclass
class Plan:
    ngpu: int
    describe: str
    memory: dict[str, int]  # component -> bytes per rank, in the order they are added up
    param_bytes_by_dtype: dict[str, int]
    optimizer_bytes: int
    comm: dict[str, dict[str, int]]  # kind -> tag -> bytes per step (this rank)
    flops_per_step_per_rank: float
    peak_flops: float
    mfu: float
    step_time_s: float
    tokens_per_step: int
    gpu_memory_bytes: float
    ac_mode: str
    activation: ActivationMeasure
    notes: list[str]
    accumulated_grad_bytes: int = 0  # the unsharded gradients FSDP keeps between micro-batches (any accumulation)
    # the same micro-batch measured with activation checkpointing off, when the plan is asked (:attr:`without_ac`)
    measure_without_ac: Callable[[], ActivationMeasure] | None = None
    # the same micro-batch measured under a compiled memory budget (:func:`budget_that_fits`)
    measure_at_budget: Callable[[float], ActivationMeasure] | None = None

    @functools.cached_property
    def without_ac(self) -> ActivationMeasure | None:
        return None if self.measure_without_ac is None else self.measure_without_ac()

    @property
    def total_bytes(self) -> int:
        return sum(self.memory.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s


# what helps when a component does not fit
KNOBS = {
    "parameters": "more ranks (data_parallel_shard_degree) or fewer HSDP replicas (data_parallel_replicate_degree)",
    "gradients": "more ranks (data_parallel_shard_degree)",
    "optimizer state": 'more ranks (data_parallel_shard_degree), or optimizer.name = "Muon" (one state per matrix)',
    "accumulated gradients": "gradient_accumulation_steps = 1 with a larger local_batch_size, "
    'or training.mixed_precision_reduce = "bfloat16"',
    "gathered units": "parallelism.fsdp_keep_core_gathered_fraction = 0 (reshard the core after forward)",
    "reduce-scatter staging": 'training.mixed_precision_reduce = "bfloat16"',
    "compute weights": 'training.mixed_precision_mode = "autocast" with cast_weights_once = false '
    "(each use casts its weight again), or FSDP",
    "activations": "a smaller training.local_batch_size (more gradient_accumulation_steps)",
    "backward transients": "a smaller training.local_batch_size (more gradient_accumulation_steps)",
}
# the components that grow with a micro-batch's rows
PER_ROW = ("activations", "backward transients")
# stronger activation checkpointing, after each mode
STRONGER_AC = {"none": "recurrent", "selective": "recurrent", "recurrent": "full"}


def make_plan(cfg: JobConfig, opts: PlanOptions) -> Plan:
    """Everything the table shows, for ``opts.ngpu`` ranks (runs its own fake process group)."""
    t = cfg.training
    param_dtype = DTYPES[t.mixed_precision_param]
    gpu_memory = opts.gpu_memory_gib * GIB
    accum = t.gradient_accumulation_steps
    notes: list[str] = []
    with fake_process_group(opts.ngpu):
        spec, args, model, dims, units = build_sharded_model(cfg, opts.ngpu, gpu_memory)
        params = list(model.parameters())
        by_dtype = local_bytes(params)
        param_bytes = sum(by_dtype.values())
        optimizer_bytes = optimizer_state_bytes(model, cfg)
        groups = fsdp_groups(model, units) if units else []

    memory = {"parameters": param_bytes, "gradients": param_bytes, "optimizer state": optimizer_bytes}
    comm: dict[str, dict[str, int]] = {}
    if groups:
        if accum > 1:
            memory["accumulated gradients"] = sum(g.accumulated_grad_bytes for g in groups)
        kept = [g for g in groups if not g.reshard_after_forward]
        others = sorted((g.gathered_bytes for g in groups if g.reshard_after_forward), reverse=True)
        memory["gathered units"] = sum(g.gathered_bytes for g in kept) + sum(others[:2])
        memory["reduce-scatter staging"] = max(g.reduce_scatter_bytes for g in groups)
        for g in groups:
            if g.shard_size > 1:
                gathers = accum * (1 + g.reshard_after_forward)  # forward, and backward after a reshard
                comm.setdefault("all_gather", {})[g.tag] = gathers * g.gathered_bytes
                comm.setdefault("reduce_scatter", {})[g.tag] = g.reduce_scatter_bytes
            if g.replicas > 1:
                comm.setdefault("all_reduce", {})[g.tag] = g.reduce_scatter_bytes // g.shard_size
        kept_names = ", ".join(g.tag for g in kept if g.tag != "root") or "none"
        notes.append(f"kept gathered after forward: root, {kept_names}")
    elif opts.ngpu > 1:
        notes.append("no FSDP (parallelism.fsdp): every rank holds the whole model")

    measure = functools.partial(
        measure_activation_bytes,
        batch=t.local_batch_size,
        seq_len=t.seq_len,
        param_dtype=param_dtype,
        fsdp=bool(groups),
    )
    act = measure(cfg)
    without_ac = at_budget = None
    if cfg.activation_checkpoint.mode != "none":
        without_ac = functools.partial(measure, with_checkpointing(cfg, "none"))
        if cfg.training.compile and opts.search_budget:
            at_budget = lambda budget: measure(with_checkpointing(cfg, "memory_budget", budget))  # noqa: E731
    if act.cast_bytes:
        memory["compute weights"] = act.cast_bytes
    memory["activations"] = act.bytes
    memory["backward transients"] = act.peak - act.bytes
    notes.extend(act.notes)
    if act.segments is not None:
        notes.append(f"core tokens (segments) assumed S = ceil(seq_len * moe_tokens_per_byte) = {act.segments}")

    if dims.ep_enabled:
        comm["all_to_all"] = expert_all_to_all_bytes(cfg, args, act.segments or t.seq_len, param_dtype)
        notes.append("all-to-all: balanced routing, top_k rows per segment, alignment padding not counted")

    converters = cfg.model.converters
    peak = (opts.peak_tflops or H100_BF16_DENSE_TFLOPS * (2 if "float8" in converters else 1)) * 1e12
    local_tokens = t.local_batch_size * accum * t.seq_len
    flops = spec.flops_per_token(args, t.seq_len) * local_tokens
    return Plan(
        ngpu=opts.ngpu,
        describe=dims.describe(),
        memory=memory,
        param_bytes_by_dtype=by_dtype,
        optimizer_bytes=optimizer_bytes,
        comm=comm,
        flops_per_step_per_rank=flops,
        peak_flops=peak,
        mfu=opts.mfu,
        step_time_s=flops / (opts.mfu * peak),
        tokens_per_step=local_tokens * dims.dp_degree,
        gpu_memory_bytes=gpu_memory,
        ac_mode=cfg.activation_checkpoint.mode,
        activation=act,
        notes=notes,
        accumulated_grad_bytes=sum(g.accumulated_grad_bytes for g in groups),
        measure_without_ac=without_ac,
        measure_at_budget=at_budget,
    )


def with_checkpointing(cfg: JobConfig, mode: str, budget: float | None = None) -> JobConfig:
    """A copy of ``cfg`` with activation checkpointing ``mode`` (and ``memory_budget``)."""
    other = copy.deepcopy(cfg)
    other.activation_checkpoint.mode = mode
    if budget is not None:
        other.activation_checkpoint.memory_budget = budget
    return other


# What a micro-batch must leave free beside the plan: the caching allocator's fragmentation, a share
# of the planned bytes, and the CUDA context and NCCL buffers (the upper end of "~1-3 GiB").
ALLOCATOR_MARGIN = 0.15
CONTEXT_GIB = 3.0


def micro_batch_choices(plan: Plan, cfg: JobConfig) -> list[tuple[int, int, int]]:
    """(local_batch_size, gradient_accumulation_steps, planned bytes per rank) of every split of this
    rank's rows per step into micro-batches of equal rows (the same bytes per step). The activations
    scale with a micro-batch's rows; FSDP keeps the accumulated gradient only with more than one."""
    t = cfg.training
    rows = t.local_batch_size * t.gradient_accumulation_steps
    per_row = sum(plan.memory[k] for k in PER_ROW) / t.local_batch_size
    return [(n, rows // n, split_bytes(plan, n, rows // n, per_row)) for n in range(1, rows + 1) if rows % n == 0]


def split_bytes(plan: Plan, local: int, accum: int, per_row: float) -> int:
    """Bytes per rank planned for micro-batches of ``local`` rows, ``accum`` per step, holding ``per_row``
    bytes per row (activations and backward transients); the rest of the plan as it is."""
    fixed = plan.total_bytes - sum(plan.memory[k] for k in PER_ROW) - plan.memory.get("accumulated gradients", 0)
    return round(fixed + local * per_row + (plan.accumulated_grad_bytes if accum > 1 else 0))


def fits_with_room(plan: Plan, nbytes: float) -> bool:
    """``nbytes`` planned per rank fit with ``ALLOCATOR_MARGIN`` and ``CONTEXT_GIB`` to spare."""
    return nbytes * (1 + ALLOCATOR_MARGIN) <= plan.gpu_memory_bytes - CONTEXT_GIB * GIB


def largest_micro_batch(plan: Plan, cfg: JobConfig) -> tuple[int, int, int] | None:
    """The split of :func:`micro_batch_choices` with the most rows per micro-batch that fits with
    ``ALLOCATOR_MARGIN`` and ``CONTEXT_GIB`` to spare, or None. A step that is not one CUDA graph waits
    on its host, whose launches per micro-batch do not grow with its rows
    (tests/integration/test_launches_per_batch.py), and the grouped expert GEMMs get more rows."""
    fits = [c for c in micro_batch_choices(plan, cfg) if fits_with_room(plan, c[2])]
    return max(fits) if fits else None


def without_checkpointing(plan: Plan, cfg: JobConfig) -> tuple[int, float] | None:
    """(bytes planned per rank, share of the step's matmul and attention FLOPs saved) for the micro-batch
    :func:`largest_micro_batch` picks, with activation checkpointing off; None when it is off already
    or nothing fits. Checkpointing recomputes what it dropped, so it pays only where memory needs it."""
    pick = largest_micro_batch(plan, cfg)
    if plan.without_ac is None or pick is None:
        return None
    local, accum, _ = pick
    nbytes = split_bytes(plan, local, accum, plan.without_ac.peak / cfg.training.local_batch_size)
    return nbytes, 1 - plan.without_ac.flops / plan.activation.flops


# the compiled memory budgets the plan tries, largest first (:func:`budget_that_fits`)
BUDGETS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)


def budget_that_fits(plan: Plan, cfg: JobConfig) -> tuple[float, int, float] | None:
    """(budget, bytes planned per rank, its recompute as a share of the unchecked step's matmul and
    attention FLOPs) of the largest of ``BUDGETS`` under which the micro-batch :func:`largest_micro_batch`
    picks fits with room, found by bisection (the saved bytes grow with the budget); None when the plan
    was not asked to search, checkpointing is not needed, or no budget fits."""
    off = without_checkpointing(plan, cfg)
    if plan.measure_at_budget is None or off is None or fits_with_room(plan, off[0]):
        return None
    local, accum, _ = largest_micro_batch(plan, cfg)

    def planned(budget: float) -> tuple[int, int]:
        measured = plan.measure_at_budget(budget)
        return split_bytes(plan, local, accum, measured.peak / cfg.training.local_batch_size), measured.flops

    best = None
    low, high = 0, len(BUDGETS) - 1  # BUDGETS[high] is the smallest budget
    while low <= high:
        mid = (low + high) // 2
        nbytes, flops = planned(BUDGETS[mid])
        if fits_with_room(plan, nbytes):
            best, high = (BUDGETS[mid], nbytes, flops / plan.without_ac.flops - 1), mid - 1
        else:
            low = mid + 1
    return best


def expert_all_to_all_bytes(cfg: JobConfig, args, segments: int, dtype: torch.dtype) -> dict[str, int]:
    """Per MoE layer, what this rank sends per step: each call sends its routed rows out and back
    (dispatch, combine), again in backward, and once more when activation checkpointing recomputes
    the layer; plus the (E,) int64 counts once per call (recorded, replayed by the recompute)."""
    from spider_titan.moe.layer import MoE

    t = cfg.training
    rows = t.local_batch_size * segments * args.top_k
    passes = 4 + 2 * (cfg.activation_checkpoint.mode in ("full", "recurrent"))
    per_call = passes * rows * args.dim * dtype.itemsize + args.n_experts * 8
    with torch.device("meta"):
        model = registry.get("model", cfg.model.name).model_cls(args)
    calls = t.gradient_accumulation_steps * args.n_loops
    return {fqn: calls * per_call for fqn, m in model.named_modules() if isinstance(m, MoE)}


def format_plan(plan: Plan, cfg: JobConfig) -> str:
    t = cfg.training

    def gib(nbytes: float) -> str:
        return f"{nbytes / GIB:8.2f} GiB"

    lines = [
        f"plan: {cfg.model.name}/{cfg.model.flavor} on {plan.ngpu} GPUs ({plan.describe})",
        (
            f"  micro-batch {t.local_batch_size} x {t.seq_len}, accumulation {t.gradient_accumulation_steps}, "
            f"AC {cfg.activation_checkpoint.mode}, params {t.mixed_precision_param}, reduce {t.mixed_precision_reduce}"
        ),
        "",
        "memory per rank",
    ]
    for name, nbytes in plan.memory.items():
        detail = ""
        if name == "parameters":
            detail = "  (" + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in plan.param_bytes_by_dtype.items()) + ")"
        if name == "activations":
            detail = f"  ({nbytes / (t.local_batch_size * t.seq_len) / 1024:.0f} KiB per input byte)"
        lines.append(f"  {name:<24}{gib(nbytes)}{detail}")
    lines.append(f"  {'total':<24}{gib(plan.total_bytes)}  (before CUDA context / NCCL buffers, ~1-3 GiB)")
    lines.append("")
    lines.append("communication per step (this rank)")
    if not plan.comm:
        lines.append("  none")
    for kind, tags in plan.comm.items():
        top = sorted(tags.items(), key=lambda kv: -kv[1])[:3]
        lines.append(
            f"  {kind:<24}{gib(sum(tags.values()))}  (largest: " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in top) + ")"
        )
    lines.append("")
    lines.append(
        f"compute  {plan.flops_per_step_per_rank / 1e12:.1f} TFLOP per rank per step; at MFU "
        f"{plan.mfu:.0%} of {plan.peak_flops / 1e12:.0f} TFLOP/s: {plan.step_time_s:.2f} s/step, "
        f"{plan.tokens_per_s:,.0f} tokens/s ({plan.tokens_per_s / plan.ngpu:,.0f} per GPU)"
    )
    lines.append("")
    lines.append(micro_batch_line(plan, cfg))
    checkpointing = checkpointing_line(plan, cfg)
    if checkpointing:
        lines.append(checkpointing)
    for note in plan.notes:
        lines.append(f"note: {note}")
    lines.append(verdict(plan))
    return "\n".join(lines)


def micro_batch_line(plan: Plan, cfg: JobConfig) -> str:
    """What :func:`largest_micro_batch` picks, as the flags that ask for it."""
    t = cfg.training
    spare = f"with {ALLOCATOR_MARGIN:.0%} and {CONTEXT_GIB:.0f} GiB to spare"
    pick = largest_micro_batch(plan, cfg)
    if pick is None:
        return f"micro-batch  none of {t.local_batch_size * t.gradient_accumulation_steps} rows per step fits {spare}"
    local, accum, nbytes = pick
    size = f"{local} x {t.seq_len}, accumulation {accum} ({nbytes / GIB:.1f} GiB planned)"
    if (local, accum) == (t.local_batch_size, t.gradient_accumulation_steps):
        return f"micro-batch  the config's, {size}, is the largest that fits {spare}"
    return (
        f"micro-batch  the largest that fits {spare}: {size}; the same bytes per step, fewer launches per step: "
        f"--training.local_batch_size {local} --training.gradient_accumulation_steps {accum}"
    )


CHECKPOINTING_NOT_NEEDED = "checkpointing  not needed at that micro-batch"  # scripts/bench_gpu.py reads it


MEMORY_BUDGET_FITS = "memory budget  fits at that micro-batch"  # scripts/bench_gpu.py reads it


def checkpointing_line(plan: Plan, cfg: JobConfig) -> str | None:
    """What :func:`without_checkpointing` finds, as one line (None when checkpointing is off), and
    when it is needed, the line of :func:`budget_that_fits` after it."""
    off = without_checkpointing(plan, cfg)
    if off is None:
        return None
    nbytes, saved = off
    if not fits_with_room(plan, nbytes):
        line = f"checkpointing  needed at that micro-batch: without it {nbytes / GIB:.1f} GiB planned"
        fit = budget_that_fits(plan, cfg)
        if fit is not None:
            budget, nbytes, extra = fit
            ours = plan.activation.flops / plan.without_ac.flops - 1
            line += (
                f"\n{MEMORY_BUDGET_FITS}: compiled blocks saving {budget:g} of their activations, "
                f"{nbytes / GIB:.1f} GiB planned; its recompute adds {extra:.0%} to the matmul and attention FLOPs "
                f"of the unchecked step, the config's checkpointing {ours:.0%}: "
                f"--activation_checkpoint.mode memory_budget --activation_checkpoint.memory_budget {budget:g}"
            )
        return line
    return (
        f"{CHECKPOINTING_NOT_NEEDED}: without it {nbytes / GIB:.1f} GiB planned, which fits; the step skips "
        f"the recompute, {saved:.0%} of its matmul and attention FLOPs: --activation_checkpoint.mode none"
    )


def verdict(plan: Plan) -> str:
    """ "fits in X GiB of Y", or the first component with which the running total passes the
    budget and the knob that helps most there."""
    budget = plan.gpu_memory_bytes
    running = 0
    for name, nbytes in plan.memory.items():
        running += nbytes
        if running > budget:
            knob = KNOBS[name]
            if name in PER_ROW and plan.ac_mode == "memory_budget":
                knob += ", or a lower activation_checkpoint.memory_budget"
            elif name in PER_ROW and plan.ac_mode in STRONGER_AC:
                knob += f', or activation_checkpoint.mode = "{STRONGER_AC[plan.ac_mode]}"'
            return (
                f"DOES NOT FIT: {running / GIB:.1f} GiB of {budget / GIB:.0f} GiB reached at {name} "
                f"({nbytes / GIB:.2f} GiB); try {knob}"
            )
    return f"fits in {running / GIB:.1f} GiB of {budget / GIB:.0f} GiB (before CUDA / NCCL overhead)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        print(USAGE)
        print(plan_flags_help())
        return 0
    try:
        opts, cfg = parse_plan_args(argv)
    except ConfigError as e:
        for line in e.problems:
            print(f"config error: {line}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        plan = make_plan(cfg, opts)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan, cfg))
    return 0 if plan.total_bytes <= plan.gpu_memory_bytes else 1


if __name__ == "__main__":
    sys.exit(main())
