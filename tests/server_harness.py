"""Start and stop a real ``tidal serve`` for end-to-end tests (imported by test modules)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

API_KEY = "test-key"


def health_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of ``url``/health, or None when nothing answers."""
    import urllib.error

    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


async def stream_one(session, url: str, body: dict) -> dict:
    """One streamed completion through an ``aiohttp`` session: ``rid``, ``usage``, ``done`` (``[DONE]``
    arrived) and the ``text`` of choice 0."""
    usage, done, rid, text = None, False, None, ""
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                rid = chunk["id"].removeprefix("cmpl-")
                usage = chunk.get("usage") or usage
                if chunk["choices"]:
                    text += chunk["choices"][0]["text"]
    return {"rid": rid, "usage": usage, "done": done, "text": text}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    out.append(int(entry))
            except (OSError, IndexError):
                pass
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


class Server:
    def __init__(self, model: str, *flags: str, api_key: str | None = API_KEY, device: str = "cpu",
                 ready_timeout: float = 120.0, env: dict[str, str] | None = None):
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="tidal-test-")
        self.tap_addr = f"ipc://{self.dir}/tap"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "tidal.cli", "serve", "--model", model, "--port", str(self.port),
               "--served-model-name", "tiny",
               "--tap-addr", self.tap_addr, "--device", device, *flags]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = open(os.path.join(self.dir, "serve.log"), "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=None if env is None else {**os.environ, **env})
        self.url = f"http://127.0.0.1:{self.port}"
        self.wait_ready(ready_timeout)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tidal serve exited ({self.proc.returncode}):\n{self.logs()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"tidal serve not ready after {timeout} s:\n{self.logs()}")

    def logs(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def post(self, path: str, body, raw: bytes | None = None, headers=None) -> tuple[int, dict]:
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=headers or self.headers())
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Poll /metrics until every ``_in_use`` gauge reads 0 (returns the last reading)."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            if m["tidal_kv_pages_in_use"] == 0 and m["tidal_state_slots_in_use"] == 0 \
                    and m["tidal_requests_running"] == 0:
                return m
            if time.time() > deadline:
                return m
            time.sleep(0.05)

    def stop(self, timeout: float = 20.0) -> list[int]:
        """SIGTERM ``tidal serve``; returns the pids of its children still alive afterwards."""
        children = child_pids(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        deadline = time.time() + 5
        alive = children
        while alive and time.time() < deadline:
            alive = [p for p in children if os.path.exists(f"/proc/{p}") and "tidal" in cmdline(p)]
            time.sleep(0.05)
        if not alive:  # keep the folder (its serve.log) only when something went wrong
            self.log.close()
            shutil.rmtree(self.dir, ignore_errors=True)
        return alive


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
    """Stream one greedy completion (ignore_eos); returns (first-text s, full s, usage, rid).

    First text is the first SSE event with a non-empty ``choices[].text``, timed from just before
    the HTTP request, as the seeds' protocol measures it.
    """
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    first, usage, rid = None, None, None
    with urllib.request.urlopen(req, timeout=1800) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            rid = chunk["id"].removeprefix("cmpl-")
            if chunk.get("usage"):
                usage = chunk["usage"]
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.monotonic() - t0
    return first, time.monotonic() - t0, usage, rid
