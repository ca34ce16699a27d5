"""Engram: hashed n-gram "conditional memory" with a context-aware gate (DeepSeek, arXiv 2601.07372).

Two lookup tables per Engram layer, ``engram_buckets x engram_dim`` each, zero-initialised (so an
Engram adds nothing until it has learned something, while its gate and projections are random and
pass gradients to the tables from the first step):

* order 1 (``table1``): keyed by a hash of the segment's own bytes;
* order 2 (``table2``): keyed by a hash of (previous segment's hash, this segment's hash).

``e = [table1[b1], table2[b2]]`` (2 * engram_dim), ``k = key_norm(key_proj(e))``,
``q = query_norm(h)``, ``alpha = sigmoid(<q, k> / sqrt(dim))``, output ``alpha * value_proj(e)``.
Only ``q`` reads the state: the keys and values depend on the segment's bytes alone, so the
recurrent core computes them once per forward (:meth:`Engram.memory`) and every loop reads them.

Hash (integer arithmetic, identical on every device, no host round trip):
``h1 = sum_j (byte_j + 1) * BASE**j  mod P`` over the segment's bytes (j = position inside the
segment, at most ``max_segment_bytes`` of them), with P = 2**31 - 1 (a Mersenne prime) so every
product of two residues fits in int64. Per-byte terms are summed per segment as differences of
an int64 prefix sum at the segment ends (exact, deterministic, no scatter).
``h2 = (h1_prev * PAIR + h1 + 1) mod P`` with ``h1_prev = 0`` before the first segment. A bucket
is ``((h * MIX + ADD) mod P) mod engram_buckets``, with different MIX constants per table. A
segment's hashes depend only on its own bytes and the previous segment's, never on later bytes.

``models.common.ByteNgrams`` is the byte-level sibling (BLT's hash n-gram embeddings) on the same hash.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from spider_titan.models.common import HASH_ADD, HASH_BASE, HASH_MIX, HASH_PRIME, embedding_rows

_P, _BASE = HASH_PRIME, HASH_BASE
_PAIR = 1_000_000_007 % _P
_MIX = (HASH_MIX, 2_654_435_761 % _P)
_ADD = (HASH_ADD, 40_503)


def _pow_mod(base: int, exp: torch.Tensor, max_exp: int) -> torch.Tensor:
    """``base ** exp mod P`` elementwise for int64 ``exp`` in [0, max_exp], by repeated squaring."""
    result = torch.ones_like(exp)
    b = base % _P
    for bit in range(max(1, max_exp.bit_length())):
        result = torch.where((exp >> bit) & 1 == 1, result * b % _P, result)
        b = b * b % _P
    return result


def engram_bucket_ids(
    input_ids: torch.Tensor, pos_in_seg: torch.Tensor, ends: torch.Tensor, n_buckets: int, max_segment_bytes: int
) -> torch.Tensor:
    """(B, T) byte ids, each byte's position in its segment (B, T) and the segments' last bytes (B, S)
    (``Segmentation.pos_in_seg`` / ``.ends``) -> (B, S, 2) int64 bucket ids (order 1, order 2) per segment."""
    terms = (input_ids.long() + 1) * _pow_mod(_BASE, pos_in_seg, max_segment_bytes) % _P  # (B, T)
    prefix = torch.cumsum(terms, dim=1)  # < T * P, exact in int64
    at_end = prefix.gather(1, ends)  # (B, S)
    h1 = (at_end - F.pad(at_end[:, :-1], (1, 0), value=0)) % _P
    h2 = (F.pad(h1[:, :-1], (1, 0), value=0) * _PAIR + h1 + 1) % _P
    b1 = (h1 * _MIX[0] + _ADD[0]) % _P % n_buckets
    b2 = (h2 * _MIX[1] + _ADD[1]) % _P % n_buckets
    return torch.stack([b1, b2], dim=-1)


class Engram(nn.Module):
    """``memory(bucket_ids (..., 2), dtype) -> (..., 2 dim)``, then per loop
    ``forward(h (B, S, dim), memory (B, S, 2 dim)) -> (B, S, dim)``, added to the residual."""

    def __init__(self, dim: int, n_buckets: int, engram_dim: int, norm_eps: float):
        super().__init__()
        self.dim = dim
        self.table1 = nn.Embedding(n_buckets, engram_dim)
        self.table2 = nn.Embedding(n_buckets, engram_dim)
        self.key_proj = nn.Linear(2 * engram_dim, dim, bias=False)
        self.value_proj = nn.Linear(2 * engram_dim, dim, bias=False)
        self.query_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.key_norm = nn.RMSNorm(dim, eps=norm_eps)

    def memory(self, bucket_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The segments' normalised keys and values, ``[key_norm(key_proj(e)), value_proj(e)]``: what
        does not depend on the state, computed once for every loop that reads it."""
        e1, e2 = embedding_rows(self.table1, bucket_ids[..., 0]), embedding_rows(self.table2, bucket_ids[..., 1])
        e = torch.cat([e1, e2], dim=-1).to(dtype)
        return torch.cat([self.key_norm(self.key_proj(e)), self.value_proj(e)], dim=-1)

    def forward(self, h: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        k, v = memory.split(self.dim, dim=-1)
        q = self.query_norm(h)
        alpha = torch.sigmoid((q * k).sum(dim=-1, keepdim=True) / math.sqrt(self.dim))
        return alpha * v

    def init_weights(self, init_std: float, out_std: float) -> None:
        nn.init.zeros_(self.table1.weight)
        nn.init.zeros_(self.table2.weight)
        nn.init.trunc_normal_(self.key_proj.weight, std=init_std)
        nn.init.trunc_normal_(self.value_proj.weight, std=out_std)
        self.query_norm.reset_parameters()
        self.key_norm.reset_parameters()
