"""How long ``tidal serve`` takes to say ready, and whether anything compiles or is captured after it.

    python benchmarks/bench_startup.py --out DIR [--preset flash-next] [--starts 2]
                                       [--lengths 16,512,4000,16000] [--burst 32] [--burst-prompt 256]
                                       [--burst-tokens 16] [--coalesce]
                                       [--device cuda] [-- extra tidal serve flags]

Starts ``tidal serve --load-format random`` (plus the flags after ``--``) ``--starts`` times over one compile
cache that begins empty (``--compile-cache`` in a new temporary folder), so the first start compiles every
kernel and the later ones load what it left. After each start: first two bursts of ``--burst`` prompts of
``--burst-prompt`` tokens (``--burst-tokens`` each, new ids, nothing cached), the first the very first requests
the server gets (its median first text over the second's: ``first_burst_over_second``); then one streamed prompt
of each ``--lengths`` length (4 output tokens); then ``/metrics``' ``tidal_compilations_after_ready_total`` and
``tidal_graph_captures_after_ready_total``, both 0 when the warm-up met every kernel variant and graph shape.
Per start it records the seconds from launch to ``/health`` 200 and the warm-up's log lines (its time, and the
kernels that took longest to compile). ``--coalesce``: one more start over the same cache with the other
``--prefill-coalesce`` setting than the starts ran (``--no-prefill-coalesce`` unless the flags after ``--`` hold
it), the same bursts and prompts, and per length the coalesced start's first text over the aligned one's
(``coalesce_over_aligned``): aligned, a cold prompt runs its tail after the last checkpoint as a forward of its
own.
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
import threading
import time
import urllib.request

from tidal.bench.server import Server, serve_args, split_serve_flags
from tidal.executor.presets import write_checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import Prompts, burst  # noqa: E402


class HealthProbe:
    """``/health`` requested every 10 ms from a thread of its own while the block runs; :meth:`summary` gives the
    probes' count, p50, p99 and max seconds."""

    def __init__(self, url: str):
        self.url, self.seconds = url, []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.is_set():
            t0 = time.monotonic()
            with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
                r.read()
            self.seconds.append(time.monotonic() - t0)
            time.sleep(0.01)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join(15)

    def summary(self) -> dict:
        s = sorted(self.seconds)
        if not s:
            return {"probes": 0}
        return {"probes": len(s), "p50": s[len(s) // 2], "p99": s[min(len(s) - 1, int(0.99 * len(s)))], "max": s[-1]}


COUNTERS = ("tidal_compilations_after_ready_total", "tidal_graph_captures_after_ready_total")


def one_start(path: str, ns, flags: list[str], prompts: Prompts) -> dict:
    t0 = time.monotonic()
    srv = Server(path, *flags, served_model_name="bench", device=ns.device, ready_timeout=3600)
    out: dict = {"start_to_ready_s": time.monotonic() - t0}
    try:
        # The start's profile: the load, the compile workers, the warm-up and its longest compiles.
        out["warm_up_log"] = re.findall(r"\S+ (?:INFO|WARNING) (.*(?:warmed up in|longest compiles:|compile workers|"
                                        r"compile worker|weights:|model loaded in).*)", srv.logs())
        warm = [line for line in out["warm_up_log"] if "warmed up in" in line]
        print(f"ready after {out['start_to_ready_s']:.1f} s; {warm[0] if warm else 'no warm-up line'}", flush=True)
        for line in out["warm_up_log"]:
            if "warmed up in" not in line:
                print(f"  {line}", flush=True)
        with HealthProbe(srv.url) as probe:
            bursts = [asyncio.run(burst(srv.url, [prompts(ns.burst_prompt) for _ in range(ns.burst)],
                                        ns.burst_tokens)) for _ in range(2)]
        out["health_during_bursts_s"] = probe.summary()
        firsts = [statistics.median(e[0] for e in b["events"]) for b in bursts]
        out["burst_first_text_p50_s"] = firsts
        out["burst_wall_s"] = [b["wall_s"] for b in bursts]
        out["first_burst_over_second"] = firsts[0] / firsts[1]
        print(f"  bursts of {ns.burst}: first text p50 {firsts[0]:.3f} s, then {firsts[1]:.3f} s "
              f"({out['first_burst_over_second']:.2f}x); /health meanwhile {out['health_during_bursts_s']}", flush=True)
        out["first_text_s"] = {}
        for n in ns.lengths:
            got = asyncio.run(burst(srv.url, [prompts(n)], 4))
            out["first_text_s"][n] = got["events"][0][0]
            print(f"  {n}-token prompt: first text {out['first_text_s'][n]:.3f} s", flush=True)
        metrics = srv.metrics()
        # None where the server exports no such counter (it runs no warm-up: the CPU).
        out["after_ready"] = {name: sum(v for k, v in metrics.items() if k.split("{")[0] == name)
                              if any(k.split("{")[0] == name for k in metrics) else None for name in COUNTERS}
        print(f"  after ready: {out['after_ready']}", flush=True)
        missed = re.findall(r"compiling .* after ready", srv.logs())
        out["compiled_after_ready"] = missed[:50]
    finally:
        out["left_after_stop"] = srv.stop()
    return out


def main() -> None:
    argv, extra = split_serve_flags(sys.argv[1:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="flash-next")
    ap.add_argument("--starts", type=int, default=2)
    ap.add_argument("--lengths", default="16,512,4000,16000", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument("--burst-prompt", type=int, default=256)
    ap.add_argument("--burst-tokens", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--coalesce", action="store_true",
                    help="one more start with the other --prefill-coalesce setting, the coalesced start's first "
                         "texts against the aligned one's")
    ns = ap.parse_args(argv)
    os.makedirs(ns.out, exist_ok=True)
    path = write_checkpoint(ns.preset, tempfile.mkdtemp(), weights=False)
    cache = tempfile.mkdtemp(prefix="tidal-compile-")
    flags = ["--load-format", "random", "--compile-cache", cache, *extra]
    result: dict = {"preset": ns.preset, "device": ns.device, "flags": flags, "starts": []}
    prompts = Prompts(3)

    def save() -> None:
        with open(os.path.join(ns.out, "bench_startup.json"), "w") as f:
            json.dump(result, f, indent=1)

    for i in range(ns.starts):
        print(f"start {i + 1} ({'empty compile cache' if i == 0 else 'the cache the first start left'})", flush=True)
        result["starts"].append(one_start(path, ns, flags, prompts))
        save()
    if ns.coalesce and result["starts"]:
        coalesced = serve_args(path, flags).prefill_coalesce
        other = "--no-prefill-coalesce" if coalesced else "--prefill-coalesce"
        print(f"start with {other} (the same cache)", flush=True)
        result["other_start"] = {"flag": other, **one_start(path, ns, [*flags, other], prompts)}
        firsts = (result["starts"][-1]["first_text_s"], result["other_start"]["first_text_s"])
        on, off = firsts if coalesced else firsts[::-1]
        result["coalesce_over_aligned"] = {n: on[n] / off[n] for n in on}
        for n, ratio in result["coalesce_over_aligned"].items():
            print(f"  {n}-token prompt: first text {on[n]:.3f} s coalesced against {off[n]:.3f} s with "
                  f"--no-prefill-coalesce ({ratio:.2f}x)", flush=True)
        save()
    print("\nstart   ready s   first burst / second   compiled after ready   captured after ready")
    for i, s in enumerate(result["starts"]):
        a = s["after_ready"]
        print(f"{i + 1:<7d} {s['start_to_ready_s']:7.1f}   {s['first_burst_over_second']:20.2f}   "
              f"{a[COUNTERS[0]]!s:>20}   {a[COUNTERS[1]]!s:>20}")


if __name__ == "__main__":
    main()
