"""Building blocks shared by the models: attention through SDPA, SwiGLU, the pre-norm block, RoPE
and the initialisation scales. The contract a model fulfils is in ``spider_titan/protocol.py``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from spider_titan.quantization.weight_only import is_quantized

# SDPA backends, most preferred first. FlashAttention needs q, k and v of one head dim, so MLA's
# (qk 192, v 128) would fall through to math with torch's default order on some builds; cuDNN and
# the memory-efficient kernel take unequal dims. On CPU only flash (CPU) and math apply.
# GPU figures per backend: python -m lab.bench.benchmark attention (docs/benchmarks.md).
SDPA_PRIORITY = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """Causal ``scaled_dot_product_attention`` of (B, H, T, d) tensors under :data:`SDPA_PRIORITY`
    (the first backend that accepts the shapes runs; torch.compile traces the choice)."""
    with sdpa_kernel(SDPA_PRIORITY, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)


class SwiGLU(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, std=init_std)
        nn.init.trunc_normal_(self.w3.weight, std=init_std)
        nn.init.trunc_normal_(self.w2.weight, std=out_std)


class PreNormBlock(nn.Module):
    """Pre-RMSNorm transformer block around any attention ``attention(x, freqs)``:
    ``x += attention(attention_norm(x), freqs); x += feed_forward(ffn_norm(x))`` (SwiGLU).

    The attention module provides ``init_weights(init_std, out_std)`` like SwiGLU does.
    """

    def __init__(self, attention: nn.Module, dim: int, inter_dim: int, norm_eps: float):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.attention = attention
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.feed_forward = SwiGLU(dim, inter_dim)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, cache=None) -> torch.Tensor:
        """``cache``: the attention's key/value cache for incremental decoding (attentions that take one)."""
        extra = {} if cache is None else {"cache": cache}
        x = x + self.attention(self.attention_norm(x), freqs, **extra)
        return x + self.feed_forward(self.ffn_norm(x))

    def init_weights(self, init_std: float, out_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.attention.init_weights(init_std, out_std)
        self.ffn_norm.reset_parameters()
        self.feed_forward.init_weights(init_std, out_std)


class GrowingTensor:
    """A tensor appended to along ``dim`` (decoding caches), in a buffer that doubles when full: an
    append copies only the new positions, not everything held (``torch.cat`` would, every byte)."""

    def __init__(self, dim: int):
        self.dim, self.length = dim, 0
        self.buffer: torch.Tensor | None = None

    def append(self, x: torch.Tensor) -> torch.Tensor:
        """Append ``x`` along ``dim``; returns a view of everything held."""
        end = self.length + x.shape[self.dim]
        if self.buffer is None or end > self.buffer.shape[self.dim]:
            held = 0 if self.buffer is None else self.buffer.shape[self.dim]
            shape = list(x.shape)
            shape[self.dim] = max(end, 2 * held, 64)
            grown = x.new_empty(shape)
            if self.buffer is not None:
                grown.narrow(self.dim, 0, self.length).copy_(self.view())
            self.buffer = grown
        self.buffer.narrow(self.dim, self.length, end - self.length).copy_(x)
        self.length = end
        return self.view()

    def view(self) -> torch.Tensor:
        """Everything appended so far (a view of the buffer)."""
        assert self.buffer is not None, "nothing appended yet"
        return self.buffer.narrow(self.dim, 0, self.length)


def rope_frequencies(head_dim: int, max_len: int, theta: float, device=None) -> torch.Tensor:
    """RoPE rotations as ``(max_len, head_dim // 2, 2)`` fp32 [cos, sin] pairs.

    Real cos/sin instead of complex numbers: inductor generates no code for complex ops, so a
    complex RoPE would fall back to eager inside every compiled block.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, T, H, D) by ``freqs`` (T, D/2, 2), or (B, T, D/2, 2) for per-row positions.

    Consecutive pairs (x[2i], x[2i+1]) are rotated by angle i, computed in fp32.
    """
    f = freqs[None, :, None] if freqs.dim() == 3 else freqs[:, :, None]  # (B|1, T, 1, D/2, 2)
    cos, sin = f[..., 0], f[..., 1]
    xp = x.float().reshape(*x.shape[:-1], -1, 2)
    x0, x1 = xp[..., 0], xp[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).type_as(x)


def default_init_std(dim: int) -> float:
    """Std for input projections: 0.02, the GPT-2/Llama convention."""
    return 0.02


def depth_scaled_std(n_layers: int) -> float:
    """Std for residual output projections, scaled by depth (GPT-2: 0.02 / sqrt(2 * n_layers))."""
    return 0.02 / math.sqrt(2 * max(1, n_layers))


# Integer hashing of bytes, identical on every device: a polynomial in HASH_BASE modulo the Mersenne prime
# HASH_PRIME (every product of two residues fits in int64), buckets by ``(h * mix + add) mod P mod n``.
HASH_PRIME = 2**31 - 1
HASH_BASE = 1_000_003
HASH_MIX = 1_103_515_245
HASH_ADD = 12_345


def hashed_byte_ngrams(buckets: int) -> dict:
    """Hashed byte n-grams of lengths 3-8 with ``buckets`` rows per length: one setting per flavor, shared by
    Spider and dense so that the two compare with the same input embeddings (lab/DECISIONS.md,
    ``byte_ngram_orders`` and ``byte_ngram_buckets``: debug's 2,048 and ``small``'s 32,768 each)."""
    return {"byte_ngram_orders": [3, 4, 5, 6, 7, 8], "byte_ngram_buckets": buckets}


def byte_ngram_problems(orders: list[int], lr: float = 1.0) -> list[str]:
    """The rules of a model's ``byte_ngram_orders`` and ``byte_ngram_lr``, one line each broken (the args'
    ``validate``)."""
    out = []
    if not (all(n >= 2 for n in orders) and len(set(orders)) == len(orders)):
        out.append(
            f"byte_ngram_orders: {orders}: give distinct lengths of at least 2 (length 1 is the byte embedding itself)"
        )
    if not 0 < lr < float("inf"):
        out.append(f"byte_ngram_lr: {lr} must be a finite number > 0")
    return out


def embedding_rows(table: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """``table(ids)``. A table an int8 / int4 export quantized (quantization/weight_only.py) dequantizes only
    the rows ``ids`` read; torchao's own embedding dequantizes the whole table at every lookup."""
    weight = table.weight
    if not is_quantized(weight):
        return table(ids)
    # torchao's subclasses hold data, scales and zero points with one row per table row: take the rows read
    rows = weight._apply_fn_to_data(lambda t: t[ids.flatten()]).dequantize()
    return rows.view(*ids.shape, rows.shape[-1])


class ByteNgrams(nn.Module):
    """Hashed byte n-gram embeddings (BLT, Pagnoni et al. 2024), added to the byte embeddings.

    ``forward(input_ids (B, T), first) -> (B, T - first, dim)``: for each byte from ``first`` on, the
    sum over ``orders`` of a row of that order's table, keyed by a hash of the n bytes ending at the byte
    (bytes before the row's start hash as 0). Tables start at zero; the hash reads no later byte.
    ``lr_multiplier``: the tables' learning rate over the model's (optim.optimizers reads it): a row gets a
    gradient only in the steps whose bytes hit it."""

    def __init__(self, orders: list[int], n_buckets: int, dim: int, lr_multiplier: float = 1.0):
        super().__init__()
        self.lr_multiplier = lr_multiplier
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
            h = (h + src[:, span - j : span - j + T] * pow(HASH_BASE, j, HASH_PRIME)) % HASH_PRIME
            if j + 1 in self.orders:
                mix = HASH_MIX * (j + 2) % HASH_PRIME
                out.append((h * mix + HASH_ADD + j) % HASH_PRIME % self.n_buckets)
        return torch.stack(out, dim=-1)

    def forward(self, input_ids: torch.Tensor, first: int = 0) -> torch.Tensor:
        ids = self.bucket_ids(input_ids, first)
        return sum(embedding_rows(table, ids[..., i]) for i, table in enumerate(self.tables))

    def init_weights(self) -> None:
        for table in self.tables:
            nn.init.zeros_(table.weight)
