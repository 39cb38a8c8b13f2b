"""``tidal serve``: start frontend, scheduler, executors and detokenizer; supervise; shut down.

Each role runs as its own process (``python -m tidal.roles ROLE``), named ``tidal-<role>`` for
``ps``. They talk over ZeroMQ: ``ipc://`` sockets in a private (0700) run directory unless
``tcp://`` addresses are given.

A failing mesh (a process died, an executor reported an unusable device, or the scheduler found
it hung) first makes the frontend answer every request in flight with an error and ``/health``
503; then ``serve`` exits 1, or with ``--restart-on-failure`` restarts the other processes (and
the frontend, if it was the one that died) and serves again. SIGINT/SIGTERM drain: new requests
get 503, those in flight may finish within ``--shutdown-timeout``, the rest are aborted, and
``serve`` exits 0. Either way it returns after every child is gone and the run directory is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import zmq

from .args import ServerArgs
from .ipc import Pull, Push
from .messages import ExecutorFailed, FrontendInbound, Ready, Shutdown

logger = logging.getLogger(__name__)
DEMO_PRESET = "small"
DEMO_VERSION = 2  # bumped when what `tidal checkpoint` writes changes (2: tool and reasoning template)
READY_TIMEOUT = 1800.0
FAIL_GRACE = 1.0  # seconds the frontend gets to send its error answers before processes are stopped
Role = tuple[str, int | None]


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tidal")


def demo_checkpoint() -> str:
    """The built-in demo checkpoint, written once under the user's cache directory."""
    path = os.path.join(cache_dir(), f"demo-{DEMO_PRESET}-v{DEMO_VERSION}")
    marker = os.path.join(path, ".complete")
    if os.path.exists(marker):
        return path
    os.makedirs(cache_dir(), exist_ok=True)
    with open(os.path.join(cache_dir(), ".demo.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(marker):
            from .executor.presets import write_checkpoint

            logger.info("writing the demo checkpoint (preset %r, random weights) to %s", DEMO_PRESET, path)
            tmp = path + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            write_checkpoint(DEMO_PRESET, tmp, seed=0)
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
            open(marker, "w").close()
    return path


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

    def roles(self) -> list[Role]:
        """This host's processes: its executors, and on host 0 the frontend, scheduler and detokenizer."""
        executors: list[Role] = [("executor", r) for r in self.args.local_ranks()]
        if self.args.node_rank > 0:
            return executors
        return [("detokenizer", None), ("scheduler", None)] + executors + [("frontend", None)]

    def awaited(self) -> set[str]:
        """The processes host 0 waits for (every rank's executor, wherever it runs)."""
        names = {f"executor-{r}" for r in range(self.args.tp)}
        return names | {"detokenizer", "scheduler", "frontend"}

    def _command(self, role: str, rank: int | None) -> list[str]:
        return [sys.executable, "-m", "tidal.roles", role] + ([str(rank)] if rank is not None else [])

    def prestart(self) -> None:
        """Start this host's executors before the flags are checked: each imports what it runs (torch, the
        model code: the longest part of a start) while this process checks, then reads its arguments on
        stdin (:meth:`start` sends them) and only then does anything else; :meth:`cancel` ends them
        unseen."""
        env = dict(os.environ, TIDAL_MODEL_PATH=self.model_path, TIDAL_ARGS_ON_STDIN="1")
        for role, rank in self.roles():
            if role == "executor":
                self.procs[f"{role}-{rank}"] = subprocess.Popen(self._command(role, rank), env=env,
                                                                stdin=subprocess.PIPE)

    @staticmethod
    def _awaits_args(proc: subprocess.Popen) -> bool:
        """Started by :meth:`prestart` and not yet sent its arguments."""
        return proc.stdin is not None and not proc.stdin.closed

    def cancel(self) -> None:
        """End the processes :meth:`prestart` started, before they have done anything but import."""
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

    def dead(self) -> list[tuple[str, int]]:
        return [(n, p.returncode) for n, p in self.procs.items() if p.poll() is not None]

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


def supervise_executors(mesh: "Mesh", stopping: dict) -> int:
    logger.info("host %d: executors %s started", mesh.args.node_rank, mesh.args.local_ranks())
    while stopping["signal"] is None:
        dead = mesh.dead()
        if dead:
            logger.error("%s exited (code %s); shutting down", *dead[0])
            return 1
        time.sleep(0.2)
    return 0


def wait_ready(mesh: Mesh, control: Pull, stopping: dict, waiting: set[str]) -> bool:
    """Until every process in ``waiting`` reports ready; False if one dies, time runs out or a signal
    arrives first."""
    deadline = time.monotonic() + READY_TIMEOUT
    while waiting and stopping["signal"] is None:
        dead = mesh.dead()
        if dead:
            logger.error("%s exited (code %s) during start-up", *dead[0])
            return False
        if time.monotonic() > deadline:
            logger.error("processes not ready after %.0f s: %s", READY_TIMEOUT, sorted(waiting))
            return False
        msg = control.recv(timeout_ms=200)
        if isinstance(msg, Ready):
            waiting.discard(msg.role)
            if msg.info:
                logger.info("%s ready: %s", msg.role, msg.info)
    return stopping["signal"] is None


def watch(mesh: Mesh, control: Pull, stopping: dict) -> str | None:
    """While serving: the reason the mesh failed, or ``None`` once a signal arrives."""
    while stopping["signal"] is None:
        dead = mesh.dead()
        if dead:
            return "{} exited (code {})".format(*dead[0])
        msg = control.recv(timeout_ms=200)
        if isinstance(msg, ExecutorFailed):
            who = "the scheduler's watchdog" if msg.rank < 0 else f"executor {msg.rank}"
            return f"{who}: {msg.error}"
    return None


def drain(mesh: Mesh, control: Pull, to_frontend: Push, stopping: dict, timeout: float) -> None:
    """Let the frontend finish (or, at ``timeout``, abort) the requests in flight; a second signal or a
    dead frontend ends the wait at once."""
    first = stopping["count"]
    to_frontend.send(Shutdown(reason="shutting down", drain=True, timeout=timeout))
    deadline = time.monotonic() + timeout + 5.0
    while time.monotonic() < deadline and stopping["count"] == first:
        if mesh.procs["frontend"].poll() is not None:
            return
        msg = control.recv(timeout_ms=100)
        if isinstance(msg, Ready) and msg.role == "frontend-drained":
            return
    logger.warning("the frontend did not finish draining; stopping")


def serve(args: ServerArgs) -> int:
    from .ipc import set_process_name, setup_logging

    setup_logging(args.log_level, "serve")
    set_process_name("tidal-serve")
    model_path = args.model
    if model_path is None:
        model_path = demo_checkpoint()
        logger.info("no --model: serving the built-in demo checkpoint %s (random weights: its answers are "
                    "noise)", model_path)
        args = args.replace(served_model_name=args.served_model_name or "tidal-demo")
    elif not os.path.isdir(model_path):
        logger.error("--model %s: not a directory", model_path)
        return 2
    from .args import ArgsError
    from .config import ConfigError, ModelConfig
    from .sizing import check_fits

    try:
        config = ModelConfig.from_file(model_path)
    except ConfigError as e:
        logger.error("--model %s: %s", model_path, e)
        return 2
    mesh = Mesh(args, model_path)
    mesh.prestart()
    try:
        check_fits(args, config, args.resolved_device())
    except ArgsError as e:
        mesh.cancel()
        logger.error("%s", e)
        return 2
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
    control: Pull = Pull(ctx, args.control_addr, Ready | ExecutorFailed, bind=True)
    mesh.args = args
    stopping = {"signal": None, "count": 0}

    def on_signal(signum, frame):
        stopping["signal"] = signum
        stopping["count"] += 1

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        mesh.start()
        if args.node_rank > 0:  # executors only: host 0 coordinates; supervise them until a signal
            return supervise_executors(mesh, stopping)
        if not wait_ready(mesh, control, stopping, mesh.awaited()):
            return 0 if stopping["signal"] is not None else 1
        to_frontend: Push[FrontendInbound] = Push(ctx, args.frontend_addr)
        while True:
            to_frontend.send(Ready(role="mesh"))
            logger.info("serving %s at http://%s:%d (tap: %s)", args.model_name, args.host, args.port,
                        args.tap_addr)
            failure = watch(mesh, control, stopping)
            if failure is None:  # a signal: drain
                logger.info("received %s; draining (up to %.0f s)", signal.Signals(stopping["signal"]).name,
                            args.shutdown_timeout)
                drain(mesh, control, to_frontend, stopping, args.shutdown_timeout)
                return 0
            logger.error("%s", failure)
            to_frontend.send(Shutdown(reason=failure))  # requests in flight get an error, /health 503
            time.sleep(FAIL_GRACE)
            if not args.restart_on_failure:
                logger.error("exiting (--restart-on-failure restarts the mesh instead)")
                return 1
            keep = frozenset({"frontend"}) if mesh.procs["frontend"].poll() is None else frozenset()
            logger.info("restarting %s", sorted(n for n in mesh.procs if n not in keep))
            mesh.stop(keep=keep)
            while control.recv(timeout_ms=0) is not None:  # what the old processes said last
                pass
            mesh.start(keep=keep)
            if not wait_ready(mesh, control, stopping, mesh.awaited() - keep):
                return 0 if stopping["signal"] is not None else 1
    finally:
        mesh.stop()
        ctx.destroy(0)
        remove_sockets(args, run_dir, made)
        for s, h in old.items():
            signal.signal(s, h)

