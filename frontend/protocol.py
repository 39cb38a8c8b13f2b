"""OpenAI request validation and response shapes.

Every field a request may carry is listed here. Unknown fields and unsupported values are
rejected with a 400 naming the field; fields that OpenAI clients commonly send at their neutral
value (``best_of: 1``, ``echo: false`` ...) are accepted at that value only.
"""

from __future__ import annotations

import json
import math
import re
import sys
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..messages import ImageInput
from ..vision import IMAGE_MARK, ImageError, ImageProcessor, read_image_url, rgb_input
from .controls import parse_controls
from .errors import APIError, bad
from .logprobs import parse_logprobs

# Fields accepted only at these neutral values (vLLM's extensions among them: what their values ask for is what
# tidal does anyway, or, for the byte-level tokenizer, what no value changes).
NEUTRAL = {
    "best_of": (1,),
    "echo": (False,),
    "suffix": (None,),
    "priority": (None, 0),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "spaces_between_special_tokens": (None, True, False),
    "add_special_tokens": (None, True, False),
    "service_tier": (None, "auto", "default"),
}
# Chat fields that completions accept only at these neutral values.
TOOL_NEUTRAL = {"parallel_tool_calls": (None, True, False), "tools": (None, []), "tool_choice": (None, "none", "auto")}
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos",
                 "stream", "stream_options", "user", "skip_special_tokens", "logprobs", "n", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids",
                 "include_stop_str_in_output", "truncate_prompt_tokens", *NEUTRAL}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", *TOOL_NEUTRAL}
CHAT_FIELDS = COMMON_FIELDS | {"top_logprobs", "response_format", "messages", "max_completion_tokens",
                               "chat_template_kwargs", "metadata", "add_generation_prompt", "continue_final_message",
                               "store", "tools", "tool_choice", "parallel_tool_calls"}
CHAT_NEUTRAL = {**NEUTRAL, "continue_final_message": (None, False)}
MAX_STOP_STRINGS = 16
# Prompts in one completions request (each with its ``n`` choices).
MAX_PROMPTS = 64
# A positive temperature below this samples greedily (its limit): float32 logits divided by a much
# smaller one overflow to inf and the sampler's probabilities to nan.
MIN_TEMPERATURE = 1e-5
MESSAGE_FIELDS = {"role", "content", "name"}
# Fields of messages of one role only.
ROLE_FIELDS = {"assistant": {"tool_calls", "reasoning_content"}, "tool": {"tool_call_id"}}
# Message fields accepted only when empty (no refusals, no audio; tool fields on other roles).
NEUTRAL_MESSAGE_FIELDS = {"tool_calls", "function_call", "refusal", "audio", "tool_call_id", "reasoning_content"}
ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI's rule for function names.
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _show(value: Any, limit: int = 80) -> str:
    """``value`` as JSON, cut to ``limit`` characters, for error messages that quote a request's value."""
    if isinstance(value, str) and len(value) > limit:
        return f"{json.dumps(value[:limit], ensure_ascii=False)[:-1]}... ({len(value)} characters)"
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (ValueError, TypeError, RecursionError):  # nested too deeply to write out
        text = "an array" if isinstance(value, list) else "an object" if isinstance(value, dict) else "a value"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters of JSON)"


def _alternatives(values: tuple) -> str:
    """``null, true or false``: the values a field accepts, in JSON."""
    shown = []
    for v in values:
        if not any((v == w and type(v) is type(w)) or (_is_num(v) and _is_num(w) and v == w) for w in shown):
            shown.append(v)
    texts = [json.dumps(v) for v in shown]
    return texts[0] if len(texts) == 1 else f"{', '.join(texts[:-1])} or {texts[-1]}"


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
    # Requests the server holds at once (--max-running-requests + --max-queued-requests).
    max_requests: int = 1 << 30
    # The image processor and image limits of a model with a vision tower (None: text only).
    images: ImageProcessor | None = None


class PackedIds(Sequence):
    """Token ids as one msgpack array: how a tokenizer worker hands the frontend a prompt (bytes cross the pipe
    without a Python int apiece), which goes into the scheduler's ``GenerateReq`` as it is (:meth:`raw`) and is
    unpacked only where the frontend reads the ids (echo, a chat's reasoning state)."""

    __slots__ = ("packed", "length", "_ids")

    def __init__(self, packed: bytes, length: int):
        self.packed, self.length = packed, length
        self._ids: list[int] | None = None

    @classmethod
    def of(cls, ids: list[int]) -> PackedIds:
        return cls(msgspec.msgpack.encode(ids), len(ids))

    @property
    def ids(self) -> list[int]:
        if self._ids is None:
            self._ids = msgspec.msgpack.decode(self.packed, type=list[int])
        return self._ids

    def raw(self) -> msgspec.Raw:
        return msgspec.Raw(self.packed)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):
        return self.ids[index]

    def __iter__(self):
        return iter(self.ids)

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (list, PackedIds)) else NotImplemented

    def __reduce__(self):
        return PackedIds, (self.packed, self.length)


def packed(parsed: ParsedRequest) -> ParsedRequest:
    """``parsed`` with its prompts' ids packed (:class:`PackedIds`), for the pipe back to the frontend."""
    prompts = [PackedIds.of(ids) for ids in parsed.prompts]
    parsed.prompt_ids = prompts[0] if prompts else PackedIds.of(parsed.prompt_ids)
    parsed.prompts = prompts
    return parsed


@dataclass
class ParsedRequest:
    chat: bool
    prompt_ids: list[int] | PackedIds
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: list[str]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    # ``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk carries the usage so far.
    continuous_usage: bool
    skip_special_tokens: bool
    model: str
    # Alternatives listed per token's log-probability entry (-1: no log-probabilities).
    logprobs: int = -1
    # Penalties and token controls (frontend/controls.py).
    controls: dict = field(default_factory=dict)
    # Completions: every prompt of the request (``prompt_ids`` is the first), and ``echo``.
    prompts: list[list[int] | PackedIds] = field(default_factory=list)
    prompt_max_tokens: list[int] = field(default_factory=list)  # per prompt: the default fits each one
    echo: bool = False
    # Chat: parse the answer's <tool_call> blocks into tool_calls (tools given, tool_choice not "none").
    parse_tool_calls: bool = False
    parallel_tool_calls: bool = True
    # Chat: the images of the messages, in prompt order.
    images: list[ImageInput] = field(default_factory=list)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_ids(v: Any) -> bool:
    """An array of integers (booleans are not): one pass of C-level type lookups, a 32K-token prompt in
    well under a millisecond (JSON gives no int subclass but bool)."""
    return isinstance(v, list) and (not v or set(map(type, v)) == {int})


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
        raise APIError(400, f"the request body is not valid UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start} "
                            f"({e.reason})") from None
    try:  # msgspec parses a long token-id array about 2.5x faster than json; what it refuses (NaN, 1e400,
        # lone surrogate escapes, every error) json parses or answers, as it would any body
        body = msgspec.json.decode(text)
    except Exception:  # whatever it raises: json answers
        body = _json_loads(text)
    if _SURROGATE_ESCAPE.search(text):
        where = _unencodable_field(body)
        if where is not None:
            raise bad(where, f"'{where}' holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff), which is "
                             "not valid Unicode")
    return body


def _json_loads(text: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise APIError(400, "the request body nests arrays or objects too deeply: this server parses at most about "
                            f"{sys.getrecursionlimit()} levels") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except ValueError:  # an integer too long to convert
        raise APIError(400, f"the request body holds a number of more than {sys.get_int_max_str_digits()} digits, "
                            "more than this server parses") from None


def _panic(e: BaseException) -> bool:
    """A Rust panic in a tokenizer (pyo3's ``PanicException`` derives from BaseException)."""
    return type(e).__name__ == "PanicException"


def _encode(param: str, text: str, tokenizer, limits: Limits, check_length: bool = True) -> list[int]:
    """``text``'s ids; unless ``check_length`` (a prompt to be truncated), a text too long to fit the context
    is refused before it is tokenized."""
    if limits.max_token_bytes and check_length:
        bound = limits.max_model_len * limits.max_token_bytes
        if len(text) >= bound:  # a token covers at most max_token_bytes bytes, so at most as many characters
            chars = min(len(text), len(unicodedata.normalize("NFC", text)))
            if chars >= bound:
                raise bad(param, f"'{param}' has {chars} characters, so at least {-(-chars // limits.max_token_bytes)} "
                                 f"tokens; the model's context length is {limits.max_model_len}")
    try:
        return tokenizer.encode(text)
    except Exception as e:
        raise bad(param, f"'{param}' could not be tokenized: {e}") from None
    except BaseException as e:
        if not _panic(e):
            raise
        raise bad(param, f"'{param}' could not be tokenized (the tokenizer failed: {e}; a very long run of "
                         "whitespace can do this)") from None


def _check_fields(body: Any, allowed: set[str], neutral: dict[str, tuple] = NEUTRAL) -> None:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    for key in body:
        if key not in allowed:
            raise bad(key, f"unknown or unsupported field {_show(key)}")
    for key, values in neutral.items():  # true is not 1, nor false 0
        if key in body and not any(body[key] == v and isinstance(body[key], bool) == isinstance(v, bool)
                                   for v in values):
            raise bad(key, f"'{key}' must be {_alternatives(values)} (other values are not supported), "
                           f"got {_show(body[key])}")


def _sampling(body: dict, limits: Limits) -> dict[str, Any]:
    model = body.get("model", limits.model_name)
    if not isinstance(model, str):
        raise bad("model", f"'model' must be a string, got {_show(model)}")
    if model != limits.model_name:
        raise APIError(400, f"the model {_show(model)} does not exist; this server serves {_show(limits.model_name)}",
                       param="model", code="model_not_found")
    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if not _is_num(temperature) or not 0 <= temperature <= 2:
        raise bad("temperature", f"'temperature' must be a number between 0 and 2, got {_show(temperature)}")
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0
    top_p = body.get("top_p", 1.0)
    if top_p is None:
        top_p = 1.0
    if not _is_num(top_p) or not 0 < top_p <= 1:
        raise bad("top_p", f"'top_p' must be a number greater than 0 and at most 1, got {_show(top_p)}")
    top_k = body.get("top_k", 0)
    if top_k is None:
        top_k = 0
    if not _is_int(top_k) or top_k < -1:
        raise bad("top_k", f"'top_k' must be an integer, -1 or more (-1 and 0: no limit), got {_show(top_k)}")
    if top_k >= limits.vocab_size:
        top_k = 0  # keeps the whole vocabulary: off
    min_p = body.get("min_p", 0.0)
    if min_p is None:
        min_p = 0.0
    if not _is_num(min_p) or not 0 <= min_p <= 1:
        raise bad("min_p", f"'min_p' must be a number between 0 and 1, got {_show(min_p)}")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**63):
        raise bad("seed", f"'seed' must be an integer between -2^63 and 2^63 - 1, got {_show(seed)}")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", "'stop' must be a non-empty string or an array of non-empty strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    flags = {}
    for name, default in (("ignore_eos", False), ("stream", False), ("skip_special_tokens", True)):
        value = body.get(name, default)
        if value is None:
            value = default
        if not isinstance(value, bool):
            raise bad(name, f"'{name}' must be true or false, got {_show(value)}")
        flags[name] = value
    options = body.get("stream_options")
    usage_flags = {"include_usage": False, "continuous_usage_stats": False}
    if options is not None:
        if not flags["stream"]:
            raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if not isinstance(options, dict) or set(options) - set(usage_flags):
            raise bad("stream_options", "'stream_options' must be an object with only 'include_usage' and "
                                        "'continuous_usage_stats'")
        for name in usage_flags:
            value = options.get(name)
            if value is not None and not isinstance(value, bool):
                raise bad(f"stream_options.{name}",
                          f"'stream_options.{name}' must be true or false, got {_show(value)}")
            usage_flags[name] = bool(value)
    include_usage = usage_flags["include_usage"]
    # vLLM's semantics: usage in every chunk only when usage is included at all.
    continuous_usage = include_usage and usage_flags["continuous_usage_stats"]
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", f"'user' must be a string, got {_show(user)}")
    return dict(model=model, temperature=float(temperature), top_p=float(top_p), top_k=max(top_k, 0),
                min_p=float(min_p), seed=seed, stop=stop, include_usage=include_usage,
                continuous_usage=continuous_usage, **flags)


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
        raise bad(name, f"'{name}' must be an integer, 1 or more, got {_show(value)}")
    if value > room:
        raise bad(name, f"'{name}' ({_show(value)}) plus the prompt ({prompt_len} tokens) exceeds the model's context "
                        f"length of {limits.max_model_len} tokens")
    return value


def _check_prompt_ids(ids: list[int], limits: Limits, param: str) -> None:
    if not ids:
        raise bad(param, f"'{param}' must contain at least one token")
    if len(ids) >= limits.max_model_len:
        raise bad(param, f"'{param}' has {len(ids)} tokens; the model's context length is {limits.max_model_len}")
    if len(ids) >= limits.kv_capacity:
        raise bad(param, f"'{param}' has {len(ids)} tokens; the KV cache holds {limits.kv_capacity}")
    if min(ids) >= 0 and max(ids) < limits.vocab_size:
        return
    for t in ids:
        if not 0 <= t < limits.vocab_size:
            raise bad(param, f"'{param}' holds the token id {_show(t)}, outside the vocabulary (0 to "
                             f"{limits.vocab_size - 1})")


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"'{name}' must be true or false, got {_show(value)}")
    return value


def _truncated(body: dict, ids: list[int], limits: Limits) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep the prompt's last k tokens (-1: as many as the context
    length allows, leaving one for the answer)."""
    k = body.get("truncate_prompt_tokens")
    if k is None:
        return ids
    if not _is_int(k) or k < -1 or k == 0:
        raise bad("truncate_prompt_tokens",
                  f"'truncate_prompt_tokens' must be a positive integer or -1, got {_show(k)}")
    keep = limits.max_model_len - 1 if k == -1 else k
    return ids[-keep:] if len(ids) > keep else ids


PROMPT_FORMS = "a string, an array of token ids, or an array of prompts (strings or token-id arrays)"


def _one_prompt(prompt: Any, param: str, limits: Limits, tokenizer, body: dict,
                forms: str = "a string or an array of token ids") -> list[int]:
    if isinstance(prompt, str):
        truncating = body.get("truncate_prompt_tokens") is not None
        ids = _encode(param, prompt, tokenizer, limits, check_length=not truncating)
    elif _is_ids(prompt):
        ids = list(prompt)
    else:
        raise bad(param, f"'{param}' must be {forms}, got {_show(prompt)}")
    ids = _truncated(body, ids, limits)
    _check_prompt_ids(ids, limits, param)
    return ids


def parse_completion(body: Any, limits: Limits, tokenizer) -> ParsedRequest:
    _check_fields(body, COMPLETION_FIELDS, {**{k: v for k, v in NEUTRAL.items() if k != "echo"}, **TOOL_NEUTRAL})
    if "prompt" not in body:
        raise bad("prompt", "'prompt' is required")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise bad("prompt", f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS} per request")
        prompts = [_one_prompt(p, f"prompt[{i}]", limits, tokenizer, body) for i, p in enumerate(prompt)]
    else:  # one prompt, its ids checked once
        prompts = [_one_prompt(prompt, "prompt", limits, tokenizer, body, PROMPT_FORMS)]
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise bad("echo", f"'echo' must be a boolean, got {_show(echo)}")
    params = _sampling(body, limits)

    logprobs = parse_logprobs(body, chat=False)
    given = body.get("max_tokens")
    if echo and _is_int(given) and given == 0:  # the prompt alone (scored, with logprobs)
        max_tokens = [0] * len(prompts)
    else:  # the default (16) is clamped to each prompt's room; a given value must fit every prompt
        max_tokens = [_max_tokens(body, ("max_tokens",), 16, len(p), limits) for p in prompts]
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        if len(p) + max(m, 1) - 1 > limits.kv_capacity:
            param = "max_tokens" if given is not None else ("prompt" if len(prompts) == 1 else f"prompt[{i}]")
            raise bad(param, f"the prompt{'' if len(prompts) == 1 else f' {i}'} ({len(p)} tokens) plus max_tokens "
                             f"({m}) needs more than the {limits.kv_capacity} tokens the KV cache holds")
    controls = parse_controls(body, limits.vocab_size, min(max_tokens))
    n = controls.get("n", 1)
    if len(prompts) * n > MAX_PROMPTS * 2:
        raise bad("n", f"'n' ({n}) times the prompts ({len(prompts)}) is more than {MAX_PROMPTS * 2} choices per "
                       "request")
    if len(prompts) * n > limits.max_requests:
        raise bad("n", f"'n' ({n}) times the prompts ({len(prompts)}) is more than the {limits.max_requests} "
                       "requests this server holds at once (--max-running-requests + --max-queued-requests)")
    return ParsedRequest(chat=False, prompt_ids=prompts[0], max_tokens=max_tokens[0], logprobs=logprobs,
                         controls=controls, prompts=prompts, prompt_max_tokens=max_tokens, echo=echo, **params)


def _message_text(m: dict, i: int, images: list | None = None, limits: Limits | None = None) -> str:
    """A message's content as text; each image part becomes ``IMAGE_MARK`` and its ``(param, resized RGB)`` is
    appended to ``images``."""
    content = m.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        _no_image_mark(content, f"messages[{i}].content")
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            param = f"messages[{i}].content[{j}]"
            if isinstance(part, dict) and part.get("type") == "image_url":
                parts.append(_image_part(part, param, m.get("role"), images, limits))
                continue
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kinds = "a text or image_url part" if limits is not None and limits.images else "a text part"
                raise bad(param, f"'{param}' must be {kinds} "
                                 '({"type": "text", "text": "..."}); got ' + _show(part))
            _no_image_mark(part["text"], param)
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content",
              f"'messages[{i}].content' must be a string, null or an array of content parts, got {_show(content)}")


def _no_image_mark(text: str, param: str) -> None:
    if IMAGE_MARK in text:
        raise bad(param, f"'{param}' holds the character U+{ord(IMAGE_MARK):04X}, which stands for images here")


def _image_part(part: dict, param: str, role, images: list | None, limits: Limits | None) -> str:
    processor = limits.images if limits is not None else None
    if processor is None or images is None:
        raise bad(param, f"'{param}': this model takes no images (its checkpoint has no vision tower)")
    if role != "user":
        raise bad(param, f"'{param}': images go in user messages, not {_show(role)}")
    _only_keys(part, param, ("type", "image_url"))
    spec = part.get("image_url")
    if isinstance(spec, dict):
        _only_keys(spec, f"{param}.image_url", ("url", "detail"))
        url = spec.get("url")
    else:
        url = spec
    if len(images) >= processor.max_images:
        raise bad(param, f"'{param}': a request holds at most {processor.max_images} images (--max-images-per-request)")
    try:
        rgb, _ = processor.resize(read_image_url(url, processor))
    except ImageError as e:
        raise bad(param, f"'{param}.image_url.url': {e}") from None
    images.append((param, rgb))
    return IMAGE_MARK


def _expand_images(ids: list[int], images: list, processor: ImageProcessor) -> tuple[list[int], list[ImageInput]]:
    """``ids`` with each image's one placeholder id repeated to its token count, and the images' inputs."""
    at = [k for k, t in enumerate(ids) if t == processor.image_token_id]
    if len(at) != len(images):
        raise bad("messages", f"the rendered prompt holds {len(at)} image placeholders for {len(images)} images "
                              "(message text may not contain <|image_pad|>)")
    out, inputs, prev = [], [], 0
    for k, (_, rgb) in zip(at, images, strict=True):
        out += ids[prev:k]
        inputs.append(rgb_input(rgb, len(out), processor))
        out += [processor.image_token_id] * inputs[-1].tokens
        prev = k + 1
    return out + ids[prev:], inputs


def _only_keys(value: dict, param: str, allowed: tuple[str, ...]) -> None:
    for key in value:
        if key not in allowed:
            raise bad(f"{param}.{key}", f"unknown field {_show(key)} in '{param}' (allowed: "
                                        f"{', '.join(f'{k!r}' for k in allowed)})")


def _optional(value: dict, key: str, kind: type, param: str, what: str) -> None:
    if value.get(key) is not None and not isinstance(value[key], kind):
        raise bad(f"{param}.{key}", f"'{param}.{key}' must be {what} or null, got {_show(value[key])}")


def _tools(body: dict) -> list[dict]:
    """The request's function tools, as the chat template gets them (null fields left out)."""
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad("tools", f"'tools' must be an array of function tools, got {_show(tools)}")
    out, names = [], set()
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(param, f"'{param}' must be an object "
                             '({"type": "function", "function": {"name": ...}})' f", got {_show(tool)}")
        _only_keys(tool, param, ("type", "function"))
        if tool.get("type") != "function":
            raise bad(f"{param}.type", f"'{param}.type' must be \"function\", got {_show(tool.get('type'))}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad(f"{param}.function", f"'{param}.function' must be an object with a 'name', "
                                           f"got {_show(function)}")
        _only_keys(function, f"{param}.function", ("name", "description", "parameters", "strict"))
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad(f"{param}.function.name", f"'{param}.function.name' must be a string of 1 to 64 letters, "
                                                f"digits, underscores and dashes, got {_show(name)}")
        if name in names:
            raise bad(f"{param}.function.name", f"'{param}.function.name': two tools are named {_show(name)}")
        names.add(name)
        _optional(function, "description", str, f"{param}.function", "a string")
        _optional(function, "parameters", dict, f"{param}.function", "an object (a JSON Schema)")
        _optional(function, "strict", bool, f"{param}.function", "true, false")
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return out


def _tool_choice(body: dict, tools: list[dict]) -> str:
    """``none``, ``auto``, ``required`` or ``function`` (one named function)."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad("tool_choice", f"'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                     '{"type": "function", "function": {"name": ...}}' f", got {_show(choice)}")
        if choice == "required" and not tools:
            raise bad("tool_choice", "'tool_choice' \"required\" needs at least one tool in 'tools'")
        return choice
    if not isinstance(choice, dict):
        raise bad("tool_choice", f"'tool_choice' must be a string or an object, got {_show(choice)}")
    _only_keys(choice, "tool_choice", ("type", "function"))
    if choice.get("type") != "function":
        raise bad("tool_choice.type", f"'tool_choice.type' must be \"function\", got {_show(choice.get('type'))}")
    function = choice.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad("tool_choice.function", "'tool_choice.function' must be an object with a 'name' (a string), "
                                          f"got {_show(function)}")
    _only_keys(function, "tool_choice.function", ("name",))
    if function["name"] not in {t["function"]["name"] for t in tools}:
        raise bad("tool_choice.function.name", f"'tool_choice.function.name' is {_show(function['name'])}, "
                                               "which names no function in 'tools'")
    return "function"


def _tool_calls(m: dict, i: int) -> list[dict]:
    """An assistant message's ``tool_calls``, as the chat template gets them."""
    calls = m.get("tool_calls")
    if not calls:
        return []
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad(param, f"'{param}' must be an array, got {_show(calls)}")
    out = []
    for j, call in enumerate(calls):
        at = f"{param}[{j}]"
        if not isinstance(call, dict):
            raise bad(at, f"'{at}' must be an object, got {_show(call)}")
        _only_keys(call, at, ("id", "type", "function", "index"))
        if call.get("type", "function") != "function":
            raise bad(f"{at}.type", f"'{at}.type' must be \"function\", got {_show(call.get('type'))}")
        _optional(call, "id", str, at, "a string")
        function = call.get("function")
        if not isinstance(function, dict):
            raise bad(f"{at}.function", f"'{at}.function' must be an object with 'name' and 'arguments', "
                                        f"got {_show(function)}")
        _only_keys(function, f"{at}.function", ("name", "arguments"))
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise bad(f"{at}.function.name", f"'{at}.function.name' must be a non-empty string, "
                                             f"got {_show(function.get('name'))}")
        if not isinstance(function.get("arguments"), str):
            raise bad(f"{at}.function.arguments", f"'{at}.function.arguments' must be a string (the arguments "
                                                  f"as JSON text), got {_show(function.get('arguments'))}")
        out.append({"id": call.get("id") or f"call_{j}", "type": "function",
                    "function": {"name": function["name"], "arguments": function["arguments"]}})
    return out


def _no_special_text(value: Any, param: str, tokenizer) -> None:
    """The chat template renders tools and tool calls as template text, where a special-token string
    would become a control token: refuse one there (message content may hold them, as plain text)."""
    specials = [s for s in tokenizer.special_strings() if s]
    stack = [(param, value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            hit = next((s for s in specials if s in item), None)
            if hit is not None:
                raise bad(path, f"'{path}' contains {_show(hit)}, a special token of this model; only message "
                                "content may contain special-token text")
        elif isinstance(item, dict):
            for key, sub in item.items():
                stack += [(f"{path}.{key}", key), (f"{path}.{key}", sub)]
        elif isinstance(item, list):
            stack += [(f"{path}[{k}]", sub) for k, sub in enumerate(item)]


def _render_message(m: Any, i: int, images: list | None = None, limits: Limits | None = None) -> dict:
    """A request message as the chat template gets it."""
    if not isinstance(m, dict):
        raise bad(f"messages[{i}]", f"'messages[{i}]' must be an object, got {_show(m)}")
    role = m.get("role")
    if role is None:
        raise bad(f"messages[{i}].role", f"'messages[{i}].role' is required")
    if role not in ROLES:
        raise bad(f"messages[{i}].role", f"'messages[{i}].role' must be one of {', '.join(map(json.dumps, ROLES))}, "
                                         f"got {_show(role)}")
    own = ROLE_FIELDS.get(role, set())
    for key, value in m.items():
        if key not in MESSAGE_FIELDS and key not in own and not (key in NEUTRAL_MESSAGE_FIELDS and not value):
            where = [r for r, fields in ROLE_FIELDS.items() if key in fields]
            only = f" (only on {where[0]} messages)" if where else ""
            raise bad(f"messages[{i}].{key}", f"unsupported message field {_show(key)}{only}")
    out = {"role": "system" if role == "developer" else role, "content": _message_text(m, i, images, limits)}
    if role == "assistant":
        calls = _tool_calls(m, i)
        if calls:
            out["tool_calls"] = calls
        _optional(m, "reasoning_content", str, f"messages[{i}]", "a string")
        if m.get("reasoning_content"):
            out["reasoning_content"] = m["reasoning_content"]
    elif role == "tool":
        _optional(m, "tool_call_id", str, f"messages[{i}]", "a string")
        if m.get("tool_call_id"):
            out["tool_call_id"] = m["tool_call_id"]
    return out


def parse_chat(body: Any, limits: Limits, tokenizer, answers=None) -> ParsedRequest:
    _check_fields(body, CHAT_FIELDS, CHAT_NEUTRAL)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"'messages' must be a non-empty array, got {_show(messages)}")
    tools = _tools(body)
    choice = _tool_choice(body, tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", f"'parallel_tool_calls' must be true, false or null, got {_show(parallel)}")
    _no_special_text(tools, "tools", tokenizer)
    images: list = []
    rendered = [_render_message(m, i, images, limits) for i, m in enumerate(messages)]
    for i, m in enumerate(rendered):
        for key in ("tool_calls", "reasoning_content"):
            if key in m:
                _no_special_text(m[key], f"messages[{i}].{key}", tokenizer)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", f"'chat_template_kwargs' must be an object, got {_show(kwargs)}")
    for key in ("messages", "add_generation_prompt", "encode_content"):
        if key in kwargs:
            raise bad(f"chat_template_kwargs.{key}", f"'chat_template_kwargs.{key}' is set by the server")
    if tools:
        kwargs = {**kwargs, "tools": tools}
    generation_prompt = _flag(body, "add_generation_prompt", True)
    try:
        ids = tokenizer.apply_chat_template(rendered, add_generation_prompt=generation_prompt,
                                            encode_content=answers.lookup if answers else None,
                                            images=bool(images), **kwargs)
    except Exception as e:  # a template error is the request's fault (roles, kwargs)
        raise bad("messages", f"the chat template could not render these messages: {e}") from None
    except BaseException as e:
        if not _panic(e):
            raise
        raise bad("messages", f"messages could not be tokenized (the tokenizer failed: {e}; a very long run of "
                              "whitespace can do this)") from None
    inputs: list[ImageInput] = []
    if images:
        ids, inputs = _expand_images(ids, images, limits.images)
        if body.get("truncate_prompt_tokens") is not None:
            raise bad("truncate_prompt_tokens", "'truncate_prompt_tokens' cannot cut a prompt that holds images")
    ids = _truncated(body, ids, limits)
    _check_prompt_ids(ids, limits, "messages")
    params = _sampling(body, limits)
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), limits.default_max_tokens or None,
                             len(ids), limits)

    return ParsedRequest(chat=True, prompt_ids=ids, max_tokens=max_tokens, logprobs=parse_logprobs(body, chat=True),
                         controls=parse_controls(body, limits.vocab_size, max_tokens),
                         parse_tool_calls=bool(tools) and choice != "none", parallel_tool_calls=parallel is not False,
                         images=inputs, **params)


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
