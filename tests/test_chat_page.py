"""The chat page at ``/``: headers over plain HTTP, then Debian's Chromium driven by Playwright against a real
``tidal serve`` of the tiny checkpoint with an API key.

Chromium comes from the system package (``.ci/run`` installs it); ``TIDAL_SKIP_BROWSER=1`` skips the browser
cases explicitly.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request

import pytest
from server_harness import API_KEY, Server

CHROMIUM = "/usr/bin/chromium"
# Without the background-networking flags Chromium keeps dialing out, and a closed network refuses it.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 30_000
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    # A 16-token checkpoint alignment lets a short second turn find the first one in the prefix cache.
    srv = Server(tiny_checkpoint, "--checkpoint-align", "16")
    yield srv
    assert srv.stop() == []


@pytest.fixture(scope="module")
def browser():
    if os.environ.get("TIDAL_SKIP_BROWSER") == "1":
        pytest.skip("TIDAL_SKIP_BROWSER=1")
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: the chat-page test needs Debian's chromium package, which .ci/run "
                    "installs (apt-get install -y chromium); set TIDAL_SKIP_BROWSER=1 to skip these cases")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    """A fresh browser context (empty localStorage) and page."""
    context = browser.new_context(viewport={"width": 1100, "height": 800})
    context.set_default_timeout(TIMEOUT_MS)
    yield context.new_page()
    context.close()


def open_with_key(page, server) -> None:
    from playwright.sync_api import expect

    page.goto(server.url + "/")
    page.locator("#key").fill(API_KEY)
    page.locator("#key").press("Tab")  # "change": the page stores the key and lists the models
    expect(page.locator("#model")).to_have_value("tiny")


def ask(page, text: str, temperature: str, max_tokens: str, status: str = "done"):
    """Send ``text`` from the page; returns the new assistant turn once its stream ended with ``status``."""
    from playwright.sync_api import expect

    turns = page.locator(".turn.assistant")
    before = turns.count()
    page.locator("#temperature").fill(temperature)
    page.locator("#max-tokens").fill(max_tokens)
    page.locator("#prompt").fill(text)
    page.locator("#send").click()
    turn = turns.nth(before)
    if status != "streaming":
        expect(turn).to_have_attribute("data-status", status)
    return turn


def stat(turn, name: str) -> str:
    return turn.locator(f"[data-stat={name}]").text_content()


def sdk_chat(server, messages: list[dict], max_tokens: int):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=max_tokens)


def test_page_headers_and_no_external_urls(server):
    with urllib.request.urlopen(server.url + "/", timeout=10) as r:  # no Authorization header
        assert r.status == 200
        headers, page = r.headers, r.read().decode("utf-8")
    assert headers["Content-Type"] == "text/html; charset=utf-8"
    assert headers["X-Content-Type-Options"] == "nosniff"
    csp = headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src 'unsafe-inline'" in csp
    assert "style-src 'unsafe-inline'" in csp and "connect-src 'self'" in csp
    assert page.startswith("<!DOCTYPE html>") and "/v1/chat/completions" in page
    assert not re.search(r"""(?:src|href|action)\s*=\s*["']?\s*(?:https?:)?//""", page, re.I)
    assert not re.search(r"@import|url\(\s*['\"]?(?:https?:)?//", page, re.I)
    assert "innerHTML" not in page and "insertAdjacentHTML" not in page and "document.write" not in page
    # The page is open; the API behind it still wants the key.
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(server.url + "/v1/models", timeout=10)
    assert err.value.code == 401


def test_without_key_the_page_asks_for_it(server, page):
    from playwright.sync_api import expect

    page.goto(server.url + "/")
    notice = page.locator("#notice")
    expect(notice).to_be_visible()
    expect(notice).to_contain_text("requires an API key (401)")
    expect(notice).to_contain_text("--api-key")
    turn = ask(page, "Hello?", "0", "8", status="error")
    assert "requires an API key" in turn.locator(".error").text_content()
    assert "failed" in page.locator(".turn.user").get_attribute("class")


def test_streamed_answers_equal_the_api(server, page, tmp_path):
    from playwright.sync_api import expect

    sent = []
    page.on("request", lambda r: sent.append((r.post_data_json, r.all_headers()))
            if r.url.endswith("/v1/chat/completions") else None)
    open_with_key(page, server)
    expect(page.locator("#notice")).to_be_hidden()

    first = ask(page, "Hello, tide!", "0", "16")
    answer = first.locator(".content").text_content()
    body, headers = sent[0]
    assert headers["authorization"] == f"Bearer {API_KEY}"
    assert body == {"messages": [{"role": "user", "content": "Hello, tide!"}], "stream": True,
                    "stream_options": {"include_usage": True}, "model": "tiny", "temperature": 0, "max_tokens": 16}
    expected = sdk_chat(server, body["messages"], 16)
    assert answer and answer == expected.choices[0].message.content
    assert re.fullmatch(r"\d+\.\d{3} s", stat(first, "ttft"))
    speed = re.fullmatch(r"(\d+\.\d) tok/s", stat(first, "tps"))
    assert speed and float(speed.group(1)) > 0
    assert stat(first, "completion") == "16 tokens"
    assert stat(first, "cached") == f"0 of {expected.usage.prompt_tokens} prompt tokens"
    assert first.locator(".note").text_content() == "cut at max tokens"

    # The second turn carries the first; its prompt starts with the first one's, which the cache holds.
    second = ask(page, "Tell me more.", "0", "16")
    messages = sent[1][0]["messages"]
    assert messages == [{"role": "user", "content": "Hello, tide!"}, {"role": "assistant", "content": answer},
                        {"role": "user", "content": "Tell me more."}]
    expected = sdk_chat(server, messages, 16)
    assert second.locator(".content").text_content() == expected.choices[0].message.content
    cached = re.fullmatch(r"(\d+) of (\d+) prompt tokens", stat(second, "cached"))
    assert cached and int(cached.group(2)) == expected.usage.prompt_tokens and int(cached.group(1)) >= 16

    shot = tmp_path / "chat.png"
    page.screenshot(path=str(shot), full_page=True)
    data = shot.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    print(f"chat page screenshot: {shot}")

    page.reload()  # the key comes back from localStorage; the conversation starts anew
    expect(page.locator("#key")).to_have_value(API_KEY)
    expect(page.locator("#model")).to_have_value("tiny")
    assert page.locator(".turn").count() == 0


def test_stop_aborts_the_stream(server, page):
    from playwright.sync_api import expect

    aborted = server.metrics()['tidal_requests_total{finish_reason="abort"}']
    open_with_key(page, server)
    turn = ask(page, "Write a long story.", "0", "2000", status="streaming")
    expect(turn.locator(".content")).to_have_text(re.compile(r"\S"))
    expect(page.locator("#stop")).to_be_enabled()
    page.locator("#stop").click()
    expect(turn).to_have_attribute("data-status", "stopped")
    assert turn.locator(".note").text_content() == "stopped"
    assert re.fullmatch(r"\d+\.\d{3} s", stat(turn, "ttft"))
    assert turn.locator("[data-stat=tps]").count() == 0  # no usage chunk: the stream did not finish
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()
    # 2000 tokens take far longer than this on a CPU: the server dropped the request.
    assert server.wait_idle(timeout=10)["tidal_requests_running"] == 0
    assert server.metrics()['tidal_requests_total{finish_reason="abort"}'] == aborted + 1


def test_errors_and_reasoning_are_shown(server, page):
    from playwright.sync_api import expect

    open_with_key(page, server)
    # A JSON error body from the server (400) is shown with the server's message.
    turn = ask(page, "Hello?", "0", "10000000", status="error")
    expect(turn.locator(".error")).to_contain_text("Error 400:")
    expect(turn.locator(".error")).to_contain_text("exceeds the model's context length")

    # A stream with reasoning, content written as markup, and an SSE error event at the end.
    markup = '<img src=x onerror="document.title=1">'
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "thinking <b>hard</b>"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": markup}, "finish_reason": None}]},
        {"error": {"message": "the engine failed", "type": "server_error", "param": None, "code": None}},
    ]
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=sse))
    turn = ask(page, "Think first.", "0", "16", status="error")
    assert turn.locator(".reasoning").text_content() == "thinking <b>hard</b>"
    assert turn.locator(".reasoning").evaluate("e => getComputedStyle(e).fontStyle") == "italic"
    assert turn.locator(".content").text_content() == markup
    assert turn.locator(".error").text_content() == "Error from the server: the engine failed"
    assert page.locator(".turn img, .turn b:not([data-stat])").count() == 0  # text, never markup
    assert page.title() == "tidal chat"
