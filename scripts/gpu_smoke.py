"""Serve a checkpoint on the GPU and time a cold long prompt, its continuation and decoding.

    python scripts/gpu_smoke.py --model DIR [--tokens 4000] [serve flags ...]

Prints first-text latency of the cold prompt and of the continuation (prefix-cache hit), cached
tokens, and decode tokens/s of a 128-token greedy generation.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_harness import Server, Tap, stream_completion  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--device", default="cuda")
    ns, flags = ap.parse_known_args()
    rng = random.Random(0)
    cold = [rng.randrange(1000, 240000) for _ in range(ns.tokens)]
    cont = cold + [rng.randrange(1000, 240000) for _ in range(77)]
    t0 = time.monotonic()
    srv = Server(ns.model, "--served-model-name", "tiny", *flags, api_key=None, device=ns.device,
                 ready_timeout=900)
    print(f"server ready in {time.monotonic() - t0:.1f} s", flush=True)
    tap = Tap(srv.tap_addr)
    try:
        stream_completion(srv.url, list(range(1, 513)), 8)  # warm-up
        c_first, c_full, c_usage, c_rid = stream_completion(srv.url, cold, 16)
        w_first, w_full, w_usage, w_rid = stream_completion(srv.url, cont, 16)
        d_first, d_full, _, _ = stream_completion(srv.url, list(range(2000, 2064)), 128)
        decode_tps = (128 - 1) / (d_full - d_first)
        print(f"cold {ns.tokens} tokens: first text {c_first:.3f} s, full {c_full:.3f} s, "
              f"cached {c_usage['prompt_tokens_details']['cached_tokens']}")
        print(f"continuation {ns.tokens + 77}: first text {w_first:.3f} s, full {w_full:.3f} s, "
              f"cached {w_usage['prompt_tokens_details']['cached_tokens']}")
        print(f"decode: 128 tokens after a 64-token prompt, {decode_tps:.1f} tokens/s")
        print("cold plan:", tap.wait_finished(c_rid)[0]["plan"])
        print("continuation plan:", tap.wait_finished(w_rid)[0]["plan"])
    finally:
        tap.close()
        alive = srv.stop()
        print("processes left after SIGTERM:", alive)


if __name__ == "__main__":
    main()
