"""Sample text from a safetensors export, or straight from a training run's checkpoint.

    python scripts/generate.py --model exports/dense --prompt "def main(" --max_new_bytes 200
    python scripts/generate.py --model outputs/debug_dense/export --prompt "The " --temperature 0 # greedy
    printf 'any \xff bytes' | python scripts/generate.py --model exports/dense --prompt_file -
    python scripts/generate.py --model outputs/my_run --prompt "def "   # newest checkpoint of a run
    python scripts/generate.py --model exports/spider --interactive     # type, the model continues

The model named in the export's config.json is rebuilt through the registry and fed
``[BOS] + prompt bytes``; each next byte is greedy (``--temperature 0``) or drawn at
``--temperature`` from the ``--top_k`` most likely bytes (0 = all), until EOS or
``--max_new_bytes``. The model reads bytes, so the prompt is taken as the raw bytes of the
argument (any byte string, UTF-8 or not) or of ``--prompt_file``. ``--n_loops`` above the trained
count runs only the loops up to the last one the end-of-run calibration gave a non-zero gain (the
output is the same; one line on stderr says so). ``--interactive``: a session that streams each
byte as it is sampled and keeps the decoder's caches between turns (``generation.Conversation``).
The work is done by :mod:`spider_titan.generation`.
"""

from __future__ import annotations

import argparse
import codecs
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from spider_titan.cli import ArgumentParser, at_least, quiet_stdout_errors
from spider_titan.generation import (
    Conversation,
    check_sampling,
    effective_loops,
    generate,
    load_model,
    model_spec,
    resolve_device,
    uses_cache,
)
from spider_titan.protocol import DTYPES
from spider_titan.training.ttt import TTTSettings, adapt_on_prompt
from spider_titan.vocab import BOS_ID


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, documented by ``--help``."""
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        help="export folder (config.json + model.safetensors), or a run / checkpoint / step-<N> folder "
        "(the newest complete checkpoint's weights, no export needed)",
    )
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="", help="text to continue (default: empty, start of a document)")
    prompt.add_argument("--prompt_file", metavar="PATH", help="read the prompt's bytes from this file (- = stdin)")
    p.add_argument("--max_new_bytes", type=int, default=256, help="most bytes to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top_k", type=int, default=0, help="sample among the k most likely bytes; 0 = all (default 0)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass; 1 = all (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument(
        "--n_loops",
        type=int,
        default=None,
        help="Spider: core loops at generation (test-time depth; default: as trained)",
    )
    p.add_argument(
        "--interactive",
        action="store_true",
        help="a conversation: each line you type is appended (without its newline) and the model's "
        "continuation streams; an empty line continues, /reset starts a new document, Ctrl-D ends",
    )
    p.add_argument(
        "--ttt",
        action="store_true",
        help="test-time training: adapt LoRA adapters on the prompt, chunk by chunk, before sampling "
        "(spider_titan/training/ttt.py, its default settings); the report names what was adapted",
    )
    p.add_argument("--no_cache", action="store_true", help="recompute the whole context for every byte (the reference)")
    p.add_argument(
        "--report",
        action="store_true",
        help="one line on stderr: bytes, speed, cached or not, loops (on with --n_loops)",
    )
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="device (default: cuda if available)"
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="compute dtype (default float32)")
    p.add_argument(
        "--keep_quantized",
        action="store_true",
        help="an int8 / int4 export's weights stay quantized in memory, dequantized at every use (less memory, "
        "slower decoding); default: dequantized once at load into --dtype",
    )
    return p.parse_args(argv)


def read_prompt(args: argparse.Namespace) -> bytes:
    """The prompt's bytes: the argument as the OS passed it (os.fsencode undoes Python's decoding,
    so a non-UTF-8 argument is not an error), or the file's or stdin's bytes."""
    if args.prompt_file is None:
        return os.fsencode(args.prompt)
    if args.prompt_file == "-":
        return sys.stdin.buffer.read()
    try:
        return Path(args.prompt_file).read_bytes()
    except OSError as e:
        raise ValueError(f"--prompt_file {args.prompt_file}: {e.strerror}") from None


def skipped_loops(run: int, asked: int) -> str:
    """Why only ``run`` of the ``asked`` loops run (``effective_loops``)."""
    which = f"loop {asked} has" if asked == run + 1 else f"loops {run + 1}-{asked} have"
    it = "it leaves" if asked == run + 1 else "they leave"
    return f"{which} calibrated gain 0 ({it} the output unchanged); running {run} loops"


def main(argv: list[str] | None = None) -> None:
    """Load the export, sample, print the prompt and its continuation; a user error exits with one line,
    a closed stdout (``| head``) quietly with 141, Ctrl-C with 130."""
    try:
        with quiet_stdout_errors("generate"):
            _main(argv)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the exit itself
        print("", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag for every setting that is out of range, before anything is loaded."""
    check_sampling(temperature=args.temperature, top_k=args.top_k, max_new_bytes=args.max_new_bytes, top_p=args.top_p)
    if args.n_loops is not None:
        at_least(1, "--n_loops", args.n_loops, "core loops at generation")
    if args.ttt and args.interactive:
        raise ValueError("--ttt adapts on the prompt before sampling; it does not combine with --interactive")
    if not Path(args.model).exists():
        raise FileNotFoundError(
            f"--model {args.model} does not exist; give an export folder (scripts/export_safetensors.py) or a run folder"
        )


def _main(argv: list[str] | None) -> None:
    args = parse_args(argv)
    try:
        check_args(args)
        device = resolve_device(args.device)
        prompt = read_prompt(args)
        model, config = load_model(
            Path(args.model), device=device, dtype=DTYPES[args.dtype], keep_quantized=args.keep_quantized
        )
        trained_loops = config["model"]["args"].get("n_loops")
        if args.n_loops is not None and trained_loops is None:
            raise ValueError(f"--n_loops: the model {config['model']['name']!r} has no core loops")
        run_loops = effective_loops(model, args.n_loops)
        if run_loops != args.n_loops:
            print(f"generate: --n_loops {args.n_loops}: {skipped_loops(run_loops, args.n_loops)}", file=sys.stderr)
        if args.interactive:
            return interactive(model, args, prompt)
        if args.ttt:
            adapt(model, prompt, context_len=config["model"]["args"].get("max_seq_len"), device=device)
        t0 = time.perf_counter()
        out = generate(
            model,
            prompt,
            max_new_bytes=args.max_new_bytes,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            context_len=config["model"]["args"].get("max_seq_len"),
            n_loops=args.n_loops,
            use_cache=not args.no_cache,
        )
        seconds = time.perf_counter() - t0
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"generate: error: {e}")
    cached = not args.no_cache and uses_cache(model, len(prompt) + 1 + args.max_new_bytes)
    run = "" if run_loops == args.n_loops else f", {run_loops} run"
    loops = "" if trained_loops is None else f", n_loops {args.n_loops or trained_loops} (trained {trained_loops}{run})"
    if args.report or args.n_loops is not None:
        print(
            f"generate: {len(out)} bytes in {seconds:.2f} s ({len(out) / max(seconds, 1e-9):.0f} bytes/s, "
            f"{'cached' if cached else 'recomputing the context'}{loops})",
            file=sys.stderr,
        )
    # bytes -> text for the terminal; invalid UTF-8 (in the prompt or drawn) shows as U+FFFD
    print((prompt + out).decode("utf-8", errors="replace"))


def adapt(model, prompt: bytes, *, context_len: int | None, device: torch.device) -> None:
    """``--ttt``: the model's adapters learn from ``[BOS] + prompt`` (score-first, chunk by chunk) and stay
    on it for the sampling; one report line on stderr."""
    spec = model_spec(model)
    if spec is None:
        raise ValueError(f"--ttt: a {type(model).__name__} is no registered model")
    seq_len = min(context_len or TTTSettings.chunk_bytes, 1024)
    settings = TTTSettings(chunk_bytes=min(TTTSettings.chunk_bytes, seq_len))
    tokens = np.frombuffer(prompt, dtype=np.uint8).astype(np.int64)
    _, scores = adapt_on_prompt(
        model, spec, np.concatenate([[BOS_ID], tokens]), settings, seq_len=seq_len, device=device
    )
    print(
        f"generate: test-time training on the prompt ({len(prompt)} bytes, {scores.ce.numel()} chunks of "
        f"{settings.chunk_bytes}, {settings.steps} step each, lr {settings.lr:g}, rank {settings.rank}) in "
        f"{scores.seconds:.2f} s; prompt bpb {scores.bpb:.3f} as it was read; adapted {len(scores.adapted)} "
        f"linears: {', '.join(scores.adapted)}",
        file=sys.stderr,
    )


class TerminalText:
    """Bytes -> text on a stream as they arrive: UTF-8 decoded incrementally (a character shows once
    complete, invalid bytes as U+FFFD) and unprintable characters other than newline and tab escaped
    as Python writes them (``\\x1b``), so sampled bytes cannot drive the terminal."""

    def __init__(self, stream):
        self.stream = stream
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(self, data: bytes, final: bool = False) -> None:
        text = self.decoder.decode(data, final)
        shown = "".join(c if c.isprintable() or c in "\n\t" else ascii(c)[1:-1] for c in text)
        self.stream.write(shown)
        self.stream.flush()


def interactive(model, args: argparse.Namespace, prompt: bytes) -> None:
    """The ``--interactive`` conversation on stdin/stdout (the prompt, when given, is the first turn);
    after each turn a line on stderr: bytes, bytes/s, cached or not, loops, room left. Ctrl-C ends
    it where it is (:func:`main` exits 130, without a traceback)."""
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    conv = Conversation(model, n_loops=args.n_loops, seed=args.seed, **sampling)
    loops = "" if getattr(model.args, "n_loops", None) is None else f", n_loops {conv.n_loops or model.args.n_loops}"
    how = "cached" if conv.decoder is not None else "recomputing the context"
    print(
        "generate: type text and press Enter; an empty line continues, /reset starts anew, Ctrl-D ends", file=sys.stderr
    )
    pending = prompt or None
    while True:
        if pending is None:
            print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.buffer.readline()
            if not line:
                break
            pending = line.rstrip(b"\r\n")
            if pending == b"/reset":
                conv.reset()
                print("generate: a new document", file=sys.stderr)
                pending = None
                continue
        text, pending = pending, None
        out, count, t0 = TerminalText(sys.stdout), 0, time.perf_counter()
        try:
            for byte in conv.turn(text, args.max_new_bytes):
                out.write(bytes([byte]))
                count += 1
        except ValueError as e:
            print(f"generate: {e}; /reset starts a new document", file=sys.stderr)
            continue
        out.write(b"", final=True)
        seconds = time.perf_counter() - t0
        print(
            f"\ngenerate: {count} bytes, {count / max(seconds, 1e-9):.0f} bytes/s ({how}{loops}), "
            f"{conv.room} bytes of room left",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
