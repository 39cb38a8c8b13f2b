"""Start and stop a real ``tidal serve`` for end-to-end tests (imported by test modules): the package's
``tidal.bench.server`` with the tests' defaults, ``tidal tap`` as a subprocess, and streamed requests
through ``tidal bench``'s client."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from tidal.bench import server as bench_server
from tidal.bench.client import stream_completion as _stream
from tidal.bench.client import stream_sync
from tidal.bench.server import child_pids, cmdline, free_port, health_status  # noqa: F401 (for the tests)
from tidal.bench.tap import tap_rid

API_KEY = "test-key"


class Server(bench_server.Server):
    """A ``tidal serve`` for the end-to-end tests: the model served as ``tiny``, behind ``API_KEY``."""

    def __init__(self, model: str, *flags: str, api_key: str | None = API_KEY, **kw):
        super().__init__(model, *flags, served_model_name="tiny", api_key=api_key, **kw)


async def stream_one(session, url: str, body: dict) -> dict:
    """One streamed completion through an ``aiohttp`` session (``tidal bench``'s client): ``rid``,
    ``usage``, ``done`` (``[DONE]`` arrived) and the ``text`` of choice 0."""
    out = await _stream(session, url, body)
    assert out["status"] == 200, out["error"]
    return {"rid": tap_rid(out["id"]), "usage": out["usage"], "done": out["done"], "text": out["text"]}


def start_tap(addr: str) -> subprocess.Popen:
    """``tidal tap --connect addr``, returned once it says it is connected (its stdout a text pipe)."""
    proc = subprocess.Popen([sys.executable, "-m", "tidal.cli", "tap", "--connect", addr],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()
    if not line.startswith("tap: connected"):
        proc.kill()
        raise RuntimeError(f"tidal tap did not connect to {addr}: {line!r}{proc.stderr.read()}")
    time.sleep(0.2)  # the publisher takes the subscription in asynchronously
    return proc


class Tap:
    """Runs ``tidal tap`` and collects its JSON lines per request id, in a background thread."""

    def __init__(self, addr: str):
        import threading

        self.proc = start_tap(addr)
        self.lines: list[dict] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._lock:
                self.lines.append(json.loads(line))

    def messages(self, rid: str) -> list[dict]:
        with self._lock:
            return [m for m in self.lines if m.get("rid") == rid]

    def wait_finished(self, rid: str, timeout: float = 60.0) -> tuple[dict, list[int], dict]:
        """``(PromptAdmitted, all token ids, final Detokenize)`` of ``rid``."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            msgs = self.messages(rid)
            final = [m for m in msgs if m["type"] == "Detokenize" and m.get("finished")]
            if final:
                admitted = [m for m in msgs if m["type"] == "PromptAdmitted"]
                ids = [t for m in msgs if m["type"] == "Detokenize" for t in m.get("token_ids", [])]
                return (admitted[0] if admitted else None), ids, final[0]
            time.sleep(0.02)
        raise TimeoutError(f"no finished Detokenize for {rid} on the tap")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def stream_completion(url: str, prompt, max_tokens: int, model: str = "tiny") -> tuple[float, float, dict, str]:
    """Stream one greedy completion (ignore_eos); returns (first-text s, full s, usage, rid), timed as the
    seeds' protocol times them (``tidal bench``'s client)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    out = stream_sync(url, body)
    assert out["status"] == 200, out["error"]
    return out["first_text_s"], out["full_s"], out["usage"], tap_rid(out["id"])
