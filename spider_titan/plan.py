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
* activations: the bytes one micro-batch's forward (and loss) leaves alive for backward, MEASURED by
  running the model at the config's real width, batch and sequence on fake tensors (no memory, no
  compute) under the config's activation-checkpointing mode and counting the storages still alive,
  like metrics/memory.py does on real tensors. Assumptions, each stated in the output:
  - the one data-dependent host read of the forward (Spider's segment count S) returns
    ``ceil(seq_len * moe_tokens_per_byte)`` of the model's spec (Spider: one segment per
    ``target_bytes_per_segment`` bytes); boolean checks read "true";
  - attention saves what the GPU kernels save (q, k, v, output, fp32 logsumexp), not the T x T
    matrix of the CPU math fallback (MLA's qk and v head dims differ, which CPU flash refuses);
  - the MoE backend is ``torch`` (the Triton kernels do not run on fake CPU tensors);
* reduce-scatter staging: the largest unit's reduce-scatter input (its unsharded gradient, reduce dtype);
* collectives per step, by kind and FSDP unit / MoE layer, with the CommCounter's conventions
  (parallel/comm_counter.py): all-gather = gathered output, reduce-scatter = input, all-to-all =
  what this rank sends, plus HSDP's all-reduce of the sharded gradient (not counted by the counter);
* FLOPs per step from the model spec's ``flops_per_token``; step time and tokens/s at ``--mfu`` of
  ``--peak_tflops`` (default: H100 bf16 dense 989 TFLOP/s, x2 when the float8 converter is on);
* the micro-batch: the split of the rows per step with the most rows per micro-batch that fits with
  room to spare (:func:`largest_micro_batch`), as the flags that ask for it.

Not counted: CUDA context and NCCL buffers (~1-3 GiB), the caching allocator's fragmentation, the
backward's transient activation gradients and recomputed blocks, the loss's logits gradient.
Validated against real gloo runs at debug size (tests/distributed/test_plan_validation.py). Activations
are eager's: compiled blocks save fewer when nothing is checkpointed (``planning_config``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import sys
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
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
    dispatch mode). Compiled blocks save fewer tensors, so without checkpointing the plan is high: Spider
    1B at batch 4 peaked at 35.3 GiB on an H200 against a plan of 48.3 (recurrent AC: 24.2 against 24.5)."""
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


class _LiveStorages(TorchDispatchMode):
    """Records every storage an op creates (by identity: fake tensors have no data pointer) and
    answers data-dependent host reads with the planning assumption (module docstring)."""

    def __init__(self, known: set[int], int_read: int | None):
        super().__init__()
        self.known = known
        self.int_read = int_read
        self.refs: dict[int, tuple[int, int]] = {}
        self.int_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
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
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                if key in self.known:
                    continue
                old = self.refs.get(key)
                if old is not None:
                    if not torch.UntypedStorage._expired(old[0]):
                        continue
                    torch.UntypedStorage._free_weak_ref(old[0])
                self.refs[key] = (st._weak_ref(), st.nbytes())
        return out

    def alive_bytes(self) -> int:
        total = 0
        for ref, nbytes in self.refs.values():
            if not torch.UntypedStorage._expired(ref):
                total += nbytes
            torch.UntypedStorage._free_weak_ref(ref)
        self.refs.clear()
        return total


class _GPUAttentionSaves(torch.autograd.Function):
    """Stands in for the GPU's fused attention (cuDNN / memory-efficient): what it saves for
    backward is q, k, v, the output and an fp32 logsumexp per query, never the T x T scores."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@contextmanager
def _gpu_attention() -> Iterator[None]:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = lambda q, k, v, **kwargs: _GPUAttentionSaves.apply(q, k, v)
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa


@dataclass
class ActivationMeasure:
    bytes: int
    segments: int | None  # the assumed segment count S (None: the model read none)
    notes: list[str] = field(default_factory=list)


def measure_activation_bytes(
    cfg: JobConfig, *, batch: int, seq_len: int, param_dtype: torch.dtype, gpu_attention: bool = True
) -> ActivationMeasure:
    """Bytes one micro-batch's forward and loss leave alive for backward, at the config's width,
    with its converters and activation checkpointing, on fake tensors (module docstring)."""
    from spider_titan.components.builder import build_model

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
    with FakeTensorMode(allow_non_fake_inputs=True):
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    dtype = param_dtype if p.is_floating_point() else p.dtype
                    module._parameters[name] = nn.Parameter(
                        torch.empty(p.shape, dtype=dtype), requires_grad=p.requires_grad
                    )
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
        inputs = torch.zeros(batch, seq_len, dtype=torch.long)
        labels = torch.zeros(batch, seq_len, dtype=torch.long)
        extra = {"sample_ids": torch.arange(batch)} if "sample_ids" in spec.train_inputs else {}
        known = {
            t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers(), inputs, labels, *extra.values()]
        }
        recorder = _LiveStorages(known, segments)
        with _gpu_attention() if gpu_attention else _nothing(), recorder:
            out = model(inputs, **extra)
            loss = spec.loss_sum(out.logits, labels)
        del loss
        measured = recorder.alive_bytes()
    if recorder.int_reads == 0:
        segments = None
    return ActivationMeasure(measured, segments, notes)


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
    "activations": "a smaller training.local_batch_size (more gradient_accumulation_steps)",
}
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

    act = measure_activation_bytes(cfg, batch=t.local_batch_size, seq_len=t.seq_len, param_dtype=param_dtype)
    memory["activations"] = act.bytes
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
    )


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
    per_row = plan.memory["activations"] / t.local_batch_size
    fixed = plan.total_bytes - plan.memory["activations"] - plan.memory.get("accumulated gradients", 0)
    out = []
    for local in (n for n in range(1, rows + 1) if rows % n == 0):
        accum = rows // local
        out.append((local, accum, round(fixed + local * per_row + (plan.accumulated_grad_bytes if accum > 1 else 0))))
    return out


def largest_micro_batch(plan: Plan, cfg: JobConfig) -> tuple[int, int, int] | None:
    """The split of :func:`micro_batch_choices` with the most rows per micro-batch that fits with
    ``ALLOCATOR_MARGIN`` and ``CONTEXT_GIB`` to spare, or None. A step that is not one CUDA graph waits
    on its host, whose launches per micro-batch do not grow with its rows
    (tests/integration/test_launches_per_batch.py), and the grouped expert GEMMs get more rows."""
    budget = plan.gpu_memory_bytes - CONTEXT_GIB * GIB
    fits = [c for c in micro_batch_choices(plan, cfg) if c[2] * (1 + ALLOCATOR_MARGIN) <= budget]
    return max(fits) if fits else None


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


def verdict(plan: Plan) -> str:
    """ "fits in X GiB of Y", or the first component with which the running total passes the
    budget and the knob that helps most there."""
    budget = plan.gpu_memory_bytes
    running = 0
    for name, nbytes in plan.memory.items():
        running += nbytes
        if running > budget:
            knob = KNOBS[name]
            if name == "activations" and plan.ac_mode in STRONGER_AC:
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
