"""Incremental decoding for Spider: each new byte costs one byte's work, not the whole context's.

    cache = new_cache(model, batch_size, n_loops=None)
    logits = decode(model, ids, cache)      # ids (B, t) new bytes per row -> (B, t, vocab) logits

``decode`` equals the full forward's logits at those positions (eval mode; fp32 within 1e-5,
tests/unit/test_decode_cache.py) and runs the model's own modules and its Chunker, with caches:

* byte blocks (prelude, coda): a key/value cache per MLA layer (``attention.KVCache``);
* segmentation: the boundary predictor's raw score of the new byte from it and the byte before
  (``BoundaryPredictor.raw_score``), the row's raw scores kept, then the Chunker's ``segment`` over the
  row's open tail (two closed segments and what follows: ``_close_segments``). A boundary is final
  once the byte after it is known (the forced boundaries look one byte ahead), so the Chunker says
  which segments are final (``final_segments``) and each goes to the core once, with its vector and
  Engram ids as the full forward computes them;
* the core: a key/value cache per (loop, block), fed the newly final segments together; ``up_proj`` of
  the newest segment handed over (smoothed by one step of the Chunker's EMA) is what the next bytes read;
* per-row state: rows may hold different lengths, so each row has its own caches and a batch is
  decoded row by row (the per-byte work is small matrices either way on a CPU).

``n_loops`` (test-time depth) is fixed per cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spider_titan.models.common import GrowingTensor, rope_frequencies
from spider_titan.models.spider.attention import KVCache
from spider_titan.models.spider.model import Spider
from spider_titan.models.spider.segmentation import segment_starts


def unsupported(model: Spider) -> str | None:
    """Why ``model`` cannot be decoded incrementally (None when it can): every Spider can."""
    return None


@dataclass
class RowCache:
    """One row's state: its bytes, prelude states and raw boundary scores so far, and the caches."""

    prelude: list[KVCache]
    coda: list[KVCache]
    core: list[list[KVCache]]  # [loop][block]
    ids: GrowingTensor = field(default_factory=lambda: GrowingTensor(dim=1))  # the bytes (1, T) int64
    states: GrowingTensor = field(default_factory=lambda: GrowingTensor(dim=1))  # prelude outputs (1, T, width)
    scores: GrowingTensor = field(default_factory=lambda: GrowingTensor(dim=1))  # raw boundary scores (1, T)
    closed: int = 0  # segments handed to the core
    starts: list[int] = field(default_factory=list)  # the first byte of each segment handed over
    context: torch.Tensor | None = None  # up_proj of the newest segment handed over (smoothed), (1, 1, width)


@dataclass
class SpiderCache:
    rows: list[RowCache]
    n_loops: int
    freqs: torch.Tensor  # RoPE table up to max_seq_len
    columns: int = 0  # id columns a caller fed, padding included (the transformers wrapper's count)

    @property
    def length(self) -> list[int]:
        """Bytes each row holds."""
        return [r.ids.length for r in self.rows]


def new_cache(model: Spider, batch_size: int, n_loops: int | None = None) -> SpiderCache:
    """Empty caches for ``batch_size`` rows decoded at ``n_loops`` core loops (default: the trained)."""
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
    different lengths in one batch); the logits past a row's length are zero. A row's new ids go
    through the model together (a prompt is one forward, not one per byte)."""
    if ids.dim() != 2 or ids.shape[0] != len(cache.rows):
        raise ValueError(f"decode: ids must be (batch={len(cache.rows)}, t), got {tuple(ids.shape)}")
    lengths = [ids.shape[1]] * ids.shape[0] if lengths is None else list(lengths)
    out = torch.zeros(*ids.shape, model.lm_head.out_features, device=cache.freqs.device)
    for i, row in enumerate(cache.rows):
        if lengths[i] > 0:
            out[i, : lengths[i]] = _extend(model, cache, row, ids[i : i + 1, : lengths[i]])[0]
    return out


def _extend(model: Spider, cache: SpiderCache, row: RowCache, new: torch.Tensor) -> torch.Tensor:
    """The bytes ``new (1, t)`` through the model with ``row``'s caches: their logits (1, t, vocab)."""
    a = model.args
    pos, t = row.ids.length, new.shape[1]
    if pos + t > a.max_seq_len:
        raise ValueError(f"decode: {pos} + {t} bytes exceed max_seq_len = {a.max_seq_len}; start a new cache")
    freqs = cache.freqs[pos : pos + t]
    ids = row.ids.append(new)  # (1, T)
    x = model.prelude(model.embed(ids, pos), freqs, row.prelude)  # (1, t, dim)
    row.states.append(x)
    x = model.residual_proj(x) + _close_segments(model, cache, row, ids, t)
    return model.lm_head(model.norm(model.coda(x, freqs, row.coda)))


def _boundary_logits(model: Spider, row: RowCache, ids: torch.Tensor, t: int) -> torch.Tensor:
    """The row's boundary logits so far (1, T), as ``Chunker.logits`` computes them over the whole
    row, after its last ``t`` bytes were appended."""
    if model.boundary_predictor is None:  # constant logits: any (1, T, dim) view gives their shape, no copy
        return model.chunker.logits(None, row.states.view()[:, -1:].expand(-1, ids.shape[1], -1))
    states = row.states.view()
    recent = states[:, max(states.shape[1] - t - 1, 0) :]  # the new states and h_{t-1} of the first
    scores = row.scores.append(model.boundary_predictor.raw_score(recent)[:, -t:])
    return model.boundary_predictor.logits(scores)


def _close_segments(model: Spider, cache: SpiderCache, row: RowCache, ids: torch.Tensor, t: int) -> torch.Tensor:
    """Hand the core every segment that is now final (``Chunker.final_segments``), all at once; what
    each of the row's last ``t`` bytes reads from the core (1, t, width): the smoothed output of the
    newest segment final at that byte (zeros before the first).

    The Chunker runs on a window of the row, not the whole row: from the first byte of the segment
    two before the first open one (a boundary there is final, so the window segments as the row
    does; the two segments give the Engram's order-2 hash and the smoothing weight, which read
    the segment before, their history), to the last byte. Only the logits see the whole row.
    A segment final at byte p stays so (a boundary is final once the byte after it is known), so
    the window's segmentation gives every new byte its segment, whichever byte the window ends at."""
    chunker = model.chunker
    logits = _boundary_logits(model, row, ids, t)
    first = max(row.closed - 2, 0)  # the window's first segment, in row numbering
    start = row.starts[first] if first else 0  # its first byte
    window = ids[:, start:]
    seg = chunker.segment(logits[:, start:], window)
    final = first + chunker.final_segments(seg, window.shape[1])
    newest = [row.context]  # the smoothed output of segment closed - 1 onwards (None: before segment 0)
    if final > row.closed:
        j0, j1 = row.closed - first, final - first  # the newly final segments, in the window
        states = row.states.view()[:, start:]
        out = model.core(
            chunker.pool(states, seg)[:, j0:j1],
            n_loops=cache.n_loops,
            freqs=cache.freqs[row.closed : final],
            bucket_ids=chunker.engram_ids(window, seg)[:, j0:j1],
            seg_real=torch.ones(1, j1 - j0, dtype=torch.bool, device=ids.device),
            caches=row.core,
        )
        up = model.up_proj(out.output)  # (1, n, width)
        smoothing = chunker.smoothing(seg)  # (1, S_window) or None
        for i in range(j1 - j0):
            p = None if smoothing is None else smoothing[0, j0 + i]
            newest.append(chunker.smooth_step(p, up[:, i : i + 1], newest[-1]))
        row.starts.extend((segment_starts(seg) + start)[0, j0:j1].tolist())
    # the newest segment final at each new byte, counted from segment closed - 1 (index 0 of newest)
    final_at = seg.seg_id[0, -t:] + (first - row.closed + int(chunker.chunk_start))
    row.closed, row.context = final, newest[-1]
    zeros = torch.zeros_like(row.states.view()[:, :1])
    table = torch.cat([zeros if y is None else y for y in newest], dim=1)  # (1, 1 + n, width)
    return table[:, final_at]
