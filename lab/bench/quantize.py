"""Quality and size of one trained export written as fp32, bf16, int8 and int4 (``--quantize``).

    python -m lab.bench.benchmark quantize --model outputs/debug_model/export --data builtin,data/prose

Each format is written by scripts/export_safetensors.py's code (``export_checkpoint``, the export
re-exported) into ``--out`` and loaded by ``generation.load_model`` (fp32 compute, as generate.py).
Per format: the weights' file size, the load time (median of ``--loads``), the val bits per byte of
every corpus in ``--data`` over the whole val split, each paired with bf16's over the same windows (the
difference and its standard error, ``protocol.paired_difference``), and cached decoding bytes/s on CPU
(``--new`` bytes of the first corpus' val text fed after a ``--context``-byte prompt of it), of the quantized
formats both as loaded by default (dequantized once) and kept quantized (``keep_quantized``); every model is
timed in each of ``--rounds`` rounds, in turn, and keeps its best, so a load on the machine falls on all alike,
and each is also given as a ratio to bf16's. ``--ablate``
adds a second table that decides ``Inference.quantize_keep_fqns``: int8 and int4 quantized in memory
from the bf16 export with the small or loop-sensitive linears and the hashed tables (:data:`CANDIDATES`) all
kept in bf16, then each of them quantized too, then all, each paired with the all-kept row.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from lab.bench.machine import machine
from lab.cli import check_data, check_folder, check_output_file, check_positive, parser, refuse, write_whole
from spider_titan import registry
from spider_titan.checkpoint.export import export_checkpoint
from spider_titan.data.loader import ByteDataLoader
from spider_titan.generation import load_model, model_spec
from spider_titan.protocol import paired_difference, window_cross_entropy
from spider_titan.quantization.weight_only import apply_weight_only, plan_weight_only
from spider_titan.training.validation import whole_split_batches
from spider_titan.vocab import BOS_ID

# linears, tables and expert weights that may stay bf16; the byte and loop embeddings (a few hundred rows; the loop embedding is
# read by index, not called) stay bf16 in every row
CANDIDATES = ("lm_head", "boundary_predictor", "core.inject", "router", "byte_ngrams", "engram.table", "experts")
SMALL_TABLES = ("embed_tokens", "loop_embedding")
FORMATS = {  # name -> (dtype of the rest, --quantize)
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "int8": (torch.bfloat16, "int8"),
    "int4": (torch.bfloat16, "int4"),
}


def val_loader(data: str, seq_len: int, batch: int) -> ByteDataLoader:
    """The whole val split of ``data`` (``builtin`` or a bytes folder), as validation reads it."""
    dataset = registry.get("dataset", "builtin" if data == "builtin" else "bytes")(
        None if data == "builtin" else data, split="val", seed=0
    )
    return ByteDataLoader(dataset, seq_len=seq_len, local_batch_size=batch, dp_rank=0, dp_world_size=1, seed=0)


@torch.no_grad()
def window_losses(model, loader: ByteDataLoader) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-window summed cross-entropy in nats (R,) and label counts (R,) over the whole split."""
    ce, count = [], []
    for inputs, labels in whole_split_batches(loader):
        c, n = window_cross_entropy(model(inputs).logits, labels)
        ce.append(c)
        count.append(n)
    return torch.cat(ce), torch.cat(count)


@torch.no_grad()
def decode_bytes_per_s(model, prompt: bytes, follow: bytes) -> float:
    """Bytes/s of the model's cached decoder fed ``follow`` one byte at a time after ``prompt`` (untimed).
    Every model is fed the same bytes: Spider's work per byte depends on where its segments end, so a model's
    own greedy bytes would time different work."""
    decoder = model_spec(model).cached_decoder()
    cache = decoder.new_cache(model, 1)
    decoder.decode(model, torch.tensor([[BOS_ID, *prompt]]), cache)
    t0 = time.perf_counter()
    for byte in follow:
        decoder.decode(model, torch.tensor([[byte]]), cache)
    return len(follow) / (time.perf_counter() - t0)


def folder_bytes(path: Path) -> int:
    """Bytes of the export's weight files."""
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


PROG = "python -m lab.bench.benchmark quantize"


def main(argv: list[str] | None = None) -> int:
    p = parser(PROG, __doc__)
    p.add_argument("--model", required=True, help="a trained, unquantized export (fp32 for the fp32 row)")
    p.add_argument("--data", default="builtin", help="comma-separated corpora: builtin, or bytes folders")
    p.add_argument("--out", default="outputs/quantize", help="folder for the four exports and quantize.json")
    p.add_argument("--seq_len", type=int, default=256, help="bytes per val window (default 256)")
    p.add_argument("--batch", type=int, default=8, help="val windows per forward (default 8)")
    p.add_argument("--loads", type=int, default=3, help="timed loads per format, median (default 3)")
    p.add_argument("--context", type=int, default=256, help="prompt bytes before the timed decode (default 256)")
    p.add_argument("--new", type=int, default=128, help="bytes decoded and timed per format (default 128)")
    p.add_argument("--rounds", type=int, default=3, help="decode timings per model, best kept (default 3)")
    p.add_argument("--ablate", action="store_true", help="the table that chooses the linears kept in bf16")
    p.add_argument("--markdown", help="append the table to this markdown file")
    args = p.parse_args(argv)
    args.argv = sys.argv[2:] if argv is None else list(argv)
    check_positive(
        PROG,
        seq_len=args.seq_len,
        batch=args.batch,
        loads=args.loads,
        context=args.context,
        new=args.new,
        rounds=args.rounds,
    )
    check_folder(PROG, "--model", args.model, what="a trained, unquantized export")
    corpora = [c for c in args.data.split(",") if c]
    if not corpora:
        raise refuse(PROG, "--data is empty; give builtin or bytes folders, comma-separated")
    for corpus in corpora:
        if corpus != "builtin":
            check_data(PROG, "--data", corpus)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise refuse(PROG, f"--out {args.out}: is a file; give a folder")
    check_output_file(PROG, "--markdown", args.markdown)
    try:
        return _run(args, out, corpora)
    except (FileNotFoundError, ValueError) as e:  # an export this code cannot read or re-export
        raise refuse(PROG, str(e).splitlines()[0]) from None


def _run(args: argparse.Namespace, out: Path, corpora: list[str]) -> int:
    """Every format written, loaded, scored and timed; the table printed and written."""
    torch.manual_seed(0)
    loaders = {c: val_loader(c, args.seq_len, args.batch) for c in corpora}
    text = bytearray()
    for inputs, _ in whole_split_batches(loaders[corpora[0]]):
        text += bytes(int(b) for b in inputs.flatten() if b < 256)
        if len(text) >= args.context + args.new:
            break
    prompt, follow = bytes(text[: args.context]), bytes(text[args.context : args.context + args.new])

    rows, losses, decoders = {}, {}, {}
    for name, (dtype, quantize) in FORMATS.items():
        folder = export_checkpoint(Path(args.model), out / name, dtype=dtype, quantize=quantize)
        load_model(folder)  # warm: imports, page cache
        times = []
        for _ in range(args.loads):
            t0 = time.perf_counter()
            model, _ = load_model(folder)
            times.append(time.perf_counter() - t0)
        losses[name] = {c: window_losses(model, loader) for c, loader in loaders.items()}
        rows[name] = {"file_mb": folder_bytes(folder) / 1e6, "load_s": statistics.median(times)}
        decoders[(name, "decode_bytes_per_s")] = model
        if quantize is not None:
            decoders[(name, "decode_kept_bytes_per_s")] = load_model(folder, keep_quantized=True)[0]
        print(name, json.dumps(rows[name]), flush=True)
    speeds = {key: 0.0 for key in decoders}
    for _ in range(args.rounds):  # each model once per round, in turn
        for key, model in decoders.items():
            speeds[key] = max(speeds[key], decode_bytes_per_s(model, prompt, follow))
    bf16 = speeds[("bf16", "decode_bytes_per_s")]
    for (name, column), speed in speeds.items():
        rows[name][column] = speed
        rows[name][column.replace("bytes_per_s", "vs_bf16")] = speed / bf16
    for name, row in rows.items():
        row.update(_paired(losses[name], losses["bf16"], corpora))
    ablation = {}
    if args.ablate:
        for method in ("int8", "int4"):
            variants = {"kept": CANDIDATES, **{f"+{c}": [k for k in CANDIDATES if k != c] for c in CANDIDATES}}
            variants["all"] = ()
            variants = {label: (*kept, *SMALL_TABLES) for label, kept in variants.items()}
            ref = None
            for label, kept in variants.items():
                model, _ = load_model(out / "bf16", dtype=torch.bfloat16)
                apply_weight_only(model, method, plan_weight_only(model, method, kept)[0])
                got = {c: window_losses(model.to(torch.float32), loader) for c, loader in loaders.items()}
                ref = ref or got
                ablation[f"{method} {label}"] = {
                    "vs_bf16": _paired(got, losses["bf16"], corpora),
                    "vs_kept": _paired(got, ref, corpora),
                }
                print(method, label, flush=True)

    report = {"machine": machine(), "model": args.model, "windows": args.seq_len, "rows": rows, "ablation": ablation}
    write_whole(out / "quantize.json", json.dumps(report, indent=1) + "\n")
    table = markdown(report, corpora)
    print(table)
    if args.markdown:  # appended: the file's text and the new section, written whole
        before = Path(args.markdown).read_text() if Path(args.markdown).exists() else ""
        command = " ".join([PROG, *args.argv])
        section = f"\n`{command}`\n\nMachine: {report['machine']}. Date: {time.strftime('%Y-%m-%d')}.\n\n{table}\n"
        write_whole(args.markdown, before + section)
    return 0


def _paired(got: dict, ref: dict, corpora: list[str]) -> dict:
    """Per corpus: bpb of ``got`` and its paired difference to ``ref`` (same windows) with its s.e."""
    out = {}
    for c in corpora:
        ce, count = got[c]
        diff, se = paired_difference(ce, ref[c][0], count)
        out[c] = {"bpb": float(ce.sum() / count.sum()) / math.log(2), "diff": diff, "se": se}
    return out


def _speed(row: dict, column: str) -> str:
    return f"{row[column + '_bytes_per_s']:.0f} ({row[column + '_vs_bf16']:.2f}x)"


def _cell(r: dict) -> str:
    return f"{r['bpb']:.4f} ({r['diff']:+.4f} ± {r['se']:.4f})"


def markdown(report: dict, corpora: list[str]) -> str:
    """The formats as a markdown table (bpb and paired difference to bf16 per corpus, size, load,
    decode), then the ablation's (difference to bf16 and to the row with every candidate kept)."""
    names = [Path(c).name for c in corpora]
    head = ["format", *[f"{n} val bpb (vs bf16 ± s.e.)" for n in names], "weights MB", "load s"]
    head += ["decode B/s (x bf16)", "kept quantized: decode B/s (x bf16)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in report["rows"].items():
        cells = [name, *[_cell(row[c]) for c in corpora]]
        cells += [f"{row['file_mb']:.2f}", f"{row['load_s']:.3f}"]
        cells += [_speed(row, "decode")]
        cells += [_speed(row, "decode_kept") if "decode_kept_bytes_per_s" in row else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    if report["ablation"]:
        head = ["quantized in memory", *[f"{n} {vs}" for n in names for vs in ("vs bf16", "vs kept")]]
        lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name, row in report["ablation"].items():
            cells = [name]
            for c in corpora:
                cells += [f"{row[vs][c]['diff']:+.4f} ± {row[vs][c]['se']:.4f}" for vs in ("vs_bf16", "vs_kept")]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
