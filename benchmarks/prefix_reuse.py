"""Measure what prefix caching saves: cold prompt, then a continuation that starts with it.

    python benchmarks/prefix_reuse.py --model DIR [--tokens 4000] [--extra 77] [serve flags ...]

Starts one `tidal serve` per arm (cache off, align, coalesced), sends the cold prompt and the
continuation (temperature 0, ignore_eos, 16 tokens, streaming), and prints first-text latency,
full time, cached tokens and whether the continuation's token ids agree across arms (via the tap).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_harness import Server, Tap, stream_completion  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--extra", type=int, default=77)
    ap.add_argument("--max-tokens", type=int, default=16)
    ns, flags = ap.parse_known_args()
    import random

    rng = random.Random(0)
    cold = [rng.randrange(1000, 240000) for _ in range(ns.tokens)]
    cont = cold + [rng.randrange(1000, 240000) for _ in range(ns.extra)]
    arms = {"cache off": ["--disable-prefix-cache"], "align": [], "coalesce": ["--prefill-coalesce"]}
    rows, ids = [], {}
    for name, arm_flags in arms.items():
        srv = Server(ns.model, *flags, *arm_flags, api_key=None)
        tap = Tap(srv.tap_addr)
        try:
            stream_completion(srv.url, list(range(1, 65)), 4)  # warm-up
            c_first, c_full, c_usage, _ = stream_completion(srv.url, cold, ns.max_tokens)
            w_first, w_full, w_usage, rid = stream_completion(srv.url, cont, ns.max_tokens)
            ids[name] = tap.wait_finished(rid)[1]
            rows.append((name, c_first, w_first, w_full, w_usage["prompt_tokens_details"]["cached_tokens"]))
        finally:
            tap.close()
            srv.stop()
    base = rows[0][2]
    print(f"{'arm':<10} {'cold first-text s':>18} {'cont first-text s':>18} {'cont full s':>12} "
          f"{'cached':>7} {'vs off':>7}")
    for name, c_first, w_first, w_full, cached in rows:
        print(f"{name:<10} {c_first:>18.3f} {w_first:>18.3f} {w_full:>12.3f} {cached:>7} {base / w_first:>6.2f}x")
    same = all(v == ids["cache off"] for v in ids.values())
    print(f"continuation token ids equal across arms: {same}")


if __name__ == "__main__":
    main()
