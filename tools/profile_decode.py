"""Where a decode step's time goes: GPU busy against the host's share, through the real scheduler.

    python tools/profile_decode.py --out DIR [--preset bench] [--batches 1,8,32] [--contexts 16,8192]
        [--steps 24] [--graphs on,off] [--kernel-table N] [--kernel-order] [--layers N]
        [--quantization nvfp4] [--ple-backend pinned]

For each batch size and context, ``batch`` requests of ``context`` random prompt ids are prefilled and
then decoded by ``LLM``'s own loop (scheduler + runner in one process: what the executor does per
step, without the ZeroMQ hops). Over ``--steps`` decode steps under the torch profiler: wall time per
step, GPU busy time per step (the union of the CUDA kernel intervals, so overlapping kernels count
once) and the GPU's idle time between and inside steps (wall - busy). ``--graphs`` lists the arms: decode
steps replayed from CUDA graphs (``on``) and run eagerly (``off``, as ``--disable-cuda-graph``); one model
serves both, the graphs set aside while no request runs. ``--layers`` keeps the preset's first N decoder
layers; ``--quantization`` gives it random routed experts and n-gram table in that layout.
Writes ``DIR/profile_decode.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tidal import LLM
from tidal.executor.presets import keep_first_layers, write_checkpoint
from tidal.messages import Detokenize, GenerateReq, SamplingParams


def busy_us(prof) -> tuple[float, int]:
    """Union length (microseconds) of the device kernel intervals in ``prof``, and the kernel count."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    total, end = 0.0, None
    for s, e in spans:
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total, len(spans)


def kernel_table(prof, steps: int, top: int) -> str:
    """The ``top`` CUDA kernels by device time: calls and microseconds per step."""
    per: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = per.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.time_range.end - e.time_range.start
    rows = sorted(per.items(), key=lambda kv: -kv[1][1])[:top]
    lines = [f"  {'us/step':>9s} {'calls/step':>10s}  kernel"]
    lines += [f"  {us / steps:9.1f} {n / steps:10.1f}  {name[:110]}" for name, (n, us) in rows]
    return "\n".join(lines)


def kernel_order(prof) -> str:
    """The kernels of one step in launch order with their microseconds: those between the last two
    launches of the longest of the kernels launched once a step (the fewest times, at least twice:
    the vocabulary projection; at large batches a MoE kernel is longer, but launched once a layer)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    counts = collections.Counter(s[2] for s in spans)
    fewest = min((n for n in counts.values() if n >= 2), default=0)
    once = [s for s in spans if counts[s[2]] == fewest]
    if not once:
        return "  fewer than two steps profiled"
    longest = max(once, key=lambda s: s[1] - s[0])[2]
    marks = [i for i, s in enumerate(spans) if s[2] == longest]
    if len(marks) < 2:
        return "  fewer than two steps profiled"
    lo, hi = marks[-2] + 1, marks[-1] + 1
    return "\n".join(f"  {i:4d} {end - start:7.1f}  {name[:110]}" for i, (start, end, name) in enumerate(spans[lo:hi]))


def run(llm: LLM, batch: int, context: int, steps: int, seed: int, graphs: bool, top: int = 0,
        order: bool = False) -> dict:
    gen = torch.Generator().manual_seed(seed)
    rids = [f"p{seed}-{i}" for i in range(batch)]
    for rid in rids:
        ids = torch.randint(1000, 30000, (context,), generator=gen).tolist()
        # Early requests decode while later ones prefill: enough tokens that none ends in the window.
        llm.scheduler.add_request(GenerateReq(rid=rid, prompt_ids=ids, max_tokens=steps + 2 * batch + 16,
                                              sampling=SamplingParams(), ignore_eos=True))
    loop = llm._run()
    produced = {rid: 0 for rid in rids}

    def until(count: int) -> None:  # run the loop until every request has ``count`` output tokens
        for event in loop:
            if isinstance(event, Detokenize) and event.rid in produced:
                produced[event.rid] += len(event.token_ids)
                if min(produced.values()) >= count:
                    return

    until(2)  # prefills done, decoding under way
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = min(produced.values())
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        until(start + steps)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    for _ in loop:  # finish the requests
        pass
    busy, kernels = busy_us(prof)
    n = min(produced.values()) - start
    row = {"cuda_graph": graphs, "batch": batch, "context": context, "steps": n, "wall_ms_per_step": wall * 1e3 / n,
           "gpu_busy_ms_per_step": busy / 1e3 / n, "gpu_idle_ms_per_step": (wall * 1e6 - busy) / 1e3 / n,
           "gpu_idle_fraction": 1 - busy / (wall * 1e6), "kernels_per_step": kernels / n,
           "tok_per_s": batch * n / wall}
    print(f"graphs {'on ' if graphs else 'off'} batch {batch:3d} context {context:6d}: "
          f"{row['wall_ms_per_step']:7.2f} ms/step, GPU busy "
          f"{row['gpu_busy_ms_per_step']:6.2f} ms, idle {row['gpu_idle_ms_per_step']:6.2f} ms "
          f"({row['gpu_idle_fraction'] * 100:.0f}%), {row['kernels_per_step']:.0f} kernels/step, "
          f"{row['tok_per_s']:.1f} tok/s", flush=True)
    if top:
        print(kernel_table(prof, n, top), flush=True)
    if order:
        print(kernel_order(prof), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="16,8192")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--graphs", default="on,off", help="arms: on (CUDA graphs), off (eager steps)")
    ap.add_argument("--kernel-table", type=int, default=0, help="print the top N kernels of each row")
    ap.add_argument("--kernel-order", action="store_true", help="print one step's kernels in launch order")
    ap.add_argument("--layers", type=int, default=None, help="the preset's first N decoder layers")
    ap.add_argument("--quantization", default=None, choices=["nvfp4", "fp8"],
                    help="random routed experts and n-gram table in this layout")
    ap.add_argument("--ple-backend", default="gpu", choices=["gpu", "pinned", "disk"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ns = ap.parse_args()
    os.makedirs(ns.out, exist_ok=True)
    batches = [int(x) for x in ns.batches.split(",")]
    contexts = [int(x) for x in ns.contexts.split(",")]
    path = write_checkpoint(ns.preset, tempfile.mkdtemp(), weights=False)
    if ns.layers is not None:
        keep_first_layers(path, ns.layers)
    longest = max(contexts) + ns.steps + 2 * max(batches) + 64  # prompt + max_tokens of every request
    llm = LLM(path, device=ns.device, dtype="bfloat16" if ns.device == "cuda" else "float32", load_format="random",
              max_model_len=longest, kv_pool_tokens=max(batches) * longest + 4096,
              max_running_requests=max(batches), max_prefill_length=8192, quantization=ns.quantization,
              ple_backend=ns.ple_backend)
    graphs = llm.runner.graphs
    rows = []
    for mode in ns.graphs.split(","):
        llm.runner.graphs = graphs if mode == "on" else None
        if mode == "on" and graphs is None:
            print("graphs on: this device runs no CUDA graphs; skipped", flush=True)
            continue
        for context in contexts:
            for batch in batches:
                rows.append(run(llm, batch, context, ns.steps, seed=len(rows), graphs=mode == "on",
                                top=ns.kernel_table, order=ns.kernel_order))
                with open(os.path.join(ns.out, "profile_decode.json"), "w") as f:
                    json.dump({"preset": ns.preset, "layers": ns.layers, "quantization": ns.quantization,
                           "device": ns.device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
