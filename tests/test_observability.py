"""Observability and the command line: /metrics histograms and rates, per-request log lines,
progress bars, ``--help`` defaults, ``--version`` and one-line start-up errors."""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import time

import pytest

from tidal import __version__
from tidal.cli import build_parser


def histogram(m: dict[str, float], name: str) -> tuple[list[tuple[float, float]], float, float]:
    """``([(le, cumulative count), ...], sum, count)`` of histogram ``name`` in a /metrics reading."""
    buckets = []
    for key, value in m.items():
        found = re.fullmatch(rf'{name}_bucket\{{le="([^"]+)"\}}', key)
        if found:
            buckets.append((float(found.group(1)), value))
    return sorted(buckets), m[f"{name}_sum"], m[f"{name}_count"]


def test_latency_histograms_count_every_request_and_token(server, client):
    before = server.wait_idle()
    n, max_tokens = 3, 12
    usages = []
    for i in range(n):
        ids = [random.Random(i).randrange(300, 5000) for _ in range(40 + i)]
        r = client.completions.create(model="tiny", prompt=ids, max_tokens=max_tokens, temperature=0.0,
                                      extra_body={"ignore_eos": True})
        usages.append(r.usage)
    stream = client.completions.create(model="tiny", prompt="streamed", max_tokens=max_tokens, stream=True,
                                       extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    streamed = [c for c in stream]
    usages.append(streamed[-1].usage)
    after = server.wait_idle()
    requests = n + 1
    completion = sum(u.completion_tokens for u in usages)
    assert completion == requests * max_tokens
    for name in ("tidal_time_to_first_token_seconds", "tidal_inter_token_latency_seconds",
                 "tidal_e2e_request_latency_seconds"):
        buckets, total, count = histogram(after, name)
        cumulative = [c for _, c in buckets]
        assert cumulative == sorted(cumulative), name  # cumulative buckets never decrease
        assert buckets[-1] == (float("inf"), count), name
        assert total >= histogram(before, name)[1], name
    def grew(name: str) -> float:
        return histogram(after, name)[2] - histogram(before, name)[2]

    ttft, e2e = grew("tidal_time_to_first_token_seconds"), grew("tidal_e2e_request_latency_seconds")
    itl = grew("tidal_inter_token_latency_seconds")
    assert ttft == requests and e2e == requests
    # Every token after a request's first message counts once; the first message holds >= 1 token.
    assert requests * (max_tokens - 4) <= itl <= completion - requests
    e2e_sum = after["tidal_e2e_request_latency_seconds_sum"] - before["tidal_e2e_request_latency_seconds_sum"]
    ttft_sum = after["tidal_time_to_first_token_seconds_sum"] - before["tidal_time_to_first_token_seconds_sum"]
    assert e2e_sum >= ttft_sum > 0
    # What the warm-up before ready missed (on the CPU nothing compiles or is captured).
    assert after["tidal_compilations_after_ready_total"] == 0
    assert after["tidal_graph_captures_after_ready_total"] == 0


def test_prefix_cache_hit_rates_and_checkpoint_counts(server, client):
    ids = [random.Random(7).randrange(300, 5000) for _ in range(300)]
    client.completions.create(model="tiny", prompt=ids, max_tokens=1)
    again = client.completions.create(model="tiny", prompt=ids + [400, 401], max_tokens=1)
    m = server.wait_idle()
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert m["tidal_scheduler_checkpoints_written_total"] >= 1
    prompt, cached = m["tidal_scheduler_prompt_tokens_total"], m["tidal_scheduler_cached_tokens_total"]
    assert m["tidal_prefix_cache_token_hit_rate"] == pytest.approx(cached / prompt)
    assert 0 < m["tidal_prefix_cache_token_hit_rate"] < 1
    assert m["tidal_prefix_cache_request_hit_rate"] == pytest.approx(
        m["tidal_scheduler_cache_hits_total"] / m["tidal_scheduler_cache_queries_total"])
    assert m["tidal_requests_waiting"] == 0  # the queue depth, idle


def test_each_finished_request_logs_one_line_with_its_id(server, client):
    r = client.completions.create(model="tiny", prompt="log me", max_tokens=3, extra_body={"ignore_eos": True})
    rid = r.id.removeprefix("cmpl-")
    deadline = time.time() + 5
    while time.time() < deadline:
        lines = [ln for ln in server.logs().splitlines() if f"request rid={rid} " in ln]
        if lines:
            break
        time.sleep(0.1)
    assert len(lines) == 1, server.logs()[-2000:]
    fields = dict(kv.split("=", 1) for kv in lines[0].split("request ", 1)[1].split())
    assert fields["finish_reason"] == "length"
    assert int(fields["prompt_tokens"]) == r.usage.prompt_tokens
    assert int(fields["completion_tokens"]) == 3
    assert 0 < float(fields["ttft_s"]) <= float(fields["e2e_s"])


def run_tidal(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tidal.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


def test_checkpoint_writing_and_weight_loading_show_progress(tmp_path):
    out = run_tidal("checkpoint", "--preset", "tiny", "--out", str(tmp_path / "ck"), env={"TIDAL_PROGRESS": "1"})
    assert out.returncode == 0, out.stderr
    assert "writing tiny checkpoint" in out.stderr and "100%" in out.stderr
    quiet = run_tidal("checkpoint", "--preset", "tiny", "--out", str(tmp_path / "ck2"), env={"TIDAL_PROGRESS": "0"})
    assert quiet.returncode == 0 and "%|" not in quiet.stderr
    code = ("from tidal.executor.loader import load_model; import sys; "
            f"load_model({str(tmp_path / 'ck')!r}); load_model({str(tmp_path / 'ck')!r}, load_format='random')")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "TIDAL_PROGRESS": "1"})
    assert loaded.returncode == 0, loaded.stderr
    assert "loading weights" in loaded.stderr and "random weights" in loaded.stderr


def test_version():
    out = run_tidal("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"tidal {__version__}"


@pytest.mark.parametrize("command", ["serve", "run"])
def test_every_server_flag_has_help_and_shows_its_default(command):
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, type(parser._subparsers._group_actions[0])))
    p = sub.choices[command]
    options = p.format_help().split("options:", 1)[1]
    # One entry per flag: from a line starting "  -" up to the next such line.
    entries = {m.group(1): " ".join(m.group(0).split())
               for m in re.finditer(r"^  (-[-\w]+).*?(?=^  -|\Z)", options, re.M | re.S)}
    # tidal run leaves unset flags out of its namespace (the environment may set them): its defaults
    # are those of tidal serve's flags and of its own (RunOptions).
    from tidal.runtime.run import RunOptions

    real = {a.dest: a.default for a in sub.choices["serve"]._actions}
    real.update({f: getattr(RunOptions(), f) for f in RunOptions.__dataclass_fields__})
    for action in p._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, f"{command} {action.option_strings[0]} has no help"
        default = real.get(action.dest, action.default) if command == "run" else action.default
        if default is not None and default is not False:
            assert "default" in entries[action.option_strings[0]], f"{command} {action.option_strings[0]}: no default"


def one_line_error(out: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_startup_errors_are_one_line_naming_the_flag_before_any_process_starts(tiny_checkpoint, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        line = one_line_error(run_tidal("serve", "--model", tiny_checkpoint, "--device", "cpu", "--port", str(port)))
        assert "--port" in line and "in use" in line
    line = one_line_error(run_tidal("serve", "--model", str(tmp_path / "missing"), "--device", "cpu"))
    assert "--model" in line and "not a directory" in line
    line = one_line_error(run_tidal("serve", "--model", tiny_checkpoint, "--device", "cpu",
                                    "--kv-pool-tokens", str(1 << 40)))
    assert line.count("--kv-pool-tokens") >= 1 and "GiB" in line
    line = one_line_error(run_tidal("serve", "--model", tiny_checkpoint, "--device", "cpu",
                                    "--max-model-len", "4096", "--kv-pool-tokens", "1024"))
    assert "--kv-pool-tokens" in line and "--max-model-len 4096" in line
    line = one_line_error(run_tidal("serve", "--model", tiny_checkpoint, "--device", "cpu", "--state-slots", "2",
                                    "--max-running-requests", "4"))
    assert "--state-slots" in line
    line = one_line_error(run_tidal("serve", "--model", tiny_checkpoint, "--tp", "0"))
    assert "--tp" in line
    import torch

    if not torch.cuda.is_available():
        line = one_line_error(run_tidal("serve", "--model", tiny_checkpoint, "--device", "cuda"))
        assert "--device" in line and "no CUDA device" in line
    # All of them well before a mesh could have loaded anything (each role process imports torch).
    assert time.monotonic() - t0 < 60


def test_a_method_the_path_does_not_take_gets_405_with_allow(server):
    import urllib.error
    import urllib.request

    for method, path, allowed in (("POST", "/", "GET"), ("GET", "/v1/completions", "POST")):
        req = urllib.request.Request(server.url + path, method=method, data=b"{}" if method == "POST" else None)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 405
        assert allowed in e.value.headers["Allow"]
        assert "error" in json.loads(e.value.read())


def test_scheduler_stats_leave_idle_at_once():
    """The scheduler rate-limits its stats, except transitions into and out of idle: the frontend sees a
    request start before its output, so a reader polling for idle after a response never takes the idle
    snapshot from before that request for the one after it (with its counters not yet counted)."""
    from types import SimpleNamespace

    from tidal.scheduler.process import SchedulerLoop

    sent = []
    proc = SchedulerLoop.__new__(SchedulerLoop)
    proc.to_detok = SimpleNamespace(send=sent.append)
    proc._last_stats, proc._last_stats_time = None, 0.0

    def stats(running: int, cached: int):
        proc.scheduler = SimpleNamespace(stats=lambda: SimpleNamespace(
            running=running, waiting=0, kv_pages_in_use=running, state_slots_in_use=running, kv_pages_cached=3,
            state_slots_cached=1, counters={"cached_tokens": cached}))
        proc._send_stats()
        return len(sent)

    assert stats(0, 0) == 1  # idle: at once
    assert stats(1, 256) == 2  # leaves idle within the interval: at once
    assert stats(1, 300) == 2  # busy and changed within the interval: held back
    assert stats(0, 300) == 3  # back to idle: at once, with the counters
    assert sent[-1].counters == {"cached_tokens": 300}
