"""The one supervisor of a mesh, and the member beside every role.

Every process of a mesh (frontend, scheduler, detokenizer, one executor per rank) runs its role in the
main thread and a :class:`Member` in a thread beside it. The role reports to its member only, over a
private ``ipc://`` relay: ``Ready`` once it serves, ``Drained`` (the frontend) once a drain is over,
``ExecutorFailed`` when a device is lost or the scheduler's watchdog finds an executor hung. The member
sends a ``Heartbeat`` to ``--control-addr`` every second and at once on every change, passes
``ExecutorFailed`` on, and ends the process when the role ends.

The :class:`Supervisor` binds ``--control-addr``. It runs in ``tidal serve``'s process, which also
starts the processes and sees them exit, or under ``tidal run`` in the scheduler's process. Both hosts
use it alike:

- once every process of the mesh is ready it sends ``MeshReady`` to the frontend (``/health`` is 503
  until then, and again while the mesh fails);
- the mesh fails when a process reports ``failed``, an ``ExecutorFailed`` arrives, a process sends no
  heartbeat for ``--heartbeat-timeout`` seconds, a process exits that its host saw exit, a new process
  replaces one that neither left nor failed, or the mesh is not ready within ``--ready-timeout``. The
  frontend then answers every request in flight with the reason as an error, and the host ends or
  restarts the mesh (``tidal serve`` exits 1 or, with ``--restart-on-failure``, starts the other
  processes again; under ``tidal run`` every process exits 1 and the restart policy of the containers
  starts them again);
- a stop (a signal to the host, or a process other than the frontend leaving on purpose) drains the
  frontend (new requests 503, those in flight may finish within ``--shutdown-timeout``), then sends
  ``Shutdown`` to the others and waits for each to leave.

A process is told from its replacement by its instance id: the last words of a replaced process are
ignored, whatever the clocks of the hosts say.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..config.server_args import ServerArgs
from ..messages import (
    ControlInbound,
    Drained,
    ExecutorFailed,
    Heartbeat,
    MemberState,
    MeshReady,
    Ready,
    RelayInbound,
    Shutdown,
    encode,
)
from .ipc import PeerStuck, Pull, Push, exit_now

logger = logging.getLogger(__name__)

FAIL_GRACE = 1.0  # seconds the frontend gets to send its error answers before the mesh's processes stop
LEAVE_WAIT = 5.0  # seconds a stop waits for each process to confirm it left
SHUTTING_DOWN = "shutting down"


def heartbeat_interval(timeout: float) -> float:
    return min(1.0, timeout / 4)


def exit_reason(code: int) -> str:
    """How a process ended, from its exit status (negative: the signal that ended it)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "a signal"
        return f"was killed by {name} (signal {-code})"
    return f"exited with code {code}"


def mesh_members(args: ServerArgs) -> list[str]:
    """Every process of the mesh, wherever it runs."""
    return ["scheduler", "detokenizer", "frontend"] + [f"executor-{r}" for r in range(args.tp)]


def set_ready_file(path: str | None, ready: bool, name: str) -> None:
    """``path`` exists exactly while ``name`` is ready (container health checks look at it)."""
    if path is None:
        return
    if ready:
        with open(path, "w") as f:
            f.write(f"{name}\n")
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


# ---- beside every role --------------------------------------------------------------------------
class Member(threading.Thread):
    """The thread beside a role: heartbeats to the supervisor, the role's reports passed on, and the
    process's end.

    ``owns_process``: the member ends the process when the role ends (``os._exit``); without it (the
    scheduler's process under ``tidal run``, which the supervisor beside it ends) it only says so.
    ``drains``: a signal to the process drains a ready frontend, or makes another role leave at once
    (``tidal run``); without it a signal is the host's business (``tidal serve`` stops its processes).
    """

    def __init__(self, name: str, args: ServerArgs, *, owns_process: bool = True, drains: bool = False,
                 ready_file: str | None = None):
        super().__init__(name="tidal-member", daemon=True)
        self.name_, self.args = name, args
        self.owns_process, self.drains, self.ready_file = owns_process, drains, ready_file
        self.relay_dir = tempfile.mkdtemp(prefix="tidal-member-")
        self.relay_addr = f"ipc://{os.path.join(self.relay_dir, 'relay')}"
        self.ctx = zmq.Context()
        self.relay: Pull[RelayInbound] = Pull(self.ctx, self.relay_addr, RelayInbound, bind=True)
        self.instance = f"{uuid.uuid4().hex[:12]}-{os.getpid()}"
        self.state: MemberState = "starting"
        self.error = ""
        self.started = time.monotonic()
        self.signals = 0
        self.ended: tuple[int, str | None] | None = None  # the role's exit code and error, once it returned
        self.done = threading.Event()
        self.up = self.ctx.socket(zmq.PUSH)
        timeout_ms = int(args.heartbeat_timeout * 1000)
        for opt, value in ((zmq.LINGER, 0), (zmq.IMMEDIATE, 1), (zmq.SNDHWM, 16), (zmq.SNDTIMEO, 1000),
                           (zmq.HEARTBEAT_IVL, 1000), (zmq.HEARTBEAT_TTL, timeout_ms),
                           (zmq.HEARTBEAT_TIMEOUT, timeout_ms)):
            self.up.setsockopt(opt, value)
        self.monitor = self.up.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self.up.connect(args.control_addr)
        self.connected = False

    def role_args(self) -> ServerArgs:
        """The arguments the role runs with: its reports go to this member."""
        return self.args.replace(control_addr=self.relay_addr)

    def on_signal(self, signum, frame) -> None:
        self.signals += 1
        if self.signals > 1:
            logger.warning("second signal: exiting now")
            self.finish(0, flush=False)

    def role_ended(self, code: int, error: str | None) -> None:
        self.ended = (code, error)

    def send_up(self, msg, block: bool = False) -> None:
        try:
            self.up.send(encode(msg), 0 if block else zmq.NOBLOCK)
        except zmq.Again:  # not connected (yet): the next beat says the same
            pass

    def beat(self, final: bool = False) -> None:
        self.send_up(Heartbeat(role=self.name_, instance=self.instance, state=self.state, error=self.error),
                     block=final)

    def finish(self, code: int, flush: bool = True) -> None:
        """End the process with ``code`` (or, without ``owns_process``, only this thread). ``flush`` (only
        from this thread, which owns the sockets) first lets queued messages leave, for up to a second:
        os._exit would drop them."""
        set_ready_file(self.ready_file, False, self.name_)
        if flush:
            self.ctx.destroy(linger=1000)
        shutil.rmtree(self.relay_dir, ignore_errors=True)
        if self.owns_process:  # the role's thread waits on ``done`` for ever: the exit code is this one
            logging.shutdown()
            exit_now(code)
        self.done.set()
        raise SystemExit(code)

    def leave(self, code: int, state: MemberState, error: str = "") -> None:
        self.state, self.error = state, error
        self.beat(final=True)
        self.finish(code)

    def run(self) -> None:
        try:
            self.loop()
        except SystemExit:
            pass
        except Exception:
            logger.exception("the member of %s failed", self.name_)
            if self.owns_process:
                self.finish(1)

    def loop(self) -> None:
        args = self.args
        poller = zmq.Poller()
        poller.register(self.relay.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        next_beat, drain_until, handled_signal = 0.0, None, False
        while True:
            for msg in self.relay.drain():
                if isinstance(msg, ExecutorFailed):  # the supervisor hears it at once, not at the next beat
                    self.send_up(msg, block=True)
                elif isinstance(msg, Drained):
                    logger.info("drained; leaving")
                    self.leave(0, "leaving")
                elif isinstance(msg, Ready) and self.state == "starting":
                    self.state = "ready"
                    set_ready_file(self.ready_file, True, self.name_)
                    next_beat = 0.0
            while self.monitor.poll(0):
                event = recv_monitor_message(self.monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED and not self.connected:
                    self.connected = True
                    logger.debug("connected to the supervisor at %s", args.control_addr)
                elif event == zmq.EVENT_DISCONNECTED and self.connected:
                    if self.signals:
                        self.finish(0)
                    logger.error("lost the supervisor (--control-addr %s): the mesh stopped or failed; exiting",
                                 args.control_addr)
                    self.finish(1)
            now = time.monotonic()
            if not self.connected and now - self.started > args.ready_timeout:
                logger.error("no supervisor at --control-addr %s after --ready-timeout %g s; exiting",
                             args.control_addr, args.ready_timeout)
                self.leave(1, "failed", "the supervisor never appeared")
            if self.ended is not None:
                code, error = self.ended
                if code == 0:
                    self.leave(0, "leaving")
                self.leave(1, "failed", error or f"exit code {code}")
            if self.drains and self.signals and not handled_signal:
                handled_signal = True
                if self.name_ != "frontend" or self.state != "ready":
                    logger.info("signal: leaving")
                    self.leave(0, "leaving")
                logger.info("signal: draining (up to --shutdown-timeout %g s)", args.shutdown_timeout)
                to_frontend: Push = Push(self.ctx, args.frontend_addr, send_timeout_ms=1000)
                try:
                    to_frontend.send(Shutdown(reason=SHUTTING_DOWN, drain=True, timeout=args.shutdown_timeout))
                except PeerStuck:
                    self.leave(0, "leaving")
                to_frontend.close(linger_ms=1000)
                drain_until = now + args.shutdown_timeout + LEAVE_WAIT
            if drain_until is not None and now > drain_until:
                logger.warning("the frontend did not finish draining; leaving")
                self.leave(0, "leaving")
            if now >= next_beat:
                self.beat()
                next_beat = now + heartbeat_interval(args.heartbeat_timeout)
            poller.poll(100)


# ---- the supervisor -----------------------------------------------------------------------------
@dataclasses.dataclass
class MemberRecord:
    instance: str
    state: MemberState
    last_seen: float
    error: str = ""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a watch ended: the mesh ``failed`` (the reason), or it is to stop in order."""

    failed: bool
    reason: str


class Supervisor:
    """The mesh's readiness, failures and orderly stop (see the module docstring). ``binds`` are the
    addresses its control socket binds (``--control-addr`` as this host binds it, and any local ones)."""

    def __init__(self, args: ServerArgs, ctx: zmq.Context, binds: list[str], ready_file: str | None = None):
        self.args, self.ready_file = args, ready_file
        self.control: Pull[ControlInbound] = Pull(ctx, binds[0], ControlInbound, bind=True)
        for addr in binds[1:]:
            self.control.sock.bind(addr)
        self.to_frontend: Push = Push(ctx, args.frontend_addr, send_timeout_ms=1000)
        self.ctx = ctx
        self.expected = mesh_members(args)
        self.members: dict[str, MemberRecord] = {}
        self.retired: set[str] = set()  # instances replaced or forgotten: their last words are ignored
        self.serving = False
        self.waiting_since = time.monotonic()
        self.signals = 0  # the host counts the signals it got here
        self.stop_reason: str | None = None  # a process other than the frontend left on purpose

    # -- what the members say
    def tell_frontend(self, msg) -> None:
        try:
            self.to_frontend.send(msg)
        except PeerStuck:
            logger.warning("the frontend took no %s", type(msg).__name__)

    def heard(self, msg: Heartbeat) -> str | None:
        """Take in one heartbeat; the reason the mesh fails, if it does."""
        name = msg.role
        if name not in self.expected:
            logger.warning("a heartbeat from %s, which is not part of this mesh (--tp %d); ignored", name,
                           self.args.tp)
            return None
        if msg.instance in self.retired:
            return None
        mine = self.members.get(name)
        if mine is not None and mine.instance != msg.instance:
            if mine.state not in ("leaving", "failed"):
                return f"{name} restarted (a new process replaced one that had not stopped)"
            self.retired.add(mine.instance)
            logger.info("a new %s joined", name)
            mine = None
        elif mine is not None and mine.state in ("leaving", "failed"):
            return None
        now = time.monotonic()
        self.members[name] = MemberRecord(msg.instance, msg.state, now, msg.error)
        if msg.state == "failed":
            return f"{name} failed: {msg.error}"
        if msg.state == "ready" and (mine is None or mine.state != "ready"):
            logger.info("%s is ready", name)
        if msg.state == "leaving":
            if name == "frontend":
                logger.info("the frontend left; waiting for a new one")
                self.serving = False
                set_ready_file(self.ready_file, False, "mesh")
            elif self.stop_reason is None:
                self.stop_reason = f"{name} stopped"
        return None

    def alive(self, name: str) -> bool:
        m = self.members.get(name)
        return m is not None and m.state not in ("leaving", "failed")

    def forget(self, names) -> None:
        """Processes the host is about to start again: what their old instances say is ignored, and the
        mesh is waiting for them (``--ready-timeout`` counts from now)."""
        for name in names:
            m = self.members.pop(name, None)
            if m is not None:
                self.retired.add(m.instance)
        self.serving = False
        self.stop_reason = None
        self.waiting_since = time.monotonic()

    def restarting(self, names) -> None:
        """Processes ``names`` were stopped and are about to start again: they are forgotten, and what the
        others said meanwhile is taken in (the watch was not listening while the stop lasted, which may be
        longer than ``--heartbeat-timeout``)."""
        said = self.control.drain()
        self.forget(names)
        for msg in said:
            if isinstance(msg, Heartbeat):
                self.heard(msg)

    def exited_reason(self, name: str, code: int, explain: Callable[[str, int, bool], str] | None) -> str:
        """Why the mesh fails when process ``name`` exited with ``code``: how it ended and whether it had become
        ready, with what ``explain`` adds (the load plan's memory for an executor killed while it loaded)."""
        m = self.members.get(name)
        starting = m is None or m.state == "starting"
        reason = f"{name} {exit_reason(code)}" + (" while starting" if starting else "")
        extra = explain(name, code, starting) if explain is not None else ""
        return f"{reason}{': ' + extra if extra else ''}"

    # -- the watch
    def watch(self, exited: Callable[[], list[tuple[str, int]]] = list,
              explain: Callable[[str, int, bool], str] | None = None,
              inspect: Callable[[str], str] | None = None) -> Outcome:
        """Until the mesh fails or is to stop; ``exited`` lists the host's processes that exited (with their
        codes) where the host owns them; ``explain(name, code, starting)`` adds to the reason a process exited,
        ``inspect(name)`` to the reason a process that still runs sent no heartbeat (what the host sees of it)."""
        args = self.args
        poller = zmq.Poller()
        poller.register(self.control.sock, zmq.POLLIN)
        while True:
            for msg in self.control.drain():
                if isinstance(msg, ExecutorFailed):
                    who = "the scheduler's watchdog" if msg.rank < 0 else f"executor {msg.rank}"
                    return Outcome(True, f"{who}: {msg.error}")
                reason = self.heard(msg)
                if reason is not None:
                    return Outcome(True, reason)
            if self.signals:
                return Outcome(False, SHUTTING_DOWN)
            if self.stop_reason is not None:
                return Outcome(False, self.stop_reason)
            gone = exited()
            if gone:
                return Outcome(True, self.exited_reason(*gone[0], explain))
            now = time.monotonic()
            for name, m in self.members.items():
                if m.state not in ("leaving", "failed") and now - m.last_seen > args.heartbeat_timeout:
                    gone = dict(exited())
                    if name in gone:
                        return Outcome(True, self.exited_reason(name, gone[name], explain))
                    seen = inspect(name) if inspect is not None else ""
                    return Outcome(True, f"{name}: no heartbeat for {args.heartbeat_timeout:g} s "
                                         "(--heartbeat-timeout): " + (seen or "the process died or cannot reach "
                                                                              "the supervisor"))
            ready = all(name in self.members and self.members[name].state == "ready" for name in self.expected)
            if ready and not self.serving:
                self.serving = True
                self.tell_frontend(MeshReady())
                set_ready_file(self.ready_file, True, "mesh")
                logger.info("serving %s at http://%s:%d (tap: %s)", args.model_name, args.host, args.port,
                            args.tap_addr)
            if not ready and not self.serving and now - self.waiting_since > args.ready_timeout:
                waiting = [n for n in self.expected if n not in self.members or self.members[n].state != "ready"]
                return Outcome(True, f"not ready after --ready-timeout {args.ready_timeout:g} s: "
                                     f"{', '.join(waiting)}")
            poller.poll(100)

    def fail(self, reason: str) -> None:
        """The requests in flight get ``reason`` as an error, and ``/health`` 503."""
        logger.error("%s; the mesh failed", reason)
        self.serving = False
        set_ready_file(self.ready_file, False, "mesh")
        self.tell_frontend(Shutdown(reason=reason))
        time.sleep(FAIL_GRACE)

    def stop(self, reason: str, exited: Callable[[], list[tuple[str, int]]] = list) -> None:
        """Stop the mesh in order: the frontend drains (at once unless the whole mesh is shutting down),
        then every other process gets ``Shutdown``; returns once all have left (or exited, where the host
        sees that) or the waits ran out. A second signal ends each wait at once."""
        args = self.args
        logger.info("%s: stopping the mesh", reason)
        self.serving = False
        set_ready_file(self.ready_file, False, "mesh")
        if self.alive("frontend"):
            if reason != SHUTTING_DOWN:  # a process is gone: what is in flight cannot finish
                self.tell_frontend(Shutdown(reason=reason))
            timeout = args.shutdown_timeout if reason == SHUTTING_DOWN else 0.0
            if timeout:
                logger.info("draining (up to --shutdown-timeout %g s)", timeout)
            self.tell_frontend(Shutdown(reason=reason, drain=True, timeout=timeout))
            self.wait_left(["frontend"], time.monotonic() + timeout + LEAVE_WAIT, exited)
        stops = [("detokenizer", args.detokenizer_addr), ("scheduler", args.scheduler_addr)]
        stops += [(f"executor-{r}", addr) for r, addr in enumerate(args.executor_addrs())]
        for name, addr in stops:
            if self.alive(name):
                push: Push = Push(self.ctx, addr, send_timeout_ms=1000)
                with contextlib.suppress(PeerStuck):
                    push.send(Shutdown(reason=reason))
                push.close(linger_ms=1000)
        self.wait_left([name for name, _ in stops], time.monotonic() + LEAVE_WAIT, exited)

    def wait_left(self, names: list[str], deadline: float, exited: Callable[[], list[tuple[str, int]]]) -> None:
        signals = self.signals
        while any(self.alive(n) for n in names) and time.monotonic() < deadline and self.signals == signals:
            for name, _ in exited():
                if name in self.members:
                    self.members[name].state = "leaving"
            msg = self.control.recv(timeout_ms=100)
            if isinstance(msg, Heartbeat) and msg.role in self.expected and msg.instance not in self.retired:
                m = self.members.get(msg.role)
                if m is not None and m.instance == msg.instance:
                    m.state, m.last_seen = msg.state, time.monotonic()
        left = [n for n in names if self.alive(n)]
        if left:
            logger.warning("%s did not leave in time", ", ".join(left))
