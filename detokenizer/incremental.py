"""Per-request incremental detokenization that never emits broken UTF-8, with stop strings."""

from __future__ import annotations

import codecs

from ..tokenizer import Tokenizer


class IncrementalText:
    """Turns token ids into text deltas.

    Bytes of a multi-byte character split across tokens are held until the character completes.
    Text that could be the beginning of a stop string is held until it is known not to be one; a
    matched stop string and everything after it are never emitted.

    Only the text a stop string could still reach is kept (``buf``, starting at absolute offset
    ``base``), so a long output costs linear time, not a copy of everything so far per token.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None, skip_special: bool = True,
                 include_stop: bool = False):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop  # the matched stop string ends the text instead of being cut
        self.skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.buf = ""
        self.base = 0  # absolute offset of buf[0] in the request's text
        self.emitted = 0
        self.tokens = 0  # ids consumed (up to and including the one completing a stop string)
        self.stopped = False
        self._longest_stop = max((len(s) for s in self.stop), default=0)

    def feed(self, token_ids: list[int]) -> str:
        """Consume ids; returns the newly safe text. After a stop string matches, ignores input."""
        for tok in token_ids:
            if self.stopped:
                break
            self.tokens += 1
            if self.skip_special and self.tokenizer.is_special(tok):
                continue
            self.buf += self._decoder.decode(self.tokenizer.token_bytes(tok))
            if self.stop:
                self._check_stop()
        return self._release(final=False)

    def finish(self) -> str:
        """The request ended: flush held bytes (as U+FFFD if incomplete) and held-back text."""
        if not self.stopped:
            self.buf += self._decoder.decode(b"", final=True)
            if self.stop:
                self._check_stop()
        return self._release(final=True)

    def _check_stop(self) -> None:
        start = max(self.base, self.emitted - self._longest_stop) - self.base
        hits = [(i, i + len(s)) for i, s in ((self.buf.find(s, start), s) for s in self.stop) if i >= 0]
        if hits:
            first, end = min(hits)
            self.buf = self.buf[:end if self.include_stop else first]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = self.base + len(self.buf)
        if not final and not self.stopped and self.stop:
            end -= self._partial_stop_suffix()
        end = max(end, self.emitted)
        delta = self.buf[self.emitted - self.base:end - self.base]
        self.emitted = end
        # Drop what no stop string can reach any more.
        keep = max(self.base, self.emitted - self._longest_stop)
        self.buf, self.base = self.buf[keep - self.base:], keep
        return delta

    def _partial_stop_suffix(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.buf)), best, -1):
                if self.buf.endswith(s[:n]):
                    best = n
                    break
        return best
