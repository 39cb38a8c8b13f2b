"""``n`` > 1 through the OpenAI SDK: the prompt is computed by the first choice, the others find it in
the prefix cache; each choice samples on its own (seed + index)."""

from __future__ import annotations

from server_harness import Tap

PROMPT = [1000 + i for i in range(300)]  # 300 tokens: checkpoint at 256 (--checkpoint-align 64)


def test_greedy_choices_are_equal_and_share_the_prompt(server, client):
    tap = Tap(server.tap_addr)
    try:
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=3, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert len({c.text for c in out.choices}) == 1 and out.choices[0].text
        assert out.usage.prompt_tokens == 300 and out.usage.completion_tokens == 18
        rid = out.id.removeprefix("cmpl-")
        admitted = [tap.wait_finished(r)[0] for r in (rid, f"{rid}.1", f"{rid}.2")]
        ids = [tap.wait_finished(r)[1] for r in (rid, f"{rid}.1", f"{rid}.2")]
        assert ids[0] == ids[1] == ids[2]
        # Choice 0 computed the prompt; the others restored it from the prefix cache (all but the tail).
        assert [a["cached_tokens"] for a in admitted] == [0, 256, 256]
    finally:
        tap.close()
    assert server.wait_idle()["tidal_kv_pages_in_use"] == 0


def test_seeded_choices_differ_and_repeat(client):
    def ask():
        out = client.completions.create(model="tiny", prompt=PROMPT[:40], max_tokens=8, n=3, temperature=1.0,
                                        seed=123, extra_body={"ignore_eos": True})
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    first = ask()
    assert len(set(first)) > 1  # each choice samples on its own
    assert ask() == first  # choice i uses seed + i: the same request gives the same choices


def test_streaming_chat_choices(client):
    texts, finish, usage = {}, {}, None
    for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=5, n=2, temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}):
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert set(texts) == {0, 1} and texts[0] == texts[1] and texts[0]
    assert finish == {0: "length", 1: "length"}
    assert usage.completion_tokens == 10


def test_too_many_choices(server):
    status, resp = server.post("/v1/completions", {"model": "tiny", "prompt": "x", "n": 17})
    assert status == 400 and resp["error"]["param"] == "n"
    assert "'n' must be an integer between 1 and 16" in resp["error"]["message"]
