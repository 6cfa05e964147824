"""`frugaltrain data`: train a byte-level BPE tokenizer, tokenize a corpus into token shards.

    frugaltrain data tokenizer --input corpus/ --vocab-size 4096 --out runs/tok
    frugaltrain data prepare --input corpus/ --tokenizer runs/tok --out runs/shards
    frugaltrain data prepare --input docs.jsonl --text-field body --tokenizer runs/tok --out DIR
    frugaltrain train --set data.path=runs/shards --set model.vocab_size=4096

--input takes a text file, a directory of text files, a JSONL or Parquet file (or a directory of
them), or '' (the default) for the Python standard library's sources. Nothing is downloaded.
A bad argument is one line on stderr, exit code 2, and nothing written.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from frugaltrain.config import ConfigError

PROG = "frugaltrain data"


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are our one-line format instead of usage + exit."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    t = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer (transformers format)")
    p = sub.add_parser("prepare", help="tokenize a corpus into token shards and a manifest")
    for q in (t, p):
        q.add_argument(
            "--input", default="", help="text/JSONL/Parquet file or directory ('': stdlib)"
        )
        q.add_argument("--out", required=True, help="output directory (new or empty)")
        q.add_argument(
            "--max-bytes", type=int, default=0, help="read at most this much text (0: all)"
        )
        q.add_argument("--text-field", default="text", help="text column of JSONL/Parquet rows")
        q.add_argument("--force", action="store_true", help="replace an earlier output in --out")
    t.add_argument("--vocab-size", type=int, required=True, help="tokens, 256 bytes + EOS included")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (data tokenizer --out)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="documents held out")
    p.add_argument("--shard-tokens", type=int, default=50_000_000, help="tokens per shard file")
    p.add_argument("--num-proc", type=int, default=1, help="tokenizing processes")
    return parser


def _check_flags(args: argparse.Namespace) -> None:
    """Flag values, refused with the flag's name before anything is read or written."""
    from frugaltrain.data.tokenizer import EOS, MIN_VOCAB

    if args.max_bytes < 0:
        raise _UsageError(f"--max-bytes {args.max_bytes}: must be >= 0 (0: no limit)")
    if args.command == "tokenizer" and args.vocab_size < MIN_VOCAB:
        raise _UsageError(
            f"--vocab-size {args.vocab_size}: must be at least {MIN_VOCAB} (256 bytes + {EOS}); "
            "4096-50000 is usual"
        )
    if args.command == "prepare":
        if not 0 < args.val_fraction < 1:
            raise _UsageError(f"--val-fraction {args.val_fraction}: must be between 0 and 1")
        if args.shard_tokens < 1:
            raise _UsageError(f"--shard-tokens {args.shard_tokens}: must be positive")
        if args.num_proc < 1:
            raise _UsageError(f"--num-proc {args.num_proc}: must be at least 1")


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from frugaltrain.data.tokenizer import load_tokenizer, tokenizer_hash, train_tokenizer

    options = {"max_bytes": args.max_bytes, "text_field": args.text_field, "force": args.force}
    t0 = time.perf_counter()
    out = train_tokenizer(args.input, args.vocab_size, args.out, **options)
    seconds = time.perf_counter() - t0
    tok = load_tokenizer(out)
    print(
        f"wrote {out}: byte-level BPE, {len(tok)} tokens (asked {args.vocab_size}), "
        f"sha256 {tokenizer_hash(tok)[:16]}, {seconds:.1f} s"
    )
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from frugaltrain.data.prepare import prepare

    t0 = time.perf_counter()
    m = prepare(
        args.input,
        args.tokenizer,
        args.out,
        val_fraction=args.val_fraction,
        text_field=args.text_field,
        shard_tokens=args.shard_tokens,
        num_proc=args.num_proc,
        max_bytes=args.max_bytes,
        force=args.force,
    )
    seconds = time.perf_counter() - t0
    print(
        f"wrote {Path(args.out).expanduser().resolve()} ({m['dtype']}, vocab {m['vocab_size']},"
        f" split by {m['split_rule']}) in {seconds:.1f} s"
    )
    for split, counts in m["splits"].items():
        n = sum(s["split"] == split for s in m["shards"])
        print(
            f"  {split:<5} {counts['documents']:>9} documents {counts['tokens']:>12} tokens "
            f"{n:>4} shards"
        )
    return 0


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
        _check_flags(args)
        return cmd_tokenizer(args) if args.command == "tokenizer" else cmd_prepare(args)
    except (_UsageError, ConfigError, ImportError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
