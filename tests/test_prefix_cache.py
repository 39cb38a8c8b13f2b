"""Prefix caching of hybrid state against real ``tidal serve`` processes on the tiny checkpoint."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest
import torch
from server_harness import Server, Tap

from tidal import LLM
from tidal.tokenizer import load_tokenizer

ALIGN = 64


def ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 248000, (n,), generator=gen).tolist()


COLD = ids(1000, 11)
CONTINUATION = COLD + ids(77, 12)


class Served:
    """A server with its tap."""

    def __init__(self, model: str, *flags: str):
        self.server = Server(model, *flags, api_key=None)
        self.tap = Tap(self.server.tap_addr)

    def complete(self, prompt, max_tokens: int = 24, **extra) -> tuple[dict, dict, list[int], dict]:
        status, body = self.server.post("/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra})
        assert status == 200, body
        admitted, token_ids, final = self.tap.wait_finished(body["id"].removeprefix("cmpl-"))
        return body, admitted, token_ids, final

    def counter(self, name: str) -> float:
        return self.server.metrics()[f"tidal_scheduler_{name}_total"]

    def close(self) -> list[int]:
        self.tap.close()
        return self.server.stop()


@pytest.fixture(scope="module")
def default(tiny_checkpoint):
    s = Served(tiny_checkpoint, "--max-prefill-length", "2048", "--enable-cache-report")
    yield s
    assert s.close() == []


@pytest.fixture(scope="module")
def aligned(tiny_checkpoint):
    s = Served(tiny_checkpoint, "--max-prefill-length", "2048", "--no-prefill-coalesce")
    yield s
    assert s.close() == []


@pytest.fixture(scope="module")
def uncached(tiny_checkpoint):
    s = Served(tiny_checkpoint, "--max-prefill-length", "2048", "--disable-prefix-cache")
    yield s
    assert s.close() == []


@pytest.fixture(scope="module")
def offline(tiny_checkpoint) -> LLM:
    return LLM(tiny_checkpoint, device="cpu", disable_prefix_cache=True)


@pytest.fixture(scope="module")
def runs(default, aligned, uncached):
    """Cold 1000-token prompt, then its 1077-token continuation, on each server."""
    out = {}
    for name, served in (("default", default), ("aligned", aligned), ("uncached", uncached)):
        before = served.counter("prefill_forwards")
        cold = served.complete(COLD)
        cont = served.complete(CONTINUATION, max_tokens=32)
        out[name] = dict(cold=cold, cont=cont, prefill_forwards=served.counter("prefill_forwards") - before)
    return out


def test_continuation_reuses_960_tokens_with_the_same_ids(runs, offline):
    body, admitted, token_ids, final = runs["default"]["cont"]
    assert admitted["cached_tokens"] == 960
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 960
    assert final["usage"]["cached_tokens"] == 960
    assert runs["default"]["cold"][1]["cached_tokens"] == 0
    assert runs["default"]["cold"][1]["plan"]["checkpoints"] == [960]
    # The same request without the prefix cache, and offline.
    assert runs["uncached"]["cont"][1]["cached_tokens"] == 0
    assert token_ids == runs["uncached"]["cont"][2]
    assert token_ids == offline.generate([CONTINUATION], max_tokens=32, ignore_eos=True)[0]
    assert runs["default"]["cold"][2] == offline.generate([COLD], max_tokens=24, ignore_eos=True)[0]


def test_coalescing_same_ids_same_cache_fewer_forwards(runs):
    """The default coalesces prompt tails; --no-prefill-coalesce runs them as forwards of their own."""
    c, d = runs["default"], runs["aligned"]
    assert c["cont"][1]["cached_tokens"] == d["cont"][1]["cached_tokens"] == 960
    assert c["cold"][2] == d["cold"][2] and c["cont"][2] == d["cont"][2]
    # Align mode cuts a forward at the checkpoint; coalescing exports it from inside one forward.
    assert d["cold"][1]["plan"]["chunks"] == [[0, 960], [960, 1000]]
    assert c["cold"][1]["plan"]["chunks"] == [[0, 1000]]
    assert c["cold"][1]["plan"]["checkpoints"] == d["cold"][1]["plan"]["checkpoints"] == [960]
    assert d["cont"][1]["plan"]["chunks"] == [[960, 1024], [1024, 1077]]
    assert c["cont"][1]["plan"]["chunks"] == [[960, 1077]]
    assert c["prefill_forwards"] == 2 and d["prefill_forwards"] == 4


def test_two_turn_chat_reuses_prompt_and_answer(default, tiny_checkpoint):
    tok = load_tokenizer(tiny_checkpoint)
    user = {"role": "user", "content": "Describe the harbour at low tide, slowly. " * 12}
    status, first = default.server.post("/v1/chat/completions", {
        "model": "tiny", "messages": [user], "max_completion_tokens": 70, "temperature": 0, "ignore_eos": True})
    assert status == 200
    p1, o1 = first["usage"]["prompt_tokens"], first["usage"]["completion_tokens"]
    answer = first["choices"][0]["message"]["content"]
    status, second = default.server.post("/v1/chat/completions", {
        "model": "tiny", "temperature": 0, "max_completion_tokens": 4,
        "messages": [user, {"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]})
    assert status == 200
    # Turn 1 left checkpoints at the last aligned position of its prompt and of prompt + answer.
    expected = (p1 + o1 - 1) // ALIGN * ALIGN
    assert expected > (p1 - 1) // ALIGN * ALIGN  # the answer really contributes
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == expected
    assert second["usage"]["prompt_tokens"] > p1 + o1
    assert len(tok.apply_chat_template([user])) == p1


def test_abort_mid_prefill_with_planned_checkpoint_leaks_nothing(default):
    srv = default.server
    start = srv.metrics()
    long_prompt = ids(12000, 21)

    async def fire_and_drop():
        async with aiohttp.ClientSession() as s:
            task = asyncio.ensure_future(s.post(srv.url + "/v1/completions", json={
                "model": "tiny", "prompt": long_prompt, "max_tokens": 4, "temperature": 0}))
            await asyncio.sleep(0.6)  # admitted, a prefill chunk or two done, not finished
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
    asyncio.run(fire_and_drop())
    m = srv.wait_idle()
    admitted = [x for x in default.tap.lines if x["type"] == "PromptAdmitted" and x["prompt_tokens"] == 12000]
    assert admitted and admitted[-1]["plan"]["checkpoints"] == [11968]
    _, token_ids, final = default.tap.wait_finished(admitted[-1]["rid"])
    assert final["finish_reason"] == "abort" and token_ids == []
    assert 0 < m["tidal_scheduler_prefill_forwards_total"] - start["tidal_scheduler_prefill_forwards_total"] < 7
    assert m["tidal_kv_pages_in_use"] == 0 and m["tidal_state_slots_in_use"] == 0
    assert m["tidal_scheduler_checkpoints_written_total"] == start["tidal_scheduler_checkpoints_written_total"]
    assert m["tidal_state_slots_cached"] == start["tidal_state_slots_cached"]
    # The aborted prompt left no checkpoint to hit, and the server keeps serving.
    _, admitted2, _, _ = default.complete(long_prompt[:3000], max_tokens=2)
    assert admitted2["cached_tokens"] == 0


def test_cache_report_log_line(default):
    prompt = ids(700, 31)
    reports = []
    for _ in range(2):
        _, admitted, _, _ = default.complete(prompt, max_tokens=2)
        deadline = time.time() + 5
        lines = []
        while not lines and time.time() < deadline:
            lines = [line for line in default.server.logs().splitlines()
                     if "cache report" in line and admitted["rid"] in line]
            time.sleep(0.05)
        assert len(lines) == 1
        reports.append(lines[0])
    assert "prompt_tokens=700 cached_tokens=0 computed_tokens=700 checkpoints_written=[640]" in reports[0]
    assert "prompt_tokens=700 cached_tokens=640 computed_tokens=60 checkpoints_written=[]" in reports[1]


def test_small_pool_fifty_requests_evict_and_return_to_idle(tiny_checkpoint, offline):
    served = Served(tiny_checkpoint, "--kv-pool-tokens", "4096", "--state-slots", "16",
                    "--max-running-requests", "4", "--max-model-len", "1024")
    try:
        docs = [ids(300, 100 + d) for d in range(5)]
        prompts = []
        for i in range(50):
            if i % 5 == 4:
                prompts.append(ids(90 + i, 500 + i))  # unshared
            else:
                prompts.append(docs[i % 5] + ids(20 + i, 900 + i))  # shared 300-token prefix
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda p: served.complete(p, max_tokens=6), prompts))
        expected = offline.generate(prompts, max_tokens=6, ignore_eos=True)
        for (body, _, token_ids, final), want in zip(results, expected, strict=True):
            assert final["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 6
            assert token_ids == want
        hits = [r[1]["cached_tokens"] for r in results]
        assert sum(1 for h in hits if h > 0) >= 10
        m = served.server.wait_idle()
        assert m["tidal_scheduler_pages_evicted_total"] > 0
        assert m["tidal_scheduler_checkpoints_evicted_total"] > 0
        assert m["tidal_kv_pages_in_use"] == 0 and m["tidal_state_slots_in_use"] == 0
        assert m["tidal_kv_pages_cached"] > 0 and m["tidal_state_slots_cached"] > 0
        assert m["tidal_state_slots_cached"] <= 12  # the checkpoint part of --state-slots 16
    finally:
        assert served.close() == []


def test_metrics_count_hits_reuse_checkpoints_and_forwards(default):
    before = default.server.metrics()
    cold = ids(1000, 41)
    default.complete(cold, max_tokens=24)
    default.complete(cold + ids(77, 42), max_tokens=32)
    after = default.server.wait_idle()

    def delta(name):
        return after[name] - before[name]
    assert delta("tidal_scheduler_cache_queries_total") == 2
    assert delta("tidal_scheduler_cache_hits_total") == 1
    assert delta("tidal_scheduler_cached_tokens_total") == 960
    assert delta("tidal_cached_prompt_tokens_total") == 960
    # Prompt checkpoints at 960 and 1024, and the continuation's end-of-request checkpoint at 1088.
    assert delta("tidal_scheduler_checkpoints_written_total") == 3
    # cold: 1 prompt forward (its checkpoints exported inside) + 23 decodes; continuation: 1 + 31.
    assert delta("tidal_scheduler_prefill_forwards_total") == 2
    assert delta("tidal_scheduler_request_forwards_total") == 24 + 32
    assert delta('tidal_requests_total{finish_reason="length"}') == 2
