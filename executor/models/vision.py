"""The Qwen4-Exp vision tower: image patches to the text model's embedding width, and the 3-D rotary
positions of the vision tokens in the text.

An image arrives as ``pixel_values`` ``[patches, channels * temporal_patch * patch * patch]`` with its
grid ``(t, h, w)`` in patches; patches are ordered by spatial-merge block (``merge x merge`` neighbours
consecutive), as the image processor writes them. The tower embeds each patch (a linear map, the
checkpoint's Conv3d with stride equal to its kernel), adds the learned position table resampled
bilinearly (corners aligned) to the image's grid, runs ``depth`` pre-norm blocks of full attention
within each frame (2-D axial rotary over the patch's row and column) and a GELU MLP, and merges each
block of ``merge x merge`` patches into one token of the text model's width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class VisionConfig:
    """The ``vision_config`` of a composite checkpoint (transformers' ``Qwen4ExpVisionConfig`` defaults)."""

    def __init__(self, raw: dict):
        self.raw = raw
        self.depth = raw.get("depth", 27)
        self.hidden_size = raw.get("hidden_size", 1152)
        self.hidden_act = raw.get("hidden_act", "gelu_pytorch_tanh")
        self.intermediate_size = raw.get("intermediate_size", 4304)
        self.num_heads = raw.get("num_heads", 16)
        self.in_channels = raw.get("in_channels", 3)
        self.patch_size = raw.get("patch_size", 16)
        self.spatial_merge_size = raw.get("spatial_merge_size", 2)
        self.temporal_patch_size = raw.get("temporal_patch_size", 2)
        self.out_hidden_size = raw.get("out_hidden_size", 3584)
        self.num_position_embeddings = raw.get("num_position_embeddings", 2304)
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config.rope_parameters.rope_type: only 'axial' is supported, got "
                             f"{rope.get('rope_type')!r}")
        self.rope_theta = rope.get("rope_theta", 10000.0)
        for name in ("patch_size", "temporal_patch_size"):
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"vision_config.{name}: one integer is supported, got {getattr(self, name)!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision_config.hidden_size {self.hidden_size} is not a multiple of num_heads "
                             f"{self.num_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act: one of {sorted(ACTIVATIONS)}, got {self.hidden_act!r}")

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
               "silu": F.silu, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


def block_order(h: int, w: int, merge: int) -> torch.Tensor:
    """``[h * w, 2]`` (row, column) of each patch of an ``h x w`` grid in spatial-merge-block order."""
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
    return torch.stack([rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)], dim=-1)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d = cfg.hidden_size
        self.heads = cfg.num_heads
        self.norm1 = nn.LayerNorm(d, eps=1e-6)
        self.norm2 = nn.LayerNorm(d, eps=1e-6)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc1 = nn.Linear(d, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, d)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: list[int]) -> torch.Tensor:
        n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.heads, -1).unbind(1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = torch.empty_like(q)
        start = 0
        for length in frames:  # full attention within each frame
            rows = slice(start, start + length)
            out[rows] = F.scaled_dot_product_attention(q[rows].transpose(0, 1), k[rows].transpose(0, 1),
                                                       v[rows].transpose(0, 1)).transpose(0, 1)
            start += length
        x = x + self.proj(out.reshape(n, d))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (halves rotated) in fp32; ``x`` ``[n, heads, dim]``, ``cos``/``sin`` ``[n, dim]``."""
    dtype = x.dtype
    x = x.float()
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos[:, None] + turned * sin[:, None]).to(dtype)


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        d, merge = cfg.hidden_size, cfg.spatial_merge_size
        self.patch_embed = nn.Linear(cfg.patch_dim, d)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, d)
        self.side = math.isqrt(cfg.num_position_embeddings)
        quarter = cfg.head_dim // 4  # frequencies per axis: head_dim / 2 rotated pairs over (row, column)
        # Kept outside the buffers (the loader builds modules on the meta device and fills buffers with ones).
        self._inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(quarter, device="cpu").float() / quarter)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger_norm = nn.LayerNorm(d, eps=1e-6)
        self.merger_fc1 = nn.Linear(d * merge * merge, d * merge * merge)
        self.merger_fc2 = nn.Linear(d * merge * merge, cfg.out_hidden_size)

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """Text tokens of an image or video of this patch grid."""
        t, h, w = grid
        return t * h * w // self.cfg.spatial_merge_size ** 2

    def _positions(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per patch: the learned position embedding resampled to its grid, and its (row, column)."""
        merge, side = self.cfg.spatial_merge_size, self.side
        table = self.pos_embed.weight.view(side, side, -1).permute(2, 0, 1)[None].float()
        embeds, coords = [], []
        for t, h, w in grids:
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # [d, h, w]
            rc = block_order(h, w, merge)
            embeds.append(grid[:, rc[:, 0], rc[:, 1]].T.repeat(t, 1))
            coords.append(rc.repeat(t, 1))
        return torch.cat(embeds), torch.cat(coords)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """``[sum of tokens(grid), out_hidden_size]``: every image's tokens, in order."""
        cfg = self.cfg
        dtype = self.patch_embed.weight.dtype
        x = self.patch_embed(pixel_values.to(dtype))
        embeds, coords = self._positions(grids)
        x = x + embeds.to(x.device, dtype)
        coords = coords.to(x.device)
        inv_freq = self._inv_freq.to(x.device)
        freqs = torch.cat([coords[:, 0, None] * inv_freq, coords[:, 1, None] * inv_freq], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)
        cos, sin = freqs.cos(), freqs.sin()
        frames = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, frames)
        merged = self.merger_norm(x).view(-1, cfg.hidden_size * cfg.spatial_merge_size ** 2)
        return self.merger_fc2(F.gelu(self.merger_fc1(merged)))

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Weights from a checkpoint's ``visual.*`` tensors (names after the ``visual.`` prefix)."""
        cfg = self.cfg
        own = {"patch_embed.proj.weight": ("patch_embed.weight", lambda t: t.reshape(cfg.hidden_size, -1)),
               "patch_embed.proj.bias": ("patch_embed.bias", None),
               "pos_embed.weight": ("pos_embed.weight", None),
               "merger.norm.weight": ("merger_norm.weight", None), "merger.norm.bias": ("merger_norm.bias", None),
               "merger.linear_fc1.weight": ("merger_fc1.weight", None),
               "merger.linear_fc1.bias": ("merger_fc1.bias", None),
               "merger.linear_fc2.weight": ("merger_fc2.weight", None),
               "merger.linear_fc2.bias": ("merger_fc2.bias", None)}
        for i in range(cfg.depth):
            for theirs, mine in (("norm1", "norm1"), ("norm2", "norm2"), ("attn.qkv", "qkv"), ("attn.proj", "proj"),
                                 ("mlp.linear_fc1", "fc1"), ("mlp.linear_fc2", "fc2")):
                for part in ("weight", "bias"):
                    own[f"blocks.{i}.{theirs}.{part}"] = (f"blocks.{i}.{mine}.{part}", None)
        params = dict(self.named_parameters())
        missing = sorted(set(own) - set(tensors))
        if missing:
            raise ValueError(f"the checkpoint's vision tower lacks {len(missing)} tensors, e.g. visual.{missing[0]}")
        unknown = sorted(set(tensors) - set(own))
        if unknown:
            raise ValueError(f"unexpected vision tower tensor visual.{unknown[0]} ({len(unknown)} unknown)")
        with torch.no_grad():
            for theirs, (mine, reshape) in own.items():
                value = tensors[theirs]
                value = reshape(value) if reshape is not None else value
                if tuple(value.shape) != tuple(params[mine].shape):
                    raise ValueError(f"visual.{theirs}: shape {tuple(value.shape)}, the config gives "
                                     f"{tuple(params[mine].shape)}")
                params[mine].copy_(value)


def rope_positions(ids: list[int], grids: list[tuple[int, int, int]], image_token_id: int,
                   merge: int) -> tuple[torch.Tensor, int]:
    """``([3, len(ids)] positions (temporal, row, column), delta)`` of a prompt whose runs of
    ``image_token_id`` are the images of ``grids`` in order: text tokens count on from the position
    before them on all three axes; an image's tokens start at that position and add their frame, row
    and column in merged tokens; the text after an image goes on from its largest extent
    (``max(h, w) / merge`` past its start). ``delta`` is what a token at sequence index ``i`` after the
    prompt adds to ``i`` (generated tokens sit at ``i + delta`` on every axis)."""
    out = torch.empty(3, len(ids), dtype=torch.long)
    images = iter(grids)
    pos, i = 0, 0
    while i < len(ids):
        if ids[i] != image_token_id:
            out[:, i] = pos
            pos, i = pos + 1, i + 1
            continue
        t, h, w = next(images)
        gh, gw = h // merge, w // merge
        n = t * gh * gw
        frame = torch.arange(t).repeat_interleave(gh * gw)
        row = torch.arange(gh).repeat_interleave(gw).repeat(t)
        col = torch.arange(gw).repeat(gh * t)
        out[:, i:i + n] = torch.stack([frame, row, col]) + pos
        pos += max(gh, gw)
        i += n
    return out, pos - len(ids)
