"""Command line: `bumblebee list`, `bumblebee pair --model M --slot S --a X --b Y [--json PATH]`."""
from __future__ import annotations

import argparse
import os
import sys


def _swaps(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--swap expects slot=impl, got {item!r}")
        slot, name = item.split("=", 1)
        out[slot] = name
    return out


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _check_writable(path: str) -> str | None:
    """Why `path` cannot be written, or None: checked before a run, not after it (the file is
    opened for appending and, if it did not exist, removed again)."""
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    if not existed:
        os.remove(path)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bumblebee", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="every slot, its implementations and SKILL.md")
    p = sub.add_parser("pair", help="train one model with two implementations of a slot and compare")
    p.add_argument("--model", default="qwen3-tiny")
    p.add_argument("--slot", default="attention")
    p.add_argument("--a", default="sdpa")
    p.add_argument("--b", default="eager")
    p.add_argument("--steps", type=_positive_int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=_positive_int, default=2)
    p.add_argument("--seq-len", type=_positive_int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", default=None)
    p.add_argument("--swap", action="append", default=[], metavar="SLOT=IMPL",
                   help="other slots to set on both sides")
    p.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    if args.cmd == "pair" and args.json and (why := _check_writable(args.json)):
        parser.error(f"--json {args.json}: cannot write there ({why})")

    from bumblebee import registry
    if args.cmd == "list":
        print(registry.describe())
        return 0
    from bumblebee.pairing import SAME_CODE_EXIT, format_report, pair, write_json
    try:
        report = pair(args.model, args.slot, args.a, args.b, steps=args.steps, seed=args.seed,
                      batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, device=args.device,
                      impl=_swaps(args.swap))
    except ValueError as e:
        print(f"bumblebee pair: {e}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if report["status"] == "same_code":
        print(f"bumblebee pair: both sides ran {report['ran']['a']['code']}'s code on {report['device']}: "
              f"nothing was compared", file=sys.stderr)
        return SAME_CODE_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
