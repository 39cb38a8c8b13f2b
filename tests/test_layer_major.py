"""Layer-major long prefill with experts streamed from host memory, and the PLE table backends.

Compared with independent runs: the resident model (every expert on the device), chunked prefill,
and a fresh model scoring the same tokens.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager

import aiohttp
import pytest
import torch
from server_harness import Server, Tap

from tidal import LLM
from tidal.config.server_args import ServerArgs
from tidal.executor.offload.experts import ExpertStore
from tidal.executor.offload.ple_table import PinnedTable, RowsAhead
from tidal.kernels.moe import fused_experts_ref
from tidal.messages import Batch, SegmentSpec
from tidal.scheduler.layer_major import layer_major_decision

CHUNK = 64
OFFLOAD = dict(moe_strategy="offload", moe_cache_slots=4, max_prefill_length=CHUNK)


def ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 248000, (n,), generator=gen).tolist()


PROMPT = ids(200, 1)
CONTINUATION = PROMPT + ids(200, 2)


# ---- eligibility -------------------------------------------------------------------------------
def _args(**kw) -> ServerArgs:
    base = dict(prefill_layer_major=True, moe_strategy="offload", max_prefill_length=4096)
    return ServerArgs(**{**base, **kw})


def test_default_off():
    assert ServerArgs().prefill_layer_major is False
    ok, why = layer_major_decision(ServerArgs(moe_strategy="offload"), 10_000, 0, False)
    assert not ok and why == "layer-major off"


@pytest.mark.parametrize("kw,new,others,eligible,words", [
    ({}, 4096, 0, False, "within --max-prefill-length"),    # == --max-prefill-length: chunked
    ({}, 4097, 0, True, "layer-major"),                     # one more: layer-major
    ({}, 32768, 0, True, "layer-major"),                    # at the cap
    ({}, 32769, 0, False, "--layer-major-max-tokens"),      # over the cap
    ({"ple_backend": "disk"}, 8000, 0, False, "disk"),
    ({"ple_backend": "pinned"}, 8000, 0, True, "layer-major"),
    ({"layer_major_turns": 1}, 8000, 1, False, "other request"),  # one turn: a second request running
    ({}, 8000, 1, True, "2 turns"),                         # over turns: others decode meanwhile
    ({"moe_strategy": "resident"}, 8000, 0, False, "offload"),
    ({"tp": 2}, 8000, 0, False, "--tp 2"),
])
def test_eligibility_boundaries(kw, new, others, eligible, words):
    ok, why = layer_major_decision(_args(**kw), new, others, False)
    assert ok is eligible and words in why


def test_turns_beyond_the_layers_are_capped_in_the_decision():
    # More turns than decoder layers run one a layer: the reason gives that count, and one turn runs alone.
    ok, why = layer_major_decision(_args(layer_major_turns=4), 8000, 0, False, layers=3)
    assert ok and why.endswith(", 3 turns")
    ok, why = layer_major_decision(_args(layer_major_turns=4), 8000, 0, False, layers=1)
    assert ok and why.endswith(", one turn")
    ok, why = layer_major_decision(_args(layer_major_turns=4), 8000, 1, False, layers=1)
    assert not ok and "one turn runs alone" in why


def test_scoring_request_is_not_layer_major():
    ok, why = layer_major_decision(_args(), 8000, 0, True)
    assert not ok and "scoring" in why


@contextmanager
def one_turn(store: ExpertStore):
    """A layer-major prefill of one turn, as the executor runs it."""
    store.begin()
    try:
        with store.whole_layers():
            yield
    finally:
        store.end()


# ---- greedy ids and expert streaming -------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """Resident experts, chunked: the ids every other arm must reproduce."""
    llm = LLM(tiny_checkpoint, max_prefill_length=CHUNK)
    return llm.generate([PROMPT], max_tokens=8, ignore_eos=True)[0], \
        llm.generate([CONTINUATION], max_tokens=8, ignore_eos=True)[0]


@pytest.mark.parametrize("coalesce", [False, True], ids=["align", "coalesce"])
@pytest.mark.parametrize("layer_major", [False, True], ids=["chunked", "layer-major"])
def test_same_ids_cold_and_after_a_prefix_hit(tiny_checkpoint, reference, layer_major, coalesce):
    llm = LLM(tiny_checkpoint, prefill_layer_major=layer_major, prefill_coalesce=coalesce, **OFFLOAD)
    admitted = []
    llm.scheduler.emit = _recording(llm, admitted)
    cold = llm.generate([PROMPT], max_tokens=8, ignore_eos=True)[0]
    warm = llm.generate([CONTINUATION], max_tokens=8, ignore_eos=True)[0]
    assert (cold, warm) == reference
    assert [a.cached_tokens for a in admitted] == [0, 192]
    assert [a.plan.mode for a in admitted] == ["layer_major" if layer_major else "chunked"] * 2
    if layer_major:  # one forward takes every new token, the checkpoint exported from inside it
        assert [a.plan.chunks for a in admitted] == [[[0, 200]], [[192, 400]]]
        assert all("tail coalesced" in a.plan.reason for a in admitted)


def _recording(llm: LLM, admitted: list):
    from tidal.messages import PromptAdmitted

    emit = llm.scheduler.emit

    def record(event):
        if isinstance(event, PromptAdmitted):
            admitted.append(event)
        emit(event)
    return record


@pytest.mark.parametrize("layer_major,coalesce,expected", [(True, True, 1), (True, False, 1), (False, True, 4)],
                         ids=["layer-major", "layer-major-align", "chunked"])
def test_each_layer_streams_once_per_layer_major_prefill_and_once_per_chunk(tiny_checkpoint, layer_major, coalesce,
                                                                             expected):
    """200 new tokens, chunks of 64, coalesced (one planned forward): 4 chunks. Sampling one token
    routes to 2 of 8 experts, which the 4-slot cache serves without streaming the layer. Layer-major
    coalesces without the flag too: no tail forward streams the layers a second time."""
    llm = LLM(tiny_checkpoint, prefill_layer_major=layer_major, prefill_coalesce=coalesce, **OFFLOAD)
    llm.generate([PROMPT], max_tokens=1, ignore_eos=True)
    stats = llm.runner.expert_store.stats()
    layers = llm.config.num_hidden_layers
    assert stats["expert_layer_streams"] == [expected] * layers
    experts = llm.config.num_experts
    assert stats["expert_loads"] == [expected * experts] * layers
    one = llm.runner.expert_store.expert_bytes
    assert stats["expert_bytes"] == [expected * experts * one] * layers


def test_start_copies_the_first_two_layers():
    """``start`` copies the first two MoE layers (before any MoE call), one into each
    buffer; the first layer's MoE call takes its copy, and once its calls are all queued the third layer
    goes into that buffer: one stream per layer."""
    g = torch.Generator().manual_seed(0)
    gate_up = {i: torch.randn(4, 8, 8, generator=g) for i in (1, 3, 5)}
    down = {i: torch.randn(4, 8, 4, generator=g) for i in (1, 3, 5)}
    store = ExpertStore(gate_up, down, num_slots=2, device="cpu")
    x = torch.randn(5, 8, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3], [3, 1]])
    weights = torch.full((5, 2), 0.5)
    with one_turn(store):
        assert store.stats()["expert_layer_streams"] == [0, 0, 0]
        store.start()
        assert store.stats()["expert_layer_streams"] == [1, 1, 0]
        out = store.forward(1, x, ids, weights)
        assert store.stats()["expert_layer_streams"] == [1, 1, 0]
        store.finished(1)
        assert store.stats()["expert_layer_streams"] == [1, 1, 1]
        out3 = store.forward(3, x, ids, weights)
    assert torch.allclose(out3, fused_experts_ref(x, ids, weights, gate_up[3], down[3]), atol=1e-5)
    assert torch.allclose(out, fused_experts_ref(x, ids, weights, gate_up[1], down[1]), atol=1e-5)


def _store(device: str, slots: int = 2):
    g = torch.Generator().manual_seed(0)
    gate_up = {i: torch.randn(4, 8, 8, generator=g) for i in (1, 3, 5)}
    down = {i: torch.randn(4, 8, 4, generator=g) for i in (1, 3, 5)}
    return ExpertStore(gate_up, down, num_slots=slots, device=device), gate_up, down


def test_finished_layer_starts_the_layer_after_next():
    """Layer-major: when a layer's last MoE call is queued its buffer takes the layer after next, so
    every later layer's copy is already under way when its first MoE call comes."""
    store, gate_up, down = _store("cpu")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 8, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3], [3, 1]])
    weights = torch.full((5, 2), 0.5)
    with one_turn(store):
        out = {1: store.forward(1, x, ids, weights)}
        assert store.stats()["expert_layer_streams"] == [1, 1, 0]
        store.finished(1)
        assert store.stats()["expert_layer_streams"] == [1, 1, 1]
        for layer in (3, 5):
            out[layer] = store.forward(layer, x, ids, weights)
            store.finished(layer)
    assert store.stats()["expert_layer_streams"] == [1, 1, 1]
    for layer in (1, 3, 5):
        assert torch.allclose(out[layer], fused_experts_ref(x, ids, weights, gate_up[layer], down[layer]), atol=1e-5)
    store.finished(1)  # outside layer-major: nothing moves
    assert store.stats()["expert_layer_streams"] == [1, 1, 1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_layer_streams_take_cached_experts_from_their_slots(device):
    """A whole-layer copy takes the experts the cache holds from their device slots and copies only the
    others from host memory; the counters count host copies, and the layer computes as from the host."""
    store, gate_up, down = _store(device, slots=3)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 8, generator=g).to(device)
    weights = torch.full((5, 2), 0.5, device=device)
    few = torch.tensor([[0, 2]] * 5, device=device)  # decodes: experts 0 and 2 of layer 3 into the cache
    store.forward(3, x, few, weights)
    assert store.stats()["expert_loads"] == [0, 2, 0]
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3], [3, 1]], device=device)
    with one_turn(store):
        for layer in (1, 3, 5):
            got = store.forward(layer, x, ids, weights)
            want = fused_experts_ref(x.cpu(), ids.cpu(), weights.cpu(), gate_up[layer], down[layer])
            assert torch.allclose(got.cpu(), want, atol=1e-5), layer
    one = store.expert_bytes
    assert store.stats() == {"expert_loads": [4, 2 + 2, 4], "expert_bytes": [4 * one, 4 * one, 4 * one],
                             "expert_layer_streams": [1, 1, 1]}


def test_decode_uses_the_expert_cache(tiny_checkpoint, reference):
    llm = LLM(tiny_checkpoint, **OFFLOAD)
    assert llm.generate([PROMPT], max_tokens=8, ignore_eos=True)[0] == reference[0]
    stats = llm.runner.expert_store.stats()
    # Four prefill chunks stream every layer; seven single-token decodes copy single experts only.
    assert stats["expert_layer_streams"] == [4] * llm.config.num_hidden_layers
    assert all(loads > 4 * llm.config.num_experts for loads in stats["expert_loads"])


def test_context_restored_after_an_exception_in_a_middle_layer(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, prefill_layer_major=True, **OFFLOAD)
    runner = llm.runner
    layer = runner.model.model.layers[2]
    original = layer.before_moe
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # layer 2, second internal chunk
            raise RuntimeError("injected")
        return original(*args, **kwargs)

    layer.before_moe = failing
    pages = list(range(16))
    batch = Batch(batch_id=1, mode="layer_major", chunk_size=CHUNK, segments=[
        SegmentSpec(rid="r", slot=0, start=0, token_ids=PROMPT[:150], pages=pages, sample=True)])
    with pytest.raises(RuntimeError, match="injected"):
        runner.execute(batch)
    layer.before_moe = original
    assert runner.expert_store._whole_layers is False
    # The runner serves on: the same tokens in another slot score like a fresh model.
    out = runner.execute(Batch(batch_id=2, segments=[
        SegmentSpec(rid="s", slot=1, start=0, token_ids=PROMPT[:150], pages=list(range(20, 36)),
                    want_logits=True)]))
    fresh = LLM(tiny_checkpoint).score(PROMPT[:150])
    assert (out.logits[0] - fresh).abs().max().item() <= 1e-4


def test_layer_major_batch_equals_chunked_logits(tiny_checkpoint):
    """Runner level, with internal checkpoints at, inside and between internal chunks: the sampled
    token and every exported state equal the chunked run's."""
    def run(mode: str):
        llm = LLM(tiny_checkpoint, **OFFLOAD)
        spec = SegmentSpec(rid="r", slot=0, start=0, token_ids=PROMPT[:190], pages=list(range(12)), sample=True,
                           exports=[[64, 10], [100, 11], [190, 12]])
        out = llm.runner.execute(Batch(batch_id=1, mode=mode, chunk_size=CHUNK, segments=[spec]))
        states = llm.runner.states
        return out.token_ids, [torch.cat([t[s].flatten().float() for t in states._tensors()]) for s in (0, 10, 11, 12)]

    ids_lm, states_lm = run("layer_major")
    ids_ch, states_ch = run("chunked")
    assert ids_lm == ids_ch
    for a, b in zip(states_lm, states_ch, strict=True):
        assert (a - b).abs().max().item() <= 1e-4


# ---- PLE backends --------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["pinned", "disk"])
def test_ple_backends_give_the_same_ids(tiny_checkpoint, reference, backend):
    llm = LLM(tiny_checkpoint, ple_backend=backend, max_prefill_length=CHUNK)
    assert llm.generate([PROMPT], max_tokens=8, ignore_eos=True)[0] == reference[0]


def test_layer_major_gathers_pinned_ple_rows_ahead(tiny_checkpoint, reference, monkeypatch):
    """With pinned tables a layer-major prefill gathers each table's rows once for the whole prompt (on a
    worker thread) instead of once per internal chunk; the ids stay those of the resident reference."""
    llm = LLM(tiny_checkpoint, ple_backend="pinned", prefill_layer_major=True, **OFFLOAD)
    sent = []
    send = RowsAhead.send
    monkeypatch.setattr(RowsAhead, "send", lambda self, lo, hi: sent.append((lo, hi)) or send(self, lo, hi))
    gathers, on_device = [], []
    gather, gather_on_device = PinnedTable.gather, PinnedTable.gather_on_device
    monkeypatch.setattr(PinnedTable, "gather", lambda self, rows: gathers.append(rows.shape[0]) or gather(self, rows))
    monkeypatch.setattr(PinnedTable, "gather_on_device",
                        lambda self, rows: on_device.append(rows.shape[0]) or gather_on_device(self, rows))
    assert llm.generate([PROMPT], max_tokens=8, ignore_eos=True)[0] == reference[0]
    tables = len(llm.config.ple_layers)
    assert sorted(set(sent)) == [(0, 64), (64, 128), (128, 192), (192, 200)] and len(sent) == 4 * tables
    # The prompt's rows all came ahead; only the seven decodes read rows, a row each, the way a graph can.
    assert gathers == [] and on_device == [1] * 7 * tables


@pytest.mark.gpu
def test_layer_major_on_cuda_gives_the_chunked_ids(tiny_checkpoint):
    """On CUDA, with the expert copy stream, pinned PLE rows gathered ahead and uploaded ahead of later
    layer copies (tiny's second PLE layer is not its first layer): the ids of chunked prefill."""
    kw = dict(device="cuda", ple_backend="pinned", **OFFLOAD)
    chunked = LLM(tiny_checkpoint, **kw)
    layer_major = LLM(tiny_checkpoint, prefill_layer_major=True, **kw)
    for seed in (5, 6, 7):  # cold prompts, each after the last one's decodes
        prompt = ids(900, seed)
        want = chunked.generate([prompt], max_tokens=8, ignore_eos=True)[0]
        assert layer_major.generate([prompt], max_tokens=8, ignore_eos=True)[0] == want, seed
    assert layer_major.runner.expert_store.stats()["expert_layer_streams"][0] == 3


# ---- served: abort during a layer-major prefill ---------------------------------------------------
def test_abort_during_layer_major_prefill_leaks_nothing(tiny_checkpoint):
    srv = Server(tiny_checkpoint, "--moe-strategy", "offload", "--moe-cache-slots", "4", "--prefill-layer-major",
                 "--max-prefill-length", "512", "--layer-major-max-tokens", "16384", api_key=None)
    tap = Tap(srv.tap_addr)
    try:
        long_prompt = ids(12000, 21)

        def admitted() -> list[dict]:
            return [x for x in tap.lines if x["type"] == "PromptAdmitted" and x["prompt_tokens"] == 12000]

        async def fire_and_drop():
            async with aiohttp.ClientSession() as s:
                task = asyncio.ensure_future(s.post(srv.url + "/v1/completions", json={
                    "model": "tiny", "prompt": long_prompt, "max_tokens": 4, "temperature": 0}))
                deadline = time.monotonic() + 60
                while not admitted() and time.monotonic() < deadline:  # then the layer-major turn is under way
                    await asyncio.sleep(0.01)
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        asyncio.run(fire_and_drop())
        m = srv.wait_idle(timeout=60)
        seen = admitted()
        assert seen and seen[-1]["plan"]["mode"] == "layer_major"
        _, token_ids, final = tap.wait_finished(seen[-1]["rid"])
        assert final["finish_reason"] == "abort" and token_ids == []
        assert m["tidal_kv_pages_in_use"] == 0 and m["tidal_state_slots_in_use"] == 0
        assert m["tidal_requests_running"] == 0
        # Expert counters reach /metrics, one series per MoE layer.
        assert m['tidal_expert_layer_streams_total{layer="0"}'] >= 1
    finally:
        tap.close()
        assert srv.stop() == []
