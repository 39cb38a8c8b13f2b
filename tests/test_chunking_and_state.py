"""Chunking invariance and state checkpoint/restore on the model runner."""

from __future__ import annotations

import pytest
import torch

from tidal import LLM
from tidal.messages import Batch, SegmentSpec

PROMPT = 200


@pytest.fixture(scope="module")
def prompt(tiny_checkpoint) -> list[int]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 248000, (PROMPT,), generator=gen)
    ids[90] = 248046  # EOS inside the prompt
    return ids.tolist()


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, prompt, device):
    llm = LLM(tiny_checkpoint, device=device)
    return llm.score(prompt), llm.generate([prompt], max_tokens=24, ignore_eos=True)[0]


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunk_size_does_not_change_logits_or_ids(tiny_checkpoint, prompt, reference, chunk, device):
    ref_logits, ref_ids = reference
    llm = LLM(tiny_checkpoint, device=device, max_prefill_length=chunk)
    logits = llm.score(prompt)
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    assert llm.generate([prompt], max_tokens=24, ignore_eos=True)[0] == ref_ids


def test_prefill_then_decode_equals_one_forward(tiny_checkpoint, prompt, reference, device):
    """Logits from decoding the prompt's tail token by token equal those of a single forward."""
    ref_logits, _ = reference
    llm = LLM(tiny_checkpoint, device=device)
    runner, ps = llm.runner, llm.sizes.page_size
    pages = list(range(-(-PROMPT // ps)))
    head = 150
    out = runner.execute(Batch(batch_id=1, segments=[
        SegmentSpec(rid="r", slot=0, start=0, token_ids=prompt[:head], pages=pages, want_logits=True)]))
    rows = [out.logits[0]]
    for pos in range(head, PROMPT):
        out = runner.execute(Batch(batch_id=2 + pos, segments=[
            SegmentSpec(rid="r", slot=0, start=pos, token_ids=[prompt[pos]], pages=pages, want_logits=True)]))
        rows.append(out.logits[0])
    assert (torch.cat(rows).cpu() - ref_logits).abs().max().item() <= 1e-4


def test_concurrent_requests_match_single(tiny_checkpoint, prompt, reference, device):
    """Mixed prefill chunks and decodes of other requests in one forward change nothing."""
    _, ref_ids = reference
    llm = LLM(tiny_checkpoint, device=device, max_prefill_length=48)
    others = [prompt[10:90], prompt[:33], prompt[5:170]]
    outs = llm.generate([others[0], prompt, others[1], others[2]], max_tokens=24, ignore_eos=True)
    assert outs[1] == ref_ids
    singles = [llm.generate([p], max_tokens=24, ignore_eos=True)[0] for p in others]
    assert [outs[0], outs[2], outs[3]] == singles


def _forward(runner, slot, start, tokens, pages, exports=(), copies=()):
    spec = SegmentSpec(rid=f"s{slot}", slot=slot, start=start, token_ids=tokens, pages=pages, want_logits=True,
                       exports=[list(e) for e in exports])
    return runner.execute(Batch(batch_id=0, segments=[spec], copies=[list(c) for c in copies])).logits[0]


@pytest.mark.parametrize("internal", [False, True], ids=["at-forward-end", "inside-forward"])
def test_checkpoint_restore_continues_exactly(tiny_checkpoint, prompt, device, internal):
    """Copying a request's state at position p (and sharing its KV pages up to p) into a new
    request and continuing gives the original's logits."""
    llm = LLM(tiny_checkpoint, device=device)
    runner, ps = llm.runner, llm.sizes.page_size
    p = 64
    pages_a = list(range(0, 13))
    if internal:
        # One forward over [0, 200) exports the state at 64 into slot 9 from inside the forward.
        full = _forward(runner, 0, 0, prompt, pages_a, exports=[(p, 9)])
    else:
        head = _forward(runner, 0, 0, prompt[:p], pages_a)
        runner.states.copy_many([0], [9])
        full = torch.cat([head, _forward(runner, 0, p, prompt[p:], pages_a)])
    # Request B: shares A's first p // ps pages, owns fresh pages after them, restores slot 9 into slot 5.
    pages_b = pages_a[: p // ps] + list(range(20, 20 + 13 - p // ps))
    cont = _forward(runner, 5, p, prompt[p:], pages_b, copies=[(9, 5)])
    assert (cont - full[p:]).abs().max().item() <= 1e-4
    # The restored request decodes on: same next-token logits as A decoding the same token.
    nxt = 12345
    a = _forward(runner, 0, PROMPT, [nxt], pages_a)
    b = _forward(runner, 5, PROMPT, [nxt], pages_b)
    assert (a - b).abs().max().item() <= 1e-4


def test_bf16_prompt_split_on_gdn_blocks_equals_one_forward(tiny_checkpoint):
    """In bf16, where any difference in how a prompt is split shows in the rounding, limits that are
    not multiples of 64 cut forwards at multiples of 64 (the chunked GDN kernels' block), and the
    logits equal one forward's bitwise; so do greedy ids, cold, in chunks and after a prefix-cache hit.
    (Cut at 300 itself, the same check moved logits by up to 0.28.)"""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(1000, 240000, (700,), generator=gen)
    ids[350] = 248046
    prompt = ids.tolist()
    cold = LLM(tiny_checkpoint, device="cpu", dtype="bfloat16")
    want = cold.score(prompt)
    want_ids = cold.generate([prompt], max_tokens=12, ignore_eos=True)[0]
    before = cold.scheduler.counters["cached_tokens"]
    assert cold.generate([prompt], max_tokens=12, ignore_eos=True)[0] == want_ids
    assert cold.scheduler.counters["cached_tokens"] - before == 640
    for limit in (300, 100):
        llm = LLM(tiny_checkpoint, device="cpu", dtype="bfloat16", max_prefill_length=limit)
        assert torch.equal(llm.score(prompt), want), limit
        assert llm.generate([prompt], max_tokens=12, ignore_eos=True)[0] == want_ids, limit


@pytest.mark.parametrize("pairs", [[(0, 9)], [(0, 9), (3, 4)], [(1, 2), (3, 4), (5, 6), (7, 8), (0, 9)]],
                         ids=["one", "two", "five"])
def test_copy_many_copies_every_state_of_each_pair(tiny_checkpoint, device, pairs):
    """Few pairs (one multi-tensor copy) and many (gather-scatter) alike: each destination slot holds its
    source's every state tensor afterwards, every other slot is untouched."""
    states = LLM(tiny_checkpoint, device=device).runner.states
    gen = torch.Generator().manual_seed(3)
    tensors = list(states._tensors())
    for t in tensors:
        t.copy_(torch.randint(0, 1000, t.shape, generator=gen).to(t.dtype))
    before = [t.clone() for t in tensors]
    states.copy_many([s for s, _ in pairs], [d for _, d in pairs])
    dst = {d: s for s, d in pairs}
    for t, b in zip(tensors, before, strict=True):
        for slot in range(t.shape[0]):
            assert torch.equal(t[slot], b[dst.get(slot, slot)]), slot
