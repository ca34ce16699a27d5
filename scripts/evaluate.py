"""Val bits per byte of one trained Spider at several eval loop counts, with each count's paired
difference to the first and the difference's standard error over the val windows.

    python scripts/evaluate.py --model RUN/export --loops 2,4                # built-in corpus
    python scripts/evaluate.py --model RUN/export --data data/prose --loops 2,4 --json out.json
    python scripts/evaluate.py --model RUN/export --loops 3,4 --depth_scale 1,2  # per-segment depth
    python scripts/evaluate.py --model RUN/export --loops trained,max          # n_loops, max_loops
    python scripts/evaluate.py --model A/export --model B/export --data data/held_out  # models, B against A

The counts are evaluated on the same bytes (the whole val split, as ``validation.steps = -1``), so
their difference is measured far more precisely than either figure: the standard error is the
spread of the per-window differences (a ratio estimator over windows, each weighted by its bytes),
which is what decides whether more loops are better, worse or indistinguishable. ``--model`` takes
an export folder or a run / checkpoint folder (its newest complete checkpoint), as generate.py.
A model with per-segment depth (``model.depth_capacity``) is also evaluated at each ``--depth_scale``: its
loops' shares times the scale (at most 1), every (loops, scale) pair against the first. Given several
``--model`` (Spider or dense), each is evaluated as trained on the same windows, against the first.
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
    """Per-window summed cross-entropy in nats (R,) float64 and label counts (R,) over the whole val split
    (``n_loops`` None: the model as trained, for a model without loops too)."""
    ce, count = [], []
    kwargs = {} if n_loops is None else {"n_loops": n_loops}
    for inputs, labels in whole_split_batches(loader):
        c, n = window_cross_entropy(model(inputs.to(device), **kwargs).logits, labels.to(device))
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
    p.add_argument(
        "--model",
        required=True,
        action="append",
        help="export folder, or a run / checkpoint folder; several: compare the models, each against the first",
    )
    p.add_argument("--data", default=None, help="a bytes folder; default: the built-in corpus")
    p.add_argument(
        "--loops",
        default=None,
        help="comma-separated eval loop counts, or 'trained' / 'max' (the model's n_loops / max_loops); the first "
        "is the reference (default 2,4; one --model only)",
    )
    p.add_argument("--depth_scale", default="1", help="per-segment depth: comma-separated scales of the loops' shares")
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda; fp32 either way")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if len(args.model) > 1 and (args.loops is not None or args.depth_scale != "1"):
        raise SystemExit("--loops and --depth_scale take one --model; several are compared as trained")
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    dataset = registry.get("dataset", "bytes" if args.data else "builtin")(args.data, split="val", seed=0)
    loader = ByteDataLoader(
        dataset, seq_len=args.seq_len, local_batch_size=args.batch, dp_rank=0, dp_world_size=1, seed=0
    )
    if len(args.model) > 1:
        losses = {
            path: window_losses(load_model(Path(path), device=device)[0], loader, None, device) for path in args.model
        }
        rows = report(losses, lambda path: {"model": path}, lambda path: path)
    else:
        rows = compare_loops(args, loader, device)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


def compare_loops(args, loader: ByteDataLoader, device: torch.device) -> list[dict]:
    """One model at each of ``--loops`` (and ``--depth_scale``), every setting against the first."""
    model, _ = load_model(Path(args.model[0]), device=device)
    loops = parse_loops(args.loops or "2,4", model.args)
    scales = [float(x) for x in args.depth_scale.split(",")]
    router = getattr(getattr(model, "core", None), "depth", None)
    if router is None and scales != [1.0]:
        raise SystemExit("--depth_scale: the model has no per-segment depth (model.depth_capacity is empty)")
    losses = {}
    for scale in scales:
        with router.scaled(scale) if router is not None else contextlib.nullcontext():
            losses.update({(n, scale): window_losses(model, loader, n, device) for n in loops})

    def fields(key):
        n, scale = key
        return {"n_loops": n} if router is None else {"n_loops": n, "depth_scale": scale}

    def label(key):
        n, scale = key
        return f"n_loops {n}" + ("" if router is None else f" depth x{scale:g}")

    return report(losses, fields, label)


def report(losses: dict, fields, label) -> list[dict]:
    """Each entry's val bpb and its paired difference to the first entry, printed and as rows."""
    base, count = next(iter(losses.values()))
    rows = []
    for key, (ce, _) in losses.items():
        diff, se = paired_difference(ce, base, count)
        bpb = float(ce.sum() / count.sum()) / math.log(2)
        row = {**fields(key), "val_bpb": bpb, "diff_bpb": diff, "se_bpb": se, "windows": int((count > 0).sum())}
        rows.append(row)
        print(
            f"{label(key)}: val bpb {bpb:.5f}  vs the first: {diff:+.5f} +- {se:.5f} (1 s.e., {row['windows']} windows)"
        )
    return rows


if __name__ == "__main__":
    main()
