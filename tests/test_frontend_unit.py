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


def test_time_to_first_token_counts_tokenization(tiny_checkpoint, tmp_path):
    """The TTFT metric starts when the request arrives, before its (here slow) parsing and tokenizing."""
    args = wire(ServerArgs(model=tiny_checkpoint, served_model_name="tiny"), str(tmp_path))
    frontend = Frontend(args, tiny_checkpoint)
    frontend.load()
    parse = frontend.parser.parse

    async def slow_parse(raw, chat):
        await asyncio.sleep(PARSE_SECONDS)
        return await parse(raw, chat)

    frontend.parser.parse = slow_parse

    async def go():
        frontend.client.start()
        frontend.client.ready = True
        async with TestClient(TestServer(frontend.app())) as client:
            async def engine():
                while not frontend.client.queues:
                    await asyncio.sleep(0.01)
                (rid, queue), = frontend.client.queues.items()
                queue.put_nowait(TextDelta(rid=rid, text="ok", token_ids=[5], finished=True, finish_reason="length",
                                           usage=Usage(prompt_tokens=1, completion_tokens=1)))

            answer = asyncio.create_task(engine())
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
