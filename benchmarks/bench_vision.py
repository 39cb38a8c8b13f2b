"""A long vision prompt through ``tidal serve``, cold and warm, beside the vision tower alone.

    python benchmarks/bench_vision.py --out DIR [--preset bench] [--prompt-tokens 6598] [--device cuda]
                                      [--vision '{"depth": 27, ...}'] [-- extra tidal serve flags]

The preset's config with a vision tower (transformers' ``Qwen4ExpVisionConfig`` defaults: 27 blocks of width
1152, patch 16, merge 2; ``--vision`` overrides fields) and random weights (``--load-format random``) is served;
one chat request holds a short text and one image sized so that the prompt has about ``--prompt-tokens``
tokens. Streamed from outside (greedy, 8 output tokens): the cold request's first text, then the same request
again (its prefix cached: first text and cached tokens). In this process, after the server stops: the tower
alone on the same image's pixel values (median of 3 warm runs; its share of the cold first text), and the
same prompt through ``tidal.LLM`` (the server's scheduler and executor without the mesh: the forward-level
figure). Writes ``DIR/bench_vision.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import os
import statistics
import sys
import tempfile
import time

import aiohttp
import numpy as np
import torch

from tidal import LLM
from tidal.bench.server import Server, split_serve_flags
from tidal.bench.timing import host_seconds
from tidal.executor.presets import write_checkpoint
from tidal.vision import ImageProcessor, image_input

VISION_DEFAULTS = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                       spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                       hidden_act="gelu_pytorch_tanh")
TEXT = "Describe this picture in detail."
OUTPUT = 8


def composite(preset: str, vision: dict, max_pixels: int) -> str:
    path = write_checkpoint(preset, tempfile.mkdtemp(), weights=False)
    with open(os.path.join(path, "config.json")) as f:
        text = json.load(f)
    vision = {**VISION_DEFAULTS, **vision, "out_hidden_size": text["hidden_size"]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "qwen4_exp", "text_config": text, "vision_config": vision}, f)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump({"patch_size": vision["patch_size"], "merge_size": vision["spatial_merge_size"],
                   "temporal_patch_size": vision["temporal_patch_size"],
                   "size": {"shortest_edge": 1024, "longest_edge": max_pixels}}, f)
    return path


def image_of(tokens: int, factor: int) -> np.ndarray:
    """An RGB image whose size is a multiple of ``factor`` with about ``tokens`` vision tokens, 1:2."""
    rows = max(1, math.isqrt(tokens // 2))
    cols = max(1, tokens // rows)
    rng = np.random.default_rng(0)
    return rng.integers(0, 255, (rows * factor, cols * factor, 3), dtype=np.uint8)


def png(array: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


async def first_text(url: str, image_png: bytes) -> tuple[float, dict]:
    body = {"model": "bench", "stream": True, "max_tokens": OUTPUT, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": TEXT},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image_png)
                                                    .decode()}}]}]}
    first, usage = None, {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        t0 = time.monotonic()
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
            async for line in r.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"the request failed: {chunk['error']}")
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    first = time.monotonic() - t0
    return first, usage


def main() -> None:
    argv, extra = split_serve_flags(sys.argv[1:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--prompt-tokens", type=int, default=6598)
    ap.add_argument("--vision", type=json.loads, default={})
    ap.add_argument("--device", default="cuda")
    ns = ap.parse_args(argv)
    os.makedirs(ns.out, exist_ok=True)
    vision = {**VISION_DEFAULTS, **ns.vision}
    factor = vision["patch_size"] * vision["spatial_merge_size"]
    array = image_of(max(1, ns.prompt_tokens - 20), factor)  # ~20 tokens of template and text
    max_pixels = array.shape[0] * array.shape[1]
    path = composite(ns.preset, ns.vision, max_pixels)
    image_png = png(array)
    context = ns.prompt_tokens * 2 + 1024
    flags = ["--load-format", "random", "--max-model-len", str(context), "--kv-pool-tokens", str(context * 2),
             "--max-image-pixels", str(max_pixels), *extra]
    t0 = time.monotonic()
    srv = Server(path, *flags, served_model_name="bench", device=ns.device, ready_timeout=1800)
    out: dict = {"preset": ns.preset, "device": ns.device, "vision": vision, "image": list(array.shape[:2]),
                 "flags": flags, "start_to_ready_s": time.monotonic() - t0}
    try:
        cold, usage = asyncio.run(first_text(srv.url, image_png))
        warm, warm_usage = asyncio.run(first_text(srv.url, image_png))
        out["cold"] = {"first_text_s": cold, "prompt_tokens": usage["prompt_tokens"]}
        out["warm"] = {"first_text_s": warm, "cached_tokens": warm_usage["prompt_tokens_details"]["cached_tokens"]}
        print(f"{usage['prompt_tokens']}-token vision prompt: cold first text {cold:.3f} s, warm {warm:.3f} s "
              f"({out['warm']['cached_tokens']} cached)", flush=True)
    finally:
        out["left_after_stop"] = srv.stop()

    llm = LLM(path, device=ns.device, dtype="auto", load_format="random", max_model_len=context,
              kv_pool_tokens=context * 2)
    processor = ImageProcessor.from_checkpoint(path, llm.config.vision_config, llm.config.image_token_id)
    from PIL import Image

    pixels, grid = processor.preprocess(Image.fromarray(array))
    tower = llm.runner.model.visual
    values = torch.from_numpy(pixels).to(llm.runner.device)
    with torch.inference_mode():
        runs = [host_seconds(lambda: tower(values, [grid]), llm.runner.device) for _ in range(4)][1:]
    encoder = statistics.median(runs)
    tokens = processor.tokens(grid)
    prompt = [11] * 10 + [llm.config.vision_start_token_id] + [llm.config.image_token_id] * tokens + [
        llm.config.vision_end_token_id] + [12] * 10
    images = [image_input(pixels, grid, 11, processor.merge_size)]
    llm.generate([prompt], max_tokens=1, ignore_eos=True, images=[images])  # warm-up
    other = [image_input(pixels[::-1].copy(), grid, 11, processor.merge_size)]  # another image: nothing cached
    forward = host_seconds(lambda: llm.generate([prompt], max_tokens=1, ignore_eos=True, images=[other]),
                           llm.runner.device)
    out["encoder_s"] = encoder
    out["encoder_share_of_cold"] = encoder / cold
    out["forward_prefill_s"] = forward
    out["cold_over_forward"] = cold / forward
    with open(os.path.join(ns.out, "bench_vision.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"vision tower alone {encoder:.3f} s ({out['encoder_share_of_cold']:.0%} of the cold first text); "
          f"the same prompt's prefill in-process {forward:.3f} s (cold first text / that = "
          f"{out['cold_over_forward']:.2f})")


if __name__ == "__main__":
    main()
