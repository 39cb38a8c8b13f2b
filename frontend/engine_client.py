"""The frontend's side of the mesh: send requests and aborts, route text deltas to requests."""

from __future__ import annotations

import asyncio
import logging

import zmq.asyncio

from ..messages import (
    AbortReq,
    FrontendInbound,
    GenerateReq,
    MeshReady,
    SchedulerStats,
    Shutdown,
    TextDelta,
    Tokenizing,
)
from ..runtime.ipc import AsyncPull, AsyncPush
from .metrics import Metrics

logger = logging.getLogger(__name__)


class EngineClient:
    def __init__(self, scheduler_addr: str, frontend_addr: str, metrics: Metrics):
        self.ctx = zmq.asyncio.Context()
        self.to_scheduler: AsyncPush = AsyncPush(self.ctx, scheduler_addr)
        self.inbound: AsyncPull = AsyncPull(self.ctx, frontend_addr, FrontendInbound, bind=True)
        self.metrics = metrics
        self.queues: dict[str, asyncio.Queue] = {}
        self.bodies = 0  # request bodies read and not yet sent on as requests (or refused)
        self.ready = False
        self.failure: str | None = None
        self.on_drained = None  # called once a drain is over
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._receive())

    async def _receive(self) -> None:
        while True:
            msg = await self.inbound.recv()
            if isinstance(msg, TextDelta):
                queue = self.queues.get(msg.rid)
                if queue is not None:
                    queue.put_nowait(msg)
            elif isinstance(msg, SchedulerStats):
                self.metrics.stats = msg
            elif isinstance(msg, MeshReady):
                if self.failure is not None:
                    logger.info("the mesh restarted; serving again")
                self.ready, self.failure = True, None
                logger.info("all processes are ready")
            elif isinstance(msg, Shutdown):
                self.ready = False
                self.failure = msg.reason or "shutting down"
                if msg.drain:
                    asyncio.get_running_loop().create_task(self._drain(msg.timeout))
                else:
                    logger.error("the mesh failed (%s): failing %d requests in flight", self.failure,
                                 len(self.queues))
                    self.fail_in_flight(f"the server failed: {self.failure}", 500)

    def fail_in_flight(self, error: str, status: int) -> None:
        """End every request this frontend waits on with ``error`` (its handler answers the client)."""
        for rid, queue in list(self.queues.items()):
            queue.put_nowait(TextDelta(rid=rid, text="", token_ids=[], finished=True, finish_reason="error",
                                       error=error, error_status=status))

    async def _drain(self, timeout: float) -> None:
        """SIGTERM: new requests already get 503; wait for the ones in flight, abort what is left at
        the deadline, then tell the launcher."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        logger.info("draining: %d requests in flight, up to %.0f s", len(self.queues), timeout)
        while self.queues and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = list(self.queues)
        if left:
            logger.warning("--shutdown-timeout reached: aborting %d requests", len(left))
            self.fail_in_flight("the server is shutting down (--shutdown-timeout reached)", 503)
            for rid in left:
                await self.to_scheduler.send(AbortReq(rid=rid, reason="abort"))
            await asyncio.sleep(0.2)  # let the handlers write their answers
        if self.on_drained is not None:
            self.on_drained()

    async def submit(self, req: GenerateReq) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[req.rid] = queue
        await self.to_scheduler.send(req)
        return queue

    async def tokenizing(self, change: int) -> None:
        """Count a request body in (+1: read, to be parsed) or out (-1: its requests sent, or refused) and tell
        the scheduler the count."""
        self.bodies += change
        await self.to_scheduler.send(Tokenizing(count=self.bodies))

    async def abort(self, rid: str) -> None:
        self.queues.pop(rid, None)
        await self.to_scheduler.send(AbortReq(rid=rid, reason="abort"))

    def release(self, rid: str) -> None:
        self.queues.pop(rid, None)
