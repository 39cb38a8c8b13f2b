"""``bench.png``: first-text latency by prompt length per arm, and the open-loop latency distributions."""

from __future__ import annotations

import statistics
from typing import Any

ARM_STYLE = {"cold": ("tab:blue", "o"), "continuation": ("tab:orange", "s")}


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    samples = [s for s in result["samples"] if s["phase"] == "pairs"]
    for arm, (color, marker) in ARM_STYLE.items():
        points = [(s["prompt_tokens"], s["first_text_s"]) for s in samples
                  if s["arm"] == arm and s["first_text_s"] is not None]
        if not points:
            continue
        left.scatter(*zip(*points, strict=True), color=color, marker=marker, alpha=0.5, label=f"{arm} (each)")
        lengths = sorted({x for x, _ in points})
        medians = [statistics.median(y for x, y in points if x == n) for n in lengths]
        left.plot(lengths, medians, color=color, label=f"{arm} (median)")
    left.set_xlabel("prompt tokens")
    left.set_ylabel("first-text latency (s)")
    left.set_title("cold vs continuation, sequential")
    left.set_ylim(bottom=0)
    if left.has_data():
        left.legend()

    loop = [s for s in result["samples"] if s["phase"] == "open_loop"]
    series = {"TTFT": [s["first_text_s"] for s in loop], "end-to-end": [s["full_s"] for s in loop],
              "inter-token": [g for s in loop for g in s["itl_s"]]}
    for name, values in series.items():
        xs = sorted(v for v in values if v is not None and v > 0)
        if xs:
            right.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=f"{name} (n={len(xs)})")
    if right.has_data():
        right.set_xscale("log")
        right.legend()
        params = result["parameters"]
        right.set_title(f"open loop: {params['requests']} requests, {params['request_rate']} req/s, "
                        f"concurrency {params['concurrency']}")
    else:
        right.set_title("no open-loop phase (--requests 0)")
    right.set_xlabel("latency (s)")
    right.set_ylabel("fraction of samples")
    fig.suptitle(f"tidal bench: {result['server']['model']} at {result['server']['base_url']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
