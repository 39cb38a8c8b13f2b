"""Conversations decoding while a long cold prompt prefills: stall-free layer-major against one turn and chunked.

    python benchmarks/bench_stall_free.py --out DIR [--preset bench] [--cold 32012] [--chunk 4096]
                                          [--cache-fraction 0.11] [--conversations 1,8,32] [--turns 2,4]
                                          [--arms single_turn,stall_free,chunked] [--device cuda]

A fresh ``tidal serve`` per arm (``--load-format random``, experts offloaded with a cache of ~11% of all
experts, pinned PLE, ``--max-prefill-length`` 4096, ``--prefill-coalesce``): ``stall_free`` is ``--prefill-
layer-major --layer-major-turns TURNS``, one arm ``stall_free:TURNS`` per value of ``--turns``;
``single_turn`` the same with one turn (only while nothing else runs: with conversations decoding the
prompt runs chunked), ``chunked`` no layer-major. Warm-ups (a short request, a long prompt), then a long cold
prompt alone (its first text: the arm's ``alone_first_text_s``); for each N of ``--conversations``: N
conversations (512-token prompts, greedy, ``ignore_eos``) start; once each has streamed 32 text events, a window
of their decoding alone is measured (the baseline), and a long cold prompt of random token ids arrives (greedy,
``--long-tokens`` output tokens, the seed's protocol: first text is the first SSE event with text, timed from
just before the request). During its prefill (from its request to its first text) the conversations'
inter-token latency (gaps between text events, per conversation, pooled) p50 / p99 / max and their decode tok/s
(text events a second, all conversations) are reported beside the baseline's, and the long prompt's first text
beside its first text alone in the same server (``first_text_over_alone``) and in the other arms. The plan mode
the tap reports for the long prompt is kept.

Every arm gets the same prompts (each long one cold in its server), and the tap's token ids of every request
are compared with the first arm's (``ids_equal_to_first_arm``): the long prompts' whole outputs, and each
conversation's ids as far as both arms streamed it (they are cancelled after the long prompt). With
``single_turn`` first, the long prompt alone is the run the others must reproduce. Writes
``DIR/bench_stall_free.json`` after every arm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time

import aiohttp
import torch

from tidal.bench.client import stream_events
from tidal.bench.server import Server
from tidal.bench.stats import gaps, percentile
from tidal.bench.tap import TapReader, tap_rid
from tidal.executor.presets import write_checkpoint

ARM_FLAGS = {
    "stall_free": ["--prefill-layer-major"],
    "single_turn": ["--prefill-layer-major", "--layer-major-turns", "1"],
    "chunked": [],
}
CHAT_PROMPT = 512  # tokens of each conversation's prompt
BASELINE_EVENTS = 32  # text events each conversation streams before the baseline window opens


def window_stats(streams: list[list[float]], lo: float, hi: float) -> dict:
    pooled = [g for events in streams for g in gaps(events, lo, hi)]
    count = sum(1 for events in streams for t in events if lo <= t <= hi)
    return {"itl_p50_s": percentile(pooled, 50), "itl_p99_s": percentile(pooled, 99),
            "itl_max_s": max(pooled, default=float("nan")), "events_per_s": count / (hi - lo) if hi > lo else 0.0,
            "gaps": len(pooled), "window_s": hi - lo}


async def one_round(url: str, n: int, chats: list[list[int]], long_prompt: list[int], ns) -> dict:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        streams: list[list[float]] = [[] for _ in range(n)]
        infos: list[dict] = [{} for _ in range(n)]
        tasks = [asyncio.create_task(stream_events(session, url, chats[i], ns.chat_tokens, streams[i], infos[i]))
                 for i in range(n)]
        while min(len(s) for s in streams) < BASELINE_EVENTS:
            for t in tasks:
                if t.done():
                    if t.exception() is not None:
                        raise t.exception()
                    raise RuntimeError("a conversation ended before the long prompt arrived; raise --chat-tokens")
            await asyncio.sleep(0.01)
        opened = time.monotonic()
        await asyncio.sleep(ns.baseline_s)
        long_events: list[float] = []
        info: dict = {}
        sent = time.monotonic()
        await stream_events(session, url, long_prompt, ns.long_tokens, long_events, info)
        done = time.monotonic()
        first = long_events[0]
        ended = [t.done() for t in tasks]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if any(ended):
        raise RuntimeError("a conversation ended during the long prompt; raise --chat-tokens")
    return {"conversations": n, "long_first_text_s": first - sent, "long_full_s": done - sent,
            "long_rid": tap_rid(info.get("id")), "chat_rids": [tap_rid(i.get("id")) for i in infos],
            "baseline": window_stats(streams, opened, sent), "during_prefill": window_stats(streams, sent, first)}


async def solo(url: str, prompt: list[int], max_tokens: int) -> tuple[float, str | None]:
    """First text of ``prompt`` with nothing else running, and the request's tap name."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        events: list[float] = []
        info: dict = {}
        sent = time.monotonic()
        await stream_events(session, url, prompt, max_tokens, events, info)
    return events[0] - sent, tap_rid(info.get("id"))


def tap_ids(tap: TapReader, rid: str | None, finished: bool = True) -> list[int] | None:
    """The token ids the tap saw for ``rid``: once it finished, or (``finished`` False: a cancelled
    conversation) as far as they came."""
    if rid is None:
        return None
    rec = tap.wait(rid, timeout=600) if finished else tap.records.get(rid)
    return None if rec is None else list(rec.token_ids)


def run_arm(arm: str, path: str, ns, slots: int, prompts) -> dict:
    kind, _, turns = arm.partition(":")
    n_max = max(ns.conversations)
    context = max(ns.cold + ns.long_tokens, CHAT_PROMPT + ns.chat_tokens) + 64
    kv = n_max * (CHAT_PROMPT + ns.chat_tokens) + ns.cold + ns.long_tokens + 1024  # no preemption
    flags = ["--load-format", "random", "--max-prefill-length", str(ns.chunk), "--ple-backend", "pinned",
             "--moe-strategy", "offload", "--moe-cache-slots", str(slots), "--prefill-coalesce",
             "--max-running-requests", str(n_max + 2), "--max-model-len", str(context), "--kv-pool-tokens", str(kv),
             *ARM_FLAGS[kind]]
    if kind == "stall_free":
        flags += ["--layer-major-turns", turns]
    srv = Server(path, *flags, served_model_name="bench", device=ns.device, ready_timeout=900)
    tap = TapReader(srv.tap_addr)
    out = {"arm": arm, "flags": flags, "rounds": []}
    try:
        asyncio.run(solo(srv.url, prompts["chats"][0], 8))  # warm-ups: the short and the long shapes
        asyncio.run(solo(srv.url, prompts["warm"], 8))
        out["alone_first_text_s"], rid = asyncio.run(solo(srv.url, prompts["alone"], ns.long_tokens))
        out["alone_ids"] = tap_ids(tap, rid)
        print(f"{arm:12s} long prompt alone: first text {out['alone_first_text_s']:.3f} s", flush=True)
        for n in ns.conversations:
            r = asyncio.run(one_round(srv.url, n, prompts["chats"], prompts["rounds"][n], ns))
            rec = tap.wait(r["long_rid"], timeout=600)
            r["long_plan"] = rec.plan if rec is not None else None
            r["long_ids"] = None if rec is None else list(rec.token_ids)
            time.sleep(0.5)  # the cancelled conversations' last tokens reach the tap
            r["chat_ids"] = [tap_ids(tap, rid, finished=False) for rid in r["chat_rids"]]
            out["rounds"].append(r)
            b, d = r["baseline"], r["during_prefill"]
            print(f"{arm:12s} N={n:<3d} long first text {r['long_first_text_s']:.3f} s "
                  f"(mode {(r['long_plan'] or {}).get('mode')}); ITL p50/p99/max alone "
                  f"{b['itl_p50_s'] * 1e3:.1f}/{b['itl_p99_s'] * 1e3:.1f}/{b['itl_max_s'] * 1e3:.1f} ms, during "
                  f"{d['itl_p50_s'] * 1e3:.1f}/{d['itl_p99_s'] * 1e3:.1f}/{d['itl_max_s'] * 1e3:.1f} ms; "
                  f"events/s {b['events_per_s']:.1f} -> {d['events_per_s']:.1f}", flush=True)
    finally:
        tap.close()
        out["left_after_stop"] = srv.stop()
    return out


def same_ids(first: dict, arm: dict) -> dict:
    """Whether ``arm``'s requests gave ``first``'s token ids: the long prompts whole, each conversation on the
    ids both arms saw (a request the tap did not report counts as unequal)."""
    rounds = {r["conversations"]: r for r in first["rounds"]}
    out = {"alone": arm["alone_ids"] is not None and arm["alone_ids"] == first["alone_ids"]}
    for r in arm["rounds"]:
        ref = rounds.get(r["conversations"])
        if ref is None:
            continue
        out[f"long_{r['conversations']}"] = r["long_ids"] is not None and r["long_ids"] == ref["long_ids"]
        out[f"chats_{r['conversations']}"] = all(
            a is not None and b is not None and a[:min(len(a), len(b))] == b[:min(len(a), len(b))]
            for a, b in zip(r["chat_ids"], ref["chat_ids"], strict=True))
    out["all"] = all(out.values())
    return out


def summarize(arms: list[dict]) -> tuple[dict, dict]:
    """Per arm and conversation count: the long prompt's first text against alone, the conversations' ITL."""
    summary = {}
    for arm in arms:
        for r in arm["rounds"]:
            b, d = r["baseline"], r["during_prefill"]
            summary.setdefault(arm["arm"], {})[r["conversations"]] = {
                "long_first_text_s": r["long_first_text_s"], "long_mode": (r["long_plan"] or {}).get("mode"),
                "first_text_over_alone": r["long_first_text_s"] / arm["alone_first_text_s"],
                "itl_p99_during_over_alone": d["itl_p99_s"] / b["itl_p99_s"] if b["itl_p99_s"] else None,
                "itl_p50_s": d["itl_p50_s"], "itl_p99_s": d["itl_p99_s"], "itl_max_s": d["itl_max_s"],
                "itl_p99_alone_s": b["itl_p99_s"],
                "events_per_s_during": d["events_per_s"], "events_per_s_alone": b["events_per_s"]}
    alone = {arm["arm"]: arm["alone_first_text_s"] for arm in arms}
    if "single_turn" in alone:
        for name, rows in summary.items():  # against one turn of layer-major with nothing else running
            for row in rows.values():
                if name.startswith("stall_free"):
                    row["first_text_over_single_turn_alone"] = row["long_first_text_s"] / alone["single_turn"]
    return summary, alone


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--cold", type=int, default=32012)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--cache-fraction", type=float, default=0.11)
    ap.add_argument("--conversations", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--turns", default="2,4", type=lambda s: [int(x) for x in s.split(",")],
                    help="--layer-major-turns of each stall_free arm")
    ap.add_argument("--arms", default="single_turn,stall_free,chunked")
    ap.add_argument("--chat-tokens", type=int, default=4096, help="output tokens a conversation asks for")
    ap.add_argument("--long-tokens", type=int, default=128)
    ap.add_argument("--baseline-s", type=float, default=1.0, help="the conversations' window alone")
    ap.add_argument("--device", default="cuda")
    ns = ap.parse_args()
    os.makedirs(ns.out, exist_ok=True)
    path = write_checkpoint(ns.preset, tempfile.mkdtemp(), weights=False)
    from tidal.config.model import ModelConfig

    config = ModelConfig.from_file(path)
    slots = max(config.num_experts_per_tok, int(config.num_experts * config.num_hidden_layers * ns.cache_fraction))
    gen = torch.Generator().manual_seed(0)

    def draw(n: int) -> list[int]:  # ordinary (non-special) ids
        return torch.randint(1000, 150000, (n,), generator=gen).tolist()

    chats = [draw(CHAT_PROMPT) for _ in range(max(ns.conversations))]
    # Every arm gets the same prompts; each long one is new to its server (no cache hits).
    prompts = {"chats": chats, "warm": draw(ns.cold), "alone": draw(ns.cold),
               "rounds": {n: draw(ns.cold) for n in ns.conversations}}
    names: list[str] = []
    for a in ns.arms.split(","):
        names += [f"stall_free:{turns}" for turns in ns.turns] if a == "stall_free" else [a]
    arms: list[dict] = []
    for name in names:  # the file is rewritten after each arm
        arms.append(run_arm(name, path, ns, slots, prompts))
        summary, alone = summarize(arms)
        result = {"preset": ns.preset, "cold": ns.cold, "chunk": ns.chunk, "turns": ns.turns, "cache_slots": slots,
                  "alone_first_text_s": alone, "summary": summary,
                  "ids_equal_to_first_arm": {arm["arm"]: same_ids(arms[0], arm) for arm in arms[1:]}, "arms": arms}
        with open(os.path.join(ns.out, "bench_stall_free.json"), "w") as f:
            json.dump(result, f, indent=1)
    print("\narm             N    long first text s  / alone  mode         ITL p50 / p99 / max ms   "
          "p99 during/alone  events/s alone -> during")
    for name, rows in summary.items():
        for n, row in rows.items():
            ratio = row["itl_p99_during_over_alone"]
            print(f"{name:15s} {n:<4d} {row['long_first_text_s']:17.3f}  {row['first_text_over_alone']:6.2f}  "
                  f"{str(row['long_mode']):11s}  "
                  f"{row['itl_p50_s'] * 1e3:6.1f} / {row['itl_p99_s'] * 1e3:6.1f} / {row['itl_max_s'] * 1e3:7.1f}  "
                  f"{ratio if ratio is None else f'{ratio:16.2f}'}  {row['events_per_s_alone']:8.1f} -> "
                  f"{row['events_per_s_during']:.1f}")
    print("long prompt alone, first text s: " + ", ".join(f"{k} {v:.3f}" for k, v in alone.items()))
    for name, rows in summary.items():
        for n, row in rows.items():
            if "first_text_over_single_turn_alone" in row:
                print(f"{name} at N={n} / single_turn alone, first text: "
                      f"{row['first_text_over_single_turn_alone']:.3f}")
    for name, same in result["ids_equal_to_first_arm"].items():
        print(f"ids of {name} equal to {arms[0]['arm']}'s: {same}")


if __name__ == "__main__":
    main()
