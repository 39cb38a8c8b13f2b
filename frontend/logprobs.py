"""``logprobs`` requests and the OpenAI response shapes of token log-probabilities.

Values are the log-softmax of the model's logits at each sampled position (the model's own
distribution, before temperature, top-k/top-p or any other sampling adjustment), computed on the
device for the requests that ask.
"""

from __future__ import annotations

import codecs
from typing import Any

from ..messages import TokenLogprob
from .errors import bad

MAX_LOGPROBS = 20


def _int_in_range(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS:
        raise bad(name, f"'{name}' must be an integer between 0 and {MAX_LOGPROBS}")
    return value


def parse_logprobs(body: dict, chat: bool) -> int:
    """How many alternatives each token's entry lists (-1: no log-probabilities asked for).

    Completions: ``logprobs`` 0-20. Chat: ``logprobs`` true, with ``top_logprobs`` 0-20.
    """
    if not chat:
        if body.get("logprobs") is False:
            return -1
        n = _int_in_range(body, "logprobs")
        return -1 if n is None else n
    flag = body.get("logprobs")
    if flag is not None and not isinstance(flag, bool):
        raise bad("logprobs", "'logprobs' must be a boolean")
    top = _int_in_range(body, "top_logprobs")
    if top is not None and top > 0 and not flag:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return (top or 0) if flag else -1


def _token(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special=False)


def completion_logprobs(tokenizer, token_ids: list[int], entries: list[TokenLogprob | None],
                        offset: int) -> dict[str, Any]:
    """The completions shape: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``
    (offsets count characters from ``offset``, the length of the text already returned). A ``None``
    entry (an echoed prompt's first token) gives ``null`` values."""
    tokens = [_token(tokenizer, t) for t in token_ids]
    offsets = text_offsets(tokenizer, token_ids, offset)
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": [None if e is None else {_token(tokenizer, i): lp
                                                 for i, lp in zip(e.top_ids, e.top_logprobs, strict=True)}
                         for e in entries],
        "text_offset": offsets,
    }


def text_offsets(tokenizer, token_ids: list[int], offset: int = 0) -> list[int]:
    """Where each token's text starts in the decoded text, from ``offset``: the characters complete
    before it, so a character split across tokens (each alone decodes to U+FFFD) counts once, where it
    ends, and the offsets never decrease."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = []
    for t in token_ids:
        out.append(offset)
        offset += len(decoder.decode(tokenizer.token_bytes(t)))
    return out


def chat_logprobs(tokenizer, token_ids: list[int], entries: list[TokenLogprob]) -> dict[str, Any]:
    """The chat shape: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}``."""
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": _token(tokenizer, token_id), "logprob": logprob,
                "bytes": list(tokenizer.token_bytes(token_id))}

    return {"content": [{**item(t, e.logprob),
                         "top_logprobs": [item(i, lp) for i, lp in zip(e.top_ids, e.top_logprobs, strict=True)]}
                        for t, e in zip(token_ids, entries, strict=True)]}
