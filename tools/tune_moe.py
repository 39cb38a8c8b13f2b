"""Sweep the launch configs of the MoE kernels at the bench shapes or any other (device-only).

    python tools/tune_moe.py [--tokens 4096,32768] [--quantization nvfp4] [--decode-tokens 1,8,32]
        [--experts 512] [--hidden 2048] [--intermediate 512] [--top-k 10] [--gemv-arms bf16,triton,asm,grouped]
        [--nvfp4-variants words,asm-swap] [--nvfp4-configs "128,128,128,8,3;64,128,128,4,3"]
        [--decode-gemm-configs "16,128,128,4,3"]

The bench shapes by default (512 experts, top-10, hidden 2048, intermediate 512; ``flash-next``'s are
``--hidden 2560 --intermediate 640``), bf16, softmax-top-k routing of random logits; an empty ``--tokens`` or
``--decode-tokens`` skips that part. For
each token count, prints the path it replaces (rows gathered in expert order, torch's grouped GEMM,
the SiLU-gate pass) and then each config of ``moe_triton.sorted_gate_up`` (:data:`CONFIGS`, weight tiles
by pointer or by tensor descriptor): median time (CUDA events),
TFLOP/s of the gate_up GEMM, and the largest difference from the replaced path, so
``moe_triton.SORTED_GATE_UP`` can be set from data. Then the whole routed-expert computation
(``moe.fused_experts``) with the config in the module.

``--quantization nvfp4`` sweeps the NVFP4 passes instead (``moe_nvfp4_triton``: gate_up and down over packed
experts), each against the bf16 path at the same shapes and against the experts dequantized per call and the bf16
path (what runs without the kernels); then, for ``--decode-tokens``, the decode GEMVs over NVFP4 and bf16 experts
and their configs, timed as CUDA graphs (a launch costs more than these kernels). Each NVFP4 variant of the grouped
GEMMs decodes its tiles in column order by Triton's operations or by PTX, or as even and odd columns, its tiles copied
by descriptor (as bytes or as 32-bit words) or by pointer, its rows gathered inside the GEMM or copied first, the
decoded tile the MMA's first operand (from registers) or its second (:data:`VARIANTS`); the GEMVs decode
codes by Triton's operations or by PTX (:data:`DECODES`, ``--gemv-arms``); the ``grouped`` arm times the grouped GEMMs
at the decode token counts (:data:`DECODE_GEMM_CONFIGS`, or ``--decode-gemm-configs``).
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import triton

from tidal.kernels import moe, moe_decode_triton, moe_nvfp4_triton, moe_triton


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


# NVFP4 passes: (block_m, block_n, block_k in values, warps, stages); ``--nvfp4-configs`` replaces them.
NVFP4_CONFIGS = [(128, 64, 128, 8, 3), (128, 128, 64, 8, 3), (64, 128, 128, 4, 3), (256, 64, 64, 8, 3)]
# name -> (interleave, asm, tma, gathered, swap, words): how a weight tile is decoded and fed to the MMA, and how the
# tiles arrive (moe_nvfp4_triton.INTERLEAVE, ASM, TMA, GATHERED, SWAP, WORDS); ``--nvfp4-variants`` picks some.
VARIANTS = {"words": (True, True, True, True, True, True), "asm-swap": (True, True, True, True, True, False),
            "tma-gathered": (True, False, True, True, False, False), "asm": (True, True, True, True, False, False),
            "tma": (True, False, True, False, False, False), "pointer": (True, False, False, False, False, False),
            "even-odd": (False, False, False, False, False, False)}
# How the decode GEMVs decode NVFP4 codes (moe_decode_triton.FP4_ASM).
DECODES = {False: "triton", True: "asm"}
# (block_m, block_n, block_k, num_warps, num_stages) of both grouped GEMMs in the decode sweep's "grouped" arm: the
# prefill path (sort by expert, tensor-core tiles, each distinct expert read once) at decode token counts; the
# prefill's own two configs first.
DECODE_GEMM_CONFIGS = [moe_nvfp4_triton.DECODE_CONFIG, moe_nvfp4_triton.GATE_UP_CONFIG, moe_nvfp4_triton.DOWN_CONFIG,
                       *((bm, moe_triton.GemmConfig(*c)) for bm, *c in ((16, 64, 128, 4, 3), (16, 128, 128, 4, 3),
                                                                      (16, 64, 256, 4, 3), (32, 64, 128, 4, 3)))]
GEMV_CONFIGS = [((2, 2048, 4), (32, 512, 4)), ((8, 512, 4), (32, 512, 4)), ((4, 1024, 4), (16, 512, 4)),
                ((16, 256, 4), (64, 256, 4)), ((8, 1024, 8), (32, 512, 8)), ((2, 1024, 4), (16, 256, 4)),
                # reduction tiles that divide flash-next's 2,560 and 640 (no masked remainder tile)
                ((4, 512, 4), (16, 128, 4)), ((8, 256, 4), (32, 128, 4)), ((2, 512, 4), (8, 128, 4)),
                ((4, 256, 4), (16, 64, 4)), ((8, 512, 8), (32, 128, 8)), ((16, 128, 4), (64, 64, 4)),
                ((4, 512, 2), (16, 128, 2)), ((8, 256, 2), (8, 128, 2))]


def routing(tokens: int, experts: int, top_k: int, hidden: int, g: torch.Generator):
    x = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=g, device="cuda"), -1), top_k)
    return x, ids, (weights / weights.sum(-1, keepdim=True)).bfloat16()


def timed(fn, graph: bool) -> float:
    """Median ms of ``fn``: CUDA events over launches, or over replays of a CUDA graph of it."""
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def sweep_nvfp4(tokens: int, gate_up, down, q_gate_up, q_down, top_k: int, g: torch.Generator,
                configs: list[tuple[int, ...]], variants: list[str]) -> None:
    experts, inter, hidden = gate_up.shape[0], gate_up.shape[1] // 2, gate_up.shape[2]
    x, ids, weights = routing(tokens, experts, top_k, hidden, g)
    sorted_ids, order = torch.sort(ids.flatten(), stable=True)
    ends = torch.searchsorted(sorted_ids, torch.arange(experts, device="cuda", dtype=sorted_ids.dtype),
                              right=True, out_int32=True)
    flops = 2.0 * ids.numel() * hidden * inter  # each pass's third: gate_up is twice this, down once
    packed_gu, packed_down = q_gate_up.nvfp4(), q_down.nvfp4()
    act = moe_nvfp4_triton.sorted_gate_up_nvfp4(x, order, ends, *packed_gu, top_k)
    act_words = moe_nvfp4_triton.permute_k(act) if act.shape[1] % moe_nvfp4_triton.K_CHUNK == 0 else act
    # Each variant's largest difference from the bf16 passes over the dequantized experts (bf16's rounding).
    exact = {"gate_up": moe_triton.sorted_gate_up(x, order, ends, q_gate_up.dequantize(x.dtype), top_k).float(),
             "down": moe._grouped_mm(act, q_down.dequantize(x.dtype).transpose(1, 2), offs=ends).float()}
    for name, make, ref, mult in (
            ("gate_up", lambda cfg, v: moe_nvfp4_triton.sorted_gate_up_nvfp4(x, order, ends, *packed_gu, top_k,
                                                                             cfg, *v),
             lambda: moe_triton.sorted_gate_up(x, order, ends, gate_up, top_k), 2),
            ("down", lambda cfg, v: moe_nvfp4_triton.sorted_down_nvfp4(
                act_words if v[5] else act, ends, *packed_down, cfg, *v[:3], swap=v[4], words=v[5], permuted=v[5]),
             lambda: moe._grouped_mm(act, down.transpose(1, 2), offs=ends), 1)):
        ms = timed(ref, False)
        print(f"T={tokens} {name}: bf16 {ms * 1e3:8.1f} us ({mult * flops / ms / 1e9:5.0f} TFLOP/s)", flush=True)
        for (bm, bn, bk, w, s), variant in itertools.product(configs, variants):
            if name == "down" and variant == "tma":  # its rows are in expert order already: the gathered variant
                continue
            cfg = (bm, moe_triton.GemmConfig(bn, bk, w, s))
            label = f"m{bm} n{bn} k{bk} w{w} s{s} {variant}"
            try:
                diff = (make(cfg, VARIANTS[variant]).float() - exact[name]).abs().max().item()
                ms = timed(functools.partial(make, cfg, VARIANTS[variant]), False)
            except Exception as e:  # out of shared memory or registers for this config
                print(f"  {label}: {type(e).__name__}", flush=True)
                continue
            print(f"  {label}: {ms * 1e3:8.1f} us ({mult * flops / ms / 1e9:5.0f} TFLOP/s) max diff {diff:.4f}",
                  flush=True)
    from tidal.executor.quant import routed_experts

    for name, fn in (("bf16 experts", lambda: moe.fused_experts(x, ids, weights, gate_up, down)),
                     ("nvfp4 read packed", lambda: moe.fused_experts_nvfp4(x, ids, weights, packed_gu, packed_down)),
                     ("nvfp4 dequantized per call", lambda: moe.fused_experts(
                         x, ids, weights, q_gate_up.dequantize(x.dtype), q_down.dequantize(x.dtype))),
                     ("routed_experts (dispatch)", lambda: routed_experts(x, ids, weights, q_gate_up, q_down))):
        ms = timed(fn, False)
        print(f"  whole routed experts, {name}: {ms * 1e3:8.1f} us ({3 * flops / ms / 1e9:5.0f} TFLOP/s)", flush=True)


def sweep_gemv(tokens: int, gate_up, down, q_gate_up, q_down, top_k: int, g: torch.Generator,
               kinds: list[str], gemm_configs: list[tuple[int, moe_triton.GemmConfig]]) -> None:
    x, ids, weights = routing(tokens, gate_up.shape[0], top_k, gate_up.shape[2], g)
    packed = (q_gate_up.nvfp4(), q_down.nvfp4())
    distinct = torch.unique(ids).numel()
    arms = (("bf16", (gate_up, down), gate_up[0].numel() * 2 * 3 // 2, False),
            *((f"nvfp4 {label}", packed, q_gate_up.bytes_per_expert() + q_down.bytes_per_expert(), asm)
              for asm, label in DECODES.items()))
    for label, (gu, dn), nbytes, asm in arms:
        if label.split()[-1] not in kinds:
            continue
        moe_decode_triton.FP4_ASM = asm
        for a, b in GEMV_CONFIGS:
            cfg = (moe_decode_triton.GemvConfig(*a), moe_decode_triton.GemvConfig(*b))
            try:
                ms = timed(functools.partial(moe_decode_triton.moe_gemv, x, ids, weights, gu, dn, None, cfg), True)
            except Exception as e:  # out of shared memory or registers for this config
                print(f"T={tokens} gemv {label} {a} {b}: {type(e).__name__} {str(e)[-400:]}", flush=True)
                continue
            print(f"T={tokens} gemv {label} {a} {b}: {ms * 1e3:7.1f} us, {distinct * nbytes / ms / 1e6:6.0f} GB/s "
                  f"of distinct experts", flush=True)
    if "grouped" in kinds:
        sweep_decode_gemm(tokens, x, ids, weights, packed, distinct, q_gate_up.bytes_per_expert()
                          + q_down.bytes_per_expert(), gemm_configs)


def sweep_decode_gemm(tokens: int, x, ids, weights, packed, distinct: int, nbytes: int,
                      configs: list[tuple[int, moe_triton.GemmConfig]]) -> None:
    """The grouped GEMM path over NVFP4 experts (``moe.fused_experts_nvfp4``: sort, both GEMMs, combine) at a
    decode token count, both passes at each of ``configs``, timed as a CUDA graph like the
    GEMVs; the largest difference from the GEMV at its default configs."""
    ref = moe_decode_triton.moe_gemv(x, ids, weights, *packed).float()
    saved = moe_nvfp4_triton.GATE_UP_CONFIG, moe_nvfp4_triton.DOWN_CONFIG, moe_nvfp4_triton.DECODE_CONFIG
    try:
        for cfg in configs:
            moe_nvfp4_triton.GATE_UP_CONFIG = moe_nvfp4_triton.DOWN_CONFIG = moe_nvfp4_triton.DECODE_CONFIG = cfg
            label = f"m{cfg[0]} n{cfg[1].block_n} k{cfg[1].block_k} w{cfg[1].num_warps} s{cfg[1].num_stages}"
            fn = functools.partial(moe.fused_experts_nvfp4, x, ids, weights, *packed)
            try:
                diff = (fn().float() - ref).abs().max().item()
                ms = timed(fn, True)
            except Exception as e:  # out of shared memory or registers for this config
                print(f"T={tokens} grouped gemm {label}: {type(e).__name__} {str(e)[-400:]}", flush=True)
                continue
            print(f"T={tokens} grouped gemm {label}: {ms * 1e3:7.1f} us, {distinct * nbytes / ms / 1e6:6.0f} GB/s of "
                  f"distinct experts, max diff from the gemv {diff:.4f}", flush=True)
    finally:
        moe_nvfp4_triton.GATE_UP_CONFIG, moe_nvfp4_triton.DOWN_CONFIG, moe_nvfp4_triton.DECODE_CONFIG = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,32768")
    ap.add_argument("--quantization", default=None, choices=["nvfp4"])
    ap.add_argument("--decode-tokens", default="1,8,32")
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--gemv-arms", default="bf16,triton,asm,grouped",
                    help="decode arms: GEMVs over bf16 experts, over NVFP4 decoded by Triton's operations (triton) or "
                         "by PTX (asm); the NVFP4 grouped GEMMs of prefill (grouped)")
    ap.add_argument("--nvfp4-variants", default=",".join(VARIANTS),
                    help=f"the NVFP4 grouped GEMMs' variants to sweep, of {', '.join(VARIANTS)}")
    ap.add_argument("--nvfp4-configs", default=";".join(",".join(map(str, c)) for c in NVFP4_CONFIGS),
                    help="the NVFP4 grouped GEMMs' configs, block_m,block_n,block_k,warps,stages each, ';' between")
    ap.add_argument("--decode-gemm-configs", default=None,
                    help="the grouped arm's configs (default DECODE_GEMM_CONFIGS), as --nvfp4-configs")
    ns = ap.parse_args()
    variants = [v for v in ns.nvfp4_variants.split(",") if v]
    if unknown := set(variants) - set(VARIANTS):
        ap.error(f"--nvfp4-variants: unknown {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    configs = [tuple(int(v) for v in c.split(",")) for c in ns.nvfp4_configs.split(";") if c]
    if any(len(c) != 5 for c in configs):
        ap.error("--nvfp4-configs: five integers a config (block_m,block_n,block_k,warps,stages)")
    gemm_configs = DECODE_GEMM_CONFIGS
    if ns.decode_gemm_configs:
        parsed = [tuple(int(v) for v in c.split(",")) for c in ns.decode_gemm_configs.split(";") if c]
        if any(len(c) != 5 for c in parsed):
            ap.error("--decode-gemm-configs: five integers a config (block_m,block_n,block_k,warps,stages)")
        gemm_configs = [(bm, moe_triton.GemmConfig(*c)) for bm, *c in parsed]
    experts, hidden, inter, top_k = ns.experts, ns.hidden, ns.intermediate, ns.top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g, device="cuda") / hidden ** 0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter, generator=g, device="cuda") / inter ** 0.5).bfloat16()
    counts = [int(t) for t in ns.tokens.split(",") if t]
    if ns.quantization is None:
        for tokens in counts:
            sweep(tokens, gate_up, down, top_k, g)
        return
    from tidal.executor.quant import quantize_experts

    q_gate_up, q_down = quantize_experts(gate_up, [inter, inter], "nvfp4"), quantize_experts(down, [hidden], "nvfp4")
    for tokens in counts:
        sweep_nvfp4(tokens, gate_up, down, q_gate_up, q_down, top_k, g, configs, variants)
    for tokens in (int(t) for t in ns.decode_tokens.split(",") if t):
        sweep_gemv(tokens, gate_up, down, q_gate_up, q_down, top_k, g, ns.gemv_arms.split(","), gemm_configs)


if __name__ == "__main__":
    main()
