"""``tidal run ROLE``: one process of the mesh on its own, e.g. one container each under docker compose.

``tidal serve`` starts every process on one host and supervises them. ``tidal run frontend``,
``tidal run scheduler``, ``tidal run executor --rank R`` (one per TP rank) and ``tidal run detokenizer``
start one each, wherever they run; every address comes from a flag or an environment variable, and
the processes reach each other over ``tcp://`` (or ``ipc://`` on one host).

Flags and environment: ``tidal run`` takes every ``tidal serve`` flag plus its own (``--rank``,
``--bind-host``, ``--heartbeat-timeout``, ``--ready-timeout``, ``--ready-file``). Each ``--some-flag``
may come from ``TIDAL_SOME_FLAG`` instead (``--tp`` from ``TIDAL_TP``, ``--scheduler-addr`` from
``TIDAL_SCHEDULER_ADDR``); a flag given on the command line wins, an empty variable counts as unset,
and a switch reads ``1/true/yes/on`` or ``0/false/no/off``.

Binding: each process binds its own sockets (the frontend ``--frontend-addr``; the scheduler
``--scheduler-addr`` and ``--control-addr``; executor R its entry of ``--executor-addr``; the
detokenizer ``--detokenizer-addr`` and ``--tap-addr``) and connects to the others'. ``--bind-host
0.0.0.0`` binds the ``tcp://`` ones on that host at the address's port, so that every process can be
given the same addresses, which name the services (``tcp://scheduler:5551``).

Supervision (what ``tidal serve`` does on one host): the scheduler process supervises. It binds
``--control-addr``; every other process sends it a heartbeat every second, a ``Ready`` message whose
``info`` holds ``member`` (the process's instance id), ``started`` and ``state`` (``starting``,
``ready``, ``leaving`` or ``failed``). The role itself reports to its own process (a private ``ipc://``
relay), which turns that into the heartbeat's state. The scheduler:

- sends ``Ready("mesh")`` to the frontend once the scheduler and every other process are ready, so
  ``/health`` is 503 until then (and while a frontend that left is replaced);
- counts the mesh failed when a process reports ``failed``, an ``ExecutorFailed`` arrives (a device
  lost, or its own watchdog), a process sends no heartbeat for ``--heartbeat-timeout`` seconds, a new
  instance replaces one that neither left nor failed, or the mesh is not ready within
  ``--ready-timeout``: it fails the requests in flight (``Shutdown`` to the frontend: error answers,
  ``/health`` 503) and exits 1;
- the others watch their connection to it (ZeroMQ heartbeats on that socket): when it ends, or does
  not appear within ``--ready-timeout``, they exit 1. A failure thus exits every process non-zero,
  and a restart policy (compose's ``restart: on-failure``) starts the mesh again.

SIGTERM/SIGINT: the frontend drains (new requests 503, those in flight may finish within
``--shutdown-timeout``), then leaves; the others leave at once. Leaving is a clean exit 0, announced
in a last heartbeat. When the frontend leaves, the scheduler waits for a new one; when another
process leaves, the mesh cannot serve, so the scheduler stops the rest (the frontend drains, the
others get ``Shutdown``) and exits 0. A signal to the scheduler stops the mesh the same way. A second
signal ends a process at once.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid

import zmq
from zmq.utils.monitor import recv_monitor_message

from .args import ArgsError, ServerArgs, add_server_flags
from .ipc import PeerStuck, Pull, Push, set_process_name, setup_logging
from .messages import ExecutorFailed, Ready, Shutdown, encode
from .roles import ROLES

logger = logging.getLogger(__name__)

ENV_PREFIX = "TIDAL_"
FAIL_GRACE = 1.0  # seconds the frontend gets to send its error answers before the scheduler exits
LEAVE_WAIT = 5.0  # seconds a stopping scheduler waits for each process to confirm it left
_UNSET = argparse.SUPPRESS  # parsed flags left at this were not given: the environment or the default decides
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

# The addresses each role needs, and what they are (for the error naming a missing one).
ADDRESSES = {
    "scheduler_addr": "the address the scheduler binds",
    "executor_addr": "the address each executor binds, with '{rank}' for its rank when --tp > 1",
    "detokenizer_addr": "the address the detokenizer binds",
    "frontend_addr": "the address the frontend binds for the mesh's messages",
    "control_addr": "the address the scheduler binds to supervise the mesh",
}
REQUIRED = {
    "frontend": ("scheduler_addr", "frontend_addr", "control_addr"),
    "scheduler": ("scheduler_addr", "executor_addr", "detokenizer_addr", "frontend_addr", "control_addr"),
    "executor": ("executor_addr", "scheduler_addr", "control_addr"),
    "detokenizer": ("detokenizer_addr", "frontend_addr", "scheduler_addr", "control_addr"),
}
# ``tidal serve``'s own flags, which mean nothing to one process.
SERVE_ONLY = {
    "restart_on_failure": "the restart policy of the containers (or of the process manager) restarts "
                          "processes under tidal run",
    "run_dir": "tidal run makes no run directory; give every address instead",
}


@dataclasses.dataclass(frozen=True)
class RunOptions:
    rank: int = 0
    bind_host: str | None = None
    heartbeat_timeout: float = 10.0
    ready_timeout: float = 1800.0
    ready_file: str | None = None

    @property
    def heartbeat_interval(self) -> float:
        return min(1.0, self.heartbeat_timeout / 4)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """One ``tidal run``: the role, its options and the mesh's server arguments."""

    role: str
    options: RunOptions
    args: ServerArgs

    @property
    def name(self) -> str:
        return f"executor-{self.options.rank}" if self.role == "executor" else self.role

    def bind(self, addr: str) -> str:
        """``addr`` as this process binds it (``--bind-host`` in place of a ``tcp://`` host)."""
        return self.args.replace(bind_host=self.options.bind_host).bind_addr(addr)

    def role_args(self, control_addr: str) -> ServerArgs:
        """The arguments the role runs with: its control messages go to ``control_addr`` (this process's
        relay) and its own sockets bind on ``--bind-host`` (``ServerArgs.bind_addr``)."""
        return self.args.replace(control_addr=control_addr, bind_host=self.options.bind_host)


# ---- flags and environment --------------------------------------------------------------------
def env_name(option: str) -> str:
    """``--scheduler-addr`` -> ``TIDAL_SCHEDULER_ADDR``."""
    return ENV_PREFIX + option.lstrip("-").replace("-", "_").upper()


def _add_role_flags(p: argparse.ArgumentParser) -> None:
    d = RunOptions()
    p.add_argument("--rank", type=int, default=d.rank, help="executor: its tensor-parallel rank, in [0, --tp)")
    p.add_argument("--bind-host", default=None,
                   help="bind this process's tcp:// sockets on this host (e.g. 0.0.0.0) at their addresses' "
                        "ports, so that the addresses can name the services (default: bind them as given)")
    p.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout,
                   help="seconds without a heartbeat after which a process (or the scheduler, seen from the "
                        "others) counts as gone")
    p.add_argument("--ready-timeout", type=float, default=d.ready_timeout,
                   help="seconds the scheduler waits for every process to be ready, and the others wait for "
                        "the scheduler to appear")
    p.add_argument("--ready-file", default=None,
                   help="a file that exists while this process is ready (the scheduler's: while the mesh "
                        "serves), for container health checks")


def _flag_actions() -> dict[str, argparse.Action]:
    p = argparse.ArgumentParser(add_help=False)
    add_server_flags(p)
    _add_role_flags(p)
    return {a.dest: a for a in p._actions if a.option_strings}


def add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("role", choices=ROLES, help="the process to run")
    add_server_flags(p)
    _add_role_flags(p)
    for action in p._actions:  # unset flags are left out of the namespace: run_role looks at the environment
        if action.option_strings and action.dest != "help":
            shown = action.default is not None and action.default is not False and "default" not in (action.help or "")
            action.help = (f"{action.help or ''}{f' (default: {action.default})' if shown else ''}"
                           f" [env {env_name(action.option_strings[0])}]").replace("%", "%%")
            action.default = _UNSET
    p.epilog = ("Every --some-flag may be given as the environment variable TIDAL_SOME_FLAG instead "
                "(--tp: TIDAL_TP, --scheduler-addr: TIDAL_SCHEDULER_ADDR); a flag on the command line wins.")


def _from_env(action: argparse.Action, var: str, raw: str):
    flag = action.option_strings[0]
    if action.nargs == 0:  # a switch
        if raw.lower() in _TRUE:
            return action.const
        if raw.lower() in _FALSE:
            return not action.const
        raise ArgsError(f"{var}={raw!r} (for {flag}): must be one of {'/'.join(_TRUE + _FALSE)}")
    try:
        value = action.type(raw) if action.type else raw
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        raise ArgsError(f"{var}={raw!r} (for {flag}): not a valid value") from None
    if action.choices is not None and value not in action.choices:
        raise ArgsError(f"{var}={raw!r} (for {flag}): must be one of {', '.join(map(str, action.choices))}")
    return value


def _check_address(source: str, addr: str) -> None:
    if not addr.startswith("tcp://"):
        return
    port = addr.rsplit(":", 1)[-1] if addr.count(":") >= 2 else ""
    if not (port.isdigit() and 0 < int(port) < 65536):
        raise ArgsError(f"{source}: must be tcp://HOST:PORT, got {addr!r}")


def resolve(ns: argparse.Namespace, environ=os.environ) -> RunPlan:
    """The run that ``ns`` (parsed by ``tidal run``'s parser) and ``environ`` describe; every error is an
    :class:`ArgsError` naming the flag and its variable."""
    values, source = {}, {}
    for dest, action in _flag_actions().items():
        flag, var = action.option_strings[0], env_name(action.option_strings[0])
        if getattr(ns, dest, _UNSET) is not _UNSET:
            values[dest], source[dest] = getattr(ns, dest), flag
        elif environ.get(var, "") != "":
            values[dest], source[dest] = _from_env(action, var, environ[var]), f"{flag} (from {var})"
        else:
            values[dest], source[dest] = action.default, flag
    role = ns.role
    for dest, why in SERVE_ONLY.items():
        if values[dest]:
            raise ArgsError(f"{source[dest]}: belongs to tidal serve; {why}")
    for dest in REQUIRED[role]:
        if values[dest] is None:
            flag = "--" + dest.replace("_", "-")
            raise ArgsError(f"{flag} (or {env_name(flag)}) is required: {ADDRESSES[dest]}")
    for dest in ("tap_addr", "dist_init_addr", *ADDRESSES):
        if values[dest] is not None:
            _check_address(source[dest], values[dest].replace("{rank}", "0"))
    options = RunOptions(**{f.name: values.pop(f.name) for f in dataclasses.fields(RunOptions)})
    try:
        args = ServerArgs(**{f.name: values[f.name] for f in dataclasses.fields(ServerArgs) if f.name in values})
        if role in ("scheduler", "executor"):
            args.executor_addrs()
    except ArgsError as e:
        flag = str(e).split(":", 1)[0]
        dest = flag.lstrip("-").replace("-", "_")
        raise ArgsError(f"{source[dest]}{str(e)[len(flag):]}" if dest in source else str(e)) from None
    if role == "executor":
        if not 0 <= options.rank < args.tp:
            raise ArgsError(f"{source['rank']}: must be in [0, --tp {args.tp}), got {options.rank}")
        if args.tp > 1 and args.dist_init_addr is None:
            raise ArgsError(f"--dist-init-addr (or TIDAL_DIST_INIT_ADDR) is required with --tp {args.tp}: "
                            "tcp://HOST:PORT where the ranks meet (rank 0 listens there)")
    if options.heartbeat_timeout < 1:
        raise ArgsError(f"{source['heartbeat_timeout']}: must be >= 1 second, got {options.heartbeat_timeout}")
    if options.ready_timeout <= 0:
        raise ArgsError(f"{source['ready_timeout']}: must be > 0 seconds, got {options.ready_timeout}")
    return RunPlan(role, options, args)


def model_path(args: ServerArgs) -> str:
    """The checkpoint every process of the mesh reads: ``--model``, or the built-in demo checkpoint."""
    from .launcher import demo_checkpoint

    if args.model is None:
        return demo_checkpoint()
    if not os.path.isdir(args.model):
        raise ArgsError(f"--model {args.model}: not a directory")
    from .config import ConfigError, ModelConfig

    try:
        ModelConfig.from_file(args.model)
    except ConfigError as e:
        raise ArgsError(f"--model {args.model}: {e}") from None
    return args.model


# ---- the process's side of supervision --------------------------------------------------------
class Watch(threading.Thread, abc.ABC):
    """The thread beside a role: reads the role's control messages from the private relay, follows
    signals and the role's end, and ends the process (the role's thread never does)."""

    def __init__(self, plan: RunPlan, relay_dir: str):
        super().__init__(name="tidal-watch", daemon=True)
        self.plan, self.opts, self.name = plan, plan.options, plan.name
        self.relay_dir = relay_dir
        self.relay_addr = f"ipc://{os.path.join(relay_dir, 'control')}"
        self.ctx = zmq.Context()
        self.relay: Pull = Pull(self.ctx, self.relay_addr, Ready | ExecutorFailed, bind=True)
        self.signals = 0
        self.ended: tuple[int, str | None] | None = None  # the role's exit code and error, once it returned
        self.started = time.time()

    def on_signal(self, signum, frame) -> None:
        self.signals += 1
        if self.signals > 1:
            logger.warning("second signal: exiting now")
            self.finish(0, flush=False)

    def role_ended(self, code: int, error: str | None) -> None:
        self.ended = (code, error)

    def set_ready_file(self, ready: bool) -> None:
        path = self.opts.ready_file
        if path is None:
            return
        if ready:
            with open(path, "w") as f:
                f.write(f"{self.name}\n")
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def finish(self, code: int, flush: bool = True) -> None:
        """End the process with ``code``. ``flush`` (only from the watch thread, which owns the sockets)
        first lets queued messages leave, for up to a second: os._exit would drop them."""
        if flush:
            self.ctx.destroy(linger=1000)
        self.set_ready_file(False)
        shutil.rmtree(self.relay_dir, ignore_errors=True)
        logging.shutdown()
        os._exit(code)

    def run(self) -> None:
        try:
            self.loop()
        except Exception:
            logger.exception("supervision of %s failed", self.name)
            self.finish(1)

    @abc.abstractmethod
    def loop(self) -> None:
        """The watch: a member's heartbeats, or the supervisor's control loop."""


class Member(Watch):
    """Frontend, executor or detokenizer: heartbeats to the scheduler, and the process's end when the
    scheduler is gone."""

    def __init__(self, plan: RunPlan, relay_dir: str):
        super().__init__(plan, relay_dir)
        self.instance = f"{uuid.uuid4().hex[:12]}-{os.getpid()}"
        self.state, self.error = "starting", ""
        self.up = self.ctx.socket(zmq.PUSH)
        for opt, value in ((zmq.LINGER, 0), (zmq.IMMEDIATE, 1), (zmq.SNDHWM, 16), (zmq.SNDTIMEO, 1000),
                           (zmq.HEARTBEAT_IVL, 1000), (zmq.HEARTBEAT_TTL, int(self.opts.heartbeat_timeout * 1000)),
                           (zmq.HEARTBEAT_TIMEOUT, int(self.opts.heartbeat_timeout * 1000))):
            self.up.setsockopt(opt, value)
        self.monitor = self.up.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self.up.connect(plan.args.control_addr)
        self.connected = False

    def beat(self, final: bool = False) -> None:
        msg = Ready(role=self.name, info={"member": self.instance, "started": self.started, "state": self.state,
                                          "error": self.error})
        try:
            self.up.send(encode(msg), 0 if final else zmq.NOBLOCK)
        except zmq.Again:  # not connected (yet): the next beat says the same
            pass

    def leave(self, code: int, state: str, error: str = "") -> None:
        self.state, self.error = state, error
        self.beat(final=True)
        self.finish(code)

    def loop(self) -> None:
        args, opts = self.plan.args, self.opts
        poller = zmq.Poller()
        poller.register(self.relay.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        next_beat, drain_until, handled_signal = 0.0, None, False
        while True:
            for msg in self.relay.drain():
                if isinstance(msg, ExecutorFailed):  # the scheduler hears it at once, not at the next beat
                    with contextlib.suppress(zmq.Again):
                        self.up.send(encode(msg))
                elif msg.role == "frontend-drained":
                    logger.info("drained; leaving")
                    self.leave(0, "leaving")
                elif msg.role == self.name and self.state == "starting":
                    self.state = "ready"
                    self.set_ready_file(True)
                    next_beat = 0.0
            while self.monitor.poll(0):
                event = recv_monitor_message(self.monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED and not self.connected:
                    self.connected = True
                    logger.info("connected to the scheduler at %s", args.control_addr)
                elif event == zmq.EVENT_DISCONNECTED and self.connected:
                    if self.signals:
                        self.finish(0)
                    logger.error("lost the scheduler (--control-addr %s): the mesh stopped or failed; exiting",
                                 args.control_addr)
                    self.finish(1)
            now = time.monotonic()
            if not self.connected and time.time() - self.started > opts.ready_timeout:
                logger.error("no scheduler at --control-addr %s after --ready-timeout %g s; exiting",
                             args.control_addr, opts.ready_timeout)
                self.leave(1, "failed", "the scheduler never appeared")
            if self.ended is not None:
                code, error = self.ended
                if code == 0:
                    self.leave(0, "leaving")
                self.leave(1, "failed", error or f"exit code {code}")
            if self.signals and not handled_signal:
                handled_signal = True
                if self.plan.role != "frontend" or self.state != "ready":
                    logger.info("signal: leaving")
                    self.leave(0, "leaving")
                logger.info("signal: draining (up to --shutdown-timeout %g s)", args.shutdown_timeout)
                self_push: Push = Push(self.ctx, args.frontend_addr, send_timeout_ms=1000)
                try:
                    self_push.send(Shutdown(reason="shutting down", drain=True, timeout=args.shutdown_timeout))
                except PeerStuck:
                    self.leave(0, "leaving")
                self_push.close(linger_ms=1000)
                drain_until = now + args.shutdown_timeout + 5.0
            if drain_until is not None and now > drain_until:
                logger.warning("the frontend did not finish draining; leaving")
                self.leave(0, "leaving")
            if now >= next_beat:
                self.beat()
                next_beat = now + opts.heartbeat_interval
            poller.poll(100)


@dataclasses.dataclass
class MemberState:
    instance: str
    started: float
    state: str
    last_seen: float
    error: str = ""


class Supervisor(Watch):
    """The scheduler process's side: the mesh's readiness, failures and orderly stop (see the module
    docstring)."""

    def __init__(self, plan: RunPlan, relay_dir: str):
        super().__init__(plan, relay_dir)
        args = plan.args
        self.control: Pull = Pull(self.ctx, plan.bind(args.control_addr), Ready | ExecutorFailed, bind=True)
        self.to_frontend: Push = Push(self.ctx, args.frontend_addr, send_timeout_ms=1000)
        self.expected = ["frontend", "detokenizer"] + [f"executor-{r}" for r in range(args.tp)]
        self.members: dict[str, MemberState] = {}
        self.scheduler_ready = False
        self.serving = False
        self.stop_reason: str | None = None  # set when a process other than the frontend left

    def tell_frontend(self, msg) -> None:
        try:
            self.to_frontend.send(msg)
        except PeerStuck:
            logger.warning("the frontend took no %s", type(msg).__name__)

    def fail(self, reason: str) -> None:
        logger.error("%s; failing the mesh (every process exits 1)", reason)
        self.tell_frontend(Shutdown(reason=reason))
        time.sleep(FAIL_GRACE)
        self.finish(1)

    def heard(self, msg: Ready) -> None:
        info, name = msg.info, msg.role
        if name not in self.expected:
            logger.warning("a heartbeat from %s, which is not part of this mesh (--tp %d); ignored", name,
                           self.plan.args.tp)
            return
        now = time.monotonic()
        mine = self.members.get(name)
        new = MemberState(str(info.get("member")), float(info.get("started", 0.0)), str(info.get("state")), now,
                          str(info.get("error", "")))
        if mine is not None and mine.instance != new.instance:
            if new.started < mine.started:
                return  # the last words of a process already replaced
            if mine.state != "leaving":
                self.fail(f"{name} restarted (a new process replaced one that had not stopped)")
            logger.info("a new %s joined", name)
        elif mine is not None and mine.state == "leaving":
            return
        self.members[name] = new
        if new.state == "failed":
            self.fail(f"{name} failed: {new.error}")
        if new.state == "leaving" and (mine is None or mine.state != "leaving"):
            if name == "frontend":
                logger.info("the frontend left; waiting for a new one")
                self.serving = False
                self.set_ready_file(False)
            elif self.stop_reason is None:
                self.stop_reason = f"{name} stopped"

    def stop(self, reason: str) -> None:
        """Stop the whole mesh in order: the frontend drains, then the others get ``Shutdown``; exit 0."""
        args = self.plan.args
        logger.info("%s: stopping the mesh", reason)
        self.set_ready_file(False)
        deadline = time.monotonic() + LEAVE_WAIT
        if self.alive("frontend"):
            if reason != "shutting down":  # a process is gone: what is in flight cannot finish
                self.tell_frontend(Shutdown(reason=reason))
            timeout = args.shutdown_timeout if reason == "shutting down" else 0.0
            self.tell_frontend(Shutdown(reason=reason, drain=True, timeout=timeout))
            deadline = time.monotonic() + timeout + LEAVE_WAIT
            self.wait_left(["frontend"], deadline)
        stops = [("detokenizer", args.detokenizer_addr)]
        stops += [(f"executor-{r}", addr) for r, addr in enumerate(args.executor_addrs())]
        for name, addr in stops:
            if self.alive(name):
                push: Push = Push(self.ctx, addr, send_timeout_ms=1000)
                with contextlib.suppress(PeerStuck):
                    push.send(Shutdown(reason=reason))
                push.close(linger_ms=1000)
        self.wait_left([name for name, _ in stops], time.monotonic() + LEAVE_WAIT)
        self.finish(0)

    def alive(self, name: str) -> bool:
        m = self.members.get(name)
        return m is not None and m.state not in ("leaving", "failed")

    def wait_left(self, names: list[str], deadline: float) -> None:
        signals = self.signals
        while any(self.alive(n) for n in names) and time.monotonic() < deadline and self.signals == signals:
            msg = self.control.recv(timeout_ms=100)
            if isinstance(msg, Ready) and "member" in msg.info and msg.role in self.expected:
                m = self.members.get(msg.role)
                if m is not None and m.instance == msg.info["member"]:
                    m.state = str(msg.info.get("state"))

    def loop(self) -> None:
        args, opts = self.plan.args, self.opts
        poller = zmq.Poller()
        poller.register(self.relay.sock, zmq.POLLIN)
        poller.register(self.control.sock, zmq.POLLIN)
        logger.info("supervising the mesh at %s: waiting for %s", args.control_addr, ", ".join(self.expected))
        while True:
            for msg in self.relay.drain() + self.control.drain():
                if isinstance(msg, ExecutorFailed):
                    who = "the scheduler's watchdog" if msg.rank < 0 else f"executor {msg.rank}"
                    self.fail(f"{who}: {msg.error}")
                elif "member" in msg.info:
                    self.heard(msg)
                elif msg.role == "scheduler":
                    self.scheduler_ready = True
            if self.ended is not None:
                code, error = self.ended
                if code != 0:
                    self.fail(f"the scheduler failed: {error or f'exit code {code}'}")
                self.stop("the scheduler stopped")
            if self.signals:
                self.stop("shutting down")
            if self.stop_reason is not None:
                self.stop(self.stop_reason)
            now = time.monotonic()
            for name, m in self.members.items():
                if m.state not in ("leaving", "failed") and now - m.last_seen > opts.heartbeat_timeout:
                    self.fail(f"{name}: no heartbeat for {opts.heartbeat_timeout:g} s (--heartbeat-timeout): "
                              "the process died or cannot reach the scheduler")
            ready = self.scheduler_ready and all(
                name in self.members and self.members[name].state == "ready" for name in self.expected)
            if ready and not self.serving:
                self.serving = True
                self.tell_frontend(Ready(role="mesh"))
                self.set_ready_file(True)
                logger.info("every process is ready: serving %s", args.model_name)
            if not ready and not self.serving and time.time() - self.started > opts.ready_timeout:
                waiting = [n for n in self.expected if n not in self.members or self.members[n].state != "ready"]
                self.fail(f"not ready after --ready-timeout {opts.ready_timeout:g} s: {', '.join(waiting)}")
            poller.poll(100)


# ---- entry point ------------------------------------------------------------------------------
def run_role(ns: argparse.Namespace) -> int:
    try:
        plan = resolve(ns)
    except ArgsError as e:
        print(f"tidal run {ns.role}: error: {e}", file=sys.stderr)
        return 2
    setup_logging(plan.args.log_level, plan.name)
    set_process_name(f"tidal-{plan.name}")
    try:
        path = model_path(plan.args)
        if plan.role == "frontend":
            from .launcher import port_free

            if not port_free(plan.args.host, plan.args.port):
                raise ArgsError(f"--port {plan.args.port}: {plan.args.host}:{plan.args.port} is already in use")
    except ArgsError as e:
        print(f"tidal run {ns.role}: error: {e}", file=sys.stderr)
        return 2
    relay_dir = tempfile.mkdtemp(prefix="tidal-run-")
    try:
        watch = (Supervisor if plan.role == "scheduler" else Member)(plan, relay_dir)
    except zmq.ZMQError as e:
        shutil.rmtree(relay_dir, ignore_errors=True)
        print(f"tidal run {ns.role}: error: --control-addr {plan.args.control_addr}: {e}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, watch.on_signal)
    watch.start()
    from .roles import run

    try:
        run(plan.role, plan.role_args(watch.relay_addr), path, plan.options.rank)
        watch.role_ended(0, None)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        watch.role_ended(code, None if code == 0 else str(e.code))
    except zmq.ZMQError as e:  # an address that cannot be bound or reached: no traceback
        logger.error("%s: %s", plan.name, e)
        watch.role_ended(1, f"ZMQError: {e}")
    except Exception as e:
        logger.exception("%s failed", plan.name)
        watch.role_ended(1, f"{type(e).__name__}: {e}")
    while True:  # the watch thread ends the process
        watch.join(1.0)
        if not watch.is_alive():
            return 1
