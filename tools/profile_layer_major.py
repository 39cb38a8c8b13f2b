"""Where a long prefill's time goes with experts in host memory: layer-major against chunked, offline.

    python tools/profile_layer_major.py --out DIR [--preset bench] [--tokens 32000] [--chunk 4096]
                                          [--cache-fraction 0.11] [--arms layer_major,chunked] [--host N]
                                          [--quantization nvfp4] [--ple-backend pinned] [--layers N]

One ``LLM`` with ``--moe-strategy offload``, the n-gram table on ``--ple-backend`` (pinned by default), an
expert cache of ``--cache-fraction`` of all routed experts and, with ``--quantization``, random experts in
that layout (host banks, cache and layer buffers hold its bytes); each arm (``--prefill-layer-major`` on or
off) generates one token for a cold random prompt of ``--tokens`` tokens after a warm-up prompt of the same
length. Per arm: the wall time
of ``generate`` (scheduling, the prefill, sampling), the expert bytes it moved and the PCIe floor
(those bytes over the pinned host-to-device bandwidth measured here), then, under the torch
profiler, how the wall time divides: host time before the first device event, host-to-device copy
time, kernel time, both at once, neither (the device idle), the host's tail after the last
device event, the time before the first copy, between copies and after the last one, with the
longest idle gaps, the device events of most total time, and per layer when its experts were asked
for, copied and used. ``--host N`` adds cProfile's N
costliest host functions for the layer-major arm. Writes ``DIR/profile_layer_major.json``. Weights are seeded random.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import pstats
import tempfile
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from tidal import LLM  # noqa: E402
from tidal.bench.timing import h2d_bandwidth  # noqa: E402
from tidal.config.model import ModelConfig  # noqa: E402
from tidal.executor.offload.ple_table import RowsAhead  # noqa: E402
from tidal.executor.presets import keep_first_layers, write_checkpoint  # noqa: E402


def traced(name: str) -> bool:
    """A host range this script records (the profiler shows them on the device as well)."""
    return name in ("generate", "ple rows send") or name.startswith("expert fill ")


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(hi - lo for lo, hi in intervals)


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline(prof, t0: float) -> list[str]:
    """Per MoE layer, in ms from the start of ``generate``: when the host asked for its experts
    (``fill``), when its two copies (gate/up and down) ran on the device and how long the copy stream
    stood idle before them, and when its first and last routed-expert kernels ran (one per internal
    chunk); then the host's waits for PLE rows gathered ahead."""
    cpu = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    asks = sorted((e.time_range.start, e.name.split()[-1]) for e in cpu if e.name.startswith("expert fill "))
    copies = sorted((e.time_range.end - e.time_range.start, e.time_range.start, e.time_range.end)
                    for e in prof.events() if e.device_type == DeviceType.CUDA and "Memcpy HtoD" in e.name)
    copies = sorted((lo, hi) for _, lo, hi in copies[-2 * len(asks):])  # the layers' copies are the longest
    moe = sorted(e.time_range.start for e in prof.events()
                 if e.device_type == DeviceType.CUDA and e.name == "_sorted_gate_up_kernel")
    if not asks or len(copies) != 2 * len(asks):
        return []
    per = -(-len(moe) // max(len(asks), 1))
    lines, end = [], t0
    for k, (at, layer) in enumerate(asks):
        lo, hi = copies[2 * k][0], copies[2 * k + 1][1]
        runs = moe[k * per:(k + 1) * per]
        lines.append(f"layer {layer}: fill asked {(at - t0) / 1e3:6.1f}, "
                     f"copied {(lo - t0) / 1e3:6.1f}-{(hi - t0) / 1e3:6.1f} "
                     f"(copy stream idle {(lo - end) / 1e3:5.1f} before), experts "
                     + (f"{(runs[0] - t0) / 1e3:6.1f}-{(runs[-1] - t0) / 1e3:6.1f}" if runs else "-"))
        end = hi
    waits = [(e.time_range.start, e.time_range.end) for e in cpu if e.name == "ple rows send"]
    if waits:
        lines.append("PLE rows sent at " + ", ".join(f"{(lo - t0) / 1e3:.1f} (+{(hi - lo) / 1e3:.1f})"
                                                     for lo, hi in sorted(waits)))
    return lines


def breakdown(prof, gaps: int) -> dict:
    """The ``generate`` range divided into host head, copy, kernel, overlap, idle and host tail (ms)."""
    span = next(e for e in prof.events() if e.name == "generate" and e.device_type == DeviceType.CPU)
    t0, t1 = span.time_range.start, span.time_range.end
    device = [e for e in prof.events() if e.device_type == DeviceType.CUDA and t0 <= e.time_range.start <= t1
              and not traced(e.name)]
    copies = union([(e.time_range.start, e.time_range.end) for e in device if "Memcpy HtoD" in e.name])
    kernels = union([(e.time_range.start, e.time_range.end) for e in device if "Memcpy" not in e.name
                     and "Memset" not in e.name])
    busy = union(copies + kernels)
    first, last = busy[0][0], busy[-1][1]
    idle = [(busy[k][1], busy[k + 1][0]) for k in range(len(busy) - 1)]
    copy_gaps = [(copies[k][1], copies[k + 1][0]) for k in range(len(copies) - 1)]
    ms = 1e-3
    by_name: dict[str, list[float]] = {}
    for e in device:
        entry = by_name.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += (e.time_range.end - e.time_range.start) * ms
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]
    return {
        "wall_ms": (t1 - t0) * ms,
        "host_head_ms": (first - t0) * ms,
        "host_tail_ms": (t1 - last) * ms,
        "copy_ms": length(copies) * ms,
        "kernel_ms": length(kernels) * ms,
        "copy_and_kernel_ms": intersect(copies, kernels) * ms,
        "idle_ms": length(idle) * ms,
        "before_first_copy_ms": (copies[0][0] - t0) * ms if copies else None,
        "copy_gaps_ms": length(copy_gaps) * ms,
        "after_last_copy_ms": (t1 - copies[-1][1]) * ms if copies else None,
        "device_events": len(device),
        "longest_idle": [{"at_ms": (lo - t0) * ms, "ms": (hi - lo) * ms}
                         for lo, hi in sorted(idle, key=lambda g: g[0] - g[1])[:gaps]],
        "top_device_events": [{"name": name[:80], "count": n, "ms": t} for name, (n, t) in top],
        "timeline": timeline(prof, t0),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--tokens", type=int, default=32000)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--cache-fraction", type=float, default=0.11)
    ap.add_argument("--arms", default="layer_major,chunked")
    ap.add_argument("--gaps", type=int, default=8, help="longest idle gaps to list")
    ap.add_argument("--host", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, choices=["nvfp4", "fp8"],
                    help="random routed experts and n-gram table in this layout (host banks and cache hold it)")
    ap.add_argument("--ple-backend", default="pinned", choices=["gpu", "pinned", "disk"])
    ap.add_argument("--layers", type=int, default=None, help="the preset's first N decoder layers")
    ns = ap.parse_args()
    os.makedirs(ns.out, exist_ok=True)
    path = write_checkpoint(ns.preset, tempfile.mkdtemp(), weights=False)
    if ns.layers:
        keep_first_layers(path, ns.layers)
    config = ModelConfig.from_file(path)
    experts = config.num_experts * config.num_hidden_layers
    slots = max(config.num_experts_per_tok, int(experts * ns.cache_fraction))
    bandwidth = h2d_bandwidth(ns.device)
    print(f"pinned host-to-device: {bandwidth / 1e9:.1f} GB/s; expert cache {slots} slots of "
          f"{experts} experts", flush=True)
    llm = LLM(path, device=ns.device, dtype=ns.dtype, load_format="random", max_prefill_length=ns.chunk,
              max_model_len=ns.tokens + 64, moe_strategy="offload", moe_cache_slots=slots,
              ple_backend=ns.ple_backend, quantization=ns.quantization, prefill_layer_major=True,
              max_running_requests=1)
    store = llm.runner.expert_store
    cuda = ns.device.startswith("cuda")
    fill, send = store._fill, RowsAhead.send

    def traced_fill(index: int, layer: int) -> None:  # host ranges for the timeline
        with record_function(f"expert fill {layer}"):
            fill(index, layer)

    def traced_send(self, lo: int, hi: int) -> torch.Tensor:
        with record_function("ple rows send"):
            return send(self, lo, hi)
    store._fill = traced_fill
    RowsAhead.send = traced_send

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
    gen = torch.Generator().manual_seed(0)

    def prompt() -> list[int]:
        return torch.randint(1000, config.vocab_size - 1000, (ns.tokens,), generator=gen).tolist()

    def moved() -> int:
        return sum(store.stats()["expert_bytes"])

    results = {"bandwidth_GBps": bandwidth / 1e9, "slots": slots, "tokens": ns.tokens,
               "layers": config.num_hidden_layers, "quantization": ns.quantization, "arms": {}}
    for arm in ns.arms.split(","):
        llm.scheduler.args = dataclasses.replace(llm.scheduler.args, prefill_layer_major=arm == "layer_major")
        llm.generate([prompt()], max_tokens=1)  # warm-up: the long shapes compile and autotune
        sync()
        before, t0 = moved(), time.monotonic()
        llm.generate([prompt()], max_tokens=1)
        sync()
        wall, nbytes = time.monotonic() - t0, moved() - before
        parts = None
        if cuda:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                with record_function("generate"):
                    llm.generate([prompt()], max_tokens=1)
                    sync()
            parts = breakdown(prof, ns.gaps)
        floor = nbytes / bandwidth
        results["arms"][arm] = {"wall_s": wall, "bytes": nbytes, "pcie_floor_s": floor, "profiled": parts}
        print(f"{arm:12s} wall {wall:.3f} s, {nbytes / 1e9:.2f} GB moved, PCIe floor {floor:.3f} s "
              f"({wall / floor:.2f}x)", flush=True)
        if parts is None:
            continue
        print("  profiled: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()
                                         if k.endswith("_ms") and v is not None)
              + f", {parts['device_events']} device events", flush=True)
        for e in parts["top_device_events"]:
            print(f"    {e['ms']:8.1f} ms {e['count']:6d}x  {e['name']}")
        print("  longest idle: " + ", ".join(f"{g['ms']:.1f} ms at {g['at_ms']:.0f}" for g in parts["longest_idle"]),
              flush=True)
        for line in parts["timeline"]:
            print("  " + line)
        if ns.host and arm == "layer_major":
            host = cProfile.Profile()
            host.enable()
            llm.generate([prompt()], max_tokens=1)
            sync()
            host.disable()
            host.dump_stats(os.path.join(ns.out, "layer_major_host.prof"))
            pstats.Stats(host).strip_dirs().sort_stats("tottime").print_stats(ns.host)
    if {"layer_major", "chunked"} <= results["arms"].keys():
        ratio = results["arms"]["chunked"]["wall_s"] / results["arms"]["layer_major"]["wall_s"]
        results["chunked_over_layer_major"] = ratio
        print(f"chunked / layer-major: {ratio:.2f}x")
    with open(os.path.join(ns.out, "profile_layer_major.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
