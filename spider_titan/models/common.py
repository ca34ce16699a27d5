"""Building blocks and contracts shared by every model in spider_titan.

A model is a plain ``nn.Module`` with no distributed imports; ``forward(input_ids, labels=None,
sample_ids=None)``, where ``sample_ids`` (B,) int64 keys any training-time noise per sample
(the trainer passes global sample indices, so noise does not depend on the parallel layout). It is described to the rest of
the framework by a :class:`ModelSpec` (registered in ``components/registry.py``) and returns a
:class:`ModelOutput` from ``forward``. Parallelism, float8, activation checkpointing and
``torch.compile`` are applied from outside, and they find the model's repeated blocks through
``ModelSpec.block_containers``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

# Vocabulary (MODEL.md): 0..255 bytes, then specials.
VOCAB_SIZE = 272
PAD_ID = 256
BOS_ID = 257
EOS_ID = 258
IGNORE_INDEX = -100

# dtype names as configs and CLIs spell them
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ModelOutput:
    """What every model's forward returns.

    logits:   (B, T, VOCAB_SIZE)
    loss:     scalar total loss (lm_loss + weighted auxiliary terms), None without labels
    aux_loss: scalar, the weighted sum of the non-LM loss terms (zero for models without any);
              present with or without labels so the train loop can normalise the LM term itself
    aux:      scalar tensors for metrics (lm_loss, moe_aux_loss, ...), detached or not
    """

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    aux: dict[str, torch.Tensor] = field(default_factory=dict)


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-byte cross-entropy over labels != IGNORE_INDEX, computed in fp32."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def lm_loss_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy over labels != IGNORE_INDEX (0 when there are none)."""
    n = (labels != IGNORE_INDEX).sum().clamp(min=1)
    return lm_loss_sum(logits, labels) / n


# SDPA backends, most preferred first. FlashAttention needs q, k and v of one head dim, so MLA's
# (qk 192, v 128) would fall through to math with torch's default order on some builds; cuDNN and
# the memory-efficient kernel take unequal dims. On CPU only flash (CPU) and math apply.
# GPU figures per backend: scripts/benchmark.py attention (docs/benchmarks.md).
SDPA_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """Causal ``scaled_dot_product_attention`` of (B, H, T, d) tensors under :data:`SDPA_PRIORITY`
    (the first backend that accepts the shapes runs; torch.compile traces the choice)."""
    with sdpa_kernel(SDPA_PRIORITY, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)


@dataclass(frozen=True)
class ModelSpec:
    """How the framework builds and handles one registered model.

    name:             registry key
    args_cls:         dataclass of the model's hyper-parameters (every field overridable in [model])
    flavors:          flavor name -> args instance
    model_cls:        nn.Module class constructed as ``model_cls(args)``; must build on the meta device
                      and provide ``init_weights()``
    block_containers: FQNs of the ModuleLists that hold the repeated blocks (FSDP units, AC and
                      compile targets), in forward order
    flops_per_token:  ``(args, seq_len) -> float`` training FLOPs (fwd+bwd) per input token, for MFU
    recurrent_containers: the block containers applied several times per forward (a recurrent
                      core); activation checkpointing's ``recurrent`` mode wraps these
    loss_sum:         ``(logits, labels) -> scalar``: the training objective summed over labels (the
                      trainer normalises it over all micro-batches and ranks); next-byte
                      cross-entropy unless a model says otherwise
    train_inputs:     extra keyword inputs the model's training forward takes from the trainer:
                      ``"sample_ids"`` ((B,) int64 global sample indices, keys for training noise)
    eval_variants:    ``args -> [(suffix, forward_kwargs), ...]``: validation runs once per variant,
                      calling ``model(inputs, **forward_kwargs)`` and logging ``val_loss{suffix}`` /
                      ``val_bpb{suffix}`` (the variant with suffix "" also logs each ``aux`` scalar
                      as ``val_<key>``); None means one plain pass
    """

    name: str
    args_cls: type
    flavors: dict[str, Any]
    model_cls: type
    block_containers: tuple[str, ...]
    flops_per_token: Callable[..., float]
    recurrent_containers: tuple[str, ...] = ()
    eval_variants: Callable[[Any], list[tuple[str, dict]]] | None = None
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss_sum
    train_inputs: tuple[str, ...] = ()

    def build_args(self, flavor: str, overrides: dict[str, Any] | None = None):
        """The flavor's args with ``overrides`` applied (keys already validated by the config)."""
        if flavor not in self.flavors:
            raise ValueError(
                f"model.flavor: {flavor!r} is not a flavor of {self.name!r}; choose one of {list(self.flavors)}"
            )
        return dataclasses.replace(self.flavors[flavor], **(overrides or {}))

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """Every repeated block as (fqn, module), in forward order."""
        out = []
        for container in self.block_containers:
            mod = model.get_submodule(container)
            for name, block in mod.named_children():
                out.append((f"{container}.{name}", block))
        return out


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

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), freqs)
        return x + self.feed_forward(self.ffn_norm(x))

    def init_weights(self, init_std: float, out_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.attention.init_weights(init_std, out_std)
        self.ffn_norm.reset_parameters()
        self.feed_forward.init_weights(init_std, out_std)


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
