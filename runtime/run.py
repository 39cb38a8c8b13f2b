"""``tidal run ROLE``: one process of the mesh on its own, e.g. one container each under docker compose.

``tidal serve`` starts every process on one host. ``tidal run frontend``, ``tidal run scheduler``,
``tidal run executor --rank R`` (one per TP rank) and ``tidal run detokenizer`` start one each, wherever
they run; every address comes from a flag or an environment variable, and the processes reach each other
over ``tcp://`` (or ``ipc://`` on one host).

Flags and environment: ``tidal run`` takes every ``tidal serve`` flag (but the two that only mean
something to ``serve``) plus its own (``--rank``, ``--bind-host``, ``--ready-file``). Each ``--some-flag``
may come from ``TIDAL_SOME_FLAG`` instead (``--tp`` from ``TIDAL_TP``, ``--scheduler-addr`` from
``TIDAL_SCHEDULER_ADDR``); a flag given on the command line wins, an empty variable counts as unset,
and a switch reads ``1/true/yes/on`` or ``0/false/no/off``.

Binding: each process binds its own sockets (the frontend ``--frontend-addr``; the scheduler
``--scheduler-addr`` and ``--control-addr``; executor R its entry of ``--executor-addr``; the
detokenizer ``--detokenizer-addr`` and ``--tap-addr``) and connects to the others'. ``--bind-host
0.0.0.0`` binds the ``tcp://`` ones on that host at the address's port, so that every process can be
given the same addresses, which name the services (``tcp://scheduler:5551``).

Supervision is :mod:`.supervisor`'s, as under ``tidal serve``; here the supervisor runs in the scheduler's
process. A failed mesh exits every process 1 (the others see the supervisor's connection end), and the
restart policy of the containers (compose's ``restart: on-failure``) starts it again. SIGTERM/SIGINT:
the frontend drains (new requests 503, those in flight may finish within ``--shutdown-timeout``), then
leaves; the others leave at once. Leaving is a clean exit 0, announced in a last heartbeat. When the
frontend leaves, the scheduler waits for a new one; when another process leaves, the mesh cannot serve,
so the scheduler stops the rest and exits 0. A signal to the scheduler stops the mesh the same way. A
second signal ends a process at once. ``--ready-file`` exists while the process is ready (the
scheduler's: while the mesh serves), for container health checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading

import zmq

from ..config.server_args import ArgsError, ServerArgs, add_server_flags
from .demo import checkpoint_path
from .ipc import set_process_name, setup_logging
from .roles import ROLES, member_name, run_role
from .supervisor import Member, Supervisor

logger = logging.getLogger(__name__)

ENV_PREFIX = "TIDAL_"
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
    ready_file: str | None = None


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """One ``tidal run``: the role, its options and the mesh's server arguments."""

    role: str
    options: RunOptions
    args: ServerArgs

    @property
    def name(self) -> str:
        return member_name(self.role, self.options.rank)

    @property
    def bound_args(self) -> ServerArgs:
        """The arguments the role runs with: its own sockets bind on ``--bind-host``
        (``ServerArgs.bind_addr``)."""
        return self.args.replace(bind_host=self.options.bind_host)


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
    for action in p._actions:  # unset flags are left out of the namespace: resolve looks at the environment
        if action.option_strings and action.dest != "help":
            shown = action.default is not None and action.default is not False and "default" not in (action.help or "")
            action.help = (f"{action.help or ''}{f' (default: {action.default})' if shown else ''}"
                           f" [env {env_name(action.option_strings[0])}]").replace("%", "%%")
            action.default = _UNSET
    p.epilog = ("Every --some-flag may be given as the environment variable TIDAL_SOME_FLAG instead "
                "(--tp: TIDAL_TP, --scheduler-addr: TIDAL_SCHEDULER_ADDR); a flag on the command line wins.")


def _from_env(action: argparse.Action, var: str, raw: str):
    flag = action.option_strings[0]
    if action.nargs == 0:  # a switch: store_true / store_false, or --flag / --no-flag (its const is None)
        on = True if isinstance(action, argparse.BooleanOptionalAction) else action.const
        if raw.lower() in _TRUE:
            return on
        if raw.lower() in _FALSE:
            return not on
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
    return RunPlan(role, options, args)


# ---- entry point ------------------------------------------------------------------------------
def _serve_as_scheduler(plan: RunPlan, path: str) -> int:
    """The scheduler's process: the role, its member, and the mesh's supervisor, which ends the process."""
    args = plan.bound_args
    local_dir = tempfile.mkdtemp(prefix="tidal-run-")
    local = f"ipc://{os.path.join(local_dir, 'control')}"  # where this process's own member reports
    ctx = zmq.Context()
    try:
        supervisor = Supervisor(args, ctx, [args.bind_addr(args.control_addr), local], plan.options.ready_file)
    except zmq.ZMQError as e:
        shutil.rmtree(local_dir, ignore_errors=True)
        print(f"tidal run scheduler: error: --control-addr {args.control_addr}: {e}", file=sys.stderr)
        return 2
    logger.info("supervising the mesh at %s: waiting for %s", args.control_addr, ", ".join(supervisor.expected))

    def on_signal(signum, frame) -> None:
        supervisor.signals += 1
        if supervisor.signals > 1:
            logger.warning("second signal: exiting now")
            os._exit(0)

    def supervise() -> None:
        code = 1
        try:
            outcome = supervisor.watch()
            if outcome.failed:
                supervisor.fail(outcome.reason)
            else:
                supervisor.stop(outcome.reason)
                code = 0
        except Exception:
            logger.exception("supervision failed")
        ctx.destroy(linger=1000)
        shutil.rmtree(local_dir, ignore_errors=True)
        logging.shutdown()
        os._exit(code)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    watcher = threading.Thread(target=supervise, name="tidal-supervisor", daemon=True)
    watcher.start()
    run_role("scheduler", 0, Member("scheduler", args.replace(control_addr=local), owns_process=False), path)
    watcher.join()
    return 1


def run_command(ns: argparse.Namespace) -> int:
    """``tidal run ROLE``: exit 2 with one line for a bad flag; otherwise the role's process ends with its
    member (or, for the scheduler, with the supervisor)."""
    try:
        plan = resolve(ns)
    except ArgsError as e:
        print(f"tidal run {ns.role}: error: {e}", file=sys.stderr)
        return 2
    setup_logging(plan.args.log_level, plan.name)
    set_process_name(f"tidal-{plan.name}")
    try:
        path = checkpoint_path(plan.args.model, plan.args.revision)
        if plan.role == "frontend":
            from .serve import port_free

            if not port_free(plan.args.host, plan.args.port):
                raise ArgsError(f"--port {plan.args.port}: {plan.args.host}:{plan.args.port} is already in use")
    except ArgsError as e:
        print(f"tidal run {ns.role}: error: {e}", file=sys.stderr)
        return 2
    if plan.role == "scheduler":
        return _serve_as_scheduler(plan, path)
    try:
        member = Member(plan.name, plan.bound_args, drains=True, ready_file=plan.options.ready_file)
    except zmq.ZMQError as e:
        print(f"tidal run {ns.role}: error: --control-addr {plan.args.control_addr}: {e}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, member.on_signal)
    run_role(plan.role, plan.options.rank, member, path)
    return 1  # the member ends the process
