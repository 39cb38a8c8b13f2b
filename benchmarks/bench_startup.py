"""How long ``tidal serve`` takes to say ready, and whether anything compiles or is captured after it.

    python benchmarks/bench_startup.py --out DIR [--preset flash-next] [--starts 2]
                                       [--lengths 16,512,4000,16000] [--burst 32] [--burst-prompt 256]
                                       [--device cuda] [-- extra tidal serve flags]

Starts ``tidal serve --load-format random`` (plus the flags after ``--``) ``--starts`` times over one compile
cache that begins empty (``--compile-cache`` in a new temporary folder), so the first start compiles every
kernel and the later ones load what it left. After each start: one streamed prompt of each ``--lengths`` length
(new ids, nothing cached, 4 output tokens), then ``--burst`` prompts of ``--burst-prompt`` tokens at once (16
output tokens each), then ``/metrics``' ``tidal_compilations_after_ready_total`` and
``tidal_graph_captures_after_ready_total``, both 0 when the warm-up met every kernel variant and graph shape.
Per start it records the seconds from launch to ``/health`` 200, the warm-up's own log line, each prompt's
first-text latency and the burst's median.
Writes ``DIR/bench_startup.json`` after every start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time

from tidal.bench.server import Server
from tidal.executor.presets import write_checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import Prompts, burst  # noqa: E402

COUNTERS = ("tidal_compilations_after_ready_total", "tidal_graph_captures_after_ready_total")


def one_start(path: str, ns, flags: list[str], prompts: Prompts) -> dict:
    t0 = time.monotonic()
    srv = Server(path, *flags, served_model_name="bench", device=ns.device, ready_timeout=3600)
    out: dict = {"start_to_ready_s": time.monotonic() - t0}
    try:
        warm = re.findall(r"(?:warmed up in|longest compiles:) .*", srv.logs())
        out["warm_up_log"] = warm
        print(f"ready after {out['start_to_ready_s']:.1f} s; {warm[0] if warm else 'no warm-up line'}", flush=True)
        out["first_text_s"] = {}
        for n in ns.lengths:
            got = asyncio.run(burst(srv.url, [prompts(n)], 4))
            out["first_text_s"][n] = got["events"][0][0]
            print(f"  {n}-token prompt: first text {out['first_text_s'][n]:.3f} s", flush=True)
        got = asyncio.run(burst(srv.url, [prompts(ns.burst_prompt) for _ in range(ns.burst)], 16))
        out["burst_first_text_p50_s"] = statistics.median(e[0] for e in got["events"])
        out["burst_wall_s"] = got["wall_s"]
        metrics = srv.metrics()
        # None where the server exports no such counter (it runs no warm-up: the CPU).
        out["after_ready"] = {name: sum(v for k, v in metrics.items() if k.split("{")[0] == name)
                              if any(k.split("{")[0] == name for k in metrics) else None for name in COUNTERS}
        print(f"  burst of {ns.burst}: first text p50 {out['burst_first_text_p50_s']:.3f} s, wall "
              f"{got['wall_s']:.2f} s; after ready: {out['after_ready']}", flush=True)
        missed = re.findall(r"compiling .* after ready", srv.logs())
        out["compiled_after_ready"] = missed[:50]
    finally:
        out["left_after_stop"] = srv.stop()
    return out


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="flash-next")
    ap.add_argument("--starts", type=int, default=2)
    ap.add_argument("--lengths", default="16,512,4000,16000", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument("--burst-prompt", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ns = ap.parse_args(argv)
    os.makedirs(ns.out, exist_ok=True)
    path = write_checkpoint(ns.preset, tempfile.mkdtemp(), weights=False)
    cache = tempfile.mkdtemp(prefix="tidal-compile-")
    flags = ["--load-format", "random", "--compile-cache", cache, *extra]
    result: dict = {"preset": ns.preset, "device": ns.device, "flags": flags, "starts": []}
    prompts = Prompts(3)
    for i in range(ns.starts):
        print(f"start {i + 1} ({'empty compile cache' if i == 0 else 'the cache the first start left'})", flush=True)
        result["starts"].append(one_start(path, ns, flags, prompts))
        with open(os.path.join(ns.out, "bench_startup.json"), "w") as f:
            json.dump(result, f, indent=1)
    print("\nstart   ready s   compiled after ready   captured after ready")
    for i, s in enumerate(result["starts"]):
        a = s["after_ready"]
        print(f"{i + 1:<7d} {s['start_to_ready_s']:7.1f}   {a[COUNTERS[0]]!s:>20}   {a[COUNTERS[1]]!s:>20}")


if __name__ == "__main__":
    main()
