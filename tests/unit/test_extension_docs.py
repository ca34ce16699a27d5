"""docs/extension.md kept honest: each worked example is written to the file it names, registered
as the page says, and trained with (or compared against the component it stands beside)."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from spider_titan import registry
from spider_titan.train import main
from tests.utils import DEBUG_DENSE, DEBUG_SPIDER, REPO, check_ok, run_train, tiny_run, train_losses

DOC = REPO / "docs" / "extension.md"


def small(config: str = DEBUG_SPIDER, **overrides) -> list[str]:
    """The tests' tiny run of ``config``, 3 steps, no checkpoints."""
    return tiny_run(job__config_file=config, training__steps=3, checkpoint__enable=False, **overrides)


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def register_lines() -> dict[str, str]:
    """kind -> the page's ``registry.register(...)`` line for it."""
    out = {}
    for block in blocks():
        for line in block.splitlines():
            m = re.match(r'registry\.register\("(\w+)"', line)
            if m:
                out[m.group(1)] = line
    return out


@pytest.fixture
def examples(tmp_path, monkeypatch):
    """The page's files under tmp_path (importable), the registry restored afterwards."""
    for block in blocks():
        first = block.splitlines()[0]
        if first.startswith("# file: "):
            path = tmp_path / first[len("# file: ") :]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{REPO}")
    saved = {kind: dict(table) for kind, table in registry.COMPONENTS.items()}
    yield tmp_path
    for kind, table in saved.items():
        registry.COMPONENTS[kind] = table
    for name in [
        m for m in sys.modules if m.split(".")[0] in ("ext_models", "ext_converters", "ext_moe", "ext_parallel")
    ]:
        del sys.modules[name]


def register(kind: str) -> None:
    exec(register_lines()[kind], {"registry": registry})


def test_every_example_has_a_file_and_a_registration():
    files = [b.splitlines()[0] for b in blocks() if b.startswith("# file: ")]
    assert len(files) == 4, files
    assert set(register_lines()) == {"model", "converter", "moe_backend", "parallelize"}


def test_model_example_trains(examples, tmp_path, in_process):
    register("model")
    assert main(small(DEBUG_DENSE, model__name="bigram", model__n_layers=3, job__dump_folder=tmp_path / "run")) == 0
    losses = train_losses(tmp_path / "run")
    assert sorted(losses) == [1, 2, 3] and all(torch.isfinite(torch.tensor(list(losses.values()))))


def test_converter_example_swaps_linears_and_refreshes_scales(examples, tmp_path, in_process):
    register("converter")
    from spider_titan.components.builder import build_model
    from spider_titan.config.manager import parse_args

    cfg = parse_args(["--job.config_file", "train_configs/debug_model.toml", "--model.converters", "int8_qat"], env={})
    hooks: list = []
    _, _, model = build_model(cfg, hooks)
    from ext_converters.int8_qat import Int8FakeQuantLinear

    converted = [m for m in model.modules() if isinstance(m, Int8FakeQuantLinear)]
    assert converted and len(hooks) == 1
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    lin = converted[0]
    hooks[0]()
    with torch.no_grad():
        lin.weight.mul_(2.0)
    stale = lin.scale.clone()
    hooks[0]()  # after an optimizer step: the scales follow the weights
    assert torch.allclose(lin.scale, 2.0 * stale)
    assert main(small(model__converters="int8_qat", job__dump_folder=tmp_path / "run")) == 0


def test_moe_backend_example_matches_the_reference(examples):
    register("moe_backend")
    from spider_titan.moe.layer import MoE
    from spider_titan.moe.torch_backend import TorchMoEBackend

    torch.manual_seed(0)
    layer = MoE(32, 8, 2, 16)
    layer.init_weights(0.02, 0.02)
    x = torch.randn(40, 32, requires_grad=True)
    outs = []
    for backend in (TorchMoEBackend(), registry.get("moe_backend", "indexing")()):
        layer.backend = backend
        layer.zero_grad()
        x.grad = None
        y, stats = layer(x)
        (y.square().sum() + stats.aux_loss).backward()
        outs.append((y.detach(), x.grad.clone(), layer.router.weight.grad.clone(), layer.experts.w1.grad.clone()))
    for ref, got in zip(*outs):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_parallelism_example_matches_one_process(examples, tmp_path):
    """Two ranks of the page's data parallel against one process with the same global batch."""
    register_line = register_lines()["parallelize"]
    plugin = tmp_path / "sitecustomize.py"  # registers the component in every process torchrun starts
    plugin.write_text(f"from spider_titan import registry\n{register_line}\n")
    # The dense baseline: it has no batch-level losses (Spider's balance and boundary statistics are
    # reduced over the data-parallel group by the shipped parallelize component, which ddp replaces).
    common = small(DEBUG_DENSE, training__deterministic=True)
    one = run_train([*common, "--training.local_batch_size", "4", "--job.dump_folder", str(tmp_path / "one")])
    check_ok(one)
    two = run_train([*common, "--parallelism.name", "ddp", "--job.dump_folder", str(tmp_path / "two")], nprocs=2)
    check_ok(two)
    a, b = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), (step, a[step], b[step])
