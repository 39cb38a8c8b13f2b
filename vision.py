"""Images in prompts: reading an image a request sends, the image processor the checkpoint names
(``preprocessor_config.json``: resize to multiples of patch x merge within min/max pixels, rescale,
normalise, patchify, as transformers' ``Qwen2VLImageProcessor`` does), and what a request carries for
each image (``ImageInput``)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass

import numpy as np

from .messages import ImageInput

# Where an image part sits in rendered chat text, before the template's vision tokens replace it.
IMAGE_MARK = "\ue0ff"
IMAGE_TOKENS = "<|vision_start|><|image_pad|><|vision_end|>"
FORMATS = ("PNG", "JPEG", "WEBP")
FETCH_TIMEOUT = 10.0  # seconds to fetch an image from an allowed host
MAX_IMAGE_BYTES = 32 << 20  # the most bytes an image may have, sent or fetched


class ImageError(ValueError):
    """An image a request cannot use; the message says why."""


@dataclass(frozen=True)
class ImageProcessor:
    """A checkpoint's image processor settings (the defaults are Qwen3-VL's)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    image_token_id: int = 248056
    # Request limits.
    max_images: int = 16
    max_image_pixels: int = 1 << 26  # width x height of a decoded image
    allowed_domains: tuple[str, ...] = ()  # hosts whose http(s) image URLs the server fetches

    @classmethod
    def from_checkpoint(cls, path: str | None, vision_config: dict, image_token_id: int, **limits) -> ImageProcessor:
        """From ``preprocessor_config.json`` (or ``processor_config.json``'s ``image_processor``) beside the
        checkpoint; what it leaves out follows the vision tower's config."""
        raw: dict = {}
        for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
            file = os.path.join(path, name) if path else ""
            if file and os.path.exists(file):
                with open(file) as f:
                    data = json.load(f)
                raw = data.get(key, {}) if key else data
                break
        size = raw.get("size") or {}
        kw = dict(
            patch_size=raw.get("patch_size", vision_config.get("patch_size", cls.patch_size)),
            temporal_patch_size=raw.get("temporal_patch_size",
                                        vision_config.get("temporal_patch_size", cls.temporal_patch_size)),
            merge_size=raw.get("merge_size", vision_config.get("spatial_merge_size", cls.merge_size)),
            min_pixels=raw.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels,
            max_pixels=raw.get("max_pixels") or size.get("longest_edge") or cls.max_pixels,
            image_mean=tuple(raw.get("image_mean", cls.image_mean)),
            image_std=tuple(raw.get("image_std", cls.image_std)),
            rescale_factor=raw.get("rescale_factor", cls.rescale_factor),
        )
        if vision_config.get("patch_size", kw["patch_size"]) != kw["patch_size"] or \
                vision_config.get("spatial_merge_size", kw["merge_size"]) != kw["merge_size"]:
            raise ValueError(f"the image processor's patch {kw['patch_size']} / merge {kw['merge_size']} differ from "
                             f"the vision tower's {vision_config}")
        return cls(**kw, image_token_id=image_token_id, **limits)

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size ** 2

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """The size an image is resized to: multiples of patch x merge, its pixels within
        [min_pixels, max_pixels], its aspect kept as closely as that allows."""
        factor = self.patch_size * self.merge_size
        if max(height, width) / min(height, width) > 200:
            raise ImageError(f"the image's aspect ratio ({width} x {height}) is beyond 200:1")
        h = round(height / factor) * factor
        w = round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / factor) * factor
            w = math.ceil(width * beta / factor) * factor
        return h, w

    def resize(self, image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """``(rgb [h, w, 3] uint8, (1, h / patch, w / patch))`` of a PIL image: RGB (transparency on white),
        resized bicubically to :meth:`target_size`."""
        from PIL import Image

        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
        else:
            image = image.convert("RGB")
        h, w = self.target_size(image.height, image.width)
        rgb = np.array(image.resize((w, h), resample=Image.Resampling.BICUBIC))
        return rgb, (1, h // self.patch_size, w // self.patch_size)

    def pixel_values(self, rgb):
        """The ``pixel_values`` rows (float32 ``[h * w, patch_dim]`` for ``h x w`` patches) of a resized image
        ``rgb`` (uint8 ``[H, W, 3]``, sides multiples of patch x merge): rescaled in float64 and normalised in
        float32 as transformers does, cut into patches in spatial-merge-block order, each patch repeated over the
        temporal patch. A numpy array gives a numpy array; a tensor a tensor on its device (the executor's: a
        request sends the resized image, an eighth of these bytes)."""
        import torch

        as_numpy = isinstance(rgb, np.ndarray)
        x = torch.from_numpy(np.ascontiguousarray(rgb)) if as_numpy else rgb
        gh, gw = self.rgb_grid(x.shape, x.dtype == torch.uint8, x.dtype)
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        mean = torch.tensor(self.image_mean, dtype=torch.float32, device=x.device)
        std = torch.tensor(self.image_std, dtype=torch.float32, device=x.device)
        pixels = (((x.double() * self.rescale_factor).float() - mean) / std).permute(2, 0, 1)  # [3, H, W]
        blocks = pixels.reshape(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        blocks = blocks[:, :, :, :, :, None].expand(*blocks.shape[:5], t, p, p)
        out = blocks.reshape(gh * gw, 3 * t * p * p).contiguous()
        return out.numpy() if as_numpy else out

    def rgb_grid(self, shape, is_uint8: bool, dtype) -> tuple[int, int]:
        """``(h, w)`` in patches of a resized RGB image of ``shape`` (``is_uint8``: its ``dtype`` is uint8); a
        ``ValueError`` unless it is ``[H, W, 3]`` uint8 with sides multiples of patch x merge."""
        side = self.patch_size * self.merge_size
        if not is_uint8 or len(shape) != 3 or shape[2] != 3 or shape[0] % side or shape[1] % side:
            raise ValueError(f"an RGB image of shape {tuple(shape)} and dtype {dtype}: need uint8 [H, W, 3] with H "
                             f"and W multiples of {side}")
        return shape[0] // self.patch_size, shape[1] // self.patch_size

    def preprocess(self, image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """``(pixel_values [h * w, patch_dim] float32, (1, h, w))`` of a PIL image: :meth:`resize`, then
        :meth:`pixel_values`."""
        rgb, grid = self.resize(image)
        return self.pixel_values(rgb), grid

    def tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // self.merge_size ** 2


def image_input(pixel_values, grid: tuple[int, int, int], offset: int, merge: int) -> ImageInput:
    """The ``ImageInput`` of one image: ``pixel_values`` ``[t * h * w, patch_dim]`` (the image processor's
    rows, patches in spatial-merge-block order), its patch ``grid`` ``(t, h, w)``, and the prompt position
    of its first placeholder id."""
    pixels = np.ascontiguousarray(np.asarray(pixel_values, dtype=np.float32))
    t, h, w = (int(x) for x in grid)
    if pixels.ndim != 2 or pixels.shape[0] != t * h * w:
        raise ValueError(f"pixel_values of shape {pixels.shape} for a grid of {t * h * w} patches")
    if h % merge or w % merge:
        raise ValueError(f"a grid of {h} x {w} patches does not divide into {merge} x {merge} merges")
    data = pixels.tobytes()
    digest = hashlib.sha256(np.array([t, h, w], dtype=np.int64).tobytes() + data).hexdigest()
    return ImageInput(offset=offset, tokens=t * h * w // merge ** 2, grid=[t, h, w], pixels=data, digest=digest)


def rgb_input(rgb: np.ndarray, offset: int, processor: ImageProcessor) -> ImageInput:
    """The ``ImageInput`` of a resized image (:meth:`ImageProcessor.resize`) at prompt position ``offset``: its
    RGB bytes travel instead of pixel values, and the executor computes those with
    :meth:`ImageProcessor.pixel_values`."""
    rgb = np.ascontiguousarray(rgb)
    h, w = processor.rgb_grid(rgb.shape, rgb.dtype == np.uint8, rgb.dtype)
    data = rgb.tobytes()
    digest = hashlib.sha256(b"rgb" + np.array([1, h, w, processor.patch_size], dtype=np.int64).tobytes()
                            + data).hexdigest()
    return ImageInput(offset=offset, tokens=h * w // processor.merge_size ** 2, grid=[1, h, w], pixels=b"",
                      digest=digest, rgb=data)


def read_image_url(url: str, processor: ImageProcessor):
    """The PIL image an ``image_url.url`` names: a ``data:`` URL (base64 PNG, JPEG or WebP), or an
    ``http(s)`` URL on an allowed host (fetched within the time and size limits)."""
    if not isinstance(url, str) or not url:
        raise ImageError("must be a data: URL or an http(s) URL")
    if url.startswith("data:"):
        head, sep, payload = url[5:].partition(",")
        if not sep or not head.endswith(";base64"):
            raise ImageError("a data: URL must be base64 (data:image/png;base64,...)")
        if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise ImageError(f"the image is larger than {MAX_IMAGE_BYTES} bytes")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError("the data: URL is not valid base64") from None
        return decode_image(data, processor)
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https"):
        raise ImageError(f"the URL scheme {parsed.scheme!r} is not supported (data:, http or https)")
    host = (parsed.hostname or "").lower()
    if host not in processor.allowed_domains:
        raise ImageError(f"the server does not fetch images from {host!r} (allowed: "
                         f"{', '.join(processor.allowed_domains) or 'none; see --allowed-media-domains'})")
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT) as response:
            data = response.read(MAX_IMAGE_BYTES + 1)
    except Exception as e:  # every fetch failure is the request's: name it
        raise ImageError(f"fetching {url} failed: {e}") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"the image at {url} is larger than {MAX_IMAGE_BYTES} bytes")
    return decode_image(data, processor)


def decode_image(data: bytes, processor: ImageProcessor):
    from PIL import Image

    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"the image is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Exception:  # Pillow raises several types for data it cannot read
        raise ImageError(f"the image could not be read (supported: {', '.join(FORMATS)})") from None
    if image.width * image.height > processor.max_image_pixels:
        raise ImageError(f"the image has {image.width} x {image.height} pixels, more than the "
                         f"{processor.max_image_pixels} allowed (--max-image-pixels)")
    try:
        image.load()
    except Exception:
        raise ImageError("the image is corrupt or truncated") from None
    return image
