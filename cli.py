"""``tidal`` command line: serve, checkpoint, tap, bench."""

from __future__ import annotations

import argparse
import sys


def _checkpoint(ns: argparse.Namespace) -> int:
    from .executor.presets import write_checkpoint

    if (ns.preset is None) == (ns.source is None):
        raise ValueError("give --preset NAME (random weights) or --from DIR (a dense checkpoint), not both")
    out = write_checkpoint(ns.preset, ns.out, seed=ns.seed, weights=not ns.config_only, quantize=ns.quantize,
                           source=ns.source)
    what = "config and tokenizer" if ns.config_only else "checkpoint"
    layout = f", {ns.quantize} experts and n-gram table" if ns.quantize else ""
    origin = f"{ns.preset} (seed {ns.seed}, random weights)" if ns.source is None else f"from {ns.source}"
    print(f"wrote {what} {origin}{layout} to {out}")
    return 0


def _serve(ns: argparse.Namespace) -> int:
    from .config.server_args import args_from_namespace
    from .runtime.serve import serve

    return serve(args_from_namespace(ns))


def _stop(signum, frame):
    raise KeyboardInterrupt


def _tap(ns: argparse.Namespace) -> int:
    """Print one JSON object per PromptAdmitted / Detokenize message published on the tap (and, on
    stderr, one line once connected: what the server publishes from then on is printed). SIGINT or
    SIGTERM ends it with exit status 0."""
    import signal

    import msgspec
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from .messages import TapMessage, decoder, to_builtins

    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)  # the subscription goes out with it
    sock.connect(ns.connect)
    dec = decoder(TapMessage)
    out = sys.stdout
    signal.signal(signal.SIGTERM, _stop)
    deadline = None if ns.count is None else ns.count
    try:
        recv_monitor_message(monitor)  # the server may not be up yet: ZeroMQ retries until it is
        sock.disable_monitor()
        print(f"tap: connected to {ns.connect}", file=sys.stderr, flush=True)
        while deadline is None or deadline > 0:
            msg = dec.decode(sock.recv())
            out.write(msgspec.json.encode(to_builtins(msg)).decode() + "\n")
            out.flush()
            if deadline is not None:
                deadline -= 1
    except KeyboardInterrupt:
        pass
    finally:
        ctx.destroy(0)
    return 0


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Each flag's help ends with its default, unless the default is unset (None: the help says what
    happens then), a switch's False, or the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        if action.option_strings and not unset and "default" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="tidal", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tidal {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    ck = sub.add_parser("checkpoint", help="write a Qwen4-Exp checkpoint with seeded random weights")
    ck.add_argument("--preset", default=None, help="tiny, small, bench or flash-next (random weights)")
    ck.add_argument("--from", dest="source", default=None,
                    help="a dense Hugging Face checkpoint directory to write again (with --quantize)")
    ck.add_argument("--quantize", default=None, choices=["nvfp4", "fp8"],
                    help="write the routed experts and the n-gram table in a published layout: nvfp4 (ModelOpt "
                         "MIXED_PRECISION) or fp8 (Qwen's block FP8)")
    ck.add_argument("--out", required=True, help="output directory")
    ck.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    ck.add_argument("--config-only", action="store_true",
                    help="write config and tokenizer only (serve with --load-format random)")
    ck.set_defaults(func=_checkpoint)

    from .config.server_args import add_server_flags

    sv = sub.add_parser("serve", help="serve the OpenAI API (the demo model without --model)",
                        formatter_class=DefaultsHelpFormatter)
    add_server_flags(sv)
    sv.set_defaults(func=_serve)

    from .runtime.run import add_run_flags, run_command

    rn = sub.add_parser("run", help="run one process of the mesh (frontend, scheduler, executor, detokenizer): "
                        "one container each under docker compose", formatter_class=DefaultsHelpFormatter)
    add_run_flags(rn)
    rn.set_defaults(func=run_command)

    from .bench.cli import add_bench_flags, run_bench

    bn = sub.add_parser("bench", help="benchmark any OpenAI-compatible endpoint (the seeds' protocol, "
                        "open-loop arrivals)")
    add_bench_flags(bn)
    bn.set_defaults(func=run_bench)

    tp = sub.add_parser("tap", help="print PromptAdmitted / Detokenize messages as JSON lines")
    tp.add_argument("--connect", required=True, help="the server's --tap-addr (printed at start-up)")
    tp.add_argument("--count", type=int, default=None, help="exit after this many messages")
    tp.set_defaults(func=_tap)
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
