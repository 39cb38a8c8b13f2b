"""Prefix cache over token ids for hybrid state.

KV pages (K, V and QSA index keys) can be shared at any page boundary, but the recurrent state of
GDN layers, their conv windows, the PLE conv windows and the n-gram context exist only where the
executor was told to save them. So a cached prefix is usable only up to a *checkpoint*: a state
slot holding the complete state at an aligned position whose pages are all cached.

Pages are content-addressed by a hash chain over page-sized blocks of token ids; a checkpoint is
keyed by the chain hash at its position. Pages a request no longer holds stay cached until LRU
eviction needs them; checkpoints not locked by a restoring request are evicted the same way.

A prompt that extends a sequence hashed before (the next turn of a conversation, a continuation of a
long cached prompt) takes that sequence's chain hashes from :class:`HashMemo` once their tokens compare
equal, and hashes only its own pages.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from .pools import PagePool, SlotPool

ROOT = b"tidal-prefix-root"


def chain_hashes(tokens: list[int], page_size: int, start: bytes = ROOT) -> list[bytes]:
    """Chain hashes of the full pages of ``tokens``; ``start`` is the hash of the page before them."""
    out, h = [], start
    for i in range(len(tokens) // page_size):
        block = array("q", tokens[i * page_size:(i + 1) * page_size]).tobytes()
        h = hashlib.blake2b(h + block, digest_size=16).digest()
        out.append(h)
    return out


MEMO_TOKENS = 1 << 20  # token ids HashMemo holds at most (up to about 36 bytes each: a reference and an int)
MEMO_ENTRIES = 64  # sequences it holds at most
MEMO_MIN_PAGES = 64  # shorter sequences hash about as fast as they compare


def _starts_with(tokens: list[int], head: list[int]) -> bool:
    """``tokens[:len(head)] == head``, in windows growing fourfold: a mismatch early costs little."""
    i, step, n = 0, 256, len(head)
    if len(tokens) < n:
        return False
    while i < n:
        j = min(n, i + step)
        if tokens[i:j] != head[i:j]:
            return False
        i, step = j, step * 4
    return True


@dataclass
class _Remembered:
    tokens: list[int]  # the sequence's full pages of token ids
    keys: list[bytes]  # their chain hashes
    parent: bytes | None  # the longest other remembered sequence it extends (by its last key) when remembered


class HashMemo:
    """The chain hashes of recently hashed token sequences, least recently used first, each under its last
    page's hash (which names the whole sequence: remembering it again only refreshes it).

    :meth:`lookup` gives the keys of the longest remembered sequence whose full pages the given tokens
    start with, compared element by element (in C, about 50x faster than hashing them): the keys are
    then exactly what :func:`chain_hashes` would give for those pages. A sequence that extends another one
    remembered (equal chain hashes over the other's pages: the next turn of a conversation, continuations of one
    long prompt) is compared only past it, once the other compared equal, so that one lookup compares each
    position of the given tokens about once however many remembered sequences share a long prefix."""

    def __init__(self, page_size: int, max_tokens: int = MEMO_TOKENS, max_entries: int = MEMO_ENTRIES):
        self.page_size, self.max_tokens, self.max_entries = page_size, max_tokens, max_entries
        self.entries: OrderedDict[bytes, _Remembered] = OrderedDict()
        self.tokens = 0

    def lookup(self, tokens: list[int]) -> list[bytes]:
        """The keys of the longest remembered sequence that ``tokens`` start with ([] if none)."""
        best: list[bytes] = []
        known: dict[bytes, bool] = {}  # entries compared in this lookup: whether tokens start with them
        for key, entry in self.entries.items():
            if len(entry.keys) > len(best) and self._starts(tokens, key, entry, known):
                best = entry.keys
        if best:
            self.entries.move_to_end(best[-1])
        return best

    def _starts(self, tokens: list[int], key: bytes, entry: _Remembered, known: dict[bytes, bool]) -> bool:
        """Whether ``tokens`` start with ``entry``: past its parent's pages only, when the parent is still here."""
        chain = []  # the entry and its remembered ancestors not compared yet, nearest first
        while key not in known:
            chain.append((key, entry))
            parent = self.entries.get(entry.parent) if entry.parent is not None else None
            if parent is None:
                break
            key, entry = entry.parent, parent
        for key, entry in reversed(chain):
            parent = self.entries.get(entry.parent) if entry.parent is not None else None
            if parent is None:
                known[key] = _starts_with(tokens, entry.tokens)
            else:
                head = len(parent.tokens)
                known[key] = (known[entry.parent] and len(tokens) >= len(entry.tokens)
                              and _starts_with(tokens[head:len(entry.tokens)], entry.tokens[head:]))
        return known[chain[0][0]] if chain else known[key]

    def refresh(self, keys: list[bytes]) -> bool:
        """Whether the sequence whose pages' chain hashes are ``keys`` is remembered (now the most recently used)."""
        if keys and keys[-1] in self.entries:
            self.entries.move_to_end(keys[-1])
            return True
        return False

    def remember(self, tokens: list[int], keys: list[bytes]) -> None:
        """``keys``: the chain hashes of ``tokens``' full pages."""
        n = len(keys) * self.page_size
        if len(keys) < MEMO_MIN_PAGES or n > self.max_tokens or self.refresh(keys):
            return
        while self.entries and (self.tokens + n > self.max_tokens or len(self.entries) >= self.max_entries):
            self.tokens -= len(self.entries.popitem(last=False)[1].tokens)
        parent = next((keys[i - 1] for i in range(len(keys) - 1, MEMO_MIN_PAGES - 1, -1)
                       if keys[i - 1] in self.entries), None)
        self.entries[keys[-1]] = _Remembered(tokens[:n], list(keys), parent)
        self.tokens += n


@dataclass
class Checkpoint:
    key: bytes  # chain hash at `position`
    position: int
    slot: int
    locks: int = 0


@dataclass(eq=False)
class _Stand:
    """What a checkpoint stands on (all must be cached for a hit): the pages past the nearest shorter checkpoint
    position of its chain known when it was written (``parent``), and what that one stands on. It outlives its
    checkpoint while longer ones stand on it."""

    key: bytes
    pages: list[bytes]  # its own page keys
    parent: _Stand | None
    missing: int = 0  # own pages not cached
    children: int = 0
    checkpoint: Checkpoint | None = None

    def whole(self) -> bool:
        node: _Stand | None = self
        while node is not None:
            if node.missing:
                return False
            node = node.parent
        return True


@dataclass
class Match:
    tokens: int = 0
    pages: list[int] = field(default_factory=list)
    checkpoint: Checkpoint | None = None
    keys: list[bytes] = field(default_factory=list)  # chain hashes of `pages`
    # Tokens covered by cached pages, checkpoint or not: where this prompt branches off a cached one.
    page_tokens: int = 0


class PrefixCache:
    def __init__(self, pages: PagePool, checkpoint_slots: SlotPool, page_size: int, align: int,
                 needs_state: bool, counters: dict[str, int]):
        self.pages, self.slots = pages, checkpoint_slots
        self.page_size, self.align = page_size, align
        self.per_ckpt = max(1, align // page_size)  # pages between checkpoint positions
        self.needs_state = needs_state
        self.counters = counters
        self.page_of: dict[bytes, int] = {}  # chain hash -> page id
        self.key_of: dict[int, bytes] = {}  # page id -> chain hash
        # Cached pages no request holds, least recently used first.
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.checkpoints: dict[bytes, Checkpoint] = {}
        self.idle_checkpoints: OrderedDict[bytes, None] = OrderedDict()
        # What each checkpoint stands on, by its key, as a tree: a checkpoint that extends a shorter one of its
        # chain stands on its own pages and that one's stand, so writing or dropping one costs its own pages,
        # not the length of the prefix. Per cached or evicted page, the stands holding it among their own pages.
        # A checkpoint with any page not cached is unreachable, the first to go for a slot.
        self.stands: dict[bytes, _Stand] = {}
        self.standing: dict[bytes, list[_Stand]] = {}
        self.memo = HashMemo(page_size)

    # ---- accounting ---------------------------------------------------------------------------
    @property
    def cached_pages(self) -> int:
        return len(self.evictable)

    @property
    def cached_slots(self) -> int:
        return len(self.idle_checkpoints)

    def available_pages(self) -> int:
        return self.pages.num_free + len(self.evictable)

    # ---- lookup -------------------------------------------------------------------------------
    def match(self, tokens: list[int], keys: list[bytes] | None = None) -> Match:
        """The longest cached prefix ending at a live checkpoint, leaving >= 1 token to compute.

        ``keys``: the chain hashes of ``tokens[:-1]``'s full pages, when the caller keeps them (a
        waiting prompt is hashed once, not at every admission attempt)."""
        if keys is None:
            keys = self.prefix_keys(tokens)
        pages: list[int] = []
        for key in keys:
            page = self.page_of.get(key)
            if page is None:
                break
            pages.append(page)
        page_tokens = len(pages) * self.page_size
        if not self.needs_state:
            return Match(tokens=page_tokens, pages=pages, keys=keys[:len(pages)], page_tokens=page_tokens)
        per_ckpt = self.per_ckpt
        for n in range(len(pages) // per_ckpt * per_ckpt, 0, -per_ckpt):
            ckpt = self.checkpoints.get(keys[n - 1])
            if ckpt is not None:
                return Match(tokens=n * self.page_size, pages=pages[:n], checkpoint=ckpt, keys=keys[:n],
                             page_tokens=page_tokens)
        return Match(page_tokens=page_tokens)

    def prefix_keys(self, tokens: list[int]) -> list[bytes]:
        """What :meth:`match` hashes: the full pages of all but the last token (the pages of a sequence
        hashed before taken from the memo)."""
        head = tokens[: len(tokens) - 1]
        known = self.memo.lookup(head)
        keys = known + chain_hashes(head[len(known) * self.page_size:], self.page_size,
                                    known[-1] if known else ROOT)
        self.memo.remember(head, keys)
        return keys

    def remember(self, tokens: list[int], keys: list[bytes]) -> None:
        """A request's hashed pages (``keys``: the chain hashes of ``tokens``' full pages), for the next
        prompt that extends them."""
        self.memo.remember(tokens, keys)

    def acquire(self, match: Match) -> None:
        """A request takes the matched pages (one reference each) and locks the checkpoint."""
        pop = self.evictable.pop
        for page in match.pages:
            pop(page, None)
        self.pages.incref(match.pages)
        if match.checkpoint is not None:
            ckpt = match.checkpoint
            ckpt.locks += 1
            self.idle_checkpoints.pop(ckpt.key, None)

    def unlock(self, ckpt: Checkpoint) -> None:
        ckpt.locks -= 1
        if ckpt.locks == 0 and ckpt.key in self.checkpoints:
            self.idle_checkpoints[ckpt.key] = None
            self.idle_checkpoints.move_to_end(ckpt.key)

    # ---- allocation with eviction -------------------------------------------------------------
    def alloc_pages(self, count: int) -> list[int] | None:
        if count > self.available_pages():
            return None
        while self.pages.num_free < count:
            self._evict_page()
        return self.pages.alloc(count)

    def _evict_page(self) -> None:
        page, _ = self.evictable.popitem(last=False)
        key = self.key_of.pop(page)
        del self.page_of[key]
        for stand in self.standing.get(key, ()):
            stand.missing += 1
        self.pages.decref([page])
        self.counters["pages_evicted"] += 1

    def alloc_checkpoint_slot(self) -> int | None:
        slot = self.slots.alloc()
        if slot is not None:
            return slot
        # Prefer checkpoints whose pages are gone (unreachable), then the least recently used.
        victim = next((k for k in self.idle_checkpoints if not self.stands[k].whole()), None)
        if victim is None and self.idle_checkpoints:
            victim = next(iter(self.idle_checkpoints))
        if victim is None:
            return None
        self._drop_checkpoint(victim)
        return self.slots.alloc()

    def _drop_checkpoint(self, key: bytes) -> None:
        ckpt = self.checkpoints.pop(key)
        self.idle_checkpoints.pop(key, None)
        stand = self.stands[key]
        stand.checkpoint = None
        while stand is not None and stand.checkpoint is None and not stand.children:  # nothing stands on it
            for page_key in stand.pages:
                on = self.standing[page_key]
                on.remove(stand)
                if not on:
                    del self.standing[page_key]
            del self.stands[stand.key]
            stand = stand.parent
            if stand is not None:
                stand.children -= 1
        self.slots.free(ckpt.slot)
        self.counters["checkpoints_evicted"] += 1

    # ---- insertion ----------------------------------------------------------------------------
    def insert_pages(self, pages: list[int], keys: list[bytes], new_tokens: list[int],
                     hashed: list[bytes] | tuple = ()) -> None:
        """Index a request's next full pages, holding ``new_tokens``; ``keys`` (the chain hashes
        of its pages indexed so far) grows by theirs, the first ``len(hashed)`` of which the caller
        hashed already. A page whose content is already cached under another id stays private to the
        request."""
        first = len(keys)
        keys += hashed
        keys += chain_hashes(new_tokens[len(hashed) * self.page_size:], self.page_size, keys[-1] if keys else ROOT)
        for page, key in zip(pages[first:len(keys)], keys[first:], strict=True):
            if key not in self.page_of and page not in self.key_of:
                self.page_of[key] = page
                self.key_of[page] = key
                for stand in self.standing.get(key, ()):  # cached again: its checkpoints may be whole again
                    stand.missing -= 1
                self.pages.incref([page])  # the cache's own reference

    def insert_checkpoint(self, page_keys: list[bytes], slot: int) -> bool:
        """Publish the state in ``slot`` as the checkpoint at the end of the pages ``page_keys``;
        ``False`` means the caller keeps (and must free) the slot."""
        key = page_keys[-1]
        if key in self.checkpoints:
            return False
        stand = self.stands.get(key)
        if stand is None:
            parent, start = None, 0
            for n in range((len(page_keys) - 1) // self.per_ckpt * self.per_ckpt, 0, -self.per_ckpt):
                parent = self.stands.get(page_keys[n - 1])
                if parent is not None:
                    start = n
                    break
            own = page_keys[start:]
            if not all(map(self.page_of.__contains__, own)) or (parent is not None and not parent.whole()):
                return False
            stand = self.stands[key] = _Stand(key=key, pages=list(own), parent=parent)
            if parent is not None:
                parent.children += 1
            standing = self.standing
            for page_key in own:
                on = standing.get(page_key)
                if on is None:
                    standing[page_key] = [stand]
                else:
                    on.append(stand)
        elif not stand.whole():
            return False
        stand.checkpoint = self.checkpoints[key] = Checkpoint(key=key, position=len(page_keys) * self.page_size,
                                                              slot=slot)
        self.idle_checkpoints[key] = None
        self.counters["checkpoints_written"] += 1
        return True

    def release_pages(self, pages: list[int]) -> None:
        """A request lets go of its pages; cached ones become evictable, deepest first."""
        key_of, refs, evictable = self.key_of, self.pages.refs, self.evictable
        for page in reversed(pages):
            if refs[page] == 2 and page in key_of:  # held by this request alone, so not evictable until now
                evictable[page] = None
        self.pages.decref(pages)
