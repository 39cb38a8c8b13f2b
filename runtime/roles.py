"""Entry point of one mesh process: ``python -m tidal.runtime.roles ROLE [RANK]`` (how ``tidal serve``
starts its processes; ``tidal run ROLE`` runs a role through :func:`run` too).

The server arguments arrive as JSON in ``TIDAL_SERVER_ARGS`` (or, with ``TIDAL_ARGS_ON_STDIN`` set, on stdin
once the role's modules are imported: ``tidal serve`` starts its processes so while it checks the flags) and
the checkpoint path in ``TIDAL_MODEL_PATH``.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import sys

import zmq

from ..config.server_args import ArgsError, ServerArgs
from .ipc import die_with_parent, exit_now, set_process_name, setup_logging
from .supervisor import Member

logger = logging.getLogger(__name__)


# Each role's module and the function that runs it: ``fn(args, model_path)``, the executor's with its rank.
ENTRY = {"frontend": ("tidal.frontend.server", "run_frontend"),
         "scheduler": ("tidal.scheduler.process", "run_scheduler"),
         "executor": ("tidal.executor.process", "run_executor"),
         "detokenizer": ("tidal.detokenizer.process", "run_detokenizer")}
ROLES = tuple(ENTRY)


def member_name(role: str, rank: int) -> str:
    return f"executor-{rank}" if role == "executor" else role


def run(role: str, args: ServerArgs, model_path: str, rank: int = 0) -> None:
    """Run ``role`` in this process until it returns (the frontend never returns on its own)."""
    if role not in ENTRY:
        raise ValueError(f"unknown role {role!r} (one of {', '.join(ROLES)})")
    module, name = ENTRY[role]
    fn = getattr(importlib.import_module(module), name)
    extra = (rank,) if role == "executor" else ()
    fn(args, model_path, *extra)


def run_role(role: str, rank: int, member: Member, model_path: str) -> None:
    """Run ``role`` with ``member`` beside it until the role ends; the member then ends the process."""
    member.start()
    try:
        run(role, member.role_args(), model_path, rank)
        member.role_ended(0, None)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        member.role_ended(code, None if code == 0 else str(e.code))
    except zmq.ZMQError as e:  # an address that cannot be bound or reached: no traceback
        logger.error("%s: %s", member.name_, e)
        member.role_ended(1, f"ZMQError: {e}")
    except Exception as e:
        logger.exception("%s failed", member.name_)
        member.role_ended(1, f"{type(e).__name__}: {e}")
    member.done.wait()


def check_flags(args: ServerArgs, model_path: str, fd: int) -> None:
    """``tidal serve``'s start-up memory check (``executor.memory.fit.check_fits``), run in the first executor it
    starts, which imports torch and the model code anyway: ``{"plan": ..., "device": ...}`` or ``{"error": ...}``
    (the ``ArgsError``'s line) written to ``fd`` as JSON."""
    from ..config.model import ModelConfig
    from ..executor.memory.fit import check_fits

    try:
        device = args.resolved_device()
        config = ModelConfig.from_file(model_path).with_quantization(args.quantization, args.load_format)
        reply = {"plan": check_fits(args, config, device), "device": device}
    except ArgsError as e:
        reply = {"error": str(e)}
    with os.fdopen(fd, "wb") as f:
        f.write(json.dumps(reply).encode())


def main(argv: list[str]) -> int:
    role = argv[0]
    rank = int(argv[1]) if len(argv) > 1 else 0
    name = member_name(role, rank)
    set_process_name(f"tidal-{name}")
    die_with_parent()
    # `tidal serve` stops its processes itself: Ctrl-C in a terminal reaches the whole group, but only
    # `serve` acts on it; SIGTERM (from `serve`) ends a role at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: exit_now(0))
    if role not in ROLES:
        setup_logging("info", name)
        logger.error("unknown role %r", role)
        return 2
    if os.environ.get("TIDAL_ARGS_ON_STDIN"):
        # Started while `serve` checks the flags: import what the role runs meanwhile, then wait for the
        # arguments; an empty stdin means `serve` refused to start (it said why). The executor given a
        # TIDAL_CHECK_FD first gets the flags to check, one line.
        importlib.import_module(ENTRY[role][0])
        check_fd = os.environ.pop("TIDAL_CHECK_FD", None)
        if check_fd is not None:
            request = sys.stdin.buffer.readline()
            if not request:
                return 0
            check_flags(ServerArgs.from_json(request), os.environ["TIDAL_MODEL_PATH"], int(check_fd))
        data = sys.stdin.buffer.read()
        if not data:
            return 0
    else:
        data = os.environ["TIDAL_SERVER_ARGS"].encode()
    args = ServerArgs.from_json(data)
    setup_logging(args.log_level, name)
    run_role(role, rank, Member(name, args), os.environ["TIDAL_MODEL_PATH"])
    return 1  # the member ends the process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
