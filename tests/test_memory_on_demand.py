"""KV pages on demand, preemption with resumption from a checkpoint, and decode-step message size.

Preempted requests are compared with the same requests run alone (a fresh model, plenty of pages).
"""

from __future__ import annotations

import pytest
import torch

from tidal import LLM
from tidal.config.model import ModelConfig
from tidal.config.pools import pool_sizes
from tidal.config.server_args import ServerArgs
from tidal.messages import GenerateReq, SamplingParams, encode
from tidal.scheduler import Scheduler


def ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 248000, (n,), generator=gen).tolist()


PROMPTS = [ids(150, 1), ids(120, 2), ids(170, 3)]
OUTPUT = 150


@pytest.fixture(scope="module")
def alone(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, max_prefill_length=64)
    return [llm.generate([p], max_tokens=OUTPUT, ignore_eos=True)[0] for p in PROMPTS]


@pytest.mark.parametrize("cache", [True, False], ids=["resume-from-checkpoint", "no-prefix-cache"])
def test_preempted_requests_equal_their_runs_alone(tiny_checkpoint, alone, cache):
    """Three requests of up to 320 positions (20 pages each) share a 32-page pool: the newest is
    preempted whenever a decode needs a page, and resumes when pages free up."""
    llm = LLM(tiny_checkpoint, max_prefill_length=64, kv_pool_tokens=512, max_model_len=512,
              disable_prefix_cache=not cache)
    outs = llm.generate(PROMPTS, max_tokens=OUTPUT, ignore_eos=True)
    assert outs == alone
    counters = llm.scheduler.counters
    assert counters["preemptions"] > 0
    if cache:  # resumption restored a checkpoint instead of recomputing from the start
        assert counters["cache_hits"] > 0
    stats = llm.scheduler.stats()
    assert stats.kv_pages_in_use == 0 and stats.state_slots_in_use == 0


def test_eight_chats_without_max_tokens_run_at_once(tiny_checkpoint):
    """Default flags, a 32K-context model: max_tokens defaults to the rest of the context, and each
    request holds pages only for what it has computed."""
    config = ModelConfig.from_file(tiny_checkpoint)
    args = ServerArgs(model=tiny_checkpoint)
    assert config.max_position_embeddings == 32768
    sched = Scheduler(args, config, pool_sizes(args, config), lambda e: None)
    for i in range(8):
        prompt = ids(200, 10 + i)
        sched.add_request(GenerateReq(rid=f"chat{i}", prompt_ids=prompt, max_tokens=32768 - len(prompt)))
    batch = sched.schedule()
    assert len(sched.running) == 8 and not sched.waiting
    assert len(batch.segments) == 8
    assert all(len(r.pages) == 13 for r in sched.running.values())  # ceil(200 / 16)


def test_decode_message_does_not_grow_with_context(tiny_checkpoint):
    """A decode step's Batch carries the new token and at most one new page, whatever the context."""
    config = ModelConfig.from_file(tiny_checkpoint)
    args = ServerArgs(model=tiny_checkpoint, max_prefill_length=None)
    sizes_by_context = {}
    for context in (100, 3000):
        sched = Scheduler(args, config, pool_sizes(args, config), lambda e: None)
        for i in range(4):
            sched.add_request(GenerateReq(rid=f"r{i}", prompt_ids=ids(context, i), max_tokens=40,
                                          sampling=SamplingParams()))
        while sched.waiting or not all(r.prefill_done for r in sched.running.values()):  # the prefills
            batch = sched.schedule()
            sched.process_result(batch, [7 if s.sample else -1 for s in batch.segments])
        sizes = []
        for _ in range(20):
            batch = sched.schedule()
            assert all(len(s.token_ids) == 1 and len(s.pages) <= 1 for s in batch.segments)
            sizes.append(len(encode(batch)))
            sched.process_result(batch, [7] * len(batch.segments))
        sizes_by_context[context] = max(sizes)
    # 30x the context: only integers get wider in msgpack (positions, page ids), a few bytes a segment.
    assert sizes_by_context[3000] <= sizes_by_context[100] + 8 * 4


def test_score_after_the_cache_holds_pages(tiny_checkpoint):
    """Scoring takes its pages by evicting cached ones, like any other request."""
    llm = LLM(tiny_checkpoint, kv_pool_tokens=512, max_model_len=512)
    llm.generate([ids(300, 5)], max_tokens=8, ignore_eos=True)
    assert llm.scheduler.stats().kv_pages_cached > 0
    logits = llm.score(ids(400, 6))
    fresh = LLM(tiny_checkpoint).score(ids(400, 6))
    assert (logits - fresh).abs().max().item() <= 1e-4


def test_preemption_through_the_server_with_overlap(tiny_checkpoint, alone):
    """The same three requests through ``tidal serve`` (two batches in flight, decodes sent ahead)
    with the 32-page pool: preempted and resumed, each equals its run alone; the pools end idle."""
    from concurrent.futures import ThreadPoolExecutor

    from server_harness import Server, Tap

    srv = Server(tiny_checkpoint, "--max-prefill-length", "64", "--kv-pool-tokens", "512", "--max-model-len", "512",
                 api_key=None)
    tap = Tap(srv.tap_addr)
    try:
        bodies = [{"model": "tiny", "prompt": p, "max_tokens": OUTPUT, "temperature": 0, "ignore_eos": True}
                  for p in PROMPTS]
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda b: srv.post("/v1/completions", b), bodies))
        got = []
        for status, body in answers:
            assert status == 200, body
            _, ids, final = tap.wait_finished(body["id"].removeprefix("cmpl-"))
            assert final["finish_reason"] == "length"
            got.append(ids)
        assert got == alone
        m = srv.wait_idle()
        assert m["tidal_scheduler_preemptions_total"] > 0 and m["tidal_scheduler_decodes_ahead_total"] > 0
        assert m["tidal_kv_pages_in_use"] == 0 and m["tidal_state_slots_in_use"] == 0
    finally:
        tap.close()
        assert srv.stop() == []
