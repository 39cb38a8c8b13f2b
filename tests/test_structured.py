"""Structured output: ``response_format`` JSON schemas constrain what random weights generate."""

from __future__ import annotations

import json

import pytest

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "colour": {"enum": ["red", "green", "blue"]},
}, "required": ["ok", "n", "colour"], "additionalProperties": False}


def validates(value, schema) -> bool:
    """The subset of JSON Schema that SCHEMA uses."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) and \
            schema.get("minimum", value) <= value <= schema.get("maximum", value)
    if kind == "object":
        return isinstance(value, dict) and set(schema.get("required", [])) <= set(value) and \
            (schema.get("additionalProperties", True) or set(value) <= set(schema["properties"])) and \
            all(validates(v, schema["properties"][k]) for k, v in value.items() if k in schema.get("properties", {}))
    raise AssertionError(kind)


def test_json_schema_output_validates(client, server):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "Answer in JSON."}]
    for seed in (1, 2, 3):
        out = client.chat.completions.create(model="tiny", messages=messages, response_format=fmt, max_tokens=40,
                                             temperature=1.0, seed=seed)
        value = json.loads(out.choices[0].message.content)
        assert validates(value, SCHEMA), value
        assert out.choices[0].finish_reason == "stop"  # the grammar ended the answer with EOS
    # Streaming, and batched with an unconstrained request.
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=messages, response_format=fmt, max_tokens=40, stream=True) if c.choices)
    assert validates(json.loads(text), SCHEMA)
    free = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                          extra_body={"ignore_eos": True})
    assert free.usage.completion_tokens == 8
    assert server.wait_idle()["tidal_kv_pages_in_use"] == 0


def test_json_object_starts_an_object(client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "{}"}],
                                         response_format={"type": "json_object"}, max_tokens=6, temperature=0)
    assert out.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("fmt,param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": "nope"}, "response_format.json_schema"),
    ({"type": "yaml"}, "response_format"),
])
def test_bad_response_format(server, fmt, param):
    status, resp = server.post("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                        "response_format": fmt, "max_tokens": 4})
    assert status == 400 and resp["error"]["param"] == param, resp
