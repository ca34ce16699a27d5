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
    ``ceil(seq_len * moe.tokens_per_byte)`` of the model's spec (Spider: one segment per
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

from spider_titan.plan.activations import ActivationMeasure, measure_activation_bytes
from spider_titan.plan.cli import main
from spider_titan.plan.compiled import CompiledSaves, compile_like_trainer
from spider_titan.plan.estimate import GIB, H100_BF16_DENSE_TFLOPS, PER_ROW, Plan, make_plan, with_checkpointing
from spider_titan.plan.options import USAGE, PlanOptions, parse_plan_args, plan_flags_help
from spider_titan.plan.report import (
    CHECKPOINTING_NOT_NEEDED,
    KNOBS,
    MEMORY_BUDGET_FITS,
    checkpointing_line,
    format_plan,
    micro_batch_line,
    verdict,
)
from spider_titan.plan.search import (
    ALLOCATOR_MARGIN,
    BUDGETS,
    CONTEXT_GIB,
    budget_that_fits,
    fits_with_room,
    largest_micro_batch,
    micro_batch_choices,
    split_bytes,
    without_checkpointing,
)
from spider_titan.plan.sharded import build_sharded_model, fake_process_group, local_bytes, planning_config

__all__ = [
    "ALLOCATOR_MARGIN",
    "BUDGETS",
    "CHECKPOINTING_NOT_NEEDED",
    "CONTEXT_GIB",
    "GIB",
    "H100_BF16_DENSE_TFLOPS",
    "KNOBS",
    "MEMORY_BUDGET_FITS",
    "PER_ROW",
    "USAGE",
    "ActivationMeasure",
    "CompiledSaves",
    "Plan",
    "PlanOptions",
    "budget_that_fits",
    "build_sharded_model",
    "checkpointing_line",
    "compile_like_trainer",
    "fake_process_group",
    "fits_with_room",
    "format_plan",
    "largest_micro_batch",
    "local_bytes",
    "main",
    "make_plan",
    "measure_activation_bytes",
    "micro_batch_choices",
    "micro_batch_line",
    "parse_plan_args",
    "plan_flags_help",
    "planning_config",
    "split_bytes",
    "verdict",
    "with_checkpointing",
    "without_checkpointing",
]
