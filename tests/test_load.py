"""Load and disconnects: concurrent streams (60, and 200 at full size: ``slow``) equal to the same requests sent
alone; a responsive frontend under them and while a long prompt is tokenized; clients that vanish at every stage
leak nothing."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import threading
import time
import urllib.request

import aiohttp
import pytest
from server_harness import Server, Tap, child_pids, cmdline, stream_one

from tidal.bench.stats import percentile

# Concurrent clients: the default run's, and the full size (``slow``: ``make test-all``).
CLIENTS = [60, pytest.param(200, marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    srv = Server(tiny_checkpoint, "--max-prefill-length", "256", "--max-model-len", "16384", "--disable-prefix-cache",
                 api_key=None)
    yield srv
    assert srv.stop() == []


def load_requests(clients: int) -> list[dict]:
    rng = random.Random(11)
    out = []
    for _ in range(clients):
        n = rng.choice([3, 9, 17, 40, 64, 300])  # 300: two prefill chunks
        out.append({"model": "tiny", "prompt": [rng.randrange(1, 240000) for _ in range(n)],
                    "max_tokens": rng.randrange(1, 8), "ignore_eos": True, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}})
    return out


@pytest.mark.parametrize("clients", CLIENTS)
def test_concurrent_streams_equal_the_same_requests_alone(server, clients):
    bodies = load_requests(clients)
    tap = Tap(server.tap_addr)
    try:
        async def together():
            async with aiohttp.ClientSession() as s:
                return await asyncio.gather(*(stream_one(s, server.url, b) for b in bodies))

        async def alone():
            async with aiohttp.ClientSession() as s:
                return [await stream_one(s, server.url, b) for b in bodies]

        loaded = asyncio.run(together())
        idle = server.wait_idle()
        assert idle["tidal_kv_pages_in_use"] == 0 and idle["tidal_state_slots_in_use"] == 0
        assert idle["tidal_requests_running"] == 0
        single = asyncio.run(alone())
        for body, a, b in zip(bodies, loaded, single, strict=True):
            assert a["done"] and a["usage"]["completion_tokens"] == body["max_tokens"]
            assert a["usage"]["prompt_tokens"] == len(body["prompt"])
            ids_a = tap.wait_finished(a["rid"])[1]
            ids_b = tap.wait_finished(b["rid"])[1]
            assert ids_a == ids_b and len(ids_a) == body["max_tokens"]
            assert a["text"] == b["text"]
    finally:
        tap.close()
    assert server.wait_idle()["tidal_kv_pages_in_use"] == 0


@pytest.fixture(scope="module")
def hf_server(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with only its ``tokenizer.json`` (the ``tokenizers`` library: real checkpoints'
    path, one that holds the interpreter lock while it encodes)."""
    from tidal.tokenizer import HFTokenizer, load_tokenizer

    path = tmp_path_factory.mktemp("tokenizer-json")
    for name in os.listdir(tiny_checkpoint):
        if not name.endswith(".tiktoken"):
            os.symlink(os.path.join(tiny_checkpoint, name), path / name)
    assert isinstance(load_tokenizer(str(path)), HFTokenizer)
    srv = Server(str(path), "--max-model-len", "16384", "--disable-prefix-cache", api_key=None)
    srv.checkpoint = str(path)
    yield srv
    assert srv.stop() == []


@pytest.mark.parametrize("clients", CLIENTS)
def test_health_and_metrics_answer_while_clients_stream(server, clients):
    """``/health`` and ``/metrics``, probed from a thread of their own while the clients stream 48 tokens each:
    p99 <= 50 ms, none over 100 ms."""
    bodies = load_requests(clients)
    for body in bodies:
        body["max_tokens"] = 48
    probes: dict[str, list[float]] = {"/health": [], "/metrics": []}
    done = threading.Event()

    def probe():
        while not done.is_set():
            for path, seen in probes.items():
                t0 = time.monotonic()
                with urllib.request.urlopen(server.url + path, timeout=5) as r:
                    assert r.status == 200
                    r.read()
                seen.append(time.monotonic() - t0)
            time.sleep(0.01)

    async def together():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(stream_one(s, server.url, b) for b in bodies))

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    try:
        streams = asyncio.run(together())
    finally:
        done.set()
        thread.join(10)
    assert all(r["done"] and r["usage"]["completion_tokens"] == 48 for r in streams)
    for path, seen in probes.items():
        seen.sort()
        p99 = seen[min(len(seen) - 1, int(0.99 * len(seen)))]
        assert len(seen) >= 20 and p99 <= 0.05 and seen[-1] <= 0.1, (path, len(seen), p99, seen[-5:])


@pytest.mark.parametrize("words", [40_000, 400_000])
@pytest.mark.parametrize("which", ["tiktoken", "tokenizer.json"])
def test_health_answers_while_a_long_prompt_is_tokenized(request, which, words):
    """A chat message of ``words`` words, about 2.5 tokens each (refused afterwards as longer than the
    context: the rendering and tokenizing, up to seconds, are the point): ``/health`` answers throughout,
    95% of probes within 50 ms and every one within 250 ms (on two loaded cores the OS alone can hold one
    probe back ~100 ms; tokenizing on the event loop would hold one back for the seconds it takes), and a
    short request is served meanwhile."""
    server = request.getfixturevalue("server" if which == "tiktoken" else "hf_server")
    vocab = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    text = " ".join(random.Random(3).choice(vocab) + str(i % 97) for i in range(words))
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 1}).encode()
    result: dict = {}

    def send():
        req = urllib.request.Request(server.url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        try:
            urllib.request.urlopen(req, timeout=120)
        except urllib.error.HTTPError as e:
            result["status"], result["body"] = e.code, json.loads(e.read())
        result["elapsed"] = time.monotonic() - t0

    def send_short():  # a short request meanwhile: parsed by another worker
        t0 = time.monotonic()
        status, out = server.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                      "ignore_eos": True})
        result["short"] = (time.monotonic() - t0, out["usage"]["completion_tokens"] if status == 200 else out)

    thread = threading.Thread(target=send)
    thread.start()
    time.sleep(0.02)  # the long body is sent and parsing
    other = threading.Thread(target=send_short)
    other.start()
    probes = []
    while thread.is_alive():
        t0 = time.monotonic()
        with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
            assert r.status == 200
        probes.append(time.monotonic() - t0)
        time.sleep(0.002)  # several probes even where the tokenizer takes well under 100 ms
    thread.join()
    other.join()
    short = result.get("short")
    assert result["status"] == 400 and "tokens" in result["body"]["error"]["message"], result
    assert len(probes) >= 5, (probes, result)
    p95 = percentile(probes, 95)
    assert p95 <= 0.05 and max(probes) <= 0.25, (p95, sorted(probes)[-5:], result["elapsed"])
    assert short is not None and short[1] == 2, short
    if words >= 400_000:  # seconds of tokenizing: the short request does not wait for them
        assert short[0] < result["elapsed"], (short, result["elapsed"])


def raw_request(server: Server, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def wait_aborted(server: Server, before: dict, admitted: bool, timeout: float = 15.0) -> dict:
    """Until the request is gone and every pool idle; ``admitted``: it must have been aborted at the
    scheduler (a client gone before its request was handed on leaves nothing to abort)."""
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        aborted = m["tidal_scheduler_requests_aborted_total"] - before["tidal_scheduler_requests_aborted_total"]
        finished = m["tidal_scheduler_requests_finished_total"] - before["tidal_scheduler_requests_finished_total"]
        done = aborted == 1 if admitted else (aborted == 1 or (aborted == 0 and finished == 0))
        if done and m["tidal_kv_pages_in_use"] == 0 and m["tidal_state_slots_in_use"] == 0 \
                and m["tidal_requests_running"] == 0 and m["tidal_requests_waiting"] == 0:
            return m
        if time.time() > deadline:
            raise AssertionError(f"not aborted and idle: {m}")
        time.sleep(0.05)


@pytest.mark.parametrize("stage", ["before-first-token", "mid-prefill", "mid-decode"])
def test_client_that_vanishes_is_aborted_end_to_end(server, stage):
    before = server.metrics()
    rng = random.Random(5)
    prompt = [rng.randrange(1, 240000) for _ in range(12000 if stage == "mid-prefill" else 40)]
    sock = raw_request(server, {"model": "tiny", "prompt": prompt, "max_tokens": 3000, "ignore_eos": True,
                                "stream": True})
    if stage == "before-first-token":
        sock.close()
    elif stage == "mid-prefill":
        deadline = time.time() + 20  # until the scheduler has the request running its prefill chunks
        while server.metrics()["tidal_requests_running"] == 0 and time.time() < deadline:
            time.sleep(0.01)
        sock.close()
    else:
        sock.settimeout(30)
        received = b""
        while received.count(b"data: {") < 3:
            received += sock.recv(65536)
        sock.close()
    after = wait_aborted(server, before, admitted=stage != "before-first-token")
    length = 'tidal_requests_total{finish_reason="length"}'
    assert after[length] == before[length]
    # Far fewer than the 3000 tokens asked for were generated.
    assert after["tidal_scheduler_generation_tokens_total"] - before["tidal_scheduler_generation_tokens_total"] < 1000
    status, body = server.post("/v1/completions", {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_a_killed_tokenizer_worker_is_replaced_and_no_request_fails(hf_server):
    """Requests are parsed in ``--tokenizer-workers`` processes under the frontend; one killed between
    requests is started again and every later request is served."""
    frontend = next(p for p in child_pids(hf_server.proc.pid) if cmdline(p) == "tidal-frontend")

    def workers() -> list[int]:
        return [p for p in child_pids(frontend) if cmdline(p).startswith("tidal-tokenizer-")]

    deadline = time.monotonic() + 30
    while len(workers()) < 2 and time.monotonic() < deadline:  # they name themselves once started
        time.sleep(0.1)
    before = workers()
    assert len(before) == 2, [cmdline(p) for p in child_pids(frontend)]
    os.kill(before[0], signal.SIGKILL)
    time.sleep(0.2)
    for i in range(6):
        status, out = hf_server.post("/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 2})
        assert status == 200 and out["usage"]["completion_tokens"] == 2, out
    deadline = time.monotonic() + 30
    while len(workers()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    after = workers()
    assert len(after) == 2 and before[0] not in after and before[1] in after


def test_an_answer_quoted_back_keeps_its_ids_in_every_tokenizer_worker(hf_server):
    """A chat answer sent back in the next turn is rendered with the ids the model generated (the answer
    memory), not re-tokenized, whichever worker parses the next turn: each worker learns every answer."""
    from tidal.bench.tap import tap_rid
    from tidal.frontend.answer_memory import AnswerMemory
    from tidal.frontend.protocol import Limits, parse_chat
    from tidal.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(hf_server.checkpoint)
    limits = Limits(model_name="tiny", max_model_len=16384, kv_capacity=1 << 20, vocab_size=tokenizer.n_vocab)
    tap = Tap(hf_server.tap_addr)
    try:
        for i in range(8):  # greedy answers of the random model until one re-tokenizes to other ids
            first = [{"role": "user", "content": f"Write a word number {i}."}]
            status, out = hf_server.post("/v1/chat/completions", {
                "model": "tiny", "messages": first, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
            assert status == 200, out
            answer = out["choices"][0]["message"]["content"]
            ids = tap.wait_finished(tap_rid(out["id"]))[1]
            second = {"model": "tiny", "max_tokens": 1, "messages": first + [
                {"role": "assistant", "content": answer}, {"role": "user", "content": "Another."}]}
            memory = AnswerMemory()
            memory.remember(answer, ids, tokenizer)
            remembered = len(parse_chat(second, limits, tokenizer, memory).prompt_ids)
            retokenized = len(parse_chat(second, limits, tokenizer, AnswerMemory()).prompt_ids)
            if remembered != retokenized:
                break
        else:
            raise AssertionError("every answer re-tokenizes to its own ids: nothing to remember")
    finally:
        tap.close()
    for _ in range(6):  # more than there are workers: the shared queue hands requests to each
        status, out = hf_server.post("/v1/chat/completions", second)
        assert status == 200 and out["usage"]["prompt_tokens"] == remembered, (out, remembered, retokenized)
