"""Hyper-parameters of the Spider model and its flavors (docs/model.md, "Flavors").

Every field can be overridden from the ``[model]`` table of a TOML file or with
``--model.<field> value``; ``validate()`` lists every inconsistency at once so the config
loader can report them together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class SpiderArgs:
    # ---- width and attention (MLA, DeepSeek-V2)
    dim: int = 128
    """Model width (bytes, segments and the recurrent state all live in this width)."""
    n_heads: int = 4
    """Attention heads of every MLA layer."""
    kv_lora_rank: int = 32
    """MLA: width of the compressed key/value latent (``wkv_a`` output, before the rope part)."""
    qk_nope_head_dim: int = 32
    """MLA: per-head query/key width without rotary embedding."""
    qk_rope_head_dim: int = 16
    """MLA: per-head query/key width with rotary embedding (the key's rope part is shared by all heads)."""
    v_head_dim: int = 32
    """MLA: per-head value width."""

    byte_dim: int = 0
    """Width of the byte-level parts (``embed_tokens``, ``prelude``, ``boundary_predictor``, ``coda``,
    ``norm``, ``lm_head``); 0 means ``dim``. Narrower than ``dim`` (H-Net's narrow outer stages), the
    core's ``inject`` projects the pooled segments up (byte_dim -> dim) and ``up_proj`` projects the
    core output down (dim -> byte_dim), so the FLOPs per byte move into the core; at ``dim`` the model
    is the plain one, tensor for tensor (old checkpoints load)."""
    byte_mlp: bool = True
    """SwiGLU MLPs (``inter_dim``) in the byte blocks; false: attention-only byte blocks."""

    # ---- depth
    n_prelude: int = 1
    """Dense byte blocks before the boundary predictor (``prelude.layers``)."""
    n_core: int = 2
    """MoE blocks in the weight-shared recurrent core (``core.layers``), run once per loop."""
    n_coda: int = 1
    """Dense byte blocks after the upsample (``coda.layers``)."""
    inter_dim: int = 256
    """SwiGLU hidden width of the dense byte blocks."""

    # ---- MoE (core blocks)
    n_experts: int = 8
    """Routed experts per core block."""
    top_k: int = 2
    """Experts each segment is routed to."""
    moe_inter_dim: int = 64
    """SwiGLU hidden width of one expert (a multiple of 8 for torch._grouped_mm)."""

    # ---- Engram (hashed n-gram memory in the core)
    engram_layers: list[int] = field(default_factory=lambda: [1])
    """Indices of the core blocks (0-based) that carry an Engram between attention and MoE."""
    engram_buckets: int = 1024
    """Rows of each Engram lookup table (order-1 and order-2 tables alike)."""
    engram_dim: int = 32
    """Width of each Engram table row; the two lookups are concatenated (2 * engram_dim)."""

    # ---- recurrence
    n_loops: int = 2
    """Core loops in training (and at eval unless the caller passes ``n_loops``)."""
    max_loops: int = 4
    """Most loops the model supports (loop embeddings and per-loop LoRA adapters exist for each)."""
    lora_rank: int = 4
    """Rank of the per-loop LoRA adapters on the core blocks' ``wq`` and ``wo``."""
    act_epsilon: float = 0.01
    """ACT: a segment halts once its cumulative halting probability reaches 1 - act_epsilon."""
    halting: Literal["none", "act"] = "none"
    """How the core's loops are combined. ``none``: every segment runs all loops and the core
    output is the last loop's state (fixed depth; ``mean_loops`` = loops run). ``act``: Graves'
    adaptive halting (halting-weighted sum of the loop states, ponder loss, early exit at eval).
    ``act`` collapsed to ~1 loop in training, so ``none`` is the default (docs/experiments.md)."""
    loop_sampling: Literal["fixed", "poisson_lognormal", "tail"] = "fixed"
    """Core loops per training step. ``fixed``: ``n_loops`` every step. ``poisson_lognormal``
    (Geiping et al. 2025): ``1 + Poisson(r)``, r log-normal (sigma 1/2) with mean ``n_loops - 1``,
    so the mean is ``n_loops`` (slightly less after the cap at ``max_loops``). ``tail``: a share
    ``loop_tail`` of the steps runs ``deep = min(2 * n_loops, max_loops)`` loops, a share
    ``loop_tail * (deep - n_loops) / (n_loops - 1)`` one loop (so the mean is exactly ``n_loops``),
    the rest ``n_loops``: the count that eval at 2x the mean runs is trained. Drawn on the host
    from a generator keyed by the optimizer step, so every rank and micro-batch of a step runs the
    same count without a collective (recurrence.sample_loops). Eval runs ``n_loops`` unless asked."""
    loop_tail: float = 0.1
    """``loop_sampling = "tail"``: the share of training steps run at ``min(2 * n_loops, max_loops)`` loops."""
    backprop_loops: int = 0
    """Truncated backprop: in training only the last ``backprop_loops`` loops keep a graph; the
    earlier ones run under no_grad and hand on a detached state (Geiping et al.: k = 8 of 32).
    0: every loop (full backprop)."""
    loop_init_std: float = 0.0
    """Training only: the core starts from ``h_0 ~ N(0, loop_init_std^2)`` instead of 0 (Geiping et al.
    2025's random initial state, so the loops learn to converge from any state), the noise keyed by
    the sample's global index (the same whatever rank or row; without ``sample_ids``, h_0 = 0).
    Eval starts from 0. 0: off."""
    loop_lora: bool = True
    """Per-loop LoRA adapters on the core blocks' ``wq``/``wo`` (false: the loops share their
    weights exactly; an ablation)."""
    loop_embedding: bool = True
    """A learned vector added to the state at the start of each loop (one per loop index). False:
    none, so with ``loop_lora = false`` every loop applies the same map to the state (time-invariant,
    as in Geiping et al. 2025): a loop past the trained ones is the map the model was trained to
    iterate, not one with untrained loop-specific parameters."""
    loop_step_size: bool = False
    """A learned step size per loop: loop i hands on ``h + g_i (F_i(h) - h)`` instead of ``F_i(h)``
    (``h`` the state it received, ``F_i`` the loop as without this option), ``g_i = 1 + 10 * core.loop_step[i]``
    with ``loop_step`` zero-initialised, so the model starts as without it. With sampled loop counts
    the loops past the mean learn how far to move the state (0: not at all). False: no parameter."""
    extra_loop_gains: bool = True
    """A gain per loop index past ``n_loops`` (buffer ``core.extra_loop_gain``, ones at init), used at
    eval only: loop i >= n_loops hands on ``h + gain_i (F_i(h) - h)`` (``h`` the state it received,
    ``F_i(h)`` what the loop makes of it), so gain 0 makes it hand on its input unchanged and 1 is the
    plain loop. The end-of-run calibration (``[calibration]``, models/spider/calibration.py) fits each
    gain on fresh training batches, so that evaluating at more loops than trained (test-time depth)
    is no worse than at ``n_loops`` and better where a damped loop helps. ``halting = "act"`` ignores
    them. False: no buffer (models saved before the field existed)."""
    loop_state_norm: bool = False
    """RMS-normalise the core state at the end of every loop (one RMSNorm shared by the loops), so
    the state a loop hands on has the same scale at any depth, as the sandwich-normed recurrent
    block of Geiping et al. 2025 keeps it. False: the residual stream carries over unnormalised."""

    # ---- segmentation (segmentation.py)
    target_bytes_per_segment: float = 4.0
    """Compression the boundary loss aims at (bytes per segment)."""
    max_segment_bytes: int = 16
    """A boundary is forced whenever a segment would grow past this many bytes."""
    boundary_predictor: Literal["cosine", "mlp", "fixed", "space"] = "cosine"
    """``cosine``: H-Net routing, p_t = (1 - cos(q_t, k_{t-1})) / 2 of projected adjacent prelude
    states; ``mlp``: FlexiTokens' Linear-GELU-Linear logit; ``fixed``: no predictor, a boundary
    every round(target_bytes_per_segment) bytes (an ablation; measured best with ``chunk_convention =
    "mean"``, which the default ``first`` is not); ``space``: no predictor, SpaceByte's
    rule, a segment ends at a space or punctuation byte that follows a letter, digit or non-ASCII
    byte (still cut at ``max_segment_bytes``; a baseline)."""
    boundary_dim: int = 0
    """Width of the boundary predictor's projections (``cosine``: ``q_proj`` and ``k_proj``, byte width ->
    boundary_dim; ``mlp``: its hidden layer); 0 means the byte width (H-Net's routing module, square and
    identity-initialised). Narrower, both start as the identity's first rows (``q_t`` and ``k_t`` the same
    first coordinates of the prelude state, as the identity makes them the same state), and the
    predictor's share of the FLOPs per byte (5 % of debug's and ``small``'s at full width) shrinks in
    proportion: compute that fixed segments never spend. The debug and ``small`` flavors use 32."""
    boundary_loss: Literal["ratio", "hinge"] = "ratio"
    """``ratio``: H-Net's two-sided ratio loss, minimal at the target compression; ``hinge``:
    FlexiTokens' relu(rate - 1/target), which only penalises too many boundaries."""
    boundary_band: float = 0.2
    """Dead zone of the ratio loss (``boundary_loss = "ratio"``; the hinge ignores it), relative to
    ``target_bytes_per_segment``: a row whose bytes per segment lie within ``target * (1 +- band)`` gets
    no gradient from it (the LM gradient alone places its boundaries, with ``boundary_confidence``), a
    row outside is pulled to the band's nearest edge.
    0: the plain ratio loss, pulling to the target from any rate. 0.2 by default since 2026-11-26 (with
    H-Net's path, below): H-Net's ratio weight 0.03 let the LM gradient shrink segments to 2.5 bytes on
    prose at debug, weight 1.0 everywhere held 4 bytes but lost at ``small`` on the built-in corpus; the
    band keeps the freedom inside and stops the drift at its edge (docs/experiments.md, "A dead zone"; the
    pull at each edge: ``boundary_coeff``, ``boundary_band_upper``)."""
    boundary_band_inner: float = 0.0
    """With a dead zone (``boundary_band`` > 0): the weight, relative to ``boundary_coeff``, of the plain
    ratio loss added to it, a weak pull towards the target at every rate (inside the band too), the band's
    edge then a wall. 0: none (0.03 with weight 1.0 measured worse on code at ``small``: 1.942 against
    1.880, one seed; docs/experiments.md, "Shapes of the dead zone's pull")."""
    boundary_band_upper: float = 0.3
    """With a dead zone: the weight of the pull on a row above the band (segments longer than its upper
    edge) relative to a row below it; 1: both edges alike. 0.3 since 2026-11-26 (fifth session; 1 before),
    with ``boundary_coeff`` 1.0: a firm lower edge, where the LM gradient pushes on prose (0.3 on both edges
    let a debug prose run settle at 2.95 bytes per segment, under the band), and above the band the weak
    pull that won on code. Measured at exactly equal FLOPs at debug and ``small`` on both corpora, 3 seeds
    per cell (2 on prose at ``small``): level with 0.3 on both edges (1.961 against 1.968 bpb over the
    cells) and every run inside the band (docs/experiments.md, "A firm lower edge")."""
    boundary_noise: Literal["none", "gumbel"] = "none"
    """``none``: the hard rule p >= 0.5 in training and eval alike (one function); ``gumbel``:
    training hardens a Gumbel-sigmoid sample instead (the pre-2026-11-23 behaviour, which segments
    differently in training and eval)."""
    boundary_standardize: bool = True
    """Standardise the predictor's score per row with running (causal) mean and variance and
    compare it with a learned threshold (segmentation.BoundaryPredictor): holds the boundary rate
    against drifts of the score. False: the raw score's p >= 0.5 (H-Net's rule as published)."""
    boundary_ste: bool = False
    """True: the LM loss also trains the predictor (and, through it, the prelude) by the
    straight-through segment index (segmentation.py). False: the segment index carries no gradient;
    with ``boundary_confidence`` also off the predictor reads the prelude detached and only the boundary
    loss trains it. Off by default: at debug scale it bought no measurable bpb and made the boundary rate
    noisier (docs/experiments.md); the LM gradient reaches the predictor through H-Net's confidence factor
    (``boundary_confidence``, on by default)."""
    boundary_confidence: bool = True
    """H-Net's confidence-weighted straight-through estimator: each byte's upsampled core output is
    multiplied by ``1 + c - c.detach()`` (value 1), c the probability of the boundary choice that
    decided which segment the byte reads (p where a boundary was chosen, 1 - p where not), so the
    LM loss trains the predictor; the predictor then reads the prelude undetached (as with
    ``boundary_ste``) and ``dechunk_smoothing`` passes the LM gradient to it too. On by default since
    2026-11-26, with ``dechunk_smoothing``, ``chunk_convention = "first"`` and ``boundary_band`` (H-Net's
    path: the three work as a set, docs/experiments.md); False with those: the model before."""
    boundary_prelude_grad: bool = True
    """Whether the boundary loss's gradient reaches the prelude through the predictor, when the predictor
    reads the prelude undetached (``boundary_confidence`` or ``boundary_ste``; H-Net's ratio loss does).
    False: the boundary loss trains the predictor only (its probabilities come from a second predictor
    pass on the detached prelude, counted in the FLOPs); the LM gradient still reaches the prelude
    through the predictor. Measured 2026-11-26 (docs/experiments.md, "Why the dead zone loses"): level or
    worse than True at equal FLOPs, so True stays the default."""
    chunk_convention: Literal["mean", "first"] = "first"
    """``mean``: a segment is the mean of its bytes and byte t reads the core output of the segment
    before its own. ``first`` (H-Net): the predictor decides "a chunk starts at t", a chunk is its
    first byte's prelude state and every byte reads its own chunk's output (the Engram of chunk k
    then hashes chunk k - 1's bytes, the last complete ones). Both are causal (tests). ``first`` by default
    since 2026-11-26 (H-Net's path, ``boundary_confidence``); fixed segments do better with ``mean``, learned
    ones worse (0.026 bpb over debug and ``small`` on both corpora at equal FLOPs, 10 of 11 seed pairs;
    docs/experiments.md, "Code at `small`: five seeds")."""
    dechunk_smoothing: bool = True
    """H-Net's dechunk smoothing: before the upsample, the core outputs become an EMA over segments,
    ``out_k = P_k y_k + (1 - P_k) out_{k-1}``, P_k the probability of the boundary that opened
    segment k (1 where it was forced); causal, computed in closed form. On by default since 2026-11-26
    (H-Net's path, ``boundary_confidence``)."""
    stage_init: bool = True
    """H-Net's stage-aware initialisation: residual outputs of the byte blocks scaled by the byte
    stages' own depth (``0.02 / sqrt(2 (n_prelude + n_coda))``), the core's by the whole depth; the
    prelude residual reaches the coda through ``residual_proj``, a zero-initialised dim x dim
    projection (H-Net's fp32 residual), and ``up_proj`` starts at the identity (H-Net's dechunk
    has no projection), so at the start the coda reads only the core's output. On by default since
    2026-11-25: at equal training FLOPs it won 7 of 8 runs (debug and ``small``, built-in corpus and
    prose, two seeds; docs/experiments.md, "Stage-aware init as the default"). False: the model
    before (residual projections by the whole depth, the prelude residual added directly)."""
    boundary_temperature: float = 0.5
    """Temperature of the relaxed-Bernoulli (Gumbel-sigmoid) boundary samples (``boundary_noise = "gumbel"``)."""
    segment_bucket: int = 0
    """Round the batch's segment count S up to a multiple of this (0 or 1: off; never past the
    sequence length), so the core sees a bounded set of shapes: a compiled core then meets a new
    shape only a few times, and cuDNN attention reuses its per-shape graphs. The padding segments
    are masked: outputs, losses and reported figures equal the unbucketed model's. The cost is
    core work on up to bucket - 1 extra segments (1B, seq 4096, ~1000 segments: at most 6 % with
    64; with ``pack_segments`` only the core's attention sees them), so the debug flavor (64-256
    bytes, ~16-64 segments, eager on CPU) leaves it off and the 1B flavor uses 64."""
    pack_segments: bool = True
    """The core's per-segment work (``inject``, projections, LoRA, Engram, MoE) on the batch's real segments
    only, packed into one row; its attention lays them out as (B, S) rows again (attention.PackedRows). False:
    every row is padded to the largest row's segment count S and the padding is computed (and never
    read). Learned segmentation gives rows different counts: padded, the core did 11 % more segment
    slots than segments on the built-in corpus (`small`, 8 rows of 256 bytes; 9 % at 2048 bytes).
    The outputs are the same either way up to rounding; the FLOPs per byte count what runs."""

    # ---- loss weights
    moe_aux_coeff: float = 0.01
    """Weight of the MoE load-balancing loss (mean over core blocks and loops of E * sum f_i P_i)."""
    boundary_coeff: float = 1.0
    """Weight of the boundary loss (``boundary_loss``). With the dead zone (``boundary_band``) it is the pull
    on rows below the band, and ``boundary_band_upper`` times it the pull on rows above. History: 1.0 on
    both edges until 2026-11-26 (it cost 0.057 bpb on the built-in corpus at ``small``: docs/experiments.md,
    "Shapes of the dead zone's pull"), then 0.3 on both edges, then (fifth session) 1.0 below and 0.3 above."""
    ponder_coeff: float = 0.01
    """Weight of the ACT ponder loss (Graves' N + R, mean over real segments)."""

    # ---- misc
    rope_theta: float = 10000.0
    """RoPE base (byte layers rotate by byte position, the core by segment index)."""
    max_seq_len: int = 2048
    """Longest input (in bytes) the model accepts; RoPE tables are computed per call up to T."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    @property
    def byte_width(self) -> int:
        """The byte-level width: ``byte_dim``, or ``dim`` when it is 0."""
        return self.byte_dim or self.dim

    @property
    def boundary_width(self) -> int:
        """The boundary predictor's projection width: ``boundary_dim``, or the byte width when it is 0."""
        return self.boundary_dim or self.byte_width

    def validate(self) -> list[str]:
        """Every inconsistency among the fields, one line each (empty when the args are usable)."""
        out = []
        for name in (
            "dim",
            "n_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "n_core",
            "inter_dim",
            "n_experts",
            "top_k",
            "moe_inter_dim",
            "engram_buckets",
            "engram_dim",
            "n_loops",
            "max_loops",
            "lora_rank",
            "max_segment_bytes",
            "max_seq_len",
        ):
            if getattr(self, name) < 1:
                out.append(f"{name}: {getattr(self, name)} must be >= 1")
        for name in ("n_prelude", "n_coda"):
            if getattr(self, name) < 0:
                out.append(f"{name}: {getattr(self, name)} must be >= 0")
        if self.qk_rope_head_dim % 2:
            out.append(f"qk_rope_head_dim: {self.qk_rope_head_dim} must be even for RoPE")
        if self.n_loops > self.max_loops:
            out.append(f"n_loops: {self.n_loops} > max_loops ({self.max_loops}); raise max_loops or lower n_loops")
        if self.top_k > self.n_experts:
            out.append(f"top_k: {self.top_k} > n_experts ({self.n_experts})")
        if self.dim % 8 or self.moe_inter_dim % 8:
            out.append(
                f"dim ({self.dim}) and moe_inter_dim ({self.moe_inter_dim}) must be multiples of 8 "
                "(grouped GEMM needs 16-byte aligned rows)"
            )
        bad = [j for j in self.engram_layers if not 0 <= j < self.n_core]
        if bad:
            out.append(f"engram_layers: {bad} are not core block indices 0..{self.n_core - 1}")
        if self.target_bytes_per_segment < 1.0:
            out.append(f"target_bytes_per_segment: {self.target_bytes_per_segment} must be >= 1")
        for name, allowed in (
            ("boundary_predictor", ("cosine", "mlp", "fixed", "space")),
            ("chunk_convention", ("mean", "first")),
            ("boundary_loss", ("ratio", "hinge")),
            ("boundary_noise", ("none", "gumbel")),
            ("halting", ("none", "act")),
            ("loop_sampling", ("fixed", "poisson_lognormal", "tail")),
        ):
            if getattr(self, name) not in allowed:
                out.append(f"{name}: {getattr(self, name)!r} is not one of {list(allowed)}")
        if self.boundary_loss == "ratio" and self.target_bytes_per_segment <= 1.0:
            out.append(
                f"target_bytes_per_segment: {self.target_bytes_per_segment} must be > 1 for boundary_loss = 'ratio' "
                "(its N/(N-1) factor); use 'hinge' or a larger target"
            )
        if not 0.0 <= self.boundary_band < 1.0:
            out.append(f"boundary_band: {self.boundary_band} must be in [0, 1) (0: no dead zone)")
        elif self.boundary_loss == "ratio" and self.target_bytes_per_segment * (1.0 - self.boundary_band) <= 1.0:
            out.append(
                f"boundary_band: {self.boundary_band} puts the band's lower edge at "
                f"{self.target_bytes_per_segment * (1.0 - self.boundary_band):g} bytes per segment; the ratio loss "
                "needs it > 1 (a narrower band or a larger target)"
            )
        if self.boundary_band_inner < 0:
            out.append(f"boundary_band_inner: {self.boundary_band_inner} must be >= 0 (0: no pull inside the band)")
        elif self.boundary_band_inner > 0 and not (self.boundary_band > 0 and self.boundary_loss == "ratio"):
            out.append(
                "boundary_band_inner: a pull inside the band needs a band (boundary_band > 0) and boundary_loss = "
                "'ratio'; without one, set boundary_coeff"
            )
        if self.boundary_band_upper < 0:
            out.append(f"boundary_band_upper: {self.boundary_band_upper} must be >= 0 (0: no pull above the band)")
        if self.loop_init_std < 0:
            out.append(f"loop_init_std: {self.loop_init_std} must be >= 0 (0: the core starts from zero)")
        if self.byte_dim < 0:
            out.append(f"byte_dim: {self.byte_dim} must be >= 0 (0: the model width dim)")
        if not 0 <= self.boundary_dim <= self.byte_width:
            out.append(
                f"boundary_dim: {self.boundary_dim} must be in [0, {self.byte_width}] (0: the byte width; a "
                "projection wider than its input adds FLOPs and nothing else)"
            )
        if self.loop_sampling == "tail":
            deep, p_deep, p_one = self.tail_shares()
            if self.n_loops < 2 or deep <= self.n_loops:
                out.append(
                    f"loop_sampling: 'tail' needs n_loops >= 2 and max_loops > n_loops (n_loops {self.n_loops}, "
                    f"max_loops {self.max_loops}): it trains some steps at one loop and some at min(2 * n_loops, max_loops)"
                )
            elif not 0.0 < p_deep + p_one <= 1.0:
                top = (self.n_loops - 1) / (deep - 1)
                out.append(
                    f"loop_tail: {self.loop_tail} must be in (0, {top:.4g}] (the deep and one-loop shares sum to at most 1)"
                )
        if self.backprop_loops < 0:
            out.append(f"backprop_loops: {self.backprop_loops} must be >= 0 (0: backprop through every loop)")
        if self.halting == "act" and (self.loop_sampling != "fixed" or self.backprop_loops):
            out.append(
                "halting: 'act' takes loop_sampling = 'fixed' and backprop_loops = 0 (sampled or truncated "
                "loops train the fixed-depth core); set halting = 'none' or drop those options"
            )
        if self.segment_bucket < 0:
            out.append(f"segment_bucket: {self.segment_bucket} must be >= 0 (0 or 1: no bucketing)")
        if self.boundary_temperature <= 0:
            out.append(f"boundary_temperature: {self.boundary_temperature} must be > 0")
        if not 0.0 <= self.act_epsilon < 1.0:
            out.append(f"act_epsilon: {self.act_epsilon} must be in [0, 1)")
        for name in ("moe_aux_coeff", "boundary_coeff", "ponder_coeff"):
            if getattr(self, name) < 0:
                out.append(f"{name}: {getattr(self, name)} must be >= 0")
        return out

    @property
    def router_grad(self) -> bool:
        """Whether the LM loss trains the boundary predictor (``boundary_ste`` or ``boundary_confidence``):
        the predictor then reads the prelude undetached."""
        return self.boundary_ste or self.boundary_confidence

    def tail_shares(self) -> tuple[int, float, float]:
        """``loop_sampling = "tail"``: (deep count, share of steps at it, share at one loop), the shares
        such that the mean count is ``n_loops`` (needs n_loops >= 2; ``validate`` says so)."""
        deep = min(2 * self.n_loops, self.max_loops)
        return deep, self.loop_tail, self.loop_tail * (deep - self.n_loops) / max(self.n_loops - 1, 1)


# Fields added after checkpoint/export format 1 was fixed, each with the value that rebuilds a model
# saved before the field existed (the behaviour the field's introduction kept as an option), so a
# checkpoint or export that lacks them still loads as the model it is. Fields from before the
# 2026-11-23 segmentation redesign (halting, boundary_predictor, ...) are not here: models saved
# before it cannot be rebuilt by this code, and say so ("missing ...").
SPIDER_ADDED_ARGS: dict[str, object] = {
    "segment_bucket": 0,
    "boundary_confidence": False,
    "chunk_convention": "mean",
    "dechunk_smoothing": False,
    "stage_init": False,
    "loop_sampling": "fixed",
    "backprop_loops": 0,
    "byte_dim": 0,
    "byte_mlp": True,
    "loop_init_std": 0.0,
    "loop_embedding": True,
    "loop_state_norm": False,
    "loop_tail": 0.1,
    "loop_step_size": False,
    "extra_loop_gains": False,
    "boundary_band": 0.0,
    "boundary_prelude_grad": True,
    "boundary_band_inner": 0.0,
    "boundary_band_upper": 1.0,
    "boundary_dim": 0,
    "pack_segments": False,
}

SPIDER_FLAVORS: dict[str, SpiderArgs] = {
    # ~1.0 M parameters: for CPU tests and the debug config. boundary_dim 32 (since 2026-11-26; the
    # byte width before): measured at equal FLOPs on both corpora at debug and small
    # (docs/experiments.md, "Learned segmentation's compute overhead"); 1B keeps H-Net's square
    # projections, where they are a smaller share of its FLOPs and the narrow one is unmeasured.
    "debug": SpiderArgs(boundary_dim=32),
    # ~4x debug's training FLOPs per byte (4.1x at seq 256; 4.7 M parameters): the second scale of the
    # quality study (docs/benchmarks.md), every width doubled, the structure of debug kept.
    "small": SpiderArgs(
        boundary_dim=32,
        dim=256,
        kv_lora_rank=64,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        inter_dim=704,
        moe_inter_dim=160,
        engram_buckets=2048,
        engram_dim=64,
    ),
    # By docs/model.md's layout: 4 dense blocks 193.5 M, 6 core blocks 705.8 M, two Engrams 75.5 M,
    # LoRA 5.3 M, the rest (embeddings, head, boundary predictor, inject, up_proj, ...) 13.7 M
    # = 993.8 M, and stage_init's residual_proj 4.2 M (test_spider_params_flops pins it to 996 M +- 1 %).
    "1B": SpiderArgs(
        dim=2048,
        n_heads=16,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_prelude=2,
        n_core=6,
        n_coda=2,
        inter_dim=5632,
        n_experts=32,
        top_k=2,
        moe_inter_dim=528,
        engram_layers=[1, 4],
        engram_buckets=32768,
        engram_dim=512,
        n_loops=6,
        max_loops=12,
        lora_rank=8,
        max_seq_len=8192,
        segment_bucket=64,
    ),
}
