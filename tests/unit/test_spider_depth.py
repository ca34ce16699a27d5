"""The recurrent core against a hand-written reference (recurrence.py): the loops, their LoRA adapters
and loop embeddings, the Engram memory computed once for every loop, and the MoE balancing loss as the
mean over every (block, loop) call. Debug flavor, CPU, fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spider_titan.models.common import rope_frequencies
from tests.unit.test_spider_model import build


def core_inputs(model, B: int = 2, S: int = 9):
    a = model.args
    g = torch.Generator().manual_seed(3)
    s = torch.randn(B, S, a.dim, generator=g, requires_grad=True)
    freqs = rope_frequencies(a.qk_rope_head_dim, S, a.rope_theta)
    bucket_ids = torch.randint(0, a.engram_buckets, (B, S, 2), generator=g)
    seg_real = torch.ones(B, S, dtype=torch.bool)
    seg_real[1, -2:] = False
    return s, freqs, bucket_ids, seg_real, torch.randn(B, S, a.dim, generator=g)


def reference_core(core, s, freqs, bucket_ids, seg_real, n_loops: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The core written out by hand: the Engrams' keys and values are computed in every loop, and the
    MoE balancing loss is the mean over every loop's block calls; returns (output, aux)."""
    injected = core.inject(s)
    decay = torch.exp(-F.softplus(core.decay_lambda.float()))
    h, aux = None, []
    for i in range(n_loops):
        h = injected if i == 0 else decay * h + injected
        h = h + core.loop_embedding.weight[i]
        loop = torch.tensor(i)
        memory = core.engram_memory(bucket_ids, s.dtype)  # again every loop, as the core computed it once did
        for block, block_memory in zip(core.layers, memory, strict=True):
            h, block_aux, _ = block(h, loop, freqs, block_memory, seg_real)
            aux.append(block_aux)
    return core.norm(h), torch.stack(aux).mean()


def test_the_core_equals_a_hand_written_reference():
    """Three training loops, each with its own (non-zero) LoRA adapters and loop embedding: the core's
    output, balancing loss and every gradient equal the hand reference's; a loop run with another
    loop's adapters gives another output (negative control)."""
    model = build(n_loops=3).train()
    core = model.core
    with torch.no_grad():
        for block in core.layers:
            torch.nn.init.normal_(block.lora.wq_b, std=0.05)
            torch.nn.init.normal_(block.lora.wo_b, std=0.05)
        torch.nn.init.normal_(core.loop_embedding.weight, std=0.1)
    s, freqs, bucket_ids, seg_real, w = core_inputs(model)

    def grads(fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        core.zero_grad(set_to_none=True)
        s.grad = None
        out, aux = fn()
        ((out * w).sum() + aux).backward()
        found = {n: p.grad.clone() for n, p in core.named_parameters() if p.grad is not None}
        return out.detach(), found | {"input": s.grad.clone()}

    def run():
        out = core(s, n_loops=3, freqs=freqs, bucket_ids=bucket_ids, seg_real=seg_real)
        assert out.loops_run == 3
        return out.output, out.moe_aux_loss

    got_out, got = grads(run)
    want_out, want = grads(lambda: reference_core(core, s, freqs, bucket_ids, seg_real, 3))
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    with torch.no_grad():  # loop 1's adapters swapped into loop 2: a different map
        for block in core.layers:
            block.lora.wq_b[2] = block.lora.wq_b[1]
        swapped = core(s, n_loops=3, freqs=freqs, bucket_ids=bucket_ids, seg_real=seg_real).output
    assert not torch.allclose(swapped, want_out, atol=1e-4)
