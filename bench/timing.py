"""The one timer of the benchmarks and tools, and the hardware rates they divide by: CUDA events on a
GPU (``perf_counter`` elsewhere), a CUDA-graph replay timer for calls too short to launch one by one, peak
matmul throughput, HBM bandwidth and pinned host-to-device bandwidth, each measured in the run that uses it, and
the GPU's busy time in a torch profile."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_seconds(fn: Callable[[], Any], device: torch.device) -> float:
    """Wall time of one call, with the device synchronised before and after."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def gpu_busy(prof) -> tuple[int, float, float, list[tuple[float, str]]]:
    """A torch profile's device events: their count, the GPU's busy microseconds (the union of their
    intervals), the span from the first start to the last end, and each idle gap (microseconds, the event
    after it)."""
    from torch.autograd import DeviceType

    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    if not events:
        return 0, 0.0, 0.0, []
    busy, gaps, end = 0.0, [], events[0].time_range.start
    for e in events:
        start, stop = e.time_range.start, e.time_range.end
        if start > end:
            gaps.append((start - end, e.name))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return len(events), busy, end - events[0].time_range.start, gaps


def device_ms(fn: Callable[[], Any], device: torch.device, samples: int = 10, min_sample_ms: float = 1.0,
              slow_ms: float = 5000.0) -> dict[str, Any]:
    """Median per-call time after one warm-up call (which pays compilation and autotuning).

    CUDA events on CUDA, ``perf_counter`` elsewhere. A sample repeats the call until it spans about
    ``min_sample_ms`` so that microsecond kernels are not launch-timer noise; a call slower than
    ``slow_ms`` is timed once.
    """
    first = host_seconds(fn, device) * 1e3
    warm = host_seconds(fn, device) * 1e3
    if warm < slow_ms:  # the faster of two warm calls sizes the samples (a busy host inflates one)
        warm = min(warm, host_seconds(fn, device) * 1e3)
    if warm >= slow_ms:
        return {"ms": warm, "first_ms": first, "samples": 1, "reps": 1}
    if warm >= 100.0:  # slow references: a few samples are plenty and keep the kernel table short
        samples = min(samples, 3)
    reps = max(1, min(100, math.ceil(min_sample_ms / max(warm, 1e-3))))
    times = []
    for _ in range(samples):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / reps)
    return {"ms": statistics.median(times), "first_ms": first, "samples": samples, "reps": reps}


def measure_peak(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Dense GEMM throughput: an n x n x n matmul (8192 on CUDA, 512 elsewhere), median of 10."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = device_ms(lambda: torch.matmul(a, b), device, samples=10, min_sample_ms=0.0)
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "ms": t["ms"],
            "flops_per_s": 2 * n ** 3 / (t["ms"] / 1e3)}


def measure_bandwidth(device: torch.device) -> dict[str, Any]:
    """Device-to-device copy (2 GiB on CUDA, 64 MiB elsewhere); bytes read + written, median of 10."""
    nbytes = (2 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = device_ms(lambda: dst.copy_(src), device, samples=10, min_sample_ms=0.0)
    return {"copy_bytes": nbytes, "ms": t["ms"], "bytes_per_s": 2 * nbytes / (t["ms"] / 1e3)}


def graph_seconds(fn: Callable[[], Any], calls: int = 1, replays: int = 1, samples: int = 10) -> float:
    """Seconds one call of ``fn`` takes on the device alone (CUDA): ``calls`` calls captured in one graph
    (after warm-up calls on a side stream), ``replays`` replays back to back per sample, median of
    ``samples`` samples."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / (calls * replays))
    return statistics.median(times)


def h2d_bandwidth(device: str) -> float:
    """Host-to-device bytes per second (pinned on a GPU): a 1 GiB copy, median of 5 after a warm-up."""
    cuda = device.startswith("cuda")
    size = 1 << 30
    host = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty_like(host, device=device)
    times = []
    for _ in range(6):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return size / statistics.median(times[1:])
