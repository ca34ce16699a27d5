"""The model protocol: what every model gives the framework, and what the framework relies on.

A model is a plain ``nn.Module`` with no distributed imports that builds on the meta device and
provides ``init_weights()``; ``forward(input_ids, ...)`` returns a :class:`ModelOutput`. It is
described to the rest of the framework by a :class:`ModelSpec` (registered in
``registry.py``): its args and flavors, the containers of its repeated blocks (which
parallelism, float8, activation checkpointing and compile find through ``block_containers``), its
FLOPs, its training objective and its validation variants. ``sample_ids`` (B,) int64, for models
that ask for them (``training.inputs``), key training-time noise per sample: the trainer passes
global sample indices, so the noise does not depend on the parallel layout. docs/model.md says
what Spider does with each part; docs/extension.md adds a model.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from spider_titan.vocab import IGNORE_INDEX

# dtype names as configs and CLIs spell them
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# The key of ``ModelOutput.aux`` in which a model reports the training FLOPs per input byte of the
# forward just run (Spider: from its actual segmentation); the trainer uses it over the spec's
# formula when present.
FLOPS_PER_BYTE = "flops_per_byte"


@dataclass
class ModelOutput:
    """What every model's forward returns.

    logits:   (B, T, VOCAB_SIZE)
    loss:     scalar total loss (lm_loss + weighted auxiliary terms), None without labels
    aux_loss: scalar, the weighted sum of the non-LM loss terms (zero for models without any);
              present with or without labels so the train loop can normalise the LM term itself
    aux:      scalar tensors for metrics (lm_loss, moe_aux_loss, ...), detached or not
    """

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    aux: dict[str, torch.Tensor] = field(default_factory=dict)


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-byte cross-entropy over labels != IGNORE_INDEX, computed in fp32."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def lm_loss_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy over labels != IGNORE_INDEX (0 when there are none)."""
    n = (labels != IGNORE_INDEX).sum().clamp(min=1)
    return lm_loss_sum(logits, labels) / n


def window_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (window) of a batch: summed next-byte cross-entropy in nats (B,) and label count (B,),
    both float64, labels == IGNORE_INDEX left out; for comparisons window by window."""
    per_byte = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
    return per_byte.sum(1).double(), (labels != IGNORE_INDEX).sum(1).double()


def paired_difference(ce: torch.Tensor, base: torch.Tensor, count: torch.Tensor) -> tuple[float, float]:
    """Bits per byte of ``ce`` minus ``base`` (per-window summed cross-entropies in nats, (R,), over the
    same windows with ``count`` labels each) and the difference's standard error over the windows
    (a ratio estimator, each window weighted by its bytes): two settings of one model compared on
    the same bytes, far more precisely than either figure alone."""
    keep = count > 0
    d, c = (ce - base)[keep].double() / math.log(2), count[keep].double()
    diff = float(d.sum() / c.sum())
    r = d.numel()
    se = float(torch.sqrt(((d - diff * c) ** 2).sum() * r / max(r - 1, 1)) / c.sum())
    return diff, se


WindowScorer = Callable[[dict], "tuple[torch.Tensor, torch.Tensor]"]
"""``(forward_kwargs) -> (ce, count)``: the model's summed next-byte cross-entropy in nats (R,) float64
and label counts (R,) per window of a fixed set of batches, every rank's windows in one order, the
same tensors on every rank (the end-of-run calibration's batches, training/calibration.py)."""


class CachedDecoder(Protocol):
    """A model's incremental decoder (``ModelSpec.decoder``, a module with these functions): each new
    byte costs one byte's work, and the logits equal the full forward's at those positions."""

    def unsupported(self, model: nn.Module) -> str | None:
        """Why ``model`` cannot be decoded incrementally (an option the decoder does not cover), or None."""

    def new_cache(self, model: nn.Module, batch_size: int, n_loops: int | None = None) -> Any:
        """An empty cache for ``batch_size`` rows; ``n_loops``: the test-time depth, fixed per cache."""

    def decode(self, model: nn.Module, ids: torch.Tensor, cache: Any, lengths: list[int] | None = None) -> torch.Tensor:
        """Logits (B, t, VOCAB_SIZE) of the new ids (B, t) of each row (its first ``lengths[i]``),
        which the cache then holds."""


@dataclass(frozen=True)
class HFModules:
    """The transformers classes of a model's exports, each ``"module:Class"`` with the module in
    ``spider_titan.hf``: hf/bundle.py copies their modules, and every package module they import, into
    the export, so it loads with ``trust_remote_code=True`` where only torch and transformers are installed."""

    config: str
    """The ``PretrainedConfig`` (``AutoConfig``)."""
    model: str
    """The ``PreTrainedModel`` (``AutoModelForCausalLM``)."""
    tokenizer: str
    """The tokenizer (``AutoTokenizer``)."""

    @property
    def modules(self) -> tuple[str, ...]:
        """The three modules, in the order config, model, tokenizer."""
        return tuple(target.split(":")[0] for target in (self.config, self.model, self.tokenizer))


@dataclass(frozen=True)
class Training:
    """How a model trains and validates (every model has one; the defaults: next-byte cross-entropy,
    no extra inputs, no length bound, one plain validation pass)."""

    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss_sum
    """``(logits, labels) -> scalar``: the training objective summed over labels (the trainer normalises
    it over all micro-batches and ranks)."""
    inputs: tuple[str, ...] = ()
    """Extra keyword inputs the training forward takes from the trainer: ``"sample_ids"`` ((B,) int64
    global sample indices, keys for training noise), ``"step"`` (host int, the optimizer step: keys
    per-step randomness, the same on every rank)."""
    max_seq_len: Callable[[Any], int] | None = None
    """``args -> int``: the longest input (bytes) the model accepts; ``training.seq_len`` is checked
    against it and generation keeps a sample within it. None: no bound."""
    eval_variants: Callable[[Any], list[tuple[str, dict]]] | None = None
    """``args -> [(suffix, forward_kwargs), ...]``: validation runs once per variant, calling
    ``model(inputs, **forward_kwargs)`` and logging ``val_loss{suffix}`` / ``val_bpb{suffix}`` (the
    variant with suffix "" also logs each ``aux`` scalar as ``val_<key>``). None: one plain pass."""


@dataclass(frozen=True)
class SavedArgs:
    """How saved args (a checkpoint's or an export's ``model.args``) map to this code."""

    added: dict[str, Any] = field(default_factory=dict)
    """Args fields added after a checkpoint format was fixed -> the value that rebuilds a model saved
    without them (:meth:`ModelSpec.saved_args`, which every reader of a checkpoint or export applies)."""
    retired: dict[str, tuple[Any, str]] = field(default_factory=dict)
    """Args fields that left the model -> (the saved value the remaining code reproduces, None for any;
    the last release or commit that had the field, e.g. "release v0.1.0"): a saved model with that
    value loads without it, any other is refused in one line naming the field and that release."""
    export_values: dict[str, Any] = field(default_factory=dict)
    """Args fields an export writes at these values whatever the run trained with: how training shaped
    its tensors for speed, which inference must not inherit (Spider's static-shape capacities drop
    segments of a dense prompt)."""


@dataclass(frozen=True)
class MoEPart:
    """What the framework asks a model with MoE layers (expert parallel, the planner, the balancing loss)."""

    tokens_per_byte: Callable[[Any], float]
    """``args -> float``: the tokens a MoE layer sees per input byte (Spider's core runs on segments:
    1 / target_bytes_per_segment); sizes expert parallel's fixed-capacity dispatch, and is the count of
    core tokens the planner assumes the forward reads back to the host."""
    experts: Callable[[Any], int]
    """``args -> int``: routed experts per MoE layer (expert parallel splits them over ranks)."""
    top_k: Callable[[Any], int]
    """``args -> int``: experts each token is routed to."""
    width: Callable[[Any], int]
    """``args -> int``: the width of a routed token (what all-to-all sends per row)."""
    calls_per_forward: Callable[[Any], int] = lambda args: 1
    """``args -> int``: how often each MoE layer runs in one training forward (Spider: its core loops)."""
    aux_loss_coeff: Callable[[float], dict[str, Any]] | None = None
    """``coeff -> args overrides`` that weight the model's load-balancing loss by ``[moe] aux_loss_coeff``
    (0 under ``load_balance = "aux_free"``); a ``[model]`` override of the same field wins. None: the
    model has no such loss."""


@dataclass(frozen=True)
class Recurrence:
    """A model whose blocks run several times per forward (a recurrent core with a test-time depth)."""

    containers: tuple[str, ...]
    """The block containers applied several times per forward; activation checkpointing's
    ``recurrent`` mode wraps these."""
    effective_loops: Callable[[nn.Module, int | None], int | None] | None = None
    """``(model, n_loops) -> n_loops``: the fewest loops an eval forward asked for ``n_loops`` (test-time
    depth) must run for the same output bit for bit; generation runs only those. None: as asked."""
    calibrate: Callable[[nn.Module, Any, WindowScorer], dict[str, float]] | None = None
    """``(model, args, score: WindowScorer) -> {name: figure}``: after the last training step, fits
    eval-time settings of the trained model (buffers, never its trained weights) on fresh training
    batches scored by ``score``, the same way on every rank; returns figures to log. None: nothing to
    fit ([calibration])."""


@dataclass(frozen=True)
class Inference:
    """What generation and the export ask a model that has more than its forward."""

    decoder: str | None = None
    """The module of the model's incremental decoder (a :class:`CachedDecoder`), imported when generation
    asks (:meth:`ModelSpec.cached_decoder`): named, not imported, because a decoder imports its model.
    None: generation recomputes the context for each byte."""
    hf_modules: HFModules | None = None
    """The transformers classes an export bundles (:class:`HFModules`, docs/hf.md); None: the export
    holds no Hugging Face files."""
    quantize_keep_fqns: tuple[str, ...] | None = None
    """Linears and embedding tables whose FQN contains one of these keep the export's dtype in an int8 /
    int4 export (quantization/weight_only.py); None: the model has no quantized export."""


@dataclass(frozen=True)
class Acceleration:
    """What the speed features (float8, torch.compile, CUDA graphs) need to know of a model."""

    float8_skip_fqns: tuple[str, ...] = ()
    """Linears whose FQN contains one of these stay in high precision under the float8 converter
    (besides ``float8.filter_fqns``): the parts fp8 hurts or does not speed up."""
    compiled_modules: tuple[str, ...] = ()
    """Modules outside the block containers that ``training.compile`` compiles too, each as one graph:
    glue whose shapes do not change with the data (Spider's boundary predictor runs on bytes), so it
    adds no recompile; a missing module is skipped."""
    graph_blockers: Callable[[Any], list[str]] | None = None
    """``args -> [reason, ...]``: why a training step's forward is not the same CUDA graph every step (a
    host read of a data-dependent size, a per-step host choice); ``training.cuda_graph`` refuses the run
    with them. None: nothing blocks."""


@dataclass(frozen=True)
class ModelSpec:
    """How the framework builds and handles one registered model. The framework reads a model's args
    only through its spec (never a field by name); what only some models have is an optional part,
    None when a model has none.

    name:             registry key
    args_cls:         dataclass of the model's hyper-parameters (every field overridable in [model])
    flavors:          flavor name -> args instance
    model_cls:        nn.Module class constructed as ``model_cls(args)``; must build on the meta device
                      and provide ``init_weights()``
    block_containers: FQNs of the ModuleLists that hold the repeated blocks (FSDP units, AC and
                      compile targets), in forward order
    flops_per_token:  ``(args, seq_len) -> float`` training FLOPs (fwd+bwd) per input token, for MFU
    training:         :class:`Training`: the objective, extra training inputs, the length bound, the
                      validation variants
    saved:            :class:`SavedArgs`: fields added and retired since a checkpoint format was fixed,
                      and the values an export writes
    moe:              :class:`MoEPart`, for models with MoE layers
    recurrence:       :class:`Recurrence`, for models with a recurrent core
    inference:        :class:`Inference`: cached decoding, the Hugging Face classes, quantized exports
    acceleration:     :class:`Acceleration`: what float8, compile and CUDA graphs must leave alone or add
    """

    name: str
    args_cls: type
    flavors: dict[str, Any]
    model_cls: type
    block_containers: tuple[str, ...]
    flops_per_token: Callable[..., float]
    training: Training = Training()
    saved: SavedArgs = SavedArgs()
    moe: MoEPart | None = None
    recurrence: Recurrence | None = None
    inference: Inference | None = None
    acceleration: Acceleration = Acceleration()

    def build_args(self, flavor: str, overrides: dict[str, Any] | None = None):
        """The flavor's args with ``overrides`` applied (keys already validated by the config)."""
        if flavor not in self.flavors:
            raise ValueError(
                f"model.flavor: {flavor!r} is not a flavor of {self.name!r}; choose one of {list(self.flavors)}"
            )
        return dataclasses.replace(self.flavors[flavor], **(overrides or {}))

    def saved_args(self, args: dict[str, Any]) -> dict[str, Any]:
        """A saved model's args (a checkpoint's or an export's ``model.args``) as this code rebuilds
        that model: the fields added since (``saved.added``) filled in, the retired ones
        (``saved.retired``) dropped where saved at the value the code reproduces; a field missing for any
        other reason stays missing. ValueError, one line, for a retired option at another value."""
        added, retired_args = self.saved.added, self.saved.retired
        args = {**{k: v for k, v in added.items() if k not in args}, **args}
        retired = {k: args.pop(k) for k in list(args) if k in retired_args}
        used = [
            (k, v, retired_args[k][1])
            for k, v in retired.items()
            if retired_args[k][0] is not None and v != retired_args[k][0]
        ]
        if used:
            fields = ", ".join(f"{k} = {v!r} (last in {where})" for k, v, where in used)
            raise ValueError(
                f"this {self.name} model was saved with options that have left spider_titan: {fields}; "
                "load it with spider_titan at that release"
            )
        return args

    def build_on_meta(self, args: Any) -> nn.Module:
        """The model for ``args`` on the meta device: no memory until ``to_empty`` + ``init_weights``."""
        with torch.device("meta"):
            return self.model_cls(args)

    def cached_decoder(self) -> CachedDecoder | None:
        """The model's incremental decoder (the ``inference.decoder`` module), None when it has none."""
        decoder = None if self.inference is None else self.inference.decoder
        return importlib.import_module(decoder) if decoder is not None else None

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """Every repeated block as (fqn, module), in forward order."""
        out = []
        for container in self.block_containers:
            mod = model.get_submodule(container)
            for name, block in mod.named_children():
                out.append((f"{container}.{name}", block))
        return out

    def compiled_extras(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The ``acceleration.compiled_modules`` this model has, as (fqn, module)."""
        names = dict(model.named_modules())
        return [(fqn, names[fqn]) for fqn in self.acceleration.compiled_modules if fqn in names]


PostStepHook = Callable[[], "dict[str, torch.Tensor] | None"]
"""The one after-step seam (components/builder.py ``Run.post_step_hooks``): called after every optimizer
step; returns None, or device scalars of that step to log with its metrics (averaged over ranks, read
only at log steps: a hook must not sync), e.g. expert parallel's dropped-token fraction."""
