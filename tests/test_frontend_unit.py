"""The frontend alone (no mesh): an aiohttp test server around ``Frontend`` with the engine's answers
put on the request's queue by hand."""

from __future__ import annotations

import asyncio
import time

from aiohttp.test_utils import TestClient, TestServer

from tidal.config.server_args import ServerArgs
from tidal.frontend.server import Frontend
from tidal.messages import TextDelta, Usage
from tidal.runtime.serve import wire

PARSE_SECONDS = 0.4


def _frontend(checkpoint: str, tmp_path, slow_parse: bool = False, sent: list | None = None) -> Frontend:
    """A loaded ``Frontend``; with ``slow_parse`` each parse first sleeps ``PARSE_SECONDS``; with ``sent`` what it
    sends the scheduler is appended there instead."""
    args = wire(ServerArgs(model=checkpoint, served_model_name="tiny"), str(tmp_path))
    frontend = Frontend(args, checkpoint)
    frontend.load()
    if slow_parse:
        parse = frontend.parser.parse

        async def slow(raw, chat):
            await asyncio.sleep(PARSE_SECONDS)
            return await parse(raw, chat)

        frontend.parser.parse = slow
    if sent is not None:
        class Recorder:
            async def send(self, msg):
                sent.append(msg)

        frontend.client.to_scheduler = Recorder()
    return frontend


async def _answer(frontend: Frontend, count: int) -> None:
    """The engine's side: once ``count`` requests wait, each gets "ok" as its one token and finishes."""
    while len(frontend.client.queues) < count:
        await asyncio.sleep(0.01)
    for rid, queue in frontend.client.queues.items():
        queue.put_nowait(TextDelta(rid=rid, text="ok", token_ids=[5], finished=True, finish_reason="length",
                                   usage=Usage(prompt_tokens=1, completion_tokens=1)))


def test_time_to_first_token_counts_tokenization(tiny_checkpoint, tmp_path):
    """The TTFT metric starts when the request arrives, before its (here slow) parsing and tokenizing."""
    frontend = _frontend(tiny_checkpoint, tmp_path, slow_parse=True)

    async def go():
        frontend.client.start()
        frontend.client.ready = True
        async with TestClient(TestServer(frontend.app())) as client:
            answer = asyncio.create_task(_answer(frontend, 1))
            t0 = time.monotonic()
            response = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
            elapsed = time.monotonic() - t0
            assert response.status == 200 and (await response.json())["choices"][0]["text"] == "ok"
            await answer
            return elapsed

    elapsed = asyncio.run(go())
    frontend.parser.close()
    assert frontend.metrics.ttft.sum >= PARSE_SECONDS
    assert frontend.metrics.ttft.sum <= elapsed


def test_answers_503_before_the_tokenizer_is_loaded(tiny_checkpoint, tmp_path):
    """The port answers while the frontend loads its tokenizer: every API path says the server is starting."""
    args = wire(ServerArgs(model=tiny_checkpoint, served_model_name="tiny"), str(tmp_path))
    frontend = Frontend(args, tiny_checkpoint)

    async def go():
        frontend.client.start()
        async with TestClient(TestServer(frontend.app())) as client:
            health = await client.get("/health")
            assert health.status == 503 and (await health.json()) == {"status": "unavailable", "reason": "starting"}
            for method, path in (("get", "/v1/models"), ("post", "/v1/completions")):
                response = await getattr(client, method)(path, json={"model": "tiny", "prompt": "x"})
                body = await response.json()
                assert response.status == 503 and response.headers["Retry-After"] == "1", (path, body)
                assert body["error"]["type"] == "service_unavailable" and "starting" in body["error"]["message"]
            assert (await client.get("/metrics")).status == 200

    asyncio.run(go())
    assert not frontend.loaded


def test_token_id_prompts_are_checked_element_by_element():
    """Token-id prompts: accepted exactly when every element is an integer (not a boolean) inside the
    vocabulary, whatever the array's length and wherever the bad element sits; a refusal names the field
    and, for an id outside the vocabulary, the first such id."""
    from tidal.frontend.errors import APIError
    from tidal.frontend.protocol import Limits, parse_completion

    vocab = 1000
    limits = Limits(model_name="m", max_model_len=1 << 16, kv_capacity=1 << 20, vocab_size=vocab)

    def valid(ids) -> bool:  # the rule, one element at a time
        return bool(ids) and all(type(t) is int and 0 <= t < vocab for t in ids)

    base = list(range(1, 5001))
    base = [t % vocab for t in base]
    cases = [base, [0], [vocab - 1], [], [vocab], [-1], [10**30], [True], [1, False], [1.0], [2, 3.5], [[1], 2],
             [1, None], [1, "2"]]
    for bad_value in (True, 7.0, -3, vocab, 10**20, None, "5", [5]):
        for where in (0, 2500, 4999):
            ids = list(base)
            ids[where] = bad_value
            cases.append(ids)
    for ids in cases:
        try:
            parsed = parse_completion({"prompt": ids}, limits, None)
        except APIError as e:
            assert not valid(ids), ids[:8]
            assert e.status == 400 and e.param == "prompt", e.body()
            out = [t for t in ids if type(t) is int and not 0 <= t < vocab]
            if ids and all(type(t) is int for t in ids) and out:
                assert f"token id {out[0]}" in e.message, e.message
            continue
        assert valid(ids), ids[:8]
        assert parsed.prompts == [ids]
    # A list of prompts: each is checked, the refusal names the one that fails.
    try:
        parse_completion({"prompt": [[1, 2], [3, True]]}, limits, None)
        raise AssertionError("a boolean token id was accepted")
    except APIError as e:
        assert e.param == "prompt[1]", e.body()


def test_request_bodies_parse_as_json_does():
    """Every body parses to what ``json.loads`` gives (values and their types) or is refused with a 400, as
    ``json.loads`` refuses it: valid bodies, the corners where JSON parsers differ, and random byte edits."""
    import json
    import random
    import sys

    from tidal.frontend.errors import APIError
    from tidal.frontend.protocol import parse_body

    def typed(v):  # a value with every type spelled out: 1 and 1.0 and True differ
        if isinstance(v, dict):
            return {k: typed(x) for k, x in v.items()}
        if isinstance(v, list):
            return [typed(x) for x in v]
        return (type(v).__name__, repr(v))

    depth = sys.getrecursionlimit()
    corners = ['{"a":1,"a":2}', '{"a":100000000000000000000000000000}', '{"a":1e400}', '{"a":-1e400}',
               '{"a":"\\ud800"}', '{"a":"\\udfff x"}', '{"a":NaN}', '{"a":Infinity}', '{"a":"x\ty"}', '{"a":1} x',
               "[" * (depth - 20) + "]" * (depth - 20), "[" * (depth + 20) + "]" * (depth + 20), '{"a":-0}',
               '{"a":-0.0}', '{"a":1.5e-400}', '{"a":0.1}', '{"a":"\\u0000"}', ' {"a":1} ', '{"a":1,}', '{"a":01}',
               '{"a":"\\x"}', '{"a":-}', '{"a":9223372036854775808}', '{"a":-9223372036854775809}',
               '{"a":1' + "0" * 5000 + "}", '{"a":1.' + "1" * 5000 + "}", "\ufeff{}", '"text"', "3", "null", "",
               '{"prompt":[1,2,3],"max_tokens":4,"temperature":0.5,"stop":["\\n"],"logit_bias":{"5":-1.5e2}}',
               '{"messages":[{"role":"user","content":"h\\u00e9llo \\ud83d\\ude00"}]}', '{"a":1E5,"b":1e-5,"c":2.0}']
    rng = random.Random(0)
    bodies = [c.encode() for c in corners]
    for _ in range(1500):
        b = bytearray(rng.choice(corners[-4:]).encode())
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(b) + 1)
            op = rng.random()
            if op < 0.4 and i < len(b):
                del b[i]
            elif op < 0.8:
                b[i:i] = bytes([rng.choice(b'{}[]",:0123456789-+.eE\\u tnfalsr\x00\xff')])
            elif i < len(b):
                b[i] = rng.randrange(256)
        bodies.append(bytes(b))
    for raw in bodies:
        try:
            want = ("ok", typed(json.loads(raw.decode("utf-8"))))
        except (ValueError, RecursionError, UnicodeDecodeError):
            want = ("refused",)
        try:
            got = ("ok", typed(parse_body(raw)))
        except APIError as e:
            assert e.status == 400, (raw[:60], e.message)
            got = ("refused",)
        if want[0] == "ok" and got[0] == "refused":  # a lone surrogate escape: refused after parsing, by design
            assert "\\ud" in raw.decode().lower(), raw[:60]
            continue
        assert got == want, raw[:80]


def test_the_scheduler_hears_of_bodies_in_tokenization(tiny_checkpoint, tmp_path):
    """Each body read counts one up before its parse and down after its requests went out (or it was refused),
    so the scheduler sees every request of a body before the count that drops it."""
    from tidal.messages import GenerateReq, Tokenizing

    sent: list = []
    frontend = _frontend(tiny_checkpoint, tmp_path, sent=sent)

    async def go():
        frontend.client.start()
        frontend.client.ready = True
        async with TestClient(TestServer(frontend.app())) as client:
            answer = asyncio.create_task(_answer(frontend, 2))
            ok = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1, "n": 2})
            assert ok.status == 200
            await answer
            bad = await client.post("/v1/completions", json={"model": "tiny", "prompt": [1, True], "max_tokens": 1})
            assert bad.status == 400

    asyncio.run(go())
    frontend.parser.close()
    kinds = [(type(m).__name__, m.count if isinstance(m, Tokenizing) else None) for m in sent
             if isinstance(m, Tokenizing | GenerateReq)]
    assert kinds == [("Tokenizing", 1), ("GenerateReq", None), ("GenerateReq", None), ("Tokenizing", 0),
                     ("Tokenizing", 1), ("Tokenizing", 0)]
    assert frontend.client.bodies == 0


def test_a_client_gone_during_tokenization_counts_its_body_out(tiny_checkpoint, tmp_path):
    """A client that disconnects while its body is parsed cancels the handler; its body still counts out, so the
    scheduler's count is back at 0 and later prompts do not wait for it."""
    from tidal.messages import Tokenizing

    sent: list = []
    frontend = _frontend(tiny_checkpoint, tmp_path, slow_parse=True, sent=sent)

    async def go():
        import aiohttp

        frontend.client.start()
        frontend.client.ready = True
        async with TestClient(TestServer(frontend.app())) as client:
            try:
                await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                                  timeout=aiohttp.ClientTimeout(total=PARSE_SECONDS / 4))
            except TimeoutError:
                pass
            await asyncio.sleep(PARSE_SECONDS * 2)

    asyncio.run(go())
    frontend.parser.close()
    counts = [m.count for m in sent if isinstance(m, Tokenizing)]
    assert counts == [1, 0] and frontend.client.bodies == 0
    assert not any(type(m).__name__ == "GenerateReq" for m in sent)


def test_packed_prompt_ids_cross_the_pipe_as_bytes_and_reach_the_scheduler_whole():
    """A tokenizer worker hands the frontend a prompt's ids packed: the pipe carries bytes (no int apiece), the
    frontend reads them only where it needs them, and the scheduler decodes the very ids from the request."""
    import pickle

    from tidal.frontend.protocol import PackedIds, ParsedRequest, packed
    from tidal.messages import GenerateReq, SchedulerInbound, decoder, encode

    ids = list(range(5, 230000, 7))
    piped = pickle.loads(pickle.dumps(PackedIds.of(ids)))
    assert piped._ids is None and len(piped) == len(ids)  # nothing unpacked on the way
    assert piped[-64:] == ids[-64:] and list(piped) == ids and piped == ids
    sent = encode(GenerateReq(rid="r", prompt_ids=piped.raw(), max_tokens=1))
    assert sent == encode(GenerateReq(rid="r", prompt_ids=ids, max_tokens=1))
    assert decoder(SchedulerInbound).decode(sent).prompt_ids == ids

    fields = dict(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, stop=[],
                  ignore_eos=False, stream=False, include_usage=False, continuous_usage=False,
                  skip_special_tokens=True, model="m")
    two = packed(ParsedRequest(chat=False, prompt_ids=[1, 2], prompts=[[1, 2], [3]], **fields))
    assert two.prompt_ids is two.prompts[0] and [list(p) for p in two.prompts] == [[1, 2], [3]]
    chat = packed(ParsedRequest(chat=True, prompt_ids=[4, 5, 6], **fields))
    assert isinstance(chat.prompt_ids, PackedIds) and chat.prompt_ids == [4, 5, 6] and chat.prompts == []
