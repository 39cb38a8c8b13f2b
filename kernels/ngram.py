"""Hashed n-gram ids for PLE (per-layer embeddings): torch reference, and the dispatcher that sends CUDA
tensors to the Triton kernel of ``ngram_triton``."""

from __future__ import annotations

import torch

from .backend import use_triton

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_LAYER_PRIME = 10007


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _M1) & _MASK64
    value = ((value ^ (value >> 27)) * _M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def layer_multipliers(vocab_size: int, ngram_size: int, ple_layer_index: int, seed: int) -> list[int]:
    """Odd hash multipliers, one per n-gram position, small enough that ``id * m`` fits int64."""
    half_bound = max(1, (((1 << 63) - 1) // max(vocab_size, 1)) // 2)
    base = seed + _LAYER_PRIME * ple_layer_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half_bound) + 1 for i in range(ngram_size)]


def shift_within_segment(history: torch.Tensor, shift: int, eos: int) -> torch.Tensor:
    """``history[p - shift]`` where no EOS ends a segment in between, else ``eos``.

    A token right after an EOS starts a new segment, so n-grams never span documents.
    """
    if shift == 0:
        return history
    n = history.shape[-1]
    pos = torch.arange(n, device=history.device)
    eos_pos = torch.where(history == eos, pos, torch.full_like(pos, -1))
    last_eos = torch.cummax(eos_pos, dim=-1).values
    prev_eos = torch.cat([last_eos.new_full((1,), -1), last_eos[:-1]])
    in_segment = pos - (prev_eos + 1)
    source = pos - shift
    shifted = history[source.clamp_min(0)]
    valid = (in_segment >= shift) & (source >= 0)
    return torch.where(valid, shifted, torch.full_like(shifted, eos))


def _hash_heads(shifted: list[torch.Tensor], multipliers: torch.Tensor, head_vocab_sizes: torch.Tensor,
                head_offsets: torch.Tensor, heads_per_ngram: int) -> torch.Tensor:
    """Table rows of every head from ``shifted[s]`` (the id ``s`` tokens back): n-gram order 2 first."""
    blocks = []
    for order in range(2, multipliers.shape[0] + 1):
        lo = (order - 2) * heads_per_ngram
        mixed = shifted[0] * multipliers[0]
        for p in range(1, order):
            mixed = torch.bitwise_xor(mixed, shifted[p] * multipliers[p])
        sizes = head_vocab_sizes[lo:lo + heads_per_ngram]
        blocks.append(torch.remainder(mixed.unsqueeze(-1), sizes) + head_offsets[lo:lo + heads_per_ngram])
    return torch.cat(blocks, dim=-1)


def ngram_ids(context: torch.Tensor, tokens: torch.Tensor, eos: int, multipliers: torch.Tensor,
              head_vocab_sizes: torch.Tensor, head_offsets: torch.Tensor, heads_per_ngram: int) -> torch.Tensor:
    """Row ids into a PLE table for ``tokens`` (one sequence) after ``context`` (its previous ids).

    Returns ``[L, (ngram_size - 1) * heads_per_ngram]``; n-gram order 2 first.
    """
    ngram_size = multipliers.shape[0]
    history = torch.cat([context.long(), tokens.long()])
    shifted = [shift_within_segment(history, s, eos) for s in range(ngram_size)]
    return _hash_heads(shifted, multipliers, head_vocab_sizes, head_offsets, heads_per_ngram)[context.shape[0]:]


def ngram_ids_varlen(context: torch.Tensor, tokens: torch.Tensor, row_segment: torch.Tensor,
                     cu_seqlens: torch.Tensor, eos: int,
                     multipliers: torch.Tensor, head_vocab_sizes: torch.Tensor, head_offsets: torch.Tensor,
                     heads_per_ngram: int) -> torch.Tensor:
    """:func:`ngram_ids_varlen_ref`'s result: one Triton launch for CUDA tensors (``ngram_triton``), the
    reference otherwise."""
    if use_triton(tokens, "ngram"):
        from .ngram_triton import ngram_ids_varlen as triton_ids

        return triton_ids(context, tokens, row_segment, cu_seqlens, eos, multipliers, head_vocab_sizes,
                          head_offsets, heads_per_ngram)
    return ngram_ids_varlen_ref(context, tokens, row_segment, cu_seqlens, eos, multipliers, head_vocab_sizes,
                                head_offsets, heads_per_ngram)


def ngram_ids_varlen_ref(context: torch.Tensor, tokens: torch.Tensor, row_segment: torch.Tensor,
                         cu_seqlens: torch.Tensor, eos: int,
                         multipliers: torch.Tensor, head_vocab_sizes: torch.Tensor, head_offsets: torch.Tensor,
                         heads_per_ngram: int) -> torch.Tensor:
    """:func:`ngram_ids` for a flat batch of segments at once.

    Args:
        context: ``[N, W]`` each segment's previous ids (``W = ngram_size - 1``).
        tokens: ``[T]`` the rows of all segments; row_segment ``[T]`` their segment index; cu_seqlens
            ``[N + 1]`` the segments' row offsets.
    Every segment is laid out as its context followed by its tokens in one flat history. A shift of
    at most ``W`` from a token row stays inside its own segment's part, and an EOS found in an
    earlier segment's part leaves at least ``W`` rows of in-segment history, so one pass over the
    flat history gives each segment exactly its own ids.
    """
    n, width = context.shape
    total = tokens.shape[0]
    device = tokens.device
    token_at = row_segment * width + torch.arange(total, device=device) + width
    history = torch.empty(total + n * width, dtype=torch.long, device=device)
    seg_start = cu_seqlens[:-1].long() + width * torch.arange(n, device=device)
    history[(seg_start[:, None] + torch.arange(width, device=device)).flatten()] = context.flatten().long()
    history[token_at] = tokens.long()
    ngram_size = multipliers.shape[0]
    shifted = [shift_within_segment(history, s, eos)[token_at] for s in range(ngram_size)]
    return _hash_heads(shifted, multipliers, head_vocab_sizes, head_offsets, heads_per_ngram)
