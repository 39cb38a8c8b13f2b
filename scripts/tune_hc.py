"""Sweep the fused hyper-connection ``up`` GEMM + block input kernel's tiles at the bench shapes (device-only).

    python scripts/tune_hc.py [--tokens 32768] [--small 1,8,32]

hc 4 x hidden 2048, low rank 320, bf16. For each ``(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)`` prints
the median time (``triton.testing.do_bench``) at ``--tokens`` rows against the unfused pair it replaces
(cuBLAS ``up`` GEMM, then the gated-mean kernel), with the TFLOP/s and bytes it implies; then the
configured tile at the ``--small`` (decode) row counts against the same pair. From this table
``hyper_connection_triton.HC_UP_CONFIG_16BIT`` is set.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

from tidal.kernels import hyper_connection_triton as hct

CONFIGS = [
    (64, 64, 64, 4, 3), (64, 64, 64, 8, 3), (128, 64, 64, 8, 3), (128, 64, 64, 8, 2), (128, 32, 64, 8, 3),
    (128, 32, 64, 4, 3), (64, 32, 64, 4, 3), (128, 64, 32, 8, 4), (64, 128, 64, 8, 3), (256, 32, 64, 8, 3),
    (64, 64, 32, 4, 4),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--small", default="1,8,32")
    ns = ap.parse_args()
    hc, hidden, lowrank, dt = 4, 2048, 320, torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)

    def case(rows: int):
        normed = torch.randn(rows, hc * hidden, device="cuda", generator=g, dtype=dt)
        act = torch.randn(rows, lowrank, device="cuda", generator=g, dtype=dt)
        w_up = (0.05 * torch.randn(hc * hidden, lowrank, device="cuda", generator=g)).to(dt)
        return act, w_up, normed

    def bench(fn) -> float:
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    def unfused(act, w_up, normed):
        return hct.hc_block_input_triton(normed, F.linear(act, w_up), hc)

    t = ns.tokens
    act, w_up, normed = case(t)
    flops = 2 * t * lowrank * hc * hidden
    moved = (normed.numel() + t * hidden + act.numel()) * 2
    base = bench(lambda: unfused(act, w_up, normed))
    want = unfused(act, w_up, normed).float()
    print(f"{t} rows: unfused (cuBLAS up + gated mean) {base * 1e3:.1f} us; fused moves {moved / 1e6:.0f} MB, "
          f"{flops / 1e9:.0f} GFLOP", flush=True)
    for cfg in CONFIGS:
        try:
            ms = bench(lambda cfg=cfg: hct.hc_up_block_input_triton(act, w_up, normed, hc, cfg))
            got = hct.hc_up_block_input_triton(act, w_up, normed, hc, cfg).float()
        except Exception as e:  # a tile that does not fit (shared memory, registers) is reported, not fatal
            print(f"  {cfg}: failed: {type(e).__name__}: {str(e)[:80]}", flush=True)
            continue
        err = ((got - want).abs().max() / want.abs().max()).item()
        print(f"  {cfg}: {ms * 1e3:7.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s  {moved / ms / 1e9:6.0f} GB/s  "
              f"{base / ms:5.2f}x unfused  max rel diff {err:.1e}", flush=True)
    for rows in (int(x) for x in ns.small.split(",") if x):
        small = case(rows)
        fused = bench(lambda small=small: hct.hc_up_block_input_triton(*small, hc))
        base = bench(lambda small=small: unfused(*small))
        print(f"{rows} rows, configured tile {hct.HC_UP_CONFIG_16BIT}: fused {fused * 1e3:.1f} us, "
              f"unfused {base * 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    main()
