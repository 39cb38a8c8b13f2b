"""Sweep the launch configs of the grouped path's gate_up pass at the bench shapes (device-only).

    python tools/tune_moe.py [--tokens 4096,32768]

512 experts, top-10, hidden 2048, intermediate 512, bf16, softmax-top-k routing of random logits. For
each token count, prints the path it replaces (rows gathered in expert order, torch's grouped GEMM,
the SiLU-gate pass) and then each config of ``moe_triton.sorted_gate_up`` (:data:`CONFIGS`, weight tiles
by pointer or by tensor descriptor): median time (CUDA events),
TFLOP/s of the gate_up GEMM, and the largest difference from the replaced path, so
``moe_triton.SORTED_GATE_UP`` can be set from data. Then the whole routed-expert computation
(``moe.fused_experts``) with the config in the module.
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton

from tidal.kernels import moe, moe_triton


def sweep(tokens: int, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, g: torch.Generator) -> None:
    experts, inter, hidden = gate_up.shape[0], gate_up.shape[1] // 2, gate_up.shape[2]
    x = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=g, device="cuda"), -1), top_k)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
    sorted_ids, order = torch.sort(ids.flatten(), stable=True)
    ends = torch.searchsorted(sorted_ids, torch.arange(experts, device="cuda", dtype=sorted_ids.dtype),
                              right=True, out_int32=True)
    flops = 2.0 * ids.numel() * hidden * 2 * inter

    def replaced() -> torch.Tensor:
        h = moe._grouped_mm(x[order // top_k], gate_up.transpose(1, 2), offs=ends)
        return moe_triton.silu_mul(h)

    def fused(cfg: tuple[int, moe_triton.GemmConfig], tma: bool) -> torch.Tensor:
        return moe_triton.sorted_gate_up(x, order, ends, gate_up, top_k, cfg, tma)

    ref = replaced().float()
    ms = triton.testing.do_bench(replaced, warmup=25, rep=200, return_mode="median")
    print(f"T={tokens}: gather + grouped GEMM + SiLU gate {ms * 1e3:8.1f} us ({flops / ms / 1e9:5.0f} TFLOP/s)",
          flush=True)
    for bm, bn, bk, w, s, tma in CONFIGS:
        cfg = (bm, moe_triton.GemmConfig(bn, bk, w, s))
        name = f"m{bm} n{bn} k{bk} w{w} s{s}{' tma' if tma else ''}"
        try:
            diff = (fused(cfg, tma).float() - ref).abs().max().item()
            ms = triton.testing.do_bench(functools.partial(fused, cfg, tma), warmup=25, rep=200,
                                         return_mode="median")
        except Exception as e:  # out of shared memory or registers for this config
            print(f"  {name}: {type(e).__name__}", flush=True)
            continue
        print(f"  {name}: {ms * 1e3:8.1f} us ({flops / ms / 1e9:5.0f} TFLOP/s) max diff {diff:.4f}", flush=True)
    ms = triton.testing.do_bench(lambda: moe.fused_experts(x, ids, weights, gate_up, down), warmup=25, rep=200,
                                 return_mode="median")
    print(f"  fused_experts with {moe_triton.SORTED_GATE_UP}, tma {moe_triton.SORTED_GATE_UP_TMA}: "
          f"{ms * 1e3:8.1f} us", flush=True)


# (block_m, block_n, block_k, warps, stages, weight tiles by tensor descriptor): the best of the pointer
# sweep with and without descriptors, and deeper pipelines.
CONFIGS = [(128, 128, 64, 8, 3, False), (128, 64, 64, 8, 3, False),
           *[(*c, True) for c in ((128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 8, 3),
                                  (128, 64, 64, 4, 3), (128, 64, 64, 8, 4), (64, 128, 64, 4, 3), (64, 128, 64, 8, 4),
                                  (128, 128, 128, 8, 2), (256, 64, 64, 8, 3))]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,32768")
    ns = ap.parse_args()
    experts, hidden, inter = 512, 2048, 512
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g, device="cuda") / hidden ** 0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter, generator=g, device="cuda") / inter ** 0.5).bfloat16()
    for tokens in map(int, ns.tokens.split(",")):
        sweep(tokens, gate_up, down, 10, g)


if __name__ == "__main__":
    main()
