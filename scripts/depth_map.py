"""Which bytes get deep segments: a text with the core loops its segments ran, under per-segment depth.

    python scripts/depth_map.py --model outputs/my_run/export --text "def parse(self, text):"
    python scripts/depth_map.py --model outputs/my_run/export --text_file README.md --max_bytes 600 --n_loops 4

Prints each line of the text (``[BOS] + bytes``, through one forward in eval mode) with a line under it
that gives, under each segment's first byte, the loops the segment ran (``model.depth_capacity``: the first
loop runs every segment, the router picks who runs the later ones, recurrence.DepthRouter) and ``·`` under
its other bytes; then the share of bytes at each depth. Non-printable bytes show as ``.``. ``--png PATH``
also draws the text with each byte on a colour for its segment's loops (matplotlib: ``.[plot]``).
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
    p.add_argument("--png", metavar="PATH", default=None, help="also draw the text coloured by loops here")
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
    out = []
    for row in lines_of(data, loops, starts):
        out.append("".join(ch for ch, _, _ in row))
        out.append("".join(((str(n) if n < 10 else "+") if start else "\u00b7") for _, n, start in row))
    return "\n".join(out)


def lines_of(data: bytes, loops: list[int], starts: list[bool]) -> list[list[tuple[str, int, bool]]]:
    """The text's non-blank lines (a blank line adds nothing to read) as (character, loops, segment start)
    per byte; non-printable bytes as ``.``."""
    out, line = [], []
    for byte, n, start in zip(data, loops, starts):
        if byte == 10:
            if line:
                out.append(line)
            line = []
            continue
        line.append((chr(byte) if 32 <= byte < 127 else ".", n, start))
    return out + ([line] if line else [])


def draw(data: bytes, loops: list[int], starts: list[bool], path: Path, n_loops: int) -> None:
    """A picture of the text, each byte on a colour for the loops its segment ran (1 .. ``n_loops``)."""
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("--png needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    rows = lines_of(data, loops, starts)
    width = max(len(r) for r in rows)
    colors = plt.get_cmap("YlOrRd")([0.08 + 0.8 * i / max(1, n_loops - 1) for i in range(n_loops)])
    fig, ax = plt.subplots(figsize=(0.11 * width + 0.4, 0.22 * len(rows) + 0.8))
    for y, row in enumerate(rows):
        for x, (ch, n, _) in enumerate(row):
            ax.add_patch(Rectangle((x, -y - 1), 1, 1, color=colors[n - 1], lw=0))
            ax.text(x + 0.5, -y - 0.5, ch, ha="center", va="center", family="monospace", fontsize=8)
    ax.set_xlim(0, width)
    ax.set_ylim(-len(rows), 0)
    ax.axis("off")
    shares = Counter(loops)
    handles = [
        Patch(color=colors[k - 1], label=f"{k} loop{'s' * (k > 1)}: {shares[k] / len(loops):.0%} of bytes")
        for k in range(1, n_loops + 1)
    ]
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=n_loops, fontsize=8, frameon=False)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Map the text; a user error exits with one line."""
    args = parse_args(argv)
    try:
        data = args.text.encode() if args.text is not None else Path(args.text_file).read_bytes()
        model, _ = load_model(Path(args.model))
        data = data[: min(args.max_bytes, model.args.max_seq_len - 1)]
        loops, starts = depth_map(model, data, args.n_loops)
        if args.png:
            draw(data, loops, starts, Path(args.png), args.n_loops or model.args.n_loops)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"depth_map: error: {e}")
    print(render(data, loops, starts))
    shares = Counter(loops)
    print("\nbytes by loops run: " + ", ".join(f"{k}: {shares[k] / len(loops):.0%}" for k in sorted(shares)))


if __name__ == "__main__":
    main()
