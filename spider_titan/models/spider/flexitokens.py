"""FlexiTokens segmentation: learned byte boundaries, downsample to segments, causal upsample.

References: FlexiTokens (arXiv 2507.12720) for the boundary predictor and hinge loss; Nawrot et
al. 2023, "Efficient Transformers with Dynamic Token Pooling", for the pooling matrices and the
causal shift.

Conventions
-----------
* A boundary at byte t means "a segment ends at byte t". ``seg_id[t]`` (the segment holding
  byte t) is the number of boundaries strictly before t, so it never depends on byte t or later.
* Predictor: ``BoundaryPredictor`` (Linear-GELU-Linear on the prelude output) gives a logit per
  byte; ``p_t = sigmoid(logit)``. Training samples a relaxed Bernoulli (Gumbel-sigmoid,
  ``soft = sigmoid((logit + log u - log(1-u)) / temperature)``) and hardens it at 0.5; eval uses
  ``p_t > 0.5``.
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
  the relaxed sample) at positions the predictor decided. Following Nawrot et al., the exclusive
  cumulative sum ``c_t`` of ``delta`` stands for the (soft) segment index of byte t, and the
  pooling matrices carry ``1 + c_t`` (value exactly 1) at byte t's entry, so gradients reach the
  predictor through both the downsample and the upsample while the forward pass is exactly hard.
* Downsample: ``s = W @ x`` with ``W (B, S, T)`` the row-normalised one-hot membership (a segment
  is the mean of its bytes). Upsample: byte t reads the core output of segment ``seg_id[t] - 1``
  (the last segment that ended strictly before t's segment; zero for the first segment) through
  ``U (B, T, S)``. Dense bmm instead of scatter/gather: deterministic on every device, with a
  cost of 2*S*dim FLOPs per byte each way (about 1 % of the 1B model's FLOPs at T=4096).
* S, the largest segment count in the batch, is read back to the host once per forward; rows
  with fewer segments are padded, and ``seg_valid``/``seg_real`` mark which segments exist / hold
  real bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spider_titan.models.common import BOS_ID, EOS_ID, PAD_ID


class BoundaryPredictor(nn.Module):
    """``forward(h (B, T, dim)) -> logits (B, T)`` fp32: "a segment ends at this byte"."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.proj(h))).squeeze(-1).float()

    def init_weights(self, init_std: float, target_bytes_per_segment: float) -> None:
        """Small weights, and an output bias that starts the boundary rate at 1/target."""
        nn.init.trunc_normal_(self.proj.weight, std=init_std)
        nn.init.zeros_(self.proj.bias)
        nn.init.trunc_normal_(self.out.weight, std=init_std)
        rate = min(1.0 / target_bytes_per_segment, 1.0 - 1e-6)
        nn.init.constant_(self.out.bias, math.log(rate / (1.0 - rate)))


@dataclass
class Segmentation:
    """One batch's segmentation (shapes: B rows, T bytes, S = largest segment count).

    boundaries:    (B, T) bool, final hard boundaries (a segment ends at t)
    seg_id:        (B, T) int64, segment holding byte t
    pos_in_seg:    (B, T) int64, 0-based position of byte t inside its segment
    ste:           (B, T) fp32, value 0; carries the straight-through gradient of the soft segment index
    probs:         (B, T) fp32, predictor probabilities p_t (no noise)
    decided:       (B, T) bool, positions whose boundary the predictor chose (not forced by specials)
    ends:          (B, S) int64, last byte of each segment (arbitrary for missing segments)
    seg_valid:     (B, S) bool, the segment exists in that row
    seg_real:      (B, S) bool, the segment exists and holds real (non-PAD) bytes
    num_segments:  S (a host int)
    """

    boundaries: torch.Tensor
    seg_id: torch.Tensor
    pos_in_seg: torch.Tensor
    ste: torch.Tensor
    probs: torch.Tensor
    decided: torch.Tensor
    ends: torch.Tensor
    seg_valid: torch.Tensor
    seg_real: torch.Tensor
    num_segments: int


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


def segment_bytes(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    training: bool,
    temperature: float,
    max_segment_bytes: int,
    noise_keys: torch.Tensor | None = None,
) -> Segmentation:
    """Boundaries from predictor ``logits (B, T)`` and the bytes, with forced boundaries and STE.

    Training noise comes from ``keyed_uniform(noise_keys)`` when keys are given (one per row),
    else from torch's global RNG.
    """
    B, T = input_ids.shape
    device = input_ids.device
    probs = torch.sigmoid(logits)
    if training:
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
    base = ((soft > 0.5) & ~is_pad) | special

    # Length cap: every max_segment_bytes-th byte after the previous boundary.
    idx = torch.arange(T, device=device)
    run = idx - _previous_boundary(base)  # 1-based position since the previous base boundary
    capped = run % max_segment_bytes == 0
    boundaries = base | capped

    decided = ~special & ~is_pad
    delta = torch.where(decided & ~capped, soft - soft.detach(), torch.zeros_like(soft))
    ste = _exclusive_cumsum(delta)

    seg_id = _exclusive_cumsum(boundaries.long())
    pos_in_seg = idx - _previous_boundary(boundaries) - 1
    n_segments = boundaries.sum(dim=1)  # (B,) the last byte always ends a segment
    S = int(n_segments.max())  # the one host sync of the forward pass
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
        decided=decided,
        ends=ends,
        seg_valid=seg_valid,
        seg_real=seg_real,
        num_segments=S,
    )


def downsample(x: torch.Tensor, seg: Segmentation) -> torch.Tensor:
    """x (B, T, dim) -> s (B, S, dim): each segment is the mean of its bytes (zero for missing ones)."""
    S = seg.num_segments
    member = seg.seg_id[:, None, :] == torch.arange(S, device=x.device)[None, :, None]  # (B, S, T)
    w = member.float() * (1.0 + seg.ste[:, None, :])  # value = membership, gradient via the STE
    count = w.sum(dim=-1, keepdim=True)  # (B, S, 1)
    w = w / torch.where(member.any(dim=-1, keepdim=True), count, torch.ones_like(count))
    return torch.bmm(w.to(x.dtype), x)


def upsample(y: torch.Tensor, seg: Segmentation) -> torch.Tensor:
    """y (B, S, dim) -> (B, T, dim): byte t gets y of segment ``seg_id[t] - 1`` (zero for segment 0)."""
    S = seg.num_segments
    source = (seg.seg_id - 1)[:, :, None] == torch.arange(S, device=y.device)[None, None, :]  # (B, T, S)
    u = source.float() * (1.0 + seg.ste[:, :, None])
    return torch.bmm(u.to(y.dtype), y)


def boundary_loss(seg: Segmentation, target_bytes_per_segment: float) -> torch.Tensor:
    """FlexiTokens hinge: mean over rows of relu(rate - 1/target).

    ``rate`` is the mean predictor probability p_t over the positions it decides (real bytes
    that are not BOS/EOS or next to a PAD run): the expected boundary rate, smooth in the
    predictor's parameters. It only penalises too many boundaries, leaving the model free to
    compress more than the target.
    """
    m = seg.decided.float()
    rate = (seg.probs * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
    return torch.relu(rate - 1.0 / target_bytes_per_segment).mean()
