"""Hyper-parameters of the Spider model and its flavors (docs/model.md, "Flavors").

Every field can be overridden from the ``[model]`` table of a TOML file or with
``--model.<field> value``. A field's own bounds are declared with ``ranged`` (checked with the config's
sections, shown by ``--help``); ``validate()`` lists the rules between fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from spider_titan.job_config import ranged
from spider_titan.models.common import byte_ngram_problems, hashed_byte_ngrams

# The ratio loss's dead zone, relative to the target (a row within target * (1 +- RATIO_BAND) bytes per
# segment gets no pull), and the weight of its pull on rows above the band (segments too long) relative
# to rows below (segmentation.boundary_loss; lab/DECISIONS.md says why).
RATIO_BAND = 0.2
RATIO_BAND_UPPER = 0.3


@dataclass
class SpiderArgs:
    # ---- width and attention (MLA, DeepSeek-V2)
    dim: int = ranged(128, low=1)
    """Model width (bytes, segments and the recurrent state all live in this width)."""
    n_heads: int = ranged(4, low=1)
    """Attention heads of every MLA layer."""
    kv_lora_rank: int = ranged(32, low=1)
    """MLA: width of the compressed key/value latent (``wkv_a`` output, before the rope part)."""
    qk_nope_head_dim: int = ranged(32, low=1)
    """MLA: per-head query/key width without rotary embedding."""
    qk_rope_head_dim: int = ranged(16, low=1)
    """MLA: per-head query/key width with rotary embedding (the key's rope part is shared by all heads)."""
    v_head_dim: int = ranged(32, low=1)
    """MLA: per-head value width."""

    # ---- depth
    n_prelude: int = ranged(1, low=0)
    """Dense byte blocks before the boundary predictor (``prelude.layers``)."""
    n_core: int = ranged(2, low=1)
    """MoE blocks in the weight-shared recurrent core (``core.layers``), run once per loop."""
    n_coda: int = ranged(1, low=0)
    """Dense byte blocks after the upsample (``coda.layers``)."""
    inter_dim: int = ranged(256, low=1)
    """SwiGLU hidden width of the dense byte blocks."""

    # ---- MoE (core blocks)
    n_experts: int = ranged(8, low=1)
    """Routed experts per core block."""
    top_k: int = ranged(2, low=1)
    """Experts each segment is routed to."""
    moe_inter_dim: int = ranged(64, low=1)
    """SwiGLU hidden width of one expert (a multiple of 8 for torch._grouped_mm)."""

    # ---- Engram (hashed n-gram memory in the core)
    engram_layers: list[int] = field(default_factory=lambda: [1])
    """Indices of the core blocks (0-based) that carry an Engram between attention and MoE."""
    engram_buckets: int = ranged(1024, low=1)
    """Rows of each Engram lookup table (order-1 and order-2 tables alike)."""
    engram_dim: int = ranged(32, low=1)
    """Width of each Engram table row; the two lookups are concatenated (2 * engram_dim)."""

    # ---- byte n-grams (hashed embeddings at the input, models.common.ByteNgrams)
    byte_ngram_orders: list[int] = field(default_factory=list)
    """n-gram lengths (each >= 2) whose hashed embedding tables add to each byte's embedding (BLT); empty: none."""
    byte_ngram_buckets: int = ranged(8192, low=1)
    """Rows of each byte n-gram table (one table of ``dim`` columns per order)."""
    byte_ngram_lr: float = ranged(8.0, low=0, low_open=True)
    """The n-gram tables' learning rate over the optimizer's (times any ``optimizer.lr_multipliers`` factor);
    a row trains only in the steps whose bytes hit it (lab/DECISIONS.md, ``byte_ngram_lr``)."""

    # ---- recurrence
    n_loops: int = ranged(2, low=1)
    """Core loops in training (and at eval unless the caller passes ``n_loops``)."""
    max_loops: int = ranged(4, low=1)
    """Most loops the model supports (loop embeddings, LoRA adapters and eval gains exist for each)."""
    lora_rank: int = ranged(4, low=1)
    """Rank of the per-loop LoRA adapters on the core blocks' ``wq`` and ``wo``."""

    # ---- segmentation (segmentation.py)
    target_bytes_per_segment: float = ranged(4.0, low=1, low_open=True)
    """Compression the boundary loss aims at (bytes per segment)."""
    max_segment_bytes: int = ranged(16, low=1)
    """A boundary is forced whenever a segment would grow past this many bytes."""
    boundary_predictor: Literal["cosine", "fixed"] = "cosine"
    """``cosine``: H-Net's learned routing on the prelude states; ``fixed``: no predictor, a boundary
    every round(target_bytes_per_segment) bytes (a baseline, best with ``chunk_convention = "mean"``)."""
    boundary_dim: int = ranged(0, low=0)
    """Width of the boundary predictor's query and key projections (0: ``dim``, H-Net's square module)."""
    chunk_convention: Literal["mean", "first"] = "first"
    """``first`` (H-Net): a chunk is its first byte's state and its bytes read its own output; ``mean``:
    a segment is the mean of its bytes and byte t reads the segment before its own."""
    segment_bucket: int = ranged(0, low=0)
    """Round the batch's segment count up to a multiple of this (0 or 1: off), so the core meets few
    shapes; the padding segments are masked and change no output."""
    segment_capacity: float = ranged(0.0, low=0)
    """> 0: static shapes, no host sync: every row has ``ceil(segment_capacity * T / target_bytes_per_segment)``
    segment slots and the core runs on them all; a row's segments past them are dropped (its bytes there
    read no core output; ``aux.segments_dropped``). 0: the core runs on the batch's counted segments."""
    packed_capacity: float = ranged(0.0, low=0)
    """> 0, with ``segment_capacity``: the core's projections and experts run on the batch's segments packed
    into ``ceil(packed_capacity * B * T / target_bytes_per_segment)`` positions (a static shape, sized by
    the batch rather than by its densest row); segments past them are dropped from the batch's end."""

    # ---- loss weights
    moe_aux_coeff: float = ranged(0.01, low=0)
    """Weight of the MoE load-balancing loss (mean over core blocks and loops of E * sum f_i P_i)."""
    boundary_coeff: float = ranged(1.0, low=0)
    """Weight of the boundary (ratio) loss; with a band, the pull on rows below it."""

    # ---- misc
    rope_theta: float = ranged(10000.0, low=0, low_open=True)
    """RoPE base (byte layers rotate by byte position, the core by segment index)."""
    max_seq_len: int = ranged(2048, low=1)
    """Longest input (in bytes) the model accepts; RoPE tables are computed per call up to T."""
    norm_eps: float = ranged(1e-5, low=0, low_open=True)
    """RMSNorm epsilon."""

    @property
    def boundary_width(self) -> int:
        """The boundary predictor's projection width: ``boundary_dim``, or ``dim`` when it is 0."""
        return self.boundary_dim or self.dim

    @property
    def learned_segments(self) -> bool:
        """Whether a learned predictor places the boundaries (H-Net's smoothing and confidence apply)."""
        return self.boundary_predictor != "fixed"

    def validate(self) -> list[str]:
        """The rules between fields, one line each (the fields' own bounds are declared with ``ranged``)."""
        out = []
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
        out += byte_ngram_problems(self.byte_ngram_orders)
        bad = [j for j in self.engram_layers if not 0 <= j < self.n_core]
        if bad:
            out.append(f"engram_layers: {bad} are not core block indices 0..{self.n_core - 1}")
        if self.target_bytes_per_segment * (1.0 - RATIO_BAND) <= 1.0:
            out.append(
                f"target_bytes_per_segment: {self.target_bytes_per_segment:g} puts the ratio loss's band (target "
                f"+- {RATIO_BAND:.0%}) below {self.target_bytes_per_segment * (1.0 - RATIO_BAND):g} bytes per "
                f"segment; it needs the lower edge > 1 (a target above {1.0 / (1.0 - RATIO_BAND):g})"
            )
        if self.boundary_dim > self.dim:
            out.append(
                f"boundary_dim: {self.boundary_dim} must be at most dim ({self.dim}); a projection wider than its "
                "input adds FLOPs and nothing else"
            )
        if self.packed_capacity and not self.segment_capacity:
            out.append("packed_capacity: packs the slots of segment_capacity, which is 0 (set both, or neither)")
        return out


# Fields added after checkpoint/export format 1 was fixed, each with the value that rebuilds a model
# saved before the field existed, so a checkpoint or export that lacks them still loads as the model
# it is (SavedArgs.added).
SPIDER_ADDED_ARGS: dict[str, object] = {
    "segment_bucket": 0,
    "chunk_convention": "mean",
    "boundary_dim": 0,
    "segment_capacity": 0.0,
    "packed_capacity": 0.0,
    "byte_ngram_orders": [],
    "byte_ngram_buckets": 8192,
    "byte_ngram_lr": 1.0,
}

# Fields that left the model (SavedArgs.retired): the saved value at which the remaining code
# computes what the field computed (None: any value, the field had no effect on its own), and the last
# release or commit that had it; lab/DECISIONS.md says why each left.
_LAST = "commit e0e7ffe"
_RELEASE = "release v0.1.0"
SPIDER_RETIRED_ARGS: dict[str, tuple[object, str]] = {
    "byte_dim": (0, _LAST),
    "byte_mlp": (True, _LAST),
    "halting": ("none", _LAST),
    "act_epsilon": (None, _LAST),
    "ponder_coeff": (None, _LAST),
    "boundary_loss": ("ratio", _LAST),
    "boundary_noise": ("none", _LAST),
    "boundary_temperature": (None, _LAST),
    "boundary_band_inner": (0.0, _LAST),
    "boundary_standardize": (True, _LAST),
    "boundary_ste": (False, _LAST),
    "boundary_confidence": (True, _LAST),
    "boundary_prelude_grad": (True, _LAST),
    "dechunk_smoothing": (True, _LAST),
    "stage_init": (True, _LAST),
    "extra_loop_gains": (True, _LAST),
    "loop_state_norm": (False, _LAST),
    "pack_segments": (None, _LAST),  # packed or padded, the same outputs
    # per-segment depth (a router choosing which segments run each loop after the first)
    "depth_capacity": ([], _RELEASE),
    "depth_scale_range": (None, _RELEASE),  # it scaled depth_capacity's shares, and did nothing without them
    # the loop-count studies: sampled counts, truncated backprop, a random initial state, learned step sizes
    "loop_sampling": ("fixed", _RELEASE),
    "loop_tail": (None, _RELEASE),  # the deep share of loop_sampling = "tail"
    "backprop_loops": (0, _RELEASE),
    "loop_init_std": (0.0, _RELEASE),
    "loop_step_size": (False, _RELEASE),
    # the loops' own parameters could be switched off (ablations): every loop has them
    "loop_lora": (True, _RELEASE),
    "loop_embedding": (True, _RELEASE),
    # the ratio loss's dead zone, now RATIO_BAND / RATIO_BAND_UPPER
    "boundary_band": (0.2, _RELEASE),
    "boundary_band_upper": (0.3, _RELEASE),
}

SPIDER_FLAVORS: dict[str, SpiderArgs] = {
    # ~2.6 M parameters, 1.6 M of them byte n-gram tables: for CPU tests and the debug config. A narrow boundary
    # predictor (lab/DECISIONS.md, ``boundary_dim``); 1B keeps H-Net's square
    # projections. One core loop (-0.025, four paired runs at equal FLOPs; ``n_loops``).
    # Hashed byte n-grams of lengths 3-8, 2,048 buckets each (-0.354, four paired runs;
    # ``byte_ngram_orders``).
    "debug": SpiderArgs(boundary_dim=32, n_loops=1, **hashed_byte_ngrams(2048)),
    # 3.5x the two-loop debug's training FLOPs per byte (4.0x at 4 bytes per segment and 2 loops; seq 256; 54.6 M
    # parameters, 50.3 M of them byte n-gram tables): the second scale of the quality study (docs/benchmarks.md),
    # every width doubled, the structure of debug kept, except no Engram (level on the corpus it trains on, ahead
    # on text it never saw; lab/DECISIONS.md, ``engram_layers``), hashed byte n-grams of lengths 3-8
    # (``hashed_byte_ngrams``; ``byte_ngram_buckets``), their tables trained at 8x the learning rate
    # (``byte_ngram_lr``), 6 bytes per segment (-0.013, four paired runs;
    # ``target_bytes_per_segment``) and one core loop (-0.015, four paired runs at equal FLOPs; ``n_loops``).
    # Fixed 6-byte segments with mean chunks, no learned boundaries (-0.010 over six paired runs on three corpora,
    # ahead on text it never trained on; ``boundary_predictor``); ``boundary_dim`` is the learned
    # predictor's width where a run asks for one (``--model.boundary_predictor cosine``).
    "small": SpiderArgs(
        boundary_predictor="fixed",
        chunk_convention="mean",
        boundary_dim=32,
        dim=256,
        kv_lora_rank=64,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        inter_dim=704,
        moe_inter_dim=160,
        engram_layers=[],
        target_bytes_per_segment=6.0,
        n_loops=1,
        **hashed_byte_ngrams(32768),
    ),
    # The third scale of the quality study (issue 74; docs/model.md, "Flavors"), between `small` and 1B: every
    # width of `small` doubled again (dim 512, head dims 128 / 64 / 128, inters 1408 and 320) and 1B's structure
    # and choices where they matter: 2 / 6 / 2 blocks, 32 experts top-2, Engrams in core blocks 1 and 4 (their
    # rows dim / 4 wide, as 1B's), learned boundaries at 4 bytes per segment, 6 loops of 12, LoRA rank 8; the
    # byte n-grams of `small` (its dense partner reads the same). 15.5x `small`'s training FLOPs per byte at
    # seq 256 (1.86e8 against 1.20e7), 0.08x 1B's; 232.4 M parameters (100.7 M of them n-gram tables).
    "medium": SpiderArgs(
        dim=512,
        kv_lora_rank=128,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_prelude=2,
        n_core=6,
        n_coda=2,
        inter_dim=1408,
        n_experts=32,
        top_k=2,
        moe_inter_dim=320,
        engram_layers=[1, 4],
        engram_buckets=32768,
        engram_dim=128,
        boundary_dim=64,
        n_loops=6,
        max_loops=12,
        lora_rank=8,
        segment_bucket=64,
        **hashed_byte_ngrams(32768),
    ),
    # By docs/model.md's layout: 4 dense blocks 193.5 M, 6 core blocks 705.8 M, two Engrams 75.5 M,
    # LoRA 5.3 M, the rest (embeddings, head, boundary predictor, inject, up_proj, ...) 13.7 M
    # = 993.8 M, and residual_proj 4.2 M (test_spider_params_flops pins it to 996 M +- 1 %).
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
