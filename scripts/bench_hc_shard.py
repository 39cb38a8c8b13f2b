"""Hyper-connection row sharding under tensor parallelism, side by side (several GPUs; device-only).

    python scripts/bench_hc_shard.py --out DIR --tp 4 [--preset bench] [--lengths 8192,65536,131072]
        [--modes off,control,shard] [--coalesce both|on|off] [--repeats 2] [--decode-context 0,8192]
        [--decode-arms off,shard+coalesce] [--agreement] [--device cuda|cpu]

For each arm (``--hc-prefill-mode`` x ``--prefill-coalesce``) a fresh ``tidal serve --tp N
--load-format random``; per prompt length, ``--repeats`` cold prompts (distinct random ids, so
nothing is cached) timed to their first token (``max_tokens`` 1, streamed): prefill tok/s =
prompt tokens / that time. Decode (only the ``--decode-arms``): concurrency 1 and 8, 256 tokens each
after a short or ``--decode-context`` prompt, tok/s over all streams. Teacher-forced agreement (``--agreement``):
the offline model scores one 8K prompt on every rank (NCCL; gloo with ``--device cpu``) with the arm's flags and with
``off``; top-1 agreement where the ``off`` top-2 margin is >= 0.2 nats, mean |NLL difference|.
Writes ``DIR/bench_hc_shard.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_harness import Server, stream_completion  # noqa: E402

from tidal.executor.presets import write_checkpoint  # noqa: E402


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 240000) for _ in range(n)]


def arm_flags(mode: str, coalesce: bool, tp: int, longest: int) -> list[str]:
    flags = ["--tp", str(tp), "--hc-prefill-mode", mode, "--load-format", "random", "--served-model-name", "bench",
             "--max-model-len", str(longest + 1024), "--kv-pool-tokens", str(2 * longest + 16384),
             "--max-prefill-length", "8192", "--max-running-requests", "8"]
    return flags + (["--prefill-coalesce"] if coalesce else [])


def run_arm(path: str, mode: str, coalesce: bool, ns) -> dict:
    lengths = [int(x) for x in ns.lengths.split(",")]
    srv = Server(path, *arm_flags(mode, coalesce, ns.tp, max(lengths)), api_key=None, device=ns.device,
                 ready_timeout=1200)
    out = {"mode": mode, "coalesce": coalesce, "prefill": {}, "decode": {}}
    try:
        stream_completion(srv.url, prompt(1024, 1), 4, model="bench")  # warm-up
        for n in lengths:
            stream_completion(srv.url, prompt(n, 2), 1, model="bench")  # first long shape: compile, autotune
            rates = []
            for r in range(ns.repeats):
                first, full, usage, _ = stream_completion(srv.url, prompt(n, 100 + r), 1, model="bench")
                assert usage["prompt_tokens_details"]["cached_tokens"] == 0
                rates.append(n / (first or full))  # a first token that decodes to no text: the response time
            out["prefill"][n] = {"tok_per_s": statistics.mean(rates), "samples": rates}
            print(f"{mode:8s} coalesce={coalesce!s:5s} prefill {n}: {statistics.mean(rates):.0f} tok/s", flush=True)
        decode_arm = mode + ("+coalesce" if coalesce else "") in ns.decode_arms.split(",")
        for context in [int(x) for x in ns.decode_context.split(",")] if decode_arm else []:
            for conc in (1, 8):
                prompts = [prompt(max(context, 16), 500 + i) for i in range(conc)]
                t0 = time.monotonic()
                with ThreadPoolExecutor(conc) as pool:
                    results = list(pool.map(lambda p: stream_completion(srv.url, p, 256, model="bench"), prompts))
                # decode rate: generated tokens over the span after the slowest first token
                span = time.monotonic() - t0 - max(r[0] for r in results)
                rate = conc * 255 / span
                out["decode"][f"c{conc}_ctx{context}"] = rate
                print(f"{mode:8s} coalesce={coalesce!s:5s} decode c{conc} ctx {context}: {rate:.1f} tok/s", flush=True)
    finally:
        out["left_after_stop"] = srv.stop()
    return out


def _score_rank(rank: int, size: int, port: int, path: str, device: str, flags: dict, tokens: list[int],
                queue) -> None:
    import torch

    from tidal import LLM
    from tidal.executor.distributed import init_tp

    if device == "cuda":
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    init_tp(rank, size, f"tcp://127.0.0.1:{port}", "nccl" if device.startswith("cuda") else "gloo")
    llm = LLM(path, device=device, dtype="bfloat16" if device.startswith("cuda") else "float32",
              load_format="random", tp=size, max_prefill_length=len(tokens), **flags)
    logits = llm.score(tokens)
    if rank == 0:
        queue.put(logits.log_softmax(-1).numpy())


def score(path: str, tp: int, device: str, flags: dict, tokens: list[int]):
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_score_rank, args=(r, tp, port, path, device, flags, tokens, queue)) for r in range(tp)]
    for p in procs:
        p.start()
    out = torch.from_numpy(queue.get(timeout=1200))
    for p in procs:
        p.join()
    return out


def agreement(path: str, tp: int, device: str, length: int, mode: str, coalesce: bool) -> dict:
    import torch

    tokens = prompt(length, 7)
    ref = score(path, tp, device, {"hc_prefill_mode": "off"}, tokens)
    got = score(path, tp, device, {"hc_prefill_mode": mode, "prefill_coalesce": coalesce}, tokens)
    target = torch.tensor(tokens[1:])
    nll_ref = -ref[:-1].gather(1, target[:, None])[:, 0]
    nll_got = -got[:-1].gather(1, target[:, None])[:, 0]
    top2 = ref.topk(2, dim=-1).values
    strong = (top2[:, 0] - top2[:, 1]) >= 0.2
    agree = (ref.argmax(-1) == got.argmax(-1))[strong].float().mean().item()
    return {"top1_agreement": agree, "strong_positions": int(strong.sum()),
            "mean_abs_nll_diff": (nll_got - nll_ref).abs().mean().item()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--lengths", default="8192,65536,131072")
    ap.add_argument("--modes", default="off,control,shard")
    ap.add_argument("--coalesce", default="both", choices=["both", "on", "off"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--decode-context", default="0,8192")
    ap.add_argument("--decode-arms", default="off,shard+coalesce")
    ap.add_argument("--agreement", action="store_true")
    ap.add_argument("--agreement-length", type=int, default=8192)
    ap.add_argument("--device", default="cuda")
    ns = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.makedirs(ns.out, exist_ok=True)
    path = write_checkpoint(ns.preset, tempfile.mkdtemp(), weights=False)
    coalesce = {"both": [False, True], "on": [True], "off": [False]}[ns.coalesce]
    arms: list[dict] = []
    result = {"tp": ns.tp, "preset": ns.preset, "arms": arms}

    def save() -> None:  # after every arm, so a run cut short keeps what it measured
        with open(os.path.join(ns.out, "bench_hc_shard.json"), "w") as f:
            json.dump(result, f, indent=1)

    for m in ns.modes.split(","):
        for c in coalesce:
            arms.append(run_arm(path, m, c, ns))
            save()
    if ns.agreement:
        result["agreement_shard_coalesce_vs_off"] = agreement(path, ns.tp, ns.device, ns.agreement_length,
                                                              "shard", True)
        save()
    base = next((a for a in arms if a["mode"] == "off" and not a["coalesce"]), None)
    print("\narm                    " + "  ".join(f"{n:>10}" for n in arms[0]["prefill"]) + "   vs off")
    for a in arms:
        rates = [a["prefill"][n]["tok_per_s"] for n in a["prefill"]]
        gain = "" if base is None else "  ".join(
            f"{(r / base['prefill'][n]['tok_per_s'] - 1) * 100:+.1f}%" for r, n in zip(rates, a["prefill"]))
        print(f"{a['mode']:8s} coalesce={a['coalesce']!s:5s}  " + "  ".join(f"{r:10.0f}" for r in rates) + "   " + gain)
    if "agreement_shard_coalesce_vs_off" in result:
        print("agreement:", result["agreement_shard_coalesce_vs_off"])


if __name__ == "__main__":
    main()
