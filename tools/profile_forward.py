"""Profile one cold prefill (and a few decode steps) of a preset on the GPU with the torch profiler.

    python tools/profile_forward.py --out DIR [--preset bench] [--tokens 32768] [--decode-batch 8]
        [--quantization nvfp4] [--ple-backend gpu] [--layers N]

Prints the kernels by total CUDA time (the table docs/performance.md quotes) and the GPU's busy time
against the span of its kernels, with the longest idle gaps, for each phase; for the prefill also the
ops by input shape. ``--trace`` writes the prefill's Chrome trace to
``DIR/prefill_trace.json``. ``--host N`` adds the prefill's host side: the N Python functions with the most
time of their own, and with the most time in all, under cProfile (``DIR/prefill_host.prof`` keeps it all).
Weights are seeded random (``--load-format random``), generated on the device.
"""

from __future__ import annotations

import argparse
import cProfile
import math
import os
import pstats
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tidal import LLM
from tidal.bench.timing import gpu_busy
from tidal.executor.presets import keep_first_layers, write_checkpoint
from tidal.messages import Batch, SegmentSpec


def timeline(prof) -> None:
    """GPU busy time (union of kernel and memcpy intervals) against their span, and the longest gaps."""
    count, busy, span, gaps = gpu_busy(prof)
    if not count:
        print("GPU timeline: the profiler recorded no device events")
        return
    print(f"GPU timeline: {count} kernels, busy {busy / 1e3:.1f} ms of {span / 1e3:.1f} ms "
          f"({busy / span:.3f}); idle {sum(g for g, _ in gaps) / 1e3:.2f} ms in {len(gaps)} gaps")
    for gap, name in sorted(gaps, reverse=True)[:15]:
        print(f"  gap {gap:8.1f} us before {name[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--decode-batch", type=int, default=8, help="0: no decode steps")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--host", type=int, default=0)
    ap.add_argument("--quantization", default=None, choices=["nvfp4", "fp8"],
                    help="random routed experts and n-gram table in this layout")
    ap.add_argument("--ple-backend", default="gpu", choices=["gpu", "pinned", "disk"])
    ap.add_argument("--layers", type=int, default=None, help="the preset's first N decoder layers")
    ns = ap.parse_args()
    os.makedirs(ns.out, exist_ok=True)
    path = write_checkpoint(ns.preset, tempfile.mkdtemp(), weights=False)
    if ns.layers:
        keep_first_layers(path, ns.layers)
    t0 = time.monotonic()
    llm = LLM(path, device="cuda", dtype="bfloat16", load_format="random", max_prefill_length=ns.tokens,
              max_model_len=ns.tokens + 1024, kv_pool_tokens=(ns.tokens + 1024) * (ns.decode_batch + 1),
              max_running_requests=max(ns.decode_batch, 1), quantization=ns.quantization,
              ple_backend=ns.ple_backend)
    torch.cuda.synchronize()
    print(f"load: {time.monotonic() - t0:.1f} s", flush=True)
    page = llm.sizes.page_size
    gen = torch.Generator().manual_seed(0)
    # The prompt, and the decode's 64-token prompts and steps (which may need more ids than a short prompt).
    ids = torch.randint(1000, 240000, (max(ns.tokens, 64 * ns.decode_batch + 80),), generator=gen).tolist()
    pages = list(range(math.ceil(ns.tokens / page)))

    def prefill(batch_id: int) -> None:
        llm.runner.execute(Batch(batch_id=batch_id, segments=[
            SegmentSpec(rid="p", slot=0, start=0, token_ids=ids[:ns.tokens], pages=pages, sample=True)]))

    prefill(0)  # warm-up: autotuning and first-shape compilation
    torch.cuda.synchronize()
    t0 = time.monotonic()
    prefill(1)
    torch.cuda.synchronize()
    took = time.monotonic() - t0
    print(f"prefill {ns.tokens} tokens: {took * 1e3:.1f} ms, {ns.tokens / took:.0f} tok/s", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        prefill(2)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=ns.rows, max_name_column_width=60))
    timeline(prof)
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="cuda_time_total", row_limit=ns.rows,
                                                             max_name_column_width=40))
    if ns.trace:
        prof.export_chrome_trace(os.path.join(ns.out, "prefill_trace.json"))
    if ns.host:
        host = cProfile.Profile()
        host.enable()
        prefill(3)
        torch.cuda.synchronize()
        host.disable()
        host.dump_stats(os.path.join(ns.out, "prefill_host.prof"))
        for key in ("tottime", "cumtime"):
            pstats.Stats(host).strip_dirs().sort_stats(key).print_stats(ns.host)

    # Decode: B requests with 64-token prompts, then single-token steps.
    b = ns.decode_batch
    if b < 1:
        return
    per = math.ceil((64 + 64) / page)
    segs = [SegmentSpec(rid=f"d{i}", slot=i, start=0, token_ids=ids[i * 64:(i + 1) * 64],
                        pages=list(range(i * per, (i + 1) * per)), sample=True) for i in range(b)]
    llm.runner.execute(Batch(batch_id=10, segments=segs))

    def step(batch_id: int, pos: int) -> None:
        llm.runner.execute(Batch(batch_id=batch_id, segments=[
            SegmentSpec(rid=f"d{i}", slot=i, start=pos, token_ids=[ids[pos + i]], pages=segs[i].pages, sample=True,
                        sample_index=pos - 63)  # decodes of generated tokens (output 0 came from the prompt)
            for i in range(b)]))

    for i in range(3):
        step(11 + i, 64 + i)
    torch.cuda.synchronize()
    t0 = time.monotonic()
    for i in range(10):
        step(20 + i, 67 + i)
    torch.cuda.synchronize()
    took = (time.monotonic() - t0) / 10
    print(f"decode batch {b}: {took * 1e3:.2f} ms/step, {b / took:.1f} tok/s", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(40, 77)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=ns.rows, max_name_column_width=60))
    timeline(prof)


if __name__ == "__main__":
    main()
