"""Images in prompts: what a request carries for each image (``ImageInput``) and the prompt's
placeholder runs."""

from __future__ import annotations

import hashlib

import numpy as np

from .messages import ImageInput


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
