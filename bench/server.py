"""A ``tidal serve`` started and stopped from Python: how the benchmarks and the tests start a server."""

from __future__ import annotations

import argparse
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
import urllib.error
import urllib.request


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


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and every process under it (pinned host memory included)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            pass
        todo += child_pids(p)
    return total


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def split_serve_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """A benchmark's command line: its own arguments, and the ``tidal serve`` flags after ``--``."""
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


def serve_args(model: str, flags: list[str]):
    """The :class:`~tidal.config.server_args.ServerArgs` that ``tidal serve`` takes from these flags."""
    from ..config.server_args import add_server_flags, args_from_namespace

    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    return args_from_namespace(parser.parse_args(["--model", model, *flags]))


def llm_kwargs(args) -> dict:
    """``tidal.LLM`` keyword arguments for the flags of ``args`` (:func:`serve_args`) that shape the model and its
    forwards: every field not at its default, less what names the model or the server."""
    import dataclasses

    skip = {"model", "device", "dtype", "load_format", "host", "port", "served_model_name"}
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
            if f.name not in skip and getattr(args, f.name) != f.default}


def health_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of ``url``/health, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


class Server:
    """``tidal serve --model MODEL FLAGS`` on a free port of 127.0.0.1, with its tap in a private folder
    (``tap_addr``) and its log in ``serve.log`` there; returned once ``/health`` answers 200."""

    def __init__(self, model: str, *flags: str, served_model_name: str = "tidal", api_key: str | None = None,
                 device: str = "cpu", ready_timeout: float = 120.0, env: dict[str, str] | None = None):
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="tidal-server-")
        self.tap_addr = f"ipc://{self.dir}/tap"
        self.api_key, self.model_name = api_key, served_model_name
        cmd = [sys.executable, "-m", "tidal.cli", "serve", "--model", model, "--port", str(self.port),
               "--served-model-name", served_model_name, "--tap-addr", self.tap_addr, "--device", device, *flags]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = open(os.path.join(self.dir, "serve.log"), "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=None if env is None else {**os.environ, **env})
        self.url = f"http://127.0.0.1:{self.port}"
        self.wait_ready(ready_timeout)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tidal serve exited ({self.proc.returncode}):\n{self.logs()}")
            if health_status(self.url, timeout=1) == 200:
                return
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
        """``/metrics`` as ``{name{labels}: value}``."""
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
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["tidal_kv_pages_in_use"] == 0 and m["tidal_state_slots_in_use"] == 0 \
                    and m["tidal_requests_running"] == 0:
                return m
            if time.monotonic() > deadline:
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
        deadline = time.monotonic() + 5
        alive = children
        while alive and time.monotonic() < deadline:
            alive = [p for p in children if os.path.exists(f"/proc/{p}") and "tidal" in cmdline(p)]
            time.sleep(0.05)
        if not alive:  # keep the folder (its serve.log) only when something went wrong
            self.log.close()
            shutil.rmtree(self.dir, ignore_errors=True)
        return alive
