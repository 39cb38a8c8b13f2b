"""Reads the server's tap (``tidal serve --tap-addr``): cached tokens and generated token ids per request."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

# How long the subscription is given to reach the publisher before the first request (a PUB socket
# drops what it sends before a subscriber has joined).
JOIN_S = 0.5


@dataclass
class TapRecord:
    """What the tap said about one request: its first ``PromptAdmitted`` and every ``Detokenize``."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    plan: dict | None = None
    admissions: int = 0
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # time.monotonic() each token's message arrived
    finished: bool = False
    finish_reason: str | None = None


def tap_rid(response_id: str | None) -> str | None:
    """The tap's name for a request: tidal names it by the HTTP response ``id`` without its
    ``cmpl-`` (or ``chatcmpl-``) prefix."""
    if response_id is None:
        return None
    for prefix in ("chatcmpl-", "cmpl-"):
        if response_id.startswith(prefix):
            return response_id[len(prefix):]
    return response_id


class TapReader:
    """A ZeroMQ SUB on the tap, read by a background thread into one ``TapRecord`` per request id."""

    def __init__(self, addr: str):
        import msgspec
        import zmq

        from ..messages import TapMessage, decoder

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            self._sock.connect(addr)
        except zmq.ZMQError as e:
            self._ctx.destroy(0)
            raise ValueError(f"--tap-addr {addr!r}: {e}") from None
        self._decode = decoder(TapMessage).decode
        self._decode_error = msgspec.DecodeError
        self.records: dict[str, TapRecord] = {}
        self.messages = 0
        self.undecodable = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="tidal-bench-tap", daemon=True)
        self._thread.start()
        time.sleep(JOIN_S)

    def _read(self) -> None:
        from ..messages import PromptAdmitted

        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            raw = self._sock.recv()
            now = time.monotonic()
            try:
                msg = self._decode(raw)
            except self._decode_error:
                with self._cond:
                    self.undecodable += 1
                continue
            with self._cond:
                self.messages += 1
                rec = self.records.setdefault(msg.rid, TapRecord())
                if isinstance(msg, PromptAdmitted):
                    rec.admissions += 1
                    if rec.admissions == 1:  # a request resumed after preemption is admitted again
                        rec.prompt_tokens, rec.cached_tokens = msg.prompt_tokens, msg.cached_tokens
                        rec.plan = {"mode": msg.plan.mode, "chunks": len(msg.plan.chunks),
                                    "checkpoints": len(msg.plan.checkpoints)}
                else:
                    rec.token_ids.extend(msg.token_ids)
                    rec.token_times.extend([now] * len(msg.token_ids))
                    if msg.finished:
                        rec.finished, rec.finish_reason = True, msg.finish_reason
                self._cond.notify_all()

    def wait(self, rid: str, timeout: float) -> TapRecord | None:
        """The record of ``rid`` once its final ``Detokenize`` has arrived (``None`` after ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                rec = self.records.get(rid)
                if rec is not None and rec.finished:
                    return rec
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._ctx.destroy(0)
