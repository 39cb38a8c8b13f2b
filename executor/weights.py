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
from ..kernels.backend import use_triton

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


# An n-gram table is drawn in chunks of at most this many rows and values, so that a table of billions of values
# (the real geometry's: 320 M rows) is never whole on the device, nor a chunk's 64-bit temporaries large.
TABLE_CHUNK_ROWS = 1 << 20
TABLE_CHUNK_VALUES = 1 << 26

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed 64-bit integer
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def table_rows(name: str, rows: torch.Tensor, dim: int, seed: int) -> torch.Tensor:
    """Seeded standard-normal fp32 values of rows ``rows`` (long, any shape) of n-gram table ``name``: ``[*rows.shape,
    dim]`` on ``rows.device``. Each value is a function of the seed, the table's name, its row and its column alone
    (splitmix64 of its index, its top 24 bits through the inverse normal CDF), so any rows can be drawn in any order
    and on any device: a table is filled a chunk at a time, or read row by row where it is never stored
    (``--ple-backend disk`` with random weights)."""
    offset = _stable_seed(seed, name)
    if use_triton(rows, "seeded_rows"):
        lut = _NORMAL_LUTS.get(rows.device)
        if lut is None and not torch.cuda.is_current_stream_capturing():
            lut = _NORMAL_LUTS[rows.device] = _normal_values(torch.arange(1 << 24, device=rows.device))
        if lut is not None:
            from ..kernels.seeded_triton import seeded_rows

            return seeded_rows(rows, dim, offset, lut)
    x = rows.to(torch.long)[..., None] * dim + torch.arange(dim, device=rows.device)
    x.mul_(_GOLDEN).add_(offset)
    x.bitwise_xor_(_shr(x, 30)).mul_(_MIX1)
    x.bitwise_xor_(_shr(x, 27)).mul_(_MIX2)
    x.bitwise_xor_(_shr(x, 31))
    return _normal_values(_shr(x, 40))


def _normal_values(top: torch.Tensor) -> torch.Tensor:
    """Standard-normal fp32 values of 24-bit integers ``top``: the inverse normal CDF at ``(top + 0.5) / 2^24``."""
    # 2u - 1 for u = (k + 0.5) / 2^24: in (-1, 1), never at either end.
    centred = top.to(torch.float64).mul_(2.0 ** -23).add_(2.0 ** -24 - 1)
    return centred.erfinv_().mul_(math.sqrt(2)).to(torch.float32)


# Per CUDA device, :func:`_normal_values` of every 24-bit integer (64 MiB), the table the Triton kernel of
# :func:`table_rows` looks its values up in; made on first use outside a CUDA graph capture.
_NORMAL_LUTS: dict[torch.device, torch.Tensor] = {}


def random_table_chunks(name: str, shape: tuple[int, ...], config: ModelConfig, seed: int,
                        device: torch.device | str = "cpu"):
    """Yield ``(first_row, rows)`` of n-gram table ``name``'s seeded fp32 values (:func:`table_rows`),
    ``TABLE_CHUNK_ROWS`` at a time; their concatenation is ``random_tensor(name, shape, ...)``."""
    step = max(1, min(TABLE_CHUNK_ROWS, TABLE_CHUNK_VALUES // shape[1]))
    for start in range(0, shape[0], step):
        stop = min(shape[0], start + step)
        yield start, table_rows(name, torch.arange(start, stop, device=device), shape[1], seed)


# A layer's routed experts are drawn this many experts at a time (each chunk from its own seeded generator), so
# that no draw holds a whole layer in float32 (6.7 GB for flash-next's gate and up projections).
EXPERT_CHUNK = 64


def is_experts(name: str) -> bool:
    return name.endswith(("experts.gate_up_proj", "experts.down_proj"))


def random_expert_chunks(name: str, shape: tuple[int, ...], seed: int, device: torch.device | str = "cpu"):
    """Yield ``(first_expert, values)`` of routed-expert parameter ``name`` ``[E, R, C]``'s seeded fp32 values,
    :data:`EXPERT_CHUNK` experts at a time; their concatenation is ``random_tensor(name, shape, ...)``. The first
    chunk's generator is seeded by the name alone, as every other parameter's is."""
    for start in range(0, shape[0], EXPERT_CHUNK):
        gen = torch.Generator(device=device)
        gen.manual_seed(_stable_seed(seed, f"{name}[{start}]" if start else name))
        size = (min(shape[0], start + EXPERT_CHUNK) - start, *shape[1:])
        values = torch.randn(size, generator=gen, device=device, dtype=torch.float32)
        yield start, values * (1.0 / math.sqrt(shape[-1]))


def random_tensor(name: str, shape: tuple[int, ...], config: ModelConfig, seed: int,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """A seeded random fp32 value for parameter ``name``, independent of creation order (n-gram tables: see
    :func:`table_rows`).

    Scales keep activations O(1) through every path; nothing is left at a value that would make
    a path a no-op (norm offsets, PLE conv and gates are all non-zero), unlike the reference's
    training init which zeroes the PLE conv and every ``1 + weight`` norm offset.
    """
    if name.endswith("ngram_embedding.weight"):
        return torch.cat([rows for _, rows in random_table_chunks(name, shape, config, seed, device)])
    if is_experts(name):
        return torch.cat([values for _, values in random_expert_chunks(name, shape, seed, device)])
    gen = torch.Generator(device=device)
    gen.manual_seed(_stable_seed(seed, name))

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
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if name.endswith("lm_head.weight"):
        return normal(2.0 / math.sqrt(shape[-1]))
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
