"""Multi-head latent attention (MLA, DeepSeek-V2 arXiv 2405.04434), causal.

Queries come straight from ``wq`` (no query compression: the flavors have no q_lora_rank).
Keys and values go through a low-rank latent: ``wkv_a`` maps x to ``kv_lora_rank`` latent
channels plus one ``qk_rope_head_dim`` rotary key shared by every head; the latent is
RMS-normalised (``kv_norm``) and expanded by ``wkv_b`` into per-head non-rotary keys and values.
RoPE rotates only the rope parts. Softmax scale ``1/sqrt(qk_nope + qk_rope)``; causal SDPA.

The same module serves the byte layers (positions = byte indices) and the core (positions =
segment indices): the caller passes the rotation table. A core block may hand in per-loop LoRA
deltas for the query and output projections; ``wq`` and ``wo`` stay plain ``nn.Linear`` so the
float8 converter can swap them.

Packed rows (``PackedRows``, how the core runs): x holds only the batch's
real positions, one packed row (1, N, dim), and ``freqs`` one rotation per position (1, N, rope/2, 2).
The projections run on the N positions; queries, keys and values are laid out as (B, S) rows for
the causal attention (zeros in the padding, which sits after every real position of its row, so no
real query sees it) and the output is packed again before ``wo``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from spider_titan.models.common import GrowingTensor, apply_rope, causal_sdpa
from spider_titan.models.spider.args import SpiderArgs
from spider_titan.moe.base import compute_dtype, op_namespace


class LoRA(NamedTuple):
    """A rank-r update of a linear's output, ``x @ a @ b``: ``a (in, r)``, ``b (r, out)`` (per-loop LoRA
    of a core block)."""

    a: torch.Tensor
    b: torch.Tensor

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.a.to(x.dtype)) @ self.b.to(x.dtype)


def _fold(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``W + (a b)^T`` (out, in) in one rank-r GEMM."""
    return torch.addmm(w, b.t(), a.t())


@torch.library.custom_op(f"{op_namespace(__name__)}::folded_linear", mutates_args=())
def _folded_linear(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``x @ (W + (a b)^T)^T``; one opaque op, so a compiled graph keeps ``W``, ``a`` and ``b`` for the
    backward, which folds again, where the partitioner would save the folded weight (a new (out, in)
    tensor per call) rather than the weight itself."""
    return F.linear(x, _fold(w, a, b))


@_folded_linear.register_fake
def _(x, w, a, b):
    return x.new_empty(*x.shape[:-1], w.shape[0])


@torch.library.custom_op(f"{op_namespace(__name__)}::folded_linear_input_grad", mutates_args=())
def _folded_input_grad(dy: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``dy @ (W + (a b)^T)``: the input gradient, folding again. One op on the gradient, so the
    partitioner cannot move the fold into the forward and save its result."""
    return dy @ _fold(w, a, b)


@_folded_input_grad.register_fake
def _(dy, w, a, b):
    return dy.new_empty(*dy.shape[:-1], w.shape[1])


def _folded_linear_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _folded_linear_backward(ctx, dy):
    x, w, a, b = ctx.saved_tensors
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    dx = _folded_input_grad(dy, w, a, b) if ctx.needs_input_grad[0] else None
    dw = dy2.t() @ x2  # (out, in): the folded weight's gradient, also W's
    da = (b @ dw).t() if ctx.needs_input_grad[2] else None  # (in, r)
    db = (dw @ a).t() if ctx.needs_input_grad[3] else None  # (r, out)
    return dx, dw if ctx.needs_input_grad[1] else None, da, db


_folded_linear.register_autograd(_folded_linear_backward, setup_context=_folded_linear_setup)


def _folded_flop(rows_shape, w_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """Either folded-linear op: the (out x r) @ (r x in) fold and the GEMM over the rows of its first
    operand (x forward, dy for the input gradient), both against the (out, in) weight."""
    out, inn = w_shape
    return 2 * out * a_shape[1] * inn + 2 * math.prod(rows_shape[:-1]) * inn * out


def folded_linear_flops() -> dict:
    """FlopCounterMode's ``custom_mapping`` for the two opaque folded-linear ops (it cannot see their
    matmuls)."""
    return {op._opoverload.overloadpacket: _folded_flop for op in (_folded_linear, _folded_input_grad)}


def can_fold(linear: nn.Linear) -> bool:
    """Whether a LoRA update can be folded into ``linear``'s weight: a float8 linear runs its own GEMM
    and a quantized weight (a tensor subclass: an int8 or int4 export) its own kernels, so only a plain
    ``nn.Linear`` without bias, with a plain weight."""
    return type(linear) is nn.Linear and linear.bias is None and not is_traceable_wrapper_subclass(linear.weight)


def adapted_linear(linear: nn.Linear, x: torch.Tensor, lora: LoRA | None, fold: bool) -> torch.Tensor:
    """``linear(x)`` plus the LoRA update. ``fold`` (where :func:`can_fold`): one GEMM with the update
    folded into the weight, ``W + (a b)^T`` (:func:`_folded_linear`): over many rows the (out x in)
    weight moves fewer bytes than two rank-r passes over every row's activations (decoding a few bytes
    does not fold)."""
    if lora is None:
        return linear(x)
    if fold and can_fold(linear):
        dtype = compute_dtype(x)  # a custom op: autocast does not cast its inputs
        return _folded_linear(*(t.to(dtype) for t in (x, linear.weight, lora.a, lora.b)))
    return linear(x) + lora.delta(x)


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` (m,) of x (n, ...), where index n reads a row of zeros (one gather under
    compile: no copy of x with a zero row appended)."""
    n = x.shape[0]
    inside = (index < n).view(-1, *(1,) * (x.dim() - 1))
    return torch.where(inside, x.index_select(0, index.clamp(max=n - 1)), 0)


class _Regather(torch.autograd.Function):
    """``_gather_rows(x, index)`` for an ``index`` that reads each row of x at most once, ``inverse``
    mapping x's rows to where they went (or past the output: not read). The gradient gathers through
    ``inverse`` too, where autograd's own would zero-fill and scatter (atomic adds on a GPU)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return _gather_rows(x, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return _gather_rows(grad, inverse), None, None


class PackedRows(NamedTuple):
    """Where the N positions of a packed row sit in a padded (B, S) batch: ``index`` (N,) int64, flat
    slots ``b * S + s`` in increasing order; ``valid`` (B, S) bool, True at the slots packed;
    ``position`` (B * S,) int64, each slot's packed position, N where it has none. Past the real
    slots a fixed N (:meth:`fixed`) has spare positions, ``index = B * S``: they pack as zeros and pad
    nowhere. Packing and padding are gathers both ways, forward and backward."""

    index: torch.Tensor
    valid: torch.Tensor
    position: torch.Tensor

    @classmethod
    def of(cls, valid: torch.Tensor, count: int) -> PackedRows:
        """From the (B, S) mask and its number of True slots (a host int: no sync here)."""
        return cls.fixed(valid, count)

    @classmethod
    def fixed(cls, valid: torch.Tensor, size: int) -> PackedRows:
        """The first ``size`` True slots of the (B, S) mask in flat order, and spare positions if it has
        fewer (a static shape; no host read); ``valid`` then marks the slots packed."""
        flat = valid.reshape(-1)
        index = torch.nonzero_static(flat, size=size, fill_value=flat.numel()).squeeze(1)
        rank = flat.cumsum(0)  # a True slot's 1-based place among them
        kept = flat & (rank <= size)
        return cls(index, kept.view_as(valid), torch.where(kept, rank - 1, size))

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, ...) -> (1, N, ...)"""
        return _Regather.apply(x.flatten(0, 1), self.index, self.position).unsqueeze(0)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """(1, N, ...) -> (B, S, ...), zeros in the padding."""
        return _Regather.apply(x.squeeze(0), self.position, self.index).view(*self.valid.shape, *x.shape[2:])


class KVCache:
    """The keys and values one attention layer has seen, kept as SDPA reads them, (B, H, positions, d),
    in buffers that grow by doubling (``GrowingTensor``): a new byte copies its own keys only."""

    def __init__(self) -> None:
        self.k, self.v = GrowingTensor(dim=2), GrowingTensor(dim=2)

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k, v (B, T, H, d)``; every position held, (B, H, past + T, d)."""
        return self.k.append(k.transpose(1, 2)), self.v.append(v.transpose(1, 2))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Append ``k, v``; the causal attention of the new queries ``q (B, H, T, d)`` over every
        position held (B, H, T, d_v). Written out (two matmuls): SDPA's math fallback, all a CPU has
        for MLA's unequal head dims, scales the transposed key cache element by element, the cost
        that grew with the context."""
        k, v = self.extend(k, v)
        t, held = q.shape[2], k.shape[2]
        scores = torch.matmul(q * scale, k.transpose(-2, -1)).float()  # (B, H, T, held)
        if t > 1:  # the new positions see the past and each other causally
            mask = torch.ones(t, held, dtype=torch.bool, device=q.device).tril(diagonal=held - t)
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)


class MLA(nn.Module):
    """``forward(x (B, T, dim), freqs (T, rope/2, 2) cos/sin) -> (B, T, dim)``."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        norm_eps: float,
    ):
        super().__init__()
        self.n_heads = n_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scale = 1.0 / math.sqrt(self.qk_head_dim)
        self.wq = nn.Linear(dim, n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(kv_lora_rank, eps=norm_eps)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)

    @classmethod
    def from_args(cls, args: SpiderArgs) -> MLA:
        """The MLA layer of a Spider block (byte and core blocks alike)."""
        return cls(
            args.dim,
            args.n_heads,
            args.kv_lora_rank,
            args.qk_nope_head_dim,
            args.qk_rope_head_dim,
            args.v_head_dim,
            args.norm_eps,
        )

    def forward(
        self,
        x: torch.Tensor,
        freqs: torch.Tensor,
        q_lora: LoRA | None = None,
        o_lora: LoRA | None = None,
        cache: KVCache | None = None,
        packed: PackedRows | None = None,
    ) -> torch.Tensor:
        """``cache`` (incremental decoding, decode.py): x holds only new positions (``freqs`` theirs);
        their keys and values are appended to the cache and the queries attend to everything in it.
        ``packed``: x is one packed row (module docstring)."""
        b, t, _ = x.shape
        h = self.n_heads
        fold = cache is None  # decoding runs a few rows: the rank-r passes cost less than a folded weight
        q = adapted_linear(self.wq, x, q_lora, fold)
        q = q.view(b, t, h, self.qk_head_dim)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, freqs)], dim=-1)  # (B, T, H, qk)

        kv_a = self.wkv_a(x)
        c_kv, k_rope = kv_a.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_rope = apply_rope(k_rope.unsqueeze(2), freqs)  # (B, T, 1, rope), shared by the heads
        kv = self.wkv_b(self.kv_norm(c_kv)).view(b, t, h, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(b, t, h, self.qk_rope_head_dim)], dim=-1)  # (B, T, H, qk)

        if packed is not None:  # attention over the (B, S) rows, then the N positions again
            q, k, v = packed.pad(q), packed.pad(k), packed.pad(v)
            out = causal_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=self.scale)
            out = packed.pack(out.transpose(1, 2)).transpose(1, 2)  # (1, H, N, v)
        elif cache is None:
            out = causal_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=self.scale)  # (B, H, T, v)
        else:
            out = cache.attend(q.transpose(1, 2), k, v, self.scale)  # (B, H, T, v)
        out = out.transpose(1, 2).reshape(b, t, h * self.v_head_dim)
        return adapted_linear(self.wo, out, o_lora, fold)

    def init_weights(self, init_std: float, out_std: float) -> None:
        for lin in (self.wq, self.wkv_a, self.wkv_b):
            nn.init.trunc_normal_(lin.weight, std=init_std)
        nn.init.trunc_normal_(self.wo.weight, std=out_std)
        self.kv_norm.reset_parameters()
