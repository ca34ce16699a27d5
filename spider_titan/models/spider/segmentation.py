"""Byte segmentation: the boundary predictor, one boundary rule, and the :class:`Chunker` that owns
the chunk convention, pooling, H-Net's smoothing and confidence, and the boundary loss. Training
(``Spider.forward``) and cached decoding (decode.py) both call the Chunker.

References: H-Net (Hwang, Wang, Gu, arXiv 2507.07955) for the cosine routing, the chunk-start
convention, dechunk smoothing, the confidence factor and the ratio loss; Nawrot et al. 2023
("Efficient Transformers with Dynamic Token Pooling") for mean pooling and the causal shift.

Conventions
-----------
* A boundary at byte t means "a segment ends at t"; ``seg_id[t]`` counts the boundaries strictly
  before t, so it never depends on byte t or later. The predictor's logits under the chunk-start
  convention ("a chunk starts at t") are shifted into this one by :func:`end_logits`.
* One rule, the same in training and eval: a boundary where ``p_t >= 0.5``.
* Forced boundaries (no gradient): at BOS and EOS; around PAD runs (no segment mixes PAD with real
  bytes; PAD runs are cut by the length cap only, and their segments are "not real": left out of
  the MoE statistics and ``bytes_per_segment``); at the last position; and whenever a segment would
  exceed ``max_segment_bytes`` (computed in one pass with a cumulative max). A forced boundary at t
  only moves bytes > t into a new segment, so none of this leaks information backwards.
* ``chunk_convention = "first"`` (H-Net): a chunk is its first byte's prelude state and every byte
  reads its own chunk's core output; ``"mean"``: a segment is the mean of its bytes and byte t reads
  the segment that ended before its own. Both are causal (tests/unit/test_spider_model.py).
* With a learned predictor the LM loss trains it through H-Net's confidence factor (value 1) and
  its smoothing of the core outputs; the ratio loss (with a dead zone) holds the rate.
* S, the largest segment count in the batch, is read back to the host once per forward, the one
  host sync: it sizes the core's tensors. ``bucket`` rounds S up (the extra segments are masked
  padding that no byte reads back). A ``capacity`` instead fixes S (static shapes, no host sync):
  a row's segments past it are dropped, and its bytes that would read them read zero.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spider_titan.models.spider.args import RATIO_BAND, RATIO_BAND_UPPER, SpiderArgs
from spider_titan.models.spider.engram import engram_bucket_ids
from spider_titan.vocab import BOS_ID, EOS_ID, PAD_ID

NO_BOUNDARY = -30.0  # a logit that never crosses the p >= 0.5 rule (sigmoid(-30) ~ 1e-13)


def causal_standardize(x: torch.Tensor, eps: float = 1e-2) -> torch.Tensor:
    """(B, T) -> (B, T): ``(x_t - mean_{s<=t} x_s) / sqrt(var_{s<=t} x_s + eps)`` per row, by prefix
    sums in fp32, so z_t depends on bytes <= t only."""
    x = x.float()
    n = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=torch.float32)
    mean = torch.cumsum(x, dim=1) / n
    var = (torch.cumsum(x * x, dim=1) / n - mean * mean).clamp(min=0.0)
    return (x - mean) / torch.sqrt(var + eps)


class BoundaryPredictor(nn.Module):
    """``forward(h (B, T, dim)) -> logits (B, T)`` fp32 (H-Net's routing module, arXiv 2507.07955).

    ``q = q_proj(h)``, ``k = k_proj(h)``, raw score ``r_t = logit((1 - cos(q_t, k_{t-1})) / 2)``; the
    logit is ``sharpness * (causal_standardize(r)_t - threshold)``, ``threshold`` learned and started
    at ``Phi^-1(1 - 1/target)`` so a Gaussian score gives the target rate from the first step. The
    running standardisation holds the rate against drifts of the score's offset and scale.
    """

    def __init__(self, dim: int, proj_dim: int | None = None, sharpness: float = 2.0):
        super().__init__()
        self.sharpness = sharpness
        width = proj_dim or dim  # SpiderArgs.boundary_dim
        self.q_proj = nn.Linear(dim, width, bias=False)
        self.k_proj = nn.Linear(dim, width, bias=False)
        # shape (1,), not a scalar: FSDP2's fully_shard cannot shard 0-d parameters
        self.threshold = nn.Parameter(torch.empty(1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.logits(self.raw_score(h))

    def raw_score(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, dim) -> r (B, T) fp32; r_t reads h_t and h_{t-1} only (decoding feeds the last two)."""
        q = self.q_proj(h).float()
        k = F.pad(self.k_proj(h).float()[:, :-1], (0, 0, 1, 0))  # (B, T, dim), k_{t-1}
        p = ((1.0 - F.cosine_similarity(q, k, dim=-1, eps=1e-6)) / 2.0).clamp(1e-6, 1.0 - 1e-6)
        return torch.log(p) - torch.log1p(-p)

    def logits(self, r: torch.Tensor) -> torch.Tensor:
        """Raw scores of a whole row prefix (B, T) -> the standardised logits."""
        return self.sharpness * (causal_standardize(r) - self.threshold)

    def init_weights(self, target_bytes_per_segment: float) -> None:
        """Identity projections (H-Net; narrower, the identity's first rows); threshold Phi^-1(1 - 1/target)."""
        rate = min(1.0 / target_bytes_per_segment, 1.0 - 1e-6)
        nn.init.eye_(self.q_proj.weight)
        nn.init.eye_(self.k_proj.weight)
        nn.init.constant_(self.threshold, statistics.NormalDist().inv_cdf(max(1.0 - rate, 1e-6)))


@dataclass
class Segmentation:
    """One batch's segmentation (shapes: B rows, T bytes, S = largest segment count).

    boundaries:    (B, T) bool, final hard boundaries (a segment ends at t)
    seg_id:        (B, T) int64, segment holding byte t
    pos_in_seg:    (B, T) int64, 0-based position of byte t inside its segment
    probs:         (B, T) fp32, predictor probabilities p_t that a segment ends at t
    decided:       (B, T) bool, positions whose boundary the predictor chose (not forced by specials)
    free:          (B, T) bool, decided and not cut by the length cap: where the rule's choice stands
    real_bytes:    (B, T) bool, the byte is not PAD
    ends:          (B, S) int64, last byte of each segment (arbitrary for missing segments)
    seg_valid:     (B, S) bool, the segment exists in that row
    seg_real:      (B, S) bool, the segment exists and holds real (non-PAD) bytes
    row_segments:  (B,) int64, each row's segment count (may exceed S under a capacity)
    num_segments:  S (a host int), the largest row's segment count rounded up to the bucket, or the capacity
    max_row_segments: the largest row's segment count (a host int, <= S; S without a bucket; None
                   under a capacity, which reads nothing back)
    total_segments: the segments of all rows together (a host int, = seg_valid.sum(); None under a capacity)
    """

    boundaries: torch.Tensor
    seg_id: torch.Tensor
    pos_in_seg: torch.Tensor
    probs: torch.Tensor
    decided: torch.Tensor
    free: torch.Tensor
    real_bytes: torch.Tensor
    ends: torch.Tensor
    seg_valid: torch.Tensor
    seg_real: torch.Tensor
    row_segments: torch.Tensor
    num_segments: int
    max_row_segments: int | None
    total_segments: int | None

    @property
    def capped(self) -> bool:
        """Whether a capacity sized S (segments past it may exist; nothing was read back)."""
        return self.total_segments is None


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, dim=1) - x


def _previous_boundary(boundaries: torch.Tensor) -> torch.Tensor:
    """(B, T) bool -> (B, T) int64: index of the last boundary strictly before t (-1 if none)."""
    T = boundaries.shape[1]
    idx = torch.arange(T, device=boundaries.device).expand_as(boundaries)
    last = torch.where(boundaries, idx, -1).cummax(dim=1).values  # last boundary at or before t
    return F.pad(last[:, :-1], (1, 0), value=-1)


def end_logits(logits: torch.Tensor, *, chunk_start: bool) -> torch.Tensor:
    """Predictor logits in the end convention ("a segment ends at t"): under ``chunk_start``
    ("a chunk starts at t") shifted by one byte (the last byte's end is forced, its logit never read)."""
    return F.pad(logits[:, 1:], (0, 1), value=NO_BOUNDARY) if chunk_start else logits


def segment_bytes(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    max_segment_bytes: int,
    bucket: int = 1,
    capacity: int = 0,
    chunk_start: bool = False,
) -> Segmentation:
    """Boundaries from predictor ``logits (B, T)`` and the bytes: ``p >= 0.5`` plus the forced ones
    (module docstring). ``chunk_start``: the logits decide chunk starts (shifted by :func:`end_logits`).
    ``bucket > 1`` rounds S up to a multiple of it (at most T); ``capacity > 0`` sets S to it (at most
    T) without reading the counts back (module docstring)."""
    B, T = input_ids.shape
    device = input_ids.device
    probs = torch.sigmoid(end_logits(logits, chunk_start=chunk_start))

    is_pad = input_ids == PAD_ID
    next_pad = F.pad(is_pad[:, 1:], (0, 1), value=False)
    special = (input_ids == BOS_ID) | (input_ids == EOS_ID) | (is_pad != next_pad)
    special[:, -1] = True
    base = ((probs >= 0.5) & ~is_pad) | special

    # Length cap: every max_segment_bytes-th byte after the previous boundary.
    idx = torch.arange(T, device=device)
    run = idx - _previous_boundary(base)  # 1-based position since the previous base boundary
    capped = run % max_segment_bytes == 0
    boundaries = base | capped

    decided = ~special & ~is_pad
    seg_id = _exclusive_cumsum(boundaries.long())
    pos_in_seg = idx - _previous_boundary(boundaries) - 1
    n_segments = boundaries.sum(dim=1)  # (B,) the last byte always ends a segment
    if capacity > 0:
        S, max_row, total = min(T, capacity), None, None
    else:
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
        probs=probs,
        decided=decided,
        free=decided & ~capped,
        real_bytes=~is_pad,
        ends=ends,
        seg_valid=seg_valid,
        seg_real=seg_real,
        row_segments=n_segments,
        num_segments=S,
        max_row_segments=max_row,
        total_segments=total,
    )


def downsample(x: torch.Tensor, seg: Segmentation) -> torch.Tensor:
    """x (B, T, dim) -> s (B, S, dim): each segment is the mean of its bytes (zero for missing ones),
    by a scatter-add into the segments (one more slot collects the bytes of segments past a
    capacity): O(T * dim) memory."""
    B, T, D = x.shape
    S, extra = seg.num_segments, int(seg.capped)
    seg_id = seg.seg_id.clamp(max=S) if seg.capped else seg.seg_id
    num = x.new_zeros(B, S + extra, D, dtype=torch.float32).scatter_add(
        1, seg_id.unsqueeze(-1).expand(B, T, D), x.float()
    )
    ones = torch.ones(B, T, dtype=torch.float32, device=x.device)
    den = ones.new_zeros(B, S + extra).scatter_add(1, seg_id, ones)[:, :S]  # (B, S) byte counts
    den = torch.where(seg.seg_valid, den, torch.ones_like(den))
    return (num[:, :S] / den.unsqueeze(-1)).to(x.dtype)


def upsample(y: torch.Tensor, seg: Segmentation) -> torch.Tensor:
    """y (B, S, dim) -> (B, T, dim): byte t gets y of segment ``seg_id[t] - 1`` (zero for segment 0
    and for segments past a capacity)."""
    B, T = seg.seg_id.shape
    S, D = y.shape[1], y.shape[-1]
    src = (seg.seg_id - 1).clamp(min=0, max=S - 1).unsqueeze(-1).expand(B, T, D)
    scale = ((seg.seg_id > 0) & (seg.seg_id <= S)).float()  # (B, T)
    return y.gather(1, src) * scale.unsqueeze(-1).to(y.dtype)


def segment_starts(seg: Segmentation) -> torch.Tensor:
    """(B, S) int64: first byte of each segment (the byte after the previous segment's end; 0 for
    the first; clamped into the row for missing segments, whose value nobody reads)."""
    T = seg.seg_id.shape[1]
    return F.pad(seg.ends[:, :-1] + 1, (1, 0), value=0).clamp(max=T - 1)


def downsample_first(x: torch.Tensor, seg: Segmentation) -> torch.Tensor:
    """x (B, T, dim) -> s (B, S, dim): each segment is its FIRST byte's state (H-Net's chunk layer)."""
    B, T, D = x.shape
    starts = segment_starts(seg)  # (B, S)
    return x.gather(1, starts.unsqueeze(-1).expand(B, starts.shape[1], D))


def upsample_own(y: torch.Tensor, seg: Segmentation) -> torch.Tensor:
    """y (B, S, dim) -> (B, T, dim): byte t gets y of its OWN segment ``seg_id[t]`` (H-Net's dechunk);
    causal only together with :func:`downsample_first`. Zero for segments past a capacity."""
    B, T = seg.seg_id.shape
    if not seg.capped:
        return y.gather(1, seg.seg_id.unsqueeze(-1).expand(B, T, y.shape[-1]))
    S = y.shape[1]
    out = y.gather(1, seg.seg_id.clamp(max=S - 1).unsqueeze(-1).expand(B, T, y.shape[-1]))
    return out * (seg.seg_id < S).unsqueeze(-1).to(y.dtype)


def segment_start_probs(seg: Segmentation) -> torch.Tensor:
    """(B, S) fp32: the probability of the boundary that opened each segment, p at the previous
    segment's end where the predictor chose it, 1 where the boundary was forced (the first segment,
    BOS/EOS, PAD, the length cap). Carries the predictor's gradient."""
    prev_end = F.pad(seg.ends[:, :-1], (1, 0), value=0)  # (B, S); segment 0 is masked below
    first = torch.zeros_like(seg.ends, dtype=torch.bool)
    first[:, 0] = True
    free = seg.free.gather(1, prev_end) & ~first
    return torch.where(free, seg.probs.gather(1, prev_end), torch.ones_like(seg.probs[:, :1]))


def smoothing_weights(seg: Segmentation) -> torch.Tensor:
    """(B, S) fp32: ``P_k`` of H-Net's dechunk EMA, :func:`segment_start_probs` clamped to [1e-4, 1 - 1e-4]."""
    return segment_start_probs(seg).float().clamp(1e-4, 1.0 - 1e-4)


def smooth_segments(y: torch.Tensor, seg: Segmentation) -> torch.Tensor:
    """H-Net's dechunk smoothing: ``out_k = P_k y_k + (1 - P_k) out_{k-1}`` (``out_{-1} = 0``) over the
    segments (:func:`smoothing_weights`): a confident boundary passes its segment through, a doubtful
    one blends in the past; ``out_k`` reads ``y_0..y_k`` only. In closed form, ``out_k = sum_{j<=k}
    P_j exp(L_k - L_j) y_j`` with ``L`` the cumulative ``log(1 - P)`` (summed and differenced in fp64,
    which the step-by-step EMA of decode.py matches), as one (B, S, S) x (B, S, dim) product in y's
    dtype: fp32 on a CPU, bf16 on a GPU's tensor cores (as autocast ran it), the weights made in fp32."""
    P = smoothing_weights(seg)
    L = torch.cumsum(torch.log1p(-P.double()), dim=1)  # (B, S)
    S = P.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=P.device).tril()
    expo = torch.where(causal, L.unsqueeze(2) - L.unsqueeze(1), float("-inf")).float()  # (B, S_k, S_j)
    weights = torch.exp(expo) * P.unsqueeze(1)
    return torch.bmm(weights.to(y.dtype), y)


def boundary_confidence(seg: Segmentation) -> torch.Tensor:
    """(B, T) fp32, value exactly 1: H-Net's confidence-weighted straight-through factor. Byte t's
    upsampled core output is multiplied by ``1 + c - c.detach()`` with ``c = p`` if a boundary was
    chosen at t - 1 and ``1 - p`` if not, so the LM loss pushes the predictor towards the choice that
    helped it. Forced boundaries (and byte 0) carry no gradient."""
    c = torch.where(seg.boundaries, seg.probs, 1.0 - seg.probs)
    c = torch.where(seg.free, c - c.detach(), torch.zeros_like(c))
    return 1.0 + F.pad(c[:, :-1], (1, 0), value=0.0)


def boundary_loss(seg: Segmentation, target_bytes_per_segment: float, band: float, upper: float) -> torch.Tensor:
    """H-Net's ratio loss with a dead zone, a mean over rows.

    ``G`` is the row's mean predictor probability over the positions it decides, ``F`` the fraction
    of real bytes that end a segment (no gradient), N the target bytes per segment: the ratio loss
    ``N/(N-1) ((N-1) F G + (1-F)(1-G))`` lowers p while F > 1/N and raises it while F < 1/N. With a
    ``band`` each row's N is its own rate 1/F clamped to ``[N (1 - band), N (1 + band)]``: no pull
    inside the band, a pull to its nearest edge outside; ``upper`` weights the rows above the band.
    Per-row F and G make the loss split-invariant across ranks (tests/distributed/test_split_invariance.py).
    """
    m = seg.decided.float()
    G = (seg.probs * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
    N = target_bytes_per_segment
    real = seg.real_bytes.float()
    F_ = ((seg.boundaries.float() * real).sum(dim=1) / real.sum(dim=1).clamp(min=1.0)).detach()

    def ratio(N, weight=1.0):  # N: the target, a float or one per row; weight: one per row
        return (weight * N / (N - 1.0) * ((N - 1.0) * F_ * G + (1.0 - F_) * (1.0 - G))).mean()

    if band == 0.0:
        return ratio(N)
    rate = 1.0 / F_.clamp(min=1e-6)
    edge = rate.clamp(N * (1.0 - band), N * (1.0 + band))
    weight = torch.where(rate > N * (1.0 + band), upper, 1.0)  # rows above the band weighted by `upper`
    return ratio(edge, weight)


class Chunker:
    """Spider's segmentation policy: where boundaries go, how bytes become chunks and chunks become
    bytes again, and what trains the predictor. ``Spider.forward`` and the cached decoder call it, so
    neither knows the convention or whether segments are learned or fixed.

    ``boundary_predictor = "fixed"``: no predictor, a boundary every round(target) bytes (the length
    cap), no smoothing, confidence or boundary loss. Learned (``cosine``): the predictor's logits,
    H-Net's smoothing and confidence factor, the ratio loss with its dead zone.
    """

    def __init__(self, args: SpiderArgs):
        self.args = args
        self.learned = args.learned_segments
        self.chunk_start = args.chunk_convention == "first"
        fixed_cap = max(1, min(args.max_segment_bytes, round(args.target_bytes_per_segment)))
        self.max_segment_bytes = args.max_segment_bytes if self.learned else fixed_cap

    def logits(self, predictor: BoundaryPredictor | None, x: torch.Tensor) -> torch.Tensor:
        """(B, T) fp32 boundary logits of the prelude states ``x (B, T, dim)`` (constant without a predictor)."""
        if predictor is None:
            return x.new_full(x.shape[:2], NO_BOUNDARY, dtype=torch.float32)
        return predictor(x)

    def segment(
        self, logits: torch.Tensor, input_ids: torch.Tensor, *, bucket: int = 1, capacity: int = 0
    ) -> Segmentation:
        """:func:`segment_bytes` under this policy (``bucket`` and ``capacity`` as there)."""
        return segment_bytes(
            logits,
            input_ids,
            max_segment_bytes=self.max_segment_bytes,
            bucket=bucket,
            capacity=capacity,
            chunk_start=self.chunk_start,
        )

    def capacity(self, seq_len: int) -> int:
        """Segment slots per row of ``seq_len`` bytes under ``segment_capacity`` (0: counted per batch)."""
        a = self.args
        return math.ceil(a.segment_capacity * seq_len / a.target_bytes_per_segment) if a.segment_capacity > 0 else 0

    def pool(self, x: torch.Tensor, seg: Segmentation) -> torch.Tensor:
        """Byte states (B, T, dim) -> chunk vectors (B, S, dim)."""
        return downsample_first(x, seg) if self.chunk_start else downsample(x, seg)

    def engram_ids(self, input_ids: torch.Tensor, seg: Segmentation) -> torch.Tensor:
        """(B, S, 2) Engram bucket ids per chunk; a chunk that starts at its first byte may read bytes
        up to its start only, so it hashes the chunk before it, the last complete one."""
        a = self.args
        ids = engram_bucket_ids(input_ids, seg.pos_in_seg, seg.ends, a.engram_buckets, a.max_segment_bytes)
        return F.pad(ids[:, :-1], (0, 0, 1, 0)) if self.chunk_start else ids

    def unpool(self, y: torch.Tensor, seg: Segmentation) -> torch.Tensor:
        """Core outputs per chunk (B, S, dim) -> what each byte reads (B, T, dim): smoothed over the
        chunks and carrying the confidence factor when segments are learned."""
        if self.learned:
            y = smooth_segments(y, seg)
        y = upsample_own(y, seg) if self.chunk_start else upsample(y, seg)
        if self.learned:
            y = y * boundary_confidence(seg).unsqueeze(-1).to(y.dtype)
        return y

    def loss(self, seg: Segmentation) -> torch.Tensor:
        """The boundary loss (a zero scalar without a predictor)."""
        if not self.learned:
            return seg.probs.new_zeros(())
        return boundary_loss(seg, self.args.target_bytes_per_segment, RATIO_BAND, RATIO_BAND_UPPER)

    # ---- incremental decoding (decode.py): segments handed to the core one at a time

    def final_segments(self, seg: Segmentation, length: int) -> int:
        """Segments of a row of ``length`` bytes whose vectors can no longer change: those that ended
        before its last byte (a boundary is final once the byte after it is known) and, under the
        chunk-start convention, the one its last byte belongs to (its first byte is known)."""
        ended = int((seg.ends[0, : seg.num_segments] <= length - 2).sum())
        return ended + 1 if self.chunk_start else ended

    def smoothing(self, seg: Segmentation) -> torch.Tensor | None:
        """The smoothing weights ``P`` (B, S) of :func:`smooth_segments`, None when segments are fixed."""
        return smoothing_weights(seg) if self.learned else None

    @staticmethod
    def smooth_step(p: torch.Tensor | None, y: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        """One chunk's output after smoothing, from its weight ``p`` (:meth:`smoothing`; None: no
        smoothing), its core output ``y`` and the smoothed output of the chunk before (None for the
        first): one step of :func:`smooth_segments`."""
        if p is None:
            return y
        prev = torch.zeros_like(y, dtype=torch.float32) if previous is None else previous.float()
        return (p * y.float() + (1.0 - p) * prev).to(y.dtype)
