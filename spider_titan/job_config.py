"""The JobConfig: one dataclass per TOML table.

Each field is typed, defaulted and documented by the string literal under it; that text is what
``--help`` prints (read with ``ast`` by ``config.parse.field_docs``). Enumerated strings are
``Literal[...]`` and checked at parse time; component names are checked against the registry
(``config.validate.registry_problems``).

Number fields that accept only some values declare them with :func:`ranged` (a :class:`Range` in
the field's metadata); ``config.validate.range_problems`` checks every field against its range in one
place, and every float field must be finite.

Precedence: CLI ``--section.key value`` > TOML > these defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

# training.seed is added, shifted left by 40 bits, to int64 sample ids (train.py): it must stay below 2**23.
MAX_SEED = 2**23 - 1


@dataclass(frozen=True)
class Range:
    """The values a number field accepts: from ``low`` to ``high`` (None = unbounded; each bound
    excluded when ``low_open`` / ``high_open``), plus ``special`` values outside that, each with its meaning."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    special: tuple[tuple[float, str], ...] = ()

    def allows(self, value: float) -> bool:
        if any(value == v for v, _ in self.special):
            return True
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def text(self) -> str:
        """The range alone, e.g. ``in [0, 1]``, ``> 0``, ``-1 (the whole split) or >= 1`` (for --help)."""
        return self._join("")

    def describe(self, tp: type) -> str:
        """What to use instead of a refused value, e.g. ``an integer >= 1``, ``a finite number in [0, 1]``."""
        return self._join("an integer" if tp is int else "a finite number")

    def _join(self, kind: str) -> str:
        if self.low is not None and self.high is not None:
            opening, closing = "(" if self.low_open else "[", ")" if self.high_open else "]"
            bounds = f"in {opening}{_num(self.low)}, {_num(self.high)}{closing}"
        elif self.low is not None:
            bounds = f"{'>' if self.low_open else '>='} {_num(self.low)}"
        elif self.high is not None:
            bounds = f"{'<' if self.high_open else '<='} {_num(self.high)}"
        else:
            bounds = ""
        specials = [f"{_num(v)} ({meaning})" for v, meaning in self.special]
        main = " ".join(p for p in (kind, bounds) if p)
        return " or ".join(specials + ([main] if main else []))


def _num(value: float) -> str:
    """A bound as a person writes it: ``8388607``, ``0.5``, ``1e-08``."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def ranged(
    default: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    special: dict[float, str] | None = None,
) -> Any:
    """A dataclass field with ``default`` whose values must lie in the :class:`Range` given."""
    bounds = Range(low, high, low_open, high_open, tuple((special or {}).items()))
    return field(default=default, metadata={"range": bounds})


@dataclass
class Job:
    config_file: str = ""
    """TOML file to load (``--job.config_file``); CLI overrides apply on top of it."""
    dump_folder: str = "./outputs"
    """Folder for everything a run writes: resolved config, checkpoints, TensorBoard logs, exports.
    It belongs to one run (its ``run.json``): a later start there resumes that run from its checkpoints,
    or is refused; a non-empty folder spider_titan did not make is always refused."""
    overwrite: bool = False
    """Start a new run from step 0 in a dump folder that holds an earlier run, deleting the files that
    run wrote (``run.json`` lists them; checkpoints included) and nothing else."""
    description: str = ""
    """Free text describing the job, written to the resolved config."""


@dataclass
class Model:
    name: str = "spider"
    """Model component (registry key): ``spider`` or the ``dense`` baseline."""
    flavor: str = "debug"
    """Size preset of the model (``debug``, ``small``, ``1B``). Any field of the model's args can also be set in
    this section (e.g. ``n_loops = 4``) and overrides the flavor's value."""
    converters: list[str] = field(default_factory=list)
    """Module converters applied after building on meta, in order. ``["float8"]`` is the one switch
    for fp8 training (the seed's --precision fp8); where fp8 cannot run, ``float8.fallback`` says
    whether to stay in bf16 with one log line (``warn``, the seed's ``auto``) or stop (``error``)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """(Filled from the extra keys of [model]; not set directly.)"""


@dataclass
class Training:
    dataset: str = "builtin"
    """Dataset component: ``builtin`` (Python stdlib corpus, cached), ``bytes`` (.bin shards under
    ``dataset_path``), ``text`` (text/.jsonl files under ``dataset_path``), ``mock`` (synthetic)."""
    dataset_path: str = ""
    """Folder or file of the dataset (``bytes``: shard folder; ``text``: files or folders)."""
    seq_len: int = ranged(512, low=1)
    """Bytes per sample (the model sees seq_len inputs and predicts the next byte of each)."""
    local_batch_size: int = ranged(8, low=1)
    """Samples per micro-batch on each data-parallel rank."""
    gradient_accumulation_steps: int = ranged(1, low=1)
    """Micro-batches per optimizer step. Global batch = local_batch_size * accumulation * dp degree."""
    steps: int = 1000
    """Optimizer steps to run (ignored when ``target_tokens`` > 0, except on the command line over a TOML's
    ``target_tokens``; the most steps with ``flops_budget``)."""
    target_tokens: int = ranged(0, low=0)
    """When > 0, run until this many tokens (bytes) have been trained on; overrides ``steps``."""
    flops_budget: float = ranged(0.0, low=0.0)
    """When > 0, train until the training FLOPs (the model's own count, all ranks) reach this, and
    decay the learning rate over the steps the budget affords at the FLOPs per step spent so far;
    ``steps`` is then the most steps the run may take. For comparing models at equal compute when a
    step's cost varies (Spider's learned segmentation). Costs one host sync per step."""
    max_norm: float = 1.0
    """Gradient-norm clipping threshold (total norm over all parameters; <= 0 disables clipping)."""
    skip_nonfinite_steps: int = ranged(0, low=0)
    """Non-finite loss or gradient norm: 0 = stop at the first such step (exit 1, naming it and the
    last good checkpoint); N > 0 = skip the update of up to N such steps in a row and stop at the
    next one. Detection costs no host sync per step (a device-side flag read at log steps, before
    each checkpoint and at the end); skipping (N > 0) reads the flag every step, one sync per step.
    A checkpoint is never written from a non-finite state."""
    seed: int = ranged(0, low=0, high=MAX_SEED)
    """Seed for model init, data order and sampling noise (0 .. 2**23 - 1: it is added, shifted by 40 bits,
    to the int64 sample ids that key the training noise)."""
    deterministic: bool = False
    """Ask torch for deterministic algorithms (slower; for debugging and parity tests)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto`` = CUDA when available, else CPU."""
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Compute dtype of parameters on GPU (FSDP param dtype / autocast). On CPU runs stay fp32:
    CPU bf16 matmuls are slower than fp32 and gloo reductions are checked in fp32."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """dtype of gradient reduce-scatter under FSDP."""
    mixed_precision_mode: Literal["params", "autocast"] = "params"
    """Without FSDP on a GPU: ``params`` casts every parameter to mixed_precision_param once per step
    and runs without autocast, as FSDP does (bf16 activations and residual stream); ``autocast``
    keeps fp32 parameters under torch.autocast (fp32 residual stream, norms and adds)."""
    cast_weights_once: bool = True
    """Under autocast (one GPU, no FSDP): cast the matmul weights to the compute dtype once per step,
    shared by every loop, micro-batch and recompute (parallel/precision.py), not at every use."""
    compile: bool = False
    """torch.compile each block (after activation checkpointing, before FSDP)."""
    cuda_graph: bool = False
    """Capture a step's forwards and backwards as one CUDA graph after two plain steps and replay it
    (training/cuda_graph.py): one launch for thousands of kernels. One GPU, static shapes."""
    num_workers: int = ranged(0, low=0)
    """Data-loader worker processes per rank (0 = load in the training process)."""


@dataclass
class Optimizer:
    name: str = "AdamW"
    """Optimizer component: ``AdamW`` or ``Muon`` (Muon on 2-D hidden weights, AdamW elsewhere)."""
    lr: float = ranged(3e-4, low=0, low_open=True)
    """Peak learning rate."""
    beta1: float = ranged(0.9, low=0, high=1, high_open=True)
    """Adam beta1."""
    beta2: float = ranged(0.95, low=0, high=1, high_open=True)
    """Adam beta2."""
    eps: float = ranged(1e-8, low=0, low_open=True)
    """Adam epsilon."""
    weight_decay: float = ranged(0.1, low=0)
    """Decoupled weight decay, applied to matrices only (not to norms, biases, embeddings' rows of
    specials, LoRA-free scalars)."""
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"
    """AdamW's kernels: ``fused`` (one multi-tensor kernel per step), ``foreach`` or ``for-loop``;
    ``auto``: fused where every parameter is on CUDA, else foreach (what CPU FSDP runs, which have no
    fused kernel, use too, so a CPU run and its FSDP twin take the same steps)."""
    muon_lr: float = ranged(0.02, low=0, low_open=True)
    """Muon learning rate for hidden matrices (only with ``name = "Muon"``)."""
    lr_multipliers: list[str] = field(default_factory=list)
    """Per-module learning rates, entries ``PREFIX=FACTOR``: parameters whose FQN is PREFIX or starts
    with ``PREFIX.`` train at FACTOR x lr (and x muon_lr); the longest prefix wins, ``*`` takes the
    rest. H-Net's per-stage rates, outer byte stages higher: ``["*=2", "core=1"]`` for Spider."""


@dataclass
class LRScheduler:
    warmup_steps: int = ranged(100, low=0)
    """Linear warmup steps from ``lr * warmup_start_factor`` to ``lr`` (a run shorter than this warms up
    over all but its last step)."""
    warmup_start_factor: float = ranged(0.0, low=0, high=1)
    """LR multiplier at step 0 of warmup."""
    decay_type: str = "cosine"
    """Decay after warmup: ``cosine``, ``linear`` or ``wsd`` (warmup-stable-decay)."""
    decay_ratio: float = ranged(0.2, low=0, high=1)
    """``wsd`` only: fraction of the steps spent in the final linear decay."""
    min_lr_factor: float = ranged(0.1, low=0, high=1)
    """LR at the end of decay as a fraction of the peak."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """HSDP replicas (parameters replicated across this many groups, sharded inside each)."""
    data_parallel_shard_degree: int = -1
    """FSDP shard degree; -1 = whatever is left of the world size."""
    expert_parallel_degree: int = 1
    """Ranks that split the experts of each MoE layer (dim 0 of the grouped weights)."""
    expert_parallel_dispatch: Literal["dynamic", "capacity"] = "dynamic"
    """How tokens reach the experts' ranks in training. ``dynamic``: exact split sizes, one host read
    per MoE call, nothing dropped. ``capacity``: every rank sends each expert a fixed number of rows
    (``expert_capacity_factor``), no host read, an expert's overflow dropped and logged as
    ``moe_dropped_frac`` (parallel/expert_parallel.py; evaluation stays dynamic)."""
    expert_capacity_factor: float = ranged(1.25, low=0, low_open=True)
    """``capacity`` dispatch: rows each rank sends each expert per MoE call = this x the balanced
    share ``expert_capacity_tokens x top_k / n_experts``, rounded up to 16."""
    expert_capacity_tokens: int = ranged(0, low=0)
    """``capacity`` dispatch: the tokens one MoE call on one rank is planned for (the split sizes
    must be the same on every rank and known before the call, so they come from the config, not
    from the batch). 0: ``training.local_batch_size x training.seq_len x`` the model's MoE tokens
    per byte (Spider: 1 / target_bytes_per_segment), resolved at start-up and logged."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """``default`` reshards every block but the root after forward; ``never`` keeps parameters
    gathered between forward and backward (more memory, fewer all-gathers)."""
    fsdp_reshard_after_forward_units: list[str] = field(default_factory=list)
    """Per-unit overrides of ``fsdp_reshard_after_forward``, entries ``FQN=true|false`` (``true`` =
    reshard after forward), e.g. ``core=true`` or ``coda.layers.0=false``."""
    fsdp_keep_core_gathered_fraction: float = ranged(0.1, low=0, high=1)
    """With ``fsdp_reshard_after_forward = "default"``, the recurrent core (one FSDP unit) stays
    gathered from its forward to its backward, saving one all-gather per micro-batch, when its
    unsharded parameters take at most this fraction of the device's memory (GPU, or host RAM on
    CPU); 0 = reshard it after forward like the other units."""
    name: str = "fsdp"
    """The parallelize component applied to the materialised model (registry kind ``parallelize``):
    ``fsdp`` applies expert parallel, then FSDP2 / HSDP, as the keys below say."""
    fsdp: Literal["auto", "always", "never"] = "auto"
    """Wrap with FSDP2: ``auto`` = when the data-parallel world is > 1; ``always``; ``never`` (one
    process only: with several ranks nothing would average their gradients)."""
    comm_counter: bool = False
    """Count the bytes every collective moves (FSDP all-gather / reduce-scatter per unit, expert
    all-to-all per MoE layer) and write one JSON line per step to <dump_folder>/comm_counts.jsonl."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective", "recurrent", "memory_budget"] = "none"
    """``none``; ``full`` every block; ``selective`` op policy or every N-th block; ``recurrent`` the
    core blocks on every loop (the seed's gradient checkpointing); ``memory_budget`` the compiler's
    partitioner recomputes what is cheapest until each compiled block saves ``memory_budget``."""
    selective_ac_option: str = "op"
    """``selective`` only: ``op`` (save matmuls/attention except every second matmul) or an integer N
    (checkpoint every N-th block)."""
    memory_budget: float = ranged(0.5, low=0.0, high=1.0)
    """``memory_budget`` only (needs ``training.compile``): each compiled block saves this share of
    what it saves without checkpointing, above what recomputing everything would save (0: recompute
    all it can; 1: no checkpointing)."""


@dataclass
class Float8:
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """torchao float8 recipe; ``tensorwise`` is the one that supports fp8 all-gather."""
    filter_fqns: list[str] = field(default_factory=list)
    """Linears whose FQN contains any of these stay high precision too, besides the model's own
    ``Acceleration.float8_skip_fqns``."""
    pad_inner_dim: bool = True
    """Pad inner dims to multiples of 16 so fp8 matmuls accept them."""
    enable_fsdp_float8_all_gather: bool = False
    """All-gather fp8 weights under FSDP2 (tensorwise only; needs FSDP)."""
    precompute_float8_dynamic_scale_for_fsdp: bool = True
    """With fp8 all-gather: compute all scales in one fused step after each optimizer step."""
    moe_experts: bool = True
    """Use torchao's fp8 grouped GEMM for the experts where the GPU supports it (SM 9.0/10.0)."""
    fallback: Literal["warn", "error"] = "warn"
    """When fp8 is asked for but cannot run here: ``warn`` = log one line and stay bf16, ``error`` = stop."""


@dataclass
class MoE:
    backend: str = "torch"
    """MoE backend component: ``torch`` (reference) or ``triton`` (fused kernels)."""
    aux_loss_coeff: float = ranged(0.01, low=0)
    """Weight of the load-balancing loss E·Σ f_i P_i (sets the model's moe_aux_coeff)."""
    load_balance: Literal["aux_loss", "aux_free", "both"] = "aux_loss"
    """``aux_loss``: the loss only; ``aux_free``: the bias update only (loss weight 0); ``both``."""
    bias_update_rate: float = ranged(1e-3, low=0)
    """Aux-loss-free balancing: expert_bias += rate * sign(mean_count - count_i) per step."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save DCP checkpoints every ``interval`` steps and resume from the latest one."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to the dump folder (or absolute)."""
    interval: int = ranged(500, low=1)
    """Steps between checkpoints."""
    keep_latest_k: int = ranged(0, low=0)
    """Keep only the newest k complete checkpoints (0 = keep all)."""
    async_mode: Literal["disabled", "async"] = "disabled"
    """``async`` writes checkpoints in the background while training goes on."""
    load_step: int = ranged(-1, low=0, special={-1: "the latest"})
    """Resume from this step's checkpoint instead of the latest (-1 = latest)."""
    initial_load_path: str = ""
    """Start from this checkpoint folder (the seed's --resume) when the run has none of its own."""
    initial_load_model_only: bool = False
    """With ``initial_load_path``: load weights only, fresh optimizer and step 0 (--reset_steps)."""
    last_save_model_only: bool = True
    """The final save holds the model only (in ``export_dtype``)."""
    export_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of model-only saves and safetensors exports."""
    export_at_end: bool = False
    """Write a safetensors export (model.safetensors + config.json) at the end of training."""


@dataclass
class Comm:
    init_timeout_seconds: float = ranged(300.0, low=0.0, low_open=True)
    """Seconds a rank waits for the others while the run starts: the process group's rendezvous and
    every collective up to the end of the first step (checkpoint load, FSDP's first all-gathers)."""
    train_timeout_seconds: float = ranged(100.0, low=0.0, low_open=True)
    """Seconds a rank waits in a collective after the first step before it stops with one line naming
    the step and the collective's phase (another rank died, hangs or is stopped); checkpoint saves,
    validation and the end-of-run work wait ``init_timeout_seconds``. torchrun then restarts the job
    from the newest complete checkpoint (``--max-restarts``) or ends it."""


@dataclass
class Metrics:
    log_freq: int = ranged(10, low=1)
    """Steps between console/TensorBoard lines."""
    enable_jsonl: bool = True
    """Append the scalars of every logged step to ``metrics.jsonl`` in the dump folder."""
    enable_tensorboard: bool = False
    """Also write the scalars to TensorBoard."""
    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to the dump folder."""
    rank_0_only: bool = True
    """Only rank 0 logs."""


@dataclass
class Validation:
    enable: bool = False
    """Evaluate on the dataset's validation split every ``freq`` steps."""
    freq: int = ranged(100, low=1)
    """Steps between validations."""
    steps: int = ranged(10, low=1, special={-1: "the whole split"})
    """Batches per validation (-1 = the whole split)."""
    local_batch_size: int = ranged(0, low=1, special={0: "training.local_batch_size"})
    """Validation micro-batch size per rank (0 = training.local_batch_size)."""
    ttt: bool = False
    """After the final validation, also score the val split's documents chunk by chunk without and with
    score-first test-time training (training/ttt.py, its default settings): ``val_bpb_docs``,
    ``val_bpb_ttt`` and their paired difference. One process only."""
    ttt_max_bytes: int = ranged(1_000_000, low=1, special={0: "the whole split"})
    """Bytes of the val split (its first documents) that the test-time training pass reads."""


@dataclass
class Calibration:
    enable: bool = True
    """After the last training step, before the final validation, save and export, fit the model's
    eval-time settings on fresh training batches (``Recurrence.calibrate``; Spider: the gains of the
    loops past ``n_loops``, so evaluating at more loops than trained is no worse). Models without
    such settings skip it, and so does a run with no validation, checkpoint or export to read it."""
    steps: int = ranged(32, low=1)
    """Batches of ``training.local_batch_size`` per rank, the ones training would read next (its own
    position does not move), at most a tenth of the micro-batches the run trained on; the model is
    scored on them once per candidate setting (Spider: 1 + 3 per loop past ``n_loops``)."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces of the steps ``start_step`` .. ``start_step + active_steps - 1``
    (one JSON file per rank, Chrome/Perfetto and TensorBoard format; metrics/profiling.py)."""
    start_step: int = ranged(3, low=1)
    """First profiled step (the step before it warms the profiler up)."""
    active_steps: int = ranged(2, low=1)
    """Steps recorded in the trace."""
    save_traces_folder: str = "profile_traces"
    """Folder of the traces and memory snapshots, relative to the dump folder."""
    enable_memory_snapshot: bool = False
    """CUDA only: record the allocator's history from the start and dump a snapshot after step
    ``memory_snapshot_step`` (open it at https://pytorch.org/memory_viz)."""
    memory_snapshot_step: int = ranged(3, low=1)
    """Step after which the memory snapshot is written."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    float8: Float8 = field(default_factory=Float8)
    moe: MoE = field(default_factory=MoE)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    comm: Comm = field(default_factory=Comm)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    calibration: Calibration = field(default_factory=Calibration)
    profiling: Profiling = field(default_factory=Profiling)
