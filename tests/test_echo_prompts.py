"""Completions ``echo`` with prompt log-probabilities and several prompts in one request, through the
official SDK, against ``LLM.score`` and against each prompt sent alone."""

from __future__ import annotations

import random

import openai
import pytest

from tidal import LLM
from tidal.tokenizer import load_tokenizer

PROMPT = [101, 2024, 3003, 40, 77, 5, 912, 4410, 63, 2]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    llm = LLM(tiny_checkpoint)
    return lambda ids: llm.score(ids).log_softmax(-1)


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint)


def check_prompt_logprobs(lp, prompt: list[int], reference, tok, k: int) -> None:
    """Entries ``[0, len(prompt))`` of a completions ``logprobs`` are the prompt's: ``null`` first, then
    log_softmax of the model at each previous position, with its top ``k``."""
    ref = reference(prompt)
    assert lp.tokens[:len(prompt)] == [tok.decode([t], skip_special=False) for t in prompt]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(prompt)):
        row = ref[i - 1]
        assert lp.token_logprobs[i] == pytest.approx(float(row[prompt[i]]), abs=1e-4)
        if k:
            assert list(lp.top_logprobs[i].values()) == pytest.approx(row.topk(k).values.tolist(), abs=1e-4)


def test_echo_with_logprobs_returns_the_prompt_scored_then_the_answer(client, reference, tok):
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True})
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, echo=True,
                                    extra_body={"ignore_eos": True})
    prompt_text = tok.decode(PROMPT, skip_special=False)
    choice = out.choices[0]
    assert choice.text == prompt_text + plain.choices[0].text
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(PROMPT) + 5
    check_prompt_logprobs(lp, PROMPT, reference, tok, 2)
    # The answer's entries are those of the same request without echo, offsets shifted by the prompt.
    assert lp.token_logprobs[len(PROMPT):] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert lp.text_offset[len(PROMPT):] == [o + len(prompt_text) for o in plain.choices[0].logprobs.text_offset]
    assert lp.text_offset[:len(PROMPT)] == sorted(lp.text_offset[:len(PROMPT)])
    assert out.usage.prompt_tokens == len(PROMPT) and out.usage.completion_tokens == 5


def test_echo_after_a_prefix_cache_hit_still_scores_every_prompt_token(server, client, reference, tok):
    prompt = [random.Random(3).randrange(300, 9000) for _ in range(150)]
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    second = client.completions.create(model="tiny", prompt=prompt + [7], max_tokens=1)
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # the prompt is in the cache
    out = client.completions.create(model="tiny", prompt=prompt + [7], max_tokens=1, logprobs=0, echo=True)
    # Documented: echo with logprobs computes the whole prompt (no prefix-cache reuse).
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    check_prompt_logprobs(out.choices[0].logprobs, prompt + [7], reference, tok, 0)
    assert first.usage.prompt_tokens == len(prompt)
    assert server.wait_idle()["tidal_kv_pages_in_use"] == 0


def test_echo_with_max_tokens_zero_scores_the_prompt_alone(client, reference, tok):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, logprobs=1, echo=True)
    choice = out.choices[0]
    assert choice.text == tok.decode(PROMPT, skip_special=False)
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0
    assert len(choice.logprobs.token_logprobs) == len(PROMPT)
    check_prompt_logprobs(choice.logprobs, PROMPT, reference, tok, 1)
    no_lp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True)
    assert no_lp.choices[0].text == choice.text and no_lp.choices[0].logprobs is None


def test_echo_streams_the_prompt_first(client, reference, tok):
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                            logprobs=1, stream=True, extra_body={"ignore_eos": True}))
    prompt_text = tok.decode(PROMPT, skip_special=False)
    assert chunks[0].choices[0].text == prompt_text
    check_prompt_logprobs(chunks[0].choices[0].logprobs, PROMPT, reference, tok, 1)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt_text + plain.choices[0].text
    later = [c.choices[0].logprobs for c in chunks[1:] if c.choices and c.choices[0].logprobs]
    assert later and later[0].text_offset[0] == len(prompt_text)
    echo_only = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, echo=True, stream=True))
    assert echo_only[0].choices[0].text == prompt_text and echo_only[0].choices[0].logprobs is None


def test_several_prompts_give_each_prompt_its_choices(client):
    prompts = ["The tide comes", [500, 600, 700, 800, 900], "in and goes out"]
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True}) for p in prompts]
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=4, temperature=0, n=2,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == list(range(6))
    for p, single in enumerate(alone):
        for i in range(2):
            assert out.choices[p * 2 + i].text == single.choices[0].text
    assert out.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # each prompt once
    assert out.usage.completion_tokens == 6 * 4
    stream = list(client.completions.create(model="tiny", prompt=prompts, max_tokens=4, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True}))
    texts = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {p: a.choices[0].text for p, a in enumerate(alone)}
    assert stream[-1].usage.prompt_tokens == out.usage.prompt_tokens
    assert stream[-1].usage.completion_tokens == 3 * 4


def test_several_seeded_prompts_sample_with_seed_plus_choice_index(client):
    prompts = ["one prompt", "another prompt"]
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=1.0, seed=11, n=2)
    for p, prompt in enumerate(prompts):
        for i in range(2):
            alone = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1.0,
                                              seed=11 + p * 2 + i)
            assert out.choices[p * 2 + i].text == alone.choices[0].text


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"prompt": "x", "echo": "yes"}, "echo", "'echo' must be a boolean"),
    ({"prompt": ["ok", 5]}, "prompt", "'prompt' must be a string, an array of token ids"),
    ({"prompt": ["ok", [1, "a"]]}, "prompt[1]", "'prompt[1]' must be a string or an array of token ids"),
    ({"prompt": ["x"] * 65}, "prompt", "at most 64 per request"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "'max_tokens' must be an integer, 1 or more"),
    ({"prompt": ["ok", []]}, "prompt[1]", "'prompt[1]' must contain at least one token"),
])
def test_bad_echo_and_prompt_lists(client, body, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", **body)
    err = e.value.body
    assert err["param"] == param and message in err["message"]


def test_choices_beyond_what_the_server_holds_are_refused_up_front(tiny_checkpoint):
    from server_harness import Server

    srv = Server(tiny_checkpoint, "--max-running-requests", "2", "--max-queued-requests", "1",
                 "--kv-pool-tokens", "512", api_key=None)
    try:
        # More choices than the server ever holds at once: a 400 (a retry cannot help), nothing runs.
        status, body = srv.post("/v1/completions", {"model": "tiny", "prompt": ["a", "b"], "n": 2, "max_tokens": 2})
        assert status == 400 and body["error"]["param"] == "n" and "3 requests" in body["error"]["message"]
        # A prompt of the list that can never fit the KV cache: a 400 naming it, before any streaming.
        status, body = srv.post("/v1/completions", {"model": "tiny", "prompt": [[6] * 10, [5] * 500], "max_tokens": 20,
                                                    "stream": True})
        assert status == 400 and body["error"]["param"] == "max_tokens" and "512 tokens" in body["error"]["message"]
        status, body = srv.post("/v1/completions", {"model": "tiny", "prompt": [[6] * 10, [5] * 510]})
        assert status == 400 and body["error"]["param"] == "prompt[1]"
        status, body = srv.post("/v1/completions", {"model": "tiny", "prompt": ["a", "b"], "n": 1, "max_tokens": 2})
        assert status == 200 and len(body["choices"]) == 2
        m = srv.wait_idle()
        assert m['tidal_requests_total{finish_reason="length"}'] == 2 and m["tidal_kv_pages_in_use"] == 0
    finally:
        assert srv.stop() == []


def test_echo_text_offsets_index_the_text_when_characters_span_tokens(client, tok):
    prompt = "\U0001d518\U0001d52b\U0001d526 ok \u0a6e\U00013000"
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=0,
                                    temperature=0, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    ids = tok.encode(prompt)
    assert choice.text.startswith(prompt)
    offsets = choice.logprobs.text_offset
    assert len(offsets) == len(ids) + 4
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(choice.text)
    assert offsets[len(ids)] == len(prompt)  # the answer starts where the prompt's text ends
    # Token i starts after the characters its predecessors' bytes complete.
    for i in range(len(ids)):
        before = b"".join(tok.token_bytes(t) for t in ids[:i]).decode("utf-8", errors="ignore")
        assert offsets[i] == len(before)


def test_default_max_tokens_fit_each_prompt():
    from tidal.frontend.protocol import Limits, parse_completion

    limits = Limits(model_name="m", max_model_len=100, kv_capacity=1000, vocab_size=1000)
    parsed = parse_completion({"prompt": [[1, 2], [3] * 95]}, limits, tokenizer=None)
    assert parsed.prompt_max_tokens == [16, 5]  # the default, clamped to each prompt's room
    parsed = parse_completion({"prompt": [[1, 2], [3] * 80], "max_tokens": 20}, limits, tokenizer=None)
    assert parsed.prompt_max_tokens == [20, 20]
    with pytest.raises(Exception) as e:  # a given value must fit every prompt
        parse_completion({"prompt": [[1, 2], [3] * 95], "max_tokens": 20}, limits, tokenizer=None)
    assert e.value.param == "max_tokens"


@pytest.mark.parametrize("value", [False, 0.0])
def test_echo_max_tokens_zero_must_be_the_integer(client, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", echo=True, max_tokens=value)
    assert e.value.body["param"] == "max_tokens"


def test_echo_null_is_no_echo(server):
    status, body = server.post("/v1/completions", {"model": "tiny", "prompt": "abc", "echo": None, "max_tokens": 1})
    assert status == 200 and not body["choices"][0]["text"].startswith("abc")


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_n_scores_the_prompt_once_and_shares_it(server, client, reference, tok, stream):
    prompt = [random.Random(11 + stream).randrange(300, 9000) for _ in range(150)]
    before = server.wait_idle()
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=1, echo=True, n=3,
                  extra_body={"ignore_eos": True})
    if stream:
        texts, lps = {}, {}
        for chunk in client.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                if c.logprobs and c.logprobs.token_logprobs and c.logprobs.token_logprobs[0] is None:
                    lps[c.index] = c.logprobs  # the echo chunk
        assert sorted(lps) == [0, 1, 2]
        for i in range(3):
            check_prompt_logprobs(lps[i], prompt, reference, tok, 1)
        assert texts[0] == texts[1] == texts[2]
    else:
        out = client.completions.create(**kwargs)
        for c in out.choices:
            check_prompt_logprobs(c.logprobs, prompt, reference, tok, 1)
        assert out.choices[0].text == out.choices[1].text == out.choices[2].text
    after = server.wait_idle()
    # Choices 1 and 2 restored the prompt from the prefix cache (up to its last checkpoint).
    cached = after["tidal_scheduler_cached_tokens_total"] - before["tidal_scheduler_cached_tokens_total"]
    assert cached >= 2 * 128
