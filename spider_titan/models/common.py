"""Building blocks shared by the models: attention through SDPA, SwiGLU, the pre-norm block, RoPE
and the initialisation scales. The contract a model fulfils is in ``spider_titan/protocol.py``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

# SDPA backends, most preferred first. FlashAttention needs q, k and v of one head dim, so MLA's
# (qk 192, v 128) would fall through to math with torch's default order on some builds; cuDNN and
# the memory-efficient kernel take unequal dims. On CPU only flash (CPU) and math apply.
# GPU figures per backend: scripts/benchmark.py attention (docs/benchmarks.md).
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
