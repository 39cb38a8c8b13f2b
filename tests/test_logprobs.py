"""Token log-probabilities through the OpenAI SDK, against log_softmax of ``LLM.score``."""

from __future__ import annotations

import pytest

from tidal import LLM
from tidal.tokenizer import load_tokenizer

PROMPT = [101, 2024, 3003, 40, 77, 5]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    llm = LLM(tiny_checkpoint)
    return lambda ids: llm.score(ids).log_softmax(-1)


def output_ids(tap, rid: str) -> list[int]:
    return tap.wait_finished(rid.removeprefix("cmpl-").removeprefix("chatcmpl-"))[1]


def test_completion_logprobs_equal_the_model(client, tap, reference, tiny_checkpoint):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    ids = output_ids(tap, out.id)
    lp = out.choices[0].logprobs
    ref = reference(PROMPT + ids)
    tok = load_tokenizer(tiny_checkpoint)
    assert len(lp.token_logprobs) == len(ids) == 6
    assert lp.tokens == [tok.decode([i], skip_special=False) for i in ids]
    for j, token_id in enumerate(ids):
        row = ref[len(PROMPT) + j - 1]
        assert abs(lp.token_logprobs[j] - float(row[token_id])) < 1e-4
        top = row.topk(3)
        assert list(lp.top_logprobs[j].values()) == pytest.approx(top.values.tolist(), abs=1e-4)
        assert max(lp.top_logprobs[j].values()) == pytest.approx(lp.token_logprobs[j], abs=1e-6)  # greedy
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    streamed = []
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                           stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_chat_logprobs_equal_the_model(client, tap, reference, tiny_checkpoint):
    messages = [{"role": "user", "content": "Name a colour."}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    ids = output_ids(tap, out.id)
    prompt = load_tokenizer(tiny_checkpoint).apply_chat_template(messages)
    ref = reference(prompt + ids)
    content = out.choices[0].logprobs.content
    assert len(content) == len(ids) == 5
    for j, (entry, token_id) in enumerate(zip(content, ids, strict=True)):
        assert abs(entry.logprob - float(ref[len(prompt) + j - 1][token_id])) < 1e-4
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert isinstance(entry.bytes, list)

    streamed = []
    for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                                logprobs=True, stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)
    assert all(e.top_logprobs == [] for e in streamed)  # top_logprobs defaults to 0


def test_no_logprobs_unless_asked(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert out.choices[0].logprobs is None
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          logprobs=False)
    assert chat.choices[0].logprobs is None


@pytest.mark.parametrize("path,body,param,message", [
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "'logprobs' must be an integer between 0 and 20"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs", "between 0 and 20"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo", "not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs",
     "'top_logprobs' needs 'logprobs': true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs",
     "'logprobs' must be a boolean"),
])
def test_bad_logprobs_requests(server, path, body, param, message):
    status, resp = server.post(path, {"model": "tiny", "max_tokens": 1, **body})
    assert status == 400 and resp["error"]["param"] == param
    assert message in resp["error"]["message"]
