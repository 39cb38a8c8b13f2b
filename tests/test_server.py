"""End to end against a real ``tidal serve`` on the tiny checkpoint: OpenAI SDK, tap, aborts, errors."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.request

import aiohttp
import pytest
from server_harness import Server, child_pids, cmdline, start_tap, stream_one

from tidal import LLM

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    srv = Server(tiny_checkpoint, "--max-model-len", str(MAX_MODEL_LEN), "--max-running-requests", "16")
    yield srv
    alive = srv.stop()
    assert not alive, f"processes left after SIGTERM: {alive}"


@pytest.fixture(scope="module")
def offline(tiny_checkpoint) -> LLM:
    return LLM(tiny_checkpoint, device="cpu")


def test_sdk_streaming_completion_with_usage(client):
    stream = client.completions.create(model="tiny", prompt="The tide comes in", max_tokens=16, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert any(texts), "no non-empty text chunk"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    usage = [c.usage for c in chunks if c.usage]
    assert len(usage) == 1 and usage[0].completion_tokens == 16
    assert usage[0].prompt_tokens == 4 and usage[0].total_tokens == 20
    assert usage[0].prompt_tokens_details.cached_tokens == 0
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")


def test_sse_ends_with_done(server):
    async def go():
        async with aiohttp.ClientSession(headers=server.headers()) as s:
            async with s.post(server.url + "/v1/completions", json={
                    "model": "tiny", "prompt": [1, 2, 3], "max_tokens": 5, "stream": True}) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                return (await r.read()).decode()
    body = asyncio.run(go())
    events = [e for e in body.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_sdk_chat_streaming_and_not(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=8,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content  # greedy: the same text both ways
    assert chunks[-1].choices[0].finish_reason == "length"


def test_tap_ids_equal_offline_generate(server, offline, tiny_checkpoint):
    tap = start_tap(server.tap_addr)
    try:
        prompt = list(range(3000, 3137))
        status, body = server.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 20,
                                                       "temperature": 0, "ignore_eos": True})
        assert status == 200
        rid = body["id"].removeprefix("cmpl-")
        admitted, ids = None, []
        deadline = time.time() + 20
        while time.time() < deadline:
            line = json.loads(tap.stdout.readline())
            if line.get("rid") != rid:
                continue
            if line["type"] == "PromptAdmitted":
                admitted = line
            elif line["type"] == "Detokenize":
                ids += line["token_ids"]
                if line.get("finished"):
                    break
        assert admitted is not None and admitted["prompt_tokens"] == len(prompt)
        assert admitted["cached_tokens"] == 0 and admitted["plan"]["mode"] == "chunked"
        # Prefix caching (default, coalesced): one forward, the checkpoint exported from inside it.
        assert admitted["plan"]["chunks"] == [[0, len(prompt)]]
        assert admitted["plan"]["checkpoints"] == [128]
        assert line["finish_reason"] == "length" and line["usage"]["completion_tokens"] == 20
        assert ids == offline.generate([prompt], max_tokens=20, ignore_eos=True)[0]
        # its decodes were scheduled ahead of the batch sampling their input (overlap, the default)
        assert server.metrics()["tidal_scheduler_decodes_ahead_total"] >= 15
    finally:
        tap.terminate()
        tap.wait()


def test_sixteen_concurrent_streams_then_pools_idle(server):
    async def one(session, i):
        body = {"model": "tiny", "prompt": f"request number {i} " * (i + 1), "max_tokens": 10 + i,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        out = await stream_one(session, server.url, body)
        return i, out["usage"], out["done"]

    async def go():
        async with aiohttp.ClientSession(headers=server.headers()) as s:
            return await asyncio.gather(*(one(s, i) for i in range(16)))
    for i, usage, done in asyncio.run(go()):
        assert done and usage["completion_tokens"] == 10 + i
    m = server.wait_idle()
    assert m["tidal_kv_pages_in_use"] == 0 and m["tidal_state_slots_in_use"] == 0


def test_closing_a_stream_aborts_the_request(server, client):
    start = server.metrics()
    before = start['tidal_requests_total{finish_reason="abort"}']

    async def go():
        async with aiohttp.ClientSession(headers=server.headers()) as s:
            r = await s.post(server.url + "/v1/completions", json={
                "model": "tiny", "prompt": "never ending", "max_tokens": 900, "stream": True, "ignore_eos": True})
            seen = 0
            async for raw in r.content:
                if raw.startswith(b"data: {"):
                    seen += 1
                    if seen == 3:
                        break
            r.close()  # drop the connection mid-generation
    asyncio.run(go())
    deadline = time.time() + 10
    while time.time() < deadline:
        m = server.metrics()
        if m["tidal_scheduler_requests_aborted_total"] > start["tidal_scheduler_requests_aborted_total"] \
                and m["tidal_kv_pages_in_use"] == 0:
            break
        time.sleep(0.05)
    assert m['tidal_requests_total{finish_reason="abort"}'] == before + 1
    assert m["tidal_kv_pages_in_use"] == 0 and m["tidal_state_slots_in_use"] == 0
    # The scheduler dropped the request long before its 900 tokens.
    assert m["tidal_scheduler_requests_aborted_total"] == start["tidal_scheduler_requests_aborted_total"] + 1
    assert m["tidal_scheduler_generation_tokens_total"] - start["tidal_scheduler_generation_tokens_total"] < 300
    out = client.completions.create(model="tiny", prompt="still serving", max_tokens=3)
    assert out.usage.completion_tokens == 3


def test_metrics_read_at_first_text_count_the_forward_behind_it(server):
    """The counters of the forward that finished a prompt reach /metrics ahead of its first token (they are
    otherwise published at most every 50 ms while busy): a reader that sees a request's first text sees its
    prefill forward and its first token counted."""
    from tidal.bench.client import request_body, stream_sync

    for i in range(4):
        before = server.wait_idle()
        seen: list[dict[str, float]] = []
        out = stream_sync(server.url, request_body("tiny", f"count me {i}", 4, logprobs=False),
                          api_key=server.api_key, on_first_text=lambda seen=seen: seen.append(server.metrics()))
        assert out["status"] == 200 and seen, out
        for name in ("tidal_scheduler_prefill_forwards_total", "tidal_scheduler_generation_tokens_total"):
            assert seen[0][name] >= before[name] + 1, (i, name, before[name], seen[0][name])


BAD_REQUESTS = [
    ("missing prompt", {"model": "tiny"}, "prompt"),
    ("ill-typed max_tokens", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("negative max_tokens", {"prompt": "x", "max_tokens": -5}, "max_tokens"),
    ("huge max_tokens", {"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
    ("negative temperature", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("n above the limit", {"prompt": "x", "n": 17}, "n"),
    ("token id outside vocabulary", {"prompt": [5, 248320, 7]}, "prompt"),
    ("negative token id", {"prompt": [5, -1]}, "prompt"),
    ("prompt longer than context", {"prompt": list(range(1, MAX_MODEL_LEN + 5))}, "prompt"),
    ("wrong model", {"model": "gpt-4", "prompt": "x"}, "model"),
    ("unknown field", {"prompt": "x", "frobnicate": True}, "frobnicate"),
    ("penalty out of range", {"prompt": "x", "presence_penalty": 5}, "presence_penalty"),
    ("top_p out of range", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("stream_options without stream", {"prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("prompts mixed with ids", {"prompt": ["a", 5]}, "prompt"),
]


@pytest.mark.parametrize("name,body,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_completion_requests(server, name, body, param):
    status, resp = server.post("/v1/completions", body)
    assert status == 400, resp
    err = resp["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"]


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]},
     "messages[0].tool_calls[0].function"),
    ({"messages": [{"role": "user", "content": "x", "images": ["a"]}]}, "messages[0].images"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": True,
      "stream_options": {"continuous_usage_stats": "yes"}}, "stream_options.continuous_usage_stats"),
    ({"messages": [{"role": "user", "content": "x"}], "min_p": 1.5}, "min_p"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, "continue_final_message"),
    ({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "no"}, "add_generation_prompt"),
])
def test_bad_chat_requests(server, body, param):
    status, resp = server.post("/v1/chat/completions", body)
    assert status == 400 and resp["error"]["param"] == param


def test_neutral_client_fields_are_accepted(server):
    status, resp = server.post("/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "system", "content": "s", "name": "x"},
                                      {"role": "assistant", "content": "a", "tool_calls": []},
                                      {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": False, "logit_bias": {},
        "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "user": "u", "stop": None,
        "max_tokens": 2, "stream": False})
    assert status == 200 and resp["usage"]["completion_tokens"] <= 2


def _sse(server, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), headers=server.headers())
    with urllib.request.urlopen(req, timeout=60) as r:
        lines = [raw.decode().strip() for raw in r]
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats(server, chat):
    """vLLM's ``continuous_usage_stats``: every chunk carries the usage so far; a chunk's completion tokens are
    the tokens its stream has carried up to it (counted from the log-probabilities of each chunk)."""
    body = {"model": "tiny", "max_tokens": 7, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if chat:
        body.update(messages=[{"role": "user", "content": "Hi"}], logprobs=True)
    else:
        body.update(prompt=[5, 6, 7, 8], logprobs=0)
    chunks = _sse(server, "/v1/chat/completions" if chat else "/v1/completions", body)
    *streamed, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 7
    prompt = last["usage"]["prompt_tokens"]
    seen = 0
    for c in streamed:
        lp = c["choices"][0]["logprobs"]
        seen += len((lp or {}).get("content" if chat else "tokens") or [])
        assert c["usage"]["prompt_tokens"] == prompt and c["usage"]["completion_tokens"] == seen, (c, seen)
        assert c["usage"]["total_tokens"] == prompt + seen
    assert seen == 7
    # Without include_usage there is no usage at all (vLLM's semantics).
    body["stream_options"] = {"continuous_usage_stats": True}
    assert all("usage" not in c for c in _sse(server, "/v1/chat/completions" if chat else "/v1/completions", body))


def test_vllm_fields_that_clients_send(server):
    """vLLM's extensions: the ones tidal does are honoured, neutral values of the others accepted, other values
    and unsupported fields refused with a 400 naming the field."""
    prompt = list(range(1000, 1040))
    base = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    status, resp = server.post("/v1/completions", {**base, "truncate_prompt_tokens": 16})
    assert status == 200 and resp["usage"]["prompt_tokens"] == 16
    status, resp = server.post("/v1/completions", {**base, "min_p": 0.2, "temperature": 0.8, "seed": 3,
                                                   "priority": 0, "use_beam_search": False, "length_penalty": 1.0,
                                                   "spaces_between_special_tokens": True, "add_special_tokens": True,
                                                   "service_tier": "auto", "stop": None, "logprobs": None})
    assert status == 200 and resp["usage"]["completion_tokens"] == 2
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    with_prompt = server.post("/v1/chat/completions", chat)[1]["usage"]["prompt_tokens"]
    status, resp = server.post("/v1/chat/completions", {**chat, "add_generation_prompt": False,
                                                        "continue_final_message": False})
    assert status == 200 and resp["usage"]["prompt_tokens"] == with_prompt - 3  # "<|im_start|>assistant\n"
    for field, value in (("request_id", "abc"), ("guided_json", {}), ("prompt_logprobs", 1),
                         ("return_tokens_as_token_ids", True), ("min_p", -1), ("priority", 5),
                         ("use_beam_search", True), ("truncate_prompt_tokens", 0), ("functions", [])):
        status, resp = server.post("/v1/completions", {**base, field: value})
        assert status == 400 and resp["error"]["param"] == field, (field, resp)


def test_invalid_json_auth_and_unknown_route(server, client):
    status, resp = server.post("/v1/completions", None, raw=b"{not json")
    assert status == 400 and resp["error"]["type"] == "invalid_request_error"
    status, resp = server.post("/v1/completions", {"prompt": "x"}, headers={"Content-Type": "application/json"})
    assert status == 401 and resp["error"]["code"] == "invalid_api_key"
    status, resp = server.post("/v1/completions", {"prompt": "x"},
                               headers={"Content-Type": "application/json", "Authorization": "Bearer wrong"})
    assert status == 401
    status, resp = server.post("/v1/nothing", {"prompt": "x"})
    assert status == 404 and "error" in resp
    # Still serving after all of that.
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).usage.completion_tokens == 2
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_stop_string_ends_text(server, client):
    greedy = client.completions.create(model="tiny", prompt="stop strings", max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    assert len(greedy) > 6
    stop = greedy[3:6]
    out = client.completions.create(model="tiny", prompt="stop strings", max_tokens=12, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == greedy[: greedy.index(stop)]
    assert out.usage.completion_tokens < 12
    assert server.wait_idle()["tidal_kv_pages_in_use"] == 0


def test_processes_are_named_and_sigterm_leaves_nothing(tiny_checkpoint, tmp_path):
    run_dir = tmp_path / "run"  # this server's own: other tidal servers on the machine do not matter
    srv = Server(tiny_checkpoint, "--run-dir", str(run_dir), api_key=None)
    names = sorted(cmdline(p) for p in child_pids(srv.proc.pid))
    assert names == ["tidal-detokenizer", "tidal-executor-0", "tidal-frontend", "tidal-scheduler"]
    for pid in child_pids(srv.proc.pid):
        with open(f"/proc/{pid}/comm") as f:
            assert f.read().strip().startswith("tidal-")
    assert run_dir.exists()
    alive = srv.stop()
    assert alive == []
    assert srv.proc.returncode == 0
    assert not run_dir.exists()


def test_tcp_addresses(tiny_checkpoint):
    from server_harness import Tap, free_port

    addrs = {name: f"tcp://127.0.0.1:{free_port()}" for name in ("scheduler", "detokenizer", "frontend", "control")}
    flags = [x for name, addr in addrs.items() for x in (f"--{name}-addr", addr)]
    flags += ["--executor-addr", f"tcp://127.0.0.1:{free_port()}"]
    srv = Server(tiny_checkpoint, *flags, api_key=None)
    tcp_tap = None
    try:
        for addr in addrs.values():  # every role bound its tcp socket
            host, port = addr.removeprefix("tcp://").split(":")
            socket.create_connection((host, int(port)), timeout=2).close()
        tcp_tap = Tap(srv.tap_addr)
        status, body = srv.post("/v1/completions", {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3})
        assert status == 200 and body["usage"]["completion_tokens"] == 3
        _, ids, final = tcp_tap.wait_finished(body["id"].removeprefix("cmpl-"))
        assert len(ids) == 3 and final["finish_reason"] == "length"
    finally:
        if tcp_tap:
            tcp_tap.close()
        assert srv.stop() == []


def test_without_overlap_the_same_texts(tiny_checkpoint, server):
    """``--disable-overlap-schedule`` keeps one batch in flight (no decode scheduled ahead); concurrent
    greedy requests of different lengths and stop strings read the same as with overlap."""
    from concurrent.futures import ThreadPoolExecutor

    bodies = [{"model": "tiny", "prompt": [900 + 13 * i + j for j in range(20 + 9 * i)], "max_tokens": 6 + 5 * i,
               "temperature": 0, "ignore_eos": True, **({"stop": ["e"]} if i == 2 else {})} for i in range(4)]
    plain = Server(tiny_checkpoint, "--max-model-len", str(MAX_MODEL_LEN), "--disable-overlap-schedule",
                   api_key=None)
    try:
        texts = {}
        for name, srv in (("overlap", server), ("plain", plain)):
            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(lambda b, srv=srv: srv.post("/v1/completions", b), bodies))
            assert all(status == 200 for status, _ in answers)
            texts[name] = [(a["choices"][0]["text"], a["choices"][0]["finish_reason"]) for _, a in answers]
        assert texts["plain"] == texts["overlap"]
        assert plain.metrics()["tidal_scheduler_decodes_ahead_total"] == 0
        assert plain.wait_idle()["tidal_kv_pages_in_use"] == 0
    finally:
        assert plain.stop() == []


def test_bad_flag_values_name_the_flag(tiny_checkpoint):
    for flags, needle in ((["--tap-addr", "http://x"], "--tap-addr"), (["--page-size", "12"], "--page-size"),
                          (["--max-running-requests", "0"], "--max-running-requests")):
        out = subprocess.run([sys.executable, "-m", "tidal.cli", "serve", "--model", tiny_checkpoint, *flags],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and needle in out.stderr


@pytest.fixture(scope="module")
def small(tiny_checkpoint):
    """A server with a 1024-token KV pool and 5 tokens for a request without ``max_tokens``."""
    srv = Server(tiny_checkpoint, "--kv-pool-tokens", "1024", "--default-max-tokens", "5", api_key=None)
    yield srv
    assert srv.stop() == []


def test_a_request_refused_by_the_scheduler_counts_once(small):
    """More KV pages than the pool holds: a 400 with the scheduler's words, counted as rejected only.
    (Completions check this in the frontend, before anything streams; chat requests meet the scheduler.)"""
    srv = small
    start = srv.metrics()
    status, body = srv.post("/v1/chat/completions", {"model": "tiny", "max_tokens": 2000,
                                                     "messages": [{"role": "user", "content": "hi " * 20}]})
    assert status == 400 and "KV pages" in body["error"]["message"], body
    status, body = srv.post("/v1/completions", {"model": "tiny", "prompt": list(range(1, 101)),
                                                "max_tokens": 2000})
    assert status == 400 and body["error"]["param"] == "max_tokens", body
    m = srv.metrics()
    assert m["tidal_requests_rejected_total"] == start["tidal_requests_rejected_total"] + 2
    for reason in ("error", "abort"):
        key = f'tidal_requests_total{{finish_reason="{reason}"}}'
        assert m.get(key, 0) == start.get(key, 0), key


def test_at_capacity_requests_get_503_with_retry_after(tiny_checkpoint):
    """One running and one queued request at most: a third concurrent one is refused at once. (The first two
    stream until the third has its answer; their clients then leave.)"""
    srv = Server(tiny_checkpoint, "--max-running-requests", "1", "--max-queued-requests", "1", api_key=None)
    try:
        async def go():
            async with aiohttp.ClientSession() as s:
                statuses = []

                async def post(n, stream=False):
                    async with s.post(srv.url + "/v1/completions", json={
                            "model": "tiny", "prompt": list(range(1, 400)), "max_tokens": n,
                            "temperature": 0, "ignore_eos": True, "stream": stream}) as r:
                        if stream:
                            statuses.append(r.status)
                            async for _ in r.content:
                                pass
                        return r.status, r.headers.get("Retry-After"), await r.json()

                held = [asyncio.ensure_future(post(4000, stream=True)) for _ in range(2)]
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:  # one running, one queued
                    m = await asyncio.to_thread(srv.metrics)
                    if m["tidal_requests_running"] == 1 and m["tidal_requests_waiting"] == 1:
                        break
                    await asyncio.sleep(0.05)
                third = await post(2)
                for task in held:
                    task.cancel()
                await asyncio.gather(*held, return_exceptions=True)
                return third, statuses
        (status, retry, body), statuses = asyncio.run(go())
        assert status == 503 and retry == "1" and body["error"]["type"] == "service_unavailable", body
        assert set(statuses) <= {200}  # what the held ones had answered by then
        srv.wait_idle()
        status, _ = srv.post("/v1/completions", {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2})
        assert status == 200  # room again
        assert srv.wait_idle()["tidal_kv_pages_in_use"] == 0
    finally:
        assert srv.stop() == []


def test_chat_without_max_tokens_takes_the_documented_default(small):
    status, body = small.post("/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"
