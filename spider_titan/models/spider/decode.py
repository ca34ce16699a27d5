"""Incremental decoding for Spider: each new byte costs one byte's work, not the whole context's.

    cache = new_cache(model, batch_size, n_loops=None)
    logits = decode(model, ids, cache)      # ids (B, t) new bytes per row -> (B, t, vocab) logits

``decode`` equals the full forward's logits at those positions (eval mode; fp32 within 1e-5,
tests/unit/test_decode_cache.py) and runs the model's own modules and functions, with caches:

* byte blocks (prelude, coda): a key/value cache per MLA layer (``attention.KVCache``);
* segmentation: the boundary predictor's raw score of the new byte from it and the byte before
  (``BoundaryPredictor.raw_score``), the row's raw scores kept, then the same ``segment_bytes`` as
  training over the row so far. A boundary after byte t-1 is final once byte t is known (the
  forced boundaries look one byte ahead: before BOS, around PAD runs), so a segment is handed to
  the core when the byte after it arrives;
* the core: a key/value cache per (loop, block), fed one segment at a time (its mean of the
  prelude states, ``downsample``, and its Engram ids, ``engram_bucket_ids``, over the row so far);
  ``up_proj`` of the newest segment handed over is what the next bytes read (byte t reads the
  segment that ended before its own began);
* H-Net's chunk-start convention (``chunk_convention = "first"``): a segment is its first byte's
  state and its bytes read its own output, so a segment goes to the core as soon as its first byte
  is known to open it (the boundary after the byte before is final), with the Engram ids of the
  segment before it, as in the full forward;
* H-Net's dechunk smoothing (``dechunk_smoothing``): the EMA over the segments' outputs is carried
  from one segment to the next (``P_k`` from ``segment_start_probs``);
* per-row state: rows may hold different lengths, so each row has its own caches and a batch is
  decoded row by row (the per-byte work is small matrices either way on a CPU).

``n_loops`` (test-time depth) is fixed per cache. ACT halting is not decoded here (``new_cache``
raises ValueError); generation then falls back to recomputing the context (generation.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spider_titan.models.common import rope_frequencies
from spider_titan.models.spider.attention import KVCache
from spider_titan.models.spider.engram import engram_bucket_ids
from spider_titan.models.spider.model import Spider
from spider_titan.models.spider.segmentation import (
    downsample,
    downsample_first,
    segment_bytes,
    segment_start_probs,
    space_boundary_logits,
)


def unsupported(model: Spider) -> str | None:
    """Why ``model`` cannot be decoded incrementally (None when it can)."""
    a = model.args
    if a.halting != "none":
        return "halting = 'act'"
    return None


@dataclass
class RowCache:
    """One row's state: its bytes, prelude states and raw boundary scores so far, and the caches."""

    prelude: list[KVCache]
    coda: list[KVCache]
    core: list[list[KVCache]]  # [loop][block]
    ids: list[int] = field(default_factory=list)
    states: list[torch.Tensor] = field(default_factory=list)  # prelude outputs, (1, 1, width) each
    scores: list[torch.Tensor] = field(default_factory=list)  # raw boundary scores, (1, 1) each
    closed: int = 0  # segments handed to the core
    context: torch.Tensor | None = None  # up_proj of the newest segment handed over (smoothed), (1, 1, width)


@dataclass
class SpiderCache:
    rows: list[RowCache]
    n_loops: int
    freqs: torch.Tensor  # RoPE table up to max_seq_len

    @property
    def length(self) -> list[int]:
        """Bytes each row holds."""
        return [len(r.ids) for r in self.rows]


def new_cache(model: Spider, batch_size: int, n_loops: int | None = None) -> SpiderCache:
    """Empty caches for ``batch_size`` rows decoded at ``n_loops`` core loops (default: the trained)."""
    why = unsupported(model)
    if why is not None:
        raise ValueError(f"cached decoding does not cover {why}; recompute the context instead")
    a = model.args
    n_loops = a.n_loops if n_loops is None else int(n_loops)
    if not 1 <= n_loops <= a.max_loops:
        raise ValueError(f"n_loops: {n_loops} must be in [1, max_loops={a.max_loops}]")
    device = next(model.parameters()).device
    rows = [
        RowCache(
            prelude=[KVCache() for _ in model.prelude.layers],
            coda=[KVCache() for _ in model.coda.layers],
            core=[[KVCache() for _ in model.core.layers] for _ in range(n_loops)],
        )
        for _ in range(batch_size)
    ]
    freqs = rope_frequencies(a.qk_rope_head_dim, a.max_seq_len, a.rope_theta, device=device)
    return SpiderCache(rows=rows, n_loops=n_loops, freqs=freqs)


@torch.no_grad()
def decode(model: Spider, ids: torch.Tensor, cache: SpiderCache, lengths: list[int] | None = None) -> torch.Tensor:
    """Append ``ids (B, t)`` to the rows of ``cache``; their logits (B, t, vocab), as the full forward.

    ``lengths`` (one per row, <= t): append only the first ``lengths[i]`` ids of row i (prompts of
    different lengths in one batch); the logits past a row's length are zero."""
    if ids.dim() != 2 or ids.shape[0] != len(cache.rows):
        raise ValueError(f"decode: ids must be (batch={len(cache.rows)}, t), got {tuple(ids.shape)}")
    lengths = [ids.shape[1]] * ids.shape[0] if lengths is None else list(lengths)
    out = torch.zeros(*ids.shape, model.lm_head.out_features, device=cache.freqs.device)
    for i, row in enumerate(cache.rows):
        for j, b in enumerate(ids[i, : lengths[i]].tolist()):
            out[i, j] = _step(model, cache, row, b)[0, 0]
    return out


def _step(model: Spider, cache: SpiderCache, row: RowCache, byte: int) -> torch.Tensor:
    """One byte through the model with ``row``'s caches: its logits (1, 1, vocab)."""
    a = model.args
    pos = len(row.ids)
    if pos >= a.max_seq_len:
        raise ValueError(f"decode: the row holds max_seq_len = {a.max_seq_len} bytes; start a new cache")
    device = cache.freqs.device
    row.ids.append(byte)
    freqs = cache.freqs[pos : pos + 1]
    x = model.prelude(model.embed_tokens(torch.tensor([[byte]], device=device)), freqs, row.prelude)
    row.states.append(x)
    ids = torch.tensor([row.ids], device=device)
    _close_segments(model, cache, row, ids)
    y = row.context if row.context is not None else torch.zeros_like(x)
    x = (x if model.residual_proj is None else model.residual_proj(x)) + y
    return model.lm_head(model.norm(model.coda(x, freqs, row.coda)))


def _boundary_logits(model: Spider, row: RowCache, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The row's boundary logits so far (1, T) and the length cap, as Spider.forward computes them."""
    a = model.args
    T = ids.shape[1]
    if a.boundary_predictor == "fixed":
        return torch.full((1, T), -30.0, device=ids.device), max(
            1, min(a.max_segment_bytes, round(a.target_bytes_per_segment))
        )
    if a.boundary_predictor == "space":
        return space_boundary_logits(ids, chunk_start=a.chunk_convention == "first"), a.max_segment_bytes
    last_two = torch.cat(row.states[-2:], dim=1)  # h_{t-1}, h_t
    row.scores.append(model.boundary_predictor.raw_score(last_two)[:, -1:])
    return model.boundary_predictor.logits(torch.cat(row.scores, dim=1)), a.max_segment_bytes


def _close_segments(model: Spider, cache: SpiderCache, row: RowCache, ids: torch.Tensor) -> None:
    """Hand the core every segment that is now final: under the mean convention those that ended
    before the newest byte, under ``first`` also the one the newest byte opens."""
    a = model.args
    first = a.chunk_convention == "first"
    logits, cap = _boundary_logits(model, row, ids)
    T = ids.shape[1]
    if T < 2 and not first:
        return
    seg = segment_bytes(
        logits, ids, training=False, temperature=a.boundary_temperature, max_segment_bytes=cap, chunk_start=first
    )
    final = int((seg.ends[0, : seg.num_segments] <= T - 2).sum())  # segments that ended before byte T-1
    if first:
        final += 1  # the segment byte T-1 belongs to starts at or before it: its first byte is known
    if final <= row.closed:
        return
    states = torch.cat(row.states, dim=1)  # (1, T, width)
    pooled = downsample_first(states, seg) if first else downsample(states, seg)  # (1, S, width)
    buckets = engram_bucket_ids(ids, seg, a.engram_buckets, a.max_segment_bytes)  # (1, S, 2)
    if first:  # chunk k hashes chunk k - 1, the last complete one (Spider.forward)
        buckets = torch.nn.functional.pad(buckets[:, :-1], (0, 0, 1, 0))
    start_probs = segment_start_probs(seg).float().clamp(1e-4, 1.0 - 1e-4) if a.dechunk_smoothing else None
    ones = torch.ones(1, 1, dtype=torch.bool, device=ids.device)
    for k in range(row.closed, final):
        out = model.core(
            pooled[:, k : k + 1],
            n_loops=cache.n_loops,
            freqs=cache.freqs[k : k + 1],
            bucket_ids=buckets[:, k : k + 1],
            seg_real=ones,
            seg_valid=ones,
            early_exit=False,
            caches=row.core,
        )
        y = model.up_proj(out.output)
        if start_probs is not None:  # smooth_segments, one step: out_k = P_k y_k + (1 - P_k) out_{k-1}
            p = start_probs[0, k]
            prev = torch.zeros_like(y, dtype=torch.float32) if row.context is None else row.context.float()
            y = (p * y.float() + (1.0 - p) * prev).to(y.dtype)
        row.context = y
    row.closed = final
