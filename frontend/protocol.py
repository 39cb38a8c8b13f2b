"""OpenAI request validation and response shapes.

Every field a request may carry is listed here. Unknown fields and unsupported values are
rejected with a 400 naming the field; fields that OpenAI clients commonly send at their neutral
value (``n: 1``, ``presence_penalty: 0``, ``logprobs: null`` ...) are accepted at that value only.
"""

from __future__ import annotations

import math
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


@dataclass
class Limits:
    model_name: str
    max_model_len: int
    kv_capacity: int
    vocab_size: int
    # A chat request without max_tokens / max_completion_tokens gets this many (0: the rest of the context).
    default_max_tokens: int = 0


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
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_fields(body: Any, allowed: set[str]) -> None:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    for key in body:
        if key not in allowed:
            raise bad(key, f"unknown or unsupported field {key!r}")
    for key, values in NEUTRAL.items():
        if key in body and body[key] not in values:
            raise bad(key, f"{key}={body[key]!r} is not supported (accepted: {', '.join(map(repr, values))})")


def _sampling(body: dict, limits: Limits) -> dict[str, Any]:
    model = body.get("model", limits.model_name)
    if not isinstance(model, str):
        raise bad("model", "model must be a string")
    if model != limits.model_name:
        raise APIError(400, f"the model {model!r} does not exist; this server serves {limits.model_name!r}",
                       param="model", code="model_not_found")
    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if not _is_num(temperature) or not 0 <= temperature <= 2:
        raise bad("temperature", f"temperature must be a number in [0, 2], got {temperature!r}")
    top_p = body.get("top_p", 1.0)
    if top_p is None:
        top_p = 1.0
    if not _is_num(top_p) or not 0 < top_p <= 1:
        raise bad("top_p", f"top_p must be a number in (0, 1], got {top_p!r}")
    top_k = body.get("top_k", 0)
    if top_k is None:
        top_k = 0
    if not _is_int(top_k) or top_k < -1:
        raise bad("top_k", f"top_k must be an integer >= -1 (-1 or 0: off), got {top_k!r}")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**63):
        raise bad("seed", f"seed must be a 64-bit integer, got {seed!r}")
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
            raise bad(name, f"{name} must be a boolean, got {value!r}")
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
        raise bad(name, f"{name} must be an integer >= 1, got {value!r}")
    if value > room:
        raise bad(name, f"{name} ({value}) plus the prompt ({prompt_len} tokens) exceeds the model's context "
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
        ids = tokenizer.encode(prompt)
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
                raise bad(f"messages[{i}].{key}", f"unsupported message field {key!r}")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"messages[{i}].role", f"unsupported role {role!r}")
        rendered.append({"role": "system" if role == "developer" else role, "content": _message_text(m, i)})
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", "chat_template_kwargs must be an object")
    try:
        ids = tokenizer.apply_chat_template(rendered, add_generation_prompt=True,
                                            encode_content=answers.lookup if answers else None, **kwargs)
    except Exception as e:  # a template error is the request's fault (roles, kwargs)
        raise bad("messages", f"the chat template could not render these messages: {e}") from None
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
