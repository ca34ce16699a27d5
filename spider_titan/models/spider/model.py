"""Spider: a byte-level recurrent-depth MoE transformer (the contract is docs/model.md).

``forward(input_ids (B, T), labels (B, T) | None, n_loops | None) -> SpiderOutput``:

1. ``embed_tokens`` -> ``prelude`` (dense MLA + SwiGLU blocks over bytes, RoPE by byte position), all
   byte-level parts at ``byte_dim`` (default ``dim``; narrower puts the FLOPs in the core)
2. ``boundary_predictor`` + forced boundaries -> segments, by one rule in training and eval
   (segmentation.py; ``boundary_predictor = "fixed"`` cuts every round(target) bytes instead,
   ``"space"`` after words, SpaceByte's rule)
3. ``downsample`` (segment means; with ``chunk_convention = "first"`` a chunk's first byte) -> ``core``
   (recurrent MoE blocks, fixed depth or ACT, recurrence.py), on ``(B, S, dim)`` with a segment mask;
   Engram bucket ids hashed from the bytes (engram.py; under ``first`` chunk k gets chunk k - 1's)
4. ``up_proj`` (dim -> byte_dim) on the core output, optionally smoothed over segments
   (``dechunk_smoothing``), causal ``upsample`` (byte t reads the segment that ended before its own;
   under ``first`` its own chunk), times H-Net's confidence factor (``boundary_confidence``, value 1),
   added to the prelude residual (through the zero-initialised ``residual_proj`` with ``stage_init``)
5. ``coda`` (dense byte blocks) -> ``norm`` -> ``lm_head`` -> logits (B, T, 272)

Losses: ``loss = lm_loss + aux_loss`` with ``aux_loss = moe_aux_coeff * moe_aux_loss +
boundary_coeff * boundary_loss + ponder_coeff * ponder_loss`` (always computed, with or without
labels). Labels equal to PAD are ignored like -100.

``n_loops`` (eval-time override, 1..max_loops): with ``halting = "none"`` (default) the core runs
exactly that many loops; with ``halting = "act"`` at most that many (eval stops early once every
segment has halted).

``aux["flops_per_byte"]``: training FLOPs (fwd + bwd) per input byte of this very forward, from
the batch's segment counts (the core's per-segment work on its real segments under ``pack_segments``,
else on every row padded to the largest row's count; its attention over rows of that count;
``segment_bucket`` padding not counted: the bucket leaves every reported figure unchanged),
``loops_run`` (forward) and the loops with a graph (backward; fewer under truncated backprop,
``backprop_loops``)
(``spider_flops_per_byte``, causal attention counted halved like the dense baseline); a
detached scalar made from host ints, so it costs no extra sync.

Host syncs: one per forward (the largest segment count S and the total, read together); with ACT
at eval one more per loop for the early exit.

Initialisation (``init_weights()``, after ``to_empty``; there are no buffers: RoPE tables are
computed per call, the MoE's ``expert_bias`` is zeroed by ``MoE.init_weights``):
* ``embed_tokens`` N(0, 1); input projections (``wq``, ``wkv_a``, ``wkv_b``, SwiGLU/expert ``w1``,
  ``w3``, MoE router, ``inject``, Engram ``key_proj``, boundary ``proj``/``out``) trunc-normal 0.02;
* residual outputs (``wo``, ``w2``, expert ``w2``, Engram ``value_proj``, ``up_proj``) trunc-normal
  ``0.02 / sqrt(2 * depth)`` with depth = n_prelude + n_core * n_loops + n_coda, the number of
  residual blocks a byte's state passes through in training;
* ``lm_head`` trunc-normal ``byte_dim**-0.5``; norms 1; biases 0 except the boundary predictor's output
  bias (``logit(1/target_bytes_per_segment)``) and the halting bias (recurrence.py);
* zero: LoRA B matrices, ``loop_embedding``, Engram tables (docs/model.md); LoRA A N(0, 1/in_features);
  ``decay_lambda`` 0 (a = 1/2); cosine boundary projections: identity (H-Net); boundary
  threshold: Phi^-1(1 - 1/target).
* ``stage_init`` (H-Net's per-stage init): the byte blocks' residual outputs use depth
  n_prelude + n_coda instead (the core keeps the whole depth), ``residual_proj`` is zero and
  ``up_proj`` the identity.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spider_titan.models.common import PreNormBlock, default_init_std, depth_scaled_std, rope_frequencies
from spider_titan.models.spider.args import SPIDER_ADDED_ARGS, SPIDER_FLAVORS, SpiderArgs
from spider_titan.models.spider.attention import MLA, PackedRows
from spider_titan.models.spider.calibration import calibrate_extra_loops
from spider_titan.models.spider.engram import engram_bucket_ids
from spider_titan.models.spider.flops import spider_flops_per_byte
from spider_titan.models.spider.recurrence import RecurrentCore, sample_loops
from spider_titan.models.spider.segmentation import (
    BoundaryPredictor,
    boundary_confidence,
    boundary_loss,
    downsample,
    downsample_first,
    end_logits,
    segment_bytes,
    smooth_segments,
    space_boundary_logits,
    upsample,
    upsample_own,
)
from spider_titan.protocol import FLOPS_PER_BYTE, ModelOutput, ModelSpec, lm_loss_mean
from spider_titan.vocab import IGNORE_INDEX, PAD_ID, VOCAB_SIZE


@dataclass
class SpiderOutput(ModelOutput):
    """``ModelOutput`` of Spider. ``aux`` holds detached scalars: ``lm_loss`` (with labels),
    ``moe_aux_loss``, ``boundary_loss``, ``ponder_loss``, ``bytes_per_segment`` (real bytes per
    real segment over the batch), ``mean_loops`` (mean ACT halting loop over real segments;
    ``loops_run`` with fixed depth), ``loops_run`` (core loops computed: what the FLOPs depend on),
    ``expert_load_min`` and ``expert_load_max`` (fractions of routed slots over all MoE layers and
    loops), ``flops_per_byte`` (training FLOPs per input byte of this forward's segmentation)."""


class AttentionBlock(nn.Module):
    """A byte block without MLP (``byte_mlp = false``): ``x += attention(attention_norm(x), freqs)``."""

    def __init__(self, attention: nn.Module, dim: int, norm_eps: float):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.attention = attention

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        return x + self.attention(self.attention_norm(x), freqs)

    def init_weights(self, init_std: float, out_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.attention.init_weights(init_std, out_std)


class ByteStack(nn.Module):
    """A stack of byte blocks (``prelude`` / ``coda``) at ``byte_dim``: pre-norm MLA + SwiGLU blocks in
    ``layers`` (MLA only with ``byte_mlp = false``); the MLA head sizes are the core's."""

    def __init__(self, args: SpiderArgs, n_layers: int):
        super().__init__()
        width = args.byte_width

        def block() -> nn.Module:
            attention = MLA(
                width,
                args.n_heads,
                args.kv_lora_rank,
                args.qk_nope_head_dim,
                args.qk_rope_head_dim,
                args.v_head_dim,
                args.norm_eps,
            )
            if args.byte_mlp:
                return PreNormBlock(attention, width, args.inter_dim, args.norm_eps)
            return AttentionBlock(attention, width, args.norm_eps)

        self.layers = nn.ModuleList(block() for _ in range(n_layers))

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, caches: list | None = None) -> torch.Tensor:
        """``caches``: one ``KVCache`` per block (incremental decoding, decode.py)."""
        for i, block in enumerate(self.layers):
            x = block(x, freqs) if caches is None else block(x, freqs, caches[i])
        return x


class Spider(nn.Module):
    """The Spider model (module docstring); a plain nn.Module that builds on the meta device."""

    def __init__(self, args: SpiderArgs):
        super().__init__()
        problems = args.validate()
        if problems:
            raise ValueError("SpiderArgs: " + "; ".join(problems))
        self.args = args
        width = args.byte_width  # the byte-level parts; the core (with its inject: width -> dim) at dim
        self.embed_tokens = nn.Embedding(VOCAB_SIZE, width)
        self.prelude = ByteStack(args, args.n_prelude)
        self.boundary_predictor = (
            None
            if args.boundary_predictor in ("fixed", "space")
            else BoundaryPredictor(
                width, args.boundary_predictor, standardize=args.boundary_standardize, proj_dim=args.boundary_width
            )
        )
        self.core = RecurrentCore(args)
        self.up_proj = nn.Linear(args.dim, width, bias=False)  # the core output down to the byte width
        # stage_init: the prelude residual reaches the coda through a zero-initialised projection (H-Net)
        self.residual_proj = nn.Linear(width, width, bias=False) if args.stage_init else None
        self.coda = ByteStack(args, args.n_coda)
        self.norm = nn.RMSNorm(width, eps=args.norm_eps)
        self.lm_head = nn.Linear(width, VOCAB_SIZE, bias=False)

    def init_weights(self) -> None:
        """(Re)initialise every parameter in place (see the module docstring for the choices)."""
        a = self.args
        init_std = default_init_std(a.dim)
        out_std = depth_scaled_std(a.n_prelude + a.n_core * a.n_loops + a.n_coda)
        byte_std = depth_scaled_std(a.n_prelude + a.n_coda) if a.stage_init else out_std
        nn.init.normal_(self.embed_tokens.weight, std=1.0)
        for block in list(self.prelude.layers) + list(self.coda.layers):
            block.init_weights(init_std, byte_std)
        if self.boundary_predictor is not None:
            self.boundary_predictor.init_weights(init_std, a.target_bytes_per_segment)
        self.core.init_weights(init_std, out_std)
        if self.residual_proj is None:
            nn.init.trunc_normal_(self.up_proj.weight, std=out_std)
        else:
            nn.init.eye_(self.up_proj.weight)
            nn.init.zeros_(self.residual_proj.weight)
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.lm_head.weight, std=a.byte_width**-0.5)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        n_loops: int | None = None,
        sample_ids: torch.Tensor | None = None,
        step: int | None = None,
    ) -> SpiderOutput:
        """``sample_ids`` (B,) int64, optional: keys for the boundary noise in training, one per row
        (the trainer passes each sample's global index), so that a sample is segmented the same
        way whichever rank or micro-batch it lands in; without them the noise is torch's RNG.
        ``step`` (host int, optional): the optimizer step, which keys the training loop count under
        ``loop_sampling = "poisson_lognormal"`` (the same on every rank and micro-batch of the
        step); without it, or with ``n_loops`` given, training runs ``n_loops`` (default: the mean)."""
        a = self.args
        B, T = input_ids.shape
        if T > a.max_seq_len:
            raise ValueError(f"sequence length {T} > max_seq_len {a.max_seq_len}; raise model.max_seq_len")
        if n_loops is None and self.training and step is not None and a.loop_sampling != "fixed":
            n_loops = sample_loops(a, step)
        n_loops = a.n_loops if n_loops is None else int(n_loops)
        if not 1 <= n_loops <= a.max_loops:
            raise ValueError(f"n_loops: {n_loops} must be in [1, max_loops={a.max_loops}]")
        device = input_ids.device
        freqs = rope_frequencies(a.qk_rope_head_dim, T, a.rope_theta, device=device)  # (T, rope/2, 2)

        x = x_prelude = self.prelude(self.embed_tokens(input_ids), freqs)  # (B, T, dim)
        first = a.chunk_convention == "first"
        router_grad = a.router_grad  # the LM loss trains the predictor
        if a.boundary_predictor == "fixed":  # fixed-size segments: only the (shortened) length cap cuts
            logits = x.new_full((B, T), -30.0, dtype=torch.float32)
            cap = max(1, min(a.max_segment_bytes, round(a.target_bytes_per_segment)))
        elif a.boundary_predictor == "space":
            logits = space_boundary_logits(input_ids, chunk_start=first)
            cap = a.max_segment_bytes
        else:
            logits = self.boundary_predictor(x if router_grad else x.detach())
            cap = a.max_segment_bytes
        seg = segment_bytes(
            logits,
            input_ids,
            training=self.training,
            temperature=a.boundary_temperature,
            max_segment_bytes=cap,
            noise_keys=sample_ids,
            noise=a.boundary_noise,
            ste=a.boundary_ste,
            bucket=a.segment_bucket,
            chunk_start=first,
        )
        S = seg.num_segments
        bucket_ids = engram_bucket_ids(input_ids, seg, a.engram_buckets, a.max_segment_bytes)
        if first:  # chunk k may read bytes up to its start only: hash chunk k - 1, the last complete one
            bucket_ids = F.pad(bucket_ids[:, :-1], (0, 0, 1, 0))
        core = self.core(
            downsample_first(x, seg) if first else downsample(x, seg),  # (B, S, dim)
            n_loops=n_loops,
            freqs=freqs[:S],
            bucket_ids=bucket_ids,
            seg_real=seg.seg_real,
            seg_valid=seg.seg_valid,
            early_exit=not self.training,
            backprop_loops=a.backprop_loops if self.training else 0,
            init_keys=sample_ids if self.training else None,
            packed=PackedRows.of(seg.seg_valid, seg.total_segments) if a.pack_segments else None,
        )
        y = self.up_proj(core.output)  # (B, S, dim)
        if a.dechunk_smoothing:
            y = smooth_segments(y, seg, detach=not router_grad)
        y = upsample_own(y, seg) if first else upsample(y, seg)  # (B, T, dim)
        if a.boundary_confidence:
            y = y * boundary_confidence(seg).unsqueeze(-1).to(y.dtype)
        x = (x if self.residual_proj is None else self.residual_proj(x)) + y
        logits = self.lm_head(self.norm(self.coda(x, freqs)))  # (B, T, VOCAB_SIZE)

        if self.boundary_predictor is None:
            b_loss = x.new_zeros((), dtype=torch.float32)
        else:
            loss_seg = seg
            if router_grad and not a.boundary_prelude_grad:  # the boundary loss trains the predictor only
                probs = torch.sigmoid(end_logits(self.boundary_predictor(x_prelude.detach()), chunk_start=first))
                loss_seg = dataclasses.replace(seg, probs=probs)
            b_loss = boundary_loss(
                loss_seg,
                a.target_bytes_per_segment,
                a.boundary_loss,
                a.boundary_band,
                a.boundary_band_inner,
                a.boundary_band_upper,
            )
        aux_loss = a.moe_aux_coeff * core.moe_aux_loss + a.boundary_coeff * b_loss + a.ponder_coeff * core.ponder_loss
        load = core.moe_counts / core.moe_counts.sum().clamp(min=1.0)
        real_bytes = (input_ids != PAD_ID).sum().float()
        aux = {
            "moe_aux_loss": core.moe_aux_loss.detach(),
            "boundary_loss": b_loss.detach(),
            "ponder_loss": core.ponder_loss.detach(),
            "bytes_per_segment": real_bytes / seg.seg_real.sum().float().clamp(min=1.0),
            "mean_loops": core.mean_loops,
            "loops_run": torch.full((), float(core.loops_run), device=device),
            "expert_load_min": load.min(),
            "expert_load_max": load.max(),
            # From host ints, no extra sync: the core's work per segment on the batch's real segments
            # (pack_segments) or on every row padded to the largest row's count, and its attention over
            # rows of that count; without the bucket's padding (overhead, not model FLOPs).
            FLOPS_PER_BYTE: torch.full(
                (),
                spider_flops_per_byte(
                    a,
                    T,
                    n_loops=core.loops_run,
                    bytes_per_segment=B * T / seg.total_segments if a.pack_segments else T / seg.max_row_segments,
                    backprop_loops=core.backprop_loops,
                    row_segments=seg.max_row_segments,
                ),
                device=device,
            ),
        }
        if self.core.loop_step is not None:  # loop_step_size: how far each loop moves the state
            aux.update({f"loop_step_{i + 1}": g.detach() for i, g in enumerate(self.core.step_sizes().unbind())})
        loss = None
        if labels is not None:
            lm_loss = lm_loss_mean(logits, labels.masked_fill(labels == PAD_ID, IGNORE_INDEX))
            aux["lm_loss"] = lm_loss.detach()
            loss = lm_loss + aux_loss
        return SpiderOutput(logits=logits, loss=loss, aux_loss=aux_loss, aux=aux)


def parameter_breakdown(model: Spider) -> dict[str, int]:
    """Parameter counts by part (docs/model.md's breakdown), plus ``total``."""
    parts = {"dense blocks": 0, "core blocks": 0, "engram": 0, "lora": 0, "rest": 0}
    for name, p in model.named_parameters():
        if ".engram." in name:
            key = "engram"
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
    """Validation passes (``ModelSpec.eval_variants``): the default (the trained loop count, which
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


SPIDER_SPEC = ModelSpec(
    name="spider",
    args_cls=SpiderArgs,
    flavors=SPIDER_FLAVORS,
    model_cls=Spider,
    block_containers=("prelude.layers", "core.layers", "coda.layers"),
    flops_per_token=spider_flops_per_byte,
    recurrent_containers=("core.layers",),
    eval_variants=spider_eval_variants,
    train_inputs=("sample_ids", "step"),  # boundary noise keyed by global sample index, loop count by step
    moe_tokens_per_byte=spider_moe_tokens_per_byte,
    added_args=SPIDER_ADDED_ARGS,
    calibrate=calibrate_extra_loops,
)
