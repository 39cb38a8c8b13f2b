"""One streamed ``/v1/completions`` request: its timings as the seeds' protocol measures them, and its checks.

Timing starts on a monotonic clock just before the HTTP request is sent. First text is the first SSE
event carrying a non-empty ``choices[].text``; the full-response time runs to the end of the stream. Request
bodies are encoded with msgspec, inside the timed span: a 32K-id prompt in well under a millisecond, where the
standard library's ``json`` takes a few.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec

# The finish reasons a completion may end with (OpenAI's list for the completions endpoint).
VALID_FINISH = ("stop", "length", "content_filter")


class EndpointError(ValueError):
    """The endpoint cannot be benchmarked at all (unreachable, refused the key, no model)."""


def _error_text(status: int, body: bytes) -> str:
    try:
        data = json.loads(body)
        msg = data.get("error", {}).get("message") if isinstance(data.get("error"), dict) else data.get("error")
        if msg:
            return f"HTTP {status}: {msg}"
    except (ValueError, AttributeError):
        pass
    text = body.decode(errors="replace").strip().splitlines()
    return f"HTTP {status}" + (f": {text[0][:200]}" if text else "")


async def list_models(session: aiohttp.ClientSession, base: str, required: bool = True) -> list[dict]:
    """``GET /v1/models``; an ``EndpointError`` with the reason when the endpoint is unusable. Without
    ``required`` (the model is named by the user) a server without that route gives an empty list."""
    url = base + "/v1/models"
    try:
        async with session.get(url) as r:
            status, body = r.status, await r.read()
    except aiohttp.ClientError as e:
        raise EndpointError(f"cannot reach {url}: {e}") from None
    if status == 401:
        raise EndpointError(f"{url} refused the request ({_error_text(status, body)}); "
                            "give the key with --api-key or OPENAI_API_KEY")
    if status == 404 and not required:
        return []
    if status != 200:
        raise EndpointError(f"{url} answered {_error_text(status, body)}")
    try:
        data = json.loads(body).get("data")
    except (ValueError, AttributeError):
        data = None
    if not isinstance(data, list) or not all(isinstance(m, dict) and "id" in m for m in data):
        raise EndpointError(f"{url} did not answer with an OpenAI model list")
    return data


_JSON = {"Content-Type": "application/json"}


def post_json(session: aiohttp.ClientSession, url: str, body: dict[str, Any]):
    """``session.post(url, json=body)``, the body encoded by msgspec."""
    return session.post(url, data=msgspec.json.encode(body), headers=_JSON)


def request_body(model: str, prompt: str | list[int], max_tokens: int, logprobs: bool) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if logprobs:
        body["logprobs"] = 0
    return body


async def stream_completion(session: aiohttp.ClientSession, base: str, body: dict[str, Any],
                            on_first_text: Callable[[], None] | None = None) -> dict[str, Any]:
    """Send one streamed completion and read it to the end (``on_first_text`` is called as the first
    non-empty text arrives).

    Returns the raw observations: ``status``, ``error``, ``id``, ``first_text_s``, ``full_s``,
    ``text_event_s`` (offsets of the non-empty text events), ``text`` (choice 0's), ``finish_reason``,
    ``done`` (the last event was ``[DONE]``), ``usage`` and ``logprob_tokens`` (tokens counted from
    ``logprobs``, when asked).
    """
    out: dict[str, Any] = {"status": None, "error": None, "id": None, "first_text_s": None, "full_s": None,
                           "text_event_s": [], "text_chars": 0, "text": "", "finish_reason": None, "done": False,
                           "usage": None, "logprob_tokens": 0 if body.get("logprobs") is not None else None}
    t0 = time.monotonic()
    try:
        async with post_json(session, base + "/v1/completions", body) as r:
            out["status"] = r.status
            if r.status != 200:
                out["error"] = _error_text(r.status, await r.read())
                out["full_s"] = time.monotonic() - t0
                return out
            async for raw in r.content:
                now = time.monotonic() - t0
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out["done"] = True
                    continue
                out["done"] = False  # [DONE] must be the last event
                try:
                    chunk = json.loads(data)
                except ValueError:
                    out["error"] = out["error"] or f"an SSE event is not JSON: {data[:120]!r}"
                    continue
                first = out["first_text_s"]
                _read_chunk(chunk, now, out)
                if first is None and out["first_text_s"] is not None and on_first_text is not None:
                    on_first_text()
    except (aiohttp.ClientError, TimeoutError) as e:
        out["error"] = out["error"] or f"{type(e).__name__}: {e}"
    out["full_s"] = time.monotonic() - t0
    return out


def stream_sync(url: str, body: dict[str, Any], api_key: str | None = None, timeout: float = 1800.0,
                on_first_text: Callable[[], None] | None = None) -> dict[str, Any]:
    """:func:`stream_completion` from synchronous code (a thread of its own each, for concurrency)."""
    import asyncio

    async def one() -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as s:
            return await stream_completion(s, url, body, on_first_text)

    return asyncio.run(one())


def greedy_stream(url: str, prompt: str | list[int], max_tokens: int, model: str,
                  on_first_text: Callable[[], None] | None = None) -> dict[str, Any]:
    """One streamed greedy completion of exactly ``max_tokens`` tokens (``ignore_eos``) from synchronous
    code: :func:`stream_completion`'s observations, ``rid`` (the tap's name for it) added; an
    ``EndpointError`` when the server refused it."""
    from .tap import tap_rid

    out = stream_sync(url, request_body(model, prompt, max_tokens, logprobs=False), on_first_text=on_first_text)
    if out["status"] != 200 or out["error"]:
        raise EndpointError(f"{url}: {out['error'] or out['status']}")
    out["rid"] = tap_rid(out["id"])
    return out


def _read_chunk(chunk: dict, now: float, out: dict[str, Any]) -> None:
    if not isinstance(chunk, dict):
        out["error"] = out["error"] or f"an SSE event is not a JSON object: {chunk!r:.120}"
        return
    if "error" in chunk:
        err = chunk["error"]
        out["error"] = out["error"] or f"error event: {err.get('message') if isinstance(err, dict) else err}"
        return
    out["id"] = out["id"] or chunk.get("id")
    if chunk.get("usage"):
        out["usage"] = chunk["usage"]
    for choice in chunk.get("choices") or []:
        text = choice.get("text") or ""
        if text and choice.get("index", 0) == 0:
            out["text"] += text
        if text:
            out["text_event_s"].append(now)
            out["text_chars"] += len(text)
            if out["first_text_s"] is None:
                out["first_text_s"] = now
        if choice.get("finish_reason"):
            out["finish_reason"] = choice["finish_reason"]
        lp = choice.get("logprobs")
        if out["logprob_tokens"] is not None and isinstance(lp, dict):
            out["logprob_tokens"] += len(lp.get("tokens") or [])


def check(obs: dict[str, Any], prompt_tokens: int, max_tokens: int, received: int | None) -> dict[str, str | None]:
    """The protocol's checks of one request: check name -> ``None`` when it passed, else what failed.

    ``received`` is the number of generated tokens seen independently of ``usage`` (the tap's token
    ids or the streamed ``logprobs``); without it that comparison is not made.
    """
    res: dict[str, str | None] = {}
    if obs["status"] != 200:  # refused or unreachable: nothing else to check
        return {"response": obs["error"] or f"HTTP {obs['status']}"}
    if obs["error"]:
        res["response"] = obs["error"]
    res["done"] = None if obs["done"] else "the stream did not end with data: [DONE]"
    reason = obs["finish_reason"]
    res["finish_reason"] = None if reason in VALID_FINISH else (
        "no finish_reason" if reason is None else f"finish_reason {reason!r} is not one of {', '.join(VALID_FINISH)}")
    res["first_text"] = None if obs["first_text_s"] is not None else "no event carried text"
    usage = obs["usage"]
    completion = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(completion, int):
        res["usage"] = "no usage.completion_tokens in the stream (stream_options.include_usage)"
        return res
    res["usage"] = None
    if usage.get("prompt_tokens") is not None:
        res["prompt_tokens"] = None if usage["prompt_tokens"] == prompt_tokens else (
            f"usage.prompt_tokens {usage['prompt_tokens']} != {prompt_tokens} sent")
    if received is not None:
        res["completion_tokens_received"] = None if completion == received else (
            f"usage.completion_tokens {completion} != {received} tokens received")
    if reason == "length":
        res["length_is_max_tokens"] = None if completion == max_tokens else (
            f"finish_reason length with usage.completion_tokens {completion} != max_tokens {max_tokens}")
    return res


async def stream_events(http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                        events: list[float], info: dict, model: str = "bench") -> None:
    """One greedy streamed completion of ``max_tokens`` (``ignore_eos``); the arrival time
    (``time.monotonic``) of each SSE event with text is appended to ``events`` as it comes, so a cancelled
    stream keeps what it saw; ``info`` gets the response ``id`` and the final ``usage``."""
    body = request_body(model, prompt, max_tokens, logprobs=False)
    async with post_json(http, url + "/v1/completions", body) as r:
        if r.status != 200:
            raise EndpointError(f"{url}: {_error_text(r.status, await r.read())}")
        async for raw in r.content:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            info.setdefault("id", chunk.get("id"))
            if chunk.get("usage"):
                info["usage"] = chunk["usage"]
            if any(c.get("text") for c in chunk.get("choices") or []):
                events.append(time.monotonic())
