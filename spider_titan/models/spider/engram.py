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

:class:`ByteNgrams` is the byte-level sibling (BLT's hash n-gram embeddings, Pagnoni et al. 2024): for
each order n, a table row keyed by the same polynomial hash of the n bytes ending at a byte (the row's
start counting as byte 0), added to the byte's embedding before the prelude.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

_P = 2**31 - 1
_BASE = 1_000_003
_PAIR = 1_000_000_007 % _P
_MIX = (1_103_515_245, 2_654_435_761 % _P)
_ADD = (12_345, 40_503)


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
        e = torch.cat([self.table1(bucket_ids[..., 0]), self.table2(bucket_ids[..., 1])], dim=-1).to(dtype)
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


class ByteNgrams(nn.Module):
    """``forward(input_ids (B, T), first) -> (B, T - first, dim)``: for each byte from ``first`` on, the
    sum over ``orders`` of a row of that order's table, keyed by a hash of the n bytes ending at the byte
    (bytes before the row's start hash as 0). Tables start at zero; the hash reads no later byte."""

    def __init__(self, orders: list[int], n_buckets: int, dim: int):
        super().__init__()
        self.orders = sorted(orders)
        self.n_buckets = n_buckets
        self.tables = nn.ModuleList(nn.Embedding(n_buckets, dim) for _ in self.orders)

    def bucket_ids(self, input_ids: torch.Tensor, first: int = 0) -> torch.Tensor:
        """(B, T - first, len(orders)) int64 bucket ids of the bytes ``input_ids[:, first:]``."""
        span = self.orders[-1] - 1  # bytes before a byte that its longest n-gram reads
        lo = max(first - span, 0)
        src = F.pad(input_ids[:, lo:].long() + 1, (span - (first - lo), 0))  # src[:, k] = byte first - span + k
        T = input_ids.shape[1] - first
        h = torch.zeros_like(src[:, :T])
        out = []
        for j in range(self.orders[-1]):  # h: the hash of the j + 1 bytes ending at each byte
            h = (h + src[:, span - j : span - j + T] * pow(_BASE, j, _P)) % _P
            if j + 1 in self.orders:
                mix = (_MIX[0] * (j + 2)) % _P
                out.append((h * mix + _ADD[0] + j) % _P % self.n_buckets)
        return torch.stack(out, dim=-1)

    def forward(self, input_ids: torch.Tensor, first: int = 0) -> torch.Tensor:
        ids = self.bucket_ids(input_ids, first)
        return sum(table(ids[..., i]) for i, table in enumerate(self.tables))

    def init_weights(self) -> None:
        for table in self.tables:
            nn.init.zeros_(table.weight)
