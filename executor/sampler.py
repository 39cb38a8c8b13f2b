"""Token sampling on the model's device: penalties, logit bias and min_tokens, then greedy,
temperature, top-k, top-p, per-request seed."""

from __future__ import annotations

import torch

from ..messages import SamplingParams, SegmentSpec

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


class TokenCounts:
    """Per state slot, for requests with penalties: how often each token was generated, and which
    tokens the prompt holds (the repetition penalty's share). Rebuilt from a segment's ``history``
    (first sampling segment after admission or resumption), then counted as tokens are sampled."""

    def __init__(self, device: torch.device):
        self.device = device
        self.slots: dict[int, tuple[str, torch.Tensor, torch.Tensor]] = {}

    def rows(self, specs: list[SegmentSpec], vocab: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """``(counts [V] fp32, prompt_mask [V] bool)`` per sampled segment, ``None`` without penalties."""
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for spec in specs:
            if spec.sampling is None or not spec.sampling.penalized:
                out.append(None)
                continue
            entry = self.slots.get(spec.slot)
            if spec.history is not None or entry is None or entry[0] != spec.rid:
                history = spec.history or []
                counts = torch.zeros(vocab, dtype=torch.float32, device=self.device)
                generated = history[spec.history_prompt:]
                if generated:
                    ids = torch.tensor(generated, device=self.device)
                    counts.index_add_(0, ids, torch.ones(len(generated), device=self.device))
                mask = torch.zeros(vocab, dtype=torch.bool, device=self.device)
                if spec.history_prompt:
                    mask[torch.tensor(history[:spec.history_prompt], device=self.device)] = True
                entry = self.slots[spec.slot] = (spec.rid, counts, mask)
            out.append(entry[1:])
        return out

    @staticmethod
    def count(rows: list[tuple[torch.Tensor, torch.Tensor] | None], token_ids: list[int]) -> None:
        for row, token in zip(rows, token_ids, strict=True):
            if row is not None:
                row[0][token] += 1


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], indices: list[int],
                  counts: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> torch.Tensor:
    """Penalties (batched over the rows that have them), logit bias and min_tokens on ``logits [N, V]``;
    the input itself when no row asks for any."""
    bias = [r for r, p in enumerate(params) if p.logit_bias]
    ban = [r for r, p in enumerate(params) if p.min_tokens_ban and indices[r] < p.min_tokens]
    pen = [r for r, p in enumerate(params) if p.penalized and counts is not None and counts[r] is not None]
    if not (bias or ban or pen):
        return logits
    logits = logits.clone()
    if pen:
        index = torch.tensor(pen, device=logits.device)
        count = torch.stack([counts[r][0] for r in pen])
        seen = torch.stack([counts[r][1] for r in pen]) | (count > 0)
        value = torch.tensor([[params[r].repetition_penalty, params[r].frequency_penalty, params[r].presence_penalty]
                              for r in pen], dtype=logits.dtype, device=logits.device)
        rows = logits[index]
        rep = value[:, :1]
        rows = torch.where(seen, torch.where(rows > 0, rows / rep, rows * rep), rows)
        rows = rows - value[:, 1:2] * count - value[:, 2:3] * (count > 0).to(rows.dtype)
        logits[index] = rows
    for r in bias:
        ids = torch.tensor(list(params[r].logit_bias), device=logits.device)
        logits[r, ids] += torch.tensor(list(params[r].logit_bias.values()), dtype=logits.dtype, device=logits.device)
    for r in ban:
        logits[r, torch.tensor(params[r].min_tokens_ban, device=logits.device)] = float("-inf")
    return logits


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], indices: list[int],
                 counts: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> list[int]:
        """One token per row of ``logits [N, V]`` (fp32); ``counts`` per row from :class:`TokenCounts`."""
        if not params:
            return []
        logits = adjust_logits(logits, params, indices, counts)
        out = torch.argmax(logits, dim=-1)
        for row, (p, index) in enumerate(zip(params, indices, strict=True)):
            if p.greedy:
                continue
            probs = torch.softmax(filter_logits(logits[row], p), dim=-1)
            gen = self.generator if p.seed is None else _seeded_generator(self.device, p.seed, index)
            out[row] = torch.multinomial(probs, 1, generator=gen)[0]
        return out.tolist()
