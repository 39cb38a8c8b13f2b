"""Continuous batching: admission, checkpoint planning, one ``Batch`` per turn, finishing and freeing.

The scheduler never touches a tensor. It is driven by three calls: ``add_request`` / ``abort``
when messages arrive, ``schedule`` to produce the next ``Batch``, and ``process_result`` with the
sampled ids of that batch. It reports through ``emit`` (``PromptAdmitted`` once per request,
``Detokenize`` per step). The same object runs in the server's scheduler process and inside the
offline ``LLM``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from msgspec.structs import replace

from ..config.model import ModelConfig
from ..config.pools import PoolSizes
from ..config.server_args import ServerArgs
from ..messages import (
    Batch,
    Detokenize,
    GenerateReq,
    Plan,
    PromptAdmitted,
    SchedulerStats,
    SegmentSpec,
    TokenLogprob,
    Usage,
)
from .checkpoint_plan import CheckpointPlan, plan_prompt
from .chunking import chunk_bounds, chunk_step
from .hc_shard import hc_shard_decision
from .layer_major import layer_major_decision
from .pools import PagePool, SlotPool
from .prefix_cache import PrefixCache
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
        self.counters: dict[str, int] = {
            "requests_finished": 0, "requests_aborted": 0, "prompt_tokens": 0, "generation_tokens": 0,
            "forwards": 0, "prefill_forwards": 0, "cache_queries": 0, "cache_hits": 0, "cached_tokens": 0,
            "preemptions": 0, "decodes_ahead": 0, "layer_major_turns": 0,
            "checkpoints_written": 0, "checkpoints_evicted": 0, "pages_evicted": 0, "request_forwards": 0,
        }
        self.cache: PrefixCache | None = None
        if not args.disable_prefix_cache:
            self.cache = PrefixCache(
                self.pages, SlotPool(sizes.checkpoint_slots, start=sizes.request_slots), sizes.page_size,
                args.checkpoint_align, needs_state=bool(config.linear_layers or config.ple_layers),
                counters=self.counters)
        # The executor's cumulative per-MoE-layer counters (offload), passed through to /metrics.
        self.executor_stats: dict[str, list[int]] = {}
        # Requests given their first output token since the stats were last published (SchedulerLoop sends
        # those stats ahead of that token).
        self.first_tokens = 0
        self.waiting: deque[Request] = deque()
        self.running: OrderedDict[str, Request] = OrderedDict()
        self.requests: dict[str, Request] = {}
        self.batch_id = 0
        self.tokenizing = 0  # request bodies the frontend is still turning into requests (its latest count)
        self.hand_out: Callable[[], None] | None = None  # sends the events emitted so far (the serving loop's)
        self._lm_last = False  # the latest batch was a turn of a layer-major prefill
        self._lm_drop = False  # a layer-major prefill the executor holds ended between its turns

    # ---- inbound ------------------------------------------------------------------------------
    def add_request(self, msg: GenerateReq, want_logits: bool = False) -> None:
        if msg.rid in self.requests:
            self._fail(msg.rid, f"request id {msg.rid!r} is already in use", len(msg.prompt_ids))
            return
        req = Request.from_msg(msg, self.config.eos_token_ids)
        req.want_logits = want_logits
        try:
            self.check_admissible(len(req.prompt), req.max_tokens, req.full_prompt)
            self.check_images(req)
        except AdmissionError as e:
            self._fail(req.rid, str(e), len(req.prompt))
            return
        req.arrived = time.monotonic()
        self.requests[req.rid] = req
        self.waiting.append(req)

    def check_admissible(self, prompt_len: int, max_tokens: int, want_logits: bool = False) -> None:
        limit = self.sizes.max_model_len
        if prompt_len < 1:
            raise AdmissionError("the prompt must contain at least one token")
        if max_tokens < 1 and not want_logits:
            raise AdmissionError(f"max_tokens must be >= 1, got {max_tokens} (0 only with prompt log-probabilities)")
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

    def check_images(self, req: Request) -> None:
        """Each image's placeholder run lies inside the prompt, in order, and holds only image token ids."""
        if not req.images:
            return
        if self.config.vision_config is None:
            raise AdmissionError("this model has no vision tower: a request cannot hold images")
        image_id, end = self.config.image_token_id, 0
        for i, image in enumerate(req.images):
            if image.offset < end or image.tokens < 1 or image.offset + image.tokens > req.prompt_len:
                raise AdmissionError(f"image {i}: its {image.tokens} vision tokens at prompt position {image.offset} "
                                     f"do not fit the prompt ({req.prompt_len} tokens) after the image before it")
            if any(t != image_id for t in req.prompt[image.offset:image.offset + image.tokens]):
                raise AdmissionError(f"image {i}: prompt positions [{image.offset}, {image.offset + image.tokens}) "
                                     f"must all be the image token id {image_id}")
            end = image.offset + image.tokens

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

    def _end_request(self, req: Request) -> None:
        """A request leaves: a layer-major prefill the executor holds for it (between turns) is let go."""
        if req.lm_spec is not None and req.lm_turn < self._lm_turns():
            self._lm_drop = True
        req.lm_spec = None

    # ---- turn ---------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def hold_until(self) -> float | None:
        """While the frontend still tokenizes request bodies, new prompts wait for them: up to
        ``--batch-wait-ms`` after the first of them arrived, and while they do not fill a forward
        (``--max-prefill-length``). The requests of a burst then share one prompt forward, instead of the first
        few taking one and the rest the forward after it. The ``time.monotonic()`` the wait ends; None when no
        prompt waits (decode steps never do)."""
        wait = self.args.batch_wait_ms
        if not self.tokenizing or not wait:
            return None
        budget = self.args.max_prefill_length or float("inf")
        first, tokens = float("inf"), 0
        for req in itertools.chain(self.waiting, self.running.values()):
            if req.status is Status.RUNNING and (req.prefill_done or req.in_flight):
                continue
            if req.next_chunk or req.admitted and req.status is Status.WAITING:
                return None  # a prompt under way, or one preempted, goes on at once
            tokens += len(req.prompt)
            if tokens >= budget:
                return None
            first = min(first, req.arrived)
        until = first + wait / 1e3
        return until if time.monotonic() < until else None

    def schedule(self, ahead_of: Batch | None = None) -> Batch | None:
        """The next batch. With ``ahead_of`` (the batch the executor is running, not answered yet) it
        is scheduled ahead: a request whose segment there samples also decodes in this batch, on the
        token it is about to sample (see :meth:`_ahead_segment`)."""
        self._admit()
        if self._lm_drop:  # a layer-major prefill ended between its turns: the executor lets it go first
            self._lm_drop = False
            return self._batch([], mode="layer_major", drop=True)
        sampling = {seg.rid: seg for seg in ahead_of.segments if seg.sample} if ahead_of is not None else {}
        lm = self._layer_major_pending()
        if lm is not None and not lm.in_flight and (not self._lm_last or not any(
                r.prefill_done and not r.in_flight or r.in_flight == 1 and r.rid in sampling
                for r in self.running.values())):
            # Turns of the prefill alternate with the running requests' decode steps; other prompts wait.
            return self._layer_major_turn(lm)
        segments: list[SegmentSpec] = []
        copies: list[list[int]] = []
        for req in list(self.running.values()):
            if req.status is not Status.RUNNING:
                continue
            if req.prefill_done and not req.in_flight and self._ensure_pages(req, req.num_computed + 1):
                segments.append(self._decode_segment(req))
            elif req.in_flight == 1 and req.rid in sampling:
                seg = self._ahead_segment(req, sampling[req.rid])
                if seg is not None:
                    segments.append(seg)
        # A preemption above may have emptied a decode taken before it.
        segments = [seg for seg in segments if self.requests[seg.rid].status is Status.RUNNING]
        if lm is not None:
            self._lm_last = False
            return self._batch(segments) if segments else None
        budget = self.args.max_prefill_length or float("inf")
        used = 0
        for req in () if self.hold_until() is not None else self.running.values():
            if req.prefill_done or req.in_flight:
                continue
            start, end = req.chunks[req.next_chunk]
            # A single-turn layer-major forward (longer than one chunk) is the whole turn.
            alone = req.layer_major and end - start > budget
            if (used and used + (end - start) > budget) or (alone and segments):
                break
            if alone:
                return self._layer_major_turn(req)
            segments.append(self._prefill_segment(req, start, end))
            copies += req.copies
            req.copies = []
            used += end - start
        if not segments:
            return None
        return self._batch(segments, copies)

    def _prefill_segment(self, req: Request, start: int, end: int) -> SegmentSpec:
        exports = [[pos - start, slot] for pos, slot in sorted(req.exports.items()) if start < pos <= end]
        last = end == req.prefill_len
        if last and self._checkpoints_at(end) and not req.want_logits:
            slot = self._rolling_slot(req)
            if slot is not None:
                exports.append([end - start, slot])
        base, pages = self._page_delta(req)
        # A resumed request (preempted while decoding) already holds its next token: no sample.
        return self._with_history(req, SegmentSpec(
            rid=req.rid, slot=req.slot, start=start, token_ids=req.tokens(start, end), pages=pages,
            page_base=base, sample=last and not req.want_logits and not req.output and req.max_tokens > 0,
            sampling=req.sampling, sample_index=0, exports=exports, want_logits=req.want_logits,
            **self._prompt_targets(req, start, end),
        ))

    def _batch(self, segments: list[SegmentSpec], copies: list[list[int]] | None = None, **layer_major) -> Batch:
        for seg in segments:
            self.requests[seg.rid].in_flight += 1
        ahead = sum(1 for seg in segments if seg.token_ids == [-1])
        self.counters["decodes_ahead"] += ahead
        self.batch_id += 1
        if layer_major:
            return Batch(batch_id=self.batch_id, segments=segments, copies=copies or [], **layer_major)
        rows = sum(len(seg.token_ids) for seg in segments)
        decodes = ahead > 0 or any(self.requests[s.rid].prefill_done for s in segments)
        shard, _ = hc_shard_decision(self.args, rows, decodes)
        return Batch(batch_id=self.batch_id, segments=segments, copies=copies or [], hc_shard=shard)

    def _layer_major_pending(self) -> Request | None:
        """The request whose layer-major prefill runs over several turns (``--layer-major-turns`` > 1), once
        admitted and until its last turn is answered."""
        if self.args.layer_major_turns <= 1:
            return None
        return next((r for r in self.running.values()
                     if r.layer_major and not r.prefill_done and r.status is Status.RUNNING), None)

    def _lm_turns(self) -> int:
        """The turns of a layer-major prefill: ``--layer-major-turns``, at most one a decoder layer."""
        return min(self.args.layer_major_turns, self.config.num_hidden_layers)

    def _layer_major_turn(self, req: Request) -> Batch:
        """The next turn of ``req``'s layer-major prefill: the first carries its whole segment (tokens, pages,
        restores, exports), later ones name it, and the last (which samples) carries it again for the result.
        Each turn runs whole decoder layers over every internal chunk, the layers shared out as evenly as the
        turns allow."""
        chunk = chunk_step(self.args.max_prefill_length)
        layers = self.config.num_hidden_layers
        copies: list[list[int]] = []
        if req.lm_spec is None:
            start, end = req.chunks[req.next_chunk]
            req.lm_spec = self._prefill_segment(req, start, end)
            copies, req.copies = req.copies, []
            req.lm_chunks = len(chunk_bounds(start, end, chunk)) - 1
            req.lm_turn = 0
        spec, turn, turns = req.lm_spec, req.lm_turn, self._lm_turns()
        last = turn == turns - 1
        if turn == 0:  # the executor builds the prefill from this one
            seg = spec if last else replace(spec, sample=False)
        elif last:
            seg = replace(spec, pages=[])
        else:
            seg = replace(spec, sample=False, pages=[], token_ids=[], history=[], exports=[])
        req.lm_turn += 1
        self._lm_last = True
        pairs = (layers * (turn + 1) // turns - layers * turn // turns) * req.lm_chunks
        return self._batch([seg], copies, mode="layer_major", chunk_size=chunk, turn=turn, turns=turns,
                           layer_chunks=pairs)

    @staticmethod
    def _prompt_targets(req: Request, start: int, end: int) -> dict:
        """A prefill chunk's prompt log-probability request: the next prompt token of each row."""
        if req.prompt_logprobs < 0 or req.prompt_lp_sent:
            return {}
        return {"prompt_targets": req.prompt[start + 1:min(end + 1, req.prompt_len)],
                "prompt_logprobs": req.prompt_logprobs}

    def _decode_segment(self, req: Request) -> SegmentSpec:
        start = req.num_computed
        exports = []
        # Keep an end-of-request checkpoint at the last aligned position the decode passes.
        if self._checkpoints_at(start + 1):
            slot = self._rolling_slot(req)
            if slot is not None:
                exports.append([1, slot])
        base, pages = self._page_delta(req)
        return self._with_history(req, SegmentSpec(
            rid=req.rid, slot=req.slot, start=start, token_ids=[req.output[-1]], pages=pages, page_base=base,
            sample=True, sampling=req.sampling, sample_index=len(req.output), exports=exports))

    def _ahead_segment(self, req: Request, pending: SegmentSpec) -> SegmentSpec | None:
        """The decode after ``pending`` (in flight, sampling), sent before its token is known: its token
        id is ``-1``, which the executor replaces with what it sampled for the slot in the batch before.
        Only when ``pending``'s token cannot end the request by length, the decode writes no checkpoint
        and its page is free without preempting anyone; should the token end the request (a stop token,
        an abort), this segment's result is dropped, and what it wrote lies beyond everything the
        request published, in pages and a slot that whoever gets them next overwrites before reading."""
        start = pending.start + len(pending.token_ids)
        produced = len(req.output) + 1  # after pending's token
        if (req.abort_reason is not None or req.want_logits
                or req.ends_by_length(produced, self.sizes.max_model_len)):
            return None
        if self._checkpoints_at(start + 1):
            return None
        if not self._ensure_pages(req, start + 1, preempt=False):
            return None
        base, pages = self._page_delta(req)
        return SegmentSpec(rid=req.rid, slot=req.slot, start=start, token_ids=[-1], pages=pages, page_base=base,
                           sample=True, sampling=req.sampling, sample_index=produced)

    @staticmethod
    def _with_history(req: Request, seg: SegmentSpec) -> SegmentSpec:
        """The first sampling segment since (re)admission of a request with penalties or a grammar
        carries its token history; the first segment since (re)admission, its images."""
        if req.images and seg.page_base == 0 and seg.pages:
            seg.images = req.images
        if seg.sample and req.sampling.needs_history and not req.history_sent:
            prompt = req.prompt if req.sampling.repetition_penalty != 1 else []
            seg.history, seg.history_prompt = prompt + req.output, len(prompt)
            req.history_sent = True
        return seg

    def _page_delta(self, req: Request) -> tuple[int, list[int]]:
        """The page-table entries the executor does not hold yet (it keeps each slot's table)."""
        base = req.pages_sent
        req.pages_sent = len(req.pages)
        return base, req.pages[base:]

    def _checkpoints_at(self, pos: int) -> bool:
        """A forward ending at ``pos`` keeps the request's end-of-request checkpoint there."""
        return self.cache is not None and pos % self.args.checkpoint_align == 0

    # ---- memory on demand ---------------------------------------------------------------------
    def _alloc_pages(self, count: int) -> list[int] | None:
        """``count`` free KV pages (evicting cached ones if need be), or ``None``."""
        return self.cache.alloc_pages(count) if self.cache is not None else self.pages.alloc(count)

    def _release_pages(self, pages: list[int]) -> None:
        """A request lets go of its pages (those the prefix cache indexed stay cached)."""
        if self.cache is not None:
            self.cache.release_pages(pages)
        else:
            self.pages.decref(pages)

    def _ensure_pages(self, req: Request, positions: int, preempt: bool = True) -> bool:
        """Give ``req`` pages for ``positions``; under pressure (with ``preempt``) preempt the newest
        running request (``req`` itself if it is the newest). ``False`` when ``req`` cannot run this turn."""
        need = self._pages_for(positions) - len(req.pages)
        while need > 0:
            new = self._alloc_pages(need)
            if new is not None:
                req.pages += new
                return True
            if not preempt:
                return False
            victim = next((r for r in reversed(self.running.values())
                           if not r.in_flight and not r.want_logits and r.lm_spec is None), None)
            if victim is None:
                return False
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """Free the request's pages and slot and requeue it first. Its computed pages and its latest
        checkpoint stay in the prefix cache, so resuming recomputes only what no checkpoint covers."""
        if self.cache is not None:
            self._release_cache_state(req, publish=True)
        self._release_pages(req.pages)
        if req.slot is not None:
            self.slots.free(req.slot)
        self.running.pop(req.rid)
        req.requeue()
        self.counters["preemptions"] += 1
        self.waiting.appendleft(req)
        logger.info("preempted %s at %d tokens (%d output); it resumes when pages free up", req.rid,
                    req.prefill_len, len(req.output))

    def _rolling_slot(self, req: Request) -> int | None:
        """The request's end-of-request checkpoint slot, about to be rewritten."""
        if not self.cache.needs_state:
            return None
        if req.rolling_slot is None:
            req.rolling_slot = self.cache.alloc_checkpoint_slot()
        req.rolling_pos = None  # valid again once this forward completes
        return req.rolling_slot

    def process_result(self, batch: Batch, token_ids: list[int],
                       logprobs: dict[int, TokenLogprob] | None = None,
                       prompt_logprobs: dict[int, list[TokenLogprob]] | None = None) -> None:
        """``logprobs``: segment index -> the sampled token's log-probabilities (requests that asked);
        ``prompt_logprobs``: segment index -> its prompt targets' log-probabilities."""
        if batch.mode == "layer_major":
            if batch.drop:
                return
            self.counters["layer_major_turns"] += 1
            req = self.requests.get(batch.segments[0].rid)
            if batch.turn < batch.turns - 1:  # more turns to go: nothing computed is complete yet
                if req is not None and req.status is Status.RUNNING:
                    req.in_flight -= 1
                    if req.abort_reason is not None:
                        self._finish(req, req.abort_reason)
                return
            if req is not None:
                req.lm_spec = None
        self.counters["forwards"] += 1
        later: list[tuple[Request, SegmentSpec, int]] = []  # indexed once the step's tokens are out
        for index, (seg, tok) in enumerate(zip(batch.segments, token_ids, strict=True)):
            req = self.requests.get(seg.rid)
            if req is None or req.status is not Status.RUNNING:
                continue
            req.in_flight -= 1
            req.forwards += 1
            end = seg.start + len(seg.token_ids)
            req.num_computed = end
            if not req.prefill_done:
                req.next_chunk += 1
                req.prefill_forwards += 1
                self.counters["prefill_forwards"] += 1
            if req.restore is not None:  # the first forward has copied the checkpoint
                self.cache.unlock(req.restore)
                req.restore = None
            if req.abort_reason is not None:
                self._index(req, seg, end)
                self._finish(req, req.abort_reason)
                continue
            if prompt_logprobs and index in prompt_logprobs:  # entry j is position start + 1 + j's
                req.prompt_lp = req.prompt_lp[:seg.start] + list(prompt_logprobs[index])
            if req.prompt_logprobs >= 0 and req.prefill_done and not req.prompt_lp_sent:
                req.prompt_lp_sent = True
                self.emit(Detokenize(rid=req.rid, token_ids=[], prompt_logprobs=req.prompt_lp))
                req.prompt_lp = []
                if req.max_tokens == 0:
                    self._index(req, seg, end)
                    self._finish(req, "length")
                    continue
            if req.want_logits and req.prefill_done:
                self._index(req, seg, end)
                self._finish(req, "length")
                continue
            if tok < 0:
                later.append((req, seg, end))
                continue
            req.output.append(tok)
            self.counters["generation_tokens"] += 1
            self.first_tokens += len(req.output) == 1
            reason = None
            if tok in req.stop_token_ids:
                reason = "stop"
            elif req.ends_by_length(len(req.output), self.sizes.max_model_len):
                reason = "length"
            lp = logprobs.get(index) if logprobs else None
            if reason is None:
                self.emit(Detokenize(rid=req.rid, token_ids=[tok], logprobs=None if lp is None else [lp]))
                later.append((req, seg, end))
            else:
                self._index(req, seg, end)
                self._finish(req, reason, new_tokens=[tok], new_logprobs=None if lp is None else [lp])
        if later and self.hand_out is not None:
            self.hand_out()  # the tokens go out before what the forward wrote is indexed (pages, checkpoints)
        for req, seg, end in later:
            self._index(req, seg, end)

    def _index(self, req: Request, seg: SegmentSpec, end: int) -> None:
        """Publish what the forward just wrote: full pages, then completed checkpoints."""
        if self.cache is None:
            return
        ps = self.sizes.page_size
        indexed = len(req.page_keys)
        if end // ps > indexed:
            # The prompt's pages were hashed for matching at admission: their keys are taken, not hashed again.
            hashed = req.match_keys[indexed:end // ps] if req.match_keys else ()
            self.cache.insert_pages(req.pages, req.page_keys, req.key_tokens(indexed * ps, end // ps * ps), hashed)
        for offset, slot in seg.exports:
            pos = seg.start + offset
            if slot == req.rolling_slot:
                req.rolling_pos = pos
                continue
            req.exports.pop(pos, None)
            if self.cache.insert_checkpoint(req.page_keys[: pos // ps], slot):
                req.checkpoints_written.append(pos)
            else:
                self.cache.slots.free(slot)

    def fail_all(self, error: str) -> None:
        """End every request with ``error`` (in flight or not): the recovery from a scheduler bug."""
        for req in list(self.waiting) + list(self.running.values()):
            try:
                if req.status is Status.WAITING:
                    self.waiting.remove(req)
                req.in_flight = 0
                self._finish(req, "error", error=error)
            except Exception:
                logger.exception("could not fail %s cleanly", req.rid)
                self.running.pop(req.rid, None)
                self.requests.pop(req.rid, None)

    def fail_batch(self, batch: Batch, error: str) -> None:
        """The executor could not run ``batch``: every request in it ends with an error."""
        for seg in batch.segments:
            req = self.requests.get(seg.rid)
            if req is not None and req.status is Status.RUNNING:
                req.in_flight = 0
                self._finish(req, "error", error=error)

    # ---- admission ----------------------------------------------------------------------------
    def _pages_for(self, positions: int) -> int:
        return -(-positions // self.sizes.page_size)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.args.max_running_requests:
            req = self.waiting[0]
            if req.after is not None:
                first = self.requests.get(req.after)
                if first is not None and (first.status is Status.WAITING or not first.prefill_done):
                    break  # its prompt is on the way into the prefix cache
            if self.slots.num_free == 0 or not self._take_memory(req):
                break
            self.waiting.popleft()
            req.slot = self.slots.alloc()
            req.status = Status.RUNNING
            if req.restore is not None:
                req.copies = [[req.restore.slot, req.slot]]
            busy = any(r.layer_major and not r.prefill_done for r in self.running.values())
            req.layer_major, why = layer_major_decision(self.args, req.prefill_len - req.num_computed,
                                                        len(self.running) + len(self.waiting), req.full_prompt,
                                                        busy, self.config.num_hidden_layers)
            plan = self._plan(req)
            self.running[req.rid] = req
            if req.admitted:  # resumed after a preemption: admitted (and reported) once already
                continue
            req.admitted = True
            self.counters["prompt_tokens"] += req.prompt_len
            self.emit(PromptAdmitted(
                rid=req.rid, prompt_tokens=req.prompt_len, cached_tokens=req.cached_tokens,
                plan=Plan(mode="layer_major" if req.layer_major else "chunked", chunks=[list(c) for c in req.chunks],
                          checkpoints=plan.checkpoints, reason=f"{why}; {plan.reason}",
                          turns=self._lm_turns() if req.layer_major else 0),
            ))

    def _take_memory(self, req: Request) -> bool:
        """Match the prefix cache and take the request's pages; ``False`` (nothing taken) to wait."""
        need = self._pages_for(req.prefill_len)  # decoding takes its pages as it goes
        if self.cache is None or req.full_prompt:
            # Scoring matches nothing (it needs every row's logits) but evicts cached pages like anyone.
            pages = self._alloc_pages(need)
            if pages is None:
                return False
            req.pages = pages
            return True
        tokens = req.key_tokens(0, req.prefill_len)
        if req.match_keys is None:
            req.match_keys = self.cache.prefix_keys(tokens)
        match = self.cache.match(tokens, req.match_keys)
        fresh = need - len(match.pages)
        in_lru = sum(map(self.cache.evictable.__contains__, match.pages))
        if self.cache.available_pages() - in_lru < fresh:
            return False
        self.counters["cache_queries"] += 1
        self.cache.acquire(match)
        req.pages = match.pages + self.cache.alloc_pages(fresh)
        if not req.admitted:  # usage reports the first admission's hit
            req.cached_tokens = match.tokens
        req.num_computed = match.tokens
        req.restore = match.checkpoint
        req.page_keys = match.keys
        req.branch = match.page_tokens
        if match.tokens:
            self.counters["cache_hits"] += 1
            self.counters["cached_tokens"] += match.tokens
        return True

    def _plan(self, req: Request) -> CheckpointPlan:
        cache = self.cache if not req.want_logits else None  # prompt log-probabilities still write checkpoints
        plan = plan_prompt(
            prompt_len=req.prefill_len, cached=req.num_computed,
            max_chunk=None if req.layer_major else self.args.max_prefill_length,
            # A layer-major prefill always coalesces: a separate tail forward would stream every
            # layer's experts again (it routes to most of them) for a few dozen tokens.
            align=self.args.checkpoint_align, coalesce=self.args.prefill_coalesce or req.layer_major,
            checkpoint=cache is not None and cache.needs_state, branch=req.branch,
        )
        req.chunks, req.next_chunk = plan.chunks, 0
        for pos in plan.checkpoints:
            slot = cache.alloc_checkpoint_slot()
            if slot is not None:
                req.exports[pos] = slot
        if len(req.exports) != len(plan.checkpoints):
            plan.checkpoints = sorted(req.exports)
            plan.reason += "; no free checkpoint slot"
        return plan

    # ---- ending -------------------------------------------------------------------------------
    def _finish(self, req: Request, reason: str, new_tokens: list[int] | None = None,
                error: str | None = None, new_logprobs: list[TokenLogprob] | None = None) -> None:
        self._end_request(req)
        req.status = Status.FINISHED
        if self.cache is not None:
            self._release_cache_state(req, publish=reason in ("stop", "length"))
        if req.slot is not None:
            self.slots.free(req.slot)
            req.slot = None
        if req.pages:
            self._release_pages(req.pages)
            req.pages = []
        self.running.pop(req.rid, None)
        self.requests.pop(req.rid, None)
        key = "requests_aborted" if reason in ("abort", "error") else "requests_finished"
        self.counters[key] += 1
        self.counters["request_forwards"] += req.forwards
        if self.args.enable_cache_report:
            logger.info(
                "cache report rid=%s prompt_tokens=%d cached_tokens=%d computed_tokens=%d checkpoints_written=%s "
                "prefill_forwards=%d finish=%s", req.rid, req.prompt_len, req.cached_tokens,
                max(0, min(req.num_computed, req.prompt_len) - req.cached_tokens), req.checkpoints_written,
                req.prefill_forwards, reason)
        self.emit(Detokenize(
            rid=req.rid, token_ids=new_tokens or [], logprobs=new_logprobs, finished=True, finish_reason=reason,
            usage=Usage(prompt_tokens=req.prompt_len, completion_tokens=len(req.output),
                        cached_tokens=req.cached_tokens),
            error=error, error_status=500 if error is not None else None,
        ))

    def _release_cache_state(self, req: Request, publish: bool) -> None:
        cache = self.cache
        if req.restore is not None:
            cache.unlock(req.restore)
            req.restore = None
        for slot in req.exports.values():  # planned but never written
            cache.slots.free(slot)
        req.exports.clear()
        if req.rolling_slot is not None:
            if publish and req.rolling_pos is not None and cache.insert_checkpoint(
                    req.page_keys[: req.rolling_pos // self.sizes.page_size], req.rolling_slot):
                req.checkpoints_written.append(req.rolling_pos)
            else:
                cache.slots.free(req.rolling_slot)
            req.rolling_slot = None
        if publish and req.page_keys and not cache.memo.refresh(req.page_keys):
            # the next turn of this conversation hashes only its own pages
            cache.remember(req.key_tokens(0, len(req.page_keys) * self.sizes.page_size), req.page_keys)

    def _fail(self, rid: str, error: str, prompt_len: int) -> None:
        self.counters["requests_aborted"] += 1
        self.emit(Detokenize(rid=rid, token_ids=[], finished=True, finish_reason="error",
                             usage=Usage(prompt_tokens=prompt_len, completion_tokens=0), error=error,
                             error_status=400))

    def stats(self) -> SchedulerStats:
        cached_pages = self.cache.cached_pages if self.cache else 0
        cached_slots = self.cache.cached_slots if self.cache else 0
        ckpt_used = (self.cache.slots.total - self.cache.slots.num_free) if self.cache else 0
        return SchedulerStats(
            running=len(self.running), waiting=len(self.waiting),
            kv_pages_in_use=self.pages.total - self.pages.num_free - cached_pages, kv_pages_cached=cached_pages,
            kv_pages_total=self.pages.total,
            state_slots_in_use=self.slots.total - self.slots.num_free + ckpt_used - cached_slots,
            state_slots_cached=cached_slots, state_slots_total=self.sizes.num_slots, counters=dict(self.counters),
            executor_stats=self.executor_stats,
        )
