"""``tidal bench``: benchmark any OpenAI-compatible completions endpoint.

Two phases, after ``--warmups`` unscored cold/continuation pairs:

* pairs, one request at a time: per ``--prompt-tokens`` length, ``--pairs`` times a cold prompt (nothing
  cached) followed by its continuation (the cold prompt plus ``--extra-tokens``), which should find the
  cold prompt in the prefix cache;
* open loop: ``--requests`` cold prompts arriving as a seeded Poisson process of ``--request-rate``
  req/s, at most ``--concurrency`` in flight.

Prompts are lists of token ids (no tokenizer on this side), each starting with an id no other prompt
starts with, so no prompt shares a prefix with another. Every request streams greedy, ``ignore_eos``
completions of ``--max-tokens`` with ``stream_options.include_usage`` and is checked (``bench.client``).
With ``--tap-addr`` the cached tokens and generated token ids come from the server's tap; without it the
cached tokens come from ``usage.prompt_tokens_details.cached_tokens``. Writes ``bench.json`` and
``bench.png`` to ``--out``; exits 1 when a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import sys
import time
from typing import Any

from .client import EndpointError, check, list_models, request_body, stream_completion
from .report import failures, print_summary, summarize_open_loop, summarize_pairs
from .tap import TapReader, tap_rid

# How long to wait for a request's final Detokenize on the tap once its HTTP stream has ended.
TAP_WAIT_S = 5.0


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {low} or more, got {value}")
        return value
    return parse


def _lengths(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every length must be 1 or more, got {text!r}")
    return values


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of requests per second or inf, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text!r}")
    return value


def _id_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI, got {text!r}") from None
    if not 0 <= lo < hi:
        raise argparse.ArgumentTypeError(f"expected 0 <= LO < HI, got {text!r}")
    return lo, hi


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True,
                   help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)")
    p.add_argument("--out", required=True, help="directory for bench.json and bench.png (created if missing)")
    p.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None,
                   help="bearer key (default: $OPENAI_API_KEY; no key when that is unset)")
    p.add_argument("--prompt-tokens", type=_lengths, default=[512],
                   help="cold prompt length in tokens; a comma-separated list runs the pairs at each length, "
                        "the warm-ups and the open loop use the first (default: 512)")
    p.add_argument("--extra-tokens", type=_int_at_least(1), default=64,
                   help="tokens a continuation adds to its cold prompt (default: %(default)s)")
    p.add_argument("--max-tokens", type=_int_at_least(1), default=128,
                   help="tokens generated per request (default: %(default)s)")
    p.add_argument("--warmups", type=_int_at_least(0), default=2,
                   help="unscored cold/continuation pairs sent first (default: %(default)s)")
    p.add_argument("--pairs", type=_int_at_least(0), default=3,
                   help="scored cold/continuation pairs per prompt length, one request at a time "
                        "(default: %(default)s)")
    p.add_argument("--requests", type=_int_at_least(0), default=32,
                   help="open-loop requests; 0 skips the open loop (default: %(default)s)")
    p.add_argument("--request-rate", type=_rate, default=4.0,
                   help="open-loop Poisson arrival rate in requests/s, inf for all at once (default: %(default)s)")
    p.add_argument("--concurrency", type=_int_at_least(1), default=8,
                   help="open-loop requests in flight at most (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the prompt ids and the arrival times (default: %(default)s)")
    p.add_argument("--token-ids", type=_id_range, default=(1000, 30000), metavar="LO:HI",
                   help="prompt token ids are drawn from [LO, HI); keep it inside the model's vocabulary "
                        "(default: 1000:30000)")
    p.add_argument("--tap-addr", default=None,
                   help="the server's tap (tidal serve --tap-addr), read for cached tokens and token ids per "
                        "request (default: none; cached tokens then come from usage)")
    p.add_argument("--logprobs", action="store_true",
                   help="ask for each token's log-probability so that received tokens are counted from the "
                        "stream without the tap (default: off)")
    p.add_argument("--timeout", type=_rate, default=600.0,
                   help="seconds one request may take (default: %(default)s)")


class PromptIds:
    """Seeded random token-id prompts, each starting with an id drawn once (no two prompts share a prefix)."""

    def __init__(self, seed: int, lo: int, hi: int, count: int):
        if hi - lo < count:
            raise ValueError(f"--token-ids {lo}:{hi} holds {hi - lo} ids; this run needs {count} distinct "
                             "first ids, one per cold prompt")
        self.rng, self.lo, self.hi = random.Random(seed), lo, hi
        self.firsts = self.rng.sample(range(lo, hi), count)

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.lo, self.hi) for _ in range(n)]

    def cold(self, length: int) -> list[int]:
        return [self.firsts.pop()] + self.ids(length - 1)


def _normalize_url(url: str) -> str:
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url {url!r} must start with http:// or https://")
    return url[:-3] if url.endswith("/v1") else url


class Bench:
    """One run: the HTTP session, the tap, the progress bar and every sample so far."""

    def __init__(self, ns: argparse.Namespace, session, base: str, model: str, tap: TapReader | None, bar):
        self.ns, self.session, self.base, self.model, self.tap, self.bar = ns, session, base, model, tap, bar
        self.samples: list[dict[str, Any]] = []
        self.failed = 0

    async def send(self, prompt: list[int]) -> dict[str, Any]:
        return await stream_completion(self.session, self.base,
                                       request_body(self.model, prompt, self.ns.max_tokens, self.ns.logprobs))

    async def record(self, obs: dict[str, Any], prompt: list[int], phase: str, arm: str, cold_len: int,
                     **extra: Any) -> dict[str, Any]:
        """Turn one request's observations into a sample: tap data, derived rates, checks."""
        rec = None
        if self.tap is not None and obs["id"] is not None:
            rec = await asyncio.to_thread(self.tap.wait, tap_rid(obs["id"]), TAP_WAIT_S)
        usage = obs["usage"] if isinstance(obs["usage"], dict) else {}
        details = usage.get("prompt_tokens_details") or {}
        cached_usage = details.get("cached_tokens") if isinstance(details, dict) else None
        completion = usage.get("completion_tokens")
        first, full = obs["first_text_s"], obs["full_s"]
        events = obs["text_event_s"]
        received = len(rec.token_ids) if rec is not None else obs["logprob_tokens"]
        sample = {
            "phase": phase, "arm": arm, "cold_prompt_tokens": cold_len, "prompt_tokens": len(prompt), **extra,
            "id": obs["id"], "status": obs["status"], "error": obs["error"],
            "first_text_s": first, "full_s": full,
            "output_tok_per_s": completion / full if isinstance(completion, int) and full else None,
            "decode_tok_per_s": ((completion - 1) / (full - first)
                                 if isinstance(completion, int) and completion > 1 and first is not None
                                 and full > first else None),
            "tpot_s": ((full - first) / (completion - 1)
                       if isinstance(completion, int) and completion > 1 and first is not None else None),
            "itl_s": [b - a for a, b in zip(events, events[1:], strict=False)],
            "text_events": len(events), "text_chars": obs["text_chars"],
            "finish_reason": obs["finish_reason"], "done": obs["done"], "usage": obs["usage"],
            "completion_tokens": completion,
            "cached_tokens_usage": cached_usage,
            "cached_tokens_tap": rec.cached_tokens if rec is not None else None,
            "cached_tokens": rec.cached_tokens if rec is not None else cached_usage,
            "token_ids": rec.token_ids if rec is not None else None,
            "tap": None if rec is None else {"prompt_tokens": rec.prompt_tokens, "admissions": rec.admissions,
                                             "plan": rec.plan, "finish_reason": rec.finish_reason},
        }
        checks = check(obs, len(prompt), self.ns.max_tokens, received)
        if self.tap is not None and "response" not in checks:
            if rec is None and self.tap.messages == 0:  # a wrong address, not a failed request
                raise EndpointError(f"--tap-addr {self.ns.tap_addr}: nothing was published there while a request "
                                    f"ran (is it this server's --tap-addr?)")
            checks["tap"] = None if rec is not None else f"no finished Detokenize on the tap for {obs['id']}"
            if rec is not None:
                checks["tap_prompt_tokens"] = None if rec.prompt_tokens == len(prompt) else (
                    f"the tap admitted {rec.prompt_tokens} prompt tokens, {len(prompt)} were sent")
                if cached_usage is not None:
                    checks["cached_tokens_agree"] = None if cached_usage == rec.cached_tokens else (
                        f"usage cached_tokens {cached_usage} != {rec.cached_tokens} on the tap")
        if arm != "continuation" and sample["cached_tokens"] is not None:
            checks["cold_uncached"] = None if sample["cached_tokens"] == 0 else (
                f"a cold prompt (sharing no prefix with any other) admitted {sample['cached_tokens']} cached tokens")
        sample["checks"] = checks
        sample["passed"] = all(v is None for v in checks.values())
        self.failed += not sample["passed"]
        self.samples.append(sample)
        self.bar.update()
        self.bar.set_postfix(failed=self.failed)
        return sample

    async def pairs(self, prompts: PromptIds, phase: str, lengths: list[int], count: int) -> None:
        for n in lengths:
            for i in range(count):
                cold = prompts.cold(n)
                cont = cold + prompts.ids(self.ns.extra_tokens)
                await self.record(await self.send(cold), cold, phase, "cold", n, pair=i)
                await self.record(await self.send(cont), cont, phase, "continuation", n, pair=i)

    async def open_loop(self, prompts: PromptIds) -> None:
        ns = self.ns
        rng = random.Random(ns.seed + 1)
        arrivals, t = [], 0.0
        for _ in range(ns.requests):
            arrivals.append(t)
            t += 0.0 if math.isinf(ns.request_rate) else rng.expovariate(ns.request_rate)
        n = ns.prompt_tokens[0]
        batch = [prompts.cold(n) for _ in arrivals]
        slots = asyncio.Semaphore(ns.concurrency)
        t0 = time.monotonic()

        async def one(i: int, at: float, prompt: list[int]) -> None:
            await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
            async with slots:
                sent = time.monotonic() - t0
                obs = await self.send(prompt)
            await self.record(obs, prompt, "open_loop", "open_loop", n, request=i, arrival_s=at, sent_s=sent,
                              queue_wait_s=sent - at)

        await asyncio.gather(*(one(i, at, p) for i, (at, p) in enumerate(zip(arrivals, batch, strict=True))))


async def _run(ns: argparse.Namespace) -> dict[str, Any]:
    import aiohttp
    from tqdm import tqdm

    base = _normalize_url(ns.base_url)
    key = ns.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    timeout = aiohttp.ClientTimeout(total=ns.timeout)
    lengths = ns.prompt_tokens
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        models = await list_models(session, base, required=ns.model is None)
        if ns.model is None and not models:
            raise EndpointError(f"{base}/v1/models lists no model; name one with --model")
        model = ns.model or models[0]["id"]
        entry = next((m for m in models if m["id"] == model), {})
        limit = entry.get("max_model_len")
        longest = max(lengths) + ns.extra_tokens + ns.max_tokens
        if isinstance(limit, int) and longest > limit:
            raise ValueError(f"the longest request needs {longest} tokens (--prompt-tokens {max(lengths)} + "
                             f"--extra-tokens {ns.extra_tokens} + --max-tokens {ns.max_tokens}); "
                             f"the context of {model} is {limit} tokens")
        prompts = PromptIds(ns.seed, *ns.token_ids, ns.warmups + ns.pairs * len(lengths) + ns.requests)
        total = 2 * ns.warmups + 2 * ns.pairs * len(lengths) + ns.requests
        tap = TapReader(ns.tap_addr) if ns.tap_addr else None
        started = datetime.datetime.now(datetime.UTC)
        t0 = time.monotonic()
        try:
            with tqdm(total=total, file=sys.stderr, unit="req", dynamic_ncols=True) as bar:
                bench = Bench(ns, session, base, model, tap, bar)
                bar.set_description("warm-up")
                await bench.pairs(prompts, "warmup", lengths[:1], ns.warmups)
                bar.set_description("pairs")
                await bench.pairs(prompts, "pairs", lengths, ns.pairs)
                bar.set_description("open loop")
                await bench.open_loop(prompts)
        finally:
            tap_stats = None if tap is None else {"messages": tap.messages, "undecodable": tap.undecodable}
            if tap is not None:
                tap.close()
    samples = bench.samples
    fails = failures(samples)
    params = {k: v for k, v in vars(ns).items() if k not in ("func", "command", "api_key")}
    params["api_key_given"] = bool(key)
    params["token_ids"] = list(ns.token_ids)
    return {
        "tool": "tidal bench",
        "started_at": started.isoformat(timespec="seconds"),
        "duration_s": time.monotonic() - t0,
        "python": platform.python_version(),
        "parameters": params,
        "server": {"base_url": base, "model": model, "models": models},
        "cached_tokens_source": "tap" if tap is not None else "usage",
        "tap": None if tap is None else {"addr": ns.tap_addr, **tap_stats},
        "summary": {"pairs": summarize_pairs(samples, lengths), "open_loop": summarize_open_loop(samples)},
        "checks": {"passed": not fails, "requests": len(samples),
                   "failed_requests": sum(not s["passed"] for s in samples), "failures": fails},
        "samples": samples,
    }


def run_bench(ns: argparse.Namespace) -> int:
    """Run the benchmark; 0 when every check passed, 1 when one failed (bad input raises ``ValueError``)."""
    try:
        os.makedirs(ns.out, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {ns.out}: {e.strerror}") from None
    try:
        result = asyncio.run(_run(ns))
    except KeyboardInterrupt:
        print("tidal bench: interrupted", file=sys.stderr)
        return 130
    json_path, png_path = os.path.join(ns.out, "bench.json"), os.path.join(ns.out, "bench.png")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    from .plot import plot

    plot(result, png_path)
    print_summary(result, sys.stdout)
    print(f"wrote {json_path} and {png_path}")
    return 0 if result["checks"]["passed"] else 1
