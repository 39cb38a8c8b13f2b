"""Hyper-connection row sharding under tensor parallelism, side by side (several GPUs; device-only).

    python benchmarks/bench_hc_shard.py --out DIR --tp 4 [--preset bench] [--lengths 8192,65536,131072]
        [--modes off,control,shard] [--coalesce both|on|off] [--repeats 2] [--decode-context 0,8192]
        [--decode-arms off,shard+coalesce] [--arms off,shard+coalesce] [--interleave] [--agreement]
        [--device cuda|cpu]

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
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from tidal.bench.client import greedy_stream
from tidal.bench.server import Server
from tidal.executor.presets import write_checkpoint


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed * 1_000_003 + n)  # the length in the seed: no prompt is a prefix of another
    return [rng.randrange(1000, 240000) for _ in range(n)]


def arm_flags(mode: str, coalesce: bool, tp: int, longest: int) -> list[str]:
    flags = ["--tp", str(tp), "--hc-prefill-mode", mode, "--load-format", "random",
             "--max-model-len", str(longest + 1024), "--kv-pool-tokens", str(2 * longest + 16384),
             "--max-prefill-length", "8192", "--max-running-requests", "8"]
    return flags + ["--prefill-coalesce" if coalesce else "--no-prefill-coalesce"]


def start_arm(path: str, mode: str, coalesce: bool, ns) -> Server:
    lengths = [int(x) for x in ns.lengths.split(",")]
    srv = Server(path, *arm_flags(mode, coalesce, ns.tp, max(lengths)), served_model_name="bench", device=ns.device,
                 ready_timeout=1200)
    greedy_stream(srv.url, prompt(1024, 1), 4, "bench")  # warm-up
    return srv


def prefill_rate(srv: Server, n: int, seed: int) -> float:
    r = greedy_stream(srv.url, prompt(n, seed), 1, "bench")
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    return n / (r["first_text_s"] or r["full_s"])  # a first token that decodes to no text: the response time


def decode_rates(srv: Server, label: str, ns) -> dict:
    out = {}
    for context in [int(x) for x in ns.decode_context.split(",")]:
        for conc in (1, 8):
            prompts = [prompt(max(context, 16), 500 + i) for i in range(conc)]
            t0 = time.monotonic()
            with ThreadPoolExecutor(conc) as pool:
                results = list(pool.map(lambda p: greedy_stream(srv.url, p, 256, "bench"), prompts))
            # decode rate: generated tokens over the span after the slowest first token
            span = time.monotonic() - t0 - max(r["first_text_s"] or r["full_s"] for r in results)
            out[f"c{conc}_ctx{context}"] = conc * 255 / span
            print(f"{label} decode c{conc} ctx {context}: {out[f'c{conc}_ctx{context}']:.1f} tok/s", flush=True)
    return out


def run_arms(path: str, arms: list[tuple[str, bool]], ns, save) -> list[dict]:
    """Sequential: one server at a time, all of its lengths. ``--interleave``: every arm's server up
    at once and the prefill samples taken in turn (arm 1, arm 2, ..., arm 1, ...), so drift over the
    run (clocks, host load) falls on every arm alike."""
    lengths = [int(x) for x in ns.lengths.split(",")]
    results: list[dict] = []
    groups = [arms] if ns.interleave else [[a] for a in arms]
    for group in groups:
        servers, outs = [], []
        try:
            for mode, coalesce in group:
                servers.append(start_arm(path, mode, coalesce, ns))
                outs.append({"mode": mode, "coalesce": coalesce, "prefill": {}, "decode": {}})
            for n in lengths:
                for srv in servers:
                    greedy_stream(srv.url, prompt(n, 2), 1, "bench")  # first long shape: autotune
                samples: list[list[float]] = [[] for _ in servers]
                for r in range(ns.repeats):
                    for i, srv in enumerate(servers):
                        samples[i].append(prefill_rate(srv, n, 100 + r))
                        print(f"  {outs[i]['mode']} coalesce={outs[i]['coalesce']} {n}: {samples[i][-1]:.0f} tok/s",
                              flush=True)
                for out, rates in zip(outs, samples, strict=True):
                    out["prefill"][n] = {"tok_per_s": statistics.mean(rates), "samples": rates}
                    print(f"{out['mode']:8s} coalesce={out['coalesce']!s:5s} prefill {n}: "
                          f"{statistics.mean(rates):.0f} tok/s", flush=True)
            for out, srv in zip(outs, servers, strict=True):
                label = out["mode"] + ("+coalesce" if out["coalesce"] else "")
                if label in ns.decode_arms.split(","):
                    out["decode"] = decode_rates(srv, f"{label:16s}", ns)
        finally:
            for out, srv in zip(outs, servers, strict=True):
                out["left_after_stop"] = srv.stop()
        results.extend(outs)
        save(results)
    return results


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
    ap.add_argument("--arms", default="",
                    help="explicit arms, e.g. off,shard+coalesce (instead of --modes x --coalesce)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--decode-context", default="0,8192")
    ap.add_argument("--decode-arms", default="off,shard+coalesce")
    ap.add_argument("--interleave", action="store_true", help="all arms' servers at once, samples in turn")
    ap.add_argument("--agreement", action="store_true")
    ap.add_argument("--agreement-length", type=int, default=8192)
    ap.add_argument("--device", default="cuda")
    ns = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.makedirs(ns.out, exist_ok=True)
    path = write_checkpoint(ns.preset, tempfile.mkdtemp(), weights=False)
    coalesce = {"both": [False, True], "on": [True], "off": [False]}[ns.coalesce]
    result = {"tp": ns.tp, "preset": ns.preset, "arms": []}

    def save(arms: list[dict] | None = None) -> None:  # after every arm, so a run cut short keeps its figures
        if arms is not None:
            result["arms"] = arms
        with open(os.path.join(ns.out, "bench_hc_shard.json"), "w") as f:
            json.dump(result, f, indent=1)

    wanted = ([(a.split("+")[0], a.endswith("+coalesce")) for a in ns.arms.split(",")] if ns.arms
              else [(m, c) for m in ns.modes.split(",") for c in coalesce])
    arms = run_arms(path, wanted, ns, save)
    if ns.agreement:
        result["agreement_shard_coalesce_vs_off"] = agreement(path, ns.tp, ns.device, ns.agreement_length,
                                                              "shard", True)
        save()
    base = next((a for a in arms if a["mode"] == "off" and not a["coalesce"]), None)
    print("\narm                    " + "  ".join(f"{n:>10}" for n in arms[0]["prefill"]) + "   vs off")
    for a in arms:
        rates = [a["prefill"][n]["tok_per_s"] for n in a["prefill"]]
        gain = "" if base is None else "  ".join(f"{(r / base['prefill'][n]['tok_per_s'] - 1) * 100:+.1f}%"
                                                 for r, n in zip(rates, a["prefill"], strict=True))
        print(f"{a['mode']:8s} coalesce={a['coalesce']!s:5s}  " + "  ".join(f"{r:10.0f}" for r in rates) + "   " + gain)
    if "agreement_shard_coalesce_vs_off" in result:
        print("agreement:", result["agreement_shard_coalesce_vs_off"])


if __name__ == "__main__":
    main()
