"""``tidal bench``: end to end against a CPU ``tidal serve`` (with its tap), against a fake endpoint whose
streams break the protocol, its one-line errors, and the percentile code against a plain computation."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import subprocess
import sys
import threading

import numpy as np
import pytest
from aiohttp import web
from server_harness import API_KEY, Server, free_port

from tidal.bench.cli import PromptIds
from tidal.bench.client import check
from tidal.bench.stats import percentile, summarize

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def keyed_server(tiny_checkpoint):
    """``tidal serve`` of the tiny checkpoint that requires ``server_harness.API_KEY``."""
    srv = Server(tiny_checkpoint)
    yield srv
    assert srv.stop() == []


def bench(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    base_env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    return subprocess.run([sys.executable, "-m", "tidal.cli", "bench", *args], capture_output=True, text=True,
                          timeout=timeout, env={**base_env, **(env or {})})


def loaded(out) -> dict:
    return json.loads((out / "bench.json").read_text())


def assert_ordered(summary: dict) -> None:
    assert summary["min"] <= summary["p50"] <= summary["p90"] <= summary["p99"] <= summary["max"]
    assert summary["min"] <= summary["mean"] <= summary["max"]


def test_bench_against_tidal_server_with_tap(keyed_server, tmp_path):
    out = tmp_path / "run"
    lengths, extra, max_tokens, pairs, warmups, requests = [96, 160], 32, 6, 2, 1, 8
    proc = bench("--base-url", keyed_server.url + "/v1", "--out", str(out),
                 "--prompt-tokens", ",".join(map(str, lengths)), "--extra-tokens", str(extra),
                 "--max-tokens", str(max_tokens), "--pairs", str(pairs), "--warmups", str(warmups),
                 "--requests", str(requests), "--request-rate", "30", "--concurrency", "3", "--seed", "7",
                 "--tap-addr", keyed_server.tap_addr, env={"OPENAI_API_KEY": API_KEY})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checks: all" in proc.stdout and "TTFT s" in proc.stdout
    assert "req/s" in proc.stderr  # the progress bar
    res = loaded(out)

    p = res["parameters"]
    assert p["prompt_tokens"] == lengths and p["max_tokens"] == max_tokens and p["seed"] == 7
    assert p["api_key_given"] is True and API_KEY not in json.dumps(res)
    assert res["server"]["model"] == "tiny" and res["cached_tokens_source"] == "tap"
    assert res["tap"]["messages"] > 0 and res["tap"]["undecodable"] == 0
    assert res["checks"] == {"passed": True, "requests": len(res["samples"]), "failed_requests": 0, "failures": []}

    samples = res["samples"]
    by_phase = {ph: [s for s in samples if s["phase"] == ph] for ph in ("warmup", "pairs", "open_loop")}
    assert len(by_phase["warmup"]) == 2 * warmups
    assert len(by_phase["pairs"]) == 2 * pairs * len(lengths)
    assert len(by_phase["open_loop"]) == requests
    assert len({s["id"] for s in samples}) == len(samples)
    for s in samples:
        assert s["passed"] and all(v is None for v in s["checks"].values())
        assert {"done", "finish_reason", "usage", "completion_tokens_received", "tap", "cached_tokens_agree"} \
            <= set(s["checks"])
        assert s["done"] and s["finish_reason"] == "length" and s["status"] == 200
        assert s["completion_tokens"] == max_tokens == s["usage"]["completion_tokens"]
        assert len(s["token_ids"]) == s["completion_tokens"]
        assert s["cached_tokens_tap"] == s["cached_tokens_usage"] == s["cached_tokens"]
        assert s["tap"]["prompt_tokens"] == s["prompt_tokens"] == s["usage"]["prompt_tokens"]
        assert 0 < s["first_text_s"] <= s["full_s"]
        assert math.isclose(s["output_tok_per_s"], max_tokens / s["full_s"])
        if s["arm"] == "continuation":
            assert s["prompt_tokens"] == s["cold_prompt_tokens"] + extra
            assert 0 < s["cached_tokens"] <= s["cold_prompt_tokens"]
        else:
            assert s["prompt_tokens"] == s["cold_prompt_tokens"] and s["cached_tokens"] == 0

    rows = res["summary"]["pairs"]
    assert [r["cold_prompt_tokens"] for r in rows] == lengths
    for row in rows:
        for arm in ("cold", "continuation"):
            assert row[arm]["count"] == pairs == row[arm]["first_text_s"]["count"]
            assert_ordered(row[arm]["first_text_s"])
            assert_ordered(row[arm]["full_s"])
        assert row["cold"]["cached_tokens"]["max"] == 0 and row["continuation"]["cached_tokens"]["min"] > 0
        assert row["first_text_cold_over_continuation"] > 0

    loop = res["summary"]["open_loop"]
    assert loop["requests"] == loop["answered"] == requests
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        assert_ordered(loop[key])
    assert loop["ttft_s"]["count"] == loop["e2e_s"]["count"] == requests
    assert loop["itl_s"]["count"] == sum(len(s["itl_s"]) for s in by_phase["open_loop"]) > 0
    assert loop["ttft_s"]["p50"] <= loop["e2e_s"]["p50"]
    arrivals = [s["arrival_s"] for s in sorted(by_phase["open_loop"], key=lambda s: s["request"])]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and len(set(arrivals)) == requests
    assert all(s["queue_wait_s"] >= -1e-3 for s in by_phase["open_loop"])
    assert math.isclose(loop["output_throughput"], requests * max_tokens / loop["duration_s"])

    png = (out / "bench.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 10_000


def test_bench_without_tap_reads_usage(keyed_server, tmp_path):
    proc = bench("--base-url", keyed_server.url, "--out", str(tmp_path), "--api-key", API_KEY,
                 "--prompt-tokens", "128", "--extra-tokens", "16", "--max-tokens", "4", "--pairs", "1",
                 "--warmups", "0", "--requests", "0", "--logprobs")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = loaded(tmp_path)
    assert res["cached_tokens_source"] == "usage" and res["tap"] is None and res["summary"]["open_loop"] is None
    cold, cont = res["samples"]
    assert cold["cached_tokens"] == 0 and 0 < cont["cached_tokens"] <= 128
    for s in (cold, cont):
        assert s["token_ids"] is None and s["cached_tokens_tap"] is None
        assert "completion_tokens_received" in s["checks"] and s["passed"]  # counted from the logprobs


@pytest.mark.parametrize("args, words", [
    (["--api-key", "wrong"], ["401", "--api-key"]),
    (["--concurrency", "0"], ["--concurrency", "1 or more"]),
    (["--prompt-tokens", "32,x"], ["--prompt-tokens"]),
    (["--token-ids", "1000:1002", "--pairs", "3"], ["--token-ids", "distinct"]),
    (["--tap-addr", "ipc:///tmp/tidal-no-such-tap", "--warmups", "1", "--pairs", "1", "--requests", "0",
      "--prompt-tokens", "16", "--max-tokens", "2"], ["--tap-addr", "nothing was published"]),
])
def test_bad_input_is_one_line(keyed_server, tmp_path, args, words):
    proc = bench("--base-url", keyed_server.url, "--out", str(tmp_path), *args, env={"OPENAI_API_KEY": API_KEY})
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tidal bench: error:") and all(w in last for w in words), proc.stderr
    assert not (tmp_path / "bench.json").exists()


def test_unreachable_url_is_one_line(tmp_path):
    proc = bench("--base-url", f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "cannot reach" in proc.stderr, proc.stderr


class FakeEndpoint:
    """An aiohttp OpenAI look-alike in a thread whose streams break the protocol in one ``mode``:
    ``no_done`` leaves out ``data: [DONE]``; ``short_usage`` ends with ``length`` but reports one token
    fewer than ``max_tokens``."""

    def __init__(self, mode: str):
        self.mode, self.port = mode, free_port()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        ready.set()
        self.loop.run_forever()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = body["max_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def event(data: dict) -> None:
            await resp.write(b"data: " + json.dumps(data).encode() + b"\n\n")

        for i in range(n):
            choice = {"index": 0, "text": f" t{i}", "finish_reason": None}
            if body.get("logprobs") is not None:
                choice["logprobs"] = {"tokens": [f" t{i}"], "token_logprobs": [-1.0]}
            await event({"id": "cmpl-fake", "choices": [choice]})
        await event({"id": "cmpl-fake", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        completion = n - 1 if self.mode == "short_usage" else n
        await event({"id": "cmpl-fake", "choices": [], "usage": {
            "prompt_tokens": len(body["prompt"]), "completion_tokens": completion}})
        if self.mode != "no_done":
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.mark.parametrize("mode, failing", [
    ("no_done", {"done"}),
    ("short_usage", {"length_is_max_tokens", "completion_tokens_received"}),
])
def test_a_failing_check_fails_the_run(tmp_path, mode, failing):
    fake = FakeEndpoint(mode)
    try:
        proc = bench("--base-url", f"http://127.0.0.1:{fake.port}", "--out", str(tmp_path), "--prompt-tokens", "8",
                     "--max-tokens", "3", "--warmups", "0", "--pairs", "1", "--requests", "2", "--logprobs")
    finally:
        fake.close()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED" in proc.stdout and all(name in proc.stdout for name in failing)
    res = loaded(tmp_path)
    assert res["server"]["model"] == "fake"
    assert res["checks"]["passed"] is False and res["checks"]["failed_requests"] == res["checks"]["requests"] == 4
    assert {f["check"] for f in res["checks"]["failures"]} == failing
    assert sorted({f["sample"] for f in res["checks"]["failures"]}) == [0, 1, 2, 3]
    for s in res["samples"]:
        assert not s["passed"] and {k for k, v in s["checks"].items() if v is not None} == failing
    assert (tmp_path / "bench.png").read_bytes()[:8] == PNG_MAGIC


def plain_percentile(values: list[float], q: float) -> float:
    xs = sorted(values)
    rank = (len(xs) - 1) * q / 100
    below = int(rank)
    if below == len(xs) - 1:
        return xs[below]
    return xs[below] * (1 - (rank - below)) + xs[below + 1] * (rank - below)


def test_percentiles_and_summary_match_a_plain_computation():
    rng = random.Random(3)
    for n in (1, 2, 5, 100, 1001):
        values = [rng.expovariate(2.0) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 99.9, 100):
            assert math.isclose(percentile(values, q), plain_percentile(values, q), rel_tol=1e-12)
            assert math.isclose(percentile(values, q), float(np.percentile(values, q)), rel_tol=1e-12)
        s = summarize(values + [None])
        assert s["count"] == n and math.isclose(s["mean"], sum(values) / n)
        assert (s["p50"], s["p90"], s["p99"]) == tuple(percentile(values, q) for q in (50, 90, 99))
        assert s["min"] == min(values) and s["max"] == max(values)
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert summarize([None])["count"] == 0 and summarize([])["p99"] is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_prompts_share_no_prefix():
    prompts = PromptIds(5, 10, 200, 40)
    cold = [prompts.cold(n) for n in (1, 3, 3, 50) * 10]
    assert len({c[0] for c in cold}) == 40  # distinct first ids: none is a prefix of another
    assert all(10 <= t < 200 for c in cold for t in c)
    assert [len(c) for c in cold] == [1, 3, 3, 50] * 10
    assert PromptIds(5, 10, 200, 40).cold(50) == PromptIds(5, 10, 200, 40).cold(50)  # seeded
    with pytest.raises(ValueError, match="--token-ids"):
        PromptIds(0, 0, 3, 4)


def test_checks_of_one_stream():
    obs = {"status": 200, "error": None, "done": True, "finish_reason": "length", "first_text_s": 0.1,
           "usage": {"prompt_tokens": 5, "completion_tokens": 4}}
    assert all(v is None for v in check(obs, 5, 4, 4).values())
    assert check(obs, 5, 4, None).keys() == {"done", "finish_reason", "first_text", "usage", "prompt_tokens",
                                             "length_is_max_tokens"}
    assert check(obs, 5, 4, 3)["completion_tokens_received"]
    assert check(obs, 6, 4, 4)["prompt_tokens"]
    assert check({**obs, "finish_reason": None}, 5, 4, 4)["finish_reason"] == "no finish_reason"
    assert check({**obs, "finish_reason": "abort"}, 5, 4, 4)["finish_reason"]
    assert check({**obs, "finish_reason": "stop", "usage": {"completion_tokens": 2}}, 5, 4, 2) == {
        "done": None, "finish_reason": None, "first_text": None, "usage": None, "completion_tokens_received": None}
    assert check({**obs, "usage": None}, 5, 4, 4)["usage"]
    assert check({**obs, "status": 500, "error": "HTTP 500: boom"}, 5, 4, 4) == {"response": "HTTP 500: boom"}
    broken = check({**obs, "error": "error event: boom", "done": False}, 5, 4, 4)
    assert broken["response"] == "error event: boom" and broken["done"]
