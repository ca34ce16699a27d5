"""Training FLOPs per input byte of Spider (forward + backward), for MFU.

Counts matrix multiplies only (2 FLOPs per multiply-add), the way
``torch.utils.flop_counter.FlopCounterMode`` does, and training = 3 x forward (every matmul's
input and weight need a gradient). Attention is counted without the causal halving
(``FlopCounterMode``'s SDPA convention): QK^T and PV over the full context.

The core runs on segments, so its cost per byte scales with ``n_loops / bytes_per_segment``;
both are inputs (defaults: the args' ``n_loops`` and ``target_bytes_per_segment``). For a
measured value pass ``aux["loops_run"]`` (loops actually computed, which is ``n_loops`` in
training) and ``aux["bytes_per_segment"]`` of a forward. The segment count is taken as
``seq_len / bytes_per_segment`` (rows padded to the batch's largest segment count cost a little
more).
"""

from __future__ import annotations

from spider_titan.models.common import VOCAB_SIZE


def spider_flops_breakdown(
    args, seq_len: int, n_loops: float | None = None, bytes_per_segment: float | None = None
) -> dict[str, float]:
    """Training FLOPs per byte by part (keys below); their sum is ``spider_flops_per_byte``."""
    a = args
    loops = a.n_loops if n_loops is None else n_loops
    bps = a.target_bytes_per_segment if bytes_per_segment is None else bytes_per_segment
    T = float(seq_len)
    S = T / bps  # segments per sequence
    d, H = a.dim, a.n_heads
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim

    def mm(m: float, n: float) -> float:  # one row through an (m -> n) matmul
        return 2.0 * m * n

    attn_proj = (
        mm(d, H * qk) + mm(d, a.kv_lora_rank + a.qk_rope_head_dim)
        + mm(a.kv_lora_rank, H * (a.qk_nope_head_dim + a.v_head_dim)) + mm(H * a.v_head_dim, d)
    )

    def attn_scores(context: float) -> float:  # per query: QK^T and PV
        return mm(qk, context) * H + mm(context, a.v_head_dim) * H

    n_bytes_blocks = a.n_prelude + a.n_coda
    per_segment_loop = {  # one segment through one loop of the core
        "core_attention_proj": a.n_core * attn_proj,
        "core_attention_scores": a.n_core * attn_scores(S),
        "core_lora": a.n_core * (mm(d, a.lora_rank) + mm(a.lora_rank, H * qk)
                                 + mm(H * a.v_head_dim, a.lora_rank) + mm(a.lora_rank, d)),
        "moe_router": a.n_core * mm(d, a.n_experts),
        "moe_experts": a.n_core * a.top_k * 3 * mm(d, a.moe_inter_dim),
        "engram": len(a.engram_layers) * 2 * mm(2 * a.engram_dim, d),
        "act_halting": mm(d, 1),
    }
    fwd = {
        "byte_blocks": n_bytes_blocks * (attn_proj + 3 * mm(d, a.inter_dim)),
        "byte_attention_scores": n_bytes_blocks * attn_scores(T),
        "boundary_predictor": mm(d, d) + mm(d, 1),
        "pooling": 2 * mm(S, d),  # downsample (B,S,T)@(B,T,d) and upsample (B,T,S)@(B,S,d)
        "inject_up_proj": 2 * mm(d, d) / bps,  # once per segment each
        **{k: v * loops / bps for k, v in per_segment_loop.items()},
        "lm_head": mm(d, VOCAB_SIZE),
    }
    return {k: 3.0 * v for k, v in fwd.items()}


def spider_flops_per_byte(
    args, seq_len: int, n_loops: float | None = None, bytes_per_segment: float | None = None
) -> float:
    """Training (fwd + bwd) FLOPs per input byte; also Spider's ``ModelSpec.flops_per_token``."""
    return sum(spider_flops_breakdown(args, seq_len, n_loops, bytes_per_segment).values())
