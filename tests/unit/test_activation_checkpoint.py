"""Activation checkpointing changes memory, never results: every mode's gradients equal ``none``'s."""

from __future__ import annotations

import pytest
import torch

from spider_titan.components.builder import build_model, materialize
from spider_titan.config.manager import parse_args
from spider_titan.moe.layer import MoE
from spider_titan.protocol import lm_loss_mean

MODES = [("full", "op"), ("selective", "op"), ("selective", "2"), ("recurrent", "op")]


def grads_for(model_name: str, mode: str, option: str, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    cfg = parse_args(
        [
            "--model.name",
            model_name,
            "--activation_checkpoint.mode",
            mode,
            "--activation_checkpoint.selective_ac_option",
            option,
        ],
        env={},
    )
    spec, _, model = build_model(cfg)
    materialize(model, torch.device("cpu"), seed=0)
    torch.manual_seed(1)  # the same sampling noise (Spider's boundary predictor) in every run
    out = model(inputs)
    loss = lm_loss_mean(out.logits, inputs.roll(-1, 1)) + out.aux_loss
    loss.backward()
    return {
        n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


@pytest.mark.parametrize("model_name", ["dense", "spider"])
@pytest.mark.parametrize("mode, option", MODES, ids=[f"{m}-{o}" for m, o in MODES])
def test_ac_gradients_equal_no_ac(model_name, mode, option):
    torch.manual_seed(0)
    inputs = torch.randint(0, 256, (2, 48))
    if mode == "recurrent" and model_name == "dense":
        with pytest.raises(ValueError, match="recurrent core"):
            grads_for(model_name, mode, option, inputs)
        return
    ref = grads_for(model_name, "none", "op", inputs)
    got = grads_for(model_name, mode, option, inputs)
    assert ref.keys() == got.keys() and len(ref) > 10
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-6, msg=name)


def test_ac_wraps_the_blocks_each_mode_names():
    from spider_titan.parallel.activation_checkpoint import apply_ac

    counts = {}
    for mode, option in [("full", "op"), ("selective", "2"), ("recurrent", "op")]:
        cfg = parse_args(["--model.name", "spider", "--activation_checkpoint.mode", "none"], env={})
        spec, args, model = build_model(cfg)
        cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option = mode, option
        counts[mode] = apply_ac(model, spec, cfg.activation_checkpoint)
    n_blocks = args.n_prelude + args.n_core + args.n_coda
    assert counts == {"full": n_blocks, "selective": (n_blocks + 1) // 2, "recurrent": args.n_core}


@pytest.mark.parametrize("mode, option", [("full", "op"), ("selective", "op"), ("recurrent", "op")])
def test_recompute_replays_the_forward_routing(mode, option, monkeypatch):
    """A router that would choose differently on every call (each ``select`` adds its own random
    bias): AC gradients still equal ``none``'s, because the recompute reuses the forward's top-k."""
    import itertools

    from spider_titan.moe.layer import MoE

    calls = {"n": itertools.count()}

    def reroute(self, scores):
        bias = torch.rand(self.n_experts, generator=torch.Generator().manual_seed(next(calls["n"])))
        return torch.topk(scores.detach() + bias, self.top_k, dim=-1).indices

    monkeypatch.setattr(MoE, "select", reroute)
    torch.manual_seed(0)
    inputs = torch.randint(0, 256, (2, 48))
    ref = grads_for("spider", "none", "op", inputs)
    n_forward = next(calls["n"])
    calls["n"] = itertools.count()
    got = grads_for("spider", mode, option, inputs)
    assert next(calls["n"]) == n_forward > 0  # the recompute did not route again
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.slow
def test_the_memory_budget_is_set_for_the_compiler_and_reset_by_every_other_mode():
    """``memory_budget`` hands its budget to torch.compile's partitioner (a process-wide setting); a
    later build with another mode sets torch's default back, so no budget leaks into the next run."""
    budget = ["--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget", "0.3"]
    try:
        _, _, model = build_model(parse_args([*budget, "--training.compile", "true"], env={}))
        assert torch._functorch.config.activation_memory_budget == 0.3
        assert torch._functorch.config.unsafe_treat_script_objects_as_zero_size  # expert parallel's groups
        moes = [m for m in model.modules() if isinstance(m, MoE)]
        assert moes and all(m.save_selection for m in moes)  # the top-k is saved (next test)
        _, _, model = build_model(parse_args(["--activation_checkpoint.mode", "recurrent"], env={}))
        assert torch._functorch.config.activation_memory_budget == 1.0
        assert not torch._functorch.config.unsafe_treat_script_objects_as_zero_size
        assert not any(m.save_selection for m in model.modules() if isinstance(m, MoE))
    finally:
        torch._functorch.config.activation_memory_budget = 1.0
        torch._functorch.config.unsafe_treat_script_objects_as_zero_size = False


@pytest.mark.slow
@pytest.mark.parametrize("save_selection", [True, False])
def test_under_a_memory_budget_the_moe_top_k_is_saved_not_recomputed(save_selection):
    """A compiled memory budget lets the partitioner recompute any op in backward, and it does recompute
    the MoE's top-k (the control, ``save_selection`` off): a recompute that rounds the scores differently
    would route the backward to other experts. With it on, the backward graph has no top-k, and the
    gradients are the eager ones."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    backward_graphs = []

    def keep_backward(gm, _):
        backward_graphs.append(gm.graph)
        return gm.forward

    def backend(gm, inputs):
        return aot_module_simplified(
            gm,
            inputs,
            fw_compiler=lambda gm, _: gm.forward,
            bw_compiler=keep_backward,
            partition_fn=min_cut_rematerialization_partition,
            decompositions=select_decomp_table(),
        )

    torch.manual_seed(0)
    moe = MoE(64, 8, 2, 64)
    moe.init_weights(0.02, 0.02)
    moe.save_selection = save_selection
    x = torch.randn(256, 64, requires_grad=True)
    torch._dynamo.reset()
    torch._functorch.config.activation_memory_budget = 0.05
    try:
        torch.compile(lambda x: moe(x)[0], backend=backend)(x).square().sum().backward()
    finally:
        torch._functorch.config.activation_memory_budget = 1.0
        torch._dynamo.reset()
    (graph,) = backward_graphs
    topk = [n for n in graph.nodes if n.op == "call_function" and "topk" in str(n.target)]
    assert bool(topk) != save_selection, graph
    compiled = x.grad.clone()
    x.grad = None
    moe(x)[0].square().sum().backward()
    torch.testing.assert_close(compiled, x.grad, rtol=1e-5, atol=1e-7)
