"""Forward benchmark of tidal on one device: prefill MFU, decode against its HBM floor, kernels
against their roofline, and transformers' ``Qwen4ExpForCausalLM`` as the peer.

    python benchmarks/bench_forward.py --out DIR [--preset bench] [--layers N] [--lengths 4096,8192,32768]
        [--decode-batches 1,8,32] [--decode-context 512] [--decode-steps 32] [--decode-graphs on,off]
        [--peer/--no-peer]
        [--peer-max-seconds 60] [--kernels/--no-kernels] [--kernel-tokens 32768] [--kernel-batch 8]
        [--kernel-context 8192] [--kernel-budget-s 110] [--tidal/--no-tidal] [--merge]
        [--device cuda] [--dtype bfloat16] [--quantization bf16,nvfp4] [--ple-backend gpu]

The preset's config.json is written to a temporary directory and loaded with ``--load-format random``.
Prefill and decode drive ``llm.runner.execute(Batch)`` directly (no scheduler), one cold prefill of L
random ids per forward, timed on the host with a device synchronisation on each side; decode steps replay
CUDA graphs (``--decode-graphs on``) or run eagerly (``off``), one arm after the other on the same model.
With graphs, a second arm ("pipelined") runs the steps as the server's executor does when the scheduler
sends each decode ahead: every step launched (token -1) before the one before it is finished, timed
back to back.
Every number goes to ``DIR/bench_forward.json``, rewritten after each section (a run cut short keeps what it measured;
``--merge`` keeps the sections of an earlier file of the same preset, dtype and device that this run
skips, so the sections can run as separate commands). Peak matmul throughput (a square GEMM of
``--dtype``, 8192 on CUDA) and HBM bandwidth (a device-to-device copy, bytes read + written) are
measured in the same run, median of 10 after warm-up, and are the denominators of MFU and roofline.

Kernels (``--kernels``): each case names its fast path, torch reference and library version
(flash-linear-attention, torch SDPA, torch grouped GEMM), imported lazily: one that is not there is
reported ``missing``, one that fails ``error``, one that needs CUDA ``n/a``. Times are CUDA-event medians
after warm-up; a call slower than 1 s (a reference at 32K) is timed once (``samples: 1``). Cases left
when ``--kernel-budget-s`` runs out are ``skipped``. The roofline fraction is
max(bytes / bandwidth, FLOPs / peak) / time, with each case's bytes and FLOPs in the JSON.

Model FLOPs of one prefill forward of L tokens (``FLOP_FORMULA``; every term is in the JSON)::

    2 * L * (MACs per token of every projection actually computed)
  + L * n_gdn * Hv * (4*dk*dv + 2*64*(dk + dv))            # GDN chunked recurrence, approximate
  + n_attn * 4 * head_dim * num_heads * sum_p keys(p)      # attention over the keys attended
  + n_attn * 2 * Hi * di * sum_p ((p + 1) // ratio)        # QSA block scoring (QSA configs)
  + 2 * (2 * hc*H*lowrank + H*V)                           # final HC mixer + lm_head, sampled row only

Projection MACs per token: both hyper-connections of every layer (down hc*H->lowrank, up
lowrank->hc*H, inject hc*H->hc); GDN in_proj_qkv H*(2*Hk*dk + Hv*dv), in_proj_z H*Hv*dv, in_proj_b
and in_proj_a H*Hv each, out_proj Hv*dv*H; attention q (with its gate) H*2*nh*hd, k and v H*nkv*hd
each, o nh*hd*H, QSA index_qk_proj H*(Hi + 1)*di; router H*E, routed experts top_k*(2I*H + H*I),
shared expert 3*H*I_shared and its gate H; PLE key_proj P*hc*H and value_proj P*H on PLE layers.
``keys(p)`` for the query at position p: p + 1 (causal) on dense layers; on QSA layers with
n = (p + 1) // ratio complete blocks, min(n, budget / ratio) * ratio + (p + 1 - n * ratio), i.e.
min(p + 1, budget + tail). The GDN term counts the two state GEMMs per token (S^T q and the state
update, 2 * 2*dk*dv) and the two intra-chunk GEMMs of width 64 (q k^T over dk, scores @ v over dv);
it leaves out the WY transform (k_beta k^T, the triangular solves, w S), so it is a lower bound. Not
counted anywhere: embedding lookups, norms, activations, the depthwise convs, rotary, softmax, top-k.

Decode HBM floor of one step of B requests, each with c keys before its new token (``BYTE_FORMULA``)::

    weights: every non-routed projection above (params == MACs per token), the conv taps, the final
             mixer and lm_head, read once
  + B embedding rows (H) + B rows of every PLE n-gram table (P)
  + routed experts: n_layers * E * (1 - (1 - top_k/E)^B) * 3*H*I   (the expected number of distinct
             experts for B tokens under uniformly random routing)
  + per attention layer and request: keys(c) * 2*nkv*hd K/V read, the pooled QSA key of every complete
             block scored ((c + 1) // ratio * di) plus one raw index key (a block's raw keys are pooled
             once, when it completes), the new K, V, index key written
  + per GDN layer and request: the fp32 state Hv*dk*dv*4 read and written, the conv window
             (k - 1) * conv_dim read and written
  + per PLE layer and request: the conv window (k - 1) * ngram_size * hc*H read and written

Weights, KV and conv windows in ``--dtype``; norm vectors and biases (< 0.1%) left out. The floor time
is bytes / measured bandwidth; the report gives floor / measured step time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tidal import LLM
from tidal.bench.timing import device_ms, host_seconds, measure_bandwidth, measure_peak, synchronize
from tidal.config.model import ModelConfig
from tidal.executor.presets import keep_first_layers, write_checkpoint
from tidal.messages import Batch, SegmentSpec

FLOP_FORMULA = (
    "2*L*sum(projection MACs/token) + L*n_gdn*Hv*(4*dk*dv + 2*64*(dk+dv)) "
    "+ n_attn*4*head_dim*num_heads*sum_p keys(p) + n_attn*2*Hi*di*sum_p((p+1)//ratio) "
    "+ 2*(2*hc*H*lowrank + H*V); keys(p) = p+1 dense, min(n, budget/ratio)*ratio + (p+1-n*ratio) QSA "
    "with n = (p+1)//ratio; GDN term omits the WY transform (lower bound)"
)
BYTE_FORMULA = (
    "non-routed weights + conv taps + mixer + lm_head; B*(H + n_ple*P) embedding rows; "
    "n_layers*E*(1-(1-top_k/E)^B)*3*H*I routed (uniform routing expectation); per attention layer and "
    "request keys(c)*2*nkv*hd + QSA pooled keys of complete blocks + one raw index key + new K/V/index key; "
    "per GDN layer "
    "and request 2*Hv*dk*dv*4 state + 2*(k-1)*conv_dim window; per PLE layer and request 2*W*hc*H window"
)
TOKEN_LOW, TOKEN_HIGH = 1000, 240000
DECODE_WARMUP = 3


# ---- timing ---------------------------------------------------------------------------------------
# ---- model arithmetic -----------------------------------------------------------------------------
def projection_macs(c: ModelConfig) -> dict[str, int]:
    """Multiply-adds per token of every projection of the decoder stack, by name, summed over layers."""
    h, hc, r, n = c.hidden_size, c.hc_count, c.hc_lowrank, c.num_hidden_layers
    n_gdn, n_attn, n_ple = len(c.linear_layers), len(c.attention_layers), len(c.ple_layers)
    hv, value_dim = c.linear_num_value_heads, c.linear_num_value_heads * c.linear_value_head_dim
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    index = (c.indexer_n_heads + 1) * c.indexer_head_dim if c.has_qsa else 0
    return {
        "hc.down": n * 2 * hc * h * r,
        "hc.up": n * 2 * r * hc * h,
        "hc.inject": n * 2 * hc * h * hc,
        "gdn.in_proj_qkv": n_gdn * h * c.gdn_conv_dim,
        "gdn.in_proj_z": n_gdn * h * value_dim,
        "gdn.in_proj_b": n_gdn * h * hv,
        "gdn.in_proj_a": n_gdn * h * hv,
        "gdn.out_proj": n_gdn * value_dim * h,
        "attn.q_proj": n_attn * h * 2 * nh * hd,
        "attn.k_proj": n_attn * h * nkv * hd,
        "attn.v_proj": n_attn * h * nkv * hd,
        "attn.o_proj": n_attn * nh * hd * h,
        "qsa.index_qk_proj": n_attn * h * index,
        "moe.router": n * h * c.num_experts,
        "moe.routed": n * c.num_experts_per_tok * 3 * h * c.moe_intermediate_size,
        "moe.shared": n * 3 * h * c.shared_expert_intermediate_size,
        "moe.shared_gate": n * h,
        "ple.key_proj": n_ple * c.ple_embed_dim * hc * h,
        "ple.value_proj": n_ple * c.ple_embed_dim * h,
    }


def head_macs(c: ModelConfig) -> dict[str, int]:
    """Per sampled row: the final hyper-connection mixer (down + up) and lm_head."""
    return {"head.mixer": 2 * c.hc_count * c.hidden_size * c.hc_lowrank, "head.lm_head": c.hidden_size * c.vocab_size}


def attended_keys(c: ModelConfig, positions: torch.Tensor, qsa: bool | None = None) -> torch.Tensor:
    """Keys the query at each position attends to (see the module docstring); ``qsa=False``: causal."""
    visible = positions.long() + 1
    if not (c.has_qsa if qsa is None else qsa):
        return visible
    ratio = c.indexer_compress_ratio
    blocks = visible // ratio
    return torch.clamp(blocks, max=c.qsa_block_topk) * ratio + (visible - blocks * ratio)


def prefill_flops(c: ModelConfig, length: int) -> dict[str, int]:
    """FLOPs of one cold prefill forward of ``length`` tokens sampling its last row, by term."""
    terms = {name: 2 * length * macs for name, macs in projection_macs(c).items()}
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    terms["gdn.recurrence"] = (length * len(c.linear_layers) * c.linear_num_value_heads
                               * (4 * dk * dv + 2 * 64 * (dk + dv)))
    pos = torch.arange(length, dtype=torch.long)
    n_attn = len(c.attention_layers)
    terms["attn.core"] = n_attn * 4 * c.head_dim * c.num_attention_heads * int(attended_keys(c, pos).sum())
    terms["qsa.scoring"] = 0
    if c.has_qsa:
        blocks = int(((pos + 1) // c.indexer_compress_ratio).sum())
        terms["qsa.scoring"] = n_attn * 2 * c.indexer_n_heads * c.indexer_head_dim * blocks
    terms.update({name: 2 * macs for name, macs in head_macs(c).items()})
    return terms


def expert_bytes(c: ModelConfig, fmt: str | None, elem: int) -> int:
    """Bytes of one routed expert (gate, up and down) as tidal stores it: ``elem`` bytes a parameter, or the
    quantized layout ``fmt`` (``nvfp4``: 4.5 bits a weight and an fp32 scale a row; ``fp8``: a byte a weight and
    the 128 x 128 block scales)."""
    h, inter = c.hidden_size, c.moe_intermediate_size
    if fmt is None:
        return 3 * h * inter * elem
    from tidal.executor.quant import empty_experts

    return sum(empty_experts(fmt, 1, parts, cols, "meta").bytes_per_expert()
               for parts, cols in (([inter, inter], h), ([h], inter)))


def decode_bytes(c: ModelConfig, batch: int, context: float, elem: int, fmt: str | None = None) -> dict[str, float]:
    """HBM bytes one decode step of ``batch`` requests must move, by term (module docstring); routed experts in
    ``fmt`` (None: ``elem`` bytes a parameter)."""
    macs = projection_macs(c)
    h, hc = c.hidden_size, c.hc_count
    conv_taps = len(c.linear_layers) * c.gdn_conv_dim * c.linear_conv_kernel_dim
    conv_taps += len(c.ple_layers) * hc * h * c.ple_conv_kernel_size
    dense = sum(v for k, v in macs.items() if k != "moe.routed") + sum(head_macs(c).values()) + conv_taps
    experts = c.num_experts * (1 - (1 - c.num_experts_per_tok / c.num_experts) ** batch)
    pos = torch.tensor([int(round(context))])
    keys = int(attended_keys(c, pos)[0])
    per_token_kv = 2 * c.num_key_value_heads * c.head_dim + (c.indexer_head_dim if c.has_qsa else 0)
    # QSA: the pooled key of every complete block is scored; a block's raw index keys are read once, when
    # its last token arrives (one key a step, amortised).
    index_read = ((int(round(context)) + 1) // c.indexer_compress_ratio + 1) * c.indexer_head_dim if c.has_qsa else 0
    n_attn, n_gdn, n_ple = len(c.attention_layers), len(c.linear_layers), len(c.ple_layers)
    gdn_state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    return {
        "weights.dense": dense * elem,
        "weights.embedding_rows": batch * (h + n_ple * c.ple_embed_dim) * elem,
        "weights.routed_experts": c.num_hidden_layers * experts * expert_bytes(c, fmt, elem),
        "kv.read": n_attn * batch * (keys * 2 * c.num_key_value_heads * c.head_dim + index_read) * elem,
        "kv.write": n_attn * batch * per_token_kv * elem,
        "gdn.state": n_gdn * batch * 2 * gdn_state,
        "gdn.conv_window": n_gdn * batch * 2 * (c.linear_conv_kernel_dim - 1) * c.gdn_conv_dim * elem,
        "ple.conv_window": n_ple * batch * 2 * c.ple_conv_window * hc * h * elem,
    }


def model_parameters(c: ModelConfig) -> int:
    """Parameters the formulas above account for (embedding and PLE tables included, norms left out)."""
    macs = projection_macs(c)
    routed = c.num_hidden_layers * c.num_experts * 3 * c.hidden_size * c.moe_intermediate_size
    convs = len(c.linear_layers) * c.gdn_conv_dim * c.linear_conv_kernel_dim
    convs += len(c.ple_layers) * c.hc_count * c.hidden_size * c.ple_conv_kernel_size
    tables = sum(c.ngram_table_rows(i) * (c.ple_embed_dim // c.ngram_heads) for i in range(len(c.ple_layers)))
    embed = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    return (sum(v for k, v in macs.items() if k != "moe.routed") + routed + convs + tables + embed
            + sum(head_macs(c).values()))


# ---- tidal ----------------------------------------------------------------------------------------
def random_ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(TOKEN_LOW, TOKEN_HIGH, (n,), generator=gen).tolist()


def build_llm(ckpt: str, ns: argparse.Namespace, lengths: list[int], batches: list[int],
              quantization: str | None = None) -> LLM:
    page = 16
    per_request = -(-(ns.decode_context + 2 * (DECODE_WARMUP + ns.decode_steps) + 1) // page) * page
    max_len = max([*lengths, per_request, 2])
    requests = max(batches, default=1)  # an empty --decode-batches runs prefill only
    kv_tokens = max(max_len, requests * per_request) + page
    return LLM(ckpt, device=ns.device, dtype=ns.dtype, load_format="random",
               max_prefill_length=max(lengths, default=max_len), max_model_len=max_len, kv_pool_tokens=kv_tokens,
               max_running_requests=requests, page_size=page, quantization=quantization, ple_backend=ns.ple_backend)


def bench_prefill(llm: LLM, c: ModelConfig, lengths: list[int], device: torch.device,
                  peak: float) -> list[dict[str, Any]]:
    page = llm.sizes.page_size
    rows = []
    for length in lengths:
        ids = random_ids(length, seed=length)
        batch = Batch(batch_id=0, segments=[SegmentSpec(rid=f"prefill-{length}", slot=0, start=0, token_ids=ids,
                                                        pages=list(range(-(-length // page))), sample=True)])
        warm = host_seconds(lambda b=batch: llm.runner.execute(b), device)
        runs = [host_seconds(lambda b=batch: llm.runner.execute(b), device) for _ in range(3)]
        sec = statistics.median(runs)
        terms = prefill_flops(c, length)
        flops = sum(terms.values())
        rows.append({"tokens": length, "ms": sec * 1e3, "runs_ms": [r * 1e3 for r in runs], "warmup_ms": warm * 1e3,
                     "tok_s": length / sec, "flops": flops, "flops_terms": terms,
                     "flops_per_s": flops / sec, "mfu": flops / sec / peak})
        print(f"prefill {length}: {sec * 1e3:.1f} ms, {length / sec:.0f} tok/s, MFU {flops / sec / peak:.3f}",
              flush=True)
    return rows


def bench_decode(llm: LLM, c: ModelConfig, batches: list[int], context: int, steps: int, device: torch.device,
                 bandwidth: float, elem: int, graphs: bool, fmt: str | None = None) -> list[dict[str, Any]]:
    page = llm.sizes.page_size
    per_request = -(-(context + 2 * (DECODE_WARMUP + steps) + 1) // page)
    rows = []
    for size in batches:
        pages = [list(range(i * per_request, (i + 1) * per_request)) for i in range(size)]
        last = []
        for i in range(size):  # each request prefilled alone, cold, in its own slot and pages
            spec = SegmentSpec(rid=f"decode-{i}", slot=i, start=0, token_ids=random_ids(context, seed=10_000 + i),
                               pages=pages[i], sample=True)
            last.append(llm.runner.execute(Batch(batch_id=0, segments=[spec])).token_ids[0])
        pos = context

        def step_batch(step: int, tokens: list[int], pos=pos, pages=pages, size=size) -> Batch:
            return Batch(batch_id=step, segments=[
                SegmentSpec(rid=f"decode-{i}", slot=i, start=pos + step, token_ids=[tokens[i]], pages=pages[i],
                            sample=True, sample_index=step + 1)  # output 0 came from the prompt: these decode
                for i in range(size)])                            # generated tokens

        times = []
        replays = llm.runner.graphs.steps if llm.runner.graphs is not None else 0
        if graphs:  # the graph of every shape the steps meet (the QSA block count grows with them), first
            for step in range(2 * (DECODE_WARMUP + steps) + 1):
                llm.runner.graphs.ensure([pos + step] * size)
        for step in range(DECODE_WARMUP + steps):
            batch = step_batch(step, last)
            synchronize(device)
            t0 = time.perf_counter()
            last = llm.runner.execute(batch).token_ids
            synchronize(device)
            if step >= DECODE_WARMUP:
                times.append(time.perf_counter() - t0)
        arms = [("", statistics.median(times), [t * 1e3 for t in times], context + DECODE_WARMUP + (steps - 1) / 2)]
        replay_ms = None  # the step's graph replayed alone, back to back
        if graphs:
            # As the executor's loop runs a decode sent ahead: each step launched (token -1) before the step
            # before it is finished; the mean time of a step over the timed steps, back to back.
            first = DECODE_WARMUP + steps
            launched = llm.runner.launch(step_batch(first, last))
            for step in range(first + 1, first + DECODE_WARMUP + steps + 1):
                if step == first + DECODE_WARMUP + 1:
                    synchronize(device)
                    t0 = time.perf_counter()
                ahead = llm.runner.launch(step_batch(step, [-1] * size))
                llm.runner.finish(launched)
                launched = ahead
            last = llm.runner.finish(launched).token_ids
            sec = (time.perf_counter() - t0) / steps
            arms.append((" pipelined", sec, [], first + context + DECODE_WARMUP + 1 + (steps - 1) / 2))
            if llm.runner.graphs.capture:  # the device's own time for the step: the rest of a step is idle
                alone = llm.runner.graphs.replay_seconds([pos + step] * size, steps)
                print(f"decode graphs on batch {size}: the graph replayed alone {alone * 1e3:.3f} ms/step; the "
                      f"device idles {(sec - alone) * 1e3:.3f} ms of a pipelined step, "
                      f"{(statistics.median(times) - alone) * 1e3:.3f} ms of a step run alone", flush=True)
                replay_ms = alone * 1e3
        # Steps the fixed-shape (graph) path ran: every one when graphs are on; fewer means steps that the
        # runner did not take for decodes of generated tokens ran eagerly, and the arm measured those.
        replays = (llm.runner.graphs.steps if llm.runner.graphs is not None else 0) - replays
        want = (DECODE_WARMUP + steps) * len(arms) + (len(arms) - 1)
        if graphs and replays != want:
            print(f"decode graphs on batch {size}: only {replays} of {want} steps ran from the graph path", flush=True)
        for arm, sec, steps_ms, mean_context in arms:
            terms = decode_bytes(c, size, mean_context, elem, fmt)
            floor = sum(terms.values()) / bandwidth
            rows.append({"cuda_graph": graphs, "pipelined": bool(arm), "graph_steps": replays, "batch": size,
                         "graph_replay_ms": replay_ms,
                         "context": mean_context, "step_ms": sec * 1e3, "steps_ms": steps_ms, "tok_s": size / sec,
                         "floor_bytes": sum(terms.values()), "floor_bytes_terms": terms, "floor_ms": floor * 1e3,
                         "floor_fraction": floor / sec})
            print(f"decode graphs {'on' if graphs else 'off'}{arm} batch {size}: {sec * 1e3:.2f} ms/step, "
                  f"{size / sec:.1f} tok/s, floor {floor * 1e3:.3f} ms ({floor / sec:.3f})", flush=True)
    return rows


def bench_arm(ckpt: str, ns: argparse.Namespace, config: ModelConfig, device: torch.device, peak: float,
              bandwidth: float, elem: int, fmt: str) -> dict[str, Any]:
    """Prefill and decode of one weight format (``bf16``: the model in ``--dtype``; ``nvfp4``, ``fp8``: random
    routed experts and n-gram table in that layout), each decode row against the floor of its own bytes."""
    quantization = None if fmt == "bf16" else fmt
    print(f"arm {fmt}", flush=True)
    t0 = time.monotonic()
    llm = build_llm(ckpt, ns, ns.lengths, ns.decode_batches, quantization)
    arm: dict[str, Any] = {"load_s": time.monotonic() - t0}
    with contextlib.suppress(Exception):  # an internal detail; only a cross-check of the formula
        arm["params_model"] = sum(p.numel() for p in llm.runner.model.parameters())
    arm["prefill"] = bench_prefill(llm, config, ns.lengths, device, peak)
    graphs, arm["decode"] = llm.runner.graphs, []
    for mode in ns.decode_graphs.split(","):  # between arms no request holds a slot
        if mode == "on" and graphs is None:
            print("decode graphs on: this device runs no CUDA graphs; skipped", flush=True)
            continue
        llm.runner.graphs = graphs if mode == "on" else None
        arm["decode"] += bench_decode(llm, config, ns.decode_batches, ns.decode_context, ns.decode_steps,
                                      device, bandwidth, elem, graphs=mode == "on", fmt=quantization)
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return arm


# ---- kernels --------------------------------------------------------------------------------------
Args = dict[str, Any]


@dataclass
class Impl:
    label: str
    fn: Callable[[Args], Any]
    env: dict[str, str] = field(default_factory=dict)
    cuda_only: bool = False


Candidate = Callable[[], Impl]
TORCH_ENV = {"TIDAL_KERNELS": "torch"}


def attr(module: str, name: str, call: Callable[[Any, Args], Any], env: dict[str, str] | None = None,
         label: str | None = None, cuda_only: bool = False) -> Candidate:
    """A lazily imported implementation: ``call(module.name, args)``; missing module or name -> missing."""
    def resolve() -> Impl:
        fn = getattr(importlib.import_module(module), name)
        tag = label or f"{module.removeprefix('tidal.')}.{name}" + (" [TIDAL_KERNELS=torch]" if env else "")
        return Impl(tag, lambda a: call(fn, a), dict(env or {}), cuda_only)
    return resolve


def ref_of(module: str, name: str, call: Callable[[Any, Args], Any]) -> list[Candidate]:
    """``module.name_ref`` if present, else the dispatcher forced onto its torch path."""
    return [attr(module, f"{name}_ref", call), attr(module, name, call, env=TORCH_ENV)]


@dataclass
class KernelCase:
    name: str
    shape: str
    build: Callable[[], Args]
    fast: list[Candidate]
    ref: list[Candidate]
    library: list[Candidate]
    nbytes: Callable[[Args], float]
    flops: Callable[[Args], float]


@contextlib.contextmanager
def environ(overrides: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def kernel_cases(c: ModelConfig, device: torch.device, dtype: torch.dtype, tokens: int, batch: int,
                 context: int, formats: tuple[str, ...] = ("bf16",)) -> list[KernelCase]:
    """The kernel table: model shapes of ``c`` at ``tokens`` prefill rows and ``batch`` decode rows; with
    ``nvfp4`` among ``formats``, the routed experts in NVFP4 too."""
    eb = torch.tensor([], dtype=dtype).element_size()
    h, hc = c.hidden_size, c.hc_count
    width = hc * h
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    eps = c.rms_norm_eps

    def rand(*shape: int, scale: float = 1.0, dt: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dt)

    def i32(values: list[int] | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int32, device=device)

    cases: list[KernelCase] = []
    for phase, rows in (("prefill", tokens), ("decode", batch)):
        cases.append(KernelCase(
            f"rms_norm {phase}", f"x [{rows}, {width}] group {h}",
            lambda rows=rows: {"x": rand(rows, width), "w": rand(width, scale=0.1)},
            [attr("tidal.kernels.norm", "rms_norm", lambda f, a: f(a["x"], a["w"], eps, group_size=h))],
            ref_of("tidal.kernels.norm", "rms_norm", lambda f, a: f(a["x"], a["w"], eps, group_size=h)), [],
            lambda a: (2 * a["x"].numel() + a["w"].numel()) * eb, lambda a: 4 * a["x"].numel()))
        hc_res = lambda f, a: f(a["streams"], a["out"], a["inject"], hc, a["w"], eps)  # noqa: E731
        cases.append(KernelCase(
            f"hc_residual_norm {phase}", f"streams [{rows}, {width}], block_out [{rows}, {h}]",
            lambda rows=rows: {"streams": rand(rows, width), "out": rand(rows, h), "inject": rand(rows, hc),
                               "w": rand(width, scale=0.1)},
            [attr("tidal.kernels.hyper_connection", "hc_residual_norm", hc_res)],
            ref_of("tidal.kernels.hyper_connection", "hc_residual_norm", hc_res), [],
            lambda a: (3 * a["streams"].numel() + a["out"].numel() + a["inject"].numel() + a["w"].numel()) * eb,
            lambda a: 8 * a["streams"].numel()))
        hc_in = lambda f, a: f(a["normed"], a["up"], hc)  # noqa: E731
        cases.append(KernelCase(
            f"hc_block_input {phase}", f"normed, up_out [{rows}, {width}]",
            lambda rows=rows: {"normed": rand(rows, width), "up": rand(rows, width)},
            [attr("tidal.kernels.hyper_connection", "hc_block_input", hc_in)],
            ref_of("tidal.kernels.hyper_connection", "hc_block_input", hc_in), [],
            lambda a: (2 * a["normed"].numel() + a["normed"].shape[0] * h) * eb, lambda a: 4 * a["normed"].numel()))

    conv_dim, taps = c.gdn_conv_dim, c.linear_conv_kernel_dim
    conv_window = taps - 1

    def conv_args(rows: int, segs: int) -> Args:
        cu = [0, rows] if segs == 1 else list(range(segs + 1))
        return {"x": rand(rows, conv_dim), "states": rand(segs + 4, conv_window, conv_dim),
                "w": rand(conv_dim, taps, scale=0.5), "cu": i32(cu), "slots": i32(list(range(segs))),
                "fresh": torch.full((segs,), segs == 1, dtype=torch.bool, device=device), "max": rows // segs}

    conv_varlen = lambda f, a: f(a["x"], a["states"], a["w"], a["cu"], a["slots"], a["fresh"],  # noqa: E731
                                 max_seqlen=a["max"])
    conv_bytes = lambda a: (2 * a["x"].numel() + 2 * len(a["slots"]) * conv_window * conv_dim  # noqa: E731
                            + a["w"].numel()) * eb
    conv_flops = lambda a: 2 * a["x"].numel() * taps  # noqa: E731
    cases.append(KernelCase(
        "causal_conv1d_varlen prefill", f"x [{tokens}, {conv_dim}], k {taps}, 1 segment",
        lambda: conv_args(tokens, 1), [attr("tidal.kernels.conv", "causal_conv1d_varlen", conv_varlen)],
        ref_of("tidal.kernels.conv", "causal_conv1d_varlen", conv_varlen), [], conv_bytes, conv_flops))
    conv_update = lambda f, a: f(a["x"], a["states"], a["w"], a["slots"], a["fresh"])  # noqa: E731
    cases.append(KernelCase(
        "causal_conv1d_update decode", f"x [{batch}, {conv_dim}], k {taps}",
        lambda: conv_args(batch, batch), [attr("tidal.kernels.conv", "causal_conv1d_update", conv_update)],
        ref_of("tidal.kernels.conv", "causal_conv1d_update", conv_update), [], conv_bytes, conv_flops))

    state_bytes = hv * dk * dv * 4

    def gdn_args(rows: int, decode: bool) -> Args:
        a = {"q": rand(rows, hk, dk), "k": rand(rows, hk, dk), "v": rand(rows, hv, dv),
             "g": -torch.rand(rows, hv, device=device) * 0.1, "beta": torch.rand(rows, hv, device=device).to(dtype)}
        if decode:
            a.update(pool=torch.zeros(rows + 4, hv, dk, dv, device=device), slots=torch.arange(rows, device=device),
                     fresh=torch.zeros(rows, dtype=torch.bool, device=device))
        else:
            a.update(h0=torch.zeros(1, hv, dk, dv, device=device), cu=i32([0, rows]), cu_host=[0, rows])
        return a

    gdn_io = lambda a: (a["q"].numel() * 2 + a["v"].numel() * 2) * eb + a["g"].numel() * (4 + eb)  # noqa: E731
    gdn_chunk_flops = lambda a: a["v"].shape[0] * hv * (4 * dk * dv + 2 * 64 * (dk + dv))  # noqa: E731
    cases.append(KernelCase(
        "gdn chunked prefill", f"T {tokens}, Hk {hk}, Hv {hv}, dk {dk}, dv {dv}", lambda: gdn_args(tokens, False),
        [attr("tidal.kernels.gdn_varlen", "gdn_prefill",
              lambda f, a: f(a["q"], a["k"], a["v"], a["g"], a["beta"], a["h0"], a["cu"], a["cu_host"]))],
        [attr("tidal.kernels.gdn_varlen", "gdn_prefill_ref",
              lambda f, a: f(a["q"], a["k"], a["v"], a["g"], a["beta"], a["h0"], a["cu_host"])),
         attr("tidal.kernels.gdn", "chunk_gated_delta_rule", _chunk_gdn_one_sequence)],
        [attr("fla.ops.gated_delta_rule", "chunk_gated_delta_rule", _fla_chunk, label="fla chunk_gated_delta_rule",
              cuda_only=True)],
        lambda a: gdn_io(a) + 2 * state_bytes, gdn_chunk_flops))
    gdn_decode = lambda f, a: f(  # noqa: E731
        a["q"], a["k"], a["v"], a["g"], a["beta"], a["pool"], a["slots"], a["fresh"])
    cases.append(KernelCase(
        "gdn decode", f"B {batch}, Hk {hk}, Hv {hv}, dk {dk}, dv {dv}, fp32 state pool",
        lambda: gdn_args(batch, True),
        [attr("tidal.kernels.gdn_decode_triton", "gdn_decode", gdn_decode, cuda_only=True)],
        [attr("tidal.kernels.gdn", "gdn_decode_ref", gdn_decode)],
        [attr("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule", _fla_recurrent,
              label="fla fused_recurrent_gated_delta_rule", cuda_only=True)],
        lambda a: gdn_io(a) + 2 * a["v"].shape[0] * state_bytes, lambda a: a["v"].shape[0] * hv * 6 * dk * dv))

    page = 16
    ratio = c.indexer_compress_ratio or 0
    topk = c.qsa_block_topk if c.has_qsa else 0

    def attention_args(segs: int, kv_len: int, qsa: bool) -> Args:
        rows = kv_len if segs == 1 else segs
        per = -(-kv_len // page)
        table = torch.randperm(segs * per, device=device).to(torch.int32).view(segs, per)
        cu = [0, rows] if segs == 1 else list(range(segs + 1))
        a = {"q": rand(rows, nh, hd), "k": rand(segs * per, page, nkv, hd), "v": rand(segs * per, page, nkv, hd),
             "table": table, "cu": i32(cu), "kv_lens": i32([kv_len] * segs), "max": rows // segs, "sel": None,
             "keys": int(attended_keys(c, torch.arange(kv_len - rows // segs, kv_len).repeat(segs), qsa).sum())}
        if qsa:
            pos = torch.arange(kv_len - rows // segs, kv_len, device=device).repeat(segs)
            complete = (pos + 1) // ratio
            blocks = max(kv_len // ratio, 1)
            score = torch.rand(rows, blocks, device=device)
            score[torch.arange(blocks, device=device).unsqueeze(0) >= complete.unsqueeze(1)] = -1.0
            picked = score.topk(min(topk, blocks), dim=-1)
            a["sel"] = torch.where(picked.values >= 0, picked.indices, -1).to(torch.int32).contiguous()
        return a

    attn_call = lambda f, a: f(a["q"], a["k"], a["v"], a["table"], a["cu"], a["kv_lens"], hd ** -0.5,  # noqa: E731
                               block_sel=a["sel"], qsa_ratio=ratio if a["sel"] is not None else 0,
                               max_seqlen_q=a["max"])
    attn_ref = lambda f, a: f(a["q"], a["k"], a["v"], a["table"], a["cu"], a["kv_lens"], hd ** -0.5,  # noqa: E731
                              block_sel=a["sel"], qsa_ratio=ratio if a["sel"] is not None else 0)
    variants = [("dense", False)] + ([("qsa", True)] if c.has_qsa else [])
    for phase, segs, kv_len in (("prefill", 1, tokens), ("decode", batch, context)):
        for kind, qsa in variants:
            rows = kv_len if segs == 1 else segs
            cases.append(KernelCase(
                f"paged_attention {kind} {phase}",
                f"q [{rows}, {nh}, {hd}], kv {kv_len} x {segs}, Hkv {nkv}, page {page}"
                + (f", top-{topk} blocks of {ratio}" if qsa else ""),
                lambda segs=segs, kv_len=kv_len, qsa=qsa: attention_args(segs, kv_len, qsa),
                [attr("tidal.kernels.attention_triton", "paged_attention", attn_call, cuda_only=True)],
                [attr("tidal.kernels.attention", "paged_attention_ref", attn_ref)],
                [] if qsa else [lambda: Impl("torch SDPA (contiguous KV)", _sdpa)],
                lambda a: (2 * a["q"].numel() + 2 * _kv_read(a, nkv, hd)) * eb
                + (a["sel"].numel() * 4 if a["sel"] is not None else 0),
                lambda a: 4 * hd * nh * a["keys"]))

    e, top, inter = c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size

    def moe_args(rows: int) -> Args:
        ids = torch.rand(rows, e, device=device).topk(top, dim=-1).indices
        w = torch.rand(rows, top, device=device)
        a = {"x": rand(rows, h), "ids": ids, "w": (w / w.sum(-1, keepdim=True)).to(dtype),
             "gate_up": rand(e, 2 * inter, h, scale=0.02), "down": rand(e, h, inter, scale=0.02)}
        order = torch.argsort(ids.flatten(), stable=True)
        a["sorted"] = a["x"][order // top]
        a["offs"] = torch.cumsum(torch.bincount(ids.flatten(), minlength=e), 0, dtype=torch.int32)
        a["distinct"] = int(torch.unique(ids).numel())
        return a

    moe = lambda f, a: f(a["x"], a["ids"], a["w"], a["gate_up"], a["down"])  # noqa: E731
    # The dispatcher (grouped GEMM or Triton by size), then the Triton kernel alone at the same shapes.
    fast_paths = [("fused_experts", attr("tidal.kernels.moe", "fused_experts", moe)),
                  ("fused_experts_triton", attr("tidal.kernels.moe_triton", "fused_experts_triton", moe,
                                                cuda_only=True))]
    for phase, rows in (("prefill", tokens), ("decode", batch)):
        for title, fast in fast_paths:
            cases.append(KernelCase(
                f"{title} {phase}", f"T {rows}, E {e}, top {top}, H {h}, I {inter}", lambda rows=rows: moe_args(rows),
                [fast], [attr("tidal.kernels.moe", "fused_experts_ref", moe)], [_grouped_mm_candidate],
                lambda a: (a["distinct"] * 3 * h * inter + 2 * a["x"].numel()) * eb + a["ids"].numel() * (8 + eb),
                lambda a: 2 * a["ids"].numel() * 3 * h * inter))
    if "nvfp4" in formats:
        cases += nvfp4_cases(c, moe_args, moe, tokens, batch, eb)
    return cases


def nvfp4_cases(c: ModelConfig, moe_args: Callable[[int], Args], moe: Callable[[Any, Args], Any], tokens: int,
                batch: int, eb: int) -> list[KernelCase]:
    """The routed experts in NVFP4 at the bf16 cases' shapes: the kernels that read the packed experts (grouped
    GEMMs for prefill and decode batches past ``moe.NVFP4_GEMV_MAX_TOKENS``, GEMVs for smaller decode batches), the
    reference (experts dequantized per call, then the bf16 path) and,
    as the library column, the bf16 experts' own fast path on the same rows."""
    h, inter = c.hidden_size, c.moe_intermediate_size
    one = expert_bytes(c, "nvfp4", eb)

    def args(rows: int) -> Args:
        from tidal.executor.quant import quantize_experts

        a = moe_args(rows)
        a["q_gate_up"] = quantize_experts(a["gate_up"], [inter, inter], "nvfp4")
        a["q_down"] = quantize_experts(a["down"], [h], "nvfp4")
        return a

    routed = lambda f, a: f(a["x"], a["ids"], a["w"], a["q_gate_up"], a["q_down"])  # noqa: E731
    packed = lambda f, a: f(a["x"], a["ids"], a["w"], a["q_gate_up"].nvfp4(), a["q_down"].nvfp4())  # noqa: E731
    ref = attr("tidal.executor.quant", "routed_experts", routed, env={"TIDAL_KERNELS": "torch:nvfp4"},
               label="executor.quant.routed_experts [TIDAL_KERNELS=torch:nvfp4: dequantized per call]")
    from tidal.kernels.moe import NVFP4_GEMV_MAX_TOKENS

    decode = (attr("tidal.kernels.moe_decode_triton", "moe_gemv", packed, cuda_only=True)
              if batch <= NVFP4_GEMV_MAX_TOKENS else attr("tidal.kernels.moe", "fused_experts_nvfp4", packed))
    phases = (("prefill", tokens, attr("tidal.kernels.moe", "fused_experts_nvfp4", packed),
               attr("tidal.kernels.moe", "fused_experts", moe, label="bf16 experts: kernels.moe.fused_experts")),
              ("decode", batch, decode,
               attr("tidal.kernels.moe_decode_triton", "moe_gemv", moe, cuda_only=True,
                    label="bf16 experts: kernels.moe_decode_triton.moe_gemv")))
    return [KernelCase(
        f"nvfp4 experts {phase}", f"T {rows}, E {c.num_experts}, top {c.num_experts_per_tok}, H {h}, I {inter}",
        lambda rows=rows: args(rows), [fast], [ref], [library],
        lambda a: a["distinct"] * one + 2 * a["x"].numel() * eb + a["ids"].numel() * (8 + eb),
        lambda a: 2 * a["ids"].numel() * 3 * h * inter) for phase, rows, fast, library in phases]


def _kv_read(a: Args, nkv: int, hd: int) -> int:
    """Elements of K and V a kernel must read at least once: every key of every segment (dense)
    or only the attended ones (QSA decode); for a prefill every key is read once either way."""
    segs = a["table"].shape[0]
    if segs == 1:
        return int(a["kv_lens"][0]) * nkv * hd
    return int(a["keys"]) * nkv * hd


def _chunk_gdn_one_sequence(fn: Any, a: Args) -> Any:
    """``tidal.kernels.gdn.chunk_gated_delta_rule`` (expanded, l2-normalised q/k) on one sequence."""
    group = a["v"].shape[1] // a["q"].shape[1]
    q = F.normalize(a["q"].float(), dim=-1).repeat_interleave(group, dim=1)
    k = F.normalize(a["k"].float(), dim=-1).repeat_interleave(group, dim=1)
    return fn(q, k, a["v"], a["g"], a["beta"], a["h0"][0])


def _fla_chunk(fn: Any, a: Args) -> Any:
    kw = dict(scale=a["q"].shape[-1] ** -0.5, initial_state=a["h0"], output_final_state=True,
              use_qk_l2norm_in_kernel=True, cu_seqlens=a["cu"].long())
    return fn(a["q"][None], a["k"][None], a["v"][None], a["g"][None], a["beta"][None], **kw)


def _fla_recurrent(fn: Any, a: Args) -> Any:
    rows = a["v"].shape[0]
    return fn(a["q"][:, None], a["k"][:, None], a["v"][:, None], a["g"][:, None], a["beta"][:, None],
              scale=a["q"].shape[-1] ** -0.5, initial_state=a["pool"][:rows], output_final_state=True,
              use_qk_l2norm_in_kernel=True)


def _sdpa(a: Args) -> Any:
    """Flash/efficient SDPA over the same keys laid out contiguously (gathered once, not timed)."""
    if "dense_kv" not in a:
        segs, kv_len = a["table"].shape[0], int(a["kv_lens"][0])
        pos = torch.arange(kv_len, device=a["q"].device)
        rows = a["table"][:, pos // a["k"].shape[1]].long() * a["k"].shape[1] + pos % a["k"].shape[1]
        k = a["k"].flatten(0, 1)[rows].permute(0, 2, 1, 3).contiguous()  # [N, Hkv, S, D]
        v = a["v"].flatten(0, 1)[rows].permute(0, 2, 1, 3).contiguous()
        q = a["q"].view(segs, -1, *a["q"].shape[1:]).permute(0, 2, 1, 3).contiguous()  # [N, H, L, D]
        a["dense_kv"] = (q, k, v, q.shape[2] > 1)
    q, k, v, causal = a["dense_kv"]
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def _grouped_mm_candidate() -> Impl:
    gmm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if gmm is None:
        raise ImportError("torch has no grouped_mm")

    def run(a: Args) -> Any:
        gate, up = gmm(a["sorted"], a["gate_up"].transpose(1, 2), offs=a["offs"]).chunk(2, dim=-1)
        return gmm(F.silu(gate) * up, a["down"].transpose(1, 2), offs=a["offs"])

    return Impl(f"torch {getattr(gmm, '__name__', 'grouped_mm')} (pre-sorted rows, gate_up + down)", run)


def run_impl(candidates: list[Candidate], args: Args, device: torch.device, floor_ms: float) -> dict[str, Any]:
    """Resolve the first available candidate and time it; missing / error / oom never raise."""
    if not candidates:
        return {"status": "n/a"}
    impl, why = None, ""
    for candidate in candidates:
        try:
            impl = candidate()
            break
        except Exception as e:  # ImportError, AttributeError, or a module failing to load its backend
            why = f"{type(e).__name__}: {e}"
    if impl is None:
        return {"status": "missing", "why": why[:300]}
    if impl.cuda_only and device.type != "cuda":
        return {"status": "n/a", "impl": impl.label, "why": "needs CUDA"}
    try:
        with environ(impl.env):
            t = device_ms(lambda: impl.fn(args), device, samples=5, slow_ms=1000.0)
    except torch.cuda.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        return {"status": "oom", "impl": impl.label, "error": str(e)[:300]}
    except Exception as e:
        return {"status": "error", "impl": impl.label, "error": f"{type(e).__name__}: {e}"[:500]}
    return {"status": "ok", "impl": impl.label, **t, "roofline": floor_ms / t["ms"] if t["ms"] > 0 else None}


def bench_kernels(cases: list[KernelCase], device: torch.device, peak: float, bandwidth: float,
                  budget_s: float) -> list[dict[str, Any]]:
    start = time.monotonic()
    rows = []
    for case in cases:
        row: dict[str, Any] = {"name": case.name, "shape": case.shape}
        if time.monotonic() - start > budget_s:
            rows.append({**row, "status": "skipped: time budget"})
            continue
        try:
            args = case.build()
        except torch.cuda.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            rows.append({**row, "status": f"oom building inputs: {e}"[:300]})
            continue
        nbytes, flops = float(case.nbytes(args)), float(case.flops(args))
        floor_ms = max(nbytes / bandwidth, flops / peak) * 1e3
        row.update(bytes=nbytes, flops=flops, floor_ms=floor_ms, bound="memory" if nbytes / bandwidth >= flops / peak
                   else "compute")
        with torch.inference_mode():
            for key, candidates in (("fast", case.fast), ("ref", case.ref), ("library", case.library)):
                row[key] = run_impl(candidates, args, device, floor_ms)
        rows.append(row)
        del args
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        cells = [f"{k} {_cell(row[k])}" for k in ("fast", "ref", "library")]
        print(f"kernel {case.name}: " + ", ".join(cells), flush=True)
    return rows


# ---- peer -----------------------------------------------------------------------------------------
def bench_peer(ckpt: str, lengths: list[int], device: torch.device, dtype: torch.dtype,
               max_seconds: float) -> dict[str, Any]:
    """transformers' model from the same config.json, random init on the device, one sequence per
    forward (``use_cache=False``, logits for the last row only), warmed up at each length."""
    try:
        from transformers import AutoConfig, Qwen4ExpForCausalLM
    except ImportError as e:
        return {"status": "missing", "why": str(e)}
    config = AutoConfig.from_pretrained(ckpt)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            held = [Qwen4ExpForCausalLM(config).eval()]  # cleared at the end so the memory can go
    finally:
        torch.set_default_dtype(previous)
    out: dict[str, Any] = {"status": "ok", "model": "transformers Qwen4ExpForCausalLM",
                           "attn_implementation": getattr(config, "_attn_implementation", None), "runs": []}
    try:
        for length in sorted(lengths):
            ids = torch.tensor([random_ids(length, seed=length)], device=device)

            def forward(ids: torch.Tensor = ids) -> None:
                with torch.inference_mode():
                    held[0](input_ids=ids, use_cache=False, logits_to_keep=1)

            try:
                warm = host_seconds(forward, device)
                if warm > max_seconds:
                    out["runs"].append({"tokens": length, "warmup_s": warm, "status": "over --peer-max-seconds"})
                    break
                runs = [host_seconds(forward, device) for _ in range(3 if warm < 10 else 1)]
            except torch.cuda.OutOfMemoryError as e:
                out["runs"].append({"tokens": length, "status": f"oom: {e}"[:300]})
                break
            sec = statistics.median(runs)
            out["runs"].append({"tokens": length, "ms": sec * 1e3, "runs_ms": [r * 1e3 for r in runs],
                                "warmup_s": warm, "tok_s": length / sec, "status": "ok"})
            print(f"peer {length}: {sec * 1e3:.1f} ms, {length / sec:.0f} tok/s", flush=True)
            if sec > max_seconds:
                break
    finally:
        held.clear()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def peer_ratio(results: dict[str, Any]) -> dict[str, Any] | None:
    """tidal / peer prefill tok/s at the longest length the peer finished."""
    done = [r for r in (results.get("peer") or {}).get("runs", []) if r.get("status") == "ok"]
    tidal = {r["tokens"]: r["tok_s"] for r in results.get("prefill") or []}
    common = [r for r in done if r["tokens"] in tidal]
    if not common:
        return None
    last = max(common, key=lambda r: r["tokens"])
    return {"tokens": last["tokens"], "tidal_tok_s": tidal[last["tokens"]], "peer_tok_s": last["tok_s"],
            "tidal_over_peer": tidal[last["tokens"]] / last["tok_s"]}


# ---- report ---------------------------------------------------------------------------------------
def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                  "cuda": torch.version.cuda}
    for name in ("triton", "transformers", "flash-linear-attention", "fla-core"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _cell(r: dict[str, Any]) -> str:
    if r.get("status") == "ok":
        return f"{r['ms']:.3f} ({r['roofline']:.2f})" if r.get("roofline") is not None else f"{r['ms']:.3f}"
    return str(r.get("status"))


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[f"{v:.4g}" if isinstance(v, float) else str(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def report(results: dict[str, Any]) -> str:
    m = results["meta"]
    layers = f" (first {m['layers']} layers)" if m.get("layers") else ""
    out = [f"device {m['device_name']} ({m['device']}), {m['dtype']}, preset {m['preset']}{layers}, "
           + ", ".join(f"{k} {v}" for k, v in m["versions"].items())]
    if "peak" in results:
        p, b = results["peak"], results["bandwidth"]
        out.append(f"peak {p['flops_per_s'] / 1e12:.3g} TFLOP/s ({p['n']}^3 {p['dtype']} matmul), "
                   f"bandwidth {b['bytes_per_s'] / 1e9:.3g} GB/s (copy, read + write)")
    arms = results.get("arms") or {m.get("quantization", ["bf16"])[0]: results}
    for fmt, arm in arms.items():
        if arm.get("prefill"):
            out += ["", f"{fmt}: prefill (one cold forward, median of 3)", table(
                ["tokens", "ms", "tok/s", "TFLOP", "TFLOP/s", "MFU"],
                [[r["tokens"], r["ms"], r["tok_s"], r["flops"] / 1e12, r["flops_per_s"] / 1e12, r["mfu"]]
                 for r in arm["prefill"]])]
        if arm.get("decode"):
            out += ["", f"{fmt}: decode (median step of B requests; floor of {fmt}'s bytes)", table(
                ["graphs", "batch", "context", "ms/step", "tok/s", "floor MB", "floor ms", "floor/measured"],
                [["on" if r.get("cuda_graph") else "off", r["batch"], r["context"], r["step_ms"], r["tok_s"],
                  r["floor_bytes"] / 1e6, r["floor_ms"], r["floor_fraction"]] for r in arm["decode"]])]
    if results.get("kernels"):
        out += ["", "kernels: ms (fraction of roofline)", table(
            ["kernel", "shape", "floor ms", "bound", "fast", "ref", "library"],
            [[r["name"], r["shape"], r.get("floor_ms", ""), r.get("bound", r.get("status", "")),
              *(_cell(r[k]) if k in r else "" for k in ("fast", "ref", "library"))] for r in results["kernels"]])]
    peer = results.get("peer")
    if peer and peer.get("runs"):
        out += ["", f"peer: {peer['model']}", table(
            ["tokens", "ms", "tok/s", "warm-up s", "status"],
            [[r["tokens"], r.get("ms", ""), r.get("tok_s", ""), r.get("warmup_s", ""), r["status"]]
             for r in peer["runs"]])]
    if results.get("peer_ratio"):
        r = results["peer_ratio"]
        out.append(f"tidal / peer at {r['tokens']} tokens: {r['tidal_over_peer']:.2f}x "
                   f"({r['tidal_tok_s']:.0f} vs {r['peer_tok_s']:.0f} tok/s)")
    return "\n".join(out)


def save(path: str, results: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2, default=str)
    os.replace(tmp, path)


def int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for bench_forward.json")
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--layers", type=int, default=None,
                    help="keep the preset's first N decoder layers (and its PLE layers among them): a model too large "
                         "for the device measured over fewer layers, every floor of the same layers")
    ap.add_argument("--lengths", type=int_list, default=[4096, 8192, 32768], help="prefill lengths, comma-separated")
    ap.add_argument("--decode-batches", type=int_list, default=[1, 8, 32])
    ap.add_argument("--decode-context", type=int, default=512, help="prompt tokens of each decoding request")
    ap.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per batch size")
    ap.add_argument("--decode-graphs", default="on,off", help="decode arms: on (CUDA graphs), off (eager steps)")
    ap.add_argument("--tidal", action=argparse.BooleanOptionalAction, default=True, help="prefill and decode")
    ap.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--peer-max-seconds", type=float, default=60.0)
    ap.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--kernel-tokens", type=int, default=None, help="prefill rows of the kernel table "
                    "(default 32768 on CUDA, 256 elsewhere)")
    ap.add_argument("--kernel-batch", type=int, default=8, help="decode rows of the kernel table")
    ap.add_argument("--kernel-context", type=int, default=None, help="decode context of the kernel table "
                    "(default 8192 on CUDA, 512 elsewhere)")
    ap.add_argument("--kernel-budget-s", type=float, default=110.0, help="kernel cases left after this are skipped")
    ap.add_argument("--merge", action="store_true", help="keep the sections of an existing bench_forward.json "
                    "(same preset, dtype, device) that this run skips")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--ple-backend", default="gpu", choices=["gpu", "pinned", "disk"],
                    help="where the n-gram tables live (pinned: host memory, rows read by the device in decode steps)")
    ap.add_argument("--quantization", type=formats, default=["bf16"],
                    help="weight formats, one arm each in this process: bf16 (the model in --dtype), nvfp4, fp8 "
                         "(random routed experts and n-gram table in that layout); comma-separated")
    return ap.parse_args(argv)


def formats(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = sorted(set(names) - {"bf16", "nvfp4", "fp8"})
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--quantization {text!r}: expected bf16, nvfp4 and fp8 only")
    return names


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    device = torch.device(ns.device)
    dtype = getattr(torch, ns.dtype)
    os.makedirs(ns.out, exist_ok=True)
    path = os.path.join(ns.out, "bench_forward.json")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    meta = {"script": "benchmarks/bench_forward.py", "argv": sys.argv[1:] if argv is None else argv,
            "preset": ns.preset, "layers": ns.layers, "device": str(device), "device_name": name, "dtype": ns.dtype,
            "quantization": ns.quantization, "ple_backend": ns.ple_backend,
            "versions": versions(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"device {name}; " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), flush=True)
    results: dict[str, Any] = {}
    if ns.merge and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        same = all(old.get("meta", {}).get(k) == meta.get(k)
                   for k in ("preset", "layers", "dtype", "device_name", "quantization"))
        if same:
            results = {k: v for k, v in old.items() if k != "meta"}
    results["meta"] = meta
    results["flop_formula"], results["byte_formula"] = FLOP_FORMULA, BYTE_FORMULA

    with tempfile.TemporaryDirectory(prefix="tidal-bench-") as ckpt:
        write_checkpoint(ns.preset, ckpt, weights=False)
        if ns.layers is not None:
            keep_first_layers(ckpt, ns.layers)
        config = ModelConfig.from_file(ckpt)
        elem = torch.tensor([], dtype=dtype).element_size()
        results["config"] = {"params_formula": model_parameters(config), "layers": config.num_hidden_layers,
                             "gdn_layers": len(config.linear_layers), "attention_layers": len(config.attention_layers),
                             "qsa": config.has_qsa, "ple_layers": len(config.ple_layers)}
        results["peak"] = measure_peak(device, dtype)
        results["bandwidth"] = measure_bandwidth(device)
        peak, bandwidth = results["peak"]["flops_per_s"], results["bandwidth"]["bytes_per_s"]
        print(f"peak {peak / 1e12:.3g} TFLOP/s, bandwidth {bandwidth / 1e9:.3g} GB/s", flush=True)
        save(path, results)

        if ns.tidal:
            results["arms"] = {}
            for fmt in ns.quantization:
                results["arms"][fmt] = arm = bench_arm(ckpt, ns, config, device, peak, bandwidth, elem, fmt)
                if fmt == ns.quantization[0]:  # the first arm's tables at the top level as well
                    results["load_s"], results["prefill"], results["decode"] = arm["load_s"], arm["prefill"], \
                        arm["decode"]
                    with contextlib.suppress(KeyError):
                        results["config"]["params_model"] = arm.pop("params_model")
                save(path, results)

        if ns.kernels:
            cuda = device.type == "cuda"
            tokens = ns.kernel_tokens or (32768 if cuda else 256)
            context = ns.kernel_context or (8192 if cuda else 512)
            cases = kernel_cases(config, device, dtype, tokens, ns.kernel_batch, context, tuple(ns.quantization))
            results["kernels"] = bench_kernels(cases, device, peak, bandwidth, ns.kernel_budget_s)
            save(path, results)

        if ns.peer:
            results["peer"] = bench_peer(ckpt, ns.lengths, device, dtype, ns.peer_max_seconds)
        results["peer_ratio"] = peer_ratio(results)
        save(path, results)
    print()
    print(report(results))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
