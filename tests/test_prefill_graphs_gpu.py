"""Prompt forwards replayed from CUDA graphs against the same prompts run eagerly (bf16, flash-linear-attention's
chunked recurrence, the Triton kernels): the last row's logits of every shape family (one unsplit chunk, a split
at a coalesced checkpoint, a split at the last multiple of 64, a continuation after a cached prefix), the
greedy ids of whole requests, and a replay that never waits for the device."""

from __future__ import annotations

import pytest
import torch

from tidal import LLM


def ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 240000, (n,), generator=gen).tolist()


LENGTHS = (2, 37, 64, 100, 128, 129, 700, 2000, 4000, 8192)


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    graphed = LLM(tiny_checkpoint, device="cuda", dtype="bfloat16", max_prefill_length=8192)
    eager = LLM(tiny_checkpoint, device="cuda", dtype="bfloat16", max_prefill_length=8192, disable_prefill_graph=True)
    assert graphed.runner.prefill_graphs is not None and graphed.runner.prefill_graphs.capture
    assert eager.runner.prefill_graphs is None
    return graphed, eager


@pytest.mark.gpu
@pytest.mark.parametrize("length", LENGTHS)
def test_replayed_prompt_logits_equal_eager(pair, length):
    graphed, eager = pair
    prompt = ids(length, length)
    graphs = graphed.runner.prefill_graphs
    before = graphs.replays
    first = graphed.generate([prompt], max_tokens=1)[0]
    assert graphs.replays == before + 1
    got = graphs.logits[0].float().cpu()
    want = eager.score(prompt)[-1].float()
    torch.testing.assert_close(got, want, atol=0.03 * want.abs().max().item(), rtol=0.02)
    assert first == eager.generate([prompt], max_tokens=1)[0]


@pytest.mark.gpu
def test_replayed_requests_give_eager_ids(pair):
    """Whole requests (prompt forwards from graphs, then decode steps), twice: the second round's prompts are
    prefix-cache hits, and a longer prompt continues a cached one."""
    graphed, eager = pair
    prompts = [ids(n, 100 + n) for n in (37, 300, 1000)]
    for _ in range(2):
        want = [eager.generate([p], max_tokens=16, ignore_eos=True)[0] for p in prompts]
        assert [graphed.generate([p], max_tokens=16, ignore_eos=True)[0] for p in prompts] == want
    longer = prompts[1] + want[1] + ids(77, 7)
    assert graphed.generate([longer], max_tokens=16, ignore_eos=True) == eager.generate([longer], max_tokens=16,
                                                                                         ignore_eos=True)
    stats = graphed.scheduler.stats()
    assert stats.kv_pages_in_use == 0 and stats.state_slots_in_use == 0


@pytest.mark.gpu
def test_replay_never_syncs_with_the_host(pair):
    """After its capture, a prompt forward is one upload and one replay: no device sync."""
    graphed, _ = pair
    runner = graphed.runner
    graphs = runner.prefill_graphs
    prompt = ids(300, 9)
    pages = list(range(-(-300 // runner.kv.page_size)))
    with torch.inference_mode():
        graphs.run(0, 0, prompt, pages, [(256, 3)])  # captures the shape if it is new
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            logits = graphs.run(0, 0, prompt, pages, [(256, 3)])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(logits.float()).all()
