"""The dense projections of a decode step, as cuBLAS runs them, in two weight layouts (device-only).

    python benchmarks/bench_decode_gemm.py [--preset bench] [--rows 1,8,32]

For every distinct projection shape of the preset (rows x out x in, bf16), the time of ``F.linear(x, W)``
with ``W [out, in]`` as the model stores it (cuBLAS "TN") and of ``x @ Wt`` with the same weight stored
transposed, ``Wt [in, out]`` ("NN"): each call captured 20 times in a CUDA graph and replayed (no launch
gaps from Python), median of 10 replays per call; beside them the time the weight's bytes take at the
HBM bandwidth measured in the same run (a device-to-device copy, bytes read + written). Prints a table.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.nn.functional as F

from tidal.bench.timing import graph_seconds, measure_bandwidth
from tidal.config.model import ModelConfig
from tidal.executor.layers.linear import StackedWeight
from tidal.executor.models.qwen4_exp import Qwen4ExpForCausalLM
from tidal.executor.presets import write_checkpoint

CALLS = 20


def shapes(preset: str) -> dict[tuple[int, int], list[str]]:
    """(out, in) of every weight a decode step multiplies by as it runs (stacked projections as their
    stacks; not experts, embeddings or lm_head), with the names that have it."""
    config = ModelConfig.from_file(write_checkpoint(preset, tempfile.mkdtemp(), weights=False))
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(config)

    def short(name: str) -> str:
        return ".".join(part for part in name.split(".") if not part.isdigit() and part not in ("model", "layers"))

    names = {id(p): short(n).removesuffix(".weight") for n, p in model.named_parameters()}
    out: dict[tuple[int, int], list[str]] = {}

    def add(shape: tuple[int, int], name: str) -> None:
        if name not in out.setdefault(shape, []):
            out[shape].append(name)

    stacked = set()
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, StackedWeight):
                weights = [lin.weight for lin in value.linears]
                stacked.update(id(w) for w in weights)
                add((sum(value.sizes), weights[0].shape[1]), "[" + "; ".join(names[id(w)] for w in weights) + "]")
    for name, param in model.named_parameters():
        if (param.dim() == 2 and id(param) not in stacked and "experts" not in name and "embed" not in name
                and name != "lm_head.weight"):
            add(tuple(param.shape), names[id(param)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--rows", default="1,8,32")
    ns = ap.parse_args()
    bw = measure_bandwidth(torch.device("cuda"))["bytes_per_s"]
    print(f"bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    print(f"{'rows':>4} {'out':>6} {'in':>6} {'TN us':>7} {'NN us':>7} {'floor us':>8}  weights")
    for (n, k), names in sorted(shapes(ns.preset).items(), key=lambda item: -item[0][0] * item[0][1]):
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        wt = w.t().contiguous()
        floor = n * k * 2 / bw
        for m in (int(r) for r in ns.rows.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            tn = graph_seconds(lambda x=x, w=w: F.linear(x, w), calls=CALLS)
            nn_ = graph_seconds(lambda x=x, wt=wt: x @ wt, calls=CALLS)
            print(f"{m:>4} {n:>6} {k:>6} {tn * 1e6:7.2f} {nn_ * 1e6:7.2f} {floor * 1e6:8.2f}  {', '.join(names)}",
                  flush=True)


if __name__ == "__main__":
    main()
