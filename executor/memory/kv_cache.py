"""Paged KV cache for attention layers: K, V and the QSA raw index keys."""

from __future__ import annotations

import torch

from ...config.model import ModelConfig
from ..distributed.shard import kv_heads


class KVPool:
    """Fixed pages of ``page_size`` tokens for every attention layer.

    A request's page table lists the pages covering positions ``[0, n)``; position ``p`` lives in
    ``page_table[p // page_size]`` at row ``p % page_size``. K is stored after norm and rotary, as
    attention reads it; index keys are stored raw (before pooling, norm and rotary), as QSA pools them.
    ``index_block_k`` holds each complete QSA block's pooled, normalised, rotated key at the row of
    the block's last token (written once, when that token is).
    """

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, device: torch.device | str,
                 dtype: torch.dtype):
        self.num_pages = num_pages
        self.page_size = page_size
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.index_k: dict[int, torch.Tensor] = {}
        self.index_block_k: dict[int, torch.Tensor] = {}
        for layer in config.attention_layers:
            shape = (num_pages, page_size, kv_heads(config)[1], config.head_dim)  # this rank's KV heads
            self.k[layer] = torch.zeros(shape, dtype=dtype, device=device)
            self.v[layer] = torch.zeros(shape, dtype=dtype, device=device)
            if config.has_qsa:
                for table in (self.index_k, self.index_block_k):
                    table[layer] = torch.zeros((num_pages, page_size, config.indexer_head_dim), dtype=dtype,
                                               device=device)

    def flat(self, table: dict[int, torch.Tensor], layer: int) -> torch.Tensor:
        """``table[layer]`` viewed as ``[num_pages * page_size, ...]`` rows."""
        t = table[layer]
        return t.view(-1, *t.shape[2:])

    def bytes_per_token(self) -> int:
        total = 0
        for table in (self.k, self.v, self.index_k, self.index_block_k):
            for t in table.values():
                total += t[0, 0].numel() * t.element_size()
        return total
