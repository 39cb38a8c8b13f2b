"""The frontend's side of the mesh: send requests and aborts, route text deltas to requests."""

from __future__ import annotations

import asyncio
import logging

import zmq.asyncio

from ..ipc import AsyncPull, AsyncPush
from ..messages import (
    AbortReq,
    ExecutorFailed,
    FrontendInbound,
    GenerateReq,
    Ready,
    SchedulerStats,
    Shutdown,
    TextDelta,
)
from .metrics import Metrics

logger = logging.getLogger(__name__)


class EngineClient:
    def __init__(self, scheduler_addr: str, frontend_addr: str, metrics: Metrics):
        self.ctx = zmq.asyncio.Context()
        self.to_scheduler: AsyncPush = AsyncPush(self.ctx, scheduler_addr)
        self.inbound: AsyncPull = AsyncPull(self.ctx, frontend_addr, FrontendInbound, bind=True)
        self.metrics = metrics
        self.queues: dict[str, asyncio.Queue] = {}
        self.ready = False
        self.failure: str | None = None
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
            elif isinstance(msg, Ready) and msg.role == "mesh":
                self.ready = True
                logger.info("all processes are ready")
            elif isinstance(msg, (ExecutorFailed, Shutdown)):
                self.ready = False
                self.failure = getattr(msg, "error", None) or getattr(msg, "reason", "shutting down")

    async def submit(self, req: GenerateReq) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[req.rid] = queue
        await self.to_scheduler.send(req)
        return queue

    async def abort(self, rid: str) -> None:
        self.queues.pop(rid, None)
        await self.to_scheduler.send(AbortReq(rid=rid, reason="abort"))

    def release(self, rid: str) -> None:
        self.queues.pop(rid, None)
