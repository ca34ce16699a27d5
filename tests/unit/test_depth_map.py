"""scripts/depth_map.py: the loops each byte's segment ran under per-segment depth, and its rendering."""

from __future__ import annotations

import dataclasses
import importlib

import torch

from spider_titan.models.spider import SPIDER_FLAVORS, Spider
from spider_titan.vocab import BOS_ID
from tests.utils import REPO


def test_the_map_gives_each_byte_its_segments_loops(monkeypatch):
    """Loops per byte lie in 1..n_loops, every segment at least 2 deep is one the router let run loop
    2 (the share of such segments is the model's own depth_share_2), and the rendering puts a digit
    under each segment's first byte."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    depth_map = importlib.import_module("depth_map")
    torch.manual_seed(0)
    model = Spider(dataclasses.replace(SPIDER_FLAVORS["debug"], n_loops=3, depth_capacity=[0.5, 0.5, 0.25]))
    model.init_weights()
    torch.nn.init.normal_(model.boundary_predictor.q_proj.weight, std=0.2)
    torch.nn.init.normal_(model.boundary_predictor.k_proj.weight, std=0.2)
    model.eval()
    data = bytes(range(32, 127)) * 3
    loops, starts = depth_map.depth_map(model, data)
    assert len(loops) == len(starts) == len(data) and set(loops) <= {1, 2, 3} and len(set(loops)) > 1
    segments = [n for n, s in zip(loops, starts) if s]
    with torch.no_grad():
        share = float(model(torch.tensor([[BOS_ID, *data]])).aux["depth_share_2"])
    # byte 0 (BOS) is its own segment, not mapped: allow it on either side of the share
    assert abs(sum(n >= 2 for n in segments) / len(segments) - share) < 1.5 / len(segments)
    text, digits = depth_map.render(data[:20], loops[:20], starts[:20]).split("\n")
    assert text == data[:20].decode() and all((d != "\u00b7") == s for d, s in zip(digits, starts[:20]))


def test_the_picture_colours_each_byte_by_its_loops(monkeypatch, tmp_path):
    """--png: one coloured cell per printable byte of each non-blank line, its colour the one of its loops
    (a blank line is skipped; two bytes at the same depth share a colour, different depths do not)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    depth_map = importlib.import_module("depth_map")
    data = b"ab\n\ncd"
    loops, starts = [1, 3, 3, 3, 2, 2], [True, True, False, False, True, False]  # a b \n \n c d
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    depth_map.draw(data, loops, starts, tmp_path / "map.png", n_loops=3)
    assert (tmp_path / "map.png").read_bytes()[:4] == b"\x89PNG"
    cells = [p for p in figures[0].axes[0].patches if isinstance(p, Rectangle)]
    assert [(int(c.get_x()), int(c.get_y())) for c in cells] == [(0, -1), (1, -1), (0, -2), (1, -2)]
    colour = [tuple(c.get_facecolor()) for c in cells]  # a, b, c, d: loops 1, 3, 2, 2
    assert colour[2] == colour[3] and len({colour[0], colour[1], colour[2]}) == 3
