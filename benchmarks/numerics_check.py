"""bf16 against float32 on one device: teacher-forced agreement, and greedy ids that chunking and a
prefix-cache hit must not change.

    python benchmarks/numerics_check.py --out DIR [--preset small] [--tokens 2048] [--device cuda]
        [--chunk 1000] [--greedy-tokens 32] [--bisect 'torch;torch:moe,route']
        [--quantization nvfp4 [--reference-kernels torch:nvfp4]]

With ``--quantization`` the preset is written with its routed experts and n-gram table in that published
layout, and the teacher-forced baseline is the same checkpoint in bf16 on its reference path
(``TIDAL_KERNELS=--reference-kernels``, by default the experts dequantized before the grouped GEMM): the
gates then measure what the kernels that read the stored format change, with ``mean_abs_nll_diff`` <= 0.01.

The preset is written with seeded weights (``write_checkpoint(preset, dir, seed=0)``); the prompt is
``--tokens`` ids drawn with ``torch.Generator().manual_seed(0)`` from [1000, 240000), with the config's
EOS id in the middle (n-gram history resets there).

Gates (the seed write-up's teacher-forced protocol, fp32 as the baseline):

* ``top1_agreement``: over positions whose fp32 top-2 log-prob margin is >= 0.2 nats, the share where
  the bf16 argmax equals the fp32 argmax; >= 0.99 (and at least one such position);
* ``mean_abs_nll_diff``: mean over positions of |NLL_bf16 - NLL_fp32| of the next prompt token; <= 0.02;
* ``greedy_ids_equal``: in bf16, ``--greedy-tokens`` greedy ids (``ignore_eos``) of the cold prompt equal
  those with ``max_prefill_length=--chunk`` (forwards of ``--chunk`` rounded down to a multiple of 64:
  960 tokens by default) and those of the same prompt run again on the cold run's
  LLM, which hits the prefix cache (its ``cached_tokens`` counter is reported and must be > 0 when the
  scheduler exposes counters).

The fp32 baseline runs on the device's default kernels; where they refuse fp32 (flash-linear-attention's
chunked GDN asserts on it) it runs on the torch references instead (``TIDAL_KERNELS=torch``), and
``teacher_forced.reference_kernels`` says which. TF32 is off for it.

It also reports, without gating, whether the device's GEMMs (dense, at every weight shape the model
runs, and grouped) give a row the same result whatever the number of rows beside it, for the row counts
the greedy runs meet: the remaining condition for chunked prefill to compute exactly what one forward
does; and whether the cold run repeated in a fresh engine gives the same ids
(run-to-run reproducibility, without which no chunking difference can be told apart).

Where a greedy run leaves the cold ids it prints the output index and the cold run's bf16 top-2 margin
there. ``--bisect`` runs the greedy part again under each listed ``TIDAL_KERNELS`` value (whole runs
on the references, or named operations only) and reports which keep the ids equal; it does not change
the gates.

Prints PASS/FAIL per gate, writes ``DIR/numerics_check.json``, exits 1 when a gate fails.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import tempfile
import time
from typing import Any

import torch

from tidal import LLM
from tidal.config.model import ModelConfig
from tidal.executor.presets import write_checkpoint
from tidal.kernels.backend import parse_setting
from tidal.scheduler.chunking import chunk_step

MARGIN = 0.2
MIN_AGREEMENT = 0.99
MAX_NLL_DIFF = 0.02
MAX_NLL_DIFF_QUANTIZED = 0.01
ROWS = 256  # log-softmax rows at a time: [ROWS, vocab] fp32 stays small


def build_prompt(config: ModelConfig, tokens: int) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 240000, (tokens,), generator=gen)
    if config.eos_token_ids:
        ids[tokens // 2] = config.eos_token_ids[0]
    return ids.tolist()


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


@contextlib.contextmanager
def kernels(value: str):
    """``TIDAL_KERNELS=value`` inside, the previous setting after."""
    previous = os.environ.get("TIDAL_KERNELS")
    os.environ["TIDAL_KERNELS"] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TIDAL_KERNELS", None)
        else:
            os.environ["TIDAL_KERNELS"] = previous


def score(ckpt: str, device: str, dtype: str, prompt: list[int]) -> torch.Tensor:
    llm = LLM(ckpt, device=device, dtype=dtype)
    try:
        return llm.score(prompt)
    finally:
        del llm
        free(device)


def score_fp32(ckpt: str, device: str, prompt: list[int]) -> tuple[torch.Tensor, str]:
    """The fp32 baseline on the device's default kernels; if those refuse fp32 (flash-linear-attention
    does), on the torch references (``TIDAL_KERNELS=torch``), and the JSON says which."""
    try:
        return score(ckpt, device, "float32", prompt), "default"
    except Exception as e:
        if not device.startswith("cuda"):
            raise
        reason = f"{type(e).__name__}: {e}"[:300]
        print(f"fp32 on the default kernels failed ({reason}); fp32 baseline on TIDAL_KERNELS=torch", flush=True)
    free(device)  # the failed model was still referenced by the exception's traceback
    with kernels("torch"):
        return score(ckpt, device, "float32", prompt), f"torch (default failed: {reason})"


def compare_logits(ref: torch.Tensor, test: torch.Tensor, prompt: list[int]) -> dict[str, Any]:
    """Teacher-forced comparison of two ``[L, vocab]`` logit tensors (row i predicts token i + 1)."""
    target = torch.tensor(prompt[1:], dtype=torch.long)
    nll_ref, nll_test, margins, agree = [], [], [], []
    for lo in range(0, ref.shape[0], ROWS):
        a = torch.log_softmax(ref[lo:lo + ROWS].float(), dim=-1)
        b = torch.log_softmax(test[lo:lo + ROWS].float(), dim=-1)
        top2 = a.topk(2, dim=-1).values
        margins.append(top2[:, 0] - top2[:, 1])
        agree.append(a.argmax(dim=-1) == b.argmax(dim=-1))
        rows = torch.arange(lo, min(lo + ROWS, ref.shape[0] - 1))
        if rows.numel():
            nll_ref.append(-a[rows - lo, target[rows]])
            nll_test.append(-b[rows - lo, target[rows]])
    margin, same = torch.cat(margins), torch.cat(agree)
    diff = (torch.cat(nll_test) - torch.cat(nll_ref)).abs()
    strong = margin >= MARGIN
    count = int(strong.sum())
    return {
        "positions": int(ref.shape[0]),
        "mean_abs_nll_diff": float(diff.mean()),
        "max_abs_nll_diff": float(diff.max()),
        "mean_nll_reference": float(torch.cat(nll_ref).mean()),
        "mean_nll_test": float(torch.cat(nll_test).mean()),
        "margin_threshold": MARGIN,
        "strong_margin_positions": count,
        "top1_agreement": float(same[strong].float().mean()) if count else None,
        "top1_agreement_all_positions": float(same.float().mean()),
        "max_abs_logit_diff": float((ref - test).abs().max()),
    }


def greedy(ckpt: str, device: str, prompt: list[int], tokens: int, chunk: int) -> dict[str, Any]:
    """bf16 greedy ids: cold, cold again in a fresh engine, chunked, and the same prompt again after the
    cold run (a cache hit); where a run leaves the cold ids, the index and the cold run's bf16 top-2
    margin there (scored teacher-forced)."""
    llm = LLM(ckpt, device=device, dtype="bfloat16")
    cold = llm.generate([prompt], max_tokens=tokens, ignore_eos=True)[0]
    counters = getattr(llm.scheduler, "counters", None)
    before = dict(counters) if isinstance(counters, dict) else None
    cached = llm.generate([prompt], max_tokens=tokens, ignore_eos=True)[0]
    hit = None
    if before is not None and "cached_tokens" in counters:
        hit = int(counters["cached_tokens"] - before.get("cached_tokens", 0))
    # Teacher-forced over the prompt and the cold outputs: row len(prompt) - 1 + i predicts output i.
    sequence = prompt + cold[:-1]
    whole = llm.score(sequence)
    top2 = torch.log_softmax(whole[len(prompt) - 1:].float(), dim=-1).topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    del llm
    free(device)
    # The cold run again in a fresh engine: whether the greedy ids are reproducible at all, which tells a
    # chunking difference from run-to-run nondeterminism.
    llm = LLM(ckpt, device=device, dtype="bfloat16")
    again = llm.generate([prompt], max_tokens=tokens, ignore_eos=True)[0]
    del llm
    free(device)
    llm = LLM(ckpt, device=device, dtype="bfloat16", max_prefill_length=chunk)
    chunked = llm.generate([prompt], max_tokens=tokens, ignore_eos=True)[0]
    # What chunking alone changes: the same sequence scored in chunks against in one forward, over the
    # rows after the first forward (empty when one forward holds the whole sequence).
    diff = (llm.score(sequence)[chunk_step(chunk):] - whole[chunk_step(chunk):]).abs().flatten()
    diff = diff if diff.numel() else torch.zeros(1)
    del llm, whole
    free(device)
    out: dict[str, Any] = {"cold": cold, "cold_again": again, "chunked": chunked, "cached": cached, "chunk": chunk,
                           "cached_tokens": hit,
                           "cold_margins": margins, "min_cold_margin": min(margins),
                           "chunked_logit_diff": {"max": float(diff.max()), "mean": float(diff.mean())}}
    print(f"greedy: logits scored in chunks of {chunk} against one forward, rows after the first chunk: "
          f"max |diff| {diff.max():.4f}, mean {diff.mean():.5f}; cold outputs' top-2 margins: smallest "
          f"{min(margins):.4f}, {sum(m < 0.05 for m in margins)} of {len(margins)} under 0.05 nats", flush=True)
    for name, ids in (("cold_again", again), ("chunked", chunked), ("cached", cached)):
        first = next((i for i, (a, b) in enumerate(zip(cold, ids, strict=True)) if a != b), None)
        out[f"{name}_first_difference"] = first
        if first is not None:
            print(f"greedy: {name} leaves the cold ids at output {first} (cold run's bf16 top-2 margin there "
                  f"{margins[first]:.4f} nats; smallest over the outputs {min(margins):.4f})", flush=True)
    return out


def linear_shapes(ckpt: str, device: str, prompt: list[int]) -> list[tuple[int, int]]:
    """The ``(in, out)`` weight shapes of every ``F.linear`` the bf16 model runs (a short prompt and a
    decode step), in first-call order: the GEMMs whose row invariance chunked prefill depends on."""
    shapes: dict[tuple[int, int], None] = {}
    linear = torch.nn.functional.linear

    def recording(x, weight, bias=None):
        shapes.setdefault((int(weight.shape[1]), int(weight.shape[0])))
        return linear(x, weight, bias)

    llm = LLM(ckpt, device=device, dtype="bfloat16")
    torch.nn.functional.linear = recording
    try:
        llm.generate([prompt[:300]], max_tokens=2, ignore_eos=True)
    finally:
        torch.nn.functional.linear = linear
    del llm
    free(device)
    return list(shapes)


def gemm_row_invariance(device: str, shapes: list[tuple[int, int]], whole_rows: int, row_counts: list[int],
                        dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Whether a GEMM row's result depends on how many rows share the GEMM (what batch-invariant chunked
    prefill needs): rows of ``x[:m] @ w.T`` against the same rows of ``x @ w.T`` (``whole_rows`` rows),
    for the model's own weight shapes and the row counts its greedy runs meet (``row_counts``: whole
    forwards, chunks, the tail after a cache hit; larger counts compare their first ``whole_rows`` rows);
    and a grouped GEMM whose groups hold fewer rows. Informational: reported, not a gate."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    out: dict[str, Any] = {}
    for k, n in shapes:
        x = torch.randn(max([whole_rows, *row_counts]), k, generator=gen).to(device, dtype)
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, dtype)
        whole = torch.nn.functional.linear(x[:whole_rows], w)
        for m in row_counts:
            part = torch.nn.functional.linear(x[:m], w)
            rows = min(m, whole_rows)
            out[f"linear {m}x{k}x{n}"] = float((part[:rows].float() - whole[:rows].float()).abs().max())
    from tidal.kernels.moe import _grouped_mm, grouped_mm_supported

    x = torch.randn(2048, 1024, generator=gen).to(device, dtype)
    if _grouped_mm is not None and grouped_mm_supported(x):
        w = (torch.randn(8, 512, 1024, generator=gen) / 32).to(device, dtype)
        full = _grouped_mm(x, w.transpose(1, 2), offs=torch.arange(256, 2049, 256, device=device, dtype=torch.int32))
        half = _grouped_mm(x[:1024], w.transpose(1, 2),
                           offs=torch.tensor([128 * (i + 1) for i in range(8)], device=device, dtype=torch.int32))
        # Rows 0..127 are expert 0's in both; the rest of the groups are smaller in ``half``.
        out["grouped 128 of 256 rows, expert 0"] = float((half[:128].float() - full[:128].float()).abs().max())
    varying = {name: value for name, value in out.items() if value}
    print(f"gemm rows: {len(varying)} of {len(out)} (shape, row count) pairs give a row another result than "
          f"among {whole_rows} rows", flush=True)
    for name, value in varying.items():
        print(f"gemm rows: {name}: max |part - whole| {value:.3g}", flush=True)
    return out


def gate(name: str, value: Any, threshold: str, ok: bool) -> dict[str, Any]:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {value} ({threshold})", flush=True)
    return {"name": name, "value": value, "threshold": threshold, "pass": ok}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for numerics_check.json")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--chunk", type=int, default=1000, help="max_prefill_length of the chunked greedy run")
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--quantization", default=None, choices=["nvfp4", "fp8"],
                    help="write the preset in this layout; the baseline is then its reference path in bf16")
    ap.add_argument("--reference-kernels", default="torch:nvfp4",
                    help="with --quantization: TIDAL_KERNELS of the baseline")
    ap.add_argument("--bisect", default="", help="';'-separated TIDAL_KERNELS values (e.g. 'torch;torch:moe,route'): "
                    "the greedy runs again under each, to find the kernel a greedy difference comes from")
    ns = ap.parse_args(argv)
    bisect_values = [v.strip() for v in ns.bisect.split(";") if v.strip()]
    for value in [*bisect_values, ns.reference_kernels]:  # a typo fails now, not after the scoring
        parse_setting(value)
    if bisect_values and not ns.device.startswith("cuda"):
        print("--bisect: the CPU runs the torch references whatever TIDAL_KERNELS says", flush=True)
    # The fp32 baseline is exact fp32: no TF32 in matmuls or cuDNN convs.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(ns.out, exist_ok=True)
    path = os.path.join(ns.out, "numerics_check.json")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tidal-numerics-") as ckpt:
        write_checkpoint(ns.preset, ckpt, seed=0, quantize=ns.quantization)
        config = ModelConfig.from_file(ckpt)
        prompt = build_prompt(config, ns.tokens)
        if ns.quantization:
            with kernels(ns.reference_kernels):
                reference, reference_kernels = score(ckpt, ns.device, "bfloat16", prompt), ns.reference_kernels
        else:
            reference, reference_kernels = score_fp32(ckpt, ns.device, prompt)
        bf16 = score(ckpt, ns.device, "bfloat16", prompt)
        forced = compare_logits(reference, bf16, prompt)
        forced["reference_kernels"] = reference_kernels
        del reference, bf16
        ids = greedy(ckpt, ns.device, prompt, ns.greedy_tokens, ns.chunk)
        # The row counts the greedy runs meet: the whole prompt, its chunks (the last one of the prompt and
        # of the scored sequence), the tail a cache hit recomputes, one decode row, the scored sequence.
        step = chunk_step(ns.chunk)
        scored = len(prompt) + ns.greedy_tokens - 1
        tail = len(prompt) - (ids["cached_tokens"] or len(prompt))
        counts = sorted({1, step, len(prompt) - (len(prompt) - 1) // step * step,
                         scored - (scored - 1) // step * step, scored, *([tail] if tail else [])})
        gemm_rows = gemm_row_invariance(ns.device, linear_shapes(ckpt, ns.device, prompt), len(prompt), counts)
        bisect = {}
        for value in bisect_values:
            with kernels(value):
                run = greedy(ckpt, ns.device, prompt, ns.greedy_tokens, ns.chunk)
            bisect[value] = run
            print(f"bisect TIDAL_KERNELS={value}: cold == chunked {run['cold'] == run['chunked']}, "
                  f"cold == cached {run['cold'] == run['cached']}, first differences chunked "
                  f"{run['chunked_first_difference']} cached {run['cached_first_difference']}", flush=True)

    agreement, count = forced["top1_agreement"], forced["strong_margin_positions"]
    same = ids["cold"] == ids["chunked"] == ids["cached"]
    hit_ok = ids["cached_tokens"] is None or ids["cached_tokens"] > 0
    max_nll = MAX_NLL_DIFF_QUANTIZED if ns.quantization else MAX_NLL_DIFF
    baseline = "reference" if ns.quantization else "fp32"
    gates = [
        gate("top1_agreement", agreement,
             f">= {MIN_AGREEMENT} over {count} positions with {baseline} margin >= {MARGIN}",
             agreement is not None and agreement >= MIN_AGREEMENT),
        gate("mean_abs_nll_diff", forced["mean_abs_nll_diff"], f"<= {max_nll} nats",
             math.isfinite(forced["mean_abs_nll_diff"]) and forced["mean_abs_nll_diff"] <= max_nll),
        gate("greedy_ids_equal", same, f"cold == chunked ({ns.chunk}) == prefix-cache hit "
             f"({ids['cached_tokens']} cached tokens)", same and hit_ok),
    ]
    passed = all(g["pass"] for g in gates)
    results = {
        "meta": {"script": "benchmarks/numerics_check.py", "preset": ns.preset, "tokens": ns.tokens,
                 "quantization": ns.quantization,
                 "device": ns.device, "device_name": torch.cuda.get_device_name(ns.device)
                 if ns.device.startswith("cuda") else "cpu", "torch": torch.__version__,
                 "seconds": time.monotonic() - t0},
        "teacher_forced": forced, "greedy": ids, "greedy_bisect": bisect, "gemm_row_invariance": gemm_rows,
        "gates": gates, "pass": passed,
    }
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"{'PASS' if passed else 'FAIL'}: wrote {path}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
