"""The recurrent core: weight-shared MoE blocks looped over the segments, with adaptive halting.

References: Geiping et al. 2025 (arXiv 2502.05171, input injection every loop); Bae et al. 2024
(arXiv 2410.20672, per-loop LoRA in recursive transformers); Graves 2016 (arXiv 1603.08983, ACT).

Loop i of ``n_loops`` on the segment states ``s (B, S, byte_dim)``, starting from ``h_0 = 0``:

1. LTI injection ``h = a * h + inject(s)`` (``inject``: byte_dim -> dim, the projection into the core) with ``a = exp(-softplus(decay_lambda))`` in (0, 1)^dim,
   a stable learnable diagonal; ``inject(s)`` is computed once and reused by every loop.
   ``decay_lambda`` starts at 0, i.e. ``a = 1/2``: each loop keeps half of the previous state.
2. ``h = h + loop_embedding[i]`` (zero-initialised; none with ``loop_embedding = false``).
3. Each core block j: ``h += attn(attention_norm(h))`` (MLA, causal over segments, RoPE by segment
   index, loop i's LoRA on ``wq``/``wo`` unless ``loop_lora = false``); Engram at the blocks in ``engram_layers``
   (``h += engram(h, bucket_ids)``); ``h += moe(moe_norm(h))`` with the segment mask as the MoE's
   token mask (padding segments left out of the load statistics). Under ``pack_segments`` (default)
   the loops run on the batch's real segments only, packed once into one row (attention.PackedRows:
   each block's attention lays them out as (B, S) rows, everything else is per segment), and the
   output is laid out as (B, S) again at the end (zeros in the padding); without it padding segments
   are computed too (and never read).
   With ``loop_step_size``, the loop hands on ``h_in + g_i (h - h_in)`` (``h_in`` the state it
   received, 0 for the first loop), a learned step size ``g_i`` per loop index (starting at 1).
   With ``loop_state_norm``, ``h = state_norm(h)`` ends every loop (the scale handed on does not
   grow with the loop count).
   At eval (``halting = "none"``), a loop past ``n_loops`` hands on ``h_in + gain_i (h - h_in)``, a gain per
   loop index (``extra_loop_gains``, buffer ``extra_loop_gain``; ones until the end-of-run
   calibration fits them, models/spider/calibration.py): gain 0 hands on ``h_in`` bit for bit.
4. ``halting = "none"`` (default): no halting; the core output is ``norm(h)`` after the last
   loop, every segment runs every loop (``mean_loops`` = ``loops_run`` = n_loops, no compute is
   spent on halted segments because none halt, ``ponder_loss`` = 0). At eval ``n_loops`` runs
   exactly that many loops (1 .. max_loops).
   ``halting = "act"``: the loop's state is ``y_i = norm(h)`` (an RMSNorm so the output scale does not grow with
   the loop count), ``p_i = sigmoid(halt_predictor(y_i))``. A running segment halts at loop i
   when ``cum + p_i >= 1 - act_epsilon`` or at the last loop; its weight there is the remainder
   ``R = 1 - cum``, before that ``p_i``, after that 0. The core output is ``sum_i w_i y_i`` (fp32
   accumulation). ``ponder_loss`` = Graves' ``N + R`` (N = halting loop, 1-based; the gradient
   flows through R) averaged over real segments. Halted segments keep being updated (later
   segments still attend to them) but their output is frozen, so how long the batch keeps
   looping never changes an already-halted segment's output.
5. ACT, eval only: after a loop in which every existing segment has halted, stop (one host sync
   per loop). ``n_loops`` may go up to ``max_loops`` at eval (test-time compute). Halted segments
   are still computed until the whole batch halts (their output is frozen); that cost is counted
   in ``aux["flops_per_byte"]`` (loops_run), never hidden.

   With ``loop_init_std`` > 0, training starts from a random ``h_0`` (Geiping et al.), keyed per sample.
6. Training with ``backprop_loops = k`` > 0 (truncated backprop, Geiping et al. 2025): loops
   ``0 .. n_loops - k - 1`` run under ``torch.no_grad()``, so the state entering loop ``n_loops - k`` is
   detached and only the last k loops (and ``inject``, which they read) get gradients. The MoE
   balancing loss is then the mean over those k loops (the others have no graph); their expert
   counts still enter ``moe_counts``. ``loop_sampling = "poisson_lognormal"``: the trainer's step
   keys ``sample_loops``, which draws ``n_loops`` for that step on the host.

Why fixed depth by default: with ACT the ponder cost drove the halting unit to stop after about
one loop while training still paid for every loop (docs/experiments.md, "Recurrent depth").

Reported: ``mean_loops`` = mean halting loop N over real segments (the ACT depth the segments
used); ``loops_run`` = loops actually computed (``n_loops`` in training, fewer at eval after an
early exit) — the number that sets the core's FLOPs.

The halting predictor starts with tiny weights (std 0.1/sqrt(dim), so initial logits stay within
about +-0.1 of the bias) and bias ``-log(n_loops - 1)``, i.e. ``p = 1/n_loops``: at init every
training loop is used and the output is close to the uniform average of the loop states.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from spider_titan.models.spider.args import SpiderArgs
from spider_titan.models.spider.attention import MLA, KVCache, PackedRows
from spider_titan.models.spider.engram import Engram
from spider_titan.models.spider.segmentation import keyed_uniform
from spider_titan.moe.layer import MoE

# Keys the loop-count generator (with the step), as in seal-rg/recurrent-pretraining: a fixed
# offset so step 0 is not seed 0.
_LOOP_SEED = 514229
# loop_step_size: g = 1 + LOOP_STEP_SCALE * loop_step, so AdamW moves a step size ten times as fast
# as a weight (at lr 3e-3, the 80 deep steps of an 800-step debug run can take g from 1 to 0).
LOOP_STEP_SCALE = 10.0


def sample_loops(args: SpiderArgs, step: int) -> int:
    """Training loop count of optimizer step ``step``; ``loop_sampling = "tail"``: see its field.
    ``"poisson_lognormal"``: ``1 + Poisson(r)``, ``r ~ LogNormal(log(m) - sigma^2 / 2, sigma)`` with ``m = n_loops - 1`` and
    sigma 1/2 (so E[r] = m and the mean count is ``n_loops``), capped at ``max_loops`` (loop
    embeddings and LoRA adapters exist up to there). A pure function of (args, step), drawn on the
    host: every rank and micro-batch of a step gets the same count with no collective and no sync.
    Geiping et al. draw ``1 + Poisson(r)`` with E[r] = the mean, i.e. one loop more on average;
    here the mean is the configured ``n_loops`` so FLOPs budgets stay comparable with fixed depth."""
    m = args.n_loops - 1
    if m <= 0:
        return 1
    rng = np.random.default_rng([_LOOP_SEED, step])
    if args.loop_sampling == "tail":  # {1, n_loops, deep} with mean n_loops (args.tail_shares)
        deep, p_deep, p_one = args.tail_shares()
        u = rng.random()
        return deep if u < p_deep else 1 if u < p_deep + p_one else args.n_loops
    sigma = 0.5
    rate = rng.lognormal(math.log(m) - sigma**2 / 2, sigma)
    return int(min(1 + rng.poisson(rate), args.max_loops))


def initial_state(keys: torch.Tensor | None, S: int, dim: int, std: float) -> torch.Tensor | None:
    """The random initial state ``h_0`` (B, S, dim) fp32, ``N(0, std^2)`` by Box-Muller from
    ``keyed_uniform``: a pure function of (sample key, segment, channel), so a sample starts from
    the same state on any rank or row. None (h_0 = 0) without keys or with std 0."""
    if keys is None or std <= 0:
        return None
    u = keyed_uniform(keys, 2 * S * dim).view(-1, 2, S, dim)  # (B, 2, S, dim) in (0, 1)
    return std * torch.sqrt(-2.0 * torch.log(u[:, 0])) * torch.cos(2.0 * math.pi * u[:, 1])


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

    def q_delta(self, x: torch.Tensor, loop: torch.Tensor) -> torch.Tensor:
        return (x @ _at(self.wq_a, loop).to(x.dtype)) @ _at(self.wq_b, loop).to(x.dtype)

    def o_delta(self, x: torch.Tensor, loop: torch.Tensor) -> torch.Tensor:
        return (x @ _at(self.wo_a, loop).to(x.dtype)) @ _at(self.wo_b, loop).to(x.dtype)

    def init_weights(self) -> None:
        nn.init.normal_(self.wq_a, std=self.wq_a.shape[1] ** -0.5)
        nn.init.normal_(self.wo_a, std=self.wo_a.shape[1] ** -0.5)
        nn.init.zeros_(self.wq_b)
        nn.init.zeros_(self.wo_b)


class CoreBlock(nn.Module):
    """One weight-shared core block (MLA + per-loop LoRA, optional Engram, MoE).

    ``forward(h (B, S, dim), loop, freqs, bucket_ids (B, S, 2), seg_mask (B, S))
    -> (h, moe_aux_loss (scalar), moe_counts (E,))``; tensors only (``packed`` a tuple of two), so
    activation checkpointing and torch.compile can wrap it as is. ``packed``: h, bucket_ids and
    seg_mask hold one packed row (1, N, ...) and freqs one rotation per segment (module docstring,
    item 3); the attention needs the rows' layout.
    """

    def __init__(self, args: SpiderArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = MLA.from_args(args)
        self.lora = (
            LoopLoRA(
                args.max_loops,
                args.dim,
                args.n_heads * (args.qk_nope_head_dim + args.qk_rope_head_dim),
                args.n_heads * args.v_head_dim,
                args.lora_rank,
            )
            if args.loop_lora
            else None
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
        bucket_ids: torch.Tensor,
        seg_mask: torch.Tensor,
        cache: KVCache | None = None,
        packed: PackedRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lora = self.lora
        h = h + self.attention(
            self.attention_norm(h),
            freqs,
            q_adapter=None if lora is None else (lambda x: lora.q_delta(x, loop)),
            o_adapter=None if lora is None else (lambda x: lora.o_delta(x, loop)),
            cache=cache,
            packed=packed,
        )
        if self.engram is not None:
            h = h + self.engram(h, bucket_ids)
        y, stats = self.moe(self.moe_norm(h), token_mask=seg_mask)
        return h + y, stats.aux_loss, stats.counts

    def init_weights(self, init_std: float, out_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.attention.init_weights(init_std, out_std)
        if self.lora is not None:
            self.lora.init_weights()
        if self.engram is not None:
            self.engram.init_weights(init_std, out_std)
        self.moe_norm.reset_parameters()
        self.moe.init_weights(init_std, out_std)


@dataclass
class HaltingState:
    """Graves' ACT bookkeeping for (B, S) segments, all fp32 (bool for ``halted``).

    cum:       halting probability spent by running segments (sum of p over their earlier loops)
    halted:    the segment has halted
    n_used:    N, the loop (1-based) at which it halted (0 while running)
    remainder: R = 1 - cum at the halting loop (carries the ponder gradient)
    """

    cum: torch.Tensor
    halted: torch.Tensor
    n_used: torch.Tensor
    remainder: torch.Tensor

    @classmethod
    def start(cls, B: int, S: int, device: torch.device) -> HaltingState:
        z = torch.zeros(B, S, dtype=torch.float32, device=device)
        return cls(cum=z, halted=torch.zeros(B, S, dtype=torch.bool, device=device), n_used=z, remainder=z)

    def step(self, p: torch.Tensor, loop: int, *, last: bool, epsilon: float) -> torch.Tensor:
        """Advance by loop ``loop`` (0-based) with halting probabilities ``p (B, S)``; returns the
        loop's output weights: ``p`` while running, the remainder ``1 - cum`` on the halting loop
        (when ``cum + p >= 1 - epsilon``, or the last loop), 0 after."""
        running = ~self.halted
        halt_now = running if last else running & (self.cum + p >= 1.0 - epsilon)
        zero = torch.zeros_like(p)
        w = torch.where(halt_now, 1.0 - self.cum, torch.where(running, p, zero))
        self.remainder = torch.where(halt_now, 1.0 - self.cum, self.remainder)
        self.n_used = torch.where(halt_now, torch.full_like(p, loop + 1), self.n_used)
        self.cum = self.cum + torch.where(running & ~halt_now, p, zero)
        self.halted = self.halted | halt_now
        return w


@dataclass
class CoreOutput:
    """What the recurrent core hands back to the model.

    output:       (B, S, dim) halting-weighted sum of the per-loop states (model dtype)
    moe_aux_loss: scalar fp32, mean over (block, loop) calls of E * sum f_i P_i
    moe_counts:   (E,) fp32 routed slots per expert, summed over blocks and loops (detached)
    ponder_loss:  scalar fp32, Graves' N + R averaged over real segments
    mean_loops:   scalar fp32, mean halting loop N over real segments (detached)
    loops_run:    loops actually computed (host int)
    backprop_loops: of those, the loops with a graph (host int; ``loops_run`` outside truncated training)
    """

    output: torch.Tensor
    moe_aux_loss: torch.Tensor
    moe_counts: torch.Tensor
    ponder_loss: torch.Tensor
    mean_loops: torch.Tensor
    loops_run: int
    backprop_loops: int


class RecurrentCore(nn.Module):
    """The looped core stack with LTI input injection, loop embeddings and ACT (module docstring)."""

    def __init__(self, args: SpiderArgs):
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList(CoreBlock(args, j) for j in range(args.n_core))
        self.inject = nn.Linear(args.byte_width, args.dim, bias=False)  # also the byte_dim -> dim projection
        self.decay_lambda = nn.Parameter(torch.empty(args.dim))
        self.loop_embedding = nn.Embedding(args.max_loops, args.dim) if args.loop_embedding else None
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.state_norm = nn.RMSNorm(args.dim, eps=args.norm_eps) if args.loop_state_norm else None
        self.loop_step = nn.Parameter(torch.empty(args.max_loops)) if args.loop_step_size else None
        # Eval-time gains of the loops past n_loops, set by the end-of-run calibration: a buffer, so it
        # is saved and exported with the weights, replicated (never sharded) and never trained.
        if args.extra_loop_gains:
            self.register_buffer("extra_loop_gain", torch.empty(args.max_loops))
        else:
            self.extra_loop_gain = None
        self.halt_predictor = nn.Linear(args.dim, 1) if args.halting == "act" else None
        # ACT's ponder loss is a mean over the real segments of the global micro-batch when a
        # differentiable sum over the data-parallel ranks is installed here (as for the MoE
        # statistics, parallel/parallelize.py), so it does not depend on how the batch is split.
        self.reduce_stats: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(
        self,
        s: torch.Tensor,
        *,
        n_loops: int,
        freqs: torch.Tensor,
        bucket_ids: torch.Tensor,
        seg_real: torch.Tensor,
        seg_valid: torch.Tensor,
        early_exit: bool,
        backprop_loops: int = 0,
        init_keys: torch.Tensor | None = None,
        caches: list[list[KVCache]] | None = None,
        packed: PackedRows | None = None,
    ) -> CoreOutput:
        """``backprop_loops`` k > 0 (applied only while autograd records): loops before the last k run
        under no_grad (truncated backprop, module docstring item 6). ``init_keys`` (B,) int64: with
        ``loop_init_std`` > 0, the keys of the random initial state (``initial_state``). ``packed``
        (``seg_valid``'s slots): the loops run on the real segments only (module docstring, item 3)."""
        B, S, _ = s.shape
        h0 = initial_state(init_keys, S, self.args.dim, self.args.loop_init_std)  # keyed by (row, segment)
        if packed is not None:  # (B, S, ...) -> (1, N, ...) once for every loop and block
            s, bucket_ids, seg_real, seg_valid = (packed.pack(t) for t in (s, bucket_ids, seg_real, seg_valid))
            freqs = freqs.index_select(0, packed.index % S).unsqueeze(0)  # (1, N, rope/2, 2): index in its row
            h0 = None if h0 is None else packed.pack(h0)
            B, S = 1, s.shape[1]
        truncate = backprop_loops > 0 and torch.is_grad_enabled()
        first_grad_loop = max(n_loops - backprop_loops, 0) if truncate else 0
        injected = self.inject(s)  # (B, S, dim), the same every loop
        decay = torch.exp(-F.softplus(self.decay_lambda.float())).to(s.dtype)  # (dim,) in (0, 1)
        loop_emb = None if self.loop_embedding is None else self.loop_embedding.weight

        act = HaltingState.start(B, S, s.device)
        out = s.new_zeros(B, S, self.args.dim, dtype=torch.float32)
        aux_sum = s.new_zeros((), dtype=torch.float32)
        counts = s.new_zeros(self.args.n_experts, dtype=torch.float32)

        loops_run = 0
        h0 = None if h0 is None else h0.to(s.dtype)
        steps = None if self.loop_step is None else self.step_sizes()  # (max_loops,) fp32
        gains = self.extra_loop_gain if not self.training and self.halt_predictor is None else None
        h = injected  # loop 0 (h_0 = 0): decay * h_0 + inject(s)
        for i in range(n_loops):
            with torch.set_grad_enabled(torch.is_grad_enabled() and i >= first_grad_loop):
                before = h if i > 0 else h0  # the state loop i receives (None: zero)
                if i > 0:
                    h = decay * h + injected
                elif h0 is not None:
                    h = decay * h0 + injected
                if loop_emb is not None:
                    h = h + loop_emb[i].to(h.dtype)
                # For torch.compile'd blocks (no-ops otherwise): the loop index goes in as a tensor and
                # the segment count S as a symbol, so one graph serves every loop and every batch
                # instead of a recompile per loop index and per new S.
                loop = torch.full((), i, dtype=torch.int64, device=s.device)
                for t, dim in ((h, 1), (freqs, freqs.dim() - 3), (bucket_ids, 1), (seg_real, 1)):
                    torch._dynamo.maybe_mark_dynamic(t, dim)
                if packed is not None:
                    torch._dynamo.maybe_mark_dynamic(packed.index, 0)
                    torch._dynamo.maybe_mark_dynamic(packed.valid, 1)
                for j, block in enumerate(self.layers):
                    if caches is None:
                        h, aux, cnt = block(h, loop, freqs, bucket_ids, seg_real, packed=packed)
                    else:  # incremental decoding (decode.py): loop i's keys and values of block j
                        h, aux, cnt = block(h, loop, freqs, bucket_ids, seg_real, caches[i][j])
                    if i >= first_grad_loop:  # the balancing loss over the loops that carry a graph
                        aux_sum = aux_sum + aux
                    counts = counts + cnt
                if steps is not None:  # h + g_i (F_i(h) - h); from h_0 = 0: g_i F_i(0)
                    g = steps[i].to(h.dtype)
                    h = g * h if before is None else before + g * (h - before)
                if self.state_norm is not None:
                    h = self.state_norm(h)
                if gains is not None and i >= self.args.n_loops:  # test-time depth: how far loop i moves
                    h = before + gains[i].to(h.dtype) * (h - before)
            loops_run += 1

            if self.halt_predictor is None:
                continue
            y = self.norm(h)
            p = torch.sigmoid(self.halt_predictor(y).squeeze(-1).float())  # (B, S)
            w = act.step(p, i, last=i == n_loops - 1, epsilon=self.args.act_epsilon)
            out = out + w.unsqueeze(-1) * y.float()
            if early_exit and i < n_loops - 1 and bool((act.halted | ~seg_valid).all()):
                break

        grad_loops = loops_run - min(first_grad_loop, loops_run)
        moe_aux_loss = aux_sum / (max(grad_loops, 1) * len(self.layers))
        rows = (lambda t: t) if packed is None else packed.pad  # the output as (B, S) rows again
        if self.halt_predictor is None:  # fixed depth: every segment used every loop
            zero = s.new_zeros((), dtype=torch.float32)
            return CoreOutput(
                output=rows(self.norm(h)),
                moe_aux_loss=moe_aux_loss,
                moe_counts=counts,
                ponder_loss=zero,
                mean_loops=zero + float(loops_run),
                loops_run=loops_run,
                backprop_loops=grad_loops,
            )
        real = seg_real.float()
        sums = torch.stack([((act.n_used + act.remainder) * real).sum(), (act.n_used * real).sum(), real.sum()])
        if self.training and self.reduce_stats is not None:
            sums = self.reduce_stats(sums)  # over the data-parallel ranks
        n_real = sums[2].clamp(min=1.0)
        return CoreOutput(
            output=rows(out.to(s.dtype)),
            moe_aux_loss=moe_aux_loss,
            moe_counts=counts,
            ponder_loss=sums[0] / n_real,
            mean_loops=(sums[1] / n_real).detach(),
            loops_run=loops_run,
            backprop_loops=grad_loops,
        )

    def step_sizes(self) -> torch.Tensor:
        """``g`` (max_loops,) of ``loop_step_size``: ``1 + LOOP_STEP_SCALE * loop_step``."""
        return 1.0 + LOOP_STEP_SCALE * self.loop_step.float()

    def init_weights(self, init_std: float, out_std: float) -> None:
        for block in self.layers:
            block.init_weights(init_std, out_std)
        nn.init.trunc_normal_(self.inject.weight, std=init_std)
        nn.init.zeros_(self.decay_lambda)  # a = exp(-softplus(0)) = 1/2
        if self.loop_embedding is not None:
            nn.init.zeros_(self.loop_embedding.weight)
        self.norm.reset_parameters()
        if self.state_norm is not None:
            self.state_norm.reset_parameters()
        if self.loop_step is not None:
            nn.init.zeros_(self.loop_step)
        if self.extra_loop_gain is not None:
            nn.init.ones_(self.extra_loop_gain)
        if self.halt_predictor is not None:
            nn.init.normal_(self.halt_predictor.weight, std=0.1 / math.sqrt(self.args.dim))
            n = self.args.n_loops
            nn.init.constant_(self.halt_predictor.bias, -math.log(n - 1) if n > 1 else 0.0)
