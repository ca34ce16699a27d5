"""Val bits per byte of one trained Spider at several eval loop counts, with each count's paired
difference to the first and the difference's standard error over the val windows.

    python scripts/eval_loops.py --model RUN/export --loops 2,4                # built-in corpus
    python scripts/eval_loops.py --model RUN/export --data data/prose --loops 2,4 --json out.json
    python scripts/eval_loops.py --model RUN/export --loops 3,4 --depth_scale 1,2  # per-segment depth
    python scripts/eval_loops.py --model RUN/export --loops trained,max          # n_loops, max_loops

The counts are evaluated on the same bytes (the whole val split, as ``validation.steps = -1``), so
their difference is measured far more precisely than either figure: the standard error is the
spread of the per-window differences (a ratio estimator over windows, each weighted by its bytes),
which is what decides whether more loops are better, worse or indistinguishable. ``--model`` takes
an export folder or a run / checkpoint folder (its newest complete checkpoint), as generate.py.
A model with per-segment depth (``model.depth_capacity``) is also evaluated at each ``--depth_scale``: its
loops' shares times the scale (at most 1), every (loops, scale) pair against the first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from pathlib import Path

import torch

from spider_titan import registry
from spider_titan.data.loader import ByteDataLoader
from spider_titan.generation import load_model
from spider_titan.protocol import paired_difference, window_cross_entropy
from spider_titan.training.validation import whole_split_batches


@torch.no_grad()
def window_losses(
    model, loader: ByteDataLoader, n_loops: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-window summed cross-entropy in nats (R,) float64 and label counts (R,) over the whole val split."""
    ce, count = [], []
    for inputs, labels in whole_split_batches(loader):
        c, n = window_cross_entropy(model(inputs.to(device), n_loops=n_loops).logits, labels.to(device))
        ce.append(c.cpu())
        count.append(n.cpu())
    return torch.cat(ce), torch.cat(count)


def parse_loops(spec: str, model_args) -> list[int]:
    """'2,4' or 'trained,max' as loop counts of a model with these args (deduplicated, in order)."""
    named = {"trained": model_args.n_loops, "max": model_args.max_loops}
    try:
        loops = list(dict.fromkeys(named[n] if n in named else int(n) for n in spec.split(",")))
    except ValueError:
        raise SystemExit(f"--loops {spec!r}: counts are integers, 'trained' or 'max'") from None
    if len(loops) < 2:
        raise SystemExit(f"--loops {spec!r}: give at least two different counts (the first is the reference)")
    return loops


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="export folder, or a run / checkpoint folder")
    p.add_argument("--data", default=None, help="a bytes folder; default: the built-in corpus")
    p.add_argument(
        "--loops",
        default="2,4",
        help="comma-separated eval loop counts, or 'trained' / 'max' (the model's n_loops / max_loops); the first "
        "is the reference",
    )
    p.add_argument("--depth_scale", default="1", help="per-segment depth: comma-separated scales of the loops' shares")
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda; fp32 either way")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    model, _ = load_model(Path(args.model), device=device)
    loops = parse_loops(args.loops, model.args)
    dataset = registry.get("dataset", "bytes" if args.data else "builtin")(args.data, split="val", seed=0)
    loader = ByteDataLoader(
        dataset, seq_len=args.seq_len, local_batch_size=args.batch, dp_rank=0, dp_world_size=1, seed=0
    )
    scales = [float(x) for x in args.depth_scale.split(",")]
    router = getattr(getattr(model, "core", None), "depth", None)
    if router is None and scales != [1.0]:
        raise SystemExit("--depth_scale: the model has no per-segment depth (model.depth_capacity is empty)")
    losses = {}
    for scale in scales:
        with router.scaled(scale) if router is not None else contextlib.nullcontext():
            losses.update({(n, scale): window_losses(model, loader, n, device) for n in loops})
    first = (loops[0], scales[0])
    base, count = losses[first]
    rows = []
    for (n, scale), (ce, _) in losses.items():
        diff, se = paired_difference(ce, base, count)
        bpb = float(ce.sum() / count.sum()) / math.log(2)
        row = {"n_loops": n, "val_bpb": bpb, "diff_bpb": diff, "se_bpb": se, "windows": int((count > 0).sum())}
        rows.append(row if router is None else {**row, "depth_scale": scale})
        at = f"n_loops {n}" + ("" if router is None else f" depth x{scale:g}")
        print(f"{at}: val bpb {bpb:.5f}  vs the first: {diff:+.5f} +- {se:.5f} (1 s.e., {row['windows']} windows)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
