"""Measure what prefix caching saves: cold prompt, then a continuation that starts with it.

    python benchmarks/prefix_reuse.py --model DIR [--tokens 4000] [--extra 77] [serve flags ...]

Starts one `tidal serve` per arm (cache off, align, coalesced), sends the cold prompt and the
continuation (temperature 0, ignore_eos, 16 tokens, streaming), and prints first-text latency,
full time, cached tokens and whether the continuation's token ids agree across arms (via the tap).
"""

from __future__ import annotations

import argparse

from tidal.bench.client import greedy_stream
from tidal.bench.server import Server
from tidal.bench.tap import TapReader


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
    arms = {"cache off": ["--disable-prefix-cache"], "align": ["--no-prefill-coalesce"],
            "coalesce": ["--prefill-coalesce"]}
    rows, ids = [], {}
    for name, arm_flags in arms.items():
        srv = Server(ns.model, *flags, *arm_flags)
        tap = TapReader(srv.tap_addr)
        try:
            greedy_stream(srv.url, list(range(1, 65)), 4, srv.model_name)  # warm-up
            cold_run = greedy_stream(srv.url, cold, ns.max_tokens, srv.model_name)
            warm = greedy_stream(srv.url, cont, ns.max_tokens, srv.model_name)
            rec = tap.wait(warm["rid"], timeout=60)
            ids[name] = rec.token_ids if rec is not None else None
            rows.append((name, cold_run["first_text_s"], warm["first_text_s"], warm["full_s"],
                         warm["usage"]["prompt_tokens_details"]["cached_tokens"]))
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
