"""``tidal serve``: every process of the mesh on this host, started and supervised.

Each role runs as its own process (``python -m tidal.runtime.roles ROLE``), named ``tidal-<role>`` for
``ps``, with a member beside it (:mod:`.supervisor`). They talk over ZeroMQ: ``ipc://`` sockets in a
private (0700) run directory unless ``tcp://`` addresses are given. This process runs the mesh's
:class:`~.supervisor.Supervisor` and also sees its children exit.

A failing mesh first makes the frontend answer every request in flight with an error and ``/health``
503; then ``serve`` exits 1, or with ``--restart-on-failure`` restarts the other processes (and the
frontend, if it was the one that died) and serves again. SIGINT/SIGTERM drain: new requests get 503,
those in flight may finish within ``--shutdown-timeout``, the rest are aborted, and ``serve`` exits 0.
Either way it returns after every child is gone and the run directory is removed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import zmq

from ..config.server_args import ArgsError, ServerArgs
from .demo import checkpoint_path
from .ipc import host_memory, set_process_name, setup_logging
from .supervisor import Supervisor, exit_reason, mesh_members

logger = logging.getLogger(__name__)
Role = tuple[str, int | None]


def wire(args: ServerArgs, run_dir: str) -> ServerArgs:
    """Fill every unset address with an ``ipc://`` path of its own in ``run_dir``."""
    def ipc(name: str) -> str:
        return f"ipc://{os.path.join(run_dir, name)}"

    dist = args.dist_init_addr
    if dist is None and args.tp > 1:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            dist = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    return args.replace(
        run_dir=run_dir, dist_init_addr=dist,
        scheduler_addr=args.scheduler_addr or ipc("scheduler"),
        executor_addr=args.executor_addr or ipc("executor-{rank}"),
        detokenizer_addr=args.detokenizer_addr or ipc("detokenizer"),
        frontend_addr=args.frontend_addr or ipc("frontend"),
        control_addr=args.control_addr or ipc("control"),
        tap_addr=args.tap_addr or ipc("tap"),
    )


class Mesh:
    def __init__(self, args: ServerArgs, model_path: str):
        self.args, self.model_path = args, model_path
        self.procs: dict[str, subprocess.Popen] = {}
        self.checker: str | None = None  # the executor that runs the start-up memory check (:meth:`check`)
        self.check_fd: int | None = None  # the read end of the pipe its answer comes on

    def roles(self) -> list[Role]:
        """This host's processes: its executors, and on host 0 the frontend, scheduler and detokenizer."""
        executors: list[Role] = [("executor", r) for r in self.args.local_ranks()]
        if self.args.node_rank > 0:
            return executors
        return [("detokenizer", None), ("scheduler", None)] + executors + [("frontend", None)]

    def _command(self, role: str, rank: int | None) -> list[str]:
        return [sys.executable, "-m", "tidal.runtime.roles", role] + ([str(rank)] if rank is not None else [])

    def prestart(self) -> None:
        """Start this host's processes before the flags are checked: each imports what it runs (torch and the
        model code for an executor, the HTTP stack for the frontend: the longest part of a start), then reads
        its arguments on stdin (:meth:`start` sends them) and only then does anything else; :meth:`cancel`
        ends them unseen. The first executor also runs the memory check (:meth:`check`), so that this process
        need not import torch; the frontend, imported meanwhile, answers (503) soon after the check."""
        env = dict(os.environ, TIDAL_MODEL_PATH=self.model_path, TIDAL_ARGS_ON_STDIN="1")
        for role, rank in self.roles():
            name = role if rank is None else f"{role}-{rank}"
            if role == "executor" and self.checker is None:
                self.checker = name
                self.check_fd, write = os.pipe()
                self.procs[name] = subprocess.Popen(self._command(role, rank), env=dict(env, TIDAL_CHECK_FD=str(write)),
                                                    stdin=subprocess.PIPE, pass_fds=(write,))
                os.close(write)
            else:
                self.procs[name] = subprocess.Popen(self._command(role, rank), env=env, stdin=subprocess.PIPE)

    def check(self) -> dict:
        """The start-up memory check of the flags (``executor.memory.fit.check_fits``), run by the executor
        :meth:`prestart` started first once it has imported torch: ``{"plan": ..., "device": ...}`` (the load
        plan, the resolved device), ``{"error": ...}`` (the ``ArgsError``'s line), or ``{"failed": ...}``
        when that process ended without an answer."""
        proc = self.procs[self.checker]
        with contextlib.suppress(OSError):  # one that died says so below
            proc.stdin.write(self.args.to_json() + b"\n")
            proc.stdin.flush()
        chunks = []
        while chunk := os.read(self.check_fd, 65536):
            chunks.append(chunk)
        os.close(self.check_fd)
        self.check_fd = None
        if chunks:
            return json.loads(b"".join(chunks))
        return {"failed": f"{self.checker} {exit_reason(proc.wait())} before it checked the flags"}

    @staticmethod
    def _awaits_args(proc: subprocess.Popen) -> bool:
        """Started by :meth:`prestart` and not yet sent its arguments."""
        return proc.stdin is not None and not proc.stdin.closed

    def cancel(self) -> None:
        """End the processes :meth:`prestart` started, before they have done anything but import."""
        if self.check_fd is not None:
            os.close(self.check_fd)
            self.check_fd = None
        for name, proc in list(self.procs.items()):
            if self._awaits_args(proc):
                proc.terminate()  # its SIGTERM handler exits at once, mid-import too
                with contextlib.suppress(OSError):
                    proc.stdin.close()
                proc.wait()
                del self.procs[name]

    def start(self, keep: frozenset[str] = frozenset()) -> None:
        """Start every role of this host except those named in ``keep`` (left running); those started
        by :meth:`prestart` get their arguments now."""
        data = self.args.to_json()
        env = dict(os.environ)
        env["TIDAL_SERVER_ARGS"] = data.decode()
        env["TIDAL_MODEL_PATH"] = self.model_path
        for role, rank in self.roles():
            name = role if rank is None else f"{role}-{rank}"
            if name in keep:
                continue
            proc = self.procs.get(name)
            if proc is not None and self._awaits_args(proc) and proc.poll() is None:
                with contextlib.suppress(OSError):  # one that died is reported by ``dead``
                    proc.stdin.write(data)
                    proc.stdin.close()
                continue
            self.procs[name] = subprocess.Popen(self._command(role, rank), env=env)

    def exited(self) -> list[tuple[str, int]]:
        """This host's processes that exited, with their exit codes."""
        return [(n, p.returncode) for n, p in self.procs.items() if p.poll() is not None]

    def inspect(self, name: str) -> str:
        """What this host sees of process ``name`` that still runs: its state and resident memory, and the host's
        available memory."""
        proc = self.procs.get(name)
        if proc is None:
            return ""
        status = {}
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            return ""
        state = status.get("State", "?").strip()
        rss = int(status.get("VmRSS", "0 kB").split()[0]) * 1024
        return (f"pid {proc.pid} is alive ({state}, {rss / GiB:.1f} GiB resident) but silent; "
                f"{host_memory_text()}")

    def stop(self, timeout: float = 10.0, keep: frozenset[str] = frozenset()) -> None:
        procs = [p for n, p in self.procs.items() if n not in keep]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def remove_sockets(args: ServerArgs, run_dir: str, made_dir: bool) -> None:
    """Remove every ipc:// socket file this server bound (a --tap-addr outside the run directory too),
    and the run directory if this server made it."""
    for name in ("scheduler_addr", "detokenizer_addr", "frontend_addr", "control_addr", "tap_addr"):
        addr = getattr(args, name)
        if addr and addr.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.unlink(addr[len("ipc://"):])
    for addr in args.executor_addrs():
        if addr.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.unlink(addr[len("ipc://"):])
    if made_dir:
        shutil.rmtree(run_dir, ignore_errors=True)


def port_free(host: str, port: int) -> bool:
    """Whether the frontend could bind ``host:port`` (checked before any process starts)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


GiB = 1 << 30


def host_memory_text() -> str:
    total, available = host_memory("MemTotal"), host_memory("MemAvailable")
    if total is None or available is None:
        return "the host's memory is unknown"
    return f"the host has {available / GiB:.1f} GiB available of {total / GiB:.1f} GiB"


def load_plan_explainer(plan: dict[str, int], device: str, host_at_start: str):
    """``explain`` for :meth:`Supervisor.watch`: an executor that died while starting (loading its weights) gets
    the memory its load plan needed, what the host had then and has now; a SIGKILL the usual sender of it."""
    def explain(name: str, code: int, starting: bool) -> str:
        if not name.startswith("executor") or not starting:
            return ""
        text = (f"its load plan needed {plan['weights_host'] / GiB:.1f} GiB of host memory locked for "
                f"host-resident weights and {(plan['weights_device'] + plan['kv'] + plan['state']) / GiB:.1f} GiB on "
                f"{device} (weights, KV pool, state slots); at start {host_at_start}, now {host_memory_text()}")
        if code == -signal.SIGKILL:
            text += ("; the kernel's out-of-memory killer sends SIGKILL when the host runs out of memory (fewer "
                     "host-resident weights: --ple-backend disk, a smaller --quantization, more --nnodes)")
        return text

    return explain


def watch_executors(mesh: Mesh, stopping: dict) -> int:
    """A host other than host 0 runs executors only (host 0 supervises them): until one exits (1) or a
    signal arrives (0)."""
    logger.info("host %d: executors %s started", mesh.args.node_rank, mesh.args.local_ranks())
    while stopping["signal"] is None:
        exited = mesh.exited()
        if exited:
            logger.error("%s %s; shutting down", exited[0][0], exit_reason(exited[0][1]))
            return 1
        time.sleep(0.2)
    return 0


def serve(args: ServerArgs) -> int:
    setup_logging(args.log_level, "serve")
    set_process_name("tidal-serve")
    try:
        model_path = checkpoint_path(args.model, args.revision)
    except ArgsError as e:
        logger.error("%s", e)
        return 2
    if args.model is None:
        logger.info("no --model: serving the built-in demo checkpoint %s (random weights: its answers are "
                    "noise)", model_path)
        args = args.replace(served_model_name=args.served_model_name or "tidal-demo")
    from ..config.model import ConfigError, ModelConfig

    try:
        ModelConfig.from_file(model_path).with_quantization(args.quantization, args.load_format)
    except ConfigError as e:
        logger.error("%s", e)
        return 2
    mesh = Mesh(args, model_path)
    mesh.prestart()
    checked = mesh.check()
    if "plan" not in checked:
        mesh.cancel()
        logger.error("%s", checked.get("error") or checked["failed"])
        return 2 if "error" in checked else 1
    if args.node_rank == 0 and not port_free(args.host, args.port):
        mesh.cancel()
        logger.error("--port %d: %s:%d is already in use (pick another port)", args.port, args.host, args.port)
        return 2
    # --run-dir: the socket directory (made if missing, and then removed on exit); default a fresh one.
    made = args.run_dir is None or not os.path.exists(args.run_dir)
    run_dir = tempfile.mkdtemp(prefix="tidal-") if args.run_dir is None else args.run_dir
    os.makedirs(run_dir, exist_ok=True)
    os.chmod(run_dir, 0o700)
    args = wire(args, run_dir)
    ctx = zmq.Context()
    mesh.args = args
    stopping = {"signal": None}
    supervisor = Supervisor(args, ctx, [args.control_addr]) if args.node_rank == 0 else None

    def on_signal(signum, frame):
        stopping["signal"] = signum
        if supervisor is not None:
            supervisor.signals += 1

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    explain = load_plan_explainer(checked["plan"], checked["device"], host_memory_text())
    try:
        mesh.start()
        if supervisor is None:
            return watch_executors(mesh, stopping)
        while True:
            outcome = supervisor.watch(mesh.exited, explain, mesh.inspect)
            if not outcome.failed:
                if stopping["signal"] is not None:
                    logger.info("received %s", signal.Signals(stopping["signal"]).name)
                supervisor.stop(outcome.reason, mesh.exited)
                return 0
            served = supervisor.serving
            supervisor.fail(outcome.reason)
            if not args.restart_on_failure:
                logger.error("exiting (--restart-on-failure restarts the mesh instead)")
                return 1
            if not served:
                logger.error("the mesh failed before it served; exiting")
                return 1
            keep = frozenset({"frontend"}) if mesh.procs["frontend"].poll() is None else frozenset()
            logger.info("restarting %s", sorted(n for n in mesh.procs if n not in keep))
            mesh.stop(keep=keep)
            supervisor.restarting([n for n in mesh_members(args) if n not in keep])
            mesh.start(keep=keep)
    finally:
        mesh.stop()
        ctx.destroy(0)
        remove_sockets(args, run_dir, made)
        for s, h in old.items():
            signal.signal(s, h)
