"""The scheduler on its own: admission, chunk plans, continuous batching, aborts, pool accounting."""

from __future__ import annotations

import pytest

from tidal.config.model import ModelConfig
from tidal.config.pools import pool_sizes
from tidal.config.server_args import ServerArgs
from tidal.messages import AbortReq, Detokenize, GenerateReq, PromptAdmitted
from tidal.scheduler import Scheduler


@pytest.fixture
def make(tiny_checkpoint):
    config = ModelConfig.from_file(tiny_checkpoint)

    def build(**kw):
        args = ServerArgs(model=tiny_checkpoint, **kw)
        events = []
        sched = Scheduler(args, config, pool_sizes(args, config), events.append)
        return sched, events
    return build


def fake_run(sched, batch, token=7):
    sched.process_result(batch, [token if s.sample else -1 for s in batch.segments])


def req(rid, n, max_tokens=4, **kw):
    return GenerateReq(rid=rid, prompt_ids=list(range(1, n + 1)), max_tokens=max_tokens, **kw)


def test_plan_chunks_and_prefill_budget(make):
    sched, events = make(max_prefill_length=128, max_running_requests=4, disable_prefix_cache=True)
    sched.add_request(req("a", 320))
    sched.add_request(req("b", 30))
    batch = sched.schedule()
    admitted = {e.rid: e for e in events if isinstance(e, PromptAdmitted)}
    assert admitted["a"].plan.chunks == [[0, 128], [128, 256], [256, 320]]
    assert admitted["b"].plan.chunks == [[0, 30]]
    assert admitted["a"].plan.mode == "chunked" and admitted["a"].cached_tokens == 0
    assert admitted["a"].plan.checkpoints == []
    # Turn 1: only a's first chunk fits the 128-token budget.
    assert [(s.rid, s.start, len(s.token_ids)) for s in batch.segments] == [("a", 0, 128)]
    fake_run(sched, batch)
    batch = sched.schedule()
    assert [(s.rid, s.start, len(s.token_ids)) for s in batch.segments] == [("a", 128, 128)]
    fake_run(sched, batch)
    batch = sched.schedule()
    assert [(s.rid, s.start, len(s.token_ids), s.sample) for s in batch.segments] == [
        ("a", 256, 64, True), ("b", 0, 30, True)]
    fake_run(sched, batch)
    # Both decode together, every turn.
    batch = sched.schedule()
    assert [(s.rid, s.start, s.token_ids) for s in batch.segments] == [("a", 320, [7]), ("b", 30, [7])]


def test_prompt_forwards_end_on_multiples_of_64(make):
    """A limit that is not a multiple of 64 cuts forwards at the multiple below it (the GDN kernels'
    block), and the plan says so; the turn budget stays the limit."""
    sched, events = make(max_prefill_length=100, max_running_requests=4, disable_prefix_cache=True)
    sched.add_request(req("a", 250))
    sched.add_request(req("b", 30))
    batch = sched.schedule()
    plan = next(e for e in events if isinstance(e, PromptAdmitted) and e.rid == "a").plan
    assert plan.chunks == [[0, 64], [64, 128], [128, 192], [192, 250]]
    assert "forwards end on multiples of 64" in plan.reason
    assert [(s.rid, s.start, len(s.token_ids)) for s in batch.segments] == [("a", 0, 64), ("b", 0, 30)]


def test_layer_major_internal_chunks_end_on_multiples_of_64(make):
    sched, events = make(max_prefill_length=100, prefill_layer_major=True, moe_strategy="offload",
                         disable_prefix_cache=True)
    sched.add_request(req("a", 300))
    batch = sched.schedule()
    assert batch.mode == "layer_major" and batch.chunk_size == 64
    assert [(s.start, len(s.token_ids)) for s in batch.segments] == [(0, 300)]
    plan = next(e for e in events if isinstance(e, PromptAdmitted)).plan
    assert "internal chunks of 64" in plan.reason


def test_finish_by_length_and_eos_frees_everything(make):
    sched, events = make(max_running_requests=2)
    sched.add_request(req("a", 10, max_tokens=3))
    sched.add_request(req("b", 10, max_tokens=50))
    while sched.has_work():
        batch = sched.schedule()
        tokens = [248046 if s.rid == "b" and s.sample_index == 1 else 7 for s in batch.segments]
        sched.process_result(batch, [t if s.sample else -1 for t, s in zip(tokens, batch.segments, strict=True)])
    done = {e.rid: e for e in events if isinstance(e, Detokenize) and e.finished}
    assert done["a"].finish_reason == "length" and done["a"].usage.completion_tokens == 3
    assert done["b"].finish_reason == "stop" and done["b"].usage.completion_tokens == 2
    stats = sched.stats()
    assert stats.kv_pages_in_use == 0 and stats.state_slots_in_use == 0 and stats.running == 0


def test_ignore_eos_and_stop_token_ids(make):
    sched, events = make()
    sched.add_request(req("a", 5, max_tokens=3, ignore_eos=True))
    sched.add_request(req("b", 5, max_tokens=9, stop_token_ids=[7]))
    while sched.has_work():
        batch = sched.schedule()
        sched.process_result(batch, [248046 if s.rid == "a" else 7 for s in batch.segments])
    done = {e.rid: e for e in events if isinstance(e, Detokenize) and e.finished}
    assert done["a"].finish_reason == "length" and done["a"].usage.completion_tokens == 3
    assert done["b"].finish_reason == "stop" and done["b"].usage.completion_tokens == 1


def test_waits_for_capacity_then_runs(make):
    sched, events = make(max_running_requests=1)
    sched.add_request(req("a", 10, max_tokens=2))
    sched.add_request(req("b", 10, max_tokens=2))
    batch = sched.schedule()
    assert {s.rid for s in batch.segments} == {"a"}
    assert sched.stats().waiting == 1
    while sched.has_work():
        fake_run(sched, batch)
        batch = sched.schedule() if sched.has_work() else None
    assert sum(1 for e in events if isinstance(e, Detokenize) and e.finished) == 2


def test_never_fitting_request_is_rejected(make):
    sched, events = make(max_model_len=64)
    sched.add_request(req("a", 60, max_tokens=10))
    [err] = [e for e in events if isinstance(e, Detokenize)]
    assert err.finish_reason == "error" and "context length of 64" in err.error
    assert not sched.has_work()
    sched2, events2 = make(kv_pool_tokens=32, max_model_len=None)
    sched2.add_request(req("b", 40, max_tokens=4))
    assert "KV pages" in events2[0].error


def test_abort_is_idempotent_everywhere(make):
    sched, events = make(max_running_requests=1, max_prefill_length=8)
    sched.add_request(req("a", 20))
    sched.add_request(req("b", 20))
    batch = sched.schedule()  # a in flight, b waiting
    sched.abort("b")
    sched.abort("b")
    sched.abort("a")  # in flight: finishes when its result arrives
    assert sched.stats().state_slots_in_use == 1
    fake_run(sched, batch)
    sched.abort("a")
    sched.abort("never-existed")
    finished = [e for e in events if isinstance(e, Detokenize) and e.finished]
    assert sorted((e.rid, e.finish_reason) for e in finished) == [("a", "abort"), ("b", "abort")]
    stats = sched.stats()
    assert stats.kv_pages_in_use == 0 and stats.state_slots_in_use == 0 and not sched.has_work()


def test_slot_pool_refuses_a_double_free():
    from tidal.scheduler.pools import SlotPool

    pool = SlotPool(2, start=10)
    slot = pool.alloc()
    pool.free(slot)
    with pytest.raises(RuntimeError, match="freed but not held"):
        pool.free(slot)
    with pytest.raises(RuntimeError):
        pool.free(99)


def test_skip_special_tokens_reaches_the_detokenizer(tiny_checkpoint):
    """The scheduler loop forwards the request's skip_special_tokens in DetokenizeInit."""
    from tidal.messages import DetokenizeInit
    from tidal.scheduler.process import SchedulerLoop

    sent = []
    loop = object.__new__(SchedulerLoop)
    loop._out = sent  # the step's buffer for the detokenizer
    loop.scheduler = type("NoScheduler", (), {"add_request": staticmethod(lambda msg: None)})()
    loop.handle(GenerateReq(rid="x", prompt_ids=[1, 2, 3], max_tokens=2, skip_special_tokens=False))
    loop.handle(GenerateReq(rid="y", prompt_ids=[1, 2, 3], max_tokens=2))
    assert [(m.rid, m.skip_special_tokens) for m in sent if isinstance(m, DetokenizeInit)] == \
        [("x", False), ("y", True)]


def _loop(make, overlap: bool = False, **flags):
    """A SchedulerLoop around a real Scheduler, with its sockets replaced by lists."""
    from tidal.scheduler.process import SchedulerLoop

    sched, events = make(**{"disable_prefix_cache": True, **flags})
    loop = object.__new__(SchedulerLoop)
    loop.args, loop.scheduler, loop.in_flight, loop.running, loop.failed = sched.args, sched, None, True, False
    loop.ahead, loop.overlap = None, overlap
    sent_detok, sent_exec = [], []
    loop.to_detok = type("Sink", (), {"send": staticmethod(sent_detok.append)})()
    loop.to_executors = [type("Sink", (), {"send": staticmethod(sent_exec.append)})()]
    loop._last_stats, loop._last_stats_time = None, 0.0
    loop._out = events  # the scheduler's emit target is the loop's per-step buffer
    sched.hand_out = loop._flush
    loop.sent_detok = sent_detok
    return loop, sent_detok, sent_exec


def _emitted(sent_detok) -> list:
    """Every event the loop sent to the detokenizer, in order (unpacking its per-step messages)."""
    from tidal.messages import StepOutput

    return [e for m in sent_detok if isinstance(m, StepOutput) for e in m.events]


def _feed(loop, msgs):
    """One scheduler-loop step that receives ``msgs``."""
    def drain():
        rest = list(msgs)
        msgs.clear()
        return rest
    loop.inbound = type("Inbox", (), {"recv": staticmethod(lambda timeout_ms: msgs.pop(0) if msgs else None),
                                      "drain": staticmethod(drain)})()
    loop.step()


def test_a_failure_in_result_handling_ends_every_request(make, monkeypatch):
    from tidal.messages import BatchResult

    loop, events, sent = _loop(make)
    _feed(loop, [req("a", 10), req("b", 12)])
    batch = sent[-1]
    assert loop.in_flight is batch
    monkeypatch.setattr(loop.scheduler, "process_result", lambda *a: 1 / 0)
    _feed(loop, [BatchResult(batch_id=batch.batch_id, token_ids=[7] * len(batch.segments))])
    ends = {e.rid: e for e in _emitted(events) if isinstance(e, Detokenize) and e.finished}
    assert set(ends) == {"a", "b"} and all(e.finish_reason == "error" for e in ends.values())
    stats = loop.scheduler.stats()
    assert stats.running == 0 and stats.kv_pages_in_use == 0 and stats.state_slots_in_use == 0
    assert loop.in_flight is None and not loop.scheduler.has_work()


def test_one_message_per_step_to_the_detokenizer(make):
    from tidal.messages import BatchResult, StepOutput

    loop, events, sent = _loop(make)
    _feed(loop, [req("a", 10), req("b", 12), req("c", 9)])
    batch = sent[-1]
    outputs = [m for m in loop.sent_detok if isinstance(m, StepOutput)]
    # the step that admitted them: three inits and three admissions, one message
    assert len(outputs) == 1 and len(outputs[0].events) == 6
    loop.sent_detok.clear()
    _feed(loop, [BatchResult(batch_id=batch.batch_id, token_ids=[7] * len(batch.segments))])
    outputs = [m for m in loop.sent_detok if isinstance(m, StepOutput)]
    assert len(outputs) == 1 and sorted(e.rid for e in outputs[0].events) == ["a", "b", "c"]


def test_a_results_tokens_go_out_before_the_next_batch(make):
    """The step that takes a batch's result sends its tokens to the detokenizer before it schedules and sends
    the next batch (the decodes), so a first text does not wait for the next batch's scheduling."""
    from tidal.messages import BatchResult, StepOutput

    loop, events, sent = _loop(make)
    order: list[str] = []
    detok, execs = loop.to_detok.send, loop.to_executors[0].send
    loop.to_detok = type("Sink", (), {"send": staticmethod(lambda m: (order.append(type(m).__name__), detok(m)))})()
    loop.to_executors = [type("Sink", (), {"send": staticmethod(lambda m: (order.append("Batch"), execs(m)))})()]
    _feed(loop, [req("a", 10)])
    batch = sent[-1]
    order.clear()
    _feed(loop, [BatchResult(batch_id=batch.batch_id, token_ids=[7])])
    outputs = [m for m in loop.sent_detok if isinstance(m, StepOutput)]
    assert any(e.rid == "a" and e.token_ids == [7] for e in outputs[-1].events)
    steps = [o for o in order if o in ("StepOutput", "Batch")]
    assert steps == ["StepOutput", "Batch"], order  # the token first, then a's first decode
    assert len(sent[-1].segments) == 1 and sent[-1].segments[0].token_ids == [7]


def test_a_stale_result_leaves_the_batch_in_flight(make):
    from tidal.messages import BatchResult

    loop, events, sent = _loop(make)
    _feed(loop, [req("a", 10)])
    batch = sent[-1]
    _feed(loop, [BatchResult(batch_id=batch.batch_id + 100, token_ids=[7])])
    assert loop.in_flight is batch  # still waiting for its own result
    _feed(loop, [BatchResult(batch_id=batch.batch_id, token_ids=[7])])
    assert loop.in_flight is not batch
    assert any(isinstance(e, Detokenize) and e.rid == "a" and e.token_ids == [7] for e in _emitted(events))


def _answer(batch, tokens: dict[str, int]):
    from tidal.messages import BatchResult

    return BatchResult(batch_id=batch.batch_id, token_ids=[tokens[s.rid] if s.sample else -1 for s in batch.segments])


@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "prefix-cache"])
def test_overlap_sends_the_next_batch_before_the_result(make, cache):
    """With overlap the loop sends batch N+1 while N runs: the decodes of requests that N samples for
    carry token -1. A request that N ends (stop token, max_tokens, abort) gets no token from N+1's
    answer, and every page and slot comes back."""
    loop, events, sent = _loop(make, overlap=True, disable_prefix_cache=not cache)
    eos = loop.scheduler.config.eos_token_ids[0]
    _feed(loop, [req("a", 10, max_tokens=6), req("b", 12, max_tokens=3), req("c", 9, max_tokens=1),
                 req("d", 11, max_tokens=6)])
    assert len(sent) == 2
    first, ahead = sent
    assert all(len(s.token_ids) > 1 and s.sample for s in first.segments)
    # c ends with its first token (max_tokens 1): nothing ahead for it
    assert {s.rid: (s.start, s.token_ids, s.sample_index) for s in ahead.segments} == \
        {"a": (10, [-1], 1), "b": (12, [-1], 1), "d": (11, [-1], 1)}
    assert loop.in_flight is first and loop.ahead is ahead
    _feed(loop, [_answer(first, {"a": 7, "b": 7, "c": 7, "d": 7})])
    assert loop.in_flight is ahead and len(sent) == 3  # the batch after, sent before ahead's answer
    third = sent[2]
    assert {s.rid: s.start for s in third.segments} == {"a": 11, "b": 13, "d": 12}
    _feed(loop, [AbortReq(rid="d"), _answer(ahead, {"a": eos, "b": 8, "d": 8})])  # a stops, d is aborted
    assert len(sent) == 3  # b's third token is its last: nothing ahead of it
    _feed(loop, [_answer(third, {"a": 99, "b": 9, "d": 99})])  # a and d ended: dropped
    while sent[-1] is not third and loop.in_flight is not None:
        batch = loop.in_flight
        _feed(loop, [_answer(batch, {s.rid: 5 for s in batch.segments})])
    got: dict[str, list[int]] = {}
    reasons = {}
    for e in _emitted(events):
        if isinstance(e, Detokenize):
            got.setdefault(e.rid, []).extend(e.token_ids)
            if e.finished:
                reasons[e.rid] = e.finish_reason
    assert got == {"a": [7, eos], "b": [7, 8, 9], "c": [7], "d": [7]}  # an abort drops the token in flight
    assert reasons == {"a": "stop", "b": "length", "c": "length", "d": "abort"}
    assert 99 not in sum(got.values(), [])
    assert loop.in_flight is None and loop.ahead is None and not loop.scheduler.has_work()
    stats = loop.scheduler.stats()
    assert stats.running == 0 and stats.kv_pages_in_use == 0 and stats.state_slots_in_use == 0


def test_prompts_wait_for_requests_still_being_tokenized(make, monkeypatch):
    """While the frontend tokenizes other bodies, a new prompt waits for them (one forward for the burst): until
    the count drops to 0, the prompts fill --max-prefill-length, or --batch-wait-ms passes since the first
    arrived. Decode steps and prompts under way never wait."""
    from tidal.scheduler import scheduler as module

    now = [100.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: now[0])
    sched, _ = make(max_prefill_length=64, disable_prefix_cache=True, batch_wait_ms=10)
    sched.tokenizing = 2
    sched.add_request(req("a", 20))
    assert sched.hold_until() == pytest.approx(100.010)
    assert sched.schedule() is None  # admitted, its prompt held
    now[0] += 0.004
    sched.add_request(req("b", 20))
    assert sched.schedule() is None and sched.hold_until() == pytest.approx(100.010)  # from a's arrival
    sched.tokenizing = 0
    batch = sched.schedule()
    assert [s.rid for s in batch.segments] == ["a", "b"]
    fake_run(sched, batch)
    sched.tokenizing = 1
    sched.add_request(req("c", 30))
    batch = sched.schedule()  # a and b decode; c waits
    assert [(s.rid, len(s.token_ids)) for s in batch.segments] == [("a", 1), ("b", 1)]
    fake_run(sched, batch)
    now[0] += 0.011  # --batch-wait-ms after c arrived
    assert sched.hold_until() is None
    assert [s.rid for s in sched.schedule().segments] == ["a", "b", "c"]

    sched, _ = make(max_prefill_length=64, disable_prefix_cache=True, batch_wait_ms=10)
    sched.tokenizing = 5
    sched.add_request(req("d", 40))
    assert sched.schedule() is None
    sched.add_request(req("e", 24))  # 64 prompt tokens fill a forward: no more waiting
    assert [s.rid for s in sched.schedule().segments] == ["d", "e"]

    sched, _ = make(max_prefill_length=64, disable_prefix_cache=True, batch_wait_ms=10)
    sched.add_request(req("f", 100))  # two chunks
    fake_run(sched, sched.schedule())
    sched.tokenizing = 1
    sched.add_request(req("g", 10))
    assert sched.hold_until() is None  # f's second chunk goes on, g with it
    assert [(s.rid, s.start) for s in sched.schedule().segments] == [("f", 64), ("g", 0)]

    sched, _ = make(max_prefill_length=64, disable_prefix_cache=True, batch_wait_ms=0)
    sched.tokenizing = 3
    sched.add_request(req("h", 10))
    assert sched.schedule() is not None  # --batch-wait-ms 0: never waits


def test_loop_waits_for_tokenized_requests_then_batches_them(make):
    """Through the scheduler loop: the frontend's counts hold the first prompt of a burst (no batch goes out)
    until the last body's request arrives; then both prompts leave in one batch."""
    from tidal.messages import Tokenizing

    loop, events, sent = _loop(make, overlap=True, batch_wait_ms=1000)
    _feed(loop, [Tokenizing(count=1), Tokenizing(count=2), req("a", 10), Tokenizing(count=1)])
    assert sent == [] and loop.in_flight is None
    _feed(loop, [req("b", 12), Tokenizing(count=0)])
    assert len(sent) == 2  # the prompts, then their decodes ahead
    assert [(s.rid, len(s.token_ids)) for s in sent[0].segments] == [("a", 10), ("b", 12)]


def test_tokens_go_out_before_the_forward_is_indexed(make):
    """``hand_out`` (the serving loop's flush) runs once a result's tokens are emitted and before the pages and
    checkpoints the forward wrote are indexed; a request the token ends is indexed before it finishes, so what it
    computed is cached all the same."""
    sched, events = make(disable_prefix_cache=False)
    seen = []
    sched.hand_out = lambda: seen.append(([(e.rid, e.token_ids) for e in events if isinstance(e, Detokenize)],
                                          len(sched.cache.page_of)))
    sched.add_request(req("a", 200, max_tokens=4))
    sched.add_request(GenerateReq(rid="b", prompt_ids=list(range(1000, 1100)), max_tokens=1))
    batch = sched.schedule()
    fake_run(sched, batch)
    page = sched.sizes.page_size
    (tokens, cached_then), = seen
    assert ("a", [7]) in tokens and ("b", [7]) in tokens
    assert cached_then == 100 // page  # b's pages (indexed as it finished), not a's yet
    assert len(sched.cache.page_of) == 100 // page + 200 // page
