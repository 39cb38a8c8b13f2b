"""``tidal`` command line: serve, checkpoint, tap, bench."""

from __future__ import annotations

import argparse
import sys


def _checkpoint(ns: argparse.Namespace) -> int:
    from .executor.presets import write_checkpoint

    out = write_checkpoint(ns.preset, ns.out, seed=ns.seed, weights=not ns.config_only)
    what = "config and tokenizer" if ns.config_only else "checkpoint"
    print(f"wrote {ns.preset} {what} (seed {ns.seed}, random weights) to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    ck = sub.add_parser("checkpoint", help="write a Qwen4-Exp checkpoint with seeded random weights")
    ck.add_argument("--preset", required=True, help="tiny, small or bench")
    ck.add_argument("--out", required=True, help="output directory")
    ck.add_argument("--seed", type=int, default=0)
    ck.add_argument("--config-only", action="store_true",
                    help="write config and tokenizer only (serve with --load-format random)")
    ck.set_defaults(func=_checkpoint)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return ns.func(ns) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"tidal {ns.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
