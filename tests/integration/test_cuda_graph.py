"""training.cuda_graph (training/cuda_graph.py): a step's forwards and backwards captured once as a CUDA
graph and replayed. On CUDA the graphed run's losses equal the plain run's; everywhere, a run the graph
cannot serve is refused naming what it lacks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spider_titan.models.spider.model import SPIDER_SPEC, spider_graph_blockers
from spider_titan.training.cuda_graph import flatten_outputs, graph_blockers, unflatten_outputs
from tests.utils import check_ok, run_train, tiny_run, train_losses

BASE = tiny_run(training__seq_len=256, training__local_batch_size=8, training__steps=6, model__segment_capacity=1.5)


@pytest.mark.slow
def test_a_run_the_graph_cannot_serve_is_refused_naming_what_it_lacks(tmp_path):
    proc = run_train(
        BASE
        + ["--training.cuda_graph", "true", "--model.segment_capacity", "0", "--training.device", "cpu"]
        + ["--job.dump_folder", str(tmp_path)]
    )
    assert proc.returncode != 0
    assert "training.cuda_graph needs a CUDA device (this run is on cpu)" in proc.stderr, proc.stderr
    assert "model.segment_capacity > 0" in proc.stderr, proc.stderr
    assert not (tmp_path / "config.toml").exists()  # refused before the run's record and config are written


def test_the_blockers_name_every_per_step_host_choice():
    debug = SPIDER_SPEC.build_args("debug")
    static = dataclasses.replace(debug, segment_capacity=1.5)
    assert spider_graph_blockers(static) == []
    counted = spider_graph_blockers(debug)
    assert len(counted) == 1 and "model.segment_capacity" in counted[0]
    assert graph_blockers(device=torch.device("cuda"), world_size=1, model_blockers=[]) == []
    assert "one process" in graph_blockers(device=torch.device("cuda"), world_size=2, model_blockers=[])[0]
    fp32 = graph_blockers(device=torch.device("cuda"), world_size=1, model_blockers=[], fp32_experts=True)
    assert len(fp32) == 1 and "bfloat16" in fp32[0]


def test_the_outputs_travel_as_one_flat_copy_and_come_back_whole():
    aux = {"bytes_per_segment": torch.tensor(3.9), "loops": torch.tensor([0.5, 0.25, 0.25]), "n": torch.tensor(7.0)}
    outputs = (torch.tensor(12.5), torch.tensor(256.0), aux)
    flat, layout = flatten_outputs(outputs)
    assert flat.shape == (7,) and flat.dtype == torch.float32
    ce, tokens, back = unflatten_outputs(flat.clone(), layout)
    assert ce.item() == 12.5 and tokens.item() == 256.0 and list(back) == list(aux)
    for key in aux:
        assert torch.equal(back[key], aux[key]), key


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize(
    "extra",
    [
        ["--moe.backend", "triton", "--training.compile", "true"],
        ["--moe.backend", "torch"],
    ],
    ids=["bf16-triton-compiled", "bf16-torch-eager"],
)
def test_graphed_losses_equal_the_plain_runs_on_cuda(extra, tmp_path):
    """Steps 1-2 run plain, step 3 is captured, 3-6 replay: every step's loss equals the plain run's
    within 3e-3 (bf16: fp32's grouped expert GEMM reads its offsets on the host, so it cannot be captured).
    On an H200 the plain and graphed runs already part by 3e-4 at step 2, before the capture (bf16
    kernels are not bitwise reproducible run to run); at steps 3 and 4 they were 0.7e-3 to 1.2e-3 apart."""
    losses = {}
    for graphed in ("false", "true"):
        dump = tmp_path / graphed
        args = BASE + extra + ["--training.device", "cuda", "--training.cuda_graph", graphed]
        check_ok(run_train(args + ["--job.dump_folder", str(dump)], env={"TRITON_INTERPRET": "0"}))
        losses[graphed] = train_losses(dump)
    plain, graphed = losses["false"], losses["true"]
    assert sorted(plain) == sorted(graphed) == list(range(1, 7)), (plain, graphed)
    for step in plain:
        assert abs(plain[step] - graphed[step]) <= 3e-3 * abs(plain[step]), (step, plain, graphed)
    assert graphed[6] < graphed[1], graphed
