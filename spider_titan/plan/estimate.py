"""The plan of one run at N ranks (:func:`make_plan`): memory per rank by component, collectives per
step, FLOPs and step time, from the sharded model and the measured activations."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spider_titan import registry
from spider_titan.job_config import JobConfig
from spider_titan.plan.activations import ActivationMeasure, measure_activation_bytes
from spider_titan.plan.options import PlanOptions
from spider_titan.plan.sharded import (
    build_sharded_model,
    fake_process_group,
    fsdp_groups,
    local_bytes,
    optimizer_state_bytes,
)
from spider_titan.protocol import DTYPES

GIB = 2**30
H100_BF16_DENSE_TFLOPS = 989.0


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


# the components that grow with a micro-batch's rows
PER_ROW = ("activations", "backward transients")


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
        notes.append(f"core tokens (segments) assumed S = ceil(seq_len * moe.tokens_per_byte) = {act.segments}")

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


def expert_all_to_all_bytes(cfg: JobConfig, args, segments: int, dtype: torch.dtype) -> dict[str, int]:
    """Per MoE layer, what this rank sends per step: each call sends its routed rows out and back
    (dispatch, combine), again in backward, and once more when activation checkpointing recomputes
    the layer; plus the (E,) int64 counts once per call (recorded, replayed by the recompute)."""
    from spider_titan.moe.layer import MoE

    t = cfg.training
    spec = registry.get("model", cfg.model.name)
    moe = spec.moe  # the planner asks for these bytes only under expert parallel, i.e. of a model with MoE layers
    rows = t.local_batch_size * segments * moe.top_k(args)
    passes = 4 + 2 * (cfg.activation_checkpoint.mode in ("full", "recurrent"))
    per_call = passes * rows * moe.width(args) * dtype.itemsize + moe.experts(args) * 8
    with torch.device("meta"):
        model = spec.model_cls(args)
    calls = t.gradient_accumulation_steps * moe.calls_per_forward(args)
    return {fqn: calls * per_call for fqn, m in model.named_modules() if isinstance(m, MoE)}
