"""Learned segmentation holds its target on a short fixed-seed training run (debug flavor, CPU,
a few seconds): the regression test for the collapse of issue 10, where the FlexiTokens hinge with
Gumbel sampling drove segments to the 16-byte cap within 100 steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import spider_titan
from spider_titan.models.spider import SPIDER_FLAVORS, Spider
from spider_titan.vocab import BOS_ID, EOS_ID


def corpus() -> torch.Tensor:
    """Real text that ships with the package: its own Python sources, as documents."""
    ids = []
    for path in sorted(Path(spider_titan.__file__).parent.rglob("*.py")):
        ids += [BOS_ID] + list(path.read_bytes()) + [EOS_ID]
    return torch.tensor(ids, dtype=torch.long)


@pytest.fixture
def one_thread():
    """One intra-op thread: CPU reductions then add in a fixed order, so the run is reproducible
    (with several threads a boundary decided by a hair can flip between runs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_bytes_per_segment_stays_in_band_train_and_eval(one_thread):
    """60 steps of the debug model: the training batches' rate after a short warm-up, and the eval
    rate on 32 held-out rows (mean of the evaluations after steps 40, 50 and 60: the early rate swings
    by about +-1 byte from one evaluation to the next before it settles) stay within 25 % of the
    target, far from the cap."""
    torch.manual_seed(0)
    args = SPIDER_FLAVORS["debug"]
    model = Spider(args)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    data = corpus()
    B, T, steps, target = 4, 128, 60, args.target_bytes_per_segment
    held_out = data[-(32 * T) :].view(32, T)
    g = torch.Generator().manual_seed(0)
    train_bps, eval_bps = [], []
    for step in range(1, steps + 1):
        starts = torch.randint(0, len(data) - T - 1, (B,), generator=g)
        window = torch.stack([data[s : s + T + 1] for s in starts.tolist()])
        out = model(window[:, :-1], labels=window[:, 1:], sample_ids=torch.arange(B) + step * B)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        train_bps.append(out.aux["bytes_per_segment"].item())
        if step in (40, 50, 60):
            model.eval()
            with torch.no_grad():
                eval_bps.append(model(held_out).aux["bytes_per_segment"].item())
            model.train()
    late = train_bps[10:]  # after a short warm-up
    mean_late, mean_eval = sum(late) / len(late), sum(eval_bps) / len(eval_bps)
    print(f"\ntrain bytes/segment (every 5th step): {[round(v, 2) for v in train_bps[::5]]}, eval {eval_bps}")
    assert abs(mean_late / target - 1) < 0.25, f"train bytes/segment {mean_late:.2f} left the band around {target}"
    assert abs(mean_eval / target - 1) < 0.25, f"eval bytes/segment {mean_eval:.2f} left the band around {target}"
    assert max(late) < args.max_segment_bytes / 2  # far from the collapse to the cap
