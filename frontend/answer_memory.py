"""The exact token ids of recent assistant answers, keyed by their text.

A chat client sends an answer back as text in the next turn. Re-tokenising that text need not give
the ids the model generated (a model may emit a non-canonical split), and one differing id ends the
prefix-cache match there. Rendering a remembered answer with its generated ids keeps the second
turn's prompt equal to the first turn's prompt + answer, so it reuses both.
"""

from __future__ import annotations

from collections import OrderedDict


class AnswerMemory:
    def __init__(self, max_entries: int = 4096, max_tokens: int = 4_000_000):
        self.max_entries, self.max_tokens = max_entries, max_tokens
        self._ids: OrderedDict[str, list[int]] = OrderedDict()
        self._tokens = 0

    def remember(self, text: str, token_ids: list[int], tokenizer) -> None:
        """Store ``token_ids`` for ``text`` if they decode to exactly that text."""
        ids = list(token_ids)
        while ids and tokenizer.is_special(ids[-1]):
            ids.pop()  # a final EOS is re-added by the chat template as a control token
        if not text or not ids or tokenizer.decode(ids) != text or len(ids) > self.max_tokens:
            return
        if text in self._ids:
            self._tokens -= len(self._ids.pop(text))
        self._ids[text] = ids
        self._tokens += len(ids)
        while len(self._ids) > self.max_entries or self._tokens > self.max_tokens:
            _, old = self._ids.popitem(last=False)
            self._tokens -= len(old)

    def lookup(self, message: dict) -> list[int] | None:
        if message.get("role") != "assistant":
            return None
        ids = self._ids.get(message.get("content") or "")
        if ids is not None:
            self._ids.move_to_end(message["content"])
        return ids
