"""The recurrent core: weight-shared MoE blocks looped over the segments.

References: Geiping et al. 2025 (arXiv 2502.05171: input injection every loop); Bae et al. 2024
(arXiv 2410.20672: per-loop LoRA).

Loop i of ``n_loops`` on the chunk vectors ``s (B, S, dim)``, starting from ``h_0 = 0``:

1. LTI injection ``h = a * h + inject(s)``, ``a = exp(-softplus(decay_lambda))`` in (0, 1)^dim (a stable
   learned diagonal, 1/2 at init); ``inject(s)`` is computed once for every loop.
2. ``h = h + loop_embedding[i]`` (zero-initialised).
3. Each core block: MLA over segments (causal, RoPE by segment index, loop i's LoRA on ``wq``/``wo``),
   an Engram at the blocks in ``engram_layers`` (its keys and values, which read the segments' bytes
   only, computed once for every loop: ``Engram.memory``), then the MoE with the segment mask as its
   token mask.
   The loops run on the batch's real segments only, packed once into one row (attention.PackedRows:
   the attention lays them out as (B, S) rows again), and the output is laid out as rows at the end.
4. At eval a loop past ``n_loops`` hands on ``h_in + gain_i (h - h_in)`` (``h_in`` the state it
   received) with the buffer
   ``extra_loop_gain`` (ones until the end-of-run calibration fits it, calibration.py): gain 0 hands on
   ``h_in`` bit for bit, so evaluating deeper than trained is never worse than the trained depth.
5. The core output is ``norm(h)`` after the last loop; every segment runs every loop, and training
   runs ``n_loops`` loops with a graph through all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from spider_titan.models.spider.args import SpiderArgs
from spider_titan.models.spider.attention import MLA, KVCache, LoRA, PackedRows, can_fold
from spider_titan.models.spider.engram import Engram
from spider_titan.moe.layer import MoE


def _at(weights: torch.Tensor, loop: torch.Tensor) -> torch.Tensor:
    """``weights[loop]`` for a 0-dim int64 ``loop`` tensor, as a gather: torch.compile traces it
    without reading the index on the host (plain indexing would, or would specialise on it)."""
    return weights.index_select(0, loop.reshape(1)).squeeze(0)


class LoopLoRA(nn.Module):
    """Rank-r adapters on a core block's ``wq`` and ``wo``, one pair per loop index < max_loops.

    Stored stacked (``wq_a [L, dim, r]``, ``wq_b [L, r, q_out]``, ``wo_a [L, o_in, r]``,
    ``wo_b [L, r, dim]``) so a block's FSDP unit holds all of them and the loop index is a plain
    index. ``delta(x) = (x @ A[i]) @ B[i]`` with no extra scale; A ~ N(0, 1/in_features) so
    ``x @ A`` has unit scale for unit-RMS inputs, B = 0 so loop i starts as the shared block.
    """

    def __init__(self, max_loops: int, dim: int, q_out: int, o_in: int, rank: int):
        super().__init__()
        self.wq_a = nn.Parameter(torch.empty(max_loops, dim, rank))
        self.wq_b = nn.Parameter(torch.empty(max_loops, rank, q_out))
        self.wo_a = nn.Parameter(torch.empty(max_loops, o_in, rank))
        self.wo_b = nn.Parameter(torch.empty(max_loops, rank, dim))

    def q(self, loop: torch.Tensor) -> LoRA:
        """Loop ``loop``'s adapter of ``wq``."""
        return LoRA(_at(self.wq_a, loop), _at(self.wq_b, loop))

    def o(self, loop: torch.Tensor) -> LoRA:
        """Loop ``loop``'s adapter of ``wo``."""
        return LoRA(_at(self.wo_a, loop), _at(self.wo_b, loop))

    def init_weights(self) -> None:
        nn.init.normal_(self.wq_a, std=self.wq_a.shape[1] ** -0.5)
        nn.init.normal_(self.wo_a, std=self.wo_a.shape[1] ** -0.5)
        nn.init.zeros_(self.wq_b)
        nn.init.zeros_(self.wo_b)


class CoreBlock(nn.Module):
    """One weight-shared core block (MLA + per-loop LoRA, optional Engram, MoE).

    ``forward(h (B, S, dim), loop, freqs, memory (B, S, 2 dim) | None, seg_mask (B, S))
    -> (h, moe_aux_loss (scalar), moe_counts (E,))``, ``memory`` the Engram's (:meth:`Engram.memory`,
    None without one); tensors only (``packed`` a tuple of three), so
    activation checkpointing and torch.compile can wrap it as is. ``packed``: h, memory and
    seg_mask hold one packed row (1, N, ...) and freqs one rotation per segment (module docstring,
    item 3); the attention needs the rows' layout.
    """

    def __init__(self, args: SpiderArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = MLA.from_args(args)
        self.lora = LoopLoRA(
            args.max_loops,
            args.dim,
            args.n_heads * (args.qk_nope_head_dim + args.qk_rope_head_dim),
            args.n_heads * args.v_head_dim,
            args.lora_rank,
        )
        if layer_id in args.engram_layers:
            self.engram = Engram(args.dim, args.engram_buckets, args.engram_dim, args.norm_eps)
        else:
            self.engram = None
        self.moe_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe = MoE(args.dim, args.n_experts, args.top_k, args.moe_inter_dim)

    def forward(
        self,
        h: torch.Tensor,
        loop: torch.Tensor,
        freqs: torch.Tensor,
        memory: torch.Tensor | None,
        seg_mask: torch.Tensor,
        cache: KVCache | None = None,
        packed: PackedRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lora = self.lora
        h = h + self.attention(
            self.attention_norm(h),
            freqs,
            q_lora=lora.q(loop),
            o_lora=lora.o(loop),
            cache=cache,
            packed=packed,
        )
        if self.engram is not None:
            h = h + self.engram(h, memory)
        y, stats = self.moe(self.moe_norm(h), token_mask=seg_mask)
        return h + y, stats.aux_loss, stats.counts

    def init_weights(self, init_std: float, out_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.attention.init_weights(init_std, out_std)
        self.lora.init_weights()
        if self.engram is not None:
            self.engram.init_weights(init_std, out_std)
        self.moe_norm.reset_parameters()
        self.moe.init_weights(init_std, out_std)


@dataclass
class CoreOutput:
    """What the recurrent core hands back to the model.

    output:       (B, S, dim) ``norm(h)`` after the last loop (model dtype; zeros at padding segments)
    moe_aux_loss: scalar fp32, mean over the (block, loop) calls of E * sum f_i P_i
    moe_counts:   (E,) fp32 routed slots per expert, summed over blocks and loops (detached)
    loops_run:    loops computed (host int)
    """

    output: torch.Tensor
    moe_aux_loss: torch.Tensor
    moe_counts: torch.Tensor
    loops_run: int


class RecurrentCore(nn.Module):
    """The looped core stack with LTI input injection and loop embeddings (module docstring)."""

    def __init__(self, args: SpiderArgs):
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList(CoreBlock(args, j) for j in range(args.n_core))
        self.inject = nn.Linear(args.dim, args.dim, bias=False)
        self.decay_lambda = nn.Parameter(torch.empty(args.dim))
        self.loop_embedding = nn.Embedding(args.max_loops, args.dim)
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # Eval-time gains of the loops past n_loops, set by the end-of-run calibration: a buffer, so it
        # is saved and exported with the weights, replicated (never sharded) and never trained.
        self.register_buffer("extra_loop_gain", torch.empty(args.max_loops))

    def forward(
        self,
        s: torch.Tensor,
        *,
        n_loops: int,
        freqs: torch.Tensor,
        bucket_ids: torch.Tensor,
        seg_real: torch.Tensor,
        caches: list[list[KVCache]] | None = None,
        packed: PackedRows | None = None,
    ) -> CoreOutput:
        """``packed``: the loops run on the real segments only, packed into one row; ``caches``
        (incremental decoding, decode.py): one key/value cache per (loop, block)."""
        B, S, _ = s.shape
        if packed is not None:  # (B, S, ...) -> (1, N, ...) once for every loop and block
            s, bucket_ids, seg_real = (packed.pack(t) for t in (s, bucket_ids, seg_real))
            freqs = freqs.index_select(0, packed.index % S).unsqueeze(0)  # (1, N, rope/2, 2): index in its row
        injected = self.inject(s)  # (B, S, dim), the same every loop
        memory = self.engram_memory(bucket_ids, s.dtype)  # per block, the same every loop
        decay = torch.exp(-F.softplus(self.decay_lambda.float())).to(s.dtype)  # (dim,) in (0, 1)

        aux_sum = s.new_zeros((), dtype=torch.float32)
        counts = s.new_zeros(self.args.n_experts, dtype=torch.float32)
        h = s.new_zeros(injected.shape)  # the state loop 0 receives
        for i in range(n_loops):
            loop = torch.full((), i, dtype=torch.int64, device=s.device)
            # For torch.compile'd blocks (no-ops otherwise): the loop index goes in as a tensor and
            # the segment count as a symbol (run_loop marks the state), so one graph serves every
            # loop and every batch instead of a recompile per loop index and per new count.
            for t, dim in ((freqs, freqs.dim() - 3), (seg_real, 1), *((m, 1) for m in memory if m is not None)):
                torch._dynamo.maybe_mark_dynamic(t, dim)
            if packed is not None:
                torch._dynamo.maybe_mark_dynamic(packed.index, 0)
                torch._dynamo.maybe_mark_dynamic(packed.position, 0)
                torch._dynamo.maybe_mark_dynamic(packed.valid, 1)
            h, aux_sum, counts = self.run_loop(
                h,
                injected,
                decay,
                loop,
                freqs,
                memory,
                seg_real,
                aux_sum,
                counts,
                caches[i] if caches is not None else None,
                packed,
            )

        return CoreOutput(
            output=self.norm(h) if packed is None else packed.pad(self.norm(h)),  # the output as (B, S) rows again
            moe_aux_loss=aux_sum / (max(n_loops, 1) * len(self.layers)),
            moe_counts=counts,
            loops_run=n_loops,
        )

    def run_loop(
        self,
        before: torch.Tensor,
        injected: torch.Tensor,
        decay: torch.Tensor,
        loop: torch.Tensor,
        freqs: torch.Tensor,
        memory: tuple[torch.Tensor | None, ...],
        seg_real: torch.Tensor,
        aux_sum: torch.Tensor,
        counts: torch.Tensor,
        caches: list[KVCache] | None = None,
        packed: PackedRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One loop (module docstring, items 1-4) on the state ``before`` it receives (zeros before the
        first), the loop index a 0-dim tensor, so every loop runs the same code. Returns (the state it
        hands on, ``aux_sum`` plus its blocks' balancing losses, ``counts`` plus their routed slots)."""
        h = decay * before + injected
        h = h + _at(self.loop_embedding.weight, loop).to(h.dtype)
        torch._dynamo.maybe_mark_dynamic(h, 1)  # the state the first block receives (see forward)
        for j, block in enumerate(self.layers):
            if caches is None:
                h, aux, cnt = block(h, loop, freqs, memory[j], seg_real, packed=packed)
            else:  # incremental decoding (decode.py): this loop's keys and values of block j
                h, aux, cnt = block(h, loop, freqs, memory[j], seg_real, caches[j])
            aux_sum = aux_sum + aux
            counts = counts + cnt
        if not self.training:  # test-time depth: a loop past n_loops moves the state by its gain
            gain = _at(self.extra_loop_gain, loop).to(h.dtype)
            h = torch.where(loop >= self.args.n_loops, before + gain * (h - before), h)
        return h, aux_sum, counts

    def engram_memory(self, bucket_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor | None, ...]:
        """Per block, its Engram's keys and values of the segments ``bucket_ids (B, S, 2)`` (None for a
        block without one): they read the segments' bytes, not the state, so every loop shares them."""
        return tuple(None if b.engram is None else b.engram.memory(bucket_ids, dtype) for b in self._blocks())

    def _blocks(self) -> list[CoreBlock]:
        """The core blocks, under whatever wrapper activation checkpointing or compile put around them."""
        return [next(m for m in layer.modules() if isinstance(m, CoreBlock)) for layer in self.layers]

    def folds_lora(self) -> bool:
        """Whether a forward without caches folds the per-loop LoRA into the weights
        (``attention.adapted_linear``, where ``attention.can_fold``)."""
        attn = self._blocks()[0].attention
        return can_fold(attn.wq) and can_fold(attn.wo)

    @torch.no_grad()
    def inert_loops(self) -> list[bool]:
        """Per loop index, whether its own parameters are at their inert init (every block's LoRA ``B``
        zero, its loop-embedding row zero): all such loops compute the same map of the state. Called alike on every rank (a sharded parameter is gathered)."""
        per_loop = [p for b in self._blocks() for p in (b.lora.wq_b, b.lora.wo_b)]
        per_loop.append(self.loop_embedding.weight)
        inert = torch.ones(self.args.max_loops, dtype=torch.bool)
        for p in per_loop:
            full = p.full_tensor() if isinstance(p, DTensor) else p
            inert &= (full.reshape(self.args.max_loops, -1) == 0).all(dim=1).cpu()
        return inert.tolist()

    def init_weights(self, init_std: float, out_std: float) -> None:
        for block in self.layers:
            block.init_weights(init_std, out_std)
        nn.init.trunc_normal_(self.inject.weight, std=init_std)
        nn.init.zeros_(self.decay_lambda)  # a = exp(-softplus(0)) = 1/2
        nn.init.zeros_(self.loop_embedding.weight)
        self.norm.reset_parameters()
        nn.init.ones_(self.extra_loop_gain)
