"""HTTP frontend: the OpenAI API over aiohttp on uvloop.

aiohttp rather than starlette + uvicorn: one dependency that is both the server and (for tests
and ``tidal bench``) the client, native SSE through ``StreamResponse``, and handler cancellation
on client disconnect, which is how a closed stream aborts its request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import zmq
from aiohttp import web

from ..config.model import ModelConfig
from ..config.pools import pool_sizes
from ..config.server_args import ServerArgs
from ..messages import Drained, GenerateReq, Ready, SamplingParams, TextDelta, Usage
from ..runtime.ipc import Push
from ..tokenizer import load_tokenizer
from ..vision import ImageProcessor
from .engine_client import EngineClient
from .errors import APIError
from .logprobs import chat_logprobs, completion_logprobs
from .metrics import Metrics
from .parse_pool import ParsePool
from .parsers import ChatOutput, thinking_closed
from .protocol import (
    Limits,
    PackedIds,
    ParsedRequest,
    chat_chunk,
    completion_chunk,
    full_response,
    usage_body,
    usage_chunk,
)

logger = logging.getLogger(__name__)


@dataclass
class Choice:
    """One choice of a request (prompt p's choice i, its own request to the scheduler) as the handler
    follows it. ``share``: with echo and log-probabilities, choice 0 of a prompt computes the prompt's
    entries and hands them to the prompt's other choices through the future (``(is choice 0, future)``)."""

    rid: str
    prompt_ids: list[int] | PackedIds
    queue: asyncio.Queue
    share: tuple[bool, asyncio.Future] | None = None
    first_at: float | None = None  # when the first token arrived
    last_at: float = 0.0  # when the latest token arrived
    ttft: float | None = None
    finished: bool = False  # the request ended on the server

    def hand_over(self, entries: list | None) -> None:
        """Choice 0 gives its prompt's entries (``None``: it failed) to the other choices, once."""
        if self.share is not None and self.share[0] and not self.share[1].done():
            self.share[1].set_result(entries)


def _json(data, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data, ensure_ascii=False), status=status, content_type="application/json")


def _error(err: APIError) -> web.Response:
    # ASCII escapes: a message or param may quote text that is not valid Unicode (a lone surrogate).
    response = web.Response(text=json.dumps(err.body()), status=err.status, content_type="application/json")
    if err.retry_after is not None:
        response.headers["Retry-After"] = str(err.retry_after)
    return response


def _sse(data) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


def image_processor(args: ServerArgs, config: ModelConfig, model_path: str, tokenizer) -> ImageProcessor | None:
    """The image processor of a model with a vision tower (None: text only)."""
    if config.vision_config is None:
        return None
    pad = tokenizer.encode_with_special("<|image_pad|>")
    if pad != [config.image_token_id]:
        logger.warning("the tokenizer encodes <|image_pad|> as %s, not the image token id %d of config.json: "
                       "serving text only", pad, config.image_token_id)
        return None
    return ImageProcessor.from_checkpoint(model_path, config.vision_config, config.image_token_id,
                                          max_images=args.max_images_per_request,
                                          max_image_pixels=args.max_image_pixels,
                                          allowed_domains=tuple(args.allowed_media_domains))


class Frontend:
    """The HTTP API of one server. Built in two steps, so that the port answers (503, ``starting``) while the
    tokenizer loads: the constructor sets up what ``/health`` and ``/metrics`` need, :meth:`load` the
    tokenizer, the request limits and the parse pool."""

    def __init__(self, args: ServerArgs, model_path: str):
        self.args, self.model_path = args, model_path
        self.metrics = Metrics()
        self.client = EngineClient(args.scheduler_addr, args.bind_addr(args.frontend_addr), self.metrics)
        self.created = int(time.time())
        self.loaded = False  # :meth:`load` is done

    def load(self) -> None:
        args, model_path = self.args, self.model_path
        config = ModelConfig.from_file(model_path).with_quantization(args.quantization, args.load_format)
        sizes = pool_sizes(args, config)
        self.tokenizer = load_tokenizer(model_path)
        max_token_bytes = max((len(self.tokenizer.token_bytes(i)) for i in range(self.tokenizer.n_vocab)), default=0)
        self.limits = Limits(model_name=args.model_name, max_model_len=sizes.max_model_len,
                             kv_capacity=sizes.num_pages * sizes.page_size, vocab_size=config.vocab_size,
                             default_max_tokens=args.default_max_tokens, max_token_bytes=max_token_bytes,
                             max_requests=args.max_running_requests + args.max_queued_requests,
                             images=image_processor(args, config, model_path, self.tokenizer))
        # The stored format of the weights, as /v1/models reports it (null: the checkpoint's float dtype).
        self.quantization = config.quantization.label if config.quantization is not None else None
        self.parser = ParsePool(model_path, self.limits, args.tokenizer_workers)
        self.loaded = True

    # ---- app --------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.args.max_request_bytes, middlewares=[self._errors, self._auth])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_get("/", self.chat_page)
        return app

    async def chat_page(self, request: web.Request) -> web.Response:
        """The chat page: one static file that loads without a key; its own API calls send the key."""
        return web.Response(body=Path(__file__).with_name("chat.html").read_bytes(), headers={
            "Content-Type": "text/html; charset=utf-8", "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
            "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                       "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                                       "frame-ancestors 'none'"})

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except APIError as e:
            if e.status in (400, 413, 503):
                self.metrics.rejected += 1
            return _error(e)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            response = _error(APIError(e.status, e.reason or "error", type_="invalid_request_error"))
            if "Allow" in e.headers:  # 405: the methods the path takes
                response.headers["Allow"] = e.headers["Allow"]
            return response
        except Exception:  # a bug must not take the connection down without an answer
            logger.exception("unhandled error on %s %s", request.method, request.path)
            return _error(APIError(500, "internal server error", type_="server_error"))

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.args.api_key and request.path.startswith("/v1/"):
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")  # bytes as sent
            if not hmac.compare_digest(given, f"Bearer {self.args.api_key}".encode()):  # constant time
                raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                               type_="authentication_error", code="invalid_api_key")
        return await handler(request)

    async def health(self, request: web.Request) -> web.Response:
        if self.client.ready:
            return _json({"status": "ok"})
        return _json({"status": "unavailable", "reason": self.client.failure or "starting"}, status=503)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.render(), content_type="text/plain")

    async def models(self, request: web.Request) -> web.Response:
        if not self.loaded:
            raise APIError(503, "the server is not ready (starting); retry shortly", type_="service_unavailable",
                           retry_after=1)
        return _json({"object": "list", "data": [{
            "id": self.limits.model_name, "object": "model", "created": self.created, "owned_by": "tidal",
            "max_model_len": self.limits.max_model_len, "quantization": self.quantization}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    # ---- generation -------------------------------------------------------------------------
    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if not self.client.ready:
            reason = self.client.failure or "starting"
            raise APIError(503, f"the server is not ready ({reason}); retry shortly", type_="service_unavailable",
                           retry_after=1)
        arrival = time.monotonic()  # time to first token counts tokenization too
        capacity = self.args.max_running_requests + self.args.max_queued_requests
        if len(self.client.queues) >= capacity:
            raise APIError(503, f"the server is at capacity: {capacity} requests running or queued "
                                f"(--max-running-requests + --max-queued-requests); retry shortly",
                           type_="service_unavailable", retry_after=1)
        raw = await self._read_body(request)
        # The scheduler counts the bodies being tokenized: prompts that arrive together wait briefly for each other
        # (--batch-wait-ms) and share one forward. A body's requests go out before the count drops.
        try:
            await self.client.tokenizing(+1)  # counted before its message goes: a cancelled handler still counts out
            parsed, choices = await self._submit(raw, chat, capacity)
        finally:
            await self.client.tokenizing(-1)
        n = parsed.controls.get("n", 1)
        try:
            if parsed.stream:
                return await self._stream(request, choices, parsed, arrival, n)
            results = await asyncio.gather(*(self._collect(c, parsed, arrival) for c in choices))
            return _json(self._merge(results, n))
        finally:
            for choice in choices:
                if choice.finished:
                    self.client.release(choice.rid)
                else:  # client gone or handler failed: free everything the request holds
                    self.metrics.finished("abort", None)
                    logger.info("request rid=%s finish_reason=abort e2e_s=%.4f (the client went away)", choice.rid,
                                time.monotonic() - arrival)
                    asyncio.get_running_loop().create_task(self.client.abort(choice.rid))

    async def _submit(self, raw: bytes, chat: bool, capacity: int) -> tuple[ParsedRequest, list[Choice]]:
        """Parse a request body and send the scheduler its requests: one per prompt and choice."""
        # JSON parsing, validation, chat templates and tokenization run in a tokenizer worker process: a long
        # prompt must not stall every other stream and /health on the event loop.
        parsed = await self.parser.parse(raw, chat)
        rid = uuid.uuid4().hex
        n = parsed.controls.get("n", 1)
        # Choice index p * n + i: prompt p's choice i. Choice i > 0 is its own request, admitted once
        # choice 0 has computed the prompt (it finds the prompt in the prefix cache); with a seed,
        # choice index c samples with seed + c. Echo with logprobs (or with max_tokens 0) asks for
        # the prompt's log-probabilities: such a request computes its whole prompt. Choice 0 of a prompt
        # does, and hands the entries to the prompt's other choices (``Choice.share``), which then find the
        # prompt in the prefix cache like any choice i > 0.
        prompts = parsed.prompts or [parsed.prompt_ids]
        max_tokens = parsed.prompt_max_tokens or [parsed.max_tokens]
        if len(prompts) * n > 1 and len(self.client.queues) + len(prompts) * n > capacity:
            raise APIError(503, f"the server is at capacity: this request's {len(prompts) * n} choices do not fit "
                                f"beside the requests in flight ({capacity} at most: --max-running-requests + "
                                f"--max-queued-requests); retry shortly", type_="service_unavailable", retry_after=1)
        prompt_lp = max(parsed.logprobs, 0) if parsed.echo and (parsed.logprobs >= 0 or not max(max_tokens)) else -1
        choices: list[Choice] = []
        for p, ids in enumerate(prompts):
            base = rid if p == 0 else f"{rid}-{p}"
            entries = asyncio.get_running_loop().create_future() if prompt_lp >= 0 and max_tokens[p] else None
            for i in range(n):
                choice_rid = base if i == 0 else f"{base}.{i}"
                seed = None if parsed.seed is None else (parsed.seed + p * n + i + 2**63) % 2**64 - 2**63
                queue = await self.client.submit(GenerateReq(
                    rid=choice_rid, prompt_ids=ids.raw() if isinstance(ids, PackedIds) else ids,
                    max_tokens=max_tokens[p],
                    sampling=SamplingParams(temperature=parsed.temperature, top_p=parsed.top_p, top_k=parsed.top_k,
                                            min_p=parsed.min_p,
                                            seed=seed, logprobs=parsed.logprobs, **parsed.controls["sampling"]),
                    ignore_eos=parsed.ignore_eos, stop=parsed.stop, skip_special_tokens=parsed.skip_special_tokens,
                    stop_token_ids=parsed.controls["stop_token_ids"],
                    include_stop_str_in_output=parsed.controls["include_stop_str_in_output"],
                    after=None if i == 0 else base,
                    prompt_logprobs=prompt_lp if i == 0 or entries is None else -1, images=parsed.images))
                choices.append(Choice(choice_rid, ids, queue, None if entries is None else (i == 0, entries)))
        return parsed, choices

    @staticmethod
    def _merge(results: list[dict], n: int) -> dict:
        """One response of several choices: each prompt counted once, the completions summed."""
        body = results[0]
        if len(results) > 1:
            body["choices"] = [{**r["choices"][0], "index": i} for i, r in enumerate(results)]
            completion = sum(r["usage"]["completion_tokens"] for r in results)
            body["usage"]["completion_tokens"] = completion
            firsts = [r["usage"] for r in results[::n]]
            body["usage"]["prompt_tokens"] = sum(u["prompt_tokens"] for u in firsts)
            body["usage"]["prompt_tokens_details"] = {
                "cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in firsts)}
            body["usage"]["total_tokens"] = body["usage"]["prompt_tokens"] + completion
        return body

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.args.max_request_bytes
        size = request.content_length
        if size is None or size <= limit:
            try:
                return await request.read()
            except web.HTTPRequestEntityTooLarge:
                size = None  # chunked: aiohttp stopped reading at the limit
        length = f"{size} bytes" if size is not None else f"more than {limit} bytes"
        raise APIError(413, f"the request body is {length}; this server accepts at most {limit} bytes "
                            "(--max-request-bytes)", code="request_too_large")

    async def _next(self, choice: Choice, arrival: float) -> TextDelta:
        delta: TextDelta = await choice.queue.get()
        now = time.monotonic()
        if delta.token_ids:
            if choice.first_at is None:
                choice.first_at, choice.ttft = now, now - arrival
                self.metrics.observe_ttft(now - arrival)
            else:
                self.metrics.observe_tokens(now - choice.last_at, len(delta.token_ids))
            choice.last_at = now
        if delta.finished:
            choice.finished = True
            if delta.error_status != 400:  # a request refused at admission counts as rejected, once
                self.metrics.finished(delta.finish_reason, delta.usage, now - arrival)
            self._log_finished(delta, choice.ttft, now - arrival)
        return delta

    @staticmethod
    def _log_finished(delta: TextDelta, ttft: float | None, seconds: float) -> None:
        """One logfmt line per finished request (per choice), keyed by its request id."""
        u = delta.usage
        fields = {"rid": delta.rid, "finish_reason": delta.finish_reason or "error",
                  "prompt_tokens": u.prompt_tokens if u else None, "cached_tokens": u.cached_tokens if u else None,
                  "completion_tokens": u.completion_tokens if u else None,
                  "ttft_s": f"{ttft:.4f}" if ttft is not None else None, "e2e_s": f"{seconds:.4f}"}
        if delta.error:
            fields["error"] = json.dumps(delta.error[:200])
        logger.info("request %s", " ".join(f"{k}={v}" for k, v in fields.items() if v is not None))

    @staticmethod
    def _failure(delta: TextDelta) -> APIError:
        if delta.error_status == 400:
            return APIError(400, delta.error or "the request cannot be served")
        if delta.error_status == 503:
            return APIError(503, delta.error or "the server is shutting down", type_="service_unavailable",
                            retry_after=1)
        return APIError(500, delta.error or "the request failed", type_="server_error")

    def _ending(self, parsed: ParsedRequest, delta: TextDelta, parts: list[str], ids: list[int],
                output: ChatOutput | None) -> tuple[str, str | None]:
        """A choice that finished well: its text and finish reason as its parser (if any) gives them; a chat
        answer is remembered so that a later conversation quoting it re-encodes to the same ids."""
        text = output.content if output is not None else "".join(parts)
        if parsed.chat and delta.finish_reason in ("stop", "length"):
            self.parser.remember(text, ids)
        return text, output.finish_reason(delta.finish_reason) if output is not None else delta.finish_reason

    def _output(self, parsed: ParsedRequest) -> ChatOutput | None:
        """The parser of a chat answer's reasoning and tool calls (None: the text as generated)."""
        reasoning = self.args.reasoning_parser is not None
        if not parsed.chat or not (reasoning or parsed.parse_tool_calls):
            return None
        return ChatOutput(self.tokenizer, parsed.stop, parsed.skip_special_tokens,
                          not thinking_closed(self.tokenizer, parsed.prompt_ids) if reasoning else None,
                          parsed.parse_tool_calls, parsed.parallel_tool_calls,
                          include_stop=parsed.controls.get("include_stop_str_in_output", False))

    def _logprobs(self, parsed: ParsedRequest, ids: list[int], entries: list, offset: int) -> dict | None:
        """The ``logprobs`` of a choice or chunk covering tokens ``ids`` (None when not asked)."""
        if parsed.logprobs < 0:
            return None
        ids = ids[:len(entries)]
        if parsed.chat:
            return chat_logprobs(self.tokenizer, ids, entries)
        return completion_logprobs(self.tokenizer, ids, entries, offset)

    def _echo(self, parsed: ParsedRequest, prompt_ids: list[int] | PackedIds,
              prompt_entries: list | None) -> tuple[str, dict | None]:
        """Echo: the prompt's text and (with logprobs) its entries; the first token has none."""
        text = self.tokenizer.decode(prompt_ids, skip_special=False)
        if parsed.logprobs < 0:
            return text, None
        entries = [None] + list(prompt_entries or [])
        return text, completion_logprobs(self.tokenizer, prompt_ids[:len(entries)], entries, 0)

    @staticmethod
    async def _prompt_entries(choice: Choice, own: list | None) -> list | None:
        """Echo's prompt entries of a choice: its own, or those of its prompt's choice 0."""
        if choice.share is None:
            return own
        owner, entries = choice.share
        if owner:
            choice.hand_over(own)
            return own
        return await entries

    async def _collect(self, choice: Choice, parsed: ParsedRequest, arrival: float) -> dict:
        parts, ids, entries, prompt_entries = [], [], [], None
        try:
            while True:
                delta = await self._next(choice, arrival)
                parts.append(delta.text)
                ids += delta.token_ids
                entries += delta.logprobs or []
                if delta.prompt_logprobs is not None:
                    prompt_entries = delta.prompt_logprobs
                if delta.finished:
                    break
        finally:  # a choice 0 that failed still releases its prompt's other choices
            choice.hand_over(prompt_entries)
        prompt_entries = await self._prompt_entries(choice, prompt_entries)
        if delta.finish_reason == "error":
            raise self._failure(delta)
        output = self._output(parsed)
        if output is not None:
            output.feed(ids, finished=True)
        text, reason = self._ending(parsed, delta, parts, ids, output)
        usage = delta.usage or Usage(prompt_tokens=len(choice.prompt_ids), completion_tokens=0)
        echoed, echo_logprobs = self._echo(parsed, choice.prompt_ids, prompt_entries) if parsed.echo else ("", None)
        body = full_response(choice.rid, int(time.time()), parsed.model, parsed.chat, echoed + text, reason, usage)
        if output is not None:
            body["choices"][0]["message"].update(output.message())
        logprobs = self._logprobs(parsed, ids, entries, len(echoed))
        if echo_logprobs is not None:
            logprobs = {k: echo_logprobs[k] + logprobs[k] for k in echo_logprobs}
        body["choices"][0]["logprobs"] = logprobs
        return body

    async def _stream(self, request, choices: list[Choice], parsed: ParsedRequest, arrival: float,
                      n: int) -> web.StreamResponse:
        created, model, rid = int(time.time()), parsed.model, choices[0].rid
        first = await self._next(choices[0], arrival)
        # Errors before the first token (admission) still get a proper status and error body.
        if first.finished and first.finish_reason == "error" and not first.text:
            raise self._failure(first)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        lock = asyncio.Lock()

        async def write(chunk: dict, index: int, tokens: int | Usage | None = None) -> None:
            """``tokens``: the choice's completion tokens so far (its ``Usage`` at its end), for the usage a
            chunk carries with ``continuous_usage_stats``."""
            for choice in chunk.get("choices", []):
                choice["index"] = index
            if parsed.continuous_usage and tokens is not None:
                if isinstance(tokens, Usage):
                    chunk["usage"] = usage_body(tokens)
                else:
                    prompt = len(choices[index].prompt_ids)
                    chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": tokens,
                                      "total_tokens": prompt + tokens}
            async with lock:
                await response.write(_sse(chunk))

        usages = await asyncio.gather(*(
            self._stream_choice(write, i, rid, parsed, choice, arrival, created, first if i == 0 else None)
            for i, choice in enumerate(choices)))
        if parsed.include_usage and any(u is not None for u in usages):  # the choices that ran
            firsts = [u for u in usages[::n] if u is not None]
            usage = Usage(prompt_tokens=sum(u.prompt_tokens for u in firsts),
                          completion_tokens=sum(u.completion_tokens for u in usages if u is not None),
                          cached_tokens=sum(u.cached_tokens for u in firsts))
            await response.write(_sse(usage_chunk(rid, created, model, parsed.chat, usage)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _stream_choice(self, write, index: int, rid: str, parsed: ParsedRequest, choice: Choice,
                             arrival: float, created: int, delta: TextDelta | None) -> Usage | None:
        """One choice's chunks (``index``; ids ``rid``, the request's); its usage, or ``None`` when it failed."""
        model = parsed.model
        try:
            if delta is None:
                delta = await self._next(choice, arrival)
        finally:  # choice 0's first message carries its prompt's entries (or its error)
            choice.hand_over(delta.prompt_logprobs if delta is not None else None)
        if parsed.chat:
            await write(chat_chunk(rid, created, model, {"role": "assistant", "content": ""}, None), index, 0)
        parts, ids = [], []
        pending_ids, pending_entries, sent = [], [], 0  # tokens whose log-probabilities are not out yet
        if parsed.echo:  # the prompt first (its log-probabilities arrive before any output token)
            prompt_entries = await self._prompt_entries(choice, delta.prompt_logprobs)
            echoed, echo_logprobs = self._echo(parsed, choice.prompt_ids, prompt_entries)
            chunk = completion_chunk(rid, created, model, echoed, None)
            chunk["choices"][0]["logprobs"] = echo_logprobs
            sent = len(echoed)
            await write(chunk, index, 0)
        output = self._output(parsed)
        while True:
            parts.append(delta.text)
            ids += delta.token_ids
            pending_ids += delta.token_ids
            pending_entries += delta.logprobs or []
            if output is not None:  # reasoning, content and tool-call deltas of the parsed text
                for message in output.feed(delta.token_ids, finished=delta.finished):
                    chunk = chat_chunk(rid, created, model, message, None)
                    chunk["choices"][0]["logprobs"] = self._logprobs(parsed, pending_ids, pending_entries, sent)
                    pending_ids, pending_entries = [], []
                    await write(chunk, index, len(ids))
            elif delta.text:
                chunk = chat_chunk(rid, created, model, {"content": delta.text}, None) if parsed.chat \
                    else completion_chunk(rid, created, model, delta.text, None)
                chunk["choices"][0]["logprobs"] = self._logprobs(parsed, pending_ids, pending_entries, sent)
                pending_ids, pending_entries = [], []
                sent += len(delta.text)
                await write(chunk, index, len(ids))
            if delta.finished:
                break
            delta = await self._next(choice, arrival)
        if delta.finish_reason == "error":  # an error event naming the choice
            body = self._failure(delta).body()
            body["error"]["index"] = index
            await write(body, index)
            return None
        _, reason = self._ending(parsed, delta, parts, ids, output)
        final = chat_chunk(rid, created, model, {}, reason) if parsed.chat \
            else completion_chunk(rid, created, model, "", delta.finish_reason)
        if pending_entries:
            final["choices"][0]["logprobs"] = self._logprobs(parsed, pending_ids, pending_entries, sent)
        await write(final, index, delta.usage if delta.usage is not None else len(ids))
        return delta.usage


async def serve_frontend(args: ServerArgs, model_path: str) -> None:
    frontend = Frontend(args, model_path)
    frontend.client.start()
    runner = web.AppRunner(frontend.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    logger.info("listening on http://%s:%d (503 until every process is ready)", args.host, args.port)
    await asyncio.to_thread(frontend.load)
    ctx = zmq.Context()
    control = Push(ctx, args.control_addr)
    frontend.client.on_drained = lambda: control.send(Drained())
    control.send(Ready(role="frontend"))
    await asyncio.Event().wait()


def run_frontend(args: ServerArgs, model_path: str) -> None:
    try:
        import uvloop

        uvloop.run(serve_frontend(args, model_path))
    except ImportError:
        asyncio.run(serve_frontend(args, model_path))
