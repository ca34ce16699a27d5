"""Spider: a byte-level recurrent-depth MoE transformer (the contract is docs/model.md).

``forward(input_ids (B, T), labels (B, T) | None, n_loops | None) -> SpiderOutput``:

1. ``embed_tokens`` (plus hashed byte n-grams, ``byte_ngram_orders``) -> ``prelude`` (dense MLA + SwiGLU blocks over bytes, RoPE by byte position)
2. the :class:`~spider_titan.models.spider.segmentation.Chunker`: ``boundary_predictor`` logits ->
   segments (one rule in training and eval) -> chunk vectors (B, S, dim) and their Engram bucket ids
3. ``core`` (recurrent MoE blocks, recurrence.py) on the batch's real segments, packed into one row
4. ``up_proj`` of the core output -> the Chunker hands every byte its chunk's output (smoothed, with
   H-Net's confidence factor, when segments are learned), added to the prelude residual through the
   zero-initialised ``residual_proj``
5. ``coda`` (dense byte blocks) -> ``norm`` -> ``lm_head`` -> logits (B, T, 272)

Losses: ``aux_loss = moe_aux_coeff * moe_aux_loss + boundary_coeff * boundary_loss`` (with or
without labels; the trainer adds the LM loss). Labels equal to PAD are ignored like -100.

``aux["flops_per_byte"]``: training FLOPs (fwd + bwd) per input byte of this very forward, from the
batch's segment count and the loops run (``spider_flops_per_byte``); built from host ints, no sync.
One host sync per forward: every row's segment count, read together (segmentation.py); none with
``segment_capacity`` (static shapes: the core runs on a fixed number of segment slots per row).

Initialisation (``init_weights()``, after ``to_empty``): ``embed_tokens`` N(0, 1); input projections
trunc-normal 0.02; residual outputs trunc-normal ``0.02 / sqrt(2 * depth)``, depth the byte stages'
own (n_prelude + n_coda) for the byte blocks and the whole training depth (n_prelude + n_core *
n_loops + n_coda) for the core (H-Net's stage-aware init); ``residual_proj`` zero and ``up_proj`` the
identity, so at the start the coda reads only the core's output; ``lm_head`` trunc-normal
``dim**-0.5``; the boundary predictor and the core as their modules say.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import record_function

from spider_titan.models.common import ByteNgrams, PreNormBlock, default_init_std, depth_scaled_std, rope_frequencies
from spider_titan.models.spider.args import SPIDER_ADDED_ARGS, SPIDER_FLAVORS, SPIDER_RETIRED_ARGS, SpiderArgs
from spider_titan.models.spider.attention import MLA, PackedRows
from spider_titan.models.spider.calibration import calibrate_extra_loops, effective_loops
from spider_titan.models.spider.flops import spider_flops_per_byte
from spider_titan.models.spider.recurrence import RecurrentCore
from spider_titan.models.spider.segmentation import BoundaryPredictor, Chunker
from spider_titan.protocol import (
    FLOPS_PER_BYTE,
    Acceleration,
    HFModules,
    Inference,
    ModelOutput,
    ModelSpec,
    MoEPart,
    Recurrence,
    SavedArgs,
    Training,
    lm_loss_mean,
)
from spider_titan.vocab import IGNORE_INDEX, PAD_ID, VOCAB_SIZE


@dataclass
class SpiderOutput(ModelOutput):
    """``ModelOutput`` of Spider. ``aux`` holds detached scalars: ``lm_loss`` (with labels),
    ``moe_aux_loss``, ``boundary_loss``, ``bytes_per_segment`` (real bytes per real segment over the
    batch), ``mean_loops`` (loops per segment, the mean over real segments), ``loops_run`` (core loops
    computed: what the FLOPs depend on),
    ``expert_load_min`` and ``expert_load_max`` (fractions of routed slots over all MoE layers and
    loops), ``flops_per_byte`` (training FLOPs per input byte of this forward's segmentation)."""


class ByteStack(nn.Module):
    """A stack of byte blocks (``prelude`` / ``coda``): pre-norm MLA + SwiGLU blocks in ``layers``."""

    def __init__(self, args: SpiderArgs, n_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(
            PreNormBlock(MLA.from_args(args), args.dim, args.inter_dim, args.norm_eps) for _ in range(n_layers)
        )

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, caches: list | None = None) -> torch.Tensor:
        """``caches``: one ``KVCache`` per block (incremental decoding, decode.py)."""
        for i, block in enumerate(self.layers):
            x = block(x, freqs) if caches is None else block(x, freqs, caches[i])
        return x


class Spider(nn.Module):
    """The Spider model (module docstring); a plain nn.Module that builds on the meta device."""

    def __init__(self, args: SpiderArgs):
        """``args`` as the config (or a saved model's reader) checked them: the model trusts them."""
        super().__init__()
        self.args = args
        self.chunker = Chunker(args)
        self.embed_tokens = nn.Embedding(VOCAB_SIZE, args.dim)
        self.byte_ngrams = (
            ByteNgrams(args.byte_ngram_orders, args.byte_ngram_buckets, args.dim, args.byte_ngram_lr)
            if args.byte_ngram_orders
            else None
        )
        self.prelude = ByteStack(args, args.n_prelude)
        self.boundary_predictor = BoundaryPredictor(args.dim, args.boundary_width) if args.learned_segments else None
        self.core = RecurrentCore(args)
        self.up_proj = nn.Linear(args.dim, args.dim, bias=False)
        # the prelude residual reaches the coda through a zero-initialised projection (H-Net)
        self.residual_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.coda = ByteStack(args, args.n_coda)
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.lm_head = nn.Linear(args.dim, VOCAB_SIZE, bias=False)

    def init_weights(self) -> None:
        """(Re)initialise every parameter in place (see the module docstring for the choices)."""
        a = self.args
        init_std = default_init_std(a.dim)
        byte_std = depth_scaled_std(a.n_prelude + a.n_coda)
        nn.init.normal_(self.embed_tokens.weight, std=1.0)
        if self.byte_ngrams is not None:
            self.byte_ngrams.init_weights()
        for block in list(self.prelude.layers) + list(self.coda.layers):
            block.init_weights(init_std, byte_std)
        if self.boundary_predictor is not None:
            self.boundary_predictor.init_weights(a.target_bytes_per_segment)
        self.core.init_weights(init_std, depth_scaled_std(a.n_prelude + a.n_core * a.n_loops + a.n_coda))
        nn.init.eye_(self.up_proj.weight)
        nn.init.zeros_(self.residual_proj.weight)
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.lm_head.weight, std=a.dim**-0.5)

    def embed(self, input_ids: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Embeddings (B, T - first, dim) of the bytes ``input_ids[:, first:]``, each plus its hashed
        n-grams (``byte_ngram_orders``), which read the bytes before ``first`` too."""
        x = self.embed_tokens(input_ids[:, first:])
        return x if self.byte_ngrams is None else x + self.byte_ngrams(input_ids, first).to(x.dtype)

    def byte_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The prelude's byte states (B, T, dim) of ``input_ids``: what the boundary predictor reads
        (lab/analysis/segment_capacity.py and the GPU harness segment with them, without the core)."""
        freqs = rope_frequencies(
            self.args.qk_rope_head_dim, input_ids.shape[1], self.args.rope_theta, device=input_ids.device
        )
        return self.prelude(self.embed(input_ids), freqs)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        n_loops: int | None = None,
        sample_ids: torch.Tensor | None = None,
    ) -> SpiderOutput:
        """``n_loops``: the core loops to run (default: the trained ``n_loops``; up to ``max_loops`` at eval).
        ``sample_ids`` is part of the model contract (protocol.py: keys for training noise); Spider draws none."""
        a = self.args
        B, T = input_ids.shape
        if T > a.max_seq_len:
            raise ValueError(f"sequence length {T} > max_seq_len {a.max_seq_len}; raise model.max_seq_len")
        n_loops = a.n_loops if n_loops is None else int(n_loops)
        if not 1 <= n_loops <= a.max_loops:
            raise ValueError(f"n_loops: {n_loops} must be in [1, max_loops={a.max_loops}]")
        device = input_ids.device
        freqs = rope_frequencies(a.qk_rope_head_dim, T, a.rope_theta, device=device)  # (T, rope/2, 2)

        # Named ranges (the profiler's "spider.*", lab/bench/gpu.py): where a step's time goes.
        with record_function("spider.byte_blocks"):
            x = self.prelude(self.embed(input_ids), freqs)  # (B, T, dim)
        chunker = self.chunker
        with record_function("spider.segmentation"):
            capacity = chunker.capacity(T)
            logits = chunker.logits(self.boundary_predictor, x)
            seg = chunker.segment(logits, input_ids, bucket=a.segment_bucket, capacity=capacity)
            S = seg.num_segments
            chunks, bucket_ids = chunker.pool(x, seg), chunker.engram_ids(input_ids, seg)  # (B, S, dim), (B, S, 2)
            # the core runs on the real segments packed into one row; under a capacity on every slot, or
            # on a fixed number of packed positions (packed_capacity)
            pack_size = math.ceil(a.packed_capacity * B * T / a.target_bytes_per_segment)  # 0 without packed_capacity
            if not capacity:
                packed = PackedRows.of(seg.seg_valid, seg.total_segments)
            elif pack_size:
                packed = PackedRows.fixed(seg.seg_valid, pack_size)
            else:
                packed = None
        with record_function("spider.core"):
            core = self.core(
                chunks,
                n_loops=n_loops,
                freqs=freqs[:S],
                bucket_ids=bucket_ids,
                seg_real=seg.seg_real,
                packed=packed,
            )
        with record_function("spider.dechunk_head"):
            y = chunker.unpool(self.up_proj(core.output), seg)  # (B, T, dim)
            x = self.residual_proj(x) + y
        with record_function("spider.byte_blocks"):
            x = self.coda(x, freqs)
        with record_function("spider.dechunk_head"):
            logits = self.lm_head(self.norm(x))  # (B, T, VOCAB_SIZE)

        b_loss = chunker.loss(seg)
        aux_loss = a.moe_aux_coeff * core.moe_aux_loss + a.boundary_coeff * b_loss
        load = core.moe_counts / core.moe_counts.sum().clamp(min=1.0)
        real_bytes = (input_ids != PAD_ID).sum().float()
        dropped = (seg.row_segments - S).clamp(min=0).sum() if capacity else 0  # segments past a row's slots
        real_segments = seg.seg_real.sum() + dropped
        if pack_size:  # and the slots past the packed positions
            dropped = dropped + (seg.seg_valid.sum() - pack_size).clamp(min=0)
        aux = {
            "moe_aux_loss": core.moe_aux_loss.detach(),
            "boundary_loss": b_loss.detach(),
            "bytes_per_segment": real_bytes / real_segments.float().clamp(min=1.0),
            "mean_loops": torch.full((), float(core.loops_run), device=device),  # every segment runs every loop
            "loops_run": torch.full((), float(core.loops_run), device=device),
            "expert_load_min": load.min(),
            "expert_load_max": load.max(),
            # From host ints, no extra sync: the core's per-segment work on the batch's real segments,
            # its attention over rows of the largest row's count; the bucket's padding not counted.
            # Under a capacity the work of every slot (the core computes them all).
            FLOPS_PER_BYTE: torch.full(
                (),
                spider_flops_per_byte(
                    a,
                    T,
                    n_loops=core.loops_run,
                    bytes_per_segment=(B * T / pack_size if pack_size else T / S)
                    if capacity
                    else B * T / seg.total_segments,
                    row_segments=S if capacity else seg.max_row_segments,
                    lora_rows=B if self.core.folds_lora() else 0,
                ),
                device=device,
            ),
        }
        if capacity:  # the share of the batch's segments past the capacity
            aux["segments_dropped"] = dropped / seg.row_segments.sum()
        loss = None
        if labels is not None:  # the LM loss mean over the labels, plus aux_loss (the trainer normalises its own)
            lm_loss = lm_loss_mean(logits, labels.masked_fill(labels == PAD_ID, IGNORE_INDEX))
            aux["lm_loss"] = lm_loss.detach()
            loss = lm_loss + aux_loss
        return SpiderOutput(logits=logits, loss=loss, aux_loss=aux_loss, aux=aux)


def parameter_breakdown(model: Spider) -> dict[str, int]:
    """Parameter counts by part (docs/model.md's breakdown), plus ``total``."""
    parts = {"dense blocks": 0, "core blocks": 0, "engram": 0, "byte n-grams": 0, "lora": 0, "rest": 0}
    for name, p in model.named_parameters():
        if ".engram." in name:
            key = "engram"
        elif name.startswith("byte_ngrams."):
            key = "byte n-grams"
        elif ".lora." in name:
            key = "lora"
        elif name.startswith(("prelude.layers.", "coda.layers.")):
            key = "dense blocks"
        elif name.startswith("core.layers."):
            key = "core blocks"
        else:
            key = "rest"
        parts[key] += p.numel()
    parts["total"] = sum(parts.values())
    return parts


def spider_eval_variants(args: SpiderArgs) -> list[tuple[str, dict]]:
    """Validation passes (``Training.eval_variants``): the default (the trained loop count, which
    the validator runs once with the equal ``_loops<n_loops>`` pass), then eval loop counts 1, 2, 4
    and ``max_loops`` (test-time compute), deduplicated and capped at ``max_loops``."""
    out, seen = [("", {"n_loops": args.n_loops})], set()
    for n in (1, 2, 4, args.max_loops):
        if n <= args.max_loops and n not in seen:
            seen.add(n)
            out.append((f"_loops{n}", {"n_loops": n}))
    return out


def spider_moe_tokens_per_byte(args: SpiderArgs) -> float:
    """The core's MoE layers see segments: about one token per ``target_bytes_per_segment`` bytes."""
    return 1.0 / args.target_bytes_per_segment


SPIDER_MOE = MoEPart(
    tokens_per_byte=spider_moe_tokens_per_byte,
    experts=lambda a: a.n_experts,
    top_k=lambda a: a.top_k,
    width=lambda a: a.dim,
    calls_per_forward=lambda a: a.n_loops,  # every core block's MoE runs once per loop
    aux_loss_coeff=lambda coeff: {"moe_aux_coeff": coeff},
)


def spider_graph_blockers(a: SpiderArgs) -> list[str]:
    """What keeps a Spider training step from being one CUDA graph (training.cuda_graph)."""
    reasons = []
    if a.segment_capacity <= 0:
        reasons.append("model.segment_capacity > 0 (static shapes: without it the forward reads the segment count)")
    return reasons


SPIDER_SPEC = ModelSpec(
    name="spider",
    args_cls=SpiderArgs,
    flavors=SPIDER_FLAVORS,
    model_cls=Spider,
    block_containers=("prelude.layers", "core.layers", "coda.layers"),
    flops_per_token=spider_flops_per_byte,
    training=Training(max_seq_len=lambda a: a.max_seq_len, eval_variants=spider_eval_variants),
    saved=SavedArgs(
        added=SPIDER_ADDED_ARGS,
        retired=SPIDER_RETIRED_ARGS,
        export_values={"segment_capacity": 0.0, "packed_capacity": 0.0},  # static shapes are training's choice
    ),
    moe=SPIDER_MOE,
    recurrence=Recurrence(
        containers=("core.layers",), effective_loops=effective_loops, calibrate=calibrate_extra_loops
    ),
    inference=Inference(
        decoder="spider_titan.models.spider.decode",
        hf_modules=HFModules(
            config="spider_titan.hf.configuration_spider:SpiderConfig",
            model="spider_titan.hf.modeling_spider:SpiderForCausalLM",
            tokenizer="spider_titan.hf.tokenization_spider:SpiderByteTokenizer",
        ),
        # int4 costs +0.004-0.006 bpb more with lm_head quantized, +0.007 with the boundary predictor, nothing
        # measurable with core.inject (docs/benchmarks.md, "Quantized exports"); the routers pick experts and
        # are read as weights (moe/layer.py), not called as modules, and are 0.04 % of 1B's parameters; the
        # byte and loop embeddings are a few hundred rows, while the hashed tables (byte n-grams, Engram) are
        # quantized
        quantize_keep_fqns=("lm_head", "boundary_predictor", "router", "embed_tokens", "loop_embedding"),
    ),
    acceleration=Acceleration(
        # the byte-level edges, segmentation, routers and Engram stay high precision
        float8_skip_fqns=(
            "boundary_predictor",
            "loop_embedding",
            "engram",
            "norm",
            "embed_tokens",
            "lm_head",
            "router",
        ),
        compiled_modules=("boundary_predictor", "byte_ngrams"),  # on (B, T) bytes, whatever the segmentation
        graph_blockers=spider_graph_blockers,
    ),
)
