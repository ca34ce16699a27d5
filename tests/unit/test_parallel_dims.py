"""ParallelDims and the single-process pieces of spider_titan.parallel (no torchrun needed)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from spider_titan.distributed import clip_grad_norm_
from spider_titan.parallel.comm_counter import CommCounter, read_comm_counts, step_total
from spider_titan.parallel.expert_parallel import expert_major_index
from spider_titan.parallel.mesh import ParallelDims, use_fsdp


def dims(world: int, rep: int = 1, shard: int = -1, ep: int = 1) -> ParallelDims:
    cfg = SimpleNamespace(
        data_parallel_replicate_degree=rep, data_parallel_shard_degree=shard, expert_parallel_degree=ep
    )
    return ParallelDims.from_config(cfg, world, check=False)


def test_degrees_resolve_and_derive():
    d = dims(8, rep=2, ep=2)
    assert (d.dp_replicate, d.dp_shard, d.ep, d.dp_shard_mod_ep) == (2, 4, 2, 2)
    assert d.problems() == []
    assert d.dp_degree == d.gradient_divide_factor == 8
    assert d.fsdp_enabled and d.hsdp_enabled and d.ep_enabled
    assert not dims(1).fsdp_enabled
    assert use_fsdp(SimpleNamespace(fsdp="auto"), dims(2))
    assert not use_fsdp(SimpleNamespace(fsdp="never"), dims(2))
    assert use_fsdp(SimpleNamespace(fsdp="always"), dims(1))


@pytest.mark.parametrize(
    "world, rep, shard, ep, needle",
    [
        (4, 3, -1, 1, "WORLD_SIZE(4) = dp_replicate(3) * dp_shard(-1) has no whole-number dp_shard"),
        (6, 2, 2, 1, "dp_replicate(2) * dp_shard(2) = 4 != WORLD_SIZE(6)"),
        (6, 1, -1, 4, "dp_shard(6) = dp_shard_mod_ep * ep(4) has no whole-number dp_shard_mod_ep"),
        (2, 0, -1, 1, "data_parallel_replicate_degree: 0 must be >= 1"),
        (2, 1, 0, 1, "data_parallel_shard_degree: 0 must be >= 1 or -1"),
    ],
)
def test_each_inconsistency_is_one_line_with_the_equation(world, rep, shard, ep, needle):
    problems = dims(world, rep, shard, ep).problems()
    assert len(problems) == 1 and needle in problems[0] and "\n" not in problems[0], problems
    with pytest.raises(ValueError, match=r"parallelism"):
        ParallelDims.from_config(
            SimpleNamespace(
                data_parallel_replicate_degree=rep, data_parallel_shard_degree=shard, expert_parallel_degree=ep
            ),
            world,
        )


def test_expert_major_index_reorders_rank_major_rows():
    ep, n_local = 3, 4
    recv = torch.randint(0, 4, (ep, n_local))
    recv[1, 2] = 0  # empty blocks are fine
    # rank-major rows labelled (source, expert, i)
    labels = [(s, e, i) for s in range(ep) for e in range(n_local) for i in range(int(recv[s, e]))]
    index = expert_major_index(recv, len(labels))
    got = [labels[j] for j in index.tolist()]
    assert got == sorted(labels, key=lambda t: (t[1], t[0], t[2]))


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm_matches_torch_in_one_process(norm_type):
    torch.manual_seed(0)
    grads = [torch.randn(8, 8), torch.randn(8), torch.randn(3, 8)]
    ours, theirs = ([nn.Parameter(torch.zeros_like(g)) for g in grads] for _ in range(2))
    for a, b, g in zip(ours, theirs, grads):
        a.grad, b.grad = g.clone(), g.clone()
    want = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type=norm_type)
    got = clip_grad_norm_(ours, 0.5, norm_type=norm_type)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)


def test_comm_counter_steps_and_file(tmp_path):
    counter = CommCounter(tmp_path / "comm.jsonl")
    counter.add("all_gather", "core", 100)
    counter.add("all_gather", "core.experts", 10)
    counter.add("all_to_all", "core.layers.0.moe.experts", 7)
    first = counter.step()
    counter.add("all_gather", "core", 100)
    second = counter.step()
    assert first == {"all_gather": {"core": 100, "core.experts": 10}, "all_to_all": {"core.layers.0.moe.experts": 7}}
    assert second == {"all_gather": {"core": 100}}
    assert step_total(first, "all_gather", "core") == 110 and step_total(first, "reduce_scatter") == 0
    assert counter.totals()["all_gather"]["core"] == 200
    rows = read_comm_counts(tmp_path / "comm.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["all_gather"]["core"] == 100


def test_comm_counter_closes_a_step_per_post_step_hook(tmp_path, in_process):
    """The parallelize component hands the builder the counter's step as a post-step hook: one tally
    per optimizer step, written to comm_counts.jsonl."""
    from spider_titan.components.builder import build_run
    from spider_titan.config.manager import parse_args
    from spider_titan.parallel.comm_counter import COMM_COUNTS_FILE

    cfg = parse_args(
        [
            "--job.config_file",
            "train_configs/debug_model.toml",
            "--parallelism.comm_counter",
            "true",
            "--training.dataset",
            "mock",
            "--validation.enable",
            "false",
        ],
        env={},
    )
    run = build_run(cfg, rank=0, world_size=1, dump_folder=tmp_path)
    counters = [h.__self__ for h in run.post_step_hooks if isinstance(getattr(h, "__self__", None), CommCounter)]
    assert len(counters) == 1
    counters[0].add("all_gather", "root", 8)
    for hook in run.post_step_hooks:
        hook()
    for hook in run.post_step_hooks:
        hook()
    assert counters[0].steps == [{"all_gather": {"root": 8}}, {}]
    assert [r["step"] for r in read_comm_counts(tmp_path / COMM_COUNTS_FILE)] == [1, 2]


@pytest.fixture
def one_rank_gloo(tmp_path):
    """A 1-rank gloo process group for the custom collectives (torn down afterwards)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_custom_collectives_on_gloo(one_rank_gloo):
    from spider_titan.parallel.float8_allgather import BytesAllGather
    from spider_titan.parallel.fsdp import CountingReduceScatter

    counter = CommCounter()
    ag = BytesAllGather(counter, "unit")
    x = torch.tensor([0.5, -2.0, 448.0, 1.0]).to(torch.float8_e4m3fn)
    out = ag.allocate((4,), dtype=torch.float8_e4m3fn, device=torch.device("cpu"))
    ag(out, x, one_rank_gloo)  # gloo has no float8: "Invalid scalar type" without the uint8 view
    assert torch.equal(out.float(), x.float())

    rs = CountingReduceScatter(counter, "unit")
    g = torch.arange(4.0)
    res = torch.empty(4)
    rs(res, g.clone(), one_rank_gloo, dist.ReduceOp.PREMUL_SUM(0.25))  # gloo has no PREMUL_SUM
    torch.testing.assert_close(res, g * 0.25)
    assert counter.totals() == {"all_gather": {"unit": 4}, "reduce_scatter": {"unit": 16}}


def test_spider_fsdp_units_make_the_core_one_unit():
    from spider_titan.components.builder import build_model
    from spider_titan.config.manager import parse_args
    from spider_titan.parallel.parallelize import fsdp_units

    spec, _, model = build_model(parse_args(["--model.name", "spider", "--model.flavor", "debug"], env={}))
    names = [fqn for fqn, _ in fsdp_units(spec, model)]
    assert names == ["prelude.layers.0", "core", "coda.layers.0"]  # forward order
