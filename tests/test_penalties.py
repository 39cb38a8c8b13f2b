"""Penalties and token controls: the batched device code against a plain torch reference, and end to
end through the server against ``LLM.score`` with the penalties applied by hand."""

from __future__ import annotations

import pytest
import torch

from tidal import LLM
from tidal.executor.sampler import TokenCounts, adjust_logits
from tidal.messages import SamplingParams, SegmentSpec

IM_END = 248046
PROMPT = [300, 301, 302, 303, 300, 301]


def reference_row(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int],
                  index: int) -> torch.Tensor:
    """vLLM's semantics, one token at a time."""
    out = logits.clone()
    for token in range(out.shape[0]):
        count = output.count(token)
        if p.repetition_penalty != 1 and (count or token in prompt):
            out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
        out[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    for token, bias in p.logit_bias.items():
        out[token] += bias
    if index < p.min_tokens:
        for token in p.min_tokens_ban:
            out[token] = float("-inf")
    return out


def test_adjust_logits_matches_the_reference():
    gen = torch.Generator().manual_seed(0)
    vocab = 50
    logits = torch.randn(5, vocab, generator=gen) * 3
    params = [
        SamplingParams(frequency_penalty=0.7, presence_penalty=0.3),
        SamplingParams(repetition_penalty=1.8),
        SamplingParams(repetition_penalty=0.6, frequency_penalty=-0.4, logit_bias={3: 5.0, 7: -100.0}),
        SamplingParams(min_tokens=4, min_tokens_ban=[1, 2]),
        SamplingParams(),
    ]
    prompts = [[1, 2, 3], [4, 4, 9, 30], [5, 6], [], []]
    outputs = [[7, 7, 8, 49], [9, 10, 10], [3, 11], [12], []]
    indices = [4, 3, 2, 1, 0]
    counts = TokenCounts(torch.device("cpu"))
    specs = [SegmentSpec(rid=f"r{i}", slot=i, start=0, token_ids=[], sampling=p, sample=True,
                         history=(prompts[i] if p.repetition_penalty != 1 else []) + outputs[i],
                         history_prompt=len(prompts[i]) if p.repetition_penalty != 1 else 0)
             for i, p in enumerate(params)]
    rows = counts.rows(specs, vocab)
    got = adjust_logits(logits, params, indices, rows)
    for r, p in enumerate(params):
        expect = reference_row(logits[r], p, prompts[r] if p.repetition_penalty != 1 else [], outputs[r], indices[r])
        torch.testing.assert_close(got[r], expect)
    # Counting on: a sampled token joins the counts of its row only.
    TokenCounts.count(rows, [7, 9, 3, 12, 0])
    assert rows[0][0][7] == 3 and rows[1][0][9] == 2 and rows[3] is None and rows[4] is None
    # The next segment of the same request (no history) keeps the counts.
    again = counts.rows([SegmentSpec(rid="r0", slot=0, start=0, token_ids=[], sampling=params[0], sample=True)], vocab)
    assert again[0][0][7] == 3


def run(server, tap, **body):
    status, resp = server.post("/v1/completions", {"model": "tiny", "prompt": PROMPT, "temperature": 0, **body})
    assert status == 200, resp
    ids = tap.wait_finished(resp["id"].removeprefix("cmpl-"))[1]
    return resp, ids


def test_penalties_end_to_end_equal_the_reference(server, tap, tiny_checkpoint):
    # A bias makes a new token (1234) and a prompt token (300) the favourites, so the penalties bite.
    bias = {1234: 6.0, 300: 5.0}
    body = {"max_tokens": 8, "ignore_eos": True, "frequency_penalty": 1.5, "presence_penalty": 0.5,
            "repetition_penalty": 1.4, "logit_bias": {str(k): v for k, v in bias.items()}}
    _, ids = run(server, tap, **body)
    params = SamplingParams(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.4, logit_bias=bias)
    llm = LLM(tiny_checkpoint)
    expected: list[int] = []
    for index in range(8):
        logits = llm.score(PROMPT + expected)[-1]
        expected.append(int(reference_row(logits, params, PROMPT, expected, index).argmax()))
    assert ids == expected
    biased = run(server, tap, max_tokens=8, ignore_eos=True, logit_bias=body["logit_bias"])[1]
    assert biased == [1234] * 8 and ids != biased  # the penalties changed the greedy path
    assert ids.count(1234) < 8


def test_logit_bias_min_tokens_and_stop_token_ids(server, tap):
    resp, ids = run(server, tap, max_tokens=5, ignore_eos=True, logit_bias={"1234": 100})
    assert ids == [1234] * 5
    # EOS pushed to the top, held back for min_tokens: three other tokens, then EOS ends the request.
    resp, ids = run(server, tap, max_tokens=10, logit_bias={str(IM_END): 100}, min_tokens=3)
    assert len(ids) == 4 and ids[-1] == IM_END and IM_END not in ids[:3]
    assert resp["choices"][0]["finish_reason"] == "stop" and resp["usage"]["completion_tokens"] == 4
    resp, ids = run(server, tap, max_tokens=10, ignore_eos=True, logit_bias={"777": 100}, stop_token_ids=[777])
    assert ids == [777] and resp["choices"][0]["finish_reason"] == "stop"


def test_include_stop_str_in_output(server):
    status, plain = server.post("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 12,
                                                    "temperature": 0, "ignore_eos": True})
    text = plain["choices"][0]["text"]
    stop = text[3:6]
    for include in (False, True):
        status, resp = server.post("/v1/completions", {
            "model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stop": [stop], "include_stop_str_in_output": include})
        at = text.index(stop)
        assert resp["choices"][0]["text"] == (text[:at + len(stop)] if include else text[:at])
        assert resp["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "a lot"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"999999999": 1}}, "logit_bias"),
    ({"min_tokens": 9}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
])
def test_bad_controls(server, body, param):
    status, resp = server.post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4, **body})
    assert status == 400 and resp["error"]["param"] == param, resp
    assert f"'{param}'" in resp["error"]["message"]
