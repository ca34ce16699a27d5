"""Aux-loss-free balancing: counts over training micro-batches only (not recomputations, not
evaluation forwards); the update direction."""

from __future__ import annotations

import torch

from spider_titan.components.builder import build_model, materialize
from spider_titan.config.manager import parse_args
from spider_titan.moe.layer import MoE
from spider_titan.moe.load_balance import AuxFreeBalancer


def build(ac_mode: str):
    cfg = parse_args(["--model.name", "spider", "--activation_checkpoint.mode", ac_mode], env={})
    _, _, model = build_model(cfg)
    materialize(model, torch.device("cpu"), 0)
    bal = AuxFreeBalancer(model, rate=0.01)
    return model, Step(bal), bal


class Step:
    """An optimizer step as the trainer runs it: the (no-op) update, then the post-step hook."""

    def __init__(self, bal: AuxFreeBalancer):
        self.bal = bal

    def step(self) -> None:
        self.bal.update()


def run_step(model, opt, batches):
    model.train()
    for x in batches:
        torch.manual_seed(1)
        out = model(x)
        (out.logits.float().mean() + out.aux_loss).backward()


def batches(seed: int, n: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, 64), generator=gen) for _ in range(n)]


def test_counts_cover_all_micro_batches_and_skip_recomputation():
    model, opt, bal = build("none")
    run_step(model, opt, batches(0))
    per_layer = [c.clone() for c in bal.counts()]
    assert sum(float(c.sum()) for c in per_layer) > 0

    model_ac, opt_ac, bal_ac = build("full")  # full AC re-runs every MoE forward in backward
    run_step(model_ac, opt_ac, batches(0))
    for a, b in zip(per_layer, bal_ac.counts()):
        torch.testing.assert_close(a, b)


def test_update_moves_bias_toward_balance_once_per_step():
    model, opt, bal = build("none")
    run_step(model, opt, batches(0, n=1))
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    counts = [c.clone() for c in bal.counts()]
    opt.step()  # the post-step hook applies the update and clears the counts
    assert all((c == 0).all() for c in bal.counts())
    for layer, c in zip(layers, counts):
        expected = 0.01 * torch.sign(c.mean() - c)
        torch.testing.assert_close(layer.expert_bias, expected)
    opt.step()  # a step without training forwards leaves the bias alone
    for layer, c in zip(layers, counts):
        torch.testing.assert_close(layer.expert_bias, 0.01 * torch.sign(c.mean() - c))


def test_eval_forward_between_steps_does_not_feed_the_update():
    """A validation forward (eval mode) between two steps changes neither the counts nor the bias
    update: the run with it ends with the same biases as the run without it."""
    biases = []
    for with_eval in (False, True):
        model, opt, bal = build("recurrent")
        for step in range(3):  # an odd count: two +-rate updates can cancel to a zero bias
            run_step(model, opt, batches(step))
            opt.step()
            if with_eval:
                model.eval()
                with torch.no_grad():
                    model(batches(99)[0])
                assert all((c == 0).all() for c in bal.counts())
        biases.append([m.expert_bias.clone() for m in model.modules() if isinstance(m, MoE)])
    assert any((b != 0).any() for b in biases[0])
    for a, b in zip(*biases):
        torch.testing.assert_close(a, b)


def test_registry_hands_the_update_to_the_builder_as_a_post_step_hook():
    from spider_titan.components.builder import build_run
    from spider_titan.config.manager import parse_args as parse

    def hooks(mode):
        cfg = parse(
            [
                "--model.name",
                "spider",
                "--training.dataset",
                "mock",
                "--training.seq_len",
                "64",
                "--moe.load_balance",
                mode,
            ],
            env={},
        )
        return build_run(
            cfg, rank=0, world_size=1, dump_folder=__import__("pathlib").Path("/tmp/unused")
        ).post_step_hooks

    assert hooks("aux_loss") == []
    (update,) = hooks("aux_free")
    assert isinstance(update.__self__, AuxFreeBalancer)


# ---------------------------------------------------------------- global-batch statistics


def _moe_layer():
    torch.manual_seed(0)
    moe = MoE(dim=16, n_experts=4, top_k=2, inter_dim=16)
    moe.init_weights(0.5, 0.02)
    x = torch.randn(3, 5, 16)
    mask = torch.rand(3, 5) > 0.3
    return moe, x, mask


def test_reduce_stats_as_two_identical_ranks_keeps_the_loss_and_the_gradient():
    """A reducer that doubles its input is what two ranks holding the same tokens would see. The
    global-batch f_i and P_i equal the local ones, so the aux loss is unchanged; the sum's backward
    doubles the gradient reaching this rank's sums and the doubled token count halves it, so each
    rank's router gradient is the single-process one, and so is FSDP's average of the two."""
    moe, x, mask = _moe_layer()
    moe.train()
    _, ref = moe(x, token_mask=mask)
    ref.aux_loss.backward()
    ref_grad = moe.router.weight.grad.clone()
    moe.router.weight.grad = None

    moe.reduce_stats = lambda t: 2 * t
    _, got = moe(x, token_mask=mask)
    got.aux_loss.backward()
    torch.testing.assert_close(got.aux_loss, ref.aux_loss)
    torch.testing.assert_close(moe.router.weight.grad, ref_grad)
    torch.testing.assert_close(got.counts, ref.counts)  # counts stay this rank's (telemetry, aux-free)


def test_reduce_stats_sums_what_the_loss_uses_in_training_only():
    """The reducer sees (P sums, slot counts, token count) of this rank's real tokens, in training;
    an eval forward never calls it (ranks may run different loop counts at eval)."""
    moe, x, mask = _moe_layer()
    seen = []

    def record(t):
        seen.append(t.detach().clone())
        return t

    moe.reduce_stats = record
    moe.eval()
    with torch.no_grad():
        moe(x, token_mask=mask)
    assert seen == []
    moe.train()
    _, stats = moe(x, token_mask=mask)
    (sums,) = seen
    E, n_real = moe.n_experts, int(mask.sum())
    torch.testing.assert_close(sums[E : 2 * E], stats.counts)
    assert float(sums[2 * E]) == n_real and float(sums[E : 2 * E].sum()) == 2 * n_real
    torch.testing.assert_close(sums[:E].sum(), torch.tensor(float(n_real)))  # probabilities sum to 1 per token
