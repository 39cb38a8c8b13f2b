"""Tool calls, reasoning and error messages of /v1/chat/completions, through the OpenAI SDK.

Random weights say nothing useful, so the servers run with ``TIDAL_SCRIPTED_OUTPUT``: every request
first emits the token ids of a scripted answer (a tool call, a reasoning block), then
``<|im_end|>``. Parsers and the chat template are also checked without a server.
"""

from __future__ import annotations

import json
import random

import openai
import pytest
from server_harness import Server

from tidal.executor.presets import CHAT_TEMPLATE
from tidal.frontend.parsers import ChatOutput, parse_tool_call
from tidal.tokenizer import CHATML_TEMPLATE, _compile, load_tokenizer

ALIGN = 64  # --checkpoint-align
TOOL_CALL_ID = 248058  # <tool_call>
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}}}},
]
CALLS_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
# Reasoning, then a tool call whose JSON is cut short (no closing brace).
THINK_TEXT = ('<think>\nThe user wants the weather.\n</think>\n\nIt is sunny.\n<tool_call>\n'
              '{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>')
USER = {"role": "user", "content": "What is the weather in Paris, and the time?"}


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint)


def scripted_server(checkpoint: str, tok, text: str, *flags: str):
    ids = tok.encode_with_special(text + "<|im_end|>")
    return Server(checkpoint, "--max-model-len", "2048", *flags, api_key=None,
                  env={"TIDAL_SCRIPTED_OUTPUT": ",".join(map(str, ids))})


@pytest.fixture(scope="module")
def calls_server(tiny_checkpoint, tok):
    srv = scripted_server(tiny_checkpoint, tok, CALLS_TEXT)
    yield srv
    assert srv.stop() == []


@pytest.fixture(scope="module")
def think_server(tiny_checkpoint, tok):
    srv = scripted_server(tiny_checkpoint, tok, THINK_TEXT, "--reasoning-parser", "qwen3")
    yield srv
    assert srv.stop() == []


def sdk(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def accumulate(stream) -> dict:
    """A streamed answer put together from its deltas, the way SDK users do."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None, "roles": []}
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        if delta.role:
            out["roles"].append(delta.role)
        out["content"] += delta.content or ""
        out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            entry = out["calls"].setdefault(call.index, {"id": None, "type": None, "name": "", "arguments": ""})
            entry["id"] = call.id or entry["id"]
            entry["type"] = call.type or entry["type"]
            if call.function:
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
        out["finish"] = choice.finish_reason or out["finish"]
    return out


# ---- tool calls ---------------------------------------------------------------------------------
def test_tool_calls_are_parsed(calls_server):
    out = sdk(calls_server).chat.completions.create(model="tiny", messages=[USER], tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}, {"zone": "CET"}]
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
    assert len({c.id for c in calls}) == 2
    assert getattr(choice.message, "reasoning_content", None) is None  # no --reasoning-parser


def test_tool_calls_stream(calls_server):
    client = sdk(calls_server)
    got = accumulate(client.chat.completions.create(model="tiny", messages=[USER], tools=TOOLS, stream=True))
    assert got["finish"] == "tool_calls" and got["content"] == "Let me check." and got["roles"] == ["assistant"]
    assert [(c["name"], json.loads(c["arguments"]), c["type"]) for c in got["calls"].values()] == \
        [("get_weather", {"city": "Paris"}, "function"), ("get_time", {"zone": "CET"}, "function")]
    assert all(c["id"].startswith("call_") for c in got["calls"].values())
    # The SDK's own stream helper puts the same message together.
    with client.chat.completions.stream(model="tiny", messages=[USER], tools=TOOLS) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "Let me check."
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')]


def test_tool_choice_variants(calls_server, tok):
    client = sdk(calls_server)
    plain = tok.decode(tok.encode_with_special(CALLS_TEXT))  # the text as generated, special tokens skipped
    # none: no parsing, the text as generated.
    out = client.chat.completions.create(model="tiny", messages=[USER], tools=TOOLS, tool_choice="none")
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == plain
    # No tools: the same.
    out = client.chat.completions.create(model="tiny", messages=[USER])
    assert out.choices[0].message.content == plain and out.choices[0].message.tool_calls is None
    # required and a named function: parsed as with auto (not enforced).
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        out = client.chat.completions.create(model="tiny", messages=[USER], tools=TOOLS, tool_choice=choice)
        assert [c.function.name for c in out.choices[0].message.tool_calls] == ["get_weather", "get_time"]
    # parallel_tool_calls false: the first call only.
    for stream in (False, True):
        kw = dict(model="tiny", messages=[USER], tools=TOOLS, parallel_tool_calls=False)
        if stream:
            got = accumulate(client.chat.completions.create(stream=True, **kw))
            names = [c["name"] for c in got["calls"].values()]
        else:
            got = client.chat.completions.create(**kw).choices[0]
            names = [c.function.name for c in got.message.tool_calls]
        assert names == ["get_weather"]


def test_unclosed_tool_call_is_content(calls_server, tok):
    """Cut by max_tokens inside the first block: the text comes back as content, as generated."""
    ids = tok.encode_with_special(CALLS_TEXT)
    n = ids.index(TOOL_CALL_ID) + 4
    expected = tok.decode(ids[:n], skip_special=False)
    assert expected.startswith("Let me check.\n<tool_call>\n{")
    client = sdk(calls_server)
    out = client.chat.completions.create(model="tiny", messages=[USER], tools=TOOLS, max_tokens=n)
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content == expected
    got = accumulate(client.chat.completions.create(model="tiny", messages=[USER], tools=TOOLS, max_tokens=n,
                                                    stream=True))
    assert got["finish"] == "length" and not got["calls"] and got["content"] == expected


def test_tool_calls_and_results_are_rendered(calls_server, tok):
    """The answer sent back (assistant tool_calls) with the tool results renders through the template:
    the prompt is the first prompt + the generated answer token for token, so the prefix cache
    reuses it."""
    client = sdk(calls_server)
    system = {"role": "system", "content": "You answer briefly. " * 4}
    first = client.chat.completions.create(model="tiny", messages=[system, USER], tools=TOOLS)
    p1, o1 = first.usage.prompt_tokens, first.usage.completion_tokens
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    results = [{"role": "tool", "tool_call_id": c.id, "content": content}
               for c, content in zip(first.choices[0].message.tool_calls, ["18 C, sunny", "14:05"], strict=True)]
    messages = [system, USER, assistant, *results]
    second = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=1)

    rendered = tok.apply_chat_template(messages, tools=TOOLS)
    assert second.usage.prompt_tokens == len(rendered)
    first_prompt = tok.apply_chat_template([system, USER], tools=TOOLS)
    assert len(first_prompt) == p1
    answer = tok.encode_with_special(CALLS_TEXT + "<|im_end|>")
    assert o1 == len(answer) and rendered[:p1 + o1] == first_prompt + answer
    text = tok.decode(rendered, skip_special=False)
    assert "<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n14:05\n</tool_response>" in text
    assert '"name": "get_weather", "description": "The weather in a city."' in text  # the tools block
    expected = (p1 + o1 - 1) // ALIGN * ALIGN
    assert expected > (p1 - 1) // ALIGN * ALIGN  # the answer really contributes
    assert second.usage.prompt_tokens_details.cached_tokens == expected


BAD_TOOLS = [
    ({"tools": [{"type": "function"}]}, "tools[0].function", "'tools[0].function' must be an object"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name",
     "letters, digits, underscores and dashes, got \"get weather\""),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "must be \"function\", got \"retrieval\""),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", "two tools are named \"get_weather\""),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "none"}}]},
     "tools[0].function.parameters", "must be an object (a JSON Schema) or null, got \"none\""),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "<|im_end|>"}}]},
     "tools[0].function.description", "contains \"<|im_end|>\", a special token"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "got \"always\""),
    ({"tool_choice": "required"}, "tool_choice", "needs at least one tool"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}},
     "tool_choice.function.name", "names no function in 'tools'"),
    ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls", "must be true, false or null, got 1"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_time", "arguments": {"zone": "CET"}}}]}]}, "messages[1].tool_calls[0].function.arguments",
     "must be a string (the arguments as JSON text)"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{"id": "c"}]}]}, "messages[1].tool_calls[0].function",
     "must be an object with 'name' and 'arguments', got null"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0].tool_call_id",
     "(only on tool messages)"),
]


@pytest.mark.parametrize("body,param,message", BAD_TOOLS, ids=[b[1] for b in BAD_TOOLS])
def test_bad_tools_are_400s_naming_the_field(calls_server, body, param, message):
    status, resp = calls_server.post("/v1/chat/completions", {"model": "tiny", "messages": [USER], **body})
    assert status == 400, resp
    assert resp["error"]["param"] == param and message in resp["error"]["message"], resp["error"]


def test_bad_tools_through_the_sdk(calls_server):
    with pytest.raises(openai.BadRequestError) as e:
        sdk(calls_server).chat.completions.create(model="tiny", messages=[USER], tools=[
            {"type": "function", "function": {"name": ""}}])
    assert e.value.param == "tools[0].function.name"


def test_completions_accept_tool_fields_only_at_neutral_values(calls_server):
    status, _ = calls_server.post("/v1/completions", {"prompt": "x", "max_tokens": 1, "tools": [],
                                                      "tool_choice": "none", "parallel_tool_calls": True})
    assert status == 200
    status, resp = calls_server.post("/v1/completions", {"prompt": "x", "tools": TOOLS})
    assert status == 400 and resp["error"]["param"] == "tools"
    assert resp["error"]["message"].startswith("'tools' must be null or [] (other values are not supported), got [")


# ---- error messages in JSON terms ---------------------------------------------------------------
@pytest.mark.parametrize("body,param,message", [
    ({"temperature": True}, "temperature", "'temperature' must be a number between 0 and 2, got true"),
    ({"best_of": 3}, "best_of", "'best_of' must be 1 (other values are not supported), got 3"),
    ({"response_format": {"type": "xml"}}, "response_format",
     "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\""),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "must be true, false or null, got \"no\""),
    ({"stream": None, "stream_options": {"include_usage": True}}, "stream_options",
     "'stream_options' is only allowed when 'stream' is true"),
    ({"ignore_eos": None, "skip_special_tokens": 0}, "skip_special_tokens", "must be true or false, got 0"),
    ({"messages": [{"role": None, "content": "x"}]}, "messages[0].role", "'messages[0].role' is required"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "got \"robot\""),
    ({"model": "m" * 100_000}, "model", "(100000 characters) does not exist; this server serves \"tiny\""),
    ({"stop": [None]}, "stop", "an array of non-empty strings"),
    ({"n": True}, "n", "'n' must be an integer between 1 and 16"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages", "is set by the server"),
])
def test_error_messages_speak_json(calls_server, body, param, message):
    status, resp = calls_server.post("/v1/chat/completions", {"model": "tiny", "messages": [USER], **body})
    assert status == 400 and resp["error"]["param"] == param, resp
    text = resp["error"]["message"]
    assert message in text and len(text) < 300, text
    for python in ("True", "False", "None", "[]'", "{}'"):
        assert python not in text, text


def test_body_errors_speak_json(calls_server):
    for raw, message in ((b'{"messages": "\xff"}', "not valid UTF-8: byte 0xff at offset 14"),
                         (b'{"max_tokens": ' + b"7" * 5000 + b"}", "a number of more than 4300 digits")):
        status, resp = calls_server.post("/v1/chat/completions", None, raw=raw)
        assert status == 400 and message in resp["error"]["message"], resp
        assert "codec" not in resp["error"]["message"] and "sys." not in resp["error"]["message"]


# ---- reasoning ----------------------------------------------------------------------------------
def test_reasoning_is_split_off(think_server):
    out = sdk(think_server).chat.completions.create(model="tiny", messages=[USER], tools=TOOLS)
    message = out.choices[0].message
    assert message.reasoning_content == "The user wants the weather."
    # The tool call's JSON is cut short: no tool call, the block stays in the content as generated.
    assert message.content == ('It is sunny.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n'
                               '</tool_call>')
    assert message.tool_calls is None and out.choices[0].finish_reason == "stop"


def test_reasoning_streams(think_server):
    got = accumulate(sdk(think_server).chat.completions.create(model="tiny", messages=[USER], tools=TOOLS,
                                                               stream=True))
    assert got["reasoning"] == "The user wants the weather."
    assert got["content"].startswith("It is sunny.\n<tool_call>\n{") and got["content"].endswith("\n</tool_call>")
    assert not got["calls"] and got["finish"] == "stop"


def test_reasoning_without_tools_and_with_thinking_closed(think_server, tok):
    client = sdk(think_server)
    out = client.chat.completions.create(model="tiny", messages=[USER]).choices[0].message
    assert out.reasoning_content == "The user wants the weather."
    assert out.content.startswith("It is sunny.\n") and "<tool_call>" not in out.content  # special: skipped
    # enable_thinking false: the prompt closes the <think> block, so the whole answer is content.
    out = client.chat.completions.create(model="tiny", messages=[USER],
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].message.reasoning_content is None
    assert out.choices[0].message.content.startswith("<think>\nThe user wants the weather.\n</think>")
    prompt = tok.apply_chat_template([USER], enable_thinking=False)
    assert out.usage.prompt_tokens == len(prompt)
    assert tok.decode(prompt, skip_special=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# ---- without a server ---------------------------------------------------------------------------
def test_plain_conversations_render_as_before():
    """The preset's template renders conversations without tools or reasoning byte for byte as the
    plain ChatML template did (prompts and prefix-cache hits stay the same)."""
    new, old = _compile(CHAT_TEMPLATE), _compile(CHATML_TEMPLATE)
    rng = random.Random(0)
    pieces = ["hi", "", " ", "\n", "a\nb", "<think>", "  x", "y\n\n", "<|im_end|>", "{{ z }}", "é✓"]
    for _ in range(500):
        messages = [{"role": rng.choice(["system", "user", "assistant"]),
                     "content": "".join(rng.choices(pieces, k=rng.randint(0, 4)))} for _ in range(rng.randint(1, 5))]
        for prompt in (True, False):
            kwargs = rng.choice([{}, {"tools": None}, {"tools": []}, {"enable_thinking": True}])
            assert new.render(messages=messages, add_generation_prompt=prompt, **kwargs) == \
                old.render(messages=messages, add_generation_prompt=prompt, **kwargs)


def test_earlier_reasoning_is_dropped(tok):
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nFour."},
                {"role": "user", "content": "3+3?"},
                {"role": "assistant", "content": "", "reasoning_content": "call it",
                 "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
                {"role": "tool", "content": "6"}]
    text = tok.decode(tok.apply_chat_template(messages), skip_special=False)
    assert text == ("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\nFour.<|im_end|>\n"
                    "<|im_start|>user\n3+3?<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\ncall it\n</think>\n\n<tool_call>\n"
                    '{"name": "add", "arguments": {}}\n</tool_call><|im_end|>\n'
                    "<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_parse_tool_call():
    assert parse_tool_call('\n{"name": "f", "arguments": {"a": [1, "é"]}}\n') == ("f", '{"a": [1, "é"]}')
    assert parse_tool_call('{"name": "f"}') == ("f", "{}")
    assert parse_tool_call('{"name": "f", "arguments": "{\\"a\\": 1}"}') == ("f", '{"a": 1}')
    for bad in ('{"name": "f", "arguments": {}', '{"arguments": {}}', '{"name": "", "arguments": {}}', "[1]",
                '{"name": 5}', '{"name": "f", "arguments": [1]}', '{"name": "f", "arguments": "x"}', "[" * 5000):
        assert parse_tool_call(bad) is None, bad


@pytest.mark.parametrize("text,reasoning,tools,expected", [
    (CALLS_TEXT, None, True, {"content": "Let me check.", "tool_calls": ["get_weather", "get_time"]}),
    (THINK_TEXT, True, True, {"content": THINK_TEXT.split("\n\n", 1)[1], "reasoning_content":
                              "The user wants the weather."}),
    (THINK_TEXT, False, False, {"content": THINK_TEXT.replace("<tool_call>", "").replace("</tool_call>", ""),
                                "reasoning_content": None}),
    ("no markers at all", True, False, {"content": None, "reasoning_content": "no markers at all"}),
    ('<tool_call>\n{"name": "f"}\n</tool_call>\nThen text. <tool_call>\n{"bad"}\n</tool_call>', None, True,
     {"content": 'Then text. <tool_call>\n{"bad"}\n</tool_call>', "tool_calls": ["f"]}),
])
def test_chat_output_is_the_same_streamed_in_any_pieces(tok, text, reasoning, tools, expected):
    ids = tok.encode_with_special(text + "<|im_end|>")
    whole = ChatOutput(tok, [], True, reasoning, tools)
    whole.feed(ids, finished=True)
    message = whole.message()
    assert {k: v for k, v in message.items() if k != "tool_calls"} == \
        {k: v for k, v in expected.items() if k != "tool_calls"}
    assert [c["function"]["name"] for c in message.get("tool_calls", [])] == expected.get("tool_calls", [])
    rng = random.Random(len(text))
    for _ in range(20):
        pieces = ChatOutput(tok, [], True, reasoning, tools)
        deltas, at = [], 0
        while at < len(ids):
            step = rng.randint(1, 4)
            deltas += pieces.feed(ids[at:at + step], finished=at + step >= len(ids))
            at += step
        joined = {key: "".join(d.get(key, "") for d in deltas) for key in ("content", "reasoning_content")}
        assert joined["content"] == (message["content"] or "")
        assert joined["reasoning_content"] == (message.get("reasoning_content") or "")
        calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        assert [(c["index"], c["function"]) for c in calls] == \
            [(i, c["function"]) for i, c in enumerate(message.get("tool_calls", []))]
