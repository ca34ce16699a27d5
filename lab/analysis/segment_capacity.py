"""How much segment capacity a corpus needs: a trained Spider's segment counts per row and per batch.

    python -m lab.analysis.segment_capacity --model outputs/my_run/export --data data/my_corpus --seq 4096 --batch 4

``model.segment_capacity`` c gives every row ``ceil(c * seq / target)`` segment slots, and
``model.packed_capacity`` p gives the batch ``ceil(p * batch * seq / target)`` packed positions (static shapes,
``training.cuda_graph``); a segment past them is dropped. This segments ``--batches`` batches of the split
with the model's boundary predictor (eval mode, no core) and prints the quantiles of the c each row needs
(``segments * target / seq``) and of the p each batch needs, so a capacity can be set just above the
largest: every slot past it is computed for nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from lab.cli import check_data, check_folder, check_output_file, check_positive, parser, refuse, write_whole
from spider_titan import registry
from spider_titan.data.loader import ByteDataLoader
from spider_titan.generation import load_model

QUANTILES = (0.5, 0.9, 0.99, 1.0)


@torch.no_grad()
def capacity_needed(model, batches) -> dict[str, list[float]]:
    """For each batch of input ids (B, T): ``rows``, the segment capacity each row needs, and ``batches``,
    the packed capacity the batch needs, in the model's units (a multiple of ``T / target``)."""
    a = model.args
    rows, packed = [], []
    for ids in batches:
        B, T = ids.shape
        seg = model.chunker.segment(model.chunker.logits(model.boundary_predictor, model.byte_states(ids)), ids)
        counts = seg.row_segments.double() * a.target_bytes_per_segment
        rows += (counts / T).tolist()
        packed.append(float(counts.sum()) / (B * T))
    return {"rows": rows, "batches": packed}


def summary(needed: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Mean and ``QUANTILES`` of each list of :func:`capacity_needed`."""
    return {
        name: {"mean": float(np.mean(v)), **{f"q{q:g}": float(np.quantile(v, q)) for q in QUANTILES}}
        for name, v in needed.items()
    }


PROG = "python -m lab.analysis.segment_capacity"


def main(argv: list[str] | None = None) -> int:
    p = parser(PROG, __doc__)
    p.add_argument("--model", required=True, metavar="DIR", help="an export (or a run folder) of a Spider")
    p.add_argument("--data", default=None, help="a bytes folder (default: the built-in corpus)")
    p.add_argument("--split", default="train", choices=("train", "val"), help="the split to segment (default train)")
    p.add_argument("--seq", type=int, default=4096, help="bytes per row (default 4096)")
    p.add_argument("--batch", type=int, default=4, help="rows per batch (default 4)")
    p.add_argument("--batches", type=int, default=60, help="batches to segment (default 60)")
    p.add_argument("--json", default=None, help="also write the summary here")
    args = p.parse_args(argv)
    check_positive(PROG, seq=args.seq, batch=args.batch, batches=args.batches)
    check_folder(PROG, "--model", args.model, what="an export or a run folder of a Spider")
    check_data(PROG, "--data", args.data)
    check_output_file(PROG, "--json", args.json)
    try:
        model, _ = load_model(Path(args.model), device="cpu")
        dataset = registry.get("dataset", "bytes" if args.data else "builtin")(args.data, split=args.split, seed=0)
    except (FileNotFoundError, ValueError) as e:
        raise refuse(PROG, str(e).splitlines()[0]) from None
    if getattr(model, "chunker", None) is None:
        raise refuse(
            PROG, f"--model {args.model}: a {type(model).__name__} model has no segments; give a Spider export"
        )
    if getattr(model, "boundary_predictor", None) is None:
        raise refuse(PROG, f"--model {args.model}: no learned boundary predictor (fixed segments need no measuring)")
    loader = ByteDataLoader(dataset, seq_len=args.seq, local_batch_size=args.batch, dp_rank=0, dp_world_size=1, seed=0)
    batches = (batch[0] for batch, _ in zip(loader, range(args.batches)))
    result = summary(capacity_needed(model, batches))
    for name, label in (("rows", "model.segment_capacity per row"), ("batches", "model.packed_capacity per batch")):
        s = result[name]
        print(f"{label}: mean {s['mean']:.3f}, " + ", ".join(f"q{q:g} {s[f'q{q:g}']:.3f}" for q in QUANTILES))
    print(f"bytes per segment: {model.args.target_bytes_per_segment / result['rows']['mean']:.2f}")
    if args.json:
        write_whole(args.json, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
