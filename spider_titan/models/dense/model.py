"""The ``dense`` baseline: a byte-level Llama-style decoder, the yardstick Spider is compared with.

Pre-RMSNorm blocks of grouped-query causal attention (RoPE, SDPA) and a SwiGLU MLP over the
272-id byte vocabulary of docs/model.md; untied lm_head. Built on the meta device, then
``init_weights()`` (trunc-normal 0.02, residual outputs scaled by depth as in GPT-2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from spider_titan.models.common import (
    ByteNgrams,
    PreNormBlock,
    apply_rope,
    byte_ngram_problems,
    causal_sdpa,
    depth_scaled_std,
    hashed_byte_ngrams,
    rope_frequencies,
)
from spider_titan.protocol import Acceleration, ModelOutput, ModelSpec, SavedArgs, Training, lm_loss_mean
from spider_titan.vocab import VOCAB_SIZE


@dataclass
class DenseArgs:
    dim: int = 128
    """Model width."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Query heads."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide n_heads."""
    inter_dim: int = 352
    """SwiGLU hidden width."""
    max_seq_len: int = 8192
    """Longest sequence the RoPE table covers."""
    rope_theta: float = 10000.0
    """RoPE base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    byte_ngram_orders: list[int] = field(default_factory=list)
    """n-gram lengths (each >= 2) whose hashed embedding tables add to each byte's embedding (BLT); empty: none."""
    byte_ngram_buckets: int = 8192
    """Rows of each byte n-gram table (one table of ``dim`` columns per order)."""
    byte_ngram_lr: float = 8.0
    """The n-gram tables' learning rate over the optimizer's (as Spider's ``byte_ngram_lr``)."""

    def validate(self) -> list[str]:
        out = []
        if self.dim % self.n_heads:
            out.append(f"dim: {self.dim} is not divisible by n_heads ({self.n_heads})")
        elif (self.dim // self.n_heads) % 2:
            out.append(f"dim / n_heads = {self.dim // self.n_heads} must be even for RoPE")
        if self.n_heads % self.n_kv_heads:
            out.append(f"n_kv_heads: {self.n_kv_heads} must divide n_heads ({self.n_heads})")
        return out + byte_ngram_problems(self.byte_ngram_orders, self.byte_ngram_lr)


DENSE_FLAVORS = {
    # Spider debug's partner, with its hashed byte n-grams (``hashed_byte_ngrams``).
    "debug": DenseArgs(**hashed_byte_ngrams(2048)),
    # ~4x debug's training FLOPs per byte (4.07x at seq 256), the dense partner of Spider's "small", with
    # the same hashed byte n-grams.
    "small": DenseArgs(dim=256, inter_dim=832, **hashed_byte_ngrams(32768)),
    # Spider "medium"'s partner (issue 74): every width of `small` doubled (dim 512, 128-wide heads as 1B's, SwiGLU
    # 1664), 10 blocks (Spider medium's 2 + 6 + 2), `small`'s byte n-grams; 2.09e8 training FLOPs per byte at
    # seq 256, 1.12x Spider medium's at its 6 loops and 4 bytes per segment; 134.4 M parameters (100.7 M n-gram tables).
    "medium": DenseArgs(dim=512, n_layers=10, n_heads=4, n_kv_heads=2, inter_dim=1664, **hashed_byte_ngrams(32768)),
    # 22 blocks of (GQA 16/4 heads: 10.5 M) + (SwiGLU 5632: 34.6 M) = 992 M, + embeddings/head 1.1 M.
    "1B": DenseArgs(dim=2048, n_layers=22, n_heads=16, n_kv_heads=4, inter_dim=5632),
}


class Attention(nn.Module):
    def __init__(self, args: DenseArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        out = causal_sdpa(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=self.n_heads != self.n_kv_heads
        )  # (B, H, T, hd)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))

    def init_weights(self, init_std: float, out_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, std=init_std)
        nn.init.trunc_normal_(self.wo.weight, std=out_std)


class DenseModel(nn.Module):
    def __init__(self, args: DenseArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(VOCAB_SIZE, args.dim)
        self.byte_ngrams = (
            ByteNgrams(args.byte_ngram_orders, args.byte_ngram_buckets, args.dim, args.byte_ngram_lr)
            if args.byte_ngram_orders
            else None
        )
        self.layers = nn.ModuleList(
            PreNormBlock(Attention(args), args.dim, args.inter_dim, args.norm_eps) for _ in range(args.n_layers)
        )
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.lm_head = nn.Linear(args.dim, VOCAB_SIZE, bias=False)
        self.register_buffer("freqs", self._freqs(), persistent=False)

    def _freqs(self) -> torch.Tensor:
        return rope_frequencies(self.args.dim // self.args.n_heads, self.args.max_seq_len, self.args.rope_theta)

    def init_weights(self) -> None:
        """Initialise every parameter and buffer in place (after ``to_empty``)."""
        with torch.device(self.embed_tokens.weight.device):
            self.freqs = self._freqs()
        nn.init.normal_(self.embed_tokens.weight, std=1.0)
        if self.byte_ngrams is not None:
            self.byte_ngrams.init_weights()
        out_std = depth_scaled_std(self.args.n_layers)
        for block in self.layers:
            block.init_weights(0.02, out_std)
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.lm_head.weight, std=self.args.dim**-0.5)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, sample_ids: torch.Tensor | None = None
    ) -> ModelOutput:
        """``sample_ids`` is part of the model contract (keys for training noise); this model draws none."""
        t = input_ids.shape[1]
        if t > self.args.max_seq_len:
            raise ValueError(f"sequence length {t} > max_seq_len {self.args.max_seq_len}; raise model.max_seq_len")
        h = self.embed_tokens(input_ids)
        if self.byte_ngrams is not None:
            h = h + self.byte_ngrams(input_ids).to(h.dtype)
        freqs = self.freqs[:t]
        for block in self.layers:
            h = block(h, freqs)
        logits = self.lm_head(self.norm(h))
        aux_loss = logits.new_zeros((), dtype=torch.float32)
        loss, aux = None, {}
        if labels is not None:
            loss = lm_loss_mean(logits, labels)
            aux["lm_loss"] = loss.detach()
        return ModelOutput(logits=logits, loss=loss, aux_loss=aux_loss, aux=aux)


def dense_flops_per_token(args: DenseArgs, seq_len: int, **_) -> float:
    """Training FLOPs (fwd + bwd = 3x forward) per token: 6 * matmul params + causal attention.

    Causal attention is counted halved (QK^T and PV over ~T^2/2 unmasked pairs, what a causal
    flash kernel computes): the convention of Spider's ``spider_flops_per_byte`` too, so the two
    models' FLOPs compare like for like.
    """
    hd = args.dim // args.n_heads
    per_layer = args.dim * hd * (2 * args.n_heads + 2 * args.n_kv_heads) + 3 * args.dim * args.inter_dim
    matmul_params = args.n_layers * per_layer + args.dim * VOCAB_SIZE
    # causal attention: QK^T and PV, each 2*T*hd per head per token, halved by the mask
    attn = args.n_layers * 2 * 2 * args.n_heads * hd * seq_len / 2
    return 6 * matmul_params + 3 * attn


DENSE_SPEC = ModelSpec(
    name="dense",
    args_cls=DenseArgs,
    flavors=DENSE_FLAVORS,
    model_cls=DenseModel,
    block_containers=("layers",),
    flops_per_token=dense_flops_per_token,
    training=Training(max_seq_len=lambda a: a.max_seq_len),
    saved=SavedArgs(added={"byte_ngram_orders": [], "byte_ngram_buckets": 8192, "byte_ngram_lr": 1.0}),
    acceleration=Acceleration(float8_skip_fqns=("lm_head",)),  # the output projection stays high precision
)
