"""Sweep the launch configs of the varlen causal conv1d prefill kernel at the bench shapes (device-only).

    python tools/tune_conv.py [--tokens 32768]

A GDN layer's conv: the q, k and v column slices (2048, 2048 and 4096 channels) of a ``[T, 8192]`` bf16
projection output, kernel 4, one segment with a carried window, q and k L2-normalised per 128-channel head
in the epilogue. Prints each config's median time for
the three calls (CUDA events) and the fraction of the HBM floor (one read of the input, one write of
the output) at the bandwidth of a same-size copy, so ``conv_triton.VARLEN_CONFIG`` can be set from data.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from tidal.kernels import conv_triton


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ns = ap.parse_args()
    t, widths, k = ns.tokens, (2048, 2048, 4096), 4
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(t, sum(widths), device=dev, generator=g, dtype=torch.bfloat16)
    w = torch.randn(sum(widths), k, device=dev, generator=g, dtype=torch.bfloat16)
    states = torch.randn(2, k - 1, sum(widths), device=dev, generator=g, dtype=torch.bfloat16)
    cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
    slots = torch.tensor([1], dtype=torch.int32, device=dev)
    fresh = torch.tensor([False], device=dev)
    seg = torch.zeros(t, dtype=torch.int32, device=dev)
    floor_bytes = 2 * x.numel() * x.element_size()
    copy = torch.empty_like(x)
    copy_ms = triton.testing.do_bench(lambda: copy.copy_(x), warmup=25, rep=200, return_mode="median")
    print(f"T={t}: copy of the input {copy_ms * 1e3:.1f} us ({floor_bytes / copy_ms / 1e9:.2f} TB/s)", flush=True)

    def layer(cfg):
        lo, outs = 0, []
        for width, l2_group in zip(widths, (128, 128, 0), strict=True):
            cols = slice(lo, lo + width)
            outs.append(conv_triton.causal_conv1d_varlen(x[:, cols], states[:, :, cols], w[cols], cu, slots, fresh,
                                                         row_segment=seg, config=cfg, l2_group=l2_group))
            lo += width
        return outs

    ref = torch.cat(layer(conv_triton.VARLEN_CONFIG), dim=1)
    for cfg in itertools.product((64, 128, 256), (128, 256, 512), (4, 8)):
        try:
            same = torch.equal(torch.cat(layer(cfg), dim=1), ref)
            ms = triton.testing.do_bench(lambda cfg=cfg: layer(cfg), warmup=25, rep=200, return_mode="median")
        except Exception as e:  # out of registers or shared memory for this config
            print(f"  t{cfg[0]} c{cfg[1]} w{cfg[2]}: {type(e).__name__}", flush=True)
            continue
        print(f"  t{cfg[0]} c{cfg[1]} w{cfg[2]}: {ms * 1e3:7.1f} us  {copy_ms / ms:.2f} of a copy  same {same}",
              flush=True)


if __name__ == "__main__":
    main()
