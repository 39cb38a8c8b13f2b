"""Paged KV cache for attention layers: K, V and the QSA raw index keys."""

from __future__ import annotations

import torch

from ...config import ModelConfig


class KVPool:
    """Fixed pages of ``page_size`` tokens for every attention layer.

    A request's page table lists the pages covering positions ``[0, n)``; position ``p`` lives in
    ``page_table[p // page_size]`` at row ``p % page_size``. K is stored after norm and rotary, as
    attention reads it; index keys are stored raw (before pooling, norm and rotary), as QSA pools them.
    """

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, device: torch.device | str,
                 dtype: torch.dtype):
        self.num_pages = num_pages
        self.page_size = page_size
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.index_k: dict[int, torch.Tensor] = {}
        for layer in config.attention_layers:
            shape = (num_pages, page_size, config.num_key_value_heads, config.head_dim)
            self.k[layer] = torch.zeros(shape, dtype=dtype, device=device)
            self.v[layer] = torch.zeros(shape, dtype=dtype, device=device)
            if config.has_qsa:
                self.index_k[layer] = torch.zeros(
                    (num_pages, page_size, config.indexer_head_dim), dtype=dtype, device=device
                )

    def rows(self, page_table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Flat row indices (into ``[num_pages * page_size]``) of positions ``[start, end)``."""
        pos = torch.arange(start, end, device=page_table.device)
        return page_table[pos // self.page_size] * self.page_size + pos % self.page_size

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              index_k: torch.Tensor | None) -> None:
        self.k[layer].view(-1, *self.k[layer].shape[2:])[rows] = k
        self.v[layer].view(-1, *self.v[layer].shape[2:])[rows] = v
        if index_k is not None:
            self.index_k[layer].view(-1, self.index_k[layer].shape[-1])[rows] = index_k

    def read(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        k = self.k[layer].view(-1, *self.k[layer].shape[2:])[rows]
        v = self.v[layer].view(-1, *self.v[layer].shape[2:])[rows]
        idx = None
        if layer in self.index_k:
            idx = self.index_k[layer].view(-1, self.index_k[layer].shape[-1])[rows]
        return k, v, idx

    def bytes_per_token(self) -> int:
        total = 0
        for table in (self.k, self.v, self.index_k):
            for t in table.values():
                total += t[0, 0].numel() * t.element_size()
        return total
