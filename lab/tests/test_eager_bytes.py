"""lab/bench/benchmark.py eager_bytes (lab/bench/eager_bytes.py): the bytes a step's eager ops move at a
config's real width, on the planner's fake tensors. The counts are checked against sizes known from the
model itself, and the compiled glue (the spec's ``compiled_modules``) must leave the eager count."""

from __future__ import annotations

import warnings

import pytest

from tests.utils import REPO

CONFIG = str(REPO / "train_configs/debug_model.toml")


@pytest.fixture
def bench():
    from lab.bench import eager_bytes

    return eager_bytes


def _measure(bench, compiled: bool):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anomaly mode's warning
        return bench.measure(CONFIG, {"training.compile": compiled})


def test_the_one_gpu_cast_moves_every_parameter_once_each_way(bench):
    """Params mode casts each fp32 parameter to bf16 once per step (read 4 bytes, write 2) and its gradient
    back once (read 2, write 4): 6 bytes per element each way, summed over the model's parameters."""
    from spider_titan import plan
    from spider_titan.components.builder import build_model

    seen = _measure(bench, compiled=False)
    _, cfg = plan.parse_plan_args(["--job.config_file", CONFIG, "--ngpu", "1"])
    _, _, model = build_model(plan.planning_config(cfg))
    expected = 6 * sum(p.numel() for p in model.parameters() if p.is_floating_point())
    casts = {src: b for (src, op), b in seen.by_source.items() if op == "_to_copy" and "precision.py" in src}
    kinds = sorted(src.split()[1] if src.startswith("backward") else "forward" for src in casts)
    assert kinds == ["ToCopyBackward0", "forward"], casts
    assert sorted(casts.values()) == [expected, expected]


def test_compiled_glue_leaves_the_eager_count(bench):
    """Compiled, the blocks' and the boundary predictor's ops run inside graphs: none of their lines is
    counted, while eager they are, and the eager total falls."""
    eager, compiled = _measure(bench, compiled=False), _measure(bench, compiled=True)

    def moved(seen, *where: str) -> int:
        return sum(b for (src, _), b in seen.by_source.items() if all(w in src for w in where))

    for where in [("(raw_score)",), ("models/common.py", "(forward)")]:  # the predictor's score, the blocks
        assert moved(eager, *where) > 0 and moved(compiled, *where) == 0, where
    assert sum(compiled.by_op.values()) < sum(eager.by_op.values()) / 2
