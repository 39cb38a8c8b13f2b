"""Faults and shutdown: injected exceptions (``TIDAL_FAULTS``), killed processes, a hung executor,
SIGTERM drain. In every case the clients get an answer within seconds, nothing hangs, no process
is orphaned and no page or slot leaks."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
from server_harness import Server, child_pids, cmdline, health_status

LONG = 4000  # output tokens: a request still decoding when the fault hits


def stream_events(srv: Server, max_tokens: int, first: threading.Event | None = None,
                  prompt=(1, 2, 3, 4, 5)) -> dict:
    """One streamed completion; every SSE payload, the HTTP status and the error body, if any."""
    body = json.dumps({"model": "tiny", "prompt": list(prompt), "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True}).encode()
    req = urllib.request.Request(srv.url + "/v1/completions", data=body, headers=srv.headers())
    out = {"events": [], "status": None, "error": None}
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            out["status"] = r.status
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    out["events"].append(line[6:])
                    if first is not None and line != "data: [DONE]":
                        first.set()
    except urllib.error.HTTPError as e:
        out["status"], out["error"] = e.code, json.loads(e.read())
    finally:
        if first is not None:
            first.set()
    return out


def in_background(fn, *args):
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(fn(*args)), daemon=True)
    thread.start()
    return thread, result


def health(srv: Server) -> int | None:
    return health_status(srv.url, timeout=1)


def role_pid(srv: Server, name: str) -> int:
    (pid,) = [p for p in child_pids(srv.proc.pid) if cmdline(p) == f"tidal-{name}"]
    return pid


def assert_stream_failed(result: dict) -> None:
    """Either an error status with the OpenAI error body, or an SSE error event and then [DONE]."""
    if result["status"] != 200:
        assert result["status"] in (500, 503) and result["error"]["error"]["message"], result
        return
    events = result["events"]
    assert events[-1] == "[DONE]", events[-3:]
    assert "error" in json.loads(events[-2]), events[-3:]


def ok_completion(srv: Server, max_tokens: int = 4) -> dict:
    status, body = srv.post("/v1/completions", {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": max_tokens,
                                                "ignore_eos": True})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == max_tokens
    return body


def test_executor_exception_fails_that_batch_only(tiny_checkpoint):
    srv = Server(tiny_checkpoint, env={"TIDAL_FAULTS": "executor.error@3"})
    try:
        status, body = srv.post("/v1/completions", {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 8,
                                                    "ignore_eos": True})
        assert status == 500
        assert "injected fault at executor.error" in body["error"]["message"]
        assert body["error"]["type"] == "server_error"
        assert health(srv) == 200
        ok_completion(srv)
        assert srv.wait_idle()["tidal_kv_pages_in_use"] == 0
    finally:
        assert srv.stop() == []


def test_scheduler_exception_in_result_handling_recovers(tiny_checkpoint):
    srv = Server(tiny_checkpoint, env={"TIDAL_FAULTS": "scheduler.result@2"})
    try:
        result = stream_events(srv, 8)
        assert_stream_failed(result)
        assert health(srv) == 200
        ok_completion(srv)
        idle = srv.wait_idle()
        assert idle["tidal_kv_pages_in_use"] == 0 and idle["tidal_state_slots_in_use"] == 0
    finally:
        assert srv.stop() == []


def test_unusable_device_fails_requests_turns_health_503_and_exits_nonzero(tiny_checkpoint):
    srv = Server(tiny_checkpoint, env={"TIDAL_FAULTS": "executor.fatal@5"})
    children = child_pids(srv.proc.pid)
    t0 = time.monotonic()
    result = stream_events(srv, LONG)
    assert_stream_failed(result)
    assert "injected fault at executor.fatal" in json.dumps(result)
    assert time.monotonic() - t0 < 15
    statuses = set()
    while srv.proc.poll() is None and time.monotonic() - t0 < 20:
        statuses.add(health(srv))
        time.sleep(0.05)
    assert srv.proc.returncode == 1
    assert 503 in statuses  # while the mesh was failing, before the exit
    time.sleep(0.5)
    assert [p for p in children if os.path.exists(f"/proc/{p}") and "tidal" in cmdline(p)] == []
    assert "the device is unusable" in srv.logs()
    srv.stop()


def test_hung_executor_is_noticed(tiny_checkpoint):
    srv = Server(tiny_checkpoint, "--executor-timeout", "2", env={"TIDAL_FAULTS": "executor.hang@3"})
    t0 = time.monotonic()
    status, body = srv.post("/v1/completions", {"model": "tiny", "prompt": [1, 2], "max_tokens": 8,
                                                "ignore_eos": True})
    assert status == 500 and "--executor-timeout" in body["error"]["message"]
    assert time.monotonic() - t0 < 12
    srv.proc.wait(20)
    assert srv.proc.returncode == 1
    assert srv.stop() == []


@pytest.fixture(scope="module")
def restarting(tiny_checkpoint):
    """One ``--restart-on-failure`` server for the kills below, one after another: each restart must leave a mesh
    that survives the next."""
    srv = Server(tiny_checkpoint, "--restart-on-failure")
    yield srv
    assert srv.stop() == []
    assert srv.proc.returncode == 0


@pytest.mark.parametrize("victim", ["executor-0", "detokenizer", "scheduler"])
def test_killed_process_fails_requests_and_mesh_restarts(restarting, victim):
    srv = restarting
    first = threading.Event()
    thread, result = in_background(stream_events, srv, LONG, first)
    assert first.wait(30)
    os.kill(role_pid(srv, victim), signal.SIGKILL)
    thread.join(15)
    assert not thread.is_alive()
    assert_stream_failed(result)
    # The error names what died and how.
    assert victim.split("-")[0] in json.dumps(result) and "SIGKILL (signal 9)" in json.dumps(result)
    assert f"{victim} was killed by SIGKILL (signal 9)" in srv.logs()
    srv.wait_ready(60)  # /health 200 again once the mesh is back
    ok_completion(srv)
    idle = srv.wait_idle()
    assert idle["tidal_kv_pages_in_use"] == 0 and idle["tidal_state_slots_in_use"] == 0
    names = sorted(cmdline(p) for p in child_pids(srv.proc.pid))
    assert names == ["tidal-detokenizer", "tidal-executor-0", "tidal-frontend", "tidal-scheduler"]


def test_executor_killed_while_loading_names_the_signal_and_its_memory(tiny_checkpoint, tmp_path):
    """A SIGKILL before ready (what the kernel's out-of-memory killer does to an executor whose weights outgrow
    the host): ``tidal serve`` exits 1 and says which process, which signal, and the memory its load plan needed."""
    import socket
    import subprocess
    import sys

    from server_harness import free_port

    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "tidal.cli", "serve", "--model", tiny_checkpoint, "--port",
                             str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "TIDAL_FAULTS": "executor.load.hang"})
    try:
        # The frontend listens once the flags are checked, as the executor gets its arguments.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, open(tmp_path / "serve.log").read()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        names = {p: cmdline(p) for p in child_pids(proc.pid)}
        executor = [p for p, name in names.items() if name == "tidal-executor-0"]
        assert executor, f"no executor started: {names}"
        time.sleep(2)  # it has its arguments and hangs where it would load
        os.kill(executor[0], signal.SIGKILL)
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    log.seek(0)
    text = log.read()
    assert "executor-0 was killed by SIGKILL (signal 9) while starting: its load plan needed" in text, text[-3000:]
    assert "GiB of host memory" in text and "out-of-memory killer" in text and "the host has" in text


def test_killed_process_without_restart_exits_nonzero(tiny_checkpoint):
    srv = Server(tiny_checkpoint)
    children = child_pids(srv.proc.pid)
    first = threading.Event()
    thread, result = in_background(stream_events, srv, LONG, first)
    assert first.wait(30)
    os.kill(role_pid(srv, "detokenizer"), signal.SIGKILL)
    thread.join(15)
    assert not thread.is_alive()
    # The detokenizer carried the text: the client sees the stream end with an error, or cut off.
    assert result["events"] == [] or result["events"][-1] == "[DONE]" or result["status"] is not None
    srv.proc.wait(20)
    assert srv.proc.returncode == 1
    time.sleep(0.5)
    assert [p for p in children if os.path.exists(f"/proc/{p}") and "tidal" in cmdline(p)] == []
    srv.stop()


def test_sigterm_drains_requests_in_flight(tiny_checkpoint):
    srv = Server(tiny_checkpoint, "--shutdown-timeout", "30")
    first = threading.Event()
    thread, result = in_background(stream_events, srv, 64, first)
    assert first.wait(30)
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:  # new requests are refused while draining
        status, body = srv.post("/v1/completions", {"model": "tiny", "prompt": [1], "max_tokens": 2})
        assert status == 503 and "shutting down" in body["error"]["message"]
    except OSError:  # or the drain already ended and the port is closed
        pass
    thread.join(30)
    assert result["status"] == 200
    chunks = [json.loads(e) for e in result["events"][:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # it ran to its end
    srv.proc.wait(20)
    assert srv.proc.returncode == 0
    assert srv.stop() == []


def test_sigterm_aborts_what_outlives_the_shutdown_timeout(tiny_checkpoint):
    srv = Server(tiny_checkpoint, "--shutdown-timeout", "1")
    first = threading.Event()
    thread, result = in_background(stream_events, srv, LONG, first)
    assert first.wait(30)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    thread.join(15)
    assert not thread.is_alive()
    assert_stream_failed(result)
    assert "shutting down" in json.dumps(result)
    srv.proc.wait(20)
    assert time.monotonic() - t0 < 20  # 1 s of --shutdown-timeout, then the processes stop (about 2 s idle)
    assert srv.proc.returncode == 0
    assert srv.stop() == []


def test_an_error_on_another_rank_fails_the_batch_with_its_message(tiny_checkpoint):
    """Under --tp 2 an exception on rank 1 leaves rank 0 inside the batch's collectives: the request
    fails with rank 1's message and the mesh restarts (the ranks cannot go on out of step)."""
    srv = Server(tiny_checkpoint, "--tp", "2", "--restart-on-failure", api_key=None,
                 env={"TIDAL_FAULTS": "executor1.error@2"})
    try:
        t0 = time.monotonic()
        status, body = srv.post("/v1/completions", {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 8,
                                                    "ignore_eos": True})
        assert status == 500
        assert "rank 1: InjectedFault: injected fault at executor1.error" in body["error"]["message"]
        assert time.monotonic() - t0 < 15
        # The request's error reaches the client before the launcher has taken the mesh down: wait for
        # the restart to begin (/health 503), then for it to end.
        deadline = time.monotonic() + 15
        while health(srv) == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        srv.wait_ready(60)
        status, body = srv.post("/v1/completions", {"model": "tiny", "prompt": [4, 5], "max_tokens": 1})
        assert status == 200 and body["usage"]["completion_tokens"] == 1, body
        assert srv.wait_idle()["tidal_kv_pages_in_use"] == 0
    finally:
        assert srv.stop() == []


def test_scripted_output_hook(tiny_checkpoint):
    """The test hook other API tests use to force a model's output (a tool call, a reasoning block)."""
    srv = Server(tiny_checkpoint, api_key=None, env={"TIDAL_SCRIPTED_OUTPUT": "11,12,13"})
    try:
        status, body = srv.post("/v1/completions", {"model": "tiny", "prompt": [1, 2], "max_tokens": 5,
                                                    "ignore_eos": True})
        assert status == 200
        from tidal.tokenizer import load_tokenizer

        tok = load_tokenizer(tiny_checkpoint)
        assert body["choices"][0]["text"].startswith(tok.decode([11, 12, 13]))
    finally:
        assert srv.stop() == []


def test_a_push_whose_peer_takes_nothing_raises_instead_of_blocking(tmp_path):
    import zmq

    from tidal.messages import Shutdown
    from tidal.runtime.ipc import PeerStuck, Push

    ctx = zmq.Context()
    try:
        push = Push(ctx, f"ipc://{tmp_path}/nobody", bind=True, send_timeout_ms=200)
        t0 = time.monotonic()
        with pytest.raises(PeerStuck, match="nothing was taken from this socket for 0.2 s"):
            push.send(Shutdown())
        assert time.monotonic() - t0 < 5
        push.close()
    finally:
        ctx.term()


def test_the_kept_frontend_is_heard_across_a_restart_longer_than_the_heartbeat_timeout(tmp_path):
    """While the launcher stops the failed processes (up to 10 s when one ignores SIGTERM) the watch is not
    listening; the frontend's heartbeats of that time count once the stopped ones are forgotten, and the
    stopped processes' last words do not."""
    import zmq

    from tidal.config.server_args import ServerArgs
    from tidal.messages import Heartbeat, encode
    from tidal.runtime.serve import wire
    from tidal.runtime.supervisor import Supervisor

    args = wire(ServerArgs(model="m", heartbeat_timeout=1.0, tp=2), str(tmp_path))
    ctx = zmq.Context()
    sup = Supervisor(args, ctx, [args.control_addr])
    up = ctx.socket(zmq.PUSH)
    up.connect(args.control_addr)
    try:
        def say(role, instance, state="ready"):
            up.send(encode(Heartbeat(role=role, instance=instance, state=state)))

        for role in ("scheduler", "detokenizer", "frontend", "executor-0", "executor-1"):
            say(role, f"{role}-old")
        deadline = time.monotonic() + 5
        while len(sup.members) < 5 and time.monotonic() < deadline:
            for msg in sup.control.drain():
                assert sup.heard(msg) is None
            time.sleep(0.01)
        assert len(sup.members) == 5
        time.sleep(1.5)  # the stop outlasts --heartbeat-timeout
        say("frontend", "frontend-old")
        say("executor-0", "executor-0-old", "failed")  # a stopped process's last words
        time.sleep(0.2)
        stopped = ["scheduler", "detokenizer", "executor-0", "executor-1"]
        sup.restarting(stopped)
        assert sorted(sup.members) == ["frontend"]
        assert time.monotonic() - sup.members["frontend"].last_seen < 1.0
        assert not sup.serving
    finally:
        up.close(0)
        sup.control.close()
        sup.to_frontend.close()
        ctx.destroy(0)


REAPED = """
import ctypes, json, os, signal, sys, time
from tidal.bench.server import Server, child_pids

ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of the server come here, unreaped


def descendants():  # {pid: (comm, state)} of every process under this one, zombies included
    out, todo = {}, [os.getpid()]
    while todo:
        for pid in child_pids(todo.pop()):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    comm, rest = f.read().split(" (", 1)[1].rsplit(") ", 1)
            except (OSError, ValueError):
                continue
            out[pid] = (comm, rest.split()[0])
            todo.append(pid)
    return out


srv = Server(sys.argv[1], served_model_name="tiny")
status, _ = srv.post("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2})
tree = sorted(comm for comm, _ in descendants().values())
srv.proc.send_signal(signal.SIGTERM)
srv.proc.wait(30)
deadline = time.monotonic() + 2
while (left := descendants()) and time.monotonic() < deadline:
    time.sleep(0.05)
for pid in left:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
print(json.dumps({"status": status, "tree": tree, "code": srv.proc.returncode, "left": sorted(left.values())}))
"""


def test_after_sigterm_no_process_of_the_server_is_left_alive_or_unreaped(tiny_checkpoint):
    """``tidal serve`` under a subreaper that never reaps (as PID 1 of a container may be): within 2 s of its exit
    every process it started, its processes' own children included (the tokenizer workers, multiprocessing's
    resource tracker), has ended and been reaped by its parent."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", REAPED, tiny_checkpoint], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["status"] == 200 and out["code"] == 0, out
    assert sum(name.startswith("tidal-tokenize") for name in out["tree"]) == 2, out["tree"]  # grandchildren seen
    assert out["left"] == [], out
