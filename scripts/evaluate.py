"""Val bits per byte of trained models on the same val windows, each paired with the first: the
difference and its standard error over the windows.

    python scripts/evaluate.py --model A/export --model B/export --data data/held_out  # B against A
    python scripts/evaluate.py --model RUN/export --n_loops 2,4                 # one Spider at 2 and 4 loops
    python scripts/evaluate.py --model RUN/export --n_loops trained,max --json out.json  # n_loops, max_loops

Every entry is evaluated on the same bytes (the whole val split, as ``validation.steps = -1``), so
their difference is measured far more precisely than either figure: the standard error is the
spread of the per-window differences (a ratio estimator over windows, each weighted by its bytes),
which is what decides whether one model (or loop count) is better, worse or indistinguishable.
``--model`` takes an export folder or a run / checkpoint folder (its newest complete checkpoint), as
generate.py. Several ``--model`` (Spider or dense) are each evaluated as trained, against the first;
one Spider with ``--n_loops`` is evaluated at each loop count, against the first count.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch

from spider_titan import registry
from spider_titan.data.loader import ByteDataLoader
from spider_titan.errors import ScriptParser
from spider_titan.generation import load_model
from spider_titan.protocol import paired_difference, window_cross_entropy
from spider_titan.training.validation import whole_split_batches

PROG = "evaluate"


def fail(message: str) -> SystemExit:
    """The one line this script exits with (status 1)."""
    return SystemExit(f"{PROG}: error: {message}")


@torch.no_grad()
def window_losses(
    model, loader: ByteDataLoader, n_loops: int | None, device: torch.device | str = "cpu"
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


def check_loops_spec(spec: str) -> None:
    """``--n_loops`` reads as counts: positive integers, ``trained`` or ``max``, at least two entries."""
    items = [s.strip() for s in spec.split(",")]
    if not all(s in ("trained", "max") or (s.isdigit() and int(s) > 0) for s in items):
        raise fail(f"--n_loops {spec!r}: counts are positive integers, 'trained' or 'max'")


def parse_loops(spec: str, model_args) -> list[int]:
    """'2,4' or 'trained,max' as loop counts of a model with these args (deduplicated, in order), each
    within what the model runs (1 .. max_loops)."""
    named = {"trained": model_args.n_loops, "max": model_args.max_loops}
    try:
        loops = list(dict.fromkeys(named[n] if n in named else int(n) for n in spec.split(",")))
    except ValueError:
        raise fail(f"--n_loops {spec!r}: counts are integers, 'trained' or 'max'") from None
    if len(loops) < 2:
        raise fail(f"--n_loops {spec!r}: give at least two different counts (the first is the reference)")
    outside = [n for n in loops if not 1 <= n <= model_args.max_loops]
    if outside:
        raise fail(f"--n_loops {spec!r}: {outside} outside 1..{model_args.max_loops} (the model's max_loops)")
    return loops


def parse_args(argv: list[str] | None = None):
    """The command line, checked before any model is loaded: a mistake is one line, exit status 1 or 2."""
    p = ScriptParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        required=True,
        action="append",
        help="export folder, or a run / checkpoint folder; several: compare the models, each against the first",
    )
    p.add_argument(
        "--data", default=None, help="a bytes folder (scripts/prepare_data.py); default: the built-in corpus"
    )
    p.add_argument(
        "--n_loops",
        default=None,
        help="one Spider at these comma-separated loop counts, or 'trained' / 'max' (its n_loops / max_loops); the "
        "first is the reference (default 2,4 with one --model)",
    )
    p.add_argument("--seq_len", type=int, default=256, help="bytes per val window (default 256)")
    p.add_argument("--batch", type=int, default=8, help="val windows per forward (default 8)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda; fp32 either way")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if len(args.model) > 1 and args.n_loops is not None:
        raise fail("--n_loops takes one --model; several are compared as trained")
    if args.n_loops is not None:
        check_loops_spec(args.n_loops)
    for name, value in (("seq_len", args.seq_len), ("batch", args.batch)):
        if value <= 0:
            raise fail(f"--{name} {value}: give a positive number")
    missing = [m for m in args.model if not Path(m).is_dir()]
    if missing:
        raise fail(
            f"--model {missing[0]}: no such folder; give an export (scripts/export_safetensors.py) or a run folder"
        )
    if args.data is not None and not Path(args.data).is_dir():
        raise fail(f"--data {args.data}: no such folder; give a folder of shards (scripts/prepare_data.py)")
    if args.device not in ("auto", "cpu", "cuda"):
        raise fail(f"--device {args.device}: choose auto, cpu or cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise fail("--device cuda: torch sees no CUDA device here; use --device cpu (or auto)")
    if args.json is not None:
        out = Path(args.json)
        if out.is_dir():
            raise fail(f"--json {args.json}: is a folder; give a file name")
        if not out.parent.is_dir():
            raise fail(f"--json {args.json}: the folder {out.parent} does not exist; create it or write elsewhere")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    try:
        dataset = registry.get("dataset", "bytes" if args.data else "builtin")(args.data, split="val", seed=0)
        models = {path: load_model(Path(path), device=device)[0] for path in args.model}
    except (FileNotFoundError, ValueError) as e:
        raise fail(str(e).splitlines()[0]) from None
    loader = ByteDataLoader(
        dataset, seq_len=args.seq_len, local_batch_size=args.batch, dp_rank=0, dp_world_size=1, seed=0
    )
    if len(models) > 1:
        losses = {path: window_losses(model, loader, None, device) for path, model in models.items()}
        rows = report(losses, lambda path: {"model": path}, lambda path: path)
    else:
        ((path, model),) = models.items()
        if getattr(getattr(model, "args", None), "max_loops", None) is None:
            raise fail(f"--model {path}: a {type(model).__name__} has no core loops; give a Spider, or several --model")
        loops = parse_loops(args.n_loops or "2,4", model.args)
        losses = {n: window_losses(model, loader, n, device) for n in loops}
        rows = report(losses, lambda n: {"n_loops": n}, lambda n: f"n_loops {n}")
    if args.json:
        out = Path(args.json)
        partial = out.with_name(f".{out.name}.partial")  # renamed when whole: never half a file
        try:
            partial.write_text(json.dumps(rows, indent=1) + "\n")
            os.replace(partial, out)
        finally:
            partial.unlink(missing_ok=True)


def report(losses: dict, fields, label) -> list[dict]:
    """Each entry's val bpb and its paired difference to the first entry, printed and as rows."""
    base, count = next(iter(losses.values()))
    if not int(count.sum()):
        raise fail("the val split is shorter than one window: lower --seq_len")
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
    sys.exit(main())
