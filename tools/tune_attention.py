"""Sweep the Triton attention kernels' launch configs at the bench shapes (device-only).

    python tools/tune_attention.py [--tokens 32768]

One prompt of QSA prefill rows (top-32 of 64-key blocks, random selections) and dense causal prefill,
D=256, 16 query / 2 KV heads, bf16, pages of 16. Prints the median time (CUDA events) of: the QSA rows
with the split between the tile and the row kernel (``qsa_tile_below``) at several positions, 0 being
every row in the row kernel; the row kernel's and the tile kernel's launch configs (QSA rows, then
dense). So ``QSA_TILE_BELOW`` and the tables in ``attention_triton`` can be set from data.
"""

from __future__ import annotations

import argparse

import torch
import triton

from tidal.kernels import attention_triton as at


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ns = ap.parse_args()
    t, h, hkv, d, page, ratio, topk = ns.tokens, 16, 2, 256, 16, 64, 32
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(t, h, d, device=dev, generator=g, dtype=torch.bfloat16)
    pages = t // page
    k = torch.randn(pages, page, hkv, d, device=dev, generator=g, dtype=torch.bfloat16)
    v = torch.randn(pages, page, hkv, d, device=dev, generator=g, dtype=torch.bfloat16)
    table = torch.randperm(pages, device=dev, generator=g).to(torch.int32)[None]
    cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
    kv_lens = torch.tensor([t], dtype=torch.int32, device=dev)
    visible = (torch.arange(t, device=dev) + 1) // ratio
    scores = torch.rand(t, t // ratio, device=dev, generator=g)
    scores = scores.masked_fill(torch.arange(t // ratio, device=dev)[None] >= visible[:, None], -1)
    top, idx = scores.topk(topk, dim=-1)
    sel = torch.where(top < 0, -1, idx).to(torch.int32)
    keys_per_row = (sel >= 0).sum(-1) * ratio + (torch.arange(t, device=dev) + 1 - visible * ratio)
    qsa_bytes = float(keys_per_row.sum()) * hkv * d * 2 * 2
    qsa_flops = float(keys_per_row.sum()) * h * d * 4
    dense_flops = t * (t + 1) / 2 * h * d * 4

    def run(selected: bool, tile_below: int = 0) -> float:
        fn = (lambda: at.paged_attention(q, k, v, table, cu, kv_lens, d ** -0.5, block_sel=sel, qsa_ratio=ratio,
                                         max_seqlen_q=t, qsa_tile_below=tile_below)) if selected else \
             (lambda: at.paged_attention(q, k, v, table, cu, kv_lens, d ** -0.5, max_seqlen_q=t))
        return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")

    print(f"QSA rows: {qsa_bytes / 1e9:.1f} GB of K/V gathered, {qsa_flops / 1e12:.2f} TFLOP", flush=True)
    for tile_below in sorted({0, t // 4, t // 2, 5 * t // 8, at.QSA_TILE_BELOW, 3 * t // 4, 7 * t // 8, t}):
        print(f"qsa tile below {tile_below:6d}: {run(True, tile_below):7.2f} ms", flush=True)
    base_row = dict(at._ROW_CONFIGS_16BIT)
    for block_n, warps, stages in ((32, 4, 2), (32, 2, 2), (64, 8, 2)):
        at._ROW_CONFIGS_16BIT[256] = (block_n, warps, stages)
        ms = run(True)
        print(f"row  n{block_n} w{warps} s{stages}: {ms:7.2f} ms  {qsa_bytes / ms / 1e9:6.2f} TB/s  "
              f"{qsa_flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
    at._ROW_CONFIGS_16BIT.update(base_row)
    print(f"dense causal: {dense_flops / 1e12:.1f} TFLOP", flush=True)
    base_tile = dict(at._TILE_CONFIGS_16BIT)
    for block_m, block_n, warps, stages in ((128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2), (64, 64, 4, 2)):
        at._TILE_CONFIGS_16BIT[256] = (block_m, block_n, warps, stages)
        try:
            dense, qsa = run(False), run(True, t)
        except Exception as e:  # out of shared memory or registers for this config
            print(f"tile m{block_m} n{block_n} w{warps} s{stages}: {type(e).__name__}")
            continue
        print(f"tile m{block_m} n{block_n} w{warps} s{stages}: dense {dense:7.2f} ms "
              f"{dense_flops / dense / 1e9:6.1f} TFLOP/s; QSA rows all in the tile kernel {qsa:7.2f} ms", flush=True)
    at._TILE_CONFIGS_16BIT.update(base_tile)


if __name__ == "__main__":
    main()
