"""A request's images on the executor: their vision features and the 3-D rotary positions they give
every position of the request (``models/vision.py`` defines both as transformers does)."""

from __future__ import annotations

import numpy as np
import torch

from ..messages import ImageInput


def images_past(images: list[ImageInput], start: int) -> list[ImageInput]:
    """The images that end past position ``start``: those a request computing from ``start`` needs features of."""
    return [im for im in images if im.offset + im.tokens > start]


class RequestImages:
    """The images of one request, encoded (``features``: every vision token's embedding, in prompt
    order). Text positions count on from the position before them; an image's tokens sit at its start
    plus (frame, row, column) in merged tokens, and the text after it goes on ``max(rows, columns)``
    past its start."""

    def __init__(self, images: list[ImageInput], features: torch.Tensor, merge: int, start: int = 0):
        """``features``: those of the images that end past position ``start`` (the request's first uncomputed
        position: the rows before it are cached, so the images wholly before it need none)."""
        self.spans = []  # (offset, tokens, t, rows, columns)
        for image in images:
            t, h, w = image.grid
            gh, gw = h // merge, w // merge
            if image.tokens != t * gh * gw:
                raise ValueError(f"an image of grid {image.grid} has {t * gh * gw} vision tokens, not {image.tokens}")
            self.spans.append((image.offset, t * gh * gw, t, gh, gw))
        encoded = [(o, n) for o, n, *_ in self.spans if o + n > start]
        # Rows before this position may lie in an image without features: no forward of this request reads them.
        self.unencoded_end = max((o + n for o, n, *_ in self.spans if o + n <= start), default=0)
        self.index = np.concatenate([np.arange(o, o + n) for o, n in encoded]) if encoded else \
            np.zeros(0, dtype=np.int64)
        if features.shape[0] != len(self.index):
            raise ValueError(f"{features.shape[0]} vision features for {len(self.index)} image tokens")
        self.features = features
        self.delta = sum(max(gh, gw) - n for _, n, _, gh, gw in self.spans)
        # From this position on every token is text at its position plus ``delta`` on all three axes.
        self.text_from = max((o + n for o, n, *_ in self.spans), default=0)

    def shift_from(self, first: int) -> int | None:
        """The rotary shift of rows (and QSA blocks) that start at ``first`` or later: ``delta`` past the images,
        ``None`` before their end (such rows turn with (frame, row, column) positions)."""
        return self.delta if first >= self.text_from else None

    def positions(self, seq: np.ndarray) -> np.ndarray:
        """``[3, len(seq)]`` (frame, row, column) positions of the sequence positions ``seq``."""
        out = np.broadcast_to(seq, (3, len(seq))).copy()
        shift = 0  # what the images before a position add to it
        for offset, tokens, _, gh, gw in self.spans:
            inside = (seq >= offset) & (seq < offset + tokens)
            if inside.any():
                k = seq[inside] - offset
                base = offset + shift
                out[0, inside] = base + k // (gh * gw)
                out[1, inside] = base + (k // gw) % gh
                out[2, inside] = base + k % gw
            shift += max(gh, gw) - tokens
            out[:, seq >= offset + tokens] += max(gh, gw) - tokens
        return out

    def rows(self, start: int, n: int) -> tuple[np.ndarray, slice]:
        """The vision tokens among positions ``[start, start + n)``: their offsets in that range, and
        their rows of ``features``."""
        if start < self.unencoded_end:
            raise ValueError(f"positions from {start} on reach into an image encoded for the request's rows past "
                             f"{self.unencoded_end} only")
        lo, hi = np.searchsorted(self.index, [start, start + n])
        return self.index[lo:hi] - start, slice(int(lo), int(hi))
