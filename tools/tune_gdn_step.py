"""Time a GDN layer's decode core at the bench shapes (device-only): the step kernel at several warp counts
against the three launches it replaces (gates, recurrent step, gated norm).

    python tools/tune_gdn_step.py [--batches 1,8,32] [--warps 4,8,16]

16 key heads and 32 value heads of 128, bf16 projections, fp32 states in a pool of 64 slots. Each variant is
captured 20 times over in one CUDA graph (launched with PDL, as in a decode graph) and the graph's replay
timed with CUDA events (``tidal.bench.timing.graph_seconds``); prints microseconds a call and the state bytes'
rate (read and written once).
"""

from __future__ import annotations

import argparse

import torch

from tidal.bench.timing import graph_seconds
from tidal.kernels import gdn_decode_triton
from tidal.kernels.gdn_gates_triton import gdn_gates
from tidal.kernels.norm_triton import gated_rms_norm_triton


def run_batch(batch: int, warps_list: list[int]) -> None:
    hk, hv, dk, dv = 16, 32, 128, 128
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(batch)
    wide = torch.randn(batch, 2 * hk * dk + 2 * hv * dv + 2 * hv, device=dev, generator=g).to(dt)
    qkv, z = wide[:, :2 * hk * dk + hv * dv], wide[:, 2 * hk * dk + hv * dv:2 * hk * dk + 2 * hv * dv]
    b, a = wide[:, -2 * hv:-hv], wide[:, -hv:]
    a_log, dt_bias = torch.randn(hv, device=dev).to(dt), torch.randn(hv, device=dev).to(dt)
    norm_w = torch.rand(dv, device=dev).to(dt) + 0.5
    pool = torch.randn(64, hv, dk, dv, device=dev) * 0.1
    slots = torch.randperm(64, device=dev)[:batch]
    fresh = torch.zeros(batch, dtype=torch.bool, device=dev)
    state_bytes = 2 * batch * hv * dk * dv * 4

    def parts():
        gd, beta = gdn_gates(a, b, a_log, dt_bias)
        q = qkv[:, :hk * dk].unflatten(-1, (hk, dk))
        k = qkv[:, hk * dk:2 * hk * dk].unflatten(-1, (hk, dk))
        v = qkv[:, 2 * hk * dk:].unflatten(-1, (hv, dv))
        core = gdn_decode_triton.gdn_decode(q, k, v, gd, beta, pool, slots, fresh)
        gated_rms_norm_triton(core, z.unflatten(-1, (hv, dv)), norm_w, 1e-6)

    us = graph_seconds(parts, calls=20) * 1e6
    print(f"batch {batch:3d}: gates + step + norm  {us:7.2f} us  ({state_bytes / us / 1e6:.2f} TB/s)", flush=True)
    for warps in warps_list:
        us = graph_seconds(lambda warps=warps: gdn_decode_triton.gdn_decode_step(
            qkv, z, b, a, a_log, dt_bias, norm_w, 1e-6, "silu", pool, slots, fresh, num_warps=warps), calls=20) * 1e6
        print(f"batch {batch:3d}: step kernel, {warps:2d} warps {us:7.2f} us  ({state_bytes / us / 1e6:.2f} TB/s)",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--warps", default="4,8,16")
    ns = ap.parse_args()
    for batch in (int(b) for b in ns.batches.split(",")):
        run_batch(batch, [int(w) for w in ns.warps.split(",")])


if __name__ == "__main__":
    main()
