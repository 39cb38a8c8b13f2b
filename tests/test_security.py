"""Security: the API key guards every /v1 route, loopback by default, a private run directory that
goes away, and nothing from a socket is unpickled or evaluated."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import stat
import urllib.error
import urllib.request

from server_harness import API_KEY, Server

from tidal.cli import build_parser
from tidal.config.server_args import ServerArgs

PACKAGE = pathlib.Path(__file__).resolve().parent.parent


def call(srv: Server, method: str, path: str, headers: dict[str, str], body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(srv.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_api_key_guards_every_v1_route_and_run_dir_is_private(tiny_checkpoint, tmp_path):
    run_dir = tmp_path / "run"
    tap = tmp_path / "elsewhere-tap"  # an ipc socket outside the run directory is removed too
    srv = Server(tiny_checkpoint, "--run-dir", str(run_dir), "--tap-addr", f"ipc://{tap}")
    try:
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
        assert stat.S_ISSOCK(os.stat(tap).st_mode)
        routes = [("GET", "/v1/models", None),
                  ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1}),
                  ("POST", "/v1/chat/completions",
                   {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})]
        bad = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
               {"Authorization": f"bearer {API_KEY}"}, {"Authorization": f"Bearer {API_KEY}x"},
               {"Authorization": "Bearer \u00e9\u00e8"}]
        for method, path, body in routes:
            for headers in bad:
                status, resp = call(srv, method, path, {k: v.encode().decode("latin-1") for k, v in headers.items()},
                                    body)
                assert status == 401, (path, headers, resp)
                assert resp["error"]["code"] == "invalid_api_key"
            status, _ = call(srv, method, path, {"Authorization": f"Bearer {API_KEY}"}, body)
            assert status == 200, path
        assert call(srv, "GET", "/health", {})[0] == 200  # probes need no key
    finally:
        assert srv.stop() == []
    assert not run_dir.exists() and not tap.exists()


def test_loopback_by_default():
    assert ServerArgs().host == "127.0.0.1"
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"


def test_nothing_from_a_socket_is_unpickled_or_evaluated():
    """No pickle, marshal, eval or exec anywhere in the package (tests and scripts aside): messages
    are msgspec structs, decoded against their declared types."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ("tests", "scripts", ".venv", "build") or rel.parts[0].startswith("."):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                if any(n and n.split(".")[0] in ("pickle", "cPickle", "dill", "marshal", "shelve") for n in names):
                    found.append(f"{rel}:{node.lineno} imports {names}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("eval", "exec"):
                found.append(f"{rel}:{node.lineno} calls {node.func.id}")
            elif isinstance(node, ast.Attribute) and node.attr in ("recv_pyobj", "send_pyobj"):
                found.append(f"{rel}:{node.lineno} uses {node.attr}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                  and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
                found.append(f"{rel}:{node.lineno} calls torch.load")
    assert found == []
