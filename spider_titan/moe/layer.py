"""The MoE layer: router, dropless dispatch through a backend, grouped SwiGLU experts, combine.

Pipeline (docs/moe.md): fp32 router -> softmax scores -> top-k on ``scores + expert_bias`` (selection
only) -> gate weights from the unbiased scores, renormalised -> ``backend.build_map`` ->
``backend.expand`` -> ``GroupedExperts`` -> ``backend.reduce``. Every token goes to its k experts
(dropless: capacity-based dropping would let one sequence change another's logits), and nothing
waits on the host, so the layer is CUDA-graph and ``torch.compile`` friendly.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from spider_titan.moe.base import MoEBackend, compute_dtype, op_namespace
from spider_titan.moe.routing_replay import is_recomputing, replay_or_record
from spider_titan.moe.torch_backend import TorchMoEBackend


@torch.library.custom_op(f"{op_namespace(__name__)}::grouped_mm", mutates_args=())
def _grouped_mm_opaque(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` as one opaque op, for dtypes other than bf16 (see ``_raw_grouped_mm``)."""
    return torch._grouped_mm(a, b, offs=offs)


@_grouped_mm_opaque.register_fake
def _(a, b, offs):
    if b.dim() == 3:  # (R, K) x (E, K, N) -> (R, N)
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])  # (K, R) x (R, N) -> (E, K, N)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in fp32, under autocast too: autocast would run the linear of fp32 inputs in
    its low-precision dtype (bf16), and the router is fp32 by design."""
    device = x.device.type
    off = torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else contextlib.nullcontext()
    with off:
        return F.linear(x.float(), weight.float())


def grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of one grouped GEMM from its shapes (``torch.utils.flop_counter``'s convention; it has no
    formula of its own for ``_grouped_mm``): 2 * M * K * N over all groups."""
    if len(out_shape) == 2:  # (M, K) x (E, K, N) -> (M, N)
        return 2 * a_shape[0] * a_shape[1] * out_shape[1]
    if len(a_shape) == 2 and len(b_shape) == 2:  # (K, M) x (M, N) -> (E, K, N): the weight gradient
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    raise NotImplementedError(f"grouped mm {a_shape} x {b_shape} -> {out_shape}")


def grouped_mm_ops() -> list:
    """The grouped-GEMM ops the MoE layer dispatches: torch's, and this module's opaque wrapper."""
    return [torch.ops.aten._grouped_mm, _grouped_mm_opaque._opoverload.overloadpacket]


def _raw_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm``, traceable by torch.compile in every dtype.

    Its meta kernel accepts only bf16 (the CUDA kernel's rule) although the CPU kernel runs fp32 too,
    so compiling an fp32 model (CPU debug runs) fails; other dtypes go through an opaque custom op.
    """
    if a.dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=offs)
    return _grouped_mm_opaque(a, b, offs)


class _GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm(a (R, K), b (E, K, N), offs) -> (R, N)`` with a robust backward.

    Two traps of the raw op: its backward rejects a stride-0 incoming gradient (what
    ``out.sum().backward()`` produces), so the gradient is made contiguous here; and rows past
    ``offs[-1]`` are never written, so the input gradient's rows there are zeroed (unless
    ``filled``: no row is past it).
    """

    @staticmethod
    def forward(ctx, a, b, offs, filled=False):
        ctx.save_for_backward(a, b, offs)
        ctx.filled = filled
        return _raw_grouped_mm(a, b, offs)

    @staticmethod
    def backward(ctx, grad):
        a, b, offs = ctx.saved_tensors
        grad = grad.contiguous()
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = _zero_rows_past_end(_raw_grouped_mm(grad, b.transpose(-2, -1), offs), offs, ctx.filled)
        if ctx.needs_input_grad[1]:
            # Computed as (E, N, K) and handed back transposed: in the experts' layout ``b`` is the
            # transpose of an (E, N, K) parameter, whose gradient then arrives contiguous (no copy).
            grad_b = _raw_grouped_mm(grad.transpose(-2, -1), a, offs).transpose(-2, -1)  # (E, K, N)
        return grad_a, grad_b, None, None


def _zero_rows_past_end(t: torch.Tensor, offs: torch.Tensor, filled: bool = False) -> torch.Tensor:
    """Zero the rows of ``t (R, n)`` at or past ``offs[-1]`` (a grouped GEMM leaves them unwritten);
    ``filled``: there are none, ``t`` as it is."""
    if filled:
        return t
    used = torch.arange(t.shape[0], device=t.device) < offs[-1]  # (R,)
    return torch.where(used.unsqueeze(-1), t, 0)


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as 3-D weights so grouped GEMM and expert parallel shard dim 0.

    ``forward(x_exp (R, dim), offs (E,) int32) -> (R, dim)``: expert e handles rows
    ``offs[e-1]:offs[e]``; rows at or past ``offs[-1]`` come out zero. ``torch._grouped_mm``
    needs 16-byte aligned strides, so ``dim`` and ``inter_dim`` must be multiples of 8.

    Layout (torchtitan's): each weight is stored (E, out, in), like an ``nn.Linear`` per expert,
    and the GEMMs read it transposed, (E, in, out) per-group column-major. That is the layout
    torchao's fp8 grouped GEMM requires of its right operand (strides (K*N, 1, K)), so fp8 needs
    no per-call copy of the weights (a row-major (E, in, out) weight cost one transpose copy per
    GEMM, ~207 MB per MoE call at 1B). Checkpoints of the project's first days hold (E, in, out).
    """

    def __init__(self, n_experts: int, dim: int, inter_dim: int):
        super().__init__()
        if dim % 8 or inter_dim % 8:
            raise ValueError(
                f"GroupedExperts: dim ({dim}) and inter_dim ({inter_dim}) must be multiples of 8 "
                "(torch._grouped_mm needs 16-byte aligned rows)"
            )
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, inter_dim, dim))  # (E, out, in)
        self.w3 = nn.Parameter(torch.empty(n_experts, inter_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, inter_dim))

    def _grouped_mm(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, filled: bool = False) -> torch.Tensor:
        """``a (R, K) @ b[e] (K, N)`` per row group, ``b`` per-group column-major (a transposed weight);
        ``filled``: no row of ``a`` is past ``offs[-1]``. The float8 converter overrides this method."""
        return _GroupedMM.apply(a, b, offs, filled)

    def forward(
        self, x_exp: torch.Tensor, offs: torch.Tensor, row_real: torch.Tensor | None = None, filled: bool = False
    ) -> torch.Tensor:
        """``row_real (R,)`` bool: the rows that hold a real (not padding) token. Unused here; expert
        parallel's fixed-capacity dispatch fills capacity with them first and counts drops of them.
        ``filled``: ``offs[-1] = R``, no row past the last group (a map without alignment padding)."""
        return self.swiglu(x_exp, offs, self.w1, self.w3, self.w2, filled)

    def swiglu(
        self,
        x_exp: torch.Tensor,
        offs: torch.Tensor,
        w1: torch.Tensor,
        w3: torch.Tensor,
        w2: torch.Tensor,
        filled: bool = False,
    ) -> torch.Tensor:
        """The experts' SwiGLU on explicit weights (expert parallel passes its local shards).

        Tokens and weights are cast to the compute dtype (``base.compute_dtype``: autocast's when
        it is on, else the tokens'), so the grouped GEMM never sees fp32 inputs under autocast.
        ``filled``: every row is inside a group, so no product needs its unwritten rows zeroed.
        """
        dtype = compute_dtype(x_exp)
        x_exp = x_exp.to(dtype)
        # Mask each product right away: garbage in unwritten rows would become NaN through
        # silu' in the backward even behind a later mask (0 * NaN = NaN).
        w1, w3, w2 = (w if w.dtype == dtype else w.to(dtype) for w in (w1, w3, w2))
        w1, w3, w2 = (w.transpose(-2, -1) for w in (w1, w3, w2))  # (E, in, out) views, column-major

        def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return _zero_rows_past_end(self._grouped_mm(a, b, offs, filled), offs, filled)

        h = F.silu(gemm(x_exp, w1)) * gemm(x_exp, w3)  # (R, inter)
        return gemm(h, w2)  # (R, dim)

    def init_weights(self, init_std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1, std=init_std)
        nn.init.trunc_normal_(self.w3, std=init_std)
        nn.init.trunc_normal_(self.w2, std=out_std)


def _must_save(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE


_must_save_context = functools.partial(create_selective_checkpoint_contexts, _must_save)


@dataclass
class MoEStats:
    """Load-balance statistics of one MoE call, over real tokens only (``token_mask``).

    aux_loss: scalar fp32, ``E * sum_i f_i * P_i`` (f_i: fraction of routed slots to expert i, no
              gradient; P_i: mean router probability of expert i, with gradient). Equals 1 for a
              perfectly uniform router. In training, f_i and P_i are over the global micro-batch
              (every data-parallel rank's tokens) when a ``reduce_stats`` is installed.
    counts:   (E,) fp32, detached: this rank's routed slots per expert, for load fractions and
              the aux-loss-free bias update (all-reduce it over data/expert ranks before use).
    """

    aux_loss: torch.Tensor
    counts: torch.Tensor


class MoE(nn.Module):
    """Dropless top-k MoE with SwiGLU experts and a pluggable dispatch backend.

    ``forward(x (..., dim), token_mask (...) bool | None) -> (y (..., dim), MoEStats)``.
    Masked tokens (padding) still pass through the experts (skipping them would need their count
    on the host) but are left out of the load-balance statistics.

    ``align`` pads each expert's row segment to a multiple (16 for fp8 grouped GEMM) and may be
    changed after construction by a converter; ``backend`` may be swapped likewise.

    Global-batch load balancing (Qiu et al. 2025, arXiv 2501.11873, used in Qwen3-MoE): the aux
    loss's f_i and P_i are statistics of the whole data-parallel micro-batch, not of this rank's
    share, so training does not depend on how the global batch is split over ranks, and the loss
    asks for balance over many sequences instead of within a few. ``reduce_stats`` (None: this
    rank alone) is how the model reaches the other ranks without importing torch.distributed: a
    differentiable sum over the data-parallel ranks, installed by ``parallel/parallelize.py``.
    The statistics are per micro-batch, not per optimizer step (a micro-batch's loss is
    backpropagated before the next one exists): with gradient accumulation, 1 rank x B samples and
    R ranks x B/R samples agree when they accumulate the same number of micro-batches (the loader
    gives rank r the r-th slice of each global micro-batch); evaluation keeps each rank's own.
    """

    FP32_PARAMS = ("router.weight",)  # read in fp32 under autocast too (parallel/precision.py)

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        inter_dim: int,
        *,
        align: int = 1,
        backend: MoEBackend | None = None,
    ):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"MoE: top_k ({top_k}) must be in [1, n_experts={n_experts}]")
        self.dim = dim
        self.n_experts = n_experts
        self.top_k = top_k
        self.align = align
        self.backend = backend if backend is not None else TorchMoEBackend()
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(n_experts, dim, inter_dim)
        # Aux-loss-free balancing (DeepSeek-V3): shifts which experts are selected, never the weights.
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))
        # Routed slots per expert over this optimizer step's training forwards (moe/load_balance.py
        # reads and clears it); not part of the state dict. Counted only when ``count_load`` is set.
        self.register_buffer("step_counts", torch.zeros(n_experts, dtype=torch.float32), persistent=False)
        self.count_load = False
        # Sums a tensor over the data-parallel ranks, differentiably (class docstring); training only.
        self.reduce_stats: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Compiled memory budgets (activation_checkpoint.mode "memory_budget") set it: see ``select``.
        self.save_selection = False

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """The routing decision: scores (T, E) -> topk_idx (T, k) over ``scores + expert_bias``.

        Under a compiled memory budget the partitioner may recompute the top-k in backward from
        recomputed scores, and a recompute that rounds differently would pick other experts than the
        forward: with ``save_selection`` the selection is a must-save selective-checkpoint region."""
        if self.save_selection:
            return checkpoint(self._select, scores, use_reentrant=False, context_fn=_must_save_context)
        return self._select(scores)

    def _select(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.topk(scores.detach() + self.expert_bias, self.top_k, dim=-1).indices

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, dim) -> scores (T, E) fp32, topk_idx (T, k), gate weights (T, k) fp32.

        The selection is made once per forward: an activation-checkpoint recompute replays it
        (routing_replay.py) instead of choosing again, so ties or nondeterminism cannot route
        the recompute differently. Scores and gate weights are recomputed (they carry gradient).
        """
        logits = fp32_linear(x, self.router.weight)  # (T, E)
        scores = logits.softmax(dim=-1)
        topk_idx = replay_or_record(lambda: self.select(scores))  # (T, k)
        weights = scores.gather(1, topk_idx)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, topk_idx, weights

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEStats]:
        shape = x.shape
        x2 = x.reshape(-1, self.dim)  # (T, dim)
        scores, topk_idx, weights = self.route(x2)

        rmap = self.backend.build_map(topk_idx, self.n_experts, self.align)
        # Cast before the expand: it then moves (and expert parallel all-to-alls) compute-dtype rows.
        x_exp = self.backend.expand(x2.to(compute_dtype(x2)), rmap)  # (R, dim)
        real = self._real_tokens(scores, token_mask)  # (T,)
        pos = rmap.pos_to_token
        row_real = torch.where(pos >= 0, real[pos.clamp(min=0)], 0.0) > 0  # (R,) rows of real tokens
        # without alignment padding the map has T k rows, all inside a group (moe/base.max_rows)
        y_exp = self.experts(x_exp, rmap.offs, row_real, filled=self.align == 1)  # (R, dim)
        y = self.backend.reduce(y_exp, weights, rmap)  # (T, dim)
        counts = self._counts(topk_idx, real)  # (E,), this rank's
        stats = self._stats(scores, counts, real)
        # Training forwards only: not evaluation (its routing must not steer the next update), not
        # an activation-checkpoint recompute (the same tokens a second time).
        if self.count_load and self.training and not is_recomputing():
            self.step_counts.add_(counts)
        return y.to(x.dtype).reshape(shape), stats

    def _real_tokens(self, scores: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
        """(T,) fp32, 1 for a real token, 0 for padding."""
        T = scores.shape[0]
        if token_mask is None:
            return scores.new_ones(T)
        if token_mask.numel() != T:
            raise ValueError(f"MoE: token_mask has {token_mask.numel()} entries for {T} tokens")
        return token_mask.reshape(T).to(scores.dtype)

    def _counts(self, topk_idx: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """(E,) fp32, detached: routed slots of real tokens per expert."""
        slot_real = real.unsqueeze(-1).expand_as(topk_idx).reshape(-1)  # (T*k,)
        return real.new_zeros(self.n_experts).scatter_add_(0, topk_idx.reshape(-1), slot_real).detach()

    def _stats(self, scores: torch.Tensor, counts: torch.Tensor, real: torch.Tensor) -> MoEStats:
        """The aux loss from this rank's sums, reduced over the data-parallel ranks in training.

        Why the gradient comes out exact (R data-parallel ranks, each backpropagating its own loss,
        FSDP averaging the gradients): every rank gets the same global sums and hence the same
        aux loss L(P_sum), P_sum = sum over ranks r of P_sum_r (rank r's summed probabilities).
        The sum's backward adds the incoming gradients of all R ranks, so rank r's router sees
        R * dL/dP_sum * dP_sum_r/dtheta; FSDP's average over the R ranks divides by R again,
        leaving sum_r dL/dP_sum * dP_sum_r/dtheta = dL/dtheta of one process holding the whole
        global micro-batch. The counts (f_i) and the token count carry no gradient.
        """
        E = self.n_experts
        n_real = real.sum().reshape(1)  # (1,)
        p_sum = (scores * real.unsqueeze(-1)).sum(0)  # (E,), with gradient
        sums = torch.cat([p_sum, counts, n_real])  # (2E + 1,): one collective for all three
        if self.training and self.reduce_stats is not None:
            sums = self.reduce_stats(sums)
        p_sum, slots, n_real = sums[:E], sums[E : 2 * E].detach(), sums[2 * E :].detach().clamp(min=1)
        f = slots / (n_real * self.top_k)  # (E,)
        p = p_sum / n_real  # (E,)
        return MoEStats(aux_loss=E * (f * p).sum(), counts=counts)

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor, rate: float) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower the over-loaded."""
        counts = counts.to(self.expert_bias.device, torch.float32)
        self.expert_bias += rate * torch.sign(counts.mean() - counts)

    def init_weights(self, init_std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.router.weight, std=init_std)
        self.experts.init_weights(init_std, out_std)
        self.expert_bias.zero_()
        self.step_counts.zero_()
