"""The summaries of ``bench.json`` and the table ``tidal bench`` prints, built from the samples."""

from __future__ import annotations

from typing import Any, TextIO

from .stats import summarize

PAIR_ARMS = ("cold", "continuation")


def answered(sample: dict[str, Any]) -> bool:
    """Whether the request got a full streamed answer (its timings count in the summaries)."""
    return "response" not in sample["checks"]


def summarize_pairs(samples: list[dict[str, Any]], lengths: list[int]) -> list[dict[str, Any]]:
    """Per cold prompt length: each arm's first-text, full-response, output tok/s and cached tokens, and
    the ratio of the median cold first-text latency to the median continuation one."""
    out = []
    for n in lengths:
        row: dict[str, Any] = {"cold_prompt_tokens": n}
        for arm in PAIR_ARMS:
            arm_samples = [s for s in samples
                           if s["phase"] == "pairs" and s["arm"] == arm and s["cold_prompt_tokens"] == n]
            ok = [s for s in arm_samples if answered(s)]
            row[arm] = {
                "count": len(arm_samples),
                "prompt_tokens": arm_samples[0]["prompt_tokens"] if arm_samples else None,
                "first_text_s": summarize(s["first_text_s"] for s in ok),
                "full_s": summarize(s["full_s"] for s in ok),
                "output_tok_per_s": summarize(s["output_tok_per_s"] for s in ok),
                "decode_tok_per_s": summarize(s["decode_tok_per_s"] for s in ok),
                "cached_tokens": summarize(s["cached_tokens"] for s in ok),
            }
        cold, cont = row["cold"]["first_text_s"]["p50"], row["continuation"]["first_text_s"]["p50"]
        row["first_text_cold_over_continuation"] = cold / cont if cold is not None and cont else None
        out.append(row)
    return out


def summarize_open_loop(samples: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Latency percentiles and throughput of the open-loop phase, over the wall time from the first
    request sent to the last response ended."""
    loop = [s for s in samples if s["phase"] == "open_loop"]
    if not loop:
        return None
    ok = [s for s in loop if answered(s)]
    start = min(s["sent_s"] for s in loop)
    duration = max(s["sent_s"] + s["full_s"] for s in loop) - start
    completion = sum(s["completion_tokens"] or 0 for s in ok)
    prompt = sum(s["prompt_tokens"] for s in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    return {
        "requests": len(loop),
        "answered": len(ok),
        "duration_s": duration,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(completion),
        "total_token_throughput": per_s(prompt + completion),
        # Requests in flight on average (sum of response times over the wall time).
        "mean_in_flight": per_s(sum(s["full_s"] for s in loop)),
        "ttft_s": summarize(s["first_text_s"] for s in ok),
        "itl_s": summarize(g for s in ok for g in s["itl_s"]),
        "tpot_s": summarize(s["tpot_s"] for s in ok),
        "e2e_s": summarize(s["full_s"] for s in ok),
        "queue_wait_s": summarize(s["queue_wait_s"] for s in loop),
        "output_tok_per_s": summarize(s["output_tok_per_s"] for s in ok),
        "cached_tokens": summarize(s["cached_tokens"] for s in ok),
    }


def failures(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"sample": i, "phase": s["phase"], "arm": s["arm"], "id": s["id"], "check": name, "detail": detail}
            for i, s in enumerate(samples) for name, detail in s["checks"].items() if detail is not None]


def _fmt(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def print_summary(result: dict[str, Any], out: TextIO) -> None:
    p, server = result["parameters"], result["server"]
    w = out.write
    w(f"tidal bench: {server['model']} at {server['base_url']}; cached tokens from {result['cached_tokens_source']}\n")
    w(f"pairs (sequential, {p['pairs']} per length, max_tokens {p['max_tokens']}, "
      f"continuation +{p['extra_tokens']} tokens), medians:\n")
    w(f"  {'arm':<13}{'prompt':>8}{'n':>4}{'first-text s':>14}{'full s':>10}{'out tok/s':>11}"
      f"{'decode tok/s':>14}{'cached':>9}\n")
    for row in result["summary"]["pairs"]:
        for arm in PAIR_ARMS:
            a = row[arm]
            w(f"  {arm:<13}{a['prompt_tokens'] or '-':>8}{a['count']:>4}{_fmt(a['first_text_s']['p50']):>14}"
              f"{_fmt(a['full_s']['p50']):>10}{_fmt(a['output_tok_per_s']['p50'], 2):>11}"
              f"{_fmt(a['decode_tok_per_s']['p50'], 2):>14}{_fmt(a['cached_tokens']['p50'], 0):>9}\n")
        ratio = row["first_text_cold_over_continuation"]
        if ratio is not None:
            w(f"  first text, cold / continuation: {ratio:.2f}x\n")
    loop = result["summary"]["open_loop"]
    if loop is not None:
        w(f"open loop: {loop['requests']} requests, Poisson {p['request_rate']} req/s, concurrency "
          f"{p['concurrency']}, {loop['duration_s']:.2f} s: {_fmt(loop['request_throughput'], 2)} req/s, "
          f"{_fmt(loop['output_throughput'], 1)} output tok/s, {_fmt(loop['mean_in_flight'], 2)} in flight\n")
        w(f"  {'':<18}{'p50':>9}{'p90':>9}{'p99':>9}{'mean':>9}\n")
        for key, label in (("ttft_s", "TTFT s"), ("itl_s", "inter-token s"), ("tpot_s", "per output token s"),
                           ("e2e_s", "end-to-end s"), ("queue_wait_s", "client queue s")):
            s = loop[key]
            w(f"  {label:<18}" + "".join(f"{_fmt(s[k], 4):>9}" for k in ("p50", "p90", "p99", "mean")) + "\n")
    checks = result["checks"]
    if checks["passed"]:
        w(f"checks: all {checks['requests']} requests passed\n")
    else:
        w(f"checks: {checks['failed_requests']} of {checks['requests']} requests FAILED\n")
        failed = [(i, s) for i, s in enumerate(result["samples"]) if not s["passed"]]
        for i, s in failed[:10]:
            what = "; ".join(f"{k}: {v}" for k, v in s["checks"].items() if v is not None)
            name = f"{s['phase']}/{s['arm']}" + (f" {s['id']}" if s["id"] else "")
            w(f"  #{i} {name}: {what}\n")
        if len(failed) > 10:
            w(f"  ... {len(failed) - 10} more in bench.json\n")
