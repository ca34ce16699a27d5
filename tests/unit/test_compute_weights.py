"""Weights cast once per step under autocast (parallel/precision.py; issue 39, item 3).

The reduced-width spider_1b config (its loops, recurrent activation checkpointing, per-loop LoRA,
grouped experts; two micro-batches) trains two steps on CPU under bf16 autocast, as a GPU run
without FSDP does: once with the train step's ComputeWeights, once with plain autocast. A dispatch
mode counts every cast whose input is a parameter's storage (autocast's casts, the experts' and the
LoRA slices' ``.to(x.dtype)``, ComputeWeights' own). With ComputeWeights each parameter is cast at
most once per step; plain autocast casts the core's weights at every loop, micro-batch and recompute.
The forward computes the same numbers either way (autocast rounds these weights to bf16 at every
use), so step 1's loss is equal to the last bit; only the backward's sums over a weight's uses
differ (bf16 into the one cast, against fp32 per use), so step 2 agrees to bf16 precision.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spider_titan.parallel.precision import ComputeWeights, matmul_weight_names
from tests.unit.test_host_syncs import SMALL
from tests.utils import tiny_run

STEPS = 2


class ParameterCasts(TorchDispatchMode):
    """Counts ``_to_copy`` calls per parameter storage that change the dtype."""

    def __init__(self, params: list[torch.nn.Parameter]):
        super().__init__()
        self.names = {p.untyped_storage().data_ptr(): name for name, p in params}
        self.casts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            src, dtype = args[0], kwargs.get("dtype")
            name = self.names.get(src.untyped_storage().data_ptr())
            if name is not None and dtype is not None and dtype != src.dtype:
                self.casts[name] += 1
        return func(*args, **kwargs)


def train(tmp_path, cast_once: bool) -> tuple[list[dict], list[Counter], list[str]]:
    from spider_titan.config.manager import parse_args
    from spider_titan.train import Trainer

    argv = tiny_run(job__config_file="train_configs/spider_1b.toml", **SMALL)
    argv += ["--training.gradient_accumulation_steps", "2", "--training.steps", str(STEPS)]
    argv += ["--job.dump_folder", str(tmp_path / f"cast_once_{cast_once}")]
    trainer = Trainer(parse_args(argv, env={}))
    run = trainer.run
    model = run.model
    bf16 = torch.bfloat16
    trainer.run = dataclasses.replace(
        run, autocast_dtype=bf16, compute_weights=ComputeWeights(model, bf16) if cast_once else None
    )
    params = list(model.named_parameters())
    rows, casts = [], []
    try:
        for step in range(1, STEPS + 1):
            with ParameterCasts(params) as counter:
                metrics = trainer.train_step(trainer.next_micro_batches(), step)
            rows.append({k: float(v) for k, v in metrics.items()})
            casts.append(counter.casts)
    finally:
        trainer.close()
    return rows, casts, matmul_weight_names(model)


@pytest.mark.slow
def test_each_weight_is_cast_once_per_step_and_the_forward_is_unchanged(in_process, tmp_path):
    once, once_casts, names = train(tmp_path, cast_once=True)
    plain, plain_casts, _ = train(tmp_path, cast_once=False)
    print(
        f"\ncasts of parameters per step: {sum(once_casts[0].values())} cast once, "
        f"{sum(plain_casts[0].values())} under plain autocast (most for one parameter: "
        f"{max(once_casts[0].values())} and {max(plain_casts[0].values())}), {len(names)} matmul weights"
    )
    for counts in once_casts:
        assert counts == Counter({name: 1 for name in names}), counts  # each matmul weight once, nothing else
    # the control: plain autocast casts the looped core's weights many times a step (so the count can fail)
    assert max(plain_casts[0].values()) >= 4, plain_casts[0]
    # and no other parameter (the per-loop LoRA slices are gathered first: autocast casts the copies)
    assert set(plain_casts[0]) <= set(names)
    # the same forward: step 1 (same weights, same batches) to the last bit, aux metrics included
    assert once[0] == {**plain[0], "grad_norm": once[0]["grad_norm"]}
    assert once[0]["grad_norm"] == pytest.approx(plain[0]["grad_norm"], rel=1e-2)
    for a, b in zip(once[1:], plain[1:]):
        assert a["ce_sum"] == pytest.approx(b["ce_sum"], rel=1e-3)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_params_mode_computes_what_a_bf16_copy_computes():
    """training.mixed_precision_mode = "params" (the default without FSDP on a GPU) casts every floating
    parameter once and runs without autocast: FSDP's MixedPrecisionPolicy. So a forward and backward
    give exactly the logits of a bf16 copy of the model, and gradients equal to the copy's, cast to fp32.
    Autocast, the control, does not: its residual stream stays fp32, so its logits differ."""
    import copy

    from spider_titan.job_config import Training
    from spider_titan.models.spider import SPIDER_FLAVORS, Spider
    from spider_titan.parallel.precision import compute_precision, floating_param_names

    bf16 = torch.bfloat16
    torch.manual_seed(0)
    model = Spider(dataclasses.replace(SPIDER_FLAVORS["debug"], n_core=1, n_prelude=1, n_coda=1))
    model.init_weights()
    copied = copy.deepcopy(model).to(bf16)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))

    autocast_dtype, weights = compute_precision(model, Training(mixed_precision_mode="params"), bf16)
    assert autocast_dtype is None and weights.names == floating_param_names(model)
    params = list(model.named_parameters())
    with ParameterCasts(params) as counter, weights():
        out = model(ids, labels=ids)
        out.loss.backward()
    assert counter.casts == Counter({name: 1 for name, p in params if p.is_floating_point()})  # each once
    ref = copied(ids, labels=ids)
    ref.loss.backward()
    assert out.logits.dtype == bf16 and torch.equal(out.logits, ref.logits)
    for (name, p), q in zip(params, copied.parameters()):
        assert torch.equal(p.grad, q.grad.float()), name

    autocast_dtype, weights = compute_precision(model, Training(mixed_precision_mode="autocast"), bf16)
    assert autocast_dtype == bf16 and weights.names == matmul_weight_names(model)
    with torch.autocast("cpu", dtype=bf16), weights():
        plain = model(ids, labels=ids)
    assert not torch.equal(plain.logits, ref.logits)
    assert compute_precision(model, Training(mixed_precision_mode="autocast", cast_weights_once=False), bf16) == (
        bf16,
        None,
    )
    assert compute_precision(model, Training(), None) == (None, None)  # fp32 (a CPU run): no casts
