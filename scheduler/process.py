"""The scheduler process: requests and results in, batches and detokenize steps out."""

from __future__ import annotations

import logging
import math
import time

import zmq

from ..config.model import ModelConfig
from ..config.pools import pool_sizes
from ..config.server_args import ServerArgs
from ..messages import (
    AbortReq,
    Batch,
    BatchResult,
    DetokenizeInit,
    ExecutorFailed,
    GenerateReq,
    Ready,
    SchedulerInbound,
    Shutdown,
    StepOutput,
    Tokenizing,
)
from ..runtime.faults import check
from ..runtime.ipc import Pull, Push
from .scheduler import Scheduler

logger = logging.getLogger(__name__)

STATS_INTERVAL = 0.05  # seconds between pool-gauge updates while busy


class SchedulerLoop:
    """Owns the sockets around a :class:`Scheduler`.

    Up to two batches are in flight: while the executor runs ``in_flight``, the next batch is scheduled
    and sent (``ahead``), its decodes of requests that ``in_flight`` samples for carrying the token id
    ``-1`` that the executor fills in; so the executor finds its next batch waiting when it finishes
    one, and scheduling and both hops overlap the device's work. ``--disable-overlap-schedule`` keeps
    one batch in flight.
    """

    def __init__(self, args: ServerArgs, model_path: str):
        self.args = args
        config = ModelConfig.from_file(model_path)
        self.sizes = pool_sizes(args, config)
        self.ctx = zmq.Context()
        self.inbound: Pull = Pull(self.ctx, args.bind_addr(args.scheduler_addr), SchedulerInbound, bind=True)
        self.to_detok: Push = Push(self.ctx, args.detokenizer_addr)
        self.to_executors = [Push(self.ctx, addr) for addr in args.executor_addrs()]
        self.control: Push = Push(self.ctx, args.control_addr)
        # What a step emits for the detokenizer goes out as one StepOutput at the step's end.
        self._out: list = []
        self.scheduler = Scheduler(args, config, self.sizes, self._out.append)
        self.scheduler.hand_out = self._flush
        self.in_flight: Batch | None = None  # the oldest batch sent and not answered
        self.ahead: Batch | None = None  # the batch sent after it
        self.overlap = not args.disable_overlap_schedule
        self.in_flight_since = 0.0
        self.failed = False  # an executor failed for good: the launcher restarts the mesh or exits
        self._last_stats = None
        self._last_stats_time = 0.0
        self.running = True

    def handle(self, msg) -> None:
        if isinstance(msg, GenerateReq):
            self._out.append(DetokenizeInit(rid=msg.rid, prompt_tokens=len(msg.prompt_ids), stop=msg.stop,
                                            skip_special_tokens=msg.skip_special_tokens,
                                            include_stop_str_in_output=msg.include_stop_str_in_output))
            self.scheduler.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.scheduler.abort(msg.rid, msg.reason)
        elif isinstance(msg, Tokenizing):
            self.scheduler.tokenizing = msg.count
        elif isinstance(msg, BatchResult):
            batch = self.in_flight
            if batch is None or batch.batch_id != msg.batch_id:
                # A stale answer (another rank's copy of a batch already settled, or one given up on
                # by a recovery): the batch in flight, if any, still waits for its own.
                logger.warning("result for batch %s is not the batch in flight (%s); ignored", msg.batch_id,
                               None if batch is None else batch.batch_id)
                return
            self.in_flight, self.ahead = self.ahead, None
            self.in_flight_since = time.monotonic()
            if msg.executor_stats:
                self.scheduler.executor_stats = msg.executor_stats
            if msg.error is not None:
                logger.error("executor failed batch %d: %s", msg.batch_id, msg.error)
                self.scheduler.fail_batch(batch, msg.error)
            else:
                check("scheduler.result")
                self.scheduler.process_result(batch, msg.token_ids, msg.logprobs, msg.prompt_logprobs)
        elif isinstance(msg, ExecutorFailed):
            logger.error("executor %d failed: %s", msg.rank, msg.error)
            self._executor_gone(f"the executor failed: {msg.error}")
        elif isinstance(msg, Shutdown):
            self.running = False

    def _executor_gone(self, error: str) -> None:
        """No batch can run any more: every request ends with ``error`` and nothing new is scheduled
        (the launcher restarts the mesh or exits)."""
        self.failed = True
        self.in_flight = self.ahead = None
        self.scheduler.fail_all(error)

    def step(self) -> None:
        if (self.in_flight is not None and not self.failed
                and time.monotonic() - self.in_flight_since > self.args.executor_timeout):
            error = (f"batch {self.in_flight.batch_id} got no result within --executor-timeout "
                     f"{self.args.executor_timeout:g} s; the executor counts as hung")
            logger.error("%s", error)
            self.control.send(ExecutorFailed(rank=-1, error=error))
            self._executor_gone(error)
        timeout = 100
        if self.scheduler.has_work() and self.in_flight is None:
            until = self.scheduler.hold_until()  # prompts wait for requests still being tokenized
            timeout = 0 if until is None else max(1, math.ceil((until - time.monotonic()) * 1e3))
        first = self.inbound.recv(timeout_ms=timeout)
        msgs = ([first] if first is not None else []) + self.inbound.drain()
        for msg in msgs:
            try:
                self.handle(msg)
            except Exception:
                self._recover(f"handling {type(msg).__name__}")
        if self.failed and self.scheduler.has_work():  # requests that arrived after the failure
            self.scheduler.fail_all("the executor failed; the server is restarting or shutting down")
        if any(isinstance(msg, BatchResult) for msg in msgs):
            self._flush()  # a result's tokens go out before the next batch is scheduled
        if self.in_flight is None and not self.failed:
            batch = self._schedule()
            if batch is not None:
                self.in_flight = batch
                self.in_flight_since = time.monotonic()
                for sock in self.to_executors:
                    sock.send(batch)
        if self.overlap and self.in_flight is not None and self.ahead is None and not self.failed:
            batch = self._schedule(ahead_of=self.in_flight)
            if batch is not None:
                self.ahead = batch
                for sock in self.to_executors:
                    sock.send(batch)
        self._flush()
        self._send_stats()

    def _flush(self) -> None:
        """Send the detokenizer the events of this step so far, in order."""
        if self._out:
            if self.scheduler.first_tokens:
                # The counters of the forwards that finished a prompt reach /metrics before its first text.
                self._send_stats(now=True)
            self.to_detok.send(StepOutput(events=list(self._out)))
            self._out.clear()

    def _schedule(self, ahead_of: Batch | None = None) -> Batch | None:
        try:
            return self.scheduler.schedule(ahead_of)
        except Exception:
            self._recover("scheduling")
            return None

    def _recover(self, what: str) -> None:
        """A scheduler bug fails the requests it holds, not the process: every request ends with an
        error now (its client gets an answer, its pages and slot return), and the batch in flight is
        given up on (its result, when it comes, is stale)."""
        logger.exception("scheduler error while %s; failing every request", what)
        self.in_flight = self.ahead = None
        self.scheduler.fail_all(f"internal error in the scheduler while {what}")

    def _send_stats(self, now: bool = False) -> None:
        """Publish the pool gauges and counters when they changed: at most every ``STATS_INTERVAL`` while
        busy, at once on the way into or out of idle or when ``now``."""
        self.scheduler.first_tokens = 0
        sent_at = time.monotonic()
        stats = self.scheduler.stats()
        changed = (stats.running, stats.waiting, stats.kv_pages_in_use, stats.state_slots_in_use,
                   stats.kv_pages_cached, stats.state_slots_cached, tuple(sorted(stats.counters.items())))
        # Transitions into and out of idle go out at once: gauges read 0 as soon as the last request ends,
        # and a reader that saw idle sees the next request start before any of its output arrives (stats and
        # output reach the frontend in order), so it never takes the earlier idle snapshot for the later one.
        was_idle = self._last_stats is not None and self._last_stats[0] == 0
        if changed != self._last_stats and (now or sent_at - self._last_stats_time >= STATS_INTERVAL
                                            or stats.running == 0 or was_idle):
            self.to_detok.send(stats)
            self._last_stats, self._last_stats_time = changed, sent_at

    def run(self) -> None:
        self.control.send(Ready(role="scheduler"))
        logger.info("ready: %d KV pages of %d tokens, %d state slots", self.sizes.num_pages,
                    self.sizes.page_size, self.sizes.num_slots)
        while self.running:
            self.step()


def run_scheduler(args: ServerArgs, model_path: str) -> None:
    SchedulerLoop(args, model_path).run()
