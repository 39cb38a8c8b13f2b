"""Token sampling on the model's device: greedy, temperature, top-k, top-p, per-request seed."""

from __future__ import annotations

import torch

from ..messages import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15


def _seeded_generator(device: torch.device, seed: int, index: int) -> torch.Generator:
    """A generator that depends only on (seed, output index): a seeded request samples the same
    tokens whatever it is batched with, and after a prefix-cache hit."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * _SEED_MIX + index) % (2**63 - 1))
    return gen


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus, keeps at least one token) on one row."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the tokens ranked above it already reach top_p.
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], indices: list[int]) -> list[int]:
        """One token per row of ``logits [N, V]`` (fp32)."""
        if not params:
            return []
        out = torch.argmax(logits, dim=-1)
        for row, (p, index) in enumerate(zip(params, indices, strict=True)):
            if p.greedy:
                continue
            probs = torch.softmax(filter_logits(logits[row], p), dim=-1)
            gen = self.generator if p.seed is None else _seeded_generator(self.device, p.seed, index)
            out[row] = torch.multinomial(probs, 1, generator=gen)[0]
        return out.tolist()
