"""Hyper-connection row sharding at the forward level, without the serving path (several GPUs).

    python benchmarks/bench_hc_forward.py --out DIR --tp 2 [--preset bench] [--lengths 8192,65536]
        [--chunk 8192] [--repeats 5] [--profile-rows 30] [--device cuda|cpu]

One process per rank (NCCL), one model per rank (``--load-format random``). Each cold prompt runs
as the scheduler would run it, in forwards of ``--chunk`` tokens; the same prompt alternately with
``Batch.hc_shard`` off and on (same weights, same process), ``--repeats`` times, each timed from
the first forward to the sampled token with the device synchronised. Then rank 0 profiles one
``--chunk`` forward each way and prints the kernels by CUDA time, with the share of the
hyper-connection kernels and of the collectives. Writes ``DIR/bench_hc_forward.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import tempfile
import time


def _rank(rank: int, size: int, port: int, path: str, ns, queue) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tidal import LLM
    from tidal.executor.distributed import init_tp
    from tidal.messages import Batch, SegmentSpec

    cuda = ns.device == "cuda"
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    init_tp(rank, size, f"tcp://127.0.0.1:{port}", "nccl" if cuda else "gloo")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    lengths = [int(x) for x in ns.lengths.split(",")]
    longest = max(lengths)
    llm = LLM(path, device=device, dtype="bfloat16" if cuda else "float32", load_format="random", tp=size,
              hc_prefill_mode="shard",
              max_prefill_length=ns.chunk, max_model_len=longest + 1024, kv_pool_tokens=longest + 2 * ns.chunk,
              max_running_requests=1)
    page = llm.sizes.page_size
    batch_ids = iter(range(1 << 30))

    def prefill(ids: list[int], shard: bool, chunk: int) -> float:
        sync()
        t0 = time.perf_counter()
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            first, last = start // page, math.ceil((start + len(part)) / page)
            seg = SegmentSpec(rid="p", slot=0, start=start, token_ids=part, pages=list(range(first, last)),
                              page_base=first, sample=start + len(part) == len(ids))
            llm.runner.execute(Batch(batch_id=next(batch_ids), segments=[seg], hc_shard=shard))
        sync()
        return time.perf_counter() - t0

    gen = torch.Generator().manual_seed(0)
    out: dict = {"tp": size, "chunk": ns.chunk, "lengths": {}}
    for n in lengths:
        ids = torch.randint(1000, 240000, (n,), generator=gen).tolist()
        prefill(ids, False, ns.chunk), prefill(ids, True, ns.chunk)  # warm-up, autotuning
        times: dict[str, list[float]] = {"off": [], "shard": []}
        for _ in range(ns.repeats):
            for arm in ("off", "shard"):
                times[arm].append(prefill(ids, arm == "shard", ns.chunk))
        row = {arm: {"median_s": statistics.median(t), "tok_per_s": n / statistics.median(t), "samples_s": t}
               for arm, t in times.items()}
        row["shard_vs_off"] = row["shard"]["tok_per_s"] / row["off"]["tok_per_s"] - 1
        out["lengths"][n] = row
        if rank == 0:
            print(f"{n:7d} tokens: off {row['off']['tok_per_s']:9.0f} tok/s   shard {row['shard']['tok_per_s']:9.0f}"
                  f" tok/s   {row['shard_vs_off'] * 100:+.1f}%", flush=True)
    ids = torch.randint(1000, 240000, (ns.chunk,), generator=gen).tolist()
    for arm in ("off", "shard"):
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            prefill(ids, arm == "shard", ns.chunk)
        events = prof.key_averages()
        def spent(e):
            return e.device_time_total if cuda else e.self_cpu_time_total

        total = sum(spent(e) for e in events)
        groups = {"hyper-connection": ("hc_", "_hc", "hyper"), "collectives": ("nccl", "allgather", "reducescatter",
                                                                                "allreduce")}
        shares = {g: sum(spent(e) for e in events if any(k in e.key.lower() for k in keys)) / total
                  for g, keys in groups.items()}
        out.setdefault("profile", {})[arm] = {"kernel_ms": total / 1e3, "shares": shares}
        if rank == 0:
            print(f"\n== {arm}: one {ns.chunk}-token forward, {total / 1e3:.1f} ms of kernels; "
                  + ", ".join(f"{g} {s * 100:.1f}%" for g, s in shares.items()), flush=True)
            print(events.table(sort_by="cuda_time_total" if cuda else "self_cpu_time_total",
                               row_limit=ns.profile_rows, max_name_column_width=70),
                  flush=True)
    if rank == 0:
        queue.put(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--lengths", default="8192,65536")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile-rows", type=int, default=30)
    ap.add_argument("--device", default="cuda", help="cuda (NCCL, bf16) or cpu (gloo, float32: a check of the script)")
    ns = ap.parse_args()
    import torch.multiprocessing as mp

    from tidal.executor.presets import write_checkpoint

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.makedirs(ns.out, exist_ok=True)
    path = write_checkpoint(ns.preset, tempfile.mkdtemp(), weights=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, ns.tp, port, path, ns, queue)) for r in range(ns.tp)]
    for p in procs:
        p.start()
    result = queue.get(timeout=1200)
    for p in procs:
        p.join()
    with open(os.path.join(ns.out, "bench_hc_forward.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
