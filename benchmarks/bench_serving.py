"""What a user of ``tidal serve`` meets, beside what the forward does for the same shapes, in one run.

    python benchmarks/bench_serving.py --out DIR [--preset bench] [--lengths 1024,8192,32768]
                                       [--concurrency 1,8,32] [--burst-prompt 1024] [--burst-tokens 256]
                                       [--device cuda] [-- extra tidal serve flags]

One ``tidal serve --load-format random`` (its defaults, or the flags after ``--``), measured from outside with
streamed greedy token-id completions (``ignore_eos``; first text is the first SSE event with text, timed from
just before the request; every prompt is new unless said, so nothing is cached):

- ``start_to_ready_s``: from starting the server to ``/health`` 200;
- ``first_burst_after_ready``: the first thing the server gets, a burst of the largest ``--concurrency`` C prompts
  of ``--burst-prompt`` tokens (``--burst-tokens`` each), its median first text against the next burst of the
  same shape (``first_over_second``): what the first users after a start meet;
- ``first_after_ready``: the first single request, a ``--burst-prompt``-token cold prompt with 8 output tokens,
  against the same shape once warm (``first_over_warm``);
- ``cold``: per ``--lengths`` length, a warm-up of that length, then a cold prompt's first text;
- ``continuation``: the longest cold prompt plus 77 new tokens (its prefix cached) -> first text and cached
  tokens;
- ``bursts``: per ``--concurrency`` C, C prompts of ``--burst-prompt`` tokens with ``--burst-tokens`` each, sent
  at once (after an untimed burst of the same shape): median first text, inter-token latency (gaps between text
  events, pooled) p50/p99, output tok/s, the wall time, and decode tok/s once all are decoding (text events from
  the last first text to the first end).

The server is stopped and the same model and flags run in this process (``tidal.LLM``, the server's scheduler
and executor without the mesh), giving the forward-level figures: each length's prefill (a one-token
generation, warm), the continuation's (after an untimed one of another 77 tokens), the C-prompt burst's prefill,
a decode step at batch C (the mean of 32 steps once all C decode), and the two batches a burst takes when its first
prompt goes alone (``first_then_rest_s``: that prompt's forward, then the batch of its first decode and the other
prompts the prefill budget takes). Ratios: cold first text over (prefill +
one batch-1 step), the continuation's over its forward, a burst's median first text over its prefill, burst decode
tok/s over C / step(C), burst wall time over (burst prefill + ``--burst-tokens`` steps at batch C).
Writes ``DIR/bench_serving.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

import aiohttp
import torch

from tidal import LLM
from tidal.bench.client import stream_events
from tidal.bench.server import Server, llm_kwargs, serve_args, split_serve_flags
from tidal.bench.stats import gaps, percentile
from tidal.bench.timing import host_seconds
from tidal.executor.presets import write_checkpoint
from tidal.messages import GenerateReq, SamplingParams

CONTINUATION = 77  # new tokens after a cached long prompt
DECODE_STEPS = 32  # decode steps timed at the forward level


class Prompts:
    """New random ordinary token ids for every prompt: nothing shares a prefix unless built to."""

    def __init__(self, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, n: int) -> list[int]:
        return torch.randint(1000, 150000, (n,), generator=self.gen).tolist()


async def burst(url: str, prompts: list[list[int]], tokens: int) -> dict:
    """Every prompt sent at once; per request its text-event times, relative to the burst's start."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        events: list[list[float]] = [[] for _ in prompts]
        infos: list[dict] = [{} for _ in prompts]
        t0 = time.monotonic()
        await asyncio.gather(*(stream_events(http, url, p, tokens, e, i)
                               for p, e, i in zip(prompts, events, infos, strict=True)))
        wall = time.monotonic() - t0
    return {"events": [[t - t0 for t in e] for e in events], "infos": infos, "wall_s": wall}


def first_text(url: str, prompt: list[int], tokens: int = 8) -> tuple[float, dict]:
    out = asyncio.run(burst(url, [prompt], tokens))
    return out["events"][0][0], out["infos"][0]


def burst_stats(out: dict, tokens: int) -> dict:
    events = out["events"]
    firsts = [e[0] for e in events]
    ends = [e[-1] for e in events]
    pooled = [g for e in events for g in gaps(e, 0.0, float("inf"))]
    lo, hi = max(firsts), min(ends)
    decoding = sum(1 for e in events for t in e if lo < t <= hi)
    produced = sum(i["usage"]["completion_tokens"] for i in out["infos"])
    return {"first_text_p50_s": statistics.median(firsts), "first_text_max_s": max(firsts),
            "itl_p50_s": percentile(pooled, 50), "itl_p99_s": percentile(pooled, 99), "wall_s": out["wall_s"],
            "output_tok_per_s": produced / out["wall_s"], "all_tokens": produced == tokens * len(events),
            "decode_events_per_s": decoding / (hi - lo) if hi > lo else None}


def serving(path: str, ns, flags: list[str], prompts: Prompts) -> dict:
    t0 = time.monotonic()
    srv = Server(path, *flags, served_model_name="bench", device=ns.device, ready_timeout=1800)
    out: dict = {"start_to_ready_s": time.monotonic() - t0}
    try:
        c = max(ns.concurrency)
        bursts = [burst_stats(asyncio.run(burst(srv.url, [prompts(ns.burst_prompt) for _ in range(c)],
                                                ns.burst_tokens)), ns.burst_tokens) for _ in range(2)]
        out["first_burst_after_ready"] = {"concurrency": c, "first_s": bursts[0]["first_text_p50_s"],
                                          "second_s": bursts[1]["first_text_p50_s"],
                                          "first_over_second": bursts[0]["first_text_p50_s"]
                                          / bursts[1]["first_text_p50_s"]}
        print(f"first burst of {c} after ready: first text p50 {bursts[0]['first_text_p50_s']:.3f} s, the next "
              f"{bursts[1]['first_text_p50_s']:.3f} s", flush=True)
        first, _ = first_text(srv.url, prompts(ns.burst_prompt))
        first_text(srv.url, prompts(ns.burst_prompt))
        warm, _ = first_text(srv.url, prompts(ns.burst_prompt))
        out["first_after_ready"] = {"first_s": first, "warm_s": warm, "first_over_warm": first / warm}
        print(f"ready after {out['start_to_ready_s']:.1f} s; first request {first:.3f} s, warm {warm:.3f} s",
              flush=True)
        out["cold"] = {}
        for n in ns.lengths:
            first_text(srv.url, prompts(n))
            longest = prompts(n)
            out["cold"][n] = first_text(srv.url, longest)[0]
            print(f"cold {n} tokens: first text {out['cold'][n]:.3f} s", flush=True)
        cont, info = first_text(srv.url, longest + prompts(CONTINUATION))
        out["continuation"] = {"first_s": cont, "cached_tokens": info["usage"]["prompt_tokens_details"]
                               ["cached_tokens"] if info.get("usage", {}).get("prompt_tokens_details") else None}
        print(f"continuation of {CONTINUATION} tokens after {len(longest)}: first text {cont:.3f} s "
              f"({out['continuation']['cached_tokens']} cached)", flush=True)
        out["bursts"] = {}
        for c in ns.concurrency:
            asyncio.run(burst(srv.url, [prompts(ns.burst_prompt) for _ in range(c)], ns.burst_tokens))
            stats = burst_stats(asyncio.run(burst(srv.url, [prompts(ns.burst_prompt) for _ in range(c)],
                                                  ns.burst_tokens)), ns.burst_tokens)
            out["bursts"][c] = stats
            print(f"burst of {c}: first text p50 {stats['first_text_p50_s']:.3f} s, ITL p50/p99 "
                  f"{stats['itl_p50_s'] * 1e3:.1f}/{stats['itl_p99_s'] * 1e3:.1f} ms, {stats['output_tok_per_s']:.1f} "
                  f"output tok/s, wall {stats['wall_s']:.2f} s", flush=True)
    finally:
        out["left_after_stop"] = srv.stop()
    return out


def timed(device: str, fn) -> float:
    return host_seconds(fn, torch.device(device))


def decode_step(llm: LLM, prompts: Prompts, batch: int, prompt_tokens: int, device: str) -> float:
    """Mean seconds of a decode step with ``batch`` requests decoding, the server's scheduler and executor
    stepped in this process."""
    sched = llm.scheduler
    for i in range(batch):
        sched.add_request(GenerateReq(rid=f"step-{batch}-{i}", prompt_ids=prompts(prompt_tokens),
                                      max_tokens=DECODE_STEPS * 4, sampling=SamplingParams(), ignore_eos=True))
    while not all(r.prefill_done and r.output for r in sched.running.values()) or len(sched.running) < batch:
        step(llm)
    for _ in range(4):
        step(llm)
    seconds = timed(device, lambda: [step(llm) for _ in range(DECODE_STEPS)]) / DECODE_STEPS
    end_all(llm)
    return seconds


def step(llm: LLM) -> None:
    """One batch of the server's scheduler, run by its executor, in this process."""
    sched = llm.scheduler
    b = sched.schedule()
    out = llm.runner.execute(b)
    sched.process_result(b, out.token_ids, out.logprobs, out.prompt_logprobs)


def end_all(llm: LLM) -> None:
    """Abort every request the scheduler holds and drop its events."""
    for rid in list(llm.scheduler.requests):
        llm.scheduler.abort(rid)
    llm._events.clear()


def first_then_rest(llm: LLM, prompts: Prompts, c: int, prompt_tokens: int, device: str) -> tuple[float, float]:
    """Seconds of the two batches a burst of ``c`` prompts most often takes when its prompts arrive one by one: the
    first prompt's forward alone, then the next batch (its first decode with the other prompts, as far as the
    prefill budget takes them), the server's scheduler and executor stepped in this process."""
    def add(i: int) -> None:
        llm.scheduler.add_request(GenerateReq(rid=f"split-{c}-{i}", prompt_ids=prompts(prompt_tokens), max_tokens=4,
                                              sampling=SamplingParams(), ignore_eos=True))

    add(0)
    alone = timed(device, lambda: step(llm))
    for i in range(1, c):
        add(i)
    rest = timed(device, lambda: step(llm))
    end_all(llm)
    return alone, rest


def forward_level(path: str, ns, llm_args: dict, prompts: Prompts) -> dict:
    llm = LLM(path, device=ns.device, dtype="auto", load_format="random", **llm_args)

    def prefill(*ps: list[int]) -> float:
        return timed(ns.device, lambda: llm.generate(list(ps), max_tokens=1, ignore_eos=True))

    out: dict = {"prefill_s": {}}
    for n in ns.lengths:
        prefill(prompts(n))
        longest = prompts(n)
        out["prefill_s"][n] = prefill(longest)
    prefill(longest + prompts(CONTINUATION))  # untimed: the continuation's shape compiled (and captured)
    out["continuation_s"] = prefill(longest + prompts(CONTINUATION))
    out["burst_prefill_s"], out["step_s"], out["first_then_rest_s"] = {}, {}, {}
    for c in sorted(set(ns.concurrency) | {1}):
        prefill(*[prompts(ns.burst_prompt) for _ in range(c)])
        out["burst_prefill_s"][c] = prefill(*[prompts(ns.burst_prompt) for _ in range(c)])
        out["step_s"][c] = decode_step(llm, prompts, c, ns.burst_prompt, ns.device)
        if c > 1:
            first_then_rest(llm, prompts, c, ns.burst_prompt, ns.device)  # untimed: the mixed shapes compiled
            out["first_then_rest_s"][c] = first_then_rest(llm, prompts, c, ns.burst_prompt, ns.device)
    return out


def main() -> None:
    argv, extra = split_serve_flags(sys.argv[1:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--lengths", default="1024,8192,32768", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--concurrency", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--burst-prompt", type=int, default=1024)
    ap.add_argument("--burst-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ns = ap.parse_args(argv)
    os.makedirs(ns.out, exist_ok=True)
    path = write_checkpoint(ns.preset, tempfile.mkdtemp(), weights=False)
    context = max(max(ns.lengths) + CONTINUATION, ns.burst_prompt) + ns.burst_tokens + 64
    kv = max(context, max(ns.concurrency) * (ns.burst_prompt + ns.burst_tokens)) + 1024
    flags = ["--load-format", "random", "--max-model-len", str(context), "--kv-pool-tokens", str(kv),
             "--max-running-requests", str(max(max(ns.concurrency), 2)), *extra]
    served = serving(path, ns, flags, Prompts(1))
    # The forward-level runs take the server's flags that shape the forward.
    args = serve_args(path, flags)
    llm_args = llm_kwargs(args)
    llm_args["max_prefill_length"] = args.max_prefill_length
    forward = forward_level(path, ns, llm_args, Prompts(2))
    step1 = forward["step_s"][1]
    ratios = {"cold_over_forward": {n: served["cold"][n] / (forward["prefill_s"][n] + step1) for n in ns.lengths},
              "continuation_over_forward": served["continuation"]["first_s"] / forward["continuation_s"],
              "first_over_warm": served["first_after_ready"]["first_over_warm"],
              "first_burst_over_second": served["first_burst_after_ready"]["first_over_second"], "bursts": {}}
    for c in ns.concurrency:
        b, step_c = served["bursts"][c], forward["step_s"][c]
        floor = forward["burst_prefill_s"][c] + ns.burst_tokens * step_c
        ratios["bursts"][c] = {"decode_over_forward": (b["decode_events_per_s"] or 0) / (c / step_c),
                               "wall_over_forward": b["wall_s"] / floor,
                               "first_text_p50_s": b["first_text_p50_s"],
                               "first_over_prefill": b["first_text_p50_s"] / forward["burst_prefill_s"][c]}
    result = {"preset": ns.preset, "device": ns.device, "flags": flags, "serving": served, "forward": forward,
              "ratios": ratios}
    with open(os.path.join(ns.out, "bench_serving.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nstart to ready {served['start_to_ready_s']:.1f} s; first burst / second "
          f"{ratios['first_burst_over_second']:.2f}; first request / warm {ratios['first_over_warm']:.2f}")
    print("length   cold first text s   prefill s   ratio")
    for n in ns.lengths:
        print(f"{n:<8d} {served['cold'][n]:17.3f}   {forward['prefill_s'][n]:9.3f}   "
              f"{ratios['cold_over_forward'][n]:.2f}")
    print(f"continuation: {served['continuation']['first_s']:.3f} s against {forward['continuation_s']:.3f} s "
          f"({ratios['continuation_over_forward']:.2f})")
    print("C     first text p50 s   burst prefill s   ratio   first alone + rest s   decode / forward   "
          "wall / (prefill + steps)   step ms")
    for c in ns.concurrency:
        r = ratios["bursts"][c]
        split = forward["first_then_rest_s"].get(c)
        split_text = f"{split[0]:.3f} + {split[1]:.3f}" if split else "-"
        print(f"{c:<5d} {r['first_text_p50_s']:16.3f}   {forward['burst_prefill_s'][c]:15.3f}   "
              f"{r['first_over_prefill']:5.2f}   {split_text:>20s}   {r['decode_over_forward']:16.2f}   "
              f"{r['wall_over_forward']:24.2f}   {forward['step_s'][c] * 1e3:7.2f}")


if __name__ == "__main__":
    main()
