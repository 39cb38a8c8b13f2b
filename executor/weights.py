"""Checkpoint names and seeded random weights.

Module parameter names equal the Hugging Face text-model names after two folds: per-expert
``experts.N.{gate,up,down}_proj.weight`` become fused ``experts.gate_up_proj`` / ``experts.down_proj``
and PLE ``ngram_embedding.shard_N.weight`` parts become one ``ngram_embedding.weight``.
"""

from __future__ import annotations

import math
import re
import zlib

import torch

from ..config.model import ModelConfig

EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
PLE_SHARD_KEY = re.compile(r"^(model\.layers\.\d+\.ple\.ple_embedding\.ngram_embedding)\.shard_(\d+)\.weight$")
# Parts of a composite (vision-language) or multi-token-prediction checkpoint that a text server ignores.
IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
VISION_PREFIXES = ("model.visual.", "visual.")


def vision_name(key: str) -> str | None:
    """A vision-tower tensor's name inside the tower (``None``: not the tower's)."""
    for prefix in VISION_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return None


def canonical_name(key: str) -> str | None:
    """Map a checkpoint key to text-model naming; ``None`` for tensors tidal does not serve."""
    if key.startswith(IGNORED_PREFIXES):
        return None
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    if key.startswith("language_model.model."):
        return "model." + key[len("language_model.model."):]
    if key.startswith("language_model.lm_head."):
        return key[len("language_model."):]
    return key


def _stable_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


# An n-gram table is drawn in chunks of this many rows, each from its own seed, so that a table of billions of
# values (the real geometry's: 320 M rows) is never whole in fp32 on the device.
TABLE_CHUNK_ROWS = 1 << 20


def random_table_chunks(name: str, shape: tuple[int, ...], config: ModelConfig, seed: int,
                        device: torch.device | str = "cpu"):
    """Yield ``(first_row, rows)`` of n-gram table ``name``'s seeded fp32 values, ``TABLE_CHUNK_ROWS`` at a time;
    their concatenation is ``random_tensor(name, shape, ...)``."""
    for start in range(0, shape[0], TABLE_CHUNK_ROWS):
        rows = (min(TABLE_CHUNK_ROWS, shape[0] - start), *shape[1:])
        yield start, random_tensor(name, rows, config, seed, device, stream=f"{name}@{start}" if start else name)


def random_tensor(name: str, shape: tuple[int, ...], config: ModelConfig, seed: int,
                  device: torch.device | str = "cpu", stream: str | None = None) -> torch.Tensor:
    """A seeded random fp32 value for parameter ``name``, independent of creation order (``stream``: the name the
    seed is taken from, by default ``name``).

    Scales keep activations O(1) through every path; nothing is left at a value that would make
    a path a no-op (norm offsets, PLE conv and gates are all non-zero), unlike the reference's
    training init which zeroes the PLE conv and every ``1 + weight`` norm offset.
    """
    if stream is None and name.endswith("ngram_embedding.weight") and shape[0] > TABLE_CHUNK_ROWS:
        return torch.cat([rows for _, rows in random_table_chunks(name, shape, config, seed, device)])
    gen = torch.Generator(device=device)
    gen.manual_seed(_stable_seed(seed, stream or name))

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std + mean

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return torch.rand(shape, generator=gen, device=device, dtype=torch.float32) * (hi - lo) + lo

    leaf = name.rsplit(".", 2)
    if name.endswith("A_log"):
        return uniform(0.05, 1.0).log()
    if name.endswith("dt_bias"):
        return normal(0.3, 0.5)
    if name.endswith("linear_attn.norm.weight"):
        return normal(0.1, 1.0)
    if name.endswith("conv1d.weight"):
        return normal(1.0 / math.sqrt(shape[-1]))
    if name.startswith("visual.") and "norm" in leaf[-2] and name.endswith(".weight"):  # the tower's LayerNorms
        return normal(0.1, 1.0)
    if "norm" in leaf[-2] and name.endswith(".weight"):  # every (1 + w) RMSNorm
        return normal(0.1)
    if name.endswith("embed_tokens.weight") or name.endswith("ngram_embedding.weight"):
        return normal(1.0)
    if name.endswith("lm_head.weight"):
        return normal(2.0 / math.sqrt(shape[-1]))
    if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
        return normal(1.0 / math.sqrt(shape[-1]))
    if name.endswith(".weight") and len(shape) == 2:
        return normal(1.0 / math.sqrt(shape[-1]))
    if name.endswith(".bias"):
        return normal(0.02)
    raise KeyError(f"no random initialiser for parameter {name} {tuple(shape)}")


def split_for_checkpoint(name: str, tensor: torch.Tensor, config: ModelConfig):
    """Yield ``(checkpoint_key, tensor)`` in the layout ``save_pretrained`` writes."""
    if name.startswith("model.") and name.endswith("mlp.experts.gate_up_proj"):
        base = name[: -len("gate_up_proj")]
        inter = tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            yield f"{base}{e}.gate_proj.weight", tensor[e, :inter]
            yield f"{base}{e}.up_proj.weight", tensor[e, inter:]
    elif name.endswith("mlp.experts.down_proj"):
        base = name[: -len("down_proj")]
        for e in range(tensor.shape[0]):
            yield f"{base}{e}.down_proj.weight", tensor[e]
    elif name.endswith("ngram_embedding.weight"):
        base = name[: -len(".weight")]
        parts = max(1, config.split_ngram_parts)
        for i, part in enumerate(torch.tensor_split(tensor, parts, dim=0)):
            yield f"{base}.shard_{i}.weight", part
    else:
        yield name, tensor
