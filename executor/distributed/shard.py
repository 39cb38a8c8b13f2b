"""Which part of every Qwen4-Exp weight a tensor-parallel rank holds (transformers' TP plan).

- GDN: key and value heads split (in_proj_qkv / conv1d rows by the q, k and v sections, z, b, a,
  dt_bias, A_log by value head); out_proj split on its input: partial outputs, summed across ranks.
- Attention: query heads split (q_proj rows carry each head's gate too), KV heads split, or each
  rank holding the one KV head its query heads read when there are fewer KV heads than ranks;
  o_proj split on its input. The QSA indexer (a single key head) is replicated: every rank selects
  the same blocks without reducing scores.
- MoE: experts and the shared expert split on the intermediate dimension (gate and up rows, down
  columns): partial outputs, summed. The router is replicated.
- Hyper-connections: ``input_mix_weight_down`` split on its input (partial low-rank mix, summed).
- PLE: the n-gram table split on its embedding dimension (rows gathered, then all-gathered).
- Everything else (embeddings, norms, lm_head) is replicated. A bias added after a summed partial
  output is kept on rank 0 only.
"""

from __future__ import annotations

import torch

from ...config.model import ModelConfig
from .group import split, tp


def kv_heads(config: ModelConfig) -> tuple[int, int]:
    """``(first, count)`` of the KV heads this rank holds."""
    group = tp()
    n_q, n_kv = config.num_attention_heads, config.num_key_value_heads
    if n_kv >= group.size:
        return split(n_kv, "num_key_value_heads")
    q0, _ = split(n_q, "num_attention_heads")
    return q0 // (n_q // n_kv), 1


def gdn_sections(config: ModelConfig) -> list[tuple[int, int]]:
    """``(start, count)`` rows of this rank in the full q | k | v conv channels of a GDN layer."""
    c = config
    key = c.linear_num_key_heads * c.linear_key_head_dim
    k0, kn = split(c.linear_num_key_heads, "linear_num_key_heads")
    v0, vn = split(c.linear_num_value_heads, "linear_num_value_heads")
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    return [(k0 * dk, kn * dk), (key + k0 * dk, kn * dk), (2 * key + v0 * dv, vn * dv)]


class LazySlice:
    """A checkpoint tensor not read yet (a safetensors slice): :func:`shard` reads only this rank's
    part through :meth:`narrow`."""

    def __init__(self, source):
        self.source = source
        self.shape = tuple(source.get_shape())

    def narrow(self, dim: int, start: int, count: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + count)
        return self.source[tuple(index)]

    def read(self) -> torch.Tensor:
        return self.source[tuple(slice(None) for _ in self.shape)]


def _whole(t) -> torch.Tensor:
    return t.read() if isinstance(t, LazySlice) else t


def _rows(t, parts: list[tuple[int, int]], dim: int = 0) -> torch.Tensor:
    return torch.cat([t.narrow(dim, start, count) for start, count in parts], dim=dim)


def shard(name: str, full, config: ModelConfig) -> torch.Tensor:
    """This rank's part of parameter ``name``, given the full (TP = 1) tensor or a :class:`LazySlice`."""
    group = tp()
    if group.size == 1:
        return _whole(full)
    c = config
    leaf = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
    if ".linear_attn." in name:
        if leaf.endswith(("in_proj_qkv", "conv1d")):
            return _rows(full, gdn_sections(c))
        if leaf.endswith("in_proj_z"):
            v0, vn = split(c.linear_num_value_heads, "linear_num_value_heads")
            return full.narrow(0, v0 * c.linear_value_head_dim, vn * c.linear_value_head_dim)
        if leaf.endswith(("in_proj_b", "in_proj_a", "dt_bias", "A_log")):
            return full.narrow(0, *split(c.linear_num_value_heads, "linear_num_value_heads"))
        if leaf.endswith("out_proj"):
            v0, vn = split(c.linear_num_value_heads, "linear_num_value_heads")
            return full.narrow(1, v0 * c.linear_value_head_dim, vn * c.linear_value_head_dim)
        return _whole(full)
    if ".self_attn." in name and ".indexer." not in name:
        hd = c.head_dim
        if leaf.endswith("q_proj"):
            q0, qn = split(c.num_attention_heads, "num_attention_heads")
            return full.narrow(0, q0 * 2 * hd, qn * 2 * hd)
        if leaf.endswith(("k_proj", "v_proj")):
            k0, kn = kv_heads(c)
            return full.narrow(0, k0 * hd, kn * hd)
        if leaf.endswith("o_proj"):
            if name.endswith(".bias"):
                return _whole(full) if group.rank == 0 else torch.zeros(full.shape)
            q0, qn = split(c.num_attention_heads, "num_attention_heads")
            return full.narrow(1, q0 * hd, qn * hd)
        return _whole(full)
    if name.endswith("mlp.experts.gate_up_proj"):
        inter = c.moe_intermediate_size
        i0, n = split(inter, "moe_intermediate_size")
        return _rows(full, [(i0, n), (inter + i0, n)], dim=1)
    if name.endswith("mlp.experts.down_proj"):
        return full.narrow(2, *split(c.moe_intermediate_size, "moe_intermediate_size"))
    if ".shared_expert." in name:
        part = split(c.shared_expert_intermediate_size, "shared_expert_intermediate_size")
        return full.narrow(1 if leaf.endswith("down_proj") else 0, *part)
    if leaf.endswith("input_mix_weight_down"):
        return full.narrow(1, *split(c.hc_count * c.hidden_size, "hc_count * hidden_size"))
    if name.endswith("ngram_embedding.weight"):
        return full.narrow(1, *split(full.shape[1], "the PLE embedding dimension per head"))
    return _whole(full)


def shard_expert_part(part: str, full, config: ModelConfig) -> torch.Tensor:
    """This rank's part of one expert's checkpoint tensor (``gate_proj``/``up_proj`` ``[I, H]``,
    ``down_proj`` ``[H, I]``)."""
    if tp().size == 1:
        return _whole(full)
    i0, n = split(config.moe_intermediate_size, "moe_intermediate_size")
    return full.narrow(1 if part == "down_proj" else 0, i0, n)
