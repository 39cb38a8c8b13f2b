"""OpenAI request validation and response shapes.

Every field a request may carry is listed here. Unknown fields and unsupported values are
rejected with a 400 naming the field; fields that OpenAI clients commonly send at their neutral
value (``n: 1``, ``presence_penalty: 0``, ``logprobs: null`` ...) are accepted at that value only.
"""

from __future__ import annotations

import json
import math
import re
import sys
import unicodedata
from dataclasses import dataclass, field
from typing import Any

# Fields accepted only at these neutral values.
NEUTRAL = {
    "n": (1,),
    "best_of": (1,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (False,),
    "suffix": (None,),
    "logit_bias": (None, {}),
    "parallel_tool_calls": (None, True, False),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
}
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "stream",
                 "stream_options", "user", "skip_special_tokens", *NEUTRAL}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "chat_template_kwargs", "metadata", "store"}
MAX_STOP_STRINGS = 16
# A positive temperature below this samples greedily (its limit): float32 logits divided by a much
# smaller one overflow to inf and the sampler's probabilities to nan.
MIN_TEMPERATURE = 1e-5
MESSAGE_FIELDS = {"role", "content", "name"}
# Message fields accepted only when empty (no tool calls, no refusals, no audio).
NEUTRAL_MESSAGE_FIELDS = {"tool_calls", "function_call", "refusal", "audio", "tool_call_id", "reasoning_content"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.retry_after = retry_after  # seconds, sent as Retry-After (503 at capacity)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def _show(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages that quote a request's value."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


@dataclass
class Limits:
    model_name: str
    max_model_len: int
    kv_capacity: int
    vocab_size: int
    # A chat request without max_tokens / max_completion_tokens gets this many (0: the rest of the context).
    default_max_tokens: int = 0
    # The longest token in bytes (0: unknown). A string prompt of more characters than
    # max_model_len * max_token_bytes cannot fit and is refused without tokenizing it.
    max_token_bytes: int = 0


@dataclass
class ParsedRequest:
    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    skip_special_tokens: bool
    model: str
    extra: dict = field(default_factory=dict)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))  # math.isfinite(10**400) overflows


# A \uD800-\uDFFF escape: the only way an unpaired surrogate gets into a body decoded as UTF-8.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _unencodable_field(body: Any) -> str | None:
    """The field (``messages[0].content``) of a string or key that holds an unpaired surrogate."""
    stack = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                return path or "body"
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            sub = f"{path}[{key}]" if isinstance(value, list) else f"{path}.{key}" if path else key
            if isinstance(key, str) and not _encodable(key):
                return sub.encode("utf-8", "backslashreplace").decode()
            if isinstance(item, (str, list, dict)):
                stack.append((sub, item))
    return None


def parse_body(raw: bytes) -> Any:
    """A request body: JSON in UTF-8, every string valid Unicode."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8: {e}") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise APIError(400, "the request body nests arrays or objects too deeply: this server parses at most about "
                            f"{sys.getrecursionlimit()} levels") from None
    except ValueError as e:  # JSONDecodeError; also an integer of more than 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if _SURROGATE_ESCAPE.search(text):
        where = _unencodable_field(body)
        if where is not None:
            raise bad(where, f"{where} holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff), which is "
                             "not valid Unicode")
    return body


def _panic(e: BaseException) -> bool:
    """A Rust panic in a tokenizer (pyo3's ``PanicException`` derives from BaseException)."""
    return type(e).__name__ == "PanicException"


def _encode(param: str, text: str, tokenizer, limits: Limits) -> list[int]:
    if limits.max_token_bytes:
        bound = limits.max_model_len * limits.max_token_bytes
        if len(text) >= bound:  # a token covers at most max_token_bytes bytes, so at most as many characters
            chars = min(len(text), len(unicodedata.normalize("NFC", text)))
            if chars >= bound:
                raise bad(param, f"{param} has {chars} characters, so at least {-(-chars // limits.max_token_bytes)} "
                                 f"tokens; the model's context length is {limits.max_model_len}")
    try:
        return tokenizer.encode(text)
    except Exception as e:
        raise bad(param, f"{param} could not be tokenized: {e}") from None
    except BaseException as e:
        if not _panic(e):
            raise
        raise bad(param, f"{param} could not be tokenized (the tokenizer failed: {e}; a very long run of "
                         "whitespace can do this)") from None


def _check_fields(body: Any, allowed: set[str]) -> None:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    for key in body:
        if key not in allowed:
            raise bad(key, f"unknown or unsupported field {_show(key)}")
    for key, values in NEUTRAL.items():
        if key in body and body[key] not in values:
            raise bad(key, f"{key}={_show(body[key])} is not supported (accepted: {', '.join(map(repr, values))})")


def _sampling(body: dict, limits: Limits) -> dict[str, Any]:
    model = body.get("model", limits.model_name)
    if not isinstance(model, str):
        raise bad("model", "model must be a string")
    if model != limits.model_name:
        raise APIError(400, f"the model {_show(model)} does not exist; this server serves {limits.model_name!r}",
                       param="model", code="model_not_found")
    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if not _is_num(temperature) or not 0 <= temperature <= 2:
        raise bad("temperature", f"temperature must be a number in [0, 2], got {_show(temperature)}")
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0
    top_p = body.get("top_p", 1.0)
    if top_p is None:
        top_p = 1.0
    if not _is_num(top_p) or not 0 < top_p <= 1:
        raise bad("top_p", f"top_p must be a number in (0, 1], got {_show(top_p)}")
    top_k = body.get("top_k", 0)
    if top_k is None:
        top_k = 0
    if not _is_int(top_k) or top_k < -1:
        raise bad("top_k", f"top_k must be an integer >= -1 (-1 or 0: off), got {_show(top_k)}")
    if top_k >= limits.vocab_size:
        top_k = 0  # keeps the whole vocabulary: off
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**63):
        raise bad("seed", f"seed must be a 64-bit integer, got {_show(seed)}")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", "stop must be a non-empty string or a list of non-empty strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    flags = {}
    for name, default in (("ignore_eos", False), ("stream", False), ("skip_special_tokens", True)):
        value = body.get(name, default)
        if value is None:
            value = default
        if not isinstance(value, bool):
            raise bad(name, f"{name} must be a boolean, got {_show(value)}")
        flags[name] = value
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not flags["stream"]:
            raise bad("stream_options", "stream_options is only allowed when stream is true")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise bad("stream_options", "stream_options may only contain include_usage")
        if options.get("continuous_usage_stats") not in (None, False):
            raise bad("stream_options.continuous_usage_stats", "continuous_usage_stats is not supported")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise bad("stream_options.include_usage", "include_usage must be a boolean")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", "user must be a string")
    return dict(model=model, temperature=float(temperature), top_p=float(top_p), top_k=max(top_k, 0), seed=seed,
                stop=stop, include_usage=include_usage, **flags)


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None, prompt_len: int, limits: Limits) -> int:
    room = limits.max_model_len - prompt_len
    value, name = None, names[0]
    for n in names:
        if body.get(n) is not None:
            value, name = body[n], n
            break
    if value is None:
        if default is None:
            return max(room, 0) if room > 0 else 1
        value = default
        if value > room:
            value = room
    if not _is_int(value) or value < 1:
        raise bad(name, f"{name} must be an integer >= 1, got {_show(value)}")
    if value > room:
        raise bad(name, f"{name} ({_show(value)}) plus the prompt ({prompt_len} tokens) exceeds the model's context "
                        f"length of {limits.max_model_len} tokens")
    return value


def _check_prompt_ids(ids: list[int], limits: Limits, param: str) -> None:
    if not ids:
        raise bad(param, f"{param} must contain at least one token")
    if len(ids) >= limits.max_model_len:
        raise bad(param, f"{param} has {len(ids)} tokens; the model's context length is {limits.max_model_len}")
    if len(ids) >= limits.kv_capacity:
        raise bad(param, f"{param} has {len(ids)} tokens; the KV cache holds {limits.kv_capacity}")
    for t in ids:
        if not 0 <= t < limits.vocab_size:
            raise bad(param, f"token id {t} is outside the vocabulary [0, {limits.vocab_size})")


def parse_completion(body: Any, limits: Limits, tokenizer) -> ParsedRequest:
    _check_fields(body, COMPLETION_FIELDS)
    if "prompt" not in body:
        raise bad("prompt", "prompt is required")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = _encode("prompt", prompt, tokenizer, limits)
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        ids = list(prompt)
    elif isinstance(prompt, list):
        raise bad("prompt", "prompt must be a string or a list of token ids (one prompt per request)")
    else:
        raise bad("prompt", "prompt must be a string or a list of token ids")
    _check_prompt_ids(ids, limits, "prompt")
    params = _sampling(body, limits)
    max_tokens = _max_tokens(body, ("max_tokens",), 16, len(ids), limits)
    return ParsedRequest(chat=False, prompt_ids=ids, max_tokens=max_tokens, **params)


def _message_text(m: dict, i: int) -> str:
    content = m.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content[{j}]", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content", "content must be a string or a list of text parts")


def parse_chat(body: Any, limits: Limits, tokenizer, answers=None) -> ParsedRequest:
    _check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "each message must be an object")
        for key, value in m.items():
            if key not in MESSAGE_FIELDS and not (key in NEUTRAL_MESSAGE_FIELDS and not value):
                raise bad(f"messages[{i}].{key}", f"unsupported message field {_show(key)}")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"messages[{i}].role", f"unsupported role {_show(role)}")
        rendered.append({"role": "system" if role == "developer" else role, "content": _message_text(m, i)})
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", "chat_template_kwargs must be an object")
    try:
        ids = tokenizer.apply_chat_template(rendered, add_generation_prompt=True,
                                            encode_content=answers.lookup if answers else None, **kwargs)
    except Exception as e:  # a template error is the request's fault (roles, kwargs)
        raise bad("messages", f"the chat template could not render these messages: {e}") from None
    except BaseException as e:
        if not _panic(e):
            raise
        raise bad("messages", f"messages could not be tokenized (the tokenizer failed: {e}; a very long run of "
                              "whitespace can do this)") from None
    _check_prompt_ids(ids, limits, "messages")
    params = _sampling(body, limits)
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), limits.default_max_tokens or None,
                             len(ids), limits)
    return ParsedRequest(chat=True, prompt_ids=ids, max_tokens=max_tokens, **params)


def usage_body(usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def completion_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None) -> dict:
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: str | None) -> dict:
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, created: int, model: str, chat: bool, usage) -> dict:
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage_body(usage)}


def full_response(rid: str, created: int, model: str, chat: bool, text: str, finish_reason: str, usage) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created, "model": model,
                "choices": [choice], "usage": usage_body(usage)}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": usage_body(usage)}
