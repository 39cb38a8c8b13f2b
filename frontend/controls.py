"""Choices, penalties and token controls of a request: ``n``, ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``logit_bias``, ``min_tokens``, ``stop_token_ids`` and
``include_stop_str_in_output``. The executor applies the logit changes on the device, batched."""

from __future__ import annotations

import json
import math
from typing import Any

from .errors import bad

MAX_CHOICES = 16
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 64


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and isinstance(value, float):
        ok = math.isfinite(value)
    if ok:
        try:
            number = float(value)
        except OverflowError:
            ok = False
    if not ok or not (low < number if low_open else low <= number) or number > high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise bad(name, f"'{name}' must be a number in {interval}")
    return number


def _token_id(value: Any, vocab: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab


def parse_controls(body: dict, vocab_size: int, max_tokens: int) -> dict[str, Any]:
    """``{"sampling": SamplingParams fields, "stop_token_ids": [...], "include_stop_str_in_output": bool,
    "n": choices}``."""
    sampling: dict[str, Any] = {
        "presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0, 0.0, 10.0, low_open=True),
    }
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids")
        parsed = {}
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and key.isdigit() and len(key) <= 9 else None
            if token is None or not _token_id(token, vocab_size):
                raise bad("logit_bias", f"'logit_bias' keys must be token ids in [0, {vocab_size})")
            parsed[token] = _number({"logit_bias": value}, "logit_bias", 0.0, -100.0, 100.0)
        sampling["logit_bias"] = parsed
    min_tokens = body.get("min_tokens")
    if min_tokens is not None:
        if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or not 0 <= min_tokens <= max_tokens:
            raise bad("min_tokens", f"'min_tokens' must be an integer between 0 and 'max_tokens' ({max_tokens})")
        sampling["min_tokens"] = min_tokens
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list) or len(stop_ids) > MAX_STOP_TOKEN_IDS \
            or not all(_token_id(t, vocab_size) for t in stop_ids):
        raise bad("stop_token_ids", f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids "
                                    f"in [0, {vocab_size})")
    include = body.get("include_stop_str_in_output", False)
    if include is None:
        include = False
    if not isinstance(include, bool):
        raise bad("include_stop_str_in_output", "'include_stop_str_in_output' must be a boolean")
    grammar = _response_format(body)
    if grammar is not None:
        sampling["grammar"] = grammar
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise bad("n", f"'n' must be an integer between 1 and {MAX_CHOICES}")
    return {"sampling": sampling, "stop_token_ids": stop_ids, "include_stop_str_in_output": include, "n": n}


def _response_format(body: dict) -> str | None:
    """The llguidance grammar of ``response_format`` (``json_object``, ``json_schema``), or ``None``.

    JSON is generated compact (no free whitespace between tokens): a model that wanders would
    otherwise fill ``max_tokens`` with blanks."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise bad("response_format.json_schema", "'response_format.json_schema' must be an object with a "
                                                     "'schema' object")
        if spec.get("strict") not in (None, True, False):
            raise bad("response_format.json_schema.strict", "'strict' must be true or false")
        schema = spec.get("schema", {})
    else:
        raise bad("response_format", "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\"")
    if body.get("ignore_eos"):
        raise bad("ignore_eos", "'ignore_eos' cannot be used with 'response_format': the grammar ends the answer")
    try:
        import llguidance
        from llguidance import LLMatcher
    except ImportError:
        raise bad("response_format", "'response_format' needs the llguidance package on the server") from None
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    try:
        grammar = llguidance.grammar_from("json_schema", json.dumps(schema))
        error = LLMatcher.validate_grammar(grammar)
    except Exception as e:  # the compiler's own message says what is wrong
        error = str(e) or type(e).__name__
    if error:
        raise bad("response_format.json_schema.schema", f"the JSON schema cannot be used: {error[:300]}")
    return grammar
