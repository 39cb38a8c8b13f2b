"""Continuous batching: admission, chunk planning, one ``Batch`` per turn, finishing and freeing.

The scheduler never touches a tensor. It is driven by three calls: ``add_request`` / ``abort``
when messages arrive, ``schedule`` to produce the next ``Batch``, and ``process_result`` with the
sampled ids of that batch. It reports through ``emit`` (``PromptAdmitted`` once per request,
``Detokenize`` per step). The same object runs in the server's scheduler process and inside the
offline ``LLM``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from typing import Callable

from ..args import ServerArgs
from ..config import ModelConfig
from ..messages import Batch, Detokenize, GenerateReq, Plan, PromptAdmitted, SchedulerStats, SegmentSpec, Usage
from ..sizing import PoolSizes
from .pools import PagePool, SlotPool
from .request import Request, Status

logger = logging.getLogger(__name__)


class AdmissionError(ValueError):
    """A request that can never run with this server's limits."""


class Scheduler:
    def __init__(self, args: ServerArgs, config: ModelConfig, sizes: PoolSizes, emit: Callable[[object], None]):
        self.args, self.config, self.sizes = args, config, sizes
        self.emit = emit
        self.pages = PagePool(sizes.num_pages)
        self.slots = SlotPool(sizes.request_slots)
        self.waiting: deque[Request] = deque()
        self.running: OrderedDict[str, Request] = OrderedDict()
        self.requests: dict[str, Request] = {}
        self.batch_id = 0
        self.counters: dict[str, int] = {
            "requests_finished": 0, "requests_aborted": 0, "prompt_tokens": 0, "generation_tokens": 0,
            "forwards": 0,
        }

    # ---- inbound ------------------------------------------------------------------------------
    def add_request(self, msg: GenerateReq, want_logits: bool = False) -> None:
        if msg.rid in self.requests:
            self._fail(msg.rid, f"request id {msg.rid!r} is already in use", len(msg.prompt_ids))
            return
        req = Request.from_msg(msg, self.config.eos_token_ids)
        req.want_logits = want_logits
        try:
            self.check_admissible(len(req.prompt), req.max_tokens, want_logits)
        except AdmissionError as e:
            self._fail(req.rid, str(e), len(req.prompt))
            return
        self.requests[req.rid] = req
        self.waiting.append(req)

    def check_admissible(self, prompt_len: int, max_tokens: int, want_logits: bool = False) -> None:
        limit = self.sizes.max_model_len
        if prompt_len < 1:
            raise AdmissionError("the prompt must contain at least one token")
        if max_tokens < 1 and not want_logits:
            raise AdmissionError(f"max_tokens must be >= 1, got {max_tokens}")
        if prompt_len + max_tokens > limit:
            raise AdmissionError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the model's context "
                f"length of {limit} tokens"
            )
        needed = self._pages_for(prompt_len + max(max_tokens, 1) - 1)
        if needed > self.pages.total:
            raise AdmissionError(
                f"the request needs {needed} KV pages but the pool holds {self.pages.total} "
                f"(--kv-pool-tokens)"
            )

    def abort(self, rid: str, reason: str = "abort") -> None:
        """Idempotent: unknown or finished ids are ignored; in-flight rows finish on their result."""
        req = self.requests.get(rid)
        if req is None or req.status is Status.FINISHED:
            return
        if req.status is Status.WAITING:
            self.waiting.remove(req)
            self._finish(req, reason)
        elif req.in_flight:
            req.abort_reason = reason
        else:
            self._finish(req, reason)

    # ---- turn ---------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        self._admit()
        segments: list[SegmentSpec] = []
        for req in self.running.values():
            if req.prefill_done and not req.in_flight:
                segments.append(SegmentSpec(
                    rid=req.rid, slot=req.slot, start=req.num_computed, token_ids=[req.output[-1]],
                    pages=req.pages, sample=True, sampling=req.sampling, sample_index=len(req.output),
                ))
        budget = self.args.max_prefill_length or float("inf")
        used = 0
        for req in self.running.values():
            if req.prefill_done or req.in_flight:
                continue
            start, end = req.chunks[req.next_chunk]
            if used and used + (end - start) > budget:
                break
            last = end == req.prompt_len
            segments.append(SegmentSpec(
                rid=req.rid, slot=req.slot, start=start, token_ids=req.prompt[start:end], pages=req.pages,
                sample=last and not req.want_logits, sampling=req.sampling, sample_index=0,
                exports=[[pos - start, slot] for pos, slot in req.exports.items() if start < pos <= end],
                want_logits=req.want_logits,
            ))
            used += end - start
        if not segments:
            return None
        for seg in segments:
            self.requests[seg.rid].in_flight = True
        self.batch_id += 1
        return Batch(batch_id=self.batch_id, segments=segments)

    def process_result(self, batch: Batch, token_ids: list[int]) -> None:
        self.counters["forwards"] += 1
        for seg, tok in zip(batch.segments, token_ids):
            req = self.requests.get(seg.rid)
            if req is None or req.status is not Status.RUNNING:
                continue
            req.in_flight = False
            req.forwards += 1
            req.num_computed = seg.start + len(seg.token_ids)
            if not (req.prefill_done):
                req.next_chunk += 1
            if req.abort_reason is not None:
                self._finish(req, req.abort_reason)
                continue
            if req.want_logits and req.prefill_done:
                self._finish(req, "length")
                continue
            if tok < 0:
                continue
            req.output.append(tok)
            self.counters["generation_tokens"] += 1
            reason = None
            if tok in req.stop_token_ids:
                reason = "stop"
            elif len(req.output) >= req.max_tokens or req.prompt_len + len(req.output) >= self.sizes.max_model_len:
                reason = "length"
            if reason is None:
                self.emit(Detokenize(rid=req.rid, token_ids=[tok]))
            else:
                self._finish(req, reason, new_tokens=[tok])

    def fail_batch(self, batch: Batch, error: str) -> None:
        """The executor could not run ``batch``: every request in it ends with an error."""
        for seg in batch.segments:
            req = self.requests.get(seg.rid)
            if req is not None and req.status is Status.RUNNING:
                req.in_flight = False
                self._finish(req, "error", error=error)

    # ---- internals ----------------------------------------------------------------------------
    def _pages_for(self, positions: int) -> int:
        return -(-positions // self.sizes.page_size)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.args.max_running_requests:
            req = self.waiting[0]
            need = self._pages_for(req.max_positions())
            if self.slots.num_free == 0 or self.pages.num_free < need:
                break
            self.waiting.popleft()
            req.slot = self.slots.alloc()
            req.pages = self.pages.alloc(need)
            req.status = Status.RUNNING
            req.cached_tokens = 0
            req.num_computed = 0
            self._plan(req)
            self.running[req.rid] = req
            self.counters["prompt_tokens"] += req.prompt_len
            self.emit(PromptAdmitted(
                rid=req.rid, prompt_tokens=req.prompt_len, cached_tokens=req.cached_tokens,
                plan=Plan(mode="chunked", chunks=[list(c) for c in req.chunks],
                          checkpoints=sorted(req.exports), reason=self._plan_reason(req)),
            ))

    def _plan(self, req: Request) -> None:
        step = self.args.max_prefill_length or req.prompt_len
        bounds = list(range(req.cached_tokens, req.prompt_len, step)) + [req.prompt_len]
        req.chunks = list(zip(bounds[:-1], bounds[1:]))
        req.next_chunk = 0

    def _plan_reason(self, req: Request) -> str:
        if len(req.chunks) == 1:
            return "prompt fits one forward"
        return f"chunked by --max-prefill-length {self.args.max_prefill_length}"

    def _finish(self, req: Request, reason: str, new_tokens: list[int] | None = None,
                error: str | None = None) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req.slot is not None:
            self.slots.free(req.slot)
            req.slot = None
        if req.pages:
            self.pages.decref(req.pages)
            req.pages = []
        self.running.pop(req.rid, None)
        self.requests.pop(req.rid, None)
        key = "requests_aborted" if reason in ("abort", "error") else "requests_finished"
        self.counters[key] += 1
        self.emit(Detokenize(
            rid=req.rid, token_ids=new_tokens or [], finished=True, finish_reason=reason,
            usage=Usage(prompt_tokens=req.prompt_len, completion_tokens=len(req.output),
                        cached_tokens=req.cached_tokens),
            error=error, error_status=500 if error is not None else None,
        ))

    def _fail(self, rid: str, error: str, prompt_len: int) -> None:
        self.counters["requests_aborted"] += 1
        self.emit(Detokenize(rid=rid, token_ids=[], finished=True, finish_reason="error",
                             usage=Usage(prompt_tokens=prompt_len, completion_tokens=0), error=error,
                             error_status=400))

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            running=len(self.running), waiting=len(self.waiting),
            kv_pages_in_use=self.pages.total - self.pages.num_free, kv_pages_cached=0,
            kv_pages_total=self.pages.total,
            state_slots_in_use=self.slots.total - self.slots.num_free, state_slots_cached=0,
            state_slots_total=self.slots.total, counters=dict(self.counters),
        )
