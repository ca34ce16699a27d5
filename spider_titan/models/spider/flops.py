"""Training FLOPs per input byte of Spider (forward + backward), for MFU.

Counts matrix multiplies only (2 FLOPs per multiply-add), the way
``torch.utils.flop_counter.FlopCounterMode`` does, and training = 3 x forward (every matmul's
input and weight need a gradient). Causal attention is counted HALVED (QK^T and PV over the
T*(T+1)/2 ~ T^2/2 unmasked pairs, what a causal flash kernel computes), the same convention as
``dense_flops_per_token``, so the two models' FLOPs compare like for like. (FlopCounterMode counts
SDPA over the full T^2, and not at all for CPU flash attention; the test adds SDPA by this
formula.) The segment pooling is a scatter/gather, no matmul, so it is not counted.

The core runs on segments, so its cost per byte scales with ``n_loops / bytes_per_segment``
(under truncated backprop, loops before the last ``backprop_loops`` cost their forward only);
both are inputs (defaults: the args' ``n_loops`` and ``target_bytes_per_segment``, a planning
estimate). The honest number for a step is ``aux["flops_per_byte"]`` of its training forward,
computed with ``n_loops = loops_run``, ``row_segments = S`` (the batch's largest segment count: the
attention, ``up_proj`` and smoothing run on (B, S) rows, padding included) and
``bytes_per_segment`` = the bytes per segment the core's per-segment work sees: B T / (real
segments) under ``pack_segments``, else T / S (padding computed).
"""

from __future__ import annotations

from spider_titan.vocab import VOCAB_SIZE


def spider_flops_breakdown(
    args,
    seq_len: int,
    n_loops: float | None = None,
    bytes_per_segment: float | None = None,
    backprop_loops: float | None = None,
    row_segments: float | None = None,
) -> dict[str, float]:
    """Training FLOPs per byte by part (keys below); their sum is ``spider_flops_per_byte``.
    ``backprop_loops``: the loops that also run backward (default: the args' ``backprop_loops``,
    0 meaning every loop); the others cost their forward only (truncated backprop).
    ``row_segments``: segment slots per row of the (B, S) layout (default ``seq_len /
    bytes_per_segment``, no padding); ``bytes_per_segment`` then sets the per-segment work only."""
    a = args
    loops = a.n_loops if n_loops is None else n_loops
    k = a.backprop_loops if backprop_loops is None else backprop_loops
    grad_loops = loops if k <= 0 else min(k, loops)
    bps = a.target_bytes_per_segment if bytes_per_segment is None else bytes_per_segment
    T = float(seq_len)
    S = T / bps if row_segments is None else float(row_segments)  # segment slots per row
    per_slot = S / T  # (B, S) slots per byte: what the attention and the row-level parts run on
    d, H = a.dim, a.n_heads
    db = a.byte_width  # the byte-level width (embeddings, byte blocks, predictor input, head)
    dp = a.boundary_width  # the predictor's projection width
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim

    def mm(m: float, n: float) -> float:  # one row through an (m -> n) matmul
        return 2.0 * m * n

    def attn_proj_at(width: float) -> float:  # MLA's projections of one row at model width ``width``
        return (
            mm(width, H * qk)
            + mm(width, a.kv_lora_rank + a.qk_rope_head_dim)
            + mm(a.kv_lora_rank, H * (a.qk_nope_head_dim + a.v_head_dim))
            + mm(H * a.v_head_dim, width)
        )

    attn_proj = attn_proj_at(d)

    def attn_scores(context: float) -> float:  # per query, causal-halved: QK^T and PV
        return (mm(qk, context) * H + mm(context, a.v_head_dim) * H) / 2

    n_bytes_blocks = a.n_prelude + a.n_coda
    per_loop = {  # one loop of the core, per byte: per segment (/ bps) or per (B, S) slot (* per_slot)
        "core_attention_proj": a.n_core * attn_proj / bps,
        "core_attention_scores": a.n_core * attn_scores(S) * per_slot,
        "core_lora": a.n_core
        * (mm(d, a.lora_rank) + mm(a.lora_rank, H * qk) + mm(H * a.v_head_dim, a.lora_rank) + mm(a.lora_rank, d))
        * a.loop_lora
        / bps,
        "moe_router": a.n_core * mm(d, a.n_experts) / bps,
        "moe_experts": a.n_core * a.top_k * 3 * mm(d, a.moe_inter_dim) / bps,
        "engram": len(a.engram_layers) * 2 * mm(2 * a.engram_dim, d) / bps,
        "act_halting": mm(d, 1) * (a.halting == "act") * per_slot,
    }
    fwd = {
        "byte_blocks": n_bytes_blocks * (attn_proj_at(db) + 3 * mm(db, a.inter_dim) * a.byte_mlp),
        "byte_attention_scores": n_bytes_blocks * attn_scores(T),
        # Without the straight-through path the predictor reads the prelude detached: its backward
        # computes weight gradients only (2x forward instead of 3x in total).
        "boundary_predictor": {"mlp": mm(db, dp) + mm(dp, 1), "cosine": 2 * mm(db, dp), "fixed": 0.0, "space": 0.0}[
            a.boundary_predictor
        ]
        * (
            (1.0 if a.router_grad else 2.0 / 3.0)
            # a second pass on the detached prelude for the boundary loss (weight gradients only)
            + (2.0 / 3.0) * (a.router_grad and not a.boundary_prelude_grad)
        ),
        # byte_dim -> dim once per segment (the core's input, packed with it), dim -> byte_dim per (B, S) slot
        "inject_up_proj": mm(db, d) / bps + mm(d, db) * per_slot,
        "residual_proj": mm(db, db) * a.stage_init,
        # the EMA over segments as one (S x S) @ (S x byte_dim) product per row
        "dechunk_smoothing": mm(S, db) * per_slot * a.dechunk_smoothing,
        **{k: v * loops for k, v in per_loop.items()},
        "lm_head": mm(db, VOCAB_SIZE),
    }
    out = {k: 3.0 * v for k, v in fwd.items()}
    # The core's loops: forward (1x) for every loop, backward (2x) for the loops with a graph.
    out.update({k: v * (loops + 2.0 * grad_loops) for k, v in per_loop.items()})
    return out


def spider_flops_per_byte(
    args,
    seq_len: int,
    n_loops: float | None = None,
    bytes_per_segment: float | None = None,
    backprop_loops: float | None = None,
    row_segments: float | None = None,
) -> float:
    """Training (fwd + bwd) FLOPs per input byte; also Spider's ``ModelSpec.flops_per_token``."""
    return sum(spider_flops_breakdown(args, seq_len, n_loops, bytes_per_segment, backprop_loops, row_segments).values())
