"""The detokenizer process: ``Detokenize`` in, ``TextDelta`` out, and the read-only tap."""

from __future__ import annotations

import logging

import zmq

from ..config.server_args import ServerArgs
from ..messages import (
    AbortReq,
    Detokenize,
    DetokenizeInit,
    DetokenizerInbound,
    FrontendInbound,
    PromptAdmitted,
    Ready,
    SchedulerInbound,
    SchedulerStats,
    StepOutput,
    TextDelta,
    Usage,
)
from ..runtime.ipc import Publisher, Pull, Push
from ..tokenizer import Tokenizer, load_tokenizer
from .incremental import IncrementalText

logger = logging.getLogger(__name__)


class Detokenizer:
    """Turns the scheduler's per-step ``Detokenize`` into ``TextDelta`` for the frontend.

    A stop string ends the text at once; the scheduler is told to stop generating (``AbortReq``
    with reason ``stop``) and its later messages for that request are dropped.
    """

    def __init__(self, tokenizer: Tokenizer, send_text, send_abort, publish=None):
        self.tokenizer = tokenizer
        self.send_text, self.send_abort, self.publish = send_text, send_abort, publish
        self.states: dict[str, IncrementalText] = {}
        self.usage: dict[str, Usage] = {}
        self.stopped: set[str] = set()

    def handle(self, msg) -> None:
        if isinstance(msg, DetokenizeInit):
            self.states[msg.rid] = IncrementalText(self.tokenizer, msg.stop, msg.skip_special_tokens,
                                                   msg.include_stop_str_in_output)
            self.usage[msg.rid] = Usage(prompt_tokens=msg.prompt_tokens, completion_tokens=0)
        elif isinstance(msg, PromptAdmitted):
            if self.publish:
                self.publish(msg)
            usage = self.usage.get(msg.rid)
            if usage is not None:
                usage.cached_tokens = msg.cached_tokens
        elif isinstance(msg, Detokenize):
            if self.publish:
                self.publish(msg)
            self._detokenize(msg)

    def _detokenize(self, msg: Detokenize) -> None:
        rid = msg.rid
        if rid in self.stopped:
            if msg.finished:
                self.stopped.discard(rid)
            return
        state = self.states.get(rid)
        if state is None:
            state = self.states[rid] = IncrementalText(self.tokenizer)
        text = state.feed(msg.token_ids)
        if state.stopped:
            text += state.finish()
            usage = self.usage.pop(rid, None) or Usage(prompt_tokens=0, completion_tokens=0)
            usage.completion_tokens = state.tokens
            self.states.pop(rid, None)
            if not msg.finished:
                self.stopped.add(rid)
                self.send_abort(AbortReq(rid=rid, reason="stop"))
            self.send_text(TextDelta(rid=rid, text=text, token_ids=list(msg.token_ids), logprobs=msg.logprobs,
                                     finished=True, finish_reason="stop", usage=usage))
            return
        if msg.finished:
            text += state.finish()
            self.states.pop(rid, None)
            self.usage.pop(rid, None)
        self.send_text(TextDelta(rid=rid, text=text, token_ids=list(msg.token_ids), logprobs=msg.logprobs,
                                 prompt_logprobs=msg.prompt_logprobs, finished=msg.finished,
                                 finish_reason=msg.finish_reason, usage=msg.usage, error=msg.error,
                                 error_status=msg.error_status))


def run_detokenizer(args: ServerArgs, model_path: str) -> None:
    ctx = zmq.Context()
    inbound: Pull = Pull(ctx, args.bind_addr(args.detokenizer_addr), DetokenizerInbound, bind=True)
    to_frontend: Push[FrontendInbound] = Push(ctx, args.frontend_addr)
    to_scheduler: Push[SchedulerInbound] = Push(ctx, args.scheduler_addr)
    tap = Publisher(ctx, args.bind_addr(args.tap_addr)) if args.tap_addr else None
    control: Push = Push(ctx, args.control_addr)
    detok = Detokenizer(load_tokenizer(model_path), to_frontend.send, to_scheduler.send,
                        tap.publish if tap else None)
    control.send(Ready(role="detokenizer"))
    logger.info("ready%s", f"; tap on {args.tap_addr}" if args.tap_addr else "")
    for msg in inbound.until_shutdown():
        if isinstance(msg, SchedulerStats):
            to_frontend.send(msg)
            continue
        for event in msg.events if isinstance(msg, StepOutput) else [msg]:
            try:
                detok.handle(event)
            except Exception as e:  # one request's failure must not stop the others' text
                logger.exception("detokenizing %s failed", getattr(event, "rid", "?"))
                rid = getattr(event, "rid", None)
                if rid is not None:
                    detok.states.pop(rid, None)
                    to_scheduler.send(AbortReq(rid=rid, reason="error"))
                    to_frontend.send(TextDelta(rid=rid, text="", token_ids=[], finished=True,
                                               finish_reason="error", error=f"detokenizer: {e}", error_status=500))
