"""Training FLOPs per input byte of Spider (forward + backward), for MFU.

Counts matrix multiplies only (2 FLOPs per multiply-add), the way
``torch.utils.flop_counter.FlopCounterMode`` does, and training = 3 x forward (every matmul's
input and weight need a gradient). Causal attention is counted HALVED (QK^T and PV over the
T*(T+1)/2 ~ T^2/2 unmasked pairs, what a causal flash kernel computes), the same convention as
``dense_flops_per_token``, so the two models' FLOPs compare like for like. (FlopCounterMode counts
SDPA over the full T^2, and not at all for CPU flash attention; the test adds SDPA by this
formula.) The segment pooling is a scatter/gather, no matmul, so it is not counted.

The core runs on segments, so its cost per byte scales with ``n_loops / bytes_per_segment``;
both are inputs (defaults: the args' ``n_loops`` and ``target_bytes_per_segment``, a planning
estimate). The honest number for a step is ``aux["flops_per_byte"]`` of its training forward,
computed with ``n_loops = loops_run``, ``row_segments = S`` (the batch's largest segment count: the
attention, ``up_proj`` and smoothing run on (B, S) rows, padding included) and
``bytes_per_segment`` = the bytes per segment the core's per-segment work sees: B T / (real
segments), the core running on the real segments only.
"""

from __future__ import annotations

from spider_titan.vocab import VOCAB_SIZE


def spider_flops_breakdown(
    args,
    seq_len: int,
    n_loops: float | None = None,
    bytes_per_segment: float | None = None,
    row_segments: float | None = None,
    lora_rows: float = 0.0,
) -> dict[str, float]:
    """Training FLOPs per byte by part (keys below); their sum is ``spider_flops_per_byte``.
    ``row_segments``: segment slots per row of the (B, S) layout (default ``seq_len /
    bytes_per_segment``, no padding); ``bytes_per_segment`` then sets the per-segment work only.
    ``lora_rows``: the rows of a micro-batch whose loops fold their LoRA into the weights, once per
    loop and micro-batch (``attention.adapted_linear``), and three times more in its backward;
    0: the adapters run on every segment (decoding, float8 linears; an upper bound for planning)."""
    a = args
    loops = a.n_loops if n_loops is None else n_loops
    bps = a.target_bytes_per_segment if bytes_per_segment is None else bytes_per_segment
    T = float(seq_len)
    S = T / bps if row_segments is None else float(row_segments)  # segment slots per row
    per_slot = S / T  # (B, S) slots per byte: what the attention and the row-level parts run on
    d, H = a.dim, a.n_heads
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

    # per segment: (x @ A) @ B on the query and on the output projection; folded: (d x r) @ (r x H qk)
    # and (H v x r) @ (r x d) once per loop and micro-batch of lora_rows x T bytes
    lora_segment = mm(d, a.lora_rank) + mm(a.lora_rank, H * qk) + mm(H * a.v_head_dim, a.lora_rank) + mm(a.lora_rank, d)
    lora_folded = (mm(H * qk, a.lora_rank) * d + mm(d, a.lora_rank) * H * a.v_head_dim) / max(lora_rows * T, 1.0)

    def loop_cost(bps: float, slots: float) -> dict[str, float]:
        """One loop of the core, per byte: per segment (/ bps) or per (B, S) slot (* slots / T)."""
        lora = lora_folded if lora_rows else lora_segment / bps
        return {
            "core_attention_proj": a.n_core * attn_proj / bps,
            "core_attention_scores": a.n_core * attn_scores(slots) * slots / T,
            "core_lora": a.n_core * lora,
            "moe_router": a.n_core * mm(d, a.n_experts) / bps,
            "moe_experts": a.n_core * a.top_k * 3 * mm(d, a.moe_inter_dim) / bps,
        }

    per_loop = loop_cost(bps, S)
    learned = a.learned_segments
    fwd = {
        "byte_blocks": n_bytes_blocks * (attn_proj_at(d) + 3 * mm(d, a.inter_dim)),
        "byte_attention_scores": n_bytes_blocks * attn_scores(T),
        "boundary_predictor": 2 * mm(d, dp) * learned,  # q_proj and k_proj
        # inject once per segment (the core's input, packed with it), up_proj per (B, S) slot
        "inject_up_proj": mm(d, d) / bps + mm(d, d) * per_slot,
        # each Engram's key and value projections, once per segment for every loop (Engram.memory)
        "engram": len(a.engram_layers) * 2 * mm(2 * a.engram_dim, d) / bps,
        "residual_proj": mm(d, d),
        # the EMA over segments as one (S x S) @ (S x dim) product per row (learned segments only)
        "dechunk_smoothing": mm(S, d) * per_slot * learned,
        "lm_head": mm(d, VOCAB_SIZE),
    }
    out = {k: 3.0 * v for k, v in fwd.items()}
    # The core's loops: forward (1x) and backward (2x) for every loop.
    out.update({k: v * (loops + 2.0 * loops) for k, v in per_loop.items()})
    if lora_rows:  # a folding loop's backward makes three fold-sized products (the fold again, dA, dB), not two
        out["core_lora"] += a.n_core * lora_folded * loops
    return out


def spider_flops_per_byte(
    args,
    seq_len: int,
    n_loops: float | None = None,
    bytes_per_segment: float | None = None,
    row_segments: float | None = None,
    lora_rows: float = 0.0,
) -> float:
    """Training (fwd + bwd) FLOPs per input byte; also Spider's ``ModelSpec.flops_per_token``."""
    return sum(spider_flops_breakdown(args, seq_len, n_loops, bytes_per_segment, row_segments, lora_rows).values())
