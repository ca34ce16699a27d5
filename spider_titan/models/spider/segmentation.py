"""Learned byte segmentation: boundary predictor, one boundary rule, downsample, causal upsample.

References: H-Net (Hwang, Wang, Gu, arXiv 2507.07955) for the cosine routing, the hard p >= 0.5
rule and the ratio loss; FlexiTokens (arXiv 2507.12720) for the MLP predictor and hinge loss;
Nawrot et al. 2023, "Efficient Transformers with Dynamic Token Pooling", for the pooling, the
straight-through segment index and the causal shift.

Conventions
-----------
* A boundary at byte t means "a segment ends at byte t". ``seg_id[t]`` (the segment holding
  byte t) is the number of boundaries strictly before t, so it never depends on byte t or later.
* Predictor (``BoundaryPredictor``, ``SpiderArgs.boundary_predictor``): a logit per byte,
  ``p_t = sigmoid(logit)``; ``cosine`` (H-Net, default) or ``mlp`` (FlexiTokens), optionally
  causally standardised against a learned threshold (``boundary_standardize``, default on).
* One rule: a boundary where ``p_t >= 0.5``, the same function in training and eval
  (``boundary_noise = "none"``, default). ``boundary_noise = "gumbel"`` keeps the old training
  rule (harden a Gumbel-sigmoid sample ``sigmoid((logit + log u - log(1-u)) / temperature)``,
  eval uses p), which segments differently in training and eval.
* Forced boundaries (the predictor has no say there, so they carry no straight-through gradient):
  - at BOS and EOS (a document's BOS is its own one-byte segment, since the byte before it is an
    EOS or the start; EOS closes the last segment of a document);
  - around PAD runs: at the last byte before a PAD run and at the last PAD of a run, so no
    segment mixes PAD with real bytes. Inside a PAD run the predictor is ignored and the PADs
    are chunked by ``max_segment_bytes`` only (one segment per PAD would multiply the core's
    work on heavily padded rows). Segments made of PAD are "not real": they are left out of the
    MoE statistics, the ponder loss and ``bytes_per_segment``. PAD bytes are otherwise ordinary
    context (no attention mask), so pad on the right.
  - at the last position (every byte belongs to a finished segment);
  - whenever a segment would exceed ``max_segment_bytes``: with all other boundaries fixed, the
    sequential rule "cut when the running length reaches L" cuts exactly at every L-th byte after
    the previous boundary, so it is computed in one pass with a cumulative max.
  A forced boundary at t (like any boundary at t) only moves bytes > t into a new segment, so
  none of this can leak information backwards.
* Straight-through estimator: ``delta_t = soft_t - soft_t.detach()`` (value exactly 0, gradient of
  p, or of the relaxed sample with Gumbel noise) at positions the predictor decided. Following
  Nawrot et al., the exclusive cumulative sum ``c_t`` of ``delta`` stands for the (soft) segment
  index of byte t, and the pooling weights carry ``1 + c_t`` (value exactly 1) at byte t, so
  gradients reach the predictor through both the downsample and the upsample while the forward
  pass is exactly hard.
* Objective (``boundary_loss``): H-Net's two-sided ratio loss (default) or the FlexiTokens hinge;
  ``boundary_band`` turns the ratio loss into a dead zone around the target.
* Downsample: a segment is the mean of its bytes, by a scatter-add of the weighted byte states
  into their segment (O(T * dim) memory; the (B, S, T) matrix of the first version is gone and a
  test checks values and gradients against it within 1e-6). Upsample: byte t reads the core output
  of segment ``seg_id[t] - 1`` (the last segment that ended strictly before t's segment; zero for
  the first segment) by a gather. On CUDA scatter-add uses atomics, so the last bits of the
  pooled sums may vary from run to run unless ``torch.use_deterministic_algorithms`` is on.
* H-Net's path (``SpiderArgs``, the default since 2026-11-26): ``chunk_convention = "first"`` reads
  the logits as "a chunk starts at t" (shifted into the end convention above by :func:`end_logits`),
  represents a chunk by its first byte's state (:func:`downsample_first`) and hands every byte its own
  chunk's output (:func:`upsample_own`): causal because the chunk's vector reads nothing past its first
  byte.
  :func:`smooth_segments` is H-Net's dechunk EMA; :func:`boundary_confidence` its confidence-weighted
  straight-through factor; :func:`space_boundary_logits` SpaceByte's rule (a baseline).
* S, the largest segment count in the batch, is read back to the host once per forward (the one
  host sync: dynamic chunking needs it to size the core's tensors); rows with fewer segments are
  padded, and ``seg_valid``/``seg_real`` mark which segments exist / hold real bytes.
* Bucketed S (``bucket``, ``SpiderArgs.segment_bucket``): S is rounded up to a multiple of the
  bucket (at most T), so the core sees a few shapes instead of a new one every batch (a compiled
  model recompiles or runs dynamic kernels per new shape; cuDNN attention builds a graph per
  shape). The extra segments are padding like a short row's: they come after every real segment,
  so causal attention never lets a real segment read them; no byte reads them back (the upsample
  reads segments that ended before the byte); the MoE statistics and the ponder loss skip them
  (``seg_real``). Outputs and losses equal the unbucketed model's (tests/unit/test_spider_model.py).

Why these defaults (cosine predictor, causal standardisation, ratio loss with a dead zone, H-Net's
path): the measurements are in docs/experiments.md ("Segmentation", "H-Net's chunking path"); in short,
the hinge collapses to the length cap, the plain hard rule with the ratio loss swings, and the
standardisation holds the rate at the target. H-Net's chunk-start convention, dechunk smoothing and
confidence factor work as a set (each alone loses, together they win at equal FLOPs); the LM gradient
they give the predictor asks for shorter segments than the target on prose, which the ratio loss's dead
zone (``boundary_band``) stops at the band's edge without pulling inside it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spider_titan.vocab import BOS_ID, EOS_ID, PAD_ID


def causal_standardize(x: torch.Tensor, eps: float = 1e-2) -> torch.Tensor:
    """(B, T) -> (B, T): ``(x_t - mean_{s<=t} x_s) / sqrt(var_{s<=t} x_s + eps)`` per row.

    Running statistics over the row's bytes up to and including t (prefix sums, O(T)), so z_t
    depends on bytes <= t only: causal like the logit itself. Computed in fp32.
    """
    x = x.float()
    n = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=torch.float32)
    mean = torch.cumsum(x, dim=1) / n
    var = (torch.cumsum(x * x, dim=1) / n - mean * mean).clamp(min=0.0)
    return (x - mean) / torch.sqrt(var + eps)


class BoundaryPredictor(nn.Module):
    """``forward(h (B, T, dim)) -> logits (B, T)`` fp32: "a segment ends at this byte" when
    ``logit >= 0`` (i.e. p >= 0.5).

    Raw score ``r_t``:
    * ``kind = "cosine"`` (H-Net routing, arXiv 2507.07955): ``q = q_proj(h)``, ``k = k_proj(h)``,
      ``r_t = logit((1 - cos(q_t, k_{t-1})) / 2)`` (``k_{-1} = 0``). A boundary at t thus means
      "byte t differs from byte t-1, close the segment at t" (H-Net starts a new chunk at t
      instead; our convention keeps the decision at t a function of bytes <= t). ``q_proj`` and
      ``k_proj`` start at the identity, as in H-Net.
    * ``kind = "mlp"`` (FlexiTokens): ``r_t = out(gelu(proj(h)))``, output bias ``logit(1/target)``.

    ``standardize`` (``SpiderArgs.boundary_standardize``): the logit is
    ``sharpness * (causal_standardize(r)_t - threshold)`` with ``threshold`` a learned scalar that
    starts at the standard-normal quantile ``Phi^-1(1 - 1/target)`` (so a Gaussian score gives the
    target rate from the first step). The per-row running standardisation makes the boundary rate
    insensitive to drifts of the score's offset and scale (the prelude and the projections move
    every step), which is what made the plain rule oscillate; the predictor learns *where* to cut
    (the ranking of bytes, from the LM's straight-through gradient), the ratio loss tunes
    ``threshold`` and the score's shape so that *how often* stays at the target.
    """

    def __init__(
        self,
        dim: int,
        kind: str = "cosine",
        standardize: bool = True,
        sharpness: float = 2.0,
        proj_dim: int | None = None,
    ):
        super().__init__()
        self.kind = kind
        self.standardize = standardize
        self.sharpness = sharpness
        width = proj_dim or dim  # SpiderArgs.boundary_dim: the projections' output width
        if kind == "mlp":
            self.proj = nn.Linear(dim, width)
            self.out = nn.Linear(width, 1)
        else:
            self.q_proj = nn.Linear(dim, width, bias=False)
            self.k_proj = nn.Linear(dim, width, bias=False)
        # shape (1,), not a scalar: FSDP2's fully_shard cannot shard 0-d parameters
        self.threshold = nn.Parameter(torch.empty(1)) if standardize else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.logits(self.raw_score(h))

    def raw_score(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, dim) -> r (B, T) fp32; r_t reads h_t and h_{t-1} only (incremental decoding feeds
        the last two positions)."""
        if self.kind == "mlp":
            return self.out(F.gelu(self.proj(h))).squeeze(-1).float()
        q = self.q_proj(h).float()
        k = F.pad(self.k_proj(h).float()[:, :-1], (0, 0, 1, 0))  # (B, T, dim), k_{t-1}
        p = ((1.0 - F.cosine_similarity(q, k, dim=-1, eps=1e-6)) / 2.0).clamp(1e-6, 1.0 - 1e-6)
        return torch.log(p) - torch.log1p(-p)

    def logits(self, r: torch.Tensor) -> torch.Tensor:
        """Raw scores of a whole row prefix (B, T) -> the logits (standardised when configured)."""
        if self.threshold is None:
            return r
        return self.sharpness * (causal_standardize(r) - self.threshold)

    def init_weights(self, init_std: float, target_bytes_per_segment: float) -> None:
        """mlp: small weights and an output bias that starts the boundary rate at 1/target;
        cosine: identity projections (H-Net); narrower (``boundary_dim``) the identity's first rows,
        so q and k both read the same first coordinates of the prelude state (at a random init as
        good a projection as any); threshold: Phi^-1(1 - 1/target)."""
        rate = min(1.0 / target_bytes_per_segment, 1.0 - 1e-6)
        if self.kind == "mlp":
            nn.init.trunc_normal_(self.proj.weight, std=init_std)
            nn.init.zeros_(self.proj.bias)
            nn.init.trunc_normal_(self.out.weight, std=init_std)
            nn.init.constant_(self.out.bias, math.log(rate / (1.0 - rate)))
        else:
            nn.init.eye_(self.q_proj.weight)
            nn.init.eye_(self.k_proj.weight)
        if self.threshold is not None:
            nn.init.constant_(self.threshold, statistics.NormalDist().inv_cdf(max(1.0 - rate, 1e-6)))


@dataclass
class Segmentation:
    """One batch's segmentation (shapes: B rows, T bytes, S = largest segment count).

    boundaries:    (B, T) bool, final hard boundaries (a segment ends at t)
    seg_id:        (B, T) int64, segment holding byte t
    pos_in_seg:    (B, T) int64, 0-based position of byte t inside its segment
    ste:           (B, T) fp32, value 0; carries the straight-through gradient of the soft segment index
    probs:         (B, T) fp32, predictor probabilities p_t (no noise) that a segment ends at t
    soft:          (B, T) fp32, the value the rule thresholded at t (p, or the Gumbel-relaxed sample)
    decided:       (B, T) bool, positions whose boundary the predictor chose (not forced by specials)
    free:          (B, T) bool, decided and not cut by the length cap: where the rule's choice stands
    real_bytes:    (B, T) bool, the byte is not PAD
    ends:          (B, S) int64, last byte of each segment (arbitrary for missing segments)
    seg_valid:     (B, S) bool, the segment exists in that row
    seg_real:      (B, S) bool, the segment exists and holds real (non-PAD) bytes
    num_segments:  S (a host int), the largest row's segment count rounded up to the bucket
    max_row_segments: the largest row's segment count (a host int, <= S; S without a bucket)
    total_segments: the segments of all rows together (a host int, = seg_valid.sum())
    """

    boundaries: torch.Tensor
    seg_id: torch.Tensor
    pos_in_seg: torch.Tensor
    ste: torch.Tensor
    probs: torch.Tensor
    soft: torch.Tensor
    decided: torch.Tensor
    free: torch.Tensor
    real_bytes: torch.Tensor
    ends: torch.Tensor
    seg_valid: torch.Tensor
    seg_real: torch.Tensor
    num_segments: int
    max_row_segments: int
    total_segments: int


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, dim=1) - x


def _previous_boundary(boundaries: torch.Tensor) -> torch.Tensor:
    """(B, T) bool -> (B, T) int64: index of the last boundary strictly before t (-1 if none)."""
    T = boundaries.shape[1]
    idx = torch.arange(T, device=boundaries.device).expand_as(boundaries)
    last = torch.where(boundaries, idx, -1).cummax(dim=1).values  # last boundary at or before t
    return F.pad(last[:, :-1], (1, 0), value=-1)


_MASK64 = (1 << 64) - 1


def _i64(c: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def keyed_uniform(keys: torch.Tensor, T: int) -> torch.Tensor:
    """(B,) int64 keys -> (B, T) fp32 uniforms in (0, 1), a pure function of (key, position).

    splitmix64 of ``key * 2^20 + t`` in wrapping int64 arithmetic (the same bits on CPU and GPU),
    keeping the top 24 bits so the float is exact. Keyed by a sample's global index, a sample
    gets the same noise whatever rank, micro-batch or row it lands in.
    """
    t = torch.arange(T, device=keys.device, dtype=torch.int64)
    z = keys.to(torch.int64).unsqueeze(1) * (1 << 20) + t + _i64(0x9E3779B97F4A7C15)  # (B, T)
    z = (z ^ _shr(z, 30)) * _i64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _i64(0x94D049BB133111EB)
    z = z ^ _shr(z, 31)
    return (_shr(z, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def end_logits(logits: torch.Tensor, *, chunk_start: bool) -> torch.Tensor:
    """Predictor logits in the end convention ("a segment ends at t"): under ``chunk_start``
    ("a chunk starts at t") shifted by one byte (the last byte's end is forced, its logit never read)."""
    return F.pad(logits[:, 1:], (0, 1), value=-30.0) if chunk_start else logits


def segment_bytes(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    training: bool,
    temperature: float,
    max_segment_bytes: int,
    noise_keys: torch.Tensor | None = None,
    noise: str = "none",
    ste: bool = True,
    bucket: int = 1,
    chunk_start: bool = False,
) -> Segmentation:
    """Boundaries from predictor ``logits (B, T)`` and the bytes, with forced boundaries and STE.

    The rule is ``soft_t >= 0.5`` with ``soft = p`` (``noise = "none"``: the same function in
    training and eval). ``ste = False`` leaves the straight-through term out (value and
    gradient 0). With ``noise = "gumbel"`` training hardens a Gumbel-sigmoid sample
    instead; its noise comes from ``keyed_uniform(noise_keys)`` when keys are given (one per
    row), else from torch's global RNG. ``bucket > 1`` rounds S up to a multiple of it (at most
    T); the extra segments are padding (module docstring).

    ``chunk_start`` (``chunk_convention = "first"``, H-Net): ``logits[t]`` decides "a chunk starts
    at t", i.e. "a segment ends at t - 1"; they are shifted by one byte into the end convention that
    the rest of this function (and every field of the result) uses. The decision at t - 1 then
    depends on byte t, which the first-byte downsample tolerates (module docstring).
    """
    B, T = input_ids.shape
    device = input_ids.device
    logits = end_logits(logits, chunk_start=chunk_start)
    probs = torch.sigmoid(logits)
    if training and noise == "gumbel":
        if noise_keys is not None:
            u = keyed_uniform(noise_keys, T).to(logits.dtype)
        else:
            u = torch.rand_like(logits)
        u = u.clamp(1e-6, 1.0 - 1e-6)
        soft = torch.sigmoid((logits + torch.log(u) - torch.log1p(-u)) / temperature)
    else:
        soft = probs

    is_pad = input_ids == PAD_ID
    next_pad = F.pad(is_pad[:, 1:], (0, 1), value=False)
    special = (input_ids == BOS_ID) | (input_ids == EOS_ID) | (is_pad != next_pad)
    special[:, -1] = True
    base = ((soft >= 0.5) & ~is_pad) | special

    # Length cap: every max_segment_bytes-th byte after the previous boundary.
    idx = torch.arange(T, device=device)
    run = idx - _previous_boundary(base)  # 1-based position since the previous base boundary
    capped = run % max_segment_bytes == 0
    boundaries = base | capped

    decided = ~special & ~is_pad
    free = decided & ~capped
    delta = torch.where(free & ste, soft - soft.detach(), torch.zeros_like(soft))
    ste = _exclusive_cumsum(delta)

    seg_id = _exclusive_cumsum(boundaries.long())
    pos_in_seg = idx - _previous_boundary(boundaries) - 1
    n_segments = boundaries.sum(dim=1)  # (B,) the last byte always ends a segment
    counts = n_segments.tolist()  # the one host sync of the forward: every row's segment count
    max_row, total = max(counts), sum(counts)
    S = min(T, -(-max_row // bucket) * bucket) if bucket > 1 else max_row
    # Stable sort puts the boundary positions first, in order: the ends of segments 0..n_b-1.
    ends = torch.sort((~boundaries).to(torch.uint8), dim=1, stable=True).indices[:, :S]  # (B, S)
    seg_valid = torch.arange(S, device=device) < n_segments[:, None]
    seg_real = seg_valid & ~is_pad.gather(1, ends)
    return Segmentation(
        boundaries=boundaries,
        seg_id=seg_id,
        pos_in_seg=pos_in_seg,
        ste=ste,
        probs=probs,
        soft=soft,
        decided=decided,
        free=free,
        real_bytes=~is_pad,
        ends=ends,
        seg_valid=seg_valid,
        seg_real=seg_real,
        num_segments=S,
        max_row_segments=max_row,
        total_segments=total,
    )


def downsample(x: torch.Tensor, seg: Segmentation) -> torch.Tensor:
    """x (B, T, dim) -> s (B, S, dim): each segment is the mean of its bytes (zero for missing ones).

    ``index_add``-style scatter of the bytes' weighted states into their segments: O(T * dim)
    memory (no (B, S, T) matrix). Byte weights ``1 + ste`` are exactly 1 in value and carry the
    straight-through gradient; the mean divides by the summed weights (value = byte count).
    """
    B, T, D = x.shape
    w = 1.0 + seg.ste  # (B, T) fp32, value 1
    index = seg.seg_id.unsqueeze(-1).expand(B, T, D)
    num = x.new_zeros(B, seg.num_segments, D, dtype=torch.float32).scatter_add(1, index, x.float() * w.unsqueeze(-1))
    den = w.new_zeros(B, seg.num_segments).scatter_add(1, seg.seg_id, w)  # (B, S)
    den = torch.where(seg.seg_valid, den, torch.ones_like(den))
    return (num / den.unsqueeze(-1)).to(x.dtype)


def upsample(y: torch.Tensor, seg: Segmentation) -> torch.Tensor:
    """y (B, S, dim) -> (B, T, dim): byte t gets y of segment ``seg_id[t] - 1`` (zero for segment 0).

    A gather (O(T * dim)), scaled by ``1 + ste`` (value 1, the straight-through gradient).
    """
    B, T = seg.seg_id.shape
    D = y.shape[-1]
    src = (seg.seg_id - 1).clamp(min=0).unsqueeze(-1).expand(B, T, D)
    scale = torch.where(seg.seg_id > 0, 1.0 + seg.ste, torch.zeros_like(seg.ste))  # (B, T)
    return y.gather(1, src) * scale.unsqueeze(-1).to(y.dtype)


def segment_starts(seg: Segmentation) -> torch.Tensor:
    """(B, S) int64: first byte of each segment (the byte after the previous segment's end; 0 for
    the first; clamped into the row for missing segments, whose value nobody reads)."""
    T = seg.seg_id.shape[1]
    return F.pad(seg.ends[:, :-1] + 1, (1, 0), value=0).clamp(max=T - 1)


def downsample_first(x: torch.Tensor, seg: Segmentation) -> torch.Tensor:
    """x (B, T, dim) -> s (B, S, dim): each segment is its FIRST byte's state (H-Net's chunk layer,
    ``chunk_convention = "first"``), scaled by ``1 + ste`` there (value 1). The segment's vector
    then reads only bytes up to its start, so :func:`upsample_own` may hand it to its own bytes."""
    B, T, D = x.shape
    starts = segment_starts(seg)  # (B, S)
    w = (1.0 + seg.ste).gather(1, starts)  # (B, S)
    return x.gather(1, starts.unsqueeze(-1).expand(B, starts.shape[1], D)) * w.unsqueeze(-1).to(x.dtype)


def upsample_own(y: torch.Tensor, seg: Segmentation) -> torch.Tensor:
    """y (B, S, dim) -> (B, T, dim): byte t gets y of its OWN segment ``seg_id[t]`` (H-Net's dechunk,
    ``chunk_convention = "first"``), scaled by ``1 + ste`` (value 1). Causal only together with
    :func:`downsample_first` (a segment's vector from bytes up to its first)."""
    B, T = seg.seg_id.shape
    out = y.gather(1, seg.seg_id.unsqueeze(-1).expand(B, T, y.shape[-1]))
    return out * (1.0 + seg.ste).unsqueeze(-1).to(y.dtype)


def segment_start_probs(seg: Segmentation) -> torch.Tensor:
    """(B, S) fp32: the probability of the boundary that opened each segment, ``soft`` at the
    previous segment's end where the predictor chose it, 1 where the boundary was forced (the first
    segment, BOS/EOS, PAD, the length cap). Carries the predictor's gradient."""
    prev_end = F.pad(seg.ends[:, :-1], (1, 0), value=0)  # (B, S); segment 0 is masked below
    first = torch.zeros_like(seg.ends, dtype=torch.bool)
    first[:, 0] = True
    free = seg.free.gather(1, prev_end) & ~first
    return torch.where(free, seg.soft.gather(1, prev_end), torch.ones_like(seg.soft[:, :1]))


def smooth_segments(y: torch.Tensor, seg: Segmentation, *, detach: bool) -> torch.Tensor:
    """H-Net's dechunk smoothing (``dechunk_smoothing``): an EMA over the segments' outputs,
    ``out_k = P_k y_k + (1 - P_k) out_{k-1}`` (``out_{-1} = 0``), with ``P_k`` the probability of the
    boundary that opened segment k (:func:`segment_start_probs`), clamped to [1e-4, 1 - 1e-4] as
    in H-Net. A confident boundary passes its segment through, a doubtful one blends in the past.

    ``out_k`` depends on ``y_0..y_k`` only, so either upsample stays causal. Computed in closed form
    (``out_k = sum_{j<=k} P_j exp(L_k - L_j) y_j``, ``L`` the cumulative ``log(1 - P)``, summed and
    differenced in fp64) as one (B, S, S) x (B, S, dim) product in fp32: no loop over segments. ``detach``: the predictor gets no
    gradient through P (when the LM loss is not meant to train it).
    """
    P = segment_start_probs(seg).float().clamp(1e-4, 1.0 - 1e-4)
    if detach:
        P = P.detach()
    # L in fp64: it falls by up to 9.2 per segment, so over hundreds of segments an fp32 L_k - L_j keeps
    # only ~4 digits (weights off by 1e-5 relative against the step-by-step EMA of decode.py)
    L = torch.cumsum(torch.log1p(-P.double()), dim=1)  # (B, S)
    S = P.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=P.device).tril()
    expo = torch.where(causal, L.unsqueeze(2) - L.unsqueeze(1), float("-inf")).float()  # (B, S_k, S_j)
    weights = torch.exp(expo) * P.unsqueeze(1)
    return torch.bmm(weights, y.float()).to(y.dtype)


def boundary_confidence(seg: Segmentation) -> torch.Tensor:
    """(B, T) fp32, value exactly 1: H-Net's confidence-weighted straight-through factor
    (``boundary_confidence``). Byte t's upsampled core output is multiplied by
    ``1 + c - c.detach()`` with ``c = p`` if a boundary was chosen at t - 1 (t opens a segment) and
    ``1 - p`` if not, so the LM loss pushes the predictor towards the choice that helped it. The
    choice at t - 1 is the one that decided which segment byte t reads in either convention. Forced
    boundaries (and byte 0) carry no gradient.
    """
    c = torch.where(seg.boundaries, seg.soft, 1.0 - seg.soft)
    c = torch.where(seg.free, c - c.detach(), torch.zeros_like(c))
    return 1.0 + F.pad(c[:, :-1], (1, 0), value=0.0)


def _spacelike(input_ids: torch.Tensor) -> torch.Tensor:
    """SpaceByte's spacelike bytes: not an ASCII letter or digit, not a UTF-8 continuation byte,
    not a special id (BOS/EOS/PAD are cut by their own rules)."""
    b = input_ids
    alnum = ((b >= 48) & (b <= 57)) | ((b >= 65) & (b <= 90)) | ((b >= 97) & (b <= 122))
    continuation = (b >= 0x80) & (b <= 0xBF)
    return (b < 256) & ~alnum & ~continuation


def space_boundary_logits(input_ids: torch.Tensor, *, chunk_start: bool) -> torch.Tensor:
    """(B, T) fp32 +-30 logits of the SpaceByte rule (``boundary_predictor = "space"``): a segment
    ends at a spacelike byte that follows a non-spacelike one (the end of a word and its first
    space or punctuation). With ``chunk_start`` the same cuts are given as chunk starts (t starts a
    chunk when t - 1 ends a segment), the input :func:`segment_bytes` expects then."""
    space = _spacelike(input_ids)
    ends = space & ~F.pad(space[:, :-1], (1, 0), value=True)
    if chunk_start:
        ends = F.pad(ends[:, :-1], (1, 0), value=False)
    return torch.where(ends, 30.0, -30.0).float()


def boundary_loss(
    seg: Segmentation,
    target_bytes_per_segment: float,
    kind: str = "ratio",
    band: float = 0.0,
    inner: float = 0.0,
    upper: float = 1.0,
) -> torch.Tensor:
    """The boundary objective, a mean over rows (``kind`` is ``SpiderArgs.boundary_loss``,
    ``band`` ``SpiderArgs.boundary_band``, ``inner`` ``SpiderArgs.boundary_band_inner``, ``upper``
    ``SpiderArgs.boundary_band_upper``).

    ``G`` is the mean predictor probability p_t over the positions it decides (real bytes that
    are not BOS/EOS or next to a PAD run): smooth in the predictor's parameters.

    * ``hinge`` (FlexiTokens): ``relu(G - 1/N)``. It only penalises too many boundaries; measured
      (2026-11-23, debug, built-in corpus) the segments then grow to the ``max_segment_bytes`` cap.
    * ``ratio`` (H-Net): ``N/(N-1) * ((N-1) F G + (1-F)(1-G))`` with ``F`` the fraction of real
      bytes that end a segment (hard, forced boundaries included, no gradient) and N the target
      bytes per segment. Its gradient in G is ``N/(N-1) (N F - 1)``: it lowers p while F > 1/N and
      raises it while F < 1/N, so it holds the compression at N from both sides (minimum 1 at
      F = G = 1/N).
    * ``band`` > 0 (ratio only): a dead zone. Each row's N is its own rate 1/F clamped to
      ``[N (1 - band), N (1 + band)]`` (no gradient), so inside the band the row sits at its own
      loss minimum (value 1, gradient 0: the LM gradient alone places the boundaries) and outside
      it the ratio loss pulls towards the nearest edge of the band. ``inner`` > 0 adds ``inner`` times
      the plain ratio loss (aimed at N itself): a weak pull towards the target at every rate, the
      band's edge a wall. ``upper`` weights the rows above the band (segments too long) against
      those below it.

    F and G are per row and the loss is their mean over rows, so it needs no sum over ranks to be
    split-invariant: a row never straddles ranks, every rank holds the same number of rows, and
    FSDP's gradient average over the ranks is then the mean over all rows of the global batch
    (tests/distributed/test_split_invariance.py). H-Net takes F and G over the whole batch
    instead; that would need the MoE's global-batch sums (moe/layer.py) and is a different
    objective (it lets single rows stray from the target).
    """
    m = seg.decided.float()
    G = (seg.probs * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
    N = target_bytes_per_segment
    if kind == "hinge":
        return torch.relu(G - 1.0 / N).mean()
    real = seg.real_bytes.float()
    F_ = ((seg.boundaries.float() * real).sum(dim=1) / real.sum(dim=1).clamp(min=1.0)).detach()

    def ratio(N, weight=1.0):  # N: the target, a float or one per row; weight: one per row
        return (weight * N / (N - 1.0) * ((N - 1.0) * F_ * G + (1.0 - F_) * (1.0 - G))).mean()

    if band == 0.0:
        return ratio(N)
    rate = 1.0 / F_.clamp(min=1e-6)
    edge = rate.clamp(N * (1.0 - band), N * (1.0 + band))
    weight = torch.where(rate > N * (1.0 + band), upper, 1.0)  # rows above the band weighted by `upper`
    return ratio(edge, weight) + inner * ratio(N)
