"""Sampling: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from tidal import LLM
from tidal.executor.sampler import Sampler, filter_logits
from tidal.messages import SamplingParams


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0, 2.5])
    out = filter_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.isfinite(out).nonzero().flatten().tolist() == [1, 4]


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    out = filter_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.isfinite(out).nonzero().flatten().tolist() == [0, 1]
    # The top token always survives, however small top_p is.
    out = filter_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.01))
    assert torch.isfinite(out).nonzero().flatten().tolist() == [0]


def test_sampling_frequencies_follow_temperature():
    sampler = Sampler(torch.device("cpu"), seed=1)
    logits = torch.tensor([[0.0, 1.0, 2.0]]).repeat(4000, 1)
    ids = sampler(logits, [SamplingParams(temperature=1.0)] * 4000, list(range(4000)))
    freq = torch.bincount(torch.tensor(ids), minlength=3).float() / 4000
    expected = torch.softmax(torch.tensor([0.0, 1.0, 2.0]), dim=0)
    assert (freq - expected).abs().max() < 0.03
    cold = sampler(logits[:500], [SamplingParams(temperature=0.05)] * 500, list(range(500)))
    assert set(cold) == {2}


def test_seeded_requests_are_reproducible(tiny_checkpoint, device):
    llm = LLM(tiny_checkpoint, device=device)
    prompt = list(range(2000, 2040))
    a = llm.generate([prompt], max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)[0]
    # Batched with other work, the seeded request samples the same tokens.
    b = llm.generate([prompt[:7], prompt, prompt[3:]], max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)[1]
    c = llm.generate([prompt], max_tokens=12, temperature=1.0, seed=43, ignore_eos=True)[0]
    assert a == b
    assert a != c
    greedy = llm.generate([prompt], max_tokens=12, ignore_eos=True)[0]
    assert llm.generate([prompt], max_tokens=12, temperature=1.0, top_k=1, seed=5, ignore_eos=True)[0] == greedy


def test_tiny_temperature_samples_greedily_not_nan():
    import torch

    from tidal.executor.sampler import Sampler
    from tidal.messages import SamplingParams

    logits = torch.tensor([[0.1, 3.0, -2.0, 2.9], [5.0, 0.0, 0.0, 4.99]])
    sampler = Sampler(torch.device("cpu"))
    for t in (1e-300, 5e-324, 1e-6):
        assert sampler(logits, [SamplingParams(temperature=t)] * 2, [0, 0]) == [1, 0]
