"""FSDP2 over 2 gloo ranks vs one process: same global batch and seed give the same losses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spider_titan.parallel.mesh import destroy_process_groups
from tests.utils import DEBUG_DENSE, check_ok, run_train, tiny_run, train_losses

# the debug config's batch of 8, validation, TensorBoard and end-of-run export kept (None: the TOML's value)
COMMON = tiny_run(
    job__config_file=DEBUG_DENSE,
    training__steps=5,
    training__local_batch_size=None,
    training__deterministic=True,
    validation__enable=None,
    metrics__enable_tensorboard=None,
    checkpoint__export_at_end=None,
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "multi",
    [
        ["--training.local_batch_size", "2"],  # FSDP: 2 ranks x 2 samples
        ["--training.local_batch_size", "1", "--training.gradient_accumulation_steps", "2"],  # + accumulation
    ],
    ids=["fsdp", "fsdp-accum"],
)
def test_fsdp_two_ranks_match_single_process(multi, tmp_path):
    single = run_train(COMMON + ["--training.local_batch_size", "4", "--job.dump_folder", str(tmp_path / "one")])
    check_ok(single)
    sharded = run_train(COMMON + multi + ["--job.dump_folder", str(tmp_path / "two")], nprocs=2)
    check_ok(sharded)
    ref, got = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert sorted(ref) == sorted(got) == [1, 2, 3, 4, 5]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-4), (step, ref, got)
    # the losses must move, or equality would prove nothing
    assert ref[5] < ref[1]


# ---------------------------------------------------------------- FSDP hot path


@pytest.mark.parametrize(
    "counter, backend, custom",
    [(False, "nccl", False), (True, "nccl", True), (False, "gloo", True), (True, "gloo", True)],
)
def test_custom_comms_only_for_counter_or_gloo(counter, backend, custom):
    """On NCCL with the counter off no private comm slot is set: FSDP2 keeps its default collectives."""
    from spider_titan.parallel.fsdp import needs_custom_comms

    assert needs_custom_comms(counter_enabled=counter, backend=backend) is custom


def test_keep_gathered_rule():
    from torch import nn

    from spider_titan.parallel.fsdp import keep_gathered

    core = nn.Linear(1000, 1000, bias=False)  # 4 MB in fp32, 2 MB in bf16
    assert keep_gathered(core, torch.bfloat16, device_memory=20_000_000, fraction=0.1)
    assert not keep_gathered(core, torch.float32, device_memory=20_000_000, fraction=0.1)


def _accum_worker(rank: int, world_size: int, store: str, out: str) -> None:
    """Two micro-batches per step under FSDP (+ the core kept gathered, the default), gradient
    sync on every micro-batch vs on the last only: the same gradients, half the reduce-scatter."""
    import json

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from spider_titan.components.builder import build_model, materialize
    from spider_titan.config.manager import parse_args
    from spider_titan.parallel.comm_counter import CommCounter, step_total
    from spider_titan.parallel.fsdp import maybe_no_grad_sync
    from spider_titan.parallel.mesh import ParallelDims
    from spider_titan.parallel.parallelize import apply_parallelism
    from spider_titan.protocol import lm_loss_sum

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        micro = torch.randint(0, 256, (2, 1, 65), generator=torch.Generator().manual_seed(rank))
        grads, tallies = {}, {}
        for no_sync in (False, True):
            cfg = parse_args(
                ["--model.name", "spider", "--model.flavor", "debug", "--parallelism.comm_counter", "true"],
                env={"WORLD_SIZE": str(world_size)},
            )
            spec, _, model = build_model(cfg)
            materialize(model, torch.device("cpu"), 0)
            dims = ParallelDims.from_config(cfg.parallelism, world_size)
            counter = CommCounter()
            apply_parallelism(
                model,
                spec,
                dims,
                dims.build_meshes("cpu"),
                cfg.parallelism,
                param_dtype=torch.float32,
                reduce_dtype=torch.float32,
                counter=counter,
            )
            for i, x in enumerate(micro):
                with maybe_no_grad_sync(model, is_last_microbatch=not no_sync or i == len(micro) - 1):
                    out_ = model(x[:, :-1], sample_ids=torch.tensor([2 * rank + i]))
                    (lm_loss_sum(out_.logits, x[:, 1:]) / 128 + out_.aux_loss / 2).backward()
            tallies[no_sync] = counter.step()
            grads[no_sync] = {
                n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                for n, p in model.named_parameters()
                if p.grad is not None
            }
        assert sorted(grads[False]) == sorted(grads[True]) and len(grads[False]) > 10
        for name, want in grads[False].items():
            # relative to the tensor's largest entry: residual_proj's first-step gradient reaches ~1e3
            atol = 1e-7 * max(1.0, want.abs().max().item())
            torch.testing.assert_close(grads[True][name], want, rtol=1e-5, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
        if rank == 0:
            Path(out).write_text(
                json.dumps(
                    {
                        str(k): {kind: step_total(t, kind) for kind in ("all_gather", "reduce_scatter")}
                        | {
                            "core_all_gather": step_total(t, "all_gather", "core"),
                            "core_reduce_scatter": step_total(t, "reduce_scatter", "core"),
                        }
                        for k, t in tallies.items()
                    }
                )
            )
        dist.barrier()
    finally:
        destroy_process_groups()


@pytest.mark.slow
def test_gradient_sync_on_last_micro_batch_only(tmp_path):
    import json

    out = tmp_path / "bytes.json"
    torch.multiprocessing.spawn(_accum_worker, args=(2, str(tmp_path / "store"), str(out)), nprocs=2)
    sync_all, sync_last = json.loads(out.read_text())["False"], json.loads(out.read_text())["True"]
    assert sync_last["reduce_scatter"] * 2 == sync_all["reduce_scatter"] > 0
    assert sync_last["all_gather"] == sync_all["all_gather"] > 0
    # the core stays gathered from forward to backward: one all-gather per micro-batch, not two
    assert sync_all["core_all_gather"] == sync_all["core_reduce_scatter"] > 0
    assert sync_last["core_all_gather"] == 2 * sync_last["core_reduce_scatter"]


def test_unit_reshard_rule_and_overrides():
    """The core stays gathered under ``default`` when it fits; overrides win; bad entries fail."""
    from types import SimpleNamespace

    from torch import nn

    from spider_titan.parallel.parallelize import unit_reshard_after_forward

    units = [("prelude.layers.0", nn.Linear(4, 4)), ("core", nn.Linear(8, 8)), ("coda.layers.0", nn.Linear(4, 4))]

    def cfg(policy="default", fraction=0.1, overrides=()):
        return SimpleNamespace(
            fsdp_reshard_after_forward=policy,
            fsdp_keep_core_gathered_fraction=fraction,
            fsdp_reshard_after_forward_units=list(overrides),
        )

    assert unit_reshard_after_forward(units, ["core"], cfg(), torch.float32) == {"core": False}
    assert unit_reshard_after_forward(units, ["core"], cfg(fraction=0.0), torch.float32) == {}
    assert unit_reshard_after_forward(units, ["core"], cfg(policy="always"), torch.float32) == {}
    got = unit_reshard_after_forward(
        units, ["core"], cfg(overrides=["core=true", "coda.layers.0=false"]), torch.float32
    )
    assert got == {"core": True, "coda.layers.0": False}
    with pytest.raises(ValueError, match="is not FQN=true\\|false"):
        unit_reshard_after_forward(units, ["core"], cfg(overrides=["core"]), torch.float32)


@pytest.mark.parametrize(
    "shape, group, want",
    [
        ((32, 528, 2048), 8, 0),  # 1B experts at 8 ranks: dim 0 divides
        ((32, 528, 2048), 64, 2),  # 64 ranks: dim 0 would be half padding; 528 % 64 != 0, 2048 divides
        ((32, 2048, 528), 512, 1),
        ((272, 2048), 64, 1),  # 320 padded rows for 272 (18 %)
        ((2050, 128), 64, 0),  # 2112 for 2050 (3 %): padding is cheaper than the extra copy
        ((3, 5), 4, 0),  # nothing divides: dim 0 (padded) as FSDP2 would
        ((7,), 4, 0),
        ((8, 64), 1, 0),
    ],
)
def test_shard_dim_avoids_padding_dim_0(shape, group, want):
    from spider_titan.parallel.fsdp import shard_dim

    assert shard_dim(shape, group) == want
