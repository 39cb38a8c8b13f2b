"""Layer-major long prefill against chunked, with experts streamed from host memory (device-only).

    python benchmarks/bench_layer_major.py --out DIR [--preset bench] [--cold 32012] [--continuation 32077]
                                        [--chunk 4096] [--cache-fraction 0.11] [--arms chunked,layer_major,resident]
                                        [--no-coalesce] [--prompts text|ids] [--pairs 3]
                                        [--quantization nvfp4|fp8] [--ple-backend pinned|gpu|disk] [--layers N]

The seed's protocol against a fresh ``tidal serve`` per arm (``--load-format random``, pinned PLE,
``--max-prefill-length`` 4096, an expert cache of ~11% of all experts for the offload arms,
``--prefill-coalesce`` in every arm unless ``--no-coalesce``: a layer-major prefill always exports its
checkpoint from inside its one forward, and so every arm runs the prompt in the same forwards and
gives the same greedy ids, none paying a separate tail forward): three 512-token warm-ups, then
(cold, continuation) pairs built from three repeated paragraphs with the served tokenizer
(``--prompts ids``: random token ids instead, sent as token-id prompts); the first pair warms the
long shapes and is not scored, the other two colds are.
Each request streams ``temperature 0, max_tokens 128, ignore_eos``; first text is the first SSE
event with non-empty text, timed from just before the HTTP request. Per arm: medians of first-text
and full-response time and output tok/s, host-to-device expert bytes per scored cold request up to
its first text (``/metrics`` read when the first text arrives; a decode step or two may slip in),
and the PCIe floor: those bytes over the pinned host-to-device bandwidth measured in this run.
Decode tok/s is the tokens after the first over the time from first text to the response's end. Device memory
is what the GPU has in use (``cudaMemGetInfo``) less what it had before the arm's server started, read after the
last request; host memory the resident set of the server's processes (pinned memory included). Token ids (from the
tap) are compared across arms. ``--quantization`` serves random weights in a quantized layout (the real-depth
``flash-next`` preset fits one H200 only so); ``--pairs`` fewer (cold, continuation) pairs (one: the cold is
scored though it is the first at its length). With the resident arm in the run, ``layer_major_over_bound`` is
layer-major's first text over the longer of its PCIe floor and the resident arm's first text. Writes
``DIR/bench_layer_major.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from tidal.bench.client import greedy_stream
from tidal.bench.server import Server, rss_bytes
from tidal.bench.tap import TapReader
from tidal.bench.timing import h2d_bandwidth
from tidal.executor.presets import keep_first_layers, write_checkpoint
from tidal.tokenizer import load_tokenizer

SHORT = "Arithmetic exercises: add two small integers and explain the answer.\n"
PARAGRAPHS = [
    "Astronomy records describe distant stars, spectral lines, orbital periods and careful observations.\n",
    "Botanical notes describe leaves, roots, flowering seasons, soil moisture and seed dispersal.\n",
    "Cartography exercises describe rivers, mountain contours, compass bearings and geographic coordinates.\n",
]
GiB = 1 << 30
ARM_FLAGS = {
    "chunked": ["--moe-strategy", "offload"],
    "layer_major": ["--moe-strategy", "offload", "--prefill-layer-major"],
    "resident": ["--moe-strategy", "resident"],
}


def exact(tok, text: str, length: int) -> str:
    """Text that encodes to exactly ``length`` tokens (the seed's construction)."""
    ids = tok.encode(text)[:length]
    assert len(ids) == length, f"the text encodes to only {len(ids)} tokens"
    out = tok.decode(ids, skip_special=False)
    assert tok.encode(out) == ids, "the cut text does not re-encode to the same ids"
    return out


def expert_bytes(srv: Server, metrics: dict[str, float] | None = None) -> float:
    m = srv.metrics() if metrics is None else metrics
    return sum(v for k, v in m.items() if k.startswith("tidal_expert_bytes_total"))


def run_arm(arm: str, path: str, ns, prompts: dict, slots: int) -> dict:
    flags = ["--load-format", "random", "--max-prefill-length", str(ns.chunk),
             "--ple-backend", ns.ple_backend, "--max-running-requests", "2", "--max-model-len", "98304",
             "--kv-pool-tokens", "98304", "--enable-cache-report", *ARM_FLAGS[arm]]
    if ns.quantization:
        flags += ["--quantization", ns.quantization]
    flags.append("--prefill-coalesce" if ns.coalesce else "--no-prefill-coalesce")
    if arm != "resident":
        flags += ["--moe-cache-slots", str(slots)]
    device_before = device_used(ns.device)
    t0 = time.monotonic()
    srv = Server(path, *flags, served_model_name="bench", device=ns.device, ready_timeout=900)
    start_s = time.monotonic() - t0
    tap = TapReader(srv.tap_addr)
    out = {"arm": arm, "flags": flags, "start_s": start_s, "requests": []}
    try:
        for name, prompt in prompts["sequence"]:
            # The counters of the request before reach /metrics with the scheduler's idle snapshot, which may
            # trail its last streamed event: read the start only once that snapshot is in.
            before = expert_bytes(srv, srv.wait_idle())
            at_first: list[float] = []
            obs = greedy_stream(srv.url, prompt, ns.max_tokens, "bench",
                                on_first_text=lambda seen=at_first: seen.append(expert_bytes(srv)))
            rec = tap.wait(obs["rid"], timeout=600)
            if rec is None:
                raise RuntimeError(f"the tap never saw {obs['rid']} finish")
            r = {k: obs[k] for k in ("rid", "first_text_s", "full_s", "usage", "finish_reason", "done")}
            r.update(name=name, expert_bytes=expert_bytes(srv, srv.wait_idle()) - before, token_ids=rec.token_ids,
                     expert_bytes_to_first_text=(at_first[0] - before) if at_first else None,
                     output_tok_per_s=obs["usage"]["completion_tokens"] / obs["full_s"],
                     decode_tok_per_s=(obs["usage"]["completion_tokens"] - 1) / (obs["full_s"] - obs["first_text_s"]),
                     cached_tokens=rec.cached_tokens, prompt_tokens=rec.prompt_tokens, plan=rec.plan)
            ok = r["done"] and r["finish_reason"] == "length" and r["usage"]["completion_tokens"] == ns.max_tokens
            r["checks_ok"] = bool(ok)
            out["requests"].append(r)
            print(f"{arm:12s} {name:22s} first {r['first_text_s']:.3f} s full {r['full_s']:.3f} s "
                  f"cached {r['cached_tokens']} mode {r['plan']['mode']} H2D to first text "
                  f"{(r['expert_bytes_to_first_text'] or 0) / 1e9:.2f} GB, in all {r['expert_bytes'] / 1e9:.2f} GB "
                  f"checks {'ok' if ok else 'FAILED'}", flush=True)
        out["device_bytes"] = device_used(ns.device) - device_before
        out["host_bytes"] = rss_bytes(srv.proc.pid)
        print(f"{arm:12s} memory: device {out['device_bytes'] / GiB:.1f} GiB, host {out['host_bytes'] / GiB:.1f} GiB",
              flush=True)
    finally:
        tap.close()
        out["left_after_stop"] = srv.stop()
    return out


def device_used(device: str) -> int:
    if not device.startswith("cuda"):
        return 0
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return total - free


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--cold", type=int, default=32012)
    ap.add_argument("--continuation", type=int, default=32077)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--cache-fraction", type=float, default=0.11)
    ap.add_argument("--arms", default="chunked,layer_major,resident")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--coalesce", action=argparse.BooleanOptionalAction, default=True,
                    help="--prefill-coalesce in every arm (--no-coalesce: --no-prefill-coalesce)")
    ap.add_argument("--pairs", type=int, default=3, choices=[1, 2, 3], help="(cold, continuation) pairs")
    ap.add_argument("--quantization", default=None, choices=["nvfp4", "fp8"],
                    help="random weights in this quantized layout")
    ap.add_argument("--ple-backend", default="pinned", choices=["gpu", "pinned", "disk"])
    ap.add_argument("--prompts", default="text", choices=["text", "ids"],
                    help="text: the seed's repeated paragraphs; ids: random token ids (with random weights they "
                         "spread a chunk's routing over the experts as trained routers do; text repeated this way "
                         "concentrates it)")
    ap.add_argument("--layers", type=int, default=None, help="the preset's first N decoder layers")
    ns = ap.parse_args()
    os.makedirs(ns.out, exist_ok=True)
    path = write_checkpoint(ns.preset, tempfile.mkdtemp(), weights=False)
    if ns.layers:
        keep_first_layers(path, ns.layers)
    tok = load_tokenizer(path)
    from tidal.config.model import ModelConfig

    config = ModelConfig.from_file(path)
    slots = max(config.num_experts_per_tok, int(config.num_experts * config.num_hidden_layers * ns.cache_fraction))
    if ns.prompts == "text":
        short = exact(tok, SHORT * 100, 512)
        pairs = []
        for paragraph in PARAGRAPHS[:ns.pairs]:
            continuation = exact(tok, paragraph * 3500, ns.continuation)
            cold = exact(tok, continuation, ns.cold)
            assert continuation.startswith(cold)
            pairs.append((cold, continuation))
    else:  # token ids drawn at random from ordinary (non-special) ids, sent as the prompt itself
        gen = torch.Generator().manual_seed(0)

        def draw(n: int) -> list[int]:
            return torch.randint(1000, 150000, (n,), generator=gen).tolist()
        short = draw(512)
        pairs = []
        for _ in PARAGRAPHS[:ns.pairs]:
            cold = draw(ns.cold)
            pairs.append((cold, cold + draw(ns.continuation - ns.cold)))
    sequence = [("warmup-1", short), ("warmup-2", short), ("functional", short)]
    for i, (cold, continuation) in enumerate(pairs):
        sequence += [(f"cold-{i}", cold), (f"continuation-{i}", continuation)]
    bandwidth = h2d_bandwidth(ns.device)
    print(f"pinned host-to-device: {bandwidth / 1e9:.1f} GB/s; expert cache {slots} slots", flush=True)
    arms = [run_arm(a, path, ns, {"sequence": sequence}, slots) for a in ns.arms.split(",")]
    summary = {}
    for arm in arms:
        scored = [r for r in arm["requests"] if r["name"] in (("cold-1", "cold-2") if ns.pairs > 1 else ("cold-0",))]
        med = {k: statistics.median(r[k] for r in scored)
               for k in ("first_text_s", "full_s", "output_tok_per_s", "decode_tok_per_s")}
        moved = statistics.median(r["expert_bytes_to_first_text"] or 0 for r in scored)
        med.update(h2d_bytes=moved, pcie_floor_s=moved / bandwidth, device_bytes=arm["device_bytes"],
                   host_bytes=arm["host_bytes"], all_checks_ok=all(r["checks_ok"] for r in arm["requests"]))
        summary[arm["arm"]] = med
    reference = [r["token_ids"] for r in arms[0]["requests"]]
    same_ids = {a["arm"]: [r["token_ids"] for r in a["requests"]] == reference for a in arms}
    result = {"preset": ns.preset, "layers": config.num_hidden_layers, "quantization": ns.quantization,
              "ple_backend": ns.ple_backend, "prompts": ns.prompts, "coalesce": ns.coalesce,
              "h2d_bytes_per_s": bandwidth,
              "cache_slots": slots, "summary": summary, "ids_equal_to_first_arm": same_ids, "arms": arms}
    if "chunked" in summary and "layer_major" in summary:
        lm, ch = summary["layer_major"], summary["chunked"]
        result["first_text_ratio_chunked_over_layer_major"] = ch["first_text_s"] / lm["first_text_s"]
        result["layer_major_over_pcie_floor"] = lm["first_text_s"] / lm["pcie_floor_s"] if lm["pcie_floor_s"] else None
    if "resident" in summary and "layer_major" in summary:
        # What layer-major can reach: the link's floor or the resident forward, whichever is longer.
        lm, resident = summary["layer_major"], summary["resident"]
        result["layer_major_over_bound"] = lm["first_text_s"] / max(lm["pcie_floor_s"], resident["first_text_s"])
    with open(os.path.join(ns.out, "bench_layer_major.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("\narm           first-text s  full s   out tok/s  decode tok/s  H2D GB   PCIe floor s  device GiB  "
          "host GiB  checks  ids")
    for name, med in summary.items():
        print(f"{name:12s}  {med['first_text_s']:12.3f}  {med['full_s']:7.3f}  {med['output_tok_per_s']:9.2f}  "
              f"{med['decode_tok_per_s']:12.2f}  {med['h2d_bytes'] / 1e9:7.2f}  {med['pcie_floor_s']:12.3f}  "
              f"{med['device_bytes'] / GiB:10.1f}  {med['host_bytes'] / GiB:8.1f}  {str(med['all_checks_ok']):6s}  "
              f"{same_ids[name]}")
    for key in ("first_text_ratio_chunked_over_layer_major", "layer_major_over_pcie_floor", "layer_major_over_bound"):
        if key in result:
            print(f"{key}: {result[key]}")


if __name__ == "__main__":
    main()
