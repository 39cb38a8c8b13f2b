"""Images through ``tidal serve`` with the official ``openai`` SDK: base64 images in chat, streamed and
not; usage counting the vision tokens as transformers' image processor sizes them; prefix-cache hits on
the same image only; a fetched image from an allowed host; and a 400 naming the part for a remote URL on
another host, a corrupt image, too many pixels or images, while the server serves on."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import json
import os
import shutil
import threading

import numpy as np
import openai
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

PROCESSOR = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
             "size": {"shortest_edge": 4096, "longest_edge": 65536},
             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


@pytest.fixture(scope="module")
def composite(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with a small vision tower (transformers' module, random weights), its
    composite config.json and a preprocessor_config.json."""
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpVisionConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpVisionModel

    path = str(tmp_path_factory.mktemp("vl"))
    for name in os.listdir(tiny_checkpoint):
        shutil.copy(os.path.join(tiny_checkpoint, name), path)
    with open(os.path.join(path, "config.json")) as f:
        text = json.load(f)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                  num_position_embeddings=16)
    torch.manual_seed(0)
    tower = Qwen4ExpVisionModel(Qwen4ExpVisionConfig(**vision))
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0, 0.2)
    save_file({f"model.visual.{k}": v.contiguous() for k, v in tower.state_dict().items()},
              os.path.join(path, "vision.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "qwen4_exp", "text_config": text, "vision_config": vision}, f)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(PROCESSOR, f)
    return path


class Images(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("www")
    (root / "cat.png").write_bytes(png(drawn(90, 70, 3)))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Images, directory=str(root)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(composite):
    from server_harness import Server

    srv = Server(composite, "--allowed-media-domains", "127.0.0.1", "--max-image-pixels", "200000",
                 "--max-images-per-request", "3", api_key=None)
    yield srv
    assert srv.stop() == []


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


def drawn(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


def png(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def ask(image_urls: list[str], text: str = "what is this?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in image_urls]
    return [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]


def vision_tokens(image: Image.Image) -> int:
    """Tokens of an image as transformers' image processor sizes it (an independent count)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ref = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                   size={"shortest_edge": 4096, "longest_edge": 65536})
    return ref.get_number_of_image_patches(image.height, image.width) // 4


LONG = " ".join(f"word{i}" for i in range(60))  # past a checkpoint (every 64 tokens)


def test_images_in_chat_streamed_and_not(server, client):
    image = drawn(200, 120, 1)
    text_only = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": LONG}],
                                               max_tokens=4, temperature=0)
    r = client.chat.completions.create(model="tiny", messages=ask([data_url(png(image))], LONG), max_tokens=6,
                                       temperature=0, extra_body={"ignore_eos": True})
    # The image adds <|vision_start|>, its vision tokens and <|vision_end|> to the text-only prompt.
    assert r.usage.prompt_tokens == text_only.usage.prompt_tokens + vision_tokens(image) + 2
    assert r.usage.completion_tokens == 6
    stream = client.chat.completions.create(model="tiny", messages=ask([data_url(png(image))], LONG), max_tokens=6,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same image: a prefix-cache hit
    server.wait_idle()


def test_cache_hits_only_the_same_image(server, client):
    base = [data_url(png(drawn(96, 96, 7))), data_url(png(drawn(96, 96, 8)))]
    first = client.chat.completions.create(model="tiny", messages=ask(base, LONG), max_tokens=1)
    again = client.chat.completions.create(model="tiny", messages=ask(base, LONG), max_tokens=1)
    other = client.chat.completions.create(model="tiny", messages=ask([base[0], data_url(png(drawn(96, 96, 9)))],
                                                                      LONG), max_tokens=1)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens == other.usage.prompt_tokens
    total = first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens >= total - 80
    # The second image differs: nothing from its start on is reused.
    second_start = total - (vision_tokens(drawn(96, 96, 9)) + 1) - 5
    assert other.usage.prompt_tokens_details.cached_tokens <= second_start
    m = server.wait_idle()
    assert m["tidal_kv_pages_in_use"] == 0 and m["tidal_state_slots_in_use"] == 0


def test_an_image_from_an_allowed_host(server, client, files):
    r = client.chat.completions.create(model="tiny", messages=ask([f"{files}/cat.png"]), max_tokens=2)
    assert r.usage.prompt_tokens > vision_tokens(drawn(90, 70, 3))


@pytest.mark.parametrize("url, message", [
    ("http://localhost:1/cat.png", "does not fetch images from 'localhost'"),
    ("https://example.com/cat.png", "does not fetch images from 'example.com'"),
    (data_url(b"\x89PNG\r\n\x1a\n" + b"\0" * 40), "could not be read"),
    (data_url(png(drawn(500, 401, 2))), "more than the 200000 allowed"),
    ("data:image/png;base64,%%%", "not valid base64"),
])
def test_unusable_images_get_a_400_naming_the_part(server, client, url, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ask([url]), max_tokens=2)
    body = e.value.body
    assert body["param"] == "messages[0].content[1]" and message in body["message"], body
    assert client.chat.completions.create(model="tiny", messages=ask([data_url(png(drawn(64, 64, 4)))]),
                                          max_tokens=1).usage.completion_tokens == 1


def test_too_many_images_and_images_outside_user_messages(server, client):
    url = data_url(png(drawn(40, 40, 5)))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ask([url] * 4), max_tokens=1)
    assert e.value.body["param"] == "messages[0].content[4]" and "at most 3 images" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", max_tokens=1, messages=[
            {"role": "system", "content": [{"type": "image_url", "image_url": {"url": url}}]},
            {"role": "user", "content": "hi"}])
    assert e.value.body["param"] == "messages[0].content[0]" and "user messages" in e.value.body["message"]
    server.wait_idle()
