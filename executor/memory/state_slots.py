"""Per-request recurrent state slots: everything a hybrid layer carries between forwards."""

from __future__ import annotations

import torch

from ...config.model import ModelConfig
from ..distributed import split
from ..distributed.shard import gdn_sections
from ..upload import device_ints

FEW_PAIRS = 4  # slot pairs copied row by row in one launch; more pairs gather and scatter per tensor


class StatePool:
    """``num_slots`` slots, each holding one request's state at one position.

    Per GDN layer: the conv window (last ``k - 1`` pre-conv rows of q/k/v) and the fp32 recurrent
    state per value head. Per PLE layer: the conv window (last ``(k - 1) * ngram_size`` normalised
    gated rows). Per slot: the n-gram context (last ``ngram_size - 1`` token ids), shared by all
    PLE layers because it depends on token ids alone.

    A slot's content is meaningful only together with a position, which the scheduler tracks; a
    segment starting at position 0 ignores the slot's previous content (the zero state).
    """

    def __init__(self, config: ModelConfig, num_slots: int, device: torch.device | str, dtype: torch.dtype):
        self.config = config
        self.num_slots = num_slots
        c = config
        self.gdn_conv: dict[int, torch.Tensor] = {}
        self.gdn_state: dict[int, torch.Tensor] = {}
        conv_dim = sum(count for _, count in gdn_sections(c)) if c.linear_layers else 0  # this rank's channels
        value_heads = split(c.linear_num_value_heads, "linear_num_value_heads")[1] if c.linear_layers else 0
        for layer in c.linear_layers:
            self.gdn_conv[layer] = torch.zeros(
                (num_slots, c.linear_conv_kernel_dim - 1, conv_dim), dtype=dtype, device=device
            )
            self.gdn_state[layer] = torch.zeros(
                (num_slots, value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
                dtype=torch.float32, device=device,
            )
        self.ple_conv: dict[int, torch.Tensor] = {}
        for layer in c.ple_layers:
            self.ple_conv[layer] = torch.zeros(
                (num_slots, c.ple_conv_window, c.hc_count * c.hidden_size), dtype=dtype, device=device
            )
        width = c.ngram_context if c.ple_layer_ids else 0
        eos = c.ngram_eos_id
        self.ngram_context = torch.full((num_slots, width), eos, dtype=torch.long, device=device)

    def _tensors(self):
        yield from self.gdn_conv.values()
        yield from self.gdn_state.values()
        yield from self.ple_conv.values()
        yield self.ngram_context

    def copy_layer(self, layer: int, src: int, dst: int) -> None:
        """Copy only decoder layer ``layer``'s state (a layer-major prefill checkpoints layer by layer)."""
        for table in (self.gdn_conv, self.gdn_state, self.ple_conv):
            if layer in table:
                table[layer][dst].copy_(table[layer][src])

    def copy_many(self, src: list[int], dst: list[int]) -> None:
        """Copy every state of slot ``src[i]`` into slot ``dst[i]`` (the pairs must not chain: no slot is
        both a source and a destination). A few pairs (a prefix-cache restore, a prompt's checkpoints) go
        in one multi-tensor copy of their rows; more, one gather-scatter per state tensor."""
        pairs = [(s, d) for s, d in zip(src, dst, strict=True) if s != d]
        if not pairs:
            return
        tensors = list(self._tensors())
        if len(pairs) <= FEW_PAIRS:
            torch._foreach_copy_([t[d] for _, d in pairs for t in tensors], [t[s] for s, _ in pairs for t in tensors])
            return
        both = device_ints(pairs, self.ngram_context.device)
        s_t, d_t = both[:, 0], both[:, 1]
        for t in tensors:
            t[d_t] = t[s_t]

    def bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self._tensors())
