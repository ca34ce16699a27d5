"""The live-activation counter, and the memory property each checkpoint mode promises."""

from __future__ import annotations

import torch

from spider_titan.components.builder import build_model, materialize
from spider_titan.config.manager import parse_args
from spider_titan.metrics.memory import count_live_activation_bytes


def test_counter_sees_saved_and_output_storages_once():
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(32, 16))
    with count_live_activation_bytes(x, w) as live:
        y = x.exp()  # exp saves its output for backward
        z = (y @ w).view(-1)  # mm saves y (already counted) and w (a parameter); z is alive (held here)
        tmp = x * 3  # freed before the end: not counted
        del tmp
    expected = y.untyped_storage().nbytes() + z.untyped_storage().nbytes()
    assert live.total == expected


def live_bytes(mode: str, n_loops: int) -> int:
    cfg = parse_args(
        [
            "--model.name",
            "spider",
            "--model.n_loops",
            str(n_loops),
            "--model.max_loops",
            "8",
            "--activation_checkpoint.mode",
            mode,
        ],
        env={},
    )
    _, _, model = build_model(cfg)
    materialize(model, torch.device("cpu"), 0)
    x = torch.randint(0, 256, (2, 256), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    with count_live_activation_bytes(model, x) as live:
        out = model(x)
    out.logits.sum().backward()
    return live.total


def test_checkpointing_saves_memory_and_recurrent_saving_grows_with_loops():
    none2, rec2, full2 = (live_bytes(m, 2) for m in ("none", "recurrent", "full"))
    none6, rec6 = (live_bytes(m, 6) for m in ("none", "recurrent"))
    assert full2 < rec2 < none2
    assert none6 > none2  # without AC every loop keeps its activations
    assert none6 / rec6 > none2 / rec2  # so checkpointing the core pays more with more loops
