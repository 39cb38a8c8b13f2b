"""Token sampling on the model's device: penalties, logit bias and min_tokens, then greedy,
temperature, top-k, top-p, per-request seed."""

from __future__ import annotations

import numpy as np
import torch

from ..messages import SamplingParams, SegmentSpec
from .upload import device_ints


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


# splitmix64 constants, as signed 64-bit integers (torch multiplies int64 with wrap-around).
_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
_STREAM = _signed(0xD6E8FEB86659FD93)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def seeded_uniform(seeds: torch.Tensor, indices: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms in (0, 1), ``[rows, vocab]``, a pure function of (seed, output index, token id)
    (splitmix64 over a counter): a seeded request draws the same numbers whatever it is batched with,
    on any device."""
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = (seeds[:, None] * _GOLDEN + indices[:, None] * _STREAM) + tokens[None, :] * _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    x = x ^ _shr(x, 31)
    return (_shr(x, 11).to(torch.float64) + 0.5).mul_(2.0 ** -53).to(torch.float32)


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of ``logits [N, V]`` divided by their temperature, then min-p (tokens less likely than ``min_p``
    times the most likely one, vLLM's order), then top-k (``k`` tokens, 0: off), then top-p (the smallest
    nucleus reaching ``p``, at least one token) masked to -inf; one sort for all."""
    logits = logits / temperature[:, None]
    if min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), float("-inf"))
    vocab = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    ordered, order = torch.sort(logits, dim=-1, descending=True)
    keep = torch.arange(vocab, device=logits.device)[None, :] < k[:, None]
    probs = torch.softmax(ordered.masked_fill(~keep, float("-inf")), dim=-1)
    # Drop a token once the tokens ranked above it already reach top_p.
    keep &= (probs.cumsum(-1) - probs) < top_p[:, None]
    keep[:, 0] = True
    return logits.masked_fill(~torch.zeros_like(keep).scatter(1, order, keep), float("-inf"))


def slot_state(slots: dict[int, tuple[str, object]], spec: SegmentSpec, build):
    """The per-request state a sampled segment's slot holds, rebuilt with ``build()`` when the
    segment carries the request's ``history`` (first sampling since admission or resumption) or the
    slot holds another request's."""
    entry = slots.get(spec.slot)
    if spec.history is not None or entry is None or entry[0] != spec.rid:
        entry = slots[spec.slot] = (spec.rid, build())
    return entry[1]


class TokenCounts:
    """Per state slot, for requests with penalties: how often each token was generated, and which
    tokens the prompt holds (the repetition penalty's share). Rebuilt from a segment's ``history``
    (first sampling segment after admission or resumption), then counted as tokens are sampled."""

    def __init__(self, device: torch.device):
        self.device = device
        self.slots: dict[int, tuple[str, tuple[torch.Tensor, torch.Tensor]]] = {}

    def _build(self, spec: SegmentSpec, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        history = spec.history or []
        counts = torch.zeros(vocab, dtype=torch.float32, device=self.device)
        generated = history[spec.history_prompt:]
        if generated:
            ids = torch.tensor(generated, device=self.device)
            counts.index_add_(0, ids, torch.ones(len(generated), device=self.device))
        mask = torch.zeros(vocab, dtype=torch.bool, device=self.device)
        if spec.history_prompt:
            mask[torch.tensor(history[:spec.history_prompt], device=self.device)] = True
        return counts, mask

    def rows(self, specs: list[SegmentSpec], vocab: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """``(counts [V] fp32, prompt_mask [V] bool)`` per sampled segment, ``None`` without penalties."""
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for spec in specs:
            if spec.sampling is None or not spec.sampling.penalized:
                out.append(None)
                continue
            out.append(slot_state(self.slots, spec, lambda spec=spec: self._build(spec, vocab)))
        return out

    @staticmethod
    def count(rows: list[tuple[torch.Tensor, torch.Tensor] | None], token_ids: list[int]) -> None:
        for row, token in zip(rows, token_ids, strict=True):
            if row is not None:
                row[0][token] += 1


def _adjusted_rows(params: list[SamplingParams], indices: list[int],
                   counts: list[tuple[torch.Tensor, torch.Tensor] | None] | None) -> tuple[list[int], ...]:
    """The rows with a logit bias, a min_tokens ban in force, and penalties."""
    bias = [r for r, p in enumerate(params) if p.logit_bias]
    ban = [r for r, p in enumerate(params) if p.min_tokens_ban and indices[r] < p.min_tokens]
    pen = [r for r, p in enumerate(params) if p.penalized and counts is not None and counts[r] is not None]
    return bias, ban, pen


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], indices: list[int],
                  counts: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> torch.Tensor:
    """Penalties (batched over the rows that have them), logit bias and min_tokens on ``logits [N, V]``;
    the input itself when no row asks for any."""
    bias, ban, pen = _adjusted_rows(params, indices, counts)
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
        ids = device_ints(list(params[r].logit_bias), logits.device)
        logits[r, ids] += device_ints(list(params[r].logit_bias.values()), logits.device, np.float32).to(logits.dtype)
    for r in ban:
        logits[r, device_ints(params[r].min_tokens_ban, logits.device)] = float("-inf")
    return logits


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], indices: list[int],
                 counts: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> list[int]:
        """One token per row of ``logits [N, V]`` (fp32); ``counts`` per row from :class:`TokenCounts`."""
        return self.sample(logits, params, indices, counts).tolist() if params else []

    @staticmethod
    def plain_greedy(params: list[SamplingParams], indices: list[int],
                     counts: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> bool:
        """Every row greedy with nothing that adjusts its logits (penalties only where ``counts`` are given):
        its token is the plain arg-max of the model's logits."""
        return all(p.greedy for p in params) and not any(_adjusted_rows(params, indices, counts))

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], indices: list[int],
               counts: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> torch.Tensor:
        """:meth:`__call__`'s ids as a device tensor ``[N]``, with no device sync on the way (parameters
        go up as non-blocking copies): a decode step can be sampled before the one before it is done.

        ``logits`` may be in a narrower float dtype (a decode graph's): the arg-max of a greedy row without
        adjustments is the same token there as in fp32 (the widening is exact), and anything else works on
        an fp32 copy."""
        if logits.dtype != torch.float32 and not self.plain_greedy(params, indices, counts):
            logits = logits.float()
        logits = adjust_logits(logits, params, indices, counts)
        out = torch.argmax(logits, dim=-1)
        rows = [r for r, p in enumerate(params) if not p.greedy]
        if rows:
            # Gumbel-max: argmax(logits / T + Gumbel noise) samples softmax(logits / T), every row at once.
            device = logits.device
            picked = [params[r] for r in rows]
            vocab = logits.shape[-1]
            index = device_ints(rows, device)
            temperature = device_ints([p.temperature for p in picked], device, np.float32)
            filtered = logits[index]
            if any(0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0 for p in picked):
                min_p = (device_ints([p.min_p for p in picked], device, np.float32)
                         if any(p.min_p > 0 for p in picked) else None)
                filtered = filter_logits(filtered, temperature, device_ints([p.top_k for p in picked], device),
                                         device_ints([p.top_p for p in picked], device, np.float32), min_p)
            else:
                filtered = filtered / temperature[:, None]
            uniform = torch.rand(filtered.shape, generator=self.generator, device=device)
            seeded = [j for j, p in enumerate(picked) if p.seed is not None]
            if seeded:
                seeds = device_ints([picked[j].seed for j in seeded], device)
                steps = device_ints([indices[rows[j]] for j in seeded], device)
                uniform[device_ints(seeded, device)] = seeded_uniform(seeds, steps, filtered.shape[-1])
            gumbel = -torch.log(-torch.log(uniform.clamp_(1e-20, 1.0 - 1e-7)))
            out[index] = torch.argmax(filtered + gumbel, dim=-1)
        return out
