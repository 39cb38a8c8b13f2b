"""Prompt forwards from CUDA graphs against the same forwards run eagerly, in one process.

    python benchmarks/bench_prefill_graphs.py --out DIR [--preset bench] [--lengths 64,256,1000,1024,2000,4096,8192]
                                              [--context 32000] [--repeats 5] [--device cuda] [--profile N]
                                              [-- tidal serve flags]

One ``tidal.LLM`` of the preset (random weights; the serve flags after ``--`` shape it as they shape a server),
timed from the host (the device synchronised before and after): a one-token greedy generation of a new prompt of
each length (cold: nothing cached), and of 77 new tokens after a cached ``--context``-token prompt (the
continuation: its prefix a prefix-cache hit). Two arms on the same runner, alternating sample by sample: ``graphs``
(the runner's prompt graphs, captured before timing) and ``eager`` (the same runner without them). Per length the
median seconds of each arm, ``graphs_over_eager`` and whether the graphs arm replayed a graph (lengths past the
largest captured size run eagerly in both). ``--profile N`` then profiles one more sample of each arm and case:
the GPU's busy time (the union of its kernels) against the host's wall time and the N ops with the most device
time under the torch profiler, and the N Python functions with the most time in all under cProfile. Writes
``DIR/bench_prefill_graphs.json``. On a CPU the arms run the graphs' padded forward eagerly (``capture`` off): a
check of the plumbing, not a measurement.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tidal import LLM
from tidal.bench.server import llm_kwargs, serve_args, split_serve_flags
from tidal.bench.timing import gpu_busy, host_seconds
from tidal.executor.prefill_graph import rows_of
from tidal.executor.presets import write_checkpoint
from tidal.executor.runner import prompt_graph_tokens

CONTINUATION = 77


def main() -> None:
    argv, extra = split_serve_flags(sys.argv[1:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--lengths", default="64,256,1000,1024,2000,4096,8192",
                    type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--context", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", type=int, default=0, help="profile one more sample per arm and case")
    ns = ap.parse_args(argv)
    os.makedirs(ns.out, exist_ok=True)
    device = torch.device(ns.device)
    path = write_checkpoint(ns.preset, tempfile.mkdtemp(), weights=False)
    longest = max(max(ns.lengths), ns.context + CONTINUATION)
    flags = ["--load-format", "random", "--max-model-len", str(longest + 64), "--kv-pool-tokens",
             str(2 * longest + 4096), *extra]
    args = serve_args(path, flags)
    llm = LLM(path, device=ns.device, dtype="auto", load_format="random", **llm_kwargs(args))
    runner = llm.runner
    graphs = runner.prefill_graphs
    if graphs is None and device.type == "cpu":
        runner.use_prefill_graphs(runner.graphs.max_pages if runner.graphs else 4096, capture=False,
                                  max_tokens=prompt_graph_tokens(args))
        graphs = runner.prefill_graphs
    if graphs is None:
        raise SystemExit("this runner has no prompt graphs (--disable-prefill-graph, --tp, offload, disk PLE or a "
                         "torch GDN recurrence)")
    graph_bytes = 0
    if graphs.capture:
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(device)
        for key in graphs.shapes():
            graphs.prepare(key)
        torch.cuda.empty_cache()
        graph_bytes = torch.cuda.memory_reserved(device) - before
        print(f"{graphs.captures} prompt graphs of up to {rows_of(graphs.sizes[-1])} rows hold "
              f"{graph_bytes / 2**30:.2f} GiB of device memory", flush=True)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.config.vocab_size

    def prompt(n: int) -> list[int]:
        return torch.randint(1000, min(vocab, 240000), (n,), generator=gen).tolist()

    def timed(arm: str, ids: list[int]) -> tuple[float, bool]:
        runner.prefill_graphs = graphs if arm == "graphs" else None
        before = graphs.replays
        seconds = host_seconds(lambda: llm.generate([ids], max_tokens=1, ignore_eos=True), device)
        runner.prefill_graphs = graphs
        return seconds, graphs.replays > before

    base = prompt(ns.context)
    llm.generate([base], max_tokens=1, ignore_eos=True)  # cached from here on
    cases = [(f"cold {n}", lambda n=n: prompt(n)) for n in ns.lengths]
    cases.append((f"+{CONTINUATION} after {ns.context}", lambda: base + prompt(CONTINUATION)))
    rows = []
    for name, make in cases:
        samples: dict[str, list[float]] = {"graphs": [], "eager": []}
        replayed = []
        for arm in ("graphs", "eager"):  # untimed: compile the eager shapes, fill caches
            timed(arm, make())
        for _ in range(ns.repeats):
            for arm in ("graphs", "eager"):
                seconds, hit = timed(arm, make())
                samples[arm].append(seconds)
                if arm == "graphs":
                    replayed.append(hit)
        g, e = statistics.median(samples["graphs"]), statistics.median(samples["eager"])
        rows.append({"case": name, "graphs_s": g, "eager_s": e, "graphs_over_eager": g / e,
                     "replayed": all(replayed), "samples": samples})
        print(f"{name:<22s} graphs {g * 1e3:8.2f} ms   eager {e * 1e3:8.2f} ms   {g / e:5.2f}"
              f"{'' if all(replayed) else '   (no graph: eager in both)'}", flush=True)
    if ns.profile:
        for (name, make), row in zip(cases, rows, strict=True):
            for arm in ("graphs", "eager"):  # untimed: the cold prompts since may have evicted the cached prompt
                timed(arm, make())
            row["profile"] = {arm: profiled(arm, make, timed, device, ns.profile, name)
                              for arm in ("graphs", "eager")}
            row["host_split"] = {arm: host_split(llm, lambda arm=arm, make=make: timed(arm, make()), name, arm)
                                 for arm in ("graphs", "eager")}
    result = {"preset": ns.preset, "device": ns.device,
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "flags": flags, "captured": graphs.captures, "shapes": len(graphs.shapes()),
              "largest_rows": rows_of(graphs.sizes[-1]), "graph_bytes": graph_bytes, "rows": rows}
    with open(os.path.join(ns.out, "bench_prefill_graphs.json"), "w") as f:
        json.dump(result, f, indent=1)


def host_split(llm: LLM, run, name: str, arm: str) -> dict:
    """The host's wall time of one sample, unprofiled, split among the steps of a generation (each step's own
    time, the steps it calls excluded): scheduling, the runner's preparation, the forward's launch (a graph's
    upload and replay, or an eager forward), sampling, the reads that wait for the device, and the result's
    bookkeeping. Wraps the methods for one sample and puts them back."""
    runner, scheduler = llm.runner, llm.scheduler
    steps = [("schedule", scheduler, "schedule"), ("prepare", runner, "_prepare"),
             ("forward", runner, "_forward_batch"), ("forward", runner.model, "forward"),
             ("sample", runner, "_sample"), ("process_result", scheduler, "process_result")]
    if runner.prefill_graphs is not None:
        steps.append(("forward", runner.prefill_graphs, "run"))
    spent: dict[str, float] = {}
    stack: list[list[float]] = []

    def wrap(label, fn):
        def timed_call(*a, **k):
            stack.append([time.perf_counter(), 0.0])
            try:
                return fn(*a, **k)
            finally:
                t0, inner = stack.pop()
                took = time.perf_counter() - t0
                spent[label] = spent.get(label, 0.0) + took - inner
                if stack:
                    stack[-1][1] += took
        return timed_call

    saved = [(obj, attr, obj.__dict__.get(attr)) for _, obj, attr in steps]
    tolist = torch.Tensor.tolist
    try:
        for label, obj, attr in steps:
            setattr(obj, attr, wrap(label, getattr(obj, attr)))
        torch.Tensor.tolist = wrap("device wait (tolist)", tolist)
        wall, _ = run()
    finally:
        torch.Tensor.tolist = tolist
        for obj, attr, old in saved:
            if old is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)
    spent["other"] = wall - sum(spent.values())
    print(f"{name} [{arm}] host split, wall {wall * 1e3:.2f} ms: "
          + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in spent.items()), flush=True)
    return {"wall_s": wall, "steps_s": spent}


def profiled(arm: str, make, timed, device: torch.device, top: int, name: str) -> dict:
    """One sample under the torch profiler (the GPU's busy time against the wall time) and one under cProfile
    (the ``top`` functions by time in all, printed)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        wall, _ = timed(arm, make())
    count, busy, span, gaps = gpu_busy(prof)
    print(f"{name} [{arm}]: wall {wall * 1e3:.2f} ms (profiled), GPU busy {busy / 1e3:.2f} ms in {count} device "
          f"events over {span / 1e3:.2f} ms, {len(gaps)} gaps", flush=True)
    if count:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=70))
    host = cProfile.Profile()
    host.enable()
    wall_host, _ = timed(arm, make())
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).strip_dirs().sort_stats("cumtime").print_stats(top)
    print(f"{name} [{arm}]: wall {wall_host * 1e3:.2f} ms under cProfile\n" + text.getvalue(), flush=True)
    return {"wall_s": wall, "gpu_busy_s": busy / 1e6, "device_events": count, "span_s": span / 1e6,
            "gaps": len(gaps)}


if __name__ == "__main__":
    main()
