"""Parallel layouts of the Spider debug model vs one process, and what their collectives move.

Each parallel CLI run is compared with a 1-process run that holds the whole global batch (4
samples) in one micro-batch: the MoE balance statistics are sums over the data-parallel ranks
(global-batch load balancing, moe/layer.py), so the ranks together compute what one process
computes on the global batch; the boundary loss is a mean over rows, so it matches as it stands.
The boundary rule draws no noise (a pure function of the bytes and the weights), so a sample is
segmented the same way on any rank and in any micro-batch: the learned segmentation runs for real
in every layout.

AdamW hardly notices a gradient off by a constant factor, so the losses alone would not catch a
wrong gradient scale (e.g. expert gradients divided by the efsdp size instead of the dp degree):
the CLI tests also compare the gradient norm, and ``test_gradients_match_one_process`` compares
every parameter's gradient.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from spider_titan.parallel.comm_counter import read_comm_counts, step_total
from spider_titan.parallel.mesh import destroy_process_groups
from tests.utils import DEBUG_SPIDER, REPO, check_ok, read_metrics, run_train, tiny_run

# the debug config's batch of 8 and its end-of-run export kept (None: the TOML's value)
COMMON = tiny_run(
    job__config_file=REPO / DEBUG_SPIDER,
    model__name="spider",
    model__flavor="debug",
    training__steps=5,
    training__local_batch_size=None,
    training__deterministic=True,
    checkpoint__export_at_end=None,
)
TRITON = {"TRITON_INTERPRET": "1"}
STATIC = ["--model.segment_capacity", "4.0", "--model.packed_capacity", "4.0"]

# name -> (nprocs, extra args, env); the reference holds in one micro-batch what the ranks split
RUNS = {
    "ref": (1, ["--training.local_batch_size", "4"], None),
    "fsdp2": (2, ["--training.local_batch_size", "2", "--parallelism.comm_counter", "true"], None),
    "fsdp2_loops4": (
        2,
        ["--training.local_batch_size", "2", "--parallelism.comm_counter", "true", "--model.n_loops", "4"],
        None,
    ),
    "hsdp2x2": (4, ["--training.local_batch_size", "1", "--parallelism.data_parallel_replicate_degree", "2"], None),
    # EP 2 inside FSDP 2 (experts not FSDP-sharded further), with the Triton MoE backend
    "ep2_fsdp2": (
        2,
        [
            "--training.local_batch_size",
            "2",
            "--parallelism.expert_parallel_degree",
            "2",
            "--moe.backend",
            "triton",
            "--parallelism.comm_counter",
            "true",
        ],
        TRITON,
    ),
    # EP 2 x DP 2: experts split 2 ways and FSDP-sharded over the other 2 ranks; recurrent AC on top
    "ep2_dp2": (
        4,
        [
            "--training.local_batch_size",
            "1",
            "--parallelism.expert_parallel_degree",
            "2",
            "--activation_checkpoint.mode",
            "recurrent",
            "--parallelism.comm_counter",
            "true",
        ],
        None,
    ),
    # static shapes (segment slots and packed positions) that never drop: the same function as "ref"
    "ref_static": (1, ["--training.local_batch_size", "4", *STATIC], None),
    "fsdp2_static": (2, ["--training.local_batch_size", "2", *STATIC], None),
    "fp8": (
        2,
        ["--training.local_batch_size", "2", "--model.converters", "float8", "--parallelism.comm_counter", "true"],
        None,
    ),
    "fp8_all_gather": (
        2,
        [
            "--training.local_batch_size",
            "2",
            "--model.converters",
            "float8",
            "--float8.enable_fsdp_float8_all_gather",
            "true",
            "--parallelism.comm_counter",
            "true",
        ],
        None,
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run each named CLI run once per module, on first use; returns its dump folder."""
    root = tmp_path_factory.mktemp("parallel_runs")
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            nprocs, extra, env = RUNS[name]
            folder = root / name
            check_ok(run_train(COMMON + extra + ["--job.dump_folder", str(folder)], nprocs=nprocs, env=env))
            done[name] = folder
        return done[name]

    return get


def steps(folder: Path) -> dict[int, dict]:
    return {row["step"]: row for row in read_metrics(folder) if "loss" in row}


def assert_same_training(ref: Path, got: Path, rel: float = 1e-4) -> None:
    a, b = steps(ref), steps(got)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5]
    for step in a:
        for key in ("loss", "grad_norm", "moe_aux_loss"):
            assert b[step][key] == pytest.approx(a[step][key], rel=rel), (step, key, a[step][key], b[step][key])
    assert a[5]["loss"] < a[1]["loss"]  # the losses must move, or equality would prove nothing


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, ref",
    [("fsdp2", "ref"), ("hsdp2x2", "ref"), ("ep2_fsdp2", "ref"), ("ep2_dp2", "ref"), ("fsdp2_static", "ref_static")],
)
def test_parallel_run_matches_one_process(runs, name, ref):
    assert_same_training(runs(ref), runs(name))
    if name.startswith("ep"):
        first = read_comm_counts(runs(name) / "comm_counts.jsonl")[0]
        assert step_total(first, "all_to_all") > 0  # tokens really crossed ranks
    if name == "ep2_dp2":  # experts are FSDP-sharded over the 2 ranks that hold the same experts
        assert step_total(first, "all_gather", "core.experts") > 0


@pytest.mark.slow
def test_static_shapes_that_drop_nothing_train_as_counted_segments_do(runs):
    """Segment slots and packed positions with room for every segment compute what the counted segments
    compute (their sums run in another order)."""
    assert_same_training(runs("ref"), runs("ref_static"))


@pytest.mark.slow
def test_core_all_gather_bytes_do_not_grow_with_n_loops(runs):
    """The recurrent core is one FSDP unit, gathered once per step whatever the loop count."""
    two = read_comm_counts(runs("fsdp2") / "comm_counts.jsonl")
    four = read_comm_counts(runs("fsdp2_loops4") / "comm_counts.jsonl")
    assert len(two) == len(four) == 5
    for a, b in zip(two, four):
        assert a["all_gather"]["core"] == b["all_gather"]["core"] > 0
        assert a["reduce_scatter"]["core"] == b["reduce_scatter"]["core"] > 0
    # the core stays gathered from forward to backward (fsdp.py): the unit's parameters (fp32) are
    # gathered once per step and reduce-scattered once; the other units are gathered twice
    assert two[0]["all_gather"]["core"] == two[0]["reduce_scatter"]["core"]
    assert two[0]["all_gather"]["coda.layers.0"] == 2 * two[0]["reduce_scatter"]["coda.layers.0"]


@pytest.mark.slow
def test_fp8_all_gather_tracks_fp8_run_and_moves_fp8(runs):
    """fp8 all-gather (fp32 parameters on CPU): same losses as the fp8 run without it; the dense
    blocks (converted linears + tiny norms) gather 1 byte per weight instead of 4."""
    plain, fp8 = runs("fp8"), runs("fp8_all_gather")
    a, b = steps(plain), steps(fp8)
    for step in a:
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-3), (step, a[step]["loss"], b[step]["loss"])
    off = read_comm_counts(plain / "comm_counts.jsonl")[-1]["all_gather"]
    on = read_comm_counts(fp8 / "comm_counts.jsonl")[-1]["all_gather"]
    for unit in ("prelude.layers.0", "coda.layers.0"):
        assert 0.25 <= on[unit] / off[unit] < 0.26, (unit, on[unit], off[unit])


# ---------------------------------------------------------------- gradients, parameter by parameter

LAYOUTS = {
    # 4 ranks: experts split 2 ways and FSDP-sharded 2 ways (their reduce-scatter divides by 4,
    # not by its group size 2); HSDP 2 x 2 with EP 2 (dense HSDP, experts HSDP over replicas)
    "ep2_dp_shard4": ["--parallelism.expert_parallel_degree", "2"],
    "ep2_hsdp2x2": ["--parallelism.expert_parallel_degree", "2", "--parallelism.data_parallel_replicate_degree", "2"],
}


def _gradient_worker(rank: int, world_size: int, store: str, layouts: list[list[str]]) -> None:
    from torch.distributed.tensor import DTensor

    from spider_titan.components.builder import build_model, materialize
    from spider_titan.config.manager import parse_args
    from spider_titan.distributed import clip_grad_norm_
    from spider_titan.parallel.mesh import ParallelDims
    from spider_titan.parallel.parallelize import apply_parallelism
    from spider_titan.protocol import lm_loss_sum

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        base = ["--model.name", "spider", "--model.flavor", "debug"]
        batches = torch.randint(0, 256, (world_size, 1, 65), generator=torch.Generator().manual_seed(1))
        n_global = batches[:, :, 1:].numel()

        def loss_of(model, x, dp, sample_ids):  # train.py's normalisation: ce * dp / N_global + aux
            out = model(x[:, :-1], sample_ids=sample_ids)
            return lm_loss_sum(out.logits, x[:, 1:]) * dp / n_global + out.aux_loss

        cfg = parse_args(base, env={})
        _, _, ref = build_model(cfg)
        materialize(ref, torch.device("cpu"), 0)
        # one process, the ranks' batches as one micro-batch (the MoE statistics are global-batch ones)
        loss_of(ref, batches[:, 0], 1, torch.arange(world_size)).backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        ref_norm = torch.nn.utils.get_total_norm(list(ref_grads.values()))

        for overrides in layouts:
            cfg = parse_args(base + overrides, env={"WORLD_SIZE": str(world_size)})
            spec, _, model = build_model(cfg)
            materialize(model, torch.device("cpu"), 0)
            dims = ParallelDims.from_config(cfg.parallelism, world_size)
            apply_parallelism(
                model,
                spec,
                dims,
                dims.build_meshes("cpu"),
                cfg.parallelism,
                param_dtype=torch.float32,
                reduce_dtype=torch.float32,
            )
            loss_of(model, batches[rank], dims.dp_degree, torch.tensor([rank])).backward()
            norm = clip_grad_norm_(list(model.parameters()), 0.0)
            for name, p in model.named_parameters():
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                want = ref_grads[name]
                torch.testing.assert_close(
                    g,
                    want,
                    rtol=1e-4,
                    atol=1e-4 * float(want.abs().max()) + 1e-12,
                    msg=lambda m, n=name, o=overrides: f"{o} {n}: {m}",
                )
            assert math.isclose(float(norm), float(ref_norm), rel_tol=1e-5), (overrides, float(norm), float(ref_norm))
        dist.barrier()  # all ranks done talking before any tears its gloo group down
    finally:
        destroy_process_groups()


@pytest.mark.slow
def test_gradients_match_one_process():
    """Every parameter's gradient (experts, router, all aux-loss paths) and the clipped-norm input
    under EP x FSDP and EP x HSDP equal the one-process gradient of the same four micro-batches."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(
            _gradient_worker, args=(4, str(Path(tmp) / "store"), list(LAYOUTS.values())), nprocs=4
        )


# ---------------------------------------------------------------- start-up errors


@pytest.mark.parametrize(
    "world_size, args, needle",
    [
        (
            "4",
            ["--parallelism.data_parallel_replicate_degree", "3"],
            "WORLD_SIZE(4) = dp_replicate(3) * dp_shard(-1) has no whole-number dp_shard",
        ),
        (
            "4",
            ["--parallelism.expert_parallel_degree", "4", "--model.n_experts", "6"],
            "n_experts(6) = experts_per_rank * expert_parallel_degree(4)",
        ),
        (
            "1",
            ["--model.converters", "float8", "--float8.enable_fsdp_float8_all_gather", "true"],
            "float8.enable_fsdp_float8_all_gather: needs FSDP",
        ),
    ],
    ids=["world-size", "experts-vs-ep", "fp8-all-gather-without-fsdp"],
)
def test_bad_layout_fails_at_start_with_one_line(world_size, args, needle, monkeypatch, capsys):
    from spider_titan.train import main

    monkeypatch.setenv("WORLD_SIZE", world_size)
    assert main(COMMON + args) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], lines


# ---------------------------------------------------------------- routing replayed by recompute


def _routing_replay_worker(rank: int, world_size: int, store: str, mode: str) -> None:
    """EP 2 with recurrent AC must give the gradients of EP 2 without AC when routing ties
    (``ties``: router weights zeroed, every score equal) or when routing a second time would
    choose differently (``reroute``: each ``select`` call adds its own random bias, so a recompute
    that routed again would route elsewhere, change the all-to-all splits and fail or differ)."""
    import itertools

    from torch.distributed.tensor import DTensor

    from spider_titan.components.builder import build_model, materialize
    from spider_titan.config.manager import parse_args
    from spider_titan.moe.layer import MoE
    from spider_titan.parallel.mesh import ParallelDims
    from spider_titan.parallel.parallelize import apply_parallelism, fsdp_units
    from spider_titan.protocol import lm_loss_sum

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    real_select = MoE.select
    calls = itertools.count()

    def reroute(self, scores):  # call n routes with its own bias: no two calls agree
        bias = torch.rand(self.n_experts, generator=torch.Generator().manual_seed(next(calls)))
        return torch.topk(scores.detach() + bias, self.top_k, dim=-1).indices

    try:
        if mode == "reroute":
            MoE.select = reroute
        x = torch.randint(0, 256, (1, 65), generator=torch.Generator().manual_seed(10 + rank))
        grads = {}
        for ac in ("none", "recurrent"):
            cfg = parse_args(
                [
                    "--model.name",
                    "spider",
                    "--model.flavor",
                    "debug",
                    "--parallelism.expert_parallel_degree",
                    "2",
                    "--activation_checkpoint.mode",
                    ac,
                ],
                env={"WORLD_SIZE": str(world_size)},
            )
            spec, _, model = build_model(cfg)
            materialize(model, torch.device("cpu"), 0)
            if mode == "ties":
                for m in model.modules():
                    if isinstance(m, MoE):
                        m.router.weight.data.zero_()
            dims = ParallelDims.from_config(cfg.parallelism, world_size)
            apply_parallelism(
                model,
                spec,
                dims,
                dims.build_meshes("cpu"),
                cfg.parallelism,
                param_dtype=torch.float32,
                reduce_dtype=torch.float32,
            )
            if ac == "none":  # under EP the core is prefetched one unit ahead, and prefetches the next
                names = [fqn for fqn, _ in fsdp_units(spec, model)]
                before, after = names[names.index("core") - 1], names[names.index("core") + 1]
                states = {f: model.get_submodule(f)._get_fsdp_state() for f in (before, "core", after)}
                assert states[before]._states_to_forward_prefetch == [states["core"]]
                assert states["core"]._states_to_forward_prefetch == [states[after]]
            calls = itertools.count()  # both runs see the same sequence of routings in forward
            out = model(x[:, :-1], sample_ids=torch.tensor([rank]))
            (lm_loss_sum(out.logits, x[:, 1:]) / 64 + out.aux_loss).backward()
            grads[ac] = {
                n.replace("._checkpoint_wrapped_module", ""): (
                    p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                )
                for n, p in model.named_parameters()
                if p.grad is not None
            }
        ref, got = grads["none"], grads["recurrent"]
        assert sorted(ref) == sorted(got) and any("experts" in n for n in ref)
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        dist.barrier()
    finally:
        MoE.select = real_select
        destroy_process_groups()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ties", "reroute"])
def test_recompute_replays_routing_under_expert_parallel(mode):
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_routing_replay_worker, args=(2, str(Path(tmp) / "store"), mode), nprocs=2)
