"""A layer-major prefill over several scheduling turns while other requests decode (``--layer-major-turns``).

Every request's greedy ids must equal the same request run alone; the conversations must take steps
between the prefill's turns; aborts and failures between turns must leave nothing behind.
"""

from __future__ import annotations

import math

import pytest
import torch

from tidal import LLM
from tidal.executor.layer_major import LayerMajorPrefill
from tidal.messages import Detokenize, GenerateReq, PromptAdmitted, SamplingParams

CHUNK = 64
OFFLOAD = dict(moe_strategy="offload", moe_cache_slots=4, max_prefill_length=CHUNK, prefill_layer_major=True)
CONVERSATIONS = 3
TOKENS = 40  # each conversation's output: enough to decode through the whole prefill


def ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 248000, (n,), generator=gen).tolist()


LONG = ids(300, 5)
LONG_AGAIN = LONG[:256] + ids(100, 6)  # a prefix-cache hit on LONG (256 tokens: 4 checkpoint-aligned pages)
CHATS = [ids(12 + 5 * i, 10 + i) for i in range(CONVERSATIONS)]


@pytest.fixture(scope="module")
def alone(tiny_checkpoint):
    """Each prompt run by itself (resident experts, chunked): the ids every arm must reproduce."""
    llm = LLM(tiny_checkpoint, max_prefill_length=CHUNK)
    out = {"long": llm.generate([LONG], max_tokens=8, ignore_eos=True)[0],
           "again": llm.generate([LONG_AGAIN], max_tokens=8, ignore_eos=True)[0]}
    for i, chat in enumerate(CHATS):
        out[f"chat{i}"] = llm.generate([chat], max_tokens=TOKENS, ignore_eos=True)[0]
    return out


class Driver:
    """The scheduler and executor of an ``LLM`` stepped by hand, as the server's loops run them (a failed
    batch fails its requests, not the loop); records every batch and every token."""

    def __init__(self, llm: LLM):
        self.llm, self.scheduler, self.runner = llm, llm.scheduler, llm.runner
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.admitted: dict[str, PromptAdmitted] = {}
        self.batches: list[tuple[str, list[str]]] = []  # (kind, rids) in order
        self.emitted: list[tuple[int, str]] = []  # (batch index, rid) of each token
        self.turn_pairs: list[int] = []  # (layer, internal chunk) pairs of each layer-major turn

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.scheduler.add_request(GenerateReq(rid=rid, prompt_ids=list(prompt), max_tokens=max_tokens,
                                               sampling=SamplingParams(), ignore_eos=True))
        self.tokens[rid] = []

    def step(self) -> bool:
        batch = self.scheduler.schedule()
        if batch is None:
            return False
        kind = "turn" if batch.mode == "layer_major" else "batch"
        self.batches.append((kind, [s.rid for s in batch.segments]))
        if kind == "turn" and not batch.drop:
            self.turn_pairs.append(batch.layer_chunks)
        try:
            out = self.runner.execute(batch)
        except Exception as e:
            self.scheduler.fail_batch(batch, f"{type(e).__name__}: {e}")
        else:
            self.scheduler.process_result(batch, out.token_ids, out.logprobs, out.prompt_logprobs)
        for event in self.llm._events:
            if isinstance(event, PromptAdmitted):
                self.admitted[event.rid] = event
            elif isinstance(event, Detokenize):
                self.tokens[event.rid] += event.token_ids
                self.emitted += [(len(self.batches) - 1, event.rid)] * len(event.token_ids)
                if event.finished:
                    self.finish[event.rid] = event.finish_reason
        self.llm._events.clear()
        return True

    def until(self, done, limit: int = 10_000) -> None:
        for _ in range(limit):
            if done() or not self.step():
                return
        raise AssertionError("the requests did not finish")

    def run_all(self) -> None:
        self.until(lambda: not self.scheduler.has_work())

    def turns(self) -> list[int]:
        return [i for i, (kind, _) in enumerate(self.batches) if kind == "turn"]

    def idle(self) -> None:
        stats = self.scheduler.stats()
        cached = stats.kv_pages_cached
        assert stats.running == stats.waiting == 0
        assert stats.kv_pages_in_use == 0 and stats.state_slots_in_use == 0, stats
        assert self.scheduler.pages.total - self.scheduler.pages.num_free == cached
        assert self.runner.layer_major is None
        assert not self.runner.expert_store.active


def start_conversations(d: Driver) -> None:
    for i, chat in enumerate(CHATS):
        d.add(f"chat{i}", chat, TOKENS)
    d.until(lambda: all(len(d.tokens[f"chat{i}"]) >= 2 for i in range(CONVERSATIONS)))


@pytest.mark.parametrize("coalesce", [False, True], ids=["align", "coalesce"])
@pytest.mark.parametrize("turns,slots", [(1, 4), (4, 4), (3, 4), (9, 16)],
                         ids=["one-turn", "layer-a-turn", "uneven-turns", "layer-a-turn-cache16"])
def test_ids_equal_alone_cold_and_after_a_hit_with_decodes_between_turns(tiny_checkpoint, alone, turns, slots,
                                                                         coalesce):
    """With 4 cache slots the conversations' decodes (5 experts a layer) take layers whole: those the prefill's
    buffers hold as they are, the others into the buffers, which the prefill copies again; with 16 they go
    through the cache (but for the buffered layers), which keeps what the prefill's whole-layer copies will take
    from it."""
    llm = LLM(tiny_checkpoint, prefill_coalesce=coalesce, layer_major_turns=turns, **{**OFFLOAD,
                                                                                       "moe_cache_slots": slots})
    d = Driver(llm)
    d.add("long", LONG, 8)  # alone: layer-major whatever the turns
    d.run_all()
    assert d.tokens["long"] == alone["long"]
    assert d.admitted["long"].plan.mode == "layer_major"
    layers = llm.config.num_hidden_layers
    want_turns = min(turns, layers)  # at most one a layer
    assert len(d.turns()) == want_turns
    assert d.admitted["long"].plan.turns == want_turns
    # Each turn ran whole layers over every internal chunk, the layers shared out evenly.
    chunks = math.ceil(len(LONG) / CHUNK)
    per_turn = sorted(pairs // chunks for pairs in d.turn_pairs)
    assert sum(per_turn) == layers and per_turn[-1] - per_turn[0] <= 1
    assert all(pairs % chunks == 0 for pairs in d.turn_pairs)
    if turns > 1:  # every state the prefill wrote (its checkpoints' included) equals one turn's, bit for bit
        one = LLM(tiny_checkpoint, prefill_coalesce=coalesce, layer_major_turns=1,
                  **{**OFFLOAD, "moe_cache_slots": slots})
        assert one.generate([LONG], max_tokens=8, ignore_eos=True)[0] == alone["long"]
        for got, want in zip(llm.runner.states._tensors(), one.runner.states._tensors(), strict=True):
            assert torch.equal(got, want)

    start_conversations(d)
    first = len(d.batches)
    d.add("again", LONG_AGAIN, 8)
    d.run_all()
    assert d.tokens["again"] == alone["again"]
    for i in range(CONVERSATIONS):
        assert d.tokens[f"chat{i}"] == alone[f"chat{i}"], i
    admitted = d.admitted["again"]
    assert admitted.cached_tokens == 256
    if turns == 1:  # one turn runs alone: with conversations decoding the prompt runs chunked
        assert admitted.plan.mode == "chunked" and "--layer-major-turns 1" in admitted.plan.reason
        return
    assert admitted.plan.mode == "layer_major" and admitted.plan.turns == want_turns
    turns = [t for t in d.turns() if t >= first]
    assert len(turns) == want_turns
    assert llm.scheduler.counters["layer_major_turns"] == len(d.turns())
    # Between consecutive turns every conversation took a decode step (they all decode through the prefill).
    between = [sum(1 for b, rid in d.emitted if lo < b < hi and rid.startswith("chat"))
               for lo, hi in zip(turns, turns[1:], strict=False)]
    assert between and all(n == CONVERSATIONS for n in between), between
    # No decode ran inside a turn, and the long prompt's other segments ran in no turn.
    assert all(rids == ["again"] for kind, rids in d.batches[first:] if kind == "turn")
    d.idle()


def test_decodes_between_turns_take_the_buffered_layers_and_copy_first(tiny_checkpoint, alone):
    """A turn that ends with a layer leaves the layer after next uncopied until the next turn begins, so the
    decode steps between them queue their expert copies ahead of it; those steps take the layers the buffers
    hold whole (copying none of their experts) and the others through the cache."""
    llm = LLM(tiny_checkpoint, layer_major_turns=4, **{**OFFLOAD, "moe_cache_slots": 6})  # a layer a turn
    store = llm.runner.expert_store
    d = Driver(llm)
    start_conversations(d)
    d.add("long", LONG, 8)
    before = store.stats()
    d.until(lambda: len(d.turns()) == 1)  # the first turn: every chunk of the first layer

    def delta(key: str, since: dict) -> list[int]:
        return [a - b for a, b in zip(store.stats()[key], since[key], strict=True)]

    assert delta("expert_layer_streams", before) == [1, 1, 0, 0]
    between = store.stats()
    d.step()  # the conversations' decode step
    assert d.batches[-1][0] == "batch" and len(d.batches[-1][1]) == CONVERSATIONS
    assert delta("expert_loads", between)[:2] == [0, 0]  # both buffered layers served whole
    assert delta("expert_layer_streams", between) == [0, 0, 0, 0]
    d.step()  # the second turn starts the third layer's copy
    assert d.batches[-1][0] == "turn"
    assert delta("expert_layer_streams", between) == [0, 0, 1, 0]
    d.run_all()
    assert d.tokens["long"] == alone["long"]
    for i in range(CONVERSATIONS):
        assert d.tokens[f"chat{i}"] == alone[f"chat{i}"], i
    d.idle()


@pytest.mark.parametrize("who", ["long", "chat1"])
def test_an_abort_between_turns_frees_everything(tiny_checkpoint, alone, who):
    llm = LLM(tiny_checkpoint, layer_major_turns=4, **OFFLOAD)
    d = Driver(llm)
    start_conversations(d)
    d.add("long", LONG, 8)
    d.until(lambda: len(d.turns()) >= 3)
    assert d.runner.layer_major is not None  # held between turns
    llm.scheduler.abort(who)
    d.run_all()
    assert d.finish[who] == "abort"
    for rid in ["long"] + [f"chat{i}" for i in range(CONVERSATIONS)]:
        if rid != who:
            assert d.tokens[rid] == alone[rid], rid
    d.idle()
    # The executor let the prefill go at once: a drop turn, before any other batch, when the prompt was aborted.
    if who == "long":
        after = d.batches[d.turns()[2] + 1:]
        assert ("turn", []) in after


def test_a_failing_turn_fails_only_its_request(tiny_checkpoint, alone, monkeypatch):
    llm = LLM(tiny_checkpoint, layer_major_turns=4, **OFFLOAD)
    d = Driver(llm)
    start_conversations(d)
    run, calls = LayerMajorPrefill.run, []

    def failing(self, pairs):
        calls.append(pairs)
        if len(calls) == 3:
            raise RuntimeError("injected failure in a middle turn")
        return run(self, pairs)

    monkeypatch.setattr(LayerMajorPrefill, "run", failing)
    d.add("long", LONG, 8)
    d.run_all()
    assert d.finish["long"] == "error" and d.tokens["long"] == []
    for i in range(CONVERSATIONS):
        assert d.tokens[f"chat{i}"] == alone[f"chat{i}"]
    d.idle()
    d.add("long2", LONG, 8)  # and serves on
    d.run_all()
    assert d.tokens["long2"] == alone["long"]
    d.idle()
