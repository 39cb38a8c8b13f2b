"""Decode through ``tidal serve``: CUDA graphs and overlapped scheduling on and off, side by side
(device-only).

    python benchmarks/bench_decode_server.py --out DIR [--preset bench] [--concurrency 1,8,32]
        [--contexts 16,8192] [--tokens 256] [--arms graphs,graphs-no-overlap,eager] [-- SERVE_FLAGS...]

One ``tidal serve --load-format random`` per arm, all up at once: ``graphs`` (the defaults: CUDA
graphs, overlapped scheduling), ``graphs-no-overlap`` (``--disable-overlap-schedule``), ``eager``
(``--disable-cuda-graph``), ``eager-no-overlap`` (both); for each context and concurrency the arms
take turns, each first running an untimed sample of the same shape. Each sample starts ``concurrency``
streamed greedy completions of ``--tokens`` tokens (``ignore_eos``) after distinct random prompts of
``context`` tokens (nothing cached); decode tok/s = generated tokens after the first / the time from the
latest first token to the last token, as the server's tap delivered them (a token whose text is empty, common
under random weights, sends no SSE event).
Flags after ``--`` go to every server (e.g. ``-- --quantization nvfp4 --ple-backend pinned``).
Writes ``DIR/bench_decode_server.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from tidal.bench.client import greedy_stream
from tidal.bench.server import Server, split_serve_flags
from tidal.bench.tap import TapReader
from tidal.executor.presets import write_checkpoint

ARMS = {"graphs": [], "graphs-no-overlap": ["--disable-overlap-schedule"], "eager": ["--disable-cuda-graph"],
        "eager-no-overlap": ["--disable-cuda-graph", "--disable-overlap-schedule"]}


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed * 1_000_003 + n)
    return [rng.randrange(1000, 240000) for _ in range(n)]


def sample(srv: Server, tap: TapReader, context: int, conc: int, tokens: int, seed: int) -> dict:
    """Decode tok/s of ``conc`` concurrent requests: the tokens after each one's first over the time from the
    latest first token to the last token, both as the tap delivered them (a token whose text is empty sends no
    SSE event, so the stream cannot time it); with the times (seconds from the start) they are drawn from."""
    prompts = [prompt(context, seed * 1000 + i) for i in range(conc)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(conc) as pool:
        results = list(pool.map(lambda p: greedy_stream(srv.url, p, tokens, "bench"), prompts))
    wall = time.monotonic() - t0
    assert all(r["usage"]["completion_tokens"] == tokens for r in results)
    records = [tap.wait(r["rid"], 30.0) for r in results]
    if any(rec is None or len(rec.token_times) != tokens for rec in records):
        raise RuntimeError(f"the tap did not deliver {tokens} tokens of every request")
    first = max(rec.token_times[0] for rec in records) - t0
    last = max(rec.token_times[-1] for rec in records) - t0
    return {"tok_per_s": conc * (tokens - 1) / (last - first), "ms_per_step": (last - first) / (tokens - 1) * 1e3,
            "wall_s": wall, "first_token_s": first, "last_token_s": last,
            "tap_messages": max(len(set(rec.token_times)) for rec in records)}


def main() -> None:
    argv, extra = split_serve_flags(sys.argv[1:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--contexts", default="16,8192")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--arms", default="graphs,graphs-no-overlap,eager")
    ns = ap.parse_args(argv)
    os.makedirs(ns.out, exist_ok=True)
    path = write_checkpoint(ns.preset, tempfile.mkdtemp(prefix="tidal-ckpt-"), weights=False)
    concs = [int(x) for x in ns.concurrency.split(",")]
    contexts = [int(x) for x in ns.contexts.split(",")]
    per_request = max(contexts) + ns.tokens + 64
    flags = ["--load-format", "random", "--max-model-len", str(per_request),
             "--kv-pool-tokens", str(max(concs) * per_request + 16384), "--max-running-requests", str(max(concs)),
             "--max-prefill-length", "8192", *extra]
    arms = ns.arms.split(",")
    servers, taps = {}, {}
    results = {"preset": ns.preset, "tokens": ns.tokens, "flags": flags, "rows": []}
    try:
        for arm in arms:
            servers[arm] = Server(path, *flags, *ARMS[arm], served_model_name="bench", device="cuda",
                                  ready_timeout=600)
            taps[arm] = TapReader(servers[arm].tap_addr)
            greedy_stream(servers[arm].url, prompt(64, 1), 8, "bench")  # warm-up
        for context in contexts:
            for conc in concs:
                for arm in arms:
                    # As long as the timed sample: the graphs (and kernels) of every shape it meets, the QSA block
                    # count growing with the context included, are captured (compiled) before it.
                    sample(servers[arm], taps[arm], context, conc, ns.tokens, seed=7)
                    row = sample(servers[arm], taps[arm], context, conc, ns.tokens, seed=context + conc)
                    results["rows"].append({"arm": arm, "context": context, "concurrency": conc, **row})
                    print(f"{arm:18s} context {context:5d} concurrency {conc:3d}: {row['tok_per_s']:8.1f} tok/s "
                          f"({row['ms_per_step']:.2f} ms a step; tokens {row['first_token_s']:.3f}-"
                          f"{row['last_token_s']:.3f} s of {row['wall_s']:.3f} s, {row['tap_messages']} tap messages)",
                          flush=True)
                    with open(os.path.join(ns.out, "bench_decode_server.json"), "w") as f:
                        json.dump(results, f, indent=1)
    finally:
        for tap in taps.values():
            tap.close()
        for arm, srv in servers.items():
            left = srv.stop()
            print(f"server {arm} stopped, processes left: {left}", flush=True)


if __name__ == "__main__":
    main()
