"""Images in prompts: the vision tower, 3-D rotary positions and vision features through the scheduler,
against transformers' ``Qwen4ExpForConditionalGeneration`` on checkpoints it writes (two configs: other
patch and merge sizes, one and three images, images first and between text)."""

from __future__ import annotations

import os

import pytest
import torch

from tidal import LLM
from tidal.vision import image_input

from .conftest import HF_CONFIGS

IMAGE = 97  # the placeholder id (inside the small vocabularies)
CONFIGS = {
    "patch16_merge2": (HF_CONFIGS["hf_hc2_gqa4"], dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                                                       num_position_embeddings=16)),
    "patch8_merge1": (HF_CONFIGS["hf_hc3_ngram4"], dict(depth=1, hidden_size=48, intermediate_size=64, num_heads=4,
                                                        patch_size=8, spatial_merge_size=1, temporal_patch_size=1,
                                                        num_position_embeddings=36, hidden_act="gelu")),
}


def build(path: str, name: str, seed: int) -> str:
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    text, vision = CONFIGS[name]
    vision = dict(vision, out_hidden_size=text["hidden_size"])
    torch.manual_seed(seed)
    config = Qwen4ExpConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, vision_start_token_id=95,
                            vision_end_token_id=96)
    model = Qwen4ExpForConditionalGeneration(config)
    with torch.no_grad():  # transformers' init zeroes norm offsets and convs: draw everything
        for pname, param in model.named_parameters():
            param.normal_(0, 0.5 if "visual" in pname else 0.08)
            if pname.endswith(("norm.weight", "norm1.weight", "norm2.weight")) and "visual" in pname:
                param.add_(1.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(CONFIGS))
def composite(request, tmp_path_factory):
    from transformers import Qwen4ExpForConditionalGeneration

    path = build(str(tmp_path_factory.mktemp(request.param)), request.param, seed=len(request.param))
    hf = Qwen4ExpForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf


def images_and_prompt(hf, grids: list[tuple[int, int, int]], texts: list[list[int]], seed: int):
    """A prompt of ``texts[0]``, image 0, ``texts[1]``, image 1, ... and the images' inputs."""
    vc = hf.config.vision_config
    merge, dim = vc.spatial_merge_size, vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    gen = torch.Generator().manual_seed(seed)
    prompt, images, pixels = [], [], []
    for i, grid in enumerate(grids):
        prompt += texts[i] + [95]
        px = torch.randn(grid[0] * grid[1] * grid[2], dim, generator=gen)
        images.append(image_input(px, grid, len(prompt), merge))
        pixels.append(px)
        prompt += [IMAGE] * images[-1].tokens + [96]
    prompt += texts[len(grids)]
    return prompt, images, torch.cat(pixels), torch.tensor(grids)


def hf_forward(hf, prompt, pixels, grids):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        return hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
                  mm_token_type_ids=(ids == IMAGE).int()).logits[0]


def hf_greedy(hf, prompt, pixels, grids, n: int) -> list[int]:
    """Greedy ids by full forwards (positions recomputed from the whole sequence each step)."""
    out = []
    seq = list(prompt)
    for _ in range(n):
        tok = int(hf_forward(hf, seq, pixels, grids)[-1].argmax())
        out.append(tok)
        seq.append(tok)
    return out


CASES = {
    "one image between text": ([(1, 4, 6)], [[5, 6, 7], [8, 9, 10, 11]]),
    "image first, three images": ([(1, 4, 4), (1, 2, 6), (1, 6, 2)], [[], [12, 13], [14], [15, 16, 17]]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(composite, case):
    name, path, hf = composite
    grids, texts = CASES[case]
    prompt, images, pixels, grid_t = images_and_prompt(hf, grids, texts, seed=3)
    want = hf_forward(hf, prompt, pixels, grid_t)
    llm = LLM(path, dtype="float32")
    got = llm.score(prompt, images=images)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)


def test_greedy_ids_cold_chunked_cached_and_another_image(composite):
    name, path, hf = composite
    grids, texts = CASES["image first, three images"]
    prompt, images, pixels, grid_t = images_and_prompt(hf, grids, texts, seed=5)
    want = hf_greedy(hf, prompt, pixels, grid_t, 8)
    cold = LLM(path, dtype="float32")
    assert cold.generate([prompt], max_tokens=8, ignore_eos=True, images=[images])[0] == want
    chunked = LLM(path, dtype="float32", max_prefill_length=16, page_size=4, checkpoint_align=8)
    assert chunked.generate([prompt], max_tokens=8, ignore_eos=True, images=[images])[0] == want
    coalesced = LLM(path, dtype="float32", max_prefill_length=16, page_size=4, checkpoint_align=8,
                    prefill_coalesce=True)
    for _ in range(2):  # cold, then from a checkpoint
        assert coalesced.generate([prompt], max_tokens=8, ignore_eos=True, images=[images])[0] == want
    # The same images again: a prefix-cache hit inside the prompt, ids unchanged.
    before = chunked.scheduler.counters.get("cached_tokens", 0)
    assert chunked.generate([prompt], max_tokens=8, ignore_eos=True, images=[images])[0] == want
    assert chunked.scheduler.counters["cached_tokens"] > before
    # Another image at the same places: no hit past the first image's start, transformers' ids.
    other, other_images, other_pixels, _ = images_and_prompt(hf, grids, texts, seed=6)
    assert other == prompt
    hit = chunked.scheduler.counters["cached_tokens"]
    assert chunked.generate([other], max_tokens=8, ignore_eos=True, images=[other_images])[0] == hf_greedy(
        hf, other, other_pixels, grid_t, 8)
    assert chunked.scheduler.counters["cached_tokens"] - hit <= images[0].offset
    # Each distinct image went through the tower once (three, then three others).
    assert chunked.runner.stats()["images_encoded"] == [6]
    stats = chunked.scheduler.stats()
    assert stats.kv_pages_in_use == 0 and stats.state_slots_in_use == 0
    # Layer-major over internal chunks of 16 (in one turn and over turns), cold and after a hit.
    for turns in (1, 3):
        lm = LLM(path, dtype="float32", max_prefill_length=16, page_size=4, checkpoint_align=8,
                 moe_strategy="offload", moe_cache_slots=4, prefill_layer_major=True, layer_major_turns=turns)
        for _ in range(2):
            assert lm.generate([prompt], max_tokens=8, ignore_eos=True, images=[images])[0] == want, turns
        assert lm.scheduler.counters["layer_major_turns"] >= 1


@pytest.mark.parametrize("case", [*CASES, "image last"])
def test_image_requests_decode_in_graph_steps(composite, case):
    """Decode steps of image requests run the graphs' fixed-shape path (on the CPU without capture), their
    rotary positions shifted by what the images add; a step that completes a QSA block starting inside the
    images runs eagerly. Ids equal transformers' over several blocks, alone and beside a text request."""
    name, path, hf = composite
    # The prompt ends a token after its image: the first decodes complete blocks that start inside it.
    grids, texts = CASES[case] if case in CASES else ([(1, 4, 6)], [[5, 6, 7], []])
    prompt, images, pixels, grid_t = images_and_prompt(hf, grids, texts, seed=7)
    want = hf_greedy(hf, prompt, pixels, grid_t, 20)
    llm = LLM(path, dtype="float32", max_running_requests=2)
    llm.runner.use_graphs(4, 16, capture=False)
    text = [5, 6, 7, 8, 9]
    alone = LLM(path, dtype="float32").generate([text], max_tokens=20, ignore_eos=True)[0]
    assert llm.generate([prompt], max_tokens=20, ignore_eos=True, images=[images])[0] == want
    assert llm.runner.graphs.steps >= 17
    got = llm.generate([prompt, text], max_tokens=20, ignore_eos=True, images=[images, []])
    assert got == [want, alone]
    stats = llm.scheduler.stats()
    assert stats.kv_pages_in_use == 0 and stats.state_slots_in_use == 0


def test_text_chunks_of_image_requests_run_prompt_graphs(composite):
    """Prompt chunks past a request's images run the prompt graphs' fixed-shape forward (on the CPU without
    capture), their rotary positions shifted by what the images add: chunked, and a continuation of the cached
    image prompt, which encodes no image. Ids equal transformers'; chunks holding image rows run eagerly."""
    from tidal.executor.prefill_graph import PrefillGraphs

    name, path, hf = composite
    prompt, images, pixels, grid_t = images_and_prompt(hf, [(1, 4, 6)], [[5, 6, 7], list(range(20, 50))], seed=10)
    longer = prompt + list(range(60, 73))
    want = [hf_greedy(hf, p, pixels, grid_t, 6) for p in (prompt, longer)]
    llm = LLM(path, dtype="float32", max_prefill_length=16, page_size=4, checkpoint_align=8)
    r = llm.runner
    r.prefill_graphs = PrefillGraphs(r.model, r.config, r.kv, r.states, r.device, 64,
                                     pad_slot=r.states.num_slots - 1, pad_page=r.kv.num_pages - 1, capture=False,
                                     sizes=(0, 1))
    assert llm.generate([prompt], max_tokens=6, ignore_eos=True, images=[images])[0] == want[0]
    # The continuation's cached prefix holds the image: with the tower's features gone, it runs no tower.
    r.vision_cache.clear()
    assert llm.generate([longer], max_tokens=6, ignore_eos=True, images=[images])[0] == want[1]
    assert r.stats()["images_encoded"] == [1]
    assert r.prefill_graphs.replays >= 3  # chunks of 16 past the image, and the continuation's
    assert llm.scheduler.counters["cached_tokens"] > len(prompt) // 2
    stats = llm.scheduler.stats()
    assert stats.kv_pages_in_use == 0 and stats.state_slots_in_use == 0


@pytest.mark.parametrize("ratio", [4, 16])
def test_graph_rotary_shifts_are_the_images_positions(ratio):
    """A decode row's graph shift turns it, and the block it completes, exactly as the (frame, row, column)
    positions of its request's images do; rows whose completed block starts inside the images get none."""
    import types

    import numpy as np

    from tidal.executor.images import RequestImages
    from tidal.executor.runner import ModelRunner
    from tidal.messages import SegmentSpec

    grids, offsets, merge = [(1, 4, 6), (2, 2, 8)], [3, 13], 2
    ims = [image_input(torch.zeros(t * h * w, 4), (t, h, w), o, merge)
           for (t, h, w), o in zip(grids, offsets, strict=True)]
    images = RequestImages(ims, torch.zeros(sum(im.tokens for im in ims), 1), merge)
    runner = types.SimpleNamespace(config=types.SimpleNamespace(qsa_ratio=ratio), images={3: images})
    shifted = refused = 0
    for pos in range(images.text_from, images.text_from + 3 * ratio):
        spec = SegmentSpec(rid="r", slot=3, start=pos, token_ids=[-1], sample=True)
        shifts = ModelRunner._rope_shifts(runner, [spec, SegmentSpec(rid="t", slot=0, start=pos, token_ids=[1])])
        first = pos + 1 - ratio if (pos + 1) % ratio == 0 else pos
        want = images.positions(np.array([pos, first]))
        if shifts is None:
            refused += 1
            assert first < images.text_from and not (want[:, 1] == first + images.delta).all()
            continue
        shifted += 1
        assert shifts == [images.delta, 0]
        assert (want == np.array([pos, first]) + shifts[0]).all()
    assert shifted and refused


@pytest.mark.gpu
def test_image_requests_on_the_kernels_and_graphs_gpu(composite, monkeypatch):
    """On the GPU (fp32): image requests' greedy ids with the QSA block-key kernel on (frame, row, column)
    positions and decode steps replayed from graphs with rotary shifts, against the same requests with those
    operations on their torch references (which also decode without graphs)."""
    name, path, hf = composite
    requests = [images_and_prompt(hf, *CASES[case], seed=8)[:2] for case in CASES]
    requests.append(images_and_prompt(hf, [(1, 4, 6)], [[5, 6, 7], []], seed=9)[:2])
    prompts, images = [p for p, _ in requests], [i for _, i in requests]
    # Then each prompt with more text: its cached prefix restored, the new text a prompt graph's forward.
    rounds = [prompts, [p + list(range(60, 100)) for p in prompts]]
    kwargs = dict(max_tokens=24, ignore_eos=True, images=images)
    monkeypatch.setenv("TIDAL_KERNELS", "torch:norm_rotary,decode_prep")
    ref = LLM(path, device="cuda", dtype="float32", page_size=4, checkpoint_align=8)
    want = [ref.generate(ps, **kwargs) for ps in rounds]
    monkeypatch.delenv("TIDAL_KERNELS")
    llm = LLM(path, device="cuda", dtype="float32", page_size=4, checkpoint_align=8)
    assert [llm.generate(ps, **kwargs) for ps in rounds] == want
    assert llm.runner.graphs is not None and llm.runner.graphs.steps > 0
    assert llm.runner.prefill_graphs is not None and llm.runner.prefill_graphs.replays > 0


def test_bad_image_runs_are_refused(composite):
    name, path, hf = composite
    prompt, images, _, _ = images_and_prompt(hf, [(1, 4, 4)], [[5], [6]], seed=1)
    llm = LLM(path, dtype="float32")
    from tidal.llm import GenerationError
    from tidal.messages import ImageInput

    moved = ImageInput(offset=images[0].offset - 1, tokens=images[0].tokens, grid=images[0].grid,
                       pixels=images[0].pixels, digest=images[0].digest)
    with pytest.raises(GenerationError, match="image 0: prompt positions"):
        llm.generate([prompt], max_tokens=2, images=[[moved]])
    assert llm.generate([prompt], max_tokens=2, images=[images])  # the server goes on


def test_images_sent_as_rgb_equal_transformers_pixel_values(composite, tmp_path):
    """Images as a request sends them (resized RGB bytes, the executor computing their pixel values with the
    checkpoint's image processor, here with CLIP's mean and std) give transformers' greedy ids from its own image
    processor's pixel values; RGB bytes that do not fit the grid are refused with the sizes."""
    import json
    import shutil

    import numpy as np
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tidal.llm import GenerationError
    from tidal.messages import ImageInput
    from tidal.vision import ImageProcessor, rgb_input

    name, path, hf = composite
    vc = hf.config.vision_config
    settings = dict(patch_size=vc.patch_size, merge_size=vc.spatial_merge_size,
                    temporal_patch_size=vc.temporal_patch_size,
                    image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
    size = {"shortest_edge": 256, "longest_edge": 4096}
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(path, ckpt)
    with open(os.path.join(ckpt, "preprocessor_config.json"), "w") as f:
        json.dump({**settings, "size": size}, f)
    ref = Qwen2VLImageProcessorPil(**settings, size=size)
    processor = ImageProcessor.from_checkpoint(ckpt, vc.to_dict(), IMAGE)
    rng = np.random.default_rng(7)
    pictures = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((50, 70), (33, 20))]
    want = ref(images=pictures, return_tensors="np")
    prompt, images = [5, 6], []
    for picture in pictures:
        rgb, grid = processor.resize(picture)
        prompt.append(95)
        images.append(rgb_input(rgb, len(prompt), processor))
        assert images[-1].pixels == b"" and len(images[-1].rgb) == rgb.size
        prompt += [IMAGE] * images[-1].tokens + [96, 7]
    assert [im.grid for im in images] == want["image_grid_thw"].tolist()
    expected = hf_greedy(hf, prompt, torch.from_numpy(want["pixel_values"]),
                         torch.from_numpy(want["image_grid_thw"]), 6)
    llm = LLM(ckpt, dtype="float32")
    assert llm.generate([prompt], max_tokens=6, ignore_eos=True, images=[images])[0] == expected
    short = ImageInput(offset=images[0].offset, tokens=images[0].tokens, grid=images[0].grid, pixels=b"",
                       digest="0" * 64, rgb=images[0].rgb[:-3])
    with pytest.raises(GenerationError, match=r"ValueError: an image of grid \[1, \d+, \d+\] sent \d+ bytes of RGB, "
                                              r"not \d+ x \d+ x 3"):
        llm.generate([prompt], max_tokens=2, images=[[short, images[1]]])
    assert llm.generate([prompt], max_tokens=6, ignore_eos=True, images=[images])[0] == expected  # serves on


def _tp_rank(rank: int, port: int, path: str, runs, queue) -> None:
    torch.set_num_threads(1)
    from tidal.executor.distributed import init_tp

    init_tp(rank, 2, f"tcp://127.0.0.1:{port}", "gloo")
    try:
        results = []
        for prompt, images, kwargs in runs:
            llm = LLM(path, tp=2, dtype="float32", **kwargs)
            logits = llm.score(prompt, images=images)
            ids = [llm.generate([prompt], max_tokens=8, ignore_eos=True, images=[images])[0] for _ in range(2)]
            results.append((logits.numpy(), ids, llm.runner.stats().get("tp_hc_shard_forwards", [0])[0]))
        if rank == 0:
            queue.put(results)
    except Exception as e:  # report instead of hanging the parent
        queue.put(e)
        raise


@pytest.mark.parametrize("composite", ["patch16_merge2"], indirect=True)  # the other config's 1 GDN key head
def test_tensor_parallel_two_ranks_equal_one(composite):
    """Under --tp 2 (gloo): the same logits and greedy ids, cold and after a prefix-cache hit; and a
    1,024-row prompt with images prefilled with hyper-connection row sharding."""
    from .test_tensor_parallel import spawn_ranks

    name, path, hf = composite
    grids, texts = CASES["image first, three images"]
    prompt, images, _, _ = images_and_prompt(hf, grids, texts, seed=5)
    chunked = dict(max_prefill_length=16, page_size=4, checkpoint_align=8)
    long_texts = [[], [12, 13], [14] * 500, [15] * (1024 - 502 - 16)]  # 16: 10 vision tokens, 6 marks
    long, long_images, _, _ = images_and_prompt(hf, grids, long_texts, seed=6)
    assert len(long) == 1024
    sharded = dict(max_prefill_length=1024, hc_prefill_mode="shard", disable_prefix_cache=True)
    runs = [(prompt, images, chunked), (long, long_images, sharded)]
    want = []
    for p, im, kwargs in runs:
        one = LLM(path, dtype="float32", **{k: v for k, v in kwargs.items() if k != "hc_prefill_mode"})
        want.append((one.score(p, images=im), one.generate([p], max_tokens=8, ignore_eos=True, images=[im])[0]))
    result = spawn_ranks(2, _tp_rank, lambda rank, port, queue: (rank, port, path, runs, queue), timeout=600)
    for (logits, ids, shard_forwards), (ref_logits, ref_ids), (_, _, kwargs) in zip(result, want, runs, strict=True):
        assert (torch.from_numpy(logits) - ref_logits).abs().max().item() <= 1e-4
        assert ids == [ref_ids, ref_ids]
        assert (shard_forwards > 0) == ("hc_prefill_mode" in kwargs)


def test_preempted_image_requests_equal_their_runs_alone(composite):
    """Three image requests share a pool too small for all: preempted ones resume (their images sent
    and their positions rebuilt again) and generate what each does alone."""
    name, path, hf = composite
    runs = [images_and_prompt(hf, *CASES["one image between text"], seed=20),
            images_and_prompt(hf, *CASES["image first, three images"], seed=21),
            images_and_prompt(hf, [(1, 2, 2)], [[30, 31], [32]], seed=22)]
    prompts = [r[0] for r in runs]
    images = [r[1] for r in runs]
    small = dict(dtype="float32", max_prefill_length=16, page_size=4, checkpoint_align=8)
    alone = [LLM(path, **small).generate([p], max_tokens=40, ignore_eos=True, images=[im])[0]
             for p, im in zip(prompts, images, strict=True)]
    need = max(len(p) for p in prompts) + 40
    llm = LLM(path, **small, kv_pool_tokens=2 * need, max_model_len=need + 4)
    assert llm.generate(prompts, max_tokens=40, ignore_eos=True, images=images) == alone
    assert llm.scheduler.counters["preemptions"] > 0
    stats = llm.scheduler.stats()
    assert stats.kv_pages_in_use == 0 and stats.state_slots_in_use == 0


def fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 as the published Qwen FP8 checkpoints store it (128 x 128 blocks, scale = amax / 448), in
    plain torch: ``(float8_e4m3fn values, weight_scale_inv)``."""
    rows, cols = w.shape
    rb, cb = -(-rows // 128), -(-cols // 128)
    padded = torch.zeros(rb * 128, cb * 128)
    padded[:rows, :cols] = w
    blocks = padded.view(rb, 128, cb, 128)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(rb * 128, cb * 128)[:rows, :cols].contiguous(), scale


def test_a_block_fp8_vision_tower_loads_dequantized(composite, tmp_path):
    """A checkpoint whose tower's linear weights are block FP8 (with ``weight_scale_inv``) serves the logits of
    transformers' model on the dequantized weights."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import Qwen4ExpForConditionalGeneration

    name, path, hf = composite
    quant = tmp_path / "fp8"
    shutil.copytree(path, quant)
    files = [f for f in os.listdir(quant) if f.endswith(".safetensors")]
    deq = {}
    for f in files:
        tensors = load_file(quant / f)
        for key in [k for k in tensors if k.startswith("model.visual.") and k.endswith(".weight")
                    and tensors[k].dim() == 2 and "pos_embed" not in k]:
            q, scale = fp8_block(tensors[key].float())
            tensors[key], tensors[key[:-len("weight")] + "weight_scale_inv"] = q, scale
            rows = torch.arange(q.shape[0]) // 128
            deq[key] = q.float() * scale[rows].repeat_interleave(128, dim=1)[:, :q.shape[1]]
        save_file(tensors, quant / f)
    assert deq
    ref = Qwen4ExpForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        params = dict(ref.named_parameters())
        for key, value in deq.items():
            params[key].copy_(value)
    grids, texts = CASES["one image between text"]
    prompt, images, pixels, grid_t = images_and_prompt(ref, grids, texts, seed=9)
    got = LLM(str(quant), dtype="float32").score(prompt, images=images)
    torch.testing.assert_close(got, hf_forward(ref, prompt, pixels, grid_t), atol=1e-3, rtol=0)
