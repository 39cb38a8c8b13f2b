"""Request parsing in worker processes: JSON, validation, chat templates and tokenization.

A tokenizer library may hold the interpreter lock for a whole encode (the ``tokenizers`` bindings do), so a
long prompt parsed in a thread of the frontend would stall every stream and ``/health``. Each worker process
loads the checkpoint's tokenizer and keeps its own copy of the answer memory (``remember`` reaches every
worker before its next request); the frontend hands it the raw body and gets back a ``ParsedRequest`` or the
``APIError`` the body earns, exactly as parsing in the frontend would give. One thread of the frontend per
worker does the blocking pipe I/O, so the event loop only resolves futures. A worker that dies fails the
request it held with a 500 and is started again.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import queue
import signal
import threading

from .errors import APIError
from .protocol import Limits, ParsedRequest

logger = logging.getLogger(__name__)

MAX_PENDING = 4096  # answers a worker catches up on at most (AnswerMemory's entry limit)


def _worker(conn, index: int, model_path: str, limits: Limits, log_level: int) -> None:
    from ..runtime.ipc import die_with_parent, set_process_name
    from ..tokenizer import load_tokenizer
    from .answer_memory import AnswerMemory
    from .protocol import packed, parse_body, parse_chat, parse_completion

    die_with_parent()
    set_process_name(f"tidal-tokenizer-{index}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend drains on SIGINT; a worker ends with its pipe
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s tokenizer-worker %(name)s: %(message)s")
    tokenizer = load_tokenizer(model_path)
    answers = AnswerMemory()
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "remember":
            answers.remember(message[1], message[2], tokenizer)
            continue
        _, raw, chat = message
        try:
            body = parse_body(raw)
            parsed = parse_chat(body, limits, tokenizer, answers) if chat else parse_completion(body, limits, tokenizer)
            reply: tuple = ("ok", packed(parsed))
        except APIError as e:
            reply = ("error", (e.status, e.message, e.param, e.type, e.code, e.retry_after))
        except Exception as e:  # a bug: the request gets a 500, the worker serves on
            logger.exception("parsing a request failed")
            reply = ("failed", f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return


class _Worker:
    """One worker process and the frontend thread that talks to it."""

    def __init__(self, pool: ParsePool, index: int):
        self.pool, self.index = pool, index
        self.lock = threading.Lock()
        self.pending: list[tuple[str, list[int]]] = []  # answers to remember before the next request
        self.proc = self.conn = None
        self.thread = threading.Thread(target=self._run, name=f"tokenizer-worker-{index}", daemon=True)

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        args = (child, self.index, self.pool.model_path, self.pool.limits, logging.getLogger().level)
        self.proc = ctx.Process(target=_worker, name=f"tidal-tokenizer-{self.index}", daemon=True, args=args)
        self.proc.start()
        child.close()
        self.conn = parent
        parent.recv()  # ("ready",) once the tokenizer is loaded; EOFError if it could not start

    def _stop(self, why: str) -> None:
        if self.conn is not None:
            self.conn.close()
        code = None
        if self.proc is not None:
            self.proc.join(timeout=1)
            code = self.proc.exitcode
            self.proc.kill()
        logger.error("tokenizer worker %d %s (exit code %s); it starts again with the next request", self.index,
                     why, code)
        self.proc = self.conn = None
        with self.lock:
            self.pending = []  # a new worker starts with an empty answer memory

    def _run(self) -> None:
        try:
            self._start()
        except (EOFError, OSError):
            self._stop("did not start")
        while True:
            job = self.pool.jobs.get()
            if job is None:
                return
            loop, future, raw, chat = job
            try:
                reply = self._parse(raw, chat)
            except Exception as e:  # this thread must outlive any failure: later requests wait on it
                logger.exception("tokenizer worker %d failed", self.index)
                reply = ("failed", f"{type(e).__name__}: {e}")
            loop.call_soon_threadsafe(_resolve, future, reply)

    def _parse(self, raw: bytes, chat: bool) -> tuple:
        try:
            if self.conn is not None and not self.proc.is_alive():
                self._stop("exited")  # between requests: the next one gets a new worker
            if self.conn is None:
                self._start()
            with self.lock:
                pending, self.pending = self.pending, []
            for text, ids in pending:
                self.conn.send(("remember", text, ids))
            self.conn.send(("parse", raw, chat))
            return self.conn.recv()
        except (EOFError, OSError):
            self._stop("exited")
            return "failed", "the tokenizer worker exited while parsing this request"


def _resolve(future: asyncio.Future, reply: tuple) -> None:
    if not future.done():
        future.set_result(reply)


class ParsePool:
    def __init__(self, model_path: str, limits: Limits, workers: int):
        self.model_path, self.limits = model_path, limits
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.workers = [_Worker(self, i) for i in range(workers)]
        for w in self.workers:
            w.thread.start()

    async def parse(self, raw: bytes, chat: bool) -> ParsedRequest:
        """The request ``raw`` parsed by the next free worker; raises the ``APIError`` it earns."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.jobs.put((loop, future, raw, chat))
        kind, value = await future
        if kind == "ok":
            return value
        if kind == "error":
            status, message, param, type_, code, retry_after = value
            raise APIError(status, message, param=param, type_=type_, code=code, retry_after=retry_after)
        raise RuntimeError(value)

    def remember(self, text: str, ids: list[int]) -> None:
        """Every worker's answer memory learns ``ids`` for ``text`` before it parses another request."""
        for w in self.workers:
            with w.lock:
                w.pending.append((text, list(ids)))
                del w.pending[:-MAX_PENDING]  # an idle worker keeps only what its memory would hold

    def close(self) -> None:
        for _ in self.workers:
            self.jobs.put(None)
        for w in self.workers:
            w.thread.join(timeout=5)
            if w.conn is not None:
                w.conn.close()
            if w.proc is not None:
                w.proc.join(timeout=5)
