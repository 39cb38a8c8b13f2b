"""Decode-size kernels against the torch paths they replace, on one GPU, each replayed from a CUDA graph
(as decode runs them).

    python benchmarks/bench_decode_kernels.py --out DIR [--parts route,moe,qsa] [--tokens 1,2,4,8,16,32,48,64]
        [--contexts 8192,32768,131072] [--prefill 32768] [--hc-hidden 2048]   (parts: route, moe, qsa, hc, gemv)

MoE (the bench shapes: hidden 2048, 512 experts, top-10, intermediate 512, shared expert 512): for T
tokens, the ``grouped`` arm is the layer's MoE after the router GEMM as it ran before the GEMV kernels
(softmax + ``torch.topk`` router, sort + grouped GEMMs + SiLU-gate + combine, the shared expert's GEMMs,
gate, sigmoid and add); the ``gemv`` arm is ``route_triton`` + ``moe_gemv`` with each candidate config.
The HBM floor is the bytes of the distinct routed experts plus the shared expert over the bandwidth of a
device copy measured in the same run.

QSA block choice (16 index heads of 128, blocks of 64, top-32): T decode rows at each context, the torch
path of ``QSAIndexer._select_group`` (gather, fp32 einsum, ReLU, head sum, masked top-k) against
``qsa_select``; and one 32K-token prompt's rows (``--prefill``).

Router: ``route_ref`` (softmax, ``torch.topk``, renormalise) against ``route_triton`` at 1, 2 and 4 warps.

Hyper-connection residual and mix (``--parts hc``; hc 4 x hidden 2048 or ``--hc-hidden``, low rank 320): for T rows, the
``cublas`` arm is the residual and mix as larger batches run them (the residual-norm kernel, the ``[down;
inject]`` GEMM, the gate kernel, the ``up`` GEMM, the block-input kernel) and the kernel arms are
``hc_norm_down_triton`` then ``hc_mix_tail_triton`` at each launch shape; each of the two alone is timed
for every shape too. Dense GEMV (``--parts gemv``): the
decode step's other projections (router, out projection, the input stacks) through ``F.linear`` and through
``gemv_triton``. Weights rotate over enough copies to exceed the L2 cache (a step reads each once, from HBM).

Prints a table and writes ``DIR/bench_decode_kernels.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib

import torch
import torch.nn.functional as F

from tidal.bench.timing import device_ms, graph_seconds, measure_bandwidth
from tidal.kernels import hyper_connection as hc_k
from tidal.kernels import moe as moe_k
from tidal.kernels.gemv_triton import gemv_triton
from tidal.kernels.hyper_connection_triton import hc_mix_tail_triton, hc_norm_down_triton
from tidal.kernels.moe_decode_triton import GemvConfig, moe_gemv, route_triton
from tidal.kernels.moe_triton import silu_mul
from tidal.kernels.qsa import pick_blocks
from tidal.kernels.qsa_triton import qsa_select

H, E, K, INTER, S_INTER = 2048, 512, 10, 512, 512
CANDIDATES = [
    (GemvConfig(8, 512, 4), GemvConfig(16, 512, 4)),
    (GemvConfig(16, 512, 4), GemvConfig(16, 512, 4)),
    (GemvConfig(8, 512, 4), GemvConfig(8, 512, 4)),
    (GemvConfig(8, 512, 4), GemvConfig(32, 512, 4)),
    (GemvConfig(8, 512, 4), GemvConfig(64, 512, 8)),
    (GemvConfig(8, 1024, 4), GemvConfig(32, 512, 4)),
    (GemvConfig(4, 1024, 4), GemvConfig(32, 512, 4)),
    (GemvConfig(4, 2048, 8), GemvConfig(32, 512, 4)),
    (GemvConfig(2, 2048, 4), GemvConfig(32, 512, 4)),
]


def graph_us(fn, replays: int = 200) -> float:
    """Microseconds a call of ``fn`` takes, replayed from a CUDA graph ``replays`` times back to back."""
    return graph_seconds(fn, calls=1, replays=replays, samples=3) * 1e6


def grouped_moe(x, logits, gate_up, down, s_gate_up, s_down, s_gate):
    """The layer's MoE as it ran before the GEMV kernels (route_ref + grouped GEMMs + shared expert)."""
    weights, ids = moe_k.route_ref(logits, K, True)
    routed = moe_k.fused_experts(x, ids, weights, gate_up, down)
    shared = F.linear(silu_mul(F.linear(x, s_gate_up)), s_down)
    return routed + torch.sigmoid(F.linear(x, s_gate)) * shared


def gemv_moe(x, logits, gate_up, down, shared, cfg):
    weights, ids = route_triton(logits, K, True)
    return moe_gemv(x, ids, weights, gate_up, down, shared, configs=cfg)


def bench_moe(tokens_list, bw, results):
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    gate_up = (torch.randn(E, 2 * INTER, H, generator=g, device="cuda") / H ** 0.5).to(dt)
    down = (torch.randn(E, H, INTER, generator=g, device="cuda") / INTER ** 0.5).to(dt)
    s_gate_up = (torch.randn(2 * S_INTER, H, generator=g, device="cuda") / H ** 0.5).to(dt)
    s_down = (torch.randn(H, S_INTER, generator=g, device="cuda") / S_INTER ** 0.5).to(dt)
    s_gate = (torch.randn(1, H, generator=g, device="cuda") / H ** 0.5).to(dt)
    print(f"{'MoE T':>6} {'grouped us':>11} {'gemv us (best)':>15} {'config':>34} {'floor us':>9} {'floor/gemv':>10}")
    for t in tokens_list:
        x = torch.randn(t, H, generator=g, device="cuda").to(dt)
        logits = torch.randn(t, E, generator=g, device="cuda").to(dt)
        grouped = graph_us(functools.partial(grouped_moe, x, logits, gate_up, down, s_gate_up, s_down, s_gate))
        arms = {str(cfg): graph_us(functools.partial(gemv_moe, x, logits, gate_up, down, (s_gate_up, s_down, s_gate),
                                                     cfg))
                for cfg in CANDIDATES}
        best = min(arms, key=arms.get)
        _, ids = moe_k.route_ref(logits, K, True)
        distinct = int(ids.unique().numel())
        floor_us = (distinct * 3 * H * INTER + 3 * H * S_INTER + H) * 2 / bw * 1e6
        print(f"{t:>6} {grouped:>11.1f} {arms[best]:>15.1f} {best[:34]:>34} {floor_us:>9.1f} "
              f"{floor_us / arms[best]:>10.3f}")
        results["moe"].append({"tokens": t, "grouped_us": grouped, "gemv_us": arms, "best": best,
                               "distinct_experts": distinct, "floor_us": floor_us})


def bench_route(results):
    """The router's softmax top-k alone: torch (softmax, topk, renormalise) against the kernel at 1, 2
    and 4 warps, for a decode token, a batch of 32 and a 32K-token prompt."""
    g = torch.Generator(device="cuda").manual_seed(2)
    print(f"{'route T':>8} {'torch us':>9} {'1 warp':>8} {'2 warps':>8} {'4 warps':>8}")
    for t in (1, 32, 32768):
        logits = torch.randn(t, E, generator=g, device="cuda").to(torch.bfloat16)
        ref = graph_us(functools.partial(moe_k.route_ref, logits, K, True), replays=50)
        warps = {w: graph_us(functools.partial(route_triton, logits, K, True, w), replays=50) for w in (1, 2, 4)}
        print(f"{t:>8} {ref:>9.1f} {warps[1]:>8.1f} {warps[2]:>8.1f} {warps[4]:>8.1f}")
        results["route"].append({"tokens": t, "torch_us": ref, "kernel_us_by_warps": warps})


def torch_select(index_q, keys_flat, key_rows, positions, ratio, width):
    """``QSAIndexer._select_group`` for decode rows (one query a segment), as the torch path runs it."""
    seg_keys = keys_flat[key_rows].float()
    scores = torch.einsum("nthd,nbd->nthb", index_q[:, None].float(), seg_keys).relu_().sum(dim=2)
    scores = scores * index_q.shape[-1] ** -0.5
    return pick_blocks(scores, ((positions + 1) // ratio)[:, None], width)[:, 0]


def bench_qsa(tokens_list, contexts, prefill, results):
    g = torch.Generator(device="cuda").manual_seed(1)
    dt, hi, di, ratio, width = torch.bfloat16, 16, 128, 64, 32
    print(f"{'QSA T':>6} {'context':>8} {'torch us':>9} {'kernel us':>10}")
    for ctx in contexts:
        blocks = ctx // ratio
        for t in tokens_list:
            keys = torch.randn(t * blocks + 1, di, generator=g, device="cuda").to(dt)
            key_rows = torch.randperm(t * blocks, generator=g, device="cuda").view(t, blocks)
            q = torch.randn(t, hi, di, generator=g, device="cuda").to(dt)
            pos = torch.full((t,), ctx - 1, device="cuda")
            seg = torch.arange(t, device="cuda")
            ref = graph_us(functools.partial(torch_select, q, keys, key_rows, pos, ratio, width))
            fast = graph_us(functools.partial(qsa_select, q, keys, key_rows, seg, pos, blocks, ratio, width))
            print(f"{t:>6} {ctx:>8} {ref:>9.1f} {fast:>10.1f}")
            results["qsa"].append({"tokens": t, "context": ctx, "torch_us": ref, "kernel_us": fast})
    if prefill:
        blocks = prefill // ratio
        keys = torch.randn(blocks, di, generator=g, device="cuda").to(dt)
        key_rows = torch.arange(blocks, device="cuda")[None]
        q = torch.randn(prefill, hi, di, generator=g, device="cuda").to(dt)
        pos = torch.arange(prefill, device="cuda")
        seg = torch.zeros(prefill, dtype=torch.long, device="cuda")
        ms = device_ms(functools.partial(qsa_select, q, keys, key_rows, seg, pos, blocks, ratio, width),
                       torch.device("cuda"), samples=5)["ms"]
        print(f"QSA select, one {prefill}-token prompt: {ms:.3f} ms a layer")
        results["qsa_prefill"] = {"tokens": prefill, "kernel_ms": ms}


HC, LOWRANK = 4, 320
L2_BYTES = 50 << 20


def copies_beyond_l2(nbytes: int) -> int:
    """How many copies of ``nbytes`` of weights fill twice the L2 cache (at least 2)."""
    return max(2, -(-2 * L2_BYTES // nbytes))


def rotated_us(fn, weights) -> float:
    """Microseconds of one ``fn(*w)``, the graph running it once for every entry of ``weights`` in turn."""
    return graph_us(lambda: [fn(*w) for w in weights], replays=50) / len(weights)


def bench_hc(tokens_list, bw, results, hidden: int = H):
    g = torch.Generator(device="cuda").manual_seed(3)
    dt, width = torch.bfloat16, HC * hidden
    stack_rows = LOWRANK + HC + 4  # padded to a multiple of 8 rows, as StackedWeight does
    nbytes = (stack_rows + LOWRANK) * width * 2
    weights = [((torch.randn(stack_rows, width, generator=g, device="cuda") / width ** 0.5).to(dt),
                (torch.randn(width, LOWRANK, generator=g, device="cuda") / LOWRANK ** 0.5).to(dt))
               for _ in range(copies_beyond_l2(nbytes))]
    norm_w = (0.2 * torch.randn(width, generator=g, device="cuda")).to(dt)
    floor_us = nbytes / bw * 1e6
    print(f"HC residual + mix (hidden {hidden}): {len(weights)} weight copies, floor {floor_us:.2f} us")

    def cublas(streams, pending, stack, up):
        _, normed = hc_k.hc_residual_norm(streams, *pending, HC, norm_w, 1e-6)
        down, logits = F.linear(normed, stack)[:, :LOWRANK + HC].split([LOWRANK, HC], dim=-1)
        return hc_k.hc_block_input(normed, F.linear(hc_k.hc_gate_act(down, HC), up), HC), logits

    def norm_down_arm(streams, pending, block_n, warps, stack, up):
        return hc_norm_down_triton(streams, pending, HC, norm_w, 1e-6, stack, block_n=block_n, num_warps=warps)

    def tail_arm(down, normed, block_h, warps, stack, up):
        return hc_mix_tail_triton(down, up, normed, HC, block_h=block_h, num_warps=warps)

    def kernels(streams, pending, block_n, warps, block_h, tail_warps, stack, up):
        _, normed, y = hc_norm_down_triton(streams, pending, HC, norm_w, 1e-6, stack, block_n=block_n,
                                           num_warps=warps)
        return hc_mix_tail_triton(y[:, :LOWRANK], up, normed, HC, block_h=block_h, num_warps=tail_warps), y

    for t in tokens_list:
        streams = torch.randn(t, width, generator=g, device="cuda").to(dt)
        pending = (torch.randn(t, hidden, generator=g, device="cuda").to(dt), torch.randn(t, HC, generator=g,
                                                                                    device="cuda").to(dt))
        row = {"tokens": t, "floor_us": floor_us,
               "cublas_us": rotated_us(functools.partial(cublas, streams, pending), weights)}
        line = f"HC T={t:>3} residual norm + cublas {row['cublas_us']:6.2f} us"
        if t <= 8:
            normed = torch.randn(t, width, generator=g, device="cuda").to(dt)
            down = torch.randn(t, stack_rows, generator=g, device="cuda").to(dt)[:, :LOWRANK]
            first = {(bn, w): rotated_us(functools.partial(norm_down_arm, streams, pending, bn, w), weights)
                     for bn in (1, 2, 4) for w in (4, 8, 16)}
            tail = {(bh, w): rotated_us(functools.partial(tail_arm, down, normed, bh, w), weights)
                    for bh in (1, 2, 4, 8) for w in (1, 2, 4)}
            (bn, w), (bh, w2) = min(first, key=first.get), min(tail, key=tail.get)
            row["norm_down_us"] = {f"bn{k[0]}/w{k[1]}": v for k, v in first.items()}
            row["tail_us"] = {f"bh{k[0]}/w{k[1]}": v for k, v in tail.items()}
            first_best, tail_best = f"bn{bn}/w{w}", f"bh{bh}/w{w2}"
            best = functools.partial(kernels, streams, pending, bn, w, bh, w2)
            row["kernels_us"] = rotated_us(best, weights)
            row["best"] = (first_best, tail_best)
            line += (f"  kernels {row['kernels_us']:6.2f} us ({first_best} {row['norm_down_us'][first_best]:.2f} + "
                     f"{tail_best} {row['tail_us'][tail_best]:.2f})  floor/kernels {floor_us / row['kernels_us']:.3f}")
            got, want = best(*weights[0])[0], cublas(streams, pending, *weights[0])[0]
            row["max_abs_diff"] = float((got.float() - want.float()).abs().max())
        print(line, flush=True)
        results["hc"].append(row)


def bench_gemv(tokens_list, bw, results):
    g = torch.Generator(device="cuda").manual_seed(4)

    def gemv_arm(x, tile, warps, w):
        return gemv_triton(x, w, tile=tile, num_warps=warps)

    for name, (n, k) in {"router": (512, H), "out projection": (H, 4096), "attention [q; k; v; index]": (11392, H),
                         "GDN [qkv; z; b; a]": (12352, H)}.items():
        weights = [((torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).to(torch.bfloat16),)
                   for _ in range(copies_beyond_l2(n * k * 2))]
        floor_us = n * k * 2 / bw * 1e6
        for t in (t for t in tokens_list if t <= 8):
            x = torch.randn(t, k, generator=g, device="cuda").to(torch.bfloat16)
            gemv = {f"tile{tile}/w{nw}": rotated_us(functools.partial(gemv_arm, x, tile, nw), weights)
                    for tile in (2048, 4096, 8192, 16384) for nw in (4, 8)}
            row = {"weight": name, "out": n, "in": k, "tokens": t, "floor_us": floor_us,
                   "cublas_us": rotated_us(functools.partial(F.linear, x), weights), "gemv_us": gemv}
            best = min(gemv, key=gemv.get)
            print(f"GEMV {name:>28} T={t} cublas {row['cublas_us']:6.2f}  gemv {gemv[best]:6.2f} ({best})"
                  f"  floor {floor_us:6.2f}", flush=True)
            results["gemv"].append(row)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,2,4,8,16,32,48,64")
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--prefill", type=int, default=32768)
    ap.add_argument("--parts", default="route,moe,qsa")
    ap.add_argument("--hc-hidden", type=int, default=H, help="features a stream of the hc part (flash-next: 2560)")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    bw = measure_bandwidth(torch.device("cuda"))["bytes_per_s"]
    print(f"device copy bandwidth: {bw / 1e12:.2f} TB/s")
    results = {"bandwidth_bytes_per_s": bw, "moe": [], "qsa": [], "route": [], "hc": [], "gemv": []}
    parts = args.parts.split(",")
    if "route" in parts:
        bench_route(results)
    if "hc" in parts:
        bench_hc(tokens, bw, results, args.hc_hidden)
    if "gemv" in parts:
        bench_gemv(tokens, bw, results)
    if "moe" in parts:
        bench_moe(tokens, bw, results)
    if "qsa" in parts:
        bench_qsa([t for t in tokens if t in (1, 8, 32)], [int(c) for c in args.contexts.split(",")], args.prefill,
                  results)
    (out / "bench_decode_kernels.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
