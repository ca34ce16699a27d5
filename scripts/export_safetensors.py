"""Export a DCP checkpoint as safetensors + config.json (full tensors, plain FQNs; int8 / int4 with --quantize).

    python scripts/export_safetensors.py --checkpoint outputs/debug_dense/checkpoint/step-200 --out exports/dense
    python scripts/export_safetensors.py --checkpoint outputs/debug_dense/checkpoint --out exports/dense --dtype bfloat16
    python scripts/export_safetensors.py --checkpoint outputs/debug_model/export --out exports/spider-int8 --quantize int8

``--checkpoint`` is a ``step-<N>`` folder or a folder of them (then the newest complete one), full
or model-only, saved by any number of ranks; it is read in this one process. It may also be an
unquantized export, written again (another dtype, or quantized). ``--quantize int8|int4`` stores the
model's linears, hashed tables and MoE expert weights weight-only quantized with torchao
(quantization/weight_only.py, the rest in bf16 unless ``--dtype`` says otherwise; docs/benchmarks.md has their
quality and size; generate.py dequantizes them once at load unless ``--keep_quantized``). Above
``--max_shard_size`` bytes the weights are split into ``model-0000i-of-0000K.safetensors`` files
with a ``model.safetensors.index.json``. ``--out`` must be new, empty or a previous export (its
``.spider_titan_export`` marker), never the checkpoint folder or a folder around it: the export
replaces its folder whole and deletes nothing it did not write. The work is done by
:func:`spider_titan.checkpoint.export.export_checkpoint`; sample from the result with
``scripts/generate.py --model <out>``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spider_titan.checkpoint.export import DEFAULT_MAX_SHARD_BYTES, export_checkpoint
from spider_titan.cli import ArgumentParser, at_least, check_output_folder
from spider_titan.errors import describe_os_error, find_os_error
from spider_titan.protocol import DTYPES
from spider_titan.quantization.weight_only import METHODS, check_method


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, documented by ``--help``."""
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="a step-<N> checkpoint folder, a folder of them (then the newest complete one), or an unquantized export",
    )
    p.add_argument(
        "--out", required=True, metavar="DIR", help="export folder: new, empty, or a previous export (replaced whole)"
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="dtype of the tensors not quantized (default float32, bfloat16 with --quantize)",
    )
    p.add_argument(
        "--quantize",
        default="none",
        metavar="|".join(("none", *METHODS)),
        help="weight-only quantization of the model's linears, tables and experts with torchao (default none)",
    )
    p.add_argument(
        "--max_shard_size",
        type=int,
        default=DEFAULT_MAX_SHARD_BYTES,
        metavar="BYTES",
        help=f"largest safetensors file before sharding (default {DEFAULT_MAX_SHARD_BYTES})",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Parse the flags and write the export; a user error exits with status 1 and one line."""
    args = parse_args(argv)
    quantize = None if args.quantize == "none" else args.quantize
    dtype = args.dtype or ("float32" if quantize is None else "bfloat16")
    try:  # before anything is read
        if quantize is not None:
            check_method(quantize)
        at_least(1, "--max_shard_size", args.max_shard_size, "bytes in one safetensors file")
        check_output_folder(args.out, "--out")
        out = export_checkpoint(
            Path(args.checkpoint),
            Path(args.out),
            dtype=DTYPES[dtype],
            max_shard_bytes=args.max_shard_size,
            origin="--out",
            quantize=quantize,
        )
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"export_safetensors: error: {e}")
    except Exception as e:  # a full or read-only --out: torch and safetensors word a short write their own way
        cause = find_os_error(e, Path(args.out))
        if cause is None:
            raise
        sys.exit(f"export_safetensors: error: {describe_os_error(cause, Path(args.out), setting='--out')}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
