"""Prompt forwards from CUDA graphs against the same forwards run eagerly, in one process.

    python benchmarks/bench_prefill_graphs.py --out DIR [--preset bench] [--lengths 64,256,1000,1024,2000,4096]
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

import torch
from torch.profiler import ProfilerActivity, profile

from tidal import LLM
from tidal.bench.server import llm_kwargs, serve_args, split_serve_flags
from tidal.bench.timing import gpu_busy, host_seconds
from tidal.executor.presets import write_checkpoint

CONTINUATION = 77


def main() -> None:
    argv, extra = split_serve_flags(sys.argv[1:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--lengths", default="64,256,1000,1024,2000,4096", type=lambda s: [int(x) for x in s.split(",")])
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
    llm = LLM(path, device=ns.device, dtype="auto", load_format="random", **llm_kwargs(serve_args(path, flags)))
    runner = llm.runner
    graphs = runner.prefill_graphs
    if graphs is None and device.type == "cpu":
        runner.use_prefill_graphs(runner.graphs.max_pages if runner.graphs else 4096, capture=False)
        graphs = runner.prefill_graphs
    if graphs is None:
        raise SystemExit("this runner has no prompt graphs (--disable-prefill-graph, --tp, offload, disk PLE or a "
                         "torch GDN recurrence)")
    if graphs.capture:
        for key in graphs.shapes():
            graphs.prepare(key)
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
            row["profile"] = {arm: profiled(arm, make, timed, device, ns.profile, name)
                              for arm in ("graphs", "eager")}
    result = {"preset": ns.preset, "device": ns.device,
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "flags": flags, "captured": graphs.captures, "shapes": len(graphs.shapes()), "rows": rows}
    with open(os.path.join(ns.out, "bench_prefill_graphs.json"), "w") as f:
        json.dump(result, f, indent=1)


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
