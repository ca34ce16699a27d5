"""Val bits per byte of trained models on the same val windows, each paired with the first: the
difference and its standard error over the windows.

    python scripts/evaluate.py --model A/export --model B/export --data data/held_out  # B against A
    python scripts/evaluate.py --model RUN/export --n_loops 2,4                 # one Spider at 2 and 4 loops
    python scripts/evaluate.py --model RUN/export --n_loops trained,max --json out.json  # n_loops, max_loops
    python scripts/evaluate.py --model RUN/export --ttt --data data/held_out       # test-time training against none

Every entry is evaluated on the same bytes (the whole val split, as ``validation.steps = -1``), so
their difference is measured far more precisely than either figure: the standard error is the
spread of the per-window differences (a ratio estimator over windows, each weighted by its bytes),
which is what decides whether one model (or loop count) is better, worse or indistinguishable.
``--model`` takes an export folder or a run / checkpoint folder (its newest complete checkpoint), as
generate.py. Several ``--model`` (Spider or dense) are each evaluated as trained, against the first;
one Spider with ``--n_loops`` is evaluated at each loop count, against the first count. ``--ttt``
evaluates each model on the split's documents chunk by chunk, with and without score-first test-time
training (spider_titan/training/ttt.py), paired over the same chunks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

from spider_titan import registry
from spider_titan.cli import ArgumentParser, replace_file
from spider_titan.data.loader import ByteDataLoader
from spider_titan.generation import load_model, model_spec
from spider_titan.protocol import paired_difference, window_cross_entropy
from spider_titan.training.ttt import TTTSettings, score_documents, split_documents
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
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
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
    defaults = TTTSettings()
    p.add_argument("--ttt", action="store_true", help="each model with and without test-time training, per document")
    p.add_argument("--ttt_chunk", type=int, default=defaults.chunk_bytes, help="TTT: predictions per chunk")
    p.add_argument("--ttt_steps", type=int, default=defaults.steps, help="TTT: optimizer steps per chunk")
    p.add_argument("--ttt_lr", type=float, default=defaults.lr, help="TTT: the adapters' Adam learning rate")
    p.add_argument("--ttt_rank", type=int, default=defaults.rank, help="TTT: rank of each LoRA adapter")
    p.add_argument("--ttt_blocks", type=int, default=defaults.blocks, help="TTT: trailing blocks adapted")
    p.add_argument("--max_bytes", type=int, default=0, help="read only the split's first bytes (default 0: all)")
    args = p.parse_args(argv)
    if args.ttt:
        if args.n_loops is not None:
            raise fail("--ttt compares each model with and without test-time training; leave out --n_loops")
        args.ttt = TTTSettings(args.ttt_chunk, args.ttt_steps, args.ttt_lr, args.ttt_rank, args.ttt_blocks)
        problems = args.ttt.problems(args.seq_len)
        if problems:
            raise fail(f"{problems[0]} (--ttt_* options)")
    if args.max_bytes < 0:
        raise fail(f"--max_bytes {args.max_bytes}: give 0 (the whole split) or a positive number")
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
    if args.ttt:
        rows = ttt_rows(models, dataset, args, device)
        write_json(args.json, rows)
        return
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
    write_json(args.json, rows)


def write_json(path: str | None, rows: list[dict]) -> None:
    """``rows`` as JSON at ``path`` (nothing when None), under a temporary name until whole."""
    if path:
        replace_file(Path(path), lambda tmp: tmp.write_text(json.dumps(rows, indent=1) + "\n"))


def ttt_rows(models: dict, dataset, args, device: torch.device) -> list[dict]:
    """Each model on the split's documents, without and with test-time training, paired over the chunks."""
    tokens = dataset.window(0, min(dataset.num_tokens, args.max_bytes or dataset.num_tokens))
    docs = split_documents(tokens.astype("int64"))
    rows = []
    for path, model in models.items():
        spec = model_spec(model)
        if spec is None:
            raise fail(f"--model {path}: a {type(model).__name__} is no registered model; --ttt needs its spec")
        common = dict(seq_len=args.seq_len, batch_size=args.batch, device=device)
        try:
            plain = score_documents(model, spec, docs, ttt=None, chunk_bytes=args.ttt.chunk_bytes, **common)
            adapted = score_documents(model, spec, docs, ttt=args.ttt, **common)
        except ValueError as e:
            raise fail(f"--model {path}: {e}") from None
        if not int(plain.count.sum()):
            raise fail("the val split holds no predictions to score")
        diff, se = paired_difference(adapted.ce, plain.ce, plain.count)
        row = {
            "model": path,
            "val_bpb": plain.bpb,
            "ttt_bpb": adapted.bpb,
            "diff_bpb": diff,
            "se_bpb": se,
            "chunks": int((plain.count > 0).sum()),
            "documents": len(docs),
            "seconds": plain.seconds,
            "ttt_seconds": adapted.seconds,
            "adapted": adapted.adapted,
            "ttt": dataclasses.asdict(args.ttt),
        }
        rows.append(row)
        print(
            f"{path}: val bpb {plain.bpb:.5f}  with TTT {adapted.bpb:.5f}  {diff:+.5f} +- {se:.5f} (1 s.e., "
            f"{row['chunks']} chunks of {len(docs)} documents); {plain.seconds:.1f} s plain, {adapted.seconds:.1f} s "
            f"with TTT ({adapted.seconds / max(plain.seconds, 1e-9):.2f}x); {len(adapted.adapted)} linears adapted"
        )
    return rows


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
