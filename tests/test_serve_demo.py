"""``tidal serve`` with no ``--model``: the demo checkpoint, start-up readiness (503), shutdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from server_harness import child_pids, free_port

from tidal.runtime.demo import DEMO_VERSION


def _get(url: str, data: bytes | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_demo_model_503_until_ready_then_serves(tmp_path):
    port = free_port()
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "tidal.cli", "serve", "--port", str(port), "--device", "cpu"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        seen_503 = None
        deadline = time.time() + 180
        while time.time() < deadline:
            assert proc.poll() is None, open(tmp_path / "serve.log").read()
            try:
                status, body = _get(url + "/health")
            except OSError:
                time.sleep(0.05)
                continue
            if status == 503 and seen_503 is None:
                code, err = _get(url + "/v1/completions", json.dumps({"prompt": "x"}).encode())
                seen_503 = (body, code, err)
            if status == 200:
                break
            time.sleep(0.05)
        assert status == 200
        assert seen_503 is not None, "the frontend never answered before the mesh was ready"
        assert seen_503[0]["status"] == "unavailable"
        assert seen_503[1] == 503 and seen_503[2]["error"]["type"] == "service_unavailable"
        assert os.path.exists(tmp_path / "tidal" / f"demo-small-v{DEMO_VERSION}" / ".complete")
        status, models = _get(url + "/v1/models")
        assert [m["id"] for m in models["data"]] == ["tidal-demo"]
        status, out = _get(url + "/v1/chat/completions", json.dumps(
            {"model": "tidal-demo", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 5}).encode())
        assert status == 200 and out["usage"]["completion_tokens"] <= 5
        log.seek(0)
        assert "random weights" in log.read()
    finally:
        children = child_pids(proc.pid)
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        time.sleep(0.5)
        assert not [p for p in children if os.path.exists(f"/proc/{p}")]


def test_port_in_use_is_one_line_before_anything_starts(tiny_checkpoint):
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "tidal.cli", "serve", "--model", tiny_checkpoint, "--port",
                               str(port)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and f"--port {port}" in lines[0] and "already in use" in lines[0], lines


def test_run_dir_is_used_and_every_socket_removed_on_exit(tiny_checkpoint, tmp_path):
    """--run-dir holds the sockets (0700) and goes away with the server; so does a --tap-addr socket
    placed elsewhere."""
    import stat

    from server_harness import Server

    run_dir = tmp_path / "run"
    tap_file = str(tmp_path / "tap")
    srv = Server(tiny_checkpoint, "--run-dir", str(run_dir), "--tap-addr", f"ipc://{tap_file}", api_key=None)
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    assert any(name.startswith("scheduler") for name in os.listdir(run_dir))
    assert os.path.exists(tap_file)
    assert srv.stop() == []
    assert not run_dir.exists() and not os.path.exists(tap_file)
