"""Which bytes get deep segments: a text with the core loops its segments ran, under per-segment depth.

    python scripts/depth_map.py --model outputs/my_run/export --text "def parse(self, text):"
    python scripts/depth_map.py --model outputs/my_run/export --text_file README.md --max_bytes 600 --n_loops 4

Prints each line of the text (``[BOS] + bytes``, through one forward in eval mode) with a line under it
that gives, under each segment's first byte, the loops the segment ran (``model.depth_capacity``: the first
loop runs every segment, the router picks who runs the later ones, recurrence.DepthRouter) and ``·`` under
its other bytes; then the share of bytes at each depth. Non-printable bytes show as ``.``.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

from spider_titan.generation import load_model
from spider_titan.vocab import BOS_ID


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, documented by ``--help``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, metavar="DIR", help="an export (or a run folder) of a Spider")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--text", help="the text to map")
    text.add_argument("--text_file", metavar="PATH", help="read the text's bytes from this file")
    p.add_argument("--max_bytes", type=int, default=800, help="map at most this many bytes (default 800)")
    p.add_argument("--n_loops", type=int, default=None, help="core loops (default: as trained)")
    return p.parse_args(argv)


def depth_map(model, data: bytes, n_loops: int | None = None) -> tuple[list[int], list[bool]]:
    """Per byte of ``data``: the loops its segment ran, and whether a segment starts at it."""
    seen = {}
    segment = model.chunker.segment
    model.chunker.segment = lambda *a, **k: seen.setdefault("seg", segment(*a, **k))
    hook = model.core.register_forward_hook(lambda module, args, out: seen.setdefault("core", out))
    try:
        with torch.no_grad():
            model(torch.tensor([[BOS_ID, *data]]), n_loops=n_loops)
    finally:
        model.chunker.segment = segment
        hook.remove()
    loops = seen["core"].segment_loops
    if loops is None:
        raise ValueError(
            "the model has no per-segment depth (model.depth_capacity is empty): every segment runs every loop"
        )
    seg_id = seen["seg"].seg_id[0]
    per_byte = loops[0].gather(0, seg_id.clamp(max=loops.shape[1] - 1))[1:].tolist()
    starts = (seg_id != torch.nn.functional.pad(seg_id[:-1], (1, 0), value=-1))[1:].tolist()
    return per_byte, starts


def render(data: bytes, loops: list[int], starts: list[bool]) -> str:
    """The text line by line, each with a line giving under a segment's first byte the loops it ran
    (``·`` under its other bytes)."""
    out, line, digits = [], [], []
    for byte, n, start in zip(data, loops, starts):
        if byte == 10:
            if line:  # a blank line of the text adds nothing to read
                out += ["".join(line), "".join(digits)]
            line, digits = [], []
            continue
        line.append(chr(byte) if 32 <= byte < 127 else ".")
        digits.append((str(n) if n < 10 else "+") if start else "\u00b7")
    if line:
        out += ["".join(line), "".join(digits)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    """Map the text; a user error exits with one line."""
    args = parse_args(argv)
    try:
        data = args.text.encode() if args.text is not None else Path(args.text_file).read_bytes()
        model, _ = load_model(Path(args.model))
        data = data[: min(args.max_bytes, model.args.max_seq_len - 1)]
        loops, starts = depth_map(model, data, args.n_loops)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"depth_map: error: {e}")
    print(render(data, loops, starts))
    shares = Counter(loops)
    print("\nbytes by loops run: " + ", ".join(f"{k}: {shares[k] / len(loops):.0%}" for k in sorted(shares)))


if __name__ == "__main__":
    main()
