"""Typed ZeroMQ sockets carrying ``messages`` structs as msgpack, and process plumbing.

Every socket has one role (push, pull, pub, sub) and one typed decoder; a frame that does not
decode to the socket's union is dropped with a log line rather than crashing the process.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
from typing import Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

from ..messages import decoder, encode

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Queue depth per socket before a PUSH blocks (or a PUB drops): generous, messages are small.
HWM = 100_000
# A PUSH that cannot hand a message on for this long (the peer's queue is full, or no peer is there)
# raises instead of blocking its process forever: the process fails and the launcher sees it.
SEND_TIMEOUT_MS = 60_000


class PeerStuck(RuntimeError):
    """A PUSH socket's peer took nothing for ``SEND_TIMEOUT_MS``."""


def _configure(sock: zmq.Socket, addr: str, bind: bool) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    if bind:
        sock.bind(addr)
    else:
        sock.connect(addr)


class Push(Generic[T]):
    def __init__(self, ctx: zmq.Context, addr: str, bind: bool = False, send_timeout_ms: int = SEND_TIMEOUT_MS):
        self.addr, self.send_timeout_ms = addr, send_timeout_ms
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDTIMEO, send_timeout_ms)
        _configure(self.sock, addr, bind)

    def send(self, msg: T) -> None:
        try:
            self.sock.send(encode(msg), copy=False)
        except zmq.Again:
            raise PeerStuck(f"{self.addr}: nothing was taken from this socket for {self.send_timeout_ms / 1000:g} s "
                            f"(its receiving process is stuck or gone)") from None

    def close(self, linger_ms: int = 0) -> None:
        """Close; ``linger_ms`` waits that long for queued messages to leave (e.g. before exiting)."""
        self.sock.close(linger_ms)


class Pull(Generic[T]):
    def __init__(self, ctx: zmq.Context, addr: str, union, bind: bool = True):
        self.sock = ctx.socket(zmq.PULL)
        _configure(self.sock, addr, bind)
        self._decoder = decoder(union)

    def decode(self, frame: bytes) -> T | None:
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.error("dropped an undecodable message: %s", e)
            return None

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """Block up to ``timeout_ms`` (forever if ``None``); ``None`` when nothing arrived."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        return self.decode(self.sock.recv(copy=True))

    def until_shutdown(self):
        """Yield messages until a ``Shutdown`` arrives."""
        from ..messages import Shutdown

        while True:
            msg = self.recv()
            if isinstance(msg, Shutdown):
                return
            if msg is not None:
                yield msg

    def drain(self) -> list[T]:
        out = []
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            msg = self.decode(frame)
            if msg is not None:
                out.append(msg)

    def close(self) -> None:
        self.sock.close(0)


class AsyncPush(Generic[T]):
    def __init__(self, ctx: zmq.asyncio.Context, addr: str, bind: bool = False):
        self.sock = ctx.socket(zmq.PUSH)
        _configure(self.sock, addr, bind)

    async def send(self, msg: T) -> None:
        await self.sock.send(encode(msg))

    def close(self) -> None:
        self.sock.close(0)


class AsyncPull(Generic[T]):
    def __init__(self, ctx: zmq.asyncio.Context, addr: str, union, bind: bool = True):
        self.sock = ctx.socket(zmq.PULL)
        _configure(self.sock, addr, bind)
        self._decoder = decoder(union)

    async def recv(self) -> T | None:
        frame = await self.sock.recv()
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.error("dropped an undecodable message: %s", e)
            return None

    def close(self) -> None:
        self.sock.close(0)


class Publisher:
    """PUB socket that never blocks: when a subscriber is slow, messages to it are dropped."""

    def __init__(self, ctx: zmq.Context, addr: str):
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, HWM)
        self.sock.bind(addr)

    def publish(self, msg) -> None:
        try:
            self.sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def close(self) -> None:
        self.sock.close(0)


# ---- process plumbing -------------------------------------------------------------------------
_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1


def set_process_name(name: str) -> None:
    """Name the process for ``ps`` (command line) and ``/proc/PID/comm`` (first 15 bytes)."""
    try:
        import setproctitle

        setproctitle.setproctitle(name)
        return
    except ImportError:
        pass
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def host_memory(field: str = "MemTotal") -> int | None:
    """A ``/proc/meminfo`` figure in bytes (``MemTotal``, ``MemAvailable``), or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent (``tidal serve``) dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent is already gone
        os.kill(os.getpid(), signal.SIGTERM)


def end_children(wait: float = 1.0) -> None:
    """End the processes this one started through ``multiprocessing`` (tokenizer workers, compile workers)
    and its resource tracker, and reap them, waiting up to ``wait`` seconds each: a process that leaves by
    ``os._exit`` would otherwise leave them to init, which may not reap (PID 1 of a container)."""
    import multiprocessing
    from multiprocessing import resource_tracker

    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(wait)
        if child.exitcode is None:
            child.kill()
            child.join(wait)
    if any(child.exitcode is None for child in children):
        return  # the tracker waits for every holder of its pipe
    tracker = getattr(resource_tracker, "_resource_tracker", None)
    if tracker is not None and getattr(tracker, "_pid", None) is not None:
        with contextlib.suppress(Exception):
            tracker._stop()  # closes its pipe (it exits on EOF) and reaps it


def exit_now(code: int) -> None:
    """``os._exit(code)`` once this process's children are ended and reaped (:func:`end_children`)."""
    with contextlib.suppress(Exception):
        end_children()
    os._exit(code)


def setup_logging(level: str, role: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {role} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
