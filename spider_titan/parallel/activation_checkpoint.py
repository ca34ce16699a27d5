"""Activation checkpointing, applied from outside the model to the blocks of ``ModelSpec``.

Modes (``[activation_checkpoint] mode``):
- ``none``: keep every activation.
- ``full``: every block keeps only its input; everything inside is recomputed in backward.
- ``selective``: ``selective_ac_option = "op"`` keeps the outputs of matmuls and attention (except
  every second matmul, whose recompute is cheap next to the memory it holds) and recomputes the
  rest (norms, activations, elementwise); an integer N instead fully checkpoints every N-th block.
- ``recurrent``: only the recurrent core's blocks, on every loop (the seed trainer's gradient
  checkpointing). The core runs ``n_loops`` times per step, so its activations dominate and grow
  with ``n_loops``; checkpointing it keeps one block input per loop instead.
- ``memory_budget``: no wrapper. torch.compile's partitioner (``activation_memory_budget``) chooses,
  block by block, what to recompute in backward so that a block saves ``memory_budget`` of what it
  saves unchecked (above the floor of recomputing everything), cheapest recompute first by FLOPs:
  pointwise ops and gathers before matmuls. At Spider 1B, 16 rows, the planner measures 0.5 at 60 %
  of the activations for 5 % more matmul FLOPs, where ``recurrent`` recomputes 18 % (docs/benchmarks.md).
  Process-wide torch config: every other mode sets it back to 1 (torch's default). The MoE top-k is
  always saved (``MoE.save_selection``), never recomputed: a recompute could route differently.

Wrapping uses non-reentrant ``checkpoint_wrapper``: recomputation replays the same RNG state, and
``torch.distributed.checkpoint`` strips the wrapper's name from state-dict keys. Each checkpointed
call runs its block inside a fresh ``RoutingReplay`` (moe/routing_replay.py): the recompute reuses
the MoE routing of the forward (top-k, and under expert parallel the all-to-all split sizes) instead
of routing again, and MoE layers do not count its tokens a second time for load balancing.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from spider_titan.job_config import ActivationCheckpoint
from spider_titan.moe.layer import MoE
from spider_titan.moe.routing_replay import RoutingReplay
from spider_titan.protocol import ModelSpec

logger = logging.getLogger("spider_titan")

_aten = torch.ops.aten
# Ops whose outputs selective AC keeps (matmuls, attention, the amax reductions of fp8 scaling).
_SAVE_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._grouped_mm.default,
    _aten._scaled_mm.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten.max.default,
}
_MM_OPS = {_aten.mm.default, _aten.addmm.default}


def _op_policy_context():
    """Selective-AC contexts: save matmul/attention outputs except every second matmul.

    Called once per checkpointed forward, so each block call gets fresh counters and its
    recompute makes the same save/recompute decisions as its forward.
    """
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in _MM_OPS:
            counts[mode] += 1
            if counts[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpoint_replaying_routing(module: nn.Module, *args, **kwargs):
    """``torch.utils.checkpoint`` (non-reentrant) of ``module`` whose recompute replays the forward's
    MoE routing. Under torch.compile the compiled graph recomputes by itself; plain checkpoint then."""
    if torch.compiler.is_compiling():
        return checkpoint(module, *args, use_reentrant=False, **kwargs)
    replay = RoutingReplay()  # kept by the closure below until backward frees the checkpoint's frame

    def run(*a, **kw):
        with replay.activate():
            return module(*a, **kw)

    return checkpoint(run, *args, use_reentrant=False, **kwargs)


def _wrap(container: nn.Module, name: str, block: nn.Module, **kwargs) -> None:
    wrapper = checkpoint_wrapper(block, checkpoint_fn=_checkpoint_replaying_routing, preserve_rng_state=True, **kwargs)
    container.register_module(name, wrapper)


def apply_ac(model: nn.Module, spec: ModelSpec, cfg: ActivationCheckpoint) -> int:
    """Wrap blocks as ``cfg`` ([activation_checkpoint]) says; returns how many were wrapped."""
    budget = cfg.memory_budget if cfg.mode == "memory_budget" else 1.0
    torch._functorch.config.activation_memory_budget = budget
    # the budget sizes every value the partitioner could save; under expert parallel a compiled block also
    # takes a script object (its process group), which it cannot size: an input, so saving it costs nothing
    torch._functorch.config.unsafe_treat_script_objects_as_zero_size = cfg.mode == "memory_budget"
    for module in model.modules():  # the MoE top-k is saved, never recomputed under a budget (MoE.select)
        if isinstance(module, MoE):
            module.save_selection = cfg.mode == "memory_budget"
    if cfg.mode == "memory_budget":
        logger.info("activation checkpointing memory_budget: compiled blocks save %.2f of their activations", budget)
    if cfg.mode in ("none", "memory_budget"):
        return 0
    if cfg.mode == "recurrent":
        containers = spec.recurrence.containers if spec.recurrence is not None else ()
        if not containers:
            raise ValueError(
                f"activation_checkpoint.mode: 'recurrent' needs a model with a recurrent core; {spec.name!r} has none "
                "(use 'full' or 'selective')"
            )
    else:
        containers = spec.block_containers
    every = int(cfg.selective_ac_option) if cfg.mode == "selective" and cfg.selective_ac_option != "op" else 1
    op_level = cfg.mode == "selective" and cfg.selective_ac_option == "op"
    wrapped = 0
    index = 0
    for container_name in containers:
        container = model.get_submodule(container_name)
        for name, block in list(container.named_children()):
            if index % every == 0:
                kwargs = {"context_fn": _op_policy_context} if op_level else {}
                _wrap(container, name, block, **kwargs)
                wrapped += 1
            index += 1
    logger.info(
        "activation checkpointing %s%s: %d blocks in %s",
        cfg.mode,
        f" ({cfg.selective_ac_option})" if cfg.mode == "selective" else "",
        wrapped,
        ", ".join(containers),
    )
    return wrapped
