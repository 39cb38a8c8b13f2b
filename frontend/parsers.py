"""A chat answer's text split into reasoning, content and tool calls, as it streams.

Qwen's formats: reasoning is the text up to ``</think>`` (after a leading ``<think>``); a tool call
is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call. Both
parsers see the text token by token and hold back only what may still turn out to be a marker (or,
for tool calls, a whole block until it closes), so a streamed answer and a collected one come out
the same. A block that does not parse (bad JSON, no name, never closed) stays in the content as the
model wrote it.

``<think>``, ``</think>``, ``<tool_call>`` and ``</tool_call>`` are special tokens in some
tokenizers (the ``*.tiktoken`` vocabulary ``tidal checkpoint`` writes) and not in others (Qwen's
``tokenizer.json``); the detokenizer drops special tokens from the text. So a parsed request's
text is decoded here once more from its token ids, keeping the markers its parsers need.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from ..detokenizer.incremental import IncrementalText

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def _partial(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def thinking_closed(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether the prompt's last turn already closed a ``<think>`` block (``enable_thinking=False``
    renders ``<think>\\n\\n</think>\\n\\n`` after the generation prompt): the answer is all content."""
    tail = tokenizer.decode(prompt_ids[-64:], skip_special=False)
    return THINK_CLOSE in tail[tail.rfind("<|im_start|>") + 1:]


class ReasoningSplitter:
    """Text up to ``</think>`` (after a leading ``<think>``) is reasoning, the rest content.

    Newlines right after ``<think>`` and ``</think>`` and right before ``</think>`` are dropped (the
    template writes them). An answer that never writes ``</think>`` is all reasoning.
    """

    def __init__(self, reasoning: bool = True):
        self.state = "start" if reasoning else "content"
        self.lead = True  # strip the newlines that open the current part
        self.buf = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        if self.state == "start":
            head = self.buf.lstrip()
            if len(head) < len(THINK_OPEN) and THINK_OPEN.startswith(head):
                return out  # may still be <think>
            if head.startswith(THINK_OPEN):
                self.buf = head[len(THINK_OPEN):]
            self.state = "reasoning"
        if self.state == "reasoning":
            if self.lead:
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    return out
                self.lead = False
            at = self.buf.find(THINK_CLOSE)
            if at < 0:
                end = len(self.buf) - _partial(self.buf, THINK_CLOSE)
                end = len(self.buf[:end].rstrip("\n"))  # newlines that may precede </think>
                if end:
                    out.append(("reasoning", self.buf[:end]))
                    self.buf = self.buf[end:]
                return out
            if self.buf[:at].rstrip("\n"):
                out.append(("reasoning", self.buf[:at].rstrip("\n")))
            self.buf = self.buf[at + len(THINK_CLOSE):]
            self.state, self.lead = "content", True
        if self.lead:
            self.buf = self.buf.lstrip("\n")
            if not self.buf:
                return out
            self.lead = False
        if self.buf:
            out.append(("content", self.buf))
            self.buf = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        text, self.buf = self.buf, ""
        if not text:
            return []
        return [("content" if self.state == "content" else "reasoning", text)]


def parse_tool_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments as a JSON string)`` of one ``<tool_call>`` block's text, or None."""
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict):
        return None
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # already a JSON string: it must hold an object
        try:
            if not isinstance(json.loads(arguments), dict):
                return None
        except (ValueError, RecursionError):
            return None
        return name, arguments
    if not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


class ToolCallParser:
    """Content with ``<tool_call>`` blocks: each block that parses becomes a tool call.

    Content is held back while it may be the start of ``<tool_call>`` (and its trailing whitespace,
    which goes with a following block), and a block until ``</tool_call>``. Whitespace between and
    after tool calls is dropped. With ``parallel=False`` only the first tool call is kept.
    """

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.buf = ""
        self.in_call = False
        self.space = ""  # whitespace before the open block: content again if the block is malformed
        self.calls = 0
        self.after_call = False  # drop whitespace until the next text

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.buf += text
        out: list[tuple[str, Any]] = []
        while True:
            if not self.in_call:
                if self.after_call:
                    self.buf = self.buf.lstrip()
                    if not self.buf:
                        return out
                    self.after_call = False
                at = self.buf.find(TOOL_OPEN)
                end = at if at >= 0 else len(self.buf) - _partial(self.buf, TOOL_OPEN)
                text = self.buf[:end]
                keep = len(text.rstrip())
                if keep:
                    out.append(("content", text[:keep]))
                if at < 0:
                    self.buf = self.buf[keep:]
                    return out
                self.space, self.buf, self.in_call = text[keep:], self.buf[at + len(TOOL_OPEN):], True
            at = self.buf.find(TOOL_CLOSE)
            if at < 0:
                return out
            body, self.buf, self.in_call = self.buf[:at], self.buf[at + len(TOOL_CLOSE):], False
            call = parse_tool_call(body)
            if call is None:
                out.append(("content", self.space + TOOL_OPEN + body + TOOL_CLOSE))
            else:
                if self.parallel or not self.calls:
                    out.append(("tool_call", call))
                self.calls += 1
                self.after_call = True

    def finish(self) -> list[tuple[str, Any]]:
        text = self.space + TOOL_OPEN + self.buf if self.in_call else self.buf
        self.buf, self.space, self.in_call = "", "", False
        if self.calls and not text.strip():
            return []
        return [("content", text)] if text else []


class _KeepMarkers:
    """A tokenizer whose ``is_special`` is false for the marker tokens a parser needs."""

    def __init__(self, tokenizer, keep: set[int]):
        self.tokenizer, self.keep = tokenizer, keep

    def is_special(self, token_id: int) -> bool:
        return token_id not in self.keep and self.tokenizer.is_special(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        return self.tokenizer.token_bytes(token_id)


class ChatOutput:
    """One chat answer: token ids in, OpenAI message deltas out (``reasoning_content``, ``content``,
    ``tool_calls``), plus the whole message at the end.

    ``reasoning``: None (no reasoning parser), True (the answer starts in reasoning) or False (the
    prompt closed the reasoning already). ``tools``: parse tool calls.
    """

    def __init__(self, tokenizer, stop: list[str], skip_special: bool, reasoning: bool | None, tools: bool,
                 parallel_tool_calls: bool = True, include_stop: bool = False):
        markers = ([THINK_OPEN, THINK_CLOSE] if reasoning is not None else []) + ([TOOL_OPEN, TOOL_CLOSE] if tools
                                                                                 else [])
        keep = set()
        for marker in markers:
            ids = tokenizer.encode_with_special(marker)
            if len(ids) == 1:
                keep.add(ids[0])
        self.text = IncrementalText(_KeepMarkers(tokenizer, keep), stop, skip_special, include_stop=include_stop)
        self.reasoning = ReasoningSplitter(reasoning) if reasoning is not None else None
        self.tools = ToolCallParser(parallel_tool_calls) if tools else None
        self.reasoning_parts: list[str] = []
        self.content_parts: list[str] = []
        self.tool_calls: list[dict] = []

    def feed(self, token_ids: list[int], finished: bool = False) -> list[dict]:
        """The message deltas for these ids (the last ones of the answer when ``finished``)."""
        text = self.text.feed(token_ids)
        if finished:
            text += self.text.finish()
        parts = self.reasoning.feed(text) if self.reasoning else [("content", text)]
        if finished and self.reasoning:
            parts += self.reasoning.finish()
        events: list[tuple[str, Any]] = []
        for kind, value in parts:
            if kind == "content" and self.tools:
                events += self.tools.feed(value)
            elif value:
                events.append((kind, value))
        if finished and self.tools:
            events += self.tools.finish()
        deltas: list[dict] = []
        for kind, value in events:
            if kind == "tool_call":
                name, arguments = value
                call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": name, "arguments": arguments}}
                deltas.append({"tool_calls": [{"index": len(self.tool_calls), **call}]})
                self.tool_calls.append(call)
                continue
            if not value:
                continue
            (self.reasoning_parts if kind == "reasoning" else self.content_parts).append(value)
            key = "reasoning_content" if kind == "reasoning" else "content"
            if deltas and set(deltas[-1]) == {key}:
                deltas[-1][key] += value
            else:
                deltas.append({key: value})
        return deltas

    @property
    def content(self) -> str:
        return "".join(self.content_parts)

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.tool_calls and reason == "stop" else reason

    def message(self) -> dict:
        """The fields of the whole message besides ``role``."""
        content = self.content
        message: dict[str, Any] = {"content": content if content or not (self.tool_calls or self.reasoning_parts)
                                   else None}
        if self.reasoning is not None:
            message["reasoning_content"] = "".join(self.reasoning_parts) or None
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message
