"""Image preprocessing against transformers' own image processor (``Qwen2VLImageProcessorPil``, the
processor ``qwen4_exp`` checkpoints name): the same pixel values and grids for images drawn with Pillow in
each supported format, mode and shape, under other patch, merge and pixel-range settings; and the
request-facing errors."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image, ImageDraw

from tidal.vision import ImageError, ImageProcessor, decode_image, read_image_url


def drawn(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (width, height), tuple(int(x) for x in rng.integers(0, 255, 3)))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        draw.ellipse([x0, y0, x0 + width // 3, y0 + height // 4], fill=tuple(int(x) for x in rng.integers(0, 255, 3)))
    noise = rng.integers(0, 40, (height, width, 3), dtype=np.uint8)
    image = Image.fromarray(np.clip(np.array(image).astype(int) + noise, 0, 255).astype(np.uint8))
    if mode == "RGBA":
        alpha = Image.fromarray(rng.integers(0, 255, (height, width), dtype=np.uint8))
        image = image.convert("RGBA")
        image.putalpha(alpha)
    elif mode != "RGB":
        image = image.convert(mode)
    return image


def encoded(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **({"quality": 90} if fmt in ("JPEG", "WEBP") else {}))
    return out.getvalue()


SETTINGS = [
    dict(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=65536, max_pixels=16777216),
    dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136, max_pixels=50176,
         image_mean=(0.48145466, 0.4578275, 0.40821073), image_std=(0.26862954, 0.26130258, 0.27577711)),
    dict(patch_size=8, merge_size=1, temporal_patch_size=1, min_pixels=256, max_pixels=20000),
]
IMAGES = [(97, 61, "RGB", "PNG"), (300, 40, "RGBA", "PNG"), (45, 128, "L", "PNG"), (640, 480, "RGB", "JPEG"),
          (123, 77, "RGB", "WEBP"), (33, 900, "P", "PNG")]


@pytest.mark.parametrize("settings", range(len(SETTINGS)))
@pytest.mark.parametrize("shape", IMAGES, ids=lambda s: f"{s[0]}x{s[1]}-{s[2]}-{s[3]}")
def test_pixel_values_equal_transformers(settings, shape):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    s = dict(SETTINGS[settings])
    mean, std = s.pop("image_mean", (0.5, 0.5, 0.5)), s.pop("image_std", (0.5, 0.5, 0.5))
    width, height, mode, fmt = shape
    image = decode_image(encoded(drawn(width, height, mode, seed=width), fmt), ImageProcessor())
    ref = Qwen2VLImageProcessorPil(patch_size=s["patch_size"], merge_size=s["merge_size"],
                                   temporal_patch_size=s["temporal_patch_size"], image_mean=list(mean),
                                   image_std=list(std),
                                   size={"shortest_edge": s["min_pixels"], "longest_edge": s["max_pixels"]})
    want = ref(images=[image], return_tensors="np")
    mine = ImageProcessor(**s, image_mean=mean, image_std=std)
    pixels, grid = mine.preprocess(image)
    assert list(grid) == want["image_grid_thw"][0].tolist()
    assert pixels.shape == want["pixel_values"].shape
    np.testing.assert_allclose(pixels, want["pixel_values"], atol=1e-6, rtol=0)
    assert mine.tokens(grid) == grid[1] * grid[2] // s["merge_size"] ** 2


def test_processor_settings_come_from_the_checkpoint(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(
        '{"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "size": {"shortest_edge": 100, '
        '"longest_edge": 5000}, "image_mean": [0.1, 0.2, 0.3], "image_std": [0.4, 0.5, 0.6]}')
    p = ImageProcessor.from_checkpoint(str(tmp_path), {"patch_size": 14, "spatial_merge_size": 2}, 7, max_images=3)
    assert (p.patch_size, p.min_pixels, p.max_pixels, p.image_mean, p.image_token_id, p.max_images) == (
        14, 100, 5000, (0.1, 0.2, 0.3), 7, 3)
    with pytest.raises(ValueError, match="differ from the vision tower"):
        ImageProcessor.from_checkpoint(str(tmp_path), {"patch_size": 16}, 7)
    assert ImageProcessor.from_checkpoint(None, {"patch_size": 8, "spatial_merge_size": 1}, 7).patch_size == 8


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,!!!", "not valid base64"),
    ("data:image/png,rawbytes", "must be base64"),
    (data_url(b"not an image at all"), "could not be read"),
    (data_url(encoded(drawn(64, 64), "PNG")[:200]), "corrupt or truncated"),
    (data_url(encoded(drawn(64, 64), "GIF"), "gif"), "could not be read"),
    ("https://example.com/cat.png", "does not fetch images from 'example.com'"),
    ("file:///etc/passwd", "scheme 'file' is not supported"),
    ("", "must be a data: URL"),
])
def test_unusable_images_say_why(url, message):
    with pytest.raises(ImageError, match=message):
        read_image_url(url, ImageProcessor())


def test_too_many_pixels():
    with pytest.raises(ImageError, match="more than the 1000 allowed"):
        read_image_url(data_url(encoded(drawn(40, 30), "PNG")), ImageProcessor(max_image_pixels=1000))
    fits = read_image_url(data_url(encoded(drawn(40, 25), "PNG")), ImageProcessor(max_image_pixels=1000))
    assert fits.size == (40, 25)


@pytest.mark.gpu
@pytest.mark.parametrize("settings", range(len(SETTINGS)))
def test_pixel_values_on_the_gpu_equal_the_cpu_gpu(settings):
    """The executor computes a sent image's pixel values on its device: bit for bit what the CPU computes."""
    import torch

    s = dict(SETTINGS[settings])
    processor = ImageProcessor(**s)
    rgb, _ = processor.resize(drawn(333, 211, seed=settings))
    want = processor.pixel_values(torch.from_numpy(rgb))
    got = processor.pixel_values(torch.from_numpy(rgb).cuda())
    assert got.device.type == "cuda" and torch.equal(got.cpu(), want)
