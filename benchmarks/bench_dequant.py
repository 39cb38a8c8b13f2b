"""Dequantization of one layer's routed experts, the torch reference against the Triton kernel (device-only).

    python benchmarks/bench_dequant.py [--experts 512] [--rows 1280] [--cols 2560]

``--experts`` stacked ``[rows, cols]`` matrices (default: a ``flash-next`` layer's gate_up, gate and up each their
own tensor) are quantized to NVFP4 and to block FP8, then dequantized to bf16 three times each way
(``TIDAL_KERNELS=torch`` for the reference); prints the mean time of each, the kernel's bytes moved per second
(quantized parts read, bf16 written) and whether the two give the same bits.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch

from tidal.executor.quant import quantize_experts


def timed(fn, reps: int = 3):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        out = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--rows", type=int, default=1280)
    ap.add_argument("--cols", type=int, default=2560)
    ns = ap.parse_args()
    for fmt in ("nvfp4", "fp8"):
        values = torch.randn(ns.experts, ns.rows, ns.cols, device="cuda", dtype=torch.bfloat16)
        q = quantize_experts(values, [ns.rows // 2, ns.rows - ns.rows // 2], fmt)
        del values
        os.environ["TIDAL_KERNELS"] = "torch"
        ref_t, ref = timed(functools.partial(q.dequantize, torch.bfloat16))
        os.environ.pop("TIDAL_KERNELS")
        tri_t, tri = timed(functools.partial(q.dequantize, torch.bfloat16))
        moved = sum(t.numel() * t.element_size() for t in q.parts()) + tri.numel() * 2
        print(f"{fmt} [{ns.experts}, {ns.rows}, {ns.cols}]: torch {ref_t * 1e3:.1f} ms, triton {tri_t * 1e3:.2f} ms "
              f"({moved / tri_t / 1e12:.2f} TB/s), equal {torch.equal(ref, tri)}", flush=True)
        del ref, tri, q
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
