"""optimizer.implementation: AdamW's fused, foreach and for-loop kernels take the same steps."""

from __future__ import annotations

import dataclasses
import types

import torch

from spider_titan.job_config import Optimizer
from spider_titan.models.spider import SPIDER_FLAVORS, Spider
from spider_titan.optim.optimizers import adamw_kernels, build_adamw, build_muon


def _trained(build, implementation: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A small Spider after 3 optimizer steps on one batch, fp32 on CPU, and each parameter's learning rate."""
    torch.manual_seed(0)
    model = Spider(dataclasses.replace(SPIDER_FLAVORS["debug"], n_core=1, n_prelude=1, n_coda=1))
    model.init_weights()
    opt = build(model, Optimizer(lr=1e-2, implementation=implementation))
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    group_lr = {id(p): group["lr"] for group in opt.param_groups for p in group["params"]}
    lrs = {name: group_lr[id(p)] for name, p in model.named_parameters()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, lrs


def test_the_kernels_take_the_same_steps():
    """Three AdamW steps with each kernel choice end at the same weights, within a thousandth of each
    parameter's learning rate (fused differs by float order: ~2e-6 at lr 1e-2, 9.5e-6 on the byte n-gram
    tables at their 8x): the choice is speed only. A wrong keyword (say, betas lost on one path) moves
    weights by ~lr. Muon's inner AdamW takes the same choice."""
    reference, lrs = _trained(build_adamw, "for-loop")
    assert len(set(lrs.values())) > 1  # the tolerance follows the groups' learning rates
    for implementation in ("fused", "foreach", "auto"):
        got, _ = _trained(build_adamw, implementation)
        for name, value in reference.items():
            tol = 1e-3 * lrs.get(name, 1e-2)
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=tol, msg=f"{implementation}: {name}")
    model = Spider(dataclasses.replace(SPIDER_FLAVORS["debug"], n_core=1, n_prelude=1, n_coda=1))
    for implementation, fused, foreach in (("fused", True, False), ("auto", False, True), ("for-loop", False, False)):
        adamw = build_muon(model, Optimizer(implementation=implementation)).adamw
        assert (adamw.defaults["fused"], adamw.defaults["foreach"]) == (fused, foreach)


def test_auto_picks_fused_on_cuda_only():
    """``auto``: fused when every parameter is a CUDA tensor, foreach otherwise."""
    on = lambda kind: types.SimpleNamespace(device=torch.device(kind))  # noqa: E731
    assert adamw_kernels([on("cuda"), on("cuda")], "auto") == {"fused": True, "foreach": False}
    assert adamw_kernels([on("cuda"), on("cpu")], "auto") == {"fused": False, "foreach": True}
    assert adamw_kernels([on("cpu")], "for-loop") == {"fused": False, "foreach": False}
